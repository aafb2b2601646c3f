"""kimi-k3 end to end: llama.cpp's golden through `ggufc eval` (compiled kernels) in all three feeding
modes (rows of tests/test_goldens.py), `ggufc inspect` and its state layout (tests/test_arch_goldens.py;
the float64 interpreter's rows: tests/test_interpreter_goldens.py); KDA's key-decay delta rule
(sequential, chunked and one token at a time agree in float64, both gate forms); the cross-layer
residual attention mix against its formula with several banks, and the compiled model against the
interpreter when every layer banks (block size 1).

The KDA scan kernel against its reference: the `gated_delta_net-key` rows of
tests/test_codegen_ops.py.
"""

from __future__ import annotations

import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tvm

from ggufc.cli import main
from ggufc.codegen.families import linear_attention as LA
from ggufc.codegen.target import resolve_target
from ggufc.frontend.hyper_connections import residual_attention_mix
from ggufc.frontend.load import LoadedModel, load_model
from ggufc.ir import linear_attention as R
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.decompose import decompose
from ggufc.ir.interp import run_graph
from ggufc.ir.ref_math import rms_plain
from ggufc.passes.pipeline import run_pipeline
from tests.support.arch_models import (
    check_fused_decomposed_and_off_match_unfused,
    golden_fixture,
    interpret_float64,
)
from tests.support.goldens import GOLDEN, skip_without_goldens
from tests.support.linear_attention import worst_error_over_calls
from tests.support.op_cases import MAX_TOKENS
from tests.support.sparse_indexers import decode_kernel_calls, nmse

FIXTURE = GOLDEN / "fixtures" / "kimi-k3-moe.gguf"
needs_golden = skip_without_goldens(FIXTURE)
golden = golden_fixture("kimi-k3-moe")


# ---------------------------------------------------------------------------------------------
# llama.cpp's golden


@needs_golden
def test_hparams_of_the_llama_cpp_fixture(golden: LoadedModel) -> None:
    hp = golden.hparams
    assert hp.kda_layers == (False, True) and hp.res_block == 12 and hp.kda.gate_lower_bound == -5.0
    assert (hp.mla.n_head, hp.mla.kv_lora, hp.mla.n_rot, hp.mla.nope, hp.mla.v_head) == (1, 512, 64, 128, 128)
    assert (hp.n_latent, hp.n_ff_exp, hp.n_ff_shexp, hp.situ_beta, hp.situ_linear_beta) == (192, 192, 192, 4.0, 25.0)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ggufc-cache")


def _eval(path: Path, tokens: np.ndarray, chunk: int | None, tmp: Path) -> np.ndarray:
    """`ggufc eval` of `path` on `tokens` (`chunk` at a time; None: one call)."""
    np.save(tmp / "t.npy", tokens)
    argv = ["eval", str(path), "--tokens", str(tmp / "t.npy"), "--out", str(tmp / "o.npy")]
    assert main(argv + (["--chunk", str(chunk)] if chunk else [])) == 0
    return np.load(tmp / "o.npy")


# ---------------------------------------------------------------------------------------------
# KDA: the delta rule with one decay per key index


def _kda_inputs(gate_form: str, t: int = 19, h: int = 2, d: int = 8, seed: int = 0) -> tuple[np.ndarray, ...]:
    """float64 q, k (L2-normalised), v, the per-key decay logits of `gate_form`, beta, a state."""
    rng = np.random.default_rng(seed)
    q = R.l2_norm_ref(rng.normal(size=(t, h, d)), 1e-6)
    k = R.l2_norm_ref(rng.normal(size=(t, h, d)), 1e-6)
    v = rng.normal(size=(t, h, d))
    raw = rng.normal(size=(t, h, d))
    a = -np.exp(rng.normal(size=(h, 1)))  # ssm_a = -exp(A_log)
    if gate_form == "softplus":  # -exp(A_log) * softplus(g)
        g = np.log1p(np.exp(raw)) * a
    else:  # lower_bound * sigmoid(exp(A_log) * g), lower bound -5
        g = -5.0 / (1.0 + np.exp(raw * a))
    beta = 1.0 / (1.0 + np.exp(-rng.normal(size=(t, h))))
    state = rng.normal(size=(h, d, d)) * 0.1
    return state, q, k, v, g, beta


@pytest.mark.parametrize("gate_form", ["softplus", "lower_bound"])
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_kda_chunked_equals_recurrent(gate_form: str, chunk: int) -> None:
    state, q, k, v, g, beta = _kda_inputs(gate_form)
    s_seq, o_seq = R.gated_delta_net_ref(state, q, k, v, g, beta, "tiled", 8**-0.5)
    s_chk, o_chk = R.gated_delta_net_chunked_ref(state, q, k, v, g, beta, "tiled", 8**-0.5, chunk=chunk)
    np.testing.assert_allclose(o_chk, o_seq, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(s_chk, s_seq, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("gate_form", ["softplus", "lower_bound"])
def test_kda_one_token_at_a_time_equals_one_call(gate_form: str) -> None:
    state, q, k, v, g, beta = _kda_inputs(gate_form)
    s_all, o_all = R.gated_delta_net_ref(state, q, k, v, g, beta, "tiled", 0.5)
    s = state
    for i in range(q.shape[0]):
        s, o = R.gated_delta_net_ref(s, q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], "tiled", 0.5)
        np.testing.assert_allclose(o[0], o_all[i], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s, s_all, rtol=1e-12, atol=1e-12)


def _compiled_kda_scan(hv: int, hk: int, d: int, chunked_from: int) -> Any:
    f = LA.gated_delta_net(hv, d, d, hk, "interleaved", d**-0.5, key_decay=True, chunked_from=chunked_from)
    return tvm.compile(tvm.IRModule({"main": f}), target=resolve_target("llvm"))["main"]


@pytest.mark.parametrize("gate_form", ["softplus", "lower_bound"])
def test_kda_chunked_kernel_equals_the_float64_recurrence(gate_form: str) -> None:
    """The compiled chunked form (every call chunked) against the float64 sequential reference: 70
    tokens (a whole chunk and a partial one), then 1 and 3 more on the carried state; the compiled
    sequential form beside it for scale."""
    assert LA.CHUNKED_FROM <= MAX_TOKENS  # the -long rows of test_codegen_ops run the chunked form too
    hv, hk, d = 4, 2, 16
    kernels = {"chunked": _compiled_kda_scan(hv, hk, d, 1), "sequential": _compiled_kda_scan(hv, hk, d, 0)}
    state, q, k, v, g, beta = _kda_inputs(gate_form, t=74, h=hv, d=d, seed=3)
    q, k = q[:, ::2], k[:, ::2]  # two key heads, shared by value heads 2i and 2i+1
    errs = {}
    for name, fn in kernels.items():
        errs[name] = worst_error_over_calls(fn, state, (q, k, v, g, beta), "interleaved", d**-0.5)
    assert errs["chunked"] < 5e-6 and errs["sequential"] < 5e-6, errs


def test_kda_decays_along_the_key_axis() -> None:
    """The state M [Hv, Dv, Dk] decays column j by exp(g[j]) (llama.cpp's fused op: the key index)."""
    d = 4
    state = np.arange(d * d, dtype=np.float64).reshape(1, d, d)
    g = np.log(np.array([[[1.0, 0.5, 0.25, 0.125]]]))
    zeros = np.zeros((1, 1, d))
    new, _ = R.gated_delta_net_ref(state, zeros, zeros, zeros, g, np.zeros((1, 1)), "tiled", 1.0)
    np.testing.assert_allclose(new[0], state[0] * np.exp(g[0, 0])[None, :])
    assert not np.allclose(new[0], state[0] * np.exp(g[0, 0])[:, None])


# ---------------------------------------------------------------------------------------------
# cross-layer residual attention


def _mix_formula(bank: list[np.ndarray], cur: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    src = np.stack(bank, axis=1)  # [T, n, E]
    scores = np.concatenate([(rms_plain(src, eps) * w).sum(-1), (rms_plain(cur, eps) * w).sum(-1, keepdims=True)], 1)
    p = np.exp(scores - scores.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    return np.einsum("tc,tce->te", p[:, :-1], src) + p[:, -1:] * cur


@pytest.mark.parametrize("n_bank", [1, 3])
def test_residual_attention_mix_matches_its_formula(n_bank: int) -> None:
    t, e, eps = 5, 16, 1e-5
    rng = np.random.default_rng(n_bank)
    arrays = {f"bank{i}": rng.normal(size=(t, e)) * (i + 1) for i in range(n_bank)}
    arrays |= {"cur": rng.normal(size=(t, e)), "w": rng.normal(size=(e,))}
    b = GraphBuilder()
    vals = {n: b.input(n, a.shape, "float32") for n, a in arrays.items()}
    out = residual_attention_mix(b, [vals[f"bank{i}"] for i in range(n_bank)], vals["cur"], vals["w"], eps, "mix")
    graph = b.finish([out], {})
    feed = arrays | {"tokens": np.zeros(t, np.int32), "pos": np.int64(0)}  # the call's context sizes
    got = run_graph(graph, feed, lambda p: None, {}, dtype=np.float64).outputs[0]
    want = _mix_formula([arrays[f"bank{i}"] for i in range(n_bank)], arrays["cur"], arrays["w"], eps)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_residual_attention_mix_without_bank_is_the_stream() -> None:
    b = GraphBuilder()
    cur = b.input("cur", (3, 4), "float32")
    assert residual_attention_mix(b, [], cur, b.input("w", (4,), "float32"), 1e-5, "mix") is cur


@pytest.mark.slow  # a second compile of the golden's weights; the wide project model covers 3 banks by default
@needs_golden
@pytest.mark.parametrize("chunk", [None, 5])
def test_every_layer_banked_compiled_matches_interpreter(chunk: int | None, tmp_path: Path, cache: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """attn_res.block_size 1: both layers bank, the mixes read 1 and 2 banks (the output mix too);
    the residual restarts after each layer's attention. The logits move far from the golden's."""
    import gguf

    path = tmp_path / "kimi-bs1.gguf"
    shutil.copy(FIXTURE, path)
    reader = gguf.GGUFReader(path, "r+")
    reader.fields["kimi-k3.attn_res.block_size"].parts[-1][0] = 1
    del reader
    model = load_model(path)
    assert model.hparams.res_block == 1
    tokens = np.load(GOLDEN / "logits" / "kimi-k3-moe.npz")["tokens"][:24].astype(np.int32)
    ref = interpret_float64(model, model.graph, tokens, 24)
    gold = np.load(GOLDEN / "logits" / "kimi-k3-moe.npz")["logits_prefill"][:24]
    assert nmse(ref, gold) > 1e-3  # the banks change the model
    monkeypatch.setenv("GGUFC_CACHE", str(cache))
    assert nmse(_eval(path, tokens, chunk, tmp_path), ref) < 1e-10
    assert math.isfinite(float(np.abs(ref).max()))


# ---------------------------------------------------------------------------------------------
# fusions


@needs_golden
def test_fused_decomposed_and_switched_off_match_unfused(golden: LoadedModel) -> None:
    tokens = np.load(GOLDEN / "logits" / "kimi-k3-moe.npz")["tokens"][:16]
    fused, stats = check_fused_decomposed_and_off_match_unfused(golden, tokens, "fuse_hc", "res_mix")
    assert stats["fuse_hc"] == 4 and sum(n.op == "res_mix" for n in fused.nodes) == 4
    (moe,) = [n for n in fused.nodes if n.op == "moe_ffn"]
    assert (moe.attrs.latent, moe.attrs.latent_norm, moe.attrs.act, moe.attrs.shared_act) == (True, True, "situ",
                                                                                                "situ")
    refused, _ = run_pipeline(decompose(fused, only={"res_mix"}))
    assert Counter(n.op for n in refused.nodes) == Counter(n.op for n in fused.nodes)


@needs_golden
def test_onnxruntime_runs_kimi_k3_like_the_interpreter(golden: LoadedModel, tmp_path: Path) -> None:
    """Standard-ONNX export (the KDA scan decays along the key axis, res_mix spelled in primitives)."""
    from ggufc.ir.onnx_export import to_onnx
    from tests.support import onnx_runs as TO

    graph, load, tokens = golden.graphs["prefill_all"], golden.param_loader(), TO.prompt_tokens(golden)
    to_onnx(graph, tmp_path / "std.onnx", standard=True)
    want = TO.interpret_outputs(graph, load, tokens)
    got = TO.onnxruntime_outputs(tmp_path / "std.onnx", graph, load, tokens)
    for call_want, call_got in zip(want, got, strict=True):
        for w, g in zip(call_want, call_got, strict=True):
            assert float(np.max(np.abs(g - w))) <= TO.ORT_TOLERANCE * (float(np.max(np.abs(w))) or 1.0)


# ---------------------------------------------------------------------------------------------
# state and decode step


@needs_golden
def test_decode_kernel_count(golden: LoadedModel) -> None:
    """A decode step: 76 kernels fused (4 res_mix, one KDA scan, 3 convs), 116 with fuse_hc off,
    260 unfused."""
    fused = decode_kernel_calls(golden, True)
    assert sum(fused.values()) == 76
    assert (fused["res_mix"], fused["gated_delta_net"], fused["ssm_conv"], fused["experts"]) == (4, 1, 3, 3)
    assert sum(decode_kernel_calls(golden, True, frozenset({"fuse_hc"})).values()) == 116
    assert sum(decode_kernel_calls(golden, False).values()) == 260


# ---------------------------------------------------------------------------------------------
# the two gate forms as the frontend spells them, and what is refused


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_gate_forms(lower_bound: float | None) -> None:
    from ggufc.frontend.linear_attention import KdaDims, kda_gate

    rng = np.random.default_rng(3)
    g, a = rng.normal(size=(4, 2, 3)) * 3, -np.exp(rng.normal(size=(2, 1)))
    b = GraphBuilder()
    gv, av = b.input("g", g.shape, "float32"), b.input("a", a.shape, "float32")
    graph = b.finish([kda_gate(b, KdaDims(2, 3, 4, lower_bound), gv, av)], {})
    feed = {"g": g, "a": a, "tokens": np.zeros(4, np.int32), "pos": np.int64(0)}
    got = run_graph(graph, feed, lambda p: None, {}, dtype=np.float64).outputs[0]
    a_log = np.log(-a)
    want = (-np.exp(a_log) * np.log1p(np.exp(g)) if lower_bound is None
            else lower_bound / (1.0 + np.exp(-np.exp(a_log) * g)))
    np.testing.assert_allclose(got, want, rtol=1e-12)


def _keys(**extra: object) -> object:
    from ggufc.frontend.hparams import Keys

    base = {"block_count": 2, "attention.head_count": [1, 0], "attention.head_count_kv": [1, 0],
            "rope.dimension_count": 8, "attention.key_length_mla": 24, "attention.kv_lora_rank": 16,
            "attention.key_length": 24, "attention.value_length_mla": 16, "attention.q_lora_rank": 16,
            "kda.head_dim": 8, "ssm.conv_kernel": 4, "expert_count": 4, "expert_used_count": 2,
            "expert_feed_forward_length": 32, "expert_shared_count": 1, "expert_gating_func": 2,
            "attn_res.block_size": 1, "activation.situ_beta": 4.0, "activation.situ_linear_beta": 25.0,
            "embedding_length": 32, "context_length": 64, "attention.layer_norm_rms_epsilon": 1e-5}
    return Keys({f"kimi-k3.{k}": v for k, v in {**base, **extra}.items()}, "kimi-k3")


@pytest.mark.parametrize(("extra", "message"), [
    ({"expert_gating_func": 1}, "expert_gating_func 1 is not supported"),
    ({"expert_group_count": 4}, "grouped expert selection"),
    ({"nextn_predict_layers": 1}, "multi-token prediction"),
    ({"attention.head_count_kv": [1, 0, 0]}, "has 3 entries, expected 2"),
    ({"attention.key_length": 30}, r"must be kv_lora_rank \+ rope"),
    ({"expert_used_count": 5}, "expert_used_count"),
])
def test_refusals_are_one_line(extra: dict[str, object], message: str) -> None:
    from ggufc.frontend.archs import kimi_k3
    from ggufc.frontend.hparams import ModelError

    with pytest.raises(ModelError, match=message) as err:
        kimi_k3.read_hparams(_keys(**extra), 64)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_hparams_without_lower_bound_select_the_softplus_gate() -> None:
    from ggufc.frontend.archs import kimi_k3

    hp = kimi_k3.read_hparams(_keys(), 64)  # type: ignore[arg-type]
    assert hp.kda.gate_lower_bound is None and hp.kda_layers == (False, True) and hp.weights_scale == 1.0
    assert kimi_k3.read_hparams(_keys(**{"kda.gate_lower_bound": -5.0}), 64).kda.gate_lower_bound == -5.0  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# a wider project model: what llama.cpp's fixture (one head, one bank) leaves out


def write_wide_kimi(path: Path, seed: int = 0) -> Path:
    """3 layers (MLA with a direct `attn_q`, then two KDA), 2 heads, the softplus gate (no lower
    bound), every layer banked (block size 1), 4 experts with 2 used, renormalised and scaled
    weights, latent experts without the routed norm."""
    import gguf

    E, H, dh, conv, KVL, R, nope, Dv, X, F, L, FF, V = 64, 2, 16, 4, 32, 8, 16, 16, 4, 32, 48, 96, 96
    inner = H * dh
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "kimi-k3")
    a = "kimi-k3"
    for key, val in {"context_length": 64, "embedding_length": E, "block_count": 3, "feed_forward_length": FF,
                     "expert_count": X, "expert_used_count": 2, "expert_feed_forward_length": F,
                     "expert_shared_count": 1, "expert_gating_func": 2, "expert_latent_length": L,
                     "leading_dense_block_count": 1, "attn_res.block_size": 1, "attention.head_count": H,
                     "attention.key_length": KVL + R, "rope.dimension_count": R, "attention.kv_lora_rank": KVL,
                     "attention.key_length_mla": nope + R, "attention.value_length_mla": Dv, "kda.head_dim": dh,
                     "ssm.conv_kernel": conv}.items():
        w.add_uint32(f"{a}.{key}", val)
    for key, fval in {"attention.layer_norm_rms_epsilon": 1e-5, "activation.situ_beta": 4.0,
                      "activation.situ_linear_beta": 25.0, "expert_weights_scale": 2.5}.items():
        w.add_float32(f"{a}.{key}", fval)
    w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_array(f"{a}.attention.head_count_kv", [1, 0, 0])
    w.add_tokenizer_model("none")

    def t(name: str, *shape: int, scale: float = 0.1) -> None:
        w.add_tensor(name, (rng.normal(size=shape) * scale).astype(np.float32))

    t("token_embd.weight", V, E, scale=1.0)
    t("output_norm.weight", E)
    t("output.weight", V, E)
    t("output_res_score.weight", E)
    for il in range(3):
        p = f"blk.{il}"
        for n in ("attn_norm", "ffn_norm", "attn_res_score", "ffn_res_score"):
            t(f"{p}.{n}.weight", E)
        if il == 0:
            t(f"{p}.attn_q.weight", H * (nope + R), E)
            t(f"{p}.attn_kv_a_mqa.weight", KVL + R, E)
            t(f"{p}.attn_kv_a_norm.weight", KVL)
            t(f"{p}.attn_k_b.weight", H, KVL, nope)
            t(f"{p}.attn_v_b.weight", H, Dv, KVL)
            t(f"{p}.attn_gate.weight", H * Dv, E)
            t(f"{p}.attn_output.weight", E, H * Dv)
            for n, s in (("gate", (FF, E)), ("up", (FF, E)), ("down", (E, FF))):
                t(f"{p}.ffn_{n}.weight", *s)
            continue
        for n in "qkv":
            t(f"{p}.attn_{n}.weight", inner, E)
            t(f"{p}.ssm_conv1d_{n}.weight", inner, 1, conv, scale=0.5)
        t(f"{p}.ssm_f_a.weight", dh, E)
        t(f"{p}.ssm_f_b.weight", inner, dh)
        t(f"{p}.ssm_beta.weight", H, E)
        w.add_tensor(f"{p}.ssm_a", -np.exp(rng.normal(size=H)).astype(np.float32))
        t(f"{p}.ssm_dt.bias", inner)
        t(f"{p}.ssm_g.weight", inner, E)
        t(f"{p}.ssm_norm.weight", dh)
        t(f"{p}.attn_output.weight", E, inner)
        t(f"{p}.ffn_gate_inp.weight", X, E)
        t(f"{p}.exp_probs_b.bias", X, scale=1.0)
        t(f"{p}.ffn_gate_exps.weight", X, F, L)
        t(f"{p}.ffn_up_exps.weight", X, F, L)
        t(f"{p}.ffn_down_exps.weight", X, L, F)
        t(f"{p}.ffn_routed_down.weight", L, E)
        t(f"{p}.ffn_routed_up.weight", E, L)
        for n, s in (("gate", (F, E)), ("up", (F, E)), ("down", (E, F))):
            t(f"{p}.ffn_{n}_shexp.weight", *s)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_wide_model_compiled_matches_interpreter(chunk: int | None, tmp_path_factory: pytest.TempPathFactory,
                                                 tmp_path: Path, cache: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Two heads (per-head k_b/v_b, beta rows, A per head), three banks, the softplus gate, routing
    with 2 of 4 experts: the compiled model (one-shot, decode, chunks of 7) against the float64
    interpreter run one-shot."""
    folder = tmp_path_factory.getbasetemp() / "kimi-wide"
    folder.mkdir(exist_ok=True)
    path = folder / "wide.gguf"
    if not path.exists():
        write_wide_kimi(path)
    model = load_model(path)
    assert model.hparams.kda.gate_lower_bound is None and model.hparams.kda_layers == (False, True, True)
    tokens = np.random.default_rng(1).integers(0, 96, 20).astype(np.int32)
    ref = interpret_float64(model, model.graph, tokens, 20)
    assert nmse(interpret_float64(model, model.graph, tokens, 3), ref) < 1e-20 and float(np.std(ref)) > 0.05
    monkeypatch.setenv("GGUFC_CACHE", str(cache))
    assert nmse(_eval(path, tokens, chunk, tmp_path), ref) < 1e-10
