"""Grammar-constrained decoding with xgrammar (the structured-generation library of MLC-LLM, vLLM
and SGLang): JSON objects, JSON schemas, and the grammars tool calls need.

A grammar is compiled once per schema (xgrammar's compiler caches compiled grammars by their
text) for the model's vocabulary, then each sequence gets its own matcher: before a token is
chosen, the matcher fills a bitmask of the tokens the grammar allows next (one bit per token in
int32 words), the bits are unpacked with numpy and every other logit becomes -inf; the chosen
token advances the matcher. No torch on this path (xgrammar imports it, but its tensors are not
used: the bitmask is a numpy array handed over through DLPack).

JSON is generated compactly (xgrammar's `any_whitespace=False`: `", "` and `": "` separators, no
newlines), so a small model cannot spend its tokens on whitespace.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .token_choice import Constraint


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled (one line)."""


def _xgrammar() -> Any:
    import xgrammar  # imports torch: seconds, so only when a grammar is asked for

    return xgrammar


def check_json_schema(schema: Any, what: str = "the schema") -> None:
    """Raise GrammarError unless `schema` is a JSON schema (checked against its meta-schema)."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{what} must be a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise GrammarError(f"{what} is not a valid JSON schema: {_one_line(exc.message)}"
                           + (f" (at {where})" if where else "")) from None


class Grammars:
    """Compiles grammars for one model's vocabulary; thread-safe, built on first use."""

    def __init__(self, tokenizer: Any, n_vocab: int, stop_ids: Iterable[int]) -> None:
        self._tokenizer, self.n_vocab = tokenizer, n_vocab
        self._stop_ids = sorted(int(t) for t in stop_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                # each id's bytes as the text it adds; hidden specials are b'' (never allowed inside a grammar)
                vocab = [bytes(self._tokenizer.piece(i)) for i in range(self._tokenizer.n_vocab)]
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.n_vocab,
                                         stop_token_ids=self._stop_ids)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
            return self._compiler

    def json_schema(self, schema: Any) -> Callable[[], Constraint]:
        """Sequences whose text is a JSON value valid against `schema`. Properties and items the
        schema does not name are not generated (xgrammar's strict mode, vLLM's too): still valid
        against the schema, and a small model cannot wander into a property of its own."""
        check_json_schema(schema)
        return self._json(schema, strict=True)

    def json_object(self) -> Callable[[], Constraint]:
        """Sequences whose text is a JSON object, any properties (OpenAI's json_object mode)."""
        return self._json({"type": "object"}, strict=False)

    def _json(self, schema: Any, *, strict: bool) -> Callable[[], Constraint]:
        text = json.dumps(schema)  # the schema's property order is the answer's
        return self._compiled(lambda c: c.compile_json_schema(text, any_whitespace=False, strict_mode=strict))

    def wrapped_json(self, prefix: str, schema: Any, suffix: str) -> Callable[[], Constraint]:
        """`prefix`, JSON valid against `schema`, `suffix` (a tool call in its family's markers)."""
        check_json_schema(schema)

        def compile_one(compiler: Any) -> Any:
            xgr = _xgrammar()
            parts = [xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)]
            if prefix:
                parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(prefix)}"))
            if suffix:
                parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(suffix)}"))
            return compiler.compile_grammar(xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0])

        return self._compiled(compile_one)

    def _compiled(self, compile_one: Callable[[Any], Any]) -> Callable[[], Constraint]:
        compiler = self._get_compiler()
        try:
            grammar = compile_one(compiler)
        except Exception as exc:  # xgrammar raises its own InternalError/RuntimeError kinds
            raise GrammarError(f"cannot compile the grammar: {_xgrammar_message(exc)}") from None
        return lambda: GrammarConstraint(grammar, self.n_vocab)


class GrammarConstraint:
    """One sequence's place in a compiled grammar."""

    def __init__(self, grammar: Any, n_vocab: int) -> None:
        xgr = _xgrammar()
        self._matcher = xgr.GrammarMatcher(grammar)
        self._n_vocab = n_vocab
        self._bitmask = np.full(xgr.get_bitmask_shape(1, n_vocab), -1, dtype=np.int32)

    def allowed(self) -> np.ndarray | None:
        """A boolean [n_vocab] of the tokens the grammar allows next (None: every token)."""
        if not self._matcher.fill_next_token_bitmask(self._bitmask):
            return None
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        return bits[: self._n_vocab].view(np.bool_)

    def mask(self, logits: np.ndarray) -> None:
        allowed = self.allowed()
        if allowed is not None:
            np.putmask(logits, ~allowed, -np.inf)

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(int(token)):
            raise GrammarError(f"token {token} is not allowed by the grammar here")

    @property
    def finished(self) -> bool:
        return bool(self._matcher.is_terminated())


_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _xgrammar_message(exc: BaseException) -> str:
    """xgrammar's message without its C++ time stamp and source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _one_line(_LOCATION.sub("", text))


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 300 else line[:297] + "..."
