"""A body's @main, read from its portable StableHLO bytecode (the `.mlirbc` the runtime compiles), and how it
differs from the signature a manifest gives it."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ManifestError
from .mlirbc import Bytecode, Cursor, TableEntry, read_bytecode
from .records import Partition, TensorSig
from .vocabulary import MLIR_DTYPES

# The codes of the attributes and types @main's signature uses: VHLO's (stablehlo/dialect/VhloBytecode.cpp) and
# the builtin dialect's (mlir/IR/BuiltinDialectBytecode.td), which hold the module's attributes.
_V_ARRAY, _V_DICT, _V_INTEGER, _V_STRING, _V_TYPE = 1, 6, 9, 14, 17
_V_FUNCTION, _V_TENSOR, _V_TENSOR_ENCODED = 8, 20, 21
_V_ELEMENTS = {0: "i1", 2: "bf16", 3: "f16", 4: "f32", 5: "f64", 6: "f8E4M3FN", 7: "f8E5M2", 31: "i2", 10: "i4",
               11: "i8", 12: "i16", 13: "i32", 14: "i64", 32: "ui2", 15: "ui4", 16: "ui8", 17: "ui16", 18: "ui32",
               19: "ui64"}
_V_INDEX = 9
_B_DICT, _B_STRING, _B_INTEGER, _B_INTEGER_TYPE = 1, 2, 8, 0
_MAX_TYPE_DEPTH = 4
# vhlo.func_v1's properties, in the order its bytecode writes them (sorted by name).
_FUNC_PROPERTIES = ("arg_attrs", "function_type", "res_attrs", "sym_name", "sym_visibility")
# Shardy's (shardy/dialect/sdy/ir/bytecode.td): a tensor's sharding (three versions, each opening with its mesh and
# its dimensions' shardings), a dimension's (its axes), an axis reference (its name).
_SDY_TENSOR, _SDY_DIMENSION, _SDY_AXIS = (6, 15, 17), 5, 4


@dataclass(frozen=True)
class MainSignature:
    """@main of a body: each argument's (dtype, shape, aliased output or None), each result's (dtype, shape); the
    devices it is partitioned for, and each argument's and result's partition (() when whole on each)."""

    args: tuple[tuple[str, tuple[int, ...], int | None], ...]
    results: tuple[tuple[str, tuple[int, ...]], ...]
    partitions: int = 1
    arg_partitions: tuple[Partition, ...] = ()
    result_partitions: tuple[Partition, ...] = ()


class _Opaque:
    """An attribute or type of a kind @main's signature does not use."""


@dataclass(frozen=True)
class _Function:
    inputs: tuple
    results: tuple


@dataclass(frozen=True)
class _Sharding:
    """A Shardy tensor sharding: per dimension, the mesh axes it is split along."""

    dims: tuple[tuple[str, ...], ...]


class _Tables:
    """The entries of a body's attribute and type tables, decoded on demand into Python values: strings, ints,
    lists, dicts, (dtype, shape) for a tensor type, an element type's StableHLO name, a _Function, a _Sharding."""

    def __init__(self, bc: Bytecode, what: str):
        self.bc, self.what = bc, what
        self._attrs: dict[int, object] = {}
        self._busy: set[int] = set()

    def string(self, index: int) -> str:
        if index >= len(self.bc.strings):
            raise ManifestError(f"{self.what} refers to string {index} of {len(self.bc.strings)}: not the MLIR "
                                "bytecode jax.export writes")
        return self.bc.strings[index]

    def _entry(self, table: tuple[TableEntry, ...], index: int, kind: str) -> tuple[Cursor, str]:
        if index >= len(table):
            raise ManifestError(f"{self.what} refers to {kind} {index} of {len(table)}: not the MLIR bytecode "
                                "jax.export writes")
        entry = table[index]
        return Cursor(entry.data if entry.custom else b"", self.what), entry.dialect

    def attr(self, index: int):
        """Attribute `index`, decoded once (one that holds itself is refused)."""
        if index not in self._attrs:
            if index in self._busy:
                raise ManifestError(f"{self.what} has an attribute that holds itself: not the MLIR bytecode "
                                    "jax.export writes")
            self._busy.add(index)
            self._attrs[index] = self._decode_attr(index)
            self._busy.discard(index)
        return self._attrs[index]

    def _decode_attr(self, index: int):
        c, dialect = self._entry(self.bc.attrs, index, "attribute")
        if c.done:
            return _Opaque()
        code = c.varint()
        if dialect == "vhlo":
            if code == _V_STRING:
                return self.string(c.varint())
            if code == _V_ARRAY:
                return [self.attr(c.varint()) for _ in range(c.varint())]
            if code == _V_DICT:
                return {self.attr(k): self.attr(v) for k, v in ((c.varint(), c.varint()) for _ in range(c.varint()))}
            if code == _V_INTEGER:
                return self._integer(c, self.type(c.varint()))
            if code == _V_TYPE:
                return self.type(c.varint())
        elif dialect == "builtin":
            if code == _B_STRING:
                return self.string(c.varint())
            if code == _B_DICT:
                return {self.attr(k): self.attr(v) for k, v in ((c.varint(), c.varint()) for _ in range(c.varint()))}
            if code == _B_INTEGER:
                return self._integer(c, self.type(c.varint()))
        elif dialect == "sdy":
            if code in _SDY_TENSOR:
                c.varint()                          # the mesh
                dims = [self.attr(c.varint()) for _ in range(c.varint())]
                return _Sharding(tuple(tuple(str(a) for a in d) if isinstance(d, list) else () for d in dims))
            if code == _SDY_DIMENSION:
                return [self.attr(c.varint()) for _ in range(c.varint())]
            if code == _SDY_AXIS:
                return self.string(c.varint())
        return _Opaque()

    def type(self, index: int, depth: int = 0):
        """Type `index`; a tensor's element type and a function's types are one level down, and no type of a
        signature nests deeper than a few (a deeper one, or one that holds itself, is refused)."""
        if depth > _MAX_TYPE_DEPTH:
            raise ManifestError(f"{self.what} has types nested deeper than any signature's: not the MLIR bytecode "
                                "jax.export writes")
        c, dialect = self._entry(self.bc.types, index, "type")
        if c.done:
            return _Opaque()
        code = c.varint()
        if dialect == "builtin":
            return f"i{c.varint() >> 2}" if code == _B_INTEGER_TYPE else _Opaque()
        if dialect != "vhlo":
            return _Opaque()
        if code in _V_ELEMENTS:
            return _V_ELEMENTS[code]
        if code == _V_INDEX:
            return "index"
        if code == _V_FUNCTION:
            return _Function(tuple(self.type(c.varint(), depth + 1) for _ in range(c.varint())),
                             tuple(self.type(c.varint(), depth + 1) for _ in range(c.varint())))
        if code in (_V_TENSOR, _V_TENSOR_ENCODED):
            if code == _V_TENSOR_ENCODED:
                c.varint()
            shape = tuple(c.svarint() for _ in range(c.varint()))
            element = self.type(c.varint(), depth + 1)
            if not isinstance(element, str):
                return _Opaque()
            return MLIR_DTYPES.get(element, element), shape if all(d >= 0 for d in shape) else (-1,)
        return _Opaque()

    @staticmethod
    def _integer(c: Cursor, dtype) -> int:
        """An integer of `dtype` as MLIR writes it: a byte up to 8 bits, else a signed varint."""
        bits = dtype.lstrip("ui") if isinstance(dtype, str) else ""
        return c.take(1)[0] if bits.isdigit() and int(bits) <= 8 else c.svarint()


def _main_properties(t: _Tables) -> dict:
    """@main's properties by name: the one vhlo.func_v1 named "main" (its properties: a name, a function type)."""
    found = []
    for blob in t.bc.properties:
        c = Cursor(blob, t.what)
        values = []
        while not c.done and len(values) <= len(_FUNC_PROPERTIES):
            values.append(c.varint())
        if len(values) != len(_FUNC_PROPERTIES) or not all(v < len(t.bc.attrs) for v in values):
            continue
        props = dict(zip(_FUNC_PROPERTIES, values))
        if t.attr(props["sym_name"]) == "main" and t.attr(props["sym_visibility"]) == "public" and \
                isinstance(t.attr(props["function_type"]), _Function):
            found.append({k: t.attr(v) for k, v in props.items()})
    if len(found) != 1:
        raise ManifestError(f"{t.what} has {'no' if not found else len(found)} public @main")
    return found[0]


def _partition(attrs) -> Partition:
    """An argument's or result's partition from its Shardy sharding (a dimension split along several axes reads as
    the names joined by ",", which no manifest names)."""
    sharding = attrs.get("sdy.sharding") if isinstance(attrs, dict) else None
    if not isinstance(sharding, _Sharding):
        return ()
    dims = tuple(",".join(str(a) for a in axes) or None for axes in sharding.dims)
    return dims if any(dims) else ()


def whole_or_split(partition: Partition) -> Partition:
    """A partition with whole arrays read alike: () and all None are both ()."""
    return tuple(partition) if any(partition) else ()


def _tensor(t, what: str) -> tuple[str, tuple[int, ...]]:
    if not (isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], str)):
        raise ManifestError(f"{what} is not a ranked tensor")
    return t


def _num_partitions(t: _Tables) -> int:
    """The module's mhlo.num_partitions (1 when absent)."""
    for i, entry in enumerate(t.bc.attrs):
        if entry.custom and entry.data[:1] in (bytes([_B_DICT << 1 | 1]), bytes([_V_DICT << 1 | 1])):
            d = t.attr(i)
            if isinstance(d, dict) and isinstance(d.get("mhlo.num_partitions"), int):
                return d["mhlo.num_partitions"]
    return 1


def main_signature(bytecode: bytes, what: str = "body") -> MainSignature:
    """@main of a portable StableHLO body (what jax.export's `mlir_module_serialized` holds)."""
    t = _Tables(read_bytecode(bytecode, what), what)
    main = _main_properties(t)
    inputs, results = main["function_type"].inputs, main["function_type"].results
    arg_attrs, res_attrs = main["arg_attrs"], main["res_attrs"]
    arg_attrs = arg_attrs if isinstance(arg_attrs, list) and len(arg_attrs) == len(inputs) else [{}] * len(inputs)
    res_attrs = res_attrs if isinstance(res_attrs, list) and len(res_attrs) == len(results) else [{}] * len(results)
    args = []
    for i, (ty, attrs) in enumerate(zip(inputs, arg_attrs)):
        alias = attrs.get("tf.aliasing_output") if isinstance(attrs, dict) else None
        args.append((*_tensor(ty, f"{what} @main argument {i}"), alias if isinstance(alias, int) else None))
    return MainSignature(tuple(args), tuple(_tensor(ty, f"{what} @main result {i}") for i, ty in enumerate(results)),
                         _num_partitions(t), tuple(_partition(a) for a in arg_attrs),
                         tuple(_partition(a) for a in res_attrs))


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
