"""Fused elementwise kernels: one TE compute per fused program of unary, binary and scalar steps,
with ggml's F16 roundings (GELU's table lookups) where the program asks for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tvm import te, tirx
from tvm.tirx import Expr as PrimExpr

from ggufc.codegen.kernels.cpu_vector_math import silu_ggml
from ggufc.codegen.kernels.prim_helpers import PShape, bcast_index, broadcast_shape, f32, func
from ggufc.ir import ops as O


def sigmoid(x: PrimExpr) -> PrimExpr:
    return f32(1.0) / (f32(1.0) + te.exp(-x))


def shared(name: str, value: PrimExpr, body: Callable[[PrimExpr], PrimExpr], dtype: str = "float32") -> PrimExpr:
    """`body(v)` with `v` bound once to `value` (a Let): an expression used several times stays one
    node instead of a copy per use, which nested roundings would multiply into a tree of 10^5 nodes
    (minutes of compile time for one GELU)."""
    var = tirx.Var(name, dtype)
    return tirx.Let(var, value, body(var))


def round_to_f16(x: PrimExpr) -> PrimExpr:
    """x rounded to the nearest half-precision value (ties to even; inf beyond f16's range), in
    32-bit integer arithmetic on x's bits, so targets without f16 types (WGSL) compute it too."""
    u32 = lambda v: tirx.const(v, "uint32")  # noqa: E731
    bits = tirx.reinterpret("uint32", x)
    return shared("f16_sign", bits & u32(0x80000000), lambda sign: shared(
        "f16_mag", bits & u32(0x7FFFFFFF), lambda mag: _round_magnitude_to_f16(mag, sign), "uint32"), "uint32")


def _round_magnitude_to_f16(mag: PrimExpr, sign: PrimExpr) -> PrimExpr:
    u32 = lambda v: tirx.const(v, "uint32")  # noqa: E731
    # normal f16 range: drop 13 mantissa bits, rounding to nearest even (a carry may raise the exponent)
    normal = (mag + u32(0x0FFF) + ((mag >> u32(13)) & u32(1))) & u32(0xFFFFE000)
    normal = tirx.Select(normal >= u32(0x47800000), u32(0x7F800000), normal)  # past 65504: inf
    # f16 subnormals: multiples of 2^-24; the f32 mantissa shifted right by 126 - exponent, rounded to even
    shift_value = te.min(u32(126) - te.min(mag >> u32(23), u32(112)), u32(31))

    def subnormal(shift: PrimExpr) -> PrimExpr:
        mant = (mag & u32(0x7FFFFF)) | u32(0x800000)
        kept, rest = mant >> shift, mant & ((u32(1) << shift) - u32(1))
        half = u32(1) << (shift - u32(1))
        up = tirx.Select(tirx.any(rest > half, tirx.all(rest == half, (kept & u32(1)) == u32(1))), u32(1), u32(0))
        # the value in units of 2^-24: scale by lowering the exponent (no float constant to print)
        return shared("f16_steps", kept + up, lambda steps: tirx.Select(
            steps == u32(0), u32(0), tirx.reinterpret("uint32", steps.astype("float32")) - u32(24 << 23)), "uint32")

    tiny = shared("f16_shift", shift_value, subnormal, "uint32")
    rounded = tirx.Select(mag > u32(0x7F800000), mag, tirx.Select(mag < u32(0x38800000), tiny, normal))
    return tirx.reinterpret("float32", rounded | sign)


def cast_to_f16(x: PrimExpr) -> PrimExpr:
    """x rounded to half precision by the target's own conversion (F16C's vcvtps2ph, CUDA's and
    Metal's cvt): to nearest even like round_to_f16, as one instruction instead of ~40 integer
    operations (a GELU kernel built from those takes TVM ~30 s to lower)."""
    return x.astype("float16").astype("float32")


def gelu_tanh_f16(x: PrimExpr, to_f16: Callable[[PrimExpr], PrimExpr] = round_to_f16,
                  exact_tanh: bool = False) -> PrimExpr:
    """ir.ops.gelu_tanh_f16_ref: GELU's tanh form of the input rounded to F16, rounded to F16 (llama.cpp's
    CPU table), 0 for x <= -10 and x for x >= 10. `to_f16`: round_to_f16 or cast_to_f16. `exact_tanh`
    (CPU targets): the table entry as ggml_gelu_f32 computes it, bit for bit over every F16 input
    (ir.ops.gelu_tanh_f32)."""

    def gelu(h: PrimExpr) -> PrimExpr:
        return to_f16((_gelu_f32_exact if exact_tanh else _gelu_f32_plain)(h))

    return shared("gelu_x", x, lambda v: tirx.Select(
        v <= f32(-10.0), f32(0.0), tirx.Select(v >= f32(10.0), v, shared("gelu_h", to_f16(v), gelu))))


def _gelu_f32_plain(h: PrimExpr) -> PrimExpr:
    inner = f32(0.79788456) * h * (f32(1.0) + f32(0.044715) * h * h)
    return f32(0.5) * h * (f32(1.0) + te.tanh(inner))


def _gelu_f32_exact(h: PrimExpr) -> PrimExpr:
    """ggml_gelu_f32 as llama.cpp's FMA builds compile it (ir.ops.gelu_tanh_f32): 1 + (a h) h fused,
    tanh rounded to float32 from float64. Where 1 + tanh cancels (h < -1.8) the F16 entry keeps
    tanh's last float32 bits, which a float32 tanh approximation misses."""
    ah = tirx.Cast("float64", f32(0.044715) * h)
    poly = tirx.Cast("float32", ah * tirx.Cast("float64", h) + tirx.const(1.0, "float64"))  # exact product
    inner = f32(0.79788456) * h * poly
    tanh = tirx.Cast("float32", te.tanh(tirx.Cast("float64", inner)))
    return f32(0.5) * h * (f32(1.0) + tanh)


UNARY: dict[str, Callable[[PrimExpr], PrimExpr]] = {
    "silu": lambda x: x * sigmoid(x),
    "sigmoid": sigmoid,
    "exp": te.exp,
    "neg": lambda x: -x,
    "sqrt": te.sqrt,
    "rsqrt": lambda x: f32(1.0) / te.sqrt(x),
    "relu": lambda x: te.max(x, f32(0.0)),
    "softplus": lambda x: tirx.Select(x > f32(20.0), x, te.log(f32(1.0) + te.exp(te.min(x, f32(20.0))))),
    "square": lambda x: x * x,
    "tanh": te.tanh,
    "recip": lambda x: f32(1.0) / x,
    "sign": lambda x: tirx.Select(x > f32(0.0), f32(1.0), tirx.Select(x < f32(0.0), f32(-1.0), f32(0.0))),
    "abs": te.abs,
    "round_f16": lambda x: round_to_f16(x),
    "gelu_tanh_f16": lambda x: gelu_tanh_f16(x),
}


# the F16 roundings by the target's own conversion, for targets where it rounds as ggml does
# (codegen.target.native_f16_rounding); WGSL and CPUs without F16C keep the integer form
NATIVE_F16_UNARY: dict[str, Callable[[PrimExpr], PrimExpr]] = {
    "round_f16": cast_to_f16,
    "gelu_tanh_f16": lambda x: gelu_tanh_f16(x, cast_to_f16),
}


def rounds_to_f16(program: O.FusedElementwise) -> bool:
    """Whether an elementwise program has a step that NATIVE_F16_UNARY replaces."""
    return any(op == "unary" and attrs.fn in NATIVE_F16_UNARY for op, attrs, _ in program.program)


BINARY: dict[str, Callable[[PrimExpr, PrimExpr], PrimExpr]] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": te.max,
    "min": te.min,
}


# scalar steps ("x fn c") take the binary functions plus a power by a constant (as ir.ops.SCALAR_FNS)
SCALAR: dict[str, Callable[[PrimExpr, PrimExpr], PrimExpr]] = {**BINARY, "pow": te.power}


def elementwise_step(op: str, attrs: Any, args: list[PrimExpr], native_f16: bool = False,
                     cpu: bool = False, vector_rows: bool = False) -> PrimExpr:
    """One step of a program; `vector_rows` (a CPU kernel whose rows are whole 8-lane vectors):
    SiLU as ggml_vec_silu_f32's vector loop computes it (silu_ggml), its scalar tail not needed."""
    if op == "unary" and attrs.fn == "gelu_tanh_f16":
        return gelu_tanh_f16(args[0], cast_to_f16 if native_f16 else round_to_f16, exact_tanh=cpu)
    if op == "unary" and attrs.fn == "silu" and cpu and vector_rows:
        return silu_ggml(args[0])
    if op == "unary":
        table = NATIVE_F16_UNARY if native_f16 and attrs.fn in NATIVE_F16_UNARY else UNARY
        return table[attrs.fn](args[0])
    if op == "binary":
        return BINARY[attrs.fn](args[0], args[1])
    if op == "scalar":
        return SCALAR[attrs.fn](args[0], f32(attrs.c))
    raise NotImplementedError(f"elementwise step {op}")


def elementwise(in_shapes: Sequence[PShape], program: O.FusedElementwise, dtype: str = "float32",
                native_f16: bool = False, cpu: bool = False) -> tirx.PrimFunc:
    """One kernel for a chain of elementwise ops with numpy broadcasting; `native_f16`: F16 roundings
    by the target's conversion (NATIVE_F16_UNARY); `cpu`: for a CPU target (float64 inside the GELU,
    which GPU shading languages may lack; ggml's vector SiLU where rows are a multiple of 8 wide)."""
    ins = [te.placeholder(s, dtype, name=f"in{i}") for i, s in enumerate(in_shapes)]
    out_shape = broadcast_shape(in_shapes)
    nd = len(out_shape)
    last = out_shape[-1] if nd else 1
    vector_rows = isinstance(last, (int, tirx.IntImm)) and int(last) % 8 == 0

    def body(*idx: PrimExpr) -> PrimExpr:
        vals = [t(*bcast_index(s, idx, nd)) for t, s in zip(ins, in_shapes, strict=True)]
        for op, attrs, operands in program.program:
            vals.append(elementwise_step(op, attrs, [vals[i] for i in operands], native_f16, cpu, vector_rows))
        return vals[-1]

    out = te.compute(out_shape, body, name="out")
    return func([*ins, out])
