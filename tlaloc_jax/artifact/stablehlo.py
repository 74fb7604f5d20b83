"""A body's @main, read from textual StableHLO, and how it differs from the signature a manifest gives it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ManifestError
from .records import Partition, TensorSig
from .vocabulary import MLIR_DTYPES

_MAIN = re.compile(r"func\.func public @main\((.*?)\)\s*->\s*\((.*?)\)\s*\{", re.S)
# An argument's or result's attributes may hold braces one level deep (a mesh body's sdy.sharding: [{}, {"tp"}]).
_ARG = re.compile(r"%arg\d+: tensor<([^>]*)>(\s*\{(?:[^{}]|\{[^{}]*\})*\})?")
_RESULT = re.compile(r"tensor<([^>]*)>(\s*\{(?:[^{}]|\{[^{}]*\})*\})?")
_ALIAS = re.compile(r"tf\.aliasing_output = (\d+)")
# A Shardy sharding (what jax.export writes for a mesh body): per dimension {} or {"axis"}.
_SDY = re.compile(r"sdy\.sharding = #sdy\.sharding<@\w+, \[([^\[\]]*)\]")
_PARTITIONS = re.compile(r"mhlo\.num_partitions = (\d+)")


@dataclass(frozen=True)
class MainSignature:
    """@main of a body: each argument's (dtype, shape, aliased output or None), each result's (dtype, shape); the
    devices it is partitioned for, and each argument's and result's partition (() when whole on each)."""

    args: tuple[tuple[str, tuple[int, ...], int | None], ...]
    results: tuple[tuple[str, tuple[int, ...]], ...]
    partitions: int = 1
    arg_partitions: tuple[Partition, ...] = ()
    result_partitions: tuple[Partition, ...] = ()


def _partition(attrs: str) -> Partition:
    """An argument's or result's partition from its attributes (a dimension split along several axes reads as the
    names joined by ",", which no manifest names)."""
    m = _SDY.search(attrs or "")
    if not m:
        return ()
    dims = tuple(",".join(re.findall(r'"([^"]+)"', d)) or None for d in re.findall(r"\{([^{}]*)\}", m.group(1)))
    return dims if any(dims) else ()


def whole_or_split(partition: Partition) -> Partition:
    """A partition with whole arrays read alike: () and all None are both ()."""
    return tuple(partition) if any(partition) else ()


def _parse_tensor(t: str) -> tuple[str, tuple[int, ...]]:
    parts = t.split("x")
    try:
        shape = tuple(int(p) for p in parts[:-1])
    except ValueError:
        shape = (-1,)                       # a dynamic dimension: never equals a manifest shape
    return MLIR_DTYPES.get(parts[-1], parts[-1]), shape


def main_signature(mlir_text: str, what: str = "body") -> MainSignature:
    m = _MAIN.search(mlir_text)
    if not m:
        raise ManifestError(f"{what} has no public @main")
    args, arg_parts = [], []
    for tensor, attrs in _ARG.findall(m.group(1)):
        alias = _ALIAS.search(attrs or "")
        args.append((*_parse_tensor(tensor), int(alias.group(1)) if alias else None))
        arg_parts.append(_partition(attrs))
    found = _RESULT.findall(m.group(2))
    partitions = _PARTITIONS.search(mlir_text[:m.start()])
    return MainSignature(tuple(args), tuple(_parse_tensor(r) for r, _ in found),
                         int(partitions.group(1)) if partitions else 1, tuple(arg_parts),
                         tuple(_partition(a) for _, a in found))


def signature_mismatch(inputs: tuple[TensorSig, ...], outputs: tuple[TensorSig, ...],
                       donations: tuple[tuple[int, int], ...], sig: MainSignature, devices: int = 1) -> str | None:
    """Why a body's @main does not take and return `inputs` and `outputs` with the pools aliased as `donations`
    say, partitioned for `devices` devices and each split as its partition says (None when it does)."""
    if len(sig.args) != len(inputs):
        return f"its @main takes {len(sig.args)} arguments, the manifest lists {len(inputs)} inputs"
    if sig.partitions != devices:
        return f"it is partitioned for {sig.partitions} devices, the manifest's mesh has {devices}"
    aliases = {i: o for o, i in donations}
    for i, ((dtype, shape, alias), want) in enumerate(zip(sig.args, inputs)):
        if (dtype, shape) != (want.dtype, tuple(want.shape)):
            return (f"argument {i} ({want.label}) is {dtype}{list(shape)} in the body, the manifest says "
                    f"{want.dtype}{list(want.shape)}")
        if alias != aliases.get(i):
            return f"argument {i} ({want.label}) is aliased to output {alias} in the body, the manifest says " \
                   f"{aliases.get(i)}"
        if devices > 1 and whole_or_split(sig.arg_partitions[i]) != whole_or_split(want.partition):
            return (f"argument {i} ({want.label}) is split {list(sig.arg_partitions[i])} in the body, the manifest "
                    f"says {list(want.partition)}")
    if len(sig.results) != len(outputs):
        return f"its @main returns {len(sig.results)} results, the manifest lists {len(outputs)} outputs"
    for i, ((dtype, shape), want) in enumerate(zip(sig.results, outputs)):
        if (dtype, shape) != (want.dtype, tuple(want.shape)):
            return (f"result {i} ({want.label}) is {dtype}{list(shape)} in the body, the manifest says "
                    f"{want.dtype}{list(want.shape)}")
        if devices > 1 and whole_or_split(sig.result_partitions[i]) != whole_or_split(want.partition):
            return (f"result {i} ({want.label}) is split {list(sig.result_partitions[i])} in the body, the manifest "
                    f"says {list(want.partition)}")
    return None
