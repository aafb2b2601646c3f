"""CUDA artifacts: hand TVM's CUDA module loader the fatbin compiled at `ggufc compile` time.

TVM 0.27 stores a CUDA module as CUDA C and compiles it when the module is loaded, by calling
the global function `tvm_callback_cuda_compile(code)` (NVRTC by default, see the tvm-0.27
notes §3-4). A ggufc cuda artifact already holds that code compiled for the requested
architectures (`kernels.fatbin`: SASS per arch + PTX for newer GPUs, with the sha256 of the
source it came from). Before loading `kernels.so`, the session registers a callback that returns
the fatbin when the code matches, so the GPU host compiles nothing; any other code (or an
artifact built where no CUDA compiler existed) is compiled for the present GPU through TVM's
NVRTC path, and `CUDA_LOADS` records which happened.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

CUDA_LOADS = {"prebuilt": 0, "compiled": 0}


def provide_cuda_binary(root: Path, manifest: dict[str, Any]) -> None:
    import tvm_ffi

    info = ((manifest.get("gpu") or {}).get("cuda")) or {}
    binary = info.get("binary")
    want = str(info.get("source_sha256", ""))
    if binary is not None:  # a plain name among the artifact's hash-checked files
        files = manifest.get("files")
        if not isinstance(files, dict):
            files = {}
        if not isinstance(binary, str) or "/" in binary or binary.startswith(".") or binary not in files:
            raise ValueError(f"manifest names CUDA binary {binary!r:.60}, not one of the artifact's checked files")
    data = (Path(root) / binary).read_bytes() if binary else None
    try:  # TVM's own NVRTC/nvcc callback, for code the artifact has no binary for
        from tvm.support import nvcc as tvm_nvcc

        fallback = tvm_nvcc.tvm_callback_cuda_compile
    except ImportError:
        fallback = None

    def compile_cuda(code: str, *_: Any) -> bytearray:
        if data is not None and hashlib.sha256(str(code).encode()).hexdigest() == want:
            CUDA_LOADS["prebuilt"] += 1
            return bytearray(data)
        if fallback is None:
            raise RuntimeError("kernels.so holds CUDA code this artifact has no binary for, and TVM's NVRTC "
                               "compiler is unavailable (pip install cuda-bindings nvidia-cuda-nvrtc)")
        CUDA_LOADS["compiled"] += 1
        return bytearray(fallback(code))

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_cuda, override=True)
