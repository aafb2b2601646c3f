"""bailingmoe3 (Ling 3.0) end to end: llama.cpp's golden (layer 0 MLA with Q-LoRA, M-RoPE and a dense
FFN; layer 1 KDA with a MoE whose experts are clamped at 4 and shared expert at 5, after the SiLU)
through the float64 interpreter in all three feeding modes (tests/test_interpreter_goldens.py; `ggufc
eval` on the compiled kernels: tests/test_goldens.py; its state layout and `ggufc inspect`:
tests/test_arch_goldens.py); the clamps, which only the project's fixture reaches; a decode step's
kernels; the M-RoPE sections; MTP blocks loaded and skipped; what is refused.

The project's own fixture (KDA with a clamped dense FFN, MLA without Q-LoRA and NORM rope, a
renormalised, scaled MoE: tests/support/fixtures_bailingmoe3.py) is compiled against the interpreter by
tests/test_models_compiled.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ggufc.frontend.archs import bailingmoe3
from ggufc.frontend.blocks import Weights
from ggufc.frontend.gguf_file import GGUFModel, TensorInfo
from ggufc.frontend.hparams import Keys, ModelError, mrope_components, rope_table
from ggufc.frontend.load import LoadedModel, load_model
from ggufc.ir.builder import GraphBuilder
from tests.support.arch_models import golden_fixture, interpret_float64
from tests.support.fixtures import write_fixture
from tests.support.goldens import GOLDEN, skip_without_goldens
from tests.support.sparse_indexers import decode_kernel_calls, nmse

needs_golden = skip_without_goldens(GOLDEN / "fixtures" / "bailingmoe3-moe.gguf")
golden = golden_fixture("bailingmoe3-moe")


def _gold() -> Any:
    return np.load(GOLDEN / "logits" / "bailingmoe3-moe.npz")


# ---------------------------------------------------------------------------------------------
# llama.cpp's golden


@needs_golden
def test_hparams_of_the_llama_cpp_fixture(golden: LoadedModel) -> None:
    hp = golden.hparams
    assert hp.kda_layers == (False, True) and (hp.n_layer, hp.n_layer_all, hp.n_lead_dense) == (2, 2, 1)
    assert (hp.mla.n_head, hp.mla.q_lora, hp.mla.kv_lora, hp.mla.n_rot, hp.mla.nope, hp.mla.v_head) == (
        1, 512, 512, 64, 128, 128)
    assert (hp.kda.n_head, hp.kda.head_dim, hp.kda.conv_kernel, hp.kda.gate_lower_bound) == (1, 128, 4, -5.0)
    assert hp.rope_sections == (8, 12, 12, 0)
    assert (hp.clamp_exp, hp.clamp_shexp) == ((0.0, 4.0), (0.0, 5.0))
    assert (hp.gating, hp.weights_norm, hp.weights_scale, hp.n_ff_exp, hp.n_ff_shexp) == (
        "sigmoid", False, 1.0, (192, 192), (96, 96))


def _rebuilt(model: LoadedModel, **changes: Any) -> Any:
    """The model's all-logits graph built with other hyper-parameters."""
    hp = dataclasses.replace(model.hparams, **changes)
    return bailingmoe3.build(Weights(model.gguf, GraphBuilder()), hp, model.n_ctx, True)


@needs_golden
def test_the_golden_never_reaches_its_clamps(golden: LoadedModel) -> None:
    """llama.cpp's fixture clamps at 4 and 5, far above its activations (weights and norms
    N(0, 0.1)): without the clamps its logits are the same, so the clamps are checked on the
    project's fixture (below) and by the activation's reference."""
    gold = _gold()
    tokens, want = gold["tokens"][:32], gold["logits_prefill"][:32]
    clamped = interpret_float64(golden, golden.graph, tokens, 32)
    unclamped = interpret_float64(golden, _rebuilt(golden, clamp_exp=(0.0, 0.0), clamp_shexp=(0.0, 0.0)), tokens, 32)
    assert nmse(clamped, want) < 1e-10 and nmse(unclamped, clamped) < 1e-20


def test_the_clamps_bite_on_the_project_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/support/fixtures_bailingmoe3.py clamps at 0.3 (experts) and 0.25 (shared expert, dense FFN):
    removing them, or clamping before the SiLU as deepseek4 does, moves the logits."""
    model = load_model(write_fixture("bailingmoe3", tmp_path / "m.gguf"))
    tokens = np.random.default_rng(1).integers(0, model.hparams.n_vocab, 12).astype(np.int32)
    clamped = interpret_float64(model, model.graph, tokens, 12)
    n = model.hparams.n_layer
    unclamped = interpret_float64(model, _rebuilt(model, clamp_exp=(0.0,) * n, clamp_shexp=(0.0,) * n), tokens, 12)
    assert nmse(unclamped, clamped) > 1e-4
    monkeypatch.setattr(bailingmoe3, "_act", lambda limit: ("swiglu_clamp", limit) if limit > 1e-6 else ("swiglu", 0.0))
    assert nmse(interpret_float64(model, _rebuilt(model), tokens, 12), clamped) > 1e-6


# ---------------------------------------------------------------------------------------------
# a decode step's kernels


@needs_golden
def test_decode_kernel_count(golden: LoadedModel) -> None:
    """A decode step: 72 kernels fused, 136 unfused."""
    fused = decode_kernel_calls(golden, True)
    assert (fused["gated_delta_net"], fused["ssm_conv"]) == (1, 3)
    assert sum(fused.values()) == FUSED_DECODE_KERNELS
    assert sum(decode_kernel_calls(golden, False).values()) == UNFUSED_DECODE_KERNELS


FUSED_DECODE_KERNELS = 72  # one KDA scan, 3 convs, the MoE as 3 expert calls, a weighted sum and the shared add
UNFUSED_DECODE_KERNELS = 136


# ---------------------------------------------------------------------------------------------
# M-RoPE sections


def test_mrope_sections_are_consecutive() -> None:
    """ggml_mrope_cache_init: sector = pair % sum(sections); t, h, w, e one after another."""
    assert mrope_components([2, 1, 1, 0], 24) == ["t", "t", "h", "w"] * 3
    assert mrope_components([1, 1, 1, 1], 16) == ["t", "h", "w", "e"] * 2
    with pytest.raises(ModelError, match="dimension_sections"):
        mrope_components([2, 1, 1], 8)


def test_mrope_text_positions_with_full_sections_equal_neox() -> None:
    """Text tokens sit at (p, p, p, 0): sections covering every pair rotate as plain NEOX; an e
    section leaves its pairs unrotated."""
    plain = rope_table(32, 64, 10000.0, 1.0, None)
    np.testing.assert_array_equal(rope_table(32, 64, 10000.0, 1.0, None, [8, 12, 12, 0], interleaved=False), plain)
    with_e = rope_table(32, 16, 10000.0, 1.0, None, [2, 2, 2, 2], interleaved=False)
    np.testing.assert_array_equal(with_e[:, 6:], np.broadcast_to([1.0, 0.0], (32, 2, 2)))
    np.testing.assert_array_equal(with_e[:, :6], rope_table(32, 16, 10000.0, 1.0, None)[:, :6])


# ---------------------------------------------------------------------------------------------
# MTP blocks and refusals


def _metadata(golden: LoadedModel, **changes: Any) -> dict[str, Any]:
    meta = dict(golden.gguf.metadata)
    meta.update({f"bailingmoe3.{k}": v for k, v in changes.items()})
    return meta


@needs_golden
def test_mtp_layers_load_and_are_skipped(golden: LoadedModel) -> None:
    """A third block that is an MTP (nextn) layer: its tensors are accepted, the trunk's graph is
    the same two layers and reads none of them."""
    meta = _metadata(golden, block_count=3, nextn_predict_layers=1, **{
        "attention.head_count": [1, 0, 1], "attention.head_count_kv": [1, 0, 1],
        "swiglu_clamp_exp": [0.0, 4.0, 4.0], "swiglu_clamp_shexp": [0.0, 5.0, 5.0]})
    extra = {name: TensorInfo(name, "F32", shape, np.zeros(shape, np.float32), 4 * int(np.prod(shape)))
             for name, shape in (("blk.2.nextn.eh_proj.weight", (128, 256)), ("blk.2.nextn.enorm.weight", (128,)),
                                 ("blk.2.nextn.hnorm.weight", (128,)), ("blk.2.layer_output_norm.weight", (128,)),
                                 ("blk.2.attn_q_a.weight", (512, 128)), ("blk.2.ffn_gate_exps.weight", (2, 192, 128)))}
    model = GGUFModel("<mtp>", meta, {**golden.gguf.tensors, **extra})
    hp = bailingmoe3.read_hparams(Keys(meta, "bailingmoe3"), 128)
    assert (hp.n_layer, hp.n_layer_all, hp.kda_layers) == (2, 3, (False, True, False))
    graph = bailingmoe3.build(Weights(model, GraphBuilder()), hp, golden.n_ctx, True)
    assert set(graph.params) == set(golden.graph.params)
    stray = GGUFModel("<stray>", meta, {**model.tensors, "blk.1.stray.weight": extra["blk.2.nextn.enorm.weight"]})
    with pytest.raises(ModelError, match="unexpected tensors for bailingmoe3: blk.1.stray.weight"):
        bailingmoe3.build(Weights(stray, GraphBuilder()), hp, golden.n_ctx, True)


@needs_golden
@pytest.mark.parametrize(("changes", "message"), [
    ({"kda.safe_gate": False}, "safe_gate false is not supported"),
    ({"kda.gate_lower_bound": 0.5}, "gate_lower_bound must be negative"),
    ({"expert_gating_func": 3}, "expert_gating_func 3 is not supported"),
    ({"expert_group_count": 4}, "grouped expert selection"),
    ({"rope.scaling.type": "yarn"}, "YaRN"),
    ({"nextn_predict_layers": 2}, "must be below block_count"),
    ({"swiglu_clamp_exp": [0.0, 4.0, 1.0]}, "swiglu_clamp_exp must be a number or 2 numbers"),
    ({"attention.key_length": 500}, r"must be kv_lora_rank \+ rope"),
    ({"attention.head_count": [0, 1]}, "head_count of layer 0 must be positive"),
])
def test_refusals_are_one_line(golden: LoadedModel, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelError, match=message) as err:
        bailingmoe3.read_hparams(Keys(_metadata(golden, **changes), "bailingmoe3"), 128)
    assert "\n" not in str(err.value)


@needs_golden
def test_safe_gate_defaults_to_true(golden: LoadedModel) -> None:
    """llama.cpp's in-process test deletes kda.safe_gate to check its default."""
    meta = {k: v for k, v in golden.gguf.metadata.items() if k != "bailingmoe3.kda.safe_gate"}
    assert bailingmoe3.read_hparams(Keys(meta, "bailingmoe3"), 128).kda.gate_lower_bound == -5.0
