"""The on-disk compile cache: serialized executables keyed by body, compile options and plugin identity.

A hit deserializes an executable instead of compiling it. The key covers everything that changes the
compiled code: the body's sha256, the compile options, the plugin file and what it says of itself, the XLA
flags and the host CPU (a CPU executable holds code for the instruction set it was compiled on, so a cache
shared with, or copied to, another machine must miss rather than run that code).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import pypjrt
from pypjrt import errors as pjrt_errors

_CACHE_FORMAT = b"tlaloc-pjrt-cache-v1"


def host_cpu() -> str:
    """The host CPU's model and instruction-set flags (Linux /proc/cpuinfo; elsewhere the machine type)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.machine()
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    lines = sorted({line.strip() for line in text.splitlines() if line.split(":", 1)[0].strip() in keys})
    return platform.machine() + "\n" + "\n".join(lines)


def plugin_identity(plugin_path: str, package: str | None, api_version: tuple[int, int],
                    attributes: dict[str, Any], platform_facts: tuple[str, str]) -> str:
    """What a cached executable must match: the plugin file and what it says of itself, the XLA flags it
    compiles under (--xla_cpu_max_isa and the like change the code), and the host CPU."""
    st = os.stat(plugin_path)
    facts = {
        "path": str(Path(plugin_path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        "package": package, "api_version": list(api_version),
        "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(attributes.items())},
        "platform": list(platform_facts),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "host_cpu": host_cpu(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def facts(device, custom_calls) -> dict:
    """What an executable compiled on `device` depends on, without the plugin's path or mtime (an artifact moves
    between hosts and installs); `custom_calls`' native kernels must be registered (their variant is known)."""
    from tlaloc_jax import native
    return {
        "plugin_package": device.plugin_package, "plugin_size": os.stat(device.plugin_path).st_size,
        "api_version": list(device.api_version),
        "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(device.attributes.items())},
        "platform": [device.platform_name, device.platform_version], "devices": device.devices,
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "host_cpu": host_cpu(),
        "kernels": {t: native.loaded_variant(t) for t in sorted(custom_calls)},
    }


def facts_identity(f: dict) -> str:
    return hashlib.sha256(json.dumps(f, sort_keys=True).encode()).hexdigest()


class CompileCache:
    """Serialized executables of one plugin identity under `directory`."""

    def __init__(self, directory: str | os.PathLike[str], identity: str):
        self.directory = Path(directory).expanduser()
        self.identity = identity

    def key(self, body_sha256: str, options: bytes) -> str:
        return hashlib.sha256(b"\0".join((_CACHE_FORMAT, body_sha256.encode(), options,
                                          self.identity.encode()))).hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.pypjrta"

    def has(self, key: str) -> bool:
        """Whether a file is stored under `key` (unchecked: read checks it)."""
        return self._path(key).is_file()

    def read(self, key: str, body_sha256: str) -> tuple[bytes | None, str]:
        """(the serialized executable, checked against its metadata, "hit") or (None, "miss" | "stale")."""
        path = self._path(key)
        if not path.is_file():
            return None, "miss"
        try:
            art = pypjrt.Artifact.read(path)
            meta = art.metadata
            if (meta.get("body_sha256") != body_sha256 or meta.get("plugin_identity") != self.identity
                    # A damaged executable could abort the process inside XLA, not just fail.
                    or meta.get("executable_sha256") != hashlib.sha256(art.executable).hexdigest()):
                return None, "stale"
            return art.executable, "hit"
        except (pjrt_errors.PjrtError, OSError, ValueError, KeyError):
            return None, "stale"

    def load(self, client: pypjrt.Client, key: str, body_sha256: str,
             deserialize=None) -> tuple[pypjrt.Executable | None, str]:
        """(loaded executable, "hit") or (None, "miss" | "stale"). deserialize(client, blob): how to load it (default
        the client's own call)."""
        code, status = self.read(key, body_sha256)
        if code is None:
            return None, status
        try:
            return (deserialize(client, code) if deserialize else client.deserialize_executable(code)), "hit"
        except pjrt_errors.PjrtError:
            return None, "stale"

    def store(self, key: str, handle: pypjrt.Executable, body_sha256: str, options: bytes,
              name: str | None) -> None:
        """Write the serialized executable; a cache that cannot be written never fails a compile."""
        try:
            art = handle.to_artifact(compile_options=options, metadata={
                "body_sha256": body_sha256, "plugin_identity": self.identity, "name": name})
            art.metadata["executable_sha256"] = hashlib.sha256(art.executable).hexdigest()
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(art.to_bytes())
                os.replace(tmp, self._path(key))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except (pjrt_errors.PjrtError, OSError):
            pass
