"""gemma3 (llama.cpp `src/models/gemma3.cpp`; Gemma 3 270M-27B text): the Gemma decoder
(frontend/blocks_gemma.py) with q/k norms, window layers by a period of 6 (every 6th layer full)
when `attention.sliding_window` is set, their rope base 10000 unless `rope.freq_base_swa` says
otherwise, no score softcap, a final logit softcap only where the file sets one."""

from __future__ import annotations

from ggufc.ir.graph import Graph

from .. import blocks as B
from ..blocks_gemma import GemmaParams, build_gemma, read_gemma_hparams
from ..hparams import Keys

ARCH = "gemma3"
HParams = GemmaParams


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    return read_gemma_hparams(keys, n_vocab, arch=ARCH, window_default=0, period=6, big_layers=62,
                              swa_base_default=10000.0, attn_softcap=None, final_softcap_default=0.0, qk_norm=True)


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    return build_gemma(w, hp, n_ctx, all_logits)
