"""`ggufc export-onnx`: a model's all-logits graph written as an ONNX model (params and states as
inputs), as traced, after the fusion passes, or in standard ONNX ops only."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggufc.messages import GgufcError

from .models import precheck_gguf


@dataclass(frozen=True)
class OnnxExport:
    """What an export wrote: the graph's architecture, its ONNX node count, and its inputs."""

    arch: Any
    nodes: int
    params: int
    states: int


def export_onnx(path: Path, out: Path, n_ctx: int | None, *, fused: bool, standard: bool) -> OnnxExport:
    """Write the GGUF's all-logits graph (`fused`: after the fusion passes; `standard`: standard ONNX
    ops only) to `out`, atomically, overwriting nothing but an ONNX model ggufc wrote."""
    refuse_foreign_output(out)
    precheck_gguf(path)
    from ggufc.frontend.load import load_model
    from ggufc.ir.onnx_export import to_onnx

    graph = load_model(path, n_ctx).graphs["prefill_all"]
    if fused:
        from ggufc.passes.pipeline import run_pipeline

        graph = run_pipeline(graph)[0]
    model = to_onnx(graph, standard=standard)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(model.SerializeToString())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return OnnxExport(graph.meta.get("arch"), len(model.graph.node), len(graph.params), len(graph.states))


def refuse_foreign_output(out: Path) -> None:
    """Overwrite nothing but an ONNX model ggufc wrote; the folder must exist."""
    if out.is_dir():
        raise GgufcError(f"{out}: is a directory (expected a .onnx file path)")
    if not out.parent.is_dir():
        raise GgufcError(f"{out.parent}: no such directory")
    if out.exists():
        import onnx

        try:
            producer = onnx.load(os.fspath(out), load_external_data=False).producer_name
        except Exception:  # noqa: BLE001 - protobuf raises several kinds on foreign bytes
            producer = None
        if producer != "ggufc":
            raise GgufcError(f"{out}: exists and is not an ONNX model ggufc wrote; not overwriting it")
