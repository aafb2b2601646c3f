"""Compiled-model artifacts: write them atomically, verify them before anything is loaded.

An artifact is a directory (or a `.tar` of one) holding

- `manifest.json`: what was compiled, for which target, the calling convention, the params and
  states layout, and the sha256 of every other file;
- `manifest.sha256`: the sha256 of `manifest.json` itself, so no file goes unchecked;
- `kernels.so`: a TVM Relax VM executable (`export_library`);
- `weights.safetensors`: the params in the layout the kernels read;
- optionally `tokenizer.json`.

Nothing here imports the compiler (frontend/passes/codegen): an artifact runs with the runtime
and TVM's runtime alone. `tvm.target` is only used, when present, to learn which instruction
set extensions an LLVM CPU name implies.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import shutil
import tarfile
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ggufc.messages import GgufcError, shorten
from ggufc.version import __version__ as GGUFC_VERSION

FORMAT_VERSION = 3  # 2: manifest digest file, layout contract compiled into the kernels; 3: CPU
# entry points take each weight array as an argument
MANIFEST_NAME = "manifest.json"
MANIFEST_DIGEST_NAME = "manifest.sha256"
SEAL_FILES = (MANIFEST_NAME, MANIFEST_DIGEST_NAME)  # the files that seal an artifact, not listed in it
LAYOUT_FUNCTION = "ggufc_layout"  # a kernels function returning the layout contract it was built for
KERNELS_NAME = "kernels.so"
WEIGHTS_NAME = "weights.safetensors"
ALIGN = 64  # vectorised TVM kernels segfault on buffers that are not 64-byte aligned
MAX_MANIFEST_BYTES = 64 << 20  # real manifests are well under 1 MiB; json.loads holds it all
MAX_ARRAY_DIMS = 8
MAX_ARRAY_BYTES = 1 << 46  # no array a manifest describes can be larger than this (64 TiB)

# Fields codegen must provide; finalize_artifact and load_manifest both check them.
REQUIRED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "arch": str,
    "hparams": dict,
    "n_ctx": int,
    "n_vocab": int,
    "target": dict,
    "target_key": str,
    "functions": dict,
    "max_chunk": int,
    "params": list,
    "states": list,
}
FIELDS_ADDED_HERE = ("format_version", "ggufc_version", "files")


# How the runtime truncates each state (runtime/context.py); absent means recurrent.
STATE_KINDS = ("per_position", "recurrent", "scratch")
WINDOW_KIND = "window"  # a sliding-window layer's K/V cache of a few cells (WindowCells)
KNOWN_STATE_KINDS = (*STATE_KINDS, WINDOW_KIND)
WINDOW_STEP_QUANTUM = 32  # the CPU attention kernel's accumulators take cell s into s % 32


@dataclass(frozen=True)
class WindowCells:
    """How a sliding-window layer's K/V cache keeps only the cells its window can still read.

    A query at position p sees positions p - size < j <= p. The cache holds position j at cell
    j - shift(p) during a call at position p, where shift(p) is the largest multiple of `step`
    at or below p - (size - 1) - margin (0 before that): the window's cells plus `margin` more
    (a cut back by up to `margin` tokens is a move of cells, no compute). The kernels compute
    shift(p) themselves from the call's position; after a call the runtime moves the cells to
    shift(n_past), the layout the next call expects. `step` is a multiple of 32 so that every
    cell keeps its place in the kernel's 32 accumulators: the sums, and so the logits, are those
    of a full cache bit for bit. `cells()` is enough for a chunk of max_chunk tokens at any p.
    """

    size: int
    margin: int
    step: int

    @classmethod
    def for_window(cls, size: int) -> WindowCells:
        """Margin and step half the window, in whole 32-cell steps: cells move once every step
        tokens (size + margin of them), about 3 cells per token."""
        half = -(-size // (2 * WINDOW_STEP_QUANTUM)) * WINDOW_STEP_QUANTUM
        return cls(size, half, half)

    def shift(self, pos: int) -> int:
        """The position cell 0 holds during a call at `pos` (and after a context of `pos` tokens)."""
        return max(0, (pos - (self.size - 1) - self.margin) // self.step * self.step)

    def cells(self, max_chunk: int) -> int:
        """Cells a call of up to max_chunk tokens at any position writes or reads."""
        return self.size - 1 + self.margin + self.step + max_chunk - 1

    def as_json(self) -> dict[str, int]:
        return {"size": self.size, "margin": self.margin, "step": self.step}

    @classmethod
    def from_state(cls, state: dict[str, Any], max_chunk: int, where: str) -> WindowCells:
        """A manifest state's window, checked against its shape (an ArtifactError otherwise)."""
        raw: Any = state.get("window")
        name = str(state.get("name"))[:40]
        try:
            window = cls(int(raw["size"]), int(raw["margin"]), int(raw["step"]))
        except (KeyError, TypeError, ValueError):
            raise ArtifactError(f"{where}: window state {name!r} has no valid 'window' field") from None
        ok = window.size > 0 and window.margin >= 0 and window.step > 0 and window.step % WINDOW_STEP_QUANTUM == 0
        shape = state.get("shape")
        if not ok or not isinstance(shape, list) or not shape or shape[0] < window.cells(max_chunk):
            raise ArtifactError(f"{where}: window state {name!r} has an invalid window {raw!r:.80} for its shape")
        return window


class ArtifactError(GgufcError, ValueError):
    """An artifact that cannot be written or used; the message is one line naming the problem."""


def one_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (many libraries raise multi-line ones), shortened
    at a word; ggufc's own errors are kept whole (their hints come last)."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    return lines[0] if isinstance(exc, GgufcError) else shorten(lines[0], limit)


# --------------------------------------------------------------------------- aligned buffers


def aligned_empty(shape: tuple[int, ...] | list[int] | int, dtype: npt.DTypeLike) -> np.ndarray:
    """Uninitialised C-contiguous array whose data pointer is a multiple of 64 bytes."""
    dims = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
    dt = np.dtype(dtype)
    nbytes = math.prod(dims) * dt.itemsize
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGN
    return raw[offset : offset + nbytes].view(dt).reshape(dims)


def aligned_zeros(shape: tuple[int, ...] | list[int] | int, dtype: npt.DTypeLike) -> np.ndarray:
    out = aligned_empty(shape, dtype)
    out[...] = 0
    return out


# --------------------------------------------------------------------------- hashing


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks so large weights never sit in memory twice."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def _artifact_files(root: Path) -> list[str]:
    """Relative POSIX paths of the regular files under `root`, manifest excluded, sorted."""
    found = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            raise ArtifactError(f"{root}: {rel} is a symbolic link; artifacts hold regular files only")
        if path.is_file() and rel not in SEAL_FILES:
            found.append(rel)
    return found


# --------------------------------------------------------------------------- writing


def make_staging_dir(out_dir: str | os.PathLike[str]) -> Path:
    """A fresh staging directory beside `out_dir`, so the final rename stays on one filesystem."""
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))


def finalize_artifact(
    staging_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], manifest: dict[str, Any]
) -> dict[str, Any]:
    """Seal `staging_dir` (kernels, weights, ...) with a manifest and move it to `out_dir`.

    Adds `format_version`, `ggufc_version` and `files` (relpath -> sha256) to a copy of
    `manifest`, writes manifest.json last, then renames the directory into place. A reader
    therefore sees either no `out_dir`, the previous one, or the complete new one. On success
    `staging_dir` no longer exists; on failure it is left for the caller to remove.
    Returns the manifest as written.
    """
    staging = Path(staging_dir)
    out = Path(out_dir).absolute()
    if not staging.is_dir():
        raise ArtifactError(f"{staging}: staging directory does not exist")
    sealed = _sealed_manifest(staging, manifest)
    _write_manifest(staging, sealed)
    _apply_umask(staging)
    _move_into_place(staging, out)
    return sealed


def _apply_umask(directory: Path) -> None:
    """mkdtemp makes staging private (0700) and some writers make files 0600; the artifact gets
    the permissions of any file the user creates (directories 0777, files 0666, less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _sealed_manifest(staging: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    sealed = {k: v for k, v in manifest.items() if k not in FIELDS_ADDED_HERE}
    _check_fields(sealed, where=str(staging))
    files = {rel: sha256_file(staging / rel) for rel in _artifact_files(staging)}
    for rel in _referenced_files(sealed):
        if rel not in files:
            raise ArtifactError(f"{staging}: {rel} is missing from the staging directory")
    sealed.update(format_version=FORMAT_VERSION, ggufc_version=GGUFC_VERSION, files=files)
    return sealed


def _write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """manifest.json, then manifest.sha256 holding its digest (the last file an artifact gets)."""
    try:
        text = json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"manifest is not plain JSON data: {one_line(exc)}") from None
    data = text.encode("utf-8")
    _write_synced(directory / MANIFEST_NAME, data)
    _write_synced(directory / MANIFEST_DIGEST_NAME, f"{hashlib.sha256(data).hexdigest()}  {MANIFEST_NAME}\n".encode())


def _write_synced(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def check_output_dir(out_dir: str | os.PathLike[str]) -> None:
    """Refuse an output that is not ggufc's to replace: only an absent path, an empty directory,
    or an artifact directory holding nothing but the artifact's own files may become an artifact."""
    out = Path(out_dir).absolute()
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ArtifactError(f"{out_dir}: exists and is not a directory; give a new or empty directory")
    here = Path.cwd().resolve()
    if out.resolve() in (here, *here.parents):
        raise ArtifactError(f"{out_dir}: is the current directory or one above it; give a new or empty directory")
    if not out.exists():
        _check_parent_usable(out, out_dir)
        return
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if MANIFEST_NAME not in entries:
        raise ArtifactError(
            f"{out_dir}: directory is not empty and not a ggufc artifact (holds {_first(entries)}); "
            "give a new or empty directory"
        )
    foreign = _foreign_files(out)
    if foreign:
        raise ArtifactError(
            f"{out_dir}: holds {foreign[0]!r}, which is not part of the ggufc artifact there; "
            "refusing to replace it (give a new or empty directory)"
        )


def _check_parent_usable(out: Path, shown: str | os.PathLike[str]) -> None:
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ArtifactError(f"{shown}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ArtifactError(f"{shown}: cannot write into {parent} (permission denied)")


def _first(names: list[str]) -> str:
    return repr(names[0]) + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def _foreign_files(root: Path) -> list[str]:
    """Entries of an existing artifact directory that its own manifest does not account for."""
    try:
        manifest = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return [MANIFEST_NAME]
    if not isinstance(manifest, dict) or "ggufc_version" not in manifest or not isinstance(manifest.get("files"), dict):
        return [MANIFEST_NAME]
    own = set(manifest["files"]) | set(SEAL_FILES)
    foreign = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink() or (path.is_file() and rel not in own):
            foreign.append(rel)
        elif path.is_dir() and not any(name.startswith(rel + "/") for name in own):
            foreign.append(rel + "/")
    return foreign


def _move_into_place(staging: Path, out: Path) -> None:
    check_output_dir(out)  # again at the end: the directory may have changed during the compile
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = _same_filesystem_copy(staging, out)
    if not out.exists():
        os.rename(staging, out)
        _fsync_dir(out.parent)
        return
    # Swap: move the old artifact aside, move the new one in, then delete the old one.
    # If the second rename fails, the old artifact is put back.
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rmdir(old)
    os.rename(out, old)
    try:
        os.rename(staging, out)
    except BaseException:
        os.rename(old, out)
        raise
    _fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)


def _same_filesystem_copy(staging: Path, out: Path) -> Path:
    """`staging` itself when it can be renamed to `out`, else a copy beside `out`."""
    if _same_filesystem(staging, out.parent):
        return staging
    beside = make_staging_dir(out)
    try:
        shutil.copytree(staging, beside, dirs_exist_ok=True)
    except BaseException:
        shutil.rmtree(beside, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)
    return beside


def _same_filesystem(a: Path, b: Path) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- layout contract


def layout_contract(manifest: dict[str, Any]) -> tuple[int, ...]:
    """Four int64 words of the sha256 of every manifest value that sizes what kernels touch.

    Codegen compiles these words into the kernels (a `ggufc_layout` function, or the dispatch
    plan); the runtime recomputes them from the manifest before any kernel runs, so a manifest
    whose context, chunk size, vocabulary, states or weight shapes differ from what the kernels
    were built for is refused instead of reaching native code.
    """
    fields = {
        "n_ctx": manifest.get("n_ctx"),
        "n_vocab": manifest.get("n_vocab"),
        "max_chunk": manifest.get("max_chunk"),
        "states": [[s.get("shape"), s.get("dtype"), *([s["window"]] if "window" in s else [])]
                   for s in manifest.get("states", []) if isinstance(s, dict)],
        "params": [
            [[a.get("shape"), a.get("dtype")] for a in p.get("arrays", []) if isinstance(a, dict)]
            for p in manifest.get("params", [])
            if isinstance(p, dict)
        ],
    }
    try:
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"manifest layout is not plain JSON data ({one_line(exc)})") from None
    return tuple(int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, 32, 8))


def check_layout_contract(manifest: dict[str, Any], compiled: Any, where: str | os.PathLike[str]) -> None:
    """Refuse a manifest that does not describe the layout the kernels were compiled for."""
    try:
        words = tuple(int(w) for w in compiled)
    except (TypeError, ValueError):
        words = ()
    if words != layout_contract(manifest):
        raise ArtifactError(
            f"{where}: manifest does not match the layout the kernels were compiled for "
            "(n_ctx, max_chunk, n_vocab, states or weight shapes edited); recompile the model"
        )


# --------------------------------------------------------------------------- reading


@dataclass
class Artifact:
    """A verified artifact directory; `close()` removes it when it was extracted from an archive."""

    path: Path
    manifest: dict[str, Any]
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    def file(self, rel: str) -> Path:
        return self.path / rel

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_artifact(path: str | os.PathLike[str]) -> bool:
    """True for an artifact directory or a `.tar` archive (whether or not it verifies)."""
    p = Path(path)
    return (p.is_dir() and (p / MANIFEST_NAME).is_file()) or (p.is_file() and tarfile.is_tarfile(p))


def open_artifact(path: str | os.PathLike[str], *, target_key: str | None = None) -> Artifact:
    """Verify an artifact directory or `.tar` archive and return it; nothing is loaded yet."""
    p = Path(path)
    if p.is_dir():
        return Artifact(p, _verified_manifest(p, target_key))
    if p.is_file():
        tmp = tempfile.TemporaryDirectory(prefix="ggufc-artifact-")
        try:
            root = _extract_archive(p, Path(tmp.name))
            return Artifact(root, _verified_manifest(root, target_key), tmp)
        except BaseException:
            tmp.cleanup()
            raise
    raise ArtifactError(f"{p}: no such artifact (expected a directory or a .tar archive)")


def load_manifest(path: str | os.PathLike[str], *, target_key: str | None = None) -> dict[str, Any]:
    """The manifest of a verified artifact (see `open_artifact` for what is checked)."""
    with open_artifact(path, target_key=target_key) as artifact:
        return artifact.manifest


def _verified_manifest(root: Path, target_key: str | None) -> dict[str, Any]:
    """Every check that can refuse an artifact, run before any of its files is loaded."""
    manifest = _parse_manifest(root)
    _check_manifest_digest(root)
    _check_versions(manifest, where=str(root))
    _check_fields(manifest, where=str(root))
    _check_target(manifest, target_key, where=str(root))
    _check_files(root, manifest)
    _check_no_unlisted(root, manifest)
    return manifest


def _check_manifest_digest(root: Path) -> None:
    """manifest.json must hash to what manifest.sha256 says (an edited manifest is refused)."""
    path = root / MANIFEST_DIGEST_NAME
    if path.is_symlink() or not path.is_file():
        raise ArtifactError(f"{root}: {MANIFEST_DIGEST_NAME} is missing (not a sealed ggufc artifact)")
    if path.stat().st_size > 4096:
        raise ArtifactError(f"{root}: {MANIFEST_DIGEST_NAME} is not a digest file")
    recorded = path.read_bytes().split(b" ", 1)[0].strip().decode("ascii", "replace")
    if recorded != sha256_file(root / MANIFEST_NAME):
        raise ArtifactError(f"{root}: {MANIFEST_NAME} does not match {MANIFEST_DIGEST_NAME} (edited after sealing)")


def _unlisted_files(root: Path, manifest: dict[str, Any]) -> list[str]:
    files = manifest.get("files")
    listed = (set(files) if isinstance(files, dict) else set()) | set(SEAL_FILES)
    return [
        rel
        for path in sorted(root.rglob("*"))
        if (rel := path.relative_to(root).as_posix()) not in listed and (path.is_file() or path.is_symlink())
    ]


def _check_no_unlisted(root: Path, manifest: dict[str, Any]) -> None:
    unlisted = _unlisted_files(root, manifest)
    if unlisted:
        raise ArtifactError(f"{root}: {unlisted[0]}: not listed in the manifest (added after sealing?)")


def _parse_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"{root}: not an artifact (no {MANIFEST_NAME})")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{path}: manifest is {size} bytes (limit {MAX_MANIFEST_BYTES})")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: unreadable manifest ({one_line(exc)})") from None
    except RecursionError:
        raise ArtifactError(f"{path}: unreadable manifest (nested too deeply)") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: manifest is not a JSON object")
    return manifest


def _check_versions(manifest: dict[str, Any], where: str) -> None:
    _check_format_version(manifest, where)
    _check_ggufc_version(manifest, where)


def _check_format_version(manifest: dict[str, Any], where: str) -> None:
    found = manifest.get("format_version")
    if found != FORMAT_VERSION:
        raise ArtifactError(
            f"{where}: artifact format version {found!r}, this runtime reads version {FORMAT_VERSION}; "
            "recompile the model"
        )


def _check_ggufc_version(manifest: dict[str, Any], where: str) -> None:
    built_with = str(manifest.get("ggufc_version", ""))
    if _major_minor(built_with) != _major_minor(GGUFC_VERSION):
        raise ArtifactError(
            f"{where}: built by ggufc {built_with or '?'}, incompatible with ggufc {GGUFC_VERSION}; "
            "recompile the model"
        )


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])


def _check_fields(manifest: dict[str, Any], where: str) -> None:
    for name, kind in REQUIRED_FIELDS.items():
        value = manifest.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ArtifactError(f"{where}: manifest field '{name}' is missing or not a {_kind_name(kind)}")
    for name in ("n_ctx", "n_vocab", "max_chunk"):
        if manifest[name] <= 0:
            raise ArtifactError(f"{where}: manifest field '{name}' must be positive, got {manifest[name]}")
    if not manifest["functions"]:
        raise ArtifactError(f"{where}: manifest lists no functions")
    for param in manifest["params"]:
        arrays = param.get("arrays") if isinstance(param, dict) else None
        if not isinstance(arrays, list) or not all(isinstance(a, dict) and "key" in a for a in arrays):
            raise ArtifactError(f"{where}: manifest param {param!r:.80} has no valid 'arrays' list")
        for spec in arrays:
            array_layout(spec)
    for state in manifest["states"]:
        if not isinstance(state, dict):
            raise ArtifactError(f"{where}: manifest state {state!r:.80} is not an object")
        array_layout(state)
        if state.get("kind", STATE_KINDS[1]) not in KNOWN_STATE_KINDS:
            raise ArtifactError(f"{where}: manifest state {str(state.get('name'))!r:.40} has unknown kind "
                                f"{state.get('kind')!r:.40} (known: {', '.join(KNOWN_STATE_KINDS)})")
        if state.get("kind") == WINDOW_KIND:
            WindowCells.from_state(state, manifest["max_chunk"], where)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _referenced_files(manifest: dict[str, Any]) -> list[str]:
    """Files the runtime will open: each must be listed, with a matching hash."""
    kernel_files = manifest.get("kernel_files")  # GPU targets: plan + WGSL/MSL, or kernels.so + fatbin
    refs = [] if manifest.get("target_key") in ("vulkan", "metal") else [KERNELS_NAME]  # VM targets: always
    if isinstance(kernel_files, list) and all(isinstance(f, str) for f in kernel_files):
        refs += [f for f in kernel_files if f not in refs]
    if not refs:
        refs = [KERNELS_NAME]
    refs.append(WEIGHTS_NAME)
    tok = manifest.get("tokenizer")
    if isinstance(tok, dict) and tok.get("file"):
        refs.append(str(tok["file"]))
    return refs


def _files_table(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ArtifactError(f"{root}: manifest has no 'files' table")
    for rel in _referenced_files(manifest):
        if rel not in files:
            raise ArtifactError(f"{root}: manifest does not list {rel}")
    return files


def _file_problem(root: Path, rel: str, expected: Any) -> str | None:
    """What is wrong with one listed file (None when its sha256 matches)."""
    path = _safe_join(root, rel)
    if path.is_symlink():
        return "is a symbolic link; artifacts hold regular files only"
    if not path.is_file():
        return "is missing"
    if sha256_file(path) != expected:
        return "does not match its manifest sha256 (modified or truncated)"
    return None


def _check_file(root: Path, rel: str, expected: Any) -> None:
    problem = _file_problem(root, rel, expected)
    if problem is not None:
        raise ArtifactError(f"{root}: {rel} {problem}")


def _check_files(root: Path, manifest: dict[str, Any]) -> None:
    for rel, expected in sorted(_files_table(root, manifest).items()):
        _check_file(root, rel, expected)


def _safe_join(root: Path, rel: str) -> Path:
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise ArtifactError(f"{root}: manifest lists an unsafe path {rel!r:.80}")
    parts = Path(rel).parts
    if Path(rel).is_absolute() or ".." in parts:
        raise ArtifactError(f"{root}: manifest lists an unsafe path {rel!r}")
    return root.joinpath(*parts)


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Check:
    """One line of `ggufc verify-artifact`: what was checked, whether it passed, and why."""

    name: str
    ok: bool
    detail: str
    deferred: bool = False  # cannot run on this machine; the session makes it before anything runs

    def __post_init__(self) -> None:
        # names and details quote the manifest, which may hold anything: keep each on one line
        object.__setattr__(self, "name", _printable(self.name, 80))
        object.__setattr__(self, "detail", _printable(self.detail, 300))


def _printable(text: str, limit: int) -> str:
    clean = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


def verify_report(path: str | os.PathLike[str], *, target_key: str | None = None) -> list[Check]:
    """Every check `open_artifact` makes, each reported instead of stopping at the first failure.

    Nothing is loaded: a `.tar` is extracted into a temporary directory, files are only hashed.
    """
    p = Path(path)
    if p.is_file():
        with tempfile.TemporaryDirectory(prefix="ggufc-verify-") as tmp:
            try:
                root = _extract_archive(p, Path(tmp))
            except ArtifactError as exc:
                return [Check("archive", False, _without_prefix(exc, p))]
            return [Check("archive", True, "safe to extract"), *_directory_report(root, target_key)]
    if not p.is_dir():
        return [Check("artifact", False, "no such file or directory")]
    return _directory_report(p, target_key)


def _directory_report(root: Path, target_key: str | None) -> list[Check]:
    try:
        manifest = _parse_manifest(root)
    except ArtifactError as exc:
        return [Check("manifest", False, _without_prefix(exc, root))]
    checks = [Check("manifest", True, f"{MANIFEST_NAME} is a JSON object")]
    where = str(root)
    checks.append(_check("manifest digest", lambda: _check_manifest_digest(root),
                         f"{MANIFEST_NAME} matches {MANIFEST_DIGEST_NAME}", where))
    version, built_with = manifest.get("format_version"), manifest.get("ggufc_version")
    checks.append(_check("format version", lambda: _check_format_version(manifest, where),
                         f"{version} (this runtime reads {FORMAT_VERSION})", where))
    checks.append(_check("ggufc version", lambda: _check_ggufc_version(manifest, where),
                         f"built by {built_with}, compatible with {GGUFC_VERSION}", where))
    checks.append(_check("fields", lambda: _check_fields(manifest, where), "required fields valid", where))
    checks.append(_check("target", lambda: _check_target(manifest, target_key, where),
                         _target_summary(manifest, target_key), where))
    checks.extend(_file_checks(root, manifest))
    if all(c.ok for c in checks):  # the kernels are only opened once every file is known good
        checks.append(_layout_check(root, manifest, where))
    return checks


def _layout_check(root: Path, manifest: dict[str, Any], where: str) -> Check:
    gpu = manifest.get("gpu")
    on_plan = isinstance(gpu, dict) and gpu.get("runtime") == "plan"
    if not on_plan and manifest.get("target_key") != "llvm":
        # cuda kernels.so embeds device code that only a CUDA runtime can load; its session
        # compares the compiled contract with the manifest right after loading, before any kernel runs
        return Check("layout", True, f"checked when the {manifest.get('target_key')} session loads the kernels",
                     deferred=True)
    return _check("layout", lambda: _check_compiled_layout(root, manifest),
                  "the manifest describes the layout the kernels were compiled for", where)


def _check_compiled_layout(root: Path, manifest: dict[str, Any]) -> None:
    """The layout contract of a verified artifact: from plan.json, or from the CPU kernels."""
    gpu = manifest.get("gpu")
    if isinstance(gpu, dict) and gpu.get("runtime") == "plan":
        plan = json.loads(_safe_join(root, str(gpu.get("plan"))).read_text(encoding="utf-8"))
        check_layout_contract(manifest, plan.get("layout") if isinstance(plan, dict) else None, root)
    else:
        check_layout_contract(manifest, _cpu_kernels_layout(root), root)


def _cpu_kernels_layout(root: Path) -> Any:
    import tvm

    try:
        vm = tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(root / KERNELS_NAME)), tvm.cpu())
        return vm[LAYOUT_FUNCTION]()
    except Exception as exc:  # TVM reports loader failures with multi-line messages
        raise ArtifactError(f"{root}: {KERNELS_NAME} has no layout function ({one_line(exc)})") from None


def _check(name: str, run: Any, ok_detail: str, where: str) -> Check:
    try:
        run()
    except ArtifactError as exc:
        return Check(name, False, _without_prefix(exc, where))
    except (KeyError, TypeError, ValueError) as exc:  # a field the earlier checks already refused
        return Check(name, False, f"cannot check ({one_line(exc)})")
    return Check(name, True, ok_detail)


def _target_summary(manifest: dict[str, Any], target_key: str | None) -> str:
    target = manifest.get("target") if isinstance(manifest.get("target"), dict) else {}
    cpu = f", CPU {target['mcpu']}" if isinstance(target, dict) and target.get("mcpu") else ""
    cpu += f" ({manifest['isa']})" if cpu and isinstance(manifest.get("isa"), str) else ""
    wanted = f", as asked ({target_key})" if target_key else ""
    return f"{manifest.get('target_key')}{cpu}{wanted}; runs on this machine"


def _file_checks(root: Path, manifest: dict[str, Any]) -> list[Check]:
    try:
        files = _files_table(root, manifest)
    except ArtifactError as exc:
        return [Check("files", False, _without_prefix(exc, root))]
    checks = [_file_check(root, rel, expected) for rel, expected in sorted(files.items())]
    for rel in _unlisted_files(root, manifest):
        checks.append(Check(rel, False, "not listed in the manifest (added after sealing?)"))
    return checks


def _file_check(root: Path, rel: str, expected: Any) -> Check:
    try:
        problem = _file_problem(root, rel, expected)
    except ArtifactError as exc:
        return Check(f"{rel!r:.60}", False, _without_prefix(exc, root))
    return Check(rel, problem is None, problem or "sha256 matches")


def _without_prefix(exc: BaseException, where: str | os.PathLike[str]) -> str:
    """The message of a check, without the artifact path every message starts with."""
    text = one_line(exc)
    prefix = f"{os.fspath(where)}: "
    return text[len(prefix):] if text.startswith(prefix) else text


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class HostFeatures:
    machine: str  # normalised architecture: "x86_64", "aarch64", ...
    flags: frozenset[str] | None  # normalised CPU flags, None when the OS does not tell us


# LLVM feature name -> the name Linux /proc/cpuinfo uses, when they differ after normalising.
_CPUINFO_ALIASES = {
    "sse3": "pni",
    "bmi": "bmi1",
    "pclmul": "pclmulqdq",
    "sha": "shani",
    "neon": "asimd",
    "dotprod": "asimddp",
    "fullfp16": "asimdhp",
    "egpr": "apx",
}
# Instruction-set extensions whose absence makes generated code crash (SIGILL). Tuning flags
# that LLVM also reports ("fast-lzcnt", ...) are not checked.
_CHECKED_FEATURES = {
    "x86_64": (
        "sse3 ssse3 sse4.1 sse4.2 avx avx2 fma f16c bmi bmi2 avxvnni avx512f avx512cd avx512bw "
        "avx512dq avx512vl avx512vnni avx512bf16 avx512fp16 avx512ifma avx512vbmi avx512vbmi2 "
        "avx512bitalg avx512vpopcntdq amx-tile amx-int8 amx-bf16 "
        # named in /proc/cpuinfo too: AMD's older extensions, Xeon Phi's, and newer Intel ones a
        # `--cpu graniterapids`/`diamondrapids` build may use (egpr: APX's 32 registers)
        "sse4a fma4 xop tbm avx512er avx512pf avx5124fmaps avx5124vnniw avx512vp2intersect avxifma cmpccxadd "
        "amx-fp16 egpr"
    ).split(),
    "aarch64": "neon sve sve2 dotprod i8mm fullfp16 bf16".split(),
}
_MACHINE_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


def _normalise_flag(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "").replace(".", "")


def _normalise_machine(name: str) -> str:
    name = name.lower()
    return _MACHINE_ALIASES.get(name, name)


@lru_cache(maxsize=1)
def host_features() -> HostFeatures:
    machine = _normalise_machine(platform.machine())
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return HostFeatures(machine, None)
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(_normalise_flag(f) for f in value.split())
    return HostFeatures(machine, frozenset(flags) if flags else None)


AMX_FEATURES = ("amx-tile", "amx-int8")
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158  # Linux x86_64


def amx_usable() -> bool:
    """Whether this process may run AMX-INT8 tile code: the CPU lists it and Linux lends the tile
    state on request (it must be asked once per process before the first tile instruction, or that
    instruction faults)."""
    host = host_features()
    flags = host.flags or frozenset()
    if host.machine != "x86_64" or not all(_normalise_flag(f) in flags for f in AMX_FEATURES):
        return False
    return _tile_state_lent()


@lru_cache(maxsize=1)
def _tile_state_lent() -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def _check_target(manifest: dict[str, Any], target_key: str | None, where: str) -> None:
    built_for = manifest["target_key"]
    if target_key is not None and built_for != target_key:
        raise ArtifactError(
            f"{where}: compiled for target '{built_for}', not '{target_key}'; recompile with -t {target_key}"
        )
    if built_for == "llvm":
        _check_llvm_target_runs_here(manifest["target"], where, _recorded_features(manifest, where))


def _recorded_features(manifest: dict[str, Any], where: str) -> list[str]:
    """The CPU extensions the manifest says the code needs (`cpu_features`; older artifacts have none)."""
    recorded = manifest.get("cpu_features", [])
    if not isinstance(recorded, list) or not all(isinstance(f, str) for f in recorded):
        raise ArtifactError(f"{where}: manifest field 'cpu_features' is not a list of strings")
    return recorded


def _check_llvm_target_runs_here(target: dict[str, Any], where: str, recorded: Sequence[str] = ()) -> None:
    host = host_features()
    triple = str(target.get("mtriple", ""))
    if triple:
        target_machine = _normalise_machine(triple.split("-", 1)[0])
        if target_machine != host.machine:
            raise ArtifactError(f"{where}: compiled for {target_machine}, this machine is {host.machine}")
    missing = list(dict.fromkeys([*features_missing_here(target), *_flags_missing_here(recorded)]))
    if missing:
        raise ArtifactError(
            f"{where}: compiled for CPU '{target.get('mcpu', '?')}', whose {', '.join(missing)} "
            "this CPU lacks; recompile on this machine (no --cpu) or for a CPU it has (--cpu NAME)"
        )
    if AMX_FEATURES[1] in (_llvm_target_features(target, host.machine) or []) and not amx_usable():
        raise ArtifactError(f"{where}: compiled for AMX tiles, which the OS does not lend this process; "
                            "recompile on this machine")


def features_missing_here(target: dict[str, Any]) -> list[str]:
    """The checked ISA extensions an LLVM target (same machine kind) needs that this CPU does not
    list in /proc/cpuinfo. A CPU model can lack what its name implies: a hypervisor may hide AMX
    from a guest whose CPU LLVM still calls 'emeraldrapids'. Empty when it cannot tell (no LLVM,
    no /proc/cpuinfo): the kernels may still run."""
    needed = _llvm_target_features(target, host_features().machine)
    return [] if needed is None else _flags_missing_here(needed)


def _flags_missing_here(features: Iterable[str]) -> list[str]:
    """The LLVM-named extensions this CPU does not list in /proc/cpuinfo (none when it cannot tell)."""
    flags = host_features().flags
    if flags is None:
        return []
    return [f for f in features if _normalise_flag(_CPUINFO_ALIASES.get(f, f)) not in flags]


def target_cpu_features(target: dict[str, Any]) -> list[str] | None:
    """The checked ISA extensions code for an LLVM target (this machine's architecture) needs, as
    the manifest records them (`cpu_features`); None when LLVM is unavailable."""
    return _llvm_target_features(target, host_features().machine)


def _llvm_target_features(target: dict[str, Any], machine: str) -> list[str] | None:
    """The checked ISA extensions an LLVM target needs, or None when LLVM is unavailable."""
    checked = _CHECKED_FEATURES.get(machine, [])
    attrs = _as_list(target.get("mattr"))
    wanted = {a[1:] for a in attrs if a.startswith("+")}
    mcpu = target.get("mcpu")
    if mcpu and mcpu != "generic":
        implied = llvm_cpu_features(str(mcpu), str(target.get("mtriple", "")))
        if implied is None:
            return None
        wanted |= implied
    wanted -= {a[1:] for a in attrs if a.startswith("-")}  # switched off explicitly
    return [f for f in checked if f in wanted]


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v for v in value.split(",") if v]
    return [str(v) for v in value]


@lru_cache(maxsize=16)
def llvm_cpu_features(mcpu: str, mtriple: str = "") -> frozenset[str] | None:
    """The features LLVM gives a CPU by name (None without TVM)."""
    try:
        import tvm
        from tvm.target import codegen
    except ImportError:
        return None
    triple = mtriple or str(codegen.llvm_get_system_triple())
    if not codegen.llvm_is_valid_cpu(mcpu, triple):
        raise ArtifactError(f"compiled for CPU '{mcpu}', which LLVM does not know for {triple}")
    spec: dict[str, Any] = {"kind": "llvm", "mcpu": mcpu}
    if mtriple:
        spec["mtriple"] = mtriple
    return frozenset(str(f) for f in codegen.llvm_get_cpu_features(tvm.target.Target(spec)))


# --------------------------------------------------------------------------- archives


def _extract_archive(archive: Path, dest: Path) -> Path:
    """Extract a `.tar` of an artifact into `dest`; return the directory holding manifest.json."""
    if not tarfile.is_tarfile(archive):  # tarfile's own message ends in a colon before a list of modes
        raise ArtifactError(f"{archive}: not an artifact directory or a .tar archive of one")
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            for member in members:
                _check_member(archive, member)
            tar.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ArtifactError(f"{archive}: unreadable artifact archive ({one_line(exc)})") from None
    if (dest / MANIFEST_NAME).is_file():
        return dest
    candidates = [d for d in dest.iterdir() if (d / MANIFEST_NAME).is_file()]
    if len(candidates) != 1:
        raise ArtifactError(f"{archive}: archive holds no artifact (no {MANIFEST_NAME} at its top)")
    return candidates[0]


def _check_member(archive: Path, member: tarfile.TarInfo) -> None:
    parts = Path(member.name).parts
    if Path(member.name).is_absolute() or ".." in parts:
        raise ArtifactError(f"{archive}: archive entry {member.name!r} points outside the artifact")
    if not (member.isfile() or member.isdir()):
        raise ArtifactError(f"{archive}: archive entry {member.name!r} is not a regular file")


# --------------------------------------------------------------------------- weights


def read_weights(path: str | os.PathLike[str], manifest: dict[str, Any]) -> list[np.ndarray]:
    """The params tuple's arrays, in manifest order, each 64-byte aligned and C-contiguous.

    `path` is the artifact directory (already verified). All arrays share one aligned arena,
    filled tensor by tensor so peak memory stays near the weights' size.
    """
    from safetensors import safe_open

    specs = list(_param_array_specs(manifest))
    layout = [array_layout(s) for s in specs]
    weights = Path(path) / WEIGHTS_NAME
    claimed = sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout)
    if claimed > weights.stat().st_size:  # checked before the arena is allocated from the claim
        raise ArtifactError(f"{weights}: manifest claims {claimed} bytes of weights, the file holds fewer")
    arena = _Arena(layout)
    try:
        with safe_open(str(weights), framework="numpy") as store:
            keys = set(store.keys())
            for spec in specs:
                key = str(spec["key"])
                if key not in keys:
                    raise ArtifactError(f"{weights}: no array '{key}'")
                arena.put(key, store.get_tensor(key))
    except ArtifactError:
        raise
    except Exception as exc:  # safetensors raises its own error types; report one line
        reason = f"{type(exc).__name__}: {one_line(exc)}"
        raise ArtifactError(f"{weights}: unreadable weights ({reason})") from None
    return arena.arrays


def _param_array_specs(manifest: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for param in manifest["params"]:
        yield from param.get("arrays", [])


def array_layout(spec: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """(shape, dtype) of a manifest array or state entry."""
    try:
        shape, dtype = tuple(int(d) for d in spec["shape"]), np.dtype(spec["dtype"])
    except (KeyError, TypeError, ValueError) as exc:
        reason = one_line(exc)
        raise ArtifactError(f"manifest array {spec!r:.80} has no valid shape/dtype ({reason})") from None
    # Plain numbers only (an object dtype would read pointers out of the weights file), and a
    # size that can exist: the arena is allocated from these before any weight is read.
    if dtype.kind not in "biuf" or len(shape) > MAX_ARRAY_DIMS or any(d < 0 for d in shape):
        raise ArtifactError(f"manifest array {spec!r:.80} has an unsupported shape/dtype")
    if math.prod(shape) * dtype.itemsize > MAX_ARRAY_BYTES:
        raise ArtifactError(f"manifest array {spec!r:.80} claims more than {MAX_ARRAY_BYTES} bytes")
    return shape, dtype


class _Arena:
    """One 64-byte-aligned allocation carved into aligned arrays of the given shapes."""

    def __init__(self, layout: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> None:
        offsets, total = [], 0
        for shape, dtype in layout:
            offsets.append(total)
            nbytes = math.prod(shape) * dtype.itemsize
            total += -(-nbytes // ALIGN) * ALIGN
        buffer = aligned_empty(max(total, ALIGN), np.uint8)
        self.arrays = [
            buffer[off : off + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
            for off, (shape, dtype) in zip(offsets, layout, strict=True)
        ]
        self._next = 0

    def put(self, key: str, value: np.ndarray) -> None:
        target = self.arrays[self._next]
        if value.shape != target.shape or value.dtype != target.dtype:
            raise ArtifactError(
                f"weights array '{key}' is {value.dtype}{list(value.shape)}, "
                f"manifest says {target.dtype}{list(target.shape)}"
            )
        target[...] = value
        self._next += 1
