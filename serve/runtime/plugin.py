"""Finding a PJRT plugin and creating a client on it.

`find_plugin` locates the plugin .so (an explicit path, $TLALOC_PJRT_PLUGIN, or an installed plugin
package); `create_client` creates a PJRT client with options the plugin may not know (they are dropped and
listed); `bytecode_stablehlo_version` reads the StableHLO version a portable body was serialized to.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import pypjrt
from pypjrt import errors as pjrt_errors

#: Environment variable naming a plugin .so; read only when no explicit path is given.
ENV_PLUGIN = "TLALOC_PJRT_PLUGIN"

#: Installed plugins `find_plugin` looks for, in order: (distribution, file name it ships).
#: The CUDA plugin library ships in jax-cuda12-pjrt; jax-cuda12-plugin (the project's `cuda` extra)
#: holds jax's CUDA kernels and depends on it, and is searched too in case a build bundles both.
_INSTALLED_PLUGINS = (
    ("lammps-jax-pjrt-cpu", "pjrt_c_api_cpu_plugin.so"),
    ("jax-cuda12-pjrt", "xla_cuda_plugin.so"),
    ("jax-cuda12-plugin", "xla_cuda_plugin.so"),
)

#: How a plugin rejects a create-option it does not know (it fails the whole create call).
_REJECTED_OPTION = re.compile(r"Unexpected option name passed to PJRT_Client_Create: (\S+)")

_BYTECODE_MAGIC = b"ML\xefR"
_BYTECODE_PRODUCER = re.compile(rb"StableHLO_v(\d+)\.(\d+)\.(\d+)")


class PluginNotFoundError(FileNotFoundError):
    """No PJRT plugin at the given path, or none installed; the message says what was tried."""




def installed_plugins() -> list[tuple[str, str, Path]]:
    """(distribution, version, .so path) of each installed plugin in `_INSTALLED_PLUGINS`."""
    found = []
    for dist_name, so_name in _INSTALLED_PLUGINS:
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            continue
        for f in dist.files or ():
            if f.name == so_name:
                path = Path(dist.locate_file(f))
                if path.is_file():
                    found.append((dist_name, dist.version, path))
    return found


def find_plugin(explicit: str | os.PathLike[str] | None = None) -> str:
    """The path of the PJRT plugin .so to load.

    Precedence: `explicit`; else `$TLALOC_PJRT_PLUGIN`; else the installed CPU plugin
    (lammps-jax-pjrt-cpu); else an installed CUDA plugin (xla_cuda_plugin.so from
    jax-cuda12-pjrt / jax-cuda12-plugin). Installed plugins are located through their
    distribution's file list, not a fixed site-packages path.

    Raises:
        PluginNotFoundError: naming the path (or the packages) that was looked for.
    """
    if explicit is not None:
        p = Path(explicit).expanduser()
        if not p.is_file():
            raise PluginNotFoundError(f"no PJRT plugin at {p} (passed explicitly)")
        return str(p)
    if env := os.environ.get(ENV_PLUGIN):
        p = Path(env).expanduser()
        if not p.is_file():
            raise PluginNotFoundError(f"no PJRT plugin at {p} (from ${ENV_PLUGIN})")
        return str(p)
    if found := installed_plugins():
        return str(found[0][2])
    looked = ", ".join(f"{d} ({so})" for d, so in _INSTALLED_PLUGINS)
    raise PluginNotFoundError(
        f"no PJRT plugin: none of {looked} is installed, no path was passed and "
        f"${ENV_PLUGIN} is unset")


def bytecode_stablehlo_version(body: bytes) -> tuple[int, int, int] | None:
    """The StableHLO version a portable artifact was serialized to, or None for text.

    `Exported.mlir_module_serialized` starts with the MLIR bytecode magic and a producer string
    such as `StableHLO_v1.15.0` (jax serializes to a version about four weeks old).
    """
    if not body.startswith(_BYTECODE_MAGIC):
        return None
    m = _BYTECODE_PRODUCER.search(body[:64])
    return tuple(int(x) for x in m.groups()) if m else None  # type: ignore[return-value]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def device_assignment_proto(device_ids: Sequence[int]) -> bytes:
    """A serialized xla.DeviceAssignmentProto of one replica and len(device_ids) partitions, partition i on device
    device_ids[i]: replica_count (1) = 1, computation_count (2) = N, computation_devices (3) = [{replica_device_ids
    (1, packed) = [id]}], as XLA writes it (pypjrt encodes CompileOptions but not this message)."""
    out = b"\x08" + _varint(1) + b"\x10" + _varint(len(device_ids))
    for i in device_ids:
        ids = _varint(i)
        inner = b"\x0a" + _varint(len(ids)) + ids
        out += b"\x1a" + _varint(len(inner)) + inner
    return out


def create_client(plugin: pypjrt.Plugin, requested: dict[str, Any]
                   ) -> tuple[pypjrt.Client, dict[str, Any], dict[str, Any]]:
    """Create a client with `requested` options, dropping each one the plugin says it does not
    know. Returns (client, options applied, options dropped)."""
    opts, dropped = dict(requested), {}
    while True:
        try:
            return pypjrt.Client.create(plugin, options=opts), opts, dropped
        except pjrt_errors.InvalidArgument as e:
            m = _REJECTED_OPTION.search(e.message)
            if not m or m.group(1) not in opts:
                raise
            dropped[m.group(1)] = opts.pop(m.group(1))
