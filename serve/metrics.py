"""Prometheus metrics of one server, in its own registry.

Two sources: request latencies the HTTP layer observes (TTFT, TPOT, E2E
histograms; generated tokens for the tokens/s gauge), and a snapshot of
``engine.stats()`` taken on the engine loop at scrape time (queued and running
requests per scheduler queue and class, KV blocks on device and host,
preemptions, swaps, token totals), exported by a custom collector.

Each figure is exported twice: under our ``fluidserve_*`` names, and under
the ``vllm:*`` names (with a ``model_name`` label) that dashboards,
autoscalers and inference gateways built for vLLM read, with vLLM's
meanings. Process metrics (CPU, memory, file descriptors, GC) come with them.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Iterable

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
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


class CounterRate:
    """Per-second rate of a cumulative count sampled at scrape time: over the
    samples of the last ``window`` seconds, plus the one just before them."""

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self._samples: deque[tuple[float, float]] = deque()

    def sample(self, value: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, value))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()

    def rate(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self._samples[0], self._samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


class EngineStatsCollector:
    """Exports the latest engine stats snapshot (set by ``update``)."""

    def __init__(self) -> None:
        self.stats: Any = None
        self.offline_rate = CounterRate()

    def update(self, stats: Any) -> None:
        if stats is not None:
            self.stats = stats
            self.offline_rate.sample(float(getattr(stats, "offline_generation_tokens_total", 0) or 0))

    def collect(self) -> Iterable[Metric]:
        s = self.stats
        if s is None:
            return
        yield from self._requests(s)
        yield from self._kv(s)
        yield from self._preemptions(s)
        yield GaugeMetricFamily(f"{PREFIX}_offline_generation_tokens_per_second",
                                f"Tokens generated per second for offline requests, between engine snapshots "
                                f"at least {RATE_WINDOW_S:.0f} s apart when scraped that rarely",
                                value=self.offline_rate.rate())
        for name, attr, doc in (
            ("preemptions", "num_preemptions", "Requests preempted by the scheduler (swapped out or recomputed)"),
            ("swaps", "num_swaps", "Requests whose KV moved between device and host (out + in)"),
            ("swap_out_bytes", "swap_out_bytes", "KV bytes copied from device to host"),
            ("swap_in_bytes", "swap_in_bytes", "KV bytes copied from host to device"),
            ("swap_stall_seconds", "swap_stall_seconds", "Time steps waited on KV copies before the forward"),
            ("prompt_tokens", "prompt_tokens_total", "Prompt tokens processed"),
            ("generation_tokens", "generation_tokens_total", "Tokens generated"),
            ("offline_engine_generation_tokens", "offline_generation_tokens_total",
             "Tokens generated for offline requests (batch lines and requests marked offline)"),
            ("steps_abandoned", "num_steps_abandoned", "Offline-only steps interrupted at a layer safepoint"),
            ("steps_resumed", "num_steps_resumed",
             "Interrupted offline-only steps continued from their safepoint (no layer run twice)"),
            ("abandoned_tokens", "abandoned_tokens",
             "Tokens of interrupted steps computed again from layer 0 (not resumed)"),
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

    def _preemptions(self, s: Any) -> Iterable[Metric]:
        fam = CounterMetricFamily(f"{PREFIX}_preemptions_by_kind",
                                  "Request preemptions by what happened to the KV: swapped to the host, "
                                  "discarded and recomputed, or its step abandoned at a layer safepoint "
                                  "(that step's tokens recomputed)", labels=["kind"])
        total = int(getattr(s, "num_preemptions", 0) or 0)
        recomputes = int(getattr(s, "num_recomputes", 0) or 0)
        checkpointed = int(getattr(s, "num_checkpoint_evictions", 0) or 0)
        fam.add_metric(["swap"], float(total - recomputes - checkpointed))
        fam.add_metric(["evicted_with_checkpoint"], float(checkpointed))
        fam.add_metric(["recomputed"], float(recomputes))
        fam.add_metric(["step_abandoned"], float(getattr(s, "num_abandoned_preemptions", 0) or 0))
        yield fam
        ckpt = CounterMetricFamily(f"{PREFIX}_kv_checkpoint_bytes",
                                   "KV copied to the host by incremental checkpointing of offline requests")
        ckpt.add_metric([], float(getattr(s, "checkpoint_bytes", 0) or 0))
        yield ckpt

    def _kv(self, s: Any) -> Iterable[Metric]:
        used = GaugeMetricFamily(f"{PREFIX}_kv_blocks_used", "KV cache blocks in use", labels=["tier"])
        total = GaugeMetricFamily(f"{PREFIX}_kv_blocks_total", "KV cache blocks in the pool", labels=["tier"])
        for tier, prefix in (("device", "kv_blocks"), ("host", "kv_host_blocks")):
            used.add_metric([tier], float(getattr(s, f"{prefix}_used", 0) or 0))
            total.add_metric([tier], float(getattr(s, f"{prefix}_total", 0) or 0))
        yield used
        yield total
        # Tokens by tier: every prompt token is looked up on the device; those
        # not found there are looked up on the host (when it caches too).
        for name, doc, by_tier in (
            ("queries", "Prompt tokens looked up in the prefix cache",
             (("device", "prefix_cache_query_tokens"), ("host", "prefix_cache_host_query_tokens"))),
            ("hits", "Prompt tokens found in the prefix cache",
             (("device", "prefix_cache_hit_tokens"), ("host", "prefix_cache_host_hit_tokens"))),
        ):
            fam = CounterMetricFamily(f"{PREFIX}_prefix_cache_{name}", doc, labels=["tier"])
            for tier, attr in by_tier:
                fam.add_metric([tier], float(getattr(s, attr, 0) or 0))
            yield fam


class VllmStatsCollector:
    """The engine stats snapshot under vLLM's names: running / waiting
    requests, KV usage as a fraction, preemption and token counters."""

    def __init__(self, engine: EngineStatsCollector, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        s = self.engine.stats
        if s is None:
            return
        by_status: dict[str, int] = {}
        for (status, _queue, _klass), count in _request_counts(getattr(s, "requests", None) or {}):
            by_status[status] = by_status.get(status, 0) + count
        label = [self.model_name]
        gauges = (
            ("num_requests_running", "Requests holding KV on the device and being run", by_status.get("running", 0)),
            # vLLM counts a preempted request as waiting again.
            ("num_requests_waiting", "Requests waiting to be scheduled",
             by_status.get("waiting", 0) + by_status.get("preempted", 0)),
            ("num_requests_swapped", "Requests whose KV is on the host",
             by_status.get("swapped", 0) + by_status.get("swapping_in", 0)),
            ("kv_cache_usage_perc", "Fraction of device KV cache blocks in use (0 to 1)",
             (s.kv_blocks_used / s.kv_blocks_total) if getattr(s, "kv_blocks_total", 0) else 0.0),
        )
        for name, doc, value in gauges:
            fam = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            fam.add_metric(label, float(value))
            yield fam
        for name, attr, doc in (
            ("num_preemptions", "num_preemptions", "Cumulative preemptions by the scheduler"),
            ("prefix_cache_queries", "prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hits", ("prefix_cache_hit_tokens", "prefix_cache_host_hit_tokens"),
             "Prompt tokens found in the prefix cache"),
            ("prompt_tokens", "prompt_tokens_total", "Prompt tokens processed"),
            ("generation_tokens", "generation_tokens_total", "Generation tokens processed"),
        ):
            fam = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            attrs = attr if isinstance(attr, tuple) else (attr,)  # hits: both tiers
            fam.add_metric(label, float(sum(getattr(s, a, 0) or 0 for a in attrs)))
            yield fam


REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)


class VllmRequestMetrics:
    """Per-request histograms and counters under vLLM's names, each bound to
    this server's ``model_name`` label."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def hist(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(f"vllm:{name}", doc, ["model_name"], buckets=buckets,
                             registry=registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive outputs of a request",
                        ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Mean time per output token after the first, per request", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency", REQUEST_TIME_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time from arrival to first being scheduled",
                          REQUEST_TIME_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds",
                            "Time from first being scheduled to the first token", REQUEST_TIME_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Time from the first token to the last",
                           REQUEST_TIME_BUCKETS)
        self.inference = hist("request_inference_time_seconds",
                              "Time from first being scheduled to the last token", REQUEST_TIME_BUCKETS)
        self.success = Counter("vllm:request_success", "Requests finished, by reason",
                               ["model_name", "finished_reason"], registry=registry)
        for reason in ("stop", "length", "abort", "error"):  # zeros from the start, not gaps
            self.success.labels(model_name, reason)
        self.model_name = model_name


KLASSES = ("online", "offline")
STATUSES = ("waiting", "running", "swapped", "swapping_in", "finished")


def _request_counts(counts: dict) -> list[tuple[tuple[str, str, str], int]]:
    """``engine.stats().requests`` — keyed by (class, status), optionally with
    the scheduler queue as a third part — as ((status, queue, class), count).
    Waiting, running and swapped always appear for both classes, so a dashboard
    sees zeros rather than gaps."""
    out: dict[tuple[str, str, str], int] = {(st, "all", k): 0 for st in ("waiting", "running", "swapped")
                                            for k in KLASSES}
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

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.vllm = VllmRequestMetrics(r, model_name)
        for collector in (ProcessCollector(registry=None), GC_COLLECTOR, PLATFORM_COLLECTOR):
            r.register(collector)
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
        r.register(VllmStatsCollector(self.engine, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency of one engine request, reported into ``ServerMetrics``."""

    def __init__(self, metrics: ServerMetrics, start: float | None = None) -> None:
        self.metrics = metrics
        self.start = time.monotonic() if start is None else start
        self.first: float | None = None
        self.last: float | None = None  # the latest output with new tokens
        self.scheduled: float | None = None  # when the engine first ran it
        self.tokens: dict[int, int] = {}

    def on_output(self, out: Any) -> None:
        now = time.monotonic()
        new = sum(len(co.new_token_ids) for co in out.outputs)
        if self.scheduled is None and getattr(out, "first_scheduled_time", None) is not None:
            self.scheduled = out.first_scheduled_time
        if new and self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
            self.metrics.vllm.ttft.observe(now - self.start)
        elif new and self.last is not None:
            self.metrics.vllm.itl.observe(now - self.last)
        if new:
            self.last = now
        self.metrics.rate.add(new, now)
        for co in out.outputs:
            self.tokens[co.index] = len(co.token_ids)
        if out.finished:
            self._finish(out, now)

    def _finish(self, out: Any, now: float) -> None:
        v = self.metrics.vllm
        self.metrics.e2e.observe(now - self.start)
        v.e2e.observe(now - self.start)
        longest = max(self.tokens.values(), default=0)
        if self.first is not None and longest > 1:
            self.metrics.tpot.observe((now - self.first) / (longest - 1))
            v.tpot.observe((now - self.first) / (longest - 1))
        if self.scheduled is not None:
            v.queue.observe(max(0.0, self.scheduled - self.start))
            v.inference.observe(max(0.0, now - self.scheduled))
            if self.first is not None:
                v.prefill.observe(max(0.0, self.first - self.scheduled))
        if self.first is not None:
            v.decode.observe(now - self.first)
        for co in out.outputs:
            self.metrics.finished.labels(co.finish_reason or "unknown").inc()
            v.success.labels(v.model_name, co.finish_reason or "unknown").inc()
