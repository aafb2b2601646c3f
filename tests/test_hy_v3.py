"""hy_v3 end to end: llama.cpp's golden through `ggufc eval` (compiled kernels) in all three feeding
modes (rows of tests/test_goldens.py), `ggufc inspect` (tests/test_arch_goldens.py; the float64
interpreter's rows: tests/test_interpreter_goldens.py); the routing family's fusion on it (hit counts,
fused = unfused = decomposed, switchable); the project's fixture, whose leading dense block, 4 experts
with 2 used and a large `exp_probs_b` exercise what the golden (2 experts, both used, no
renormalisation) cannot: the selection bias, the renormalisation and the weights scale.

Compiled against the interpreter on the project's fixture (one-shot, chunked, decode, Q8_0):
tests/test_models_compiled.py; the routing kernels against their references: the `moe_routing`
rows of tests/test_codegen_ops.py.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

from ggufc.frontend.archs import hy_v3
from ggufc.frontend.hparams import Keys, ModelError
from ggufc.frontend.load import LoadedModel, load_model
from ggufc.ir.decompose import decompose
from ggufc.ir.graph import Graph
from ggufc.ir.moe_routing import MoeFFN
from ggufc.passes.pipeline import run_pipeline
from tests.support.arch_models import (
    check_fused_decomposed_and_off_match_unfused,
    golden_fixture,
    interpret_float64,
)
from tests.support.fixtures import BIASED_MOE_WEIGHTS_SCALE, write_fixture
from tests.support.goldens import GOLDEN, skip_without_goldens
from tests.support.sparse_indexers import decode_kernel_calls, nmse

needs_golden = skip_without_goldens(GOLDEN / "fixtures" / "hy_v3-moe.gguf")
golden = golden_fixture("hy_v3-moe")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_fixture("hy_v3", tmp_path_factory.mktemp("hy") / "m.gguf", seed=0, biases=True, scales=True)
    return load_model(path, n_ctx=32)


def project_tokens(model: LoadedModel, n: int = 24) -> np.ndarray:
    return np.random.default_rng(5).integers(0, model.hparams.n_vocab, n).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# llama.cpp's golden


@needs_golden
def test_hparams_of_the_llama_cpp_fixture(golden: LoadedModel) -> None:
    hp = golden.hparams
    assert (hp.gating, hp.weights_norm, hp.weights_scale) == ("sigmoid", False, 1.0)
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_ff_shexp) == (2, 2, 384, 192)


@needs_golden
def test_decode_kernel_count(golden: LoadedModel) -> None:
    """A decode step: 70 kernels fused (2 expert matmuls and one combine per MoE layer, the merged
    gate_up read in place), 78 with fuse_moe off (the merged tensor sliced every step), 141 unfused."""
    fused = decode_kernel_calls(golden, True)
    assert sum(fused.values()) == 70
    assert (fused["experts"], fused["swiglu_halves"], fused["shared_add"], fused["topk"]) == (4, 2, 2, 2)
    no_moe = decode_kernel_calls(golden, True, frozenset({"fuse_moe"}))
    assert no_moe["slice"] == 4 and sum(no_moe.values()) == 78
    assert sum(decode_kernel_calls(golden, False).values()) > 2 * sum(fused.values())


# ---------------------------------------------------------------------------------------------
# the routing family on hy_v3


def _moe_nodes(graph: Graph) -> list[Any]:
    return [n for n in graph.nodes if n.op == "moe_ffn"]


def test_fused_moe_is_the_routing_family_node(project: LoadedModel) -> None:
    """Layer 0 has no router: a dense block; layer 1: one moe_ffn with sigmoid gating, the
    selection bias, renormalised and scaled weights, merged gate_up and an ungated shared expert."""
    fused, stats = run_pipeline(project.graph, check=True)
    assert stats["fuse_moe"] == 1
    (node,) = _moe_nodes(fused)
    a: MoeFFN = node.attrs
    assert (a.gating, a.selection_bias, a.normalize, a.weights_scale) == ("sigmoid", True, True,
                                                                          BIASED_MOE_WEIGHTS_SCALE)
    assert (a.merged_gate_up, a.shared, a.shared_gated, a.act, a.shared_act) == (True, True, False, "swiglu",
                                                                                   "swiglu")
    assert a.expert_scales == ("down",) and a.shared_scales == ("gate", "up", "down")
    assert node.outputs[0].layer == 1


@needs_golden
def test_golden_every_layer_is_moe(golden: LoadedModel) -> None:
    fused, stats = run_pipeline(golden.graph, check=True)
    assert stats["fuse_moe"] == 2
    assert [(n.attrs.gating, n.attrs.selection_bias, n.attrs.normalize) for n in _moe_nodes(fused)] == \
        [("sigmoid", True, False)] * 2


def test_fused_decomposed_and_switched_off_match_unfused(project: LoadedModel) -> None:
    check_fused_decomposed_and_off_match_unfused(project, project_tokens(project), "fuse_moe", "moe_ffn")


def test_fusion_recognises_the_decomposition(project: LoadedModel) -> None:
    fused, _ = run_pipeline(project.graph)
    refused, _ = run_pipeline(decompose(fused, only={"moe_ffn"}))
    assert Counter(n.op for n in refused.nodes) == Counter(n.op for n in fused.nodes)
    assert [n.attrs for n in _moe_nodes(refused)] == [n.attrs for n in _moe_nodes(fused)]


def test_chunked_and_decode_equal_one_shot(project: LoadedModel) -> None:
    tokens = project_tokens(project)
    one_shot = interpret_float64(project, project.graph, tokens, 24)
    for chunk in (1, 7):
        assert nmse(interpret_float64(project, project.graph, tokens, chunk), one_shot) < 1e-20


def test_the_selection_bias_changes_the_experts(project: LoadedModel) -> None:
    """The project fixture's bias is large enough to pick other experts than the probabilities
    alone would (else the golden-less path would go untested): zeroing it moves the logits."""
    tokens = project_tokens(project)
    base = project.param_loader()

    def unbiased(p: Any) -> np.ndarray:
        arr = np.asarray(base(p))
        return np.zeros_like(arr) if p.source.endswith("exp_probs_b") else arr

    biased = interpret_float64(project, project.graph, tokens, 24)
    assert nmse(interpret_float64(project, project.graph, tokens, 24, unbiased), biased) > 1e-4


# ---------------------------------------------------------------------------------------------
# what is refused


def _keys(**extra: Any) -> Keys:
    meta = {"hy_v3.embedding_length": 64, "hy_v3.attention.head_count": 4, "hy_v3.block_count": 2,
            "hy_v3.attention.layer_norm_rms_epsilon": 1e-5, "hy_v3.context_length": 64, "hy_v3.expert_count": 4,
            "hy_v3.expert_used_count": 2, "hy_v3.expert_feed_forward_length": 32}
    return Keys({**meta, **{f"hy_v3.{k}": v for k, v in extra.items()}}, "hy_v3")


@pytest.mark.parametrize(("extra", "message"), [
    ({"expert_group_count": 4}, "grouped expert selection"),
    ({"expert_gating_func": 3}, "expert_gating_func 3"),
    ({"nextn_predict_layers": 1}, "MTP"),
    ({"expert_used_count": 5}, "expert_used_count"),
])
def test_unsupported_settings_are_refused_in_one_line(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelError, match=message) as info:
        hy_v3.read_hparams(_keys(**extra), 64)
    assert "\n" not in str(info.value)


def test_gating_defaults_and_scale() -> None:
    assert hy_v3.read_hparams(_keys(), 64).gating == "sigmoid"  # unset: hy_v3's default
    hp = hy_v3.read_hparams(_keys(expert_gating_func=4, expert_weights_scale=0.0), 64)
    assert (hp.gating, hp.weights_scale, hp.n_ff_shexp) == ("sqrt_softplus", 1.0, 32)
