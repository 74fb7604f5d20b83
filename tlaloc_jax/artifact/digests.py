"""The sha256 of an artifact's files, remembered between loads: a file whose stat says it has not changed since it
was hashed (device, inode, size, and modification and change times to the nanosecond) is not read again.

Any write to a file moves its change time, which no call can set back, so a file edited, replaced or copied over is
hashed again; what this does not see is a change below the file system (a disk flipping bits), as `make` and git's
index do not. The record lives in the runtime's cache directory, beside the compiled executables it already trusts.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

from .files import sha256_file

T = TypeVar("T")


class FileDigests:
    """sha256 of the files under one artifact directory, kept in `<cache_dir>/file-digests/`."""

    def __init__(self, cache_dir: str | os.PathLike[str], artifact_dir: str | os.PathLike[str]):
        root = str(Path(artifact_dir).resolve())
        self._path = Path(cache_dir).expanduser() / "file-digests" / f"{hashlib.sha256(root.encode()).hexdigest()}.json"
        try:
            known = json.loads(self._path.read_text())
            self._known = known if isinstance(known, dict) else {}
        except (OSError, ValueError):
            self._known = {}
        self._hashed: dict[str, list] = {}
        self.reads = 0      # files this instance hashed (the others were known unchanged)

    @staticmethod
    def _facts(path: Path) -> list[int]:
        st = path.stat()
        return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    def sha256(self, path: Path) -> str:
        """The file's sha256: remembered when its stat is what it was when hashed, else read and hashed."""
        key, facts = str(path), self._facts(path)
        known = self._known.get(key)
        if isinstance(known, list) and known[:-1] == facts:
            return known[-1]
        digest = sha256_file(path)
        self.reads += 1
        if self._facts(path) == facts:      # unchanged while it was read: worth remembering
            self._hashed[key] = [*facts, digest]
        return digest

    def save(self) -> None:
        """Remember what this load hashed (call once every file checked out). A cache that cannot be written
        never fails a load."""
        if not self._hashed:
            return
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self._path.parent, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({**self._known, **self._hashed}, f)
                os.replace(tmp, self._path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError:
            pass


def load_remembering(load: Callable[..., T], artifact_dir: str | os.PathLike[str],
                     cache_dir: str | os.PathLike[str] | None, **kwargs) -> T:
    """load(artifact_dir, digests=..., **kwargs) (load_manifest or bounded_manifest.load_bounded) with the sha256 of
    files unchanged since a load before taken from `cache_dir` (FileDigests), and what it hashed remembered once it
    passed; cache_dir None: every file hashed."""
    if cache_dir is None:
        return load(artifact_dir, digests=sha256_file, **kwargs)
    digests = FileDigests(cache_dir, artifact_dir)
    loaded = load(artifact_dir, digests=digests.sha256, **kwargs)
    digests.save()
    return loaded
