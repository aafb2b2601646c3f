"""x @ W.T for float32 weights in eight float lanes, as llama.cpp's AVX2 build computes it.

ggml's CPU mul_mat takes one of two orders for a float32 weight, decided per call by its row count:

* two or more activation rows (a prompt): llamafile's tinyBLAS (ggml-cpu/llamafile/sgemm.cpp,
  `tinyBLAS<8, __m256, ...>` without AVX-512; weights of m % 4 == 0 rows, k % 8 == 0). Each output
  keeps one 8-lane accumulator, one fused multiply-add per 8 columns in column order, summed as its
  `hsum(__m256)`: ((0+4) + (2+6)) + ((1+5) + (3+7)). Its tiles (4 rows by up to 3 tokens) change
  which outputs share registers, never an output's order.
* one row (sgemm is "only for prompt processing"): ggml_vec_dot_f32, four 8-lane accumulators
  over each 32 columns, reduced as GGML_F32x8_REDUCE: (s0 + s2) + (s1 + s3), then lane j + j + 4,
  then two pairwise adds, ((0+1) + (2+3)).

The kernel takes tinyBLAS's tiles for prompts (a task: 4 rows through every token, 3 tokens per
pass, 12 accumulators in AVX2's 16 registers; the last T % 3 one at a time) and vec_dot's steps for
a one-row call, or for every row where each must equal a one-token call (`one_token_order`: verify,
batched decode). Both need k % 32 == 0 here (vec_dot's scalar tail sums in double). The AVX-512
build takes 16 lanes and other sums (not modelled: its CPUs keep the float kernels' order).
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ggufc.codegen.kernels.cpu_vector_math import fma8, hsum8

LANES = 8
ROWS = 4  # weight rows per task: tinyBLAS's RM
TOKENS = 3  # tokens per pass: its RN with 16 vector registers
VEC_DOT_RUN = 32  # columns per step of ggml_vec_dot_f32: four 8-lane accumulators


def lane_dot_supported(qtype: str, n: int, k: int, target: tvm.target.Target) -> bool:
    """Whether llama.cpp's build for `target` takes these 8-lane float32 orders for this weight:
    AVX2 + FMA without AVX-512, m % 4 == 0 (tinyBLAS's), k % 32 == 0 (module docstring)."""
    features = tvm.target.codegen.target_has_features
    return (qtype == "F32" and target.kind.name == "llvm" and n % ROWS == 0 and k % VEC_DOT_RUN == 0
            and features("avx2", target) and features("fma", target) and not features("avx512f", target))


def _vec_dot_sum(acc: tirx.Buffer, r: int) -> tirx.PrimExpr:
    """GGML_F32x8_REDUCE of row r's four accumulators acc[4r .. 4r + 3] (module docstring)."""
    x = [(acc[4 * r, j] + acc[4 * r + 2, j]) + (acc[4 * r + 1, j] + acc[4 * r + 3, j]) for j in range(LANES)]
    t0 = [x[j] + x[j + 4] for j in range(4)]
    return (t0[0] + t0[1]) + (t0[2] + t0[3])


def lane_dot_matmul(n: int, k: int, one_token_order: bool = False) -> tirx.PrimFunc:
    """`(x [T, K] f32, w [N, K] f32, y [T, N] f32)` in llama.cpp's orders (module docstring):
    tinyBLAS's for a call of two or more rows, ggml_vec_dot_f32's for one row, or for every row
    with `one_token_order`."""
    N, K = T.int64(n), T.int64(k)
    steps, runs = k // LANES, k // VEC_DOT_RUN

    @T.macro
    def tile(x, w, y, jo, t, tt):  # type: ignore[no-untyped-def]
        acc = T.alloc_buffer((ROWS * tt, LANES), "float32")  # small: stack arrays per task
        for a in T.unroll(ROWS * tt):
            acc[a, 0:LANES] = T.broadcast(T.float32(0), LANES)
        for step in range(steps):
            for r in T.unroll(ROWS):
                for u in T.unroll(tt):
                    acc[r * tt + u, 0:LANES] = fma8(w.vload([jo * ROWS + r, step * LANES], "float32x8"),
                                                      x.vload([t + u, step * LANES], "float32x8"),
                                                      acc.vload([r * tt + u, 0], "float32x8"))
        for r in T.unroll(ROWS):
            for u in T.unroll(tt):
                y[t + u, jo * ROWS + r] = hsum8(acc, r * tt + u)

    @T.macro
    def one_row(x, w, y, jo, t):  # type: ignore[no-untyped-def]
        acc = T.alloc_buffer((ROWS * 4, LANES), "float32")
        for a in T.unroll(ROWS * 4):
            acc[a, 0:LANES] = T.broadcast(T.float32(0), LANES)
        for run in range(runs):
            for r in T.unroll(ROWS):
                for j in T.unroll(4):
                    at = T.meta_var(run * VEC_DOT_RUN + j * LANES)
                    acc[r * 4 + j, 0:LANES] = fma8(w.vload([jo * ROWS + r, at], "float32x8"),
                                                     x.vload([t, at], "float32x8"),
                                                     acc.vload([r * 4 + j, 0], "float32x8"))
        for r in T.unroll(ROWS):
            y[t, jo * ROWS + r] = _vec_dot_sum(acc, r)

    @T.prim_func(private=True)
    def matmul(x_h: T.handle, w: T.Buffer((N, K), "float32"), y_h: T.handle):  # type: ignore[valid-type]
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        x = T.match_buffer(x_h, (t_len, K), "float32")
        y = T.match_buffer(y_h, (t_len, N), "float32")
        for jo in T.parallel(n // ROWS):
            if t_len >= 2 and not one_token_order:
                for g in range(t_len // TOKENS):
                    tile(x, w, y, jo, g * TOKENS, TOKENS)
                for t in range(t_len // TOKENS * TOKENS, t_len):
                    tile(x, w, y, jo, t, 1)
            else:
                for t in range(t_len):
                    one_row(x, w, y, jo, t)

    return matmul
