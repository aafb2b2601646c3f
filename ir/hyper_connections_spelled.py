"""The hyper-connection ops `hc_pre`, `hc_sinkhorn`, `hc_post` and `res_mix` spelled in primitives (references in
`hyper_connections.py`).

They are both the decompositions of the fused ops and the unfused builders the frontend blocks
call, so the fusion passes match exactly what a decomposition emits and the decomposed, unfused
and fused graphs compute the same thing.
"""

from __future__ import annotations

from . import ops as O
from .builder import GraphBuilder, rms_norm_plain
from .graph import Node, Value, mul_dim
from .hyper_connections import HcPre, HcSinkhorn


def hc_pre_spelled(
    b: GraphBuilder, streams: Value, norm: Value, down: Value, up: Value, inject: Value | None, n_hc: int,
    eps: float, name: str,
) -> tuple[Value, Value | None]:
    """qwen4exp's HC mix: (layer input [T,E], post weights [T,hc] or None)."""
    t, hc, e = streams.shape
    xn = b.mul(rms_norm_plain(b, streams, eps, f"{name}.rms"), norm, f"{name}.normed")
    xf = b.reshape(xn, (t, mul_dim(int(hc), e)), f"{name}.flat")
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


def hc_sinkhorn_spelled(
    b: GraphBuilder, streams: Value, fn: Value, scale: Value, base: Value, hc_eps: float, n_iter: int, eps: float,
    name: str, *, post: bool = True,
) -> list[Value]:
    """deepseek4's full-rank HC mix (`hc_sinkhorn`): mixes = rms(flat streams) @ fn.T; pre weights
    sigmoid(mixes[:hc]*scale[0] + base) + hc_eps mix the streams into the layer input; with `post`
    also 2*sigmoid(...) post weights [T,hc] and the comb matrix [T,hc(src),hc(dst)]: softmax over
    dst + hc_eps, then divided by its column sums over src (+hc_eps), then `n_iter - 1` rounds of
    row (dst) and column (src) normalisation. Returns [mixed] or [mixed, post, comb]."""
    t, hc, e = streams.shape
    n_hc = int(hc)
    flat = b.reshape(streams, (t, mul_dim(n_hc, e)), f"{name}.flat")
    mixes = b.matmul(rms_norm_plain(b, flat, eps, f"{name}.rms"), fn, f"{name}.mixes")

    def part(lo: int, hi: int, k: int, tag: str) -> Value:
        scaled = b.mul(b.slice(mixes, 1, lo, hi, f"{name}.{tag}_raw"), b.slice(scale, 0, k, k + 1, f"{name}.{tag}_s"),
                       f"{name}.{tag}_scaled")
        return b.add(scaled, b.slice(base, 0, lo, hi, f"{name}.{tag}_b") if post else base, f"{name}.{tag}_logit")

    pre = b.scalar("add", b.unary("sigmoid", part(0, n_hc, 0, "pre"), f"{name}.pre_sig"), hc_eps, f"{name}.pre")
    weighted = b.mul(b.reshape(pre, (t, n_hc, 1), f"{name}.pre3"), streams, f"{name}.weighted")
    mixed = b.reduce("sum", weighted, name, axis=1, keepdims=False)
    if not post:
        return [mixed]
    post_w = b.scalar("mul", b.unary("sigmoid", part(n_hc, 2 * n_hc, 1, "post"), f"{name}.post_sig"), 2.0,
                      f"{name}.post")
    logits = b.reshape(part(2 * n_hc, (2 + n_hc) * n_hc, 2, "comb"), (t, n_hc, n_hc), f"{name}.comb3")
    comb = b.scalar("add", _softmax_last(b, logits, f"{name}.comb_sm"), hc_eps, f"{name}.comb_eps")

    def normalise(c: Value, axis: int, tag: str) -> Value:
        total = b.scalar("add", b.reduce("sum", c, f"{tag}.sum", axis=axis), hc_eps, f"{tag}.sum_eps")
        return b.binary("div", c, total, tag)

    comb = normalise(comb, 1, f"{name}.comb_src0")
    for i in range(1, n_iter):
        comb = normalise(normalise(comb, 2, f"{name}.comb_dst{i}"), 1, f"{name}.comb_src{i}")
    return [mixed, post_w, comb]


def _softmax_last(b: GraphBuilder, x: Value, name: str) -> Value:
    m = b.reduce("max", x, f"{name}.max")
    ex = b.unary("exp", b.binary("sub", x, m, f"{name}.shift"), f"{name}.exp")
    return b.binary("div", ex, b.reduce("sum", ex, f"{name}.sum"), name)


def hc_post_comb_spelled(b: GraphBuilder, streams: Value, y: Value, post: Value, comb: Value, name: str) -> Value:
    """post[:, :, None] * y[:, None, :] + sum_src comb[t, src, dst] * R[t, src] (ggml_dsv4_hc_post)."""
    t, hc, e = streams.shape
    c4 = b.reshape(comb, (t, hc, hc, 1), f"{name}.comb4")
    r4 = b.reshape(streams, (t, hc, 1, e), f"{name}.r4")
    mixed = b.reduce("sum", b.mul(c4, r4, f"{name}.terms"), f"{name}.mixed", axis=1, keepdims=False)
    y3 = b.reshape(y, (t, 1, e), f"{name}.y3")
    p3 = b.reshape(post, (t, hc, 1), f"{name}.post3")
    return b.add(b.mul(y3, p3, f"{name}.scattered"), mixed, name)


def res_mix_spelled(b: GraphBuilder, src: Value, cur: Value, w: Value, eps: float, name: str) -> Value:
    """Cross-layer residual attention over src [T,n,E] and cur [T,E] (the `res_mix` op)."""
    t, n, _ = src.shape
    s_src = b.reduce("sum", b.mul(rms_norm_plain(b, src, eps, f"{name}.src_norm"), w, f"{name}.src_w"),
                     f"{name}.src_score", keepdims=False)
    s_cur = b.reduce("sum", b.mul(rms_norm_plain(b, cur, eps, f"{name}.cur_norm"), w, f"{name}.cur_w"),
                     f"{name}.cur_score")
    scores = b.emit("concat", [s_src, s_cur], O.Concat(1), f"{name}.scores")
    m = b.reduce("max", scores, f"{name}.probs.max")
    e = b.unary("exp", b.binary("sub", scores, m, f"{name}.probs.shift"), f"{name}.probs.exp")
    probs = b.binary("div", e, b.reduce("sum", e, f"{name}.probs.sum"), f"{name}.probs")
    p_src = b.reshape(b.slice(probs, 1, 0, int(n), f"{name}.p_src2"), (t, n, 1), f"{name}.p_src")
    mixed = b.reduce("sum", b.mul(src, p_src, f"{name}.src_weighted"), f"{name}.src_mix", axis=1, keepdims=False)
    p_cur = b.slice(probs, 1, int(n), int(n) + 1, f"{name}.p_cur")
    return b.add(mixed, b.mul(cur, p_cur, f"{name}.cur_weighted"), name)


def _res_mix(b: GraphBuilder, n: Node) -> list[Value]:
    src, cur, w = n.inputs
    return [res_mix_spelled(b, src, cur, w, n.attrs.eps, n.outputs[0].name)]


def _hc_pre(b: GraphBuilder, n: Node) -> list[Value]:
    a: HcPre = n.attrs
    r, norm, down, up, *rest = n.inputs
    mixed, post = hc_pre_spelled(b, r, norm, down, up, rest[0] if a.post else None, a.n_hc, a.eps,
                                 n.outputs[0].name)
    return [mixed] if post is None else [mixed, post]


def _hc_sinkhorn(b: GraphBuilder, n: Node) -> list[Value]:
    a: HcSinkhorn = n.attrs
    r, fn, scale, base = n.inputs
    return hc_sinkhorn_spelled(b, r, fn, scale, base, a.hc_eps, a.n_iter, a.eps, n.outputs[0].name, post=a.post)


def _hc_post(b: GraphBuilder, n: Node) -> list[Value]:
    streams, y, post = n.inputs[:3]
    if n.attrs.comb:
        return [hc_post_comb_spelled(b, streams, y, post, n.inputs[3], n.outputs[0].name)]
    return [hc_post_spelled(b, streams, y, post, n.outputs[0].name)]


HC_DECOMPOSITIONS = {
    "hc_pre": _hc_pre,
    "hc_sinkhorn": _hc_sinkhorn,
    "hc_post": _hc_post,
    "res_mix": _res_mix,
}
