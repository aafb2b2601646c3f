"""Writing an artifact atomically: staged beside its destination, sealed with its manifest last,
renamed into place; and the check that an output directory is ggufc's to replace."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ggufc.version import __version__ as GGUFC_VERSION

from .artifact import (
    FIELDS_ADDED_HERE,
    FORMAT_VERSION,
    MANIFEST_DIGEST_NAME,
    MANIFEST_NAME,
    SEAL_FILES,
    ArtifactError,
    check_fields,
    one_line,
    referenced_files,
    sha256_file,
)


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
    check_fields(sealed, where=str(staging))
    files = {rel: sha256_file(staging / rel) for rel in _artifact_files(staging)}
    for rel in referenced_files(sealed):
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
