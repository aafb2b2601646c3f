"""The CPU's 8-bit integer matmul family (AVX2, AVX-VNNI, AVX-512 VNNI, AMX): activation rounding,
GEMVs, prompt GEMMs and MoE experts in llama.cpp's order; `isa` holds the steps that differ per
instruction set."""
