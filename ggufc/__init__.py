"""ggufc: an ahead-of-time compiler for GGUF models.

The Python API (see ggufc.api): `ggufc.compile(model, out)`, `ggufc.load(model_or_artifact)` ->
`ggufc.Model` (tokenize, generate, complete, eval). Imported on first use, so `import ggufc` stays
light.
"""

from __future__ import annotations

from typing import Any

from .messages import GgufcError
from .version import __version__

__all__ = ["GgufcError", "Model", "__version__", "compile", "load"]


def __getattr__(name: str) -> Any:
    if name in ("compile", "load", "Model"):
        from ggufc import api

        return getattr(api, name)
    raise AttributeError(f"module 'ggufc' has no attribute {name!r}")
