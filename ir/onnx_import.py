"""Read ONNX graphs back into the IR: `import_onnx(path_or_model) -> Graph`.

What it reads is what `onnx_export.to_onnx` writes: the standard ops listed there, the `ggufc`
domain nodes (exact attrs from `ggufc_attrs`), and the few multi-node idioms the export uses
(`x * sigmoid(x)` for silu, `1 / sqrt(x)` for rsqrt, `x * x` for square, MatMul over Transpose,
TopK + Cast). Graph inputs named in the `ggufc.params` metadata become params (GGUF names and
storage types kept, so the model's own loader feeds them); initializers used as data become
params whose arrays ride in `graph.meta["constants"]`, keyed by param source. Anything else
stops at the first node ggufc cannot read, with its op and node name, as one OnnxError line.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper, numpy_helper

from . import ops as O
from .builder import param_dtype
from .graph import Graph, Node, Param, Shape, State, Value
from .onnx_export import (
    DOMAIN,
    DTYPE_NAMES,
    INT64_MAX,
    REDUCE_ONNX,
    SCALAR_ONNX,
    UNARY_ONNX,
    OnnxError,
    attrs_from_json,
)
from .walk import without_dead_nodes

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
                raise OnnxError(f"unsupported ONNX op {n.op_type} (domain {domain}) at node {n.name!r}: "
                                f"ggufc reads only the ops its export writes")
            reader(self, n)
        state_out = {k: self.env[name] for k, name in self.state_out_meta.items()}
        state_names = set(self.state_out_meta.values())
        outputs = [self.env[o.name] for o in g.output if o.name not in state_names]
        meta = dict(self.meta)
        if self.constants:
            meta["constants"] = self.constants
        graph = Graph(self.inputs, self.params, self.states, self.nodes, outputs, state_out, meta)
        return without_dead_nodes(graph)  # e.g. transposes folded into a MatMul

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
        if b in im.inits and im.inits[b].size == 1 and fn in ("add", "mul", "div", "max", "min", "pow"):
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


def _read_gather_elements(im: _Importer, n: onnx.NodeProto) -> None:
    """GatherElements along the last axis: of a payload at a TopK's ids (as _export_topk writes
    it), that topk's payload; at int32 ids cast to int64 (_export_take_along), take_along."""
    ids = im.value(n.input[1])
    node = im.producer.get(ids.id)
    payload = im.value(n.input[0])
    if _attr(n, "axis", 0) not in (-1, len(payload.shape) - 1):
        raise OnnxError(f"GatherElements {n.name}: only the last axis is supported")
    if node is None or node.op != "topk":
        if ids.dtype != "int32":
            raise OnnxError(f"GatherElements {n.name}: only int32 ids (cast to int64) or a TopK's ids are supported")
        im.add("take_along", [payload, ids], O.NoAttrs(), [n.output[0]])
        return
    if node.outputs[1] is not ids or len(node.inputs) != 1 or payload.shape != node.inputs[0].shape:
        raise OnnxError(f"GatherElements {n.name}: a payload must have the TopK's scores' shape")
    vals = node.outputs[0]
    named = _value_from_label(n.output[0], vals.shape, payload.dtype)
    vals.name, vals.layer, vals.dtype = named.name, named.layer, named.dtype
    selected = Node("topk", (node.inputs[0], payload), node.attrs, node.outputs)
    im.nodes[im.nodes.index(node)] = selected
    for v in selected.outputs:
        im.producer[v.id] = selected
    im.env[n.output[0]] = vals


def _read_cast(im: _Importer, n: onnx.NodeProto) -> None:
    src = im.value(n.input[0])
    to = _attr(n, "to")
    node = im.producer.get(src.id)
    if to == TensorProto.INT32 and node is not None and node.op == "topk" and node.outputs[1] is src:
        named = _value_from_label(n.output[0], src.shape, src.dtype)
        src.name, src.layer = named.name, named.layer  # topk's ids are int32 already: keep the Cast's name
        im.alias(n.input[0], n.output[0])
    elif to == TensorProto.INT64 and src.dtype == "int32":  # int32 ids widened for GatherElements
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
    ("", "GatherElements"): _read_gather_elements,
    ("", "Cast"): _read_cast,
    ("", "Identity"): lambda im, n: im.alias(n.input[0], n.output[0]),
    ("", "Transpose"): _read_simple("transpose", lambda n: O.Transpose(tuple(_attr(n, "perm")))),
    ("", "Concat"): _read_simple("concat", lambda n: O.Concat(_attr(n, "axis"))),
    ("", "Softmax"): _read_simple("softmax", lambda n: O.Softmax(_attr(n, "axis", -1))),
    ("", "Gather"): _read_gather,
    **{(DOMAIN, op): _read_custom for op in O.OPS},
}


def _load(source: str | os.PathLike[str] | bytes | onnx.ModelProto) -> onnx.ModelProto:
    if isinstance(source, onnx.ModelProto):
        return source
    try:
        if isinstance(source, bytes):
            return onnx.load_from_string(source)
        return onnx.load(os.fspath(source))
    except (DecodeError, ValueError, RuntimeError) as e:  # protobuf's parse errors, bad external data
        raise OnnxError(f"{source if not isinstance(source, bytes) else 'bytes'}: not an ONNX model ({e})") from None


def import_onnx(source: str | os.PathLike[str] | bytes | onnx.ModelProto) -> Graph:
    """The IR graph of an ONNX model (a path, serialized bytes or a loaded ModelProto).

    Params keep their GGUF names (`Param.source`), so a loaded model's `param_loader()` feeds them;
    initializers used as data are params too, their arrays in `graph.meta["constants"]`.
    """
    return _Importer(_load(source)).run()


def constant_loader(graph: Graph, fallback: Callable[[Param], np.ndarray] | None = None
                    ) -> Callable[[Param], np.ndarray]:
    """A param loader for the interpreter: an imported constant, else `fallback` (the model's weights)."""
    constants: dict[str, np.ndarray] = graph.meta.get("constants", {})

    def load(p: Param) -> np.ndarray:
        if p.source in constants:
            return constants[p.source]
        if fallback is None:
            raise OnnxError(f"param {p.source}: not a constant of the ONNX model; pass its weights")
        return fallback(p)

    return load
