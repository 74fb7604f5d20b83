"""The lowest layer of the JAX-free runtime: one PJRT device, through pypjrt.

A `Device` loads a PJRT plugin (.so), creates a client on it, compiles StableHLO bodies written by `jax.export`
(textual MLIR or the portable bytecode `Exported.mlir_module_serialized`), uploads host arrays, runs executables
with chosen inputs donated, and copies results back::

    with Device(cache_dir="~/.cache/tlaloc/pjrt") as dev:
        exe = dev.compile(body_bytes)
        pool, x = dev.upload(pool_np), dev.upload(x_np)
        logits, pool2 = dev.execute(exe, [pool, x], donate={0})
        assert pool.consumed and dev.device_address(pool2) == address_before  # in place
        dev.to_host(logits)

Donation is what keeps the KV pools on the device: a body whose pool parameter carries `tf.aliasing_output` (what
`jax.jit(..., donate_argnums=...)` exports) writes its updated pool over the input when, and only when, that input
is donated. `execute` donates exactly the indices it is given (PJRT's `non_donatable_input_indices` holds every
other one) and raises `DonationError` if the plugin did not consume one of them, so a silent copy cannot pass for an
update in place. Measurements and the plugin's behaviour: docs/pjrt-notes.md.

This module imports only the standard library, numpy, ml_dtypes and pypjrt, never jax, jaxlib, flax, torch or
transformers. `execute` and `upload` call the PJRT C API themselves (`pypjrt.Executable.__call__` asks `IsDeleted`
of every argument after every run, and `Client.buffer_from_host` refuses read-only arrays such as memory-mapped
weights); what that needs of pypjrt's private state is in `pypjrt_compat`, the compile cache in `compile_cache`."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pypjrt
from pypjrt import errors as pjrt_errors

from tlaloc_jax import native

from . import host_memory
from . import pypjrt_compat as compat
from .compile_cache import CompileCache, plugin_identity
from .execution import DonationError, run_rows
from .handles import DTYPES, Buffer, Executable, host_bytes
from .plugin import (ENV_PLUGIN, PluginNotFoundError, bytecode_stablehlo_version, create_client,
                     device_assignment_proto, find_plugin, installed_plugins)
from .pypjrt_compat import PjrtBuffer

__all__ = [
    "ENV_PLUGIN", "PluginNotFoundError", "CompileError", "DonationError", "TooFewDevicesError",
    "find_plugin", "bytecode_stablehlo_version", "Device", "Executable", "Buffer",
]

_MISSING_FFI_HANDLER = re.compile(r"No FFI handler registered for (\S+)")
_VOIDP = ctypes.c_void_p
_EMPTY = ctypes.c_char()  # a valid host address for zero-size uploads
# (plugin path, native kernel) pairs registered in this process: a plugin's FFI registry lasts as long as it does.
_NATIVE_REGISTERED: set[tuple[str, str]] = set()
_NATIVE_LOCK = threading.Lock()


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


class Device:
    """One PJRT client on one device (device 0 of the plugin), or on its first `devices` devices for SPMD bodies
    (a tensor-parallel artifact's: docs/multi-device.md), and what runs on them.

    Args:
        plugin: path of the plugin .so; see `find_plugin` for what is used when None.
        memory_fraction: the cap on device memory the CUDA plugin may use (with preallocation
            off it allocates on demand up to this fraction). Plugins without allocator options
            (the CPU plugin) reject them; they are dropped and listed in `ignored_options`.
        cache_dir: directory of the compile cache (serialized executables keyed by body sha256,
            compile options and plugin identity). None: no cache.
        devices: how many devices bodies run on. The CPU plugin is asked for that many (its create option
            `cpu_device_count`, 1 by default: one-device serving never splits the host); a GPU plugin's visible
            GPUs are used in order. Fewer than asked raises TooFewDevicesError before anything is allocated.
            With N > 1, `compile` builds SPMD executables of N partitions, `upload` takes the device, and
            `execute_sharded` runs one argument list per device.

    Use as a context manager, or call `close()`: it releases buffers and executables before the
    client, which a plugin requires.
    """

    def __init__(self, plugin: str | os.PathLike[str] | None = None, *,
                 memory_fraction: float = 0.75,
                 cache_dir: str | os.PathLike[str] | None = None, devices: int = 1):
        self.plugin_path = find_plugin(plugin)
        compat.check_version()
        self._plugin = pypjrt.Plugin(self.plugin_path)
        # Without these the CUDA plugin reserves 75% of device memory up front (on a
        # unified-memory machine, 75% of RAM). Plugins that do not know them (CPU) reject them
        # by name; `_create_client` drops those and `ignored_options` lists them.
        requested: dict[str, Any] = {"preallocate": False,
                                     "memory_fraction": float(memory_fraction)}
        if devices < 1:
            raise ValueError(f"devices must be at least 1, got {devices}")
        if self._plugin.platform_hint == "cpu":
            # As many host devices as the bodies are partitioned for (the CPU plugin's default is several).
            requested["cpu_device_count"] = devices
        self._client, self.create_options, self.ignored_options = create_client(
            self._plugin, requested)
        available = self._client.device_count
        if available < devices:
            self._client.close()
            raise TooFewDevicesError(f"{Path(self.plugin_path).name} has {available} device(s); {devices} were asked "
                                     "for", asked=devices, available=available)
        self.devices = devices
        self._device_scope = self._client.devices()
        self._devices = self._device_scope.__enter__()[:devices]
        self.device_ids = [d.id for d in self._devices]
        self._buffer_codes = {dt: getattr(self._plugin.abi, f"PJRT_Buffer_Type_{name}")
                              for name, dt in DTYPES
                              if hasattr(self._plugin.abi, f"PJRT_Buffer_Type_{name}")}
        self._owned: weakref.WeakSet = weakref.WeakSet()
        self._adopted: list[np.ndarray] = []  # host memory adopted buffers live in (adopt)
        self._hot = compat.HotCalls(self._plugin)
        self.platform_name = self._client.platform_name
        self.platform_version = self._platform_version()
        # On the CPU plugin a buffer's device memory is host memory: `to_host` reads it in place once the
        # buffer is ready, as jaxlib does on CPU, instead of PJRT_Buffer_ToHostBuffer, which hands the copy
        # to a worker thread and waits for it (about 150 us for 4 bytes on a loaded 2-core machine).
        self._host_memory = self.platform_name.lower() == "cpu"
        self.plugin_package = next(
            (f"{d} {v}" for d, v, p in installed_plugins()
             if p.resolve() == Path(self.plugin_path).resolve()), None)
        self.identity = plugin_identity(self.plugin_path, self.plugin_package, self.api_version,
                                        self._plugin.attributes, (self.platform_name, self.platform_version))
        self._cache = CompileCache(cache_dir, self.identity) if cache_dir is not None else None
        self.shipped = None     # an artifact's own compiled entries (shipped_cache.open_shipped), after self._cache

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
        return host_memory.mem_available() if self.platform_name.lower() == "cpu" else None

    # -- native kernels ----------------------------------------------------------------------

    def register_native(self, target: str) -> None:
        """Build (or find in its cache) the native kernel `target` (tlaloc_jax.native) and register its handler with
        this plugin, once a process. Raises NativeKernelError, naming it, when this runtime has no such kernel or
        cannot build it here."""
        key = (str(self.plugin_path), target)
        with _NATIVE_LOCK:
            if key in _NATIVE_REGISTERED:
                return
            if self.platform_name.lower() != "cpu":
                raise native.NativeKernelError(f"native kernel {target!r} runs on the CPU; the plugin "
                                               f"{Path(self.plugin_path).name} is {self.platform_name}")
            compat.register_ffi_handler(self._plugin, target, native.handler(target), "Host")
            _NATIVE_REGISTERED.add(key)

    # -- compile -------------------------------------------------------------------------------

    def compile(self, mlir: str | bytes, *, name: str | None = None, concurrent: bool = False) -> Executable:
        """Compile a StableHLO body: textual MLIR, or portable bytecode
        (`Exported.mlir_module_serialized`, preferred: it is versioned and stable across XLA
        versions within the plugin's `stablehlo_versions`).

        With a cache dir, a body already compiled by this plugin is deserialized instead of
        compiled (`Executable.cache == "hit"`). concurrent: on the CPU plugin, deserialize without pypjrt's
        process-wide lock, so that a load in a background thread holds up no other thread (compat.deserialize_unlocked).

        Raises:
            CompileError: the bytecode's StableHLO version is outside the plugin's range, or the
                plugin refused the body (e.g. a custom_call it has no handler for: `.target`).
        """
        code = mlir.encode() if isinstance(mlir, str) else bytes(mlir)
        digest = hashlib.sha256(code).hexdigest()
        label = f"{name} ({digest[:12]})" if name else f"body {digest[:12]}"
        self._check_stablehlo_version(code, label, digest)
        options = self._compile_options(code)
        options_bytes = options.encode(self._plugin.abi)

        status = "off"
        t0 = time.perf_counter()
        load = compat.deserialize_unlocked if concurrent and self._host_memory else None
        if self._cache is not None:
            key = self._cache.key(digest, options_bytes)
            handle, status = self._cache.load(self._client, key, digest, load)
            if handle is not None:
                return self._own(Executable(handle, sha256=digest, name=name, cache="hit",
                                            seconds=time.perf_counter() - t0))
        if self.shipped is not None and (handle := self.shipped.load(self._client, digest, options_bytes,
                                                                     label, load)) is not None:
            return self._own(Executable(handle, sha256=digest, name=name, cache="shipped",
                                        seconds=time.perf_counter() - t0))

        t0 = time.perf_counter()
        try:
            handle = self._client.compile(code, options=options)
        except pjrt_errors.PjrtError as e:
            m = _MISSING_FFI_HANDLER.search(e.message)
            target = m.group(1) if m else None
            hint = (f"; custom_call target {target} has no handler in {self._plugin.path.name}: " +
                    ("a native kernel, which a manifest names in versions.custom_calls for the runtime to register"
                     if target in native.KERNELS else "write that step in plain ops") if target else "")
            raise CompileError(f"{self._plugin.path.name} refused {label}: {e.message}{hint}",
                               body_sha256=digest, target=target) from e
        seconds = time.perf_counter() - t0
        if self._cache is not None:
            self._cache.store(key, handle, digest, options_bytes, name)
        return self._own(Executable(handle, sha256=digest, name=name,
                                    cache=status, seconds=seconds))

    def _compile_options(self, code: bytes) -> pypjrt.CompileOptions:
        if self.devices > 1:
            # One replica of N partitions, partition i on this client's device i (the SPMD body's device i).
            return pypjrt.CompileOptions(num_partitions=self.devices, use_spmd_partitioning=True,
                                         use_shardy_partitioner=b"sdy." in code,
                                         device_assignment=device_assignment_proto(self.device_ids))
        return pypjrt.CompileOptions(use_shardy_partitioner=b"sdy." in code)

    def compiled_before(self, mlir: str | bytes, checked: bool = True) -> bool:
        """Whether the compile cache (or the artifact's shipped one) holds this body's executable from this plugin, so
        `compile` would load it (it cannot be refused). checked: its file read and checked, else only there."""
        code = mlir.encode() if isinstance(mlir, str) else bytes(mlir)
        digest, options = hashlib.sha256(code).hexdigest(), self.compile_options_bytes(code)
        key = self._cache.key(digest, options) if self._cache is not None else None
        if key is not None and (self._cache.read(key, digest)[0] is not None if checked else self._cache.has(key)):
            return True
        return self.shipped is not None and self.shipped.holds(digest, options, checked)

    @property
    def cache_directory(self) -> Path | None:
        """The compile cache's folder (None: no cache)."""
        return None if self._cache is None else self._cache.directory

    def compile_options_bytes(self, code: bytes) -> bytes:
        """The serialized compile options `compile` uses for this body (part of a compile cache's key)."""
        return self._compile_options(code).encode(self._plugin.abi)

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

    # -- buffers -------------------------------------------------------------------------------

    @property
    def host_memory(self) -> bool:
        """Whether this device's memory is host memory (the CPU plugin): `adopt` then wraps an array's own pages."""
        return self._host_memory

    def upload(self, array: Any, device: int = 0) -> Buffer:
        """Copy a host array to device `device` (any dtype in `DTYPES`, bf16 via ml_dtypes).

        Read-only arrays (np.memmap of weight files, arrays jax hands out) upload without a host
        copy: the plugin reads the memory during the call (kImmutableOnlyDuringCall). pypjrt's
        `buffer_from_host` would refuse them, as it asks for a writable buffer.
        """
        arr = np.asarray(array)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        return self._from_host(arr, self._plugin.abi.PJRT_HostBufferSemantics_kImmutableOnlyDuringCall, device)

    def adopt(self, array: np.ndarray, device: int = 0) -> Buffer:
        """A buffer over `array`'s own memory, with no copy, where device memory is host memory (the CPU plugin)
        and the array is C-contiguous and page-aligned (a weight file's np.memmap, a pool from `host_zeros`); else
        a copy (`upload`). Pages are then touched when a computation first does, not at load. The Device holds
        the array until `close()`; nothing else may write it (a writable one is the buffer's, to donate)."""
        arr = np.asarray(array)
        if not (self._host_memory and arr.flags.c_contiguous and arr.size and arr.ctypes.data % mmap.PAGESIZE == 0):
            return self.upload(arr, device)
        abi = self._plugin.abi
        semantics = (abi.PJRT_HostBufferSemantics_kMutableZeroCopy if arr.flags.writeable
                     else abi.PJRT_HostBufferSemantics_kImmutableZeroCopy)
        buf = self._from_host(arr, semantics, device)
        self._adopted.append(arr)
        return buf

    def _from_host(self, arr: np.ndarray, semantics: int, device: int) -> Buffer:
        code = self._buffer_codes.get(arr.dtype)
        if code is None:
            raise TypeError(f"cannot upload dtype {arr.dtype}: no PJRT buffer type for it "
                            f"(supported: {', '.join(d.name for _, d in DTYPES)})")
        dims = (ctypes.c_int64 * max(arr.ndim, 1))(*arr.shape)
        try:
            ptr, done = self._hot.buffer_from_host(
                client=self._client.address, data=arr.ctypes.data if arr.size else ctypes.addressof(_EMPTY),
                type=code, dims=ctypes.cast(dims, _VOIDP), num_dims=arr.ndim, host_buffer_semantics=semantics,
                device=self._devices[device].address)
        except pjrt_errors.PjrtError as e:
            with self._client.diagnose_allocation():     # an allocation failure gets the allocator's state
                raise e
        if done:
            # kImmutableOnlyDuringCall: the plugin holds no reference to `data` once the call returned, so the
            # event has nothing left to wait for; it is only destroyed (awaiting it cost ~20 us an upload).
            # Zero copy (adopt): the Device holds the memory until close, past any use the event would mark.
            self._hot.destroy_event(done)
        return self._own(Buffer(PjrtBuffer(self._plugin, ptr), tuple(arr.shape), arr.dtype, hot=self._hot))

    def to_host(self, buffer: Buffer) -> np.ndarray:
        """Copy a device buffer into a new numpy array of its shape and dtype."""
        # Only an execution consumes a buffer, and Device.execute marks what it consumed: the state says it.
        if not compat.is_live(buffer._h):
            raise ValueError(f"cannot read {buffer!r}: its device memory is gone")
        out = np.empty(buffer.shape, buffer.dtype)
        if not out.size:
            return out
        if self._host_memory and self._holds_densely(buffer):
            ctypes.memmove(out.ctypes.data, self.device_address(buffer), out.nbytes)
            return out
        buffer._h.to_host(host_bytes(out))
        return out

    def overwrite(self, buffer: Buffer, array: np.ndarray) -> bool:
        """Write `array` over `buffer`'s memory where that memory is host memory holding it densely (the CPU
        plugin): a step input's next value in a microsecond, where a new buffer costs ~40 us. False where it
        cannot (another device kind, another layout, shape or dtype): upload a new buffer instead.

        Only for a buffer that no execution in flight reads (this runtime awaits each of its executions before
        returning) and that no execution took by donation; never an adopted one (its memory is the caller's)."""
        if (not self._host_memory or not compat.is_live(buffer._h) or array.shape != buffer.shape
                or array.dtype != buffer.dtype or not self._holds_densely(buffer)):
            return False
        if array.size:
            ctypes.memmove(self.device_address(buffer), np.ascontiguousarray(array).ctypes.data, array.nbytes)
        return True

    def _holds_densely(self, buffer: Buffer) -> bool:
        """Whether a host-memory buffer, once defined (waited for here the first time), holds its array densely."""
        if not buffer._ready:
            p = self._plugin
            a = p.args("PJRT_Buffer_ReadyEvent_Args", buffer=compat.checked_pointer(buffer._h))
            p.call("PJRT_Buffer_ReadyEvent", a)
            if a.event:
                compat.consume_event(p, a.event)      # raises if the computation that defines it failed
            buffer._ready = True
        if buffer._dense is None:
            buffer._dense = self._dense(buffer)
        return buffer._dense

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
        a = p.args("PJRT_Buffer_GetMemoryLayout_Args", buffer=compat.checked_pointer(buffer._h))
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
        if compat.is_live(buffer._h):
            try:
                address = self._hot.device_pointer(compat.raw_pointer(buffer._h))
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
        return run_rows(self, executable, (args,), donate, keep)[0]

    def execute_sharded(self, executable: Executable, args: Sequence[Sequence[Buffer]],
                        donate: Iterable[int] = (), keep: Iterable[int] | None = None) -> list[list[Buffer | None]]:
        """Run an SPMD executable once on all `devices` devices: args[d] is device d's argument list (each
        argument's shard on it, or its whole copy) -> outputs[d], device d's results. Donation, `keep` and the
        errors as `execute`, on every device: a DonationError's outputs are the per-device lists."""
        if len(args) != self.devices:
            raise ValueError(f"{executable.label}: {len(args)} argument lists for {self.devices} devices")
        return run_rows(self, executable, args, donate, keep)

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
        self._adopted.clear()

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
