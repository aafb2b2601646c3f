"""ONNX view of the IR: `to_onnx` for inspection in standard tools (`onnx_import` reads it back).

Primitives become standard ONNX ops wherever one exists (MatMul over a Transpose for `x @ W.T`,
Add/Mul/..., ReduceMean, Softmax, Reshape, Gather, TopK, Slice, Concat, Sigmoid, ...); ops with
no standard counterpart (fused ops, cache and position ops, anything reading quantized storage)
become nodes of the custom domain `ggufc` carrying their attributes, readable ones plus the exact
attrs as JSON in `ggufc_attrs`. Params and states are graph inputs (quantized params as uint8
with their storage shape); state_out values are graph outputs. What the ONNX graph cannot say
(which inputs are params or states, their GGUF names and types) travels in metadata_props.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from . import ops as O
from .decompose import decompose
from .graph import Graph, Node, Param, Shape, Value
from .onnx_spelled import SPELLED
from .onnx_writer import OnnxError, OnnxWriter
from .printer import fmt_program

OPSET = 18  # axes as inputs for every Reduce*; well supported by onnxruntime
DOMAIN = "ggufc"
INT64_MAX = np.iinfo(np.int64).max

# GGML storage: elements per block and bytes per block
QUANT_BLOCKS: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q8_K": (256, 292),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "MXFP4": (32, 17),
}
FLOAT_QTYPES = {"F32": TensorProto.FLOAT, "F16": TensorProto.FLOAT16, "BF16": TensorProto.BFLOAT16}
DTYPES: dict[str, int] = {
    "float32": TensorProto.FLOAT, "int32": TensorProto.INT32, "int64": TensorProto.INT64,
    "float16": TensorProto.FLOAT16,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

UNARY_ONNX = {"sigmoid": "Sigmoid", "exp": "Exp", "neg": "Neg", "sqrt": "Sqrt", "relu": "Relu",
              "softplus": "Softplus", "tanh": "Tanh", "recip": "Reciprocal", "sign": "Sign", "abs": "Abs"}
BINARY_ONNX = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max", "min": "Min"}
SCALAR_ONNX = {**BINARY_ONNX, "pow": "Pow"}
REDUCE_ONNX = {"sum": "ReduceSum", "mean": "ReduceMean", "max": "ReduceMax"}


# ---------------------------------------------------------------------------------------------
# attrs <-> JSON (exact) and readable ONNX attributes


def _encode(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {f.name: _encode(getattr(x, f.name)) for f in dataclasses.fields(x)}
        return {"__attrs__": type(x).__name__, **fields}
    if isinstance(x, tuple | list):
        return [_encode(e) for e in x]
    return x


# every op's record by class name: the generic ops' and each family's (merged into O.OPS)
RECORDS: dict[str, type] = {op.attrs.__name__: op.attrs for op in O.OPS.values()}


def _decode(x: Any) -> Any:
    if isinstance(x, dict):
        cls = RECORDS[x["__attrs__"]]
        return cls(**{k: _decode(v) for k, v in x.items() if k != "__attrs__"})
    if isinstance(x, list):
        return tuple(_decode(e) for e in x)
    return x


def attrs_to_json(attrs: Any) -> str:
    return json.dumps(_encode(attrs))


def attrs_from_json(text: str) -> Any:
    return _decode(json.loads(text))


def _readable(attrs: Any) -> dict[str, Any]:
    """Attributes a viewer shows: scalars, strings and lists of them; programs as an expression."""
    if isinstance(attrs, O.FusedElementwise):
        return {"expr": fmt_program(attrs), "n_inputs": attrs.n_inputs}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(attrs):
        v = getattr(attrs, f.name)
        if isinstance(v, tuple):
            if not v:
                continue  # ONNX cannot type an empty list
            v = list(v) if all(_int64(e) for e in v) else [str(e) for e in v]
        elif isinstance(v, int) and not _int64(v):
            v = str(v)  # ONNX ints are int64; 64-bit hash multipliers are not
        out[f.name] = v
    return out


def _int64(x: Any) -> bool:
    return isinstance(x, int) and -(2**63) <= x < 2**63


# ---------------------------------------------------------------------------------------------
# export


def storage_shape(shape: Shape, qtype: str) -> list[int]:
    """uint8 storage of a quantized tensor: rows of `K / block` blocks of `bytes` each."""
    block, nbytes = QUANT_BLOCKS[qtype]
    dims = [int(d) for d in shape]
    if dims[-1] % block:
        raise OnnxError(f"{qtype} row of {dims[-1]} elements is not whole blocks of {block}")
    return dims[:-1] + [dims[-1] // block * nbytes]


def _dims(shape: Shape) -> list[int | str]:
    return [d if isinstance(d, int) else str(d) for d in shape]


class _Exporter(OnnxWriter):
    def __init__(self, graph: Graph, standard: bool = False) -> None:
        super().__init__(graph)
        self.standard = standard
        self.value_info: list[onnx.ValueInfoProto] = []
        # standard ONNX reads every weight as float32 of its logical shape (fed dequantized)
        self.qtype = {p.value.id: "F32" if standard else p.qtype for p in graph.params.values()}

    def is_quantized(self, v: Value) -> bool:
        return self.qtype.get(v.id, "F32") in QUANT_BLOCKS

    # -- whole graph -------------------------------------------------------------------------
    def run(self) -> onnx.ModelProto:
        g = self.graph
        inputs = [self._input_info(v, v.dtype) for v in g.inputs]
        params_meta = {}
        for p in g.params.values():
            inputs.append(self._param_info(p))
            spec = {"source": p.source, "qtype": p.qtype, "shape": _dims(p.value.shape)}
            params_meta[self.name(p.value)] = spec
        states_meta = {}
        for key, s in g.states.items():
            inputs.append(self._input_info(s.value, s.value.dtype))
            states_meta[key] = {"input": self.name(s.value), "init": s.init}
        for node in g.nodes:
            spelled = SPELLED.get(node.op) if self.standard else None
            (spelled or EXPORTERS.get(node.op, _export_custom))(self, node)
            self.value_info += [self._input_info(v, v.dtype) for v in node.outputs]
        outputs, out_names = self._outputs()
        state_out = {k: out_names[len(g.outputs) + i] for i, k in enumerate(g.state_out)}
        onnx_graph = helper.make_graph(
            self.nodes, "ggufc", inputs, outputs, self.inits, value_info=self.value_info
        )
        model = helper.make_model(
            onnx_graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
            producer_name="ggufc",
        )
        model.ir_version = 9
        simple_meta = {k: v for k, v in g.meta.items() if isinstance(v, str | int | float | bool)}
        helper.set_model_props(model, {
            "ggufc.params": json.dumps(params_meta), "ggufc.states": json.dumps(states_meta),
            "ggufc.state_out": json.dumps(state_out), "ggufc.meta": json.dumps(simple_meta),
        })
        return model

    def _input_info(self, v: Value, dtype: str) -> onnx.ValueInfoProto:
        if dtype not in DTYPES:
            raise OnnxError(f"%{v.label}: no ONNX type for {dtype}")
        return helper.make_tensor_value_info(self.name(v), DTYPES[dtype], _dims(v.shape))

    def _param_info(self, p: Param) -> onnx.ValueInfoProto:
        name = self.name(p.value)
        if self.standard:
            return helper.make_tensor_value_info(name, TensorProto.FLOAT, _dims(p.value.shape))
        if p.qtype in FLOAT_QTYPES:
            return helper.make_tensor_value_info(name, FLOAT_QTYPES[p.qtype], _dims(p.value.shape))
        if p.qtype not in QUANT_BLOCKS:
            raise OnnxError(f"param {p.source}: unknown storage type {p.qtype}")
        return helper.make_tensor_value_info(name, TensorProto.UINT8, storage_shape(p.value.shape, p.qtype))

    def _outputs(self) -> tuple[list[onnx.ValueInfoProto], list[str]]:
        """Graph outputs then new states; an input or a repeated value goes out through Identity."""
        g = self.graph
        leaves = {v.id for v in g.inputs} | {p.value.id for p in g.params.values()}
        leaves |= {s.value.id for s in g.states.values()}
        infos, names, used = [], [], set()
        for v in [*g.outputs, *g.state_out.values()]:
            name = self.name(v)
            if v.id in leaves or name in used:
                alias = self.fresh(f"{v.label}.out")
                self.emit("Identity", [name], [alias])
                name = alias
            used.add(name)
            names.append(name)
            infos.append(helper.make_tensor_value_info(name, DTYPES[v.dtype], _dims(v.shape)))
        return infos, names


# -- one exporter per op (standard ONNX where one exists) ---------------------------------------


def _export_custom(e: _Exporter, node: Node) -> None:
    if e.standard:
        raise OnnxError(f"{node.op} %{node.outputs[0].label}: no standard ONNX spelling (export without standard=True)")
    attrs = {} if isinstance(node.attrs, O.NoAttrs) else _readable(node.attrs)
    qtypes = [e.qtype[v.id] for v in node.inputs if e.is_quantized(v)]
    if qtypes:
        attrs["qtypes"] = qtypes
    e.emit(node.op, [e.name(v) for v in node.inputs], [e.name(v) for v in node.outputs], domain=DOMAIN,
           ggufc_attrs=attrs_to_json(node.attrs), **attrs)


def _export_unary(e: _Exporter, node: Node) -> None:
    fn, x, out = node.attrs.fn, e.name(node.inputs[0]), e.name(node.outputs[0])
    if fn in UNARY_ONNX:
        e.emit(UNARY_ONNX[fn], [x], [out])
    elif fn == "silu":
        sig = e.fresh(f"{out}/sigmoid")
        e.emit("Sigmoid", [x], [sig])
        e.emit("Mul", [x, sig], [out])
    elif fn == "rsqrt":
        root = e.fresh(f"{out}/sqrt")
        e.emit("Sqrt", [x], [root])
        e.emit("Reciprocal", [root], [out])
    elif fn == "square":
        e.emit("Mul", [x, x], [out])
    elif fn == "round_f16" and e.standard:  # for running; the ggufc export keeps the op (it reads back)
        _round_half(e, x, out)
    elif fn == "gelu_tanh_f16" and e.standard:
        _spell_gelu_tanh_f16(e, x, out)
    else:
        _export_custom(e, node)


def _round_half(e: _Exporter, x: str, out: str) -> None:
    half = e.fresh(f"{out}/f16")
    e.emit("Cast", [x], [half], to=TensorProto.FLOAT16)
    e.emit("Cast", [half], [out], to=TensorProto.FLOAT)


def _spell_gelu_tanh_f16(e: _Exporter, x: str, out: str) -> None:
    """ir.ops.gelu_tanh_f16_ref in standard ops: the input rounded to F16, GELU's tanh form, the
    result rounded to F16; 0 for x <= -10, x for x >= 10."""
    def const(tag: str, v: float) -> str:
        return e.const(f"{out}/{tag}", np.asarray(v, np.float32))

    def op(kind: str, args: list[str], tag: str) -> str:
        name = e.fresh(f"{out}/{tag}")
        e.emit(kind, args, [name])
        return name

    h = e.fresh(f"{out}/h")
    _round_half(e, x, h)
    h2 = op("Mul", [op("Mul", [const("a", 0.044715), h], "ah"), h], "ahh")
    inner = op("Mul", [op("Mul", [const("s", 0.79788456), h], "sh"), op("Add", [const("one", 1.0), h2], "poly")],
               "inner")
    g = op("Mul", [op("Mul", [const("half", 0.5), h], "hh"), op("Add", [const("one_t", 1.0),
                                                                        op("Tanh", [inner], "tanh")], "t1")], "g")
    g16 = e.fresh(f"{out}/g16")
    _round_half(e, g, g16)
    high = op("Where", [op("GreaterOrEqual", [x, const("ten", 10.0)], "is_high"), x, g16], "high")
    e.emit("Where", [op("LessOrEqual", [x, const("minus_ten", -10.0)], "is_low"), const("zero", 0.0), high], [out])


def _export_binary(e: _Exporter, node: Node) -> None:
    e.emit(BINARY_ONNX[node.attrs.fn], [e.name(v) for v in node.inputs], [e.name(node.outputs[0])])


def _export_scalar(e: _Exporter, node: Node) -> None:
    out = e.name(node.outputs[0])
    c = e.const(f"{out}/c", np.asarray(node.attrs.c, dtype=np.float32))
    e.emit(SCALAR_ONNX[node.attrs.fn], [e.name(node.inputs[0]), c], [out])


def _export_reduce(e: _Exporter, node: Node) -> None:
    out = e.name(node.outputs[0])
    axes = e.ints(f"{out}/axes", [node.attrs.axis])
    keepdims = int(node.attrs.keepdims)
    e.emit(REDUCE_ONNX[node.attrs.fn], [e.name(node.inputs[0]), axes], [out], keepdims=keepdims)


def _export_reshape(e: _Exporter, node: Node) -> None:
    src, shape = node.inputs[0].shape, node.attrs.shape
    target: list[int] = []
    for i, d in enumerate(shape):
        copies_input = i < len(src) and not isinstance(d, int) and src[i] == d
        target.append(d if isinstance(d, int) else 0 if copies_input else -1)
    out = e.name(node.outputs[0])
    if target.count(-1) <= 1:
        e.emit("Reshape", [e.name(node.inputs[0]), e.ints(f"{out}/shape", target)], [out])
    elif e.standard:  # two unknown dims: compute them from T and P
        dims = e.fresh(f"{out}/shape")
        e.emit("Concat", [e.symbols.tensor(d) for d in shape], [dims], axis=0)
        e.emit("Reshape", [e.name(node.inputs[0]), dims], [out])
    else:  # ONNX cannot say this without shape arithmetic
        _export_custom(e, node)


def _export_slice(e: _Exporter, node: Node) -> None:
    a, out = node.attrs, e.name(node.outputs[0])
    args = [e.ints(f"{out}/{k}", [v]) for k, v in (("starts", a.start), ("ends", a.stop), ("axes", a.axis))]
    e.emit("Slice", [e.name(node.inputs[0]), *args], [out])


def _export_last_token(e: _Exporter, node: Node) -> None:
    out = e.name(node.outputs[0])
    args = [e.ints(f"{out}/{k}", [v]) for k, v in (("starts", -1), ("ends", int(INT64_MAX)), ("axes", 0))]
    e.emit("Slice", [e.name(node.inputs[0]), *args], [out])


def _export_matmul(e: _Exporter, node: Node) -> None:
    x, w = node.inputs
    if e.is_quantized(w):
        _export_custom(e, node)
        return
    out = e.name(node.outputs[0])
    wt = e.fresh(f"{out}/wT")
    e.emit("Transpose", [e.name(w)], [wt], perm=[1, 0])
    e.emit("MatMul", [e.name(x), wt], [out])


def _export_bmm_nt(e: _Exporter, node: Node) -> None:
    out = e.name(node.outputs[0])
    bt = e.fresh(f"{out}/bT")
    e.emit("Transpose", [e.name(node.inputs[1])], [bt], perm=[0, 2, 1])
    e.emit("MatMul", [e.name(node.inputs[0]), bt], [out])


def _export_gather(e: _Exporter, node: Node) -> None:
    if e.is_quantized(node.inputs[0]):
        _export_custom(e, node)
        return
    e.emit("Gather", [e.name(v) for v in node.inputs], [e.name(node.outputs[0])], axis=0)


def _export_dequantize(e: _Exporter, node: Node) -> None:
    w, out = node.inputs[0], e.name(node.outputs[0])
    qtype = e.qtype.get(w.id, "F32")
    if qtype in ("F16", "BF16"):
        e.emit("Cast", [e.name(w)], [out], to=TensorProto.FLOAT)
    elif qtype == "F32":
        e.emit("Identity", [e.name(w)], [out])
    else:
        _export_custom(e, node)


def _export_topk(e: _Exporter, node: Node) -> None:
    """TopK (+ Cast of the ids); with a payload input the values are GatherElements of the payload
    at the selected ids (the MoE's selection by biased scores)."""
    vals, ids = (e.name(v) for v in node.outputs)
    if len(node.inputs) == 2 and not e.standard:  # with a payload: the ggufc node reads back exactly
        _export_custom(e, node)
        return
    ids64 = e.fresh(f"{ids}/int64")
    k = e.ints(f"{vals}/k", [node.attrs.k])
    top = vals if len(node.inputs) == 1 else e.fresh(f"{vals}/selected_by")
    e.emit("TopK", [e.name(node.inputs[0]), k], [top, ids64], axis=-1, largest=1, sorted=1)
    if len(node.inputs) == 2:  # the values are the payload's at the selected ids
        e.emit("GatherElements", [e.name(node.inputs[1]), ids64], [vals], axis=-1)
    e.emit("Cast", [ids64], [ids], to=TensorProto.INT32)


def _export_take_along(e: _Exporter, node: Node) -> None:
    x, ids = node.inputs
    ids64 = e.fresh(f"{e.name(ids)}/int64")
    e.emit("Cast", [e.name(ids)], [ids64], to=TensorProto.INT64)
    e.emit("GatherElements", [e.name(x), ids64], [e.name(node.outputs[0])], axis=-1)


def _export_simple(op_type: str, **fixed: Any) -> Callable[[_Exporter, Node], None]:
    def export(e: _Exporter, node: Node) -> None:
        attrs = {**fixed}
        if isinstance(node.attrs, O.Transpose):
            attrs["perm"] = list(node.attrs.perm)
        elif isinstance(node.attrs, O.Concat | O.Softmax):
            attrs["axis"] = node.attrs.axis
        e.emit(op_type, [e.name(v) for v in node.inputs], [e.name(v) for v in node.outputs], **attrs)

    return export


EXPORTERS: dict[str, Callable[[_Exporter, Node], None]] = {
    "unary": _export_unary,
    "binary": _export_binary,
    "scalar": _export_scalar,
    "reduce": _export_reduce,
    "reshape": _export_reshape,
    "transpose": _export_simple("Transpose"),
    "slice": _export_slice,
    "concat": _export_simple("Concat"),
    "dequantize": _export_dequantize,
    "gather": _export_gather,
    "matmul": _export_matmul,
    "bmm_nt": _export_bmm_nt,
    "bmm_nn": _export_simple("MatMul"),
    "topk": _export_topk,
    "take_along": _export_take_along,
    "last_token": _export_last_token,
    "softmax": _export_simple("Softmax"),
    # everything else (matmul_id, positions, causal_mask, cache ops, fused ops) is custom
}


def to_onnx(graph: Graph, path: str | os.PathLike[str] | None = None, *, standard: bool = False
            ) -> onnx.ModelProto:
    """`graph` as an ONNX model, written to `path` when one is given.

    `standard=True`: only standard ONNX ops, so onnxruntime runs it as it is: fused ops are
    decomposed first, every weight is a float32 input of its logical shape (feed it dequantized),
    and the cache, position, MoE and recurrent primitives are spelled out (`onnx_spelled`). An op
    with no spelling raises OnnxError naming it. Such a graph is for running, not for reading back.
    """
    if standard:
        graph = decompose(graph)
    try:
        model = _Exporter(graph, standard).run()
    except ValueError as e:
        raise OnnxError(str(e)) from None
    if path is not None:
        onnx.save(model, os.fspath(path))
    return model
