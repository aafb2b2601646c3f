"""Fixtures shared by the whole test run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One `GGUFC_CACHE` for the run: a fixture model compiled by one test module is reused by the
    next. Under pytest-xdist the workers share it (their base folders sit side by side), and the
    cache's compile lock makes a second worker wait for the first's artifact instead of compiling."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / "ggufc-compile-cache"
    folder.mkdir(exist_ok=True)
    return folder
