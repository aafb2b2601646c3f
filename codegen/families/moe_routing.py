"""The MoE routing family's kernels and lowering (references: `ir/moe_routing.py`); lower.py
merges `MOE_LOWERING` into its table.

* `moe_route` / the router of `moe_ffn`: gating (the softmax kernel, or one elementwise kernel for
  sigmoid / sqrt(softplus)), [probs + selection bias], top-k (reading the unbiased probs at the
  selected ids when biased) or, hash-routed, the table rows of the tokens and `take_along` of the
  probs at them, [renormalise], [scale].
* `moe_topk_softmax`: one kernel: [logits + router bias], k rounds of arg-max (descending, ties to
  the lower id), the softmax over the k chosen with ggml's float64 sum on the CPU.
* `moe_ffn`: router matmul, routing, the selected experts' matmuls (quantized kernels), their
  activation (one elementwise kernel; `act_halves` / `swiglu_halves` on a merged gate_up
  output), the weighted sum, and the shared expert: three projections, one activation kernel,
  one kernel for the gate and the combine (`shared_combine`) or the plain add (`shared_add`).

Symbolic extents: `n` (tokens of the call) and `pos` (tokens already cached), as in `kernels.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tvm import relax, te, tirx
from tvm.script import tirx as T

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.cpu_int8 import experts as E8
from ggufc.codegen.formats.cpu_schedules import qmatmul_experts
from ggufc.codegen.kernels import cpu_vector_math as CV
from ggufc.codegen.kernels.elementwise import elementwise, elementwise_step, sigmoid
from ggufc.codegen.kernels.movement import gather_f32
from ggufc.codegen.kernels.prim_helpers import PShape, Symbols, f32, func, i64
from ggufc.codegen.kernels.reductions import rms_norm, softmax
from ggufc.codegen.kernels.selection import select_among, topk
from ggufc.codegen.lower_context import GPU_KINDS, FunctionContext, weight_args
from ggufc.ir import moe_routing as MRef
from ggufc.ir import ops as O
from ggufc.ir.graph import Dim, Node, Value
from ggufc.ir.moe_routing import MoeFFN, MoeRoute, moe_inputs

Step = tuple[str, Any, tuple[int, ...]]
MUL = O.Binary("mul")


# ---------------------------------------------------------------------------------------------
# activations as elementwise programs


def act_steps(act: str, limit: float, g: int, u: int, n_before: int, linear_beta: float = 0.0) -> list[Step]:
    """Elementwise steps computing act(vals[g], vals[u]) (ir/moe_routing.py), appended after
    `n_before` values; the last step is the result."""
    steps: list[Step] = []

    def emit(op: str, attrs: Any, *operands: int) -> int:
        steps.append((op, attrs, operands))
        return n_before + len(steps) - 1

    def clip(v: int, lim: float) -> int:
        return emit("scalar", O.Scalar("max", -lim), emit("scalar", O.Scalar("min", lim), v))

    if act == "swiglu":
        emit("binary", MUL, emit("unary", O.Unary("silu"), g), u)
    elif act == "swiglu_clamp":
        gc = emit("scalar", O.Scalar("min", limit), g)
        emit("binary", MUL, emit("unary", O.Unary("silu"), gc), clip(u, limit))
    elif act == "swiglu_clamp_after":
        sc = emit("scalar", O.Scalar("min", limit), emit("unary", O.Unary("silu"), g))
        emit("binary", MUL, sc, clip(u, limit))
    elif act == "situ":  # beta * tanh(g / beta) * sigmoid(g) * (lb * tanh(u / lb) or u)
        def soft_cap(v: int, c: float) -> int:
            return emit("scalar", O.Scalar("mul", c), emit("unary", O.Unary("tanh"), emit("scalar", O.Scalar("div", c),
                                                                                          v)))

        gated = emit("binary", MUL, soft_cap(g, limit), emit("unary", O.Unary("sigmoid"), g))
        emit("binary", MUL, gated, soft_cap(u, linear_beta) if linear_beta > 0 else u)
    elif act == "swiglu_oai":  # x / (1 + exp(-alpha x)): ggml's one division
        xc = emit("scalar", O.Scalar("min", MRef.OAI_LIMIT), g)
        e = emit("unary", O.Unary("exp"), emit("scalar", O.Scalar("mul", -MRef.OAI_ALPHA), xc))
        glu = emit("binary", O.Binary("div"), xc, emit("scalar", O.Scalar("add", 1.0), e))
        emit("binary", MUL, glu, emit("scalar", O.Scalar("add", 1.0), clip(u, MRef.OAI_LIMIT)))
    else:
        raise NotImplementedError(f"expert activation {act!r} has no kernel (known: {', '.join(MRef.ACTS)})")
    return steps


def act_program(act: str, limit: float, linear_beta: float = 0.0) -> O.FusedElementwise:
    """act(g, u) of two inputs as one elementwise program."""
    return O.FusedElementwise(tuple(act_steps(act, limit, 0, 1, 2, linear_beta)), 2)


def swiglu_halves(act_shape: PShape) -> tirx.PrimFunc:
    """Args (y [T, k, 2F], act [T, k, F]): silu(y[..., :F]) * y[..., F:]."""
    n, k, f = act_shape
    y = te.placeholder((n, k, f * i64(2)), "float32", name="y")
    act = te.compute(act_shape, lambda t, s, j: y[t, s, j] * sigmoid(y[t, s, j]) * y[t, s, j + f], name="act")
    return func([y, act])


def act_halves(act_shape: PShape, program: O.FusedElementwise) -> tirx.PrimFunc:
    """Args (y [T, k, 2F], act [T, k, F]): program(y[..., :F], y[..., F:]) (act_program)."""
    n, k, f = act_shape
    y = te.placeholder((n, k, f * i64(2)), "float32", name="y")

    def body(t: tirx.PrimExpr, s: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        vals = [y[t, s, j], y[t, s, j + f]]
        for op, attrs, operands in program.program:
            vals.append(elementwise_step(op, attrs, [vals[i] for i in operands]))
        return vals[-1]

    return func([y, te.compute(act_shape, body, name="act")])


def _elementwise_temp(fc: FunctionContext, prog: O.FusedElementwise, args: list[Any], dims: list[tuple[Any, ...]],
                      out_shape: list[Any], name: str) -> Any:
    key = KK.OpKernel("elementwise", prog, tuple(dims))
    return fc.call_temp(key, lambda: elementwise([Symbols().shape(d) for d in dims], prog), args,
                        [(out_shape, "float32")], name)[0]


# ---------------------------------------------------------------------------------------------
# routing


def _gate_probs(fc: FunctionContext, logits: Any, dims: tuple[Dim, ...], gating: str, tag: str) -> Any:
    shape = [fc.dim(d) for d in dims]
    if gating == "softmax" and fc.mb.target.kind.name == "llvm":  # ggml_soft_max's steps
        n_exp = int(dims[-1])
        return fc.call_temp(KK.OpKernel("soft_max", n_exp, ()), lambda: CV.soft_max(n_exp), [logits],
                            [(shape, "float32")], f"{tag}_probs")[0]
    if gating == "softmax":
        return fc.call_temp(KK.OpKernel("softmax", None, (dims,)), lambda: softmax(Symbols().shape(dims)),
                            [logits], [(shape, "float32")], f"{tag}_probs")[0]
    steps: dict[str, tuple[Step, ...]] = {
        "sigmoid": (("unary", O.Unary("sigmoid"), (0,)),),
        "sqrt_softplus": (("unary", O.Unary("softplus"), (0,)), ("unary", O.Unary("sqrt"), (1,))),
    }
    if gating not in steps:
        raise NotImplementedError(f"MoE gating {gating!r} has no kernel (known: {', '.join(MRef.GATINGS)})")
    return _elementwise_temp(fc, O.FusedElementwise(steps[gating], 1), [logits], [dims], shape, f"{tag}_probs")


def take_along(x_shape: PShape, k: int) -> tirx.PrimFunc:
    """Args (x [..., X], ids [..., k] int32, out [..., k]): out[..., j] = x[..., ids[..., j]]."""
    x = te.placeholder(x_shape, "float32", name="x")
    ids = te.placeholder((*x_shape[:-1], i64(k)), "int32", name="ids")
    out = te.compute((*x_shape[:-1], i64(k)), lambda *i: x(*i[:-1], ids(*i).astype("int64")), name="out")
    return func([x, ids, out])


def _take_along(fc: FunctionContext, node: Node) -> list[Any]:
    x, ids = node.inputs
    k = int(ids.shape[-1])
    key = KK.OpKernel("take_along", k, (fc.kernel_key_dims(x),))
    return fc.call(key, lambda: take_along(fc.kernel_shape(x, Symbols()), k), [fc.value(x), fc.value(ids)],
                   node.outputs, node.outputs[0].name)


def _hashed_ids(fc: FunctionContext, table: Value, tokens: Value, tag: str) -> Any:
    """table[tokens] -> [T, k] int32 (llama.cpp's ffn_gate_tid2eid rows of the call's tokens)."""
    tdims, idims = tuple(int(d) for d in table.shape), fc.kernel_key_dims(tokens)
    return fc.call_temp(KK.OpKernel("gather", "int32", (tdims, idims)),
                        lambda: gather_f32(Symbols().shape(tdims), Symbols().shape(idims), "int32"),
                        [fc.value(table), fc.value(tokens)], [([fc.dim(idims[0]), i64(tdims[1])], "int32")],
                        f"{tag}_ids")[0]


def route(fc: FunctionContext, logits: Any, dims: tuple[Dim, ...], a: MoeRoute | MoeFFN, extra: list[Value],
          tag: str) -> tuple[Any, Any]:
    """(weights, ids) of a [T, X] logits expression: gating, top-k (of probs + bias when biased,
    the weights then the unbiased probs at the chosen ids) or, hash-routed, the table rows of the
    tokens with the probs at them; renormalise, scale. `extra`: [bias] or [table, tokens] or []."""
    shape = [fc.dim(d) for d in dims]
    probs = _gate_probs(fc, logits, dims, a.gating, tag)
    sel_shape = [shape[0], i64(a.k)]
    outs = [(sel_shape, "float32"), (sel_shape, "int32")]
    bias = extra[0] if a.selection_bias else None
    if a.hash_routed:
        ids = _hashed_ids(fc, extra[0], extra[1], tag)
        w = fc.call_temp(KK.OpKernel("take_along", a.k, (dims,)), lambda: take_along(Symbols().shape(dims), a.k),
                         [probs, ids], [outs[0]], f"{tag}_topk")[0]
    elif bias is None:
        w, ids = fc.call_temp(KK.OpKernel("topk", a.k, (dims,)), lambda: topk(Symbols().shape(dims), a.k),
                              [probs], outs, f"{tag}_topk")
    else:
        add = O.FusedElementwise((("binary", O.Binary("add"), (0, 1)),), 2)
        sel = _elementwise_temp(fc, add, [probs, fc.value(bias)], [dims, (dims[-1],)], shape, f"{tag}_sel")
        w, ids = fc.call_temp(KK.OpKernel("topk", (a.k, "payload"), (dims,)),
                              lambda: topk(Symbols().shape(dims), a.k, True), [sel, probs], outs, f"{tag}_topk")
    wdims = (dims[0], a.k)
    if a.normalize:
        f64_sum = fc.mb.target.kind.name == "llvm"
        w = fc.call_temp(KK.OpKernel("moe_normalize", (a.norm_clamp, f64_sum) if f64_sum else a.norm_clamp, (wdims,)),
                         lambda: moe_normalize(Symbols().shape(wdims), a.norm_clamp, f64_sum),
                         [w], [(sel_shape, "float32")], f"{tag}_weights")[0]
    if a.weights_scale != 1.0:
        scale = O.FusedElementwise((("scalar", O.Scalar("mul", a.weights_scale), (0,)),), 1)
        w = _elementwise_temp(fc, scale, [w], [wdims], sel_shape, f"{tag}_weights_scaled")
    return w, ids


def topk_softmax(shape: PShape, k: int, biased: bool, f64_sum: bool) -> tirx.PrimFunc:
    """Args (logits [T, X][, bias [X]], weights [T, k], ids [T, k] int32): the k largest of logits
    [+ bias] by k rounds of arg-max over the unchosen (a strict > keeps the lower id on a tie), then
    exp(z - z_first) times the reciprocal of their sum, the sum in float64 where `f64_sum` (ggml_soft_max;
    targets without float64 sum in float32)."""
    n, x_dim = shape
    logits = te.placeholder(shape, "float32", name="logits")
    bias = te.placeholder((x_dim,), "float32", name="bias") if biased else None
    z = te.compute(shape, lambda t, j: logits[t, j] + bias[j] if bias is not None else logits[t, j], name="z")
    argmax = te.comm_reducer(
        lambda a, b: (tirx.Select(b[1] > a[1], b[0], a[0]), tirx.Select(b[1] > a[1], b[1], a[1])),
        lambda t0, t1: (tirx.const(-1, t0), tirx.min_value(t1)), name="argmax")
    chosen: list[te.Tensor] = []

    def pick(prev: tuple[te.Tensor, ...]) -> te.Tensor:
        r = te.reduce_axis((i64(0), x_dim), name=f"r{len(prev)}")

        def best(t: tirx.PrimExpr) -> Any:
            taken = [p[t] == r.var.astype("int32") for p in prev]
            z_r = z[t, r.var]
            masked = tirx.Select(functools.reduce(tirx.Or, taken), tirx.min_value("float32"), z_r) if taken else z_r
            return argmax((r.var.astype("int32"), masked), axis=r)

        return te.compute((n,), best, name=f"best{len(prev)}")[0]

    for _ in range(k):
        chosen.append(pick(tuple(chosen)))
    ids = te.compute((n, i64(k)), lambda t, s: select_among(chosen, [t], s), name="ids")
    top = te.compute((n, i64(k)), lambda t, s: z[t, ids[t, s].astype("int64")], name="top")
    ex = te.compute((n, i64(k)), lambda t, s: te.exp(top[t, s] - top[t, i64(0)]), name="ex")
    acc = "float64" if f64_sum else "float32"
    rs = te.reduce_axis((i64(0), i64(k)), name="rs")
    total = te.compute((n,), lambda t: te.sum(ex[t, rs].astype(acc), axis=rs), name="total")
    inv = te.compute((n,), lambda t: (tirx.const(1.0, acc) / total[t]).astype("float32"), name="inv")
    weights = te.compute((n, i64(k)), lambda t, s: ex[t, s] * inv[t], name="weights")
    return func([logits, *([bias] if bias is not None else []), weights, ids])


def _moe_topk_softmax(fc: FunctionContext, node: Node) -> list[Any]:
    a: MRef.MoeTopkSoftmax = node.attrs
    logits = node.inputs[0]
    dims = fc.kernel_key_dims(logits)
    f64_sum = fc.mb.target.kind.name == "llvm"
    key = KK.OpKernel("moe_topk_softmax", (a, f64_sum), (dims,))
    return fc.call(key, lambda: topk_softmax(Symbols().shape(dims), a.k, a.biased, f64_sum),
                   [fc.value(v) for v in node.inputs], node.outputs, node.outputs[0].name)


def _moe_route(fc: FunctionContext, node: Node) -> list[Any]:
    a: MoeRoute = node.attrs
    logits = node.inputs[0]
    return list(route(fc, fc.value(logits), fc.kernel_key_dims(logits), a, list(node.inputs[1:]),
                      node.outputs[0].name))


# ---------------------------------------------------------------------------------------------
# the fused MoE FFN


def _moe_ffn(fc: FunctionContext, node: Node) -> list[Any]:
    """Router matmul, routing, the selected experts' activation, weighted sum [+ shared expert]."""
    a: MoeFFN = node.attrs
    named = moe_inputs(node.inputs, a)
    x, router, down, scales = named["x"], named["router"], named["down"], named["scales"]
    gate, up = named.get("gate"), named["gate_up" if a.merged_gate_up else "up"]
    t_dim = fc.kernel_key_dims(x)[0]
    t = fc.dim(x.shape[0])
    e = int(x.shape[1])
    rq, (n_exp, _), rarr = weight_args(fc, router)
    logits = fc.call_temp(*fc.weight_matmul(rq, n_exp, e, x.shape[0]), [fc.value(x), *rarr],
                          [([t, i64(n_exp)], "float32")], "ffn_moe_logits")[0]
    extra = [named["bias"]] if a.selection_bias else [named["hash_table"], named["tokens"]] if a.hash_routed else []
    w, ids = route(fc, logits, (t_dim, n_exp), a, extra, "ffn_moe")
    in_scheme, down_scheme = a.act_schemes
    if (in_scheme or down_scheme or any(a.shared_act_schemes)) and fc.mb.target.kind.name in GPU_KINDS:
        raise NotImplementedError(f"{node.outputs[0].label}: 8-bit activation rounding of MoE experts is a CPU "
                                  "kernel; GPU targets compile with float32 activations")
    e_in, x_in = e, fc.value(x)
    if a.latent:  # the experts run in L dims
        x_in, e_in = _project(fc, x_in, named["latent_down"], x.shape[0], "ffn_moe_latent_in")
    int8_in = all(_int8_experts(fc, wv, in_scheme) for wv in (up, *([gate] if gate is not None else [])))
    int8_down = _int8_experts(fc, down, down_scheme)
    xe = x_in if int8_in else _round_temp(fc, x_in, (t_dim, e_in), [t, i64(e_in)], in_scheme, "ffn_moe_in_q")
    x3 = fc.bb.emit(relax.op.reshape(xe, [t, i64(1), i64(e_in)]))

    def experts(inp: Any, wv: Value, per_slot: bool, kind: str, int8: bool) -> Any:
        qtype, (_, n, k), arrays = weight_args(fc, wv)
        out = [([t, i64(a.k), i64(n)], "float32")]
        if int8:  # the kernel rounds its input rows itself
            rows_alike = (fc.one_token_order and not fc.is_one(x.shape[0])
                          and E8.order_depends_on_rows(qtype, fc.mb.target))
            ikey = KK.Int8ExpertMatmul(qtype, n_exp, n, k, a.k, per_slot, rows_alike)
            y = fc.call_temp(ikey, lambda: E8.int8_experts(qtype, n_exp, n, k, a.k, per_slot, fc.mb.target, rows_alike),
                             [inp, ids, *arrays], out, f"ffn_moe_{kind}")[0]
        else:
            key = KK.ExpertMatmul(qtype, n_exp, n, k, a.k, per_slot)
            y = fc.call_temp(key, lambda: qmatmul_experts(qtype, n_exp, n, k, a.k, x_per_slot=per_slot),
                             [inp, ids, *arrays], out, f"ffn_moe_{kind}")[0]
        if kind in scales:
            y = _scale_by_expert(fc, y, scales[kind], ids, (t_dim, a.k, n), kind)
        return y

    up_y = experts(x3, up, False, "gate_up" if a.merged_gate_up else "up", int8_in)
    hidden = int(up.shape[1]) // (2 if a.merged_gate_up else 1)
    act_dims = (t_dim, a.k, hidden)
    act_shape = [t, i64(a.k), i64(hidden)]
    if a.merged_gate_up:
        act = _merged_gate_up_act(fc, up_y, act_dims, act_shape, a)
    elif gate is not None and a.act == "swiglu" and fc.mb.target.kind.name == "llvm" and hidden % 8 == 0:
        act = _vector_swiglu(fc, experts(x3, gate, False, "gate", int8_in), up_y, act_shape)
    elif gate is not None:
        act = _elementwise_temp(fc, act_program(a.act, a.act_limit, a.act_linear_beta),
                                [experts(x3, gate, False, "gate", int8_in), up_y], [act_dims, act_dims], act_shape,
                                "ffn_moe_act")
    else:
        silu = O.FusedElementwise((("unary", O.Unary("silu"), (0,)),), 1)
        act = _elementwise_temp(fc, silu, [up_y], [act_dims], act_shape, "ffn_moe_act")
    if not int8_down:
        act = _round_temp(fc, act, act_dims, act_shape, down_scheme, "ffn_moe_act_q")
    down_y = experts(act, down, True, "down", int8_down)
    dims = (t_dim, a.k, e_in)
    if a.shared or a.latent:
        routed = fc.call_temp(*_weighted_sum_kernel(fc, dims), [down_y, w], [([t, i64(e_in)], "float32")],
                              "ffn_moe_routed")[0]
        if a.latent:
            routed = _latent_out(fc, node, named, routed, t_dim)
        return shared_expert(fc, node, named, routed) if a.shared else [routed]
    return fc.call(*_weighted_sum_kernel(fc, dims), [down_y, w], node.outputs, node.outputs[0].name)


def _vector_swiglu(fc: FunctionContext, gate_y: Any, up_y: Any, act_shape: list[Any]) -> Any:
    """silu(gate) * up of the selected experts by the swiglu op's CPU kernel (llama.cpp's
    ggml_vec_swiglu_f32, as its MoE computes them), over [T k, F] views."""
    t, k, f = act_shape
    rows = [t * k, f]
    g2, u2 = (fc.bb.emit(relax.op.reshape(v, rows)) for v in (gate_y, up_y))
    width = int(f)
    act = fc.call_temp(KK.OpKernel("swiglu", width, ()), lambda: CV.swiglu(width), [g2, u2], [(rows, "float32")],
                       "ffn_moe_act")[0]
    return fc.bb.emit(relax.op.reshape(act, act_shape))


def _weighted_sum_kernel(fc: FunctionContext, dims: tuple[Any, ...]) -> tuple[KK.KernelKey, Callable[[], Any]]:
    """The experts' weighted sum: on the CPU in llama.cpp's order (weighted_sum_in_order) where
    the width allows, else the reduction."""
    k, n = int(dims[1]), int(dims[2])
    if fc.mb.target.kind.name == "llvm" and n % 8 == 0:
        return KK.OpKernel("weighted_sum", ("in_order", k, n), ()), lambda: weighted_sum_in_order(k, n)
    return KK.OpKernel("weighted_sum", None, (dims,)), lambda: weighted_sum(Symbols().shape(dims), True)


def _int8_experts(fc: FunctionContext, wv: Value, scheme: str) -> bool:
    """Whether the experts of weight `wv`, their input rounded to `scheme`, run on the target's
    8-bit kernel (q8_K rows: the K-quants)."""
    if scheme != "q8_K" or not fc.is_param(wv):
        return False
    qtype, (_, n, k), _ = weight_args(fc, wv)
    return E8.int8_experts_supported(qtype, n, k, fc.mb.target)


def _project(fc: FunctionContext, v: Any, w: Value, t_dim: Dim, name: str) -> tuple[Any, int]:
    """v @ W.T with the weight's matmul kernel -> ([T, N], N)."""
    qtype, (n, k), arrays = weight_args(fc, w)
    out = fc.call_temp(*fc.weight_matmul(qtype, n, k, t_dim), [v, *arrays], [([fc.dim(t_dim), i64(n)], "float32")],
                       name)[0]
    return out, n


def _latent_out(fc: FunctionContext, node: Node, named: dict[str, Any], y: Any, t_dim: Dim) -> Any:
    """A latent MoE's routed sum [T, L] -> [rmsnorm(., routed_norm)] @ routed_up.T [T, E]."""
    a: MoeFFN = node.attrs
    if a.latent_norm:
        dims = (t_dim, int(named["latent_norm"].shape[0]))
        llvm = fc.mb.target.kind.name == "llvm"
        y = fc.call_temp(KK.OpKernel("rms_norm", O.RMSNorm(a.latent_norm_eps), (dims, dims[1:])),
                         lambda: rms_norm(Symbols().shape(dims), True, a.latent_norm_eps, llvm),
                         [y, fc.value(named["latent_norm"])], [([fc.dim(t_dim), i64(dims[1])], "float32")],
                         "ffn_moe_latent_norm")[0]
    if a.shared:
        return _project(fc, y, named["latent_up"], t_dim, "ffn_moe_latent_out")[0]
    qtype, (n, k), arrays = weight_args(fc, named["latent_up"])
    return fc.call(*fc.weight_matmul(qtype, n, k, t_dim), [y, *arrays], node.outputs, node.outputs[0].name)[0]


def _merged_gate_up_act(fc: FunctionContext, y: Any, act_dims: tuple[Any, ...], act_shape: list[Any],
                        a: MoeFFN) -> Any:
    """act(y[..., :F], y[..., F:]) of the merged gate_up experts' output [T, k, 2F]."""
    if a.act == "swiglu":
        return fc.call_temp(KK.OpKernel("swiglu_halves", None, (act_dims,)),
                            lambda: swiglu_halves(Symbols().shape(act_dims)), [y],
                            [(act_shape, "float32")], "ffn_moe_act")[0]
    prog = act_program(a.act, a.act_limit, a.act_linear_beta)
    return fc.call_temp(KK.OpKernel("act_halves", prog, (act_dims,)),
                        lambda: act_halves(Symbols().shape(act_dims), prog), [y],
                        [(act_shape, "float32")], "ffn_moe_act")[0]


def _round_temp(fc: FunctionContext, v: Any, dims: tuple[Any, ...], shape: list[Any], scheme: str, name: str) -> Any:
    """`v` through the quantize_act kernel of `scheme` (no kernel when the scheme is "")."""
    if not scheme:
        return v
    return fc.call_temp(KK.OpKernel("quantize_act", O.QuantizeAct(scheme), (dims,)),
                        lambda: Q8.quantize_act(Symbols().shape(dims), scheme), [v], [(shape, "float32")], name)[0]


def _scale_by_expert(fc: FunctionContext, y: Any, scale: Value, ids: Any, dims: tuple[Dim, int, int],
                     kind: str) -> Any:
    """y[t, s, :] *= scale[ids[t, s]] (llama.cpp's per-expert `.scale`); dims = (tokens, slots, n)."""
    n_exp = int(scale.shape[0])
    t_dim, slots, n = dims
    id_dims = (t_dim, slots)
    t = fc.dim(t_dim)
    per = fc.call_temp(KK.OpKernel("gather", None, ((n_exp,), id_dims)),
                       lambda: gather_f32(Symbols().shape((n_exp,)), Symbols().shape(id_dims)),
                       [fc.value(scale), ids], [([t, i64(slots)], "float32")], f"ffn_moe_{kind}_scale")[0]
    per3 = fc.bb.emit(relax.op.reshape(per, [t, i64(slots), i64(1)]))
    in_dims = (dims, (t_dim, slots, 1))
    prog = O.FusedElementwise((("binary", MUL, (0, 1)),), 2)
    return fc.call_temp(KK.OpKernel("elementwise", prog, in_dims),
                        lambda: elementwise([Symbols().shape(d) for d in in_dims], prog), [y, per3],
                        [([t, i64(slots), i64(n)], "float32")], f"ffn_moe_{kind}_scaled")[0]


# ---------------------------------------------------------------------------------------------
# the shared expert


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
        return routed[t, j] + sh * sigmoid(logit[t])

    out = te.compute(shape, body, name="out")
    return func([routed, shexp, x, w, *([scale] if scale is not None else []), out])


def shared_add(shape: PShape, has_scale: bool) -> tirx.PrimFunc:
    """Args (routed [T,E], shexp [T,E][, s_down [1]], out [T,E]): routed + shexp [* s] (the
    always-active shared expert)."""
    routed = te.placeholder(shape, "float32", name="routed")
    shexp = te.placeholder(shape, "float32", name="shexp")
    scale = te.placeholder((i64(1),), "float32", name="s_down") if has_scale else None

    def body(t: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        return routed[t, j] + (shexp[t, j] * scale[i64(0)] if scale is not None else shexp[t, j])

    out = te.compute(shape, body, name="out")
    return func([routed, shexp, *([scale] if scale is not None else []), out])


def shared_expert(fc: FunctionContext, node: Node, named: dict[str, Any], routed: Any) -> list[Any]:
    """routed + act(x Wg [sg], x Wu [su]) Wd [sd] [* sigmoid(x . w) when gated]: three projections
    (the quantized matmul kernels), one activation kernel, one kernel for the gate and the combine."""
    a: MoeFFN = node.attrs
    x = named["x"]
    t, t_dim, e = fc.dim(x.shape[0]), fc.kernel_key_dims(x)[0], int(x.shape[1])
    scales = named["shexp_scales"]

    def proj(inp: Any, w: Any, name: str) -> tuple[Any, int]:
        qtype, (n, k), arrays = weight_args(fc, w)
        out = fc.call_temp(*fc.weight_matmul(qtype, n, k, x.shape[0]), [inp, *arrays], [([t, i64(n)], "float32")],
                           name)[0]
        return out, n

    in_scheme, down_scheme = a.shared_act_schemes
    xr = _round_temp(fc, fc.value(x), (t_dim, e), [t, i64(e)], in_scheme, "ffn_shexp_in_q")
    g, fs = proj(xr, named["shexp_gate"], "ffn_shexp_gate")
    u, _ = proj(xr, named["shexp_up"], "ffn_shexp_up")
    act = _shared_act(fc, a, g, u, scales, (t_dim, fs), [t, i64(fs)])
    act = _round_temp(fc, act, (t_dim, fs), [t, i64(fs)], down_scheme, "ffn_shexp_act_q")
    down, _ = proj(act, named["shexp_down"], "ffn_shexp_down")
    has_sd = "down" in scales
    s_down = [fc.value(scales["down"])] if has_sd else []
    if not a.shared_gated:
        return fc.call(KK.OpKernel("shared_add", has_sd, ((t_dim, e),)),
                       lambda: shared_add(Symbols().shape((t_dim, e)), has_sd), [routed, down, *s_down],
                       node.outputs, node.outputs[0].name)
    w_gate = named["shexp_gate_inp"]
    if fc.is_param(w_gate) and fc.param(w_gate)[0].qtype != "F32":
        raise NotImplementedError("a quantized ffn_gate_inp_shexp is not lowered (fuse_moe keeps it f32)")
    key = KK.OpKernel("shared_combine", has_sd, ((t_dim, e),))
    return fc.call(key, lambda: shared_combine(Symbols().shape((t_dim, e)), has_sd),
                   [routed, down, fc.value(x), fc.value(w_gate), *s_down], node.outputs, node.outputs[0].name)


def _shared_act(fc: FunctionContext, a: MoeFFN, g: Any, u: Any, scales: dict[str, Value], dims: tuple[Any, ...],
                shape: list[Any]) -> Any:
    """act(g [* sg], u [* su]) as one elementwise kernel (the [1] scales read as inputs)."""
    ins = [g, u]
    all_dims: list[tuple[Any, ...]] = [dims, dims]
    scale_slot: dict[str, int] = {}
    for kind in ("gate", "up"):
        if kind in scales:
            scale_slot[kind] = len(ins)
            ins.append(fc.value(scales[kind]))
            all_dims.append((1,))
    n_in = len(ins)
    steps: list[Step] = []
    slot = {"gate": 0, "up": 1}
    for kind, src in (("gate", 0), ("up", 1)):
        if kind in scale_slot:
            steps.append(("binary", MUL, (src, scale_slot[kind])))
            slot[kind] = n_in + len(steps) - 1
    steps += act_steps(a.shared_act, a.shared_act_limit, slot["gate"], slot["up"], n_in + len(steps),
                       a.shared_act_linear_beta)
    return _elementwise_temp(fc, O.FusedElementwise(tuple(steps), n_in), ins, all_dims, shape, "ffn_shexp_act")


MOE_LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "take_along": _take_along,
    "moe_route": _moe_route,
    "moe_topk_softmax": _moe_topk_softmax,
    "moe_ffn": _moe_ffn,
}


def moe_normalize(shape: PShape, clamp: float, f64_sum: bool = False) -> tirx.PrimFunc:
    """w / max(sum of the row, clamp): ggml_sum_rows then ggml_clamp and ggml_div, the sum in
    float64 where `f64_sum` (ggml_vec_sum_f32 on the CPU; targets without float64 sum in float32)."""
    w = te.placeholder(shape, "float32", name="w")
    r = te.reduce_axis((i64(0), shape[-1]), name="r")
    acc = "float64" if f64_sum else "float32"
    # TE allows a reduction only at the top of a compute: sum first, clamp in the division
    s = te.compute(shape[:-1], lambda *i: te.sum(w(*i, r).astype(acc), axis=r), name="s")
    out = te.compute(shape, lambda *i: w(*i) / te.max(s(*i[:-1]).astype("float32"), f32(clamp)), name="out")
    return func([w, out])


def weighted_sum(y_shape: PShape, scale_by: bool) -> tirx.PrimFunc:
    """y [T, k, N] * w [T, k] summed over k -> [T, N]."""
    y = te.placeholder(y_shape, "float32", name="y")
    w = te.placeholder(y_shape[:2], "float32", name="w")
    r = te.reduce_axis((i64(0), y_shape[1]), name="r")
    out = te.compute((y_shape[0], y_shape[2]), lambda t, n: te.sum(y[t, r, n] * w[t, r], axis=r), name="out")
    return func([y, w, out])


def weighted_sum_in_order(k: int, n: int) -> tirx.PrimFunc:
    """`(y [T, k, N], w [T, k], out [T, N])` as llama.cpp's MoE sums its experts (N a multiple of
    8): each product y * w rounded (ggml_mul), then added slot by slot (ggml_add), unfused."""
    K, N = T.int64(k), T.int64(n)

    @T.prim_func(private=True)
    def weighted(y_h: T.handle, w_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        y = T.match_buffer(y_h, (t_len, K, N), "float32")
        w = T.match_buffer(w_h, (t_len, K), "float32")
        out = T.match_buffer(out_h, (t_len, N), "float32")
        for t in T.parallel(t_len):
            for c in range(n // 8):
                out[t, c * 8:c * 8 + 8] = CV.rounded(y.vload([t, 0, c * 8], "float32x8") * T.broadcast(w[t, 0], 8))
                for s in range(1, k):
                    out[t, c * 8:c * 8 + 8] = out.vload([t, c * 8], "float32x8") + CV.rounded(
                        y.vload([t, s, c * 8], "float32x8") * T.broadcast(w[t, s], 8))

    return weighted
