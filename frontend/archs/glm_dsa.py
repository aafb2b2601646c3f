"""glm-dsa (llama.cpp `src/models/glm-dsa.cpp`; docs/arch/deepseek-glm-minimax-kimi-hy.md §3).

deepseek32's block (archs/deepseek32.py) with NORM rope on the indexer, the indexer key LayerNorm's
eps 0.0 (llama.cpp never sets it for this architecture), `expert_gating_func` defaulting to
sigmoid, and `attention.indexer.types`: full layers (1) compute their own top-k, shared layers (0)
reuse the most recent full layer's selection and carry no indexer tensors. Without the key every
layer is full below a 1M-token training context; from 1M on (GLM-5.2) layers 0 and 1 are full,
then one full layer in every four (2, 6, 10, ...).
"""

from __future__ import annotations

from ggufc.ir.graph import Graph

from .. import blocks as B
from ..hparams import Keys, ModelError
from . import deepseek32
from .deepseek32 import HParams

ARCH = "glm-dsa"
FACTS = deepseek32.DsaFacts(ARCH, "norm", 0.0, False)
LONG_CONTEXT = 1048576  # from here on the default schedule shares indexers


def default_types(n_layer: int, n_ctx_train: int) -> tuple[bool, ...]:
    if n_ctx_train < LONG_CONTEXT:
        return (True,) * n_layer
    return tuple(il < 2 or (il - 2) % 4 == 0 for il in range(n_layer))


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    n_layer = keys.int("block_count")
    raw = keys.raw("attention.indexer.types")
    if raw is None:
        full = default_types(n_layer, keys.int("context_length"))
    else:
        full = tuple(bool(v) for v in keys.per_layer("attention.indexer.types", n_layer))
    if not full[0]:
        raise ModelError(f"{ARCH}: attention.indexer.types must make layer 0 a full indexer layer")
    return deepseek32.read_common(keys, n_vocab, FACTS, full)


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    return deepseek32.build(w, hp, n_ctx, all_logits)
