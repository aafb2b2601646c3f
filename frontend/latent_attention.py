"""Multi-head latent attention (MLA), absorbed form, spelled from the shared blocks (llama.cpp
`deepseek32.cpp` / `glm-dsa.cpp`; docs/arch/deepseek-glm-minimax-kimi-hy.md §2.3).

Low-rank q (`attn_q_a`, its RMSNorm, `attn_q_b`) split per head into `[nope | rope]`; the joint
`attn_kv_a_mqa` projection gives `[latent | k_pe]`, the latent normalised, `k_pe` roped (one head);
`attn_k_b` is folded into q (q_nope -> kv_lora per head) so attention runs in the latent space over
a cache of one row `[kv_lora | rope]` per token: the rows are the keys and their first kv_lora
columns the values; `attn_v_b` maps each head's latent output to Dv. The cache therefore holds
kv_lora + rope floats per token and layer instead of H * (Dk + Dv) for expanded K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Value

from . import blocks as B
from .hparams import ModelError


@dataclass(frozen=True)
class MlaDims:
    n_head: int
    q_lora: int
    kv_lora: int
    n_rot: int  # the roped part of each q/k head (k_pe)
    nope: int  # the un-roped part of each q head (Dk = nope + n_rot)
    v_head: int  # Dv

    @property
    def row(self) -> int:
        """Floats per token and layer in the latent cache."""
        return self.kv_lora + self.n_rot

    @property
    def key_dim(self) -> int:
        return self.nope + self.n_rot


def low_rank_q(b: GraphBuilder, w: B.Weights, p: str, h: Value, dims: MlaDims, eps: float) -> Value:
    """The q latent qr = RMSNorm(h @ attn_q_a.T) [T, Q] (the lightning indexer reads it too)."""
    E = int(h.shape[1])
    q_a = B.linear(b, h, w.need(f"{p}.attn_q_a.weight", (dims.q_lora, E)), "q_a")
    return B.rms_norm(b, q_a, w.need(f"{p}.attn_q_a_norm.weight", (dims.q_lora,)), eps, "qr")


def head_linear(b: GraphBuilder, w: B.Weights, name: str, x: Value, n_out: int, short: str) -> Value:
    """x [T, H, K] through the per-head matrices `name` [H, n_out, K] -> [T, H, n_out]. With one head
    the GGUF tensor is 2-D [n_out, K] and this is an ordinary matmul."""
    t, n_head, k = x.shape
    info = w.model.tensors.get(name)
    if int(n_head) == 1 and info is not None and len(info.shape) == 2:
        y = b.matmul(b.reshape(x, (t, k), f"{short}.in"), w.need(name, (n_out, int(k))), f"{short}.2d")
        return b.reshape(y, (t, 1, n_out), short)
    wt = w.need(name, (int(n_head), n_out, int(k)))
    wf = wt if wt.dtype == "float32" else b.dequantize(wt, f"{short}.w")
    return b.emit("head_matmul", [x, wf], O.NoAttrs(), short)


def mla_attention(
    b: GraphBuilder, w: B.Weights, p: str, layer: int, h: Value, qr: Value, dims: MlaDims, eps: float, pos: Value,
    table: Value | None, n_ctx: int, scale: float, new_state: dict[str, Value], select: Value | None,
    out_gate: Value | None = None, output_scale: bool = True, rope_mode: str = "norm", head_gate: Value | None = None,
) -> Value:
    """The attention block's output [T, E] (before the residual); `select`: the indexer's selected
    cells [T, W] (attention reads only them), None for dense causal attention. `table` None: no
    rope anywhere (the `k_pe`/`q_pe` parts enter as they are, kimi-k3); `qr` is then the layer
    input itself when there is no q_lora (`attn_q`). `out_gate` [T, H*Dv]: the heads' output is
    multiplied by sigmoid(out_gate) before the output projection; `head_gate` [T, H]: one such gate
    per head (bailingmoe3); `output_scale` False: an `attn_output.scale` tensor is not applied (the
    caller's architecture never reads it); `rope_mode`: how q_pe/k_pe pair their dims ("norm" for the
    deepseek family, "neox" for M-RoPE text positions, whose sections live in the table)."""
    E = int(h.shape[1])
    H, R, KVL = dims.n_head, dims.n_rot, dims.kv_lora
    t = h.shape[0]
    q_w = (w.need(f"{p}.attn_q_b.weight", (H * dims.key_dim, dims.q_lora)) if dims.q_lora
           else w.need(f"{p}.attn_q.weight", (H * dims.key_dim, E)))
    q = B.heads(b, B.linear(b, qr, q_w, "q"), H, dims.key_dim, "q3")
    q_nope = b.slice(q, 2, 0, dims.nope, "q_nope")
    q_pe = b.slice(q, 2, dims.nope, dims.key_dim, "q_pe_raw")
    kv = B.linear(b, h, w.need(f"{p}.attn_kv_a_mqa.weight", (KVL + R, E)), "kv_cmpr_pe")
    k_pe = b.reshape(b.slice(kv, 1, KVL, KVL + R, "k_pe_raw2"), (t, 1, R), "k_pe_raw")
    if table is not None:
        q_pe = B.rope(b, q_pe, pos, table, rope_mode, R, "q_pe")
        k_pe = B.rope(b, k_pe, pos, table, rope_mode, R, "k_pe")
    latent = B.rms_norm(b, b.slice(kv, 1, 0, KVL, "kv_cmpr_raw"), w.need(f"{p}.attn_kv_a_norm.weight", (KVL,)),
                        eps, "kv_cmpr")
    q_abs = head_linear(b, w, f"{p}.attn_k_b.weight", q_nope, KVL, "q_nope_absorbed")
    q_full = b.emit("concat", [q_abs, q_pe], O.Concat(2), "Qcur")
    row = b.emit("concat", [b.reshape(latent, (t, 1, KVL), "kv_cmpr3"), k_pe], O.Concat(2), "Kcur")
    cache = b.state(f"cache_latent.{layer}", (n_ctx, 1, dims.row))
    kc = b.emit("cache_write", [cache, row, pos], O.NoAttrs(), f"cache_latent.{layer}")
    new_state[f"cache_latent.{layer}"] = kc
    if select is None:
        a = b.emit("attention", [q_full, kc, kc, pos], O.Attention(scale), "kqv_latent_row")
    else:  # the spelled selection: an additive mask (fuse_indexer makes it the sparse attention)
        mask = b.emit("index_mask", [select, pos], O.NoAttrs(), "kq_mask_top_k")
        a = b.emit("attention", [q_full, kc, kc, pos, mask], O.Attention(scale, "additive"), "kqv_latent_row")
    o_latent = b.slice(a, 2, 0, KVL, "kqv_latent")  # the values are the rows' first kv_lora columns
    o_heads = head_linear(b, w, f"{p}.attn_v_b.weight", o_latent, dims.v_head, "kqv_out")
    if head_gate is not None:
        sig = b.reshape(b.unary("sigmoid", head_gate, "mla_head_gate_sigmoid"), (t, H, 1), "mla_head_gate3")
        o_heads = b.mul(o_heads, sig, "mla_head_gated")
    o = B.flatten_heads(b, o_heads, "kqv_flat")
    if out_gate is not None:
        o = b.mul(o, b.unary("sigmoid", out_gate, "mla_gate_sigmoid"), "mla_gated")
    wo = w.need(f"{p}.attn_output.weight", (E, H * dims.v_head))
    scale_o = w.get(f"{p}.attn_output.scale", (1,), required=False) if output_scale else None
    return B.linear(b, o, wo, "attn_out", scale=scale_o)


def check_dims(dims: MlaDims, key_length: int, value_length: int, arch: str) -> None:
    """The cache row (`key_length`) is kv_lora + rope and the values (`value_length`) kv_lora wide."""
    if min(dims.n_head, dims.q_lora, dims.kv_lora, dims.n_rot, dims.nope, dims.v_head) <= 0 or dims.n_rot % 2:
        raise ModelError(f"{arch}: MLA dims must be positive with an even rope part, got {dims}")
    if key_length != dims.row or value_length != dims.kv_lora:
        raise ModelError(f"{arch}: attention.key_length {key_length} / value_length {value_length} must be "
                         f"kv_lora_rank + rope ({dims.row}) / kv_lora_rank ({dims.kv_lora})")
