"""The records both schemas hold: a body's argument or result, the weight and tokenizer files, what produced
the bodies; and the checks of those records that need no file."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ManifestError
from .vocabulary import (GROUPED_SCHEMES, PLATFORMS, QUANT_CODE_DTYPES, QUANT_GROUPS, QUANT_PART_DTYPES, QUANT_PARTS,
                         QuantPart, QuantScheme, Role, nbytes)


# A partition (tlaloc-serving-v4 + mesh): per dimension of an array, the mesh axis it is split along, or None.
Partition = tuple[str | None, ...]


@dataclass(frozen=True)
class TensorSig:
    """One argument or result of a body. `slot` names the weight for role WEIGHT, the pool for the pool roles, the
    author's input or output, or the bound, in a bounded program. `partition` (a body of several devices): how it
    is split over them; () whole on each."""

    role: Role
    dtype: str
    shape: tuple[int, ...]
    slot: str = ""
    partition: Partition = ()

    @property
    def label(self) -> str:
        return f"{self.role}{' ' + self.slot if self.slot else ''}"


@dataclass(frozen=True)
class WeightQuant:
    """A weight file that is one part of a quantized weight: its codes, its scales, or (uint4) its zero points.
    `weight` names the quantized weight (the parts' slots are `weight`.codes, `weight`.scales, `weight`.zeros)."""

    scheme: QuantScheme
    part: QuantPart
    weight: str
    group: int = 0                 # int4, uint4: input channels per scale; 0 otherwise
    out_major: bool = False        # codes [..., O, I] (int4 [..., O, I / 2], scales and zeros [..., O, I / group])


@dataclass(frozen=True)
class WeightShard:
    """One device's part of a split weight: its block along the split dimension, raw like a weight file."""

    file: str
    nbytes: int
    sha256: str = ""


@dataclass(frozen=True)
class WeightFile:
    slot: str
    dtype: str
    shape: tuple[int, ...]         # the whole weight's
    nbytes: int
    file: str = ""                 # weights/NNNN_<slot>.bin, raw little-endian, no header ("" for a split weight)
    sha256: str = ""               # every schema but tlaloc-serving-v2/v3 hashes it
    quant: WeightQuant | None = None   # optional: part of a quantized weight (None: a plain one)
    partition: Partition = ()      # split over a mesh's devices: in `shards`, one file per device, in order
    shards: tuple[WeightShard, ...] = ()


@dataclass(frozen=True)
class TokenizerFile:
    file: str
    sha256: str = ""               # "" in tlaloc-serving-v2/v3 artifacts


@dataclass(frozen=True)
class Versions:
    """What produced the bodies; a runtime checks them against its plugin."""

    jax: str
    jaxlib: str
    calling_convention: int
    platform: str
    attention_block: int = 0
    # The native kernels (tlaloc_jax.native) the bodies call as custom calls: a runtime builds and registers each
    # before it compiles a body, and refuses the artifact by the kernel's name if it cannot.
    custom_calls: tuple[str, ...] = ()


def check_platform(versions: Versions) -> None:
    if versions.platform not in PLATFORMS:
        raise ManifestError(f"versions.platform {versions.platform!r} is not served ({', '.join(PLATFORMS)})")


def check_weight_table(weights: tuple[WeightFile, ...], hashed_by: str | None) -> dict[str, WeightFile]:
    """Each weight's size agrees with its dtype and shape, its slot is unique, and (hashed_by: the schema that
    hashes every file) it has a sha256; each quantized weight is whole. -> {slot: weight}."""
    slots: dict[str, WeightFile] = {}
    for w in weights:
        if w.nbytes != nbytes(w.dtype, w.shape, f"weight {w.slot!r}"):
            raise ManifestError(f"weight {w.slot!r}: nbytes {w.nbytes} does not match dtype {w.dtype} "
                                f"and shape {list(w.shape)}")
        if w.slot in slots:
            raise ManifestError(f"weight {w.slot!r} is listed twice")
        for file, digest in [(s.file, s.sha256) for s in w.shards] or [(w.file, w.sha256)]:
            if hashed_by and not digest:
                raise ManifestError(f"weight {w.slot!r} file {file!r} has no sha256 ({hashed_by} hashes every file)")
        slots[w.slot] = w
    _check_quant(weights)
    return slots


def check_tokenizer_hashes(files: tuple[TokenizerFile, ...], hashed_by: str) -> None:
    for t in files:
        if not t.sha256:
            raise ManifestError(f"tokenizer file {t.file!r} has no sha256 ({hashed_by} hashes every file)")


def _check_quant(weights: tuple[WeightFile, ...]) -> None:
    """Each quantized weight has its codes in its scheme's dtype, its f32 scales and (uint4) its int8 zero points,
    of matching shapes, and no part its scheme lacks."""
    parts: dict[str, dict[QuantPart, WeightFile]] = {}
    for w in weights:
        q = w.quant
        if q is None:
            continue
        what = f"weight {w.slot!r} ({q.scheme} {q.part} of {q.weight!r})"
        if w.slot != f"{q.weight}.{q.part}":
            raise ManifestError(f"{what}: its slot should be {q.weight}.{q.part}")
        if (q.group in QUANT_GROUPS) != (q.scheme in GROUPED_SCHEMES):
            raise ManifestError(f"{what}: group {q.group} is not " + (f"one of {QUANT_GROUPS}" if q.scheme in
                                GROUPED_SCHEMES else "0 (only int4 and uint4 have groups)"))
        if q.part not in QUANT_PARTS[q.scheme]:
            raise ManifestError(f"{what}: {q.scheme} weights have no {q.part} (they have "
                                f"{', '.join(QUANT_PARTS[q.scheme])})")
        want = QUANT_CODE_DTYPES[q.scheme] if q.part == QuantPart.CODES else QUANT_PART_DTYPES[q.part]
        if w.dtype != want:
            raise ManifestError(f"{what} has dtype {w.dtype}; {q.scheme} {q.part} are {want}")
        if len(w.shape) < (2 if q.part == QuantPart.CODES else 1):
            raise ManifestError(f"{what} has shape {list(w.shape)}, too few axes")
        seen = parts.setdefault(q.weight, {})
        if q.part in seen or (seen and next(iter(seen.values())).quant.scheme != q.scheme):
            raise ManifestError(f"{what}: the quantized weight has two {q.part} or two schemes")
        seen[q.part] = w
    for name, seen in parts.items():
        scheme = next(iter(seen.values())).quant.scheme
        if set(seen) != set(QUANT_PARTS[scheme]):
            missing = next(p for p in QUANT_PARTS[scheme] if p not in seen)
            raise ManifestError(f"quantized weight {name!r} has no {missing} file")
        codes, q = seen[QuantPart.CODES], seen[QuantPart.CODES].quant
        grouped = q.scheme in GROUPED_SCHEMES
        *lead, rows, cols = codes.shape
        if q.out_major:         # [..., O, I]: the per-layer layout's
            want = (*lead, rows, cols * 2 // q.group) if grouped else (*lead, rows)
            inputs = cols * 2
        else:
            want = (*lead, rows * 2 // q.group, cols) if grouped else (*lead, cols)
            inputs = rows * 2
        if grouped and inputs % q.group:
            raise ManifestError(f"quantized weight {name!r}: {q.scheme} groups of {q.group} do not tile {inputs} "
                                "inputs")
        for part in QUANT_PARTS[scheme][1:]:
            if tuple(seen[part].shape) != tuple(want):
                raise ManifestError(f"quantized weight {name!r}: codes {list(codes.shape)} need {part} "
                                    f"{list(want)}, got {list(seen[part].shape)}")
