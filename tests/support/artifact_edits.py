"""Editing a sealed artifact in tests: the manifest digest is rewritten so that the checks behind
it (fields, hashes, the layout the kernels were built for) are what refuses the edit."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def write_manifest(root: Path, manifest: dict[str, Any] | str) -> None:
    """Replace `root`'s manifest.json and reseal manifest.sha256 to match it."""
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    (root / "manifest.json").write_text(text, encoding="utf-8")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    (root / "manifest.sha256").write_text(f"{digest}  manifest.json\n", encoding="utf-8")
