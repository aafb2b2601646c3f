"""Hyper-connection kernels and their lowering (references: `ir/hyper_connections.py`).

* `hc_pre`: one kernel per mix: per-stream RMSNorm of the [T, hc, E] streams, the low-rank gate
  (down, silu, up), the sigmoid-gated mean over streams and the post weights (inject); the hc-wide
  stream is read in this one kernel (its normalised copy stays an intermediate of the kernel).
* `hc_post`: the scatter of a block output into every stream, R + post * y, one pass over R.
* `res_mix`: cross-layer residual attention in one kernel: the RMS scores of the banked rows and
  of the stream, their softmax and the weighted sum of the raw rows.

The GPU targets schedule these TIR kernels with dlight (gpu.py).

Symbolic extents: `n` (tokens of the call) and `pos` (tokens already cached), as in `kernels.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tvm import te, tirx

from ggufc.ir import ops as O
from ggufc.ir.graph import Node

from . import kernel_keys as KK
from . import kernels as K
from .kernels import PShape, f32, func, i64
from .lower_context import FunctionContext, call_args, tensor_dims


def hc_pre(streams: PShape, rank: int, n_hc: int, eps: float, post: bool) -> tirx.PrimFunc:
    """Args (R [T,hc,E], norm [hc,E], down [lr,hc*E], up [hc*E,lr][, inject [hc,hc*E]],
    mixed [T,E][, post [T,hc]])."""
    n, hc, e = streams
    hc_i, e_i = int(hc), int(e)
    wide = i64(hc_i * e_i)
    r = te.placeholder(streams, "float32", name="r")
    norm = te.placeholder((hc, e), "float32", name="norm")
    down = te.placeholder((i64(rank), wide), "float32", name="down")
    up = te.placeholder((wide, i64(rank)), "float32", name="up")
    re_ = te.reduce_axis((i64(0), e), name="re")
    ss = te.compute((n, hc), lambda t, c: te.sum(r[t, c, re_] * r[t, c, re_], axis=re_), name="ss")
    rstd = te.compute((n, hc), lambda t, c: f32(1.0) / te.sqrt(ss[t, c] / f32(e_i) + f32(eps)), name="rstd")
    xn = te.compute((n, wide), lambda t, k: r[t, k // e, k % e] * rstd[t, k // e] * norm[k // e, k % e], name="xn")
    rk = te.reduce_axis((i64(0), wide), name="rk")
    lo = te.compute((n, i64(rank)), lambda t, j: te.sum(xn[t, rk] * down[j, rk], axis=rk), name="lo")
    act = te.compute((n, i64(rank)), lambda t, j: lo[t, j] * f32(1.0 / n_hc) * K.sigmoid(lo[t, j] * f32(1.0 / n_hc)),
                     name="act")
    rr = te.reduce_axis((i64(0), i64(rank)), name="rr")
    gate = te.compute((n, wide), lambda t, k: te.sum(act[t, rr] * up[k, rr], axis=rr), name="gate")
    rc = te.reduce_axis((i64(0), hc), name="rc")
    msum = te.compute((n, e), lambda t, j: te.sum(xn[t, rc * e + j] * K.sigmoid(gate[t, rc * e + j]), axis=rc),
                      name="msum")
    mixed = te.compute((n, e), lambda t, j: msum[t, j] / f32(hc_i), name="mixed")
    if not post:
        return func([r, norm, down, up, mixed])
    inject = te.placeholder((hc, wide), "float32", name="inject")
    rk2 = te.reduce_axis((i64(0), wide), name="rk2")
    inj = te.compute((n, hc), lambda t, c: te.sum(xn[t, rk2] * inject[c, rk2], axis=rk2), name="inj")
    out_post = te.compute((n, hc), lambda t, c: f32(2.0) * K.sigmoid(inj[t, c] * f32(1.0 / n_hc)), name="post")
    return func([r, norm, down, up, inject, mixed, out_post])


def hc_post(streams: PShape, comb: bool = False) -> tirx.PrimFunc:
    """Args (R [T,hc,E], y [T,E], post [T,hc][, comb [T,hc(src),hc(dst)]], out [T,hc,E]); with the
    comb matrix each output stream sums the comb-weighted source streams (R read once per element)."""
    n, hc, e = streams
    r = te.placeholder(streams, "float32", name="r")
    y = te.placeholder((n, e), "float32", name="y")
    post = te.placeholder((n, hc), "float32", name="post")
    if not comb:
        out = te.compute(streams, lambda t, c, j: r[t, c, j] + post[t, c] * y[t, j], name="out")
        return func([r, y, post, out])
    cm = te.placeholder((n, hc, hc), "float32", name="comb")
    rs = te.reduce_axis((i64(0), hc), name="rs")
    mixed = te.compute(streams, lambda t, d, j: te.sum(cm[t, rs, d] * r[t, rs, j], axis=rs), name="mixed")
    out = te.compute(streams, lambda t, d, j: post[t, d] * y[t, j] + mixed[t, d, j], name="out")
    return func([r, y, post, cm, out])


def hc_pre_sinkhorn(streams: PShape, a: O.HcPre) -> tirx.PrimFunc:
    """Args (R [T,hc,E], fn [M, hc*E], scale [3|1], base [M], mixed [T,E][, post [T,hc], comb
    [T,hc(src),hc(dst)]]): deepseek4's mix in one kernel (ir/hyper_connections.py sinkhorn_pre_ref);
    the Sinkhorn rounds are unrolled (a.n_iter is static)."""
    n, hc, e = streams
    n_hc = a.n_hc
    wide = n_hc * int(e)
    n_mix = (2 + n_hc) * n_hc if a.post else n_hc
    r = te.placeholder(streams, "float32", name="r")
    fn = te.placeholder((i64(n_mix), i64(wide)), "float32", name="fn")
    scale = te.placeholder((i64(3 if a.post else 1),), "float32", name="scale")
    base = te.placeholder((i64(n_mix),), "float32", name="base")
    ee = i64(int(e))

    def flat(t: tirx.PrimExpr, k: tirx.PrimExpr) -> tirx.PrimExpr:
        return r[t, k // ee, k % ee]

    rk = te.reduce_axis((i64(0), i64(wide)), name="rk")
    ss = te.compute((n,), lambda t: te.sum(flat(t, rk) * flat(t, rk), axis=rk), name="ss")
    rstd = te.compute((n,), lambda t: f32(1.0) / te.sqrt(ss[t] / f32(wide) + f32(a.eps)), name="rstd")
    rm = te.reduce_axis((i64(0), i64(wide)), name="rm")
    mixes = te.compute((n, i64(n_mix)), lambda t, m: te.sum(flat(t, rm) * rstd[t] * fn[m, rm], axis=rm), name="mixes")
    eps = f32(a.hc_eps)
    pre = te.compute((n, hc), lambda t, h: K.sigmoid(mixes[t, h] * scale[0] + base[h]) + eps, name="pre")
    rh = te.reduce_axis((i64(0), hc), name="rh")
    mixed = te.compute((n, e), lambda t, j: te.sum(pre[t, rh] * r[t, rh, j], axis=rh), name="mixed")
    if not a.post:
        return func([r, fn, scale, base, mixed])
    hc2 = i64(2 * n_hc)
    post = te.compute((n, hc), lambda t, h: f32(2.0) * K.sigmoid(mixes[t, h + hc] * scale[1] + base[h + hc]),
                      name="post")

    def logit(t: tirx.PrimExpr, s_: tirx.PrimExpr, d: tirx.PrimExpr) -> tirx.PrimExpr:
        return mixes[t, hc2 + s_ * hc + d] * scale[2] + base[hc2 + s_ * hc + d]

    lg = te.compute((n, hc, hc), logit, name="logits")
    r1 = te.reduce_axis((i64(0), hc), name="r1")
    mx = te.compute((n, hc), lambda t, s_: te.max(lg[t, s_, r1], axis=r1), name="mx")
    ex = te.compute((n, hc, hc), lambda t, s_, d: te.exp(lg[t, s_, d] - mx[t, s_]), name="ex")
    r2 = te.reduce_axis((i64(0), hc), name="r2")
    sm = te.compute((n, hc), lambda t, s_: te.sum(ex[t, s_, r2], axis=r2), name="sm")
    comb = te.compute((n, hc, hc), lambda t, s_, d: ex[t, s_, d] / sm[t, s_] + eps, name="comb_sm")

    def normalise(c: te.Tensor, over_src: bool, tag: str) -> te.Tensor:
        ra = te.reduce_axis((i64(0), hc), name=f"{tag}_r")
        if over_src:
            tot = te.compute((n, hc), lambda t, d: te.sum(c[t, ra, d], axis=ra), name=f"{tag}_sum")
            return te.compute((n, hc, hc), lambda t, s_, d: c[t, s_, d] / (tot[t, d] + eps), name=tag)
        tot = te.compute((n, hc), lambda t, s_: te.sum(c[t, s_, ra], axis=ra), name=f"{tag}_sum")
        return te.compute((n, hc, hc), lambda t, s_, d: c[t, s_, d] / (tot[t, s_] + eps), name=tag)

    comb = normalise(comb, True, "src0")
    for i in range(1, a.n_iter):
        comb = normalise(normalise(comb, False, f"dst{i}"), True, f"src{i}")
    return func([r, fn, scale, base, mixed, post, comb])


def res_mix(src_shape: PShape, eps: float) -> tirx.PrimFunc:
    """Args (src [T,n,E], cur [T,E], w [E], out [T,E])."""
    n, nb, e = src_shape
    e_f = f32(int(e))
    src = te.placeholder(src_shape, "float32", name="src")
    cur = te.placeholder((n, e), "float32", name="cur")
    w = te.placeholder((e,), "float32", name="w")
    r1, r2, r3, r4 = (te.reduce_axis((i64(0), e), name=f"r{i}") for i in range(1, 5))
    ss_src = te.compute((n, nb), lambda t, c: te.sum(src[t, c, r1] * src[t, c, r1], axis=r1), name="ss_src")
    ss_cur = te.compute((n,), lambda t: te.sum(cur[t, r2] * cur[t, r2], axis=r2), name="ss_cur")
    s_src = te.compute((n, nb), lambda t, c: te.sum(
        src[t, c, r3] * (f32(1.0) / te.sqrt(ss_src[t, c] / e_f + f32(eps))) * w[r3], axis=r3), name="s_src")
    s_cur = te.compute((n,), lambda t: te.sum(cur[t, r4] * (f32(1.0) / te.sqrt(ss_cur[t] / e_f + f32(eps))) * w[r4],
                                              axis=r4), name="s_cur")
    rc = te.reduce_axis((i64(0), nb), name="rc")
    mx_src = te.compute((n,), lambda t: te.max(s_src[t, rc], axis=rc), name="mx_src")
    mx = te.compute((n,), lambda t: tirx.max(mx_src[t], s_cur[t]), name="mx")
    rc2 = te.reduce_axis((i64(0), nb), name="rc2")
    den_src = te.compute((n,), lambda t: te.sum(te.exp(s_src[t, rc2] - mx[t]), axis=rc2), name="den_src")
    den = te.compute((n,), lambda t: den_src[t] + te.exp(s_cur[t] - mx[t]), name="den")
    p_src = te.compute((n, nb), lambda t, c: te.exp(s_src[t, c] - mx[t]) / den[t], name="p_src")
    rc3 = te.reduce_axis((i64(0), nb), name="rc3")
    mixed = te.compute((n, e), lambda t, j: te.sum(src[t, rc3, j] * p_src[t, rc3], axis=rc3), name="mixed")
    out = te.compute((n, e), lambda t, j: mixed[t, j] + cur[t, j] * (te.exp(s_cur[t] - mx[t]) / den[t]), name="out")
    return func([src, cur, w, out])


def _res_mix(fc: FunctionContext, node: Node) -> list[Any]:
    a: O.ResMix = node.attrs
    key = KK.OpKernel("res_mix", a, tensor_dims(fc, node))
    return fc.call(key, lambda: res_mix(fc.kernel_shape(node.inputs[0], K.Symbols()), a.eps), call_args(fc, node),
                   node.outputs, node.outputs[0].name)


def _hc_pre(fc: FunctionContext, node: Node) -> list[Any]:
    a: O.HcPre = node.attrs
    if a.rule == "sinkhorn":
        key = KK.OpKernel("hc_pre", a, tensor_dims(fc, node))
        return fc.call(key, lambda: hc_pre_sinkhorn(fc.kernel_shape(node.inputs[0], K.Symbols()), a),
                       call_args(fc, node), node.outputs, node.outputs[0].name)
    r, _norm, down = node.inputs[:3]
    rank = int(down.shape[0])
    key = KK.OpKernel("hc_pre", a, tensor_dims(fc, node))
    return fc.call(key, lambda: hc_pre(fc.kernel_shape(r, K.Symbols()), rank, a.n_hc, a.eps, a.post),
                   call_args(fc, node), node.outputs, node.outputs[0].name)


def _hc_post(fc: FunctionContext, node: Node) -> list[Any]:
    r = node.inputs[0]
    comb = bool(node.attrs.comb)
    key = KK.OpKernel("hc_post", comb or None, tensor_dims(fc, node))
    return fc.call(key, lambda: hc_post(fc.kernel_shape(r, K.Symbols()), comb), call_args(fc, node), node.outputs,
                   node.outputs[0].name)


HC_LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "hc_pre": _hc_pre,
    "hc_post": _hc_post,
    "res_mix": _res_mix,
}
