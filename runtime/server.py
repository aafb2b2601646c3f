"""`ggufc serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn, server-sent events for
streaming) in front of the generation engine (serve_engine.py).

Endpoints: POST /v1/completions and /v1/chat/completions (streamed or not), POST /v1/embeddings
(the final hidden states pooled `last` or `mean`, unit length, as llama-server's), GET /v1/models,
GET /health and GET /metrics (Prometheus). Bad requests get OpenAI's error body with a 4xx status (serve_requests.py); a
request that finds every slot busy and the queue full gets 503. A client that goes away (a
closed stream, or a dropped connection while it waits for a whole answer) cancels its request,
which frees its slot at the engine's next step. On SIGTERM uvicorn stops accepting connections,
lets the requests in flight finish (up to `GRACEFUL_SHUTDOWN_S`), then the engine stops.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hmac
import json
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .chat import ChatTemplateError
from .embeddings import DEFAULT_POOLING, check_pooling
from .prompting import encode_prompt, render_messages, stop_ids
from .sampling import Sampler
from .serve_engine import EmbeddingRequest, Engine, Event, Generation, ServerBusyError, Slots, Ticket
from .serve_logprobs import LogprobWriter, merge
from .serve_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .serve_metrics import ServerMetrics
from .serve_requests import (
    MAX_BODY_BYTES,
    ApiRequest,
    EmbeddingApiRequest,
    RequestError,
    parse_embedding_request,
    parse_json,
    parse_request,
)
from .serve_schema import (
    COMPLETION_RESPONSES,
    EMBEDDING_RESPONSES,
    ERROR_RESPONSES,
    METRICS_RESPONSES,
    embedding_request_model,
    request_body,
    request_models,
)
from .structured_output import GrammarError, Grammars
from .tokenizer import TokenizationError
from .tool_calls import ToolFormat, detect_format

GRACEFUL_SHUTDOWN_S = 30
_COUNTED = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models"})
RETRY_AFTER_S = 1


class ServeError(OSError):
    """The server cannot start (one line: the address is taken, ...)."""


def create_app(engine: Engine, tokenizer: Any, info: Mapping[str, Any], *, model_id: str, n_vocab: int,
               api_key: str | None = None, other_names: Sequence[str] = (), embedding_width: int = 0,
               pooling: str = DEFAULT_POOLING) -> FastAPI:
    """The ASGI app; it starts the engine with the app and stops it on shutdown. The model answers
    to `model_id` (the name in responses) and to `other_names`. `embedding_width`: the artifact's
    hidden-state width (0: it has no `embed` function, and /v1/embeddings says so); `pooling`:
    how /v1/embeddings pools an input's hidden states."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(engine.stop)

    # /openapi.json describes the requests (serve_schema.py); the handlers check bodies themselves
    app = FastAPI(title="ggufc", lifespan=lifespan, docs_url=None, redoc_url=None)
    completion_request, chat_request = request_models(model_id, engine.n_ctx, n_vocab, max_n=len(engine.slots),
                                                      model_names=tuple(other_names))
    created = int(time.time())
    context = _Context(engine, tokenizer, info, model_id, n_vocab, api_key, tuple(other_names))
    context.embedding_width, context.pooling = embedding_width, check_pooling(pooling)
    embedding_request = embedding_request_model(model_id, engine.n_ctx, n_vocab, embedding_width,
                                                model_names=tuple(other_names))
    metrics = ServerMetrics(engine)
    app.add_middleware(_RequestCounter, metrics=metrics)

    @app.get("/metrics", responses=METRICS_RESPONSES)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
        auth = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers or auth)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(RequestError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        error = RequestError(500, f"internal error ({type(exc).__name__})", kind="server_error")
        return JSONResponse(error.body(), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", **engine.status()}

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models(request: Request) -> dict[str, Any]:
        context.check_key(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "ggufc",
                                            "context_length": engine.n_ctx} for name in (model_id, *other_names)]}

    @app.post("/v1/completions", openapi_extra=request_body(completion_request), responses=COMPLETION_RESPONSES)
    async def completions(request: Request) -> Response:
        return await context.answer(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=request_body(chat_request), responses=COMPLETION_RESPONSES)
    async def chat_completions(request: Request) -> Response:
        return await context.answer(request, chat=True)

    @app.post("/v1/embeddings", openapi_extra=request_body(embedding_request), responses=EMBEDDING_RESPONSES)
    async def embeddings(request: Request) -> Response:
        return await context.embed(request)

    return app


class _RequestCounter:
    """Counts the API's responses by path and status for /metrics (plain ASGI: streamed answers and
    their disconnect handling pass through untouched)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in _COUNTED:
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_request(scope["path"], int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)


class _Context:
    """What the request handlers share: the engine, the tokenizer and the server's settings."""

    def __init__(self, engine: Engine, tokenizer: Any, info: Mapping[str, Any], model_id: str, n_vocab: int,
                 api_key: str | None, other_names: tuple[str, ...]) -> None:
        self.engine, self.tokenizer, self.info, self.other_names = engine, tokenizer, info, other_names
        self.model_id, self.n_vocab, self.api_key = model_id, n_vocab, api_key
        self.grammars = Grammars(tokenizer, n_vocab, stop_ids(info))
        self.tool_format = detect_format(str(info.get("chat_template") or ""))
        self.embedding_width, self.pooling = 0, DEFAULT_POOLING  # set by create_app

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise RequestError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                               code="invalid_api_key")

    async def answer(self, request: Request, *, chat: bool) -> Response:
        self.check_key(request)
        body = parse_json(await _read_body(request))
        parsed = parse_request(body, chat=chat, model_id=self.model_id, n_ctx=self.engine.n_ctx,
                               n_vocab=self.n_vocab, max_n=len(self.engine.slots), other_names=self.other_names)
        ids = await anyio.to_thread.run_sync(self._prompt_ids, parsed)
        if parsed.response_format is not None:
            parsed = await anyio.to_thread.run_sync(self._constrained, parsed)
        if parsed.tool_choice not in ("none", "auto"):
            parsed = await anyio.to_thread.run_sync(self._call_required, parsed)
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        tickets = self._submit(parsed, ids, asyncio.get_running_loop(), events)
        calls = self.tool_format if parsed.tools and parsed.tool_choice != "none" else None
        reply = _Reply(chat, self.model_id, parsed, self.tokenizer, calls)
        if parsed.stream:
            return _EventStream(reply.stream(events), tickets)
        return await _whole_answer(request, reply, events, tickets)

    async def embed(self, request: Request) -> Response:
        self.check_key(request)
        body = parse_json(await _read_body(request))
        if self.embedding_width <= 0:
            raise RequestError(400, "this artifact has no hidden-state output to embed (compiled by an older ggufc "
                                    "or for a GPU target); recompile it for the CPU", code="unsupported")
        parsed = parse_embedding_request(body, model_id=self.model_id, n_embd=self.embedding_width,
                                         n_vocab=self.n_vocab, other_names=self.other_names)
        inputs = await anyio.to_thread.run_sync(self._embedding_ids, parsed)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[Any] | str] = loop.create_future()

        def settle(result: list[Any] | str) -> None:
            if not done.done():
                done.set_result(result)

        def deliver(result: list[Any] | str) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
                loop.call_soon_threadsafe(settle, result)

        try:
            job = self.engine.submit_embedding(EmbeddingRequest(inputs, self.pooling), deliver)
        except ServerBusyError as exc:
            raise RequestError(503, str(exc), code="server_busy", kind="server_error") from None
        watching: asyncio.Future[Any] = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait([done, watching], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            if not done.done():
                job.cancel()
        if not done.done():
            return Response(status_code=499)  # nobody is there to read it
        result = done.result()
        if isinstance(result, str):
            status = 503 if "shutting down" in result else 500
            return JSONResponse(RequestError(status, result, kind="server_error").body(), status_code=status)
        n_tokens = sum(len(ids) for ids in inputs)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, parsed.encoding_format)}
                for i, v in enumerate(result)]
        return JSONResponse({"object": "list", "data": data, "model": self.model_id,
                             "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})

    def _embedding_ids(self, parsed: EmbeddingApiRequest) -> tuple[tuple[int, ...], ...]:
        """Each input's token ids (texts tokenized as completion prompts are), each fitting the context."""
        if parsed.ids is not None:
            inputs = parsed.ids
        else:
            assert parsed.texts is not None
            try:
                inputs = tuple(tuple(encode_prompt(self.tokenizer, self.info, text, templated=False))
                               for text in parsed.texts)
            except TokenizationError as exc:
                raise RequestError(400, str(exc), param="input") from None
        for i, ids in enumerate(inputs):
            if not ids:
                raise RequestError(400, f"input {i} has no tokens", param="input")
            if len(ids) > self.engine.n_ctx:
                raise RequestError(400, f"input {i} has {len(ids)} tokens, more than the context holds "
                                        f"({self.engine.n_ctx} tokens)", param="input", code="context_length_exceeded")
        return inputs

    def _submit(self, parsed: ApiRequest, ids: list[int], loop: asyncio.AbstractEventLoop,
                events: asyncio.Queue[tuple[int, Event]]) -> _Tickets:
        """One generation per choice, each with its own sampler (choice i seeded with seed + i)."""
        tickets = _Tickets()
        group = object() if parsed.n > 1 else None  # the choices read the prompt once
        for index in range(parsed.n):
            seed = None if parsed.seed is None else (parsed.seed + index) % (1 << 64)
            sampler = Sampler(temperature=parsed.temperature, top_k=parsed.top_k, top_p=parsed.top_p, seed=seed)
            generation = Generation(tuple(ids), parsed.max_tokens, sampler, parsed.stop, parsed.decoding, group)
            try:
                tickets.append(self.engine.submit(generation, _deliverer(loop, events, index)))
            except ServerBusyError as exc:
                tickets.cancel()
                raise RequestError(503, str(exc), code="server_busy", kind="server_error") from None
        return tickets

    def _constrained(self, parsed: ApiRequest) -> ApiRequest:
        """The request with its response_format's grammar (compiled once per schema)."""
        spec = parsed.response_format
        assert spec is not None
        try:
            if spec.kind == "json_object":
                grammar = self.grammars.json_object()
            else:
                grammar = self.grammars.json_schema(spec.schema)
        except GrammarError as exc:
            param = "response_format" if spec.kind == "json_object" else "response_format.json_schema.schema"
            raise RequestError(400, str(exc), param=param) from None
        return dataclasses.replace(parsed, decoding=dataclasses.replace(parsed.decoding, constraint=grammar))

    def _call_required(self, parsed: ApiRequest) -> ApiRequest:
        """The request with a grammar that writes one call (of the named tool, or of any) in the
        family's format."""
        if self.tool_format is None:
            raise RequestError(400, "this model's chat template has no tool-call format ggufc knows (hermes, "
                                    "llama3, mistral); a call cannot be required", param="tool_choice")
        tools = [t for t in parsed.tools if parsed.tool_choice in ("required", t.name)]
        fmt = self.tool_format
        try:
            grammar = self.grammars.wrapped_json(fmt.prefix, fmt.call_schema(tools), fmt.suffix)
        except GrammarError as exc:
            raise RequestError(400, str(exc), param="tools") from None
        return dataclasses.replace(parsed, decoding=dataclasses.replace(parsed.decoding, constraint=grammar))

    def _prompt_ids(self, parsed: ApiRequest) -> list[int]:
        """Token ids of the prompt (chat: through the model's template, in jinja2's sandbox)."""
        if parsed.prompt_ids is not None:
            ids = list(parsed.prompt_ids)
        else:
            try:
                if parsed.chat:
                    tools = [t.as_openai() for t in parsed.tools]
                    text = render_messages(self.tokenizer, self.info, parsed.messages, tools)
                else:
                    text = parsed.prompt_text or ""
                ids = encode_prompt(self.tokenizer, self.info, text, templated=parsed.chat)
            except (ChatTemplateError, TokenizationError) as exc:
                raise RequestError(400, str(exc), param="messages" if parsed.chat else "prompt") from None
        if not ids:
            raise RequestError(400, "the prompt is empty (no tokens)", param="prompt")
        if len(ids) > self.engine.n_ctx:
            raise RequestError(400, f"the prompt has {len(ids)} tokens, more than the context holds "
                                    f"({self.engine.n_ctx} tokens)", param="messages" if parsed.chat else "prompt",
                               code="context_length_exceeded")
        return ids


async def _read_body(request: Request) -> bytes:
    """The body, refused (413) past MAX_BODY_BYTES before it is all read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _deliverer(loop: asyncio.AbstractEventLoop, events: asyncio.Queue[tuple[int, Event]],
               index: int) -> Callable[[Event], None]:
    """Hand the engine thread's events of choice `index` to the request's queue on the event loop."""

    def deliver(event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            loop.call_soon_threadsafe(events.put_nowait, (index, event))

    return deliver


class _Tickets(list[Ticket]):
    """The generations of one request's choices, cancelled together."""

    def cancel(self) -> None:
        for ticket in self:
            ticket.cancel()


class _Reply:
    """OpenAI's response objects for one request's choices: whole, or as server-sent event chunks."""

    def __init__(self, chat: bool, model_id: str, parsed: ApiRequest, tokenizer: Any,
                 calls: ToolFormat | None = None) -> None:
        self.chat, self.model_id, self.parsed = chat, model_id, parsed
        self.calls = calls  # the format tool calls are parsed from (None: the text is the answer)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        wanted = parsed.decoding.top_logprobs is not None
        self.logprobs = [LogprobWriter(tokenizer, chat=chat) for _ in range(parsed.n)] if wanted else None

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id}

    @staticmethod
    def usage(raw: Sequence[Mapping[str, int]]) -> dict[str, Any]:
        """One request's usage: the prompt once, the completions of every choice."""
        prompt, completion = raw[0]["prompt_tokens"], sum(u["completion_tokens"] for u in raw)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": raw[0]["cached_tokens"]}}

    def _logprobs(self, index: int, event: Event) -> dict[str, Any] | None:
        return None if self.logprobs is None else self.logprobs[index].render(event.logprobs)

    def whole(self, finals: Sequence[_Collected]) -> dict[str, Any]:
        choices = []
        for index, final in enumerate(finals):
            choice: dict[str, Any] = {"index": index, "finish_reason": final.finish_reason, "logprobs": None}
            if self.logprobs is not None:
                choice["logprobs"] = merge(final.logprobs, chat=self.chat)
            if self.chat:
                choice["message"], called = self._message(final.text)
                choice["finish_reason"] = "tool_calls" if called else final.finish_reason
            else:
                choice["text"] = final.text
            choices.append(choice)
        usage = self.usage([f.usage for f in finals])
        return {**self._envelope(False), "choices": choices, "usage": usage}

    def _message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant's message, with `tool_calls` when the text holds calls in the family's format."""
        if self.calls is None:
            return {"role": "assistant", "content": text}, False
        content, calls = self.calls.parse(text)
        if not calls:
            return {"role": "assistant", "content": text}, False
        return {"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]}, True

    def _final_deltas(self, index: int, text: str, finish_reason: str | None) -> Iterator[bytes]:
        """A held-back answer (tools in play) as deltas: its content, or one delta per call."""
        message, called = self._message(text)
        if message.get("content"):
            yield self.chunk(index, message["content"])
        for i, call in enumerate(message.get("tool_calls", [])):
            delta = {"tool_calls": [{"index": i, **call}]}
            yield _sse({**self._envelope(True), "choices": [{"index": index, "delta": delta, "finish_reason": None,
                                                             "logprobs": None}]})
        yield self.chunk(index, None, "tool_calls" if called else finish_reason)

    def chunk(self, index: int, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              logprobs: dict[str, Any] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return _sse({**self._envelope(True), "choices": [choice]})

    async def stream(self, events: asyncio.Queue[tuple[int, Event]]) -> AsyncIterator[bytes]:
        if self.chat:
            for index in range(self.parsed.n):
                yield self.chunk(index, "", role=True)
        usages: dict[int, Mapping[str, int]] = {}
        held = [""] * self.parsed.n  # with tools in play, the answer is parsed once it is whole
        while len(usages) < self.parsed.n:
            index, event = await events.get()
            if event.kind == "text" and self.calls is not None and self.chat:
                held[index] += event.text
                continue
            if event.kind == "text":
                yield self.chunk(index, event.text, logprobs=self._logprobs(index, event))
                continue
            if event.kind == "error":
                yield _sse(RequestError(500, event.text, kind="server_error").body())
                yield b"data: [DONE]\n\n"
                return
            if self.calls is not None and self.chat:
                for delta in self._final_deltas(index, held[index], event.finish_reason):
                    yield delta
            else:
                final_logprobs = self._logprobs(index, event) if event.logprobs else None
                yield self.chunk(index, None, event.finish_reason, logprobs=final_logprobs)
            assert event.usage is not None
            usages[index] = event.usage
        if self.parsed.include_usage:
            usage = self.usage([usages[i] for i in sorted(usages)])
            yield _sse({**self._envelope(True), "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"


def _encoded(vector: Any, encoding_format: str) -> list[float] | str:
    """An embedding as JSON numbers, or (base64) its float32 little-endian bytes as OpenAI sends them."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


def _sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"


@dataclasses.dataclass
class _Collected:
    """One choice's whole answer, as its events brought it."""

    text: str = ""
    finish_reason: str | None = None
    usage: Mapping[str, int] = dataclasses.field(default_factory=dict)
    logprobs: list[dict[str, Any]] = dataclasses.field(default_factory=list)


async def _whole_answer(request: Request, reply: _Reply, events: asyncio.Queue[tuple[int, Event]],
                        tickets: _Tickets) -> Response:
    """Collect every choice's generation; a client that disconnects meanwhile cancels them."""

    async def collect() -> list[_Collected] | Event:
        finals = [_Collected() for _ in range(reply.parsed.n)]
        done = 0
        while done < len(finals):
            index, event = await events.get()
            if event.kind == "error":
                return event
            final = finals[index]
            final.text += event.text
            if reply.logprobs is not None and event.logprobs:
                final.logprobs.append(reply.logprobs[index].render(event.logprobs))
            if event.kind == "done":
                assert event.usage is not None
                final.finish_reason, final.usage = event.finish_reason, event.usage
                done += 1
        return finals

    collecting = asyncio.ensure_future(collect())
    watching = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()
            tickets.cancel()
    if not collecting.done() or collecting.cancelled():
        return Response(status_code=499)  # nobody is there to read it
    result = collecting.result()
    if isinstance(result, Event):
        tickets.cancel()  # the other choices' answers are of no use now
        status = 503 if "shutting down" in result.text else 500
        return JSONResponse(RequestError(status, result.text, kind="server_error").body(), status_code=status)
    return JSONResponse(reply.whole(result))


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """Server-sent events that stop, and cancel their request, as soon as the client goes away
    (also under ASGI 2.4 servers, where a plain StreamingResponse only notices at its next write)."""

    def __init__(self, content: AsyncIterator[bytes], tickets: _Tickets) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._tickets = tickets

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await _disconnected(receive)
                group.cancel_scope.cancel()
        finally:
            self._tickets.cancel()  # no-op for the generations already finished


# --------------------------------------------------------------------- running


def serve(open_slots: Callable[[int], Slots], tokenizer: Any, info: Mapping[str, Any], *, model_id: str,
          n_vocab: int, sock: socket.socket, parallel: int = 1, max_queue: int = 16,
          sleep_idle_s: float | None = None, api_key: str | None = None, other_names: Sequence[str] = (),
          embedding_width: int = 0, pooling: str = DEFAULT_POOLING, announce: Callable[[str], None] = print) -> None:
    """Load `parallel` slots (`open_slots(parallel)`) and serve on `sock` (from `listen`) until
    SIGINT/SIGTERM."""
    engine = Engine(open_slots, tokenizer, stop_ids(info), parallel=parallel, max_queue=max_queue,
                    sleep_idle_s=sleep_idle_s)
    if parallel > 1 and engine.batch_refused is not None:
        announce(f"slots decode one call each (no batched decode: {engine.batch_refused})")
    app = create_app(engine, tokenizer, info, model_id=model_id, n_vocab=n_vocab, api_key=api_key,
                     other_names=other_names, embedding_width=embedding_width, pooling=pooling)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            lifespan="on")
    bound_host, bound_port = sock.getsockname()[:2]
    announce(f"serving {model_id} on http://{_url_host(bound_host)}:{bound_port} "
             f"({parallel} slot{'s' if parallel > 1 else ''}, context {engine.n_ctx}, queue {max_queue})")
    _GracefulServer(config).run(sockets=[sock])
    announce("stopped")


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, minus re-raising SIGTERM/SIGINT once it has shut down gracefully: a
    server stopped by a signal has done its job and exits 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one), or a one-line ServeError; opened
    before the model loads, so a taken port is refused at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
