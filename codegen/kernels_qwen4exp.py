"""Kernels of qwen4exp's own ops: the hyper-connection mix, the QSA indexer, the PLE hash.

* `hc_pre`: one kernel per mix: per-stream RMSNorm of the [T, hc, E] streams, the low-rank gate
  (down, silu, up), the sigmoid-gated mean over streams and the post weights (inject); the hc-wide
  stream is read in this one kernel (its normalised copy stays an intermediate of the kernel).
* `hc_post`: the scatter of a block output into every stream, R + post * y, one pass over R.
* `indexer_score`: mean-pool the raw key cache per block, RMSNorm, rotate at the block start,
  score = sum over heads of relu(q . key); one kernel.
* `indexer_topk`: per query row, the cell values of the tail rule and llama.cpp's CPU top-k
  (libstdc++ heap select, so ties break the same way); one row per parallel task.
* `sparse_attention`: attention over the selected cells only ([T, W] indices, W = top_k + r - 1),
  so no [T, P+T] mask is built and the cost does not grow with the context.
* `index_mask`, `masked_attention`: the unfused spelling (a dense additive mask and attention
  that adds it), compiled for the passes-off path.
* `ple_hash`: the n-gram rows in uint64 wrap-around arithmetic, one token per parallel task,
  reading predecessors from the token-history state.

Symbolic extents: `n` (tokens of the call) and `pos` (tokens already cached), as in `kernels.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import te, tirx
from tvm.script import tirx as T

from .kernels import PShape, f32, func, i64

NEG = -3.4e38  # the masked score (finite, so a fully masked row cannot make a NaN)


def _sigmoid(x: tirx.PrimExpr) -> tirx.PrimExpr:
    return f32(1.0) / (f32(1.0) + te.exp(-x))


# ---------------------------------------------------------------------------------------------
# hyper-connections


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
    act = te.compute((n, i64(rank)), lambda t, j: lo[t, j] * f32(1.0 / n_hc) * _sigmoid(lo[t, j] * f32(1.0 / n_hc)),
                     name="act")
    rr = te.reduce_axis((i64(0), i64(rank)), name="rr")
    gate = te.compute((n, wide), lambda t, k: te.sum(act[t, rr] * up[k, rr], axis=rr), name="gate")
    rc = te.reduce_axis((i64(0), hc), name="rc")
    msum = te.compute((n, e), lambda t, j: te.sum(xn[t, rc * e + j] * _sigmoid(gate[t, rc * e + j]), axis=rc),
                      name="msum")
    mixed = te.compute((n, e), lambda t, j: msum[t, j] / f32(hc_i), name="mixed")
    if not post:
        return func([r, norm, down, up, mixed])
    inject = te.placeholder((hc, wide), "float32", name="inject")
    rk2 = te.reduce_axis((i64(0), wide), name="rk2")
    inj = te.compute((n, hc), lambda t, c: te.sum(xn[t, rk2] * inject[c, rk2], axis=rk2), name="inj")
    out_post = te.compute((n, hc), lambda t, c: f32(2.0) * _sigmoid(inj[t, c] * f32(1.0 / n_hc)), name="post")
    return func([r, norm, down, up, inject, mixed, out_post])


def hc_post(streams: PShape) -> tirx.PrimFunc:
    """Args (R [T,hc,E], y [T,E], post [T,hc], out [T,hc,E])."""
    n, hc, e = streams
    r = te.placeholder(streams, "float32", name="r")
    y = te.placeholder((n, e), "float32", name="y")
    post = te.placeholder((n, hc), "float32", name="post")
    out = te.compute(streams, lambda t, c, j: r[t, c, j] + post[t, c] * y[t, j], name="out")
    return func([r, y, post, out])


# ---------------------------------------------------------------------------------------------
# QSA indexer


def indexer_score(q_shape: PShape, n_cells: int, ratio: int, eps: float, n_rot: int) -> tirx.PrimFunc:
    """Args (q [T,Hi,Di], cache [C,Di], norm [Di], table [C//r+1, n_rot/2, 2], score [T, C//r+1])."""
    n, hi, di = q_shape
    di_i = int(di)
    nb = n_cells // ratio
    nb1 = i64(nb + 1)
    half = n_rot // 2
    q = te.placeholder(q_shape, "float32", name="q")
    cache = te.placeholder((i64(n_cells), di), "float32", name="cache")
    norm = te.placeholder((di,), "float32", name="norm")
    table = te.placeholder((nb1, i64(half), i64(2)), "float32", name="table")
    rj = te.reduce_axis((i64(0), i64(ratio)), name="rj")
    psum = te.compute((nb1, di), lambda b, d: te.sum(cache[te.min(b * i64(ratio) + rj, i64(n_cells - 1)), d], axis=rj),
                      name="psum")
    keys = te.compute((nb1, di),
                      lambda b, d: tirx.Select(b < i64(nb), psum[b, d] * f32(1.0 / ratio), cache[i64(0), d]),
                      name="keys")
    rd = te.reduce_axis((i64(0), di), name="rd")
    ss = te.compute((nb1,), lambda b: te.sum(keys[b, rd] * keys[b, rd], axis=rd), name="ss")
    rstd = te.compute((nb1,), lambda b: f32(1.0) / te.sqrt(ss[b] / f32(di_i) + f32(eps)), name="rstd")
    normed = te.compute((nb1, di), lambda b, d: keys[b, d] * rstd[b] * norm[d], name="normed")

    def rot(b: tirx.PrimExpr, d: tirx.PrimExpr) -> tirx.PrimExpr:
        second = d >= i64(half)
        pair = tirx.if_then_else(second, d - i64(half), d)
        pair = te.min(pair, i64(half - 1))
        lo = normed[b, pair]
        hi_ = normed[b, te.min(pair + i64(half), di - i64(1))]
        c, s = table[b, pair, i64(0)], table[b, pair, i64(1)]
        rotated = tirx.if_then_else(second, lo * s + hi_ * c, lo * c - hi_ * s)
        return tirx.if_then_else(d < i64(n_rot), rotated, normed[b, d])

    roped = te.compute((nb1, di), rot, name="roped")
    rq = te.reduce_axis((i64(0), di), name="rq")
    dots = te.compute((n, hi, nb1), lambda t, h, b: te.sum(q[t, h, rq] * roped[b, rq], axis=rq), name="dots")
    rh = te.reduce_axis((i64(0), hi), name="rh")
    score = te.compute((n, nb1), lambda t, b: te.sum(te.max(dots[t, rh, b], f32(0.0)), axis=rh), name="score")
    return func([q, cache, norm, table, score])


def indexer_topk(nb1: int, ratio: int, width: int, n_cells: int) -> tirx.PrimFunc:
    """Args (scores [T, NB+1], pos, sel [T, width]). Per row: cell values (block score, +1e9 for the
    tail and the incomplete block, -inf after the query), then libstdc++'s heap select of `width`
    cells (make_heap on the first k, then each later cell strictly greater than the top replaces
    it), then -1 for slots without a visible cell."""
    r = ratio
    dead = nb1 - 1

    @T.macro
    def adjust(Sel: T.Buffer, V: T.Buffer, st: T.Buffer, i: T.int64, hole0: T.int64, length: T.int64,
               value: T.int64) -> None:
        # std::__adjust_heap then std::__push_heap, comp(a, b) = V[a] > V[b]; st: hole, second, parent, value, top
        st[0] = hole0
        st[1] = hole0
        st[3] = value
        st[4] = hole0
        while st[1] < (length - T.int64(1)) // T.int64(2):
            st[1] = T.int64(2) * (st[1] + T.int64(1))
            if V[i, T.Cast("int64", Sel[i, st[1]])] > V[i, T.Cast("int64", Sel[i, st[1] - T.int64(1)])]:
                st[1] = st[1] - T.int64(1)
            Sel[i, st[0]] = Sel[i, st[1]]
            st[0] = st[1]
        if length % T.int64(2) == T.int64(0) and st[1] == (length - T.int64(2)) // T.int64(2):
            st[1] = T.int64(2) * (st[1] + T.int64(1))
            Sel[i, st[0]] = Sel[i, st[1] - T.int64(1)]
            st[0] = st[1] - T.int64(1)
        st[2] = T.max(st[0] - T.int64(1), T.int64(0)) // T.int64(2)
        while st[0] > st[4] and V[i, T.Cast("int64", Sel[i, st[2]])] > V[i, st[3]]:
            Sel[i, st[0]] = Sel[i, st[2]]
            st[0] = st[2]
            st[2] = T.max(st[0] - T.int64(1), T.int64(0)) // T.int64(2)
        Sel[i, st[0]] = T.Cast("int32", st[3])

    @T.prim_func
    def kernel(s_h: T.handle, pos: T.int64, o_h: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        S = T.match_buffer(s_h, (n, nb1), "float32")
        Sel = T.match_buffer(o_h, (n, width), "int32")
        V = T.alloc_buffer((n, n_cells), "float32")
        for i in T.parallel(n):
            st = T.decl_buffer((8,), "int64", scope="local")
            q = pos + i
            nkv = pos + n
            tail = (q + T.int64(1)) // T.int64(r) * T.int64(r)
            nfull = T.min(nkv // T.int64(r), T.int64(dead))
            for j in range(nkv):
                blk = j // T.int64(r)
                bias = T.if_then_else(blk * T.int64(r) >= tail, T.float32(1e9), T.float32(0))
                val = T.if_then_else(blk < nfull, S[i, T.min(blk, T.int64(dead))] + bias,
                                     S[i, T.int64(dead)] + T.float32(1e9))
                V[i, j] = T.if_then_else(j > q, T.min_value("float32"), val)  # -inf of the reference
            st[5] = T.min(T.int64(width), nkv)
            for a in range(T.int64(width)):
                Sel[i, a] = T.Cast("int32", a)
            if st[5] >= T.int64(2):
                st[6] = (st[5] - T.int64(2)) // T.int64(2)
                while st[6] >= T.int64(0):
                    adjust(Sel, V, st, i, st[6], st[5], T.Cast("int64", Sel[i, st[6]]))
                    st[6] = st[6] - T.int64(1)
            st[7] = st[5]
            while st[7] < nkv:
                if V[i, st[7]] > V[i, T.Cast("int64", Sel[i, 0])]:
                    adjust(Sel, V, st, i, T.int64(0), st[5], st[7])
                st[7] = st[7] + T.int64(1)
            for a in range(T.int64(width)):
                if a >= st[5] or V[i, T.Cast("int64", T.max(Sel[i, a], 0))] == T.min_value("float32"):
                    Sel[i, a] = -1

    return kernel


def index_mask(sel_shape: PShape, neg_inf: tirx.PrimExpr | None = None) -> tirx.PrimFunc:
    """Args (sel [T, W], pos, mask [T, P+T]): 0 at selected cells j <= pos + t, -inf elsewhere.
    `neg_inf`: how to spell -inf (WGSL has no infinity literal)."""
    n, w = sel_shape
    sel = te.placeholder(sel_shape, "int32", name="sel")
    pos = te.var("pos", "int64")
    rw = te.reduce_axis((i64(0), w), name="rw")
    hit = te.compute((n, pos + n), lambda t, j: te.max(tirx.Select(sel[t, rw].astype("int64") == j, f32(1.0),
                                                                     f32(0.0)), axis=rw), name="hit")
    mask = te.compute((n, pos + n), lambda t, j: tirx.Select(tirx.all(hit[t, j] > f32(0.0), j <= pos + t), f32(0.0),
                                                              f32(-float("inf")) if neg_inf is None else neg_inf),
                      name="mask")
    return func([sel, pos, mask])


def _attention_core(q_shape: PShape, cache_shape: PShape, scale: float, n_cols: tirx.PrimExpr, key_row, visible
                    ) -> tuple[list[te.Tensor], te.Tensor]:
    """Softmax attention of q over `n_cols` columns; column s of query t reads cache row
    key_row(t, s) and counts when visible(t, s)."""
    n_tok, n_head, dim = q_shape
    group = tirx.floordiv(n_head, cache_shape[1])
    q = te.placeholder(q_shape, "float32", name="q")
    kc = te.placeholder(cache_shape, "float32", name="k_cache")
    vc = te.placeholder(cache_shape, "float32", name="v_cache")
    rd = te.reduce_axis((i64(0), dim), name="rd")
    qk = te.compute((n_head, n_tok, n_cols),
                    lambda h, t, s: te.sum(q[t, h, rd] * kc[key_row(t, s), h // group, rd], axis=rd), name="qk")
    score = te.compute((n_head, n_tok, n_cols),
                       lambda h, t, s: tirx.if_then_else(visible(t, s), qk[h, t, s] * f32(scale), f32(NEG)),
                       name="score")
    rs1 = te.reduce_axis((i64(0), n_cols), name="rs1")
    mx = te.compute((n_head, n_tok), lambda h, t: te.max(score[h, t, rs1], axis=rs1), name="mx")
    ex = te.compute((n_head, n_tok, n_cols),
                    lambda h, t, s: tirx.if_then_else(visible(t, s), te.exp(score[h, t, s] - mx[h, t]), f32(0.0)),
                    name="ex")
    rs2 = te.reduce_axis((i64(0), n_cols), name="rs2")
    sm = te.compute((n_head, n_tok), lambda h, t: te.sum(ex[h, t, rs2], axis=rs2), name="sm")
    rs3 = te.reduce_axis((i64(0), n_cols), name="rs3")
    pv = te.compute((n_tok, n_head, dim),
                    lambda t, h, d: te.sum(ex[h, t, rs3] * vc[key_row(t, rs3), h // group, d], axis=rs3), name="pv")
    out = te.compute((n_tok, n_head, dim), lambda t, h, d: pv[t, h, d] / sm[h, t], name="out")
    return [q, kc, vc], out


def sparse_attention(q_shape: PShape, cache_shape: PShape, width: int, scale: float) -> tirx.PrimFunc:
    """Args (q [T,H,D], k_cache, v_cache [C,Hkv,D], pos, sel [T, W], out [T,H,D]): attention over
    the W selected cells of each query (-1 slots and cells after the query are skipped)."""
    pos = te.var("pos", "int64")
    sel = te.placeholder((q_shape[0], i64(width)), "int32", name="sel")

    def row(t: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        return te.max(sel[t, s].astype("int64"), i64(0))

    def visible(t: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        c = sel[t, s].astype("int64")
        return tirx.all(c >= i64(0), c <= pos + t)

    ins, out = _attention_core(q_shape, cache_shape, scale, i64(width), row, visible)
    return func([*ins, pos, sel, out])


def masked_attention(q_shape: PShape, cache_shape: PShape, scale: float) -> tirx.PrimFunc:
    """Args (q, k_cache, v_cache, pos, mask [T, P+T], out): causal attention plus an additive mask."""
    pos = te.var("pos", "int64")
    n_ctx = pos + q_shape[0]
    mask = te.placeholder((q_shape[0], n_ctx), "float32", name="mask")
    q = te.placeholder(q_shape, "float32", name="q")
    kc = te.placeholder(cache_shape, "float32", name="k_cache")
    vc = te.placeholder(cache_shape, "float32", name="v_cache")
    n_tok, n_head, dim = q_shape
    group = tirx.floordiv(n_head, cache_shape[1])
    rd = te.reduce_axis((i64(0), dim), name="rd")
    qk = te.compute((n_head, n_tok, n_ctx), lambda h, t, s: te.sum(q[t, h, rd] * kc[s, h // group, rd], axis=rd),
                    name="qk")

    def vis(t: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        return tirx.all(s <= pos + t, mask[t, s] > f32(NEG))

    score = te.compute((n_head, n_tok, n_ctx),
                       lambda h, t, s: tirx.if_then_else(vis(t, s), qk[h, t, s] * f32(scale) + mask[t, s], f32(NEG)),
                       name="score")
    rs1 = te.reduce_axis((i64(0), n_ctx), name="rs1")
    mx = te.compute((n_head, n_tok), lambda h, t: te.max(score[h, t, rs1], axis=rs1), name="mx")
    ex = te.compute((n_head, n_tok, n_ctx),
                    lambda h, t, s: tirx.if_then_else(vis(t, s), te.exp(score[h, t, s] - mx[h, t]), f32(0.0)),
                    name="ex")
    rs2 = te.reduce_axis((i64(0), n_ctx), name="rs2")
    sm = te.compute((n_head, n_tok), lambda h, t: te.sum(ex[h, t, rs2], axis=rs2), name="sm")
    rs3 = te.reduce_axis((i64(0), n_ctx), name="rs3")
    pv = te.compute((n_tok, n_head, dim), lambda t, h, d: te.sum(ex[h, t, rs3] * vc[rs3, h // group, d], axis=rs3),
                    name="pv")
    out = te.compute((n_tok, n_head, dim), lambda t, h, d: pv[t, h, d] / sm[h, t], name="out")
    return func([q, kc, vc, pos, mask, out])


# ---------------------------------------------------------------------------------------------
# MoE pieces: merged gate_up activation, the shared expert's gate and combine


def swiglu_halves(act_shape: PShape) -> tirx.PrimFunc:
    """Args (y [T, k, 2F], act [T, k, F]): silu(y[..., :F]) * y[..., F:]."""
    n, k, f = act_shape
    y = te.placeholder((n, k, f * i64(2)), "float32", name="y")
    act = te.compute(act_shape, lambda t, s, j: y[t, s, j] * _sigmoid(y[t, s, j]) * y[t, s, j + f], name="act")
    return func([y, act])


def shared_combine(shape: PShape, has_scale: bool) -> tirx.PrimFunc:
    """Args (routed [T,E], shexp [T,E], x [T,E], w [E][, s_down [1]], out [T,E]):
    routed + shexp [* s] * sigmoid(sum(x * w))."""
    n, e = shape
    routed = te.placeholder(shape, "float32", name="routed")
    shexp = te.placeholder(shape, "float32", name="shexp")
    x = te.placeholder(shape, "float32", name="x")
    w = te.placeholder((e,), "float32", name="w")
    scale = te.placeholder((i64(1),), "float32", name="s_down") if has_scale else None
    re_ = te.reduce_axis((i64(0), e), name="re")
    logit = te.compute((n,), lambda t: te.sum(x[t, re_] * w[re_], axis=re_), name="logit")

    def body(t: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        sh = shexp[t, j] * scale[i64(0)] if scale is not None else shexp[t, j]
        return routed[t, j] + sh * _sigmoid(logit[t])

    out = te.compute(shape, body, name="out")
    return func([routed, shexp, x, w, *([scale] if scale is not None else []), out])


# ---------------------------------------------------------------------------------------------
# PLE hash


def ple_hash(n_cells: int, ngram: int, heads_per_ngram: int, multipliers: Sequence[int], offsets: Sequence[int],
             sizes: Sequence[int], eos: int) -> tirx.PrimFunc:
    """Args (history [C] int32, tokens [T] int32, pos, rows [T, (n-1)*heads] int32)."""
    from tvm.script import ir_builder as IB
    from tvm.script.ir_builder import tirx as Tb

    n_heads = (ngram - 1) * heads_per_ngram
    u64 = "uint64"
    with IB.IRBuilder() as ib:
        with Tb.prim_func():
            Tb.func_name("ple_hash")
            Tb.func_attr({"tirx.noalias": True})
            hist = Tb.arg("hist", Tb.buffer((i64(n_cells),), "int32"))
            tok_h = Tb.arg("tokens", Tb.handle())
            pos = Tb.arg("pos", tirx.Var("pos", "int64"))
            rows_h = Tb.arg("rows", Tb.handle())
            n = tirx.Var("n", "int64")
            toks = Tb.match_buffer(tok_h, (n,), "int32")
            rows = Tb.match_buffer(rows_h, (n, i64(n_heads)), "int32")
            with Tb.parallel(i64(0), n) as i:
                ctx = Tb.decl_buffer((ngram,), "int64", scope="local")
                cut = Tb.decl_buffer((1,), "int64", scope="local")
                Tb.buffer_store(ctx, toks[i].astype("int64"), [0])
                Tb.buffer_store(cut, i64(0), [0])
                p = pos + i
                for s in range(1, ngram):
                    src = p - i64(s)
                    prev = tirx.if_then_else(tirx.any(cut[0] != i64(0), src < i64(0)), i64(-1),
                                             hist[te.max(src, i64(0))].astype("int64"))
                    stop = tirx.any(cut[0] != i64(0), prev < i64(0), prev == i64(eos))
                    Tb.buffer_store(cut, tirx.if_then_else(stop, i64(1), i64(0)), [0])
                    Tb.buffer_store(ctx, tirx.if_then_else(stop, i64(eos), prev), [s])
                for g in range(2, ngram + 1):
                    mixed = None
                    for j in range(g):
                        term = ctx[j].astype(u64) * tirx.const(int(multipliers[j]) & ((1 << 64) - 1), u64)
                        mixed = term if mixed is None else tirx.bitwise_xor(mixed, term)
                    for k in range(heads_per_ngram):
                        h = (g - 2) * heads_per_ngram + k
                        row = tirx.truncmod(mixed, tirx.const(int(sizes[h]), u64)) + tirx.const(int(offsets[h]), u64)
                        Tb.buffer_store(rows, row.astype("int32"), [i, i64(h)])
    return ib.get()
