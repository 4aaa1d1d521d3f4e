"""Prometheus metrics of one server, in its own registry.

Two sources: request latencies the HTTP layer observes (TTFT, TPOT, E2E
histograms; generated tokens for the tokens/s gauge), and a snapshot of
``engine.stats()`` taken on the engine loop at scrape time (queued and running
requests per scheduler queue and class, KV blocks on device and host,
preemptions, swaps, token totals), exported by a custom collector.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "fluidserve"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                         0.75, 1.0, 2.5)
RATE_WINDOW_S = 10.0


class TokenRate:
    """Generated tokens per second over the last ``window`` seconds."""

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self.started = time.monotonic()
        self._events: deque[tuple[float, int]] = deque()

    def add(self, num_tokens: int, now: float | None = None) -> None:
        if num_tokens:
            now = time.monotonic() if now is None else now
            self._events.append((now, num_tokens))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window:
            self._events.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        span = min(self.window, max(now - self.started, 1e-3))
        return sum(n for _, n in self._events) / span


class EngineStatsCollector:
    """Exports the latest engine stats snapshot (set by ``update``)."""

    def __init__(self) -> None:
        self.stats: Any = None

    def update(self, stats: Any) -> None:
        if stats is not None:
            self.stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self.stats
        if s is None:
            return
        yield from self._requests(s)
        yield from self._kv(s)
        for name, attr, doc in (
            ("preemptions", "num_preemptions", "Requests preempted by the scheduler"),
            ("swaps", "num_swaps", "KV swap operations between device and host"),
            ("prompt_tokens", "prompt_tokens_total", "Prompt tokens processed"),
            ("generation_tokens", "generation_tokens_total", "Tokens generated"),
        ):
            if hasattr(s, attr):
                yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(getattr(s, attr)))

    def _requests(self, s: Any) -> Iterable[Metric]:
        fam = GaugeMetricFamily(f"{PREFIX}_num_requests",
                                "Unfinished requests in the scheduler, by status, queue and class",
                                labels=["status", "queue", "klass"])
        for (status, queue, klass), count in _request_counts(getattr(s, "requests", None) or {}):
            fam.add_metric([status, queue, klass], float(count))
        yield fam

    def _kv(self, s: Any) -> Iterable[Metric]:
        used = GaugeMetricFamily(f"{PREFIX}_kv_blocks_used", "KV cache blocks in use", labels=["tier"])
        total = GaugeMetricFamily(f"{PREFIX}_kv_blocks_total", "KV cache blocks in the pool", labels=["tier"])
        for tier, prefix in (("device", "kv_blocks"), ("host", "kv_host_blocks")):
            used.add_metric([tier], float(getattr(s, f"{prefix}_used", 0) or 0))
            total.add_metric([tier], float(getattr(s, f"{prefix}_total", 0) or 0))
        yield used
        yield total


KLASSES = ("online", "offline")
STATUSES = ("waiting", "running", "swapped", "preempted", "finished")


def _request_counts(counts: dict) -> list[tuple[tuple[str, str, str], int]]:
    """``engine.stats().requests`` — keyed by (class, status), optionally with
    the scheduler queue as a third part — as ((status, queue, class), count).
    Both waiting and running always appear for both classes, so a dashboard
    sees zeros rather than gaps."""
    out: dict[tuple[str, str, str], int] = {(st, "all", k): 0 for st in ("waiting", "running") for k in KLASSES}
    for key, count in counts.items():
        parts = [str(getattr(k, "value", k)) for k in (key if isinstance(key, tuple) else (key,))]
        klass = next((p for p in parts if p in KLASSES), "all")
        status = next((p for p in parts if p in STATUSES), "all")
        rest = [p for p in parts if p not in (klass, status)]
        label = (status, rest[0] if rest else "all", klass)
        out[label] = out.get(label, 0) + int(count)
    return sorted(out.items())


class ServerMetrics:
    """The registry a server's /metrics endpoint renders."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.finished = Counter(f"{PREFIX}_requests_finished", "Requests finished, by reason",
                                ["finish_reason"], registry=r)
        self.in_flight = Gauge(f"{PREFIX}_requests_in_flight", "Requests the frontend is serving", registry=r)
        self.healthy = Gauge(f"{PREFIX}_engine_healthy", "1 while the engine loop is alive and stepping",
                             registry=r)
        self.rate = TokenRate()
        # Batch API (serve/batches.py): offline work beside the online latencies above.
        self.batches = Gauge(f"{PREFIX}_batches", "Batches by status", ["status"], registry=r)
        self.offline_in_flight = Gauge(f"{PREFIX}_offline_requests_in_flight",
                                       "Batch lines in the engine now", registry=r)
        self.offline_tokens = Counter(f"{PREFIX}_offline_generation_tokens",
                                      "Tokens generated for batch lines", registry=r)
        Gauge(f"{PREFIX}_generation_tokens_per_second", f"Tokens generated per second over the last "
              f"{RATE_WINDOW_S:.0f} s", registry=r).set_function(self.rate.rate)
        self.engine = EngineStatsCollector()
        r.register(self.engine)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency of one engine request, reported into ``ServerMetrics``."""

    def __init__(self, metrics: ServerMetrics, start: float | None = None) -> None:
        self.metrics = metrics
        self.start = time.monotonic() if start is None else start
        self.first: float | None = None
        self.tokens: dict[int, int] = {}

    def on_output(self, out: Any) -> None:
        now = time.monotonic()
        new = sum(len(co.new_token_ids) for co in out.outputs)
        if new and self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
        self.metrics.rate.add(new, now)
        for co in out.outputs:
            self.tokens[co.index] = len(co.token_ids)
        if out.finished:
            self._finish(out, now)

    def _finish(self, out: Any, now: float) -> None:
        self.metrics.e2e.observe(now - self.start)
        longest = max(self.tokens.values(), default=0)
        if self.first is not None and longest > 1:
            self.metrics.tpot.observe((now - self.first) / (longest - 1))
        for co in out.outputs:
            self.metrics.finished.labels(co.finish_reason or "unknown").inc()
