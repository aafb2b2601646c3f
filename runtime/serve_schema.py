"""The OpenAPI description of `ggufc serve`'s requests and errors (published at /openapi.json).

The server checks bodies itself, field by field (serve_requests.py), so that every refusal is
OpenAI's error body naming the field; these pydantic models only describe what it accepts, with
the limits of the model being served (its name, context and vocabulary), so that clients and API
testers (tests/test_serve_schemathesis.py) know the valid requests.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, conlist, create_model

from .serve_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .serve_requests import (
    CHAT_ROLES,
    EMBEDDING_ENCODINGS,
    MAX_EMBEDDING_INPUTS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    SEED_RANGE,
)
from .token_choice import LOGIT_BIAS_RANGE, MAX_TOP_LOGPROBS, PENALTY_RANGE

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error body, sent with every 4xx and 5xx status."""

    error: ErrorDetail


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(title="ChatMessage")
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart] = Field(description="text, or text parts; null is accepted from the assistant")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant turn's calls")
    tool_call_id: str | None = Field(None, description="a tool turn: the call it answers")


ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDefinition(BaseModel):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: ToolName


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaSpec(BaseModel):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON schema the answer follows")
    strict: bool | None = None


class TextFormat(BaseModel):
    type: Literal["text", "json_object"]


class JsonSchemaFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class StreamOptions(BaseModel):
    include_usage: bool | None = None


class _Sampling(BaseModel):
    """The fields both endpoints share (the server-specific bounds are set by `request_models`)."""

    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    response_format: TextFormat | JsonSchemaFormat | None = Field(
        None, description="json_object or json_schema: the answer follows that grammar")


def request_models(model_id: str, n_ctx: int, n_vocab: int, *, max_n: int = 1,
                   model_names: tuple[str, ...] = ()) -> tuple[type[BaseModel], type[BaseModel]]:
    """(completion request, chat request) models with this server's model names and limits
    (`max_n`: the most choices a request may ask for, one per slot)."""
    lo, hi = LOGIT_BIAS_RANGE
    bias_schema = {"type": "object", "additionalProperties": False,
                   "patternProperties": {rf"^[0-9]{{1,{len(str(n_vocab - 1))}}}$": {"type": "number", "minimum": lo,
                                                                                    "maximum": hi}}}
    biases: Any = Annotated[dict[str, float], WithJsonSchema(bias_schema)]
    limits: dict[str, Any] = {
        "model": (str, Field(json_schema_extra={"enum": [model_id, *model_names]})),
        "max_tokens": (int | None, Field(None, ge=1, le=n_ctx)),
        "top_k": (int | None, Field(None, ge=0, le=n_vocab, description="0: no top-k cut")),
        "n": (int | None, Field(None, ge=1, le=max_n, description="choices, at most one per slot")),
        "logit_bias": (biases | None, Field(None, description=f"token id (below {n_vocab}) -> bias on its logit")),
    }
    token_id: Any = Annotated[int, Field(ge=0, lt=n_vocab)]
    one_prompt: Any = Annotated[str, Field(min_length=1)] | conlist(token_id, min_length=1)
    prompt: Any = one_prompt | conlist(one_prompt, min_length=1, max_length=1)
    completion = create_model("CompletionRequest", __base__=_Sampling, **limits,
                              prompt=(prompt, Field(description="text or token ids (or a list holding one of those)")),
                              logprobs=(int | None, Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                                          description="the chosen tokens' and this many more")))
    chat = create_model("ChatCompletionRequest", __base__=_Sampling, **limits,
                        max_completion_tokens=(int | None, Field(None, ge=1, le=n_ctx)),
                        messages=(conlist(ChatMessage, min_length=1), ...),
                        logprobs=(bool | None, None),
                        top_logprobs=(int | None, Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                                        description="with logprobs: true")),
                        tools=(list[ToolDefinition] | None, None),
                        tool_choice=(ToolChoice | None,
                                     Field(None, description="a named function must be among the tools")))
    return completion, chat


def embedding_request_model(model_id: str, n_ctx: int, n_vocab: int, n_embd: int, *,
                            model_names: tuple[str, ...] = ()) -> type[BaseModel]:
    """The /v1/embeddings request with this server's model names and limits."""
    token_id: Any = Annotated[int, Field(ge=0, lt=n_vocab)]
    ids: Any = conlist(token_id, min_length=1, max_length=n_ctx)
    text: Any = Annotated[str, Field(min_length=1)]
    many: Any = conlist(text, min_length=1, max_length=MAX_EMBEDDING_INPUTS) | conlist(
        ids, min_length=1, max_length=MAX_EMBEDDING_INPUTS)
    dimensions: Any = Literal[n_embd] if n_embd > 0 else None  # type: ignore[valid-type]
    encoding: Any = Literal[EMBEDDING_ENCODINGS]  # type: ignore[valid-type]
    return create_model(
        "EmbeddingRequest",
        model=(str, Field(json_schema_extra={"enum": [model_id, *model_names]})),
        input=(text | ids | many, Field(description="text, token ids, or a list of either (one embedding each); "
                                                     "each at most the context's tokens")),
        encoding_format=(encoding | None, Field(None, description="float (default) or base64 (float32 little-endian)")),
        dimensions=(dimensions | None, Field(None, description="only the model's own width")),
        user=(str | None, None),
    )


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its body itself: the model's schema, inlined."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})
    content = {"application/json": {"schema": _inline(schema, definitions)}}
    return {"requestBody": {"required": True, "content": content}}


def _inline(node: Any, definitions: dict[str, Any]) -> Any:
    """The schema with its local `#/$defs/...` references replaced by what they name."""
    if isinstance(node, dict):
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inline(definitions[ref.removeprefix("#/$defs/")], definitions)
        return {key: _inline(value, definitions) for key, value in node.items()}
    if isinstance(node, list):
        return [_inline(value, definitions) for value in node]
    return node


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": what}
    for status, what in [(400, "a bad request (the field at fault in error.param)"),
                         (401, "a missing or wrong API key"), (404, "an unknown model or route"),
                         (413, "a body over 1 MiB"), (500, "an internal error"),
                         (503, "every slot busy and the queue full (Retry-After)")]
}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the counters in Prometheus' text format", "content": {METRICS_CONTENT_TYPE: {}}},
}
COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the completion (JSON), or its chunks as server-sent events when streamed",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **ERROR_RESPONSES,
}
EMBEDDING_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "one unit-length embedding per input, pooled as the server's --pooling says",
          "content": {"application/json": {}}},
    **ERROR_RESPONSES,
}
