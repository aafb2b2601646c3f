"""GPU kernels of qwen4exp's two hand-written CPU kernels: the PLE n-gram hash and the QSA
indexer top-k. Same arguments and results as `kernels_qwen4exp.py`.

* `ple_hash`: one thread per token. The reference hashes in uint64 wrap-around arithmetic, which
  WGSL lacks (no 64-bit integers), so every 64-bit value is a (hi, lo) pair of uint32 words:
  the product of a token (< 2^31) and a 64-bit multiplier keeps its low 64 bits exactly (the low
  word is the wrapping 32-bit product, the high word adds the 16-bit-split upper half of
  token * m_lo to token * m_hi), XOR works word-wise, and `x mod s` (s < 2^31) is
  ((hi mod s) * 2^32 + lo) mod s with the 2^32 factor applied as 32 doublings mod s, so no
  intermediate exceeds 32 bits. The rows equal the uint64 reference's bit for bit.
* `indexer_topk`: one thread per query row runs the CPU kernel's libstdc++ heap select (make_heap
  on the first k cells, then each later cell strictly greater than the top replaces it), so the
  selection and its tie order are the CPU kernel's and llama.cpp's. Cell values are formed on
  the fly from the block scores (no [T, cells] scratch), in float32 as the reference does.
  Heap indices are int32: the cells of one context fit.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import te, tirx
from tvm.script import tirx as T

from .kernels import i64

THREADS = 64
U32 = "uint32"
I32_MAX = (1 << 31) - 1


def _u32(v: int) -> tirx.PrimExpr:
    return tirx.const(v, U32)


def _mul_u32_wide(a: tirx.PrimExpr, m: int) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
    """(hi, lo) words of the 64-bit product of uint32 `a` and the constant uint32 `m`."""
    a1, a0 = tirx.truncdiv(a, _u32(1 << 16)), tirx.truncmod(a, _u32(1 << 16))
    m1, m0 = m >> 16, m & 0xFFFF
    p00, p01, p10 = a0 * _u32(m0), a0 * _u32(m1), a1 * _u32(m0)
    mid = tirx.truncdiv(p00, _u32(1 << 16)) + tirx.truncmod(p01, _u32(1 << 16)) + tirx.truncmod(p10, _u32(1 << 16))
    lo = a * _u32(m)
    hi = a1 * _u32(m1) + tirx.truncdiv(p01, _u32(1 << 16)) + tirx.truncdiv(p10, _u32(1 << 16)) \
        + tirx.truncdiv(mid, _u32(1 << 16))
    return hi, lo


def ple_hash(n_cells: int, ngram: int, heads_per_ngram: int, multipliers: Sequence[int], offsets: Sequence[int],
             sizes: Sequence[int], eos: int) -> tirx.PrimFunc:
    """Args (history [C] int32, tokens [T] int32, pos, rows [T, (n-1)*heads] int32)."""
    from tvm.script import ir_builder as IB
    from tvm.script.ir_builder import tirx as Tb

    n_heads = (ngram - 1) * heads_per_ngram
    for h in range(n_heads):
        if not 0 < int(sizes[h]) <= I32_MAX or int(offsets[h]) + int(sizes[h]) > I32_MAX:
            raise ValueError(f"ple_hash: head {h} table range {offsets[h]}+{sizes[h]} exceeds int32")
    mult = [int(m) & ((1 << 64) - 1) for m in multipliers]
    with IB.IRBuilder() as ib:
        with Tb.prim_func():
            Tb.func_name("ple_hash_gpu")
            Tb.func_attr({"tirx.noalias": True})
            hist = Tb.arg("hist", Tb.buffer((i64(n_cells),), "int32"))
            tok_h = Tb.arg("tokens", Tb.handle())
            pos = Tb.arg("pos", tirx.Var("pos", "int64"))
            rows_h = Tb.arg("rows", Tb.handle())
            n = tirx.Var("n", "int64")
            # named: a launch binds its buffers to the parameters by name
            toks = IB.IRBuilder.name("toks", Tb.match_buffer(tok_h, (n,), "int32"))
            rows = IB.IRBuilder.name("rows", Tb.match_buffer(rows_h, (n, i64(n_heads)), "int32"))
            bx = Tb.env_thread("blockIdx.x", "int64")
            tx = Tb.env_thread("threadIdx.x", "int64")
            with Tb.launch_thread(bx, tirx.floordiv(n + i64(THREADS - 1), i64(THREADS))):
                ctx = IB.IRBuilder.name("ctx", Tb.alloc_buffer((ngram,), "int32", scope="local"))
                word = IB.IRBuilder.name("word", Tb.alloc_buffer((3,), U32, scope="local"))  # hi, lo, remainder
                with Tb.launch_thread(tx, i64(THREADS)):
                    i = bx * i64(THREADS) + tx
                    with Tb.If(i < n):
                        with Tb.Then():
                            _ple_body(Tb, hist, toks, rows, ctx, word, pos + i, i, ngram, heads_per_ngram, mult,
                                      offsets, sizes, eos)
    return ib.get()


def _ple_body(Tb, hist, toks, rows, ctx, word, p, i, ngram, heads_per_ngram, mult, offsets, sizes, eos) -> None:
    """One token: its n-gram context (cut at the first missing or EOS predecessor), then the rows."""
    Tb.buffer_store(ctx, toks[i], [0])
    for s in range(1, ngram):
        src = p - i64(s)
        prev = tirx.if_then_else(src < i64(0), -1, hist[te.max(src, i64(0))])
        stop = tirx.any(prev < 0, prev == eos)
        if s > 1:  # once cut, every older slot reads EOS (and ctx[s-1] is EOS exactly when cut)
            stop = tirx.any(ctx[s - 1] == eos, stop)
        Tb.buffer_store(ctx, tirx.if_then_else(stop, eos, prev), [s])
    for g in range(2, ngram + 1):
        Tb.buffer_store(word, _u32(0), [0])
        Tb.buffer_store(word, _u32(0), [1])
        for j in range(g):
            a = ctx[j].astype(U32)
            hi, lo = _mul_u32_wide(a, mult[j] & 0xFFFFFFFF)
            hi = hi + a * _u32(mult[j] >> 32)
            Tb.buffer_store(word, tirx.bitwise_xor(word[0], hi), [0])
            Tb.buffer_store(word, tirx.bitwise_xor(word[1], lo), [1])
        for k in range(heads_per_ngram):
            h = (g - 2) * heads_per_ngram + k
            Tb.buffer_store(rows, _mod_u64(Tb, word, int(sizes[h])) + int(offsets[h]), [i, i64(h)])


def _mod_u64(Tb, word, size: int) -> tirx.PrimExpr:
    """(word[0] * 2^32 + word[1]) mod size as int32, for 0 < size < 2^31."""
    s = _u32(size)
    Tb.buffer_store(word, tirx.truncmod(word[0], s), [2])
    with Tb.serial(0, 32):
        Tb.buffer_store(word, tirx.truncmod(word[2] * _u32(2), s), [2])
    return tirx.truncmod(word[2] + tirx.truncmod(word[1], s), s).astype("int32")


def indexer_topk(nb1: int, ratio: int, width: int, n_cells: int) -> tirx.PrimFunc:
    """Args (scores [T, NB+1], pos, sel [T, width]); see `kernels_qwen4exp.indexer_topk`."""
    if n_cells + width > I32_MAX:
        raise ValueError(f"indexer_topk: {n_cells} cells do not fit int32 heap indices")
    R, DEAD, W, NT = T.int32(ratio), T.int32(nb1 - 1), T.int32(width), T.int64(THREADS)
    NB1, WID = T.int64(nb1), T.int64(width)

    def value(S: tirx.Buffer, i: tirx.PrimExpr, q: tirx.PrimExpr, nfull: tirx.PrimExpr, j: tirx.PrimExpr
              ) -> tirx.PrimExpr:
        """The CPU kernel's cell value: block score (+1e9 in the tail), -inf after the query."""
        blk = tirx.truncdiv(j, R)
        tail = tirx.if_then_else(blk * R >= tirx.truncdiv(q + 1, R) * R, T.float32(1e9), T.float32(0))
        val = tirx.if_then_else(blk < nfull, S[i, tirx.Cast("int64", tirx.min(blk, DEAD))] + tail,
                                S[i, tirx.Cast("int64", DEAD)] + T.float32(1e9))
        return tirx.if_then_else(j > q, tirx.min_value("float32"), val)

    @T.macro
    def adjust(Sel: T.Buffer, S: T.Buffer, st: T.Buffer, i: T.int64, q: T.int32, nfull: T.int32,
               hole0: T.int32, length: T.int32, val_idx: T.int32) -> None:
        # std::__adjust_heap then std::__push_heap, comp(a, b) = value(a) > value(b);
        # st: hole, second, parent, value, top
        st[0] = hole0
        st[1] = hole0
        st[3] = val_idx
        st[4] = hole0
        while st[1] < (length - 1) // 2:
            st[1] = 2 * (st[1] + 1)
            if value(S, i, q, nfull, Sel[i, T.Cast("int64", st[1])]) > value(
                    S, i, q, nfull, Sel[i, T.Cast("int64", st[1] - 1)]):
                st[1] = st[1] - 1
            Sel[i, T.Cast("int64", st[0])] = Sel[i, T.Cast("int64", st[1])]
            st[0] = st[1]
        if length % 2 == 0 and st[1] == (length - 2) // 2:
            st[1] = 2 * (st[1] + 1)
            Sel[i, T.Cast("int64", st[0])] = Sel[i, T.Cast("int64", st[1] - 1)]
            st[0] = st[1] - 1
        st[2] = T.max(st[0] - 1, 0) // 2
        while st[0] > st[4] and value(S, i, q, nfull, Sel[i, T.Cast("int64", st[2])]) > value(
                S, i, q, nfull, st[3]):
            Sel[i, T.Cast("int64", st[0])] = Sel[i, T.Cast("int64", st[2])]
            st[0] = st[2]
            st[2] = T.max(st[0] - 1, 0) // 2
        Sel[i, T.Cast("int64", st[0])] = st[3]

    @T.prim_func(private=True)
    def indexer_topk_gpu(s_h: T.handle, pos: T.int64, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        S = T.match_buffer(s_h, (n, NB1), "float32")
        Sel = T.match_buffer(o_h, (n, WID), "int32")
        bx = T.launch_thread("blockIdx.x", (n + NT - T.int64(1)) // NT)
        st = T.alloc_local((8,), "int32")
        tx = T.launch_thread("threadIdx.x", NT)
        i = T.meta_var(bx * NT + tx)
        q = T.meta_var(T.Cast("int32", pos + bx * NT + tx))
        nkv = T.meta_var(T.Cast("int32", pos + n))
        nfull = T.meta_var(T.min(T.Cast("int32", pos + n) // R, DEAD))
        if bx * NT + tx < n:
            st[5] = T.min(W, nkv)
            for a in range(WID):
                Sel[i, a] = T.Cast("int32", a)
            if st[5] >= 2:
                st[6] = (st[5] - 2) // 2
                while st[6] >= 0:
                    adjust(Sel, S, st, i, q, nfull, st[6], st[5], Sel[i, T.Cast("int64", st[6])])
                    st[6] = st[6] - 1
            st[7] = st[5]
            while st[7] < nkv:
                if value(S, i, q, nfull, st[7]) > value(S, i, q, nfull, Sel[i, 0]):
                    adjust(Sel, S, st, i, q, nfull, 0, st[5], st[7])
                st[7] = st[7] + 1
            for a in range(WID):
                if T.Cast("int32", a) >= st[5] or value(S, i, q, nfull, T.max(Sel[i, a], 0)) == T.min_value(
                        "float32"):
                    Sel[i, a] = -1

    return _with_root_block(indexer_topk_gpu)


def _with_root_block(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Relax's reshape detection inspects every one-tensor-in, one-tensor-out kernel and requires
    its body to be a root block."""
    from tvm import s_tir

    root = s_tir.SBlock([], [], [], "root", func.body)
    return func.with_body(s_tir.SBlockRealize([], True, root))
