"""Build a Hugging Face `tokenizers` tokenizer from a GGUF vocabulary, the way llama.cpp reads it.

`build_tokenizer(metadata)` turns the `tokenizer.*` keys of a GGUF file into a `TokenizerSpec`:
a `tokenizers` JSON serialisation plus the facts a runtime needs (BOS/EOS, end-of-generation ids,
whether to add BOS, the chat template). The behaviour follows llama.cpp's `src/llama-vocab.cpp`
(the oracle for GGUF files), not the original Hugging Face tokenizer of the model:

- `gpt2` vocabularies are byte-level BPE. The pre-tokenizer is the list of regexes llama.cpp uses
  for `tokenizer.ggml.pre`, applied one after the other (each splits the pieces of the previous
  one, keeping matches and gaps), which is a `Sequence` of isolating `Split`s in `tokenizers`.
- `llama` vocabularies are SentencePiece (SPM) pieces with scores. llama.cpp tokenizes them by
  repeatedly merging the adjacent pair whose concatenation is the highest-scoring vocab entry,
  with `<0xNN>` byte fallback. That is BPE whose merge ranks are the scores of the merged pieces,
  so the merges are derived from the vocab here (as HF's `convert_slow_tokenizer` does).
- CONTROL and UNKNOWN tokens become special added tokens (parsed in text only when asked,
  hidden when decoding); USER_DEFINED tokens become non-special added tokens (always parsed),
  matching llama.cpp's `tokenizer_st_partition`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ggufc.messages import GgufcError

# llama.cpp `llama_token_type` values stored in tokenizer.ggml.token_type
TOKEN_UNDEFINED, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL = 0, 1, 2, 3
TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 4, 5, 6

_SPM_SPACE = "\u2581"  # the SentencePiece whitespace marker '▁'


class TokenizerError(GgufcError, ValueError):
    """A GGUF vocabulary that cannot be turned into a tokenizer (one-line message)."""


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything a runtime needs to tokenize for one model; plain values only."""

    model: str  # tokenizer.ggml.model: "gpt2", "llama", "none", ...
    tokenizer_json: str | None  # a `tokenizers` JSON serialisation; None: no text tokenizer
    bos_id: int | None
    eos_id: int | None
    eot_ids: list[int] = field(default_factory=list)  # every id that ends generation (llama.cpp EOG)
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    clean_spaces: bool = False  # llama.cpp clean_up_tokenization_spaces when detokenizing
    chat_template: str | None = None
    pre: str | None = None  # tokenizer.ggml.pre
    bos_token: str | None = None  # texts of BOS/EOS, for chat templates
    eos_token: str | None = None
    n_vocab: int = 0
    unavailable_reason: str | None = None  # why tokenizer_json is None

    @property
    def available(self) -> bool:
        return self.tokenizer_json is not None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable) for a manifest or `ggufc.runtime.tokenizer.Tokenizer`."""
        return asdict(self)


# --- pre-tokenizer regexes -------------------------------------------------------------------
# One table: llama.cpp `llm_tokenizer_bpe` regex lists, keyed by llama.cpp pre-tokenizer family
# (LLAMA_VOCAB_PRE_TYPE_*). Families that need llama.cpp's hand-written splitters (kimi-k2,
# afmoe, superbpe) or raw-UTF-8 BPE (gemma4, sarvam-moe, whitespace) are not listed.

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_JAIS2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
    r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)
_CASED_WORDS = (  # tekken / gpt-4o: upper-case run then lower-case run; @C@: optional suffix
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+@C@"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*@C@"
)
_TEKKEN = _CASED_WORDS.replace("@C@", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = (
    _CASED_WORDS.replace("@C@", _CONTRACTIONS + "?")
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GRANITE_EMB_MULTI = _GPT4O.replace(r"(?=[\p{L}])", r"(?=[\p{L}\p{M}])")
_UNICODE_WORDS = (  # youtu / tiny_aya: Lu/Lt/Lm/Lo/M runs then lower-case runs
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
)
_DEEPSEEK3_WORDS = r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+"
)

PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "starcoder": (r"\p{N}", _GPT2),  # also refact, command-r, smollm, codeshell, exaone, ...
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3,),  # also dbrx, smaug, chatglm4
    "jais2": (_JAIS2,),
    "qwen2": (_QWEN2,),  # also stablelm2, hunyuan, solar-open, grok-2
    "qwen35": (_QWEN35,),
    "deepseek-llm": (
        r"[\r\n]",
        _DEEPSEEK_LLM_LETTERS,
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        _CJK_HANGUL,
        r"\p{N}+",
    ),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
    "deepseek-v3": (
        r"\p{N}{1,3}",
        _CJK_KANA,
        _DEEPSEEK3_WORDS + r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "spark2_5": (
        r"\p{N}{1,3}",
        _CJK_KANA,
        _DEEPSEEK3_WORDS + r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
        r"\p{N}",
    ),
    "youtu": (
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c"
        "\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _CJK_KANA,
        _UNICODE_WORDS + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "poro": (_PORO,),  # also bloom, gpt3-finnish
    "viking": (_PORO, r"\p{N}"),
    "tekken": (_TEKKEN,),
    "gpt4o": (_GPT4O,),  # also minimax-m2
    "granite-emb-multi": (_GRANITE_EMB_MULTI,),
    "tiny_aya": (
        r"\d{1,3}(?=(?:\d{3})*\b)",
        _UNICODE_WORDS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "bailingmoe": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "seed-coder": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "laguna": (r"[^\n]+|[\n]+", _QWEN2),
    "exaone-moe": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "minicpm5": (
        r"\p{N}{1,3}",
        _CONTRACTIONS
        + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}


@dataclass(frozen=True)
class _Pre:
    """How llama.cpp configures one `tokenizer.ggml.pre` value (llama_vocab::impl::load)."""

    family: str  # key of PRE_TOKENIZER_REGEXES
    clean_spaces: bool = True
    ignore_merges: bool = False  # a pre-token that is a whole vocab entry skips the merges
    add_bos: bool = False
    no_bos: bool = False  # chatglm: no default BOS


def _pres(names: str, pre: _Pre) -> dict[str, _Pre]:
    return {name: pre for name in names.split()}


_PRE: dict[str, _Pre] = {
    "": _Pre("default"),  # llama.cpp warns and uses 'default' when the key is missing
    "default": _Pre("default"),
    **_pres("minicpm5", _Pre("minicpm5", ignore_merges=True)),
    **_pres(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        _Pre("llama3", ignore_merges=True, add_bos=True),
    ),
    **_pres("deepseek-llm", _Pre("deepseek-llm", clean_spaces=False)),
    **_pres("deepseek-coder", _Pre("deepseek-coder", clean_spaces=False)),
    **_pres("deepseek-v3 hunyuan-dense hy_v4 joyai-llm", _Pre("deepseek-v3", clean_spaces=False)),
    **_pres("spark2_5", _Pre("spark2_5", clean_spaces=False)),
    **_pres("youtu", _Pre("youtu", clean_spaces=False, ignore_merges=True)),
    **_pres("falcon", _Pre("falcon")),
    **_pres(
        "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert mpt olmo "
        "jais exaone4 jina-v1-en jina-v2-code roberta-bpe",
        _Pre("gpt2"),
    ),
    **_pres("trillion granite-docling", _Pre("gpt2", clean_spaces=False)),
    **_pres("jais-2", _Pre("jais2")),
    **_pres("starcoder refact codeshell exaone minerva-7b mellum2", _Pre("starcoder")),
    **_pres("command-r smollm", _Pre("starcoder", clean_spaces=False)),
    **_pres(
        "qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open grok-2", _Pre("qwen2", clean_spaces=False)
    ),
    **_pres("stablelm2 megrez", _Pre("qwen2")),
    **_pres("qwen35", _Pre("qwen35", clean_spaces=False)),
    **_pres("dbrx smaug-bpe", _Pre("llama3")),
    **_pres("poro-chat", _Pre("poro", clean_spaces=False)),
    **_pres("bloom gpt3-finnish", _Pre("poro")),
    **_pres("chatglm-bpe", _Pre("llama3", no_bos=True)),
    **_pres("glm4 glm5", _Pre("llama3", no_bos=True, ignore_merges=True)),
    **_pres("viking", _Pre("viking", clean_spaces=False)),
    **_pres("tekken", _Pre("tekken", clean_spaces=False, ignore_merges=True, add_bos=True)),
    **_pres("gpt-4o llama4 kanana2 talkie minimax-m2", _Pre("gpt4o", clean_spaces=False)),
    **_pres("granite-embed-multi-97m", _Pre("granite-emb-multi", clean_spaces=False, ignore_merges=True)),
    **_pres("tiny_aya cohere2moe", _Pre("tiny_aya", clean_spaces=False)),
    **_pres("bailingmoe bailingmoe2 llada-moe", _Pre("bailingmoe", clean_spaces=False)),
    **_pres("seed-coder", _Pre("seed-coder", clean_spaces=False)),
    **_pres("ufakzeka", _Pre("ufakzeka", clean_spaces=False)),
    **_pres("laguna", _Pre("laguna", clean_spaces=False)),
    **_pres("exaone-moe", _Pre("exaone-moe")),
}

# --- special-token detection by text (llama.cpp auto-detects these; see llama-vocab.cpp) ------
_EOT_TEXTS = frozenset(
    "<|eot_id|> <|im_end|> <|end|> <end_of_turn> <|endoftext|> <|end_of_text|> <EOT> _<EOT> [EOT] "
    "<\uff5cend\u2581of\u2581sentence\uff5c> <end_of_utterance>".split()
)
_EOG_TEXTS = frozenset(
    "<|eot_id|> <|im_end|> <|end|> <|return|> <|call|> <|flush|> <|calls|> <end_of_turn> <|endoftext|> "
    "</s> <|eom_id|> <EOT> _<EOT> [EOT] [EOS] <|end_of_text|> <end_of_utterance> <eos> <turn|> "
    "<|tool_response> <\uff5cend\u2581of\u2581sentence\uff5c> [e~[".split()
)
# fill-in-the-middle tokens; pad/rep/sep also end generation
_FIM_TEXTS: dict[str, frozenset[str]] = {
    "pre": frozenset(
        "<|fim_prefix|> <fim-prefix> <fim_prefix> <\uff5cfim\u2581begin\uff5c> <PRE> \u2581<PRE> "
        "<|code_prefix|> <|prefix|>".split()
    ),
    "suf": frozenset(
        "<|fim_suffix|> <fim-suffix> <fim_suffix> <\uff5cfim\u2581hole\uff5c> <SUF> \u2581<SUF> "
        "<|code_suffix|> <|suffix|>".split()
    ),
    "mid": frozenset(
        "<|fim_middle|> <fim-middle> <fim_middle> <\uff5cfim\u2581end\uff5c> <MID> \u2581<MID> "
        "<|code_middle|> <|middle|>".split()
    ),
    "pad": frozenset("<|fim_pad|> <fim-pad> <fim_pad> <PAD> [PAD]".split()),
    "rep": frozenset("<|fim_repo|> <|repo_name|> <fim-repo> <REPO> <reponame>".split()),
    "sep": frozenset(["<|file_sep|>"]),
}
_ALWAYS_RENDERED = frozenset(["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"])  # gpt-oss


def build_tokenizer(metadata: Mapping[str, Any]) -> TokenizerSpec:
    """Turn GGUF `tokenizer.*` metadata into a `TokenizerSpec` (raises `TokenizerError`)."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError("GGUF has no tokenizer.ggml.model key: no vocabulary to build a tokenizer from")
    model = str(model)
    if model in ("none", "no_vocab"):
        return _unavailable(metadata, model, f"tokenizer.ggml.model is {model!r}: the file has no vocabulary")
    if model == "test":
        reason = (
            "tokenizer.ggml.model is 'test': llama.cpp's test vocabulary (tok_0, tok_1, ...) has no text form"
        )
        return _unavailable(metadata, model, reason)
    if model == "gpt2":
        return _build_bpe(metadata)
    if model == "llama":
        return _build_spm(metadata)
    raise TokenizerError(
        f"tokenizer.ggml.model {model!r} is not supported (supported: gpt2, llama, none, no_vocab, test)"
    )


def _unavailable(metadata: Mapping[str, Any], model: str, reason: str) -> TokenizerSpec:
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    return TokenizerSpec(
        model=model,
        tokenizer_json=None,
        bos_id=None,
        eos_id=None,
        chat_template=_opt_str(metadata.get("tokenizer.chat_template")),
        n_vocab=len(tokens),
        unavailable_reason=reason,
    )


# --- the vocabulary as llama.cpp sees it -----------------------------------------------------


@dataclass
class _Vocab:
    tokens: list[str]
    types: list[int]
    scores: list[float]
    ids: dict[str, int]  # text -> id; on duplicate texts the last id wins, as in llama.cpp


def _read_vocab(metadata: Mapping[str, Any]) -> _Vocab:
    raw = metadata.get("tokenizer.ggml.tokens")
    if raw is None or isinstance(raw, str | bytes) or len(raw) == 0:
        raise TokenizerError("GGUF has no tokenizer.ggml.tokens list")
    # llama.cpp renames empty tokens so every id keeps a distinct text
    tokens = [str(t) if str(t) else f"[EMPTY_{i}]" for i, t in enumerate(raw)]
    types = _int_list(metadata, "tokenizer.ggml.token_type", len(tokens), default=TOKEN_NORMAL)
    scores = [float(s) for s in _num_list(metadata, "tokenizer.ggml.scores", len(tokens))]
    ids = {text: i for i, text in enumerate(tokens)}
    return _Vocab(tokens=tokens, types=types, scores=scores, ids=ids)


def _int_list(metadata: Mapping[str, Any], key: str, n: int, default: int) -> list[int]:
    values = metadata.get(key)
    if values is None:
        return [default] * n
    if len(values) < n:
        raise TokenizerError(f"{key} has {len(values)} entries for {n} tokens")
    return [int(v) for v in values[:n]]


def _num_list(metadata: Mapping[str, Any], key: str, n: int) -> list[float]:
    values = metadata.get(key)
    if values is None:
        return [0.0] * n
    if len(values) < n:
        raise TokenizerError(f"{key} has {len(values)} entries for {n} tokens")
    return [float(v) for v in values[:n]]


# --- special ids -----------------------------------------------------------------------------


@dataclass
class _Specials:
    bos: int | None
    eos: int | None
    eog: list[int]


def _key_id(metadata: Mapping[str, Any], key: str, default: int | None, n: int) -> int | None:
    """A special-token id from its key; llama.cpp keeps the default for a missing or bad id."""
    if default is not None and default >= n:
        default = None
    value = metadata.get(key)
    if value is None:
        return default
    value = int(value)
    return value if 0 <= value < n else default


def _detect(metadata: Mapping[str, Any], vocab: _Vocab, key: str, texts: frozenset[str]) -> int | None:
    """An id from its key, else the first token with a known text, which becomes CONTROL."""
    tid = _key_id(metadata, key, None, len(vocab.tokens))
    if tid is not None:
        return tid
    found = [vocab.ids[t] for t in texts if t in vocab.ids]
    if not found:
        return None
    tid = min(found)  # llama.cpp takes whichever its hash map yields first
    vocab.types[tid] = TOKEN_CONTROL
    return tid


def _specials(metadata: Mapping[str, Any], vocab: _Vocab, bos: int | None, eos: int | None) -> _Specials:
    """BOS/EOS and the end-of-generation set, with llama.cpp's retyping of tokens by text."""
    n = len(vocab.tokens)
    bos = _key_id(metadata, "tokenizer.ggml.bos_token_id", bos, n)
    eos = _key_id(metadata, "tokenizer.ggml.eos_token_id", eos, n)
    eot = _detect(metadata, vocab, "tokenizer.ggml.eot_token_id", _EOT_TEXTS)
    eom = _detect(metadata, vocab, "tokenizer.ggml.eom_token_id", frozenset(["<|eom_id|>"]))
    fim = {
        kind: _detect(metadata, vocab, f"tokenizer.ggml.fim_{kind}_token_id", texts)
        for kind, texts in _FIM_TEXTS.items()
    }
    eog = {tid for tid in (fim["pad"], fim["rep"], fim["sep"]) if tid is not None}
    for text, tid in vocab.ids.items():
        if text in _EOG_TEXTS:
            eog.add(tid)
            vocab.types[tid] = TOKEN_CONTROL  # "control-looking token ... will be overridden"
        elif text in _ALWAYS_RENDERED:
            vocab.types[tid] = TOKEN_USER_DEFINED
    eog.update(tid for tid in (eos, eot, eom) if tid is not None)
    _drop_ambiguous_eog(vocab, eog)
    return _Specials(bos=bos, eos=eos, eog=sorted(eog))


def _drop_ambiguous_eog(vocab: _Vocab, eog: set[int]) -> None:
    """llama.cpp's workarounds: gpt-oss/solar-open '<|end|>' and gemma4/plamo '</s>' are not EOG."""
    texts = {vocab.tokens[i] for i in eog}
    has_call = bool(texts & {"<|call|>", "<|calls|>"})
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        eog.discard(vocab.ids["<|end|>"])
        vocab.types[vocab.ids["<|end|>"]] = TOKEN_USER_DEFINED
    if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"}:
        eog.discard(vocab.ids["</s>"])
        vocab.types[vocab.ids["</s>"]] = TOKEN_NORMAL


def _flag(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(key)
    return default if value is None else bool(value)


# --- tokenizers JSON pieces ------------------------------------------------------------------


def _added_tokens(vocab: _Vocab) -> list[dict[str, Any]]:
    """CONTROL/UNKNOWN: special (parse_special only, hidden in decode); USER_DEFINED: always parsed."""
    added = []
    for tid, (text, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True)):
        if kind not in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED) or vocab.ids[text] != tid:
            continue
        added.append(
            {
                "id": tid,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": kind != TOKEN_USER_DEFINED,
            }
        )
    return added


def _bpe_model(vocab: _Vocab, merges: list[list[str]], **options: Any) -> dict[str, Any]:
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        **options,
        "vocab": vocab.ids,
        "merges": _merges_json(merges),
    }


def _merges_json(merges: list[list[str]]) -> list[str] | list[list[str]]:
    # "a b" strings load in every `tokenizers` release; [a, b] pairs (0.20+) only when a piece has a space
    if any(" " in part for pair in merges for part in pair):
        return merges
    return [f"{left} {right}" for left, right in merges]


def _tokenizer_json(
    vocab: _Vocab, model: dict[str, Any], normalizer: Any, pre_tokenizer: Any, decoder: Any
) -> str:
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(vocab),
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": decoder,
        "model": model,
    }
    text = json.dumps(doc, ensure_ascii=False)
    _check_loads(text)
    return text


def _check_loads(text: str) -> None:
    """Fail at build time, with one line, if `tokenizers` rejects what was built."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises plain Exception subclasses
        raise TokenizerError(f"tokenizers rejected the built tokenizer: {_one_line(exc)}") from None


# --- gpt2: byte-level BPE --------------------------------------------------------------------


def _bpe_merges(metadata: Mapping[str, Any], vocab: _Vocab) -> list[list[str]]:
    raw = metadata.get("tokenizer.ggml.merges")
    if raw is None:
        raise TokenizerError("gpt2 vocabulary without tokenizer.ggml.merges")
    merges: list[list[str]] = []
    seen: set[tuple[str, str]] = set()
    for line in map(str, raw):
        pos = line.find(" ", 1)  # llama.cpp splits at the first space after the first char
        if pos < 0:
            continue
        left, right = line[:pos], line[pos + 1 :]
        # `tokenizers` needs both halves and the result in the vocab; llama.cpp keeps the first rank
        if (left, right) in seen or not {left, right, left + right} <= vocab.ids.keys():
            continue
        seen.add((left, right))
        merges.append([left, right])
    return merges


def _split(pattern: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def _byte_level() -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def _build_bpe(metadata: Mapping[str, Any]) -> TokenizerSpec:
    pre_name = str(metadata.get("tokenizer.ggml.pre") or "")
    pre = _PRE.get(pre_name)
    if pre is None:
        raise TokenizerError(f"tokenizer.ggml.pre {pre_name!r} (gpt2 vocabulary) is not supported")
    vocab = _read_vocab(metadata)
    specials = _specials(metadata, vocab, bos=None if pre.no_bos else 11, eos=11)  # llama.cpp defaults
    splits = [_split(p) for p in PRE_TOKENIZER_REGEXES[pre.family]]
    model = _bpe_model(vocab, _bpe_merges(metadata, vocab), ignore_merges=pre.ignore_merges)
    pre_tokenizer = {"type": "Sequence", "pretokenizers": [*splits, _byte_level()]}
    text = _tokenizer_json(vocab, model, None, pre_tokenizer, _byte_level())
    return _spec(
        metadata,
        vocab,
        specials,
        text,
        add_bos=pre.add_bos,
        add_space_prefix=False,
        clean_spaces=pre.clean_spaces,
        pre=pre_name,
    )


# --- llama: SentencePiece pieces merged by score ---------------------------------------------


def _spm_merges(vocab: _Vocab) -> list[list[str]]:
    """Every split of a vocab piece into two vocab pieces, ranked by the merged piece's score.

    llama.cpp's SPM session repeatedly merges the adjacent pair whose concatenation is the
    highest-scoring vocab entry; BPE with these ranks makes the same choices (equal scores of
    different pieces are ordered by id here, by position in llama.cpp).
    """
    ranked: list[tuple[float, int, str, str]] = []
    for tid, piece in enumerate(vocab.tokens):
        if vocab.ids[piece] != tid or vocab.types[tid] == TOKEN_BYTE:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab.ids and right in vocab.ids:
                ranked.append((-vocab.scores[tid], tid, left, right))
    ranked.sort()
    return [[left, right] for _, _, left, right in ranked]


def _spm_normalizer(add_space_prefix: bool) -> dict[str, Any]:
    # llama.cpp prefixes a space to every text fragment (each follows a special token or the start)
    # and escapes spaces as '▁'; `tokenizers` normalizes each fragment between added tokens alike.
    steps: list[dict[str, Any]] = [{"type": "Prepend", "prepend": _SPM_SPACE}] if add_space_prefix else []
    steps.append({"type": "Replace", "pattern": {"String": " "}, "content": _SPM_SPACE})
    return {"type": "Sequence", "normalizers": steps}


def _spm_decoder() -> dict[str, Any]:
    # no Strip: llama.cpp removes the prefix space only when detokenizing, which the runtime does
    return {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": _SPM_SPACE}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ],
    }


def _build_spm(metadata: Mapping[str, Any]) -> TokenizerSpec:
    vocab = _read_vocab(metadata)
    specials = _specials(metadata, vocab, bos=1, eos=2)  # llama.cpp SPM defaults
    add_space_prefix = _flag(metadata, "tokenizer.ggml.add_space_prefix", True)
    unk = _key_id(metadata, "tokenizer.ggml.unknown_token_id", 0, len(vocab.tokens))
    model = _bpe_model(
        vocab,
        _spm_merges(vocab),
        unk_token=vocab.tokens[unk] if unk is not None else None,
        byte_fallback=True,
    )
    text = _tokenizer_json(vocab, model, _spm_normalizer(add_space_prefix), None, _spm_decoder())
    return _spec(
        metadata,
        vocab,
        specials,
        text,
        add_bos=True,
        add_space_prefix=add_space_prefix,
        clean_spaces=False,
        pre=_opt_str(metadata.get("tokenizer.ggml.pre")),
    )


def _spec(
    metadata: Mapping[str, Any],
    vocab: _Vocab,
    specials: _Specials,
    tokenizer_json: str,
    *,
    add_bos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    pre: str | None,
) -> TokenizerSpec:
    def text_of(tid: int | None) -> str | None:
        return None if tid is None else vocab.tokens[tid]

    return TokenizerSpec(
        model=str(metadata["tokenizer.ggml.model"]),
        tokenizer_json=tokenizer_json,
        bos_id=specials.bos,
        eos_id=specials.eos,
        eot_ids=specials.eog,
        add_bos=_flag(metadata, "tokenizer.ggml.add_bos_token", add_bos),
        add_eos=_flag(metadata, "tokenizer.ggml.add_eos_token", False),
        add_space_prefix=_flag(metadata, "tokenizer.ggml.add_space_prefix", add_space_prefix),
        clean_spaces=clean_spaces,
        chat_template=_opt_str(metadata.get("tokenizer.chat_template")),
        pre=pre,
        bos_token=text_of(specials.bos),
        eos_token=text_of(specials.eos),
        n_vocab=len(vocab.tokens),
    )


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _one_line(exc: BaseException) -> str:
    text = re.sub(r"\s+", " ", str(exc)).strip()
    return text[:300] or type(exc).__name__
