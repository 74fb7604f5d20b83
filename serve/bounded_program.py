"""BoundedProgram: serve a bounded-program artifact (tlaloc-bounded-v1, written by tlaloc_jax.stage_bounded)
without JAX.

    program = BoundedProgram.load("artifact/")               # validate, compile every program, upload the weights
    out = program.run({"ids": ids})                          # {output name: array}, at the call's own sizes
    outs = program.run_many([{"ids": a}, {"ids": b}, ...])   # calls batched into one body where a batch bound allows

A call's size along each bound is read off its inputs (every axis of a bound must agree; 1 to the bound's max).
It runs in the program of the smallest bucket of each bound that holds it: the inputs are padded with zeros, each
bound's VALID_LENGTH and VALID_MASK inputs say what is real, and each output's bounded axes are sliced back to the
call's sizes. The exporter has checked that no program reads its padding, so what fills it does not matter.

With a batch bound, `run_many` packs calls into shared bodies: the calls are ordered by their sizes (so calls of
similar length share a bucket), taken in that order while their rows fit the bound's max, each group run in the
program that holds its rows and its longest call; every row carries its own call's lengths. Without one, each call
runs alone. A BoundedProgram is not thread-safe: one caller at a time (the HTTP server keeps one worker thread).

The decoder's artifacts are refused by name (tlaloc_jax.serve.Engine serves those), as the Engine refuses these.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tlaloc_jax import artifact as af
from tlaloc_jax.artifact import bounded_manifest as bm

from .engine import DEFAULT_CACHE_DIR
from .runtime import Buffer, Device, Executable, sharded
from .runtime.native_log import native_stderr_to_log

log = logging.getLogger("tlaloc_jax.serve.bounded_program")


class CallRefused(ValueError):
    """A call the program cannot run; the message names the input, axis or bound at fault. Nothing ran."""


@dataclass(frozen=True)
class _Call:
    """A checked call: its inputs in the program's dtypes, and its size along each bound (rows for the batch bound)."""

    inputs: dict[str, np.ndarray]
    sizes: dict[str, int]


def _as_dtype(name: str, value: Any, want: np.dtype) -> np.ndarray:
    """`value` as the program's dtype: integers to integers that hold them, floats to floats; nothing else."""
    arr = np.asarray(value)
    if arr.dtype == want:
        return arr
    if want.kind in "iu" and arr.dtype.kind in "iu":
        info = np.iinfo(want)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise CallRefused(f"input {name!r} holds values outside {want.name}")
        return arr.astype(want)
    if want.kind == "f" or want.name in ("bfloat16", "float8_e4m3fn"):
        if arr.dtype.kind in "f" or arr.dtype.name in ("bfloat16", "float8_e4m3fn"):
            return arr.astype(want)
    raise CallRefused(f"input {name!r} is {arr.dtype.name}, the program takes {want.name}")


def valid_inputs(bounds: tuple[bm.BoundSpec, ...], bucket: Mapping[str, int],
                 calls: Sequence[_Call]) -> list[np.ndarray]:
    """Each bound's VALID_LENGTH and VALID_MASK for `calls` sharing one body of sizes `bucket`: with a batch bound
    the live rows, and each row its own call's lengths (0 in padding rows); without one, the call's sizes."""
    batch = next((b for b in bounds if b.kind == af.BoundKind.BATCH), None)
    out = []
    for b in bounds:
        n = bucket[b.name]
        if batch is None:
            length = np.int32(calls[0].sizes[b.name])
        elif b is batch:
            length = np.int32(sum(c.sizes[b.name] for c in calls))
        else:
            rows = [c.sizes[b.name] for c in calls for _ in range(c.sizes[batch.name])]
            length = np.zeros(bucket[batch.name], np.int32)
            length[:len(rows)] = rows
        out += [np.asarray(length, np.int32), np.arange(n, dtype=np.int32) < np.asarray(length)[..., None]]
    return out


class BoundedProgram:
    """Serve one bounded-program artifact on one PJRT device (its own, or one shared with an Engine)."""

    def __init__(self, artifact_dir: str | Path, plugin: str | None = None, *, device: Device | None = None,
                 cache_dir: str | Path | None = DEFAULT_CACHE_DIR, memory_fraction: float = 0.75,
                 trust_weights: bool = False, progress: bool = False, manifest: bm.BoundedManifest | None = None):
        """Validate the artifact (every file's sha256, every body's @main against its program; a decoder artifact
        is refused by name; a file unchanged since a load with this cache_dir is not hashed again), then compile
        every program and upload the weights.

        device: a Device to share (an Engine's: the server runs a decoder and an embedding program on one device);
        None opens one on `plugin`. trust_weights: skip hashing the weight files (sizes are still checked).
        manifest: this artifact's manifest as bm.load_bounded returned it, when the caller has validated it.
        """
        t0 = time.perf_counter()
        self.artifact_dir = Path(artifact_dir)
        self.manifest = m = manifest or af.load_remembering(bm.load_bounded, self.artifact_dir, cache_dir,
                                                            verify_weights=not trust_weights)
        if trust_weights:
            log.warning("--trust-weights: the weight files of %s are not hashed", self.artifact_dir)
        self._owns_device = device is None
        if device is None:
            with native_stderr_to_log():
                device = Device(plugin, memory_fraction=memory_fraction, cache_dir=cache_dir)
        self.device = device
        self.executables: dict[tuple[int, ...], Executable] = {}
        self.weights: list[Buffer] = []
        try:
            self._check_device()
            from tqdm.auto import tqdm
            for p in tqdm(m.programs, desc="compile", unit="program", disable=not progress):
                self.executables[tuple(p.sizes)] = self.device.compile(
                    (self.artifact_dir / p.serialized).read_bytes(), name=p.name)
            placed = sharded.upload_weights(self.device, self.artifact_dir, m.weights, None)
            self.weights = [placed[w.slot] for w in m.weights]
        except BaseException:
            self.close()
            raise
        self._programs = {tuple(p.sizes): p for p in m.programs}
        self._batch = m.batch
        self.executions: dict[str, int] = {}
        self.load_seconds = time.perf_counter() - t0
        log.info("loaded bounded program %r from %s: %d programs (bounds %s), weights %.1f MiB, %.1f s", m.name,
                 self.artifact_dir, len(m.programs),
                 ", ".join(f"{b.name} {list(b.buckets)}" for b in m.bounds), self.weight_bytes / 2**20,
                 self.load_seconds)

    @classmethod
    def load(cls, artifact_dir: str | Path, plugin: str | None = None, **kwargs) -> "BoundedProgram":
        return cls(artifact_dir, plugin, **kwargs)

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.manifest.weights)

    def _check_device(self) -> None:
        m = self.manifest
        want = {"cpu": ("cpu",), "cuda": ("cuda", "gpu")}[m.versions.platform]
        if self.device.platform_name.lower() not in want:
            raise af.ManifestError(f"artifact was exported for {m.versions.platform}, the plugin "
                                   f"{self.device.plugin_path} is {self.device.platform_name}")
        free = self.device.memory_available()
        if free is not None and self.weight_bytes > free:
            raise af.ManifestError(f"the program's weights need {self.weight_bytes / 2**20:.1f} MiB on the device, "
                                   f"and {self.device.platform_name} has {free / 2**20:.1f} MiB free")

    # -- calls -----------------------------------------------------------------------------------

    def check(self, call: Mapping[str, Any]) -> _Call:
        """A call's inputs in the program's dtypes and its size along each bound, or CallRefused naming the fault."""
        m = self.manifest
        if not isinstance(call, Mapping):
            raise CallRefused(f"a call is a dict {{input name: array}} of {[s.name for s in m.inputs]}")
        unknown = sorted(set(call) - {s.name for s in m.inputs})
        missing = [s.name for s in m.inputs if s.name not in call]
        if unknown or missing:
            raise CallRefused(f"the program takes inputs {[s.name for s in m.inputs]}; the call "
                              f"{'lacks ' + str(missing) if missing else 'has unknown ' + str(unknown)}")
        inputs, sizes, seen = {}, {}, {}
        for spec in m.inputs:
            arr = _as_dtype(spec.name, call[spec.name], af.numpy_dtype(spec.dtype))
            if arr.ndim != len(spec.shape):
                raise CallRefused(f"input {spec.name!r} has {arr.ndim} axes, the program takes {len(spec.shape)} "
                                  f"({_axes(spec)})")
            for axis, (d, bound) in enumerate(zip(arr.shape, spec.axes)):
                where = f"input {spec.name!r} axis {axis}"
                if not bound:
                    if d != spec.shape[axis]:
                        raise CallRefused(f"{where} is {d}, the program takes {spec.shape[axis]}")
                    continue
                b = m.bound(bound)
                if not 1 <= d <= b.max:
                    raise CallRefused(f"{where} (bound {bound!r}) is {d}; it takes 1 to {b.max}")
                if bound in sizes and sizes[bound] != d:
                    raise CallRefused(f"{where} is {d}, but {seen[bound]} is {sizes[bound]}: both are bound "
                                      f"{bound!r}")
                sizes[bound], seen[bound] = d, where
            inputs[spec.name] = np.ascontiguousarray(arr)
        return _Call(inputs, sizes)

    def run(self, call: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """One call: {input name: array} -> {output name: array}, each bounded axis at the call's size."""
        return self.run_many([call])[0]

    def run_many(self, calls: Sequence[Mapping[str, Any]]) -> list[dict[str, np.ndarray]]:
        """Several calls, batched into shared bodies where the program has a batch bound; one result per call, in
        order. Every call is checked before anything runs."""
        checked = [self.check(c) for c in calls]
        results: list[dict[str, np.ndarray] | None] = [None] * len(checked)
        for group in self._groups(checked):
            for i, out in zip(group, self._execute([checked[i] for i in group])):
                results[i] = out
        return results   # type: ignore[return-value]

    def _groups(self, calls: list[_Call]) -> list[list[int]]:
        if self._batch is None:
            return [[i] for i in range(len(calls))]
        rows_bound = self._batch.name
        order = sorted(range(len(calls)), key=lambda i: [calls[i].sizes[b.name] for b in self.manifest.bounds
                                                         if b.name != rows_bound])
        groups, rows = [], 0
        for i in order:
            k = calls[i].sizes[rows_bound]
            if not groups or rows + k > self._batch.max:
                groups.append([])
                rows = 0
            groups[-1].append(i)
            rows += k
        return groups

    def _execute(self, calls: list[_Call]) -> list[dict[str, np.ndarray]]:
        """Run calls that share one body: pad, fill the valid inputs, execute, slice each call's outputs."""
        m, batch = self.manifest, self._batch
        need = {b.name: max(c.sizes[b.name] for c in calls) for b in m.bounds}
        if batch is not None:
            need[batch.name] = sum(c.sizes[batch.name] for c in calls)
        bucket = {b.name: next(s for s in b.buckets if s >= need[b.name]) for b in m.bounds}
        sizes = tuple(bucket[b.name] for b in m.bounds)
        program, exe = self._programs[sizes], self.executables[sizes]

        offsets = list(itertools.accumulate((c.sizes[batch.name] for c in calls), initial=0)) if batch else [0]
        host = []
        for spec in m.inputs:
            arr = np.zeros(bm.shape_at(spec, bucket), af.numpy_dtype(spec.dtype))
            for c, start in zip(calls, offsets):
                arr[_region(spec, c.sizes, batch, start)] = c.inputs[spec.name]
            host.append(arr)
        host += valid_inputs(m.bounds, bucket, calls)
        args = [self.device.upload(a) for a in host]
        try:
            outs = self.device.execute(exe, [*args, *self.weights])
        finally:
            for a in args:
                a.close()
        try:
            values = [self.device.to_host(o) for o in outs]
        finally:
            for o in outs:
                o.close()
        self.executions[program.name] = self.executions.get(program.name, 0) + 1
        return [{spec.name: np.array(v[_region(spec, c.sizes, batch, start)])
                 for spec, v in zip(m.outputs, values)} for c, start in zip(calls, offsets)]

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the executables and weights (and the device, when this program opened it). Idempotent."""
        for obj in [*self.executables.values(), *self.weights]:
            obj.close()
        self.executables, self.weights = {}, []
        if self._owns_device:
            self.device.close()

    def __enter__(self) -> "BoundedProgram":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _axes(spec: bm.TensorSpec) -> str:
    return ", ".join(a or str(d) for d, a in zip(spec.shape, spec.axes))


def _region(spec: bm.TensorSpec, sizes: Mapping[str, int], batch: bm.BoundSpec | None, start: int) -> tuple:
    """Where one call lies in a padded tensor: its rows from `start` along the batch axis, its sizes along the
    others."""
    return tuple(slice(start, start + sizes[a]) if batch is not None and a == batch.name else
                 slice(0, sizes[a]) if a else slice(None) for a in spec.axes)
