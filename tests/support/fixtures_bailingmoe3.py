"""bailingmoe3 in the fixture writer: the paths llama.cpp's own fixture (MLA with Q-LoRA and M-RoPE
on layer 0, KDA on layer 1) does not take: KDA on the even layers (layer 0 with a dense FFN,
clamped after its SiLU), MLA with a direct `attn_q` (no Q-LoRA) and NORM rope on the odd layers,
a sigmoid MoE with renormalised, scaled weights, clamped experts (one limit for every layer) and a
clamped shared expert (per-layer limits). `fixtures.py` calls these for the recipe with
`bailing=True`.

Sizes from the common `FixtureSize`: H = n_head (KDA and MLA), dh = head_dim, MLA kv_lora =
n_embd / 2, rope part R = head_dim / 2, nope = head_dim, Dv = head_dim. `ssm_a` is drawn positive
(the file stores +exp(A_log)). The `.scale` and KDA bias options write nothing: llama.cpp loads
those tensors for bailingmoe3 and never reads them (its own fixture carries them).
"""

from __future__ import annotations

import gguf

from tests.support.fixture_spec import FixtureSize

ARCH = "bailingmoe3"
N_LEAD_DENSE = 1
CONV_KERNEL = 4
CLAMP_EXP = 0.3  # below the typical |silu(g)| and |u| of the fixture, so the clamps bite
CLAMP_SHEXP = 0.25
VALUE_KINDS = {"exp_probs_b.bias": "selection_bias", "ssm_a": "norm"}


def dims(s: FixtureSize) -> dict[str, int]:
    return {"H": s.n_head, "dh": s.head_dim, "R": s.head_dim // 2, "nope": s.head_dim, "Dv": s.head_dim,
            "KVL": s.n_embd // 2}


def is_kda(il: int) -> bool:
    return il % 2 == 0


def write_hparams(w: gguf.GGUFWriter, s: FixtureSize) -> None:
    """The keys after the common ones (context, embedding, blocks, heads, eps, rope base)."""
    d = dims(s)
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    w.add_feed_forward_length(s.n_ff)
    w.add_key_value(f"{ARCH}.attention.head_count_kv", [0 if is_kda(il) else 1 for il in range(s.n_layer)],
                    gguf.GGUFValueType.ARRAY, u32)
    w.add_key_length(d["KVL"] + d["R"])
    w.add_value_length(d["KVL"])
    w.add_rope_dimension_count(d["R"])
    w.add_uint32(f"{ARCH}.attention.kv_lora_rank", d["KVL"])
    w.add_uint32(f"{ARCH}.attention.key_length_mla", d["nope"] + d["R"])
    w.add_uint32(f"{ARCH}.attention.value_length_mla", d["Dv"])
    w.add_uint32(f"{ARCH}.kda.head_dim", d["dh"])
    w.add_float32(f"{ARCH}.kda.gate_lower_bound", -5.0)
    w.add_uint32(f"{ARCH}.ssm.conv_kernel", CONV_KERNEL)
    w.add_uint32(f"{ARCH}.leading_dense_block_count", N_LEAD_DENSE)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_expert_feed_forward_length(s.n_ff)
    w.add_expert_shared_count(1)
    w.add_uint32(f"{ARCH}.expert_shared_feed_forward_length", s.n_ff // 2)
    w.add_uint32(f"{ARCH}.expert_gating_func", 2)
    w.add_bool(f"{ARCH}.expert_weights_norm", True)
    w.add_float32(f"{ARCH}.expert_weights_scale", 2.5)
    w.add_float32(f"{ARCH}.swiglu_clamp_exp", CLAMP_EXP)
    w.add_key_value(f"{ARCH}.swiglu_clamp_shexp", [CLAMP_SHEXP] * s.n_layer, gguf.GGUFValueType.ARRAY, f32)
