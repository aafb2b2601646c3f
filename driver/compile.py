"""`ggufc compile`: GGUF file -> artifact directory (kernels + kernel-layout weights + manifest)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from ggufc.codegen.build import DEFAULT_MAX_CHUNK, EMBED_FUNCTION, Built, Progress, kernel_weights, layout_fields
from ggufc.codegen.cpu_int8.block32 import check_prompt_tiles
from ggufc.codegen.target import cpu_manifest, target_key
from ggufc.frontend.load import LoadedModel, load_model
from ggufc.frontend.tokenizer_build import build_tokenizer
from ggufc.ir.state_kinds import SCRATCH, split_dependent, state_kinds
from ggufc.runtime import artifact as A
from ggufc.runtime import artifact_writer as AW

from .stages import build_model
from .tune.apply import open_tuning


def compile_model(
    model_path: str | os.PathLike[str], target: str = "llvm", out_dir: str | os.PathLike[str] = "out", *,
    n_ctx: int | None = None, disabled_passes: frozenset[str] = frozenset(), max_chunk: int = DEFAULT_MAX_CHUNK,
    progress: Progress = lambda s: None, tuning_db: str | os.PathLike[str] | None = None,
    tuning_min_speedup: float = 1.0, prompt_tiles: str = "kquant", window_caches: bool = True,
) -> dict[str, Any]:
    """Compile and write the artifact atomically; returns the manifest as written.

    `prompt_tiles`: "all" also puts the 32-value formats' prompt GEMMs on AMX tiles where the CPU
    has them (faster; their prompt logits then differ from llama.cpp's by float rounding), recorded
    in the manifest; "kquant" (default) only the K-quants' (codegen/quant_int8.tiles_chosen).

    `tuning_db`: a `ggufc tune` database whose tuned schedules replace the default ones where they
    measured at least `tuning_min_speedup` times faster (driver/tune/).

    `window_caches` off: sliding-window layers keep full caches on the CPU and vulkan/metal too
    (codegen/window_cache.py; cuda always does).
    """

    check_prompt_tiles(prompt_tiles)  # before the long part
    t0 = time.perf_counter()
    staging = staging_for(out_dir)  # before the long part: an output we may not write is refused now
    try:
        tuning = open_tuning(tuning_db, target, min_speedup=tuning_min_speedup)
        progress(f"reading {os.fspath(model_path)}")
        model = load_model(model_path, n_ctx)
        built = build_model(model, target, disabled_passes=disabled_passes, max_chunk=max_chunk,
                            progress=progress, tuning=tuning, prompt_tiles=prompt_tiles,
                            window_caches=window_caches)
        if tuning is not None:
            progress(f"{len(tuning.applied)} kernels use tuned schedules from {tuning_db}")
        progress("writing kernels")
        built.executable.export_library(str(staging / A.KERNELS_NAME))
        progress("writing weights in kernel layout")
        weights = kernel_weights(model, built.layouts)
        save_file(weights, str(staging / A.WEIGHTS_NAME))
        tokenizer = _write_tokenizer(model, staging)
        manifest = _manifest(model, built, tokenizer, weights, time.perf_counter() - t0)
        if prompt_tiles != "kquant":
            manifest["prompt_tiles"] = prompt_tiles
        return AW.finalize_artifact(staging, out_dir, manifest)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def staging_for(out_dir: str | os.PathLike[str]) -> Path:
    """Check that `out_dir` may become an artifact and make the staging directory beside it."""
    AW.check_output_dir(out_dir)
    try:
        return AW.make_staging_dir(out_dir)
    except OSError as exc:
        raise A.ArtifactError(f"{os.fspath(out_dir)}: cannot write there ({exc.strerror or exc})") from None


def _write_tokenizer(model: LoadedModel, staging: Path) -> dict[str, Any]:

    spec = build_tokenizer(model.gguf.metadata)
    info = {k: v for k, v in spec.to_dict().items() if k != "tokenizer_json"}
    info["file"] = None
    if spec.tokenizer_json is not None:
        (staging / "tokenizer.json").write_text(spec.tokenizer_json, encoding="utf-8")
        info["file"] = "tokenizer.json"
    return info


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _manifest(model: LoadedModel, built: Built, tokenizer: dict[str, Any], weights: dict[str, np.ndarray],
              seconds: float) -> dict[str, Any]:
    target = dict(built.target.export()) if hasattr(built.target, "export") else {"kind": built.target.kind.name}
    layout = layout_fields(model.n_ctx, int(model.hparams.n_vocab), built.max_chunk, built.layouts, built.states,
                           built.window_caches)
    return {
        "arch": model.arch,
        "hparams": _jsonable(model.hparams),
        **layout,
        "states": with_state_kinds(layout["states"], built),
        **ubatch_field(built),
        "target": _jsonable(plain_target(target)),
        "target_key": target_key(built.target),
        **cpu_manifest(built.target, _jsonable(plain_target(target))),
        "functions": {name: function_entry(name, built) for name in built.functions},
        "tokenizer": tokenizer,
        "source": {"file": os.path.basename(model.gguf.path), "sha256": A.sha256_file(model.gguf.path)},
        "passes": built.pass_stats,
        "kernels": built.kernel_names,
        **({"decode_batch_refused": built.decode_batch_refused} if built.decode_batch_refused else {}),
        "weight_bytes": int(sum(a.nbytes for a in weights.values())),
        "derived_bytes": int(sum(a.nbytes for a in model.derived.values())),
        "gguf_tensor_bytes": int(sum(t.n_bytes for t in model.gguf.tensors.values())),
        "compile_seconds": round(seconds, 3),
        **({"tuning": built.tuning.manifest()} if built.tuning is not None else {}),
        **gpu_manifest(built),
    }


def function_entry(name: str, built: Built) -> dict[str, Any]:
    """A function's token count, and for the hidden-state output its row width (n_embd)."""
    entry: dict[str, Any] = {"tokens": 1 if name == "decode" else "T"}
    if name == EMBED_FUNCTION:
        entry["width"] = int(built.graphs[name].outputs[0].shape[-1])
    return entry


def with_state_kinds(states: list[dict[str, Any]], built: Built) -> list[dict[str, Any]]:
    """Each state with its kind (ir/state_kinds.py), which tells the runtime how to truncate it;
    states the graphs do not carry (a step's own inputs on cuda) are rewritten by every call."""
    kinds = state_kinds(built.graphs["prefill_all"])
    return [{**s, "kind": A.WINDOW_KIND if "window" in s else kinds.get(s["name"], SCRATCH)} for s in states]


def ubatch_field(built: Built) -> dict[str, Any]:
    """Models whose recurrent numerics depend on the call split are fed in blocks of `ubatch` tokens
    at its multiples (llama.cpp's n_ubatch, 512: the compiled max_chunk), which the runtime keeps."""
    return {"ubatch": built.max_chunk} if split_dependent(built.graphs["prefill_all"]) else {}


def gpu_manifest(built: Built) -> dict[str, Any]:
    """GPU targets: the kernel files, how to run them, each kernel's schedule (codegen/gpu/build.py)."""
    exe = built.executable
    if not hasattr(exe, "kernel_files"):
        return {}
    return {"kernel_files": exe.kernel_files, "gpu": exe.manifest}


def plain_target(target: dict[str, Any]) -> dict[str, Any]:
    """The target as JSON: keep the fields that identify the code (kind, mcpu, mtriple, cores)."""
    keep = ("kind", "mcpu", "mtriple", "num-cores", "mattr", "arch")
    return {k: _plain_value(v) for k, v in target.items() if k in keep}


def _plain_value(value: Any) -> Any:
    if isinstance(value, (int, float, str)):
        return value
    if isinstance(value, (list, tuple)) or type(value).__name__ == "Array":  # TVM's Array of strings
        return [str(v) for v in value]
    return str(value)


def dumps(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=2, sort_keys=True)
