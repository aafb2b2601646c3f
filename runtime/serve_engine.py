"""The generation engine behind `ggufc serve`: N slots, each a Session with its own context,
stepped by one thread.

Continuous batching: every iteration of the engine's loop first admits queued requests into free
slots, then advances every busy slot by one step: a slot still reading its prompt feeds one chunk
(at most the artifact's `max_chunk` tokens), a generating slot samples a token. So a long prompt is
read between the decode steps of the other slots, never in front of all of them. The sampled
tokens of all generating slots are then fed in one batched decode call (`SlotGroup.decode_batch`:
every weight read once for all of them, each row bit-identical to that slot's own decode step);
where the artifact has no batched entry point (`batch_refused` says why) each slot feeds its token
in its own `decode` call. The slots share one copy of the weights either way.

Several choices of one request (`n`) read the prompt once: the first slot feeds it, the others
wait, then copy that slot's context and logits (`Session.copy_context`) before each samples its own
continuation.

Prefix reuse: a request goes to the free slot whose context shares the longest prefix with its
prompt; the slot's context is cut back to that prefix (`Session.truncate`) and only the rest of
the prompt is fed (a follow-up turn of a chat, or prompts sharing a system message).

Embeddings (`submit_embedding`) run on the same thread, one chunk per step between the slots'
steps, in a session of their own (`Slots.embedder`: its own states, the slots' weights), so they
neither wait for a free slot nor touch a slot's context.

Everything the HTTP side sees arrives through `deliver(Event)`, called on the engine's thread.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from .artifact import one_line
from .embeddings import Pooler
from .generate import TextStream, text_stream
from .sampling import Sampler
from .token_choice import Decoding, TokenChooser, TokenLogprob

FINISH_STOP = "stop"  # an end-of-generation token or a stop string
FINISH_LENGTH = "length"  # max_tokens, or the context is full


class ServerBusyError(RuntimeError):
    """Every slot is busy and the queue is full."""


class Runner(Protocol):
    """What the engine needs of one slot's runtime.Session."""

    n_ctx: int
    max_chunk: int

    def forward(self, tokens: np.ndarray | list[int], *, all_logits: bool = False) -> np.ndarray: ...

    def reset(self) -> None: ...

    def truncate(self, n: int) -> None: ...

    def release_device(self) -> None: ...

    def restore_device(self) -> None: ...

    def close(self) -> None: ...

    def copy_context(self, source: Any) -> None: ...


class Embedder(Protocol):
    """What the engine needs of the session that embeds (runtime.Session)."""

    max_chunk: int

    def reset(self) -> None: ...

    def hidden_states(self, tokens: np.ndarray | list[int]) -> np.ndarray: ...


class Slots(Protocol):
    """What the engine needs of a runtime.SlotGroup: one runner per slot, their batched step, and a
    session apart from them for embeddings."""

    def embedder(self) -> Embedder: ...

    @property
    def sessions(self) -> Sequence[Runner]: ...

    @property
    def batch_refused(self) -> str | None:  # why `decode_batch` is unavailable (None: it works)
        ...

    def decode_batch(self, steps: Sequence[tuple[int, int]]) -> np.ndarray: ...

    def release_device(self) -> None: ...

    def restore_device(self) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Generation:
    """One request: its prompt ids and how to continue them."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampler: Sampler
    stop_strings: tuple[str, ...] = ()
    decoding: Decoding = Decoding()  # logit bias, penalties, grammar, log-probabilities
    group: object | None = None  # the choices of one request share it: one slot reads the prompt for all


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request's stream receives: text, then one `done` (with usage) or one `error`."""

    kind: str  # "text" | "done" | "error"
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens sampled since the last event (when asked)


class Ticket:
    """A submitted request; `cancel()` (a client that went away) frees its slot at the next step."""

    def __init__(self, generation: Generation, deliver: Callable[[Event], None], wake: Callable[[], None]) -> None:
        self.generation = generation
        self.deliver = deliver
        self.cancelled = threading.Event()
        self.finished = False
        self._wake = wake

    def cancel(self) -> None:
        if not self.finished:
            self.cancelled.set()
            self._wake()


@dataclasses.dataclass(frozen=True)
class EmbeddingRequest:
    """The inputs' token ids, each pooled into one vector (runtime/embeddings.py)."""

    inputs: tuple[tuple[int, ...], ...]
    pooling: str


class EmbeddingJob:
    """A submitted embedding request: `deliver` gets the vectors in input order, or an error message."""

    def __init__(self, request: EmbeddingRequest, deliver: Callable[[list[np.ndarray] | str], None],
                 wake: Callable[[], None]) -> None:
        self.request, self.deliver, self._wake = request, deliver, wake
        self.cancelled = threading.Event()
        self.finished = False
        self.vectors: list[np.ndarray] = []
        self.pending: list[int] = []  # the current input's ids not fed yet
        self.pooler: Pooler | None = None  # the current input's, None before it starts

    def cancel(self) -> None:
        if not self.finished:
            self.cancelled.set()
            self._wake()


class StopStringFilter:
    """Cuts generated text at the first stop string, holding back a tail that could begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was reached)."""
        text = self._held + piece
        if not self._stops:
            return text, False
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return text[:cut], True
        keep = max((n for s in self._stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def finish(self) -> str:
        """What was held back, once the generation ends without a stop string."""
        held, self._held = self._held, ""
        return held


class Slot:
    """One sequence's context in its own Session, and the request it is serving."""

    def __init__(self, index: int, runner: Runner) -> None:
        self.index = index
        self.runner: Runner | None = runner
        self.context: list[int] = []  # the ids in the runner's states, in order
        self.ticket: Ticket | None = None
        self.pending: list[int] = []  # prompt ids not fed yet
        self.logits: np.ndarray | None = None
        self.produced = 0
        self.cached = 0
        self.decoder: TextStream | None = None
        self.stops = StopStringFilter(())
        self.chooser: TokenChooser | None = None
        self.logprobs: list[TokenLogprob] = []  # sampled, not yet sent with an event
        self.leader: Slot | None = None  # the slot reading this request's prompt, whose context this one copies

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        taken, self.logprobs = tuple(self.logprobs), []
        return taken

    @property
    def busy(self) -> bool:
        return self.ticket is not None

    def reusable_prefix(self, prompt: Sequence[int]) -> int:
        """How many leading ids of `prompt` this slot's context holds and may keep.

        The rest is fed in chunks of `max_chunk` as a fresh context would be, and must not end in a
        chunk of one token: that token would run through the decode kernels, whose float order
        differs from the prompt kernels' where the CPU lacks 8-bit dot products, and the answer
        would differ from a fresh run's. So at most all ids but two, and one fewer where the rest
        would leave a single token in the last chunk.
        """
        if self.runner is None:
            return 0
        limit = min(len(self.context), len(prompt) - 2)
        if limit <= 0:
            return 0
        same = np.asarray(self.context[:limit]) == np.asarray(prompt[:limit])
        keep = limit if same.all() else int(np.argmin(same))
        if keep and (len(prompt) - keep) % self.runner.max_chunk == 1:
            keep -= 1
        return keep


class Engine:
    """Slots, a FIFO queue of requests and the thread that steps them."""

    def __init__(self, open_slots: Callable[[int], Slots], tokenizer: Any, stop_ids: set[int], *,
                 parallel: int = 1, max_queue: int = 16, sleep_idle_s: float | None = None) -> None:
        if parallel < 1 or max_queue < 0:
            raise ValueError(f"parallel must be >= 1 and the queue >= 0, got {parallel} and {max_queue}")
        self._tokenizer = tokenizer
        self._stop_ids = frozenset(stop_ids)
        self._max_queue = max_queue
        self._sleep_idle_s = sleep_idle_s
        self._group: Slots | None = open_slots(parallel)
        self.batch_refused = self._group.batch_refused
        self.slots = [Slot(i, runner) for i, runner in enumerate(self._group.sessions)]
        first = self.slots[0].runner
        assert first is not None
        self.n_ctx = first.n_ctx
        self._queue: collections.deque[Ticket] = collections.deque()
        self._embeddings: collections.deque[EmbeddingJob] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._asleep = False
        self.sleeps = 0  # times the slots gave their memory back, and were loaded again (/health)
        self.wake_ups = 0
        self._last_active = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="ggufc-engine", daemon=True)
        self.tokens_generated = 0  # every sampled token of every request (/health; a freed slot stops adding)
        self.batched_steps = 0  # decode_batch calls, and the tokens they fed (/health)
        self.batched_tokens = 0
        self.prompt_tokens = 0  # of every admitted request, and those a slot's context already held (/metrics)
        self.cached_tokens = 0
        self.prefills_shared = 0  # choices that copied another choice's context instead of reading the prompt
        self.step_sizes: collections.Counter[int] = collections.Counter()  # tokens decoded per step -> steps
        self.finish_reasons: collections.Counter[str] = collections.Counter()  # finish reason (or "error") -> requests
        self.embedded_inputs = 0  # embedding inputs pooled, and their tokens (/metrics)
        self.embedded_tokens = 0

    # ------------------------------------------------------------ HTTP side

    def start(self) -> None:
        self._thread.start()

    def submit(self, generation: Generation, deliver: Callable[[Event], None]) -> Ticket:
        """Queue a request, or raise ServerBusyError when every slot is busy and the queue is full."""
        if len(generation.prompt_ids) > self.n_ctx:
            raise ValueError(f"the prompt has {len(generation.prompt_ids)} tokens, the context {self.n_ctx}")
        ticket = Ticket(generation, deliver, self._wake)
        with self._cond:
            if self._stopping:
                raise ServerBusyError("the server is shutting down")
            free = sum(not s.busy for s in self.slots)
            if len(self._queue) - free >= self._max_queue:
                raise ServerBusyError(
                    f"all {len(self.slots)} slots are busy and {len(self._queue)} requests are queued; retry later")
            self._queue.append(ticket)
            self._cond.notify()
        return ticket

    def submit_embedding(self, request: EmbeddingRequest,
                         deliver: Callable[[list[np.ndarray] | str], None]) -> EmbeddingJob:
        """Queue an embedding request, or raise ServerBusyError when the queue is full."""
        if any(len(ids) > self.n_ctx or not ids for ids in request.inputs) or not request.inputs:
            raise ValueError(f"every input needs 1 to {self.n_ctx} tokens")
        job = EmbeddingJob(request, deliver, self._wake)
        with self._cond:
            if self._stopping:
                raise ServerBusyError("the server is shutting down")
            if len(self._embeddings) >= max(self._max_queue, 1):
                raise ServerBusyError(f"{len(self._embeddings)} embedding requests are queued; retry later")
            self._embeddings.append(job)
            self._cond.notify()
        return job

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {"slots": len(self.slots), "slots_busy": sum(s.busy for s in self.slots),
                    "queued": len(self._queue), "asleep": self._asleep, "sleeps": self.sleeps,
                    "wake_ups": self.wake_ups, "tokens_generated": self.tokens_generated,
                    "batched_decode": self.batch_refused is None, "batched_steps": self.batched_steps,
                    "batched_tokens": self.batched_tokens, "prefills_shared": self.prefills_shared}

    def stop(self) -> None:
        """Refuse new requests, end the ones in flight with an error, join the thread, free the slots."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()
        for slot in self.slots:
            if slot.ticket is not None:
                self._fail(slot, "the server is shutting down")
            slot.runner = None
        if self._group is not None:
            self._group.close()
            self._group = None
        self._refuse_queue("the server is shutting down")

    def _refuse_queue(self, message: str) -> None:
        with self._cond:
            refused, self._queue = list(self._queue), collections.deque()
            jobs, self._embeddings = list(self._embeddings), collections.deque()
        for ticket in refused:
            ticket.finished = True
            ticket.deliver(Event("error", text=message))
        for job in jobs:
            job.finished = True
            job.deliver(message)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # ------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._has_work():
                    self._cond.wait(timeout=self._idle_wait())
                    self._maybe_sleep()
                if self._stopping:
                    return
                waking = self._asleep and bool(self._queue or self._embeddings)
            if waking:  # reload outside the lock: submit() and status() stay answerable meanwhile
                try:
                    self._wake_up()
                except Exception as exc:  # e.g. the artifact went away while asleep: refuse what waits
                    self._refuse_queue(f"cannot reload the model: {one_line(exc)}")
                    continue
            with self._cond:
                admitted = self._admit()
                embedding = self._embeddings[0] if self._embeddings else None
            if embedding is not None:
                self._embed_chunk(embedding)
                self._last_active = time.monotonic()
            if admitted or any(s.busy for s in self.slots):
                self._step()
                self._last_active = time.monotonic()

    def _has_work(self) -> bool:
        return bool(self._queue or self._embeddings) or any(s.busy for s in self.slots)

    def _idle_wait(self) -> float | None:
        if self._sleep_idle_s is None or self._asleep:
            return None
        return max(0.05, self._last_active + self._sleep_idle_s - time.monotonic())

    def _maybe_sleep(self) -> None:
        """After `sleep_idle_s` without work, every slot gives its memory back (weights, kernels'
        scratch, states; `Session.release_device`), keeping a host copy of its context's states, so
        prefix reuse survives the sleep."""
        if self._sleep_idle_s is None or self._asleep or self._queue or self._embeddings:
            return
        if time.monotonic() - self._last_active < self._sleep_idle_s:
            return
        if self._group is not None:
            self._group.release_device()
        self._asleep = True
        self.sleeps += 1

    def _wake_up(self) -> None:
        """Load every slot's weights and states back (engine thread, lock not held)."""
        if self._group is not None:
            self._group.restore_device()
        with self._cond:
            self._asleep = False
            self.wake_ups += 1

    def _embed_chunk(self, job: EmbeddingJob) -> None:
        """Feed one chunk of the first queued embedding request's current input (engine thread,
        lock not held); deliver its vectors once its last input is pooled."""
        try:
            if job.cancelled.is_set():
                self._end_embedding(job, None)
                return
            assert self._group is not None
            embedder = self._group.embedder()
            if job.pooler is None:  # the next input, from an empty context
                job.pooler, job.pending = Pooler(job.request.pooling), list(job.request.inputs[len(job.vectors)])
                embedder.reset()
            chunk, job.pending = job.pending[: embedder.max_chunk], job.pending[embedder.max_chunk :]
            job.pooler.add(embedder.hidden_states(chunk))
            self.embedded_tokens += len(chunk)
            if job.pending:
                return
            job.vectors.append(job.pooler.result())
            job.pooler = None
            self.embedded_inputs += 1
            if len(job.vectors) == len(job.request.inputs):
                self._end_embedding(job, job.vectors)
        except Exception as exc:  # a failing model call ends this request, not the server
            self._end_embedding(job, f"embedding failed: {one_line(exc)}")

    def _end_embedding(self, job: EmbeddingJob, result: list[np.ndarray] | str | None) -> None:
        with self._cond:
            if self._embeddings and self._embeddings[0] is job:
                self._embeddings.popleft()
        job.finished = True
        if result is not None:
            job.deliver(result)

    def _admit(self) -> bool:
        """Move queued requests into free slots (called with the lock held)."""
        admitted = False
        while self._queue:
            ticket = self._queue[0]
            if ticket.cancelled.is_set():
                self._queue.popleft()
                ticket.finished = True
                continue
            free = [s for s in self.slots if not s.busy]
            if not free or self._asleep:
                break
            self._queue.popleft()
            self._assign(ticket, free)
            admitted = True
        return admitted

    def _assign(self, ticket: Ticket, free: list[Slot]) -> None:
        """The free slot holding the longest prefix of the prompt, else the one holding least. A
        choice whose request has a slot still reading the prompt waits for it and copies its context."""
        leader = self._leader_for(ticket.generation)
        if leader is not None:
            slot = min(free, key=lambda s: len(s.context))
            self._start(slot, ticket, pending=[], cached=0)
            slot.leader = leader
            return
        prompt = ticket.generation.prompt_ids
        slot = max(free, key=lambda s: (s.reusable_prefix(prompt), -len(s.context)))
        reused = slot.reusable_prefix(prompt)
        assert slot.runner is not None
        try:
            if reused == 0:
                slot.runner.reset()
            elif reused < len(slot.context):
                slot.runner.truncate(reused)
        except Exception as exc:  # the slot's context is unknown now: the next request resets it
            slot.context = []
            ticket.finished = True
            ticket.deliver(Event("error", text=f"generation failed: {one_line(exc)}"))
            return
        slot.context = slot.context[:reused]
        self._start(slot, ticket, pending=list(prompt[reused:]), cached=reused)

    def _start(self, slot: Slot, ticket: Ticket, *, pending: list[int], cached: int) -> None:
        self.prompt_tokens += len(ticket.generation.prompt_ids)
        self.cached_tokens += cached
        slot.ticket, slot.pending, slot.cached, slot.leader = ticket, pending, cached, None
        slot.logits, slot.produced = None, 0
        slot.decoder = text_stream(self._tokenizer)
        slot.stops = StopStringFilter(ticket.generation.stop_strings)
        slot.chooser, slot.logprobs = TokenChooser(ticket.generation.sampler, ticket.generation.decoding), []

    def _leader_for(self, generation: Generation) -> Slot | None:
        """A busy slot of the same request that has not sampled yet (it reads, or has read, the prompt)."""
        if generation.group is None:
            return None
        return next((s for s in self.slots if s.ticket is not None and s.leader is None and s.produced == 0
                     and s.ticket.generation.group is generation.group), None)

    def _follow_leaders(self) -> None:
        """Followers whose leader has read the whole prompt take its context and logits; those
        whose leader went away read the prompt themselves."""
        for slot in self.slots:
            leader = slot.leader
            if leader is None or slot.ticket is None:
                continue
            group = slot.ticket.generation.group
            if leader.ticket is None or leader.ticket.generation.group is not group or leader.produced > 0:
                slot.leader = None  # gone (or already sampling): read the prompt from scratch
                slot.context, slot.pending = [], list(slot.ticket.generation.prompt_ids)
                assert slot.runner is not None
                slot.runner.reset()
                continue
            if leader.pending or leader.logits is None:
                continue  # still reading
            assert slot.runner is not None and leader.runner is not None
            try:
                slot.runner.copy_context(leader.runner)
            except Exception as exc:
                slot.leader = None
                self._fail_model_call(slot, exc)
                continue
            slot.context, slot.logits, slot.leader = list(leader.context), leader.logits.copy(), None
            self.prefills_shared += 1

    def _step(self) -> None:
        """One chunk of every slot reading a prompt, then one token of every generating slot."""
        sampled: list[tuple[Slot, int]] = []
        self._follow_leaders()
        for slot in self.slots:
            if slot.ticket is None:
                continue
            if slot.ticket.cancelled.is_set():
                self._release(slot)
                continue
            if slot.leader is not None:
                continue  # waits for its leader's prompt
            try:
                if slot.pending:
                    self._prefill_chunk(slot)
                else:
                    token = self._sample(slot)
                    if token is not None:
                        sampled.append((slot, token))
            except Exception as exc:  # a failing model call ends this request, not the server
                self._fail_model_call(slot, exc)
        if sampled:
            self.step_sizes[len(sampled)] += 1
        if len(sampled) > 1 and self.batch_refused is None:
            self._feed_batch(sampled)
        else:
            for slot, token in sampled:
                try:
                    self._feed(slot, [token])
                except Exception as exc:
                    self._fail_model_call(slot, exc)

    def _fail_model_call(self, slot: Slot, exc: Exception) -> None:
        slot.context = []  # what the runner's states hold is unknown now: the next request resets it
        self._fail(slot, f"generation failed: {one_line(exc)}")

    def _feed_batch(self, sampled: list[tuple[Slot, int]]) -> None:
        """Every sampled token in one batched decode call, each slot's row its next logits."""
        assert self._group is not None
        try:
            logits = self._group.decode_batch([(slot.index, token) for slot, token in sampled])
        except Exception as exc:
            for slot, _ in sampled:
                self._fail_model_call(slot, exc)
            return
        self.batched_steps += 1
        self.batched_tokens += len(sampled)
        for row, (slot, token) in enumerate(sampled):
            slot.logits = logits[row].copy()
            slot.context.append(token)

    def _feed(self, slot: Slot, ids: list[int]) -> None:
        assert slot.runner is not None
        slot.logits = slot.runner.forward(ids)
        slot.context.extend(ids)

    def _prefill_chunk(self, slot: Slot) -> None:
        assert slot.runner is not None
        chunk, slot.pending = slot.pending[: slot.runner.max_chunk], slot.pending[slot.runner.max_chunk :]
        self._feed(slot, chunk)

    def _sample(self, slot: Slot) -> int | None:
        """Sample the next token as `runtime.generate` does and send its text; the token to feed
        next, or None when the generation ended."""
        assert slot.ticket is not None and slot.logits is not None and slot.decoder is not None
        assert slot.chooser is not None
        generation = slot.ticket.generation
        token, logprob = slot.chooser.choose(slot.logits)
        if token in self._stop_ids:
            self._finish(slot, FINISH_STOP)
            return None
        if logprob is not None:
            slot.logprobs.append(logprob)
        slot.produced += 1
        self.tokens_generated += 1
        text, stopped = slot.stops.feed(slot.decoder.feed(token))
        if text:
            slot.ticket.deliver(Event("text", text=text, logprobs=slot.take_logprobs()))
        if stopped:
            self._finish(slot, FINISH_STOP, flush=False)
        elif slot.produced >= generation.max_tokens or len(slot.context) >= self.n_ctx:
            self._finish(slot, FINISH_LENGTH)
        else:
            return int(token)
        return None

    def _finish(self, slot: Slot, reason: str, *, flush: bool = True) -> None:
        assert slot.ticket is not None and slot.decoder is not None
        if flush:
            text, stopped = slot.stops.feed(slot.decoder.flush())
            text += "" if stopped else slot.stops.finish()
            reason = FINISH_STOP if stopped else reason
            if text:
                slot.ticket.deliver(Event("text", text=text, logprobs=slot.take_logprobs()))
        prompt = len(slot.ticket.generation.prompt_ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": slot.produced,
                 "total_tokens": prompt + slot.produced, "cached_tokens": slot.cached}
        slot.ticket.finished = True
        self.finish_reasons[reason] += 1
        slot.ticket.deliver(Event("done", finish_reason=reason, usage=usage, logprobs=slot.take_logprobs()))
        self._release(slot)

    def _fail(self, slot: Slot, message: str) -> None:
        assert slot.ticket is not None
        slot.ticket.finished = True
        self.finish_reasons["error"] += 1
        slot.ticket.deliver(Event("error", text=message))
        self._release(slot)

    def _release(self, slot: Slot) -> None:
        """The slot serves nothing; the ids it fed stay in its context for a later prefix match."""
        if slot.ticket is not None:
            slot.ticket.finished = True
        slot.ticket, slot.pending, slot.logits, slot.decoder, slot.chooser = None, [], None, None, None
        slot.leader = None
