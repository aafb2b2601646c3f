"""What the newer architectures' tests check alike on llama.cpp's goldens, one row per golden: `ggufc
inspect` naming the architecture and its fusions' hit counts, the states a model keeps per sequence.

An architecture's own test file keeps what is particular to it (its hyper-parameters, fusions,
selections, kernels of a decode step, refusals); `ggufc eval` against the same goldens is
test_goldens.py, the float64 interpreter test_interpreter_goldens.py, the sparse architectures' shared
checks test_sparse_architectures.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ggufc.cli import main
from ggufc.frontend.load import load_model
from tests.support.arch_models import DSA_SPARSE_TOP_K, MINIMAX_M3_SPARSE_TOP_K
from tests.support.goldens import GOLDEN, skip_without_goldens, with_metadata


class Inspected:
    """A golden's .gguf (the base fixture, or a copy with the variant's metadata) and the lines its
    `ggufc inspect` report must contain."""

    def __init__(self, base: str, lines: tuple[str, ...], changes: dict[str, str] | None = None):
        self.base, self.lines, self.changes = base, lines, changes or {}


INSPECTED = {
    "minimax-m3-moe-sparse": Inspected("minimax-m3-moe", ("fuse_indexer: 2", "fuse_moe: 2"),
                                       {"minimax-m3.attention.indexer.top_k": str(MINIMAX_M3_SPARSE_TOP_K)}),
    "qwen4exp-moe-sparse": Inspected("qwen4exp-moe", ("fuse_hc: 9", "fuse_indexer: 2", "fuse_moe: 2"),
                                     {"qwen4exp.attention.indexer.top_k": "4"}),
    # the indexer attention rewrite
    "glm-dsa-moe-F16-sparse": Inspected("glm-dsa-moe-F16", ("architecture: glm-dsa (supported)",
                                                            "  fuse_indexer: 2", "  fuse_moe: 1"),
                                        {"glm-dsa.attention.indexer.top_k": str(DSA_SPARSE_TOP_K)}),
    "deepseek4-moe-F16-sparse": Inspected("deepseek4-moe-F16", ("deepseek4", "fuse_hc: 17", "fuse_moe: 4",
                                                                "fuse_compressor_pool: 3"),
                                          {"deepseek4.attention.indexer.top_k": "4"}),
    "hy_v3-moe": Inspected("hy_v3-moe", ("architecture: hy_v3 (supported)", "fuse_moe: 2")),
    # four residual-attention mixes (layer 0's attention mix has an empty bank), one latent MoE
    "kimi-k3-moe": Inspected("kimi-k3-moe", ("architecture: kimi-k3 (supported)", "fuse_hc: 4", "fuse_moe: 1")),
    "bailingmoe3-moe": Inspected("bailingmoe3-moe", ("architecture: bailingmoe3 (supported)", "fuse_moe: 1")),
}


@skip_without_goldens()
@pytest.mark.parametrize("name", list(INSPECTED))
def test_inspect_lists_the_fusions(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    row = INSPECTED[name]
    path = GOLDEN / "fixtures" / f"{row.base}.gguf"
    if row.changes:
        path = with_metadata(path, tmp_path / f"{name}.gguf", row.changes)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert all(line in out for line in row.lines), [line for line in row.lines if line not in out]


_KDA_LAYER_1 = {"conv_state_q.1": (128, 3), "conv_state_k.1": (128, 3), "conv_state_v.1": (128, 3),
                "ssm_state.1": (1, 128, 128)}
STATES = {
    # layer 0 (lightning): S [H, Dk, Dv], whatever the context; layer 1 (softmax): the KV cache
    "minimax-01-moe": {"lightning_state.0": (2, 128, 128), "cache_k.1": (256, 2, 128), "cache_v.1": (256, 2, 128)},
    # MLA layer 0: one [kv_lora | rope] = 576-float row per token; KDA layer 1: three conv histories
    # [d_inner, d_conv - 1] and the recurrent state [H, dh(v), dh(k)], per sequence
    "kimi-k3-moe": {"cache_latent.0": (256, 1, 576), **_KDA_LAYER_1},
    "bailingmoe3-moe": {"cache_latent.0": (256, 1, 576), **_KDA_LAYER_1},
}


@skip_without_goldens()
@pytest.mark.parametrize("name", list(STATES))
def test_state_layout(name: str) -> None:
    """The states of the golden in a 256-cell context, by name and shape."""
    model = load_model(GOLDEN / "fixtures" / f"{name}.gguf")
    assert model.n_ctx == 256
    assert {n: tuple(int(d) for d in s.value.shape) for n, s in model.graph.states.items()} == STATES[name]
