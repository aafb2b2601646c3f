"""A session's whole context state in one file: tokens, per-position caches (the cells in use),
recurrent states, and the checkpoints and rollback copies, tied to one artifact.

The file is an uncompressed `.npz` (numpy's zip of arrays, read without pickle). Its `meta`
member is JSON: the format, the sha256 of the artifact's manifest (which lists the hash of every
kernel and weight file, so it names the artifact exactly), the token count and the positions of
the copies. A file from another artifact is refused before anything is written to the session.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ggufc.messages import GgufcError

from .artifact import one_line

FORMAT = "ggufc-session-state/1"


class StateFileError(GgufcError, ValueError):
    """A state file that cannot be loaded into this session (one line)."""


@dataclass
class SavedState:
    artifact: str  # sha256 of the artifact's manifest.json
    tokens: np.ndarray
    states: dict[int, np.ndarray]  # state index -> cells [0, n) or the whole recurrent state
    checkpoints: dict[int, list[np.ndarray]]
    rollback: dict[int, list[np.ndarray]]
    window_from: dict[int, int] = field(default_factory=dict)  # window state -> first position it holds


def write_state_file(path: str | os.PathLike[str], saved: SavedState) -> None:
    """Write atomically (a temporary file beside `path`, then renamed)."""
    meta = {"format": FORMAT, "artifact": saved.artifact, "n_past": int(saved.tokens.size),
            "states": sorted(saved.states), "checkpoints": sorted(saved.checkpoints),
            "rollback": sorted(saved.rollback), "window_from": {str(i): v for i, v in saved.window_from.items()}}
    arrays: dict[str, np.ndarray] = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8),
                                     "tokens": saved.tokens.astype(np.int32)}
    arrays.update({f"state.{i}": a for i, a in saved.states.items()})
    for name, store in (("checkpoint", saved.checkpoints), ("rollback", saved.rollback)):
        for pos, copies in store.items():
            arrays.update({f"{name}.{pos}.{j}": a for j, a in enumerate(copies)})
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)  # type: ignore[arg-type]
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_state_file(path: str | os.PathLike[str], artifact: str, n_recurrent: int) -> SavedState:
    """The file's contents once its format and artifact are checked (shapes are the caller's)."""
    where = os.fspath(path)
    try:
        with np.load(where, allow_pickle=False) as npz:
            members = {k: npz[k] for k in npz.files}
    except FileNotFoundError:
        raise StateFileError(f"{where}: no such state file") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise StateFileError(f"{where}: not a ggufc state file ({one_line(exc)})") from None
    meta = _meta(members, where)
    if meta.get("artifact") != artifact:
        raise StateFileError(f"{where}: state of another artifact (manifest sha256 {str(meta.get('artifact'))[:12]}, "
                             f"this session's is {artifact[:12]})")
    try:
        tokens = members["tokens"]
        states = {int(i): members[f"state.{int(i)}"] for i in meta["states"]}
        checkpoints = {int(p): [members[f"checkpoint.{int(p)}.{j}"] for j in range(n_recurrent)]
                       for p in meta["checkpoints"]}
        rollback = {int(p): [members[f"rollback.{int(p)}.{j}"] for j in range(n_recurrent)] for p in meta["rollback"]}
        window_from = {int(i): int(v) for i, v in dict(meta.get("window_from", {})).items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise StateFileError(f"{where}: incomplete state file (missing or malformed {one_line(exc)})") from None
    if tokens.ndim != 1 or tokens.dtype != np.int32 or tokens.size != meta.get("n_past"):
        raise StateFileError(f"{where}: malformed token list")
    return SavedState(artifact, tokens, states, checkpoints, rollback, window_from)


def _meta(members: dict[str, np.ndarray], where: str) -> dict[str, Any]:
    raw = members.get("meta")
    try:
        meta = json.loads(bytes(raw)) if raw is not None and raw.dtype == np.uint8 else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StateFileError(f"{where}: not a ggufc state file (no {FORMAT} header)")
    return meta
