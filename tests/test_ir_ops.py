"""Per-op case table: every op in OPS has rows (odd sizes; T=1 and T>1) that check its shape rule
against its reference, and for fused ops that the decomposition matches the fused reference in
float64 and float32. Adding an op to OPS without rows fails `test_every_op_has_rows`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.decompose import DECOMPOSITIONS, decompose
from ggufc.ir.graph import Graph, Node, Shape, Value, eval_shape
from ggufc.ir.hyper_connections import HcPost, HcPre, HcSinkhorn, ResMix
from ggufc.ir.interp import run_graph
from ggufc.ir.linear_attention import GatedDeltaNet, L2Norm, LightningAttention, RMSNormGated, SsmConv
from ggufc.ir.moe_routing import MoeFFN, MoeRoute, MoeTopkSoftmax
from ggufc.ir.ngram_embedding import PleHash
from ggufc.ir.printer import dump
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
from ggufc.ir.verify import IRError, verify

TOL = {np.float64: dict(rtol=1e-9, atol=1e-12), np.float32: dict(rtol=2e-4, atol=2e-5)}


@dataclass(frozen=True)
class In:
    """A case input: `kind` says how to fill it (f: normal floats, pos: positive floats, ids:N:
    ints below N, P: the start position, state: a state slot of random floats)."""

    name: str
    shape: Shape
    kind: str = "f"
    dtype: str = "float32"


@dataclass(frozen=True)
class Case:
    op: str
    attrs: Any
    inputs: tuple[In, ...]
    t: int
    p: int = 0

    @property
    def id(self) -> str:
        return f"{self.op}-{self.attrs}-T{self.t}-P{self.p}".replace(" ", "")


def _both_t(op: str, attrs: Any, inputs: tuple[In, ...], p: int = 0) -> list[Case]:
    """Rows for decode (T=1) and for an odd prefill (T=5)."""
    return [Case(op, attrs, inputs, t, p) for t in (1, 5)]


X = In("x", ("T", 7))
POS = In("pos", (), "P", "int64")
ROPE_TABLE = In("table", (13, 3, 2))
CACHE = 11  # cache cells: at least P + T for every row


def _cases() -> list[Case]:
    cases: list[Case] = []
    for fn in O.UNARY_FNS:
        cases += _both_t("unary", O.Unary(fn), (In("x", ("T", 7), "pos"),))
    for fn in O.BINARY_FNS:
        cases += _both_t("binary", O.Binary(fn), (X, In("y", (7,), "pos")))
    cases += _both_t("binary", O.Binary("mul"), (In("x", ("T", 1)), In("y", (1, 3))))
    for fn in ("add", "mul", "max", "min", "pow"):
        cases += _both_t("scalar", O.Scalar(fn, 1.5), (In("x", ("T", 7), "pos"),))
    for fn in O.REDUCE_FNS:
        cases += _both_t("reduce", O.Reduce(fn), (X,))
    cases += _both_t("reduce", O.Reduce("sum", 1, False), (In("x", ("T", 3, 5)),))
    cases += _both_t("reshape", O.Reshape(("T", 3, 5)), (In("x", ("T", 15)),))
    cases += _both_t("transpose", O.Transpose((1, 0, 2)), (In("x", ("T", 3, 5)),))
    cases += _both_t("slice", O.Slice(1, 2, 5), (X,))
    cases += _both_t("concat", O.Concat(1), (X, In("y", ("T", 3))))
    cases += _both_t("dequantize", O.NoAttrs(), (In("w", (5, 7)),))
    cases += _both_t("gather", O.NoAttrs(), (In("table", (9, 7)), In("ids", ("T",), "ids:9", "int32")))
    cases += _both_t("matmul", O.NoAttrs(), (X, In("w", (5, 7))))
    cases += _both_t("quantize_act", O.QuantizeAct("q8_0"), (In("x", ("T", 64)),))
    cases += _both_t("quantize_act", O.QuantizeAct("q8_K"), (In("x", ("T", 512)),))
    cases += _both_t("bmm_nt", O.NoAttrs(), (In("a", (3, "T", 5)), In("b", (3, 7, 5))))
    cases += _both_t("bmm_nn", O.NoAttrs(), (In("a", (3, "T", 5)), In("b", (3, 5, 7))))
    ids3 = In("ids", ("T", 2), "ids:3", "int32")
    cases += _both_t("matmul_id", O.NoAttrs(), (In("x", ("T", 1, 7)), In("w", (3, 5, 7)), ids3))
    cases += _both_t("matmul_id", O.NoAttrs(), (In("x", ("T", 2, 7)), In("w", (3, 5, 7)), ids3))
    cases += _both_t("topk", O.TopK(3), (X,))
    cases += _both_t("positions", O.Tokens(), (POS,), p=4)
    cases += _both_t("causal_mask", O.Tokens(), (POS,), p=3)
    cases += _both_t("window_mask", O.WindowMask(window=2), (POS,), p=3)
    cases += _both_t("last_token", O.NoAttrs(), (X,))
    cache_state = In("cache", (CACHE, 2, 3), "state")
    cases += _both_t("cache_write", O.NoAttrs(), (cache_state, In("x", ("T", 2, 3)), POS), p=4)
    cases += _both_t("cache_read", O.Tokens(), (In("cache", (CACHE, 2, 3)), POS), p=4)
    cases += _recurrent_cases()
    cases += _fused_cases()
    cases += _qwen4exp_cases()
    cases += _compressed_cases()
    cases += _dsa_cases()
    cases += _minimax_m3_cases()
    cases += _moe_routing_cases()
    return cases


def _minimax_m3_cases() -> list[Case]:
    """MSA: per-group block scores, block selection (local blocks first), per-group block mask,
    attention over the selected blocks (per-group additive mask, block-sparse form)."""
    cases: list[Case] = []
    for block in (3, 4):
        cases += _both_t("indexer_block_score", IndexerBlockScore(block),
                         (In("q", ("T", 2, 6)), In("cache", (12, 6))))
    for block, top_k, local, p in ((3, 2, 1, 4), (2, 3, 2, 6), (4, 8, 1, 2)):
        cases += _both_t("block_topk", BlockTopK(block, top_k, local), (In("s", ("T", 2, 12 // block)), POS), p=p)
    cases += _both_t("block_mask", BlockMask(3), (In("sel", ("T", 2, 2), "ids:4", "int32"), POS), p=4)
    q, kc, vc = In("q", ("T", 4, 5)), In("kc", (CACHE, 2, 5)), In("vc", (CACHE, 2, 5))
    cases += _both_t("attention", O.Attention(0.37, "additive"), (q, kc, vc, POS, In("m", (2, "T", "P+T"))), p=3)
    # blocks of 2 cells, ids below 4, queries from cell 6: every selected block has a visible cell
    cases += _both_t("attention", O.Attention(0.37, "blocks", 2),
                     (q, kc, vc, POS, In("sel", ("T", 2, 2), "ids:4", "int32")), p=6)
    return cases


def _qwen4exp_cases() -> list[Case]:
    """Hyper-connection mix, QSA indexer (scores, top-k with the tail rule, mask, masked and sparse
    attention) and the PLE n-gram hash."""
    cases: list[Case] = []
    streams = In("r", ("T", 3, 5))
    hc_w = (In("norm", (3, 5)), In("down", (2, 15)), In("up", (15, 2)))
    cases += _both_t("hc_pre", HcPre(3, 1e-5), (streams, *hc_w, In("inject", (3, 15))))
    cases += _both_t("hc_pre", HcPre(3, 1e-6, post=False), (streams, *hc_w))
    cases += _both_t("hc_post", HcPost(), (streams, In("y", ("T", 5)), In("post", ("T", 3), "pos")))
    sink = HcSinkhorn(3, 1e-5, hc_eps=1e-3, n_iter=3)
    cases += _both_t("hc_sinkhorn", sink, (streams, In("fn", (15, 15)), In("scale", (3,)), In("base", (15,))))
    cases += _both_t("hc_sinkhorn", HcSinkhorn(3, 1e-5, hc_eps=1e-3, post=False),
                     (streams, In("fn", (3, 15)), In("scale", (1,)), In("base", (3,))))
    cases += _both_t("hc_post", HcPost(comb=True),
                     (streams, In("y", ("T", 5)), In("post", ("T", 3), "pos"), In("comb", ("T", 3, 3), "pos")))
    for n_bank in (1, 3):  # cross-layer residual attention over n banked rows and the stream
        cases += _both_t("res_mix", ResMix(1e-5), (In("src", ("T", n_bank, 5)), In("cur", ("T", 5)),
                                                     In("w", (5,))))
    for ratio, n_rot in ((4, 4), (3, 6)):
        cache = In("cache", (12, 6))
        table = In("table", (12 // ratio + 1, n_rot // 2, 2))
        cases += _both_t("indexer_score", IndexerScore(ratio, 1e-5, n_rot),
                         (In("q", ("T", 3, 6)), cache, In("norm", (6,)), table))
    for ratio, width, p in ((3, 5, 4), (2, 3, 6), (4, 20, 2)):
        cases += _both_t("indexer_topk", IndexerTopK(ratio, width), (In("s", ("T", 12 // ratio + 1)), POS), p=p)
    cases += _both_t("index_mask", O.NoAttrs(), (In("sel", ("T", 4), "ids:5", "int32"), POS), p=4)
    ple = PleHash(3, 2, (1, 3, (1 << 40) + 5), (0, 7, 14, 21), (7, 7, 7, 5), eos=0)
    hist, toks = In("hist", (CACHE,), "ids:7", "int32"), In("tokens_in", ("T",), "ids:7", "int32")
    for p in (0, 3):
        cases += _both_t("ple_hash", ple, (hist, toks, POS), p=p)
    q, kc, vc = In("q", ("T", 4, 5)), In("kc", (CACHE, 2, 5)), In("vc", (CACHE, 2, 5))
    cases += _both_t("attention", O.Attention(0.37, "additive"), (q, kc, vc, POS, In("m", ("T", "P+T"))), p=3)
    cases += _both_t("attention", O.Attention(0.37, "indices"),
                     (q, kc, vc, POS, In("sel", ("T", 3), "ids:5", "int32")), p=4)
    return cases


def _compressed_cases() -> list[Case]:
    """Compressed rows (deepseek4): the compressor's pooling, indexer scores and attention with
    sinks over a sliding window plus all, or the selected, complete rows."""
    cases: list[Case] = []
    q_idx, rows_idx = In("q", ("T", 3, 6)), In("rows", (5, 6))
    for p in (0, 6):
        cases += _both_t("compressed_score", CompressedScore(2), (q_idx, In("w", ("T", 3)), rows_idx, POS), p=p)
    q, cache, sinks = In("q", ("T", 4, 5)), In("cache", (CACHE, 5)), In("sinks", (4,))
    rows = In("rows", (5, 5))
    for p in (0, 5):
        cases += _both_t("compressed_attention", CompressedAttention(0.37, 3), (q, cache, sinks, POS), p=p)
        cases += _both_t("compressed_attention", CompressedAttention(0.37, 4, 2), (q, cache, sinks, POS, rows), p=p)
        cases += _both_t("compressed_attention", CompressedAttention(0.37, 4, 2, selected=True),
                         (q, cache, sinks, POS, rows, In("sel", ("T", 2), "ids:5", "int32")), p=p)
    # the compressor's pooling reads whole states (the same for any T): overlapping windows of 2r
    # over [C, 2d] (several blocks, and one), plain blocks over [C, d]
    for ratio, overlap, cells, wide in ((4, True, 12, 8), (4, True, 4, 6), (3, False, 12, 5)):
        state = (cells, wide)
        cases += _both_t("compressor_pool", CompressorPool(ratio, overlap),
                         (In("kv", state), In("score", state), In("ape", (ratio, wide))))
    return cases


def _dsa_cases() -> list[Case]:
    """DSA's lightning-indexer scores (fused: its spelling equals the reference) and token top-k,
    MLA's per-head matmul."""
    cases: list[Case] = []
    lid = (In("q", ("T", 3, 6)), In("cache", (CACHE, 6)), In("w", ("T", 3)), POS)
    for p in (0, 4):
        cases += _both_t("token_score", O.NoAttrs(), lid, p=p)
    for width, p in ((3, 4), (20, 2)):
        cases += _both_t("token_topk", TokenTopK(width), (In("s", ("T", "P+T")), POS), p=p)
    cases += _both_t("head_matmul", O.NoAttrs(), (In("x", ("T", 3, 7)), In("w", (3, 5, 7))))
    return cases


def _recurrent_cases() -> list[Case]:
    """The stateful ops of the gated delta-net family (state first in, new state first out)."""
    cases: list[Case] = []
    cases += _both_t("ssm_conv", SsmConv(), (In("conv", (7, 3), "state"), X, In("w", (7, 4))))
    dilated = (In("conv", (5, 4), "state"), In("x", ("T", 5)), In("w", (5, 3)))
    cases += _both_t("ssm_conv", SsmConv(2), dilated)
    for head_map, hv in (("tiled", 4), ("interleaved", 4), ("tiled", 2)):
        gdn_in = (In("ssm", (hv, 3, 5), "state"), In("q", ("T", 2, 5)), In("k", ("T", 2, 5)),
                  In("v", ("T", hv, 3)), In("g", ("T", hv)), In("beta", ("T", hv), "pos"))
        cases += _both_t("gated_delta_net", GatedDeltaNet(head_map, 0.45), gdn_in)
    kda_in = (In("ssm", (2, 3, 5), "state"), In("q", ("T", 2, 5)), In("k", ("T", 2, 5)), In("v", ("T", 2, 3)),
              In("g", ("T", 2, 5)), In("beta", ("T", 2), "pos"))  # KDA: one decay per key index
    cases += _both_t("gated_delta_net", GatedDeltaNet("tiled", 0.45, key_decay=True), kda_in)
    lightning_in = (In("s", (2, 5, 3), "state"), In("q", ("T", 2, 5)), In("k", ("T", 2, 5)), In("v", ("T", 2, 3)))
    cases += _both_t("lightning_attention", LightningAttention((0.0625, 0.00390625), 0.5), lightning_in)
    return cases


def _fused_cases() -> list[Case]:
    cases: list[Case] = []
    cases += _both_t("softmax", O.Softmax(), (X,))
    cases += _both_t("softmax", O.Softmax(1), (In("x", ("T", 5, 3)),))
    cases += _both_t("rms_norm", O.RMSNorm(1e-5), (X, In("w", (7,))))
    cases += _both_t("rms_norm", O.RMSNorm(1e-6), (In("x", ("T", 3, 7)),))
    x64, w5, w3 = In("x", ("T", 64)), In("w", (5, 64)), In("w2", (3, 64))
    cases += _both_t("int8_matmul", O.Int8Matmul("q8_0"), (x64, w5))
    cases += _both_t("int8_gemv_group", O.GemvGroup("q8_0", 2), (x64, w5, w3))
    cases += _both_t("int8_gemv_group", O.GemvGroup("q8_0", 1, "rms_norm", 1e-5, residual=True),
                     (x64, In("gamma", (64,)), w5, In("r", ("T", 5))))
    cases += _both_t("int8_gemv_group", O.GemvGroup("q8_0", 2, "swiglu"), (x64, In("up", ("T", 64)), w5, w3))
    for mode, d, n_rot in (("norm", 6, 6), ("neox", 6, 6), ("norm", 10, 6), ("neox", 10, 6)):
        x = In("x", ("T", 3, d))
        cases += _both_t("rope", O.Rope(mode, n_rot), (x, POS, ROPE_TABLE), p=2)
    for h, hkv, p in ((4, 2, 0), (3, 3, 5), (6, 2, 4), (3, 1, 0)):
        q = In("q", ("T", h, 5))
        kc, vc = In("kc", (CACHE, hkv, 5)), In("vc", (CACHE, hkv, 5))
        cases += _both_t("attention", O.Attention(0.37), (q, kc, vc, POS), p=p)
    for window, softcap in ((3, 0.0), (1, 0.0), (0, 0.4), (4, 0.4)):  # a sliding window, a score softcap
        q, kc, vc = In("q", ("T", 4, 5)), In("kc", (CACHE, 2, 5)), In("vc", (CACHE, 2, 5))
        cases += _both_t("attention", O.Attention(0.37, window=window, softcap=softcap), (q, kc, vc, POS), p=4)
    for window in (0, 3):  # gpt-oss: a sink logit per query head, with and without a window
        q, kc, vc = In("q", ("T", 4, 5)), In("kc", (CACHE, 2, 5)), In("vc", (CACHE, 2, 5))
        cases += _both_t("attention", O.Attention(0.37, window=window, sinks=True), (q, kc, vc, POS, In("s", (4,))),
                         p=4)
    cases += _both_t("rope", O.Rope("imrope", 6, (1, 1, 0, 1)), (In("x", ("T", 3, 8)), POS, ROPE_TABLE), p=2)
    cases += _both_t("swiglu", O.NoAttrs(), (X, In("u", ("T", 7))))
    cases += _both_t("l2_norm", L2Norm(1e-6), (In("x", ("T", 3, 7)),))
    for act in ("silu", "sigmoid"):
        gated_in = (In("x", ("T", 3, 7)), In("w", (7,)), In("z", ("T", 3, 7)))
        cases += _both_t("rms_norm_gated", RMSNormGated(1e-5, act), gated_in)
    for normalize in (True, False):
        cases += _both_t("moe_route", MoeRoute(3, normalize=normalize), (In("logits", ("T", 5)),))
    cases += _both_t("moe_topk_softmax", MoeTopkSoftmax(3, biased=True), (In("logits", ("T", 5)), In("b", (5,))))
    cases += _both_t("moe_topk_softmax", MoeTopkSoftmax(1), (In("logits", ("T", 5)),))
    experts = (In("router", (5, 7)), In("gate", (5, 3, 7)), In("up", (5, 3, 7)), In("down", (5, 7, 3)))
    cases += _both_t("moe_ffn", MoeFFN(2), (X, *experts))
    scales = (In("s_up", (5,)), In("s_down", (5,)))
    no_gate = (X, experts[0], experts[2], experts[3], *scales)
    plain = MoeFFN(3, normalize=False, has_gate=False, expert_scales=("up", "down"))
    cases += _both_t("moe_ffn", plain, no_gate)
    rounded = (In("router", (5, 64)), In("gate", (5, 32, 64)), In("up", (5, 32, 64)), In("down", (5, 64, 32)))
    cases += _both_t("moe_ffn", MoeFFN(2, act_schemes=("q8_0", "q8_0")), (In("x", ("T", 64)), *rounded))
    shexp = (In("shexp_gate", (4, 7)), In("shexp_up", (4, 7)), In("shexp_down", (7, 4)))
    shared_f16 = MoeFFN(2, shared=True, shared_gated=False, shared_act_schemes=("f16", "f16"))
    cases += _both_t("moe_ffn", shared_f16, (X, *experts, *shexp))
    program = (
        ("binary", O.Binary("mul"), (0, 1)),
        ("scalar", O.Scalar("add", 0.5), (3,)),
        ("unary", O.Unary("tanh"), (4,)),
        ("binary", O.Binary("sub"), (5, 2)),
    )
    ew_inputs = (In("a", ("T", 7)), In("b", (7,)), In("c", ("T", 1)))
    cases += _both_t("fused_elementwise", O.FusedElementwise(program, 3), ew_inputs)
    return cases


def _moe_routing_cases() -> list[Case]:
    """The MoE routing family: gatings, selection bias, weights scale, expert activations, the
    ungated shared expert (and topk's payload, the biased selection's primitive)."""
    cases = _both_t("topk", O.TopK(3), (X, In("payload", ("T", 7))))
    logits, bias = In("logits", ("T", 5)), In("bias", (5,))
    for gating in ("softmax", "sigmoid", "sqrt_softplus"):
        route = MoeRoute(3, gating=gating, selection_bias=True, weights_scale=2.5)
        cases += _both_t("moe_route", route, (logits, bias))
    cases += _both_t("moe_route", MoeRoute(2, normalize=False, gating="sigmoid"), (logits,))
    router, gate, up, down = In("router", (5, 7)), In("gate", (5, 3, 7)), In("up", (5, 3, 7)), In("down", (5, 7, 3))
    clamped = MoeFFN(2, normalize=False, gating="sigmoid", selection_bias=True, weights_scale=1.5,
                       act="swiglu_clamp", act_limit=0.7)
    cases += _both_t("moe_ffn", clamped, (X, router, bias, gate, up, down))
    oai = MoeFFN(3, gating="sqrt_softplus", selection_bias=True, act="swiglu_oai")
    cases += _both_t("moe_ffn", oai, (X, router, bias, gate, up, down))
    shared = (In("sh_gate", (4, 7)), In("sh_up", (4, 7)), In("sh_down", (7, 4)))
    one = In("s", (1,), "pos")
    ungated = MoeFFN(2, normalize=False, gating="sigmoid", selection_bias=True, merged_gate_up=True,
                       expert_scales=("down",), shared=True, shared_gated=False, shared_scales=("gate", "up", "down"))
    merged = (X, router, bias, In("gate_up", (5, 6, 7)), down, In("s_down", (5,), "pos"))
    cases += _both_t("moe_ffn", ungated, (*merged, *shared, one, one, one))
    clamp_shared = MoeFFN(2, shared=True, shared_gated=False, shared_act="swiglu_clamp", shared_act_limit=0.5)
    cases += _both_t("moe_ffn", clamp_shared, (X, router, gate, up, down, *shared))
    clamp_after = MoeFFN(2, normalize=False, gating="sigmoid", selection_bias=True, act="swiglu_clamp_after",
                           act_limit=0.3, shared=True, shared_gated=False, shared_act="swiglu_clamp_after",
                           shared_act_limit=0.25)
    cases += _both_t("moe_ffn", clamp_after, (X, router, bias, gate, up, down, *shared))
    oai_shared = MoeFFN(2, act="swiglu_oai", shared=True, shared_act="swiglu_oai", shared_scales=("up",))
    cases += _both_t("moe_ffn", oai_shared, (X, router, gate, up, down, In("sh_gate_inp", (7,)), *shared, one))
    cases += _both_t("take_along", O.NoAttrs(), (X, In("ids", ("T", 3), "ids:7", "int32")))
    table, toks = In("tid2eid", (9, 2), "ids:5", "int32"), In("toks", ("T",), "ids:9", "int32")
    hashed = MoeRoute(2, gating="sqrt_softplus", hash_routed=True, weights_scale=1.5)
    cases += _both_t("moe_route", hashed, (logits, table, toks))
    hashed_ffn = MoeFFN(2, gating="sqrt_softplus", hash_routed=True, act="swiglu_clamp", act_limit=0.7)
    cases += _both_t("moe_ffn", hashed_ffn, (X, router, table, toks, gate, up, down))
    latent_experts = (In("gate", (5, 3, 4)), In("up", (5, 3, 4)), In("down", (5, 4, 3)))
    to_latent, from_latent = In("routed_down", (4, 7)), In("routed_up", (7, 4))
    situ = MoeFFN(2, gating="sigmoid", selection_bias=True, latent=True, latent_norm=True, latent_norm_eps=1e-5,
                    act="situ", act_limit=1.5, act_linear_beta=0.8, shared=True, shared_gated=False,
                    shared_act="situ", shared_act_limit=1.5, shared_act_linear_beta=0.8)
    cases += _both_t("moe_ffn", situ, (X, router, bias, *latent_experts, to_latent, In("routed_norm", (4,), "pos"),
                                       from_latent, *shared))
    plain_latent = MoeFFN(2, latent=True, act="situ", act_limit=1.5)
    cases += _both_t("moe_ffn", plain_latent, (X, router, *latent_experts, to_latent, from_latent))
    return cases


CASES = _cases()


# ---------------------------------------------------------------------------------------------
# building and running one case


def _case_graph(case: Case) -> Graph:
    b = GraphBuilder()
    b.input("tokens", ("T",), "int32")
    pos = b.input("pos", (), "int64")
    args, state_out = [], {}
    for spec in case.inputs:
        if spec.kind == "P":
            args.append(pos)
        elif spec.kind == "state":
            args.append(b.state(spec.name, spec.shape, spec.dtype))
        else:
            args.append(b.input(spec.name, spec.shape, spec.dtype))
    n_out = len(O.OPS[case.op].infer([(v.shape, v.dtype) for v in args], case.attrs))
    outs = b.emit_multi(case.op, args, case.attrs, [f"out{i}" for i in range(n_out)])
    if O.OPS[case.op].effects:
        state_out = {case.inputs[0].name: outs[0]}
    return b.finish(list(outs), state_out)


def _fill(spec: In, case: Case, rng: np.random.Generator) -> np.ndarray:
    shape = eval_shape(spec.shape, {"T": case.t, "P": case.p})
    if spec.kind == "P":
        return np.int64(case.p)
    if spec.kind.startswith("ids:"):
        return rng.integers(0, int(spec.kind[4:]), size=shape).astype(np.int32)
    a = rng.standard_normal(shape)
    return np.abs(a) + 0.5 if spec.kind == "pos" else a


def _feeds(case: Case, seed: int = 0) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    feeds: dict[str, Any] = {"tokens": np.zeros(case.t, np.int32), "pos": np.int64(case.p)}
    state: dict[str, np.ndarray] = {}
    for spec in case.inputs:
        if spec.kind != "P":
            (state if spec.kind == "state" else feeds)[spec.name] = _fill(spec, case, rng)
    return feeds, state


def _run(graph: Graph, case: Case, dtype: Any) -> list[np.ndarray]:
    feeds, state = _feeds(case)
    feeds = {k: a.astype(dtype) if a.dtype.kind == "f" else a for k, a in feeds.items()}
    res = run_graph(graph, feeds, lambda p: np.zeros(()), state, dtype=dtype)
    return [*res.outputs, *(res.state[k] for k in graph.state_out)]


# ---------------------------------------------------------------------------------------------
# tests


def test_every_op_has_rows() -> None:
    """An op added to OPS needs rows here, for a single token and for several."""
    for name in O.OPS:
        ts = {c.t for c in CASES if c.op == name}
        assert 1 in ts and any(t > 1 for t in ts), f"op {name!r} needs case rows with T=1 and T>1"


def test_every_fused_op_has_a_decomposition() -> None:
    fused = {name for name, op in O.OPS.items() if op.fused}
    assert fused == set(DECOMPOSITIONS)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_shape_rule_matches_reference(case: Case) -> None:
    graph = _case_graph(case)
    verify(graph, {"T": case.t, "P": case.p})
    env = {"T": case.t, "P": case.p}
    feeds, state = _feeds(case)
    args = [state[s.name] if s.kind == "state" else feeds[s.name] for s in case.inputs]
    got = O.OPS[case.op].ref([np.asarray(a, np.float32) if np.asarray(a).dtype.kind == "f" else a
                              for a in args], case.attrs, env)
    outs = graph.nodes[-1].outputs
    assert len(got) == len(outs)
    for v, a in zip(outs, got, strict=True):
        a = np.asarray(a)
        assert a.shape == eval_shape(v.shape, env), f"{v!r}: reference gives {a.shape}"
        expected_kind = "i" if v.dtype.startswith("int") else "f"
        assert a.dtype.kind == expected_kind, f"{v!r}: reference gives {a.dtype}"


FUSED_CASES = [c for c in CASES if O.OPS[c.op].fused]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: c.id)
def test_decomposition_matches_fused(case: Case, dtype: Any) -> None:
    graph = _case_graph(case)
    decomposed = decompose(graph)
    verify(decomposed, {"T": case.t, "P": case.p})
    assert not any(O.OPS[n.op].fused for n in decomposed.nodes)
    for want, got in zip(_run(graph, case, dtype), _run(decomposed, case, dtype), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, **TOL[dtype])


def test_decomposition_keeps_names_and_layers() -> None:
    b = GraphBuilder()
    b.input("tokens", ("T",), "int32")
    x = b.input("x", ("T", 7), "float32")
    with b.layer(3):
        y = b.emit("softmax", [x], O.Softmax(), "probs")
    graph = decompose(b.finish([y], {}))
    assert graph.outputs[0] is y
    assert {n.outputs[0].layer for n in graph.nodes} == {3}
    assert all(n.outputs[0].name.startswith("probs") for n in graph.nodes)


def test_topk_picks_the_largest_set() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 9))
    vals, ids = O.topk_ref(x, 4)
    for row, chosen, v in zip(x, ids, vals, strict=True):
        assert set(chosen) == set(np.argsort(-row)[:4])
        np.testing.assert_array_equal(v, row[chosen])


# ---------------------------------------------------------------------------------------------
# verifier and printer


def _small_graph() -> Graph:
    b = GraphBuilder()
    b.input("tokens", ("T",), "int32")
    pos = b.input("pos", (), "int64")
    x = b.input("x", ("T", 6), "float32")
    with b.layer(3):
        w = b.param("blk.3.attn_norm.weight", (6,), "F32")
        h = b.emit("rms_norm", [x, w], O.RMSNorm(1e-5), "attn_norm")
        cache = b.state("cache_k.3", (9, 2, 3))
        new = b.emit("cache_write", [cache, b.reshape(h, ("T", 2, 3), "Kcur"), pos], O.NoAttrs(), "cache_k.3")
    return b.finish([h], {"cache_k.3": new})


def _with_node(graph: Graph, i: int, **fields: Any) -> Graph:
    n = graph.nodes[i]
    new = Node(fields.get("op", n.op), fields.get("inputs", n.inputs), fields.get("attrs", n.attrs),
               fields.get("outputs", n.outputs))
    return graph.replace(nodes=[new if j == i else m for j, m in enumerate(graph.nodes)])


def test_verify_accepts_a_good_graph() -> None:
    verify(_small_graph(), {"T": 4, "P": 2})


def _bad_graphs() -> list[tuple[str, Graph]]:
    g = _small_graph()
    norm, reshape, write = g.nodes
    ghost = Value("ghost", ("T", 6), "float32")
    stale = Value("attn_norm", ("T", 7), "float32", 3)
    return [
        ("used before it is defined", g.replace(nodes=[reshape, norm, write])),
        ("never defined", _with_node(g, 0, inputs=(ghost, norm.inputs[1]))),
        ("defined twice", g.replace(nodes=[norm, norm, reshape, write])),
        ("attrs must be RMSNorm", _with_node(g, 0, attrs=O.Softmax())),
        ("the shape rule gives", _with_node(g, 0, outputs=(stale,))),
        ("unknown state", g.replace(state_out={**g.state_out, "cache_q": write.outputs[0]})),
        ("never reaches state_out", g.replace(state_out={})),
        ("graph output", g.replace(outputs=[ghost])),
        ("reshape of 24 elements into 12", _with_node(g, 1, attrs=O.Reshape(("T", 1, 3)),
                                                      outputs=(Value("Kcur", ("T", 1, 3), "float32", 3),))),
    ]


@pytest.mark.parametrize("expected,graph", _bad_graphs(), ids=lambda x: x if isinstance(x, str) else "")
def test_verify_rejects(expected: str, graph: Graph) -> None:
    with pytest.raises(IRError, match=expected) as info:
        verify(graph, {"T": 4, "P": 2})
    assert "\n" not in str(info.value)


def test_dump_reads_like_the_model() -> None:
    text = dump(_small_graph())
    assert "%attn_norm@3:float32[T,6] = rms_norm(%x, %blk.3.attn_norm.weight) eps=1e-05" in text
    assert "params: 1 (F32 1), 6 elements" in text and "%cache_k.3@3:float32[9,2,3] init=zeros" in text
    assert text.rstrip().endswith("state cache_k.3 <- %cache_k.3@3")
