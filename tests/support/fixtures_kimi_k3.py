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

import gguf

from tests.support.fixture_spec import FixtureSize

N_LEAD_DENSE = 1
CONV_KERNEL = 4
RES_BLOCK = 1
# the selection bias is drawn large enough to change which experts are picked
VALUE_KINDS = {"exp_probs_b.bias": "selection_bias"}


def dims(s: FixtureSize) -> dict[str, int]:
    return {"H": s.n_head, "dh": s.head_dim, "R": s.head_dim // 2, "nope": s.head_dim, "Dv": s.head_dim,
            "KVL": s.n_embd // 2, "Q": s.n_embd // 2, "L": s.n_embd // 2}


def is_kda(il: int) -> bool:
    return il % 2 == 1


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
