"""Causal attention over the KV cache, one (token, head) row at a time.

Each row reads only its visible cache rows [0, pos + t]: scores go to a per-row scratch of the
cache length (a compile-time constant), then one pass takes the softmax (llama.cpp's: its vector
exp, sums in float64, probabilities scaled by 1 / sum) and accumulates V. No
[heads, T, cache] matrix is materialised and masked cells are never touched. Dot products keep
8 partial sums so they vectorise without reassociating floats behind LLVM's back. Rows are spread
over the thread pool.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .cpu_vec import expf8

LANES = 8


def attention_rows(n_head: int, n_kv: int, dim: int, n_cells: int, scale: float) -> tirx.PrimFunc:
    """(q [T, H, D], k_cache [C, Hkv, D], v_cache [C, Hkv, D], pos, out [T, H, D])."""
    if dim % LANES:
        raise ValueError(f"attention: head dim {dim} must be a multiple of {LANES}")
    H, HKV, D, C = T.int64(n_head), T.int64(n_kv), T.int64(dim), T.int64(n_cells)
    G, DL, L = T.int64(n_head // n_kv), T.int64(dim // LANES), T.int64(LANES)
    SCALE = T.float32(scale)
    CP = T.int64(-(-n_cells // 16) * 16)  # scores scratch in whole 16-lane chunks

    @T.prim_func(private=True)
    def attention(q_h: T.handle, k_cache: T.Buffer((C, HKV, D), "float32"),
                  v_cache: T.Buffer((C, HKV, D), "float32"), pos: T.int64, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        q = T.match_buffer(q_h, (n, H, D), "float32")
        o = T.match_buffer(o_h, (n, H, D), "float32")
        for row in T.parallel(n * H):
            t = row // H
            h = row % H
            kv = h // G
            visible = pos + t + T.int64(1)
            scores = T.decl_buffer((CP,), "float32")
            acc = T.decl_buffer((D,), "float32")
            part = T.decl_buffer((L,), "float32")
            stat = T.decl_buffer((2,), "float32")  # max, 1 / sum
            total = T.decl_buffer((1,), "float64")
            stat[0] = T.float32(-3.0e38)
            for s in range(visible):
                for lane in T.vectorized(L):
                    part[lane] = T.float32(0)
                for d0 in range(DL):
                    for lane in T.vectorized(L):
                        part[lane] = part[lane] + q[t, h, d0 * L + lane] * k_cache[s, kv, d0 * L + lane]
                pair_sums = (part[0] + part[1]) + (part[2] + part[3]) + ((part[4] + part[5]) + (part[6] + part[7]))
                scores[s] = pair_sums * SCALE
                stat[0] = T.max(stat[0], scores[s])
            # llama.cpp's softmax (ggml_vec_soft_max_f32): its vector exp on 16 scores at a time
            # (the padding after the last visible cell gives 0), each 16 summed in float32 as
            # _mm512_reduce_add_ps does and the sums in float64; then the scores times 1 / sum
            chunks = (visible + T.int64(15)) // T.int64(16)
            for s in range(visible, chunks * T.int64(16)):
                scores[s] = T.float32(-3.0e38)
            total[0] = T.float64(0)
            for c in range(chunks):
                lo = T.meta_var(expf8(scores.vload([c * 16], "float32x8") - T.broadcast(stat[0], 8)))
                hi = T.meta_var(expf8(scores.vload([c * 16 + 8], "float32x8") - T.broadcast(stat[0], 8)))
                scores[c * 16:c * 16 + 8] = lo
                scores[c * 16 + 8:c * 16 + 16] = hi
                part[0:8] = scores.vload([c * 16], "float32x8") + scores.vload([c * 16 + 8], "float32x8")
                total[0] = total[0] + T.Cast("float64", ((part[0] + part[4]) + (part[2] + part[6]))
                                                         + ((part[1] + part[5]) + (part[3] + part[7])))
            stat[1] = T.Cast("float32", T.float64(1) / total[0])
            for d in T.vectorized(D):
                acc[d] = T.float32(0)
            for s in range(visible):
                for d in T.vectorized(D):
                    acc[d] = acc[d] + scores[s] * stat[1] * v_cache[s, kv, d]
            for d in T.vectorized(D):
                o[t, h, d] = acc[d]

    return attention
