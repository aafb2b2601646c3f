"""Hyper-connection kernels and their lowering (references: `ir/hyper_connections.py`).

* `hc_pre`: one kernel per mix: per-stream RMSNorm of the [T, hc, E] streams, the low-rank gate
  (down, silu, up), the sigmoid-gated mean over streams and the post weights (inject); the hc-wide
  stream is read in this one kernel (its normalised copy stays an intermediate of the kernel).
* `hc_sinkhorn`: deepseek4's full-rank mix in one kernel: the rms of the flattened streams, every
  mix's product, the pre and post weights and the Sinkhorn-normalised comb matrix (GPU: one
  workgroup per token).
* `hc_post`: the scatter of a block output into every stream, R + post * y, one pass over R.
* `res_mix`: cross-layer residual attention in one kernel: the RMS scores of the banked rows and
  of the stream, their softmax and the weighted sum of the raw rows.

The GPU targets schedule these TIR kernels with dlight (gpu.py).

Symbolic extents: `n` (tokens of the call) and `pos` (tokens already cached), as in `kernels.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm
from tvm import te, tirx
from tvm.script import tirx as T

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.gpu.schedules import GpuKernel, mark_schedule
from ggufc.codegen.kernels.elementwise import sigmoid
from ggufc.codegen.kernels.prim_helpers import PShape, Symbols, f32, func, i64, with_root_block
from ggufc.codegen.lower_context import FunctionContext, call_args, tensor_dims
from ggufc.ir.graph import Node
from ggufc.ir.hyper_connections import HcPre, HcSinkhorn, ResMix

NEG = -3.0e38  # a finite -inf: WGSL has no infinity literal


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
    act = te.compute((n, i64(rank)), lambda t, j: lo[t, j] * f32(1.0 / n_hc) * sigmoid(lo[t, j] * f32(1.0 / n_hc)),
                     name="act")
    rr = te.reduce_axis((i64(0), i64(rank)), name="rr")
    gate = te.compute((n, wide), lambda t, k: te.sum(act[t, rr] * up[k, rr], axis=rr), name="gate")
    rc = te.reduce_axis((i64(0), hc), name="rc")
    msum = te.compute((n, e), lambda t, j: te.sum(xn[t, rc * e + j] * sigmoid(gate[t, rc * e + j]), axis=rc),
                      name="msum")
    mixed = te.compute((n, e), lambda t, j: msum[t, j] / f32(hc_i), name="mixed")
    if not post:
        return func([r, norm, down, up, mixed])
    inject = te.placeholder((hc, wide), "float32", name="inject")
    rk2 = te.reduce_axis((i64(0), wide), name="rk2")
    inj = te.compute((n, hc), lambda t, c: te.sum(xn[t, rk2] * inject[c, rk2], axis=rk2), name="inj")
    out_post = te.compute((n, hc), lambda t, c: f32(2.0) * sigmoid(inj[t, c] * f32(1.0 / n_hc)), name="post")
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


def hc_sinkhorn(streams: PShape, a: HcSinkhorn) -> tirx.PrimFunc:
    """Args (R [T,hc,E], fn [M, hc*E], scale [3|1], base [M], mixed [T,E][, post [T,hc], comb
    [T,hc(src),hc(dst)]]): deepseek4's mix in one kernel (ir/hyper_connections.py hc_sinkhorn_ref);
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
    pre = te.compute((n, hc), lambda t, h: sigmoid(mixes[t, h] * scale[0] + base[h]) + eps, name="pre")
    rh = te.reduce_axis((i64(0), hc), name="rh")
    mixed = te.compute((n, e), lambda t, j: te.sum(pre[t, rh] * r[t, rh, j], axis=rh), name="mixed")
    if not a.post:
        return func([r, fn, scale, base, mixed])
    hc2 = i64(2 * n_hc)
    post = te.compute((n, hc), lambda t, h: f32(2.0) * sigmoid(mixes[t, h + hc] * scale[1] + base[h + hc]),
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


HC_THREADS = 64  # GPU threads per workgroup of the Sinkhorn mix (fewer when its mixes are many)
HC_SHARED_FLOATS = 2048  # partial sums in workgroup memory: 8 KiB of WebGPU's guaranteed 16


def hc_sinkhorn_gpu(n_hc: int, e: int, a: HcSinkhorn) -> tirx.PrimFunc:
    """As `hc_sinkhorn` (same arguments), one workgroup per token: one pass over the token's
    hc-wide stream sums its squares and every mix's dot product (rms(x) . fn = rstd * (x . fn)),
    each thread a strided slice, the partial sums reduced in workgroup memory; every thread then
    forms the pre weights, post weights and the Sinkhorn-normalised comb (hc x hc, tiny) from the
    same sums, and a second pass writes the pre-mixed row. Two launches' worth of dlight stages
    become one."""
    n_mix = (2 + n_hc) * n_hc if a.post else n_hc
    nt = HC_THREADS
    while nt > 1 and (n_mix + 1) * nt > HC_SHARED_FLOATS:
        nt //= 2
    HC, E, WIDE, NM, NT = T.int64(n_hc), T.int64(e), T.int64(n_hc * e), T.int64(n_mix), T.int64(nt)
    EPS, HC_EPS, WIDE_F = T.float32(a.eps), T.float32(a.hc_eps), T.float32(n_hc * e)
    NS, HC2 = T.int64(3 if a.post else 1), T.int64(2 * n_hc)

    def sigmoid_f32(x: Any) -> Any:
        return T.float32(1) / (T.float32(1) + T.exp(-x))

    @T.macro
    def sums(r: Any, fn: Any, red: Any, part: Any, ms: Any, t: Any, tx: Any) -> None:
        # part[m] (m < NM): this thread's x . fn[m]; part[NM]: its sum of squares
        for m in range(NM + T.int64(1)):
            part[m] = T.float32(0)
        for k0 in range((WIDE + NT - T.int64(1)) // NT):
            if k0 * NT + tx < WIDE:
                part[NM] = part[NM] + r[t, (k0 * NT + tx) // E, (k0 * NT + tx) % E] * r[
                    t, (k0 * NT + tx) // E, (k0 * NT + tx) % E]
                for m in range(NM):
                    part[m] = part[m] + r[t, (k0 * NT + tx) // E, (k0 * NT + tx) % E] * fn[m, k0 * NT + tx]
        for m in range(NM + T.int64(1)):
            red[m * NT + tx] = part[m]
        T.tvm_storage_sync("shared")
        for m0 in range((NM + NT) // NT):  # thread m sums mix m's partials (and NM: the squares)
            if m0 * NT + tx <= NM:
                part[0] = T.float32(0)
                for j in range(NT):
                    part[0] = part[0] + red[(m0 * NT + tx) * NT + j]
                ms[m0 * NT + tx] = part[0]
        T.tvm_storage_sync("shared")

    def at(i: Any, j: Any, over_src: bool) -> Any:  # comb[src, dst] of line i, entry j
        return j * HC + i if over_src else i * HC + j

    @T.macro
    def normalise(cm: Any, st: Any, over_src: bool) -> None:
        for i in range(HC):
            st[1] = T.float32(0)
            for j in range(HC):
                st[1] = st[1] + cm[at(i, j, over_src)]
            for j in range(HC):
                cm[at(i, j, over_src)] = cm[at(i, j, over_src)] / (st[1] + HC_EPS)

    @T.macro
    def sinkhorn(ms: Any, scale: Any, base: Any, cm: Any, st: Any, rstd: Any) -> None:
        for s_ in range(HC):  # softmax over destinations per source, plus hc_eps
            st[0] = T.float32(NEG)
            for d in range(HC):
                st[0] = T.max(st[0], ms[HC2 + s_ * HC + d] * rstd * scale[2] + base[HC2 + s_ * HC + d])
            st[1] = T.float32(0)
            for d in range(HC):
                cm[s_ * HC + d] = T.exp(ms[HC2 + s_ * HC + d] * rstd * scale[2] + base[HC2 + s_ * HC + d] - st[0])
                st[1] = st[1] + cm[s_ * HC + d]
            for d in range(HC):
                cm[s_ * HC + d] = cm[s_ * HC + d] / st[1] + HC_EPS
        normalise(cm, st, True)
        for _it in range(T.int64(a.n_iter - 1)):
            normalise(cm, st, False)
            normalise(cm, st, True)

    @T.macro
    def premix(r: Any, ms: Any, scale: Any, base: Any, mixed: Any, pre: Any, t: Any, tx: Any, rstd: Any) -> None:
        for h in range(HC):
            pre[h] = sigmoid_f32(ms[h] * rstd * scale[0] + base[h]) + HC_EPS
        for j0 in range((E + NT - T.int64(1)) // NT):
            if j0 * NT + tx < E:
                pre[HC] = T.float32(0)
                for h in range(HC):
                    pre[HC] = pre[HC] + pre[h] * r[t, h, j0 * NT + tx]
                mixed[t, j0 * NT + tx] = pre[HC]

    @T.prim_func(private=True)
    def hc_collapse_gpu(r_h: T.handle, fn: T.Buffer((NM, WIDE), "float32"), scale: T.Buffer((NS,), "float32"),
                        base: T.Buffer((NM,), "float32"), mixed_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        r = T.match_buffer(r_h, (n, HC, E), "float32")
        mixed = T.match_buffer(mixed_h, (n, E), "float32")
        t = T.launch_thread("blockIdx.x", n)
        red = T.alloc_shared(((NM + T.int64(1)) * NT,), "float32")
        ms = T.alloc_shared((NM + T.int64(1),), "float32")
        part = T.alloc_local((NM + T.int64(1),), "float32")
        pre = T.alloc_local((HC + T.int64(1),), "float32")
        tx = T.launch_thread("threadIdx.x", NT)
        sums(r, fn, red, part, ms, t, tx)
        premix(r, ms, scale, base, mixed, pre, t, tx, T.float32(1) / T.sqrt(ms[NM] / WIDE_F + EPS))

    @T.prim_func(private=True)
    def hc_sinkhorn_gpu(r_h: T.handle, fn: T.Buffer((NM, WIDE), "float32"), scale: T.Buffer((NS,), "float32"),
                            base: T.Buffer((NM,), "float32"), mixed_h: T.handle, post_h: T.handle,
                            comb_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        r = T.match_buffer(r_h, (n, HC, E), "float32")
        mixed = T.match_buffer(mixed_h, (n, E), "float32")
        post = T.match_buffer(post_h, (n, HC), "float32")
        comb = T.match_buffer(comb_h, (n, HC, HC), "float32")
        t = T.launch_thread("blockIdx.x", n)
        red = T.alloc_shared(((NM + T.int64(1)) * NT,), "float32")
        ms = T.alloc_shared((NM + T.int64(1),), "float32")
        part = T.alloc_local((NM + T.int64(1),), "float32")
        pre = T.alloc_local((HC + T.int64(1),), "float32")
        cm = T.alloc_local((HC * HC,), "float32")
        st = T.alloc_local((2,), "float32")
        tx = T.launch_thread("threadIdx.x", NT)
        sums(r, fn, red, part, ms, t, tx)
        premix(r, ms, scale, base, mixed, pre, t, tx, T.float32(1) / T.sqrt(ms[NM] / WIDE_F + EPS))
        if tx == T.int64(0):
            sinkhorn(ms, scale, base, cm, st, T.float32(1) / T.sqrt(ms[NM] / WIDE_F + EPS))
            for h in range(HC):
                post[t, h] = T.float32(2) * sigmoid_f32(
                    ms[HC + h] * (T.float32(1) / T.sqrt(ms[NM] / WIDE_F + EPS)) * scale[1] + base[HC + h])
            for i in range(HC * HC):
                comb[t, i // HC, i % HC] = cm[i]

    return hc_sinkhorn_gpu if a.post else hc_collapse_gpu


def hc_post_comb_gpu(n_hc: int, e: int) -> tirx.PrimFunc:
    """As `hc_post` with the comb matrix (same arguments), one thread per output element: the
    comb-weighted sum of the source streams plus post * y in one launch (dlight: two)."""
    HC, E, NT = T.int64(n_hc), T.int64(e), T.int64(HC_THREADS)

    @T.prim_func(private=True)
    def hc_post_comb_gpu(r_h: T.handle, y_h: T.handle, post_h: T.handle, comb_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        r = T.match_buffer(r_h, (n, HC, E), "float32")
        y = T.match_buffer(y_h, (n, E), "float32")
        post = T.match_buffer(post_h, (n, HC), "float32")
        comb = T.match_buffer(comb_h, (n, HC, HC), "float32")
        out = T.match_buffer(out_h, (n, HC, E), "float32")
        bx = T.launch_thread("blockIdx.x", (n * HC * E + NT - T.int64(1)) // NT)
        acc = T.alloc_local((1,), "float32")
        tx = T.launch_thread("threadIdx.x", NT)
        idx = T.meta_var(bx * NT + tx)
        if idx < n * HC * E:
            acc[0] = T.float32(0)
            for s_ in range(HC):
                acc[0] = acc[0] + comb[idx // (HC * E), s_, idx // E % HC] * r[idx // (HC * E), s_, idx % E]
            out[idx // (HC * E), idx // E % HC, idx % E] = post[idx // (HC * E), idx // E % HC] * y[
                idx // (HC * E), idx % E] + acc[0]

    return with_root_block(hc_post_comb_gpu)


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
    a: ResMix = node.attrs
    key = KK.OpKernel("res_mix", a, tensor_dims(fc, node))
    return fc.call(key, lambda: res_mix(fc.kernel_shape(node.inputs[0], Symbols()), a.eps), call_args(fc, node),
                   node.outputs, node.outputs[0].name)


def _hc_pre(fc: FunctionContext, node: Node) -> list[Any]:
    a: HcPre = node.attrs
    r, _norm, down = node.inputs[:3]
    rank = int(down.shape[0])
    key = KK.OpKernel("hc_pre", a, tensor_dims(fc, node))
    return fc.call(key, lambda: hc_pre(fc.kernel_shape(r, Symbols()), rank, a.n_hc, a.eps, a.post),
                   call_args(fc, node), node.outputs, node.outputs[0].name)


def _hc_sinkhorn(fc: FunctionContext, node: Node) -> list[Any]:
    a: HcSinkhorn = node.attrs
    key = KK.OpKernel("hc_sinkhorn", a, tensor_dims(fc, node))
    return fc.call(key, lambda: hc_sinkhorn(fc.kernel_shape(node.inputs[0], Symbols()), a),
                   call_args(fc, node), node.outputs, node.outputs[0].name)


def _hc_post(fc: FunctionContext, node: Node) -> list[Any]:
    r = node.inputs[0]
    comb = bool(node.attrs.comb)
    key = KK.OpKernel("hc_post", comb or None, tensor_dims(fc, node))
    return fc.call(key, lambda: hc_post(fc.kernel_shape(r, Symbols()), comb), call_args(fc, node), node.outputs,
                   node.outputs[0].name)


HC_LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "hc_pre": _hc_pre,
    "hc_sinkhorn": _hc_sinkhorn,
    "hc_post": _hc_post,
    "res_mix": _res_mix,
}


# ---------------------------------------------------------------------------------------------
# GPU kernels by key kind (merged into the GPU targets' table by lower.py)


def _hc_sinkhorn_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """The Sinkhorn mix's own kernel (`hc_pre`, the low-rank mix, has none: its TE definition is
    scheduled by dlight)."""
    _, n_hc, e = key.dims[0]  # dims of (R, fn, scale, base)
    return mark_schedule(hc_sinkhorn_gpu(int(n_hc), int(e), key.attrs), "ggufc.mix_per_token")


def _hc_post_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """The comb-mixed scatter's own kernel (None: the plain scatter, dlight's)."""
    if not key.attrs:
        return None
    _, n_hc, e = key.dims[0]  # dims of (R, y, post, comb)
    return mark_schedule(hc_post_comb_gpu(int(n_hc), int(e)), "ggufc.mix_per_element")


GPU_KERNELS: dict[str, GpuKernel] = {
    "hc_sinkhorn": _hc_sinkhorn_gpu_kernel,
    "hc_post": _hc_post_gpu_kernel,
}
