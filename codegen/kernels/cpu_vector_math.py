"""CPU vector math as llama.cpp's CPU backend does it, for the kernels that follow its numerics.

`expf8` is llama.cpp's `ggml_v_expf` (its AVX2 form), used where llama.cpp uses it: SiLU in its
SwiGLU and the softmaxes (attention's, a router's). `swiglu` is the CPU kernel of the `swiglu` op,
`soft_max` ggml_soft_max's over rows. `prefetch` and `prefetch_l2` are the cache hints the streaming
kernels (the 8-bit GEMVs, attention) issue ahead.

TVM's LLVM builds fuse a product into the add that takes it (fp-contract=fast); where llama.cpp
rounds the product first, `rounded` keeps it apart.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T


def expf8(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """exp of 8 float32 lanes by llama.cpp's `ggml_v_expf`, its AVX2 + FMA form (the x86 build the
    goldens come from has no AVX-512): n = round(x / ln 2), b = x - n ln 2 in two parts,
    j = b + ... (degree 5, no constant term), exp = fma(j, 2^n, 2^n); |n| > 126 scales in two
    steps (overflow to inf, underflow to 0 as the C code does)."""
    return ggml_expf(x, 8)


def ggml_expf(x: tirx.PrimExpr, lanes: int = 1) -> tirx.PrimExpr:
    """expf8's steps on `lanes` lanes (1: a scalar, as a TE body writes it; LLVM vectorises it back)."""
    flt_t, int_t = (f"float32x{lanes}", f"int32x{lanes}") if lanes > 1 else ("float32", "int32")
    fma_name = f"llvm.fma.v{lanes}f32" if lanes > 1 else "llvm.fma.f32"

    def c(v: float) -> tirx.PrimExpr:
        return T.broadcast(T.float32(v), lanes) if lanes > 1 else T.float32(v)

    def h(v: str) -> tirx.PrimExpr:
        return c(float.fromhex(v))

    def i(v: int) -> tirx.PrimExpr:
        return T.broadcast(T.int32(v), lanes) if lanes > 1 else T.int32(v)

    def fma(a: tirx.PrimExpr, b: tirx.PrimExpr, d: tirx.PrimExpr) -> tirx.PrimExpr:
        return T.call_llvm_pure_intrin(flt_t, fma_name, a, b, d)

    def bits(v: tirx.PrimExpr) -> tirx.PrimExpr:
        return T.reinterpret(int_t, v)

    def flt(v: tirx.PrimExpr) -> tirx.PrimExpr:
        return T.reinterpret(flt_t, v)

    r = h("0x1.8p23")
    z = fma(x, h("0x1.715476p+0"), r)
    n = z - r
    b = fma(c(0.0) - n, h("0x1.7f7d1cp-20"), fma(c(0.0) - n, h("0x1.62e4p-1"), x))
    e = T.shift_left(bits(z), i(23))
    k = flt(e + bits(c(1.0)))
    u = b * b
    j = fma(fma(fma(h("0x1.0e4020p-7"), b, h("0x1.573e2ep-5")), u, fma(h("0x1.555e66p-3"), b, h("0x1.fffdb6p-2"))),
            u, h("0x1.ffffecp-1") * b)
    g = T.Select(n <= c(0.0), i(-2113929216), i(0))  # 0x82000000
    s1 = flt(g + i(0x7F000000))
    s2 = flt(e - g)
    # lanes outside the special ranges feed their operations harmless values (k, 1): computing the
    # two-step scaling on every lane would hit subnormal operands, which cost microcode assists
    wide = T.fabs(n) > c(126.0)
    huge = T.fabs(n) > c(192.0)
    base = T.Select(wide, s2, k)
    sat = T.Select(huge, s1, c(1.0))
    return T.Select(huge, sat * sat, fma(base, j, base) * T.Select(wide, s1, c(1.0)))


def silu_ggml(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """silu of one float32 as ggml_v_silu computes each lane: x / (1 + ggml_v_expf(0 - x))."""
    return x / (T.float32(1) + ggml_expf(T.float32(0) - x))


def rounded(v: tirx.PrimExpr, dtype: str = "float32x8") -> tirx.PrimExpr:
    """v as its own rounded value: an arithmetic fence, so LLVM fuses no product into the add
    that takes it (ggml's separate multiply and add)."""
    return T.call_llvm_pure_intrin(dtype, "llvm.arithmetic.fence", v)


def fma8(a: tirx.PrimExpr, b: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.call_llvm_pure_intrin("float32x8", "llvm.fma.v8f32", a, b, c)


def fma16(a: tirx.PrimExpr, b: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.call_llvm_pure_intrin("float32x16", "llvm.fma.v16f32", a, b, c)


def hsum8(acc: tirx.Buffer, r: tirx.PrimExpr) -> tirx.PrimExpr:
    """The 8 lanes of acc[r] summed as llama.cpp's hsum_float_8 (and tinyBLAS's hsum):
    ((0+4) + (2+6)) + ((1+5) + (3+7))."""
    return ((acc[r, 0] + acc[r, 4]) + (acc[r, 2] + acc[r, 6])) + ((acc[r, 1] + acc[r, 5]) + (acc[r, 3] + acc[r, 7]))


def hsum8_lanes(v: tirx.PrimExpr) -> tirx.PrimExpr:
    """The 8 lanes of v summed as ggml's AVX hsums: ((0+4) + (2+6)) + ((1+5) + (3+7))."""
    lane = [T.Shuffle([v], [j]) for j in range(8)]
    return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]))


def soft_max(n: int) -> tirx.PrimFunc:
    """`(x [T, N], y [T, N])`, each row's softmax as ggml_soft_max (no scale, no mask) computes it
    in llama.cpp's AVX2 build: the row's max m; per 8 values e = ggml_v_expf(x - m), stored, their
    float hsum added to a float64 sum; the last N % 8 by expf, each added to the sum; then
    y = e * float(1 / sum)."""
    N = T.int64(n)
    chunks = n // 8

    @T.prim_func(private=True)
    def soft_max_cpu(x_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        x = T.match_buffer(x_h, (t_len, N), "float32")
        y = T.match_buffer(y_h, (t_len, N), "float32")
        for t in T.parallel(t_len):
            top = T.alloc_buffer((1,), "float32")
            total = T.alloc_buffer((1,), "float64")
            top[0] = x[t, 0]
            for j in range(n):
                top[0] = T.max(top[0], x[t, j])
            total[0] = T.float64(0)
            for c in range(chunks):
                y[t, c * 8:c * 8 + 8] = expf8(x.vload([t, c * 8], "float32x8") - T.broadcast(top[0], 8))
                total[0] = total[0] + T.Cast("float64", hsum8_lanes(y.vload([t, c * 8], "float32x8")))
            for j in range(chunks * 8, n):
                y[t, j] = T.exp(x[t, j] - top[0])
                total[0] = total[0] + T.Cast("float64", y[t, j])
            for j in range(n):
                y[t, j] = y[t, j] * T.Cast("float32", T.float64(1) / total[0])

    return soft_max_cpu


def silu_mul8(g: tirx.PrimExpr, u: tirx.PrimExpr) -> tirx.PrimExpr:
    """silu(g) * u on 8 lanes as llama.cpp's ggml_vec_swiglu_f32: g / (1 + exp(-g)) * u."""
    return g / (T.broadcast(T.float32(1), 8) + expf8(T.broadcast(T.float32(0), 8) - g)) * u


def swiglu(k: int, column_tasks: int = 1) -> tirx.PrimFunc:
    """`(gate [T, K], up [T, K], y [T, K])`, y = silu(gate) * up (K a multiple of 8), a task per token.

    Knob (`ggufc tune`, codegen/kernel_knobs.py): `column_tasks` > 1 splits each token's 8-lane
    vectors over that many tasks (a decode step has one token); every value's arithmetic is the same."""
    if k % 8:
        raise ValueError(f"swiglu: width {k} is not a multiple of 8")
    if column_tasks > 1:
        return _swiglu_split(k, column_tasks)
    K = T.int64(k)

    @T.prim_func(private=True)
    def swiglu_cpu(g_h: T.handle, u_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        g = T.match_buffer(g_h, (t_len, K), "float32")
        u = T.match_buffer(u_h, (t_len, K), "float32")
        y = T.match_buffer(y_h, (t_len, K), "float32")
        for t in T.parallel(t_len):
            for c in range(k // 8):
                y[t, c * 8:c * 8 + 8] = silu_mul8(g.vload([t, c * 8], "float32x8"), u.vload([t, c * 8], "float32x8"))

    return swiglu_cpu


def _swiglu_split(k: int, tasks: int) -> tirx.PrimFunc:
    """swiglu with each token's k/8 vectors split over `tasks` parallel tasks."""
    K = T.int64(k)
    per = -(-(k // 8) // tasks)  # vectors per task, the last task takes the rest

    @T.prim_func(private=True)
    def swiglu_cpu(g_h: T.handle, u_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        g = T.match_buffer(g_h, (t_len, K), "float32")
        u = T.match_buffer(u_h, (t_len, K), "float32")
        y = T.match_buffer(y_h, (t_len, K), "float32")
        for tp in T.parallel(t_len * tasks):
            for ci in range(per):
                if (tp % tasks) * per + ci < k // 8:
                    y[tp // tasks, ((tp % tasks) * per + ci) * 8:((tp % tasks) * per + ci) * 8 + 8] = silu_mul8(
                        g.vload([tp // tasks, ((tp % tasks) * per + ci) * 8], "float32x8"),
                        u.vload([tp // tasks, ((tp % tasks) * per + ci) * 8], "float32x8"))

    return swiglu_cpu


def prefetch(flat: tirx.Buffer, index: tirx.PrimExpr) -> tirx.PrimExpr:
    """Ask for the cache line holding flat[index] (read, keep in all levels): the row groups a
    task reads next, so the stream from L3/DRAM overlaps the arithmetic (~1.7x here)."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(flat[index]), T.int32(0), T.int32(3),
                              T.int32(1))


def prefetch_l2(flat: tirx.Buffer, index: tirx.PrimExpr) -> tirx.PrimExpr:
    """Ask for the cache line holding flat[index] into L2, not L1 (prefetcht1), far ahead of the
    `prefetch` stream: a cold weight stream then reaches L1 from L2 rather than DRAM, so fewer of
    the core's L1 misses wait on DRAM (cold Q4_K GEMV ~1.1x here; distance alone changed nothing)."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(flat[index]), T.int32(0), T.int32(2),
                              T.int32(1))
