"""`ggufc inspect`: what a GGUF file holds and whether ggufc can compile it, as a plain report (the
CLI prints it as text or JSON). The compiler is imported only when a report is made."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from ggufc.messages import one_line


def inspect_report(path: Path) -> dict[str, Any]:
    """What the file holds and whether ggufc can compile it (the GGUF is parsed once)."""
    from ggufc.frontend.gguf_file import open_gguf
    from ggufc.frontend.hparams import ModelError
    from ggufc.frontend.load import load_model

    try:
        model = load_model(path)
    except ModelError as exc:
        gguf = open_gguf(path)
        report = _file_report(path, gguf, missing=one_line(exc))
        report["hparams"] = raw_hparams(gguf) or None
        return report
    report = _file_report(path, model.gguf, missing=None)
    report.update(hparams=_plain(model.hparams), n_ctx=model.n_ctx)
    report["fusions"] = fusion_hits(model.graphs)
    return report


def _file_report(path: Path, gguf: Any, missing: str | None) -> dict[str, Any]:
    return {
        "file": str(path),
        "architecture": gguf.architecture or None,
        "supported": missing is None,
        "missing": missing,
        "hparams": None,
        "n_ctx": None,
        "metadata": {k: v for k, v in gguf.metadata.items() if not isinstance(v, list)},
        "tensors": [
            {"name": t.name, "type": t.qtype, "shape": list(t.shape)}
            for t in sorted(gguf.tensors.values(), key=lambda t: natural_key(t.name))
        ],
        "fusions": None,
    }


def natural_key(name: str) -> list[Any]:
    """blk.2 before blk.10: digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def raw_hparams(gguf: Any) -> dict[str, Any]:
    """The architecture's own keys as the file states them (for architectures ggufc cannot build)."""
    prefix = f"{gguf.architecture}."
    return {k[len(prefix):]: v for k, v in gguf.metadata.items() if k.startswith(prefix) and not isinstance(v, list)}


def fusion_hits(graphs: dict[str, Any]) -> dict[str, int] | str:
    """Hits per rule when compiling for this CPU: the pipeline's on the all-logits graph, and the
    target's own rules (those marked "(decode)" on the decode step's graph)."""
    try:
        from ggufc.codegen.target import cpu_target
        from ggufc.driver.stages import optimise
    except ImportError as exc:
        return f"passes unavailable ({one_line(exc)})"
    _, hits = optimise(dict(graphs), frozenset(), cpu_target())
    return dict(hits)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(obj).items()}
    return obj
