"""OpenAI request bodies for `ggufc serve`, checked field by field.

A request is untrusted input: every field the server reads is checked for its type and range,
and whatever is wrong is answered with a `RequestError` (an HTTP status and a one-line message,
sent as OpenAI's error body) naming the field. Fields ggufc does not implement are refused when
they ask for something (`best_of`, `echo`, tools, ...) and ignored when they carry their default,
so clients that send defaults work.
"""

from __future__ import annotations

import dataclasses
import decimal
import json
import math
import re
from collections.abc import Collection, Mapping
from typing import Any

from .structured_output import GrammarError, check_json_schema
from .token_choice import LOGIT_BIAS_RANGE, MAX_TOP_LOGPROBS, PENALTY_RANGE, Decoding
from .tool_calls import Tool

MAX_BODY_BYTES = 1 << 20
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_TEMPERATURE = 2.0
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


class RequestError(ValueError):
    """A request the server refuses: HTTP status, one-line message, the field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ResponseFormat:
    """`response_format`: a JSON object, or JSON valid against `schema`."""

    kind: str  # "json_object" | "json_schema"
    schema: Any = None


@dataclasses.dataclass(frozen=True)
class ApiRequest:
    """A checked completion or chat request."""

    chat: bool
    stream: bool
    include_usage: bool
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    n: int = 1  # choices
    response_format: ResponseFormat | None = None  # a grammar the text must follow
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"  # "none" | "auto" | "required" | a function's name (forced)
    decoding: Decoding = Decoding()  # logit bias, penalties, log-probabilities
    messages: tuple[dict[str, Any], ...] = ()  # chat
    prompt_text: str | None = None  # completions: text ...
    prompt_ids: tuple[int, ...] | None = None  # ... or token ids


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _json_number(literal: str) -> int | float:
    """A JSON number written with a fraction or an exponent. An integral one is an int, as JSON
    Schema counts 2.0 among the integers (token ids, limits, seeds), and exactly: 18446744073709551615.0
    is the largest seed, where a float would round it to 2**64. Beyond 20 digits, a float."""
    value = decimal.Decimal(literal)
    if value.is_finite() and value == value.to_integral_value() and value.adjusted() <= 20:
        return int(value)
    return float(literal)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (strict JSON: no NaN or Infinity), or a 400."""
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_json_number)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise RequestError(400, f"the request body is not valid JSON ({reason})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, not {_json_type(body)}")
    return body


def parse_request(body: Mapping[str, Any], *, chat: bool, model_id: str, n_ctx: int, n_vocab: int,
                  max_n: int = 1, other_names: Collection[str] = ()) -> ApiRequest:
    """The checked request; `max_n`: the most choices one request may ask for (the server's slots);
    `other_names`: names the model also answers to (`--served-model-name`)."""
    _check_model(body, model_id, other_names)
    _refuse_unsupported(body, chat)
    stream = _optional_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(400, "stream_options must be an object", param="stream_options")
    include_usage = _optional_bool(options or {}, "include_usage", False, param="stream_options.include_usage")
    limit_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default_limit = n_ctx if chat else COMPLETION_DEFAULT_MAX_TOKENS
    common: dict[str, Any] = dict(
        chat=chat, stream=stream, include_usage=include_usage,
        max_tokens=_int(body, limit_name, default_limit, 1, n_ctx),
        temperature=_number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
        top_p=_top_p(body), top_k=_int(body, "top_k", 0, 0, n_vocab),
        seed=_optional_int(body, "seed", *SEED_RANGE), stop=_stop(body),
        n=_choices(body, max_n), decoding=_decoding(body, chat, n_vocab), response_format=_response_format(body),
    )
    if chat:
        tools = _tools(body)
        tool_choice = _tool_choice(body, tools)
        if tool_choice not in ("none", "auto") and common["response_format"] is not None:
            raise RequestError(400, "a required tool call and response_format cannot be combined",
                               param="tool_choice")
        return ApiRequest(**common, messages=_messages(body), tools=tools, tool_choice=tool_choice)
    text, ids = _prompt(body, n_vocab)
    return ApiRequest(**common, prompt_text=text, prompt_ids=ids)


# --------------------------------------------------------------------- fields


def _check_model(body: Mapping[str, Any], model_id: str, other_names: Collection[str]) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError(400, f"model must be a string naming the model ('{model_id}')", param="model")
    if model != model_id and model not in other_names:
        raise RequestError(404, f"the model '{model[:100]}' does not exist; this server serves '{model_id}'",
                           param="model", code="model_not_found")


# field -> (the values that ask for nothing, what the field would ask for)
_DEFAULTS: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "best_of > 1"),
    "echo": ((None, False), "echo"),
    "suffix": ((None, ""), "suffix"),
    "functions": ((None,), "functions (send tools)"),
}


def _refuse_unsupported(body: Mapping[str, Any], chat: bool) -> None:
    for name, (defaults, what) in _DEFAULTS.items():
        value = body.get(name)
        if _is_default(value, defaults):
            continue
        raise RequestError(400, f"{what} is not supported by this server", param=name, code="unsupported")


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    """Whether `value` asks for nothing: null, an empty list or object, or a default of the same
    JSON type (so `false` is not taken for 0)."""
    if value is None or value == {} or value == []:
        return True
    return any(type(value) is type(v) and value == v for v in defaults)


def _optional_bool(body: Mapping[str, Any], name: str, default: bool, *, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(400, f"{param or name} must be true or false, got {_json_type(value)}", param=param or name)
    return value


def _int(body: Mapping[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = _optional_int(body, name, lo, hi)
    return default if value is None else value


def _optional_int(body: Mapping[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(400, f"{name} must be an integer, got {_json_type(value)}", param=name)
    if not lo <= value <= hi:
        raise RequestError(400, f"{name} must be between {lo} and {hi}, got {_short(value)}", param=name)
    return value


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise RequestError(400, f"{name} must be a number, got {_json_type(value)}", param=name)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise RequestError(400, f"{name} must be between {lo:g} and {hi:g}, got {_short(value)}", param=name)
    return float(value)


def _response_format(body: Mapping[str, Any]) -> ResponseFormat | None:
    """{"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {name, schema, strict}}."""
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise RequestError(400, "response_format.type must be 'text', 'json_object' or 'json_schema'",
                           param="response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name") or "", str):
        raise RequestError(400, "response_format.json_schema must be an object {name, schema, strict}",
                           param="response_format.json_schema")
    schema = {} if spec.get("schema") is None else spec["schema"]  # no schema: any JSON value
    if not isinstance(schema, (dict, bool)):
        raise RequestError(400, f"response_format.json_schema.schema must be an object, got {_json_type(schema)}",
                           param="response_format.json_schema.schema")
    # strict or not, the grammar holds every answer to the schema
    _optional_bool(spec, "strict", False, param="response_format.json_schema.strict")
    return ResponseFormat("json_schema", schema)


def _choices(body: Mapping[str, Any], max_n: int) -> int:
    n = _int(body, "n", 1, 1, 1 << 31)
    if n > max_n:
        raise RequestError(400, f"n must be at most {max_n} (the server's slots; start it with --parallel N "
                                f"for more), got {n}", param="n")
    return n


def _decoding(body: Mapping[str, Any], chat: bool, n_vocab: int) -> Decoding:
    return Decoding(logit_bias=_logit_bias(body, n_vocab),
                    presence_penalty=_number(body, "presence_penalty", 0.0, *PENALTY_RANGE),
                    frequency_penalty=_number(body, "frequency_penalty", 0.0, *PENALTY_RANGE),
                    top_logprobs=_chat_logprobs(body) if chat else _completion_logprobs(body))


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat: `logprobs: true` asks for the chosen tokens', `top_logprobs: k` for k more each."""
    wanted = _optional_bool(body, "logprobs", False)
    top = _optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and top > 0 and not wanted:
        raise RequestError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """Completions: `logprobs: k` (0 included) asks for the chosen tokens' and the k most likely."""
    if isinstance(body.get("logprobs"), bool):
        raise RequestError(400, f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}", param="logprobs")
    return _optional_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)


def _logit_bias(body: Mapping[str, Any], n_vocab: int) -> dict[int, float]:
    """{"token id": bias} with biases in [-100, 100], added to those tokens' logits."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(400, "logit_bias must be an object of token id -> bias", param="logit_bias")
    lo, hi = LOGIT_BIAS_RANGE
    bias: dict[int, float] = {}
    for key, amount in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12 else -1
        if not 0 <= token < n_vocab:
            raise RequestError(400, f"logit_bias key {_short(key)} is not a token id in [0, {n_vocab})",
                               param="logit_bias")
        if not isinstance(amount, (int, float)) or isinstance(amount, bool) or not lo <= amount <= hi:
            raise RequestError(400, f"logit_bias values must be numbers from {lo:g} to {hi:g}, got {_short(amount)}",
                               param="logit_bias")
        bias[token] = float(amount)
    return bias


def _top_p(body: Mapping[str, Any]) -> float:
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError(400, "top_p must be greater than 0", param="top_p")
    return top_p


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(400, "stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(400, f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    if any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise RequestError(400, f"each stop string must have 1 to {MAX_STOP_CHARS} characters", param="stop")
    return tuple(stops)


def _tools(body: Mapping[str, Any]) -> tuple[Tool, ...]:
    """`tools`: [{"type": "function", "function": {name, description?, parameters?}}], each
    parameters a JSON schema."""
    value = body.get("tools")
    if value is None or value == []:
        return ()
    if not isinstance(value, list):
        raise RequestError(400, "tools must be a list of {type: 'function', function: {...}} objects", param="tools")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict):
            raise RequestError(400, f"{where} must be {{type: 'function', function: {{name, parameters}}}}",
                               param=where)
        name, description = function.get("name"), function.get("description", "")
        if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name)):
            raise RequestError(400, f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-'",
                               param=f"{where}.function.name")
        if not isinstance(description, str):
            raise RequestError(400, f"{where}.function.description must be a string",
                               param=f"{where}.function.description")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        try:
            check_json_schema(parameters, f"{where}.function.parameters")
        except GrammarError as exc:
            raise RequestError(400, str(exc), param=f"{where}.function.parameters") from None
        tools.append(Tool(name, description, parameters))
    return tuple(tools)


def _tool_choice(body: Mapping[str, Any], tools: tuple[Tool, ...]) -> str:
    value = body.get("tool_choice")
    if value is None:
        return "auto"
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise RequestError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return str(value)
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestError(400, "tool_choice must be 'none', 'auto', 'required' or {type: 'function', "
                                "function: {name}}", param="tool_choice")
    if name not in {t.name for t in tools}:
        raise RequestError(400, f"tool_choice names '{name[:64]}', which is not among the tools", param="tool_choice")
    return name


def _messages(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    return tuple(_message(m, i) for i, m in enumerate(messages))


def _message(message: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise RequestError(400, f"{where} must be an object, got {_json_type(message)}", param=where)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise RequestError(400, f"{where}.role must be one of {', '.join(CHAT_ROLES)}", param=f"{where}.role")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):  # content parts: only text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise RequestError(400, f"{where}.content parts must be {{type: 'text', text: string}} objects",
                               param=f"{where}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise RequestError(400, f"{where}.content must be a string, got {_json_type(content)}",
                           param=f"{where}.content")
    checked: dict[str, Any] = {"role": str(role), "content": content}
    if role == "assistant" and message.get("tool_calls"):
        checked["tool_calls"] = _message_tool_calls(message["tool_calls"], where)
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                checked[key] = message[key]
    return checked


def _message_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's earlier calls, arguments as objects where they parse (what chat
    templates render with `tojson`)."""
    if not isinstance(calls, list):
        raise RequestError(400, f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    checked = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments", ""), str)):
            raise RequestError(400, f"{where}.tool_calls entries must be {{id, type, function: {{name, arguments}}}}",
                               param=f"{where}.tool_calls")
        try:
            arguments: Any = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = function.get("arguments")
        checked.append({"id": str(call.get("id", "")), "type": "function",
                        "function": {"name": function["name"], "arguments": arguments}})
    return checked


def _prompt(body: Mapping[str, Any], n_vocab: int) -> tuple[str | None, tuple[int, ...] | None]:
    """A completion prompt: a string, or a list of token ids (or a list holding one of those)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < n_vocab]
        if bad:
            raise RequestError(400, f"prompt token id {_short(bad[0])} is outside the vocabulary [0, {n_vocab})",
                               param="prompt")
        return None, tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise RequestError(400, "one prompt per request (a string or a list of token ids)", param="prompt")
    raise RequestError(400, "prompt must be a string or a non-empty list of token ids", param="prompt")


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------- /v1/embeddings

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one request
EMBEDDING_ENCODINGS = ("float", "base64")


@dataclasses.dataclass(frozen=True)
class EmbeddingApiRequest:
    """A checked embeddings request: texts, or token id lists (one of the two)."""

    texts: tuple[str, ...] | None
    ids: tuple[tuple[int, ...], ...] | None
    encoding_format: str


def parse_embedding_request(body: Mapping[str, Any], *, model_id: str, n_embd: int, n_vocab: int,
                            other_names: Collection[str] = ()) -> EmbeddingApiRequest:
    """`input`: a string, a list of strings, a list of token ids or a list of such lists;
    `dimensions`, when given, must be the model's width (no truncated embeddings)."""
    _check_model(body, model_id, other_names)
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in EMBEDDING_ENCODINGS:
        raise RequestError(400, f"encoding_format must be 'float' or 'base64', got {_short(encoding)}",
                           param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions != n_embd):
        raise RequestError(400, f"dimensions must be this model's embedding width {n_embd} (or left out), "
                                f"got {_short(dimensions)}", param="dimensions", code="unsupported")
    texts, ids = _embedding_inputs(body.get("input"), n_vocab)
    return EmbeddingApiRequest(texts, ids, encoding or "float")


def _embedding_inputs(value: Any, n_vocab: int) -> tuple[tuple[str, ...] | None, tuple[tuple[int, ...], ...] | None]:
    what = "input must be a string, a list of strings, a list of token ids or a list of token id lists"
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise RequestError(400, f"{what}, not empty; got {_json_type(value)}", param="input")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise RequestError(400, f"input holds {len(value)} items, at most {MAX_EMBEDDING_INPUTS}", param="input")
    if all(isinstance(v, str) for v in value):
        if not all(value):
            raise RequestError(400, "input: an empty string has no tokens to embed", param="input")
        return tuple(value), None
    if all(_is_int(v) for v in value):
        return None, (_token_ids(value, n_vocab),)
    if all(isinstance(v, list) for v in value):
        return None, tuple(_token_ids(v, n_vocab) for v in value)
    raise RequestError(400, f"{what}; got a list of mixed items", param="input")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(values: list[Any], n_vocab: int) -> tuple[int, ...]:
    if not values:
        raise RequestError(400, "input: an empty token id list has nothing to embed", param="input")
    for v in values:
        if not _is_int(v) or not 0 <= v < n_vocab:
            raise RequestError(400, f"input: token ids must be integers in [0, {n_vocab}), got {_short(v)}",
                               param="input")
    return tuple(values)
