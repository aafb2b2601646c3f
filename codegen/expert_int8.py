"""The routed experts' matmuls (`matmul_id`, the experts of `moe_ffn`) on 8-bit integer dot
products for the K-quants (Q4_K, Q5_K, Q6_K), on the CPU (VNNI), in llama.cpp's order.

    y[t, s] = x[t, s or 0] @ W[ids[t, s]].T          x [T, S_x, K] f32, W [X, N, K], y [T, S, N]

As llama.cpp's mul_mat_id: every input row is rounded to q8_K once (a decode step's one row
serves all its slots), the (token, slot) pairs are grouped by expert, and each expert's rows are
dotted with its group's rows. Each output value is the dense 8-bit GEMV's dot product
(codegen/kquant_int8.py's row macros, ggml_vec_dot_*_K_q8_K's order), so the result is bit for
bit the dense kernel's on the same expert rows.

Work split: the parallel loop runs over (used expert, 4-row group) pairs, the used experts
listed first, so a decode step's 4 experts keep both threads busy and an unused expert costs
nothing; a prompt's group of one expert takes its rows 4 tokens at a time (the prompt GEMM's
tiles) through each row group's codes.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from . import int8_parts as P
from .kquant_int8 import FIELDS, GEMM_TOKENS, SUPER, _field_specs, _q8k_quantize, _row_steps
from .quant import layout_spec
from .quant_int8 import int8_dot_intrinsic
from .target import UnsupportedOnTarget

# the K-quants whose rows read 32-value activation sums (Q2_K reads 16-value ones; Q2_K and Q3_K
# experts keep the float kernel)
EXPERT_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K"})


def int8_experts_supported(qtype: str, n: int, k: int, target: tvm.target.Target) -> bool:
    """Whether `target` has the 8-bit experts kernel for [X, n, k] weights of `qtype`."""
    return (int8_dot_intrinsic(target) is not None and qtype in EXPERT_TYPES and n % P.ROWS == 0
            and k % SUPER == 0)


def int8_experts(qtype: str, n_exp: int, n: int, k: int, slots: int, per_slot: bool,
                 target: tvm.target.Target) -> tirx.PrimFunc:
    """The 8-bit experts kernel for `target` (kquant_experts); raises where there is none."""
    intrin = int8_dot_intrinsic(target)
    if intrin is None or not int8_experts_supported(qtype, n, k, target):
        raise UnsupportedOnTarget(f"no 8-bit experts kernel for {qtype} {n} x {k} on {target}")
    return kquant_experts(qtype, n_exp, n, k, slots, per_slot, intrin)


SERIAL_ROWS = 8  # rows rounded, gathered and scattered without the thread pool (a decode step's)


def _expert_view(f: tirx.Buffer, e: tirx.PrimExpr) -> tirx.Buffer:
    """Expert e's [N, ...] slice of a weight field [X, N, ...], read in place."""
    per_expert = 1
    for extent in f.shape[1:]:
        per_expert = per_expert * extent
    return T.decl_buffer(f.shape[1:], f.dtype, data=f.data, elem_offset=e * per_expert)


def kquant_experts(qtype: str, n_exp: int, n: int, k: int, slots: int, per_slot: bool, intrin: str,
                   tokens: int = GEMM_TOKENS) -> tirx.PrimFunc:
    """Args (x [T, S_x, K] f32, ids [T, slots] int32, *fields [X, N, ...], y [T, slots, N] f32),
    S_x = slots when `per_slot` else 1 (qmatmul_experts' signature); ids outside [0, X) are clamped."""
    n_super, rows = k // SUPER, P.ROWS
    n_fields = len(layout_spec(qtype, (n, k)))
    groups = n // rows
    sx = slots if per_slot else 1
    specs = [((n_exp, *shape), dtype) if f < n_fields else (shape, dtype)
             for f, (shape, dtype) in enumerate(_field_specs(qtype, n, k))]
    quantize = _q8k_quantize()
    one = _row_steps(qtype, intrin, n_super, 1, P.PREFETCH_GROUPS)
    tile = _row_steps(qtype, intrin, n_super, tokens, P.PREFETCH_GROUPS)
    N, K, S, SX = T.int64(n), T.int64(k), T.int64(slots), T.int64(sx)

    @T.macro
    def group_by_expert(ids, m, count, start, cursor, order, used, n_used):  # type: ignore[no-untyped-def]
        """order: the (token, slot) pairs sorted by expert (stable); used: the experts with pairs."""
        for e in range(n_exp):
            count[e] = 0
        for q in range(m):
            count[T.max(T.min(ids[q // S, q % S], n_exp - 1), 0)] += 1
        start[0] = 0
        n_used[0] = 0
        for e in range(n_exp):
            start[e + 1] = start[e] + count[e]
            cursor[e] = start[e]
            if count[e] > 0:
                used[n_used[0]] = e
                n_used[0] = n_used[0] + 1
        for q in range(m):
            e = T.meta_var(T.max(T.min(ids[q // S, q % S], n_exp - 1), 0))
            order[cursor[e]] = T.Cast("int32", q)
            cursor[e] = cursor[e] + 1

    @T.macro
    def expert_rows(f0, f1, f2, f3, f4, f5, e, jo, ys, gb, gd, gs, gp, start, count):  # type: ignore[no-untyped-def]
        v0 = _expert_view(f0, e)
        v1 = _expert_view(f1, e)
        v2 = _expert_view(f2, e)
        v3 = _expert_view(f3, e)
        v4 = T.meta_var(_expert_view(f4, e) if n_fields > 4 else f4)  # placeholders stay as they are
        v5 = T.meta_var(_expert_view(f5, e) if n_fields > 5 else f5)
        for g in range(count[e] // tokens):
            tile(v0, v1, v2, v3, v4, v5, ys, n, jo, start[e] + g * tokens, gb, gd, gs, gp)
        for q in range(start[e] + count[e] // tokens * tokens, start[e + 1]):
            one(v0, v1, v2, v3, v4, v5, ys, n, jo, q, gb, gd, gs, gp)

    @T.macro
    def gather(q, order, xb, xd, xs, xp, gb, gd, gs, gp):  # type: ignore[no-untyped-def]
        """Pair q's rounded row (codes, scales, sums) into its place in expert order."""
        src = T.meta_var(order[q] if per_slot else order[q] // S)
        for j in range(k):
            gb[q, j] = xb[src, j]
        for j in range(n_super):
            gd[q, j] = xd[src, j]
        for j in range(n_super * 8):
            gs[q, j] = xs[src, j]
        for j in range(n_super * 128):
            gp[q, j] = xp[src, j]

    @T.macro
    def scatter(q, order, ys, y):  # type: ignore[no-untyped-def]
        for j in range(n):
            y[order[q] // S, order[q] % S, j] = ys[q, j]

    @T.prim_func(private=True)
    def experts(x_h: T.handle, ids_h: T.handle, f0: T.Buffer(specs[0][0], specs[0][1]),  # type: ignore[valid-type]
                f1: T.Buffer(specs[1][0], specs[1][1]), f2: T.Buffer(specs[2][0], specs[2][1]),  # type: ignore[valid-type]
                f3: T.Buffer(specs[3][0], specs[3][1]), f4: T.Buffer(specs[4][0], specs[4][1]),  # type: ignore[valid-type]
                f5: T.Buffer(specs[5][0], specs[5][1]), y_h: T.handle):  # type: ignore[valid-type]
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        x = T.match_buffer(x_h, (t_len, SX, K), "float32")
        ids = T.match_buffer(ids_h, (t_len, S), "int32")
        y = T.match_buffer(y_h, (t_len, S, N), "float32")
        m = T.meta_var(t_len * S)
        # every input row rounded once
        rows_in = T.decl_buffer((t_len * SX, K), "float32", data=x.data)
        xb = T.alloc_buffer((t_len * SX, K), "int8")
        xd = T.alloc_buffer((t_len * SX, n_super), "float32")
        xs = T.alloc_buffer((t_len * SX, n_super * 8), "int16")
        xp = T.alloc_buffer((t_len * SX, n_super * 128), "int16")
        if t_len * SX > SERIAL_ROWS:
            for r in T.parallel(t_len * SX):
                quantize(rows_in, r, xb, xd, xs, xp, n_super)
        else:
            for r in range(t_len * SX):
                quantize(rows_in, r, xb, xd, xs, xp, n_super)
        count = T.alloc_buffer((n_exp,), "int32")
        start = T.alloc_buffer((n_exp + 1,), "int32")
        cursor = T.alloc_buffer((n_exp,), "int32")
        used = T.alloc_buffer((n_exp,), "int32")
        n_used = T.alloc_buffer((1,), "int32")
        order = T.alloc_buffer((m,), "int32")
        group_by_expert(ids, m, count, start, cursor, order, used, n_used)
        # each expert's rows gathered together (codes, scales, sums)
        gb = T.alloc_buffer((m, K), "int8")
        gd = T.alloc_buffer((m, n_super), "float32")
        gs = T.alloc_buffer((m, n_super * 8), "int16")
        gp = T.alloc_buffer((m, n_super * 128), "int16")
        if m > SERIAL_ROWS:
            for q in T.parallel(m):
                gather(q, order, xb, xd, xs, xp, gb, gd, gs, gp)
        else:
            for q in range(m):
                gather(q, order, xb, xd, xs, xp, gb, gd, gs, gp)
        ys = T.alloc_buffer((m, N), "float32")
        for task in T.parallel(n_used[0] * groups):
            expert_rows(f0, f1, f2, f3, f4, f5, used[task // groups], task % groups, ys, gb, gd, gs, gp, start,
                        count)
        if m > SERIAL_ROWS:
            for q in T.parallel(m):
                scatter(q, order, ys, y)
        else:
            for q in range(m):
                scatter(q, order, ys, y)

    return P.without_params(experts, {f"f{f}" for f in range(n_fields, FIELDS)})
