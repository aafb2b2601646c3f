"""Causal attention as TE compute over the whole [heads, tokens, cells] score matrix, with GQA,
windows, softcaps and sinks: the form the generic schedules (and the GPUs) take. The CPU's
row-at-a-time kernels in llama.cpp's float order are in `attention.py`.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx
from tvm.tirx import Expr as PrimExpr

from ggufc.codegen.kernels.prim_helpers import PShape, f32, func, i64


def attention(q_shape: PShape, cache_shape: PShape, scale: float, window: int = 0, softcap: float = 0.0,
              sinks: bool = False) -> tirx.PrimFunc:
    """Causal attention of this call's queries over cache rows [0, pos+T) with GQA head sharing
    (`window`, `softcap`, `sinks` (a fifth input [H] after pos): see `Attention`)."""
    n_tok, n_head, dim = q_shape
    n_kv = cache_shape[1]
    group = tirx.floordiv(n_head, n_kv)
    q = te.placeholder(q_shape, "float32", name="q")
    kc = te.placeholder(cache_shape, "float32", name="k_cache")
    vc = te.placeholder(cache_shape, "float32", name="v_cache")
    pos = te.var("pos", "int64")
    n_ctx = pos + n_tok
    rd = te.reduce_axis((i64(0), dim), name="rd")
    qk = te.compute(
        (n_head, n_tok, n_ctx), lambda h, t, s: te.sum(q[t, h, rd] * kc[s, h // group, rd], axis=rd), name="qk"
    )
    cap = np.float32(softcap or 1.0)

    def capped(v: PrimExpr) -> PrimExpr:
        return te.tanh(v * f32(float(np.float32(1.0) / cap))) * f32(float(cap)) if softcap else v

    def seen(t: PrimExpr, s: PrimExpr) -> PrimExpr:
        return tirx.all(s <= pos + t, s + i64(window) > pos + t) if window else s <= pos + t

    score = te.compute(
        (n_head, n_tok, n_ctx),
        lambda h, t, s: tirx.if_then_else(seen(t, s), capped(qk[h, t, s]) * f32(scale), f32(-3.4e38)),
        name="score",
    )
    rs1 = te.reduce_axis((i64(0), n_ctx), name="rs1")
    row_max = te.compute((n_head, n_tok), lambda h, t: te.max(score[h, t, rs1], axis=rs1), name="row_max")
    sink = te.placeholder((n_head,), "float32", name="sinks")
    mx = te.compute((n_head, n_tok), lambda h, t: te.max(row_max[h, t], sink[h]), name="mx") if sinks else row_max
    ex = te.compute(
        (n_head, n_tok, n_ctx),
        lambda h, t, s: tirx.if_then_else(seen(t, s), te.exp(score[h, t, s] - mx[h, t]), f32(0.0)),
        name="ex",
    )
    rs2 = te.reduce_axis((i64(0), n_ctx), name="rs2")
    sm = te.compute((n_head, n_tok), lambda h, t: te.sum(ex[h, t, rs2], axis=rs2), name="sm")
    if sinks:  # the sink joins the denominator and carries no value
        sm = te.compute((n_head, n_tok), lambda h, t: sm[h, t] + te.exp(sink[h] - mx[h, t]), name="sm_sink")
    rs3 = te.reduce_axis((i64(0), n_ctx), name="rs3")
    pv = te.compute(
        (n_tok, n_head, dim), lambda t, h, d: te.sum(ex[h, t, rs3] * vc[rs3, h // group, d], axis=rs3), name="pv"
    )
    out = te.compute((n_tok, n_head, dim), lambda t, h, d: pv[t, h, d] / sm[h, t], name="out")
    return func([q, kc, vc, pos, *([sink] if sinks else []), out])


def attention_slot_rows(q_shape: PShape, cache_shape: PShape, scale: float, window: int = 0, softcap: float = 0.0
                        ) -> tirx.PrimFunc:
    """`attention` for the rows of a batched decode step, each one token of its own sequence:
    (q [B, H, D], k_cache [S, C, Hkv, D], v_cache, slots [B] int32, positions [B] int32, out);
    row t attends over cells [0, positions[t]] of slot slots[t]'s caches."""
    n_tok, n_head, dim = q_shape
    n_cells, n_kv = cache_shape[0], cache_shape[1]
    group = tirx.floordiv(n_head, n_kv)
    slots_dim = te.var("s", "int64")
    q = te.placeholder(q_shape, "float32", name="q")
    kc = te.placeholder((slots_dim, *cache_shape), "float32", name="k_cache")
    vc = te.placeholder((slots_dim, *cache_shape), "float32", name="v_cache")
    slots = te.placeholder((n_tok,), "int32", name="slots")
    positions = te.placeholder((n_tok,), "int32", name="positions")

    cap = np.float32(softcap or 1.0)

    def seen(t: PrimExpr, s: PrimExpr) -> PrimExpr:
        last = positions[t].astype("int64")
        return tirx.all(s <= last, s + i64(window) > last) if window else s <= last

    def capped(v: PrimExpr) -> PrimExpr:
        return te.tanh(v * f32(float(np.float32(1.0) / cap))) * f32(float(cap)) if softcap else v

    def slot(t: PrimExpr) -> PrimExpr:
        return slots[t].astype("int64")

    rd = te.reduce_axis((i64(0), dim), name="rd")
    qk = te.compute((n_head, n_tok, n_cells),
                    lambda h, t, s: te.sum(q[t, h, rd] * kc[slot(t), s, h // group, rd], axis=rd), name="qk")
    score = te.compute((n_head, n_tok, n_cells),
                       lambda h, t, s: tirx.if_then_else(seen(t, s), capped(qk[h, t, s]) * f32(scale), f32(-3.4e38)),
                       name="score")
    rs1 = te.reduce_axis((i64(0), n_cells), name="rs1")
    mx = te.compute((n_head, n_tok), lambda h, t: te.max(score[h, t, rs1], axis=rs1), name="mx")
    ex = te.compute((n_head, n_tok, n_cells),
                    lambda h, t, s: tirx.if_then_else(seen(t, s), te.exp(score[h, t, s] - mx[h, t]), f32(0.0)),
                    name="ex")
    rs2 = te.reduce_axis((i64(0), n_cells), name="rs2")
    sm = te.compute((n_head, n_tok), lambda h, t: te.sum(ex[h, t, rs2], axis=rs2), name="sm")
    rs3 = te.reduce_axis((i64(0), n_cells), name="rs3")
    pv = te.compute((n_tok, n_head, dim),
                    lambda t, h, d: te.sum(ex[h, t, rs3] * vc[slot(t), rs3, h // group, d], axis=rs3), name="pv")
    out = te.compute((n_tok, n_head, dim), lambda t, h, d: pv[t, h, d] / sm[h, t], name="out")
    return func([q, kc, vc, slots, positions, out])
