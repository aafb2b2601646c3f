"""Text <-> token ids for a compiled model, on Hugging Face `tokenizers`.

The tokenizer arrives as a `tokenizers` JSON string plus a few plain facts (the frontend's
`TokenizerSpec.to_dict()`, or the same values from an artifact manifest); nothing here imports
the frontend. Encoding is `tokenizers`' job. Decoding follows llama.cpp's `token_to_piece` on
bytes: each id maps to the bytes of its piece, CONTROL/UNKNOWN tokens are hidden unless asked
for, and text is assembled with an incremental UTF-8 decoder so a stream never splits a
multi-byte character.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from ggufc.messages import GgufcError

_SPM_SPACE = "\u2581"  # SentencePiece whitespace marker '▁'
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SUPPORTED_MODELS = ("gpt2", "llama")


class TokenizationError(GgufcError, ValueError):
    """The tokenizer cannot do what was asked (one-line message)."""


def _gpt2_byte_chars() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted (character -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in printable]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + i): b for i, b in enumerate(extra)})
    return chars


_BYTE_OF_CHAR = _gpt2_byte_chars()


def _byte_level_piece(text: str) -> bytes:
    try:
        return bytes(_BYTE_OF_CHAR[c] for c in text)
    except KeyError:  # not a byte-level string: use its text, as `tokenizers` does
        return text.encode("utf-8")


def _spm_piece(text: str) -> bytes:
    match = _BYTE_TOKEN.fullmatch(text)
    if match:
        return bytes([int(match.group(1), 16)])
    return text.replace(_SPM_SPACE, " ").encode("utf-8")


class Tokenizer:
    """Encode text to ids and decode ids to text the way llama.cpp does for the same GGUF."""

    def __init__(
        self,
        tokenizer_json: str,
        *,
        model: str,
        bos_id: int | None = None,
        eos_id: int | None = None,
        eot_ids: Iterable[int] = (),
        add_bos: bool = False,
        add_eos: bool = False,
        add_space_prefix: bool = False,
        clean_spaces: bool = False,
    ) -> None:
        if model not in _SUPPORTED_MODELS:
            raise TokenizationError(f"tokenizer model {model!r} is not supported (expected gpt2 or llama)")
        try:
            self._hf = _HFTokenizer.from_str(tokenizer_json)
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise TokenizationError(f"invalid tokenizer JSON: {_one_line(exc)}") from None
        self._json = tokenizer_json
        self._hf_literal: _HFTokenizer | None = None  # made on demand for parse_special=False
        self.model = model
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eot_ids = frozenset(int(i) for i in eot_ids)
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.clean_spaces = clean_spaces
        self._pieces, self._hidden, self._texts = _piece_table(json.loads(tokenizer_json), model)

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> Tokenizer:
        """Build from `TokenizerSpec.to_dict()` (or a manifest entry with the same keys)."""
        if spec.get("tokenizer_json") is None:
            reason = spec.get("unavailable_reason") or "the spec holds no tokenizer_json"
            raise TokenizationError(f"no text tokenizer for this model: {reason}")
        return cls(
            spec["tokenizer_json"],
            model=str(spec.get("model", "")),
            bos_id=spec.get("bos_id"),
            eos_id=spec.get("eos_id"),
            eot_ids=spec.get("eot_ids") or (),
            add_bos=bool(spec.get("add_bos", False)),
            add_eos=bool(spec.get("add_eos", False)),
            add_space_prefix=bool(spec.get("add_space_prefix", False)),
            clean_spaces=bool(spec.get("clean_spaces", False)),
        )

    # --- facts -------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self._pieces)

    @property
    def bos_token(self) -> str:
        """BOS text for chat templates ('' when the model has none)."""
        return "" if self.bos_id is None else self._texts[self.bos_id]

    @property
    def eos_token(self) -> str:
        """EOS text for chat templates ('' when the model has none)."""
        return "" if self.eos_id is None else self._texts[self.eos_id]

    def is_eog(self, token_id: int) -> bool:
        """True for ids that end generation (EOS, end-of-turn, ...)."""
        return token_id in self.eot_ids

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of an id, as stored in the GGUF (e.g. 'Ġthe', '▁the', '<s>')."""
        self._check_id(token_id)
        return self._texts[token_id]

    def token_id(self, text: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self._hf.token_to_id(text)

    # --- encode ------------------------------------------------------------------------------

    def encode(
        self,
        text: str,
        add_bos: bool | None = None,
        parse_special: bool = True,
        add_eos: bool | None = None,
    ) -> list[int]:
        """Token ids of `text`; special-token texts become their ids when `parse_special`.

        `add_bos`/`add_eos` default to the model's own setting (llama.cpp's add_special=true).
        """
        ids = list(self._encoder(parse_special).encode(text, add_special_tokens=False).ids)
        if self.add_bos if add_bos is None else add_bos:
            ids.insert(0, self._required(self.bos_id, "BOS"))
        if self.add_eos if add_eos is None else add_eos:
            ids.append(self._required(self.eos_id, "EOS"))
        return ids

    def _encoder(self, parse_special: bool) -> _HFTokenizer:
        if parse_special:
            return self._hf
        if self._hf_literal is None:
            # a second instance, so the shared one is never mutated under a concurrent caller
            literal = _HFTokenizer.from_str(self._json)
            literal.encode_special_tokens = True
            self._hf_literal = literal
        return self._hf_literal

    @staticmethod
    def _required(token_id: int | None, name: str) -> int:
        if token_id is None:
            raise TokenizationError(f"the model has no {name} token to add")
        return token_id

    # --- decode ------------------------------------------------------------------------------

    def piece(self, token_id: int, skip_special: bool = True) -> bytes:
        """The bytes one id stands for (llama.cpp token_to_piece); b'' for hidden specials."""
        self._check_id(token_id)
        if skip_special and token_id in self._hidden:
            return b""
        return self._pieces[token_id]

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`, as llama.cpp detokenizes (llama_detokenize, llama-cpp-python).

        Control tokens are hidden when `skip_special`. With a space prefix (SPM vocabularies)
        the first visible piece loses its leading space, also after a hidden BOS, as
        llama-cpp-python does. Invalid UTF-8 becomes U+FFFD; `clean_spaces` vocabularies get
        llama.cpp's clean-up of spaces before punctuation.
        """
        pieces = [self.piece(i, skip_special) for i in ids]
        if self.add_space_prefix:
            _strip_prefix_space(pieces)
        text = b"".join(pieces).decode("utf-8", errors="replace")
        return _clean_spaces(text) if self.clean_spaces else text

    def stream(self, skip_special: bool = True) -> StreamDecoder:
        """An incremental decoder for ids produced one at a time."""
        return StreamDecoder(self, skip_special=skip_special)

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._pieces):
            raise TokenizationError(
                f"token id {token_id} is outside the vocabulary (0..{len(self._pieces) - 1})"
            )


class StreamDecoder:
    """Feed ids one by one; get text pieces that never split a UTF-8 character.

    Pieces are concatenated exactly (no space stripping or clean-up), like llama.cpp's
    generation loop printing `token_to_piece` for each new token.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Text completed by this id ('' while a multi-byte character is still open)."""
        return self._utf8.decode(self._tokenizer.piece(token_id, self._skip_special))

    def flush(self) -> str:
        """Whatever is left at the end (an unfinished character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def _piece_table(config: Mapping[str, Any], model: str) -> tuple[list[bytes], frozenset[int], list[str]]:
    """Bytes per id, the ids hidden in decoding (special added tokens), and the vocab texts."""
    vocab: dict[str, int] = dict(config["model"]["vocab"])
    added = config.get("added_tokens") or []
    n = max([*vocab.values(), *(t["id"] for t in added), -1]) + 1
    texts = [""] * n
    for text, tid in vocab.items():
        texts[tid] = text
    to_bytes = _byte_level_piece if model == "gpt2" else _spm_piece
    pieces = [to_bytes(t) for t in texts]
    for token in added:  # added tokens render as their raw text, as llama.cpp does
        texts[token["id"]] = token["content"]
        pieces[token["id"]] = token["content"].encode("utf-8")
    hidden = frozenset(int(t["id"]) for t in added if t.get("special"))
    return pieces, hidden, texts


def _strip_prefix_space(pieces: list[bytes]) -> None:
    """Undo the space the encoder prefixed: drop it from the first non-empty piece."""
    for i, piece in enumerate(pieces):
        if piece:
            if piece.startswith(b" "):
                pieces[i] = piece[1:]
            return


def _clean_spaces(text: str) -> str:
    """llama.cpp's clean_up_tokenization_spaces (three passes of llama_detokenize)."""
    text = re.sub(r" (?=[?!.,])", "", text)  # " ?", " !", " .", " ,"
    text = text.replace(" ' ", "'")  # a lone apostrophe between spaces
    return re.sub(r" (?='(?:[sm]|re|ve))", "", text)  # " 's", " 'm", " 're", " 've"


def _one_line(exc: BaseException) -> str:
    text = re.sub(r"\s+", " ", str(exc)).strip()
    return text[:300] or type(exc).__name__
