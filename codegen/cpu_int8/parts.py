"""The parts the 8-bit matmul kernels share (codegen/cpu_int8/block32.py for 32-value blocks,
codegen/cpu_int8/kquant.py and codegen/cpu_int8/kquant_lowbit.py for the K-quants): row grouping, the GEMV
prologues and residual epilogue, prefetch, llama.cpp's horizontal sum, parameter pruning, and the
K-quants' integer pair sums."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from ggufc.codegen.cpu_int8.isa import Int8Isa
from ggufc.codegen.cpu_int8.isa import pairs16 as pairs16
from ggufc.codegen.kernels.cpu_vector_math import fma8 as fma8
from ggufc.codegen.kernels.cpu_vector_math import fma16 as fma16
from ggufc.codegen.kernels.cpu_vector_math import hsum8 as hsum8
from ggufc.codegen.kernels.cpu_vector_math import prefetch as prefetch
from ggufc.codegen.kernels.cpu_vector_math import prefetch_l2 as prefetch_l2
from ggufc.codegen.kernels.cpu_vector_math import silu_mul8

ROWS = 4  # rows per parallel task: independent accumulator chains, activation loads shared
MAX_GROUP = 3  # matrices one grouped GEMV kernel takes
PREFETCH_GROUPS = 4  # row groups ahead whose weight bytes are prefetched
L2_AHEAD_BYTES = 48 * 1024  # code bytes ahead a K-quant GEMV task also asks for into L2 only


Stage = tuple[Callable[..., None], Callable[..., None], bool]


def input_stage(prologue: tuple[Any, ...], k: int) -> Stage | None:
    """(setup, block, heavy): macros computing the GEMV input xin [1, K] from (x, xw, xu) one
    32-block at a time (setup: what every block needs first), and whether the blocks are worth
    spreading over the thread pool (SwiGLU's exp); or None (x is the input)."""
    kind = prologue[0] if prologue else ""
    if not kind:
        return None
    eps = float(prologue[1]) if kind == "rms_norm" else 0.0

    @T.macro
    def setup(x, rstd):  # type: ignore[no-untyped-def]
        if kind == "rms_norm":  # the rms_norm kernel's steps: squares summed in float64
            acc = T.alloc_buffer((1,), "float64")
            acc[0] = T.float64(0)
            for i in range(k):
                acc[0] = acc[0] + T.Cast("float64", x[0, i] * x[0, i])
            rstd[0] = T.float32(1) / T.sqrt(T.Cast("float32", acc[0] / T.float64(k)) + T.float32(eps))

    @T.macro
    def block(x, xw, xu, xin, rstd, b):  # type: ignore[no-untyped-def]
        if kind == "rms_norm":
            for i in range(32):
                xin[0, b * 32 + i] = x[0, b * 32 + i] * rstd[0] * xw[b * 32 + i]
        else:  # swiglu, as llama.cpp's ggml_vec_swiglu_f32: gate / (1 + exp(-gate)) * up
            for c in range(4):
                xin[0, b * 32 + c * 8:b * 32 + c * 8 + 8] = silu_mul8(x.vload([0, b * 32 + c * 8], "float32x8"),
                                                                      xu.vload([0, b * 32 + c * 8], "float32x8"))

    return setup, block, kind == "swiglu"


def slots(ns: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Row counts of the three slots (unused ones get a placeholder size) and their row-group counts."""
    padded = [*ns, *([ROWS] * (MAX_GROUP - len(ns)))]
    return padded, [n // ROWS for n in padded]


def residual_adder(residual: bool) -> Callable[..., None]:
    """The epilogue y += res (serial: one add per output row, after the parallel loop), or nothing."""

    @T.macro
    def add_residual(res, y, n):  # type: ignore[no-untyped-def]
        if residual:
            for j in range(n):
                y[0, j] = res[0, j] + y[0, j]

    return add_residual


def l2_ahead_groups(group_bytes: int, prefetch_groups: int) -> int:
    """Row groups ahead of its loads a task prefetches into L2: L2_AHEAD_BYTES of codes, and beyond
    the L1 prefetch."""
    return max(prefetch_groups + 1, -(-L2_AHEAD_BYTES // group_bytes))


# hsum_float_8 of each 8-lane half of up to 8 float32x16 accumulators at once: three levels, each
# adding the lanes of two vectors in the order hsum_float_8 adds them, ((0+4) + (2+6)) + ((1+5) +
# (3+7)), 16 sums in one vector from 21 shuffles and adds (one sum at a time takes ~12 instructions).
# Level 1, per two accumulators: each half's two 128-bit lanes added (lane j + lane j + 4).
_LEVEL1 = ([*range(0, 4), *range(8, 12), *range(16, 20), *range(24, 28)],
           [*range(4, 8), *range(12, 16), *range(20, 24), *range(28, 32)])
# Level 2, per two level-1 vectors, in each 128-bit lane: (b0 + b2, b1 + b3) of both.
_LEVEL2 = ([i for g in range(4) for i in (4 * g, 4 * g + 1, 16 + 4 * g, 17 + 4 * g)],
           [i for g in range(4) for i in (4 * g + 2, 4 * g + 3, 18 + 4 * g, 19 + 4 * g)])
# Level 3: c0 + c1 of each of the four sums in each 128-bit lane.
_LEVEL3 = ([i for g in range(4) for i in (4 * g, 4 * g + 2, 16 + 4 * g, 18 + 4 * g)],
           [i for g in range(4) for i in (4 * g + 1, 4 * g + 3, 17 + 4 * g, 19 + 4 * g)])


def _tree_levels(vectors: list[Any], add: Callable[[Any, Any], Any],
                 shuffle: Callable[[Any, Any, list[int]], Any]) -> Any:
    """The three levels on 8 vectors (anything `add` and `shuffle` take: TIR vectors, or labels)."""
    for first, second in (_LEVEL1, _LEVEL2, _LEVEL3):
        pairs = zip(vectors[::2], vectors[1::2], strict=True)
        vectors = [add(shuffle(a, b, first), shuffle(a, b, second)) for a, b in pairs]
    return vectors[0]


def half_lane(i: Any, h: Any) -> Any:
    """The lane of half_sums' result holding half h of vectors[i] (ints, or TIR expressions)."""
    return i // 2 + 8 * (i % 2) + 4 * h


@functools.cache
def _check_half_lanes() -> bool:
    """Run the levels on labels: each lane half_lane names holds hsum_float_8's sum of that half,
    which the padding never enters."""
    vectors = [[(i, lane // 8, lane % 8) for lane in range(16)] for i in range(8)]
    tree = _tree_levels(vectors, lambda a, b: [(x, y) for x, y in zip(a, b, strict=True)],
                        lambda a, b, idx: [(a + b)[k] for k in idx])
    for i, h in ((i, h) for i in range(8) for h in range(2)):
        want = (((i, h, 0), (i, h, 4)), ((i, h, 2), (i, h, 6))), (((i, h, 1), (i, h, 5)), ((i, h, 3), (i, h, 7)))
        assert tree[half_lane(i, h)] == want, (i, h)
    return True


def half_sums(vectors: list[tirx.PrimExpr]) -> tirx.PrimExpr:
    """hsum_float_8 of both 8-lane halves of each of up to 8 float32x16 `vectors`, as one
    float32x16: half h of vectors[i] in lane half_lane(i, h)."""
    assert 0 < len(vectors) <= 8 and _check_half_lanes(), "one tree takes up to 8 accumulators"
    zero = T.broadcast(T.float32(0), 16)
    padded = [*vectors, *[zero] * (8 - len(vectors))]
    return _tree_levels(padded, lambda a, b: a + b, lambda a, b, idx: T.Shuffle([a, b], idx))


def halves(low: tirx.PrimExpr, high: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
    """Two vectors of `lanes` lanes as the low and high halves of one twice as wide."""
    return T.Shuffle([low, high], list(range(2 * lanes)))


def twice(v: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
    """A vector of `lanes` lanes in both halves of one twice as wide (both halves of a zmm)."""
    return halves(v, v, lanes)


def without_params(func: tirx.PrimFunc, names: set[str]) -> tirx.PrimFunc:
    """`func` minus unused buffer parameters (one TVMScript body serves several signatures)."""
    keep = [p for p in func.params if p.name not in names]
    return tirx.PrimFunc(keep, func.body, func.ret_type, func.attrs)


def scaled_pairs(isa: Int8Isa, acc: tirx.PrimExpr, pairs: tirx.PrimExpr, scales: tirx.PrimExpr) -> tirx.PrimExpr:
    """acc + the int16 pair sums times their sub-block scales, adjacent pairs summed (vpdpwssds,
    or vpmaddwd and an add): lane j gains scale (a . q over values 4j..4j+3), exactly."""
    return isa.pair_dot(acc, pairs, scales)


def mask32(v: tirx.PrimExpr, bits: int) -> tirx.PrimExpr:
    """The bits `bits` of each int32 lane of an int32x8."""
    return T.bitwise_and(v, T.broadcast(T.int32(bits), 8))


@T.macro
def absmax_lanes(x, t, start, vectors, part):  # type: ignore[no-untyped-def]
    """part[0..7] = the largest |x[t, start + 8 c + lane]| over c < vectors, lane by lane."""
    for lane in T.vectorized(8):
        part[lane] = T.float32(0)
    for c in range(vectors):
        for lane in T.vectorized(8):
            part[lane] = T.max(part[lane], T.fabs(x[t, start + c * 8 + lane]))


def lanes_max(part: tirx.Buffer) -> tirx.PrimExpr:
    """The largest of absmax_lanes' 8 lanes, reduced as llama.cpp's quantizers do (pairs, then pairs)."""
    return T.max(T.max(T.max(part[0], part[1]), T.max(part[2], part[3])),
                 T.max(T.max(part[4], part[5]), T.max(part[6], part[7])))


def quantize_prologue(pos: Callable[..., tirx.PrimExpr], stage: Stage | None,
                       k: int) -> tuple[Callable[..., None], Callable[..., None]]:
    """(quantize, prologue) macros: token t of the input ((x, xw, xu) through `stage`, or x) ->
    codes xb[t] (int8, at pos(b, i)), scales xd[t, K/32] (f16-rounded), code sums xs[t, K/32] and
    q8_1 block sums xss[t, K/32] (f16(d * xs), d in f32); the same float32 steps as quantize_act
    (so the codes are identical). A heavy stage spreads the prologue's blocks over the thread pool
    (a second parallel launch)."""
    parallel = stage is not None and stage[2]

    @T.macro
    def quantize_block(x, t, b, xb, xd, xs, xss):  # type: ignore[no-untyped-def]
        part = T.alloc_buffer((8,), "float32")
        absmax_lanes(x, t, b * 32, 4, part)
        amax = T.meta_var(lanes_max(part))
        d = T.meta_var(amax / T.float32(127))
        inv = T.meta_var(T.if_then_else(amax > T.float32(0), T.float32(127) / amax, T.float32(0)))
        for h in range(2):
            for i in T.vectorized(16):
                xb[t, pos(b, h * 16 + i)] = T.Cast("int8", T.nearbyint(x[t, b * 32 + h * 16 + i] * inv))
        xd[t, b] = T.Cast("float32", T.Cast("float16", d))
        xs[t, b] = 0
        for i in range(32):
            xs[t, b] = xs[t, b] + T.Cast("int32", xb[t, pos(b, i)])
        xss[t, b] = T.Cast("float32", T.Cast("float16", d * T.Cast("float32", xs[t, b])))

    @T.macro
    def quantize(x, t, xb, xd, xs, xss, n_blocks):  # type: ignore[no-untyped-def]
        for b in range(n_blocks):
            quantize_block(x, t, b, xb, xd, xs, xss)

    @T.macro
    def staged_block(x, xw, xu, xin, rstd, b, xb, xd, xs, xss):  # type: ignore[no-untyped-def]
        if stage is None:
            quantize_block(x, 0, b, xb, xd, xs, xss)
        else:
            stage[1](x, xw, xu, xin, rstd, b)
            quantize_block(xin, 0, b, xb, xd, xs, xss)

    @T.macro
    def prologue(x, xw, xu, xb, xd, xs, xss, n_blocks):  # type: ignore[no-untyped-def]
        xin = T.alloc_buffer((1, k), "float32")
        rstd = T.alloc_buffer((1,), "float32")
        if stage is not None:
            stage[0](x, rstd)
        if parallel:
            for b in T.parallel(n_blocks):
                staged_block(x, xw, xu, xin, rstd, b, xb, xd, xs, xss)
        else:
            for b in range(n_blocks):
                staged_block(x, xw, xu, xin, rstd, b, xb, xd, xs, xss)

    return quantize, prologue


def q8_pos(b: tirx.PrimExpr, i: tirx.PrimExpr) -> tirx.PrimExpr:
    """Byte of value i of block b: value order."""
    return b * 32 + i
