"""The project's fixture writer: deterministic files that load, run, and exercise each optional path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from ggufc.frontend.archs import ARCHITECTURES
from ggufc.frontend.load import LoadedModel, dequantize_tensor, load_model
from ggufc.ir.interp import init_state, run_graph
from tests.support.fixture_spec import SIZES
from tests.support.fixtures import (
    RECIPES,
    SYNTHESISED,
    FixtureOptions,
    full_options,
    gpt2_vocab,
    plan_tensors,
    write_fixture,
)

ARCHS = sorted(ARCHITECTURES)
N_TOKENS = 7


def variants(arch: str) -> list[tuple[str, dict[str, Any]]]:
    """A few option combinations per architecture: plain, every optional tensor, odd sizes, quantized."""
    out: list[tuple[str, dict[str, Any]]] = [
        ("plain", {}),
        ("full", full_options(arch)),
        ("odd-tied", {"size": "odd", "tied_output": True, "rope_scaling": 2.0}),
        ("q8_0-full", {"qtype": "Q8_0", **full_options(arch)}),
        ("q4_k", {"qtype": "Q4_K", "size": "kquant"}),
    ]
    if RECIPES[arch].moe == "optional":
        out.append(("moe-scales", {"moe": True, "scales": True}))
    if RECIPES[arch].expert_gate_optional:
        out.append(("moe-gateless-q4_0", {"moe": True, "expert_gate": False, "qtype": "Q4_0"}))
    return out


CASES = [(arch, name, opts) for arch in ARCHS for name, opts in variants(arch)]
CASE_IDS = [f"{arch}-{name}" for arch, name, _ in CASES]


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sum((a - b) ** 2) / np.sum(b**2))


def tokens_for(model: LoadedModel, n: int = N_TOKENS) -> np.ndarray:
    return np.random.default_rng(1).integers(0, model.hparams.n_vocab, n).astype(np.int32)


def interpret(model: LoadedModel, tokens: np.ndarray, chunk: int, dtype: Any = np.float32) -> np.ndarray:
    """All-token logits from the reference interpreter, fed `chunk` tokens per call."""
    graph = model.graphs["prefill_all"]
    state = init_state(graph, {}, dtype)
    load = model.param_loader()
    logits = []
    for start in range(0, len(tokens), chunk):
        inputs = {"tokens": tokens[start : start + chunk], "pos": np.int64(start)}
        res = run_graph(graph, inputs, load, state, dtype=dtype)
        state = res.state
        logits.append(res.outputs[0])
    return np.concatenate(logits)


def test_every_registered_architecture_has_a_recipe() -> None:
    assert set(RECIPES) == set(ARCHITECTURES)


@pytest.mark.parametrize(("arch", "name", "opts"), CASES, ids=CASE_IDS)
def test_same_seed_same_bytes_other_seed_other_bytes(
    tmp_path: Path, arch: str, name: str, opts: dict[str, Any]
) -> None:
    first = write_fixture(arch, tmp_path / "a.gguf", seed=3, **opts).read_bytes()
    again = write_fixture(arch, tmp_path / "b.gguf", seed=3, **opts).read_bytes()
    other = write_fixture(arch, tmp_path / "c.gguf", seed=4, **opts).read_bytes()
    assert first == again
    assert first != other
    assert len(first) == len(other)  # the seed changes values, never the layout


@pytest.mark.parametrize(("arch", "name", "opts"), CASES, ids=CASE_IDS)
def test_fixture_loads_and_interprets(tmp_path: Path, arch: str, name: str, opts: dict[str, Any]) -> None:
    path = write_fixture(arch, tmp_path / "m.gguf", **opts)
    model = load_model(path)
    size = SIZES[opts.get("size", "tiny")]
    assert model.arch == arch
    assert model.hparams.n_vocab == size.vocab and model.hparams.n_layer == size.n_layer
    if not (RECIPES[arch].latent or RECIPES[arch].kimi or RECIPES[arch].bailing):  # MLA: no kv heads
        n_kv = 1 if RECIPES[arch].compressed else size.n_head_kv  # deepseek4: one shared K/V head
        assert model.hparams.n_head_kv == n_kv and model.hparams.head_dim == size.head_dim
    used = set(model.graphs["prefill_all"].params)
    assert set(model.gguf.tensors) <= used  # load_model also checks this; say so here too
    logits = interpret(model, tokens_for(model), chunk=N_TOKENS)
    assert logits.shape == (N_TOKENS, size.vocab)
    assert np.all(np.isfinite(logits))
    assert np.std(logits) > 0.05  # the layers did not wash the signal out


@pytest.mark.parametrize(("arch", "name", "opts"), CASES, ids=CASE_IDS)
def test_chunked_interpreter_equals_one_shot(
    tmp_path: Path, arch: str, name: str, opts: dict[str, Any]
) -> None:
    model = load_model(write_fixture(arch, tmp_path / "m.gguf", **opts))
    tokens = tokens_for(model)
    one_shot = interpret(model, tokens, N_TOKENS, np.float64)
    for chunk in (1, 3):
        chunked = interpret(model, tokens, chunk, np.float64)
        assert nmse(chunked, one_shot) <= 1e-9, f"chunks of {chunk}"


def test_quantized_fixture_stores_matrices_quantized(tmp_path: Path) -> None:
    model = load_model(write_fixture("llama", tmp_path / "m.gguf", qtype="Q8_0", **full_options("llama")))
    types = {name: info.qtype for name, info in model.gguf.tensors.items()}
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.attn_q.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.attn_q.bias"] == "F32"
    assert types["rope_freqs.weight"] == "F32" and types["blk.0.ffn_up.scale"] == "F32"


def test_rows_that_do_not_fill_a_block_stay_f32(tmp_path: Path) -> None:
    """odd: n_embd 48 is not a multiple of 32, n_ff 80 is not either; H*D = 48."""
    model = load_model(write_fixture("qwen3", tmp_path / "m.gguf", size="odd", qtype="Q4_0"))
    assert {info.qtype for info in model.gguf.tensors.values()} == {"F32"}
    model = load_model(write_fixture("qwen3", tmp_path / "k.gguf", size="tiny", qtype="Q4_K"))
    assert {info.qtype for info in model.gguf.tensors.values()} == {"F32"}  # K-quants need rows of 256


@pytest.mark.parametrize("qtype", list(SYNTHESISED))
def test_synthesised_blocks_decode_to_finite_weights(tmp_path: Path, qtype: str) -> None:
    model = load_model(write_fixture("qwen3moe", tmp_path / "m.gguf", size="kquant", qtype=qtype))
    quantized = [n for n, info in model.gguf.tensors.items() if info.qtype == qtype]
    assert "blk.0.ffn_down_exps.weight" in quantized and "token_embd.weight" in quantized
    for name in quantized:
        w = dequantize_tensor(model.gguf, name)
        assert np.all(np.isfinite(w)), name
        assert 0.03 < float(np.std(w)) < 0.3, name


def test_tensor_values_do_not_depend_on_other_options(tmp_path: Path) -> None:
    plain = load_model(write_fixture("llama", tmp_path / "a.gguf", seed=5))
    full = load_model(write_fixture("llama", tmp_path / "b.gguf", seed=5, **full_options("llama")))
    for name in ("token_embd.weight", "blk.1.ffn_down.weight", "blk.0.attn_norm.weight"):
        np.testing.assert_array_equal(dequantize_tensor(plain.gguf, name), dequantize_tensor(full.gguf, name))


def test_every_tensor_of_the_plan_is_written(tmp_path: Path) -> None:
    opts = {"moe": True, "scales": True, "biases": True, "rope_freqs": True}
    model = load_model(write_fixture("llama", tmp_path / "m.gguf", **opts))
    planned = {t.name: t.shape for t in plan_tensors("llama", SIZES["tiny"], FixtureOptions(**opts))}
    assert {n: tuple(i.shape) for n, i in model.gguf.tensors.items()} == planned


def test_plan_is_what_the_architecture_file_reads() -> None:
    """The tensors come from running the architecture file: its optional tensors follow the options,
    a `.scale` only beside its matrix (no gate scale beside qwen3next's merged gate_up), and an
    option whose tensor the architecture never reads raises."""
    def names(arch: str, **opts: Any) -> set[str]:
        return {t.name for t in plan_tensors(arch, SIZES["tiny"], FixtureOptions(**opts))}

    assert "output.weight" in names("qwen3") and "output.weight" not in names("qwen3", tied_output=True)
    assert names("qwen3", biases=True) - names("qwen3") == {
        f"blk.{il}.attn_{k}.bias" for il in range(2) for k in ("q", "k", "v", "output")}
    merged = names("qwen3next", scales=True)
    assert "blk.0.ffn_gate_up_exps.weight" in merged and "blk.0.ffn_down_exps.scale" in merged
    assert not {"blk.0.ffn_gate_exps.scale", "blk.0.ffn_up_exps.scale"} & merged
    assert [a for a in ARCHS if full_options(a).get("rope_freqs")] == [
        "exaone4", "granite", "granite_swa", "granitemoe", "llama", "mistral3"]


@pytest.mark.parametrize(
    ("arch", "opts"),
    [
        ("qwen3", {"rope_freqs": True}),
        ("qwen3", {"moe": True}),
        ("qwen3moe", {"moe": False}),
        ("qwen3moe", {"expert_gate": False}),
        ("llama", {"expert_gate": False}),  # gate-less experts need moe=True
        ("llama", {"tokenizer": "spm"}),
        ("llama", {"tokenizer": "gpt2"}),  # the tiny vocab is too small for 256 byte tokens
        ("llama", {"qtype": "IQ2_XS"}),
        ("mamba", {}),
    ],
)
def test_options_an_architecture_lacks_raise(tmp_path: Path, arch: str, opts: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        write_fixture(arch, tmp_path / "m.gguf", **opts)


def test_gpt2_vocabulary_is_consistent(tmp_path: Path) -> None:
    model = load_model(write_fixture("llama", tmp_path / "m.gguf", size="bpe", tokenizer="gpt2"))
    meta = model.gguf.metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert len(tokens) == model.hparams.n_vocab == SIZES["bpe"].vocab
    assert len(meta["tokenizer.ggml.token_type"]) == len(tokens)
    assert tokens[int(meta["tokenizer.ggml.eos_token_id"])] == "<|endoftext|>"
    known = set(tokens)
    for merge in meta["tokenizer.ggml.merges"]:
        left, right = merge.split(" ")
        assert left in known and right in known and left + right in known, merge


def test_gpt2_vocabulary_round_trips_text(tmp_path: Path) -> None:
    builder = pytest.importorskip("ggufc.frontend.tokenizer_build")
    tokenizers = pytest.importorskip("tokenizers")
    path = write_fixture("qwen3", tmp_path / "m.gguf", size="bpe", tokenizer="gpt2")
    spec = builder.build_tokenizer(load_model(path).gguf.metadata)
    tok = tokenizers.Tokenizer.from_str(spec.tokenizer_json)
    text = "The quick brown fox, then ünïcode!"
    ids = tok.encode(text).ids
    assert max(ids) < SIZES["bpe"].vocab
    assert len(ids) < len(text.encode())  # the merges apply
    assert tok.decode(ids) == text


def test_gpt2_vocab_fills_with_unused_tokens() -> None:
    vocab = gpt2_vocab(400)
    assert len(vocab.tokens) == len(vocab.token_types) == 400
    assert vocab.tokens[-2].startswith("<|unused_") and vocab.token_types[-2] == 5


def test_writer_output_is_a_gguf_the_reader_accepts(tmp_path: Path) -> None:
    path = write_fixture("qwen3moe", tmp_path / "m.gguf", qtype="Q5_1")
    reader = gguf.GGUFReader(path)
    assert str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8") == "qwen3moe"
