"""What native code writes to the process's stderr while a PJRT client starts, sent to the log instead.

The plugin's C++ writes its start-up lines (absl's "All log messages before absl::InitializeLog() is called are
written to STDERR", the CPU plugin's "cpu_device_count set via create_options: 1") straight to file descriptor 2,
past Python: into a notebook's cell output or a server's terminal. `native_stderr_to_log()` points descriptor 2 at
a temporary file while its block runs, then logs each line: absl's INFO lines and that notice at DEBUG, its
warnings and anything else at WARNING, its errors at ERROR.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile

log = logging.getLogger("tlaloc_jax.serve.native")

_ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_ABSL_LINE = re.compile(r"^([IWEF])\d{4} ")      # absl's prefix: severity, then MMDD
_LEVELS = {"I": logging.DEBUG, "W": logging.WARNING, "E": logging.ERROR, "F": logging.ERROR}


def _level(line: str) -> int:
    if line.strip() == _ABSL_NOTICE:
        return logging.DEBUG
    m = _ABSL_LINE.match(line)
    return _LEVELS[m.group(1)] if m else logging.WARNING


@contextlib.contextmanager
def native_stderr_to_log():
    """Descriptor 2 goes to a temporary file inside the block; its lines are logged when the block ends."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):      # no descriptor 2 to borrow: nothing to capture
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode("utf-8", "replace").splitlines():
                if line.strip():
                    log.log(_level(line), "%s", line)
