"""MoE pieces beyond the routed experts (lower.py's moe_ffn calls these): the merged gate_up
activation and the sigmoid-gated shared expert.

* `swiglu_halves`: silu(y[..., :F]) * y[..., F:] of a merged gate_up output.
* `shared_combine`: routed + shared * sigmoid(x . w_gate) [* s], one kernel for the gate and the combine.

Symbolic extents: `n` (tokens of the call) and `pos` (tokens already cached), as in `kernels.py`.
"""

from __future__ import annotations

from typing import Any

from tvm import te, tirx

from ggufc.ir import ops as O
from ggufc.ir.graph import Node

from . import kernel_keys as KK
from . import kernels as K
from . import quant as Q
from .kernels import PShape, func, i64
from .lower_context import FunctionContext, weight_args


def swiglu_halves(act_shape: PShape) -> tirx.PrimFunc:
    """Args (y [T, k, 2F], act [T, k, F]): silu(y[..., :F]) * y[..., F:]."""
    n, k, f = act_shape
    y = te.placeholder((n, k, f * i64(2)), "float32", name="y")
    act = te.compute(act_shape, lambda t, s, j: y[t, s, j] * K.sigmoid(y[t, s, j]) * y[t, s, j + f], name="act")
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
        return routed[t, j] + sh * K.sigmoid(logit[t])

    out = te.compute(shape, body, name="out")
    return func([routed, shexp, x, w, *([scale] if scale is not None else []), out])


def merged_gate_up_act(fc: FunctionContext, y: Any, act_dims: tuple[Any, ...], act_shape: list[Any]) -> Any:
    """silu(y[..., :F]) * y[..., F:] of the merged gate_up experts' output [T, k, 2F]."""
    return fc.call_temp(KK.OpKernel("swiglu_halves", None, (act_dims,)),
                        lambda: swiglu_halves(K.Symbols().shape(act_dims)), [y],
                        [(act_shape, "float32")], "ffn_moe_act")[0]


def shared_expert(fc: FunctionContext, node: Node, named: dict[str, Any], routed: Any) -> list[Any]:
    """routed + (silu(x Wg [sg]) * (x Wu [su])) Wd [sd] * sigmoid(x . w): three projections (the
    quantized matmul kernels), one activation kernel, one kernel for the gate and the combine."""
    x = named["x"]
    t, t_dim, e = fc.dim(x.shape[0]), fc.kernel_key_dims(x)[0], int(x.shape[1])
    gemv = fc.is_one(x.shape[0])
    scales = named["shexp_scales"]

    def proj(inp: Any, w: Any, name: str) -> tuple[Any, int]:
        qtype, (n, k), arrays = weight_args(fc, w)
        out = fc.call_temp(KK.WeightMatmul(qtype, n, k, gemv), lambda: Q.qmatmul(qtype, n, k, gemv=gemv),
                           [inp, *arrays], [([t, K.i64(n)], "float32")], name)[0]
        return out, n

    g, fs = proj(fc.value(x), named["shexp_gate"], "ffn_shexp_gate")
    u, _ = proj(fc.value(x), named["shexp_up"], "ffn_shexp_up")
    ins = [g, u]
    steps: list[tuple[str, Any, tuple[int, ...]]] = []
    dims: list[tuple[Any, ...]] = [(t_dim, fs), (t_dim, fs)]
    gate_slot, up_slot = 0, 1
    for kind in ("gate", "up"):
        if kind in scales:
            ins.append(fc.value(scales[kind]))
            dims.append((1,))
    n_in = len(ins)
    slot = {"gate": 2, "up": 3 if "gate" in scales else 2}
    for kind, src in (("gate", 0), ("up", 1)):
        if kind in scales:
            steps.append(("binary", O.Binary("mul"), (src, slot[kind])))
            if kind == "gate":
                gate_slot = n_in + len(steps) - 1
            else:
                up_slot = n_in + len(steps) - 1
    steps.append(("unary", O.Unary("silu"), (gate_slot,)))
    steps.append(("binary", O.Binary("mul"), (n_in + len(steps) - 1, up_slot)))
    prog = O.FusedElementwise(tuple(steps), n_in)
    key = KK.OpKernel("elementwise", prog, tuple(dims))
    act = fc.call_temp(key, lambda: K.elementwise([K.Symbols().shape(d) for d in dims], prog), ins,
                       [([t, K.i64(fs)], "float32")], "ffn_shexp_act")[0]
    down, _ = proj(act, named["shexp_down"], "ffn_shexp_down")
    w_gate = named["shexp_gate_inp"]
    if fc.is_param(w_gate) and fc.param(w_gate)[0].qtype != "F32":
        raise NotImplementedError("a quantized ffn_gate_inp_shexp is not lowered (fuse_moe keeps it f32)")
    has_sd = "down" in scales
    args = [routed, down, fc.value(x), fc.value(w_gate)] + ([fc.value(scales["down"])] if has_sd else [])
    key2 = KK.OpKernel("shared_combine", has_sd, ((t_dim, e),))
    return fc.call(key2, lambda: shared_combine(K.Symbols().shape((t_dim, e)), has_sd), args, node.outputs,
                   node.outputs[0].name)
