"""Sparse-attention indexers, CPU and GPU kernels side by side with their lowering (references:
`ir/sparse_indexers.py`), one file per selection scheme: `qsa` (blocks of the raw key cache),
`dsa` (tokens), `msa` (blocks per KV group), `compressed_rows` (deepseek4's compressors and the
attention over their rows); `selection` holds what the schemes share (llama.cpp's heap select,
the dense mask, attention over selected cells). Symbolic extents: `n` (tokens of the call) and
`pos` (tokens already cached).
"""

from __future__ import annotations

from ggufc.codegen.families.sparse_indexers import compressed_rows, dsa, msa, qsa, selection

SCHEMES = (selection, qsa, dsa, msa, compressed_rows)
# merged into codegen/lower.py's tables
INDEXER_LOWERING = {kind: rule for scheme in SCHEMES for kind, rule in scheme.LOWERING.items()}
GPU_KERNELS = {kind: kernel for scheme in SCHEMES for kind, kernel in scheme.GPU_KERNELS.items()}
