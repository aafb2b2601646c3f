"""CPU vector math as llama.cpp's CPU backend does it, for the kernels that follow its numerics.

`expf8` is llama.cpp's `ggml_v_expf` (the AVX-512 form, which its x86 builds run), used where
llama.cpp uses it: SiLU in its SwiGLU. `swiglu` is the CPU kernel of the `swiglu` op.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T


def expf8(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """exp of 8 float32 lanes by llama.cpp's `ggml_v_expf` (its AVX-512 form, within 1.5 ulp):
    n = round(x / ln 2), b = x - n ln 2 in two parts, j = 1 + b + ... (degree 5), exp = j 2^n.
    Inputs are clamped to +-130 (exp already 0 or inf there); 2^n is applied in two exact steps so
    that n = 128 and subnormal results scale as `vscalefps` does."""

    def c(v: float) -> tirx.PrimExpr:
        return T.broadcast(T.float32(v), 8)

    def fma(a: tirx.PrimExpr, b: tirx.PrimExpr, d: tirx.PrimExpr) -> tirx.PrimExpr:
        return T.call_llvm_pure_intrin("float32x8", "llvm.fma.v8f32", a, b, d)

    def pow2(e: tirx.PrimExpr) -> tirx.PrimExpr:  # 2^e for integral e in [-126, 127]
        return T.reinterpret("float32x8", T.shift_left(T.Cast("int32x8", e) + T.broadcast(T.int32(127), 8),
                                                       T.broadcast(T.int32(23), 8)))

    x = T.max(T.min(x, c(130.0)), c(-130.0))
    shift = c(float.fromhex("0x1.8p23"))
    n = fma(x, c(float.fromhex("0x1.715476p+0")), shift) - shift
    b = fma(c(0.0) - n, c(float.fromhex("0x1.7f7d1cp-20")), fma(c(0.0) - n, c(float.fromhex("0x1.62e4p-1")), x))
    u = b * b
    j = fma(fma(fma(c(float.fromhex("0x1.0e4020p-7")), b, c(float.fromhex("0x1.573e2ep-5"))), u,
                fma(c(float.fromhex("0x1.555e66p-3")), b, c(float.fromhex("0x1.fffdb6p-2")))),
            u, fma(c(float.fromhex("0x1.ffffecp-1")), b, c(1.0)))
    n1 = T.max(T.min(n, c(127.0)), c(-126.0))
    return j * pow2(n1) * pow2(n - n1)


def silu_mul8(g: tirx.PrimExpr, u: tirx.PrimExpr) -> tirx.PrimExpr:
    """silu(g) * u on 8 lanes as llama.cpp's ggml_vec_swiglu_f32: g / (1 + exp(-g)) * u."""
    return g / (T.broadcast(T.float32(1), 8) + expf8(T.broadcast(T.float32(0), 8) - g)) * u


def swiglu(k: int) -> tirx.PrimFunc:
    """`(gate [T, K], up [T, K], y [T, K])`, y = silu(gate) * up (K a multiple of 8), a task per token."""
    if k % 8:
        raise ValueError(f"swiglu: width {k} is not a multiple of 8")
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
