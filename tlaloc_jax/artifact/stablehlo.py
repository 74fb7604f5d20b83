"""A body's @main, read from textual StableHLO, and how it differs from the signature a manifest gives it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ManifestError
from .records import TensorSig
from .vocabulary import MLIR_DTYPES

_MAIN = re.compile(r"func\.func public @main\((.*?)\)\s*->\s*\((.*?)\)\s*\{", re.S)
_ARG = re.compile(r"%arg\d+: tensor<([^>]*)>(\s*\{[^}]*\})?")
_ALIAS = re.compile(r"tf\.aliasing_output = (\d+)")


@dataclass(frozen=True)
class MainSignature:
    """@main of a body: each argument's (dtype, shape, aliased output or None), each result's (dtype, shape)."""

    args: tuple[tuple[str, tuple[int, ...], int | None], ...]
    results: tuple[tuple[str, tuple[int, ...]], ...]


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
    args = []
    for tensor, attrs in _ARG.findall(m.group(1)):
        alias = _ALIAS.search(attrs or "")
        args.append((*_parse_tensor(tensor), int(alias.group(1)) if alias else None))
    results = tuple(_parse_tensor(r) for r in re.findall(r"tensor<([^>]*)>", m.group(2)))
    return MainSignature(tuple(args), results)


def signature_mismatch(inputs: tuple[TensorSig, ...], outputs: tuple[TensorSig, ...],
                       donations: tuple[tuple[int, int], ...], sig: MainSignature) -> str | None:
    """Why a body's @main does not take and return `inputs` and `outputs` with the pools aliased as `donations`
    say (None when it does)."""
    if len(sig.args) != len(inputs):
        return f"its @main takes {len(sig.args)} arguments, the manifest lists {len(inputs)} inputs"
    aliases = {i: o for o, i in donations}
    for i, ((dtype, shape, alias), want) in enumerate(zip(sig.args, inputs)):
        if (dtype, shape) != (want.dtype, tuple(want.shape)):
            return (f"argument {i} ({want.label}) is {dtype}{list(shape)} in the body, the manifest says "
                    f"{want.dtype}{list(want.shape)}")
        if alias != aliases.get(i):
            return f"argument {i} ({want.label}) is aliased to output {alias} in the body, the manifest says " \
                   f"{aliases.get(i)}"
    if len(sig.results) != len(outputs):
        return f"its @main returns {len(sig.results)} results, the manifest lists {len(outputs)} outputs"
    for i, ((dtype, shape), want) in enumerate(zip(sig.results, outputs)):
        if (dtype, shape) != (want.dtype, tuple(want.shape)):
            return (f"result {i} ({want.label}) is {dtype}{list(shape)} in the body, the manifest says "
                    f"{want.dtype}{list(want.shape)}")
    return None
