"""TE definitions of the non-matmul kernels (elementwise, reductions, norms, rope, attention, ...).

Each builder takes concrete or symbolic shapes (symbolic dims are TIR vars made per kernel, so a
kernel serves every layer and every token count) and returns an unscheduled PrimFunc whose
arguments are: tensor inputs and scalars in IR order, then outputs (Relax's call_tir convention).
Quantized matmuls and embeddings live in `quant.py`; schedules in `schedule.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tvm
from tvm import te, tirx
from tvm.tirx import Expr as PrimExpr

from ggufc.ir import ops as O

PShape = tuple[PrimExpr, ...]


def i64(v: int) -> tirx.IntImm:
    return tirx.IntImm("int64", int(v))


def f32(v: float) -> PrimExpr:
    return tirx.const(v, "float32")


class Symbols:
    """Fresh TIR vars for the symbolic dims of one kernel ("T", "P")."""

    def __init__(self, fixed: dict[str, int] | None = None) -> None:
        self.vars: dict[str, Any] = {}
        self.fixed = fixed or {}

    def var(self, name: str) -> PrimExpr:
        if name in self.fixed:
            return i64(self.fixed[name])
        if name not in self.vars:
            self.vars[name] = te.var(name.lower(), "int64")
        return self.vars[name]

    def dim(self, d: int | str) -> PrimExpr:
        if isinstance(d, int):
            return i64(d)
        return _eval_symbolic(d, self)

    def shape(self, shape: Sequence[int | str]) -> PShape:
        return tuple(self.dim(d) for d in shape)


def _eval_symbolic(expr: str, syms: Symbols) -> PrimExpr:
    # tiny evaluator for "P+T", "T*4", "(P)+(T)": the IR allows only + and * over T, P, ints
    env = {"T": syms.var("T"), "P": syms.var("P")}
    return eval(expr, {"__builtins__": {}}, env)  # noqa: S307 - IR dims are checked by ir.graph


def func(args: Sequence[Any]) -> tirx.PrimFunc:
    f = te.create_prim_func(list(args))
    return f.with_attr("tirx.noalias", True)


def _bcast_index(src: PShape, out_idx: Sequence[PrimExpr], out_nd: int) -> list[PrimExpr]:
    off = out_nd - len(src)
    return [i64(0) if _is_one(d) else out_idx[off + k] for k, d in enumerate(src)]


def _is_one(d: PrimExpr) -> bool:
    return isinstance(d, tirx.IntImm) and int(d) == 1


def _broadcast_shape(shapes: Sequence[PShape]) -> PShape:
    nd = max(len(s) for s in shapes)
    out: list[PrimExpr] = []
    for i in range(nd):
        dims = [s[i - nd + len(s)] for s in shapes if i - nd + len(s) >= 0]
        non_one = [d for d in dims if not _is_one(d)]
        out.append(non_one[0] if non_one else i64(1))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# elementwise


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


def _step(op: str, attrs: Any, args: list[PrimExpr], native_f16: bool = False, cpu: bool = False) -> PrimExpr:
    if op == "unary" and attrs.fn == "gelu_tanh_f16":
        return gelu_tanh_f16(args[0], cast_to_f16 if native_f16 else round_to_f16, exact_tanh=cpu)
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
    which GPU shading languages may lack)."""
    ins = [te.placeholder(s, dtype, name=f"in{i}") for i, s in enumerate(in_shapes)]
    out_shape = _broadcast_shape(in_shapes)
    nd = len(out_shape)

    def body(*idx: PrimExpr) -> PrimExpr:
        vals = [t(*_bcast_index(s, idx, nd)) for t, s in zip(ins, in_shapes, strict=True)]
        for op, attrs, operands in program.program:
            vals.append(_step(op, attrs, [vals[i] for i in operands], native_f16, cpu))
        return vals[-1]

    out = te.compute(out_shape, body, name="out")
    return func([*ins, out])




# ---------------------------------------------------------------------------------------------
# reductions and normalisation


def reduce(shape: PShape, attrs: O.Reduce) -> tirx.PrimFunc:
    x = te.placeholder(shape, "float32", name="x")
    nd = len(shape)
    ax = attrs.axis % nd
    r = te.reduce_axis((i64(0), shape[ax]), name="r")

    def at(idx: Sequence[PrimExpr]) -> PrimExpr:
        full = list(idx)
        if attrs.keepdims:
            full[ax] = r
        else:
            full.insert(ax, r)
        return x(*full)

    out_shape = [d for i, d in enumerate(shape) if i != ax] if not attrs.keepdims else [
        i64(1) if i == ax else d for i, d in enumerate(shape)
    ]
    if attrs.fn == "max":
        out = te.compute(out_shape, lambda *idx: te.max(at(idx), axis=r), name="out")
    else:
        acc = te.compute(out_shape, lambda *idx: te.sum(at(idx), axis=r), name="acc")
        if attrs.fn == "mean":
            out = te.compute(out_shape, lambda *idx: acc(*idx) / shape[ax].astype("float32"), name="out")
        else:
            out = acc
    return func([x, out])


def rms_norm(shape: PShape, has_weight: bool, eps: float, f64_sum: bool = False) -> tirx.PrimFunc:
    """x * (1 / sqrt(mean(x^2) + eps)) [* w]. f64_sum: the squares summed in float64 and the mean
    rounded to float32, as llama.cpp's CPU rms_norm does (targets without float64 sum in float32)."""
    x = te.placeholder(shape, "float32", name="x")
    n = shape[-1]
    w = te.placeholder((n,), "float32", name="w") if has_weight else None
    r = te.reduce_axis((i64(0), n), name="r")
    lead = shape[:-1]
    acc = "float64" if f64_sum else "float32"
    ss = te.compute(lead, lambda *i: te.sum((x(*i, r) * x(*i, r)).astype(acc), axis=r), name="ss")
    mean = te.compute(lead, lambda *i: (ss(*i) / n.astype(acc)).astype("float32"), name="mean")
    scale = te.compute(lead, lambda *i: f32(1.0) / te.sqrt(mean(*i) + f32(eps)), name="rstd")

    def body(*idx: PrimExpr) -> PrimExpr:
        y = x(*idx) * scale(*idx[:-1])
        return y * w[idx[-1]] if w is not None else y

    out = te.compute(shape, body, name="out")
    return func([x, w, out] if w is not None else [x, out])


def softmax(shape: PShape, axis: int = -1) -> tirx.PrimFunc:
    x = te.placeholder(shape, "float32", name="x")
    ax = axis % len(shape)
    n = shape[ax]
    lead = tuple(d for i, d in enumerate(shape) if i != ax)
    r1 = te.reduce_axis((i64(0), n), name="r1")
    r2 = te.reduce_axis((i64(0), n), name="r2")

    def at(t: te.Tensor, rest: Sequence[PrimExpr], j: PrimExpr) -> PrimExpr:
        return t(*rest[:ax], j, *rest[ax:])  # `rest` indexes every axis but `ax`

    def drop(idx: Sequence[PrimExpr]) -> list[PrimExpr]:
        return [*idx[:ax], *idx[ax + 1 :]]

    mx = te.compute(lead, lambda *i: te.max(at(x, i, r1), axis=r1), name="mx")
    ex = te.compute(shape, lambda *i: te.exp(x(*i) - mx(*drop(i))), name="ex")
    sm = te.compute(lead, lambda *i: te.sum(at(ex, i, r2), axis=r2), name="sm")
    out = te.compute(shape, lambda *i: ex(*i) / sm(*drop(i)), name="out")
    return func([x, out])


# ---------------------------------------------------------------------------------------------
# movement


def transpose(shape: PShape, perm: Sequence[int]) -> tirx.PrimFunc:
    x = te.placeholder(shape, "float32", name="x")
    out_shape = tuple(shape[p] for p in perm)

    def body(*idx: PrimExpr) -> PrimExpr:
        src = [i64(0)] * len(shape)
        for o, p in enumerate(perm):
            src[p] = idx[o]
        return x(*src)

    out = te.compute(out_shape, body, name="out")
    return func([x, out])


def slice_(shape: PShape, attrs: O.Slice, dtype: str) -> tirx.PrimFunc:
    x = te.placeholder(shape, dtype, name="x")
    ax = attrs.axis % len(shape)
    out_shape = tuple(i64(attrs.stop - attrs.start) if i == ax else d for i, d in enumerate(shape))
    out = te.compute(
        out_shape, lambda *idx: x(*[i + i64(attrs.start) if k == ax else i for k, i in enumerate(idx)]), name="out"
    )
    return func([x, out])


def concat(shapes: Sequence[PShape], axis: int, dtype: str) -> tirx.PrimFunc:
    ins = [te.placeholder(s, dtype, name=f"in{i}") for i, s in enumerate(shapes)]
    ax = axis % len(shapes[0])
    offsets = [i64(0)]
    for s in shapes:
        offsets.append(offsets[-1] + s[ax])
    out_shape = tuple(offsets[-1] if i == ax else d for i, d in enumerate(shapes[0]))

    def body(*idx: PrimExpr) -> PrimExpr:
        expr = None
        for k in reversed(range(len(ins))):
            src = [i - offsets[k] if d == ax else i for d, i in enumerate(idx)]
            val = ins[k](*src)
            expr = val if expr is None else tirx.if_then_else(idx[ax] < offsets[k + 1], val, expr)
        return expr

    out = te.compute(out_shape, body, name="out")
    return func([*ins, out])




def gather_f32(table_shape: PShape, ids_shape: PShape, dtype: str = "float32") -> tirx.PrimFunc:
    table = te.placeholder(table_shape, dtype, name="table")
    ids = te.placeholder(ids_shape, "int32", name="ids")
    nid = len(ids_shape)
    out = te.compute(
        (*ids_shape, *table_shape[1:]),
        lambda *idx: table(ids(*idx[:nid]).astype("int64"), *idx[nid:]),
        name="out",
    )
    return func([table, ids, out])


def last_token(shape: PShape) -> tirx.PrimFunc:
    x = te.placeholder(shape, "float32", name="x")
    out = te.compute((i64(1), *shape[1:]), lambda _t, *rest: x(shape[0] - i64(1), *rest), name="out")
    return func([x, out])


# ---------------------------------------------------------------------------------------------
# positions, rope, attention


def rope(x_shape: PShape, table_shape: PShape, attrs: O.Rope, llvm_fma: bool = False) -> tirx.PrimFunc:
    """x [T, H, D]; table [n_ctx, n_rot/2, 2] of (cos, sin); scalar pos (start position).
    `llvm_fma`: the rotation as ggml's CPU code compiles, fma(a, c, -(b s)) and fma(a, s, b c)."""
    x = te.placeholder(x_shape, "float32", name="x")
    table = te.placeholder(table_shape, "float32", name="table")
    pos = te.var("pos", "int64")
    out = _rope_compute(x_shape, x, table, lambda t: pos + t, attrs, llvm_fma)
    return func_with_scalar([x, pos, table, out])


def rope_rows(x_shape: PShape, table_shape: PShape, attrs: O.Rope, llvm_fma: bool = False) -> tirx.PrimFunc:
    """rope with each row at its own position: (x [B, H, D], positions [B] int32, table, out); the
    rows of a batched decode step, each a different sequence."""
    x = te.placeholder(x_shape, "float32", name="x")
    positions = te.placeholder((x_shape[0],), "int32", name="positions")
    table = te.placeholder(table_shape, "float32", name="table")
    out = _rope_compute(x_shape, x, table, lambda t: positions[t].astype("int64"), attrs, llvm_fma)
    return func([x, positions, table, out])


def _rope_compute(x_shape: PShape, x: te.Tensor, table: te.Tensor, position: Callable[[PrimExpr], PrimExpr],
                  attrs: O.Rope, llvm_fma: bool) -> te.Tensor:
    half = attrs.n_rot // 2
    n_rot = i64(attrs.n_rot)

    def body(t: PrimExpr, h: PrimExpr, d: PrimExpr) -> PrimExpr:
        p = position(t)
        if attrs.mode == "norm":
            pair, second = d // i64(2), d % i64(2) == i64(1)
            a, b = x[t, h, d - d % i64(2)], x[t, h, d - d % i64(2) + i64(1)]
        else:
            second = d >= i64(half)
            pair = tirx.if_then_else(second, d - i64(half), d)
            a = x[t, h, tirx.if_then_else(second, d - i64(half), d)]
            b = x[t, h, tirx.if_then_else(second, d, d + i64(half))]
        pair = tirx.min(pair, i64(half - 1))  # dims past n_rot pass through; keep the table read in bounds
        c, s = table[p, pair, i64(0)], table[p, pair, i64(1)]
        if llvm_fma:
            fma = lambda u, v, w: tirx.call_llvm_pure_intrin("float32", "llvm.fma.f32", u, v, w)  # noqa: E731
            rotated = tirx.if_then_else(second, fma(a, s, b * c), fma(a, c, -(b * s)))
        else:
            rotated = tirx.if_then_else(second, a * s + b * c, a * c - b * s)
        return tirx.if_then_else(d < n_rot, rotated, x[t, h, d])

    return te.compute(x_shape, body, name="out")


def func_with_scalar(args: Sequence[Any]) -> tirx.PrimFunc:
    return func(args)


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


def topk(shape: PShape, k: int, payload: bool = False) -> tirx.PrimFunc:
    """Top-k of each row by k rounds of arg-max over the unchosen entries (k is small: MoE).
    Args (x[, payload], vals, ids); with a payload the values are the payload's at the ids."""
    x = te.placeholder(shape, "float32", name="x")
    src = te.placeholder(shape, "float32", name="payload") if payload else x
    lead, n = shape[:-1], shape[-1]

    def pick(prev: list[te.Tensor]) -> te.Tensor:
        r = te.reduce_axis((i64(0), n), name=f"r{len(prev)}")

        def taken(idx: Sequence[PrimExpr], j: PrimExpr) -> PrimExpr:
            conds = [p(*idx) == j.astype("int32") for p in prev]
            return functools.reduce(tirx.Or, conds) if conds else tirx.const(False, "bool")

        argmax = te.comm_reducer(
            lambda a, b: (tirx.Select(b[1] > a[1], b[0], a[0]), tirx.Select(b[1] > a[1], b[1], a[1])),
            lambda t0, t1: (tirx.const(-1, t0), tirx.min_value(t1)),
            name="argmax",
        )
        best = te.compute(
            lead,
            lambda *i: argmax(
                (r.var.astype("int32"), tirx.Select(taken(i, r.var), tirx.min_value("float32"), x(*i, r.var))),
                axis=r,
            ),
            name=f"best{len(prev)}",
        )
        return best[0]

    chosen: list[te.Tensor] = []
    for _ in range(k):
        chosen.append(pick(chosen))
    ids = te.compute(
        (*lead, i64(k)),
        lambda *i: _select_among(chosen, i[:-1], i[-1]),
        name="ids",
    )
    vals = te.compute((*lead, i64(k)), lambda *i: src(*i[:-1], ids(*i).astype("int64")), name="vals")
    return func([x, *([src] if payload else []), vals, ids])


def _select_among(chosen: Sequence[te.Tensor], lead: Sequence[PrimExpr], j: PrimExpr) -> PrimExpr:
    expr = chosen[-1](*lead)
    for idx in reversed(range(len(chosen) - 1)):
        expr = tirx.Select(j == i64(idx), chosen[idx](*lead), expr)
    return expr


def moe_normalize(shape: PShape, clamp: float) -> tirx.PrimFunc:
    w = te.placeholder(shape, "float32", name="w")
    r = te.reduce_axis((i64(0), shape[-1]), name="r")
    # TE allows a reduction only at the top of a compute: sum first, clamp in the division
    s = te.compute(shape[:-1], lambda *i: te.sum(w(*i, r), axis=r), name="s")
    out = te.compute(shape, lambda *i: w(*i) / te.max(s(*i[:-1]), f32(clamp)), name="out")
    return func([w, out])


def weighted_sum(y_shape: PShape, scale_by: bool) -> tirx.PrimFunc:
    """y [T, k, N] * w [T, k] summed over k -> [T, N]."""
    y = te.placeholder(y_shape, "float32", name="y")
    w = te.placeholder(y_shape[:2], "float32", name="w")
    r = te.reduce_axis((i64(0), y_shape[1]), name="r")
    out = te.compute((y_shape[0], y_shape[2]), lambda t, n: te.sum(y[t, r, n] * w[t, r], axis=r), name="out")
    return func([y, w, out])


def cache_write(cache_shape: PShape, x_shape: PShape, dtype: str = "float32") -> tirx.PrimFunc:
    """In place: cache[pos + t] = x[t]. Built with the TIR IR builder since TE cannot write in place."""
    from tvm.script import ir_builder as IB
    from tvm.script.ir_builder import tirx as Tb

    with IB.IRBuilder() as ib:
        with Tb.prim_func():
            Tb.func_name("cache_write")
            Tb.func_attr({"tirx.noalias": True})
            cache = Tb.arg("cache", Tb.buffer(cache_shape, dtype))
            x_h = Tb.arg("x", Tb.handle())
            pos = Tb.arg("pos", tirx.Var("pos", "int64"))
            n = tirx.Var("n", "int64")
            x = Tb.match_buffer(x_h, (n, *x_shape[1:]), dtype)
            with Tb.grid(n, *x_shape[1:]) as idx:
                idx = idx if len(x_shape) > 1 else [idx]  # one extent: grid yields a bare var
                t, rest = idx[0], idx[1:]
                Tb.buffer_store(cache, x[(t, *rest)], [pos + t, *rest])
    return ib.get()


def cache_write_rows(cache_shape: PShape, x_shape: PShape, dtype: str = "float32") -> tirx.PrimFunc:
    """In place, for the rows of a batched decode step: cache[slots[t], positions[t]] = x[t], the
    caches of every slot stacked on a leading axis (cache [S, C, ...])."""
    from tvm.script import ir_builder as IB
    from tvm.script.ir_builder import tirx as Tb

    with IB.IRBuilder() as ib:
        with Tb.prim_func():
            Tb.func_name("cache_write_rows")
            Tb.func_attr({"tirx.noalias": True})
            n_slots, n = tirx.Var("s", "int64"), tirx.Var("n", "int64")
            cache_h = Tb.arg("cache", Tb.handle())
            x_h = Tb.arg("x", Tb.handle())
            slots_h = Tb.arg("slots", Tb.handle())
            positions_h = Tb.arg("positions", Tb.handle())
            cache = Tb.match_buffer(cache_h, (n_slots, *cache_shape), dtype)
            x = Tb.match_buffer(x_h, (n, *x_shape[1:]), dtype)
            slots = Tb.match_buffer(slots_h, (n,), "int32")
            positions = Tb.match_buffer(positions_h, (n,), "int32")
            with Tb.grid(n, *x_shape[1:]) as idx:
                idx = idx if len(x_shape) > 1 else [idx]
                t, rest = idx[0], idx[1:]
                where = [slots[t].astype("int64"), positions[t].astype("int64"), *rest]
                Tb.buffer_store(cache, x[(t, *rest)], where)
    return ib.get()


def tvm_dtype(d: str) -> str:
    return d


__all__ = ["tvm"]


def with_root_block(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Hand-written kernels (plain loops) under a root block, as TE-made ones are: Relax's dataflow
    rewrites (reshape detection) analyse every callee and require one."""
    if isinstance(func.body, tvm.s_tir.SBlockRealize):
        return func
    root = tvm.s_tir.SBlock([], [], [], "root", func.body)
    return func.with_body(tvm.s_tir.SBlockRealize([], True, root))
