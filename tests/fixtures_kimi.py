"""kimi-k3 in the fixture writer: MLA layers without rope (even layers, layer 0 with a dense situ
FFN) and KDA layers (odd layers), cross-layer residual attention banking every layer, a latent
MoE with situ experts and a shared expert. `fixtures.py` calls these for the recipe with
`kimi=True`.

Sizes from the common `FixtureSize`: H = n_head (KDA and MLA), dh = head_dim, MLA kv_lora =
n_embd / 2, rope part R = head_dim / 2 (never roped), nope = head_dim, Dv = head_dim, q_lora =
n_embd / 2; latent experts in n_embd / 2 dims with the routed norm. The KDA gate is the softplus
form (no `kda.gate_lower_bound`; llama.cpp's own fixture has the lower-bound form). The
`.scale` and KDA bias options write nothing: llama.cpp loads those tensors for kimi-k3 and never
reads them (its own fixture, tests/test_kimi_k3.py, carries them).
"""

from __future__ import annotations

from collections.abc import Iterator

import gguf
from fixture_spec import FixtureOptions, FixtureSize, TensorSpec, linear

N_LEAD_DENSE = 1
CONV_KERNEL = 4
RES_BLOCK = 1


def dims(s: FixtureSize) -> dict[str, int]:
    return {"H": s.n_head, "dh": s.head_dim, "R": s.head_dim // 2, "nope": s.head_dim, "Dv": s.head_dim,
            "KVL": s.n_embd // 2, "Q": s.n_embd // 2, "L": s.n_embd // 2}


def is_kda(il: int) -> bool:
    return il % 2 == 1


def plan(s: FixtureSize, opts: FixtureOptions) -> list[TensorSpec]:
    E = s.n_embd
    specs = [TensorSpec("token_embd.weight", (s.vocab, E), "matrix"), TensorSpec("output_norm.weight", (E,), "norm")]
    if not opts.tied_output:
        specs.append(TensorSpec("output.weight", (s.vocab, E), "matrix"))
    specs.append(TensorSpec("output_res_score.weight", (E,), "norm"))
    for il in range(s.n_layer):
        specs += [TensorSpec(f"blk.{il}.{t.name}", t.shape, t.kind) for t in _layer(il, s, opts)]
    return specs


def _layer(il: int, s: FixtureSize, opts: FixtureOptions) -> Iterator[TensorSpec]:
    E = s.n_embd
    yield TensorSpec("attn_norm.weight", (E,), "norm")
    yield TensorSpec("attn_res_score.weight", (E,), "norm")
    yield TensorSpec("ffn_res_score.weight", (E,), "norm")
    yield from _kda(s, opts) if is_kda(il) else _mla(s, opts)
    yield TensorSpec("ffn_norm.weight", (E,), "norm")
    if il < N_LEAD_DENSE:
        F = s.n_ff
        for name, shape in (("ffn_gate", (F, E)), ("ffn_up", (F, E)), ("ffn_down", (E, F))):
            yield from linear(name, shape, bias=False, scale=False)
        return
    yield from _latent_moe(s, opts)


def _mla(s: FixtureSize, opts: FixtureOptions) -> Iterator[TensorSpec]:
    d = dims(s)
    E, H, R, KVL, Q = s.n_embd, d["H"], d["R"], d["KVL"], d["Q"]
    yield TensorSpec("attn_q_a.weight", (Q, E), "matrix")
    yield TensorSpec("attn_q_a_norm.weight", (Q,), "norm")
    yield TensorSpec("attn_q_b.weight", (H * (d["nope"] + R), Q), "matrix")
    yield TensorSpec("attn_kv_a_mqa.weight", (KVL + R, E), "matrix")
    yield TensorSpec("attn_kv_a_norm.weight", (KVL,), "norm")
    yield TensorSpec("attn_k_b.weight", (H, KVL, d["nope"]), "matrix")
    yield TensorSpec("attn_v_b.weight", (H, d["Dv"], KVL), "matrix")
    yield from linear("attn_gate", (H * d["Dv"], E), bias=False, scale=False)
    yield from linear("attn_output", (E, H * d["Dv"]), bias=False, scale=False)


def _kda(s: FixtureSize, opts: FixtureOptions) -> Iterator[TensorSpec]:
    d = dims(s)
    E, H, dh = s.n_embd, d["H"], d["dh"]
    inner = H * dh
    for n in "qkv":
        yield from linear(f"attn_{n}", (inner, E), bias=False, scale=False)
        yield TensorSpec(f"ssm_conv1d_{n}.weight", (inner, 1, CONV_KERNEL), "conv")
    yield TensorSpec("ssm_f_a.weight", (dh, E), "matrix")
    yield TensorSpec("ssm_f_b.weight", (inner, dh), "matrix")
    yield from linear("ssm_beta", (H, E), bias=False, scale=False)
    yield TensorSpec("ssm_a", (H,), "ssm_a")
    yield TensorSpec("ssm_dt.bias", (inner,), "bias")
    yield TensorSpec("ssm_g.weight", (inner, E), "matrix")
    yield TensorSpec("ssm_norm.weight", (dh,), "norm")
    yield from linear("attn_output", (E, inner), bias=False, scale=False)


def _latent_moe(s: FixtureSize, opts: FixtureOptions) -> Iterator[TensorSpec]:
    E, F, X, L = s.n_embd, s.n_ff, s.n_expert, dims(s)["L"]
    yield TensorSpec("ffn_gate_inp.weight", (X, E), "router")
    yield TensorSpec("exp_probs_b.bias", (X,), "selection_bias")
    for kind, shape in (("gate", (X, F, L)), ("up", (X, F, L)), ("down", (X, L, F))):
        yield TensorSpec(f"ffn_{kind}_exps.weight", shape, "matrix")
    yield TensorSpec("ffn_routed_down.weight", (L, E), "matrix")
    yield TensorSpec("ffn_routed_up.weight", (E, L), "matrix")
    yield TensorSpec("ffn_routed_norm.weight", (L,), "norm")
    for name, shape in (("ffn_gate_shexp", (F, E)), ("ffn_up_shexp", (F, E)), ("ffn_down_shexp", (E, F))):
        yield from linear(name, shape, bias=False, scale=False)


def write_hparams(w: gguf.GGUFWriter, s: FixtureSize) -> None:
    """The keys after the common ones (context, embedding, blocks, heads, eps, rope base)."""
    d = dims(s)
    arch = "kimi-k3"
    u32 = gguf.GGUFValueType.UINT32
    w.add_feed_forward_length(s.n_ff)
    w.add_key_value(f"{arch}.attention.head_count_kv", [0 if is_kda(il) else 1 for il in range(s.n_layer)],
                    gguf.GGUFValueType.ARRAY, u32)
    w.add_key_length(d["KVL"] + d["R"])
    w.add_rope_dimension_count(d["R"])
    w.add_uint32(f"{arch}.attention.q_lora_rank", d["Q"])
    w.add_uint32(f"{arch}.attention.kv_lora_rank", d["KVL"])
    w.add_uint32(f"{arch}.attention.key_length_mla", d["nope"] + d["R"])
    w.add_uint32(f"{arch}.attention.value_length_mla", d["Dv"])
    w.add_uint32(f"{arch}.kda.head_dim", d["dh"])
    w.add_uint32(f"{arch}.ssm.conv_kernel", CONV_KERNEL)
    w.add_uint32(f"{arch}.attn_res.block_size", RES_BLOCK)
    w.add_float32(f"{arch}.activation.situ_beta", 4.0)
    w.add_float32(f"{arch}.activation.situ_linear_beta", 25.0)
    w.add_uint32(f"{arch}.leading_dense_block_count", N_LEAD_DENSE)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_expert_feed_forward_length(s.n_ff)
    w.add_expert_shared_count(1)
    w.add_uint32(f"{arch}.expert_latent_length", d["L"])
    w.add_uint32(f"{arch}.expert_gating_func", 2)
    w.add_bool(f"{arch}.expert_weights_norm", True)
    w.add_float32(f"{arch}.expert_weights_scale", 2.5)
