"""Bounded structural validation of a GGUF file, run before `gguf.GGUFReader` sees it.

Model files come from the internet, and the `gguf` package's reader trusts them: it slices by
claimed lengths, loops over claimed counts (a huge array count is a hang), lets element counts
wrap around in uint64 and raises assorted exception types. This module walks the same layout
(header, metadata key/values, tensor infos; see `gguf/gguf_reader.py`) with every length and
count checked against the bytes that remain *before* it is used, so nothing is allocated or
looped over in proportion to a claimed size. Any problem is one `GGUFError` whose one-line
message names the offset, key or tensor.

What it accepts is what GGUFReader then reads without surprises: magic, version 2 or 3
(little-endian), known value types, strings/arrays inside the file, bounded nesting, a
`general.alignment` that is a u32 power of two, tensor names that are unique UTF-8, at most
four dims, a known tensor type whose rows are whole blocks, element counts that fit int64,
data aligned, inside the file and not overlapping. Known keys (`general.architecture`,
`<arch>.block_count`, `tokenizer.ggml.tokens`, ...) must have the type llama.cpp reads them as.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ggufc.messages import GgufcError

GGUF_MAGIC = b"GGUF"


class GGUFError(GgufcError, ValueError):
    """A GGUF file that cannot be read: the message names the file and the problem in one line."""



SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
HEADER_BYTES = 24  # magic u32, version u32, tensor count u64, kv count u64
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value (u8/i8/bool)
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset (name and dims may be empty)
MAX_KV_COUNT = 1 << 16  # real models carry < 100 keys
MAX_TENSOR_COUNT = 1 << 16  # the largest MoE files carry a few thousand
# GGUFReader builds one numpy view per array element (~10 us each): bound the total so a
# hostile file cannot make it loop for minutes. The largest real vocabularies (256k tokens,
# with scores, types and merges) need about 1M.
MAX_ARRAY_ITEMS = 1 << 21
MAX_ARRAY_DEPTH = 3  # llama.cpp refuses nested arrays; gguf-py writes them, so a few levels pass
MAX_TENSOR_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSOR_NAME_BYTES = 63  # GGML_MAX_NAME - 1, which llama.cpp enforces
MAX_SHORT_STRING_BYTES = 1 << 10  # architecture names and the like
INT64_MAX = (1 << 63) - 1
RESERVED_KEYS = frozenset({"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"})  # the reader's own fields

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "B",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_SCALAR_STRUCTS = {t: struct.Struct("<" + f) for t, f in _SCALAR_FORMATS.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})
_INTEGER_TYPES = frozenset(_SCALAR_FORMATS) - _FLOAT_TYPES - {GGUFValueType.BOOL}
_NUMBER_TYPES = _INTEGER_TYPES | _FLOAT_TYPES

Scalar = int | float | bool


@dataclass(frozen=True)
class KeyRecord:
    name: str
    type: GGUFValueType
    offset: int  # where the key/value entry starts
    value: Scalar | None = None  # numbers and bools; None for strings and arrays
    string_span: tuple[int, int] | None = None  # (start, length) of a string value's bytes
    item_type: GGUFValueType | None = None  # arrays: the element type
    count: int = 1  # arrays: number of elements


@dataclass(frozen=True)
class TensorRecord:
    name: str
    qtype: GGMLQuantizationType
    ne: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    n_elements: int
    n_bytes: int
    offset: int  # relative to the data section
    info_offset: int  # where its tensor info starts in the file


@dataclass(frozen=True)
class GGUFLayout:
    version: int
    alignment: int
    data_offset: int
    file_size: int
    keys: dict[str, KeyRecord]
    tensors: list[TensorRecord]


# =========================================================================== entry points


def validate_gguf(path: str | os.PathLike[str]) -> GGUFLayout:
    """Check the structure of the GGUF file at `path` (memory-mapped, read-only)."""
    where = os.fspath(path)
    try:
        with open(where, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < HEADER_BYTES:  # mmap refuses empty files; report what is there instead
                return validate_gguf_bytes(fh.read(HEADER_BYTES), where)
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return validate_gguf_bytes(buf, where)
    except OSError as exc:
        raise GGUFError(f"{where}: cannot read ({exc.strerror or type(exc).__name__})") from None


Buffer = bytes | bytearray | memoryview | mmap.mmap


def validate_gguf_bytes(data: Buffer, where: str = "<bytes>") -> GGUFLayout:
    """Check the structure of a GGUF image held in memory (the fuzz tests' entry point)."""
    cursor = _Cursor(data, where)
    version = _read_header(cursor)
    kv_count = cursor.count("metadata key/value", _U64, MIN_KV_BYTES, MAX_KV_COUNT, at=16)
    tensor_count = cursor.count("tensor", _U64, MIN_TENSOR_INFO_BYTES, MAX_TENSOR_COUNT, at=8)
    cursor.pos = HEADER_BYTES
    keys = _read_metadata(cursor, kv_count)
    alignment = _alignment(cursor, keys)
    _check_known_keys(cursor, keys)
    cursor.require_room(tensor_count * MIN_TENSOR_INFO_BYTES, f"{tensor_count} tensor infos")
    tensors = _read_tensor_infos(cursor, tensor_count)
    data_offset = _align_up(cursor.pos, alignment)
    _check_tensor_data(cursor, tensors, data_offset, alignment)
    return GGUFLayout(version, alignment, data_offset, cursor.size, keys, tensors)


# =========================================================================== the cursor


class _Cursor:
    """Reads little-endian fields with a bounds check before every read."""

    def __init__(self, data: Buffer, where: str) -> None:
        self.data = data
        self.size = len(data)
        self.where = where
        self.pos = 0
        self.array_items = 0  # metadata array elements seen so far (bounded by MAX_ARRAY_ITEMS)

    def fail(self, problem: str, offset: int | None = None) -> NoReturn:
        at = self.pos if offset is None else offset
        raise GGUFError(f"{self.where}: malformed GGUF: {problem} (at offset {at})")

    def require_room(self, n_bytes: int, what: str) -> None:
        left = self.size - self.pos
        if n_bytes > left:
            self.fail(f"truncated: {n_bytes} bytes needed for {what}, {left} left")

    def unpack(self, fmt: struct.Struct, what: str) -> int | float:
        self.require_room(fmt.size, what)
        (value,) = fmt.unpack_from(self.data, self.pos)
        self.pos += fmt.size
        return value  # type: ignore[no-any-return]

    def u32(self, what: str) -> int:
        return int(self.unpack(_U32, what))

    def u64(self, what: str) -> int:
        return int(self.unpack(_U64, what))

    def count(self, what: str, fmt: struct.Struct, min_bytes: int, limit: int, *, at: int) -> int:
        """A claimed count, refused when absurd before anything is sized or looped from it."""
        self.pos = at
        n = int(self.unpack(fmt, f"the {what} count"))
        if n > limit:
            self.fail(f"claims {n} {what} entries (limit {limit})", at)
        if n * min_bytes > self.size - HEADER_BYTES:
            self.fail(f"claims {n} {what} entries, more than a {self.size}-byte file can hold", at)
        return n

    def string_span(self, what: str) -> tuple[int, int]:
        """(start, length) of a length-prefixed string, checked to lie inside the file."""
        length = self.u64(f"the length of {what}")
        self.require_room(length, what)
        start = self.pos
        self.pos += length
        return start, length

    def text(self, what: str) -> str:
        return self.check_utf8(self.string_span(what), what)

    def check_utf8(self, span: tuple[int, int], what: str) -> str:
        start, length = span
        try:
            return bytes(self.data[start : start + length]).decode("utf-8")
        except UnicodeDecodeError as exc:
            self.fail(f"{what} is not valid UTF-8", start + exc.start)

    def skip_strings(self, count: int, what: str) -> None:
        """Step over `count` length-prefixed strings (the vocabulary: keep this loop tight)."""
        data, size, pos, unpack = self.data, self.size, self.pos, _U64.unpack_from
        for index in range(count):
            if pos + 8 > size:
                self.fail(f"truncated: the length of {what} item {index} runs past the end", pos)
            end = pos + 8 + unpack(data, pos)[0]
            if end > size:
                self.fail(f"truncated: {what} item {index} runs past the end of the file", pos)
            pos = end
        self.pos = pos


# =========================================================================== header and metadata


def _read_header(cursor: _Cursor) -> int:
    magic = bytes(cursor.data[:4])
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{cursor.where}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    cursor.pos = 4
    version = cursor.u32("the version")
    if version & 0xFFFF == 0 and version:  # what GGUFReader takes for a byte-swapped file
        cursor.fail("big-endian GGUF (written for a big-endian host); ggufc reads little-endian files", 4)
    if version not in SUPPORTED_VERSIONS:
        cursor.fail(f"unsupported GGUF version {version} (supported: 2, 3)", 4)
    cursor.require_room(HEADER_BYTES - cursor.pos, "the tensor and key counts")
    return version


def _read_metadata(cursor: _Cursor, kv_count: int) -> dict[str, KeyRecord]:
    keys: dict[str, KeyRecord] = {}
    for index in range(kv_count):
        start = cursor.pos
        name = cursor.text(f"metadata key #{index}")
        if name in keys or name in RESERVED_KEYS:
            cursor.fail(f"duplicate metadata key {_show(name)}", start)
        keys[name] = _read_value(cursor, name, start)
    return keys


def _value_type(cursor: _Cursor, raw: int, key: str, offset: int) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        cursor.fail(f"key {_show(key)} has unknown value type {raw}", offset)


def _read_value(cursor: _Cursor, key: str, start: int) -> KeyRecord:
    type_at = cursor.pos
    vtype = _value_type(cursor, cursor.u32(f"the value type of key {_show(key)}"), key, type_at)
    if vtype == GGUFValueType.STRING:
        span = cursor.string_span(f"the string value of key {_show(key)}")
        cursor.check_utf8(span, f"the string value of key {_show(key)}")
        return KeyRecord(key, vtype, start, string_span=span)
    if vtype == GGUFValueType.ARRAY:
        item_type, count = _read_array(cursor, key, depth=1)
        return KeyRecord(key, vtype, start, item_type=item_type, count=count)
    value = cursor.unpack(_SCALAR_STRUCTS[vtype], f"the value of key {_show(key)}")
    return KeyRecord(key, vtype, start, value=bool(value) if vtype == GGUFValueType.BOOL else value)


def _read_array(cursor: _Cursor, key: str, depth: int) -> tuple[GGUFValueType, int]:
    """Step over one array value (its items included); returns (item type, item count)."""
    where = f"array of key {_show(key)}"
    type_at = cursor.pos
    item_type = _value_type(cursor, cursor.u32(f"the item type of the {where}"), key, type_at)
    count_at = cursor.pos
    count = cursor.u64(f"the item count of the {where}")
    cursor.array_items += count
    if cursor.array_items > MAX_ARRAY_ITEMS:
        limit = f"metadata arrays are limited to {MAX_ARRAY_ITEMS} items in all"
        cursor.fail(f"the {where} claims {count} items; {limit}", count_at)
    if item_type == GGUFValueType.STRING:
        cursor.require_room(count * 8, f"the {count} string lengths of the {where}")
        cursor.skip_strings(count, f"the {where}")
    elif item_type == GGUFValueType.ARRAY:
        if depth >= MAX_ARRAY_DEPTH:
            cursor.fail(f"the {where} nests arrays deeper than {MAX_ARRAY_DEPTH} levels", type_at)
        cursor.require_room(count * 12, f"the {count} nested arrays of the {where}")
        for _ in range(count):
            _read_array(cursor, key, depth + 1)
    else:
        cursor.require_room(count * _SCALAR_STRUCTS[item_type].size, f"the {count} items of the {where}")
        cursor.pos += count * _SCALAR_STRUCTS[item_type].size
    return item_type, count


def _alignment(cursor: _Cursor, keys: dict[str, KeyRecord]) -> int:
    record = keys.get("general.alignment")
    if record is None:
        return DEFAULT_ALIGNMENT
    if record.type != GGUFValueType.UINT32:
        cursor.fail(f"general.alignment must be a uint32, got {record.type.name}", record.offset)
    value = int(record.value or 0)
    if value <= 0 or value & (value - 1):
        cursor.fail(f"general.alignment must be a power of two, got {value}", record.offset)
    return value


# =========================================================================== known keys


def _is_integer(record: KeyRecord) -> bool:
    return record.type in _INTEGER_TYPES


def _is_number(record: KeyRecord) -> bool:
    return record.type in _NUMBER_TYPES


def _is_string(record: KeyRecord) -> bool:
    return record.type == GGUFValueType.STRING


def _is_bool(record: KeyRecord) -> bool:
    return record.type == GGUFValueType.BOOL


def _array_of(kinds: frozenset[GGUFValueType]) -> Callable[[KeyRecord], bool]:
    def check(record: KeyRecord) -> bool:
        return record.type == GGUFValueType.ARRAY and (record.count == 0 or record.item_type in kinds)

    return check


def _integer_or_per_layer(record: KeyRecord) -> bool:
    return _is_integer(record) or _array_of(_INTEGER_TYPES)(record)


_STRING_ARRAY = _array_of(frozenset({GGUFValueType.STRING}))
_NUMBER_ARRAY = _array_of(_NUMBER_TYPES)
_INTEGER_ARRAY = _array_of(_INTEGER_TYPES)

# (check, what the message calls the expected type)
KeyRule = tuple[Callable[[KeyRecord], bool], str]
_INTEGER: KeyRule = (_is_integer, "an integer")
_NUMBER: KeyRule = (_is_number, "a number")
_STRING: KeyRule = (_is_string, "a string")
_BOOL: KeyRule = (_is_bool, "a bool")
_PER_LAYER: KeyRule = (_integer_or_per_layer, "an integer or an array of integers (one per layer)")

GLOBAL_KEY_RULES: dict[str, KeyRule] = {
    "general.architecture": _STRING,
    "general.name": _STRING,
    "general.file_type": _INTEGER,
    "general.quantization_version": _INTEGER,
    "tokenizer.ggml.model": _STRING,
    "tokenizer.ggml.pre": _STRING,
    "tokenizer.ggml.tokens": (_STRING_ARRAY, "an array of strings"),
    "tokenizer.ggml.merges": (_STRING_ARRAY, "an array of strings"),
    "tokenizer.ggml.scores": (_NUMBER_ARRAY, "an array of numbers"),
    "tokenizer.ggml.token_type": (_INTEGER_ARRAY, "an array of integers"),
    "tokenizer.ggml.add_bos_token": _BOOL,
    "tokenizer.ggml.add_eos_token": _BOOL,
    "tokenizer.ggml.add_space_prefix": _BOOL,
    "tokenizer.chat_template": _STRING,
    **{
        f"tokenizer.ggml.{name}_token_id": _INTEGER
        for name in ("bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "mask")
    },
}
# `<arch>.<suffix>` keys, whatever the architecture.
ARCH_KEY_RULES: dict[str, KeyRule] = {
    "block_count": _INTEGER,
    "context_length": _INTEGER,
    "embedding_length": _INTEGER,
    "vocab_size": _INTEGER,
    "expert_count": _INTEGER,
    "expert_used_count": _INTEGER,
    "expert_feed_forward_length": _INTEGER,
    "feed_forward_length": _PER_LAYER,
    "attention.head_count": _PER_LAYER,
    "attention.head_count_kv": _PER_LAYER,
    "attention.key_length": _INTEGER,
    "attention.value_length": _INTEGER,
    "attention.layer_norm_rms_epsilon": _NUMBER,
    "attention.layer_norm_epsilon": _NUMBER,
    "rope.dimension_count": _INTEGER,
    "rope.freq_base": _NUMBER,
    "rope.scaling.type": _STRING,
    "rope.scaling.factor": _NUMBER,
}
POSITIVE_ARCH_KEYS = ("block_count", "context_length", "embedding_length")
TOKEN_ARRAYS_SAME_LENGTH = ("tokenizer.ggml.scores", "tokenizer.ggml.token_type")


def _rule_for(name: str, arch: str | None) -> KeyRule | None:
    rule = GLOBAL_KEY_RULES.get(name)
    if rule is not None:
        return rule
    prefix, _, suffix = name.partition(".")
    if prefix in ("general", "tokenizer") or (arch is not None and prefix != arch):
        return None
    return ARCH_KEY_RULES.get(suffix)


def _check_known_keys(cursor: _Cursor, keys: dict[str, KeyRecord]) -> None:
    """Known keys must have the type llama.cpp reads them as, and consistent sizes."""
    arch = _architecture(cursor, keys)
    for name, record in keys.items():
        rule = _rule_for(name, arch)
        if rule is not None and not rule[0](record):
            cursor.fail(f"key {_show(name)} must be {rule[1]}, got {_type_name(record)}", record.offset)
    _check_arch_values(cursor, keys, arch)
    _check_token_arrays(cursor, keys)


def _architecture(cursor: _Cursor, keys: dict[str, KeyRecord]) -> str | None:
    record = keys.get("general.architecture")
    if record is None or record.string_span is None:
        return None
    start, length = record.string_span
    if length > MAX_SHORT_STRING_BYTES:
        cursor.fail(f"general.architecture is {length} bytes long", record.offset)
    try:
        return bytes(cursor.data[start : start + length]).decode("utf-8")
    except UnicodeDecodeError:
        cursor.fail("general.architecture is not valid UTF-8", record.offset)


def _check_arch_values(cursor: _Cursor, keys: dict[str, KeyRecord], arch: str | None) -> None:
    if arch is None:
        return
    for suffix in POSITIVE_ARCH_KEYS:
        record = keys.get(f"{arch}.{suffix}")
        if record is not None and record.value is not None and not 0 < record.value <= INT64_MAX:
            cursor.fail(f"key {arch}.{suffix} must be positive, got {record.value}", record.offset)
    blocks = keys.get(f"{arch}.block_count")
    if blocks is None:
        return
    n_layer = blocks.value
    for suffix in ("feed_forward_length", "attention.head_count", "attention.head_count_kv"):
        record = keys.get(f"{arch}.{suffix}")
        if record is not None and record.type == GGUFValueType.ARRAY and record.count != n_layer:
            counts = f"{record.count} per-layer values, but {arch}.block_count is {n_layer}"
            cursor.fail(f"key {arch}.{suffix} has {counts}", record.offset)


def _check_token_arrays(cursor: _Cursor, keys: dict[str, KeyRecord]) -> None:
    tokens = keys.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    for name in TOKEN_ARRAYS_SAME_LENGTH:
        record = keys.get(name)
        if record is not None and record.count != tokens.count:
            cursor.fail(f"key {name} has {record.count} entries for {tokens.count} tokens", record.offset)


def _type_name(record: KeyRecord) -> str:
    if record.type == GGUFValueType.ARRAY and record.item_type is not None:
        return f"an array of {record.item_type.name}"
    return record.type.name


# =========================================================================== tensors


def _read_tensor_infos(cursor: _Cursor, tensor_count: int) -> list[TensorRecord]:
    tensors: list[TensorRecord] = []
    names: set[str] = set()
    for index in range(tensor_count):
        record = _read_tensor_info(cursor, index)
        if record.name in names:
            cursor.fail(f"duplicate tensor name {_show(record.name)}", record.info_offset)
        names.add(record.name)
        tensors.append(record)
    return tensors


def _read_tensor_info(cursor: _Cursor, index: int) -> TensorRecord:
    start = cursor.pos
    name = cursor.text(f"the name of tensor #{index}")
    what = f"tensor {_show(name)}"
    if len(name.encode("utf-8")) > MAX_TENSOR_NAME_BYTES:
        cursor.fail(f"{what}: name longer than {MAX_TENSOR_NAME_BYTES} bytes", start)
    n_dims = cursor.u32(f"the dimension count of {what}")
    if n_dims > MAX_TENSOR_DIMS:
        cursor.fail(f"{what} has {n_dims} dimensions (at most {MAX_TENSOR_DIMS})", cursor.pos - 4)
    ne = tuple(cursor.u64(f"dimension {d} of {what}") for d in range(n_dims))
    type_at = cursor.pos
    qtype = _tensor_type(cursor, cursor.u32(f"the type of {what}"), what, type_at)
    offset = cursor.u64(f"the data offset of {what}")
    n_elements = _element_count(cursor, ne, what, start)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row = ne[0] if ne else 1  # a 0-d tensor is one element
    if row % block_size:
        blocks = f"whole {qtype.name} blocks of {block_size}"
        cursor.fail(f"{what}: rows of {row} elements are not {blocks}", start)
    return TensorRecord(name, qtype, ne, n_elements, n_elements // block_size * type_size, offset, start)


def _tensor_type(cursor: _Cursor, raw: int, what: str, offset: int) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(raw)
    except ValueError:
        cursor.fail(f"{what} has unknown type id {raw}", offset)
    if qtype not in GGML_QUANT_SIZES:
        cursor.fail(f"{what} has type {qtype.name}, whose block size is unknown", offset)
    return qtype


def _element_count(cursor: _Cursor, ne: tuple[int, ...], what: str, offset: int) -> int:
    for d, size in enumerate(ne):
        if size > INT64_MAX:
            cursor.fail(f"{what}: dimension {d} is {size}, beyond int64", offset)
    n = math.prod(ne)  # Python ints: no wrap-around, unlike the reader's uint64 product
    if n > INT64_MAX:
        cursor.fail(f"{what}: {' x '.join(map(str, ne))} elements overflow int64", offset)
    return n


def _check_tensor_data(
    cursor: _Cursor, tensors: list[TensorRecord], data_offset: int, alignment: int
) -> None:
    """Each tensor's bytes lie inside the file, start aligned, and overlap no other tensor."""
    for t in tensors:
        what = f"tensor {_show(t.name)}"
        if t.offset % alignment:
            problem = f"data offset {t.offset} is not a multiple of the alignment {alignment}"
            cursor.fail(f"{what}: {problem}", t.info_offset)
        end = data_offset + t.offset + t.n_bytes
        if end > cursor.size:
            cursor.fail(
                f"truncated: {what} data ({t.n_bytes} bytes at {data_offset + t.offset}) "
                f"runs past the end of the {cursor.size}-byte file",
                t.info_offset,
            )
    occupied = sorted((t for t in tensors if t.n_bytes), key=lambda t: t.offset)
    for before, after in zip(occupied, occupied[1:], strict=False):  # neighbours
        if before.offset + before.n_bytes > after.offset:
            overlap = f"tensor {_show(after.name)} data overlaps tensor {_show(before.name)}"
            cursor.fail(overlap, after.info_offset)


# =========================================================================== helpers


def _align_up(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def _show(name: str, limit: int = 80) -> str:
    """A name from the file, quoted and escaped so it stays on one line and short."""
    return repr(name if len(name) <= limit else name[:limit] + "...")
