"""The per-op case table: every op the codegen lowers as a one- or few-node graph with its calls,
inputs and tolerances, and the float64 reference run and comparison the compiled rows are held to
(tests/test_codegen_ops.py on the CPU, tests/test_gpu_ops.py on vulkan).

Float inputs are params (fixed shapes) or rows of a param table picked by the call's tokens (so they
have T rows); quantized weights are compared as the interpreter sees them: dequantized by gguf-py.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from ggufc.codegen.cpu_int8.block32 import int8_kernels
from ggufc.codegen.formats.table import QTYPES, get_format
from ggufc.codegen.target import resolve_target
from ggufc.frontend.hparams import rope_table
from ggufc.ir import ops as O
from ggufc.ir.act_quant import ACT_QUANT_TYPES, ACT_SCHEME, MIN_TYPES, block_mins
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Param, Value
from ggufc.ir.hyper_connections import HcPost, HcPre, HcSinkhorn, ResMix
from ggufc.ir.interp import run_graph
from ggufc.ir.linear_attention import GatedDeltaNet, L2Norm, LightningAttention, RMSNormGated, SsmConv
from ggufc.ir.moe_routing import MoeFFN, MoeRoute, MoeTopkSoftmax
from ggufc.ir.ngram_embedding import PleHash
from ggufc.ir.sparse_indexers import (
    BlockMask,
    BlockTopK,
    CompressedAttention,
    CompressedScore,
    CompressorPool,
    IndexerBlockScore,
    IndexerScore,
    IndexerTopK,
    TokenTopK,
)
from tests.support.fixtures import TensorSpec, encode_tensor

VOCAB = 11  # rows of the token-indexed input tables
N_CTX = 16  # cache rows of the stateful rows
MAX_TOKENS = 16
F32_TOL = 1e-5  # max abs error relative to the reference's max |value|

# ---------------------------------------------------------------------------------------------
# calls


@dataclass(frozen=True)
class Call:
    t: int
    p: int = 0
    decode: bool = False  # run the fixed_tokens=1 entry point

    def __str__(self) -> str:
        return f"{'decode' if self.decode else 'dyn'}(T={self.t}, P={self.p})"


PREFILL = (Call(1), Call(5), Call(7))
DECODE = (Call(1, 3, decode=True),)
BOTH = PREFILL + DECODE
STATEFUL = (Call(5, 0), Call(1, 0), Call(4, 6), Call(3, 13), Call(1, 9, decode=True))
# calls of MAX_TOKENS take the chunked form of the delta-rule scan (codegen CHUNKED_FROM), the others its
# recurrence
CHUNKED = (Call(MAX_TOKENS, 0), Call(1, 0), Call(MAX_TOKENS, 0), Call(1, 9, decode=True))

# ---------------------------------------------------------------------------------------------
# building one row's graph


@dataclass
class ParamData:
    qtype: str
    shape: tuple[int, ...]
    storage: np.ndarray  # GGUF storage: f32 values or uint8 block rows
    values: np.ndarray  # what the interpreter reads (dequantized)


class CaseGraph:
    """A GraphBuilder with the data behind every param and state of one row."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.b = GraphBuilder()
        self.tokens = self.b.input("tokens", ("T",), "int32")
        self.pos = self.b.input("pos", (), "int64")
        self.params: dict[str, ParamData] = {}
        self.states: dict[str, np.ndarray] = {}

    def weight(
        self,
        shape: Sequence[int],
        qtype: str = "F32",
        domain: tuple[float, float] | None = None,
        values: np.ndarray | None = None,
    ) -> Value:
        """A param with random values (N(0, 0.5), or uniform over `domain`) stored as `qtype`."""
        source = f"{self.name}.w{len(self.params)}"
        shape = tuple(shape)
        if values is None:
            values = self._random(shape, domain)
        storage = encode_tensor(TensorSpec(source, shape, "matrix"), values, qtype, self.seed)
        self.params[source] = ParamData(qtype, shape, storage, _decoded(storage, qtype, shape))
        return self.b.param(source, shape, qtype)

    def rows(self, tail: Sequence[int], domain: tuple[float, float] | None = None) -> Value:
        """[T, *tail] activations: rows of a random table picked by the call's tokens."""
        table = self.weight((VOCAB, math.prod(tail)), domain=domain)
        x = self.b.gather(table, self.tokens, "rows")
        return x if len(tail) == 1 else self.b.reshape(x, ("T", *tail), "rows_nd")

    def state(self, shape: Sequence[int], tag: str) -> Value:
        """A state slot prefilled with random values (a cache that already holds earlier tokens)."""
        name = f"{self.name}.{tag}"
        self.states[name] = self._random(tuple(shape), None)
        return self.b.state(name, tuple(shape))

    def emit(self, op: str, inputs: Sequence[Value], attrs: Any, n_out: int = 1) -> tuple[Value, ...]:
        return self.b.emit_multi(op, inputs, attrs, [f"{op}{i}" for i in range(n_out)])

    def finish(self, outputs: Sequence[Value], state_out: dict[str, Value] | None = None) -> Graph:
        return self.b.finish(list(outputs), state_out or {})

    def _random(self, shape: tuple[int, ...], domain: tuple[float, float] | None) -> np.ndarray:
        if domain is None:
            return (0.5 * self.rng.standard_normal(shape)).astype(np.float32)
        return self.rng.uniform(domain[0], domain[1], shape).astype(np.float32)


def _decoded(storage: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if qtype == "F32":
        return np.asarray(storage, dtype=np.float32).reshape(shape)
    return gguf.quants.dequantize(storage, gguf.GGMLQuantizationType[qtype]).reshape(shape).astype(np.float32)


Build = Callable[[CaseGraph], Graph]


@dataclass(frozen=True)
class Case:
    name: str
    op: str  # the op under test (coverage of LOWERING)
    build: Build
    group: str = "f32"
    calls: tuple[Call, ...] = PREFILL  # rows where T=1 changes the kernel ask for BOTH
    compare: str = "close"  # "close", "topk" (sets of indices), "selected" (sets of the indices whose
    # score is finite: -inf rows tie and are never read) or "route" (sets of (id, weight))
    may_xfail: bool = False  # quantized prefill kernels under rework: a schedule error xfails

    @property
    def decode(self) -> bool:
        return any(c.decode for c in self.calls)


@dataclass
class BuiltCase:
    case: Case
    graph: Graph
    data: CaseGraph


def fn_name(case: Case, decode: bool) -> str:
    return re.sub(r"\W", "_", case.name) + ("__decode" if decode else "")


# ---------------------------------------------------------------------------------------------
# the case table

Input = Callable[[CaseGraph], Value]


def rows(*tail: int, domain: tuple[float, float] | None = None) -> Input:
    return lambda cg: cg.rows(tail, domain)


def rows_bcast(n: int) -> Input:
    """[T, 1, n]: a token-dependent operand that broadcasts over the middle axis."""
    return lambda cg: cg.b.reshape(cg.rows((n,)), ("T", 1, n), "rows_b")


def weight(*shape: int, qtype: str = "F32", domain: tuple[float, float] | None = None) -> Input:
    return lambda cg: cg.weight(shape, qtype, domain)


def tokens(cg: CaseGraph) -> Value:
    return cg.tokens


def op_case(name: str, op: str, attrs: Any, *inputs: Input, n_out: int = 1, **case: Any) -> Case:
    """A row whose graph is the single node `op(*inputs)`; its outputs are the graph outputs."""

    def build(cg: CaseGraph) -> Graph:
        return cg.finish(cg.emit(op, [make(cg) for make in inputs], attrs, n_out))

    return Case(name, op, build, **case)


SCALAR_FNS = getattr(O, "SCALAR_FNS", O.BINARY_FNS)  # the binary functions, plus pow where the IR has it
POSITIVE = (0.25, 4.0)
UNARY_DOMAINS = {
    "sqrt": POSITIVE,
    "rsqrt": POSITIVE,
    "recip": POSITIVE,
    "softplus": (-30.0, 30.0),
    "exp": (-4.0, 4.0),
    "gelu_tanh_f16": (-12.0, 12.0),  # past +-10 too, where llama.cpp's table is not read
}
FUSED_PROGRAM = O.FusedElementwise(
    (
        ("unary", O.Unary("silu"), (0,)),  # 3
        ("binary", O.Binary("mul"), (3, 1)),  # 4: [T, 5, 7] * [7]
        ("scalar", O.Scalar("add", 0.5), (4,)),  # 5
        ("binary", O.Binary("sub"), (5, 2)),  # 6: - [T, 1, 7]
        ("unary", O.Unary("tanh"), (6,)),
    ),
    3,
)


def elementwise_cases() -> list[Case]:
    cases = [
        op_case(f"unary-{fn}", "unary", O.Unary(fn), rows(13, domain=UNARY_DOMAINS.get(fn, (-3.0, 3.0))))
        for fn in O.UNARY_FNS
    ]
    for fn in O.BINARY_FNS:
        den = POSITIVE if fn == "div" else None
        # [T, 1, 7] (op) [5, 1] -> [T, 5, 7]: both operands broadcast
        cases.append(
            op_case(
                f"binary-{fn}-bcast",
                "binary",
                O.Binary(fn),
                rows_bcast(7),
                weight(5, 1, domain=den),
                calls=BOTH,
            )
        )
        cases.append(op_case(f"binary-{fn}-same", "binary", O.Binary(fn), rows(13), rows(13, domain=den)))
    for fn in SCALAR_FNS:
        base = POSITIVE if fn == "pow" else None  # a fractional power of a negative base is NaN
        cases.append(op_case(f"scalar-{fn}", "scalar", O.Scalar(fn, 0.37), rows(13, domain=base)))
    return [
        *cases,
        op_case("binary-add-param-first", "binary", O.Binary("add"), weight(13), rows(13)),
        op_case(
            "fused_elementwise-bcast",
            "fused_elementwise",
            FUSED_PROGRAM,
            rows(5, 7),
            weight(7),
            rows_bcast(7),
            calls=BOTH,
        ),
        op_case("swiglu", "swiglu", O.NoAttrs(), rows(12), rows(12), calls=BOTH),
    ]


def reduce_cases() -> list[Case]:
    cases = []
    for fn in O.REDUCE_FNS:
        cases += [
            op_case(f"reduce-{fn}-last-keep{int(keep)}", "reduce", O.Reduce(fn, -1, keep), rows(5, 7))
            for keep in (True, False)
        ]
        cases.append(op_case(f"reduce-{fn}-axis1", "reduce", O.Reduce(fn, 1, False), rows(5, 7)))
        # over the symbolic T axis
        cases.append(op_case(f"reduce-{fn}-tokens", "reduce", O.Reduce(fn, 0, True), rows(5, 7), calls=BOTH))
    return [
        *cases,
        op_case("softmax-last", "softmax", O.Softmax(-1), rows(3, 9, domain=(-4, 4)), calls=BOTH),
        op_case("softmax-axis1", "softmax", O.Softmax(1), rows(5, 7, domain=(-4, 4))),
        op_case("rms_norm-weight", "rms_norm", O.RMSNorm(1e-6), rows(3, 16), weight(16), calls=BOTH),
        op_case("rms_norm-plain", "rms_norm", O.RMSNorm(1e-5), rows(13)),
    ]


def _reshape_case(name: str, shape: tuple[Any, ...]) -> Case:
    def build(cg: CaseGraph) -> Graph:
        # reshape a computed value: a reshape of the gathered rows would test nothing but the gather
        return cg.finish([cg.b.reshape(cg.b.unary("neg", cg.rows((12,)), "neg"), shape, "reshaped")])

    return Case(name, "reshape", build, calls=BOTH)


def _gather_by_topk_ids(cg: CaseGraph) -> Graph:
    _, ids = cg.b.emit_multi("topk", [cg.rows((7,))], O.TopK(3), ["vals", "ids"])
    return cg.finish([cg.b.gather(cg.weight((7,)), ids, "picked")])


def _computed_table(cg: CaseGraph) -> Value:
    return cg.b.unary("neg", cg.weight((VOCAB, 6)), "table")


def movement_cases() -> list[Case]:
    return [
        _reshape_case("reshape-split", ("T", 3, 4)),
        _reshape_case("reshape-flatten", ("T*12",)),
        op_case("transpose-102", "transpose", O.Transpose((1, 0, 2)), rows(3, 4), calls=BOTH),
        op_case("transpose-210", "transpose", O.Transpose((2, 1, 0)), rows(3, 4)),
        op_case("transpose-param", "transpose", O.Transpose((2, 0, 1)), weight(3, 5, 7)),
        op_case("slice-last", "slice", O.Slice(-1, 2, 9), rows(13)),
        op_case("slice-mid", "slice", O.Slice(1, 1, 3), rows(3, 4)),
        op_case("slice-param", "slice", O.Slice(0, 1, 4), weight(6, 5)),
        op_case("concat-last", "concat", O.Concat(-1), rows(5), rows(8)),
        op_case("concat-tokens", "concat", O.Concat(0), rows(5), rows(5), calls=BOTH),
        op_case("concat-three", "concat", O.Concat(1), rows(2, 4), rows(3, 4), rows(1, 4)),
        op_case("last_token-2d", "last_token", O.NoAttrs(), rows(9), calls=BOTH),
        op_case("last_token-3d", "last_token", O.NoAttrs(), rows(2, 5)),
        op_case("gather-f32-param", "gather", O.NoAttrs(), weight(VOCAB, 13), tokens),
        op_case("gather-computed-table", "gather", O.NoAttrs(), _computed_table, tokens, calls=BOTH),
        Case("gather-2d-ids", "gather", _gather_by_topk_ids),
    ]


def selection_cases() -> list[Case]:
    logits = (-3.0, 3.0)
    return [
        op_case("topk-k3", "topk", O.TopK(3), rows(9), n_out=2, compare="topk", calls=BOTH),
        op_case("topk-3d-k1", "topk", O.TopK(1), rows(2, 9), n_out=2, compare="topk"),
        op_case("topk-full-sort", "topk", O.TopK(4), rows(4), n_out=2, compare="topk"),
        op_case(
            "moe_route-norm",
            "moe_route",
            MoeRoute(2),
            rows(6, domain=logits),
            n_out=2,
            compare="route",
            calls=BOTH,
        ),
        op_case(
            "moe_route-raw",
            "moe_route",
            MoeRoute(3, normalize=False),
            rows(5, domain=logits),
            n_out=2,
            compare="route",
        ),
    ]


def _rope_case(mode: str, n_rot: int, head_dim: int = 16) -> Case:
    table = rope_table(N_CTX, n_rot, 10000.0, 1.0, None)

    def build(cg: CaseGraph) -> Graph:
        inputs = [cg.rows((3, head_dim)), cg.pos, cg.weight(table.shape, values=table)]
        return cg.finish(cg.emit("rope", inputs, O.Rope(mode, n_rot)))

    return Case(f"rope-{mode}-rot{n_rot}of{head_dim}", "rope", build, calls=STATEFUL)


def _cache_write(cg: CaseGraph, tag: str, n_kv: int, dim: int) -> Value:
    """Write this call's [T, n_kv, dim] rows into a prefilled cache slot at pos."""
    cache = cg.state((N_CTX, n_kv, dim), tag)
    return cg.emit("cache_write", [cache, cg.rows((n_kv, dim)), cg.pos], O.NoAttrs())[0]


def _attention_case(n_head: int, n_kv: int, dim: int, f16_pv_below: int = 0, window: int = 0,
                    softcap: float = 0.0, sinks: bool = False) -> Case:
    """f16_pv_below: the CPU target's rounding of llama.cpp's one-row flash attention for calls
    shorter than that (here the 1- to 4-token calls; the 5-token one keeps float32). `window`,
    `softcap`, `sinks`: a sliding window, a tanh softcap on the scores, a sink logit per head
    (drawn large enough, uniform in [-1, 3], to take a good share of each row)."""

    def build(cg: CaseGraph) -> Graph:
        q = cg.rows((n_head, dim))
        kc, vc = _cache_write(cg, "k", n_kv, dim), _cache_write(cg, "v", n_kv, dim)
        attrs = O.Attention(1.0 / math.sqrt(dim), f16_pv_below=f16_pv_below, window=window, softcap=softcap,
                            sinks=sinks)
        extra = [cg.weight((n_head,), domain=(-1.0, 3.0))] if sinks else []
        out = cg.emit("attention", [q, kc, vc, cg.pos, *extra], attrs)[0]
        return cg.finish([out], {f"{cg.name}.k": kc, f"{cg.name}.v": vc})

    if f16_pv_below:
        return Case(f"attention-h{n_head}-kv{n_kv}-d{dim}-f16pv", "attention", build, group="cpu_rounding",
                    calls=STATEFUL)
    extra = (f"-w{window}" if window else "") + (f"-cap{softcap}" if softcap else "") + ("-sinks" if sinks else "")
    return Case(f"attention-h{n_head}-kv{n_kv}-d{dim}{extra}", "attention", build, calls=STATEFUL)


def _cache_write_case(cg: CaseGraph) -> Graph:
    c = _cache_write(cg, "c", 2, 8)
    return cg.finish([c], {f"{cg.name}.c": c})


def position_cases() -> list[Case]:
    return [
        _rope_case("norm", 16),
        _rope_case("neox", 16),
        _rope_case("norm", 8),
        _rope_case("neox", 8),
        _attention_case(4, 2, 8),
        _attention_case(3, 1, 16),
        _attention_case(2, 2, 4),
        _attention_case(4, 2, 32, f16_pv_below=5),
        _attention_case(3, 1, 16, f16_pv_below=5),
        _attention_case(4, 2, 32, window=4),  # the row kernel: windows shorter than the calls' reach
        _attention_case(4, 1, 32, window=3, softcap=0.3),  # one KV head: decode runs the head group
        _attention_case(2, 2, 32, softcap=0.3),
        _attention_case(4, 1, 32, window=3, sinks=True),  # gpt-oss: sinks, window layers, grouped heads
        _attention_case(2, 2, 32, sinks=True),
        Case("cache_write", "cache_write", _cache_write_case, calls=STATEFUL),
    ]


@dataclass(frozen=True)
class MoeShape:
    n_embd: int
    hidden: int
    n_exp: int = 5
    k: int = 2


def _moe_ffn_case(
    name: str, qtype: str, shape: MoeShape, *, gate: bool, scales: tuple[str, ...], normalize: bool,
    act_schemes: tuple[str, str] = ("", ""),
) -> Case:
    s = shape
    attrs = MoeFFN(k=s.k, normalize=normalize, has_gate=gate, expert_scales=scales, act_schemes=act_schemes)
    experts = [weight(s.n_exp, s.hidden, s.n_embd, qtype=qtype)] * (2 if gate else 1)  # gate, up
    experts.append(weight(s.n_exp, s.n_embd, s.hidden, qtype=qtype))  # down
    per_expert = [weight(s.n_exp, domain=(0.5, 1.5)) for _ in scales]
    return op_case(
        name,
        "moe_ffn",
        attrs,
        rows(s.n_embd),
        weight(s.n_exp, s.n_embd),
        *experts,
        *per_expert,
        group="act8" if act_schemes != ("", "") else "moe",
        calls=BOTH,
    )


def _matmul_id_case(qtype: str, k_dim: int, per_slot: bool, group: str) -> Case:
    n_exp, slots, n = 5, 2, 12

    def build(cg: CaseGraph) -> Graph:
        _, ids = cg.b.emit_multi("topk", [cg.rows((n_exp,))], O.TopK(slots), ["vals", "ids"])
        x = cg.rows((slots if per_slot else 1, k_dim))
        return cg.finish(cg.emit("matmul_id", [x, cg.weight((n_exp, n, k_dim), qtype), ids], O.NoAttrs()))

    return Case(
        f"matmul_id-{qtype}-{'per_slot' if per_slot else 'shared'}",
        "matmul_id",
        build,
        group=group,
        calls=BOTH,
    )


def moe_cases() -> list[Case]:
    small, kquant = MoeShape(16, 12), MoeShape(256, 256)
    return [
        _moe_ffn_case(
            "moe_ffn-f32-gate-scales", "F32", small, gate=True, scales=("gate", "up", "down"), normalize=True
        ),
        _moe_ffn_case("moe_ffn-f32-nogate-raw", "F32", small, gate=False, scales=("up",), normalize=False),
        _moe_ffn_case("moe_ffn-Q8_0", "Q8_0", MoeShape(64, 32), gate=True, scales=(), normalize=True),
        _moe_ffn_case("moe_ffn-Q4_K", "Q4_K", kquant, gate=True, scales=("down",), normalize=True),
        _moe_ffn_case("moe_ffn-Q8_0-act8", "Q8_0", MoeShape(64, 32), gate=True, scales=(), normalize=True,
                      act_schemes=("q8_0", "q8_0")),
        _moe_ffn_case("moe_ffn-Q4_K-act8", "Q4_K", kquant, gate=False, scales=("up",), normalize=True,
                      act_schemes=("q8_K", "q8_K")),
        _matmul_id_case("F32", 13, False, "moe"),
        _matmul_id_case("F32", 13, True, "moe"),
    ]


def _row_len(qtype: str) -> int:
    """Two blocks of the format (at least 64), so a row holds more than one block."""
    return 2 * max(32, get_format(qtype).block)


def _matmul_case(qtype: str, decode: bool) -> Case:
    k = _row_len(qtype)
    kind = "gemv" if decode else "prefill"
    return op_case(
        f"matmul-{qtype}-{kind}",
        "matmul",
        O.NoAttrs(),
        rows(k),
        weight(20, k, qtype=qtype),
        group=f"q{kind}",
        calls=DECODE if decode else PREFILL,
        may_xfail=not decode and qtype != "F32",
    )


def _dequantize_case(qtype: str, shape: tuple[int, ...]) -> Case:
    return op_case(
        f"dequantize-{qtype}-{len(shape)}d",
        "dequantize",
        O.NoAttrs(),
        weight(*shape, qtype=qtype),
        group="quant",
        calls=PREFILL[:1],
    )


def _quantized_gather_case(qtype: str) -> Case:
    table = weight(VOCAB, _row_len(qtype), qtype=qtype)
    return op_case(f"gather-{qtype}", "gather", O.NoAttrs(), table, tokens, group="quant")


def _dequantized_q4_0(cg: CaseGraph) -> Value:
    """The run_passes=False spelling: a standalone dequantize feeding an f32 matmul."""
    return cg.b.dequantize(cg.weight((20, 64), "Q4_0"), "w")


def _single_row(cg: CaseGraph) -> Value:
    """A literal 1-row activation (after last_token) takes the gemv kernel in a dynamic-T function."""
    return cg.b.emit("last_token", [cg.rows((64,))], O.NoAttrs(), "last")


def _act8_rows(k: int, scheme: str) -> Callable[[CaseGraph], Value]:
    """Activations rounded to 8-bit blocks, as the quantize_activations pass feeds quantised weights."""
    return lambda cg: cg.b.emit("quantize_act", [cg.rows((k,))], O.QuantizeAct(scheme), "xq")


def _act8_matmul_case(qtype: str, n: int, k: int, decode: bool) -> Case:
    """On a CPU with integer dot products a decode row runs the 8-bit GEMV (codegen/cpu_int8/block32.py), which
    rounds the activations itself; prefill runs quantize_act then the float kernel. Weights with
    block minimums read q8_1 activations: matmul(xq, W, block sums)."""
    kind = "gemv" if decode else "prefill"
    name, calls = f"matmul-{qtype}-act8-{n}x{k}-{kind}", DECODE if decode else PREFILL
    if qtype not in MIN_TYPES:
        return op_case(name, "matmul", O.NoAttrs(), _act8_rows(k, ACT_SCHEME[qtype]), weight(n, k, qtype=qtype),
                       group="act8", calls=calls)
    rounded: dict[str, Value] = {}

    def q8_1_rows(cg: CaseGraph) -> Value:
        rounded["x"], rounded["sums"] = cg.b.emit_multi("quantize_act", [cg.rows((k,))], O.QuantizeAct("q8_1"),
                                                        ["xq", "xsums"])
        return rounded["x"]

    return op_case(name, "matmul", O.NoAttrs(), q8_1_rows, weight(n, k, qtype=qtype), lambda cg: rounded["sums"],
                   group="act8", calls=calls)


def act8_cases() -> list[Case]:
    cases = [op_case("quantize_act", "quantize_act", O.QuantizeAct("q8_0"), rows(96), group="act8", calls=BOTH),
             op_case("quantize_act-q8_1", "quantize_act", O.QuantizeAct("q8_1"), rows(96), n_out=2, group="act8",
                     calls=BOTH),
             op_case("quantize_act-q8_K", "quantize_act", O.QuantizeAct("q8_K"), rows(512), group="act8",
                     calls=BOTH)]
    for qtype in sorted(ACT_QUANT_TYPES):
        shapes = ((20, 64), (4, 128), (36, 96)) if ACT_SCHEME[qtype] == "q8_0" else ((20, 256), (12, 512))
        for n, k in shapes:
            cases += [_act8_matmul_case(qtype, n, k, True), _act8_matmul_case(qtype, n, k, False)]
    return cases


# the weights the 8-bit kernels take (codegen/cpu_int8/block32.py; the K-quants codegen/cpu_int8/kquant.py)
INT8_TYPES = ("Q4_0", "Q4_1", "Q8_0")
KQUANT_INT8_TYPES = ("Q4_K", "Q5_K", "Q6_K")
HAS_INT8 = int8_kernels(resolve_target("llvm")) is not None


def int8_cases() -> list[Case]:
    """The ops of passes/fuse_int8.py: prompt GEMMs and one-token GEMVs that round their input, and
    the decode GEMV groups with an RMSNorm or SwiGLU prologue and a residual epilogue."""
    cases = []
    for qtype in INT8_TYPES:
        scheme = "q8_1" if qtype in MIN_TYPES else ACT_SCHEME[qtype]  # block minimums read the block sums
        for n, k in ((20, 64), (4, 128), (36, 128)):
            cases.append(op_case(f"int8_matmul-{qtype}-{n}x{k}", "int8_matmul", O.Int8Matmul(scheme), rows(k),
                                 weight(n, k, qtype=qtype), group="int8", calls=BOTH))
        w = [weight(n, 128, qtype=qtype) for n in (20, 8, 12)]
        cases += [
            op_case(f"int8_gemv_group-{qtype}-three", "int8_gemv_group", O.GemvGroup(scheme, 3), rows(128), *w,
                    n_out=3, group="int8", calls=DECODE),
            op_case(f"int8_gemv_group-{qtype}-rms_norm", "int8_gemv_group", O.GemvGroup(scheme, 2, "rms_norm", 1e-5),
                    rows(128), weight(128), *w[:2], n_out=2, group="int8", calls=DECODE),
            op_case(f"int8_gemv_group-{qtype}-swiglu-residual", "int8_gemv_group",
                    O.GemvGroup(scheme, 1, "swiglu", residual=True), rows(128), rows(128), w[0], rows(20),
                    group="int8", calls=DECODE),
        ]
    for qtype in KQUANT_INT8_TYPES:  # q8_K activations, 256-value super-blocks
        for n, k in ((20, 256), (8, 512)):
            cases.append(op_case(f"int8_matmul-{qtype}-{n}x{k}", "int8_matmul", O.Int8Matmul("q8_K"), rows(k),
                                 weight(n, k, qtype=qtype), group="int8", calls=BOTH))
        w = [weight(n, 256, qtype=qtype) for n in (20, 8, 12)]
        cases += [
            op_case(f"int8_gemv_group-{qtype}-three", "int8_gemv_group", O.GemvGroup("q8_K", 3), rows(256), *w,
                    n_out=3, group="int8", calls=DECODE),
            op_case(f"int8_gemv_group-{qtype}-rms_norm", "int8_gemv_group", O.GemvGroup("q8_K", 2, "rms_norm", 1e-5),
                    rows(256), weight(256), *w[:2], n_out=2, group="int8", calls=DECODE),
            op_case(f"int8_gemv_group-{qtype}-swiglu-residual", "int8_gemv_group",
                    O.GemvGroup("q8_K", 1, "swiglu", residual=True), rows(256), rows(256), w[0], rows(20),
                    group="int8", calls=DECODE),
        ]
    return cases


def quant_cases() -> list[Case]:
    cases = []
    for qtype in QTYPES:
        cases += [
            _matmul_case(qtype, False),
            _matmul_case(qtype, True),
            _quantized_gather_case(qtype),
            _dequantize_case(qtype, (6, _row_len(qtype))),
            _matmul_id_case(qtype, _row_len(qtype), False, "quant"),
        ]
    return [
        *cases,
        _dequantize_case("Q8_0", (3, 4, 64)),
        _dequantize_case("Q4_K", (2, 3, 256)),
        op_case("matmul-computed-weight", "matmul", O.NoAttrs(), rows(64), _dequantized_q4_0, group="quant"),
        op_case(
            "matmul-single-row",
            "matmul",
            O.NoAttrs(),
            _single_row,
            weight(20, 64, qtype="Q8_0"),
            group="quant",
        ),
    ]


def _ssm_conv_case(dilation: int) -> Case:
    n_ch, k = 13, 4

    def build(cg: CaseGraph) -> Graph:
        st = cg.state((n_ch, (k - 1) * dilation), "conv")
        new, y = cg.emit("ssm_conv", [st, cg.rows((n_ch,)), cg.weight((n_ch, k))], SsmConv(dilation), 2)
        return cg.finish([y, new], {st.name: new})

    return Case(f"ssm_conv-dilation{dilation}", "ssm_conv", build, group="recurrent", calls=STATEFUL)


def _gated_delta_net_case(head_map: str, hv: int, hk: int, dk: int, key_decay: bool = False,
                          calls: tuple[Call, ...] = STATEFUL) -> Case:
    """Decay logits g <= 0 and write strengths beta in (0, 1), as the gates make them; key_decay:
    one decay per key index (KDA)."""

    def build(cg: CaseGraph) -> Graph:
        st = cg.state((hv, dk, dk), "ssm")
        q, k = cg.rows((hk, dk)), cg.rows((hk, dk))
        g_shape = (hv, dk) if key_decay else (hv,)
        v, g, beta = cg.rows((hv, dk)), cg.rows(g_shape, domain=(-2.0, 0.0)), cg.rows((hv,), domain=(0.0, 1.0))
        attrs = GatedDeltaNet(head_map, dk**-0.5, key_decay)
        new, o = cg.emit("gated_delta_net", [st, q, k, v, g, beta], attrs, 2)
        return cg.finish([o, new], {st.name: new})

    kind = ("-key" if key_decay else "") + ("-long" if calls is CHUNKED else "")
    return Case(f"gated_delta_net{kind}-{head_map}-{hv}x{hk}-d{dk}", "gated_delta_net", build, group="recurrent",
                calls=calls)


def _lightning_attention_case(h: int, dk: int, dv: int, calls: tuple[Call, ...] = STATEFUL) -> Case:
    """minimax-01's slopes for h heads, the decay scale of the first of three layers."""
    from ggufc.ir.linear_attention import lightning_layer_scale, lightning_slopes

    def build(cg: CaseGraph) -> Graph:
        st = cg.state((h, dk, dv), "s")
        attrs = LightningAttention(lightning_slopes(h), lightning_layer_scale(0, 3))
        new, o = cg.emit("lightning_attention", [st, cg.rows((h, dk)), cg.rows((h, dk)), cg.rows((h, dv))], attrs, 2)
        return cg.finish([o, new], {st.name: new})

    kind = "-long" if calls is CHUNKED else ""
    return Case(f"lightning_attention{kind}-{h}-d{dk}x{dv}", "lightning_attention", build, group="recurrent",
                calls=calls)


def recurrent_cases() -> list[Case]:
    """The gated delta-net family: stateful scans (outputs and new state) and the two norms."""
    return [
        _ssm_conv_case(1),
        _ssm_conv_case(2),
        _gated_delta_net_case("tiled", 4, 2, 16),
        _gated_delta_net_case("interleaved", 6, 2, 12),
        _gated_delta_net_case("tiled", 2, 2, 16, key_decay=True),
        _gated_delta_net_case("tiled", 3, 3, 12, key_decay=True),
        _gated_delta_net_case("tiled", 4, 2, 16, calls=CHUNKED),
        _gated_delta_net_case("interleaved", 4, 2, 16, key_decay=True, calls=CHUNKED),
        _lightning_attention_case(2, 16, 16),
        _lightning_attention_case(3, 12, 5),
        _lightning_attention_case(4, 16, 8, calls=CHUNKED),
        op_case("l2_norm", "l2_norm", L2Norm(1e-6), rows(3, 7), group="recurrent", calls=BOTH),
        *[
            op_case(f"rms_norm_gated-{act}", "rms_norm_gated", RMSNormGated(1e-5, act), rows(3, 8), weight(8),
                    rows(3, 8), group="recurrent", calls=BOTH)
            for act in ("silu", "sigmoid")
        ],
    ]


def _hc_pre_case(post: bool) -> Case:
    hc, e, rank = 3, 8, 4

    def build(cg: CaseGraph) -> Graph:
        ins = [cg.rows((hc, e)), cg.weight((hc, e)), cg.weight((rank, hc * e)), cg.weight((hc * e, rank))]
        ins += [cg.weight((hc, hc * e))] if post else []
        return cg.finish(cg.emit("hc_pre", ins, HcPre(hc, 1e-5, post=post), 2 if post else 1))

    return Case(f"hc_pre-{'post' if post else 'collapse'}", "hc_pre", build, group="qwen4exp", calls=BOTH)


def _indexer_score_case(ratio: int, n_rot: int) -> Case:
    di, nb1 = 8, N_CTX // ratio + 1

    def build(cg: CaseGraph) -> Graph:
        ins = [cg.rows((2, di)), cg.state((N_CTX, di), "idx"), cg.weight((di,)), cg.weight((nb1, n_rot // 2, 2))]
        return cg.finish(cg.emit("indexer_score", ins, IndexerScore(ratio, 1e-5, n_rot)))

    return Case(f"indexer_score-r{ratio}-rot{n_rot}", "indexer_score", build, group="qwen4exp", calls=STATEFUL)


def _selected(cg: CaseGraph, ratio: int, width: int) -> Value:
    """indexer_topk over random block scores: cells in heap order, -1 where no visible cell."""
    scores = cg.rows((N_CTX // ratio + 1,))
    return cg.emit("indexer_topk", [scores, cg.pos], IndexerTopK(ratio, width))[0]


def _indexer_topk_case(ratio: int, width: int) -> Case:
    return Case(f"indexer_topk-r{ratio}-w{width}", "indexer_topk",
                lambda cg: cg.finish([_selected(cg, ratio, width)]), group="qwen4exp", calls=STATEFUL)


def _index_mask_case(cg: CaseGraph) -> Graph:
    return cg.finish([cg.emit("index_mask", [_selected(cg, 3, 5), cg.pos], O.NoAttrs())[0]])


def _qsa_attention_case(mask: str) -> Case:
    def build(cg: CaseGraph) -> Graph:
        q = cg.rows((4, 8))
        kc, vc = _cache_write(cg, "k", 2, 8), _cache_write(cg, "v", 2, 8)
        sel = _selected(cg, 3, 5)
        extra = sel if mask == "indices" else cg.emit("index_mask", [sel, cg.pos], O.NoAttrs())[0]
        out = cg.emit("attention", [q, kc, vc, cg.pos, extra], O.Attention(0.35, mask))[0]
        return cg.finish([out], {f"{cg.name}.k": kc, f"{cg.name}.v": vc})

    return Case(f"attention-qsa-{mask}", "attention", build, group="qwen4exp", calls=STATEFUL)


def _ple_hash_case(cg: CaseGraph) -> Graph:
    name = f"{cg.name}.hist"
    cg.states[name] = cg.rng.integers(0, VOCAB, N_CTX).astype(np.int32)
    hist = cg.b.state(name, (N_CTX,), "int32")
    new = cg.emit("cache_write", [hist, cg.tokens, cg.pos], O.NoAttrs())[0]
    attrs = PleHash(3, 2, (0x9E3779B97F4A7C15, 3, (1 << 40) + 5), (0, 11, 22, 33), (11, 11, 7, 5), eos=2)
    rows_ = cg.emit("ple_hash", [new, cg.tokens, cg.pos], attrs)[0]
    return cg.finish([rows_, new], {name: new})


def _moe_shared_case(name: str, qtype: str, e: int, f: int, fs: int, shared_schemes: tuple[str, str] = ("", "")
                     ) -> Case:
    """With `shared_schemes`, the shared expert's inputs rounded as llama.cpp rounds them (a CPU kernel)."""
    attrs = MoeFFN(k=2, expert_scales=("down",), merged_gate_up=True, shared=True,
                     shared_scales=("gate", "up", "down"), shared_act_schemes=shared_schemes)
    return op_case(name, "moe_ffn", attrs, rows(e), weight(5, e), weight(5, 2 * f, e, qtype=qtype),
                   weight(5, e, f, qtype=qtype), weight(5, domain=(0.5, 1.5)), weight(e),
                   weight(fs, e, qtype=qtype), weight(fs, e, qtype=qtype), weight(e, fs, qtype=qtype),
                   *[weight(1, domain=(0.5, 1.5)) for _ in range(3)],
                   group="act8" if any(shared_schemes) else "qwen4exp", calls=BOTH)


def qwen4exp_cases() -> list[Case]:
    """Hyper-connection mix and combine, QSA scoring / selection / mask / masked and sparse
    attention, the PLE hash, and the MoE with merged gate_up experts and a gated shared expert."""
    return [
        _hc_pre_case(True),
        _hc_pre_case(False),
        op_case("hc_post", "hc_post", HcPost(), rows(3, 8), rows(8), rows(3), group="qwen4exp", calls=BOTH),
        *[op_case(f"res_mix-{n}", "res_mix", ResMix(1e-5), rows(n, 8), rows(8), weight(8), group="qwen4exp",
                  calls=BOTH) for n in (1, 3)],
        _indexer_score_case(4, 8),
        _indexer_score_case(3, 6),
        _indexer_topk_case(3, 5),
        _indexer_topk_case(4, 20),
        Case("index_mask", "index_mask", _index_mask_case, group="qwen4exp", calls=STATEFUL),
        _qsa_attention_case("additive"),
        _qsa_attention_case("indices"),
        Case("ple_hash", "ple_hash", _ple_hash_case, group="qwen4exp", calls=STATEFUL),
        _moe_shared_case("moe_ffn-merged-shared-f32", "F32", 16, 12, 10),
        _moe_shared_case("moe_ffn-merged-shared-Q8_0", "Q8_0", 32, 32, 32),
        _moe_shared_case("moe_ffn-merged-shared-F16-rounded", "F16", 16, 12, 10, ("f16", "f16")),
        _moe_shared_case("moe_ffn-merged-shared-Q8_0-act8", "Q8_0", 32, 32, 32, ("q8_0", "q8_0")),
    ]


def _compressed_score_case(ratio: int) -> Case:
    def build(cg: CaseGraph) -> Graph:
        ins = [cg.rows((3, 8)), cg.rows((3,)), cg.weight((N_CTX // ratio, 8)), cg.pos]
        return cg.finish(cg.emit("compressed_score", ins, CompressedScore(ratio)))

    return Case(f"compressed_score-r{ratio}", "compressed_score", build, group="compressed", calls=STATEFUL)


def _compressed_select_case(ratio: int, top_k: int) -> Case:
    """The CSA selection: the top `top_k` compressed rows by indexer score (compared on indices)."""

    def build(cg: CaseGraph) -> Graph:
        ins = [cg.rows((2, 8)), cg.rows((2,)), cg.weight((N_CTX // ratio, 8)), cg.pos]
        score = cg.emit("compressed_score", ins, CompressedScore(ratio))[0]
        return cg.finish(cg.emit("topk", [score], O.TopK(top_k), 2))

    return Case(f"compressed_select-r{ratio}-k{top_k}", "topk", build, group="compressed", calls=STATEFUL,
                compare="selected")


def _compressed_attention_case(window: int, ratio: int, top_k: int) -> Case:
    """Attention with sinks over a cache written this call, plus compressed rows (all of them, or
    the top `top_k` by an indexer score when top_k > 0)."""

    def build(cg: CaseGraph) -> Graph:
        q = cg.rows((4, 8))
        cache = cg.state((N_CTX, 8), "c")
        kc = cg.emit("cache_write", [cache, cg.rows((8,)), cg.pos], O.NoAttrs())[0]
        ins = [q, kc, cg.weight((4,)), cg.pos]
        attrs = CompressedAttention(0.35, window, ratio, selected=top_k > 0)
        if ratio:
            rows_ = cg.weight((N_CTX // ratio, 8))
            ins.append(rows_)
        if top_k:
            score = cg.emit("compressed_score", [cg.rows((2, 8)), cg.rows((2,)), rows_, cg.pos],
                            CompressedScore(ratio))[0]
            ins.append(cg.emit("topk", [score], O.TopK(top_k), 2)[1])
        return cg.finish([cg.emit("compressed_attention", ins, attrs)[0]], {f"{cg.name}.c": kc})

    return Case(f"compressed_attention-w{window}-r{ratio}-k{top_k}", "compressed_attention", build, group="compressed",
                calls=STATEFUL)


def _compressor_pool_case(ratio: int, overlap: bool, wide: int) -> Case:
    """This call's projections written into prefilled kv and score states, then every block pooled."""
    def build(cg: CaseGraph) -> Graph:
        written = [cg.emit("cache_write", [cg.state((N_CTX, wide), tag), cg.rows((wide,)), cg.pos], O.NoAttrs())[0]
                   for tag in ("kv", "score")]
        pooled = cg.emit("compressor_pool", [*written, cg.weight((ratio, wide))], CompressorPool(ratio, overlap))
        return cg.finish([pooled[0]], {f"{cg.name}.kv": written[0], f"{cg.name}.score": written[1]})

    return Case(f"compressor_pool-r{ratio}{'-overlap' if overlap else ''}", "compressor_pool", build,
                group="compressed", calls=STATEFUL)


def compressed_cases() -> list[Case]:
    """Compressed rows (deepseek4): the compressor's pooling, the lightning indexer's scores,
    attention with sinks over a sliding window, plus every complete row or the selected ones."""
    return [
        _compressor_pool_case(4, True, 12),
        _compressor_pool_case(8, False, 6),
        op_case("hc_post-comb", "hc_post", HcPost(comb=True), rows(4, 8), rows(8), rows(4), rows(4, 4),
                group="compressed", calls=BOTH),
        op_case("hc_sinkhorn", "hc_sinkhorn", HcSinkhorn(4, 1e-5, hc_eps=1e-3, n_iter=3), rows(4, 8),
                weight(24, 32), weight(3), weight(24), n_out=3, group="compressed", calls=BOTH),
        op_case("hc_sinkhorn-collapse", "hc_sinkhorn", HcSinkhorn(4, 1e-5, hc_eps=1e-3, post=False),
                rows(4, 8), weight(4, 32), weight(1), weight(4), group="compressed", calls=BOTH),
        _compressed_score_case(4),
        _compressed_select_case(2, 3),
        _compressed_attention_case(3, 0, 0),
        _compressed_attention_case(5, 4, 0),
        _compressed_attention_case(5, 2, 3),
    ]


def _token_selected(cg: CaseGraph, width: int, di: int = 8) -> Value:
    """DSA: lightning-indexer scores over a prefilled key cache, then the token top-k."""
    ins = [cg.rows((2, di)), cg.state((N_CTX, di), "lid"), cg.rows((2,))]
    score = cg.emit("token_score", [*ins[:3], cg.pos], O.NoAttrs())[0]
    return cg.emit("token_topk", [score, cg.pos], TokenTopK(width))[0]


def _token_score_case(cg: CaseGraph) -> Graph:
    ins = [cg.rows((3, 8)), cg.state((N_CTX, 8), "lid"), cg.rows((3,))]
    return cg.finish([cg.emit("token_score", [*ins, cg.pos], O.NoAttrs())[0]])


def _latent_attention_case(cg: CaseGraph) -> Graph:
    """MLA over its latent cache: one cache for keys and values, reading only the selected cells."""
    q = cg.rows((3, 12))
    kc = _cache_write(cg, "latent", 1, 12)
    out = cg.emit("attention", [q, kc, kc, cg.pos, _token_selected(cg, 5)], O.Attention(0.3, "indices"))[0]
    return cg.finish([out], {f"{cg.name}.latent": kc})


def dsa_cases() -> list[Case]:
    """DSA's lightning-indexer scores and token top-k (the kernel's heap select, so the same cells in
    the same order as the reference), attention over MLA's latent cache at the selected cells, and
    MLA's per-head matmul."""
    return [
        Case("token_score", "token_score", _token_score_case, group="dsa", calls=STATEFUL),
        *[Case(f"token_topk-w{w}", "token_topk", lambda cg, w=w: cg.finish([_token_selected(cg, w)]), group="dsa",
               calls=STATEFUL) for w in (5, 20)],
        Case("attention-latent-indices", "attention", _latent_attention_case, group="dsa", calls=STATEFUL),
        *[op_case(f"head_matmul-{q}", "head_matmul", O.NoAttrs(), rows(3, 32), weight(3, 8, 32, qtype=q),
                  group="dsa", calls=BOTH) for q in ("F32", "F16", "Q8_0")],
    ]


def _block_score_case(block: int) -> Case:
    def build(cg: CaseGraph) -> Graph:
        ins = [cg.rows((2, 8)), cg.state((N_CTX, 8), "idx")]
        return cg.finish(cg.emit("indexer_block_score", ins, IndexerBlockScore(block)))

    return Case(f"indexer_block_score-b{block}", "indexer_block_score", build, group="minimax-m3", calls=STATEFUL)


def _selected_blocks(cg: CaseGraph, block: int, top_k: int, local: int) -> Value:
    """block_topk over random per-group block scores: local blocks, then the best earlier ones."""
    scores = cg.rows((2, N_CTX // block))
    return cg.emit("block_topk", [scores, cg.pos], BlockTopK(block, top_k, local))[0]


def _block_topk_case(block: int, top_k: int, local: int) -> Case:
    return Case(f"block_topk-b{block}-k{top_k}-l{local}", "block_topk",
                lambda cg: cg.finish([_selected_blocks(cg, block, top_k, local)]), group="minimax-m3", calls=STATEFUL)


def _block_mask_case(cg: CaseGraph) -> Graph:
    return cg.finish([cg.emit("block_mask", [_selected_blocks(cg, 3, 2, 1), cg.pos], BlockMask(3))[0]])


def _msa_attention_case(mask: str) -> Case:
    def build(cg: CaseGraph) -> Graph:
        q = cg.rows((4, 8))
        kc, vc = _cache_write(cg, "k", 2, 8), _cache_write(cg, "v", 2, 8)
        sel = _selected_blocks(cg, 3, 2, 1)
        extra = sel if mask == "blocks" else cg.emit("block_mask", [sel, cg.pos], BlockMask(3))[0]
        out = cg.emit("attention", [q, kc, vc, cg.pos, extra], O.Attention(0.35, mask, 3 if mask == "blocks" else 0))
        return cg.finish([out[0]], {f"{cg.name}.k": kc, f"{cg.name}.v": vc})

    return Case(f"attention-msa-{mask}", "attention", build, group="minimax-m3", calls=STATEFUL)


def minimax_m3_cases() -> list[Case]:
    """MSA: per-group block scores, the block selection (local blocks first), its per-group mask,
    and attention over the selected blocks (masked and block-sparse)."""
    return [
        _block_score_case(4),
        _block_score_case(3),
        _block_topk_case(3, 2, 1),
        _block_topk_case(2, 3, 2),
        _block_topk_case(4, 8, 1),
        Case("block_mask", "block_mask", _block_mask_case, group="minimax-m3", calls=STATEFUL),
        _msa_attention_case("additive"),
        _msa_attention_case("blocks"),
    ]


def _routing_ffn_case(name: str, attrs: MoeFFN, qtype: str = "F32", e: int = 16, f: int = 12, fs: int = 10,
                      n_exp: int = 5, latent: int = 8) -> Case:
    """A moe_ffn row of the routing family: inputs in ops.moe_inputs order, from the attrs (a
    latent MoE's experts in `latent` dims)."""
    ins: list[Input] = [rows(e), weight(n_exp, e)]
    if attrs.selection_bias:
        ins.append(weight(n_exp, domain=(-0.3, 0.3)))
    if attrs.hash_routed:
        ins += [_hash_table(n_exp, attrs.k), tokens]
    d = latent if attrs.latent else e
    if attrs.merged_gate_up:
        ins.append(weight(n_exp, 2 * f, d, qtype=qtype))
    else:
        ins += [weight(n_exp, f, d, qtype=qtype)] * (2 if attrs.has_gate else 1)
    ins.append(weight(n_exp, d, f, qtype=qtype))
    ins += [weight(n_exp, domain=(0.5, 1.5)) for _ in attrs.expert_scales]
    if attrs.latent:
        ins.append(weight(latent, e, qtype=qtype))
        ins += [weight(latent, domain=(0.5, 1.5))] if attrs.latent_norm else []
        ins.append(weight(e, latent, qtype=qtype))
    if attrs.shared:
        ins += [weight(e)] if attrs.shared_gated else []
        ins += [weight(fs, e, qtype=qtype), weight(fs, e, qtype=qtype), weight(e, fs, qtype=qtype)]
        ins += [weight(1, domain=(0.5, 1.5)) for _ in attrs.shared_scales]
    return op_case(name, "moe_ffn", attrs, *ins, group="moe_routing", calls=BOTH)


def _hash_table(n_exp: int, k: int) -> Input:
    """A [VOCAB, k] int32 token -> experts table (distinct experts per row, as llama.cpp's tid2eid)."""
    return lambda cg: cg.b.emit_multi("topk", [cg.weight((VOCAB, n_exp))], O.TopK(k), ["tid2eid_v", "tid2eid"])[1]


def moe_routing_cases() -> list[Case]:
    """The MoE routing family: sigmoid / sqrt-softplus gating, selection by probs + bias with the
    weights from the unbiased probs (topk's payload), weights scale, clamped SwiGLU and swiglu_oai
    experts, the ungated shared expert."""
    logits, bias = rows(6, domain=(-3.0, 3.0)), weight(6, domain=(-0.5, 0.5))
    sigmoid_route = MoeRoute(2, gating="sigmoid", selection_bias=True, weights_scale=2.5)
    softplus_route = MoeRoute(3, gating="sqrt_softplus", selection_bias=True)
    hy = MoeFFN(k=2, normalize=False, gating="sigmoid", selection_bias=True, merged_gate_up=True,
                  expert_scales=("down",), shared=True, shared_gated=False, shared_scales=("gate", "up", "down"))
    return [
        op_case("topk-payload", "topk", O.TopK(3), rows(9), rows(9), n_out=2, compare="topk", group="moe_routing"),
        op_case("moe_route-sigmoid-bias-scale", "moe_route", sigmoid_route, logits, bias, n_out=2, compare="route",
                group="moe_routing", calls=BOTH),
        op_case("moe_route-sqrt_softplus-bias", "moe_route", softplus_route, logits, bias, n_out=2,
                compare="route", group="moe_routing"),
        op_case("moe_topk_softmax-bias", "moe_topk_softmax", MoeTopkSoftmax(3, biased=True), logits, bias, n_out=2,
                compare="route", group="moe_routing", calls=BOTH),
        op_case("moe_topk_softmax-top1", "moe_topk_softmax", MoeTopkSoftmax(1), logits, n_out=2, compare="route",
                group="moe_routing"),
        _routing_ffn_case("moe_ffn-sigmoid-bias-clamp", MoeFFN(
            k=2, normalize=False, gating="sigmoid", selection_bias=True, weights_scale=1.5, act="swiglu_clamp",
            act_limit=0.7, expert_scales=("up",))),
        _routing_ffn_case("moe_ffn-sqrt_softplus-oai-Q8_0", MoeFFN(
            k=3, gating="sqrt_softplus", selection_bias=True, act="swiglu_oai"), "Q8_0", 32, 32, 32),
        _routing_ffn_case("moe_ffn-merged-ungated-shared-f32", hy),
        _routing_ffn_case("moe_ffn-merged-ungated-shared-Q8_0", hy, "Q8_0", 32, 32, 32),
        _routing_ffn_case("moe_ffn-merged-clamp-ungated-clamp", MoeFFN(
            k=2, merged_gate_up=True, act="swiglu_clamp", act_limit=0.5, shared=True, shared_gated=False,
            shared_act="swiglu_clamp", shared_act_limit=0.4)),
        _routing_ffn_case("moe_ffn-sigmoid-bias-clamp_after-ungated-clamp_after", MoeFFN(
            k=2, gating="sigmoid", selection_bias=True, weights_scale=2.5, act="swiglu_clamp_after", act_limit=0.3,
            shared=True, shared_gated=False, shared_act="swiglu_clamp_after", shared_act_limit=0.25)),
        _routing_ffn_case("moe_ffn-oai-gated-shared-oai", MoeFFN(
            k=2, act="swiglu_oai", shared=True, shared_act="swiglu_oai", shared_scales=("up",))),
        op_case("take_along", "take_along", O.NoAttrs(), rows(9),
                lambda cg: cg.b.gather(_hash_table(9, 3)(cg), cg.tokens, "token_ids"), group="moe_routing",
                calls=BOTH),
        op_case("moe_route-hash", "moe_route", MoeRoute(2, gating="sqrt_softplus", hash_routed=True,
                                                          weights_scale=1.5),
                logits, _hash_table(6, 2), tokens, n_out=2, compare="route", group="moe_routing", calls=BOTH),
        _routing_ffn_case("moe_ffn-latent-situ-norm-shared-situ", MoeFFN(
            k=2, gating="sigmoid", selection_bias=True, latent=True, latent_norm=True, latent_norm_eps=1e-5,
            act="situ", act_limit=1.5, act_linear_beta=0.8, shared=True, shared_gated=False, shared_act="situ",
            shared_act_limit=1.5, shared_act_linear_beta=0.8)),
        _routing_ffn_case("moe_ffn-latent-situ-Q8_0", MoeFFN(
            k=2, gating="sigmoid", latent=True, act="situ", act_limit=4.0), "Q8_0", 32, 32, latent=32),
        _routing_ffn_case("moe_ffn-hash-sqrt_softplus-clamp-shared", MoeFFN(
            k=2, gating="sqrt_softplus", hash_routed=True, weights_scale=1.5, act="swiglu_clamp", act_limit=0.7,
            shared=True, shared_gated=False, shared_act="swiglu_clamp", shared_act_limit=0.5)),
    ]


CASES: list[Case] = [
    *elementwise_cases(),
    *reduce_cases(),
    *movement_cases(),
    *selection_cases(),
    *position_cases(),
    *moe_cases(),
    *quant_cases(),
    *act8_cases(),
    *int8_cases(),
    *recurrent_cases(),
    *qwen4exp_cases(),
    *compressed_cases(),
    *dsa_cases(),
    *minimax_m3_cases(),
    *moe_routing_cases(),
]


# ---------------------------------------------------------------------------------------------
# building, running the reference, comparing


def build_case(case: Case, index: int) -> BuiltCase:
    cg = CaseGraph(re.sub(r"\W", "_", case.name), seed=index)
    return BuiltCase(case, case.build(cg), cg)


def run_reference(bc: BuiltCase, call: Call, tokens: np.ndarray) -> list[np.ndarray]:
    def load(p: Param) -> np.ndarray:
        return bc.data.params[p.source].values

    def mins(p: Param) -> np.ndarray:
        data = bc.data.params[p.source]
        return block_mins(data.qtype, data.storage, data.shape)

    state = {n: a.copy() for n, a in bc.data.states.items()}
    res = run_graph(bc.graph, {"tokens": tokens, "pos": np.int64(call.p)}, load, state, dtype=np.float64,
                    load_block_mins=mins)
    return res.outputs


def assert_close(got: np.ndarray, want: np.ndarray, what: str, tol: float = F32_TOL) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    if want.dtype.kind in "iu":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    finite = np.isfinite(want)
    assert np.all(np.isfinite(got) == finite), f"{what}: non-finite values differ"
    np.testing.assert_array_equal(got[~finite], want[~finite], err_msg=f"{what}: infinities")
    err = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))
    scale = float(np.max(np.abs(want), initial=0.0))
    assert err <= tol * max(scale, 1e-30), f"{what}: max abs error {err:.3e} vs max |ref| {scale:.3e}"


def compare(case: Case, got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    if case.compare == "close":
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_close(g, w, f"{what} output {i}")
        return
    (gv, gi), (wv, wi) = got, want
    assert gi.shape == wi.shape, f"{what}: ids shape {gi.shape}, expected {wi.shape}"
    if case.compare == "selected":
        _compare_finite_selection(gv, gi, wv, wi, what)
        return
    if case.compare == "topk":  # tie order is free: compare the selected sets and sorted values
        np.testing.assert_array_equal(np.sort(gi, -1), np.sort(wi, -1), err_msg=f"{what}: selected ids")
        assert_close(np.sort(gv, -1), np.sort(wv, -1), f"{what}: values")
    else:  # route: weights belong to their ids
        go, wo = np.argsort(gi, -1), np.argsort(wi, -1)
        np.testing.assert_array_equal(
            np.take_along_axis(gi, go, -1),
            np.take_along_axis(wi, wo, -1),
            err_msg=f"{what}: selected experts",
        )
        assert_close(np.take_along_axis(gv, go, -1), np.take_along_axis(wv, wo, -1), f"{what}: weights")


def _compare_finite_selection(gv: np.ndarray, gi: np.ndarray, wv: np.ndarray, wi: np.ndarray, what: str) -> None:
    """Per row, the set of selected ids with a finite score and their sorted scores (the compiled
    top-k may also mark -inf slots with id -1)."""
    k = gi.shape[-1]
    for g_ids, g_vals, w_ids, w_vals in zip(gi.reshape(-1, k), gv.reshape(-1, k), wi.reshape(-1, k),
                                            wv.reshape(-1, k), strict=True):
        g_real, w_real = np.isfinite(g_vals) & (g_ids >= 0), np.isfinite(w_vals) & (w_ids >= 0)
        assert sorted(g_ids[g_real]) == sorted(w_ids[w_real]), f"{what}: selected ids"
        assert_close(np.sort(g_vals[g_real]), np.sort(w_vals[w_real]), f"{what}: scores")
