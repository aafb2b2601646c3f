"""The generic (non-matmul) kernels, one module per kind of computation: elementwise programs,
reductions and norms, data movement, rope, attention over the KV cache (the score-matrix form and
the CPU's row-at-a-time form in llama.cpp's order), top-k, cache writes, llama.cpp's CPU vector math.

Each TE builder takes concrete or symbolic shapes (symbolic dims are TIR vars made per kernel, so a
kernel serves every layer and every token count) and returns an unscheduled PrimFunc whose
arguments are: tensor inputs and scalars in IR order, then outputs (Relax's call_tir convention).
Quantized matmuls and embeddings live in `codegen/formats`; schedules in `codegen/schedule.py`.
"""
