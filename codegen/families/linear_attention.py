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
  L1); dot products accumulate over `LANES` partial sums so the loops vectorise. Calls of
  `CHUNKED_FROM` tokens or more take the chunked WY / UT form instead (`_chunked_scan`: a task per
  value head, chunks of `CHUNK` tokens, the maths of `gated_delta_net_chunked_ref`, either decay);
  shorter calls, decode among them, keep the recurrence. Lowering picks the chunked form for KDA
  (a decay per key index) only; the per-head-decay delta-net runs the recurrence (`_gated_delta_net`).
* `lightning_attention`: minimax-01's linear attention with a fixed decay per head, a call's tokens
  one block as llama.cpp makes them: a parallel task per head runs the block's outputs
  (q_decay-scaled q times the old state, plus the decayed causal q k^T times v, the two sums kept
  apart until the end), then decays the state and adds the k_decay-scaled k^T v; one token takes
  llama.cpp's decode form (update the state, then read it with q).
* `l2_norm`, `rms_norm_gated`: one reduction and one elementwise stage, like `kernels.rms_norm`.

Every kernel takes the token count as a symbolic extent, so one compiled function serves every
call size; argument order follows Relax (inputs, then fresh outputs).

GPU counterparts (`*_gpu`, same arguments and the same in-place contract, state first):
`ssm_conv_gpu` runs one thread per channel over [history | x], then shifts its history row in
place; `gated_delta_net_gpu` runs one thread per state row of a value head (the delta rule updates
each row on its own): for every token, decay the row, kv = row . k, add (v - kv) * beta * k,
o = row . q; `lightning_attention_gpu` runs one thread per state column (h, j), which owns that
column of S[h] and output column j of head h.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.script import tirx as T

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.gpu.schedules import GpuKernel, mark_schedule
from ggufc.codegen.kernels.cpu_vector_math import expf8, rounded, silu_ggml
from ggufc.codegen.kernels.prim_helpers import PShape, Symbols, f32, func, i64
from ggufc.codegen.lower_context import FunctionContext, tensor_dims, tensor_type
from ggufc.ir.graph import Node
from ggufc.ir.linear_attention import GatedDeltaNet, LightningAttention, SsmConv

LANES = 8  # partial sums per dot product (one AVX2 register of f32)
ROW_BLOCK = 32  # state rows per parallel task of gated_delta_net
ROW_GROUP = 4  # rows the recurrence takes side by side: independent dot-product chains to overlap
VEC_DOT_ACCS = 4  # 8-lane accumulators of a row's dot product, as ggml_vec_dot_f32 on AVX2
CHANNEL_BLOCK = 64  # channels per parallel task of ssm_conv
THREADS = 64  # GPU threads per workgroup
CHUNK = 64  # tokens per chunk of the chunked delta rule (llama.cpp's chunk size)
SUB = 16  # tokens per sub-chunk: pairs across sub-chunks share their decay exps
CHUNKED_FROM = 16  # calls of this many tokens or more take the chunked form (benchmarks/bench_kda.py)


def _block(n: int, limit: int) -> int:
    """The largest power of two up to `limit` that divides n (rows per parallel task)."""
    b = limit
    while n % b:
        b //= 2
    return b


def ssm_conv(n_ch: int, k: int, dilation: int = 1) -> tirx.PrimFunc:
    """Args (state [C, H] in place, x [T, C], w [C, K], y [T, C]); H = (K-1)*dilation > 0.

    Parallel over blocks of channels; inside a block the channel loop is innermost (contiguous
    x and y rows) and sums go straight into y, so no scratch buffer is allocated per task. Each
    product is rounded before its add, as ggml_ssm_conv's scalar loop sums them (an arithmetic
    fence: TVM's LLVM builds would fuse it into a multiply-add)."""
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
                            Y[t, c] = Y[t, c] + rounded(W[c, j] * X[t + j * T.int64(dilation) - T.int64(hist), c],
                                                        "float32")
                else:
                    for j in range(T.int64(k)):
                        src = t + j * T.int64(dilation)
                        for ci in range(T.int64(cb)):
                            c = blk * cb + ci
                            Y[t, c] = Y[t, c] + rounded(W[c, j] * T.if_then_else(
                                src < T.int64(hist),
                                S[c, T.min(src, T.int64(hist - 1))],
                                X[T.max(src - T.int64(hist), T.int64(0)), c],
                            ), "float32")
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
                    key_decay: bool = False, chunked_from: int | None = None) -> tirx.PrimFunc:
    """Args (state [Hv, Dv, Dk] in place, q [T, Hk, Dk], k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv]
    (key_decay: [T, Hv, Dk], one decay per key index), beta [T, Hv], o [T, Hv, Dv]).

    Calls of at least `chunked_from` tokens (default `CHUNKED_FROM`; 0: never) take the chunked
    form (`_chunked_scan`) where it is built (Dk and Dv multiples of 8); shorter calls, decode
    among them, the sequential recurrence.

    Sequential: parallel over blocks of rows of one head; each task allocates its partial sums
    once (a scratch buffer inside a parallel loop is a workspace allocation, too dear per row) and
    runs the tokens in order, each over the block's rows (the decay, or the Dk key decays, computed
    once per token; the block's rows stay in L1, k and q of the token are shared by the rows). A
    row's dot products take ggml_vec_dot_f32's AVX2 order where Dk is a multiple of 32 (four 8-lane
    accumulators, GGML_F32x8_REDUCE), so the recurrence is llama.cpp's CPU gated_delta_net op bit for
    bit, which its CPU backend runs per token for prompts too; other Dk one 8-lane accumulator. The
    rows go a group at a time (ROW_GROUP, half that with four accumulators a row), their dot products
    interleaved 8 lanes by 8 lanes: each row keeps its own partial sums in the same order, so the
    values are those of one row at a time, and the chains of dependent adds overlap."""
    if head_map not in ("tiled", "interleaved") or hv % hk:
        raise ValueError(f"gated_delta_net: bad head sharing {head_map} for {hv} value / {hk} key heads")
    tiled = head_map == "tiled"
    rep = hv // hk
    lanes = LANES if dk % LANES == 0 else 1
    n_outer = dk // lanes
    rb = _block(dv, ROW_BLOCK)
    group = _block(rb, ROW_GROUP)
    g_shape = (dk,) if key_decay else ()
    threshold = CHUNKED_FROM if chunked_from is None else chunked_from
    chunked = threshold > 0 and chunked_form_fits(dv, dk)

    # ggml_vec_dot_f32's order (AVX2): four 8-lane accumulators over each 32 keys, reduced as
    # GGML_F32x8_REDUCE; rows whose Dk is not whole runs keep one 8-lane accumulator per row
    accs = VEC_DOT_ACCS if lanes == LANES and dk % (VEC_DOT_ACCS * LANES) == 0 else 1
    if accs > 1:
        group = _block(rb, max(1, ROW_GROUP // 2))  # 4 accumulators a row: 2 rows fill AVX2's 16 registers
    n_runs = n_outer // accs

    @T.macro
    def clear_sums(part):  # type: ignore[no-untyped-def]
        for a in T.unroll(group * accs):
            for ln in T.vectorized(T.int64(lanes)):
                part[a * lanes + ln] = T.float32(0)

    def row_total(part: tirx.Buffer, rr: int) -> tirx.PrimExpr:
        """Row rr's partial sums added up: GGML_F32x8_REDUCE, or in lane order with one accumulator."""
        def at(a: int, ln: int) -> tirx.PrimExpr:
            return part[(rr * accs + a) * lanes + ln]

        if accs == 1:
            total = at(0, 0)
            for ln in range(1, lanes):
                total = total + at(0, ln)
            return total
        x = [(at(0, ln) + at(2, ln)) + (at(1, ln) + at(3, ln)) for ln in range(LANES)]
        t0 = [x[j] + x[j + 4] for j in range(4)]
        return (t0[0] + t0[1]) + (t0[2] + t0[3])

    @T.macro
    def row_totals(part, tot):  # type: ignore[no-untyped-def]
        for rr in T.unroll(group):
            tot[rr] = row_total(part, rr)

    @T.macro
    def sequential(S, Q, K, V, G, B, Out, n):  # type: ignore[no-untyped-def]
        for blk in T.parallel(T.int64(hv * (dv // rb))):
            part = T.decl_buffer((group * accs * lanes,), "float32", scope="local")
            tot = T.decl_buffer((group,), "float32", scope="local")
            dd = T.decl_buffer((group,), "float32", scope="local")
            eg = T.decl_buffer((dk if key_decay else 1,), "float32")  # the token's key decays exp(g)
            h = blk // T.int64(dv // rb)
            kh = T.if_then_else(tiled, h % T.int64(hk), h // T.int64(rep))
            row0 = (blk % T.int64(dv // rb)) * T.int64(rb)
            for t in range(n):
                decay = T.exp(G[t, h]) if not key_decay else T.float32(0)
                if key_decay:
                    for j in range(T.int64(dk)):
                        eg[j] = T.exp(G[t, h, j])
                for rg in range(T.int64(rb // group)):
                    # decay the rows, then kv = M_i . k
                    clear_sums(part)
                    for run in range(T.int64(n_runs)):
                        for a in T.unroll(accs):
                            for rr in T.unroll(group):
                                for ln in T.vectorized(T.int64(lanes)):
                                    i = row0 + rg * T.int64(group) + rr
                                    j = T.meta_var((run * T.int64(accs) + a) * T.int64(lanes) + ln)
                                    S[h, i, j] = S[h, i, j] * (eg[j] if key_decay else decay)
                                    part[(rr * accs + a) * lanes + ln] = (part[(rr * accs + a) * lanes + ln]
                                                                          + S[h, i, j] * K[t, kh, j])
                    row_totals(part, tot)
                    for rr in T.unroll(group):
                        dd[rr] = (V[t, h, row0 + rg * T.int64(group) + rr] - tot[rr]) * B[t, h]
                    # write d * k into the rows, then o = M_i . q
                    clear_sums(part)
                    for run in range(T.int64(n_runs)):
                        for a in T.unroll(accs):
                            for rr in T.unroll(group):
                                for ln in T.vectorized(T.int64(lanes)):
                                    i = row0 + rg * T.int64(group) + rr
                                    j = T.meta_var((run * T.int64(accs) + a) * T.int64(lanes) + ln)
                                    S[h, i, j] = S[h, i, j] + dd[rr] * K[t, kh, j]
                                    part[(rr * accs + a) * lanes + ln] = (part[(rr * accs + a) * lanes + ln]
                                                                          + S[h, i, j] * Q[t, kh, j])
                    row_totals(part, tot)
                    for rr in T.unroll(group):
                        Out[t, h, row0 + rg * T.int64(group) + rr] = tot[rr] * T.float32(scale)

    chunk_scan = _chunked_scan(hv, dv, dk, hk, head_map, scale, key_decay) if chunked else sequential

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
        if chunked and n >= T.int64(threshold):
            chunk_scan(S, Q, K, V, G, B, Out, n)
        else:
            sequential(S, Q, K, V, G, B, Out, n)

    return kernel


def chunked_form_fits(dv: int, dk: int) -> bool:
    """Where the chunked form is built: 8-lane rows."""
    return dk % LANES == 0 and dv % LANES == 0


def _chunked_scan(hv: int, dv: int, dk: int, hk: int, head_map: str, scale: float, key_decay: bool) -> Any:
    """The chunked (WY / UT transform) form of the delta rule as a TIR macro, the maths of
    `gated_delta_net_chunked_ref` (a per-head decay is the same decay on every key index): a
    parallel task per value head runs its chunks of CHUNK tokens in order. Per chunk (n tokens,
    gc = cumsum of g per key index, all decays exp(gc_i - gc_j), j <= i, at most 1 so no overflow
    whatever the gate):

      A[i, j] = beta_i sum_d k_i k_j e^(gc_i - gc_j)  (j < i),  P[i, j] = sum_d q_i k_j e^(gc_i - gc_j)  (j <= i)
      U = (I + A)^-1 (beta v),  W = (I + A)^-1 (beta k e^gc)       (forward substitution, row by row)
      Vn = U - W S,  o = scale (q e^gc S + P Vn),  S' = e^gc_last S + (k e^(gc_last - gc))^T Vn

    with S = M^T: the state rows M[h, r, :] are read and written in place. The exps are llama.cpp's
    8-lane `expf8`; every product runs over 8-lane rows."""
    tiled = head_map == "tiled"
    rep = hv // hk
    C, L = CHUNK, LANES
    DK8 = dk // L

    def vec(buf: Any, *idx: Any) -> Any:
        return buf.vload(list(idx), "float32x8")

    def hsum(p: Any) -> Any:
        return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]))

    @T.macro
    def scan(S, Q, K, V, G, B, Out, n):  # type: ignore[no-untyped-def]
        for h in T.parallel(T.int64(hv)):
            gc = T.decl_buffer((C * dk,), "float32")  # running sums of the decay logits
            qg = T.decl_buffer((C * dk,), "float32")  # q e^gc
            kd = T.decl_buffer((C * dk,), "float32")  # k e^(gc_last - gc)
            w = T.decl_buffer((C * dk,), "float32")  # beta k e^gc, then W
            a = T.decl_buffer((C * C,), "float32")
            p = T.decl_buffer((C * C,), "float32")
            u = T.decl_buffer((C * dv,), "float32")  # beta v, then U, then Vn
            last = T.decl_buffer((dk,), "float32")  # e^gc_last
            pa = T.decl_buffer((L,), "float32")
            pp = T.decl_buffer((L,), "float32")
            qs = T.decl_buffer((C * dk,), "float32")  # q e^(gc - gc_b), b the first token of its sub-chunk
            ks = T.decl_buffer((C * dk,), "float32")  # k e^(gc - gc_b)
            kb = T.decl_buffer((C // SUB * C * dk,), "float32")  # per sub-chunk: earlier k e^(gc_b - gc)
            kh = T.if_then_else(tiled, h % T.int64(hk), h // T.int64(rep))
            for c in range((n + T.int64(C - 1)) // T.int64(C)):
                c0 = c * T.int64(C)
                m = T.min(n - c0, T.int64(C))
                # gc: running sums of g; the per-token rows of the chunk
                for i in range(m):
                    for d in T.vectorized(T.int64(dk)):
                        gc[i * dk + d] = (G[c0 + i, h, d] if key_decay else G[c0 + i, h]) + T.if_then_else(
                            i > T.int64(0), gc[T.max(i - T.int64(1), T.int64(0)) * dk + d], T.float32(0))
                for d8 in range(T.int64(DK8)):
                    last[d8 * L:d8 * L + L] = expf8(vec(gc, (m - T.int64(1)) * dk + d8 * L))
                for i in range(m):
                    for d8 in range(T.int64(DK8)):
                        eg = T.meta_var(expf8(vec(gc, i * dk + d8 * L)))
                        el = T.meta_var(expf8(vec(gc, (m - T.int64(1)) * dk + d8 * L) - vec(gc, i * dk + d8 * L)))
                        qg[i * dk + d8 * L:i * dk + d8 * L + L] = vec(Q, c0 + i, kh, d8 * L) * eg
                        w[i * dk + d8 * L:i * dk + d8 * L + L] = (vec(K, c0 + i, kh, d8 * L) * eg
                                                                  * T.broadcast(B[c0 + i, h], L))
                        kd[i * dk + d8 * L:i * dk + d8 * L + L] = vec(K, c0 + i, kh, d8 * L) * el
                    for r in T.vectorized(T.int64(dv)):
                        u[i * dv + r] = V[c0 + i, h, r] * B[c0 + i, h]
                # A (strictly below the diagonal) and P (on and below it). A pair in one sub-chunk
                # takes its decay row whole; a pair across sub-chunks splits it at the first token b
                # of i's sub-chunk, e^(gc_i - gc_b) e^(gc_b - gc_j) (both factors at most 1), so
                # the exps are per token and per (sub-chunk, earlier token), not per pair
                for i in range(m):
                    b = i // T.int64(SUB) * T.int64(SUB)
                    for d8 in range(T.int64(DK8)):
                        e = T.meta_var(expf8(vec(gc, i * dk + d8 * L) - vec(gc, b * dk + d8 * L)))
                        qs[i * dk + d8 * L:i * dk + d8 * L + L] = vec(Q, c0 + i, kh, d8 * L) * e
                        ks[i * dk + d8 * L:i * dk + d8 * L + L] = vec(K, c0 + i, kh, d8 * L) * e
                for sc in range((m + T.int64(SUB - 1)) // T.int64(SUB)):
                    for j in range(sc * T.int64(SUB)):
                        for d8 in range(T.int64(DK8)):
                            e = T.meta_var(expf8(vec(gc, sc * T.int64(SUB) * dk + d8 * L) - vec(gc, j * dk + d8 * L)))
                            kb[(sc * C + j) * dk + d8 * L:(sc * C + j) * dk + d8 * L + L] = (
                                vec(K, c0 + j, kh, d8 * L) * e)
                for i in range(m):
                    b = i // T.int64(SUB) * T.int64(SUB)
                    for j in range(i + T.int64(1)):
                        for ln in T.vectorized(T.int64(L)):
                            pa[ln] = T.float32(0)
                            pp[ln] = T.float32(0)
                        if j >= b:
                            for d8 in range(T.int64(DK8)):
                                e = T.meta_var(expf8(vec(gc, i * dk + d8 * L) - vec(gc, j * dk + d8 * L)))
                                kj = T.meta_var(vec(K, c0 + j, kh, d8 * L) * e)
                                pa[0:L] = pa.vload([0], "float32x8") + vec(K, c0 + i, kh, d8 * L) * kj
                                pp[0:L] = pp.vload([0], "float32x8") + vec(Q, c0 + i, kh, d8 * L) * kj
                        else:
                            for d8 in range(T.int64(DK8)):
                                kj = T.meta_var(vec(kb, ((i // T.int64(SUB)) * C + j) * dk + d8 * L))
                                pa[0:L] = pa.vload([0], "float32x8") + vec(ks, i * dk + d8 * L) * kj
                                pp[0:L] = pp.vload([0], "float32x8") + vec(qs, i * dk + d8 * L) * kj
                        a[i * C + j] = hsum(pa) * B[c0 + i, h]
                        p[i * C + j] = hsum(pp)
                # U and W by forward substitution: X_i -= A[i, j] X_j for j < i
                for i in range(m):
                    for j in range(i):
                        for r in T.vectorized(T.int64(dv)):
                            u[i * dv + r] = u[i * dv + r] - a[i * C + j] * u[j * dv + r]
                        for d in T.vectorized(T.int64(dk)):
                            w[i * dk + d] = w[i * dk + d] - a[i * C + j] * w[j * dk + d]
                # Vn = U - W S and the state's share of o, q e^gc S, over the state rows
                for i in range(m):
                    for r in range(T.int64(dv)):
                        for ln in T.vectorized(T.int64(L)):
                            pa[ln] = T.float32(0)
                            pp[ln] = T.float32(0)
                        for d8 in range(T.int64(DK8)):
                            pa[0:L] = pa.vload([0], "float32x8") + vec(w, i * dk + d8 * L) * vec(S, h, r, d8 * L)
                            pp[0:L] = pp.vload([0], "float32x8") + vec(qg, i * dk + d8 * L) * vec(S, h, r, d8 * L)
                        u[i * dv + r] = u[i * dv + r] - hsum(pa)
                        Out[c0 + i, h, r] = hsum(pp)
                # o += P Vn, then times the scale
                for i in range(m):
                    for j in range(i + T.int64(1)):
                        for r in T.vectorized(T.int64(dv)):
                            Out[c0 + i, h, r] = Out[c0 + i, h, r] + p[i * C + j] * u[j * dv + r]
                    for r in T.vectorized(T.int64(dv)):
                        Out[c0 + i, h, r] = Out[c0 + i, h, r] * T.float32(scale)
                # S' = e^gc_last S + (k e^(gc_last - gc))^T Vn, row by row of M
                for r in range(T.int64(dv)):
                    for d in T.vectorized(T.int64(dk)):
                        S[h, r, d] = S[h, r, d] * last[d]
                    for j in range(m):
                        for d in T.vectorized(T.int64(dk)):
                            S[h, r, d] = S[h, r, d] + kd[j * dk + d] * u[j * dv + r]

    return scan


# ---------------------------------------------------------------------------------------------
# norms (TE)


def l2_norm(shape: PShape, eps: float, cpu: bool = False) -> tirx.PrimFunc:
    """x / sqrt(sum(x^2) + eps) over the last axis. `cpu`: in the steps of llama.cpp's
    build_gdn_l2_norm, ggml_scale(ggml_rms_norm(x, eps / n), 1 / sqrtf(n)) on its CPU backend (the
    float32 squares summed in float64, the mean rounded to float32, two rounded scalings); other
    targets sum in float32 and divide once."""
    x = te.placeholder(shape, "float32", name="x")
    n = shape[-1]
    r = te.reduce_axis((i64(0), n), name="r")
    lead = shape[:-1]
    if not cpu:
        ss = te.compute(lead, lambda *i: te.sum(x(*i, r) * x(*i, r), axis=r), name="ss")
        out = te.compute(shape, lambda *i: x(*i) / te.sqrt(ss(*i[:-1]) + f32(eps)), name="out")
        return func([x, out])
    # eps / n and 1 / sqrtf(n) rounded as llama.cpp rounds them (float32), not folded by TVM
    width = np.float32(int(n))
    eps_n, inv_sqrt_n = float(np.float32(eps) / width), float(np.float32(1) / np.sqrt(width))
    ss = te.compute(lead, lambda *i: te.sum((x(*i, r) * x(*i, r)).astype("float64"), axis=r), name="ss")
    rstd = te.compute(lead, lambda *i: f32(1.0) / te.sqrt((ss(*i) / n.astype("float64")).astype("float32")
                                                         + f32(eps_n)), name="rstd")
    normed = te.compute(shape, lambda *i: x(*i) * rstd(*i[:-1]), name="normed")
    out = te.compute(shape, lambda *i: normed(*i) * f32(inv_sqrt_n), name="out")
    return func([x, out])


def rms_norm_gated(shape: PShape, eps: float, act: str, cpu: bool = False) -> tirx.PrimFunc:
    """rms_norm(x) * w * act(z); args (x, w [D], z, out). `cpu`: as ggml's CPU ops (rms_norm's squares
    summed in float64, the mean rounded to float32; SiLU as ggml_v_silu where rows are whole 8-lane
    vectors); other targets sum in float32."""
    x = te.placeholder(shape, "float32", name="x")
    n = shape[-1]
    w = te.placeholder((n,), "float32", name="w")
    z = te.placeholder(shape, "float32", name="z")
    r = te.reduce_axis((i64(0), n), name="r")
    lead = shape[:-1]
    acc = "float64" if cpu else "float32"
    ss = te.compute(lead, lambda *i: te.sum((x(*i, r) * x(*i, r)).astype(acc), axis=r), name="ss")
    rstd = te.compute(
        lead, lambda *i: f32(1.0) / te.sqrt((ss(*i) / n.astype(acc)).astype("float32") + f32(eps)), name="rstd"
    )
    ggml_silu = cpu and isinstance(n, (int, tirx.IntImm)) and int(n) % 8 == 0

    def gate(v: tirx.PrimExpr) -> tirx.PrimExpr:
        sig = f32(1.0) / (f32(1.0) + te.exp(-v))
        if act == "silu" and ggml_silu:
            return silu_ggml(v)
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


def _per_head(h: Any, values: tuple[float, ...]) -> Any:
    """values[h] as a float32 expression of the int64 head index h (a select chain over the constants)."""
    out = tirx.const(values[-1], "float32")
    for i in range(len(values) - 2, -1, -1):
        out = tirx.Select(h == tirx.const(i, "int64"), tirx.const(values[i], "float32"), out)
    return out


def lightning_attention(h: int, dk: int, dv: int, slopes: tuple[float, ...], layer_scale: float) -> tirx.PrimFunc:
    """Args (state [H, Dk, Dv] in place, q [T, H, Dk], k [T, H, Dk], v [T, H, Dv], o [T, H, Dv]):
    the maths of `lightning_attention_ref`, every decay exp(f32(-slope * count) * layer_scale) made
    in the reference's (llama.cpp's) float32 order.

    One parallel task per head: for each token, `inter` = (q q_decay) . S and `intra` = sum over
    the earlier keys u of (q . k_u) diag(t - u) v_u, written as their sum; then each state row
    S[i] = S[i] * block_decay + sum_t (k[t, i] k_decay[t]) v_t. The Dv columns go LANES at a time
    (contiguous rows of S and v)."""
    lanes = LANES if dv % LANES == 0 else 1
    n_outer = dv // lanes
    dl = LANES if dk % LANES == 0 else 1
    scale = T.float32(layer_scale)

    @T.macro
    def axpy(acc, a, B, i0, i1):  # type: ignore[no-untyped-def]
        """acc[j] += a * B[i0, i1, j] over the Dv columns."""
        for jo in range(T.int64(n_outer)):
            for ln in T.vectorized(T.int64(lanes)):
                acc[jo * lanes + ln] = acc[jo * lanes + ln] + a * B[i0, i1, jo * lanes + ln]

    @T.macro
    def clear(acc):  # type: ignore[no-untyped-def]
        for jo in range(T.int64(n_outer)):
            for ln in T.vectorized(T.int64(lanes)):
                acc[jo * lanes + ln] = T.float32(0)

    @T.prim_func
    def kernel(s_h: T.handle, q_h: T.handle, k_h: T.handle, v_h: T.handle, o_h: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        S = T.match_buffer(s_h, (h, dk, dv), "float32")
        Q = T.match_buffer(q_h, (n, h, dk), "float32")
        K = T.match_buffer(k_h, (n, h, dk), "float32")
        V = T.match_buffer(v_h, (n, h, dv), "float32")
        Out = T.match_buffer(o_h, (n, h, dv), "float32")
        for hh in T.parallel(T.int64(h)):
            inter = T.decl_buffer((dv,), "float32")
            intra = T.decl_buffer((dv,), "float32")
            part = T.decl_buffer((dl,), "float32", scope="local")
            w = T.decl_buffer((2,), "float32", scope="local")
            slope = T.meta_var(_per_head(hh, slopes))
            w[1] = T.exp(slope * scale * T.Cast("float32", T.int64(0) - n))  # the block's state decay
            if n == T.int64(1):
                for i in range(T.int64(dk)):
                    for jo in range(T.int64(n_outer)):
                        for ln in T.vectorized(T.int64(lanes)):
                            S[hh, i, jo * lanes + ln] = (S[hh, i, jo * lanes + ln] * w[1]
                                                         + K[0, hh, i] * V[0, hh, jo * lanes + ln])
                clear(inter)
                for i in range(T.int64(dk)):
                    axpy(inter, Q[0, hh, i], S, hh, i)
                for j in range(T.int64(dv)):
                    Out[0, hh, j] = inter[j]
            else:
                for t in range(n):
                    clear(inter)
                    clear(intra)
                    w[0] = T.exp(-slope * T.Cast("float32", t + T.int64(1)) * scale)
                    for i in range(T.int64(dk)):
                        axpy(inter, Q[t, hh, i] * w[0], S, hh, i)
                    for u in range(t + T.int64(1)):
                        for ln in T.vectorized(T.int64(dl)):
                            part[ln] = T.float32(0)
                        for do in range(T.int64(dk // dl)):
                            for ln in T.vectorized(T.int64(dl)):
                                part[ln] = part[ln] + Q[t, hh, do * dl + ln] * K[u, hh, do * dl + ln]
                        w[0] = T.float32(0)
                        for ln in range(T.int64(dl)):
                            w[0] = w[0] + part[ln]
                        w[0] = w[0] * T.exp(-slope * T.Cast("float32", t - u) * scale)
                        axpy(intra, w[0], V, u, hh)
                    for j in range(T.int64(dv)):
                        Out[t, hh, j] = inter[j] + intra[j]
                for i in range(T.int64(dk)):
                    clear(inter)
                    for t in range(n):
                        axpy(inter, K[t, hh, i] * T.exp(-slope * T.Cast("float32", n - t - T.int64(1)) * scale),
                             V, t, hh)
                    for jo in range(T.int64(n_outer)):
                        for ln in T.vectorized(T.int64(lanes)):
                            S[hh, i, jo * lanes + ln] = S[hh, i, jo * lanes + ln] * w[1] + inter[jo * lanes + ln]

    return kernel


def lightning_attention_gpu(h: int, dk: int, dv: int, slopes: tuple[float, ...], layer_scale: float) -> tirx.PrimFunc:
    """(state [H, Dk, Dv] in place, q [T, H, Dk], k [T, H, Dk], v [T, H, Dv], o [T, H, Dv]): one
    thread per state column (h, j), the CPU kernel's order of operations within the column."""
    H, DK, DV, NT = T.int64(h), T.int64(dk), T.int64(dv), T.int64(THREADS)
    scale = T.float32(layer_scale)

    @T.prim_func(private=True)
    def lightning_attention_gpu(s_h: T.handle, q_h: T.handle, k_h: T.handle, v_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        S = T.match_buffer(s_h, (H, DK, DV), "float32")
        Q = T.match_buffer(q_h, (n, H, DK), "float32")
        K = T.match_buffer(k_h, (n, H, DK), "float32")
        V = T.match_buffer(v_h, (n, H, DV), "float32")
        Out = T.match_buffer(o_h, (n, H, DV), "float32")
        bx = T.launch_thread("blockIdx.x", (H * DV + NT - T.int64(1)) // NT)
        acc = T.alloc_local((4,), "float32")
        tx = T.launch_thread("threadIdx.x", NT)
        hh = T.meta_var((bx * NT + tx) // DV)
        j = T.meta_var((bx * NT + tx) % DV)
        slope = T.meta_var(_per_head((bx * NT + tx) // DV, slopes))
        if bx * NT + tx < H * DV:
            acc[3] = T.exp(slope * scale * T.Cast("float32", T.int64(0) - n))
            if n == T.int64(1):
                acc[0] = T.float32(0)
                for i in range(DK):
                    S[hh, i, j] = S[hh, i, j] * acc[3] + K[0, hh, i] * V[0, hh, j]
                    acc[0] = acc[0] + Q[0, hh, i] * S[hh, i, j]
                Out[0, hh, j] = acc[0]
            else:
                for t in range(n):
                    acc[0] = T.float32(0)
                    for i in range(DK):
                        qd = T.meta_var(T.exp(-slope * T.Cast("float32", t + T.int64(1)) * scale))
                        acc[0] = acc[0] + Q[t, hh, i] * qd * S[hh, i, j]
                    acc[1] = T.float32(0)
                    for u in range(t + T.int64(1)):
                        acc[2] = T.float32(0)
                        # unrolled: llvmpipe (lavapipe) stops a loop after 65535 iterations counted over
                        # all its entries, which this one (Dk per query-key pair) passes after 512 pairs
                        for d in T.unroll(DK):
                            acc[2] = acc[2] + Q[t, hh, d] * K[u, hh, d]
                        acc[1] = acc[1] + acc[2] * T.exp(-slope * T.Cast("float32", t - u) * scale) * V[u, hh, j]
                    Out[t, hh, j] = acc[0] + acc[1]
                for i in range(DK):
                    acc[0] = T.float32(0)
                    for t in range(n):
                        kd = T.meta_var(T.exp(-slope * T.Cast("float32", n - t - T.int64(1)) * scale))
                        acc[0] = acc[0] + K[t, hh, i] * kd * V[t, hh, j]
                    S[hh, i, j] = S[hh, i, j] * acc[3] + acc[0]

    return lightning_attention_gpu


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
    a: SsmConv = node.attrs
    return _state_scan(fc, node, KK.CausalConv(n_ch, k, a.dilation), lambda: ssm_conv(n_ch, k, a.dilation))


def _gated_delta_net(fc: FunctionContext, node: Node) -> list[Any]:
    hv, dv, dk = (int(d) for d in node.inputs[0].shape)
    hk = int(node.inputs[1].shape[1])
    a: GatedDeltaNet = node.attrs
    # Only KDA (a decay per key index, Dk exps per token in the recurrence) takes the chunked form
    # for long calls. With one decay per head the recurrence is faster: on qwen35's shapes (Hv 12,
    # Dk = Dv 128), 128 tokens and 2 threads the chunked form took 1.8x its time, and several times
    # more on strongly decaying heads, whose e^gc within a chunk falls below e^-87 (subnormal).
    chunked_from = None if a.key_decay else 0
    return _state_scan(fc, node, KK.DeltaNetScan(hv, dv, dk, hk, a),
                       lambda: gated_delta_net(hv, dv, dk, hk, a.head_map, a.scale, a.key_decay, chunked_from))


def _lightning_attention(fc: FunctionContext, node: Node) -> list[Any]:
    h, dk, dv = (int(d) for d in node.inputs[0].shape)
    a: LightningAttention = node.attrs
    return _state_scan(fc, node, KK.LightningScan(h, dk, dv, a),
                       lambda: lightning_attention(h, dk, dv, a.slopes, a.layer_scale))


def _norm(kind: str, build: Callable[[PShape, Any, bool], tirx.PrimFunc]
          ) -> Callable[[FunctionContext, Node], list[Any]]:
    """build(shape, attrs, cpu): `cpu` where the target is llvm (sums in float64 as ggml's CPU ops)."""
    def lower(fc: FunctionContext, node: Node) -> list[Any]:
        x = node.inputs[0]
        key = KK.OpKernel(kind, node.attrs, tensor_dims(fc, node))
        cpu = fc.mb.target.kind.name == "llvm"
        return fc.call(key, lambda: build(fc.kernel_shape(x, Symbols()), node.attrs, cpu),
                       [fc.value(v) for v in node.inputs], node.outputs, node.outputs[0].name)

    return lower


LINEAR_ATTENTION_LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "ssm_conv": _ssm_conv,
    "gated_delta_net": _gated_delta_net,
    "lightning_attention": _lightning_attention,
    "l2_norm": _norm("l2_norm", lambda shape, a, cpu: l2_norm(shape, a.eps, cpu)),
    "rms_norm_gated": _norm("rms_norm_gated", lambda shape, a, cpu: rms_norm_gated(shape, a.eps, a.act, cpu)),
}


# ---------------------------------------------------------------------------------------------
# GPU kernels by key kind (merged into the GPU targets' table by lower.py)


def _causal_conv_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    return mark_schedule(ssm_conv_gpu(key.channels, key.width, key.dilation), "ggufc.scan_per_channel")


def _delta_net_scan_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    return mark_schedule(gated_delta_net_gpu(key.hv, key.dv, key.dk, key.hk, key.attrs.head_map, key.attrs.scale,
                                        key.attrs.key_decay),
                 "ggufc.scan_per_row")


def _lightning_scan_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    return mark_schedule(lightning_attention_gpu(key.h, key.dk, key.dv, key.attrs.slopes, key.attrs.layer_scale),
                         "ggufc.scan_per_column")


GPU_KERNELS: dict[str, GpuKernel] = {
    KK.CausalConv.kind: _causal_conv_gpu_kernel,
    KK.DeltaNetScan.kind: _delta_net_scan_gpu_kernel,
    KK.LightningScan.kind: _lightning_scan_gpu_kernel,
}
