"""minimax-01 end to end: llama.cpp's golden through the float64 interpreter
(tests/test_interpreter_goldens.py) and `ggufc eval` (tests/test_goldens.py) in all three feeding modes;
lightning attention's block form against the token-by-token recurrence it computes (whatever the block
split), llama.cpp's slopes and decay scales; the compiled lightning kernel against its reference over
carried state (and the `lightning_attention` rows of tests/test_codegen_ops.py); the decode step's
kernels fused and unfused; the layer pattern and what is refused."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from ggufc.codegen.families import linear_attention as LA
from ggufc.codegen.target import resolve_target
from ggufc.frontend.hparams import Keys, ModelError
from ggufc.frontend.load import LoadedModel, load_model
from ggufc.ir import linear_attention as R
from ggufc.passes.pipeline import run_pipeline
from tests.support.goldens import GOLDEN
from tests.support.sparse_probes import decode_kernel_calls

FIXTURE = GOLDEN / "fixtures" / "minimax-01-moe.gguf"
needs_golden = pytest.mark.skipif(not FIXTURE.exists(), reason=f"llama.cpp goldens not found at {GOLDEN}")


@pytest.fixture(scope="module")
def golden() -> LoadedModel:
    if not FIXTURE.exists():
        pytest.skip("llama.cpp goldens absent")
    return load_model(FIXTURE)


# ---------------------------------------------------------------------------------------------
# llama.cpp's golden


@needs_golden
def test_hparams_of_the_llama_cpp_fixture(golden: LoadedModel) -> None:
    hp = golden.hparams
    assert hp.linear == (True, False) and (hp.n_head, hp.head_dim, hp.n_rot) == (2, 128, 128)
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff) == (2, 2, 384)
    assert hp.residual_scale == pytest.approx(3.5565588, rel=1e-7)


@needs_golden
def test_state_layout(golden: LoadedModel) -> None:
    """Layer 0 (lightning): S [H, Dk, Dv], whatever the context; layer 1 (softmax): the KV cache."""
    states = {n: tuple(int(d) for d in s.value.shape) for n, s in golden.graph.states.items()}
    n_ctx = golden.n_ctx
    assert states == {"lightning_state.0": (2, 128, 128), "cache_k.1": (n_ctx, 2, 128), "cache_v.1": (n_ctx, 2, 128)}


@needs_golden
def test_decode_kernel_count(golden: LoadedModel) -> None:
    """A decode step: 51 kernels fused (one lightning scan, its joint-head gated norm, 5 RMSNorms,
    the two MoEs' softmax / top-k / renormalisation / experts), 107 unfused."""
    fused = decode_kernel_calls(golden, True)
    unfused = decode_kernel_calls(golden, False)
    assert fused["lightning_attention"] == unfused["lightning_attention"] == 1
    assert (fused["rms_norm_gated"], fused["rms_norm"], fused["moe_normalize"], fused["experts"]) == (1, 5, 2, 6)
    assert sum(fused.values()) == 51
    assert sum(unfused.values()) == 107


@needs_golden
def test_fusion_rules_fire(golden: LoadedModel) -> None:
    """The gated joint-head norm of the lightning layer is the family's rms_norm_gated rule; the
    other hits are the shared rules (6 RMSNorms, 2 MoEs with their SwiGLU and softmax)."""
    hits = {k: v for k, v in run_pipeline(golden.graph)[1].items() if v}
    assert hits == {"fuse_rms_norm": 6, "fuse_gated_norm": 1, "fuse_swiglu": 2, "fuse_softmax": 2, "fuse_moe": 2,
                    "fuse_elementwise": 7}


# ---------------------------------------------------------------------------------------------
# lightning attention: block form = recurrence


def _inputs(t: int, h: int = 3, dk: int = 8, dv: int = 6, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(h, dk, dv)) * 0.3, rng.normal(size=(t, h, dk)), rng.normal(size=(t, h, dk)),
            rng.normal(size=(t, h, dv)))


def _recurrence(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, slopes: tuple[float, ...],
                layer_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """S_t = e^(-s*slope) S_(t-1) + k_t v_t^T, o_t = q_t S_t, one token at a time in float64."""
    lam = np.exp(-np.asarray(slopes) * layer_scale)[:, None, None]
    s, out = state.copy(), np.zeros(v.shape)
    for t in range(q.shape[0]):
        s = lam * s + k[t][:, :, None] * v[t][:, None, :]
        out[t] = np.einsum("hi,hij->hj", q[t], s)
    return s, out


@pytest.mark.parametrize("splits", [(19,), (1,) * 19, (7, 7, 5), (2, 16, 1)])
def test_block_form_equals_the_recurrence(splits: tuple[int, ...]) -> None:
    """Whatever the calls (blocks), the outputs and carried state are the recurrence's (float64 sums;
    the decay factors are float32 as llama.cpp makes them, so they agree to float32 rounding of the
    decays, 1e-6 of the largest value); the split changes only rounding, which is why the compiled
    model follows llama.cpp's calls."""
    slopes, s = R.lightning_slopes(3), R.lightning_layer_scale(1, 4)
    state, q, k, v = _inputs(sum(splits))
    want_s, want_o = _recurrence(state, q, k, v, slopes, s)
    got_s, outs, t0 = state, [], 0
    for n in splits:
        got_s, o = R.lightning_attention_ref(got_s, q[t0 : t0 + n], k[t0 : t0 + n], v[t0 : t0 + n], slopes, s)
        outs.append(o)
        t0 += n
    for got, want in ((np.concatenate(outs), want_o), (got_s, want_s)):
        assert float(np.max(np.abs(got - want))) < 1e-6 * float(np.max(np.abs(want)))


def test_slopes_and_layer_scales_as_llama_cpp() -> None:
    """2^(-8/H) ratios: H 2 gives 1/16, 1/256; H 64 (MiniMax-Text-01) 2^(-(h+1)/8); the last layer's
    decays are nearly off (1e-5)."""
    assert R.lightning_slopes(2) == (0.0625, 0.00390625)
    sl64 = R.lightning_slopes(64)
    np.testing.assert_allclose(sl64, 2.0 ** (-(np.arange(64) + 1) / 8), rtol=1e-6)
    assert all(np.float32(x) == x for x in sl64)
    assert R.lightning_layer_scale(0, 80) == np.float32(1.00001)
    assert R.lightning_layer_scale(79, 80) == np.float32(1e-5)


def test_compiled_kernel_equals_the_reference_over_carried_state() -> None:
    """The CPU kernel against the float64 reference: calls of 40, 1, 7 and 1 tokens on one state."""
    h, dk, dv = 3, 16, 8
    slopes, s = R.lightning_slopes(h), R.lightning_layer_scale(0, 2)
    f = tvm.compile(LA.lightning_attention(h, dk, dv, slopes, s), target=resolve_target("llvm"))
    state, q, k, v = _inputs(49, h, dk, dv, seed=2)
    s_ref, s_dev = state, tvm.runtime.tensor(state.astype(np.float32))
    worst, t0 = 0.0, 0
    for n in (40, 1, 7, 1):
        part = [x[t0 : t0 + n] for x in (q, k, v)]
        s_ref, o_ref = R.lightning_attention_ref(s_ref, *part, slopes, s)
        out = tvm.runtime.tensor(np.zeros(o_ref.shape, np.float32))
        f(s_dev, *(tvm.runtime.tensor(x.astype(np.float32)) for x in part), out)
        worst = max(worst, float(np.max(np.abs(out.numpy() - o_ref)) / np.max(np.abs(o_ref))),
                    float(np.max(np.abs(s_dev.numpy() - s_ref)) / np.max(np.abs(s_ref))))
        t0 += n
    assert worst < 1e-5


# ---------------------------------------------------------------------------------------------
# layer pattern and refusals


def _keys(**extra: object) -> Keys:
    """`extra` sets keys; a value of None removes one."""
    base = {"block_count": 9, "embedding_length": 32, "attention.head_count": 2, "attention.key_length": 16,
            "feed_forward_length": 48, "expert_count": 4, "expert_used_count": 2, "residual_scale": 2.0,
            "attention.layer_norm_rms_epsilon": 1e-5, "context_length": 64}
    keys = {k: v for k, v in {**base, **extra}.items() if v is not None}
    return Keys({f"minimax-01.{k}": v for k, v in keys.items()}, "minimax-01")


def test_layer_pattern_defaults_to_interval_8() -> None:
    from ggufc.frontend.archs import minimax_01

    hp = minimax_01.read_hparams(_keys(), 64)
    assert hp.linear == (True,) * 7 + (False, True)
    assert minimax_01.read_hparams(_keys(full_attention_interval=3), 64).linear == (True, True, False) * 3


@pytest.mark.parametrize(("extra", "message"), [
    ({"block_count": 1}, "one lightning layer"),
    ({"residual_scale": None}, "residual_scale"),
    ({"attention.value_length": 8}, "value_length"),
    ({"expert_count": 0}, "expert_count"),
])
def test_refusals(extra: dict[str, object], message: str) -> None:
    from ggufc.frontend.archs import minimax_01

    with pytest.raises(ModelError, match=message):
        minimax_01.read_hparams(_keys(**extra), 64)
