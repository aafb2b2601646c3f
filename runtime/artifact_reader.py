"""Reading an artifact: every check that can refuse one (manifest digest, versions, fields,
target, file hashes, nothing unlisted), run before anything is loaded; `.tar` archives; the
weights, read into one aligned arena; and `ggufc verify-artifact`'s report of the same checks."""

from __future__ import annotations

import json
import math
import os
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ggufc.version import __version__ as GGUFC_VERSION

from . import host as H
from .artifact import (
    ALIGN,
    FORMAT_VERSION,
    KERNELS_NAME,
    LAYOUT_FUNCTION,
    MANIFEST_DIGEST_NAME,
    MANIFEST_NAME,
    SEAL_FILES,
    WEIGHTS_NAME,
    ArtifactError,
    aligned_empty,
    array_layout,
    check_fields,
    check_layout_contract,
    one_line,
    referenced_files,
    sha256_file,
)

MAX_MANIFEST_BYTES = 64 << 20  # real manifests are well under 1 MiB; json.loads holds it all


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
    check_fields(manifest, where=str(root))
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


def _files_table(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ArtifactError(f"{root}: manifest has no 'files' table")
    for rel in referenced_files(manifest):
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
    checks.append(_check("fields", lambda: check_fields(manifest, where), "required fields valid", where))
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
    host = H.host_features()
    triple = str(target.get("mtriple", ""))
    if triple:
        target_machine = H.normalise_machine(triple.split("-", 1)[0])
        if target_machine != host.machine:
            raise ArtifactError(f"{where}: compiled for {target_machine}, this machine is {host.machine}")
    missing = list(dict.fromkeys([*H.features_missing_here(target), *H.flags_missing_here(recorded)]))
    if missing:
        raise ArtifactError(
            f"{where}: compiled for CPU '{target.get('mcpu', '?')}', whose {', '.join(missing)} "
            "this CPU lacks; recompile on this machine (no --cpu) or for a CPU it has (--cpu NAME)"
        )
    if H.AMX_FEATURES[1] in (H.llvm_target_features(target, host.machine) or []) and not H.amx_usable():
        raise ArtifactError(f"{where}: compiled for AMX tiles, which the OS does not lend this process; "
                            "recompile on this machine")


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
