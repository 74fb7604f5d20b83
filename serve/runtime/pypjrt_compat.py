"""Every use of pypjrt's private names, in one module, for the pypjrt version it was written for.

The runtime calls the PJRT C API around pypjrt's own objects on its hot path (one Execute struct per
executable, buffers released without a wrapper, read-only uploads), which needs a handle's raw pointer
and state, the process-wide PJRT lock and the plugin's error conversion. Those are not pypjrt's public
API, so `check_version` refuses any pypjrt but the one pinned in pyproject.toml, by name.
"""

from __future__ import annotations

import ctypes
from importlib import metadata
from typing import Any

import pypjrt
from pypjrt import errors as pjrt_errors
from pypjrt._lock import _PJRT, _in_dispatch
from pypjrt.client import Buffer as PjrtBuffer
from pypjrt.client import Event as PjrtEvent
from pypjrt.client import State

#: The pypjrt releases whose private layout this module was written against (pyproject.toml pins it).
SUPPORTED_PYPJRT = ("0.1.1",)

__all__ = ["SUPPORTED_PYPJRT", "check_version", "HotCalls", "PjrtBuffer", "PjrtEvent", "is_live", "is_closed",
           "is_donated", "raw_pointer", "checked_pointer", "mark_donated", "handle_plugin",
           "consume_event", "state_name", "register_ffi_handler", "deserialize_unlocked"]


def check_version(installed: str | None = None) -> None:
    """Refuse a pypjrt this module was not written for (its private names may differ)."""
    installed = installed or metadata.version("pypjrt")
    if installed not in SUPPORTED_PYPJRT:
        raise RuntimeError(f"pypjrt {installed} is installed; tlaloc_jax.serve reaches into pypjrt's handles and "
                           f"lock as pypjrt {' / '.join(SUPPORTED_PYPJRT)} lays them out (serve/runtime/"
                           f"pypjrt_compat.py): install pypjrt=={SUPPORTED_PYPJRT[-1]}")


# -- handle state ---------------------------------------------------------------------------------------

def is_live(h) -> bool:
    return h._state is State.LIVE


def is_closed(h) -> bool:
    return h._state is State.CLOSED


def is_donated(h) -> bool:
    return h._state is State.DONATED


def state_name(h) -> str:
    return h._state.value


def raw_pointer(h) -> int:
    """The PJRT pointer of a handle, whatever its state."""
    return h._ptr


def checked_pointer(h) -> int:
    """The PJRT pointer of a live handle (pypjrt's HandleClosed otherwise)."""
    return h._check()


def mark_donated(h) -> None:
    """Record that an execution consumed the buffer's memory (pypjrt then never reads it)."""
    h._mark_donated()


def handle_plugin(h) -> pypjrt.Plugin:
    return h._plugin


def consume_event(plugin: pypjrt.Plugin, event: int) -> None:
    """Wait for an event and destroy it; raises the error it carried."""
    PjrtEvent(plugin, event).consume()


# -- the calls of every step --------------------------------------------------------------------------------

class HotCalls:
    """The PJRT calls a step makes every time (Execute, Event_Await / Event_Destroy, Buffer_Destroy,
    Buffer_IsDeleted, the device pointer, the uploads of its inputs) with each call's function pointer and argument
    struct made once (pypjrt builds a new struct for every call).

    Each call holds pypjrt's process-wide PJRT lock, as pypjrt's own calls do (a buffer finalizer on another
    thread must not race an Execute); Execute is marked as a region XLA may re-enter; a ready event is awaited
    without a separate PJRT_Event_Error (Await returns the event's error). Errors become pypjrt's exceptions."""

    def __init__(self, plugin: pypjrt.Plugin):
        self.plugin = plugin
        self._structs = {}
        for name in ("PJRT_LoadedExecutable_Execute", "PJRT_Event_Await", "PJRT_Event_Destroy",
                     "PJRT_Buffer_Destroy", "PJRT_Buffer_IsDeleted", "PJRT_Buffer_OpaqueDeviceMemoryDataPointer",
                     "PJRT_Client_BufferFromHostBuffer"):
            try:
                fn = plugin.fn(name)
            except (pjrt_errors.Unimplemented, pjrt_errors.UnsupportedByPlugin):
                continue        # device_pointer: the caller falls back to pypjrt's buffer calls
            args = plugin.args(f"{name}_Args")
            self._structs[name] = (fn, args, ctypes.byref(args))

    def _call(self, name: str, field: str, value) -> Any:
        fn, args, ref = self._structs[name]
        with _PJRT:
            setattr(args, field, value)
            err = fn(ref)
            if err:
                raise self.plugin._to_exception(err)
            return args

    def execute(self, args_struct) -> None:
        fn = self._structs["PJRT_LoadedExecutable_Execute"][0]
        with _PJRT:
            prev = getattr(_in_dispatch, "flag", False)
            _in_dispatch.flag = True
            try:
                err = fn(ctypes.byref(args_struct))
            finally:
                _in_dispatch.flag = prev
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

    def destroy_event(self, event: int) -> None:
        self._call("PJRT_Event_Destroy", "event", event)

    def buffer_from_host(self, **fields) -> tuple[int, int]:
        """PJRT_Client_BufferFromHostBuffer with `fields` set (the rest as the last call left them: every caller
        sets the same ones) -> (the buffer, its done-with-host-buffer event, 0 for none)."""
        fn, args, ref = self._structs["PJRT_Client_BufferFromHostBuffer"]
        with _PJRT:
            for name, value in fields.items():
                setattr(args, name, value)
            args.done_with_host_buffer = None
            args.buffer = None
            err = fn(ref)
            if err:
                raise self.plugin._to_exception(err)
            return args.buffer, args.done_with_host_buffer or 0

    def close_buffer(self, h: PjrtBuffer) -> None:
        """pypjrt's Buffer.close (idempotent; a donated buffer's handle is still destroyed) through the made
        struct."""
        if h._state is State.CLOSED:
            return
        h._state = State.CLOSED
        self.destroy_buffer(h._ptr)

    def is_deleted(self, buffer: int) -> bool:
        return bool(self._call("PJRT_Buffer_IsDeleted", "buffer", buffer).is_deleted)

    def device_pointer(self, buffer: int) -> int | None:
        """The buffer's device address; None when the plugin lacks the call."""
        if "PJRT_Buffer_OpaqueDeviceMemoryDataPointer" not in self._structs:
            return None
        return int(self._call("PJRT_Buffer_OpaqueDeviceMemoryDataPointer", "buffer", buffer).device_memory_ptr or 0)


# -- loading executables ------------------------------------------------------------------------------

def deserialize_unlocked(client: pypjrt.Client, blob: bytes) -> pypjrt.Executable:
    """pypjrt's Client.deserialize_executable without its process-wide lock (the lock guards buffers and executions,
    which a load touches not; the CPU client's DeserializeAndLoad is thread-safe): a load in a background thread
    then holds up no other thread's PJRT calls, such as the weights' uploads, for its half second."""
    plugin = client._plugin
    buf = ctypes.create_string_buffer(blob, len(blob))
    args = plugin.args("PJRT_Executable_DeserializeAndLoad_Args", client=client._check(),
                       serialized_executable=ctypes.cast(buf, ctypes.c_void_p), serialized_executable_size=len(blob))
    err = plugin.fn("PJRT_Executable_DeserializeAndLoad")(ctypes.byref(args))
    if err:
        raise plugin._to_exception(err)
    return pypjrt.client.Executable(plugin, args.loaded_executable, client)


# -- FFI handlers -----------------------------------------------------------------------------------------

_KEPT: list = []        # what the plugin keeps pointers to (names), for the life of the process


def register_ffi_handler(plugin: pypjrt.Plugin, name: str, address: int, platform: str) -> None:
    """Register a C function at `address` (an XLA FFI handler) for `stablehlo.custom_call @name` on `platform`
    ("Host" or "CUDA"), through the plugin's FFI extension, as pypjrt.ffi.register does for a Python callable; the
    plugin calls the handler once, synchronously, for its metadata."""
    from pypjrt._lock import dispatching
    ext = plugin.require_extension("FFI")
    name_b, platform_b = ctypes.create_string_buffer(name.encode()), ctypes.create_string_buffer(platform.encode())
    _KEPT.extend((name_b, platform_b))
    args = plugin.args("PJRT_FFI_Register_Handler_Args", target_name=ctypes.cast(name_b, ctypes.c_void_p),
                       target_name_size=len(name), handler=ctypes.c_void_p(address),
                       platform_name=ctypes.cast(platform_b, ctypes.c_void_p), platform_name_size=len(platform),
                       traits=0)
    register = ctypes.cast(ext.address + 40, ctypes.POINTER(ctypes.c_void_p))[0]   # PJRT_FFI_Extension.register_handler
    if not register:
        raise pjrt_errors.UnsupportedByPlugin("the plugin's FFI extension has no register_handler")
    with dispatching():
        err = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(register)(ctypes.byref(args))
    if err:
        raise plugin._to_exception(err)
