"""GraphBuilder: emits nodes with inferred shapes; the architecture files build through it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from . import ops as O
from .graph import Graph, Node, Param, Shape, State, Value


def param_dtype(qtype: str) -> str:
    """Values of quantized params carry their storage type, so dumps say what a kernel reads."""
    return "float32" if qtype == "F32" else qtype.lower()


class GraphBuilder:
    def __init__(self) -> None:
        self.inputs: list[Value] = []
        self.params: dict[str, Param] = {}
        self.states: dict[str, State] = {}
        self.nodes: list[Node] = []
        self._layer: int | None = None

    # -- leaves ------------------------------------------------------------------------------
    def input(self, name: str, shape: Shape, dtype: str) -> Value:
        v = Value(name, tuple(shape), dtype)
        self.inputs.append(v)
        return v

    def param(self, source: str, shape: Shape, qtype: str, name: str | None = None) -> Value:
        if source in self.params:
            return self.params[source].value
        v = Value(name or source, tuple(shape), param_dtype(qtype), self._layer)
        self.params[source] = Param(v, source, qtype)
        return v

    def state(self, name: str, shape: Shape, dtype: str = "float32") -> Value:
        v = Value(name, tuple(shape), dtype, self._layer)
        self.states[name] = State(v)
        return v

    @contextlib.contextmanager
    def layer(self, index: int | None) -> Iterator[None]:
        prev, self._layer = self._layer, index
        try:
            yield
        finally:
            self._layer = prev

    # -- nodes -------------------------------------------------------------------------------
    def emit_multi(
        self, op: str, inputs: Sequence[Value], attrs: Any, names: Sequence[str]
    ) -> tuple[Value, ...]:
        opdef = O.OPS[op]
        if not isinstance(attrs, opdef.attrs):
            raise TypeError(f"{op}: attrs must be {opdef.attrs.__name__}, got {type(attrs).__name__}")
        specs = opdef.infer([(v.shape, v.dtype) for v in inputs], attrs)
        outs = tuple(Value(n, s, d, self._layer) for n, (s, d) in zip(names, specs, strict=True))
        self.nodes.append(Node(op, tuple(inputs), attrs, outs))
        return outs

    def emit(self, op: str, inputs: Sequence[Value], attrs: Any, name: str) -> Value:
        return self.emit_multi(op, inputs, attrs, [name])[0]

    def finish(self, outputs: Sequence[Value], state_out: dict[str, Value], **meta: Any) -> Graph:
        return Graph(
            inputs=list(self.inputs),
            params=dict(self.params),
            states=dict(self.states),
            nodes=list(self.nodes),
            outputs=list(outputs),
            state_out=dict(state_out),
            meta=dict(meta),
        )

    # -- spelled-out primitives (what the shared blocks use) ---------------------------------
    def unary(self, fn: str, x: Value, name: str) -> Value:
        return self.emit("unary", [x], O.Unary(fn), name)

    def binary(self, fn: str, a: Value, b: Value, name: str) -> Value:
        return self.emit("binary", [a, b], O.Binary(fn), name)

    def add(self, a: Value, b: Value, name: str) -> Value:
        return self.binary("add", a, b, name)

    def mul(self, a: Value, b: Value, name: str) -> Value:
        return self.binary("mul", a, b, name)

    def scalar(self, fn: str, x: Value, c: float, name: str) -> Value:
        return self.emit("scalar", [x], O.Scalar(fn, float(c)), name)

    def reduce(self, fn: str, x: Value, name: str, axis: int = -1, keepdims: bool = True) -> Value:
        return self.emit("reduce", [x], O.Reduce(fn, axis, keepdims), name)

    def reshape(self, x: Value, shape: Shape, name: str) -> Value:
        return self.emit("reshape", [x], O.Reshape(tuple(shape)), name)

    def transpose(self, x: Value, perm: Sequence[int], name: str) -> Value:
        return self.emit("transpose", [x], O.Transpose(tuple(perm)), name)

    def slice(self, x: Value, axis: int, start: int, stop: int, name: str) -> Value:
        return self.emit("slice", [x], O.Slice(axis, start, stop), name)

    def dequantize(self, w: Value, name: str) -> Value:
        return self.emit("dequantize", [w], O.NoAttrs(), name)

    def matmul(self, x: Value, w: Value, name: str) -> Value:
        """x @ W.T; a quantized W is dequantized explicitly (the dequant-into-matmul pass folds it)."""
        if w.dtype != "float32":
            w = self.dequantize(w, f"{name}.w")
        return self.emit("matmul", [x, w], O.NoAttrs(), name)

    def gather(self, table: Value, ids: Value, name: str) -> Value:
        return self.emit("gather", [table, ids], O.NoAttrs(), name)


def rms_norm_spelled(b: GraphBuilder, x: Value, w: Value | None, eps: float, name: str) -> Value:
    """x * rsqrt(mean(x^2) + eps) over the last axis, times `w` when given: RMS norm as the frontend spells it."""
    sq = b.unary("square", x, f"{name}.sq")
    ms = b.reduce("mean", sq, f"{name}.ms")
    r = b.unary("rsqrt", b.scalar("add", ms, eps, f"{name}.ms_eps"), f"{name}.rstd")
    y = b.mul(x, r, f"{name}.normed" if w is not None else name)
    return b.mul(y, w, name) if w is not None else y


def rms_norm_plain(b: GraphBuilder, x: Value, eps: float, name: str) -> Value:
    """x * rsqrt(mean(x^2) + eps) over the last axis: rms_norm_spelled without a weight."""
    return rms_norm_spelled(b, x, None, eps, name)
