"""Hostile GGUF inputs for the fuzz tests and the fuzz campaign (benchmarks/fuzz_campaign.py).

`GGUFImage` writes GGUF bytes field by field (the `gguf` package's writer refuses most of what a
hostile file does) and records where each structural field sits, so mutations can aim at counts,
lengths, type ids, dims and offsets instead of only flipping random bits. `check_input` is the
property every input must satisfy: `validate_gguf_bytes` either accepts it or raises GGUFError,
and an accepted input opens with `open_gguf` (the gguf package's reader) and reads back without
any other exception.
"""

from __future__ import annotations

import itertools
import os
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ggufc.frontend.gguf_file import GGUFError, open_gguf
from ggufc.frontend.gguf_validate import validate_gguf_bytes

V = GGUFValueType
SCALAR_FORMATS = {
    V.UINT8: "<B",
    V.INT8: "<b",
    V.UINT16: "<H",
    V.INT16: "<h",
    V.UINT32: "<I",
    V.INT32: "<i",
    V.FLOAT32: "<f",
    V.BOOL: "<?",
    V.UINT64: "<Q",
    V.INT64: "<q",
    V.FLOAT64: "<d",
}


@dataclass(frozen=True)
class Field:
    """A structural field of the image: where it is, how wide, and what it means."""

    offset: int
    width: int  # 4 or 8 bytes
    kind: str  # "count", "length", "type", "ndims", "dim", "tensor_type", "data_offset", "version"


@dataclass
class GGUFImage:
    """GGUF bytes built field by field; `fields` records every structural field written."""

    version: int = 3
    alignment: int = 32
    buf: bytearray = field(default_factory=bytearray)
    fields: list[Field] = field(default_factory=list)

    def u32(self, value: int, kind: str | None = None) -> None:
        self._put(struct.pack("<I", value & 0xFFFFFFFF), kind)

    def u64(self, value: int, kind: str | None = None) -> None:
        self._put(struct.pack("<Q", value & 0xFFFFFFFFFFFFFFFF), kind)

    def _put(self, raw: bytes, kind: str | None) -> None:
        if kind is not None:
            self.fields.append(Field(len(self.buf), len(raw), kind))
        self.buf += raw

    def string(self, text: str | bytes) -> None:
        raw = text.encode("utf-8") if isinstance(text, str) else text
        self.u64(len(raw), "length")
        self.buf += raw

    def value(self, vtype: GGUFValueType, value: Any) -> None:
        if vtype == V.STRING:
            self.string(value)
        elif vtype == V.ARRAY:
            item_type, items = value
            self.u32(item_type, "type")
            self.u64(len(items), "count")
            for item in items:
                self.value(item_type, item)
        else:
            self.buf += struct.pack(SCALAR_FORMATS[vtype], value)

    def header(self, n_tensors: int, n_kv: int) -> None:
        self.buf += b"GGUF"
        self.u32(self.version, "version")
        self.u64(n_tensors, "count")
        self.u64(n_kv, "count")

    def kv(self, key: str | bytes, vtype: GGUFValueType | int, value: Any) -> None:
        self.string(key)
        self.u32(int(vtype), "type")
        if isinstance(vtype, GGUFValueType):
            self.value(vtype, value)
        elif value is not None:
            self.buf += value  # raw bytes after an unknown type id

    def tensor_info(self, name: str | bytes, ne: tuple[int, ...], qtype: int, offset: int) -> None:
        self.string(name)
        self.u32(len(ne), "ndims")
        for d in ne:
            self.u64(d, "dim")
        self.u32(qtype, "tensor_type")
        self.u64(offset, "data_offset")

    def pad_to_alignment(self) -> None:
        self.buf += bytes(-len(self.buf) % self.alignment)

    @property
    def data(self) -> bytes:
        return bytes(self.buf)


@dataclass(frozen=True)
class TensorSpec:
    name: str | bytes
    ne: tuple[int, ...]  # GGUF order, fastest first
    qtype: GGMLQuantizationType | int = GGMLQuantizationType.F32

    @property
    def n_bytes(self) -> int:
        """Its data size (4 bytes an element for a type id the gguf package does not know)."""
        known = {int(q): q for q in GGML_QUANT_SIZES}
        block, size = GGML_QUANT_SIZES[known[int(self.qtype)]] if int(self.qtype) in known else (1, 4)
        n = 1
        for d in self.ne:
            n *= d
        return n // block * size


DEFAULT_KVS: list[tuple[str, GGUFValueType, Any]] = [
    ("general.architecture", V.STRING, "llama"),
    ("general.name", V.STRING, "hostile"),
    ("llama.block_count", V.UINT32, 2),
    ("llama.context_length", V.UINT32, 64),
    ("llama.embedding_length", V.UINT32, 32),
    ("llama.attention.head_count", V.ARRAY, (V.INT32, [4, 4])),
    ("llama.rope.freq_base", V.FLOAT32, 10000.0),
    ("tokenizer.ggml.model", V.STRING, "gpt2"),
    ("tokenizer.ggml.tokens", V.ARRAY, (V.STRING, ["a", "b", "c", "<s>"])),
    ("tokenizer.ggml.scores", V.ARRAY, (V.FLOAT32, [0.0, -1.0, -2.0, 0.5])),
    ("tokenizer.ggml.token_type", V.ARRAY, (V.INT32, [1, 1, 1, 3])),
    ("tokenizer.ggml.add_bos_token", V.BOOL, True),
    ("every.u8", V.UINT8, 7),
    ("every.i8", V.INT8, -7),
    ("every.u16", V.UINT16, 700),
    ("every.i16", V.INT16, -700),
    ("every.i64", V.INT64, -(1 << 40)),
    ("every.u64", V.UINT64, 1 << 40),
    ("every.f64", V.FLOAT64, 0.25),
    ("every.nested", V.ARRAY, (V.ARRAY, [(V.UINT8, [1, 2]), (V.UINT8, [])])),
    ("every.empty", V.ARRAY, (V.STRING, [])),
]
DEFAULT_TENSORS = [
    TensorSpec("token_embd.weight", (32, 4)),
    TensorSpec("blk.0.attn_q.weight", (32, 32), GGMLQuantizationType.Q4_0),
    TensorSpec("blk.0.ffn_up.weight", (32, 2), GGMLQuantizationType.Q8_0),
    TensorSpec("blk.1.ffn_up.weight", (256, 1), GGMLQuantizationType.Q4_K),
    TensorSpec("output_norm.weight", (32,), GGMLQuantizationType.F16),
    TensorSpec("rope_freqs.weight", ()),
]


def build_gguf(
    kvs: list[tuple[Any, Any, Any]] | None = None,
    tensors: list[TensorSpec] | None = None,
    *,
    version: int = 3,
    alignment: int = 32,
    offsets: list[int] | None = None,
    n_tensors: int | None = None,
    n_kv: int | None = None,
) -> GGUFImage:
    """A small GGUF image (valid by default): `offsets` overrides the tensors' data offsets,
    `n_tensors`/`n_kv` the counts the header claims."""
    kvs = DEFAULT_KVS if kvs is None else kvs
    tensors = DEFAULT_TENSORS if tensors is None else tensors
    image = GGUFImage(version=version, alignment=alignment)
    image.header(len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
    for key, vtype, value in kvs:
        image.kv(key, vtype, value)
    packed, data_size = _packed_offsets(tensors, alignment)
    for spec, offset in zip(tensors, packed if offsets is None else offsets, strict=True):
        image.tensor_info(spec.name, spec.ne, int(spec.qtype), offset)
    image.pad_to_alignment()
    # the data of the packed layout (a hostile `offsets` may point anywhere: never sized from it)
    rng = np.random.default_rng(0)
    image.buf += rng.integers(0, 256, size=min(data_size, 1 << 20), dtype=np.uint8).tobytes()
    return image


def _packed_offsets(tensors: list[TensorSpec], alignment: int) -> tuple[list[int], int]:
    offsets, at = [], 0
    for spec in tensors:
        offsets.append(at)
        at += -(-spec.n_bytes // alignment) * alignment
    return offsets, at


def with_kv(key: Any, vtype: Any, value: Any, *, replace: bool = True) -> list[tuple[Any, Any, Any]]:
    """DEFAULT_KVS with `key` set (replacing the default entry of that key, or appended)."""
    kept = [kv for kv in DEFAULT_KVS if not (replace and kv[0] == key)]
    return [*kept, (key, vtype, value)]


# =========================================================================== the property

_serial = itertools.count()


def check_input(data: bytes, scratch: Path) -> str:
    """'refused' or 'accepted'; anything other than GGUFError escapes (the fuzz target)."""
    try:
        validate_gguf_bytes(data, "fuzz.gguf")
    except GGUFError as exc:
        _check_message(exc)
        return "refused"
    # a fresh name each time: rewriting one file in place makes ext4 flush it (~3 ms)
    path = scratch / f"fuzz-{os.getpid()}-{next(_serial)}.gguf"
    path.write_bytes(data)
    try:
        model = open_gguf(path)
    except GGUFError as exc:  # a problem only the reader sees (e.g. a non-UTF-8 token string)
        _check_message(exc)
        return "refused"
    finally:
        path.unlink()
    for info in model.tensors.values():  # every tensor's bytes are inside the mapping
        raw = np.asarray(info.data).reshape(-1).view(np.uint8)
        if raw.size:
            _ = int(raw[0]) + int(raw[-1])
    return "accepted"


def _check_message(exc: GGUFError) -> None:
    message = str(exc)
    if "\n" in message or "GGUF" not in message or len(message) > 600:
        raise AssertionError(f"GGUFError message is not one short line: {message!r}")


# =========================================================================== mutations

INTERESTING_U64 = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    12,
    13,
    31,
    32,
    33,
    63,
    64,
    255,
    256,
    4096,
    65535,
    65536,
    1 << 20,
    1 << 21,
    (1 << 21) + 1,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    (1 << 32) + 1,
    1 << 40,
    1 << 62,
    (1 << 63) - 1,
    1 << 63,
    (1 << 64) - 2,
    (1 << 64) - 1,
]
INTERESTING_U32 = [v for v in INTERESTING_U64 if v < 1 << 32] + [9, 10, 11, 12, 13, 14, 39, 40, 41, 42]


def header_end(data: bytes) -> int:
    """Where the tensor data section begins in a valid image (mutations aim before it)."""
    return validate_gguf_bytes(data).data_offset


def mutation_region(data: bytes) -> int:
    """The header of a valid image; all of an invalid one (a fuzzer's own mutants)."""
    try:
        end = max(header_end(data), 24)
    except GGUFError:
        end = len(data)
    return max(min(end, len(data)), 1)


def mutate(data: bytes, fields: list[Field], rng: random.Random, n_mutations: int = 3) -> bytes:
    """Apply up to `n_mutations` random structural mutations (and sometimes a truncation)."""
    out = bytearray(data or b"\0")
    region = mutation_region(data)
    for _ in range(rng.randint(1, n_mutations)):
        choice = rng.random()
        if choice < 0.35:
            # a structural field when the layout is known, else an interesting width anywhere
            field = rng.choice(fields) if fields else Field(rng.randrange(region), rng.choice((4, 8)), "any")
            _set_field(out, field, rng)
        elif choice < 0.65:
            out[rng.randrange(region)] ^= 1 << rng.randrange(8)
        elif choice < 0.85:
            out[rng.randrange(region)] = rng.choice([0, 1, 0x7F, 0x80, 0xC0, 0xFF])
        else:
            at = rng.randrange(region)
            chunk = out[at : at + rng.randint(1, 16)]
            out[at:at] = chunk  # duplicate a slice: shifts every later field
    if rng.random() < 0.15:
        del out[rng.randrange(len(out)) :]
    return bytes(out)


def _set_field(out: bytearray, f: Field, rng: random.Random) -> None:
    if f.width == 8:
        value = rng.choice(INTERESTING_U64 + [len(out), len(out) - 1, len(out) + 1, rng.getrandbits(64)])
        out[f.offset : f.offset + 8] = struct.pack("<Q", value & (1 << 64) - 1)
    else:
        value = rng.choice(INTERESTING_U32 + [rng.getrandbits(32)])
        out[f.offset : f.offset + 4] = struct.pack("<I", value & 0xFFFFFFFF)


def fixture_bytes(directory: Path) -> bytes:
    """The smallest fixture the project's writer makes: a 1-layer Q4_0 llama (a few KB)."""
    from tests.support.fixtures import FixtureSize, write_fixture

    size = FixtureSize(vocab=32, n_embd=32, n_layer=1, n_head=2, n_head_kv=1, head_dim=16, n_ff=32, n_ctx=16)
    path = write_fixture("llama", directory / "tiny-q4_0.gguf", size=size, qtype="Q4_0")
    return path.read_bytes()
