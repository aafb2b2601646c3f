"""GPU kernels of the gated delta-net family's two stateful scans (qwen35, qwen3next, qwen4exp).

The CPU versions (`kernels_recurrent.py`) are hand-written TIR with parallel and vectorised
loops; these are their GPU counterparts with the same arguments and the same in-place contract
(Relax `call_tir_inplace`, state first):

* `ssm_conv`: one thread per channel runs the call's tokens in order over [history | x], then
  shifts its history row in place (ascending m reads n + m > m first, as on CPU);
* `gated_delta_net`: one thread per state row i of value head h (the delta rule updates each row
  of M[h] on its own, needing only v[t, h, i], the head's shared k/q and the gates): for every
  token, decay the row, kv = row . k, add (v - kv) * beta * k, o = row . q.

Both read every symbolic size from their arguments, so one kernel serves decode and prefill.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

THREADS = 64


def ssm_conv(n_ch: int, k: int, dilation: int = 1) -> tirx.PrimFunc:
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


def gated_delta_net(hv: int, dv: int, dk: int, hk: int, head_map: str, scale: float,
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
