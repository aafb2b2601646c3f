"""The routed experts' matmuls (`matmul_id`, the experts of `moe_ffn`) on 8-bit integer dot
products for the K-quants (Q4_K, Q5_K, Q6_K), on the CPU (AVX2 and up), in llama.cpp's order.

    y[t, s] = x[t, s or 0] @ W[ids[t, s]].T          x [T, S_x, K] f32, W [X, N, K], y [T, S, N]

As llama.cpp's mul_mat_id: every input row is rounded to q8_K once (a decode step's one row
serves all its slots), the (token, slot) pairs are grouped by expert, and each expert's rows are
dotted with its group's rows. Each output value is the dense 8-bit GEMV's dot product
(codegen/cpu_int8/kquant.py's row macros, ggml_vec_dot_*_K_q8_K's order), so the result is bit for
bit the dense kernel's on the same expert rows. Q4_K experts of a multiple of 8 rows are stored 8
rows side by side where llama.cpp repacks them (q4k_interleaved.py: AVX2 to AVX-512 VNNI) and every
(token, expert) pair, prompt rows included, takes the repacked GEMV's order, as its mul_mat_id of
repacked weights runs one GEMV per pair.

Work split: the parallel loop runs over (used expert, row group) pairs, the used experts
listed first, so a decode step's 4 experts keep both threads busy and an unused expert costs
nothing; a prompt's group of one expert takes its rows 4 tokens at a time (the prompt GEMM's
tiles) through each row group's codes.

Q4_K (not repacked) and Q6_K prompts on a target with 512-bit registers take their tokens in
pairs, as the dense
prompt GEMM does (kquant._pair_gemm): each expert's group starts on an even row of the
gathered rows (an odd group ends with a padding row, computed and dropped), the rows are gathered
straight into the pair-interleaved layout, and a group goes through its row group's codes
PAIR_TILE pairs at a time, then its last one or two pairs. Its tasks run in bands of row groups,
each band through every used expert, so each thread's share holds the same tokens however
unequal the experts' groups. Every value is still one
ggml_vec_dot_q{4,6}_K_q8_K in its order, so the result is the one-token path's bit for bit.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ggufc.codegen.cpu_int8 import parts as P
from ggufc.codegen.cpu_int8 import q4k_interleaved as X
from ggufc.codegen.cpu_int8.isa import Int8Isa, int8_isa
from ggufc.codegen.cpu_int8.kquant import (
    FIELDS,
    GEMM_TOKENS,
    PAIR_ROWS,
    PAIR_TILE,
    PAIR_TYPES,
    SUPER,
    VEC_DOT,
    _q8k_quantize,
    _q8k_sums,
    _row_steps,
    kquant_tiled,
    pair_tile,
    q4k_orders,
)
from ggufc.codegen.formats.layout import layout_spec
from ggufc.codegen.target import UnsupportedOnTarget

# the K-quants whose rows read 32-value activation sums (Q2_K reads 16-value ones; Q2_K and Q3_K
# experts keep the float kernel)
EXPERT_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K"})


def int8_experts_supported(qtype: str, n: int, k: int, target: tvm.target.Target) -> bool:
    """Whether `target` has the 8-bit experts kernel for [X, n, k] weights of `qtype` (X.LAYOUT:
    Q4_K experts stored 8 rows side by side: q4k_interleaved.eligible)."""
    if qtype == X.LAYOUT:
        return X.eligible(X.QTYPE, (n, k), target)
    return (int8_isa(target) is not None and qtype in EXPERT_TYPES and n % P.ROWS == 0
            and k % SUPER == 0)


def int8_experts(qtype: str, n_exp: int, n: int, k: int, slots: int, per_slot: bool,
                 target: tvm.target.Target, one_token_order: bool = False) -> tirx.PrimFunc:
    """The 8-bit experts kernel for `target` (kquant_experts); raises where there is none.
    `one_token_order`: every row as a one-token call sums it (verify, batched decode)."""
    isa = int8_isa(target)
    if isa is None or not int8_experts_supported(qtype, n, k, target):
        raise UnsupportedOnTarget(f"no 8-bit experts kernel for {qtype} {n} x {k} on {target}")
    pairs = qtype in PAIR_TYPES and isa.wide and q4k_orders(qtype, isa, n)[0] == VEC_DOT  # vec_dot's order only
    return kquant_experts(qtype, n_exp, n, k, slots, per_slot, isa, pairs=pairs,
                          tiled=kquant_tiled(qtype, isa) and not one_token_order)


def order_depends_on_rows(qtype: str, target: tvm.target.Target) -> bool:
    """Whether an expert's row count picks its float order (Q5_K and Q6_K at AVX2: the tiled GEMM's
    from TILED_ROWS rows), so a kernel whose rows must equal one-token calls is another kernel."""
    isa = int8_isa(target)
    return isa is not None and kquant_tiled(qtype, isa)


SERIAL_ROWS = 8  # rows rounded, gathered and scattered without the thread pool (a decode step's)


def _expert_view(f: tirx.Buffer, e: tirx.PrimExpr) -> tirx.Buffer:
    """Expert e's [N, ...] slice of a weight field [X, N, ...], read in place."""
    per_expert = 1
    for extent in f.shape[1:]:
        per_expert = per_expert * extent
    return T.decl_buffer(f.shape[1:], f.dtype, data=f.data, elem_offset=e * per_expert)


def _band(groups: int, most: int = 16) -> int:
    """The largest divisor of `groups` up to `most`: row groups a prompt's task band takes per expert."""
    return max(b for b in range(1, most + 1) if groups % b == 0)


def kquant_experts(qtype: str, n_exp: int, n: int, k: int, slots: int, per_slot: bool, isa: Int8Isa,
                   tokens: int = GEMM_TOKENS, pairs: bool = False, tiled: bool = False) -> tirx.PrimFunc:
    """Args (x [T, S_x, K] f32, ids [T, slots] int32, *fields [X, N, ...], y [T, slots, N] f32),
    S_x = slots when `per_slot` else 1 (qmatmul_experts' signature); ids outside [0, X) are clamped.
    `pairs` (Q4_K, Q6_K; 512-bit registers): prompts take their tokens in pairs. `tiled` (Q5_K, Q6_K
    at AVX2): an expert given >= TILED_ROWS rows takes the tiled GEMM's order, as llama.cpp's
    mul_mat_id decides per expert (ggml_compute_forward_mul_mat_id_tiled)."""
    n_super = k // SUPER
    x8 = qtype == X.LAYOUT  # Q4_K interleaved: each (token, expert) pair in the repacked GEMV's order
    rows = X.GROUP if x8 else P.ROWS
    fields = X.layout_spec((n, k)) if x8 else layout_spec(qtype, (n, k))
    n_fields = len(fields)
    groups = n // rows
    sx = slots if per_slot else 1
    field_specs = [(tuple(shape), dtype) for _, shape, dtype in fields] + [((1,), "uint8")] * (FIELDS - n_fields)
    specs = [((n_exp, *shape), dtype) if f < n_fields else (shape, dtype)
             for f, (shape, dtype) in enumerate(field_specs)]
    if x8:
        quantize = _q8k_quantize(32, pair_offsets=False)
        one, tile = X.x8_steps(n_super, 1, isa.vnni), X.x8_steps(n_super, tokens, isa.vnni)
    else:
        quantize = _q8k_quantize(**_q8k_sums(qtype))
        # every (token, expert) pair in the one-token order: Q4_K's repacked GEMV's where its
        # matrices are repacked (row-major here; compiles store them interleaved: x8_steps)
        order = q4k_orders(qtype, isa, n)[0]
        one = _row_steps(qtype, isa, n_super, 1, P.PREFETCH_GROUPS, order=order, tiled_order=tiled)
        tile = _row_steps(qtype, isa, n_super, tokens, P.PREFETCH_GROUPS, order=order, tiled_order=tiled)
    xp_width = 1 if x8 else n_super * 128  # the pair offsets / block sums (none read in the x8 layout)
    N, K, S, SX = T.int64(n), T.int64(k), T.int64(slots), T.int64(sx)
    six = qtype == "Q6_K"
    full, two, single = (pair_tile(qtype, n_super, p) for p in (PAIR_TILE, 2, 1)) if pairs else (None,) * 3
    pair_groups = n // PAIR_ROWS
    band = _band(pair_groups)

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
            tile(v0, v1, v2, v3, v4, v5, ys, n, jo, start[e] + g * tokens, gb, gd, gs, gp, count[e])
        for q in range(start[e] + count[e] // tokens * tokens, start[e + 1]):
            one(v0, v1, v2, v3, v4, v5, ys, n, jo, q, gb, gd, gs, gp, count[e])

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
        for j in range(xp_width):
            gp[q, j] = xp[src, j]

    @T.macro
    def scatter(q, order, ys, y):  # type: ignore[no-untyped-def]
        for j in range(n):
            y[order[q] // S, order[q] % S, j] = ys[q, j]

    @T.macro
    def pad_to_pairs(count, start, order, pstart, porder):  # type: ignore[no-untyped-def]
        """porder: the expert order with every group padded to whole pairs (-1: a padding row);
        pstart: each group's first pair."""
        pstart[0] = 0
        for e in range(n_exp):
            pstart[e + 1] = pstart[e] + (count[e] + 1) // 2
        for q in range(pstart[n_exp] * 2):
            porder[q] = -1
        for e in range(n_exp):
            for j in range(count[e]):
                porder[pstart[e] * 2 + j] = order[start[e] + j]

    @T.macro
    def gather_pair(p, porder, xb, xd, xs, xp, xb2, xd2, xs2, xp2):  # type: ignore[no-untyped-def]
        """Rows 2p and 2p + 1 of the padded order side by side (kquant._pair_acts's layout);
        a padding row copies input row 0, whose products are dropped."""
        for h in T.unroll(2):
            pq = T.meta_var(T.max(porder[p * 2 + h], 0))
            src = T.meta_var(pq if per_slot else pq // S)
            for q in range(n_super * 8):
                xb2[p, q * 64 + h * 32:q * 64 + h * 32 + 32] = xb.vload([src, q * 32], "int8x32")
            for i in range(n_super):
                if six:
                    xp2[p, i * 32 + h * 16:i * 32 + h * 16 + 16] = xp.vload([src, i * 16], "int16x16")
                xd2[p, i, h * 8:h * 8 + 8] = T.broadcast(xd[src, i], 8)
                xs2[p, i, h * 8:h * 8 + 8] = xs.vload([src, i * 8], "int16x8")

    @T.macro
    def expert_pairs(f0, f1, f2, f3, f4, e, jo, ys, xb2, xd2, xs2, xp2, pstart):  # type: ignore[no-untyped-def]
        v0 = _expert_view(f0, e)
        v1 = _expert_view(f1, e)
        v2 = _expert_view(f2, e)
        v3 = _expert_view(f3, e)
        v4 = T.meta_var(_expert_view(f4, e) if n_fields > 4 else f4)
        n_pairs = T.meta_var(pstart[e + 1] - pstart[e])
        rest = T.meta_var(n_pairs % PAIR_TILE)
        tail = T.meta_var(pstart[e] + n_pairs // PAIR_TILE * PAIR_TILE)
        for g in range(n_pairs // PAIR_TILE):
            full(v0, v1, v2, v3, v4, ys, n, jo, pstart[e] + g * PAIR_TILE, xb2, xd2, xs2, xp2)
        if rest >= 2:
            two(v0, v1, v2, v3, v4, ys, n, jo, tail, xb2, xd2, xs2, xp2)
        if rest % 2 == 1:
            single(v0, v1, v2, v3, v4, ys, n, jo, tail + rest // 2 * 2, xb2, xd2, xs2, xp2)

    @T.macro
    def paired_experts(f0, f1, f2, f3, f4, m, xb, xd, xs, xp, count, start, order, used, n_used, y):  # type: ignore[no-untyped-def]
        """A prompt's experts in token pairs: gather into pairs, the pair tiles, scatter."""
        most = T.meta_var((m + n_exp + 1) // 2)  # pairs, every group padded by at most one row
        pstart = T.alloc_buffer((n_exp + 1,), "int32")
        porder = T.alloc_buffer((most * 2,), "int32")
        pad_to_pairs(count, start, order, pstart, porder)
        xb2 = T.alloc_buffer((most, K * 2), "int8")
        xd2 = T.alloc_buffer((most, n_super, 16), "float32")
        xs2 = T.alloc_buffer((most, n_super, 16), "int16")
        xp2 = T.alloc_buffer((most, K // 8 if six else 1), "int16")
        for p in T.parallel(pstart[n_exp]):
            gather_pair(p, porder, xb, xd, xs, xp, xb2, xd2, xs2, xp2)
        ys = T.alloc_buffer((most * 2, N), "float32")
        # bands of row groups outermost, each through every used expert: the threads' contiguous
        # shares of the tasks hold whole bands, so the same tokens each, however unequal the groups
        for task in T.parallel(n_used[0] * pair_groups):
            in_band = T.meta_var(task % (n_used[0] * band))
            expert_pairs(f0, f1, f2, f3, f4, used[in_band // band],
                         task // (n_used[0] * band) * band + in_band % band, ys, xb2, xd2, xs2, xp2, pstart)
        for q in T.parallel(pstart[n_exp] * 2):
            if porder[q] >= 0:
                for j in range(n):
                    y[porder[q] // S, porder[q] % S, j] = ys[q, j]

    @T.macro
    def grouped_experts(f0, f1, f2, f3, f4, f5, m, xb, xd, xs, xp, count, start, order, used, n_used, y):  # type: ignore[no-untyped-def]
        """The experts one token or GEMM_TOKENS tokens at a time: gather, the tiles, scatter."""
        # each expert's rows gathered together (codes, scales, sums)
        gb = T.alloc_buffer((m, K), "int8")
        gd = T.alloc_buffer((m, n_super), "float32")
        gs = T.alloc_buffer((m, n_super * 8), "int16")
        gp = T.alloc_buffer((m, xp_width), "int16")
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
        xp = T.alloc_buffer((t_len * SX, xp_width), "int16")
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
        if pairs:
            if m > SERIAL_ROWS:
                paired_experts(f0, f1, f2, f3, f4, m, xb, xd, xs, xp, count, start, order, used, n_used, y)
            else:
                grouped_experts(f0, f1, f2, f3, f4, f5, m, xb, xd, xs, xp, count, start, order, used, n_used, y)
        else:
            grouped_experts(f0, f1, f2, f3, f4, f5, m, xb, xd, xs, xp, count, start, order, used, n_used, y)

    return P.without_params(experts, {f"f{f}" for f in range(n_fields, FIELDS)})
