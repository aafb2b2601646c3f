"""`/metrics` of `ggufc serve` in Prometheus' text format (prometheus_client): requests by
endpoint and status, prompt, generated and embedded tokens, the queue and busy slots, and how many tokens
each decode step fed (the batch sizes continuous batching reached)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class ServerMetrics(Collector):
    """Read at each scrape: the engine's own counters, and the HTTP side's request counts."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self._requests[(endpoint, str(status))] += 1

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("ggufc_requests", "HTTP requests answered, by endpoint and status",
                                       labels=["endpoint", "status"])
        with self._lock:
            for (endpoint, status), count in sorted(self._requests.items()):
                requests.add_metric([endpoint, status], count)
        yield requests
        engine = self.engine
        status = engine.status()
        yield CounterMetricFamily("ggufc_prompt_tokens", "prompt tokens of admitted requests",
                                  value=engine.prompt_tokens)
        yield CounterMetricFamily("ggufc_prompt_tokens_cached", "prompt tokens a slot's context already held",
                                  value=engine.cached_tokens)
        yield CounterMetricFamily("ggufc_generation_tokens", "tokens generated", value=status["tokens_generated"])
        finished = CounterMetricFamily("ggufc_generations_finished", "generations ended, by finish reason",
                                       labels=["reason"])
        for reason, count in sorted(dict(engine.finish_reasons).items()):
            finished.add_metric([reason], count)
        yield finished
        yield CounterMetricFamily("ggufc_embedding_inputs", "inputs embedded (/v1/embeddings)",
                                  value=engine.embedded_inputs)
        yield CounterMetricFamily("ggufc_embedding_tokens", "tokens of the inputs embedded",
                                  value=engine.embedded_tokens)
        yield GaugeMetricFamily("ggufc_queue_length", "requests waiting for a slot", value=status["queued"])
        yield GaugeMetricFamily("ggufc_slots_busy", "slots serving a request", value=status["slots_busy"])
        yield GaugeMetricFamily("ggufc_slots", "slots", value=status["slots"])
        yield _batch_histogram(dict(engine.step_sizes))


def _batch_histogram(sizes: dict[int, int]) -> HistogramMetricFamily:
    """Decode steps by the number of tokens they fed (one per generating slot)."""
    buckets, running = [], 0
    for bound in BATCH_BUCKETS:
        running = sum(n for size, n in sizes.items() if size <= bound)
        buckets.append((str(bound), running))
    total = sum(sizes.values())
    buckets.append(("+Inf", total))
    return HistogramMetricFamily("ggufc_decode_batch_size", "tokens fed per decode step", buckets=buckets,
                                 sum_value=sum(size * n for size, n in sizes.items()))
