"""The serving engine without HTTP or a compiled model: stop strings across pieces, request
checks, and the scheduler (continuous batching, prefix reuse, the queue limit, cancellation) on a
scripted runner whose logits follow from its context."""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence

import numpy as np
import pytest

from ggufc.runtime.embeddings import pool
from ggufc.runtime.sampling import Sampler
from ggufc.runtime.serve_engine import EmbeddingRequest, Engine, Event, Generation, ServerBusyError, StopStringFilter
from ggufc.runtime.serve_requests import RequestError, parse_embedding_request, parse_json, parse_request

N_VOCAB = 16
EOS = 15


@pytest.mark.parametrize(("pieces", "stops", "expected"), [
    (["Hel", "lo wor", "ld"], ["wor"], ("Hello ", True)),
    (["a", "b", "c"], ["bc"], ("a", True)),
    (["ab", "x"], ["bc"], ("abx", False)),  # "b" held back, then released
    (["a<", "/s", ">tail"], ["</s>"], ("a", True)),
    (["no stops here"], [], ("no stops here", False)),
    (["xy", "z"], ["yz", "xyz"], ("", True)),  # the earliest stop wins
])
def test_stop_strings_across_pieces(pieces: list[str], stops: list[str], expected: tuple[str, bool]) -> None:
    f = StopStringFilter(stops)
    sent, stopped = "", False
    for piece in pieces:
        text, stopped = f.feed(piece)
        sent += text
        if stopped:
            break
    if not stopped:
        sent += f.finish()
    assert (sent, stopped) == expected


def test_requests_are_checked_field_by_field() -> None:
    body = parse_json(b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stop": "x", "seed": -5}')
    req = parse_request(body, chat=False, model_id="m", n_ctx=32, n_vocab=N_VOCAB)
    assert (req.prompt_ids, req.max_tokens, req.stop, req.seed, req.temperature) == ((1, 2, 3), 4, ("x",), -5, 1.0)
    chat = parse_request({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                  {"type": "text", "text": "b"}]}],
                          "n": 1, "logprobs": False, "presence_penalty": 0}, chat=True, model_id="m", n_ctx=32,
                         n_vocab=N_VOCAB)
    assert chat.messages == ({"role": "user", "content": "ab"},) and chat.max_tokens == 32
    for bad, param in [({"max_tokens": 33}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
                       ({"logprobs": True}, "logprobs"), ({"seed": 2**64}, "seed"), ({"top_k": -1}, "top_k"),
                       ({"prompt": [N_VOCAB]}, "prompt"), ({"prompt": []}, "prompt"), ({"n": "1"}, "n")]:
        with pytest.raises(RequestError) as info:
            parse_request({"model": "m", "prompt": "x", **bad}, chat=False, model_id="m", n_ctx=32, n_vocab=N_VOCAB)
        assert info.value.status == 400 and info.value.param == param
    with pytest.raises(RequestError) as info:
        parse_json(b'{"a": Infinity}')
    assert info.value.status == 400


def test_integral_numbers_are_integers_whatever_their_spelling() -> None:
    """JSON Schema's integers include 2.0 (schemathesis sends them): token ids, limits and seeds
    written with a fraction are accepted as the integers they are, exactly at the range's end."""
    body = parse_json(b'{"model": "m", "prompt": [1, 2.0, 3e0], "max_tokens": 4.0, "n": 1.0, "logprobs": 0.0,'
                      b' "seed": 18446744073709551615.0, "temperature": 0.5}')
    req = parse_request(body, chat=False, model_id="m", n_ctx=32, n_vocab=N_VOCAB)
    assert (req.prompt_ids, req.max_tokens, req.seed, req.temperature) == ((1, 2, 3), 4, 2**64 - 1, 0.5)
    assert parse_json(b'{"a": 1e400, "b": 1e-400, "c": 1e99999999}') == {"a": float("inf"), "b": 0.0, "c": float("inf")}
    for bad, param in [(b'"prompt": [1.5]', "prompt"), (b'"seed": 18446744073709551616.0', "seed"),
                       (b'"max_tokens": 1e400', "max_tokens")]:
        with pytest.raises(RequestError) as info:
            parse_request(parse_json(b'{"model": "m", ' + bad + b"}"), chat=False, model_id="m", n_ctx=32,
                          n_vocab=N_VOCAB)
        assert info.value.status == 400 and info.value.param == param


class ScriptedRunner:
    """Greedy picks (sum of the context's ids + 1) mod 15: EOS (15) is never picked, so only
    max_tokens and stop strings end a generation; records every forward call's length."""

    n_ctx = 64
    max_chunk = 4

    def __init__(self, calls: list[tuple[int, int]], index: int) -> None:
        self.context: list[int] = []
        self.calls, self.index = calls, index

    def forward(self, tokens: Sequence[int] | np.ndarray, *, all_logits: bool = False) -> np.ndarray:
        ids = [int(t) for t in tokens]
        assert 0 < len(ids) <= self.max_chunk and len(self.context) + len(ids) <= self.n_ctx
        self.calls.append((self.index, len(ids)))
        return self.append(ids)

    def append(self, ids: list[int]) -> np.ndarray:
        self.context += ids
        logits = np.zeros(N_VOCAB, np.float32)
        logits[(sum(self.context) + 1) % 15] = 1.0
        return logits

    def reset(self) -> None:
        self.context = []

    def truncate(self, n: int) -> None:
        assert 0 <= n <= len(self.context)
        self.context = self.context[:n]

    def release_device(self) -> None:
        self.released = True

    def restore_device(self) -> None:
        self.released = False

    def close(self) -> None:
        pass

    def copy_context(self, source: ScriptedRunner) -> None:
        self.calls.append((self.index, "copy"))
        self.context = list(source.context)

    released = False


class ScriptedEmbedder:
    """Hidden state of a token: [id, position, 1]; records its calls as ("embed", length)."""

    max_chunk = 4

    def __init__(self, calls: list[tuple[object, object]]) -> None:
        self.calls, self.n_past = calls, 0

    def reset(self) -> None:
        self.n_past = 0

    def hidden_states(self, tokens: Sequence[int]) -> np.ndarray:
        assert 0 < len(tokens) <= self.max_chunk
        self.calls.append(("embed", len(tokens)))
        rows = np.array([[t, self.n_past + i, 1] for i, t in enumerate(tokens)], np.float32)
        self.n_past += len(tokens)
        return rows


def scripted_hidden_states(ids: Sequence[int]) -> np.ndarray:
    return np.array([[t, i, 1] for i, t in enumerate(ids)], np.float32)


class ScriptedSlots:
    """Scripted runners as a slot group; `batched`: its decode_batch steps several at once
    (recorded as ("batch", slots)), else it refuses batching as a recurrent artifact would."""

    def __init__(self, n: int, calls: list[tuple[object, object]], batched: bool) -> None:
        self.sessions = [ScriptedRunner(calls, i) for i in range(n)]  # type: ignore[arg-type]
        self.calls = calls
        self.batch_refused = None if batched else "scripted: no batched entry point"

    def decode_batch(self, steps: Sequence[tuple[int, int]]) -> np.ndarray:
        assert self.batch_refused is None and len({s for s, _ in steps}) == len(steps)
        self.calls.append(("batch", tuple(s for s, _ in steps)))
        return np.stack([self.sessions[s].append([t]) for s, t in steps])

    def embedder(self) -> ScriptedEmbedder:
        if not hasattr(self, "_embedder"):
            self._embedder = ScriptedEmbedder(self.calls)
        return self._embedder

    def release_device(self) -> None:
        for r in self.sessions:
            r.release_device()

    def restore_device(self) -> None:
        for r in self.sessions:
            r.restore_device()

    def close(self) -> None:
        pass


class Letters:
    """Token i decodes to the letter 'a' + i."""

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def _expected(prompt: list[int], n: int) -> str:
    context, out = list(prompt), []
    for _ in range(n):
        token = (sum(context) + 1) % 15
        out.append(chr(ord("a") + token))
        context.append(token)
    return "".join(out)


def _engine(parallel: int, max_queue: int = 8, sleep_idle_s: float | None = None,
            batched: bool = False) -> tuple[Engine, list[ScriptedRunner], list[tuple[object, object]]]:
    calls: list[tuple[object, object]] = []
    groups: list[ScriptedSlots] = []

    def open_slots(n: int) -> ScriptedSlots:
        groups.append(ScriptedSlots(n, calls, batched))
        return groups[-1]

    engine = Engine(open_slots, Letters(), {EOS}, parallel=parallel, max_queue=max_queue, sleep_idle_s=sleep_idle_s)
    return engine, groups[0].sessions, calls


def _collect(engine: Engine, prompt: list[int], n: int, stop: tuple[str, ...] = ()) -> queue.Queue[Event]:
    events: queue.Queue[Event] = queue.Queue()
    engine.submit(Generation(tuple(prompt), n, Sampler(), stop), events.put)
    return events


def _finish(events: queue.Queue[Event]) -> tuple[str, Event]:
    text = ""
    while True:
        event = events.get(timeout=10)
        if event.kind != "text":
            return text, event
        text += event.text


def _run_queued(engine: Engine, prompts: list[list[int]], n: int) -> list[tuple[str, Event]]:
    """Queue every prompt before the engine starts (a fixed order), run it, collect each answer."""
    streams = [_collect(engine, p, n) for p in prompts]
    engine.start()
    try:
        return [_finish(s) for s in streams]
    finally:
        engine.stop()


def test_slots_interleave_prompts_with_decode_steps_and_answer_as_alone() -> None:
    engine, runners, calls = _engine(parallel=2)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [3, 1], [2, 2, 2]]
    results = _run_queued(engine, prompts, 6)
    for prompt, (text, done) in zip(prompts, results, strict=True):
        assert text == _expected(prompt, 6) and done.finish_reason == "length"
        assert done.usage is not None and done.usage["prompt_tokens"] == len(prompt)
        assert done.usage["completion_tokens"] == 6
    # the 10-token prompt is read 4 tokens at a time while the other slot already decodes
    assert calls[:6] == [(0, 4), (1, 2), (0, 4), (1, 1), (0, 2), (1, 1)]
    assert len(runners) == 2 and len(calls) == sum(len(p) // 4 + 1 for p in prompts) + 3 * 5  # one feed a token


def test_generating_slots_are_fed_in_one_batched_call() -> None:
    engine, runners, calls = _engine(parallel=3, batched=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 1], [2, 2, 2], [7]]
    results = _run_queued(engine, prompts, 5)
    for prompt, (text, done) in zip(prompts, results, strict=True):
        assert text == _expected(prompt, 5) and done.finish_reason == "length"
    # step 2: slots 1 and 2 have read their prompts and sampled, slot 0 still reads (4 + 4 + 1)
    assert calls[:6] == [(0, 4), (1, 2), (2, 3), (0, 4), ("batch", (1, 2)), (0, 1)]
    assert ("batch", (0, 1, 2)) in calls  # all three generating: one call
    status = engine.status()
    assert status["batched_decode"] and status["batched_steps"] == sum(c[0] == "batch" for c in calls) > 0


def test_prefix_reuse_and_stop_strings() -> None:
    engine, runners, calls = _engine(parallel=1)
    engine.start()
    try:
        text, done = _finish(_collect(engine, [1, 2, 3, 4], 5))
        assert text == _expected([1, 2, 3, 4], 5)
        text2, done2 = _finish(_collect(engine, [1, 2, 3, 9, 9], 5))
        assert done2.usage is not None and done2.usage["cached_tokens"] == 3
        assert text2 == _expected([1, 2, 3, 9, 9], 5)
        full = _expected([4, 4, 4], 8)
        text3, done3 = _finish(_collect(engine, [4, 4, 4], 8, stop=(full[3:5],)))
        assert (text3, done3.finish_reason) == (full[: full.find(full[3:5])], "stop")
    finally:
        engine.stop()


def test_the_queue_limit_and_cancellation() -> None:
    engine, runners, calls = _engine(parallel=1, max_queue=1)  # not started yet: nothing moves
    gone = queue.Queue[Event]()
    ticket = engine.submit(Generation((1, 2), 50, Sampler()), gone.put)
    waiting = _collect(engine, [1, 2], 2)  # one slot free, one queued: still accepted
    with pytest.raises(ServerBusyError):
        engine.submit(Generation((1, 2), 2, Sampler()), lambda e: None)
    ticket.cancel()  # its client went away before a slot took it
    engine.start()
    try:
        text, done = _finish(waiting)
    finally:
        engine.stop()
    assert (text, done.finish_reason) == (_expected([1, 2], 2), "length")
    assert gone.empty() and engine.tokens_generated == 2  # the cancelled request generated nothing


def test_idle_slots_sleep_and_wake_for_the_next_request() -> None:
    engine, runners, calls = _engine(parallel=2, sleep_idle_s=0.2)
    engine.start()
    try:
        assert _finish(_collect(engine, [5, 6], 3))[0] == _expected([5, 6], 3)
        deadline = time.monotonic() + 10
        while not engine.status()["asleep"] and time.monotonic() < deadline:
            time.sleep(0.02)
        status = engine.status()
        assert status["asleep"] and (status["sleeps"], status["wake_ups"]) == (1, 0)
        assert all(r.released for r in runners)
        text, done = _finish(_collect(engine, [5, 6, 7, 8], 3))  # the context survived the sleep
        assert text == _expected([5, 6, 7, 8], 3) and done.usage is not None and done.usage["cached_tokens"] == 2
        # counted, not read from "asleep": after 0.2 idle seconds it may sleep again on a loaded machine
        assert engine.status()["wake_ups"] == 1
    finally:
        engine.stop()


def test_choices_of_one_request_read_the_prompt_once() -> None:
    """Three choices of one request: one slot feeds the prompt, the two others copy its context;
    each answers as a lone request would. A first choice cancelled before it starts leaves the
    next to read the prompt itself."""
    engine, runners, calls = _engine(parallel=3, batched=True)
    prompt, group = [1, 2, 3, 4, 5, 6, 7, 8, 9], object()
    streams = []
    for _ in range(3):
        events: queue.Queue[Event] = queue.Queue()
        engine.submit(Generation(tuple(prompt), 5, Sampler(), group=group), events.put)
        streams.append(events)
    engine.start()
    try:
        for events in streams:
            text, done = _finish(events)
            assert text == _expected(prompt, 5) and done.finish_reason == "length"
        alone = [c for c in calls if c[0] != "batch"]  # then the three decode together
        assert alone == [(0, 4), (0, 4), (0, 1), (1, "copy"), (2, "copy")]
        assert engine.status()["prefills_shared"] == 2
    finally:
        engine.stop()

    engine, runners, calls = _engine(parallel=2)
    first: queue.Queue[Event] = queue.Queue()
    second: queue.Queue[Event] = queue.Queue()
    leader = engine.submit(Generation(tuple(prompt), 5, Sampler(), group=group), first.put)
    engine.submit(Generation(tuple(prompt), 5, Sampler(), group=group), second.put)
    leader.cancel()
    engine.start()
    try:
        assert _finish(second)[0] == _expected(prompt, 5)
        assert engine.status()["prefills_shared"] == 0
    finally:
        engine.stop()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_run_in_chunks_between_steps_and_leave_slots_alone(pooling: str) -> None:
    engine, runners, calls = _engine(parallel=1)
    events = _collect(engine, [1, 2, 3, 4, 5, 6, 7, 8, 9], 3)
    inputs = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (7,), (2, 7, 1, 8, 2))
    results: queue.Queue[object] = queue.Queue()
    engine.submit_embedding(EmbeddingRequest(inputs, pooling), results.put)
    engine.start()
    try:
        vectors = results.get(timeout=10)
        text, done = _finish(events)
    finally:
        engine.stop()
    assert isinstance(vectors, list) and len(vectors) == 3
    for got, ids in zip(vectors, inputs, strict=True):
        np.testing.assert_allclose(got, pool(scripted_hidden_states(ids), pooling), rtol=1e-6)
    assert text == _expected([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) and done.kind == "done"
    assert runners[0].context[:9] == [1, 2, 3, 4, 5, 6, 7, 8, 9]  # the slot's context is its own
    embeds = [n for who, n in calls if who == "embed"]
    assert embeds == [4, 4, 1, 1, 4, 1]  # chunks of max_chunk, each input from an empty context
    first_embed = calls.index(("embed", 4))
    assert any(who == 0 for who, _ in calls[first_embed:])  # the slot kept stepping between chunks
    assert (engine.embedded_inputs, engine.embedded_tokens) == (3, 15)


def test_embedding_requests_are_checked_field_by_field() -> None:
    def parse(**body: object) -> object:
        return parse_embedding_request({"model": "m", **body}, model_id="m", n_embd=8, n_vocab=N_VOCAB)

    assert parse(input="a b").texts == ("a b",)  # type: ignore[attr-defined]
    assert parse(input=[1, 2], dimensions=8).ids == ((1, 2),)  # type: ignore[attr-defined]
    assert parse(input=[[1], [2, 3]], encoding_format="base64").ids == ((1,), (2, 3))  # type: ignore[attr-defined]
    for bad, param in [({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"),
                       ({"input": [N_VOCAB]}, "input"), ({"input": [1, "a"]}, "input"), ({"input": None}, "input"),
                       ({"input": [False]}, "input"), ({"input": "a", "dimensions": 4}, "dimensions"),
                       ({"input": "a", "encoding_format": "hex"}, "encoding_format")]:
        with pytest.raises(RequestError) as info:
            parse(**bad)
        assert info.value.status == 400 and info.value.param == param
    with pytest.raises(RequestError) as info:
        parse_embedding_request({"model": "x", "input": "a"}, model_id="m", n_embd=8, n_vocab=N_VOCAB)
    assert info.value.status == 404
