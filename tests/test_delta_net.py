"""The gated delta-net family (qwen35, qwen3next): the spec against llama.cpp's facts, and the
compiled kernels against llama.cpp's logits.

* spec: the head-sharing rules are ggml's repeats, the chunked (WY) form equals the sequential
  recurrence, the conv carries its history across calls, the IMROPE table is the §0.3 formula;
* goldens: llama.cpp's logits for its own qwen35-dense / qwen3next-moe fixtures, through the
  compiled kernels (passes on) in all three feeding modes, within NMSE 1e-6;
* chunking: chunked prefill (1, 7, 64 tokens a call) equals one-shot prefill, in the float64
  interpreter (NMSE <= 1e-9) and in the compiled float32 kernels;
* passes: the graph with fusions on, off and decomposed agree, interpreted and compiled.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import tvm

from ggufc.codegen.build import Built, kernel_weights, weight_key
from ggufc.codegen.families import linear_attention as LA
from ggufc.codegen.target import resolve_target
from ggufc.codegen.tvm_util import to_tvm
from ggufc.driver.stages import build_model
from ggufc.frontend.hparams import imrope_components, rope_table
from ggufc.frontend.load import LoadedModel, load_model
from ggufc.ir import linear_attention as R
from ggufc.ir.decompose import decompose
from ggufc.ir.graph import Graph
from ggufc.ir.interp import init_state, run_graph
from ggufc.ir.verify import verify
from ggufc.passes.pipeline import run_pipeline
from tests.support import ggml_x86 as G
from tests.support import int8_isas as I
from tests.support.goldens import GOLDEN, skip_without_goldens
from tests.support.linear_attention import worst_error_over_calls

FIXTURES = ["qwen35-dense", "qwen3next-moe"]
MODES = {64: "logits_prefill", 1: "logits_decode", 7: "logits_chunk7"}
needs_goldens = skip_without_goldens()


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((a - b) ** 2) / np.mean(b**2))


# ---------------------------------------------------------------------------------------------
# the spec against llama.cpp's facts (docs/arch/qwen-family.md §0.3, §4)


def _gdn_inputs(rng: np.random.Generator, t: int, hk: int, hv: int, d: int) -> tuple[np.ndarray, ...]:
    q = R.l2_norm_ref(rng.standard_normal((t, hk, d)), 1e-6)
    k = R.l2_norm_ref(rng.standard_normal((t, hk, d)), 1e-6)
    v = rng.standard_normal((t, hv, d))
    g = -np.abs(rng.standard_normal((t, hv)))
    beta = rng.uniform(0.0, 1.0, (t, hv))
    state = 0.3 * rng.standard_normal((hv, d, d))
    return state, q, k, v, g, beta


@pytest.mark.parametrize(("head_map", "expand"), [("tiled", np.tile), ("interleaved", np.repeat)])
def test_head_maps_are_ggml_repeats(head_map: str, expand: Any) -> None:
    """qwen35/qwen4exp share q/k heads as ggml_repeat_4d (tiled, h % Hk); qwen3next repeats each
    head in place (interleaved, h // (Hv/Hk)). Expanding q/k that way first must give the same."""
    state, q, k, v, g, beta = _gdn_inputs(np.random.default_rng(0), 5, 2, 6, 4)
    reps = (1, 3, 1) if head_map == "tiled" else 3
    qx = expand(q, reps) if head_map == "tiled" else expand(q, reps, axis=1)
    kx = expand(k, reps) if head_map == "tiled" else expand(k, reps, axis=1)
    got = R.gated_delta_net_ref(state, q, k, v, g, beta, head_map, 0.5)
    want = R.gated_delta_net_ref(state, qx, kx, v, g, beta, "tiled", 0.5)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)
    other = "interleaved" if head_map == "tiled" else "tiled"
    assert not np.allclose(R.gated_delta_net_ref(state, q, k, v, g, beta, other, 0.5)[1], got[1])


@pytest.mark.parametrize("head_map", R.HEAD_MAPS)
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_form_equals_sequential_recurrence(head_map: str, chunk: int) -> None:
    state, q, k, v, g, beta = _gdn_inputs(np.random.default_rng(chunk), 70, 2, 4, 8)
    s_seq, o_seq = R.gated_delta_net_ref(state, q, k, v, g, beta, head_map, 8**-0.5)
    s_chk, o_chk = R.gated_delta_net_chunked_ref(state, q, k, v, g, beta, head_map, 8**-0.5, chunk=chunk)
    assert nmse(o_chk, o_seq) <= 1e-20 and nmse(s_chk, s_seq) <= 1e-20


def test_recurrence_state_carries_across_calls() -> None:
    state, q, k, v, g, beta = _gdn_inputs(np.random.default_rng(3), 11, 1, 2, 4)
    s_all, o_all = R.gated_delta_net_ref(state, q, k, v, g, beta, "tiled", 0.5)
    s, parts = state, []
    for lo, hi in ((0, 4), (4, 5), (5, 11)):
        s, o = R.gated_delta_net_ref(s, q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], "tiled", 0.5)
        parts.append(o)
    np.testing.assert_allclose(np.concatenate(parts), o_all, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(s, s_all, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("head_map", R.HEAD_MAPS)
def test_chunked_kernel_equals_the_float64_recurrence(head_map: str) -> None:
    """The compiled chunked form (per-head decay, every call chunked) against the float64
    sequential reference: 70 tokens (a whole chunk and a partial one), then 1 and 3 more on the
    carried state; the compiled sequential form beside it for scale."""
    hv, hk, d = 4, 2, 16
    state, q, k, v, g, beta = _gdn_inputs(np.random.default_rng(5), 74, hk, hv, d)
    errs = {}
    for name, chunked_from in (("chunked", 1), ("sequential", 0)):
        f = LA.gated_delta_net(hv, d, d, hk, head_map, d**-0.5, chunked_from=chunked_from)
        fn = tvm.compile(tvm.IRModule({"main": f}), target=resolve_target("llvm"))["main"]
        errs[name] = worst_error_over_calls(fn, state, (q, k, v, g, beta), head_map, d**-0.5)
    assert errs["chunked"] < 5e-6 and errs["sequential"] < 5e-6, errs


def _recurrence_outputs(head_map: str, inputs: tuple[np.ndarray, ...]) -> list[np.ndarray]:
    """The compiled recurrence (chunked form off) over 9, 1 and 6 tokens: each call's output, then
    the state."""
    state, q, k, v, g, beta = inputs
    hv, d, hk = state.shape[0], state.shape[1], q.shape[1]
    f = LA.gated_delta_net(hv, d, d, hk, head_map, d**-0.5, chunked_from=0)
    fn = tvm.compile(tvm.IRModule({"main": f}), target=resolve_target("llvm"))["main"]
    s_dev, outs = tvm.runtime.tensor(state.astype(np.float32)), []
    for t0, t1 in ((0, 9), (9, 10), (10, 16)):
        out = tvm.runtime.tensor(np.zeros((t1 - t0, hv, d), np.float32))
        fn(s_dev, *(tvm.runtime.tensor(x[t0:t1].astype(np.float32)) for x in (q, k, v, g, beta)), out)
        outs.append(out.numpy())
    return [*outs, s_dev.numpy()]


def test_causal_conv_is_ggmls_ssm_conv_on_the_cpu() -> None:
    """ggml_ssm_conv's loop: per channel and token, the window's products rounded and summed tap by
    tap from the oldest (no fused multiply-add), over calls of 5, 1 and 3 tokens on the carried
    history; a multiply-add chain (what TVM's LLVM builds made of it) differs on the same data."""
    c, k = 256, 4
    rng = np.random.default_rng(13)
    x = rng.standard_normal((9, c)).astype(np.float32)
    w = rng.standard_normal((c, k)).astype(np.float32)
    fn = tvm.compile(tvm.IRModule({"main": LA.ssm_conv(c, k)}), target=I.HASWELL)["main"]
    state = tvm.runtime.tensor(np.zeros((c, k - 1), np.float32))
    window = np.concatenate([np.zeros((k - 1, c), np.float32), x])
    want = np.zeros((9, c), np.float32)
    fused = np.zeros((9, c), np.float32)
    for t in range(9):
        for j in range(k):
            product = (window[t + j] * w[:, j]).astype(np.float32)
            want[t] = (want[t] + product).astype(np.float32)
            fused[t] = G.fma(window[t + j], w[:, j], fused[t])
    got = []
    for t0, t1 in ((0, 5), (5, 6), (6, 9)):
        y = tvm.runtime.tensor(np.zeros((t1 - t0, c), np.float32))
        fn(state, tvm.runtime.tensor(x[t0:t1]), tvm.runtime.tensor(w), y)
        got.append(y.numpy())
    np.testing.assert_array_equal(np.concatenate(got), want)
    assert not np.array_equal(fused, want)


def _libm_expf(x: float) -> np.float32:
    """expf of the C library, which ggml's scalar code calls."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    return np.float32(libm.expf(np.float32(x)))


def _ggml_gated_delta_net(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                          beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml_compute_forward_gated_delta_net (one decay per head; q/k head h % Hk) in float32, as its
    AVX2 build runs it per token: S *= expf(g) (ggml_vec_scale_f32), delta = (v - S.k) * beta with
    ggml_vec_dot_f32, S += k delta (ggml_vec_mad_f32: one fma), o = (S.q) * (1 / sqrtf(Dk))."""
    f32 = np.float32
    s, hk = state.astype(f32).copy(), q.shape[1]
    scale = f32(1) / np.sqrt(f32(q.shape[-1]))
    out = np.zeros(v.shape, f32)
    for t in range(q.shape[0]):
        for h in range(s.shape[0]):
            qh, kh = q[t, h % hk], k[t, h % hk]
            s[h] = s[h] * _libm_expf(g[t, h])
            delta = ((v[t, h] - G.vec_dot_f32(s[h], kh[None])) * beta[t, h]).astype(f32)
            s[h] = G.fma(kh[None], delta[:, None], s[h])
            out[t, h] = G.vec_dot_f32(s[h], qh[None]) * scale
    return s, out


def test_recurrence_is_ggmls_gated_delta_net_on_avx2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built for an AVX2 CPU, the recurrence (prompt calls included: llama.cpp's CPU backend runs its
    fused per-token op on prompts too) equals ggml's op bit for bit, outputs and carried state,
    over calls of 9, 1 and 6 tokens; one 8-lane partial sum per row (the order it replaced) differs."""
    hv, hk, d = 4, 2, 64
    state, q, k, v, g, beta = (x.astype(np.float32) for x in _gdn_inputs(np.random.default_rng(11), 16, hk, hv, d))
    scale = float(np.float32(1) / np.sqrt(np.float32(d)))

    def compiled_calls() -> list[np.ndarray]:
        f = LA.gated_delta_net(hv, d, d, hk, "tiled", scale, chunked_from=0)
        fn = tvm.compile(tvm.IRModule({"main": f}), target=I.HASWELL)["main"]
        s_dev, outs = tvm.runtime.tensor(state), []
        for t0, t1 in ((0, 9), (9, 10), (10, 16)):
            out = tvm.runtime.tensor(np.zeros((t1 - t0, hv, d), np.float32))
            fn(s_dev, *(tvm.runtime.tensor(np.ascontiguousarray(x[t0:t1])) for x in (q, k, v, g, beta)), out)
            outs.append(out.numpy())
        return [*outs, s_dev.numpy()]

    s_ref, want = state, []
    for t0, t1 in ((0, 9), (9, 10), (10, 16)):
        s_ref, o_ref = _ggml_gated_delta_net(s_ref, *(x[t0:t1] for x in (q, k, v, g, beta)))
        want.append(o_ref)
    want.append(s_ref)
    for got, ref in zip(compiled_calls(), want, strict=True):
        np.testing.assert_array_equal(got, ref)
    monkeypatch.setattr(LA, "VEC_DOT_ACCS", 1)
    assert not all(np.array_equal(a, b) for a, b in zip(compiled_calls(), want, strict=True))


@pytest.mark.parametrize("head_map", R.HEAD_MAPS)
def test_recurrence_row_groups_change_no_value(head_map: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows taken ROW_GROUP at a time keep each row's float order: bit-identical to one at a time."""
    inputs = _gdn_inputs(np.random.default_rng(7), 16, 2, 4, 16)
    grouped = _recurrence_outputs(head_map, inputs)
    monkeypatch.setattr(LA, "ROW_GROUP", 1)
    single = _recurrence_outputs(head_map, inputs)
    assert all(np.array_equal(a, b) for a, b in zip(grouped, single, strict=True))


@pytest.mark.parametrize("dilation", [1, 3])
def test_ssm_conv_is_a_causal_conv_with_carried_history(dilation: int) -> None:
    rng = np.random.default_rng(dilation)
    n_ch, k, t = 5, 4, 9
    w, x = rng.standard_normal((n_ch, k)), rng.standard_normal((t, n_ch))
    zeros = np.zeros((n_ch, (k - 1) * dilation))
    _, y = R.ssm_conv_ref(zeros, x, w, dilation)
    for tt in range(t):  # y[t] = sum_j w[:, j] x[t - (K-1-j)*dilation], zero before the sequence
        want = sum(
            w[:, j] * x[tt - (k - 1 - j) * dilation] for j in range(k) if tt - (k - 1 - j) * dilation >= 0
        )
        np.testing.assert_allclose(y[tt], want, rtol=1e-13, atol=1e-14)
    state, parts = zeros, []
    for lo, hi in ((0, 1), (1, 3), (3, 9)):
        state, part = R.ssm_conv_ref(state, x[lo:hi], w, dilation)
        parts.append(part)
    np.testing.assert_array_equal(np.concatenate(parts), y)


def _imrope_spec(pos: np.ndarray, n_rot: int, base: float, sections: list[int]) -> np.ndarray:
    """docs/arch/qwen-family.md §0.3, text tokens at (p, p, p, 0): angles [T, n_rot/2]."""
    i = np.arange(n_rot // 2)
    inv = base ** (-2 * i / n_rot)
    s = sum(sections)
    sec = i % s
    use_e = ~(
        ((sec % 3 == 1) & (sec < 3 * sections[1]))
        | ((sec % 3 == 2) & (sec < 3 * sections[2]))
        | ((sec % 3 == 0) & (sec < 3 * sections[0]))
    )
    p = np.where(use_e[None, :], 0.0, pos[:, None].astype(np.float64))
    return p * inv


@pytest.mark.parametrize("sections", [[2, 1, 1, 2], [11, 11, 10, 0], [3, 0, 0, 5], [32, 32, 32, 32]])
def test_imrope_table_matches_the_spec(sections: list[int]) -> None:
    n_ctx, n_rot = 40, 32
    table = rope_table(n_ctx, n_rot, 10000.0, 1.0, None, sections)
    angles = _imrope_spec(np.arange(n_ctx), n_rot, 10000.0, sections)
    np.testing.assert_allclose(table[..., 0], np.cos(angles), atol=2e-5)
    np.testing.assert_allclose(table[..., 1], np.sin(angles), atol=2e-5)
    e_pairs = [j for j, c in enumerate(imrope_components(sections, n_rot)) if c == "e"]
    assert np.all(table[:, e_pairs, 0] == 1.0) and np.all(table[:, e_pairs, 1] == 0.0)
    if sections == [2, 1, 1, 2]:
        assert e_pairs, "these sections leave pairs on the e component"


# ---------------------------------------------------------------------------------------------
# llama.cpp goldens, compiled


class Compiled:
    def __init__(self, model: LoadedModel, built: Built) -> None:
        self.model, self.built = model, built
        weights = kernel_weights(model, built.layouts)
        self.params = [
            to_tvm(weights[weight_key(lay.source, f)]) for lay in built.layouts for f, _, _ in lay.arrays
        ]
        self.vm = tvm.runtime.vm.VirtualMachine(built.executable, tvm.cpu())

    def logits(self, tokens: np.ndarray, chunk: int) -> np.ndarray:
        """Teacher-forced logits fed `chunk` tokens a call (1: the decode entry point)."""
        states = [to_tvm(np.zeros(shape, dtype)) for _, shape, dtype in self.built.states]
        fn = "decode" if chunk == 1 else "prefill_all"
        outs = []
        for i in range(0, len(tokens), chunk):
            toks = to_tvm(tokens[i : i + chunk].astype(np.int32))
            outs.append(self.vm[fn](toks, tvm.runtime.ShapeTuple([i]), states, *self.params).numpy())
        return np.concatenate(outs)


def _golden(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN / "logits" / f"{name}.npz"))


@pytest.fixture(scope="module", params=FIXTURES)
def golden_run(request: pytest.FixtureRequest) -> dict[str, Any]:
    if not GOLDEN.is_dir():
        pytest.skip(f"llama.cpp goldens not found at {GOLDEN}")
    name = request.param
    model = load_model(GOLDEN / "fixtures" / f"{name}.gguf")
    gold = _golden(name)
    comp = Compiled(model, build_model(model, max_chunk=64))
    logits = {chunk: comp.logits(gold["tokens"], chunk) for chunk in MODES}
    return {"name": name, "model": model, "gold": gold, "compiled": comp, "logits": logits}


@needs_goldens
@pytest.mark.parametrize("chunk", list(MODES))
def test_compiled_matches_llama_cpp(golden_run: dict[str, Any], chunk: int) -> None:
    got, want = golden_run["logits"][chunk], golden_run["gold"][MODES[chunk]]
    assert got.shape == want.shape and got.dtype == np.float32
    assert nmse(got, want) < 1e-6


@needs_goldens
def test_compiled_passes_fuse_the_delta_net(golden_run: dict[str, Any]) -> None:
    stats = golden_run["compiled"].built.pass_stats
    assert stats["fuse_l2_norm"] == 2 and stats["fuse_gated_norm"] == 1  # q and k; the output norm
    ops = {n.op for n in golden_run["compiled"].built.graphs["prefill_all"].nodes}
    assert {"ssm_conv", "gated_delta_net", "l2_norm", "rms_norm_gated", "attention"} <= ops


@needs_goldens
def test_compiled_chunked_prefill_equals_one_shot(golden_run: dict[str, Any]) -> None:
    """float32 kernels: one-shot, 7-token chunks and decode differ only by summation order."""
    logits = golden_run["logits"]
    assert nmse(logits[7], logits[64]) <= 1e-11
    assert nmse(logits[1], logits[64]) <= 1e-11


@pytest.mark.slow  # a second compile per fixture; test_models_compiled covers passes-off on project fixtures
@needs_goldens
def test_compiled_without_passes_matches(golden_run: dict[str, Any]) -> None:
    """Passes off: the spelled norms, the unfused MoE and gates, each op its own kernel."""
    model = golden_run["model"]
    comp = Compiled(model, build_model(model, run_passes=False, max_chunk=64))
    tokens = golden_run["gold"]["tokens"][:24]
    unfused = comp.logits(tokens, 24)
    assert nmse(unfused, golden_run["logits"][64][:24]) <= 1e-11
    assert nmse(unfused, golden_run["gold"]["logits_prefill"][:24]) < 1e-6


# ---------------------------------------------------------------------------------------------
# the interpreter: chunking and passes, float64


def _interp(
    graph: Graph, model: LoadedModel, tokens: np.ndarray, chunk: int, dtype: Any = np.float64
) -> np.ndarray:
    load = model.param_loader()
    state = init_state(graph, {}, dtype)
    outs = []
    for i in range(0, len(tokens), chunk):
        res = run_graph(
            graph, {"tokens": tokens[i : i + chunk], "pos": np.int64(i)}, load, state, dtype=dtype
        )
        state = res.state
        outs.append(res.outputs[0])
    return np.concatenate(outs)


@needs_goldens
@pytest.mark.parametrize("name", FIXTURES)
def test_interpreter_chunked_equals_one_shot_and_llama_cpp(name: str) -> None:
    model = load_model(GOLDEN / "fixtures" / f"{name}.gguf")
    gold = _golden(name)
    graph = model.graphs["prefill_all"]
    one_shot = _interp(graph, model, gold["tokens"], 64)
    assert nmse(one_shot, gold["logits_prefill"]) < 1e-10
    for chunk in (1, 7):
        chunked = _interp(graph, model, gold["tokens"], chunk)
        assert nmse(chunked, one_shot) <= 1e-9
        assert nmse(chunked, gold[MODES[chunk]]) < 1e-10


@needs_goldens
@pytest.mark.parametrize("name", FIXTURES)
def test_interpreter_fused_unfused_and_decomposed_agree(name: str) -> None:
    model = load_model(GOLDEN / "fixtures" / f"{name}.gguf")
    tokens = _golden(name)["tokens"][:20]
    raw = model.graphs["prefill_all"]
    fused, stats = run_pipeline(raw, check=True)
    assert stats["fuse_l2_norm"] == 2 and stats["fuse_gated_norm"] == 1
    decomposed = decompose(fused)
    verify(decomposed, {"T": 20, "P": 0})
    want = _interp(raw, model, tokens, 20)
    for graph in (fused, decomposed):
        assert nmse(_interp(graph, model, tokens, 7), want) <= 1e-20


# ---------------------------------------------------------------------------------------------
# qwen3next's alternative tensor layouts: legacy fused `ssm_in`, separate expert gate/up


def _write_variant(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    """A tiny qwen3next model with these exact tensors (keys as the fixture writer writes them)."""
    from tests.support import fixtures as FX

    fs, opts = FX.resolve_size("tiny"), FX.FixtureOptions()
    writer = gguf.GGUFWriter(str(path), "qwen3next")
    FX._write_hparams(writer, "qwen3next", fs, opts, moe=True)
    FX._write_tokenizer(writer, opts, None)
    for name, a in arrays.items():
        writer.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _fixture_arrays() -> dict[str, np.ndarray]:
    from tests.support import fixtures as FX

    specs = FX.plan_tensors("qwen3next", FX.resolve_size("tiny"), FX.FixtureOptions())
    return {s.name: FX.tensor_values(s, 0) for s in specs}


def _legacy_ssm_in(arrays: dict[str, np.ndarray], model: LoadedModel) -> dict[str, np.ndarray]:
    """attn_qkv + attn_gate regrouped per k head as llama.cpp's legacy [q | k | v | z] ssm_in."""
    dims = model.hparams.ssm
    hk, dk, vr = dims.n_k_heads, dims.head_k_dim, dims.head_v_dim * (dims.n_v_heads // dims.n_k_heads)
    out = {}
    for name, a in arrays.items():
        if name.endswith("attn_gate.weight"):
            continue
        if not name.endswith("attn_qkv.weight"):
            out[name] = a
            continue
        z = arrays[name.replace("attn_qkv", "attn_gate")]
        kd = dims.key_dim
        groups = [
            np.concatenate(
                [
                    a[g * dk : (g + 1) * dk],
                    a[kd + g * dk : kd + (g + 1) * dk],
                    a[2 * kd + g * vr : 2 * kd + (g + 1) * vr],
                    z[g * vr : (g + 1) * vr],
                ]
            )
            for g in range(hk)
        ]
        out[name.replace("attn_qkv", "ssm_in")] = np.concatenate(groups)
    return out


def _separate_experts(arrays: dict[str, np.ndarray], model: LoadedModel) -> dict[str, np.ndarray]:
    f = model.hparams.n_ff_exp
    out = {}
    for name, a in arrays.items():
        if name.endswith("ffn_gate_up_exps.weight"):
            out[name.replace("gate_up", "gate")] = a[:, :f]
            out[name.replace("gate_up", "up")] = a[:, f:]
        else:
            out[name] = a
    return out


@pytest.mark.parametrize("variant", ["legacy_ssm_in", "separate_experts"])
def test_qwen3next_alternative_layouts_compute_the_same(tmp_path: Path, variant: str) -> None:
    arrays = _fixture_arrays()
    base = load_model(_write_variant(tmp_path / "base.gguf", arrays))
    rewrite = _legacy_ssm_in if variant == "legacy_ssm_in" else _separate_experts
    other = load_model(_write_variant(tmp_path / "other.gguf", rewrite(arrays, base)))
    names = set(other.gguf.tensors)
    assert ("blk.0.ssm_in.weight" in names) == (variant == "legacy_ssm_in")
    assert ("blk.0.ffn_up_exps.weight" in names) == (variant == "separate_experts")
    tokens = np.arange(9, dtype=np.int32) * 5 % base.hparams.n_vocab
    want = _interp(base.graphs["prefill_all"], base, tokens, 9)
    got = _interp(other.graphs["prefill_all"], other, tokens, 4)
    assert nmse(got, want) <= 1e-20


def test_arch_facts_reach_the_graph(tmp_path: Path) -> None:
    """qwen3next shares q/k heads interleaved and rotates NEOX; qwen35 tiled with IMROPE sections."""
    from tests.support.fixtures import write_fixture
    from tests.support.fixtures_qwen35 import IMROPE_SECTIONS

    for arch, head_map, rope_mode in (("qwen3next", "interleaved", "neox"), ("qwen35", "tiled", "imrope")):
        model = load_model(write_fixture(arch, tmp_path / f"{arch}.gguf"))
        nodes = model.graphs["prefill"].nodes
        [gdn] = [n for n in nodes if n.op == "gated_delta_net"]
        assert gdn.attrs.head_map == head_map and gdn.inputs[1].shape[1] < gdn.inputs[3].shape[1]
        ropes = {n.attrs for n in nodes if n.op == "rope"}
        assert {(a.mode, a.sections) for a in ropes} == {
            (rope_mode, IMROPE_SECTIONS if arch == "qwen35" else ())
        }
        assert model.hparams.recurrent == (True, False)


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("blk.0.ssm_a", "missing tensor blk.0.ssm_a"),
        ("blk.1.attn_q_norm.weight", "missing tensor blk.1.attn_q_norm"),
    ],
)
def test_missing_required_tensor_is_one_line_error(tmp_path: Path, drop: str, message: str) -> None:
    from ggufc.frontend.hparams import ModelError

    arrays = {k: v for k, v in _fixture_arrays().items() if k != drop}
    with pytest.raises(ModelError, match=message):
        load_model(_write_variant(tmp_path / "m.gguf", arrays))


def test_unexpected_tensor_is_refused(tmp_path: Path) -> None:
    from ggufc.frontend.hparams import ModelError

    arrays = {**_fixture_arrays(), "blk.0.ssm_ba.scale": np.ones(1, np.float32)}
    with pytest.raises(ModelError, match="unexpected tensors for qwen3next: blk.0.ssm_ba.scale"):
        load_model(_write_variant(tmp_path / "m.gguf", arrays))
