"""Token generation loop: prompt -> streamed text pieces, one VM call per new token.

Stops at the first stop id (not printed), after `max_new_tokens`, or when the context is full;
the last case writes one line to stderr so a truncated answer is never silent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, cast

import numpy as np

from ggufc.messages import progress

from .sampling import Sampler
from .session import ContextOverflowError, Session
from .token_choice import Decoding, TokenChooser


class TextStream(Protocol):
    def feed(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class Decoder(Protocol):
    """What generate needs from a tokenizer: `decode`; `stream()` (runtime.tokenizer's
    StreamDecoder) is used when the tokenizer has it."""

    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDecoder:
    """Streams text from `decode` alone, holding back bytes of incomplete characters.

    The fallback for tokenizers without `stream()`. Byte-level BPE splits one character over
    several tokens, and decoding them one at a time yields U+FFFD; so decode a short window of
    recent ids and emit only text that is complete and new (the scheme of Hugging Face's and
    vLLM's streaming detokenizers).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_start = 0  # window start: context so that spacing rules see a neighbour
        self._emitted_end = 0  # ids before this index are already printed

    def feed(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        before = self._decode(self._ids[self._prefix_start : self._emitted_end])
        after = self._decode(self._ids[self._prefix_start :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # incomplete character (or nothing visible yet): wait for more ids
        self._prefix_start, self._emitted_end = self._emitted_end, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        before = self._decode(self._ids[self._prefix_start : self._emitted_end])
        after = self._decode(self._ids[self._prefix_start :])
        self._prefix_start = self._emitted_end = len(self._ids)
        return after[len(before) :] if len(after) > len(before) else ""


def text_stream(tokenizer: Decoder) -> TextStream:
    stream = getattr(tokenizer, "stream", None)
    if callable(stream):
        return cast(TextStream, stream())
    return IncrementalDecoder(lambda ids: tokenizer.decode(ids))


def generate(
    session: Session,
    tokenizer: Decoder,
    prompt_ids: Sequence[int] | np.ndarray,
    *,
    max_new_tokens: int,
    sampler: Sampler,
    stop_ids: Iterable[int] = (),
    decoding: Decoding | None = None,
) -> Iterator[str]:
    """Feed `prompt_ids` after whatever is in the session, then sample and stream text pieces
    (`decoding`: logit bias, penalties or a grammar, as the server applies them).

    Raises ContextOverflowError up front when the prompt alone does not fit. The session keeps
    every fed token, so a chat can continue with the next prompt.
    """
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    if prompt.size == 0:
        raise ValueError("generate needs at least one prompt token")
    if prompt.size > session.n_free:
        raise ContextOverflowError(
            f"prompt is {prompt.size} tokens, but the context has {session.n_free} of {session.n_ctx} free"
        )
    if max_new_tokens <= 0:
        return
    stops = {int(s) for s in stop_ids}
    decoder = text_stream(tokenizer)
    chooser = TokenChooser(sampler, decoding or Decoding())
    logits = session.forward(prompt)
    for produced in range(1, max_new_tokens + 1):
        token, _ = chooser.choose(logits)
        if token in stops:
            break
        piece = decoder.feed(token)
        if piece:
            yield piece
        if produced == max_new_tokens:
            break
        if session.n_free == 0:
            progress(f"context full ({session.n_ctx} tokens); stopping generation")
            break
        logits = session.forward([token])
    tail = decoder.flush()
    if tail:
        yield tail
