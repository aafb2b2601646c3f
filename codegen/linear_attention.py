"""The linear-attention family's kernels (the gated delta-net now), CPU and GPU side by side, and
their lowering: the two stateful scans (written as TIR, since they update
their state in place: Relax calls them through `call_tir_inplace`) and the two norms (TE).

* `ssm_conv`: causal depthwise conv over [history | this call's inputs], one channel per parallel
  task; the history (state [C, (K-1)*dilation]) is shifted in place after the outputs are made.
* `gated_delta_net`: the gated delta rule. Each row i of each value head's matrix M[h] [Dv, Dk]
  evolves on its own (its update needs only v[t, h, i], the shared k/q of the head and the gates),
  so the kernel runs the Hv*Dv rows in parallel and, inside a row, the tokens of the call in
  order: the same kernel serves decode (T=1) and chunked prefill, and equals the sequential
  recurrence of the reference by construction. The row stays in the state buffer (Dk floats, in
  L1); dot products accumulate over `LANES` partial sums so the loops vectorise.
* `l2_norm`, `rms_norm_gated`: one reduction and one elementwise stage, like `kernels.rms_norm`.

Every kernel takes the token count as a symbolic extent, so one compiled function serves every
call size; argument order follows Relax (inputs, then fresh outputs).

GPU counterparts (`*_gpu`, same arguments and the same in-place contract, state first):
`ssm_conv_gpu` runs one thread per channel over [history | x], then shifts its history row in
place; `gated_delta_net_gpu` runs one thread per state row of a value head (the delta rule updates
each row on its own): for every token, decay the row, kv = row . k, add (v - kv) * beta * k,
o = row . q.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tvm import relax, te, tirx
from tvm.script import tirx as T

from ggufc.ir import ops as O
from ggufc.ir.graph import Node

from . import kernel_keys as KK
from .kernels import PShape, Symbols, f32, func, i64
from .lower_context import FunctionContext, tensor_dims, tensor_type

LANES = 8  # partial sums per dot product (one AVX2 register of f32)
ROW_BLOCK = 32  # state rows per parallel task of gated_delta_net
CHANNEL_BLOCK = 64  # channels per parallel task of ssm_conv
THREADS = 64  # GPU threads per workgroup


def _block(n: int, limit: int) -> int:
    """The largest power of two up to `limit` that divides n (rows per parallel task)."""
    b = limit
    while n % b:
        b //= 2
    return b


def ssm_conv(n_ch: int, k: int, dilation: int = 1) -> tirx.PrimFunc:
    """Args (state [C, H] in place, x [T, C], w [C, K], y [T, C]); H = (K-1)*dilation > 0.

    Parallel over blocks of channels; inside a block the channel loop is innermost (contiguous
    x and y rows) and sums go straight into y, so no scratch buffer is allocated per task."""
    hist = (k - 1) * dilation
    if hist <= 0:
        raise NotImplementedError("ssm_conv with a kernel of width 1 has no state")
    cb = _block(n_ch, CHANNEL_BLOCK)

    @T.prim_func
    def kernel(s_h: T.handle, x_h: T.handle, w_h: T.handle, y_h: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        S = T.match_buffer(s_h, (n_ch, hist), "float32")
        X = T.match_buffer(x_h, (n, n_ch), "float32")
        W = T.match_buffer(w_h, (n_ch, k), "float32")
        Y = T.match_buffer(y_h, (n, n_ch), "float32")
        for blk in T.parallel(T.int64(n_ch // cb)):
            for t in range(n):
                for ci in range(T.int64(cb)):
                    Y[t, blk * cb + ci] = T.float32(0)
                if t >= T.int64(hist):  # the whole window is in this call's x: no history reads
                    for j in range(T.int64(k)):
                        for ci in range(T.int64(cb)):
                            c = blk * cb + ci
                            Y[t, c] = Y[t, c] + W[c, j] * X[t + j * T.int64(dilation) - T.int64(hist), c]
                else:
                    for j in range(T.int64(k)):
                        src = t + j * T.int64(dilation)
                        for ci in range(T.int64(cb)):
                            c = blk * cb + ci
                            Y[t, c] = Y[t, c] + W[c, j] * T.if_then_else(
                                src < T.int64(hist),
                                S[c, T.min(src, T.int64(hist - 1))],
                                X[T.max(src - T.int64(hist), T.int64(0)), c],
                            )
            # new history = the last H columns of [history | x]; increasing m reads n+m > m first
            for ci in range(T.int64(cb)):
                for m in range(T.int64(hist)):
                    src = n + m
                    c = blk * cb + ci
                    S[c, m] = T.if_then_else(
                        src < T.int64(hist),
                        S[c, T.min(src, T.int64(hist - 1))],
                        X[T.max(src - T.int64(hist), T.int64(0)), c],
                    )

    return kernel


def gated_delta_net(hv: int, dv: int, dk: int, hk: int, head_map: str, scale: float,
                    key_decay: bool = False) -> tirx.PrimFunc:
    """Args (state [Hv, Dv, Dk] in place, q [T, Hk, Dk], k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv]
    (key_decay: [T, Hv, Dk], one decay per key index), beta [T, Hv], o [T, Hv, Dv]).

    Parallel over blocks of rows of one head; each task allocates its LANES partial sums once
    (a scratch buffer inside a parallel loop is a workspace allocation, too dear per row) and runs
    the tokens in order, each over the block's rows (the decay is computed once per token, the
    block's rows stay in L1, k and q of the token are shared by the rows)."""
    if head_map not in ("tiled", "interleaved") or hv % hk:
        raise ValueError(f"gated_delta_net: bad head sharing {head_map} for {hv} value / {hk} key heads")
    tiled = head_map == "tiled"
    rep = hv // hk
    lanes = LANES if dk % LANES == 0 else 1
    n_outer = dk // lanes
    rb = _block(dv, ROW_BLOCK)
    g_shape = (dk,) if key_decay else ()

    @T.prim_func
    def kernel(
        s_h: T.handle,
        q_h: T.handle,
        k_h: T.handle,
        v_h: T.handle,
        g_h: T.handle,
        b_h: T.handle,
        o_h: T.handle,
    ) -> None:
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        S = T.match_buffer(s_h, (hv, dv, dk), "float32")
        Q = T.match_buffer(q_h, (n, hk, dk), "float32")
        K = T.match_buffer(k_h, (n, hk, dk), "float32")
        V = T.match_buffer(v_h, (n, hv, dv), "float32")
        G = T.match_buffer(g_h, (n, hv, *g_shape), "float32")
        B = T.match_buffer(b_h, (n, hv), "float32")
        Out = T.match_buffer(o_h, (n, hv, dv), "float32")
        for blk in T.parallel(T.int64(hv * (dv // rb))):
            part = T.decl_buffer((lanes,), "float32", scope="local")
            tot = T.decl_buffer((1,), "float32", scope="local")
            h = blk // T.int64(dv // rb)
            kh = T.if_then_else(tiled, h % T.int64(hk), h // T.int64(rep))
            for t in range(n):
                decay = T.exp(G[t, h]) if not key_decay else T.float32(0)
                for ri in range(T.int64(rb)):
                    i = (blk % T.int64(dv // rb)) * T.int64(rb) + ri
                    # decay the row, then kv = M_i . k
                    for ln in T.vectorized(T.int64(lanes)):
                        part[ln] = T.float32(0)
                    for jo in range(T.int64(n_outer)):
                        for ln in T.vectorized(T.int64(lanes)):
                            S[h, i, jo * lanes + ln] = S[h, i, jo * lanes + ln] * (
                                T.exp(G[t, h, jo * lanes + ln]) if key_decay else decay)
                            part[ln] = part[ln] + S[h, i, jo * lanes + ln] * K[t, kh, jo * lanes + ln]
                    tot[0] = T.float32(0)
                    for ln in range(T.int64(lanes)):
                        tot[0] = tot[0] + part[ln]
                    d = (V[t, h, i] - tot[0]) * B[t, h]
                    # write d * k into the row, then o = M_i . q
                    for ln in T.vectorized(T.int64(lanes)):
                        part[ln] = T.float32(0)
                    for jo in range(T.int64(n_outer)):
                        for ln in T.vectorized(T.int64(lanes)):
                            S[h, i, jo * lanes + ln] = (
                                S[h, i, jo * lanes + ln] + d * K[t, kh, jo * lanes + ln]
                            )
                            part[ln] = part[ln] + S[h, i, jo * lanes + ln] * Q[t, kh, jo * lanes + ln]
                    tot[0] = T.float32(0)
                    for ln in range(T.int64(lanes)):
                        tot[0] = tot[0] + part[ln]
                    Out[t, h, i] = tot[0] * T.float32(scale)

    return kernel


# ---------------------------------------------------------------------------------------------
# norms (TE)


def l2_norm(shape: PShape, eps: float) -> tirx.PrimFunc:
    """x / sqrt(sum(x^2) + eps) over the last axis."""
    x = te.placeholder(shape, "float32", name="x")
    r = te.reduce_axis((i64(0), shape[-1]), name="r")
    lead = shape[:-1]
    ss = te.compute(lead, lambda *i: te.sum(x(*i, r) * x(*i, r), axis=r), name="ss")
    out = te.compute(shape, lambda *i: x(*i) / te.sqrt(ss(*i[:-1]) + f32(eps)), name="out")
    return func([x, out])


def rms_norm_gated(shape: PShape, eps: float, act: str) -> tirx.PrimFunc:
    """rms_norm(x) * w * act(z); args (x, w [D], z, out)."""
    x = te.placeholder(shape, "float32", name="x")
    n = shape[-1]
    w = te.placeholder((n,), "float32", name="w")
    z = te.placeholder(shape, "float32", name="z")
    r = te.reduce_axis((i64(0), n), name="r")
    lead = shape[:-1]
    ss = te.compute(lead, lambda *i: te.sum(x(*i, r) * x(*i, r), axis=r), name="ss")
    rstd = te.compute(
        lead, lambda *i: f32(1.0) / te.sqrt(ss(*i) / n.astype("float32") + f32(eps)), name="rstd"
    )

    def gate(v: tirx.PrimExpr) -> tirx.PrimExpr:
        sig = f32(1.0) / (f32(1.0) + te.exp(-v))
        if act == "silu":
            return v * sig
        if act == "sigmoid":
            return sig
        raise NotImplementedError(f"rms_norm_gated activation {act!r}")

    out = te.compute(shape, lambda *i: x(*i) * rstd(*i[:-1]) * w[i[-1]] * gate(z(*i)), name="out")
    return func([x, w, z, out])


# -- GPU kernels --------------------------------------------------------------------------------


def ssm_conv_gpu(n_ch: int, k: int, dilation: int = 1) -> tirx.PrimFunc:
    """(state [C, H] in place, x [T, C], w [C, K], y [T, C]); H = (K-1)*dilation."""
    hist = (k - 1) * dilation
    if hist <= 0:
        raise NotImplementedError("ssm_conv with a kernel of width 1 has no state")
    C, H, KW, DIL, NT = T.int64(n_ch), T.int64(hist), T.int64(k), T.int64(dilation), T.int64(THREADS)

    @T.prim_func(private=True)
    def ssm_conv_gpu(s_h: T.handle, x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        S = T.match_buffer(s_h, (C, H), "float32")
        X = T.match_buffer(x_h, (n, C), "float32")
        W = T.match_buffer(w_h, (C, KW), "float32")
        Y = T.match_buffer(y_h, (n, C), "float32")
        bx = T.launch_thread("blockIdx.x", (C + NT - T.int64(1)) // NT)
        acc = T.alloc_local((1,), "float32")
        tx = T.launch_thread("threadIdx.x", NT)
        c = T.meta_var(bx * NT + tx)
        if bx * NT + tx < C:
            for t in range(n):
                acc[0] = T.float32(0)
                for j in range(KW):
                    acc[0] = acc[0] + W[c, j] * T.if_then_else(
                        t + j * DIL < H,
                        S[c, T.min(t + j * DIL, H - T.int64(1))],
                        X[T.max(t + j * DIL - H, T.int64(0)), c],
                    )
                Y[t, c] = acc[0]
            for m in range(H):
                S[c, m] = T.if_then_else(n + m < H, S[c, T.min(n + m, H - T.int64(1))],
                                         X[T.max(n + m - H, T.int64(0)), c])

    return ssm_conv_gpu


def gated_delta_net_gpu(hv: int, dv: int, dk: int, hk: int, head_map: str, scale: float,
                        key_decay: bool = False) -> tirx.PrimFunc:
    """(state [Hv, Dv, Dk] in place, q [T, Hk, Dk], k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv]
    (key_decay: [T, Hv, Dk]), beta [T, Hv], o [T, Hv, Dv])."""
    if head_map not in ("tiled", "interleaved") or hv % hk:
        raise ValueError(f"gated_delta_net: bad head sharing {head_map} for {hv} value / {hk} key heads")
    tiled = head_map == "tiled"
    HV, DV, DK, HK, REP = T.int64(hv), T.int64(dv), T.int64(dk), T.int64(hk), T.int64(hv // hk)
    NT, SCALE = T.int64(THREADS), T.float32(scale)
    g_shape = (DK,) if key_decay else ()

    @T.prim_func(private=True)
    def gated_delta_net_gpu(s_h: T.handle, q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle,
                            b_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        S = T.match_buffer(s_h, (HV, DV, DK), "float32")
        Q = T.match_buffer(q_h, (n, HK, DK), "float32")
        K = T.match_buffer(k_h, (n, HK, DK), "float32")
        V = T.match_buffer(v_h, (n, HV, DV), "float32")
        G = T.match_buffer(g_h, (n, HV, *g_shape), "float32")
        B = T.match_buffer(b_h, (n, HV), "float32")
        Out = T.match_buffer(o_h, (n, HV, DV), "float32")
        bx = T.launch_thread("blockIdx.x", (HV * DV + NT - T.int64(1)) // NT)
        acc = T.alloc_local((2,), "float32")
        tx = T.launch_thread("threadIdx.x", NT)
        h = T.meta_var((bx * NT + tx) // DV)
        i = T.meta_var((bx * NT + tx) % DV)
        kh = T.meta_var(T.if_then_else(tiled, (bx * NT + tx) // DV % HK, (bx * NT + tx) // DV // REP))
        if bx * NT + tx < HV * DV:
            for t in range(n):
                acc[1] = T.exp(G[t, h]) if not key_decay else T.float32(0)
                acc[0] = T.float32(0)
                for j in range(DK):
                    S[h, i, j] = S[h, i, j] * (T.exp(G[t, h, j]) if key_decay else acc[1])
                    acc[0] = acc[0] + S[h, i, j] * K[t, kh, j]
                acc[1] = (V[t, h, i] - acc[0]) * B[t, h]
                acc[0] = T.float32(0)
                for j in range(DK):
                    S[h, i, j] = S[h, i, j] + acc[1] * K[t, kh, j]
                    acc[0] = acc[0] + S[h, i, j] * Q[t, kh, j]
                Out[t, h, i] = acc[0] * SCALE

    return gated_delta_net_gpu


# -- lowering -----------------------------------------------------------------------------------
def _state_scan(fc: FunctionContext, node: Node, key: KK.KernelKey, make: Callable[[], tirx.PrimFunc]) -> list[Any]:
    """A kernel that updates its state (input 0) in place and makes one fresh output: outputs
    (new state, y) as the op records them (ssm_conv, gated_delta_net)."""
    gv = fc.mb.kernel(key, make)
    types = [tensor_type(fc.shape(o), o.dtype) for o in node.outputs]
    call = relax.call_tir_inplace(gv, [fc.value(v) for v in node.inputs], [0, -1], types)
    res = fc.bb.emit(call, name_hint=node.outputs[1].name)
    return [fc.bb.emit(relax.TupleGetItem(res, i), name_hint=o.name) for i, o in enumerate(node.outputs)]


def _ssm_conv(fc: FunctionContext, node: Node) -> list[Any]:
    n_ch, k = (int(d) for d in node.inputs[2].shape)
    a: O.SsmConv = node.attrs
    return _state_scan(fc, node, KK.CausalConv(n_ch, k, a.dilation), lambda: ssm_conv(n_ch, k, a.dilation))


def _gated_delta_net(fc: FunctionContext, node: Node) -> list[Any]:
    hv, dv, dk = (int(d) for d in node.inputs[0].shape)
    hk = int(node.inputs[1].shape[1])
    a: O.GatedDeltaNet = node.attrs
    return _state_scan(fc, node, KK.DeltaNetScan(hv, dv, dk, hk, a),
                       lambda: gated_delta_net(hv, dv, dk, hk, a.head_map, a.scale, a.key_decay))


def _norm(kind: str, build: Callable[[PShape, Any], tirx.PrimFunc]) -> Callable[[FunctionContext, Node], list[Any]]:
    def lower(fc: FunctionContext, node: Node) -> list[Any]:
        x = node.inputs[0]
        key = KK.OpKernel(kind, node.attrs, tensor_dims(fc, node))
        return fc.call(key, lambda: build(fc.kernel_shape(x, Symbols()), node.attrs),
                       [fc.value(v) for v in node.inputs], node.outputs, node.outputs[0].name)

    return lower


LINEAR_ATTENTION_LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "ssm_conv": _ssm_conv,
    "gated_delta_net": _gated_delta_net,
    "l2_norm": _norm("l2_norm", lambda shape, a: l2_norm(shape, a.eps)),
    "rms_norm_gated": _norm("rms_norm_gated", lambda shape, a: rms_norm_gated(shape, a.eps, a.act)),
}
