"""GGUF block formats in kernels: the format table, load-time repack, numpy reference decode, and the
float (dequantize-as-you-go) matmul kernels."""
