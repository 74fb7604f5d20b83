"""The host's memory as the CPU runtime sees it: what is free (MemAvailable), what this process holds resident
(VmRSS), and the bound a loaded artifact keeps to (its weights and pools, plus the runtime's stated overhead)."""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")
PROC_STATUS = Path("/proc/self/status")
# What a serving process holds besides an artifact's weights and pools: the interpreter and its imports, the PJRT
# plugin, the compiled entries, one step's temporaries. Start-up logs the resident set against this bound.
RESIDENT_OVERHEAD = 3 << 29     # 1.5 GiB


def _field_kib(path: Path, name: str) -> int | None:
    """The `name:` line of a /proc file of `kB` values, in bytes (None where the file or the line is missing)."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def mem_available() -> int | None:
    """Bytes the host can still give a process without swapping (/proc/meminfo MemAvailable), None where unknown."""
    return _field_kib(MEMINFO, "MemAvailable")


def resident_bytes() -> int | None:
    """This process's resident set (/proc/self/status VmRSS), None where unknown."""
    return _field_kib(PROC_STATUS, "VmRSS")
