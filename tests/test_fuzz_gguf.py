"""The GGUF reader against hostile bytes: every malformed input ends in one GGUFError.

A fixed corpus, so CI is deterministic and quick (well under a minute on 2 cores):
every truncation of the smallest project fixture, every single-bit flip of a synthetic file's
header/metadata/tensor-info region, sampled truncations of a golden fixture, a targeted case for
each hostile construct the validator knows, and hypothesis-driven structural mutations of both.
The longer coverage-guided campaign is benchmarks/fuzz_campaign.py.
"""

from __future__ import annotations

import random
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufc.frontend.gguf_file import GGUFError, open_gguf
from ggufc.frontend.gguf_validate import MAX_ARRAY_ITEMS, validate_gguf, validate_gguf_bytes
from tests.support.gguf_corpus import (
    DEFAULT_KVS,
    DEFAULT_TENSORS,
    GGUFImage,
    TensorSpec,
    build_gguf,
    check_input,
    fixture_bytes,
    header_end,
    mutate,
    with_kv,
)
from tests.support.goldens import GOLDEN as SHARED_GOLDEN

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType
GOLDEN = SHARED_GOLDEN / "fixtures" / "llama-dense.gguf"  # ../shared beside the checkout


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def fixture_image(scratch: Path) -> bytes:
    return fixture_bytes(scratch)


@pytest.fixture(scope="module")
def synthetic() -> GGUFImage:
    return build_gguf()


def refused(data: bytes, match: str) -> GGUFError:
    """`data` is refused by the validator with a one-line message matching `match`, quickly."""
    start = time.perf_counter()
    with pytest.raises(GGUFError, match=match) as info:
        validate_gguf_bytes(data, "case.gguf")
    assert time.perf_counter() - start < 1.0
    message = str(info.value)
    assert "\n" not in message and message.startswith("case.gguf: ") and "GGUF" in message, message
    return info.value


# =========================================================================== the valid corpus


def test_corpus_inputs_are_valid(fixture_image: bytes, synthetic: GGUFImage, scratch: Path) -> None:
    assert check_input(fixture_image, scratch) == "accepted"
    assert check_input(synthetic.data, scratch) == "accepted"
    path = scratch / "synthetic.gguf"
    path.write_bytes(synthetic.data)
    model = open_gguf(path)
    assert model.metadata["every.nested"] == [1, 2] and model.metadata["every.empty"] == []
    assert model.tensors["blk.1.ffn_up.weight"].qtype == "Q4_K"
    assert model.tensors["rope_freqs.weight"].shape == ()


def test_every_shared_golden_fixture_validates() -> None:
    folder = GOLDEN.parent
    if not folder.is_dir():
        pytest.skip(f"llama.cpp golden fixture {GOLDEN} not found (../shared beside the checkout)")
    for path in sorted(folder.glob("*.gguf")):
        layout = validate_gguf(path)
        assert layout.tensors and layout.version == 3, path


@pytest.mark.parametrize(
    "case",
    [
        "version 2",
        "alignment 1",
        "alignment 256",
        "no tensors",
        "no keys",
        "empty name and key",
        "zero-element tensor",
        "array of arrays",
    ],
)
def test_unusual_but_valid_files_are_accepted(case: str, scratch: Path) -> None:
    """The validator refuses what is malformed, not what is merely unusual."""
    builders: dict[str, Callable[[], GGUFImage]] = {
        "version 2": lambda: build_gguf(version=2),
        "alignment 1": lambda: build_gguf(with_kv("general.alignment", V.UINT32, 1), alignment=1),
        "alignment 256": lambda: build_gguf(with_kv("general.alignment", V.UINT32, 256), alignment=256),
        "no tensors": lambda: build_gguf(tensors=[]),
        "no keys": lambda: build_gguf(kvs=[]),
        "empty name and key": lambda: build_gguf(with_kv("", V.UINT8, 1), [TensorSpec("", (4,))]),
        "zero-element tensor": lambda: build_gguf(tensors=[TensorSpec("empty", (0, 4)), *DEFAULT_TENSORS]),
        "array of arrays": lambda: build_gguf(
            with_kv("every.deep", V.ARRAY, (V.ARRAY, [(V.ARRAY, [(V.INT16, [1])])]))
        ),
    }
    assert check_input(builders[case]().data, scratch) == "accepted"


# =========================================================================== truncation


def test_every_truncation_of_the_fixture_is_refused(fixture_image: bytes) -> None:
    for cut in range(len(fixture_image)):
        with pytest.raises(GGUFError):
            validate_gguf_bytes(fixture_image[:cut], "cut.gguf")


def test_truncation_messages_name_the_place(fixture_image: bytes) -> None:
    end = header_end(fixture_image)
    assert "not a GGUF file" in str(refused(fixture_image[:3], "magic"))
    refused(fixture_image[:20], r"truncated: 16 bytes needed for the tensor and key counts, 12 left")
    refused(fixture_image[:40], r"claims 15 metadata key/value entries, more than a 40-byte file can hold")
    refused(fixture_image[:1000], r"truncated: ")
    refused(
        fixture_image[: end - 10], r"truncated: \d+ bytes needed for the (data offset|type|dimension|name)"
    )
    refused(fixture_image[:-1], r"truncated: tensor '.*' data \(\d+ bytes at \d+\) runs past the end")


def test_sampled_truncations_of_a_golden_fixture() -> None:
    if not GOLDEN.is_file():
        pytest.skip(f"llama.cpp golden fixture {GOLDEN} not found (../shared beside the checkout)")
    data = GOLDEN.read_bytes()
    end = header_end(data)
    rng = random.Random(1)
    cuts = sorted({*range(0, 64), *rng.sample(range(end), 300), *rng.sample(range(end, len(data)), 60)})
    for cut in cuts:
        with pytest.raises(GGUFError):
            validate_gguf_bytes(data[:cut], "golden.gguf")


def test_truncated_files_are_refused_through_open_gguf(fixture_image: bytes, scratch: Path) -> None:
    path = scratch / "truncated.gguf"
    for cut in (0, 1, 4, 8, 23, 24, 100, header_end(fixture_image), len(fixture_image) - 1):
        path.write_bytes(fixture_image[:cut])
        with pytest.raises(GGUFError, match="GGUF"):
            open_gguf(path)


# =========================================================================== bit flips


def test_every_single_bit_flip_of_the_header_region(synthetic: GGUFImage, scratch: Path) -> None:
    """Each flip is refused with GGUFError or opens cleanly; nothing else escapes."""
    data = synthetic.data
    outcomes: dict[str, int] = {}
    for position in range(header_end(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[position] ^= 1 << bit
            outcome = check_input(bytes(flipped), scratch)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes["refused"] > outcomes.get("accepted", 0) > 0  # flips inside values stay valid


def test_byte_flips_of_the_fixture_header(fixture_image: bytes, scratch: Path) -> None:
    rng = random.Random(7)
    end = header_end(fixture_image)
    for _ in range(1500):
        data = bytearray(fixture_image)
        data[rng.randrange(end)] = rng.randrange(256)
        check_input(bytes(data), scratch)


# =========================================================================== targeted cases


def _raw(image: GGUFImage, at: int, value: bytes) -> bytes:
    data = bytearray(image.data)
    data[at : at + len(value)] = value
    return bytes(data)


def _counts(n_tensors: int, n_kv: int) -> bytes:
    return build_gguf(n_tensors=n_tensors, n_kv=n_kv).data


def _big(n: int) -> bytes:
    return n.to_bytes(8, "little")


TWO_LAYERS = [kv for kv in DEFAULT_KVS if kv[0] != "llama.attention.head_count"]

TARGETED: dict[str, tuple[Callable[[], bytes], str]] = {
    # header
    "wrong magic": (lambda: b"GGML" + build_gguf().data[4:], r"not a GGUF file \(magic b'GGML'"),
    "version 1": (lambda: build_gguf(version=1).data, "unsupported GGUF version 1"),
    "version 4": (lambda: build_gguf(version=4).data, "unsupported GGUF version 4"),
    "version 0": (lambda: build_gguf(version=0).data, "unsupported GGUF version 0"),
    "big-endian": (lambda: build_gguf(version=3 << 24).data, "big-endian GGUF"),
    "absurd key count": (
        lambda: _counts(6, (1 << 64) - 1),
        r"claims 18446744073709551615 metadata key/value",
    ),
    "key count past the file": (lambda: _counts(6, 60000), "more than a .*-byte file can hold"),
    "absurd tensor count": (lambda: _counts(1 << 40, 21), r"claims 1099511627776 tensor entries"),
    "tensor count past the file": (lambda: _counts(5000, 21), "claims 5000 tensor entries, more than"),
    "tensor count past the metadata": (
        lambda: _counts(100, 21),
        "truncated: 2400 bytes needed for 100 tensor infos",
    ),
    # strings and arrays
    "key length past the end": (
        lambda: _raw(build_gguf(), 24, _big(1 << 62)),
        r"truncated: \d+ bytes needed for metadata key #0",
    ),
    "string value past the end": (
        lambda: build_gguf([("general.name", V.STRING, "xyz" * 9)], tensors=[]).data[:60],
        "truncated: 27 bytes needed for the string value of key 'general.name'",
    ),
    "string value absurd": (
        lambda: _raw(build_gguf([("k", V.STRING, "abc")]), 24 + 8 + 1 + 4, _big((1 << 64) - 1)),
        r"truncated: 18446744073709551615 bytes needed for the string value of key 'k'",
    ),
    "array count past the end": (
        lambda: _raw(build_gguf([("k", V.ARRAY, (V.UINT32, [1, 2]))]), 24 + 8 + 1 + 4 + 4, _big(1000)),
        r"truncated: 4000 bytes needed for the 1000 items of the array of key 'k'",
    ),
    "array count absurd": (
        lambda: _raw(build_gguf([("k", V.ARRAY, (V.UINT8, [1]))]), 24 + 8 + 1 + 4 + 4, _big(1 << 60)),
        "metadata arrays are limited",
    ),
    "string array past the end": (
        lambda: _raw(build_gguf([("k", V.ARRAY, (V.STRING, ["a", "b"]))]), 24 + 8 + 1 + 4 + 4, _big(100000)),
        r"truncated: 800000 bytes needed for the 100000 string lengths of the array of key 'k'",
    ),
    "string in an array past the end": (
        lambda: _raw(
            build_gguf([("k", V.ARRAY, (V.STRING, ["a", "b"]))]), 24 + 8 + 1 + 4 + 4 + 8 + 9, _big(1 << 40)
        ),
        r"truncated: the array of key 'k' item 1 runs past the end",
    ),
    "arrays nested too deeply": (
        lambda: (
            build_gguf(
                [("k", V.ARRAY, (V.ARRAY, [(V.ARRAY, [(V.ARRAY, [(V.UINT8, [1])])])]))], tensors=[]
            ).data
        ),
        "nests arrays deeper than 3 levels",
    ),
    "too many array items in all": (
        lambda: (
            build_gguf(
                [
                    ("a", V.ARRAY, (V.UINT8, [0] * (MAX_ARRAY_ITEMS // 2 + 1))),
                    ("b", V.ARRAY, (V.UINT8, [0] * 8)),
                ]
                + [("c", V.ARRAY, (V.UINT8, [0] * (MAX_ARRAY_ITEMS // 2)))],
                tensors=[],
            ).data
        ),
        "metadata arrays are limited to",
    ),
    # types
    "unknown value type": (
        lambda: build_gguf([("k", 13, b"\0" * 8)], tensors=[]).data,
        "unknown value type 13",
    ),
    "unknown value type (huge)": (
        lambda: build_gguf([("k", 0xFFFFFFFF, b"")], tensors=[]).data,
        "unknown value type 4294967295",
    ),
    "unknown array item type": (
        lambda: build_gguf([("k", V.ARRAY, (42, []))], tensors=[]).data,
        "unknown value type 42",
    ),
    "key not UTF-8": (
        lambda: build_gguf([(b"\xff\xfe", V.UINT8, 1)]).data,
        "metadata key #0 is not valid UTF-8",
    ),
    "string value not UTF-8": (
        lambda: build_gguf([("general.name", V.STRING, b"ok\xc3")]).data,
        "string value of key 'general.name'",
    ),
    "duplicate key": (
        lambda: build_gguf(with_kv("general.name", V.STRING, "again", replace=False)).data,
        "duplicate metadata key 'general.name'",
    ),
    "reserved key": (
        lambda: build_gguf(with_kv("GGUF.kv_count", V.UINT64, 1)).data,
        "duplicate metadata key",
    ),
    # known keys
    "alignment not u32": (
        lambda: build_gguf(with_kv("general.alignment", V.UINT64, 32)).data,
        "general.alignment must be a uint32",
    ),
    "alignment zero": (
        lambda: build_gguf(with_kv("general.alignment", V.UINT32, 0)).data,
        "power of two, got 0",
    ),
    "alignment not a power of two": (
        lambda: build_gguf(with_kv("general.alignment", V.UINT32, 48)).data,
        "power of two, got 48",
    ),
    "architecture not a string": (
        lambda: build_gguf(with_kv("general.architecture", V.UINT32, 7)).data,
        "key 'general.architecture' must be a string, got UINT32",
    ),
    "block_count a string": (
        lambda: build_gguf(with_kv("llama.block_count", V.STRING, "2")).data,
        "key 'llama.block_count' must be an integer, got STRING",
    ),
    "block_count zero": (
        lambda: build_gguf(with_kv("llama.block_count", V.INT32, 0)).data,
        "must be positive",
    ),
    "context_length negative": (
        lambda: build_gguf(with_kv("llama.context_length", V.INT64, -5)).data,
        "must be positive, got -5",
    ),
    "embedding_length a float": (
        lambda: build_gguf(with_kv("llama.embedding_length", V.FLOAT32, 32.0)).data,
        "must be an integer",
    ),
    "per-layer array of the wrong length": (
        lambda: (
            build_gguf(TWO_LAYERS + [("llama.attention.head_count", V.ARRAY, (V.UINT32, [4, 4, 4]))]).data
        ),
        "has 3 per-layer values, but llama.block_count is 2",
    ),
    "per-layer array of strings": (
        lambda: (
            build_gguf(TWO_LAYERS + [("llama.attention.head_count", V.ARRAY, (V.STRING, ["4", "4"]))]).data
        ),
        "must be an integer or an array of integers",
    ),
    "tokens not strings": (
        lambda: build_gguf(with_kv("tokenizer.ggml.tokens", V.ARRAY, (V.UINT32, [1, 2, 3, 4]))).data,
        "'tokenizer.ggml.tokens' must be an array of strings, got an array of UINT32",
    ),
    "scores shorter than tokens": (
        lambda: build_gguf(with_kv("tokenizer.ggml.scores", V.ARRAY, (V.FLOAT32, [0.0]))).data,
        "tokenizer.ggml.scores has 1 entries for 4 tokens",
    ),
    "add_bos_token not a bool": (
        lambda: build_gguf(with_kv("tokenizer.ggml.add_bos_token", V.UINT8, 1)).data,
        "must be a bool",
    ),
    "bos id a string": (
        lambda: build_gguf(with_kv("tokenizer.ggml.bos_token_id", V.STRING, "1")).data,
        "must be an integer",
    ),
    # tensors
    "tensor name not UTF-8": (lambda: build_gguf(tensors=[TensorSpec(b"w\xff", (4,))]).data, "UTF-8"),
    "tensor name too long": (
        lambda: build_gguf(tensors=[TensorSpec("w" * 64, (4,))]).data,
        "name longer than 63",
    ),
    "duplicate tensor": (
        lambda: build_gguf(tensors=[TensorSpec("w", (4,)), TensorSpec("w", (8,))]).data,
        "duplicate tensor name 'w'",
    ),
    "five dimensions": (
        lambda: build_gguf(tensors=[TensorSpec("w", (1, 1, 1, 1, 1))]).data,
        "has 5 dimensions",
    ),
    "dimension beyond int64": (
        lambda: build_gguf(tensors=[TensorSpec("w", (1 << 63,))], offsets=[0]).data,
        "dimension 0 is .* beyond int64",
    ),
    "element count overflow": (
        lambda: build_gguf(tensors=[TensorSpec("w", (1 << 32, 1 << 32))], offsets=[0]).data,
        r"4294967296 x 4294967296 elements overflow int64",
    ),
    "element count wraps in uint64": (
        lambda: build_gguf(tensors=[TensorSpec("w", (1 << 33, 1 << 31))], offsets=[0]).data,
        "overflow int64",
    ),
    "unknown tensor type": (
        lambda: build_gguf(tensors=[TensorSpec("w", (4,), 99)]).data,
        "unknown type id 99",
    ),
    "quantized scalar": (
        lambda: build_gguf(tensors=[TensorSpec("w", (), Q.Q8_0)], offsets=[0]).data,
        "rows of 1 elements are not whole Q8_0 blocks of 32",
    ),
    "removed tensor type": (lambda: build_gguf(tensors=[TensorSpec("w", (4,), 4)]).data, "unknown type id 4"),
    "rows not whole blocks": (
        lambda: build_gguf(tensors=[TensorSpec("w", (48, 2), Q.Q4_0)], offsets=[0]).data,
        "rows of 48 elements are not whole Q4_0 blocks of 32",
    ),
    "data past the end": (
        lambda: build_gguf(tensors=[TensorSpec("w", (64,))], offsets=[1 << 20]).data,
        "runs past the end",
    ),
    "data offset absurd": (
        lambda: build_gguf(tensors=[TensorSpec("w", (64,))], offsets=[(1 << 64) - 32]).data,
        "runs past the end",
    ),
    "misaligned data": (
        lambda: build_gguf(tensors=[TensorSpec("w", (64,)), TensorSpec("v", (8,))], offsets=[0, 260]).data,
        "data offset 260 is not a multiple of the alignment 32",
    ),
    "overlapping tensors": (
        lambda: build_gguf(tensors=[TensorSpec("w", (64,)), TensorSpec("v", (64,))], offsets=[0, 128]).data,
        "tensor 'v' data overlaps tensor 'w'",
    ),
    "same offset twice": (
        lambda: build_gguf(tensors=[TensorSpec("w", (8,)), TensorSpec("v", (8,))], offsets=[0, 0]).data,
        "overlaps",
    ),
}


@pytest.mark.parametrize("case", sorted(TARGETED))
def test_targeted_hostile_case(case: str) -> None:
    build, match = TARGETED[case]
    refused(build(), match)


@pytest.mark.parametrize(
    "case", ["absurd key count", "string value absurd", "array count absurd", "element count overflow"]
)
def test_claimed_sizes_are_never_allocated(case: str) -> None:
    data = TARGETED[case][0]()
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError):
            validate_gguf_bytes(data, "claims.gguf")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak {peak} bytes"


def test_reader_level_problem_names_the_key(scratch: Path) -> None:
    """A string inside an array that is not UTF-8 is found by open_gguf, named, and typed."""
    path = scratch / "bad-token.gguf"
    path.write_bytes(
        build_gguf(with_kv("tokenizer.ggml.tokens", V.ARRAY, (V.STRING, ["a", b"\xff", "c", "d"]))).data
    )
    with pytest.raises(GGUFError, match=r"malformed GGUF: key 'tokenizer.ggml.tokens': 'utf-8' codec"):
        open_gguf(path)


def test_open_gguf_refuses_a_file_gguf_reader_would_hang_on(scratch: Path) -> None:
    """An array of 2^60 one-byte items in a tiny file: GGUFReader would loop for ever."""
    path = scratch / "hang.gguf"
    path.write_bytes(TARGETED["array count absurd"][0]())
    start = time.perf_counter()
    with pytest.raises(GGUFError, match="metadata arrays are limited"):
        open_gguf(path)
    assert time.perf_counter() - start < 1.0


# =========================================================================== hypothesis


BASES = ("synthetic", "fixture")


@settings(max_examples=400, deadline=2000, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(BASES), seed=st.integers(0, 2**32 - 1), n_mutations=st.integers(1, 6))
def test_structural_mutations_never_escape(
    base: str, seed: int, n_mutations: int, tmp_path_factory: Any
) -> None:
    image, fields = _base(base, tmp_path_factory)
    data = mutate(image, fields, random.Random(seed), n_mutations)
    check_input(data, _scratch(tmp_path_factory))


@settings(max_examples=200, deadline=2000, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.sampled_from(BASES),
    writes=st.lists(
        st.tuples(st.integers(0, 10_000), st.binary(min_size=1, max_size=8)), min_size=1, max_size=4
    ),
    cut=st.one_of(st.none(), st.integers(0, 10_000)),
)
def test_arbitrary_byte_writes_never_escape(
    base: str, writes: list[tuple[int, bytes]], cut: int | None, tmp_path_factory: Any
) -> None:
    image, _ = _base(base, tmp_path_factory)
    data = bytearray(image)
    end = header_end(image)
    for position, raw in writes:
        at = position % end
        data[at : at + len(raw)] = raw
    if cut is not None:
        del data[cut % len(data) :]
    check_input(bytes(data), _scratch(tmp_path_factory))


_BASE_CACHE: dict[str, tuple[bytes, list[Any]]] = {}


def _scratch(factory: Any) -> Path:
    if "scratch" not in _BASE_CACHE:
        _BASE_CACHE["scratch"] = (b"", [factory.mktemp("hypothesis")])
    return Path(_BASE_CACHE["scratch"][1][0])


def _base(name: str, factory: Any) -> tuple[bytes, list[Any]]:
    if name not in _BASE_CACHE:
        if name == "synthetic":
            image = build_gguf()
            _BASE_CACHE[name] = (image.data, list(image.fields))
        else:
            _BASE_CACHE[name] = (fixture_bytes(_scratch(factory)), [])
    return _BASE_CACHE[name]


def test_mutation_engine_is_deterministic(synthetic: GGUFImage) -> None:
    first = [mutate(synthetic.data, synthetic.fields, random.Random(3)) for _ in range(5)]
    again = [mutate(synthetic.data, synthetic.fields, random.Random(3)) for _ in range(5)]
    assert first == again
    assert any(m != synthetic.data for m in first)
    assert np.mean([len(m) for m in first]) > 24
