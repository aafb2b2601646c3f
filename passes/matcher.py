"""A small pattern matcher over the graph, rules as data (in the spirit of tinygrad's UPat).

A `Pat` describes the producer tree of a value: an op, optional exact attrs or a predicate, and
the patterns of its inputs. A named pattern binds the value it matched; the same name seen again
must be the same value (that is how `x * rsqrt(mean(x*x))` insists on one `x`). `commute` tries
both operand orders, `any_of` tries alternative spellings, so one rule covers many spellings.

A `Rule` pairs a pattern with a `build` function that checks the remaining preconditions and
returns the replacement (`Rewrite`) or None. `rewrite_graph` scans nodes from last to first, so
the largest pattern rooted at a later node wins over the smaller ones inside it. For a closed
rule (a fusion) every value computed inside the match must be used only inside it; the matched
nodes are then removed and the new node takes over the root's output values, so users need no
rewiring. An open rule (a local rewrite such as folding a dequantize) leaves the old producers
for dead-code elimination.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ggufc.ir.graph import Graph, Node, Value
from ggufc.ir.ops import OPS
from ggufc.ir.verify import shapes_equal
from ggufc.ir.walk import defined_before, escaping_ids, inner_values_escape

from .stats import with_hits


@dataclass(frozen=True)
class Pat:
    op: str | None = None  # None: any value (a leaf, its producer is not part of the match)
    src: tuple[Pat, ...] | None = None  # None: inputs are not looked at
    attrs: Any = None  # exact attrs, when given
    where: Callable[[Node], bool] | None = None  # extra test on the producer node
    name: str | None = None
    commute: bool = False  # two operands, either order
    out: int = 0  # which output of the producer (topk has two)
    alts: tuple[Pat, ...] = ()  # alternatives; this pattern then only names the result


def V(name: str) -> Pat:  # noqa: N802 - reads as a variable in patterns
    """Any value, bound to `name`."""
    return Pat(name=name)


def P(op: str, *src: Pat, attrs: Any = None, where: Callable[[Node], bool] | None = None,  # noqa: N802
      name: str | None = None, commute: bool = False, out: int = 0) -> Pat:
    """A value produced by `op` from inputs matching `src` (any inputs if none are given)."""
    return Pat(op, tuple(src) if src else None, attrs, where, name, commute, out)


def any_of(*alts: Pat, name: str | None = None) -> Pat:
    return Pat(alts=tuple(alts), name=name)


@dataclass(frozen=True)
class Match:
    values: dict[str, Value] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)
    body: tuple[Node, ...] = ()  # every producer node the pattern covered, root first

    def bind(self, name: str | None, value: Value, node: Node | None) -> Match:
        values = self.values if name is None else {**self.values, name: value}
        nodes = self.nodes if name is None or node is None else {**self.nodes, name: node}
        body = self.body if node is None or any(n is node for n in self.body) else (*self.body, node)
        return Match(values, nodes, body)


def match(pat: Pat, value: Value, producers: dict[int, Node], m: Match | None = None) -> Iterator[Match]:
    """Every way `pat` matches `value` (lazily, for backtracking)."""
    m = m or Match()
    if pat.name is not None and pat.name in m.values and m.values[pat.name] is not value:
        return
    if pat.alts:
        for alt in pat.alts:
            for m2 in match(alt, value, producers, m):
                yield m2.bind(pat.name, value, None)
        return
    if pat.op is None:
        yield m.bind(pat.name, value, None)
        return
    node = producers.get(value.id)
    if node is None or not _node_fits(pat, node, value):
        return
    m = m.bind(pat.name, value, node)
    if pat.src is None:
        yield m
        return
    if len(pat.src) != len(node.inputs):
        return
    orders = [pat.src, pat.src[::-1]] if pat.commute and len(pat.src) == 2 else [pat.src]
    for order in orders:
        yield from _match_all(order, node.inputs, producers, m)


def _node_fits(pat: Pat, node: Node, value: Value) -> bool:
    return (
        node.op == pat.op
        and pat.out < len(node.outputs)
        and node.outputs[pat.out] is value
        and (pat.attrs is None or node.attrs == pat.attrs)
        and (pat.where is None or pat.where(node))
    )


def _match_all(
    pats: Sequence[Pat], values: Sequence[Value], producers: dict[int, Node], m: Match
) -> Iterator[Match]:
    if not pats:
        yield m
        return
    for m2 in match(pats[0], values[0], producers, m):
        yield from _match_all(pats[1:], values[1:], producers, m2)


# ---------------------------------------------------------------------------------------------
# rules and the rewriter


@dataclass(frozen=True)
class Rewrite:
    op: str
    inputs: tuple[Value, ...]
    attrs: Any
    hits: int = 1


class GraphView:
    """What a rule's `build` may ask about the graph it is rewriting."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.param_ids = {p.value.id for p in graph.params.values()}
        self.producers: dict[int, Node] = graph.producers()
        self.users: dict[int, list[Node]] = graph.users()
        self.escaping = escaping_ids(graph)

    def producer(self, v: Value) -> Node | None:
        return self.producers.get(v.id)

    def is_param(self, v: Value) -> bool:
        return v.id in self.param_ids

    def n_users(self, v: Value) -> int:
        return len(self.users.get(v.id, ())) + (v.id in self.escaping)


Build = Callable[[Match, GraphView], Rewrite | None]


@dataclass(frozen=True)
class Rule:
    name: str
    pat: Pat
    build: Build
    closed: bool = True  # a fusion: the match's inner values must not escape; its nodes are removed


def rewrite_graph(graph: Graph, rules: Sequence[Rule], pass_name: str) -> Graph:
    """Apply `rules` at every node (last to first) and record the hits under `pass_name`."""
    work = _Rewriter(graph)
    hits = 0
    for index in reversed(range(len(work.nodes))):
        node = work.nodes[index]
        if node is None:
            continue
        for rule in rules:
            done = work.try_rule(rule, index, node)
            if done:
                hits += done
                break
    return with_hits(graph.replace(nodes=[n for n in work.nodes if n is not None]), pass_name, hits)


class _Rewriter(GraphView):
    def __init__(self, graph: Graph) -> None:
        super().__init__(graph)
        self.nodes: list[Node | None] = list(graph.nodes)
        self.index = {id(n): i for i, n in enumerate(graph.nodes)}

    def try_rule(self, rule: Rule, index: int, root: Node) -> int:
        """Rewrite at `root` with the first match `rule` accepts; the hits, or 0."""
        if rule.pat.out >= len(root.outputs):
            return 0
        for m in match(rule.pat, root.outputs[rule.pat.out], self.producers):
            if not m.body or m.body[0] is not root:
                continue
            inner = m.body[1:]
            if rule.closed and inner_values_escape(m.body, (root,), self.users, self.escaping):
                continue
            rw = rule.build(m, self)
            if rw is None or not self._fits(rw, root, inner if rule.closed else ()):
                continue
            new = Node(rw.op, rw.inputs, rw.attrs, root.outputs)
            self._apply(index, root, new, inner if rule.closed else ())
            return rw.hits
        return 0

    def _fits(self, rw: Rewrite, root: Node, removed: Sequence[Node]) -> bool:
        """The replacement must compute the root's outputs from values that stay defined."""
        opdef = OPS[rw.op]
        if not isinstance(rw.attrs, opdef.attrs):
            raise TypeError(f"rule built {rw.op} with {type(rw.attrs).__name__} attrs")
        gone = {v.id for n in removed for v in n.outputs}
        if any(v.id in gone for v in rw.inputs) or not defined_before(rw.inputs, self.index[id(root)],
                                                                      self.producers, self.index):
            return False
        try:
            specs = opdef.infer([(v.shape, v.dtype) for v in rw.inputs], rw.attrs)
        except (ValueError, IndexError, KeyError, TypeError):
            return False
        return len(specs) == len(root.outputs) and all(
            shapes_equal(v.shape, s) and v.dtype == d for v, (s, d) in zip(root.outputs, specs, strict=True)
        )

    def _apply(self, index: int, root: Node, new: Node, removed: Sequence[Node]) -> None:
        for old in (root, *removed):
            for v in old.inputs:
                self.users[v.id] = [u for u in self.users.get(v.id, []) if u is not old]
            self.nodes[self.index[id(old)]] = None
        for old in removed:
            for v in old.outputs:
                self.producers.pop(v.id, None)
        for v in new.inputs:
            self.users.setdefault(v.id, []).append(new)
        for v in new.outputs:
            self.producers[v.id] = new
        self.nodes[index] = new
        self.index[id(new)] = index


def where_attrs(**expected: Any) -> Callable[[Node], bool]:
    """A predicate on some attribute fields (the others may be anything)."""
    return lambda n: all(getattr(n.attrs, k, None) == v for k, v in expected.items())

