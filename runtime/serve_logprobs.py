"""Log-probabilities in OpenAI's two shapes: chat's `{"content": [{token, logprob, bytes,
top_logprobs}]}` and completions' `{tokens, token_logprobs, top_logprobs, text_offset}`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .token_choice import TokenLogprob


class LogprobWriter:
    """One choice's log-probabilities as its events bring them; `text_offset` runs across chunks."""

    def __init__(self, tokenizer: Any, *, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0

    def _piece(self, token: int) -> bytes:
        return bytes(self.tokenizer.piece(token, skip_special=False))

    def _text(self, token: int) -> str:
        return self._piece(token).decode("utf-8", errors="replace")

    def render(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            return {"token": self._text(token), "logprob": logprob, "bytes": list(self._piece(token))}

        content = [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]} for e in entries]
        return {"content": content, "refusal": None}

    def _completion(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        tokens = [self._text(e.token) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}


def merge(parts: Sequence[dict[str, Any]], *, chat: bool) -> dict[str, Any]:
    """The rendered parts of one choice as one object (a whole answer)."""
    if chat:
        return {"content": [c for p in parts for c in p["content"]], "refusal": None}
    return {key: [v for p in parts for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                  "text_offset")}
