"""The hybrid gated delta-net architectures (qwen35, qwen3next) in the fixture writer: their keys.
`fixtures.py` calls these for recipes with `hybrid=True`; the tensors are the ones the
architecture files read.

Sizes come from the common `FixtureSize`: delta-net head dim Dk = Dv = head_dim, key heads
Hk = n_head_kv and value heads Hv = n_head (so tiny fixtures share each q/k head between two value
heads and exercise the tiled/interleaved head maps), conv kernel 4. Layers alternate linear and
full attention (`full_attention_interval` 2: layer 0 is linear). qwen35's IMROPE sections
(2, 1, 1, 2) leave some rotary pairs on the "e" component (not rotated for text); qwen3next
rotates only half of each head (partial NEOX) and stores its experts' gate and up merged.
"""

from __future__ import annotations

import gguf

from tests.support.fixture_spec import FixtureSize

CONV_KERNEL = 4
FULL_ATTENTION_INTERVAL = 2
IMROPE_SECTIONS = (2, 1, 1, 2)


def ssm_sizes(s: FixtureSize) -> dict[str, int]:
    hk, hv, dk = s.n_head_kv, s.n_head, s.head_dim
    return {"Hk": hk, "Hv": hv, "Dk": dk, "C": 2 * hk * dk + hv * dk, "VD": hv * dk}


def is_linear_layer(il: int) -> bool:
    return (il + 1) % FULL_ATTENTION_INTERVAL != 0


def write_hybrid_hparams(w: gguf.GGUFWriter, arch: str, s: FixtureSize, *, moe: bool) -> None:
    z = ssm_sizes(s)
    w.add_ssm_conv_kernel(CONV_KERNEL)
    w.add_ssm_inner_size(z["VD"])
    w.add_ssm_state_size(z["Dk"])
    w.add_ssm_time_step_rank(z["Hv"])
    w.add_ssm_group_count(z["Hk"])
    w.add_full_attention_interval(FULL_ATTENTION_INTERVAL)
    if arch == "qwen35":
        w.add_rope_dimension_sections(list(IMROPE_SECTIONS))
    if moe:
        w.add_expert_shared_feed_forward_length(s.n_ff)


def rope_dimension_count(arch: str, s: FixtureSize) -> int:
    """qwen3next rotates only part of each head (the real model: 64 of 256)."""
    return s.head_dim // 2 if arch == "qwen3next" else s.head_dim
