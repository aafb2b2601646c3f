"""granitemoe (llama.cpp `src/models/granite-moe.cpp`, which reuses granite's graph; IBM Granite 3.x
MoE): granite's block (frontend/archs/granite.py) with every layer roped: `rope.scaling.finetuned`
is not read."""

from __future__ import annotations

from ..hparams import Keys
from . import granite

ARCH = "granitemoe"
HParams = granite.HParams
build = granite.build


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    return granite.read_granite_hparams(keys, n_vocab, finetuned_key=False)
