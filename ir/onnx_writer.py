"""The ONNX graph being written: fresh names, initializers, nodes, and the symbolic dims T and P as
tensors. The exporter (`onnx_export.py`) and the spelled ops (`onnx_spelled.py`) both write through
it."""

from __future__ import annotations

import ast
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ggufc.messages import GgufcError

from .graph import Dim, Graph, Value

_DIM_OPS = {ast.Add: "Add", ast.Mult: "Mul", ast.Sub: "Sub"}


class OnnxError(GgufcError, ValueError):
    """A graph or model ggufc cannot export or import: the message says which node and why."""


class OnnxWriter:
    """Names, initializers and nodes of the ONNX graph written for `graph`."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.symbols = Symbols(self)
        self.names: dict[int, str] = {}
        self.taken: set[str] = set()
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

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

    def input_named(self, name: str) -> str:
        for v in self.graph.inputs:
            if v.name == name:
                return self.name(v)
        raise OnnxError(f"the graph has no input {name!r} to size its dynamic dims from")


class Symbols:
    """The int64 [1] tensors T (tokens in this call) and P (start position), made once per graph."""

    def __init__(self, e: OnnxWriter) -> None:
        self.e = e
        self.cache: dict[str, str] = {}

    def tensor(self, d: Dim) -> str:
        """A [1] int64 tensor holding dimension `d` (an int or an expression over T and P)."""
        key = str(d)
        if key not in self.cache:
            self.cache[key] = self.e.ints(f"dim/{key}", [d]) if isinstance(d, int) else self._expr(key)
        return self.cache[key]

    def scalar(self, d: Dim) -> str:
        key = f"scalar:{d}"
        if key not in self.cache:
            out = self.e.fresh(f"dim/{d}/scalar")
            self.e.emit("Squeeze", [self.tensor(d), self.e.ints(f"{out}/axes", [0])], [out])
            self.cache[key] = out
        return self.cache[key]

    def _expr(self, text: str) -> str:
        return self._node(ast.parse(text, mode="eval").body, text)

    def _node(self, n: ast.expr, text: str) -> str:
        if isinstance(n, ast.Name) and n.id in ("T", "P"):
            return self._symbol(n.id)
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return self.tensor(n.value)
        if isinstance(n, ast.BinOp) and type(n.op) in _DIM_OPS:
            a, b = self._node(n.left, text), self._node(n.right, text)
            out = self.e.fresh(f"dim/{ast.unparse(n)}")
            self.e.emit(_DIM_OPS[type(n.op)], [a, b], [out])
            return out
        raise ValueError(f"dimension {text!r}: only + - * over T, P and integers")

    def _symbol(self, name: str) -> str:
        if name in self.cache:
            return self.cache[name]
        source = self.e.input_named("tokens" if name == "T" else "pos")
        out = self.e.fresh(f"dim/{name}")
        if name == "T":
            self.e.emit("Shape", [source], [out])
        else:
            self.e.emit("Reshape", [source, self.e.ints(f"{out}/shape", [1])], [out])
        self.cache[name] = out
        return out
