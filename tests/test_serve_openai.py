"""`ggufc serve` on SmolLM2-135M-Instruct Q4_1 with the real `openai` client: the parts of OpenAI's
API beyond plain completions: log-probabilities (equal to log_softmax of the teacher-forced
logits), several choices with a seed, logit_bias, presence / frequency penalties, and their
refusals; structured outputs (20 JSON schemas, identical to `ggufc run --json-schema`)."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.default_model import compile_default_model, needs_default_model
from tests.support.serve_support import ROOT, ServerProcess, cli_env

openai = pytest.importorskip("openai")


N_CTX = 512
SLOTS = 3
NAME = "smollm2"
OTHER_NAME = "gpt-4o-mini"  # what a client configured for another server sends


pytestmark = needs_default_model


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_default_model(tmp_path_factory.mktemp("serve-openai"), N_CTX)


@pytest.fixture(scope="module")
def model(artifact: Path) -> Iterator[Any]:
    import ggufc

    with ggufc.load(artifact) as m:
        yield m


@pytest.fixture(scope="module")
def server(artifact: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(artifact, "--parallel", str(SLOTS), "--served-model-name", NAME, OTHER_NAME)
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


def test_three_seeded_choices_are_reproducible(client: Any, model: Any, server: ServerProcess) -> None:
    options = dict(model=NAME, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=99, n=3)
    shared = server.health()["prefills_shared"]
    first = client.completions.create(**options)
    again = client.completions.create(**options)
    assert server.health()["prefills_shared"] - shared == 2 * 2  # choices 1 and 2 copied choice 0's context
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
    body = json.dumps({"model": NAME, "max_tokens": 2, **fields}).encode()
    status, reply = server.request("POST", path, body, {"Content-Type": "application/json"})
    assert status == 400, reply
    assert reply["error"]["param"] == param and "\n" not in reply["error"]["message"]


# --------------------------------------------------------------------- structured outputs

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"]}),
    ("an address", {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "city", "zip"]}),
    ("a shopping list", {"type": "object", "properties": {"items": {
        "type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}}, "required": ["items"]}),
    ("a colour", {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                  "required": ["colour"]}),
    ("a probability", {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
                       "required": ["p"]}),
    ("a dice roll", {"type": "object", "properties": {
        "roll": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 7}}, "required": ["roll"]}),
    ("a light switch", {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}),
    ("a book, subtitle optional", {"type": "object", "properties": {
        "title": {"type": "string"}, "subtitle": {"type": "string"}}, "required": ["title"]}),
    ("tagged ids", {"type": "object", "properties": {"entries": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 20}},
        "required": ["id", "tag"]}}}, "required": ["entries"]}),
    ("a flight code", {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
                       "required": ["code"]}),
    ("a 2x2 matrix", {"type": "object", "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                      "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer"}}}},
                      "required": ["rows"]}),
    ("a versioned record", {"type": "object", "properties": {"version": {"const": 2}, "body": {"type": "string"}},
                            "required": ["version", "body"]}),
    ("an id of either type", {"type": "object", "properties": {"id": {"anyOf": [{"type": "string", "maxLength": 20},
                                                                                 {"type": "integer"}]}},
                              "required": ["id"]}),
    ("a nickname or null", {"type": "object", "properties": {"nickname": {"type": ["string", "null"]}},
                            "required": ["nickname"]}),
    ("three numbers", {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3}),
    ("a closed point", {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"},
                        "z": {"type": "integer"}}, "required": ["x", "y", "z"], "additionalProperties": False}),
    ("a date", {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
                "required": ["date"]}),
    ("a short word", {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 8}},
                      "required": ["word"]}),
    ("a pizza order", {"type": "object", "properties": {
        "size": {"enum": ["small", "medium", "large"]},
        "toppings": {"type": "array", "maxItems": 3, "items": {"enum": ["cheese", "ham", "olives"]}}},
        "required": ["size", "toppings"]}),
    ("a team with references", {"type": "object", "$defs": {"member": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "role": {"enum": ["lead", "dev"]}}, "required": ["name", "role"]}},
        "properties": {"lead": {"$ref": "#/$defs/member"}, "others": {"type": "array", "maxItems": 2,
                                                                      "items": {"$ref": "#/$defs/member"}}},
        "required": ["lead", "others"]}),
]


def _json_messages(what: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You answer with JSON only."},
            {"role": "user", "content": f"Give an example of {what} as JSON."}]


def _schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def test_twenty_schemas_each_answer_validates(client: Any) -> None:
    import jsonschema

    valid = []
    for i, (what, schema) in enumerate(SCHEMAS):
        response = client.chat.completions.create(model=NAME, messages=_json_messages(what), max_tokens=160,
                                                  temperature=0, response_format=_schema_format(f"s{i}", schema))
        answer = json.loads(response.choices[0].message.content)
        jsonschema.validate(answer, schema)
        assert response.choices[0].finish_reason == "stop", (what, answer)
        valid.append(what)
    assert len(valid) == len(SCHEMAS) == 20


def test_a_schema_answer_equals_ggufc_run_json_schema(client: Any, artifact: Path, model: Any,
                                                      tmp_path: Path) -> None:
    import jsonschema

    what, schema = SCHEMAS[8]
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    prompt = f"Give an example of {what} as JSON."
    result = subprocess.run([sys.executable, "-m", "ggufc.cli", "run", str(artifact), "--chat", "--prompt", prompt,
                             "-n", "100", "--json-schema", str(path)], capture_output=True, text=True, env=cli_env(),
                            cwd=ROOT, timeout=600, check=True, stdin=subprocess.DEVNULL)
    response = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=100, temperature=0,
                                              response_format=_schema_format("entries", schema))
    content = response.choices[0].message.content
    assert result.stdout == content + "\n"
    jsonschema.validate(json.loads(content), schema)
    assert model.complete(prompt, chat=True, max_tokens=100, json_schema=schema) == content  # the Python API

    path.write_text(json.dumps({"type": "object", "required": "name"}))
    bad = subprocess.run([sys.executable, "-m", "ggufc.cli", "run", str(artifact), "--prompt", "x",
                          "--json-schema", str(path)], capture_output=True, text=True, env=cli_env(), cwd=ROOT,
                         timeout=600)
    assert bad.returncode == 1 and len(bad.stderr.splitlines()) == 1
    assert "is not a valid JSON schema" in bad.stderr


def test_json_object_streamed_and_in_batched_choices(client: Any) -> None:
    import jsonschema

    messages = _json_messages("a person with a name and an age")
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=120, temperature=0,
                                            response_format={"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)
    what, schema = SCHEMAS[18]
    response = client.chat.completions.create(model=NAME, messages=_json_messages(what), max_tokens=120,
                                              temperature=1.0, seed=3, n=SLOTS,  # sampled rows decoded together
                                              response_format=_schema_format("pizza", schema))
    assert len(response.choices) == SLOTS
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("schema", [{"type": "foo"}, {"type": "object", "properties": 5}, {"minimum": "x"}])
def test_an_invalid_schema_is_a_one_line_400(server: ServerProcess, schema: dict[str, Any]) -> None:
    body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x"}],
                       "response_format": _schema_format("bad", schema)}).encode()
    status, reply = server.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert status == 400, reply
    assert reply["error"]["param"] == "response_format.json_schema.schema"
    assert "not a valid JSON schema" in reply["error"]["message"] and "\n" not in reply["error"]["message"]


# --------------------------------------------------------------------- names, metrics (last: counts the above)


def test_served_model_names(client: Any, server: ServerProcess) -> None:
    assert [m.id for m in client.models.list().data] == [NAME, OTHER_NAME]
    response = client.completions.create(model=OTHER_NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert response.model == NAME and response.choices[0].text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="smollm3", prompt="Hello", max_tokens=2)


def _metrics(server: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = server.request("GET", "/metrics")
    assert status == 200 and isinstance(text, str)
    return collections.defaultdict(float, {(s.name, tuple(sorted(s.labels.items()))): s.value
                                           for family in text_string_to_metric_families(text) for s in family.samples})


def test_metrics_in_prometheus_format(server: ServerProcess, client: Any, model: Any) -> None:
    before = _metrics(server)
    client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=1, n=3)
    client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="smollm3", prompt="Hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[], max_tokens=2)
    after = _metrics(server)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before[key]

    assert grew("ggufc_requests_total", endpoint="/v1/completions", status="200") == 2
    assert grew("ggufc_requests_total", endpoint="/v1/completions", status="404") == 1
    assert grew("ggufc_requests_total", endpoint="/v1/chat/completions", status="400") == 1
    assert grew("ggufc_generation_tokens_total") == 3 * 10 + 4
    assert grew("ggufc_generations_finished_total", reason="length") == 4
    prompts = 3 * len(model.tokenize("Once upon a time")) + len(model.tokenize("Hello"))
    assert grew("ggufc_prompt_tokens_total") == prompts
    assert after[("ggufc_queue_length", ())] == 0 and after[("ggufc_slots", ())] == SLOTS
    several = grew("ggufc_decode_batch_size_count") - grew("ggufc_decode_batch_size_bucket", le="1.0")
    assert several >= 5  # the three choices decoded together, a row each


# --------------------------------------------------------------------- tool calls

TEMPLATE = Path(__file__).parent / "data" / "hermes_tools_template.jinja"  # Qwen 3's format, SmolLM2's turns
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                         "parameters": {"type": "object", "properties": {
                                             "zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def tool_client(artifact: Path) -> Iterator[Any]:
    proc = ServerProcess(artifact, "--chat-template-file", str(TEMPLATE), "--alias", NAME)
    try:
        yield openai.OpenAI(base_url=proc.base_url, api_key="none", max_retries=0, timeout=300)
    finally:
        proc.kill()


def test_a_required_tool_call_round_trip(tool_client: Any) -> None:
    import jsonschema

    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = tool_client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER, TIME],
                                                tool_choice="required", max_tokens=80, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)

    result = "18 degrees and sunny"
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = tool_client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER, TIME],
                                                tool_choice="none", max_tokens=30, temperature=0)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    # the call and its result were rendered into the second prompt
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + len(call.function.arguments) // 8 + 5


def test_a_named_tool_is_the_one_called_also_streamed(tool_client: Any) -> None:
    options = dict(model=NAME, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER, TIME],
                   tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=60, temperature=0)
    whole = tool_client.chat.completions.create(**options)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_time" and "zone" in json.loads(call.function.arguments)
    deltas, finish = [], None
    for chunk in tool_client.chat.completions.create(**options, stream=True):
        for c in chunk.choices:
            deltas.extend(c.delta.tool_calls or [])
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(deltas) == 1
    assert (deltas[0].function.name, deltas[0].function.arguments) == (call.function.name, call.function.arguments)


def test_a_tool_whose_parameters_are_not_a_schema_is_a_400(tool_client: Any) -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}
    with pytest.raises(openai.BadRequestError) as info:
        tool_client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], tools=[broken],
                                            max_tokens=2)
    assert info.value.body["param"] == "tools[0].function.parameters"
    assert "not a valid JSON schema" in info.value.body["message"]


# --------------------------------------------------------------------- embeddings

TEXTS = ["The capital of France is", "Embeddings map text to vectors.", "a"]


def test_embeddings_equal_the_python_api_as_float_and_base64(client: Any, model: Any) -> None:
    """The openai client asks for base64 by default and decodes it; float gives the same numbers."""
    packed = client.embeddings.create(model=NAME, input=TEXTS[0])
    plain = client.embeddings.create(model=OTHER_NAME, input=TEXTS[0], encoding_format="float")
    want = model.embed(TEXTS[0], pooling="last")
    assert packed.model == plain.model == NAME and len(packed.data) == 1 and packed.data[0].index == 0
    np.testing.assert_array_equal(np.asarray(packed.data[0].embedding, np.float32),
                                  np.asarray(plain.data[0].embedding, np.float32))
    np.testing.assert_allclose(np.asarray(plain.data[0].embedding), want, rtol=0, atol=1e-6)
    assert abs(float(np.linalg.norm(want)) - 1.0) < 1e-5 and want.shape == (576,)
    n = len(model.tokenize(TEXTS[0]))
    assert (plain.usage.prompt_tokens, plain.usage.total_tokens) == (n, n)


def test_a_batch_of_inputs_equals_one_by_one(client: Any, model: Any) -> None:
    batch = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    singles = [client.embeddings.create(model=NAME, input=t, encoding_format="float").data[0].embedding
               for t in TEXTS]
    np.testing.assert_array_equal(np.asarray([d.embedding for d in batch.data]), np.asarray(singles))
    ids = [model.tokenize(t) for t in TEXTS]
    by_ids = client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    np.testing.assert_array_equal(np.asarray([d.embedding for d in by_ids.data]), np.asarray(singles))
    one = client.embeddings.create(model=NAME, input=ids[1], encoding_format="float")
    np.testing.assert_array_equal(np.asarray(one.data[0].embedding), np.asarray(singles[1]))
    assert batch.usage.prompt_tokens == sum(len(i) for i in ids)
    assert not np.allclose(singles[0], singles[1])  # different texts, different vectors


def test_embeddings_leave_the_slots_context_alone(client: Any, server: ServerProcess) -> None:
    prompt = "Write one sentence about the sea and the sky over it."
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0)
    client.embeddings.create(model=NAME, input=[prompt * 3, "other"])
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # a slot still held the prompt


def test_embedding_metrics(client: Any, server: ServerProcess, model: Any) -> None:
    before = _metrics(server)
    client.embeddings.create(model=NAME, input=TEXTS[:2])
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=NAME, input="")
    after = _metrics(server)
    assert after[("ggufc_requests_total", (("endpoint", "/v1/embeddings"), ("status", "200")))] - \
        before[("ggufc_requests_total", (("endpoint", "/v1/embeddings"), ("status", "200")))] == 1
    assert after[("ggufc_requests_total", (("endpoint", "/v1/embeddings"), ("status", "400")))] - \
        before[("ggufc_requests_total", (("endpoint", "/v1/embeddings"), ("status", "400")))] == 1
    assert after[("ggufc_embedding_inputs_total", ())] - before[("ggufc_embedding_inputs_total", ())] == 2
    tokens = sum(len(model.tokenize(t)) for t in TEXTS[:2])
    assert after[("ggufc_embedding_tokens_total", ())] - before[("ggufc_embedding_tokens_total", ())] == tokens


BAD_EMBEDDINGS = [
    ("empty string", {"input": ""}, 400),
    ("empty list", {"input": []}, 400),
    ("empty id list", {"input": [[]]}, 400),
    ("too long for the context", {"input": [1] * (N_CTX + 1)}, 400),
    ("a number", {"input": 5}, 400),
    ("mixed items", {"input": ["a", 1]}, 400),
    ("id outside the vocabulary", {"input": [49152]}, 400),
    ("boolean id", {"input": [True]}, 400),
    ("other dimensions", {"input": "a", "dimensions": 64}, 400),
    ("unknown encoding", {"input": "a", "encoding_format": "int8"}, 400),
    ("unknown model", {"input": "a", "model": "text-embedding-3-small"}, 404),
]


@pytest.mark.parametrize(("what", "fields", "status"), BAD_EMBEDDINGS, ids=[b[0] for b in BAD_EMBEDDINGS])
def test_bad_embedding_requests_get_a_one_line_4xx(server: ServerProcess, what: str, fields: dict[str, Any],
                                                   status: int) -> None:
    body = json.dumps({"model": NAME, **fields}).encode()
    code, answer = server.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
    assert code == status, answer
    error = answer["error"]
    assert error["param"] == ("model" if status == 404 else what.startswith("other") and "dimensions"
                              or what.startswith("unknown enc") and "encoding_format" or "input")
    assert error["message"] and "\n" not in error["message"] and error["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def mean_server(artifact: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(artifact, "--pooling", "mean", "--api-key", "sesame", "--served-model-name", NAME)
    try:
        yield proc
    finally:
        proc.kill()


def test_mean_pooling_and_the_api_key(mean_server: ServerProcess, model: Any) -> None:
    keyed = openai.OpenAI(base_url=mean_server.base_url, api_key="sesame", max_retries=0, timeout=300)
    got = keyed.embeddings.create(model=NAME, input=TEXTS[1]).data[0].embedding
    np.testing.assert_allclose(np.asarray(got), model.embed(TEXTS[1], pooling="mean"), rtol=0, atol=1e-6)
    assert not np.allclose(got, model.embed(TEXTS[1], pooling="last"), atol=1e-3)
    wrong = openai.OpenAI(base_url=mean_server.base_url, api_key="guess", max_retries=0, timeout=300)
    with pytest.raises(openai.AuthenticationError):
        wrong.embeddings.create(model=NAME, input=TEXTS[1])
