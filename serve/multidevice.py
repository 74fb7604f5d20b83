"""Prototype: one PJRT client with N devices running SPMD bodies (a tensor-parallel artifact's entries).

The CPU plugin takes its device count as the client create option `cpu_device_count`; a body exported with
`mhlo.num_partitions = N` is compiled with num_partitions N, SPMD partitioning on and a device assignment (one
computation per device, device ids in order), and executed with one argument list per device, each holding
that device's shard of every argument. Standard library, numpy and pypjrt only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pypjrt
from pypjrt import errors as pjrt_errors

from .pjrt import _DTYPES, find_plugin


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def device_assignment_proto(device_ids: Sequence[int]) -> bytes:
    """xla.DeviceAssignmentProto of one replica and len(device_ids) partitions, partition i on device_ids[i]
    (replica_count = 1, computation_count = N, computation_devices[i].replica_device_ids = [id], packed)."""
    out = b"\x08" + _varint(1) + b"\x10" + _varint(len(device_ids))
    for i in device_ids:
        ids = _varint(i)
        inner = b"\x0a" + _varint(len(ids)) + ids
        out += b"\x1a" + _varint(len(inner)) + inner
    return out


class DeviceMesh:
    """N devices of one PJRT client (a prototype of the runtime's multi-device path)."""

    def __init__(self, devices: int, plugin: str | None = None):
        self.plugin = pypjrt.Plugin(find_plugin(plugin))
        self.plugin.initialize()
        options = {"cpu_device_count": devices} if self.plugin.platform_hint == "cpu" else dict(
            pypjrt.Client.GPU_DEFAULTS)
        self.client = pypjrt.Client.create(self.plugin, options=options)
        have = self.client.device_count
        if have < devices:
            self.client.close()
            raise RuntimeError(f"the artifact needs {devices} devices; {self.plugin.path.name} has {have}")
        self.n = devices
        self._scope = self.client.devices()
        self.devices = self._scope.__enter__()[:devices]
        self.ids = [d.id for d in self.devices]
        self._codes = {dt: getattr(self.plugin.abi, f"PJRT_Buffer_Type_{name}") for name, dt in _DTYPES
                       if hasattr(self.plugin.abi, f"PJRT_Buffer_Type_{name}")}

    def compile(self, body: bytes) -> pypjrt.Executable:
        opts = pypjrt.CompileOptions(num_partitions=self.n, use_spmd_partitioning=self.n > 1,
                                     use_shardy_partitioner=b"sdy." in body,
                                     device_assignment=device_assignment_proto(self.ids))
        return self.client.compile(body, options=opts)

    def upload(self, array: np.ndarray, device: int):
        arr = np.ascontiguousarray(array)
        if not arr.flags.writeable:
            arr = arr.copy()
        return self.client.buffer_from_host(arr, self._codes[arr.dtype], arr.shape, self.devices[device])

    def upload_split(self, array: np.ndarray, axis: int | None) -> list:
        """One buffer per device: the whole array (axis None), or its d-th of n equal shards along `axis`."""
        if axis is None:
            return [self.upload(array, d) for d in range(self.n)]
        return [self.upload(part, d) for d, part in enumerate(np.split(array, self.n, axis=axis))]

    def execute(self, exe: pypjrt.Executable, args: Sequence[list], donate: set[int]) -> list[list]:
        """args[i][d]: argument i on device d -> outputs[j][d]."""
        rows = [[a[d] for a in args] for d in range(self.n)]
        outs = exe.execute_sharded(rows, non_donatable=[i for i in range(len(args)) if i not in donate])
        return [[outs[d][j] for d in range(self.n)] for j in range(len(outs[0]))]

    @staticmethod
    def to_host(buffer, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        buffer.to_host(out.reshape(-1).view(np.uint8))
        return out

    def close(self) -> None:
        self._scope.__exit__(None, None, None)
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.close()
        except pjrt_errors.PjrtError:
            pass
