"""Sparse-attention indexers, one file per scheme: the DSA lightning indexer (`dsa`), the QSA block
indexer (`qsa`) and the compressed rows with their indexer (`compressed_rows`)."""
