"""The adapter slots on the device (manifest `lora`): each target's LORA_A and LORA_B and the LORA_SCALE vector,
zeroed at load and written one slot at a time as adapters come and go (serve/lora_slots.py), never per call.

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
    return sum(af.nbytes("float32" if role == af.Role.LORA_SCALE else shape.dtype, dims)
               for role, _, dims in shape.buffers())


class AdapterBuffers:
    """The device buffers an entry's LORA_A, LORA_B (by target) and LORA_SCALE arguments are, by (role, slot)."""

    def __init__(self, device: Device, shape: af.LoraShape):
        self.device = device
        self.shape = shape
        self.host: dict[tuple[af.Role, str], np.ndarray] = {}
        self.buffers: dict[tuple[af.Role, str], Buffer] = {}
        self.shared: dict[tuple[af.Role, str], bool] = {}     # the buffer is the host array's memory
        for role, slot, dims in shape.buffers():
            dtype = np.dtype(np.float32) if role == af.Role.LORA_SCALE else af.numpy_dtype(shape.dtype)
            self._place((role, slot), sharded.host_zeros(dims, dtype))
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
            if a is not None and a.shape[-1] > self.shape.max_rank:
                raise ValueError(f"adapter rank {a.shape[-1]} is past max_rank {self.shape.max_rank}")
            for layer in range(t.layers):
                # Out-major, as the buffers hold them: a layer's A slot [R, I], its B slot [O, R].
                key_a, key_b = (af.Role.LORA_A, f"{t.name}.{layer}"), (af.Role.LORA_B, f"{t.name}.{layer}")
                dest_a, dest_b = self.host[key_a][slot], self.host[key_b][:, slot]
                dest_a[...] = 0
                dest_b[...] = 0
                if a is not None:
                    dest_a[:a.shape[-1]] = a[layer].T
                    dest_b[:, :b.shape[-2]] = b[layer].T
                self._sync(key_a)
                self._sync(key_b)
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
