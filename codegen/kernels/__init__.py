"""The generic (non-matmul) kernels: elementwise programs, reductions and norms, layout ops, rope,
attention over the KV cache, and llama.cpp's CPU vector math."""
