"""Spelled forms of the hyper-connection and QSA-indexer ops, in primitives.

These are both the decompositions of the fused ops (`hc_pre`, `hc_post`, `indexer_score`) and the
unfused builders the qwen4exp architecture file calls (through `frontend/blocks_hc.py`), so the
fusion passes (`passes/fuse_hc.py`, `passes/fuse_indexer.py`) match exactly what a decomposition
emits and the decomposed, unfused and fused graphs compute the same thing.
"""

from __future__ import annotations

from . import ops as O
from .builder import GraphBuilder
from .graph import Dim, Node, Value


def _mul_dim(k: int, d: Dim) -> Dim:
    if isinstance(d, int):
        return k * d
    return d if k == 1 else (f"{k}*{d}" if d.isalnum() else f"{k}*({d})")


def rms_norm_plain(b: GraphBuilder, x: Value, eps: float, name: str) -> Value:
    """x * rsqrt(mean(x^2) + eps) over the last axis (decompose.rms_norm_spelled without weight)."""
    sq = b.unary("square", x, f"{name}.sq")
    ms = b.reduce("mean", sq, f"{name}.ms")
    r = b.unary("rsqrt", b.scalar("add", ms, eps, f"{name}.ms_eps"), f"{name}.rstd")
    return b.mul(x, r, name)


# ---------------------------------------------------------------------------------------------
# hyper-connections


def hc_pre_spelled(
    b: GraphBuilder, streams: Value, norm: Value, down: Value, up: Value, inject: Value | None, n_hc: int,
    eps: float, name: str,
) -> tuple[Value, Value | None]:
    """qwen4exp's HC mix (rule "sigmoid_mean"): (layer input [T,E], post weights [T,hc] or None)."""
    t, hc, e = streams.shape
    xn = b.mul(rms_norm_plain(b, streams, eps, f"{name}.rms"), norm, f"{name}.normed")
    xf = b.reshape(xn, (t, _mul_dim(int(hc), e)), f"{name}.flat")
    lo = b.scalar("mul", b.matmul(xf, down, f"{name}.down"), 1.0 / n_hc, f"{name}.down_scaled")
    gate = b.matmul(b.unary("silu", lo, f"{name}.act"), up, f"{name}.up")
    gated = b.mul(xf, b.unary("sigmoid", gate, f"{name}.gate"), f"{name}.gated")
    mixed = b.reduce("mean", b.reshape(gated, (t, hc, e), f"{name}.gated3"), name, axis=1, keepdims=False)
    if inject is None:
        return mixed, None
    inj = b.scalar("mul", b.matmul(xf, inject, f"{name}.inject"), 1.0 / n_hc, f"{name}.inject_scaled")
    post = b.scalar("mul", b.unary("sigmoid", inj, f"{name}.inject_sig"), 2.0, f"{name}.post")
    return mixed, post


def hc_post_spelled(b: GraphBuilder, streams: Value, y: Value, post: Value, name: str) -> Value:
    """R + post[:, :, None] * y[:, None, :] (ggml_dsv4_hc_post with comb NULL)."""
    t, hc, e = streams.shape
    y3 = b.reshape(y, (t, 1, e), f"{name}.y3")
    p3 = b.reshape(post, (t, hc, 1), f"{name}.post3")
    return b.add(streams, b.mul(y3, p3, f"{name}.scattered"), name)


def _hc_pre(b: GraphBuilder, n: Node) -> list[Value]:
    a: O.HcPre = n.attrs
    r, norm, down, up, *rest = n.inputs
    mixed, post = hc_pre_spelled(b, r, norm, down, up, rest[0] if a.post else None, a.n_hc, a.eps,
                                 n.outputs[0].name)
    return [mixed] if post is None else [mixed, post]


def _hc_post(b: GraphBuilder, n: Node) -> list[Value]:
    if n.attrs.comb:
        raise NotImplementedError("hc_post with a comb matrix (deepseek4) has no decomposition yet")
    streams, y, post = n.inputs[:3]
    return [hc_post_spelled(b, streams, y, post, n.outputs[0].name)]


# ---------------------------------------------------------------------------------------------
# QSA indexer


def block_keys_spelled(
    b: GraphBuilder, cache: Value, norm: Value, table: Value, ratio: int, eps: float, n_rot: int, name: str
) -> Value:
    """[C//r + 1, Di]: each block's mean raw key, RMS-normalised, rotated at its block start (table
    row b); the last row is the spare block (cell 0's key at position 0)."""
    n_cells, di = (int(d) for d in cache.shape)
    nb = n_cells // ratio
    full = cache if nb * ratio == n_cells else b.slice(cache, 0, 0, nb * ratio, f"{name}.full")
    pooled = b.reduce("mean", b.reshape(full, (nb, ratio, di), f"{name}.blocks"), f"{name}.pooled", axis=1,
                      keepdims=False)
    keys = b.emit("concat", [pooled, b.slice(cache, 0, 0, 1, f"{name}.cell0")], O.Concat(0), f"{name}.keys")
    normed = b.mul(rms_norm_plain(b, keys, eps, f"{name}.rms"), norm, f"{name}.normed")
    half = n_rot // 2
    rows = nb + 1
    cos = b.reshape(b.slice(table, 2, 0, 1, f"{name}.cos3"), (rows, half), f"{name}.cos")
    sin = b.reshape(b.slice(table, 2, 1, 2, f"{name}.sin3"), (rows, half), f"{name}.sin")
    lo = b.slice(normed, 1, 0, half, f"{name}.lo")
    hi = b.slice(normed, 1, half, n_rot, f"{name}.hi")
    new_lo = b.binary("sub", b.mul(lo, cos, f"{name}.lo_c"), b.mul(hi, sin, f"{name}.hi_s"), f"{name}.new_lo")
    new_hi = b.add(b.mul(lo, sin, f"{name}.lo_s"), b.mul(hi, cos, f"{name}.hi_c"), f"{name}.new_hi")
    parts = [new_lo, new_hi] + ([b.slice(normed, 1, n_rot, di, f"{name}.pass")] if n_rot < di else [])
    return b.emit("concat", parts, O.Concat(1), f"{name}.roped")


def indexer_score_spelled(
    b: GraphBuilder, q: Value, cache: Value, norm: Value, table: Value, ratio: int, eps: float, n_rot: int,
    name: str,
) -> Value:
    """score[t, b] = sum_h relu(q[t, h] . key_b) over the pooled block keys -> [T, C//r + 1]."""
    t, n_heads, di = q.shape
    keys = block_keys_spelled(b, cache, norm, table, ratio, eps, n_rot, f"{name}.k")
    rows = int(keys.shape[0])
    q2 = b.reshape(q, (_mul_dim(int(n_heads), t), di), f"{name}.q2")
    dots = b.reshape(b.matmul(q2, keys, f"{name}.dots2"), (t, n_heads, rows), f"{name}.dots")
    return b.reduce("sum", b.unary("relu", dots, f"{name}.relu"), name, axis=1, keepdims=False)


def _indexer_score(b: GraphBuilder, n: Node) -> list[Value]:
    a: O.IndexerScore = n.attrs
    q, cache, norm, table = n.inputs
    return [indexer_score_spelled(b, q, cache, norm, table, a.ratio, a.eps, a.n_rot, n.outputs[0].name)]


# ---------------------------------------------------------------------------------------------
# the sigmoid-gated shared expert of a moe_ffn (spelled as qwen3next.moe_ffn builds it)


def shared_expert_spelled(b: GraphBuilder, x: Value, routed: Value, named: dict, name: str) -> Value:
    """routed + swiglu_shexp(x) * sigmoid(sum(x * gate_inp_shexp)); each shared projection is
    (x @ W.T) [* s] as frontend/blocks.py::linear spells it."""
    scales = named["shexp_scales"]

    def linear(v: Value, w: Value, kind: str) -> Value:
        y = b.matmul(v, w, f"{name}.shexp_{kind}" if kind not in scales else f"{name}.shexp_{kind}.mm")
        return b.mul(y, scales[kind], f"{name}.shexp_{kind}") if kind in scales else y

    g = linear(x, named["shexp_gate"], "gate")
    u = linear(x, named["shexp_up"], "up")
    act = b.mul(b.unary("silu", g, f"{name}.shexp_silu"), u, f"{name}.shexp_act")
    shared = linear(act, named["shexp_down"], "down")
    w_gate = named["shexp_gate_inp"]
    if w_gate.dtype != "float32":
        w_gate = b.dequantize(w_gate, f"{name}.shexp_gate_inp.w")
    logit = b.reduce("sum", b.mul(x, w_gate, f"{name}.shexp_gate_prod"), f"{name}.shexp_gate_logit")
    gated = b.mul(shared, b.unary("sigmoid", logit, f"{name}.shexp_gate_sig"), f"{name}.shexp_gated")
    return b.add(routed, gated, name)


QWEN4EXP_DECOMPOSITIONS = {
    "hc_pre": _hc_pre,
    "hc_post": _hc_post,
    "indexer_score": _indexer_score,
}
