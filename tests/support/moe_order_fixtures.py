"""The small files whose logits llama.cpp's AVX2 build wrote into tests/goldens (by
tests/goldens/make_moe_order_goldens.py), every matrix Q4_K or every matrix Q6_K:

* qwen3moe (moe-avx2-orders.npz), sized so each of llama.cpp's MoE orders is taken at --cpu haswell
  (Q4_K experts of 8k rows repacked, an expert routed >= 8 rows of a 64-token prompt in the tiled
  Q6_K order, an F32 router of 8 rows through tinyBLAS and ggml_vec_dot_f32, K a multiple of 256);
* qwen35 (hybrid-avx2-orders.npz), three gated delta-net layers and a gated attention layer: Dk 64
  (ggml_vec_dot_f32's whole 32-key runs), 4 value heads (Q4_K gate projections llama.cpp leaves
  unrepacked: its tiled GEMM for prompts)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from tests.support.fixture_spec import FixtureSize
from tests.support.fixtures import write_fixture

QTYPES = ("Q4_K", "Q6_K")
SIZE = FixtureSize(vocab=512, n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_ff=256, n_expert=8,
                   n_expert_used=2, n_ctx=128)
HYBRID_SIZE = FixtureSize(vocab=512, n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_ff=256, n_ctx=128)
SIZES = {"qwen3moe": SIZE, "qwen35": HYBRID_SIZE}
GOLDENS = {"qwen3moe": "moe-avx2-orders.npz", "qwen35": "hybrid-avx2-orders.npz"}
SEED = 3
N_TOKENS = 64


def write(qtype: str, path: Path, arch: str = "qwen3moe") -> Path:
    return write_fixture(arch, path, seed=SEED, size=SIZES[arch], qtype=qtype, tokenizer="gpt2")


def tokens() -> np.ndarray:
    return ((np.arange(N_TOKENS) * 37 + 11) % (SIZE.vocab - 1) + 1).astype(np.int32)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
