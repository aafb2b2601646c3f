"""The n-gram embedding hash kernels, CPU and GPU side by side, and their lowering (reference:
`ir/ngram_embedding.py`).

* `ple_hash`: the n-gram rows in uint64 wrap-around arithmetic, one token per parallel task,
  reading predecessors from the token-history state.
* `ple_hash_gpu`: one thread per token. The reference hashes in uint64 wrap-around arithmetic, which
  WGSL lacks (no 64-bit integers), so every 64-bit value is a (hi, lo) pair of uint32 words:
  the product of a token (< 2^31) and a 64-bit multiplier keeps its low 64 bits exactly (the low
  word is the wrapping 32-bit product, the high word adds the 16-bit-split upper half of
  token * m_lo to token * m_hi), XOR works word-wise, and `x mod s` (s < 2^31) is
  ((hi mod s) * 2^32 + lo) mod s with the 2^32 factor applied as 32 doublings mod s, so no
  intermediate exceeds 32 bits. The rows equal the uint64 reference's bit for bit.

Symbolic extents: `n` (tokens of the call) and `pos` (tokens already cached), as in `kernels.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tvm
from tvm import te, tirx

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.gpu.schedules import GpuKernel, mark_schedule
from ggufc.codegen.kernels.prim_helpers import i64
from ggufc.codegen.lower_context import FunctionContext, call_args
from ggufc.ir.graph import Node
from ggufc.ir.ngram_embedding import PleHash

THREADS = 64  # GPU threads per workgroup
U32 = "uint32"
I32_MAX = (1 << 31) - 1



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


def ple_hash_gpu(n_cells: int, ngram: int, heads_per_ngram: int, multipliers: Sequence[int], offsets: Sequence[int],
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


def _ple_hash(fc: FunctionContext, node: Node) -> list[Any]:
    a: PleHash = node.attrs
    n_cells = int(node.inputs[0].shape[0])
    key = KK.NgramHash(a, n_cells)
    return fc.call(key, lambda: ple_hash(n_cells, a.ngram, a.heads_per_ngram, a.multipliers, a.offsets, a.sizes,
                                            a.eos), call_args(fc, node), node.outputs, node.outputs[0].name)


NGRAM_LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "ple_hash": _ple_hash,
}


# ---------------------------------------------------------------------------------------------
# GPU kernels by key kind (merged into the GPU targets' table by lower.py)


def _ngram_hash_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a = key.attrs
    return mark_schedule(ple_hash_gpu(key.cells, a.ngram, a.heads_per_ngram, a.multipliers, a.offsets, a.sizes, a.eos),
                 "ggufc.hash_per_token")












GPU_KERNELS: dict[str, GpuKernel] = {
    KK.NgramHash.kind: _ngram_hash_gpu_kernel,
}
