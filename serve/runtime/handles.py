"""Device buffers and compiled executables owned by a `Device` (serve/runtime/pjrt.py)."""

from __future__ import annotations

import ctypes
import threading

import ml_dtypes
import numpy as np
import pypjrt

from . import pypjrt_compat as compat
from .pypjrt_compat import PjrtBuffer

#: PJRT_Buffer_Type names and the numpy dtypes that hold them (bf16 and f8 via ml_dtypes).
DTYPES = (
    ("PRED", np.dtype(np.bool_)), ("S8", np.dtype(np.int8)), ("S16", np.dtype(np.int16)),
    ("S32", np.dtype(np.int32)), ("S64", np.dtype(np.int64)), ("U8", np.dtype(np.uint8)),
    ("U16", np.dtype(np.uint16)), ("U32", np.dtype(np.uint32)), ("U64", np.dtype(np.uint64)),
    ("F16", np.dtype(np.float16)), ("F32", np.dtype(np.float32)), ("F64", np.dtype(np.float64)),
    ("BF16", np.dtype(ml_dtypes.bfloat16)), ("F8E4M3FN", np.dtype(ml_dtypes.float8_e4m3fn)),
    ("F8E5M2", np.dtype(ml_dtypes.float8_e5m2)),
)

_VOIDP = ctypes.c_void_p


class Buffer:
    """A device buffer owned by a `Device`.

    `shape` and `dtype` are known without a device call for uploads and read lazily for outputs.
    `consumed` turns true once an execution took the buffer's memory by donation; a consumed
    buffer can no longer be read or passed to an execution.
    """

    __slots__ = ("_h", "_shape", "_dtype", "_ready", "_dense", "_hot", "__weakref__")

    def __init__(self, handle: PjrtBuffer, shape: tuple[int, ...] | None = None,
                 dtype: np.dtype | None = None, ready: bool = False, hot: compat.HotCalls | None = None):
        self._h = handle
        self._hot = hot          # the owning Device's made calls (close without building a struct), if given
        self._shape = shape
        self._dtype = dtype
        self._ready = ready      # known defined: an output of an execution whose completion was awaited
        self._dense = None       # True: its memory is host memory holding the array row-major (None: not known)

    @property
    def handle(self) -> PjrtBuffer:
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
            self._dtype = numpy_dtype(compat.handle_plugin(self._h), self._h.element_type)
        return self._dtype

    @property
    def consumed(self) -> bool:
        """True when a donating execution released this buffer's device memory."""
        if compat.is_donated(self._h):
            return True
        if compat.is_closed(self._h):
            return False
        return self._h.is_deleted

    @property
    def closed(self) -> bool:
        return compat.is_closed(self._h)

    def close(self) -> None:
        """Release the handle (and its device memory unless already consumed). Idempotent."""
        if self._hot is not None:
            self._hot.close_buffer(self._h)
        else:
            self._h.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        if self.closed:
            return "<Buffer closed>"
        state = "consumed" if self.consumed else "live"
        return f"<Buffer {self.dtype.name}{list(self.shape)} {state}>"


def numpy_dtype(plugin: pypjrt.Plugin, code: int) -> np.dtype:
    for name, dt in DTYPES:
        if getattr(plugin.abi, f"PJRT_Buffer_Type_{name}", None) == code:
            return dt
    raise TypeError(f"PJRT element type {code} has no numpy dtype here")


def host_bytes(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (works for 0-d and for bf16/f8 dtypes)."""
    return arr.reshape(-1).view(np.uint8)




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
            disk cache, no compilation), "shipped" (deserialized from the artifact's compile-cache folder),
            "stale" (a cached entry failed to load; recompiled).
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
            call = self._calls[key] = _ExecuteCall(plugin, compat.checked_pointer(self.handle), n, self.num_outputs,
                                                   donated, devices)
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
