"""`ggufc serve` on SmolLM2-135M-Instruct Q4_1 with the real `openai` client, on loopback ports:
chat and text completions, streamed and not, greedy output identical to `ggufc run`, stop strings,
usage, seeded sampling, prefix reuse, the API key, bad and fuzzed requests, a client that goes
away, 503 past the queue, sleeping when idle, SIGTERM; and the bounded load test (32 streaming
clients against --parallel 4, some disconnecting early)."""

from __future__ import annotations

import http.client
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.default_model import compile_default_model, needs_default_model
from tests.support.serve_support import ROOT, ServerProcess, cli_env, wait_until

openai = pytest.importorskip("openai")


KEY = "test-key-123"
N_CTX = 256
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "My favourite animal is the",
    "In 1969, the first humans",
    "A haiku about the sea:",
]


pytestmark = needs_default_model


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_default_model(tmp_path_factory.mktemp("serve"), N_CTX)


@pytest.fixture(scope="module")
def model(artifact: Path) -> Iterator[Any]:
    """The same artifact in this process: the serial reference."""
    import ggufc

    with ggufc.load(artifact) as m:
        yield m


@pytest.fixture(scope="module")
def server(artifact: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(artifact, "--parallel", "2", "--api-key", KEY, "--alias", "smollm2")
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def ggufc_run(artifact: Path, prompt: str, n: int, *, chat: bool) -> str:
    """What `ggufc run` prints (greedy), without its final newline."""
    args = [sys.executable, "-m", "ggufc.cli", "run", str(artifact), "--prompt", prompt, "-n", str(n)]
    result = subprocess.run(args + (["--chat"] if chat else []), capture_output=True, text=True, env=cli_env(),
                            cwd=ROOT, timeout=300, check=True)
    assert result.stdout.endswith("\n")
    return result.stdout[:-1]


def stream_text(stream: Any, *, chat: bool) -> tuple[str, str | None, Any]:
    """(text, finish_reason, usage) of a streamed response."""
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append((choice.delta.content if chat else choice.text) or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, usage


# --------------------------------------------------------------------- what a client sees


def test_models_and_health(server: ServerProcess, client: Any) -> None:
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    health = server.health()
    assert health["status"] == "ok" and health["slots"] == 2 and health["slots_busy"] == 0


def test_chat_greedy_equals_ggufc_run(artifact: Path, client: Any) -> None:
    prompt = "What is the capital of France?"
    expected = ggufc_run(artifact, prompt, 20, chat=True)
    messages = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].message.content == expected and expected
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, finish, usage = stream_text(stream, chat=True)
    assert text == expected and finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_greedy_equals_ggufc_run(artifact: Path, client: Any, model: Any) -> None:
    prompt = PROMPTS[0]
    expected = ggufc_run(artifact, prompt, 12, chat=False)
    whole = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected and expected
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(model.tokenize(prompt))
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    stream = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    text, finish, usage = stream_text(stream, chat=False)
    assert (text, finish) == (expected, "length")
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 12)


def test_token_id_prompt_is_the_text_prompt(client: Any, model: Any) -> None:
    ids = model.tokenize(PROMPTS[1])
    by_ids = client.completions.create(model="smollm2", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == model.complete(PROMPTS[1], max_tokens=8)


@pytest.mark.parametrize("streamed", [False, True])
def test_stop_strings_cut_the_text(client: Any, model: Any, streamed: bool) -> None:
    prompt = PROMPTS[1]
    full = model.complete(prompt, max_tokens=24)
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # a string from the middle of the greedy answer
    assert len(stop) == 3 and full.find(stop) > 0
    response = client.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0,
                                         stop=[stop, "never-generated-xyz"], stream=streamed)
    if streamed:
        text, finish, _ = stream_text(response, chat=False)
    else:
        text, finish = response.choices[0].text, response.choices[0].finish_reason
        assert response.usage.completion_tokens < 24
    assert (text, finish) == (full[: full.find(stop)], "stop")


def test_seeded_sampling_is_the_runtime_s(client: Any, model: Any) -> None:
    options = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_tokens": 12}
    first = client.completions.create(model="smollm2", prompt=PROMPTS[5], **options).choices[0].text
    again = client.completions.create(model="smollm2", prompt=PROMPTS[5], **options).choices[0].text
    assert first == again == model.complete(PROMPTS[5], max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)


def test_a_prompt_extending_a_slot_reuses_it(client: Any, model: Any) -> None:
    ids = model.tokenize(PROMPTS[6])
    client.completions.create(model="smollm2", prompt=ids, max_tokens=1, temperature=0)  # slot holds `ids`
    longer = ids + model.tokenize(" landed on the Moon", add_bos=False)
    response = client.completions.create(model="smollm2", prompt=longer, max_tokens=8, temperature=0)
    assert response.usage.prompt_tokens_details.cached_tokens == len(ids)
    assert response.choices[0].text == model.complete(longer, max_tokens=8)


def test_a_prompt_sharing_a_prefix_cuts_the_slot_back(client: Any, model: Any) -> None:
    ids = model.tokenize(PROMPTS[4])
    first = ids + model.tokenize(" 100 degrees Celsius", add_bos=False)
    second = ids + model.tokenize(" sea level, and", add_bos=False)
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    client.completions.create(model="smollm2", prompt=first, max_tokens=1, temperature=0)
    response = client.completions.create(model="smollm2", prompt=second, max_tokens=8, temperature=0)
    assert response.usage.prompt_tokens_details.cached_tokens == shared >= len(ids)
    assert response.choices[0].text == model.complete(second, max_tokens=8)


def test_the_api_key_is_required(server: ServerProcess) -> None:
    wrong = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model="smollm2", prompt="hi", max_tokens=1)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    status, body = server.request("GET", "/v1/models")
    assert status == 401 and body["error"]["type"] == "invalid_request_error"


def test_a_taken_port_is_a_one_line_error(artifact: Path, server: ServerProcess) -> None:
    result = subprocess.run([sys.executable, "-m", "ggufc.cli", "serve", str(artifact), "--port", str(server.port)],
                            capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=300)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"ggufc: error: cannot listen on 127.0.0.1:{server.port}: "
                                          "Address already in use"]


# --------------------------------------------------------------------- refused requests


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "smollm2", "prompt": "hi", "max_tokens": 2, **fields}).encode()


AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
BAD_REQUESTS = [
    ("invalid JSON", "/v1/completions", b'{"model": "smollm2", "prompt": ', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("NaN", "/v1/completions", b'{"model": "smollm2", "prompt": "x", "temperature": NaN}', 400, None),
    ("unknown model", "/v1/completions", _body(model="gpt-4"), 404, "model"),
    ("missing model", "/v1/completions", json.dumps({"prompt": "x"}).encode(), 400, "model"),
    ("prompt longer than the context", "/v1/completions", _body(prompt=" the" * (N_CTX + 8)), 400, "prompt"),
    ("negative max_tokens", "/v1/completions", _body(max_tokens=-1), 400, "max_tokens"),
    ("zero max_tokens", "/v1/completions", _body(max_tokens=0), 400, "max_tokens"),
    ("absurd max_tokens", "/v1/completions", _body(max_tokens=10**12), 400, "max_tokens"),
    ("max_tokens as text", "/v1/completions", _body(max_tokens="5"), 400, "max_tokens"),
    ("temperature out of range", "/v1/completions", _body(temperature=7), 400, "temperature"),
    ("top_p zero", "/v1/completions", _body(top_p=0), 400, "top_p"),
    ("n above the slots", "/v1/completions", _body(n=3), 400, "n"),
    ("too many stop strings", "/v1/completions", _body(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("empty stop string", "/v1/completions", _body(stop=[""]), 400, "stop"),
    ("token id outside the vocabulary", "/v1/completions", _body(prompt=[1, 10**9]), 400, "prompt"),
    ("two prompts", "/v1/completions", _body(prompt=["a", "b"]), 400, "prompt"),
    ("logprobs above 20", "/v1/completions", _body(logprobs=21), 400, "logprobs"),
    ("no messages", "/v1/chat/completions", _body(messages=[]), 400, "messages"),
    ("bad role", "/v1/chat/completions", _body(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0].role"),
    ("content of the wrong type", "/v1/chat/completions", _body(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content"),
    ("stream not a boolean", "/v1/chat/completions",
     _body(messages=[{"role": "user", "content": "x"}], stream="yes"), 400, "stream"),
]


@pytest.mark.parametrize(("what", "path", "body", "status", "param"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_a_status_and_an_error_body(server: ServerProcess, what: str, path: str, body: bytes,
                                                      status: int, param: str | None) -> None:
    got, reply = server.request("POST", path, body, AUTH)
    assert got == status, reply
    assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]
    assert reply["error"]["param"] == param


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/v1/nowhere", 404), ("GET", "/v1/completions", 405),
                                                         ("DELETE", "/v1/models", 405)])
def test_unknown_routes_get_an_error_body(server: ServerProcess, method: str, path: str, status: int) -> None:
    got, reply = server.request(method, path, headers=AUTH)
    assert got == status and reply["error"]["message"]


def test_an_oversized_body_is_refused(server: ServerProcess) -> None:
    got, reply = server.request("POST", "/v1/completions", _body(prompt="x" * (2 << 20)), AUTH)
    assert got == 413 and reply["error"]["code"] == "request_too_large"


def _fuzz_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["int", "bigint", "float", "str", "bool", "null", "list", "dict", "neg"]
    kind = rng.choice(kinds if depth < 3 else kinds[:6])
    if kind == "int":
        return rng.randint(0, 4)
    if kind == "bigint":
        return rng.choice([2**31, 2**63, 10**30, -(2**64)])
    if kind == "float":
        return rng.choice([0.0, 0.5, 1.5, 3.0, 1e308, -1e-9])
    if kind == "str":
        return rng.choice(["", "x", "smollm2", "user", "\u0000\ud7ff", "\U0001f600" * rng.randint(1, 50)])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "neg":
        return -rng.randint(1, 10**6)
    if kind == "list":
        return [_fuzz_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["role", "content", "type", "text", "x"]): _fuzz_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "stream_options", "n", "logprobs", "echo", "logit_bias", "user", "tools"]


def _fuzz_body(rng: random.Random) -> bytes:
    body: dict[str, Any] = {"model": "smollm2", "max_tokens": rng.randint(1, 3)}
    body["messages" if rng.random() < 0.5 else "prompt"] = [{"role": "user", "content": "hi"}] if rng.random() < 0.5 \
        else "hi"
    for field in rng.sample(FIELDS, rng.randint(1, 4)):
        body[field] = _fuzz_value(rng)
    for limit in ("max_tokens", "max_completion_tokens"):  # valid requests stay short
        value = body.get(limit)
        if isinstance(value, int) and not isinstance(value, bool):
            body[limit] = min(abs(value), 3)
    if body.get("max_tokens") is None:
        body["max_tokens"] = 2
    text = json.dumps(body)
    if rng.random() < 0.1:  # truncated or garbled JSON
        cut = rng.randint(0, len(text))
        text = text[:cut] + rng.choice(["", "}", "\x00", "\\u12", ",,"])
    return text.encode("utf-8")


def test_fuzzed_requests_never_crash_the_server(server: ServerProcess, client: Any, model: Any) -> None:
    rng = random.Random(2026)
    statuses: dict[int, int] = {}
    for _ in range(250):
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        status, reply = server.request("POST", path, _fuzz_body(rng), AUTH)
        statuses[status] = statuses.get(status, 0) + 1
        assert status in (200, 400, 404), (status, reply)
        if status != 200:
            assert reply["error"]["message"], reply
        elif isinstance(reply, dict):  # a non-streamed answer (streams come back as text)
            assert reply["choices"][0]["finish_reason"] in ("stop", "length")
    assert statuses.get(200, 0) > 5 and statuses.get(400, 0) > 50, statuses
    assert server.process.poll() is None and server.health()["slots_busy"] == 0
    again = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=6, temperature=0)
    assert again.choices[0].text == model.complete(PROMPTS[0], max_tokens=6)


def test_a_client_that_disconnects_frees_its_slot(server: ServerProcess) -> None:
    before = server.health()["tokens_generated"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", _body(prompt=PROMPTS[2], max_tokens=200, stream=True, temperature=0),
                 AUTH)
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # the first token arrived: the slot is generating
    conn.close()
    assert wait_until(lambda: server.health()["slots_busy"] == 0, timeout=30)
    made = server.health()["tokens_generated"] - before
    time.sleep(0.3)
    assert server.health()["tokens_generated"] - before == made  # nothing more for the gone client
    assert 1 <= made < 150, made  # stopped well before its 200 tokens


# --------------------------------------------------------------------- queue, sleep, shutdown


def test_busy_past_the_queue_then_sleep_and_sigterm(artifact: Path, model: Any) -> None:
    """One slot and no queue: a second request while the first streams is refused with 503; after
    three idle seconds the slot's memory is freed and the next request reloads it with the same output; a
    SIGTERM while a stream is in flight lets it finish, then the server exits 0."""
    # 3 s of idleness before sleeping; the wake-up is read from the server's counters, which a
    # loaded machine cannot race (the server may fall asleep again before the test looks)
    proc = ServerProcess(artifact, "--parallel", "1", "--queue", "0", "--sleep-idle", "3", "--alias", "smollm2")
    try:
        client = openai.OpenAI(base_url=proc.base_url, api_key="none", max_retries=0, timeout=120)
        stream = client.completions.create(model="smollm2", prompt=PROMPTS[3], max_tokens=60, temperature=0,
                                           stream=True)
        first = next(iter(stream))
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="smollm2", prompt=PROMPTS[4], max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "server_busy"
        text, _, _ = stream_text(stream, chat=False)
        assert first.choices[0].text + text == model.complete(PROMPTS[3], max_tokens=60)

        expected = model.complete(PROMPTS[4], max_tokens=8)  # before the wake-up: nothing slow after it
        assert wait_until(lambda: proc.health()["asleep"], timeout=20)
        asleep = proc.health()
        assert (asleep["sleeps"], asleep["wake_ups"]) == (1, 0), asleep
        rss_asleep = proc.rss_bytes()
        again = client.completions.create(model="smollm2", prompt=PROMPTS[4], max_tokens=8, temperature=0)
        rss_awake = proc.rss_bytes()  # read at once: falling asleep again takes 3 idle seconds
        assert again.choices[0].text == expected and rss_awake > rss_asleep
        assert proc.health()["wake_ups"] == 1  # the request reloaded the slot (whether or not it sleeps again)

        # 16 tokens: the stream must end within the server's 30 s of graceful shutdown, also on a
        # loaded machine, where each token can take a scheduler quantum per kernel
        expected = model.complete(PROMPTS[7], max_tokens=16)
        stream = client.completions.create(model="smollm2", prompt=PROMPTS[7], max_tokens=16, temperature=0,
                                           stream=True)
        first = next(iter(stream))
        proc.process.send_signal(15)
        text, finish, _ = stream_text(stream, chat=False)
        assert first.choices[0].text + text == expected
        assert proc.process.wait(60) == 0  # the one SIGTERM above was enough
    finally:
        proc.kill()


# --------------------------------------------------------------------- load


def _load_client(base_url: str, i: int, outcomes: list[Any]) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=180)
    prompt = PROMPTS[i % len(PROMPTS)]
    try:
        stream = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0,
                                           stream=True)
        if i % 5 == 4:  # goes away after its first token
            next(iter(stream))
            stream.close()
            outcomes[i] = ("disconnected", prompt)
            return
        text, finish, _ = stream_text(stream, chat=False)
        outcomes[i] = ("completed", prompt, text, finish)
    except openai.APIStatusError as exc:
        outcomes[i] = ("refused", exc.status_code, exc.body)
    except Exception as exc:  # noqa: BLE001 - recorded, then reported by the assertion
        outcomes[i] = ("failed", repr(exc))


def _load_round(server: ServerProcess, n_clients: int) -> list[Any]:
    outcomes: list[Any] = [None] * n_clients
    threads = [threading.Thread(target=_load_client, args=(server.base_url, i, outcomes)) for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a client hung"
    return outcomes


@pytest.mark.slow
def test_32_streaming_clients_against_4_slots(artifact: Path, model: Any) -> None:
    serial = {p: model.complete(p, max_tokens=12) for p in PROMPTS}
    proc = ServerProcess(artifact, "--parallel", "4", "--queue", "12", "--api-key", KEY, "--alias", "smollm2")
    try:
        rss = []
        for _ in range(2):  # the second round must not grow the server's memory
            outcomes = _load_round(proc, 32)
            kinds = [o[0] for o in outcomes]
            assert set(kinds) <= {"completed", "disconnected", "refused"}, outcomes
            for o in outcomes:
                if o[0] == "completed":
                    assert o[2] == serial[o[1]] and o[3] == "length", o
                elif o[0] == "refused":
                    assert o[1] == 503 and o[2]["code"] == "server_busy", o
            assert kinds.count("completed") >= 8 and kinds.count("refused") >= 1, kinds
            assert wait_until(lambda: proc.health()["slots_busy"] == 0 and proc.health()["queued"] == 0, 30)
            rss.append(proc.rss_bytes())
        health = proc.health()  # the generating slots were fed together, several tokens a call
        assert health["batched_decode"] and health["batched_tokens"] >= 2 * health["batched_steps"] > 0, health
        assert rss[1] - rss[0] < 48 << 20, rss
        assert proc.terminate() == 0
    finally:
        proc.kill()
