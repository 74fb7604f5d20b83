"""MLIR bytecode, the container of a portable StableHLO body (`.mlirbc`), read far enough to reach its attributes:
the string table, the dialects, the attribute and type tables (each entry's raw encoding) and the op properties.
Standard library only; stablehlo.py decodes the few entries a body's @main needs."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ManifestError

MAGIC = b"ML\xefR"
# Section ids of the container (mlir/Bytecode/Encoding.h).
_STRING, _DIALECT, _ATTR_TYPE, _ATTR_TYPE_OFFSET, _PROPERTIES = 0, 1, 2, 3, 8
_DIALECT_VERSIONING = 1            # the first version whose dialect entries may carry a version
_NATIVE_PROPERTIES = 5             # the first version with a properties section and flagged op names


class Cursor:
    """Reads MLIR's integer encodings from `data`; running past its end is refused as a ManifestError."""

    def __init__(self, data: bytes, what: str):
        self.data, self.pos, self.what = data, 0, what

    @property
    def done(self) -> bool:
        return self.pos >= len(self.data)

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ManifestError(f"{self.what} is cut short: not the MLIR bytecode jax.export writes")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def varint(self) -> int:
        """A prefix varint: the first byte's trailing zeros count the bytes that follow it."""
        first = self.take(1)[0]
        if first & 1:
            return first >> 1
        if first == 0:
            return int.from_bytes(self.take(8), "little")
        n = (first & -first).bit_length()
        return int.from_bytes(bytes([first]) + self.take(n - 1), "little") >> n

    def svarint(self) -> int:
        """A zigzag-encoded signed varint."""
        v = self.varint()
        return (v >> 1) ^ -(v & 1)

    def cstring(self) -> bytes:
        end = self.data.find(b"\0", self.pos)
        if end < 0:
            raise ManifestError(f"{self.what} has an unterminated string: not the MLIR bytecode jax.export writes")
        out = self.data[self.pos:end]
        self.pos = end + 1
        return out


@dataclass(frozen=True)
class TableEntry:
    """An attribute or type: its dialect and its encoding (the dialect's own when custom, else its textual form)."""

    dialect: str
    custom: bool
    data: bytes


@dataclass(frozen=True)
class Bytecode:
    version: int
    producer: str
    strings: tuple[str, ...]
    attrs: tuple[TableEntry, ...]
    types: tuple[TableEntry, ...]
    properties: tuple[bytes, ...]   # each op's properties, as its dialect encodes them


def read_bytecode(data: bytes, what: str) -> Bytecode:
    """The tables of MLIR bytecode `data` (`what` names it in errors)."""
    if not data.startswith(MAGIC):
        raise ManifestError(f"{what} is not MLIR bytecode (it does not start with {MAGIC!r})")
    top = Cursor(data, what)
    top.take(len(MAGIC))
    version = top.varint()
    producer = top.cstring().decode("utf-8", "replace")
    sections = {}
    while not top.done:
        sid, body = _section(top)
        sections[sid] = body
    missing = [n for s, n in ((_STRING, "string"), (_DIALECT, "dialect"), (_ATTR_TYPE, "attribute"),
                              (_ATTR_TYPE_OFFSET, "attribute offset")) if s not in sections]
    if missing:
        raise ManifestError(f"{what} lacks the {', '.join(missing)} section of MLIR bytecode")
    strings = _strings(Cursor(sections[_STRING], what))
    dialects = _dialects(Cursor(sections[_DIALECT], what), strings, version)
    attrs, types = _tables(Cursor(sections[_ATTR_TYPE_OFFSET], what), sections[_ATTR_TYPE], dialects)
    props = _properties(Cursor(sections[_PROPERTIES], what)) if _PROPERTIES in sections else ()
    return Bytecode(version, producer, strings, attrs, types, props)


def _section(c: Cursor) -> tuple[int, bytes]:
    """One section: an id byte (its high bit: aligned), its length, and its bytes (after padding when aligned)."""
    head = c.take(1)[0]
    length = c.varint()
    if head & 0x80:
        align = c.varint()
        if align < 1 or align & (align - 1):
            raise ManifestError(f"{c.what} has a section aligned to {align}: not the MLIR bytecode jax.export writes")
        c.take(-c.pos % align)
    return head & 0x7F, c.take(length)


def _strings(c: Cursor) -> tuple[str, ...]:
    """The string table: a count, each string's size (last string first), then the strings, each NUL-terminated."""
    sizes = [c.varint() for _ in range(c.varint())][::-1]
    out = []
    for size in sizes:
        out.append(c.take(size)[:-1].decode("utf-8", "replace"))
    return tuple(out)


def _string(strings: tuple[str, ...], index: int, what: str) -> str:
    if index >= len(strings):
        raise ManifestError(f"{what} names string {index} of {len(strings)}: not the MLIR bytecode jax.export writes")
    return strings[index]


def _dialects(c: Cursor, strings: tuple[str, ...], version: int) -> tuple[str, ...]:
    """The dialects' names, in table order (the op names that follow them are not needed)."""
    out = []
    for _ in range(c.varint()):
        if version < _DIALECT_VERSIONING:
            out.append(_string(strings, c.varint(), c.what))
            continue
        entry = c.varint()
        out.append(_string(strings, entry >> 1, c.what))
        if entry & 1:
            _section(c)                     # the dialect's version
    return tuple(out)


def _tables(offsets: Cursor, data: bytes, dialects: tuple[str, ...]
            ) -> tuple[tuple[TableEntry, ...], tuple[TableEntry, ...]]:
    """The attribute and type tables: per dialect group, each entry's size and whether its dialect encodes it."""
    counts = offsets.varint(), offsets.varint()
    at = 0
    tables = []
    for count in counts:
        entries = []
        while len(entries) < count:
            dialect = offsets.varint()
            if dialect >= len(dialects):
                raise ManifestError(f"{offsets.what} names dialect {dialect} of {len(dialects)}")
            for _ in range(offsets.varint()):
                size = offsets.varint()
                if at + (size >> 1) > len(data):
                    raise ManifestError(f"{offsets.what} has attributes past the end of their section")
                entries.append(TableEntry(dialects[dialect], bool(size & 1), data[at:at + (size >> 1)]))
                at += size >> 1
        tables.append(tuple(entries[:count]))
    return tables[0], tables[1]


def _properties(c: Cursor) -> tuple[bytes, ...]:
    return tuple(c.take(c.varint()) for _ in range(c.varint()))
