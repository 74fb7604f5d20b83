"""The adapter slots on the device (manifest `lora`): each target's LORA_A and LORA_B and the LORA_SCALE vector,
zeroed at load and written one slot at a time as adapters come and go (serve/lora.py), never per call.

Where device memory is host memory (the CPU plugin) each buffer is the host array itself (Device.adopt): writing a
slot writes the device's copy. Elsewhere the written buffer is uploaded again, once per adapter written.
"""

from __future__ import annotations

import numpy as np

from tlaloc_jax import artifact as af

from . import sharded
from .handles import Buffer
from .pjrt import Device


def adapter_bytes(shape: af.LoraShape | None) -> int:
    """The bytes of every adapter buffer (0 without a lora record)."""
    if shape is None:
        return 0
    return sum(af.nbytes(shape.dtype, shape.shapes(t)[role]) for t in shape.targets
               for role in (af.Role.LORA_A, af.Role.LORA_B)) + af.nbytes("float32", (shape.max_loras + 1,))


class AdapterBuffers:
    """The device buffers an entry's LORA_A, LORA_B (by target) and LORA_SCALE arguments are, by (role, slot)."""

    def __init__(self, device: Device, shape: af.LoraShape):
        self.device = device
        self.shape = shape
        self.host: dict[tuple[af.Role, str], np.ndarray] = {}
        self.buffers: dict[tuple[af.Role, str], Buffer] = {}
        self.shared: dict[tuple[af.Role, str], bool] = {}     # the buffer is the host array's memory
        dtype = af.numpy_dtype(shape.dtype)
        for t in shape.targets:
            dims = shape.shapes(t)
            for role in (af.Role.LORA_A, af.Role.LORA_B):
                self._place((role, t.name), sharded.host_zeros(dims[role], dtype))
        self._place((af.Role.LORA_SCALE, ""), sharded.host_zeros((shape.max_loras + 1,), np.dtype(np.float32)))
        self.stats = dict(uploads=0)

    def _place(self, key: tuple[af.Role, str], array: np.ndarray) -> None:
        buf = self.device.adopt(array)
        self.host[key], self.buffers[key] = array, buf
        self.shared[key] = bool(array.size) and self.device.device_address(buf) == array.ctypes.data

    def write(self, slot: int, weights: dict, scale: float) -> None:
        """Put an adapter in `slot` (1..max_loras): weights {target: (A [L, I, r], B [L, r, O])}, r <= max_rank (the
        rest zero), targets it lacks zero; its scale."""
        if not 0 < slot <= self.shape.max_loras:
            raise ValueError(f"LoRA slot {slot} is not one of 1..{self.shape.max_loras}")
        unknown = sorted(set(weights) - {t.name for t in self.shape.targets})
        if unknown:
            raise ValueError(f"adapter targets {unknown} are not the artifact's lora targets")
        for t in self.shape.targets:
            a, b = weights.get(t.name, (None, None))
            for role, value in ((af.Role.LORA_A, a), (af.Role.LORA_B, b)):
                dest = self.host[(role, t.name)][:, slot]
                dest[...] = 0
                if value is not None:
                    r = value.shape[-1] if role == af.Role.LORA_A else value.shape[-2]
                    if r > self.shape.max_rank:
                        raise ValueError(f"adapter rank {r} is past max_rank {self.shape.max_rank}")
                    (dest[..., :r] if role == af.Role.LORA_A else dest[..., :r, :])[...] = value
                self._sync((role, t.name))
        self.host[(af.Role.LORA_SCALE, "")][slot] = scale
        self._sync((af.Role.LORA_SCALE, ""))

    def _sync(self, key: tuple[af.Role, str]) -> None:
        """Where the buffer is not the host array's memory, upload the host array again in its place."""
        if self.shared[key]:
            return
        old = self.buffers[key]
        self.buffers[key] = self.device.upload(self.host[key])
        sharded.close(old)
        self.stats["uploads"] += 1
