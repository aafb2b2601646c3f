"""gemma2 (llama.cpp `src/models/gemma2.cpp`; Gemma 2 2B/9B/27B): the Gemma decoder
(frontend/blocks_gemma.py) without q/k norms, always windowed (4096 cells unless the file says
otherwise) on every other layer, window layers roped as the others unless `rope.freq_base_swa`
says otherwise, tanh softcaps on the scores (50) and on the logits (30)."""

from __future__ import annotations

from ggufc.ir.graph import Graph

from .. import blocks as B
from ..blocks_gemma import GemmaParams, build_gemma, read_gemma_hparams
from ..hparams import Keys, ModelError

ARCH = "gemma2"
HParams = GemmaParams


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    hp = read_gemma_hparams(keys, n_vocab, arch=ARCH, window_default=4096, period=2, big_layers=46,
                            swa_base_default=None, attn_softcap=50.0, final_softcap_default=30.0, qk_norm=False)
    if hp.final_softcap <= 0 or hp.attn_softcap <= 0:
        raise ModelError(f"gemma2 softcaps must be > 0 (attn {hp.attn_softcap}, final {hp.final_softcap}): "
                         "llama.cpp divides by them")
    return hp


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    return build_gemma(w, hp, n_ctx, all_logits)
