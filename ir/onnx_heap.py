"""libstdc++'s heap selection (`sparse_indexers.heap_select`, llama.cpp's CPU top-k) as ONNX loops.

Ties decide which cells QSA keeps, and `TopK` breaks them by index where the heap does not, so
the selection is spelled as the heap itself, every row of a [T, N] value matrix at once: a `Loop`
over the parents builds the heap on the first k cells (make_heap), a second `Loop` offers each
later cell (replacing the top when strictly greater). Each `adjust_heap` is a masked sift-down and
push-up, each a `Loop` of at most log2(k) + 1 levels; rows whose walk has ended keep their heap.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import GraphProto, NodeProto, TensorProto, ValueInfoProto, helper, numpy_helper


class Body:
    """Nodes and constants of one (sub)graph, every name under `prefix` (no clash across scopes)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[NodeProto] = []
        self.inits: list[TensorProto] = []
        self.count = 0

    def name(self, base: str) -> str:
        self.count += 1
        return f"{self.prefix}/{base}{self.count}"

    def const(self, value: object, dtype: type = np.int64) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def op(self, op_type: str, ins: list[str], base: str = "t", **attrs: Any) -> str:
        out = self.name(base)
        self.nodes.append(helper.make_node(op_type, ins, [out], **attrs))
        return out

    def graph(self, name: str, ins: list[tuple[str, int]], outs: list[tuple[str, int]]) -> GraphProto:
        """A Loop body: (iteration, condition) scalars first, then the carried tensors."""

        def info(i: int, n: str, t: int) -> ValueInfoProto:
            return helper.make_tensor_value_info(n, t, [] if i < 2 else None)

        return helper.make_graph(self.nodes, name, [info(i, n, t) for i, (n, t) in enumerate(ins)],
                                 [info(i + 1, n, t) for i, (n, t) in enumerate(outs)], self.inits)


I64, BOOL, F32 = TensorProto.INT64, TensorProto.BOOL, TensorProto.FLOAT


class HeapSelect:
    """Names of the outer tensors the loops read: values [T, N] float32, rows [1] (T), k scalar."""

    def __init__(self, values: str, rows: str, k: str, levels: str, prefix: str) -> None:
        self.values, self.rows, self.k, self.levels, self.prefix = values, rows, k, levels, prefix
        self.serial = 0

    def fresh(self, what: str) -> str:
        self.serial += 1
        return f"{self.prefix}/{what}{self.serial}"

    # -- row-wise access ([T, k] heap of cell ids, one column per row) ---------------------------
    def at(self, b: Body, heap: str, col: str) -> str:
        idx = b.op("Unsqueeze", [col, b.const([1])])
        return b.op("Squeeze", [b.op("GatherElements", [heap, idx], axis=1), b.const([1])])

    def put(self, b: Body, heap: str, col: str, val: str) -> str:
        one = b.const([1])
        return b.op("ScatterElements", [heap, b.op("Unsqueeze", [col, one]), b.op("Unsqueeze", [val, one])], axis=1)

    def value(self, b: Body, cell: str) -> str:
        return self.at(b, self.values, cell)

    def masked(self, b: Body, mask: str, new: str, old: str, matrix: bool) -> str:
        m = b.op("Unsqueeze", [mask, b.const([1])]) if matrix else mask
        return b.op("Where", [m, new, old])

    # -- adjust_heap(heap, hole, k, value) ---------------------------------------------------------
    def adjust(self, b: Body, heap: str, hole: str, value: str) -> str:
        k1 = b.op("Sub", [self.k, b.const(1)])
        half = b.op("Div", [k1, b.const(2)])  # (len - 1) // 2, len >= 1
        top = hole
        heap, hole, second = self._sift_down(b, heap, hole, half, k1)
        heap, hole = self._even_tail(b, heap, hole, second, k1)
        heap, hole = self._push_up(b, heap, hole, value, top)
        return self.put(b, heap, hole, value)

    def _sift_down(self, b: Body, heap: str, hole: str, half: str, k1: str) -> tuple[str, str, str]:
        s = Body(self.fresh("down"))
        it, cond, h, ho, se = (s.name(x) for x in ("i", "c", "heap", "hole", "second"))
        active = s.op("Less", [se, half])
        right = s.op("Mul", [s.op("Add", [se, s.const(1)]), s.const(2)])
        left = s.op("Sub", [right, s.const(1)])
        vr = self.value(s, self.at(s, h, s.op("Min", [right, k1])))
        vl = self.value(s, self.at(s, h, s.op("Min", [left, k1])))
        child = s.op("Where", [s.op("Greater", [vr, vl]), left, right])
        child_c = s.op("Min", [child, k1])
        moved = self.put(s, h, ho, self.at(s, h, child_c))
        outs = [s.op("Identity", [cond]), self.masked(s, active, moved, h, True),
                self.masked(s, active, child_c, ho, False), self.masked(s, active, child_c, se, False)]
        body = s.graph("sift_down", [(it, I64), (cond, BOOL), (h, I64), (ho, I64), (se, I64)],
                       [(outs[0], BOOL), (outs[1], I64), (outs[2], I64), (outs[3], I64)])
        res = [b.name(x) for x in ("heap", "hole", "second")]
        b.nodes.append(helper.make_node("Loop", [self.levels, "", heap, hole, hole], res, body=body))
        return res[0], res[1], res[2]

    def _even_tail(self, b: Body, heap: str, hole: str, second: str, k1: str) -> tuple[str, str]:
        """An even-length heap's last parent has one child: move it up."""
        even = b.op("Equal", [b.op("Mod", [self.k, b.const(2)]), b.const(0)])
        last_parent = b.op("Div", [b.op("Sub", [self.k, b.const(2)]), b.const(2)])
        fix = b.op("And", [b.op("Equal", [second, last_parent]), even])
        child = b.op("Min", [b.op("Add", [b.op("Mul", [second, b.const(2)]), b.const(1)]), k1])
        moved = self.put(b, heap, hole, self.at(b, heap, child))
        return self.masked(b, fix, moved, heap, True), self.masked(b, fix, child, hole, False)

    def _push_up(self, b: Body, heap: str, hole: str, value: str, top: str) -> tuple[str, str]:
        s = Body(self.fresh("up"))
        it, cond, h, ho = (s.name(x) for x in ("i", "c", "heap", "hole"))
        parent = s.op("Max", [s.op("Div", [s.op("Sub", [ho, s.const(1)]), s.const(2)]), s.const(0)])
        above = self.at(s, h, parent)
        active = s.op("And", [s.op("Greater", [ho, top]),
                              s.op("Greater", [self.value(s, above), self.value(s, value)])])
        moved = self.put(s, h, ho, above)
        outs = [s.op("Identity", [cond]), self.masked(s, active, moved, h, True),
                self.masked(s, active, parent, ho, False)]
        body = s.graph("push_up", [(it, I64), (cond, BOOL), (h, I64), (ho, I64)],
                       [(outs[0], BOOL), (outs[1], I64), (outs[2], I64)])
        res = [b.name(x) for x in ("heap", "hole")]
        b.nodes.append(helper.make_node("Loop", [self.levels, "", heap, hole], res, body=body))
        return res[0], res[1]

    # -- the two phases -------------------------------------------------------------------------------
    def make_heap(self, b: Body, heap: str) -> str:
        s = Body(self.fresh("make"))
        it, cond, h = s.name("i"), s.name("c"), s.name("heap")
        first = s.op("Div", [s.op("Sub", [self.k, s.const(2)]), s.const(2)])
        parent = s.op("Expand", [s.op("Sub", [first, it]), self.rows])
        adjusted = self.adjust(s, h, parent, self.at(s, h, parent))
        body = s.graph("make_heap", [(it, I64), (cond, BOOL), (h, I64)],
                       [(s.op("Identity", [cond]), BOOL), (adjusted, I64)])
        out = b.name("heap")
        b.nodes.append(helper.make_node("Loop", [b.op("Div", [self.k, b.const(2)]), "", heap], [out], body=body))
        return out

    def offer_rest(self, b: Body, heap: str, n: str) -> str:
        s = Body(self.fresh("offer"))
        it, cond, h = s.name("i"), s.name("c"), s.name("heap")
        cell = s.op("Expand", [s.op("Add", [self.k, it]), self.rows])
        root = s.op("Expand", [s.const(0), self.rows])
        wins = s.op("Greater", [self.value(s, cell), self.value(s, self.at(s, h, root))])
        adjusted = self.masked(s, wins, self.adjust(s, h, root, cell), h, True)
        body = s.graph("offer", [(it, I64), (cond, BOOL), (h, I64)],
                       [(s.op("Identity", [cond]), BOOL), (adjusted, I64)])
        out = b.name("heap")
        b.nodes.append(helper.make_node("Loop", [b.op("Sub", [n, self.k]), "", heap], [out], body=body))
        return out


def heap_select(b: Body, values: str, rows: str, k: str, n: str, prefix: str) -> str:
    """[T, k] int64 cell ids, as `heap_select` leaves them, for every row of `values` [T, N]."""
    kf = b.op("Cast", [b.op("Add", [k, b.const(1)])], to=F32)
    levels = b.op("Cast", [b.op("Ceil", [b.op("Div", [b.op("Log", [kf]), b.const(np.log(2.0), np.float32)])])],
                  to=I64)
    levels = b.op("Add", [levels, b.const(1)])
    hs = HeapSelect(values, rows, k, levels, prefix)
    first = b.op("Range", [b.const(0), k, b.const(1)])
    shape = b.op("Concat", [rows, b.op("Reshape", [k, b.const([1])])], axis=0)
    heap = b.op("Expand", [b.op("Unsqueeze", [first, b.const([0])]), shape])
    return hs.offer_rest(b, hs.make_heap(b, heap), n)
