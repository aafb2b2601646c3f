"""`ggufc serve` fuzzed from its own OpenAPI schema with schemathesis: a real server process on a
loopback port (SmolLM2-135M-Instruct Q4_1, context 64), every operation the schema lists, requests
that fit the schema (positive) and requests that break it (negative), each bounded in examples
and time. Nothing may answer 5xx (nor an error event inside a stream) or hang; every 4xx carries
OpenAI's error body; the server is healthy afterwards."""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from tests.support.default_model import compile_default_model, needs_default_model
from tests.support.serve_support import ServerProcess

KEY = "fuzz-key"
N_CTX = 64
# examples per operation and mode; GGUFC_FUZZ_EXAMPLES=N runs a longer campaign
EXAMPLES = int(os.environ.get("GGUFC_FUZZ_EXAMPLES", "30"))
REQUEST_TIMEOUT_S = 60.0  # a generation is at most N_CTX tokens: far less than this, unless it hangs
MAX_STREAM_EVENTS = 4 * N_CTX  # more than a stream sends, so every stream is read to its end
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance]


pytestmark = [pytest.mark.slow, needs_default_model]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    artifact = compile_default_model(tmp_path_factory.mktemp("fuzz"), N_CTX)
    proc = ServerProcess(artifact, "--parallel", "2", "--api-key", KEY, "--alias", "smollm2")
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def schema(server: ServerProcess) -> Any:
    config = schemathesis.Config.from_dict({"max-stream-events": MAX_STREAM_EVENTS})
    return schemathesis.openapi.from_url(f"http://127.0.0.1:{server.port}/openapi.json", config=config, timeout=30)


@pytest.fixture(scope="module")
def tally() -> collections.Counter[tuple[str, str, int]]:
    """(operation, generation mode, status) -> requests sent."""
    return collections.Counter()


def _operations(schema: Any) -> list[Any]:
    return [result.ok() for result in schema.get_all_operations()]


def test_schema_describes_every_route_and_request_body(schema: Any) -> None:
    """The schema is what the fuzzer generates from: every route, with typed request bodies."""
    labels = {op.label for op in _operations(schema)}
    assert labels == {"GET /health", "GET /metrics", "GET /v1/models", "POST /v1/completions",
                      "POST /v1/chat/completions", "POST /v1/embeddings"}
    for path, field in [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")]:
        body = schema.raw_schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert {"model", field} <= set(body["required"])
        assert body["properties"]["model"]["enum"] == ["smollm2"]
        assert body["properties"]["max_tokens"]["anyOf"][0]["maximum"] == N_CTX
        assert body["properties"]["n"]["anyOf"][0]["maximum"] == 2  # the slots
        assert {"logit_bias", "response_format", "presence_penalty", "logprobs"} <= body["properties"].keys()
    chat = schema.raw_schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert {"tools", "tool_choice", "top_logprobs"} <= chat["schema"]["properties"].keys()


def _check_answer(case: Any, response: Any) -> None:
    """OpenAI's shapes: an error body on every 4xx, a whole answer or a stream that ends in [DONE]."""
    where = f"{case.operation.label} {case.body!r:.300}"
    if 400 <= response.status_code < 500:
        error = response.json().get("error")
        assert isinstance(error, dict), f"{where}: {response.status_code} without an error object: {response.text:.300}"
        assert isinstance(error.get("message"), str) and error["message"], where
        assert isinstance(error.get("type"), str) and error["type"], where
        assert {"param", "code"} <= error.keys(), where
        return
    if response.status_code != 200 or case.method != "POST":
        return
    if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        assert not response.stream_cut_short, f"{where}: the stream did not end within {REQUEST_TIMEOUT_S} s"
        events = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"{where}: the stream does not end in [DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), f"{where}: error inside the stream: {event:.300}"
    else:
        assert response.json()["data" if case.path == "/v1/embeddings" else "choices"], where


def _fuzz(operation: Any, mode: GenerationMode, server: ServerProcess,
          tally: collections.Counter[tuple[str, str, int]]) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        response = case.call(base_url=f"http://127.0.0.1:{server.port}", headers={"Authorization": f"Bearer {KEY}"},
                             timeout=REQUEST_TIMEOUT_S)
        tally[operation.label, mode.value, response.status_code] += 1
        if mode is GenerationMode.POSITIVE and response.status_code >= 400:  # what the schema does not say
            error = response.json().get("error", {})
            tally[operation.label, f"positive refused: {error.get('param')}: {error.get('message', '')[:60]}", 0] += 1
        try:
            case.validate_response(response, checks=CHECKS)
            _check_answer(case, response)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nserver log: {''.join(server.lines[-20:])}") from None

    run()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_every_operation_fuzzed(mode: GenerationMode, schema: Any, server: ServerProcess,
                                tally: collections.Counter[tuple[str, str, int]]) -> None:
    for operation in _operations(schema):
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # no parameters or body to break
        _fuzz(operation, mode, server, tally)
        assert sum(n for (label, m, _), n in tally.items() if label == operation.label and m == mode.value)


def test_server_healthy_after_fuzzing(server: ServerProcess, tally: collections.Counter[tuple[str, str, int]]) -> None:
    assert tally, "the fuzzing tests did not run first"
    health = server.health()
    assert health["status"] == "ok" and server.process.poll() is None
    status, body = server.request("POST", "/v1/completions", json.dumps(
        {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).encode(),
        {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert status == 200 and body["choices"][0]["text"], body
    print("\nschemathesis requests (operation, mode, status: count):")
    for key, count in sorted(tally.items()):
        print(f"  {key[0]} {key[1]} {key[2]}: {count}")
