"""minimax-01 end to end: llama.cpp's golden through the float64 interpreter
(tests/test_interpreter_goldens.py) and `ggufc eval` (tests/test_goldens.py) in all three feeding modes;
lightning attention's block form against the token-by-token recurrence it computes (whatever the block
split), llama.cpp's slopes and decay scales; the compiled lightning kernel against its reference over
carried state (and the `lightning_attention` rows of tests/test_codegen_ops.py); a prompt longer than
llama.cpp's 512-token ubatch fed in its ubatches, whatever the checkpoints, and cut back; the decode
step's kernels fused and unfused; the layer pattern and what is refused. Its state layout:
tests/test_arch_goldens.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm

from ggufc.codegen.families import linear_attention as LA
from ggufc.codegen.target import resolve_target
from ggufc.frontend.hparams import Keys, ModelError
from ggufc.frontend.load import LoadedModel, load_model
from ggufc.ir import linear_attention as R
from ggufc.passes.pipeline import run_pipeline
from ggufc.runtime import Session
from ggufc.runtime.context import split_points
from tests.support.arch_models import golden_fixture, interpret_float64
from tests.support.goldens import GOLDEN, skip_without_goldens
from tests.support.sparse_indexers import decode_kernel_calls, nmse

FIXTURE = GOLDEN / "fixtures" / "minimax-01-moe.gguf"
needs_golden = skip_without_goldens(FIXTURE)
golden = golden_fixture("minimax-01-moe")


# ---------------------------------------------------------------------------------------------
# llama.cpp's golden


@needs_golden
def test_hparams_of_the_llama_cpp_fixture(golden: LoadedModel) -> None:
    hp = golden.hparams
    assert hp.linear == (True, False) and (hp.n_head, hp.head_dim, hp.n_rot) == (2, 128, 128)
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff) == (2, 2, 384)
    assert hp.residual_scale == pytest.approx(3.5565588, rel=1e-7)


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
# a long prompt in llama.cpp's ubatches

UBATCH = 512  # llama.cpp's default n_ubatch, ggufc's default max_chunk
LONG_CTX = 1024


def test_split_points_at_ubatch_multiples() -> None:
    """A split-dependent model's prompt is cut at multiples of the ubatch only (checkpoint interval
    or not), and still one token per call where rollback copies are kept."""
    assert split_points(40, 1000, UBATCH, 16, 1040, UBATCH) == [512, 1024, 1040]
    assert split_points(0, 700, UBATCH, 64, 697, UBATCH) == [512, 697, 698, 699, 700]
    assert split_points(40, 100, UBATCH, 64, 140) == [64, 128, 140]


@pytest.fixture(scope="module")
def long_artifact(compile_cache: Path) -> Path:
    from ggufc.driver.models import cached_artifact_dir, compiled_session, existing_session, resolve_model

    if not FIXTURE.exists():
        pytest.skip("llama.cpp goldens absent")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GGUFC_CACHE", str(compile_cache))
        model = resolve_model(str(FIXTURE), n_ctx=LONG_CTX)
        (existing_session(model) or compiled_session(model)).close()
        return cached_artifact_dir(model.path, model.target, model.n_ctx)


def _long_prompt(n: int) -> np.ndarray:
    return np.random.default_rng(5).integers(0, 128, n).astype(np.int32)


def _fed(artifact: Path, parts: list[np.ndarray], interval: int = 64) -> tuple[Session, np.ndarray]:
    session = Session(artifact, checkpoint_interval=interval)
    return session, np.concatenate([session.forward(p, all_logits=True) for p in parts])


@needs_golden
def test_long_prompt_runs_in_llama_cpps_ubatches(long_artifact: Path) -> None:
    """700 tokens in one forward (checkpoints every 64) give, bit for bit, the logits of the calls
    llama.cpp makes, [0, 512) and [512, 700), not those of 64-token calls; they equal the float64
    interpreter run in 512-token blocks to llama.cpp's golden bar; a forward starting at 40 is cut
    at 512 too."""
    tokens = _long_prompt(700)
    session, one = _fed(long_artifact, [tokens])
    assert session.manifest["ubatch"] == UBATCH
    assert session.checkpoint_bytes == 2 * 2 * 128 * 128 * 4  # copies at 512 and 700, not every 64
    assert np.array_equal(one, _fed(long_artifact, [tokens[:512], tokens[512:]])[1])
    assert not np.array_equal(one, _fed(long_artifact, np.split(tokens, range(64, 700, 64)))[1])
    model = load_model(FIXTURE, n_ctx=LONG_CTX)
    assert nmse(one, interpret_float64(model, model.graph, tokens, UBATCH)) < 1e-10
    later = _fed(long_artifact, [tokens[:40], tokens[40:]])[1]
    assert np.array_equal(later, _fed(long_artifact, [tokens[:40], tokens[40:512], tokens[512:]])[1])


@needs_golden
def test_long_prompt_cut_back_equals_fresh(long_artifact: Path) -> None:
    """Cut a 700-token context back to 600 (restored from the checkpoint at 512, 88 tokens replayed
    as one call) and to 300 (from 0), continue: the logits equal a fresh one-shot run's (the calls
    differ, so to rounding: NMSE < 1e-12), the recurrent state too."""
    tokens = _long_prompt(760)
    session, _ = _fed(long_artifact, [tokens[:700]])
    for keep in (600, 300):
        session.truncate(keep)
        got = session.forward(tokens[keep:760], all_logits=True)
        fresh, want = _fed(long_artifact, [tokens[:760]])
        assert nmse(got, want[keep:]) < 1e-12
        s, f = session.state("lightning_state.0"), fresh.state("lightning_state.0")
        assert float(np.max(np.abs(s - f))) <= 1e-5 * float(np.max(np.abs(f)))
        session.truncate(700)
    assert (session.stats.checkpoint_restores, session.stats.replayed_tokens) == (4, 88 + 100 + 300 + 188)


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
