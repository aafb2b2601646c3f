"""ONNX view of the IR: `to_onnx` for inspection in standard tools, `from_onnx` to read back.

Primitives become standard ONNX ops wherever one exists (MatMul over a Transpose for `x @ W.T`,
Add/Mul/..., ReduceMean, Softmax, Reshape, Gather, TopK, Slice, Concat, Sigmoid, ...); ops with
no standard counterpart (fused ops, cache and position ops, anything reading quantized storage)
become nodes of the custom domain `ggufc` carrying their attributes, readable ones plus the exact
attrs as JSON in `ggufc_attrs`. Params and states are graph inputs (quantized params as uint8
with their storage shape); state_out values are graph outputs. What the ONNX graph cannot say
(which inputs are params or states, their GGUF names and types) travels in metadata_props.

`from_onnx` reads back graphs made of what `to_onnx` writes: the standard ops above, the
`ggufc` nodes, and the few multi-node idioms the export uses (`x * sigmoid(x)` for silu,
`1 / sqrt(x)` for rsqrt, `x * x` for square, MatMul over Transpose, TopK + Cast). Initializers
used as data become params whose arrays ride in `graph.meta["constants"]`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import ops as O
from .builder import param_dtype
from .graph import Graph, Node, Param, Shape, State, Value

OPSET = 18  # axes as inputs for every Reduce*; well supported by onnxruntime
DOMAIN = "ggufc"
INT64_MAX = np.iinfo(np.int64).max

# GGML storage: elements per block and bytes per block
QUANT_BLOCKS: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q8_K": (256, 292),
    "Q2_K": (256, 84), "Q3_K": (256, 110),
}
FLOAT_QTYPES = {"F32": TensorProto.FLOAT, "F16": TensorProto.FLOAT16, "BF16": TensorProto.BFLOAT16}
DTYPES: dict[str, int] = {
    "float32": TensorProto.FLOAT, "int32": TensorProto.INT32, "int64": TensorProto.INT64,
    "float16": TensorProto.FLOAT16,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

UNARY_ONNX = {"sigmoid": "Sigmoid", "exp": "Exp", "neg": "Neg", "sqrt": "Sqrt", "relu": "Relu",
              "softplus": "Softplus", "tanh": "Tanh", "recip": "Reciprocal"}
BINARY_ONNX = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max", "min": "Min"}
SCALAR_ONNX = {**BINARY_ONNX, "pow": "Pow"}
REDUCE_ONNX = {"sum": "ReduceSum", "mean": "ReduceMean", "max": "ReduceMax"}


class OnnxError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------
# attrs <-> JSON (exact) and readable ONNX attributes


def _encode(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {f.name: _encode(getattr(x, f.name)) for f in dataclasses.fields(x)}
        return {"__attrs__": type(x).__name__, **fields}
    if isinstance(x, tuple | list):
        return [_encode(e) for e in x]
    return x


def _decode(x: Any) -> Any:
    if isinstance(x, dict):
        cls = getattr(O, x["__attrs__"])
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
        from .printer import fmt_program

        return {"expr": fmt_program(attrs), "n_inputs": attrs.n_inputs}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(attrs):
        v = getattr(attrs, f.name)
        if isinstance(v, tuple):
            if not v:
                continue  # ONNX cannot type an empty list
            v = list(v) if all(isinstance(e, int) for e in v) else [str(e) for e in v]
        out[f.name] = v
    return out


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


class _Exporter:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.names: dict[int, str] = {}
        self.taken: set[str] = set()
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self.qtype = {p.value.id: p.qtype for p in graph.params.values()}

    def name(self, v: Value) -> str:
        if v.id not in self.names:
            self.names[v.id] = self.fresh(v.label)
        return self.names[v.id]

    def fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            i += 1
            name = f"{base}~{i}"
        self.taken.add(name)
        return name

    def const(self, base: str, array: np.ndarray) -> str:
        name = self.fresh(base)
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def ints(self, base: str, values: list[int]) -> str:
        return self.const(base, np.asarray(values, dtype=np.int64))

    def emit(self, op_type: str, inputs: list[str], outputs: list[str], domain: str = "",
             **attrs: Any) -> None:
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=outputs[0], domain=domain, **attrs))

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
            EXPORTERS.get(node.op, _export_custom)(self, node)
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
    else:
        _export_custom(e, node)


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
    if target.count(-1) > 1:  # ONNX cannot say this without shape arithmetic
        _export_custom(e, node)
        return
    out = e.name(node.outputs[0])
    e.emit("Reshape", [e.name(node.inputs[0]), e.ints(f"{out}/shape", target)], [out])


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
    vals, ids = (e.name(v) for v in node.outputs)
    ids64 = e.fresh(f"{ids}/int64")
    k = e.ints(f"{vals}/k", [node.attrs.k])
    e.emit("TopK", [e.name(node.inputs[0]), k], [vals, ids64], axis=-1, largest=1, sorted=1)
    e.emit("Cast", [ids64], [ids], to=TensorProto.INT32)


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
    "last_token": _export_last_token,
    "softmax": _export_simple("Softmax"),
    # everything else (matmul_id, positions, causal_mask, cache ops, fused ops) is custom
}


def to_onnx(graph: Graph, path: str | os.PathLike[str]) -> onnx.ModelProto:
    """Write `graph` as an ONNX model at `path` (and return it)."""
    model = _Exporter(graph).run()
    onnx.save(model, os.fspath(path))
    return model


# ---------------------------------------------------------------------------------------------
# import

_LABEL = re.compile(r"^(?P<name>.*?)(@(?P<layer>\d+))?(~\d+)?$")


def _value_from_label(label: str, shape: Shape, dtype: str) -> Value:
    m = _LABEL.match(label)
    assert m is not None
    layer = m.group("layer")
    return Value(m.group("name"), shape, dtype, int(layer) if layer is not None else None)


def _shape_of(t: onnx.TypeProto) -> Shape:
    return tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.tensor_type.shape.dim)


class _Importer:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        props = {p.key: p.value for p in model.metadata_props}
        self.params_meta: dict[str, Any] = json.loads(props.get("ggufc.params", "{}"))
        self.states_meta: dict[str, Any] = json.loads(props.get("ggufc.states", "{}"))
        self.state_out_meta: dict[str, str] = json.loads(props.get("ggufc.state_out", "{}"))
        self.meta: dict[str, Any] = json.loads(props.get("ggufc.meta", "{}"))
        g = model.graph
        self.inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        self.info = {vi.name: vi.type for vi in [*g.value_info, *g.output]}
        self.env: dict[str, Value] = {}
        self.producer: dict[int, Node] = {}
        self.nodes: list[Node] = []
        self.inputs: list[Value] = []
        self.params: dict[str, Param] = {}
        self.states: dict[str, State] = {}
        self.constants: dict[str, np.ndarray] = {}
        self.users: dict[str, int] = {}
        for n in g.node:
            for i in n.input:
                self.users[i] = self.users.get(i, 0) + 1
        for o in g.output:
            self.users[o.name] = self.users.get(o.name, 0) + 1

    def run(self) -> Graph:
        g = self.model.graph
        state_inputs = {s["input"]: k for k, s in self.states_meta.items()}
        for vi in g.input:
            self._leaf(vi, state_inputs)
        for n in g.node:
            reader = READERS.get((n.domain or "", n.op_type))
            if reader is None:
                domain = n.domain or "ai.onnx"
                raise OnnxError(f"cannot read ONNX node {n.op_type} (domain {domain}) {n.name}")
            reader(self, n)
        state_out = {k: self.env[name] for k, name in self.state_out_meta.items()}
        state_names = set(self.state_out_meta.values())
        outputs = [self.env[o.name] for o in g.output if o.name not in state_names]
        meta = dict(self.meta)
        if self.constants:
            meta["constants"] = self.constants
        graph = Graph(self.inputs, self.params, self.states, self.nodes, outputs, state_out, meta)
        return _prune(graph)

    def _leaf(self, vi: onnx.ValueInfoProto, state_inputs: dict[str, str]) -> None:
        if vi.name in self.params_meta:
            spec = self.params_meta[vi.name]
            v = _value_from_label(vi.name, tuple(spec["shape"]), param_dtype(spec["qtype"]))
            self.params[spec["source"]] = Param(v, spec["source"], spec["qtype"])
        elif vi.name in state_inputs:
            key = state_inputs[vi.name]
            v = _value_from_label(vi.name, _shape_of(vi.type), DTYPE_NAMES[vi.type.tensor_type.elem_type])
            self.states[key] = State(v, self.states_meta[key].get("init", "zeros"))
        else:
            v = _value_from_label(vi.name, _shape_of(vi.type), DTYPE_NAMES[vi.type.tensor_type.elem_type])
            self.inputs.append(v)
        self.env[vi.name] = v

    # -- helpers for readers -----------------------------------------------------------------
    def value(self, name: str) -> Value:
        """The value of an ONNX tensor; an initializer used as data becomes a constant param."""
        if name not in self.env:
            if name not in self.inits:
                raise OnnxError(f"tensor {name} is used before it is defined")
            array = self.inits[name]
            v = _value_from_label(name, tuple(int(d) for d in array.shape), DTYPE_NAMES.get(
                helper.np_dtype_to_tensor_dtype(array.dtype), "float32"))
            self.params[name] = Param(v, name, "F32")
            self.constants[name] = array
            self.env[name] = v
        return self.env[name]

    def init_ints(self, name: str) -> list[int]:
        if name not in self.inits:
            raise OnnxError(f"{name} must be a constant initializer")
        return [int(i) for i in np.asarray(self.inits[name]).reshape(-1)]

    def produced(self, name: str, op: str) -> Node | None:
        """The IR node that made tensor `name`, when it is an `op` whose only use is here."""
        v = self.env.get(name)
        node = None if v is None else self.producer.get(v.id)
        return node if node is not None and node.op == op and self.users.get(name, 0) == 1 else None

    def add(self, op: str, inputs: list[Value], attrs: Any, out_names: list[str]) -> list[Value]:
        specs = O.OPS[op].infer([(v.shape, v.dtype) for v in inputs], attrs)
        outs = []
        for name, (shape, dtype) in zip(out_names, specs, strict=True):
            if op == "reshape" and name in self.info:  # the recorded shape says what -1 and 0 meant
                shape = _shape_of(self.info[name])
            outs.append(_value_from_label(name, shape, dtype))
        node = Node(op, tuple(inputs), attrs, tuple(outs))
        self.nodes.append(node)
        for name, v in zip(out_names, outs, strict=True):
            self.env[name] = v
            self.producer[v.id] = node
        return outs

    def alias(self, src: str, dst: str) -> None:
        self.env[dst] = self.value(src)


Reader = Callable[["_Importer", onnx.NodeProto], None]


def _attr(n: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in n.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _read_unary(fn: str) -> Reader:
    def read(im: _Importer, n: onnx.NodeProto) -> None:
        src = im.produced(n.input[0], "unary")
        if fn == "recip" and src is not None and src.attrs == O.Unary("sqrt"):
            _drop(im, src)
            im.add("unary", [src.inputs[0]], O.Unary("rsqrt"), [n.output[0]])
            return
        im.add("unary", [im.value(n.input[0])], O.Unary(fn), [n.output[0]])

    return read


def _read_binary(fn: str) -> Reader:
    def read(im: _Importer, n: onnx.NodeProto) -> None:
        a, b = n.input
        if b in im.inits and im.inits[b].size == 1 and fn in ("add", "mul", "max", "min", "pow"):
            im.add("scalar", [im.value(a)], O.Scalar(fn, float(im.inits[b].reshape(()))), [n.output[0]])
            return
        if fn == "mul" and a == b:
            im.add("unary", [im.value(a)], O.Unary("square"), [n.output[0]])
            return
        sig = im.produced(b, "unary") if fn == "mul" else None
        if sig is not None and sig.attrs == O.Unary("sigmoid") and sig.inputs[0] is im.value(a):
            _drop(im, sig)
            im.add("unary", [im.value(a)], O.Unary("silu"), [n.output[0]])
            return
        if fn == "pow":
            raise OnnxError(f"Pow {n.name}: only a scalar constant exponent is supported")
        im.add("binary", [im.value(a), im.value(b)], O.Binary(fn), [n.output[0]])

    return read


def _drop(im: _Importer, node: Node) -> None:
    """Forget a node folded into its only user."""
    im.nodes = [m for m in im.nodes if m is not node]


def _read_reduce(fn: str) -> Reader:
    def read(im: _Importer, n: onnx.NodeProto) -> None:
        axes = im.init_ints(n.input[1]) if len(n.input) > 1 else _attr(n, "axes", [])
        if len(axes) != 1:
            raise OnnxError(f"{n.op_type} {n.name}: exactly one axis is supported, got {axes}")
        keep = bool(_attr(n, "keepdims", 1))
        im.add("reduce", [im.value(n.input[0])], O.Reduce(fn, int(axes[0]), keep), [n.output[0]])

    return read


def _read_reshape(im: _Importer, n: onnx.NodeProto) -> None:
    x = im.value(n.input[0])
    if n.output[0] in im.info:
        shape = _shape_of(im.info[n.output[0]])
    else:
        target = im.init_ints(n.input[1])
        if -1 in target or 0 in target:
            raise OnnxError(f"Reshape {n.name}: the output shape must be recorded to read -1 or 0")
        shape = tuple(target)
    im.add("reshape", [x], O.Reshape(shape), [n.output[0]])


def _read_slice(im: _Importer, n: onnx.NodeProto) -> None:
    x = im.value(n.input[0])
    starts, ends = im.init_ints(n.input[1]), im.init_ints(n.input[2])
    axes = im.init_ints(n.input[3]) if len(n.input) > 3 else list(range(len(starts)))
    if len(n.input) > 4 and any(s != 1 for s in im.init_ints(n.input[4])):
        raise OnnxError(f"Slice {n.name}: steps are not supported")
    if len(starts) != 1:
        raise OnnxError(f"Slice {n.name}: one axis at a time is supported")
    start, end, axis = starts[0], ends[0], axes[0]
    if start == -1 and end >= INT64_MAX and axis == 0:
        im.add("last_token", [x], O.NoAttrs(), [n.output[0]])
        return
    im.add("slice", [x], O.Slice(axis, start, end), [n.output[0]])


def _read_matmul(im: _Importer, n: onnx.NodeProto) -> None:
    a, b = im.value(n.input[0]), im.value(n.input[1])
    t = im.produced(n.input[1], "transpose")
    if t is not None and len(b.shape) == 2 and t.attrs.perm == (1, 0):
        _drop(im, t)
        im.add("matmul", [a, t.inputs[0]], O.NoAttrs(), [n.output[0]])
    elif t is not None and len(b.shape) == 3 and t.attrs.perm == (0, 2, 1):
        _drop(im, t)
        im.add("bmm_nt", [a, t.inputs[0]], O.NoAttrs(), [n.output[0]])
    elif len(b.shape) == 3:
        im.add("bmm_nn", [a, b], O.NoAttrs(), [n.output[0]])
    else:  # x @ B is matmul(x, B^T)
        [bt] = im.add("transpose", [b], O.Transpose((1, 0)), [f"{n.output[0]}/bT"])
        im.add("matmul", [a, bt], O.NoAttrs(), [n.output[0]])


def _read_topk(im: _Importer, n: onnx.NodeProto) -> None:
    if _attr(n, "largest", 1) != 1 or _attr(n, "axis", -1) not in (-1, len(im.value(n.input[0]).shape) - 1):
        raise OnnxError(f"TopK {n.name}: only largest values along the last axis are supported")
    [k] = im.init_ints(n.input[1])
    im.add("topk", [im.value(n.input[0])], O.TopK(k), list(n.output))


def _read_cast(im: _Importer, n: onnx.NodeProto) -> None:
    src = im.value(n.input[0])
    to = _attr(n, "to")
    node = im.producer.get(src.id)
    if to == TensorProto.INT32 and node is not None and node.op == "topk" and node.outputs[1] is src:
        named = _value_from_label(n.output[0], src.shape, src.dtype)
        src.name, src.layer = named.name, named.layer  # topk's ids are int32 already: keep the Cast's name
        im.alias(n.input[0], n.output[0])
    elif to == TensorProto.FLOAT and src.dtype in ("f16", "bf16"):
        im.add("dequantize", [src], O.NoAttrs(), [n.output[0]])
    else:
        raise OnnxError(f"Cast {n.name}: only the casts to_onnx writes are supported")


def _read_simple(op: str, make_attrs: Callable[[onnx.NodeProto], Any]) -> Reader:
    def read(im: _Importer, n: onnx.NodeProto) -> None:
        im.add(op, [im.value(i) for i in n.input], make_attrs(n), list(n.output))

    return read


def _read_gather(im: _Importer, n: onnx.NodeProto) -> None:
    if _attr(n, "axis", 0) != 0:
        raise OnnxError(f"Gather {n.name}: only axis 0 (table rows) is supported")
    im.add("gather", [im.value(i) for i in n.input], O.NoAttrs(), [n.output[0]])


def _read_custom(im: _Importer, n: onnx.NodeProto) -> None:
    text = _attr(n, "ggufc_attrs")
    if n.op_type not in O.OPS or text is None:
        raise OnnxError(f"ggufc node {n.op_type} {n.name}: unknown op or missing ggufc_attrs")
    attrs = attrs_from_json(text.decode() if isinstance(text, bytes) else text)
    im.add(n.op_type, [im.value(i) for i in n.input], attrs, list(n.output))


READERS: dict[tuple[str, str], Reader] = {
    **{("", onnx_op): _read_unary(fn) for fn, onnx_op in UNARY_ONNX.items()},
    **{("", onnx_op): _read_binary(fn) for fn, onnx_op in SCALAR_ONNX.items()},
    **{("", onnx_op): _read_reduce(fn) for fn, onnx_op in REDUCE_ONNX.items()},
    ("", "Reshape"): _read_reshape,
    ("", "Slice"): _read_slice,
    ("", "MatMul"): _read_matmul,
    ("", "TopK"): _read_topk,
    ("", "Cast"): _read_cast,
    ("", "Identity"): lambda im, n: im.alias(n.input[0], n.output[0]),
    ("", "Transpose"): _read_simple("transpose", lambda n: O.Transpose(tuple(_attr(n, "perm")))),
    ("", "Concat"): _read_simple("concat", lambda n: O.Concat(_attr(n, "axis"))),
    ("", "Softmax"): _read_simple("softmax", lambda n: O.Softmax(_attr(n, "axis", -1))),
    ("", "Gather"): _read_gather,
    **{(DOMAIN, op): _read_custom for op in O.OPS},
}


def _prune(graph: Graph) -> Graph:
    """Drop nodes nothing uses (transposes folded into a MatMul, say) and unused constants."""
    live = {v.id for v in graph.outputs} | {v.id for v in graph.state_out.values()}
    kept = []
    for node in reversed(graph.nodes):
        if any(v.id in live for v in node.outputs):
            kept.append(node)
            live.update(v.id for v in node.inputs)
    return graph.replace(nodes=kept[::-1])


def from_onnx(path: str | os.PathLike[str]) -> Graph:
    """Read a graph written by `to_onnx` (or a simple ONNX graph of the same standard ops)."""
    return _Importer(onnx.load(os.fspath(path))).run()

