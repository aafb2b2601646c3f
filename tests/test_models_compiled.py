"""Whole models, compiled: each registered architecture's project-written fixture built into one Relax VM
executable (no passes) and run as one-shot prefill, chunked prefill and decode, against the interpreter.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ggufc.codegen.kernels.lane_dot_matmul import lane_dot_supported
from ggufc.codegen.target import cpu_target
from ggufc.frontend.archs import ARCHITECTURES
from tests.support.compiled_models import compile_fixture, compiled_decode, compiled_prefill, interpreted, nmse
from tests.support.fixtures import RECIPES, full_options

N_TOKENS = 10
CHUNK = 3
QUANT_OF = {"llama": "Q4_0", "qwen3": "Q8_0", "qwen3moe": "Q4_0"}  # one quantized fixture per arch
MOE_VARIANT = ("granite_swa",)  # optional-MoE archs whose MoE branch has no llama.cpp fixture
# float32 weights on AVX2 targets without AVX-512 sum a prompt as tinyBLAS and one token as
# ggml_vec_dot_f32 (llama.cpp's orders), so one-token calls and a one-shot prompt part by float32
# rounding there (1.3e-8 on minimax-m3's fixture), not only by their chunking
SPLIT_FLOAT_ORDERS = lane_dot_supported("F32", 4, 32, cpu_target())


def model_variants() -> list[tuple[str, dict[str, Any], float]]:
    """(id, write_fixture options, NMSE bound against the interpreter) for every registered arch."""
    out = []
    for arch in sorted(ARCHITECTURES):
        full = {"arch": arch, **full_options(arch)}
        out.append((f"{arch}-f32-full", full, 1e-6))
        qtype = QUANT_OF.get(arch, "Q8_0")
        out.append((f"{arch}-{qtype}", {"arch": arch, "qtype": qtype}, 1e-5))
        if arch in MOE_VARIANT:
            out.append((f"{arch}-moe-f32-full", {**full, "moe": True}, 1e-6))
        if RECIPES[arch].expert_gate_optional:  # the gate-less MoE path exists only where MoE is optional
            out.append((f"{arch}-moe-gateless", {**full, "moe": True, "expert_gate": False}, 1e-6))
    return out


VARIANTS = model_variants()
# The quantized twins of the architectures whose f32 fixture stays in the default tier: their Q8_0
# matmuls are the other architectures', and each is a whole-model compile (10-100+ s). The default
# tier keeps a dense, a MoE and a hybrid Q8_0 twin (and llama's and qwen3moe's Q4_0 ones); the slow
# tier runs the rest.
DEFAULT_TWINS = frozenset({"qwen3-Q8_0", "granitemoe-Q8_0", "qwen35-Q8_0"})
SLOW_VARIANTS = frozenset(name for name, _, _ in VARIANTS if name.endswith("-Q8_0") and name not in DEFAULT_TWINS)


def variant_params() -> list[Any]:
    return [pytest.param(v, id=v[0], marks=[pytest.mark.slow] if v[0] in SLOW_VARIANTS else []) for v in VARIANTS]


@pytest.fixture(scope="module", params=variant_params())
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    name, opts, bound = request.param
    cm = compile_fixture(tmp_path_factory.mktemp(name), opts)
    tokens = np.random.default_rng(7).integers(0, cm.model.hparams.n_vocab, N_TOKENS).astype(np.int32)
    return {
        "cm": cm,
        "tokens": tokens,
        "bound": bound,
        "float_weights": "qtype" not in opts,
        "ref": interpreted(cm.model, tokens),
        "one_shot": compiled_prefill(cm, tokens, N_TOKENS),
    }


def test_one_shot_prefill_matches_interpreter(variant: dict[str, Any]) -> None:
    got, ref = variant["one_shot"], variant["ref"]
    assert got.shape == ref.shape
    assert nmse(got, ref) <= variant["bound"]


def test_chunked_prefill_equals_one_shot(variant: dict[str, Any]) -> None:
    chunked = compiled_prefill(variant["cm"], variant["tokens"], CHUNK)
    assert nmse(chunked, variant["one_shot"]) <= 1e-9
    assert nmse(chunked, variant["ref"]) <= variant["bound"]


def test_decode_matches_interpreter(variant: dict[str, Any]) -> None:
    decoded = compiled_decode(variant["cm"], variant["tokens"])
    assert nmse(decoded, variant["ref"]) <= variant["bound"]
    split = SPLIT_FLOAT_ORDERS and variant["float_weights"]
    assert nmse(decoded, variant["one_shot"]) <= (variant["bound"] if split else 1e-9)


def test_last_token_prefill_after_a_chunk(variant: dict[str, Any]) -> None:
    """`prefill` (last-token logits) continuing a context that a first chunk filled."""
    cm, tokens = variant["cm"], variant["tokens"]
    states = cm.fresh_states()
    cm.call("prefill_all", tokens[:4], 0, states)
    last = cm.call("prefill", tokens[4:], 4, states)
    assert last.shape == (1, cm.model.hparams.n_vocab)
    assert nmse(last, variant["ref"][-1:]) <= variant["bound"]


def test_hidden_states_match_interpreter(variant: dict[str, Any]) -> None:
    """`embed` (the final norm's output, for embeddings), chunked, against the interpreter."""
    cm, tokens = variant["cm"], variant["tokens"]
    states = cm.fresh_states()
    got = np.concatenate([cm.call("embed", tokens[i : i + CHUNK], i, states) for i in range(0, len(tokens), CHUNK)])
    ref = interpreted(cm.model, tokens, hidden=True)
    assert got.shape == ref.shape == (len(tokens), cm.model.hparams.n_embd)
    assert nmse(got, ref) <= variant["bound"]
