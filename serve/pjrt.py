"""The lowest layer of the JAX-free runtime: one PJRT device, through pypjrt.

A `Device` loads a PJRT plugin (.so), creates a client on it, compiles StableHLO bodies written by
`jax.export` (textual MLIR or the portable bytecode `Exported.mlir_module_serialized`), uploads
host arrays, runs executables with chosen inputs donated, and copies results back::

    with Device(cache_dir="~/.cache/tlaloc/pjrt") as dev:
        exe = dev.compile(body_bytes)
        pool, x = dev.upload(pool_np), dev.upload(x_np)
        logits, pool2 = dev.execute(exe, [pool, x], donate={0})
        assert pool.consumed and dev.device_address(pool2) == address_before  # in place
        dev.to_host(logits)

Donation is what keeps the KV pools on the device: a body whose pool parameter carries
`tf.aliasing_output` (what `jax.jit(..., donate_argnums=...)` exports) writes its updated pool
over the input when, and only when, that input is donated. `execute` donates exactly the indices
it is given (PJRT's `non_donatable_input_indices` holds every other one) and raises
`DonationError` if the plugin did not consume one of them, so a silent copy cannot pass for an
update in place. Measurements and the plugin's behaviour: docs/pjrt-notes.md.

This module imports only the standard library, numpy, ml_dtypes and pypjrt; it must never pull
in jax, jaxlib, flax, torch or transformers. `execute` and `upload` call the PJRT C API through
pypjrt's `Plugin.call` themselves: `pypjrt.Executable.__call__` asks the plugin `IsDeleted` for
every argument after every run (5 us an argument, against 0.45 us here, on the CPU plugin), and
`Client.buffer_from_host` refuses read-only arrays (memory-mapped weights). Both touch pypjrt's
handle state (`_ptr`, `_state`, `_mark_donated`), so this module is pinned to pypjrt 0.1.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pypjrt
from pypjrt import errors as pjrt_errors
from pypjrt.client import Buffer as _PjrtBuffer
from pypjrt.client import Event as _PjrtEvent
from pypjrt.client import State as _HandleState

__all__ = [
    "ENV_PLUGIN", "PluginNotFoundError", "CompileError", "DonationError", "TooFewDevicesError",
    "find_plugin", "bytecode_stablehlo_version", "Device", "Executable", "Buffer",
]

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

#: PJRT_Buffer_Type names and the numpy dtypes that hold them (bf16 and f8 via ml_dtypes).
_DTYPES = (
    ("PRED", np.dtype(np.bool_)), ("S8", np.dtype(np.int8)), ("S16", np.dtype(np.int16)),
    ("S32", np.dtype(np.int32)), ("S64", np.dtype(np.int64)), ("U8", np.dtype(np.uint8)),
    ("U16", np.dtype(np.uint16)), ("U32", np.dtype(np.uint32)), ("U64", np.dtype(np.uint64)),
    ("F16", np.dtype(np.float16)), ("F32", np.dtype(np.float32)), ("F64", np.dtype(np.float64)),
    ("BF16", np.dtype(ml_dtypes.bfloat16)), ("F8E4M3FN", np.dtype(ml_dtypes.float8_e4m3fn)),
    ("F8E5M2", np.dtype(ml_dtypes.float8_e5m2)),
)

_BYTECODE_MAGIC = b"ML\xefR"
_BYTECODE_PRODUCER = re.compile(rb"StableHLO_v(\d+)\.(\d+)\.(\d+)")
_MISSING_FFI_HANDLER = re.compile(r"No FFI handler registered for (\S+)")
_CACHE_FORMAT = b"tlaloc-pjrt-cache-v1"
_VOIDP = ctypes.c_void_p
_EMPTY = ctypes.c_char()  # a valid host address for zero-size uploads


class _HotCalls:
    """The PJRT calls a decode step makes every time (Execute, Event_Await / Event_Destroy, Buffer_Destroy,
    Buffer_IsDeleted) without pypjrt's per-call Python: each call's function pointer and argument struct are
    made once and reused, and a ready event is awaited without the separate PJRT_Event_Error call (Await returns
    the event's error itself). Each call still holds pypjrt's process-wide PJRT lock, as pypjrt's own calls do
    (a buffer finalizer on another thread must not race an Execute), and Execute is marked as a region XLA may
    re-enter. Errors become pypjrt's exceptions. With the results a caller does not want released without a
    Buffer (Device.execute's `keep`) and the results' shapes read once per executable, this took a 3-layer
    model's decode call through the runtime from 0.72x to 0.84-0.94x in-process JAX's speed on the same body.

    When the installed pypjrt does not expose the lock (`_HotCalls.make` returns None), Device makes the same
    calls through pypjrt (_PypjrtCalls)."""

    def __init__(self, plugin, lock, dispatch_flag):
        self.plugin, self.lock, self.flag = plugin, lock, dispatch_flag
        self._structs = {}
        for name in ("PJRT_LoadedExecutable_Execute", "PJRT_Event_Await", "PJRT_Event_Destroy",
                     "PJRT_Buffer_Destroy", "PJRT_Buffer_IsDeleted", "PJRT_Buffer_OpaqueDeviceMemoryDataPointer"):
            try:
                fn = plugin.fn(name)
            except (pjrt_errors.Unimplemented, pjrt_errors.UnsupportedByPlugin):
                continue        # device_pointer: Device.device_address falls back to pypjrt's calls
            args = plugin.args(f"{name}_Args")
            self._structs[name] = (fn, args, ctypes.byref(args))

    @classmethod
    def make(cls, plugin) -> _HotCalls | None:
        try:
            from pypjrt._lock import _PJRT, _in_dispatch
        except ImportError:      # another pypjrt: its own calls take its own lock
            return None
        return cls(plugin, _PJRT, _in_dispatch)

    def _call(self, name: str, field: str, value) -> Any:
        fn, args, ref = self._structs[name]
        with self.lock:
            setattr(args, field, value)
            err = fn(ref)
            if err:
                raise self.plugin._to_exception(err)
            return args

    def execute(self, args_struct) -> None:
        fn = self._structs["PJRT_LoadedExecutable_Execute"][0]
        with self.lock:
            prev = getattr(self.flag, "flag", False)
            self.flag.flag = True
            try:
                err = fn(ctypes.byref(args_struct))
            finally:
                self.flag.flag = prev
        if err:
            raise self.plugin._to_exception(err)

    def await_event(self, event: int) -> None:
        """Wait for a PJRT event, then destroy it (also when it carried an error, which is raised)."""
        try:
            self._call("PJRT_Event_Await", "event", event)
        finally:
            self._call("PJRT_Event_Destroy", "event", event)

    def destroy_buffer(self, buffer: int) -> None:
        self._call("PJRT_Buffer_Destroy", "buffer", buffer)

    def is_deleted(self, buffer: int) -> bool:
        return bool(self._call("PJRT_Buffer_IsDeleted", "buffer", buffer).is_deleted)

    def device_pointer(self, buffer: int) -> int | None:
        """The buffer's device address; None when the plugin lacks the call."""
        if "PJRT_Buffer_OpaqueDeviceMemoryDataPointer" not in self._structs:
            return None
        return int(self._call("PJRT_Buffer_OpaqueDeviceMemoryDataPointer", "buffer", buffer).device_memory_ptr or 0)


class _PypjrtCalls:
    """_HotCalls' calls made through pypjrt's own API: what Device uses when pypjrt exposes no PJRT lock."""

    def __init__(self, plugin):
        self.plugin = plugin

    def execute(self, args_struct) -> None:
        self.plugin.call("PJRT_LoadedExecutable_Execute", args_struct, reentrant=True)

    def await_event(self, event: int) -> None:
        _PjrtEvent(self.plugin, event).consume()

    def destroy_buffer(self, buffer: int) -> None:
        _PjrtBuffer(self.plugin, buffer).close()

    def is_deleted(self, buffer: int) -> bool:
        a = self.plugin.args("PJRT_Buffer_IsDeleted_Args", buffer=buffer)
        self.plugin.call("PJRT_Buffer_IsDeleted", a)
        return bool(a.is_deleted)

    def device_pointer(self, buffer: int) -> None:
        return None         # Device.device_address asks pypjrt's buffer itself


class PluginNotFoundError(FileNotFoundError):
    """No PJRT plugin at the given path, or none installed; the message says what was tried."""


class CompileError(RuntimeError):
    """The plugin refused a body. `target` names the custom_call it has no handler for, if any."""

    def __init__(self, message: str, *, body_sha256: str, target: str | None = None):
        super().__init__(message)
        self.body_sha256 = body_sha256
        self.target = target


class TooFewDevicesError(RuntimeError):
    """The plugin's client has fewer devices than were asked for; nothing was allocated."""

    def __init__(self, message: str, *, asked: int, available: int):
        super().__init__(message)
        self.asked, self.available = asked, available


class DonationError(RuntimeError):
    """An input listed for donation was not consumed by the execution (it was copied instead).

    The execution did run: `outputs` holds its results, and the listed inputs still hold their
    old contents, so the caller loses no state.
    """

    def __init__(self, message: str, *, indices: Sequence[int], outputs: list["Buffer"]):
        super().__init__(message)
        self.indices = tuple(indices)
        self.outputs = outputs


# --------------------------------------------------------------------------- plugin discovery


def _installed_plugins() -> list[tuple[str, str, Path]]:
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
    if found := _installed_plugins():
        return str(found[0][2])
    looked = ", ".join(f"{d} ({so})" for d, so in _INSTALLED_PLUGINS)
    raise PluginNotFoundError(
        f"no PJRT plugin: none of {looked} is installed, no path was passed and "
        f"${ENV_PLUGIN} is unset")


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


def bytecode_stablehlo_version(body: bytes) -> tuple[int, int, int] | None:
    """The StableHLO version a portable artifact was serialized to, or None for text.

    `Exported.mlir_module_serialized` starts with the MLIR bytecode magic and a producer string
    such as `StableHLO_v1.15.0` (jax serializes to a version about four weeks old).
    """
    if not body.startswith(_BYTECODE_MAGIC):
        return None
    m = _BYTECODE_PRODUCER.search(body[:64])
    return tuple(int(x) for x in m.groups()) if m else None  # type: ignore[return-value]


# --------------------------------------------------------------------------- buffers


class Buffer:
    """A device buffer owned by a `Device`.

    `shape` and `dtype` are known without a device call for uploads and read lazily for outputs.
    `consumed` turns true once an execution took the buffer's memory by donation; a consumed
    buffer can no longer be read or passed to an execution.
    """

    __slots__ = ("_h", "_shape", "_dtype", "_ready", "_dense", "__weakref__")

    def __init__(self, handle: _PjrtBuffer, shape: tuple[int, ...] | None = None,
                 dtype: np.dtype | None = None, ready: bool = False):
        self._h = handle
        self._shape = shape
        self._dtype = dtype
        self._ready = ready      # known defined: an output of an execution whose completion was awaited
        self._dense = None       # True: its memory is host memory holding the array row-major (None: not known)

    @property
    def handle(self) -> _PjrtBuffer:
        """The pypjrt buffer underneath."""
        return self._h

    @property
    def shape(self) -> tuple[int, ...]:
        if self._shape is None:
            self._shape = tuple(int(d) for d in self._h.dimensions)
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        if self._dtype is None:
            self._dtype = _numpy_dtype(self._h._plugin, self._h.element_type)
        return self._dtype

    @property
    def consumed(self) -> bool:
        """True when a donating execution released this buffer's device memory."""
        st = self._h._state
        if st is _HandleState.DONATED:
            return True
        if st is _HandleState.CLOSED:
            return False
        return self._h.is_deleted

    @property
    def closed(self) -> bool:
        return self._h._state is _HandleState.CLOSED

    def close(self) -> None:
        """Release the handle (and its device memory unless already consumed). Idempotent."""
        self._h.close()

    def __del__(self):
        try:
            self._h.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        if self.closed:
            return "<Buffer closed>"
        state = "consumed" if self.consumed else "live"
        return f"<Buffer {self.dtype.name}{list(self.shape)} {state}>"


def _host_cpu() -> str:
    """The host CPU's model and instruction-set flags (Linux /proc/cpuinfo; elsewhere the machine type)."""
    import platform
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.machine()
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    lines = sorted({line.strip() for line in text.splitlines() if line.split(":", 1)[0].strip() in keys})
    return platform.machine() + "\n" + "\n".join(lines)


def _numpy_dtype(plugin: pypjrt.Plugin, code: int) -> np.dtype:
    for name, dt in _DTYPES:
        if getattr(plugin.abi, f"PJRT_Buffer_Type_{name}", None) == code:
            return dt
    raise TypeError(f"PJRT element type {code} has no numpy dtype here")


def _host_bytes(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (works for 0-d and for bf16/f8 dtypes)."""
    return arr.reshape(-1).view(np.uint8)


# --------------------------------------------------------------------------- executables


class _ExecuteCall:
    """PJRT_LoadedExecutable_Execute's argument struct for one executable, argument count, donation and device
    count, and the arrays it points at, made once and refilled by every call (Device.execute): an argument row and
    an output row per device, a completion event per device, and the options naming the arguments that are not
    donated."""

    def __init__(self, plugin: pypjrt.Plugin, handle: int, n: int, num_out: int, donated: frozenset[int],
                 devices: int = 1):
        keep = [i for i in range(n) if i not in donated]
        self.nd = (ctypes.c_int64 * max(len(keep), 1))(*keep)
        self.opts = plugin.args("PJRT_ExecuteOptions", launch_id=0)
        self.opts.non_donatable_input_indices = ctypes.cast(self.nd, _VOIDP)
        self.opts.num_non_donatable_input_indices = len(keep)
        self.rows = [(_VOIDP * max(n, 1))() for _ in range(devices)]
        self.out_rows = [(_VOIDP * max(num_out, 1))() for _ in range(devices)]
        self.arg_lists = (_VOIDP * devices)(*(ctypes.cast(r, _VOIDP) for r in self.rows))
        self.out_lists = (_VOIDP * devices)(*(ctypes.cast(r, _VOIDP) for r in self.out_rows))
        self.events = (_VOIDP * devices)()
        self.lock = threading.Lock()
        self.args = plugin.args(
            "PJRT_LoadedExecutable_Execute_Args", executable=handle, options=ctypes.addressof(self.opts),
            argument_lists=ctypes.cast(self.arg_lists, _VOIDP), num_devices=devices, num_args=n,
            output_lists=ctypes.cast(self.out_lists, _VOIDP), device_complete_events=ctypes.cast(self.events, _VOIDP))


class Executable:
    """A compiled body, loaded on one `Device`.

    Attributes:
        handle: the pypjrt executable.
        sha256: hex sha256 of the body bytes as given to `Device.compile`.
        name: optional label (an entry name) used in error messages.
        cache: "off" (no cache dir), "miss" (compiled and stored), "hit" (deserialized from the
            disk cache, no compilation), "stale" (a cached entry failed to load; recompiled).
        seconds: wall time of the compile, or of the load on a cache hit.
    """

    __slots__ = ("handle", "sha256", "name", "cache", "seconds", "num_outputs", "_calls", "_out_meta",
                 "__weakref__")

    def __init__(self, handle: pypjrt.Executable, *, sha256: str, name: str | None,
                 cache: str, seconds: float):
        self.handle = handle
        self.sha256 = sha256
        self.name = name
        self.cache = cache
        self.seconds = seconds
        self.num_outputs = handle.num_outputs
        self._calls: dict[tuple[int, frozenset[int]], _ExecuteCall] = {}
        self._out_meta: list[tuple[tuple[int, ...], np.dtype, bool]] | None = None   # Device.execute fills it

    def _call(self, plugin: pypjrt.Plugin, n: int, donated: frozenset[int], devices: int = 1) -> _ExecuteCall:
        """The Execute argument struct of calls with n arguments and these donated ones, made on first use."""
        key = (n, donated)
        if (call := self._calls.get(key)) is None:
            call = self._calls[key] = _ExecuteCall(plugin, self.handle._check(), n, self.num_outputs, donated,
                                                   devices)
        return call

    @property
    def label(self) -> str:
        return f"{self.name} ({self.sha256[:12]})" if self.name else f"body {self.sha256[:12]}"

    def memory_stats(self) -> dict[str, int]:
        """What XLA allocated for this executable (`PJRT_Executable_GetCompiledMemoryStats`).

        `alias_size_in_bytes` counts the donated inputs that outputs are written over, and
        `temp_size_in_bytes` the scratch memory: a temp at least as large as a pool means XLA
        copies the pool inside the body (it does on CPU when one step both reads a slice of the
        pool and updates it), even though the output still lands at the pool's address.
        """
        return self.handle.compiled_memory_stats()

    def close(self) -> None:
        self.handle.close()

    def __del__(self):
        try:
            self.handle.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"<Executable {self.label} outputs={self.num_outputs} cache={self.cache} "
                f"{self.seconds * 1e3:.1f} ms>")


# --------------------------------------------------------------------------- the device


class Device:
    """One PJRT client on one device (device 0 of the plugin), or on the first `devices` devices for SPMD bodies
    (a tensor-parallel artifact's: docs/multi-device.md), and what runs on them.

    Args:
        plugin: path of the plugin .so; see `find_plugin` for what is used when None.
        memory_fraction: the cap on device memory the CUDA plugin may use (with preallocation
            off it allocates on demand up to this fraction). Plugins without allocator options
            (the CPU plugin) reject them; they are dropped and listed in `ignored_options`.
        cache_dir: directory of the compile cache (serialized executables keyed by body sha256,
            compile options and plugin identity). None: no cache.
        devices: how many devices bodies run on. The CPU plugin is asked for that many (its create option
            `cpu_device_count`; 1 by default, so one-device serving never splits the host), a GPU plugin's
            visible GPUs are used in order; fewer than asked raises TooFewDevicesError before anything is
            allocated. With N > 1, `compile` builds SPMD executables of N partitions, `upload` takes the
            device, and `execute_sharded` runs one argument list per device.

    Use as a context manager, or call `close()`: it releases buffers and executables before the
    client, which a plugin requires.
    """

    def __init__(self, plugin: str | os.PathLike[str] | None = None, *,
                 memory_fraction: float = 0.75,
                 cache_dir: str | os.PathLike[str] | None = None, devices: int = 1):
        self.plugin_path = find_plugin(plugin)
        self._plugin = pypjrt.Plugin(self.plugin_path)
        # Without these the CUDA plugin reserves 75% of device memory up front (on a
        # unified-memory machine, 75% of RAM). Plugins that do not know them (CPU) reject them
        # by name; `_create_client` drops those and `ignored_options` lists them.
        requested: dict[str, Any] = {"preallocate": False,
                                     "memory_fraction": float(memory_fraction)}
        if devices < 1:
            raise ValueError(f"devices must be at least 1, got {devices}")
        if self._plugin.platform_hint == "cpu":
            # As many host devices as bodies are partitioned for (the CPU plugin's default is several).
            requested["cpu_device_count"] = devices
        self._client, self.create_options, self.ignored_options = _create_client(
            self._plugin, requested)
        available = self._client.device_count
        if available < devices:
            self._client.close()
            raise TooFewDevicesError(f"{Path(self.plugin_path).name} has {available} device(s); {devices} were asked "
                                     "for", asked=devices, available=available)
        self.devices = devices
        self._device_scope = self._client.devices()
        self._devices = self._device_scope.__enter__()[:devices]
        self._device = self._devices[0]
        self.device_ids = [d.id for d in self._devices]
        self._buffer_codes = {dt: getattr(self._plugin.abi, f"PJRT_Buffer_Type_{name}")
                              for name, dt in _DTYPES
                              if hasattr(self._plugin.abi, f"PJRT_Buffer_Type_{name}")}
        self._owned: weakref.WeakSet = weakref.WeakSet()
        self._hot = _HotCalls.make(self._plugin) or _PypjrtCalls(self._plugin)
        self._cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        self.platform_name = self._client.platform_name
        self.platform_version = self._platform_version()
        # On the CPU plugin a buffer's device memory is host memory: `to_host` reads it in place once the
        # buffer is ready, as jaxlib does on CPU, instead of PJRT_Buffer_ToHostBuffer, which hands the copy
        # to a worker thread and waits for it (about 150 us for 4 bytes on a loaded 2-core machine).
        self._host_memory = self.platform_name.lower() == "cpu"
        self.plugin_package = next(
            (f"{d} {v}" for d, v, p in _installed_plugins()
             if p.resolve() == Path(self.plugin_path).resolve()), None)
        self.identity = self._identity()

    # -- facts about the plugin --------------------------------------------------------------

    @property
    def api_version(self) -> tuple[int, int]:
        """The PJRT C API version the plugin implements."""
        return self._plugin.api_version

    @property
    def attributes(self) -> dict[str, Any]:
        """`PJRT_Plugin_Attributes` (xla_version, stablehlo versions, cuda_version ...)."""
        return dict(self._plugin.attributes)

    @property
    def stablehlo_versions(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(minimum, current) StableHLO version of portable artifacts the plugin reads."""
        return self._plugin.stablehlo_version_range

    def _platform_version(self) -> str:
        p = self._plugin
        a = p.args("PJRT_Client_PlatformVersion_Args", client=self._client.address)
        p.call("PJRT_Client_PlatformVersion", a)
        return ctypes.string_at(a.platform_version, a.platform_version_size).decode()

    def _identity(self) -> str:
        """What a cached executable must match: the plugin file and what it says of itself, the XLA
        flags it compiled under (--xla_cpu_max_isa and the like change the code), and the host CPU:
        a CPU executable holds code for the instruction set it was compiled on, so a cache directory
        shared with, or copied to, another machine must miss rather than run that code."""
        st = os.stat(self.plugin_path)
        facts = {
            "path": str(Path(self.plugin_path).resolve()), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "package": self.plugin_package,
            "api_version": list(self.api_version), "attributes": {
                k: list(v) if isinstance(v, tuple) else v
                for k, v in sorted(self._plugin.attributes.items())},
            "platform": [self.platform_name, self.platform_version],
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "host_cpu": _host_cpu(),
        }
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()

    def memory_available(self, device: int = 0) -> int | None:
        """Bytes device `device` can still allocate, or None when unknown: the plugin's limit less what is in use
        (CUDA), else, on the CPU, the host's available memory (/proc/meminfo MemAvailable), which the CPU
        plugin's devices share."""
        try:
            stats = self._devices[device].memory_stats()
        except pjrt_errors.PjrtError:
            stats = {}
        if "bytes_limit" in stats:
            return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if self.platform_name.lower() == "cpu":
            try:
                for line in Path("/proc/meminfo").read_text().splitlines():
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
            except (OSError, ValueError, IndexError):
                return None
        return None

    # -- compile -------------------------------------------------------------------------------

    def compile(self, mlir: str | bytes, *, name: str | None = None) -> Executable:
        """Compile a StableHLO body: textual MLIR, or portable bytecode
        (`Exported.mlir_module_serialized`, preferred: it is versioned and stable across XLA
        versions within the plugin's `stablehlo_versions`).

        With a cache dir, a body already compiled by this plugin is deserialized instead of
        compiled (`Executable.cache == "hit"`).

        Raises:
            CompileError: the bytecode's StableHLO version is outside the plugin's range, or the
                plugin refused the body (e.g. a custom_call it has no handler for: `.target`).
        """
        code = mlir.encode() if isinstance(mlir, str) else bytes(mlir)
        digest = hashlib.sha256(code).hexdigest()
        label = f"{name} ({digest[:12]})" if name else f"body {digest[:12]}"
        self._check_stablehlo_version(code, label, digest)
        options = pypjrt.CompileOptions(use_shardy_partitioner=b"sdy." in code)
        if self.devices > 1:
            # One replica of N partitions, partition i on this client's device i (the SPMD body's device i).
            options = pypjrt.CompileOptions(num_partitions=self.devices, use_spmd_partitioning=True,
                                            use_shardy_partitioner=b"sdy." in code,
                                            device_assignment=device_assignment_proto(self.device_ids))
        options_bytes = options.encode(self._plugin.abi)
        key = hashlib.sha256(b"\0".join(
            (_CACHE_FORMAT, digest.encode(), options_bytes, self.identity.encode()))).hexdigest()

        status = "off"
        if self._cache_dir is not None:
            t0 = time.perf_counter()
            handle, status = self._cache_load(key, digest)
            if handle is not None:
                return self._own(Executable(handle, sha256=digest, name=name, cache="hit",
                                            seconds=time.perf_counter() - t0))

        t0 = time.perf_counter()
        try:
            handle = self._client.compile(code, options=options)
        except pjrt_errors.PjrtError as e:
            m = _MISSING_FFI_HANDLER.search(e.message)
            target = m.group(1) if m else None
            hint = (f"; custom_call target {target} has no handler in {self._plugin.path.name}: "
                    f"write that step in plain ops" if target else "")
            raise CompileError(f"{self._plugin.path.name} refused {label}: {e.message}{hint}",
                               body_sha256=digest, target=target) from e
        seconds = time.perf_counter() - t0
        if self._cache_dir is not None:
            self._cache_store(key, handle, digest, options_bytes, name)
        return self._own(Executable(handle, sha256=digest, name=name,
                                    cache=status, seconds=seconds))

    def _check_stablehlo_version(self, code: bytes, label: str, digest: str) -> None:
        version = bytecode_stablehlo_version(code)
        accepted = self.stablehlo_versions
        if version is None or accepted is None:
            return
        lo, hi = accepted
        if not tuple(lo) <= version <= tuple(hi):
            fmt = lambda v: ".".join(map(str, v))  # noqa: E731
            raise CompileError(
                f"{label} is StableHLO {fmt(version)} bytecode; {self._plugin.path.name} reads "
                f"{fmt(lo)} to {fmt(hi)}", body_sha256=digest)

    def _cache_path(self, key: str) -> Path:
        assert self._cache_dir is not None
        return self._cache_dir / f"{key}.pypjrta"

    def _cache_load(self, key: str, digest: str) -> tuple[pypjrt.Executable | None, str]:
        """(loaded executable, "hit") or (None, "miss" | "stale")."""
        path = self._cache_path(key)
        if not path.is_file():
            return None, "miss"
        try:
            art = pypjrt.Artifact.read(path)
            meta = art.metadata
            if (meta.get("body_sha256") != digest or meta.get("plugin_identity") != self.identity
                    # A damaged executable could abort the process inside XLA, not just fail.
                    or meta.get("executable_sha256") != hashlib.sha256(art.executable).hexdigest()):
                return None, "stale"
            return self._client.deserialize_executable(art.executable), "hit"
        except (pjrt_errors.PjrtError, OSError, ValueError, KeyError):
            return None, "stale"

    def _cache_store(self, key: str, handle: pypjrt.Executable, digest: str,
                     options_bytes: bytes, name: str | None) -> None:
        """Write the serialized executable; a cache that cannot be written never fails a compile."""
        try:
            art = handle.to_artifact(compile_options=options_bytes, metadata={
                "body_sha256": digest, "plugin_identity": self.identity, "name": name})
            art.metadata["executable_sha256"] = hashlib.sha256(art.executable).hexdigest()
            self._cache_dir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
            fd, tmp = tempfile.mkstemp(dir=self._cache_dir, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(art.to_bytes())
                os.replace(tmp, self._cache_path(key))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except (pjrt_errors.PjrtError, OSError):
            pass

    # -- buffers -------------------------------------------------------------------------------

    def upload(self, array: Any, device: int = 0) -> Buffer:
        """Copy a host array to device `device` (any dtype in `_DTYPES`, bf16 via ml_dtypes).

        Read-only arrays (np.memmap of weight files, arrays jax hands out) upload without a host
        copy: the plugin reads the memory during the call (kImmutableOnlyDuringCall). pypjrt's
        `buffer_from_host` would refuse them, as it asks for a writable buffer.
        """
        arr = np.asarray(array)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        code = self._buffer_codes.get(arr.dtype)
        if code is None:
            raise TypeError(f"cannot upload dtype {arr.dtype}: no PJRT buffer type for it "
                            f"(supported: {', '.join(d.name for _, d in _DTYPES)})")
        p = self._plugin
        dims = (ctypes.c_int64 * max(arr.ndim, 1))(*arr.shape)
        a = p.args(
            "PJRT_Client_BufferFromHostBuffer_Args", client=self._client.address,
            data=arr.ctypes.data if arr.size else ctypes.addressof(_EMPTY),
            type=code, dims=ctypes.cast(dims, _VOIDP), num_dims=arr.ndim,
            host_buffer_semantics=p.abi.PJRT_HostBufferSemantics_kImmutableOnlyDuringCall,
            device=self._devices[device].address)
        with self._client.diagnose_allocation():
            p.call("PJRT_Client_BufferFromHostBuffer", a)
        if a.done_with_host_buffer:
            # kImmutableOnlyDuringCall: the plugin holds no reference to `data` once the call returned, so the
            # event has nothing left to wait for; it is only destroyed (awaiting it cost ~20 us an upload).
            _PjrtEvent(p, a.done_with_host_buffer).close()
        return self._own(Buffer(_PjrtBuffer(p, a.buffer), tuple(arr.shape), arr.dtype))

    def to_host(self, buffer: Buffer) -> np.ndarray:
        """Copy a device buffer into a new numpy array of its shape and dtype."""
        # Only an execution consumes a buffer, and Device.execute marks what it consumed: the state says it.
        if buffer._h._state is not _HandleState.LIVE:
            raise ValueError(f"cannot read {buffer!r}: its device memory is gone")
        out = np.empty(buffer.shape, buffer.dtype)
        if not out.size:
            return out
        if self._host_memory:
            p = self._plugin
            if not buffer._ready:
                a = p.args("PJRT_Buffer_ReadyEvent_Args", buffer=buffer._h._check())
                p.call("PJRT_Buffer_ReadyEvent", a)
                if a.event:
                    _PjrtEvent(p, a.event).consume()      # raises if the computation that defines it failed
                buffer._ready = True
            if buffer._dense is None:
                buffer._dense = self._dense(buffer)
            if buffer._dense:
                ctypes.memmove(out.ctypes.data, self.device_address(buffer), out.nbytes)
                return out
        buffer._h.to_host(_host_bytes(out))
        return out

    def _dense(self, buffer: Buffer) -> bool:
        """Whether `to_host` may copy the buffer's memory itself: host memory (the CPU plugin) with a
        device address, holding the array densely in row-major order."""
        if not self._host_memory or not self.device_address(buffer):
            return False
        ndim = len(buffer.shape)
        return ndim < 2 or self._row_major(buffer, ndim)

    def _row_major(self, buffer: Buffer, ndim: int) -> bool:
        """Whether the buffer's memory holds its array densely in row-major order (no tiles)."""
        p = self._plugin
        a = p.args("PJRT_Buffer_GetMemoryLayout_Args", buffer=buffer._h._check())
        try:
            p.call("PJRT_Buffer_GetMemoryLayout", a)
        except (pjrt_errors.Unimplemented, pjrt_errors.UnsupportedByPlugin):
            return False
        layout = a.layout
        if layout.type != p.abi.PJRT_Buffer_MemoryLayout_Type_Tiled:
            return False
        tiled = layout.tiled
        if tiled.num_tiles or tiled.minor_to_major_size != ndim:
            return False
        order = ctypes.cast(tiled.minor_to_major, ctypes.POINTER(ctypes.c_int64))
        return [order[i] for i in range(ndim)] == list(range(ndim - 1, -1, -1))

    def device_address(self, buffer: Buffer) -> int:
        """The buffer's device memory address (`PJRT_Buffer_OpaqueDeviceMemoryDataPointer`,
        else `PJRT_Buffer_UnsafePointer`). Equal addresses across an execution mean the output
        was written over the donated input."""
        if buffer._h._state is _HandleState.LIVE:
            try:
                address = self._hot.device_pointer(buffer._h._ptr)
            except (pjrt_errors.Unimplemented, pjrt_errors.UnsupportedByPlugin):
                address = None
            if address is not None:
                return address
        try:
            return buffer._h.device_pointer()
        except (pjrt_errors.Unimplemented, pjrt_errors.UnsupportedByPlugin):
            return buffer._h.unsafe_pointer()

    @staticmethod
    def is_consumed(buffer: Buffer) -> bool:
        """Whether an execution took this buffer by donation (same as `buffer.consumed`)."""
        return buffer.consumed

    # -- execute -------------------------------------------------------------------------------

    def execute(self, executable: Executable, args: Sequence[Buffer],
                donate: Iterable[int] = (), keep: Iterable[int] | None = None) -> list[Buffer | None]:
        """Run `executable` on `args` and wait for it; returns one Buffer per result.

        `donate` lists the argument indices whose buffers the execution may consume; every other
        argument is passed as non-donatable, so a body's `tf.aliasing_output` takes effect only
        where the caller asked for it. A donated input is consumed (its `Buffer.consumed` turns
        true) and the aliased output occupies its device memory. `keep` (None: all) lists the results
        the caller wants: the others are released at once and come back as None.

        Raises:
            ValueError: an argument was already consumed or closed, a donate index is out of
                range, or a donated buffer is also passed at another index.
            DonationError: a donated input was not consumed (the body has no alias for it, or
                the plugin copied); the run's outputs are on the exception.
        """
        return self._run(executable, (args,), donate, keep)[0]

    def execute_sharded(self, executable: Executable, args: Sequence[Sequence[Buffer]],
                        donate: Iterable[int] = (), keep: Iterable[int] | None = None) -> list[list[Buffer | None]]:
        """Run an SPMD executable once on all `devices` devices: args[d] is device d's argument list (each
        argument's shard on it, or its whole copy) -> outputs[d], device d's results. Donation, `keep` and the
        errors as `execute`, on every device: a DonationError's outputs are the per-device lists."""
        if len(args) != self.devices:
            raise ValueError(f"{executable.label}: {len(args)} argument lists for {self.devices} devices")
        return self._run(executable, args, donate, keep)

    def _run(self, executable: Executable, rows: Sequence[Sequence[Buffer]], donate: Iterable[int],
             keep: Iterable[int] | None) -> list[list[Buffer | None]]:
        """execute / execute_sharded: rows[d] are device d's arguments (one row on one device)."""
        n = len(rows[0])
        donated = frozenset(donate)
        if donated and not (min(donated) >= 0 and max(donated) < n):
            raise ValueError(f"{executable.label}: donate indices {sorted(donated)} out of "
                             f"range for {n} arguments")
        ptr_rows = []
        for d, args in enumerate(rows):
            if len(args) != n:
                raise ValueError(f"{executable.label}: device {d} has {len(args)} arguments, device 0 {n}")
            ptrs = []
            for i, b in enumerate(args):
                h = b._h
                if h._state is not _HandleState.LIVE:
                    where = f" on device {d}" if len(rows) > 1 else ""
                    raise ValueError(f"{executable.label}: argument {i}{where} is {h._state.value} "
                                     f"(an earlier execution consumed it, or it was closed)")
                ptrs.append(h._ptr)
            ptr_rows.append(ptrs)
            if donated:
                handles = [id(b._h) for b in args]
                for i in donated:
                    if handles.count(handles[i]) > 1:
                        raise ValueError(f"{executable.label}: argument {i} is donated and also passed "
                                         f"at another index")

        plugin, hot = self._plugin, self._hot
        devices = len(rows)
        call = executable._call(plugin, n, donated, devices)
        with call.lock:     # one struct per executable: a second thread waits while this one fills and reads it
            for row, ptrs in zip(call.rows, ptr_rows):
                row[:n] = ptrs
            for d in range(devices):
                call.events[d] = None
            try:
                hot.execute(call.args)      # reentrant: XLA may call FFI handlers synchronously inside Execute
            except pjrt_errors.PjrtError as e:
                error = type(e)(f"{executable.label}: {e.message}", e.code)
                with self._client.diagnose_allocation():     # an allocation failure gets the allocator's state
                    raise error from e
            events = list(call.events)
            out_ptr_rows = [list(r) for r in call.out_rows]
        # Wait before looking at the inputs: a donated input is still being read until then.
        failure = None
        for event in events:
            if event:
                try:
                    hot.await_event(event)
                except pjrt_errors.PjrtError as e:
                    failure = failure or e
        if failure is not None:
            for out_ptrs in out_ptr_rows:        # the failed run's results are released, not leaked
                for ptr in out_ptrs:
                    hot.destroy_buffer(ptr)
            raise failure
        # Once the run is complete its outputs are defined: to_host need not ask for their ready events.
        meta = executable._out_meta
        first = meta is None
        keep = None if keep is None else frozenset(keep)
        ready = all(events)
        out_rows: list[list[Buffer | None]] = []
        for out_ptrs in out_ptr_rows:
            outputs: list[Buffer | None] = []
            for j, ptr in enumerate(out_ptrs):
                if not first and keep is not None and j not in keep:
                    hot.destroy_buffer(ptr)
                    outputs.append(None)
                    continue
                shape, dtype, dense = (None, None, None) if first else meta[j]
                buf = Buffer(_PjrtBuffer(plugin, ptr), shape, dtype, ready=ready)
                buf._dense = dense
                outputs.append(self._own(buf))
            out_rows.append(outputs)
        if first:
            # An executable's results keep their shapes, dtypes and layouts from call to call: read them once.
            executable._out_meta = meta = [(b.shape, b.dtype, self._dense(b)) for b in out_rows[0]]
            for outputs in out_rows:
                for j, b in enumerate(outputs):
                    b._dense = meta[j][2]
                    if keep is not None and j not in keep:
                        b.close()
                        outputs[j] = None

        missing = []
        for d, args in enumerate(rows):
            for i in sorted(donated):
                h = args[i]._h
                if hot.is_deleted(h._ptr):
                    h._mark_donated()
                else:
                    missing.append((d, i))
        if missing:
            where = (f"{sorted({i for _, i in missing})}" if devices == 1 else
                     ", ".join(f"{i} on device {d}" for d, i in missing))
            raise DonationError(
                f"{executable.label}: donated argument(s) {where} were not consumed: the body "
                f"has no tf.aliasing_output for them or the plugin copied; outputs were written "
                f"elsewhere", indices=sorted({i for _, i in missing}),
                outputs=out_rows[0] if devices == 1 else out_rows)
        return out_rows

    # -- lifetime ------------------------------------------------------------------------------

    def _own(self, obj):
        self._owned.add(obj)
        return obj

    def close(self) -> None:
        """Release every buffer and executable of this device, then the client. Idempotent."""
        for obj in list(self._owned):
            try:
                obj.close()
            except pjrt_errors.PjrtError:
                pass
        self._owned.clear()
        if getattr(self, "_device_scope", None) is not None:
            self._device_scope.__exit__(None, None, None)
            self._device_scope = None
        self._client.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<Device {self.platform_name} {self.plugin_package or self.plugin_path} "
                f"api={self.api_version[0]}.{self.api_version[1]}>")


def _create_client(plugin: pypjrt.Plugin, requested: dict[str, Any]
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
