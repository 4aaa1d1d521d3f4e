"""Prometheus metrics of one server, in its own registry.

Two sources: what the HTTP layer observes of each request (``RequestTimer``:
TTFT, inter-token gaps, TPOT, end-to-end and phase times, prompt and
generation lengths, ``n`` and ``max_tokens``, prompt tokens by source), and
snapshots of ``engine.stats()`` taken on the engine loop at scrape time, one
per data-parallel replica (queued and running requests per scheduler queue
and class, KV blocks on device and host, preemptions, swaps, token totals,
tokens per step, the cache config), exported by custom collectors.

Each figure is exported under our ``fluidserve_*`` names and under vLLM's
``vllm:*`` names, types, labels (``model_name``, ``engine``) and buckets, so
dashboards, autoscalers and inference gateways built for vLLM read it with
vLLM's meaning. Replica health, the router's counters and process metrics
(CPU, memory, file descriptors, GC) come with them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from fluidserve.engine.engine import ITERATION_TOKEN_BUCKETS

log = logging.getLogger(__name__)

PREFIX = "fluidserve"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                         0.75, 1.0, 2.5)
RATE_WINDOW_S = 10.0

# vLLM's buckets, labels and label values.
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
VLLM_LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
DEFAULT_MAX_MODEL_LEN = 4096  # sizes the token-count buckets when the server does not say


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


def per_engine(stats: Any) -> dict[str, Any]:
    """``EngineStatsCollector.update``'s argument as {engine index: stats};
    a single snapshot is engine "0"."""
    if isinstance(stats, dict):
        return {str(k): v for k, v in stats.items() if v is not None}
    return {} if stats is None else {"0": stats}


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


_ENGINE_COUNTERS = (
    ("preemptions", "num_preemptions", "Requests preempted by the scheduler (swapped out or recomputed)"),
    ("swaps", "num_swaps", "Requests whose KV moved between device and host (out + in)"),
    ("swap_out_bytes", "swap_out_bytes", "KV bytes copied from device to host"),
    ("swap_in_bytes", "swap_in_bytes", "KV bytes copied from host to device"),
    ("swap_stall_seconds", "swap_stall_seconds", "Time steps waited on KV copies before the forward"),
    ("backfills", "num_backfills",
     "Requests admitted into device KV owed to streams on the host, leaving by their max_tokens before any could "
     "come back (KV loans' backfilling)"),
    ("prompt_tokens", "prompt_tokens_total", "Prompt tokens processed"),
    ("generation_tokens", "generation_tokens_total", "Tokens generated"),
    ("offline_engine_generation_tokens", "offline_generation_tokens_total",
     "Tokens generated for offline requests (batch lines and requests marked offline)"),
    ("steps_abandoned", "num_steps_abandoned", "Offline-only steps interrupted at a layer safepoint"),
    ("steps_resumed", "num_steps_resumed",
     "Interrupted offline-only steps continued from their safepoint (no layer run twice)"),
    ("abandoned_tokens", "abandoned_tokens", "Tokens of interrupted steps computed again from layer 0 (not resumed)"),
    ("steps_failed", "num_failed_steps",
     "Steps whose forward or sampling raised, the device sound: their requests failed, the engine served on"),
    ("requests_failed", "num_failed_requests", "Requests failed by a failed step (finish reason error)"),
    ("steps_launched_ahead", "num_steps_launched_ahead",
     "Decode steps queued before the previous step's tokens were read (--async-scheduling; with "
     "--speculative-config, the steps that carry no drafts)"),
    ("spec_decode_draft_tokens_withheld", "spec_num_withheld_tokens",
     "Draft tokens found but not verified: the adaptive policy judged they would cost the step more time than "
     "their chance of standing saves (--speculative-config)"),
    ("cpu_thread_changes", "num_cpu_thread_changes",
     "Times the threads a CPU step computes on changed: one left while they waited for cores, or one came back "
     "(--yield-busy-cores)"),
    ("cpu_thread_trials", "num_cpu_thread_trials",
     "Trials of steps alternating between two thread counts, begun when the threads waited for cores or to probe "
     "whether a neighbour left (--yield-busy-cores); the faster count stayed"),
)


class EngineStatsCollector:
    """Exports the latest engine stats snapshots (set by ``update``): one
    engine's, or each data-parallel replica's. Given replicas (a dict), every
    ``fluidserve_*`` series carries an ``engine`` label; a single engine's
    keep the label sets they have always had, so existing alerts match."""

    def __init__(self) -> None:
        self.by_engine: dict[str, Any] = {}
        self.replicated = False
        self.offline_rates: dict[str, CounterRate] = {}

    @property
    def stats(self) -> Any:
        """Engine "0"'s snapshot."""
        return self.by_engine.get("0")

    def update(self, stats: Any) -> None:
        """``stats``: one ``EngineStats`` (engine "0"), or a
        ``dict[str, EngineStats]`` keyed by engine index; None keeps the last."""
        if stats is None:
            return
        self.replicated = isinstance(stats, dict)
        self.by_engine = per_engine(stats)
        for engine, s in self.by_engine.items():
            rate = self.offline_rates.setdefault(engine, CounterRate())
            rate.sample(float(getattr(s, "offline_generation_tokens_total", 0) or 0))

    # Family and sample helpers: the engine label first, where there is one.
    def _family(self, cls: type, name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
        return cls(f"{PREFIX}_{name}", doc, labels=[*(("engine",) if self.replicated else ()), *labels])

    def _add(self, fam: Any, engine: str, labels: Iterable[str], value: float) -> None:
        fam.add_metric([*((engine,) if self.replicated else ()), *labels], float(value or 0))

    def collect(self) -> Iterable[Metric]:
        if not self.by_engine:
            return
        yield from self._requests()
        yield from self._kv()
        yield from self._preemptions()
        rate = self._family(GaugeMetricFamily, "offline_generation_tokens_per_second",
                            f"Tokens generated per second for offline requests, between engine snapshots at "
                            f"least {RATE_WINDOW_S:.0f} s apart when scraped that rarely")
        for engine in self.by_engine:
            self._add(rate, engine, (), self.offline_rates[engine].rate())
        yield rate
        threads = self._family(GaugeMetricFamily, "cpu_threads",
                               "Threads CPU steps compute on, a trial's alternating steps aside "
                               "(--yield-busy-cores; 0: not watched)")
        for engine, s in self.by_engine.items():
            self._add(threads, engine, (), getattr(s, "cpu_threads", 0))
        yield threads
        for name, attr, doc in _ENGINE_COUNTERS:
            fam = self._family(CounterMetricFamily, name, doc)
            for engine, s in self.by_engine.items():
                if hasattr(s, attr):
                    self._add(fam, engine, (), getattr(s, attr))
            yield fam

    def _requests(self) -> Iterable[Metric]:
        fam = self._family(GaugeMetricFamily, "num_requests",
                           "Unfinished requests in the scheduler, by status, queue and class",
                           ("status", "queue", "klass"))
        for engine, s in self.by_engine.items():
            for labels, count in _request_counts(getattr(s, "requests", None) or {}):
                self._add(fam, engine, labels, count)
        yield fam

    def _preemptions(self) -> Iterable[Metric]:
        fam = self._family(CounterMetricFamily, "preemptions_by_kind",
                           "Request preemptions by what happened to the KV: swapped to the host, discarded and "
                           "recomputed, or its step abandoned at a layer safepoint (that step's tokens recomputed)",
                           ("kind",))
        ckpt = self._family(CounterMetricFamily, "kv_checkpoint_bytes",
                            "KV copied to the host by incremental checkpointing of offline requests")
        for engine, s in self.by_engine.items():
            total = int(getattr(s, "num_preemptions", 0) or 0)
            recomputes = int(getattr(s, "num_recomputes", 0) or 0)
            checkpointed = int(getattr(s, "num_checkpoint_evictions", 0) or 0)
            self._add(fam, engine, ("swap",), total - recomputes - checkpointed)
            self._add(fam, engine, ("evicted_with_checkpoint",), checkpointed)
            self._add(fam, engine, ("recomputed",), recomputes)
            self._add(fam, engine, ("step_abandoned",), getattr(s, "num_abandoned_preemptions", 0))
            self._add(ckpt, engine, (), getattr(s, "checkpoint_bytes", 0))
        yield fam
        yield ckpt

    def _kv(self) -> Iterable[Metric]:
        used = self._family(GaugeMetricFamily, "kv_blocks_used", "KV cache blocks in use", ("tier",))
        total = self._family(GaugeMetricFamily, "kv_blocks_total", "KV cache blocks in the pool", ("tier",))
        # Tokens by tier: every prompt token is looked up on the device; those
        # not found there are looked up on the host (when it caches too).
        queries = self._family(CounterMetricFamily, "prefix_cache_queries",
                               "Prompt tokens looked up in the prefix cache", ("tier",))
        hits = self._family(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache",
                            ("tier",))
        for engine, s in self.by_engine.items():
            for tier, prefix in (("device", "kv_blocks"), ("host", "kv_host_blocks")):
                self._add(used, engine, (tier,), getattr(s, f"{prefix}_used", 0))
                self._add(total, engine, (tier,), getattr(s, f"{prefix}_total", 0))
            for tier, infix in (("device", ""), ("host", "host_")):
                self._add(queries, engine, (tier,), getattr(s, f"prefix_cache_{infix}query_tokens", 0))
                self._add(hits, engine, (tier,), getattr(s, f"prefix_cache_{infix}hit_tokens", 0))
        yield from (used, total, queries, hits)


def _vllm_waiting(s: Any) -> dict[str, int]:
    """Requests not running, by vLLM's reasons. vLLM counts a preempted
    request as waiting; ours may wait with its KV on the host (swapped), for
    device room as any other: capacity. A swap-in under way is a KV transfer
    the request waits on before it can run: deferred, as vLLM's wait for
    remote KV is."""
    by_status: dict[str, int] = {}
    for (status, _queue, _klass), count in _request_counts(getattr(s, "requests", None) or {}):
        by_status[status] = by_status.get(status, 0) + count
    return {
        "running": by_status.get("running", 0),
        "capacity": by_status.get("waiting", 0) + by_status.get("swapped", 0),
        "deferred": by_status.get("swapping_in", 0),
        "swapped": by_status.get("swapped", 0) + by_status.get("swapping_in", 0),
    }


class VllmStatsCollector:
    """The engine stats snapshots under vLLM's names, one ``engine`` label
    value per replica: scheduler state, KV usage, prefix-cache and token
    counters, tokens per step, the cache config."""

    def __init__(self, engine: EngineStatsCollector, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        engines = self.engine.by_engine
        if not engines:
            return
        yield from self._scheduler(engines)
        yield from self._counters(engines)
        yield self._iteration_tokens(engines)
        yield from self._spec_decode(engines)
        info = self._cache_config(engines)
        if info is not None:
            yield info
        lora = self._lora(engines)
        if lora is not None:
            yield lora

    def _family(self, cls: type, name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
        return cls(f"vllm:{name}", doc, labels=[*VLLM_LABELS, *extra])

    def _scheduler(self, engines: dict[str, Any]) -> Iterable[Metric]:
        g = GaugeMetricFamily
        running = self._family(g, "num_requests_running", "Number of requests in model execution batches.")
        waiting = self._family(g, "num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = self._family(g, "num_requests_waiting_by_reason",
                                 "Number of waiting requests by reason: 'capacity' = waiting for device room "
                                 "(new, preempted or swapped to the host); 'deferred' = waiting on its KV's copy "
                                 "back from the host. Sum of all reasons equals vllm:num_requests_waiting.",
                                 ("reason",))
        swapped = self._family(g, "num_requests_swapped",
                               "Number of requests whose KV is on the host (vLLM V0's name).")
        usage = self._family(g, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        gpu_usage = self._family(g, "gpu_cache_usage_perc",
                                 "GPU KV-cache usage. 1 means 100 percent usage. "
                                 "DEPRECATED: Use vllm:kv_cache_usage_perc instead.")
        sleep = self._family(g, "engine_sleep_state", "Engine sleep state; awake = 1 means the engine is awake "
                             "(the engine does not sleep).", ("sleep_state",))
        for engine, s in engines.items():
            labels = [self.model_name, engine]
            w = _vllm_waiting(s)
            running.add_metric(labels, float(w["running"]))
            waiting.add_metric(labels, float(w["capacity"] + w["deferred"]))
            for reason in WAITING_REASONS:
                by_reason.add_metric([*labels, reason], float(w[reason]))
            swapped.add_metric(labels, float(w["swapped"]))
            total = getattr(s, "kv_blocks_total", 0) or 0
            frac = (getattr(s, "kv_blocks_used", 0) or 0) / total if total else 0.0
            usage.add_metric(labels, frac)
            gpu_usage.add_metric(labels, frac)
            for state in SLEEP_STATES:
                sleep.add_metric([*labels, state], 1.0 if state == "awake" else 0.0)
        yield from (running, waiting, by_reason, swapped, usage, gpu_usage, sleep)

    def _counters(self, engines: dict[str, Any]) -> Iterable[Metric]:
        # (name, EngineStats attribute or None for a figure we never have, doc)
        for name, attr, doc in (
            ("num_preemptions", "num_preemptions", "Cumulative number of preemption from the engine."),
            ("prompt_tokens", "prompt_tokens_total", "Number of prefill tokens processed."),
            ("generation_tokens", "generation_tokens_total", "Number of generation tokens processed."),
            ("prefix_cache_queries", "prefix_cache_query_tokens",
             "Prefix cache queries, in terms of number of queried tokens (device tier)."),
            ("prefix_cache_hits", "prefix_cache_hit_tokens",
             "Prefix cache hits, in terms of number of cached tokens (device tier)."),
            # The host tier is our KV offload: vLLM reports its offload
            # connector's lookups as external.
            ("external_prefix_cache_queries", "prefix_cache_host_query_tokens",
             "External prefix cache queries, in terms of number of queried tokens (host tier: prompt tokens "
             "not found on the device)."),
            ("external_prefix_cache_hits", "prefix_cache_host_hit_tokens",
             "External prefix cache hits, in terms of number of cached tokens (host tier, copied back)."),
            ("mm_cache_queries", None, "Multi-modal cache queries, in terms of number of queried items."),
            ("mm_cache_hits", None, "Multi-modal cache hits, in terms of number of cached items."),
            # The prefix cache always leaves the prompt's last block to compute,
            # so no cached token is ever computed again.
            ("prompt_tokens_recomputed", None, "Number of cached tokens recomputed for forward pass."),
        ):
            fam = self._family(CounterMetricFamily, name, doc)
            for engine, s in engines.items():
                fam.add_metric([self.model_name, engine], float(getattr(s, attr, 0) or 0) if attr else 0.0)
            yield fam

    def _iteration_tokens(self, engines: dict[str, Any]) -> Metric:
        fam = self._family(HistogramMetricFamily, "iteration_tokens_total",
                           "Histogram of number of tokens per engine_step.")
        for engine, s in engines.items():
            counts = getattr(s, "iteration_tokens_buckets", None) or (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
            cumulative, buckets = 0, []
            for bound, count in zip((*ITERATION_TOKEN_BUCKETS, float("inf")), counts):
                cumulative += count
                buckets.append((floatToGoString(bound), float(cumulative)))
            fam.add_metric([self.model_name, engine], buckets, float(getattr(s, "iteration_tokens_sum", 0) or 0))
        return fam

    def _spec_decode(self, engines: dict[str, Any]) -> Iterable[Metric]:
        """vLLM's speculative decoding counters, where --speculative-config
        is set (the acceptance rate is accepted / draft tokens)."""
        if not any(getattr(s, "spec_accepted_per_position", None) for s in engines.values()):
            return
        for name, attr, doc in (("spec_decode_num_drafts", "spec_num_drafts", "Number of spec decoding drafts."),
                                ("spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Number of draft tokens."),
                                ("spec_decode_num_accepted_tokens", "spec_num_accepted_tokens",
                                 "Number of accepted tokens.")):
            fam = self._family(CounterMetricFamily, name, doc)
            for engine, s in engines.items():
                fam.add_metric([self.model_name, engine], float(getattr(s, attr, 0) or 0))
            yield fam
        fam = self._family(CounterMetricFamily, "spec_decode_num_accepted_tokens_per_pos",
                           "Accepted tokens per draft position.", ("position",))
        for engine, s in engines.items():
            for pos, n in enumerate(getattr(s, "spec_accepted_per_position", None) or ()):
                fam.add_metric([self.model_name, engine, str(pos)], float(n))
        yield fam

    def _cache_config(self, engines: dict[str, Any]) -> Metric | None:
        """vLLM's info-style gauge: always 1, the cache config in its labels
        (and ``engine``; no ``model_name``, as vLLM)."""
        infos = {e: dict(getattr(s, "cache_config", None) or {}) for e, s in engines.items()}
        keys = sorted(set().union(*infos.values()))
        if not keys:
            return None
        fam = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                labels=[*keys, "engine"])
        for engine, info in infos.items():
            fam.add_metric([*(info.get(k, "") for k in keys), engine], 1.0)
        return fam


    def _lora(self, engines: dict[str, Any]) -> Metric | None:
        """vLLM's ``lora_requests_info`` (with --enable-lora): the adapter
        slots and the adapters with requests waiting and running, comma
        separated, in its labels; the value the time of the figures."""
        infos = {e: s.lora_info for e, s in engines.items() if getattr(s, "lora_info", None) is not None}
        if not infos:
            return None
        fam = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters", "engine"])
        now = time.time()
        for engine, (slots, waiting, running) in infos.items():
            fam.add_metric([str(slots), ",".join(waiting), ",".join(running), engine], now)
        return fam


@dataclass
class EngineRequestSeries:
    """vLLM's per-request series of one engine, bound to its label values."""

    ttft: Any
    itl: Any
    time_per_output_token: Any  # vLLM's older name of the inter-token gaps, which dashboards still read
    tpot: Any
    e2e: Any
    queue: Any
    prefill: Any
    decode: Any
    inference: Any
    prompt_tokens: Any
    generation_tokens: Any
    params_n: Any
    params_max_tokens: Any
    max_generation_tokens: Any
    prefill_kv_computed: Any
    prompt_tokens_cached: Any
    by_source: dict[str, Any]
    success: dict[str, Any]
    success_family: Any
    labels: tuple[str, str]

    def finished(self, reason: str) -> None:
        child = self.success.get(reason)
        if child is None:
            child = self.success[reason] = self.success_family.labels(*self.labels, reason)
        child.inc()


class VllmRequestMetrics:
    """Per-request histograms and counters under vLLM's names, with vLLM's
    buckets; series per ``engine``, made on first use (``engine``)."""

    def __init__(self, registry: CollectorRegistry, model_name: str,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:
        sizes = build_1_2_5_buckets(max_model_len)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"vllm:{name}", doc, VLLM_LABELS, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"vllm:{name}", doc, [*VLLM_LABELS, *extra], registry=registry)

        self._hists = dict(
            ttft=hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
            itl=hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
            time_per_output_token=hist("time_per_output_token_seconds",
                                       "Histogram of time per output token in seconds (the inter-token latency; "
                                       "vLLM's earlier name).", ITL_BUCKETS),
            tpot=hist("request_time_per_output_token_seconds",
                      "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),
            e2e=hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                     REQUEST_TIME_BUCKETS),
            queue=hist("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                       REQUEST_TIME_BUCKETS),
            prefill=hist("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                         REQUEST_TIME_BUCKETS),
            decode=hist("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                        REQUEST_TIME_BUCKETS),
            inference=hist("request_inference_time_seconds",
                           "Histogram of time spent in RUNNING phase for request.", REQUEST_TIME_BUCKETS),
            prompt_tokens=hist("request_prompt_tokens", "Number of prefill tokens processed.", sizes),
            generation_tokens=hist("request_generation_tokens", "Number of generation tokens processed.", sizes),
            params_n=hist("request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS),
            params_max_tokens=hist("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                   sizes),
            max_generation_tokens=hist("request_max_num_generation_tokens",
                                       "Histogram of maximum number of requested generation tokens.", sizes),
            prefill_kv_computed=hist("request_prefill_kv_computed_tokens",
                                     "Histogram of new KV tokens computed during prefill (excluding cached "
                                     "tokens).", sizes),
        )
        self._cached = counter("prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        self._by_source = counter("prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",))
        self._success = counter("request_success", "Count of successfully processed requests.",
                                ("finished_reason",))
        self.model_name = model_name
        self._engines: dict[str, EngineRequestSeries] = {}

    def engine(self, engine: str) -> EngineRequestSeries:
        series = self._engines.get(engine)
        if series is None:
            labels = (self.model_name, engine)
            series = self._engines[engine] = EngineRequestSeries(
                **{k: h.labels(*labels) for k, h in self._hists.items()},
                prompt_tokens_cached=self._cached.labels(*labels),
                by_source={src: self._by_source.labels(*labels, src) for src in PROMPT_SOURCES},
                # zeros from the start, not gaps
                success={r: self._success.labels(*labels, r) for r in FINISH_REASONS},
                success_family=self._success, labels=labels)
        return series


class RouterCollector:
    """The data-parallel router's counters, read at scrape time from its
    ``counters()``: per replica (the ``"replicas"`` list) requests routed by
    reason and prefix tokens expected cached. Nothing without a router."""

    def __init__(self) -> None:
        self.source: Callable[[], dict] | None = None

    def collect(self) -> Iterable[Metric]:
        if self.source is None:
            return
        counters = self.source() or {}
        routed = CounterMetricFamily(f"{PREFIX}_router_requests",
                                     "Requests the router sent to each replica, by why it chose that replica",
                                     labels=["engine", "reason"])
        for replica, entry in enumerate(counters.get("replicas") or ()):
            for reason, n in sorted(entry.get("routed_by_reason", {}).items()):
                routed.add_metric([str(replica), reason], float(n))
        hits = CounterMetricFamily(f"{PREFIX}_router_prefix_hit_tokens",
                                   "Prompt tokens the router expected the chosen replica to hold in its prefix "
                                   "cache, at routing", labels=["engine"])
        for replica, entry in enumerate(counters.get("replicas") or ()):
            hits.add_metric([str(replica)], float(entry.get("prefix_hit_tokens", 0)))
        yield routed
        yield hits


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

    def __init__(self, model_name: str = "", max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.vllm = VllmRequestMetrics(r, model_name, max_model_len)
        for collector in (ProcessCollector(registry=None), GC_COLLECTOR, PLATFORM_COLLECTOR):
            r.register(collector)
        # What the frontend observes, one series per server whatever the
        # replicas (vLLM's series above carry the replica).
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
        self.replicas_healthy = Gauge(f"{PREFIX}_replicas_healthy", "Engine replicas serving requests",
                                      registry=r)
        self.replicas_total = Gauge(f"{PREFIX}_replicas_total", "Engine replicas configured", registry=r)
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
        self.router = RouterCollector()
        r.register(self.router)
        self.set_replicas(1, 1)

    def set_replicas(self, healthy: int, total: int) -> None:
        """How many engine replicas serve, of how many; each replica's vLLM
        request series exist (at zero) from then on."""
        self.replicas_healthy.set(healthy)
        self.replicas_total.set(total)
        for i in range(total):
            self.vllm.engine(str(i))

    def set_router_source(self, source: Callable[[], dict] | None) -> None:
        """Where the router counters come from: a callable returning
        ``Router.counters()``-style dicts, read at each scrape."""
        self.router.source = source

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency and sizes of one engine request (one prompt and its ``n``
    completions), reported into ``ServerMetrics``; vLLM's series under the
    ``engine`` (replica index) that served it. ``n`` and ``max_tokens`` are
    the request's parameters (``max_tokens`` as the engine applies it, the
    room left in the context when the client gave none, as vLLM does)."""

    def __init__(self, metrics: ServerMetrics, start: float | None = None, *, n: int | None = None,
                 max_tokens: int | None = None, engine: str = "0") -> None:
        self.metrics = metrics
        self.series = metrics.vllm.engine(engine)
        self.n = n
        self.max_tokens = max_tokens
        self.start = time.monotonic() if start is None else start
        self.first: float | None = None
        self.last: float | None = None  # the latest output with new tokens
        self.scheduled: float | None = None  # when the engine first ran it
        self.tokens: dict[int, int] = {}
        self.cached = 0  # prompt tokens whose KV came from the prefix cache

    def routed_to(self, engine: str) -> None:
        """The replica that serves the request, once the router has chosen."""
        self.series = self.metrics.vllm.engine(engine)

    def on_output(self, out: Any) -> None:
        now = time.monotonic()
        v = self.series
        new = sum(len(co.new_token_ids) for co in out.outputs)
        if self.scheduled is None and getattr(out, "first_scheduled_time", None) is not None:
            self.scheduled = out.first_scheduled_time
        if new and self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
            v.ttft.observe(now - self.start)
            self._count_prompt(out)
        elif new and self.last is not None:
            v.itl.observe(now - self.last)
            v.time_per_output_token.observe(now - self.last)
        if new:
            self.last = now
        self.metrics.rate.add(new, now)
        for co in out.outputs:
            self.tokens[co.index] = len(co.token_ids)
        if out.finished:
            self._finish(out, now)

    def _count_prompt(self, out: Any) -> None:
        """vLLM counts each completion's prompt tokens by source once the
        prompt is prefilled. The host tier's hits count as cached here (the
        request's output does not tell the tiers apart)."""
        prompt = len(out.prompt_token_ids)
        self.cached = min(int(getattr(out, "num_cached_tokens", None) or 0), prompt)
        v, k = self.series, max(1, len(out.outputs))
        v.by_source["local_compute"].inc((prompt - self.cached) * k)
        v.by_source["local_cache_hit"].inc(self.cached * k)
        v.prompt_tokens_cached.inc(self.cached * k)

    def _finish(self, out: Any, now: float) -> None:
        v = self.series
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
        prompt = len(out.prompt_token_ids)
        # vLLM's parent request (n and the longest completion) once; its child
        # requests (one per completion) each.
        v.params_n.observe(self.n or len(out.outputs))
        v.max_generation_tokens.observe(longest)
        for co in out.outputs:
            self.metrics.finished.labels(co.finish_reason or "unknown").inc()
            v.finished(co.finish_reason or "unknown")
            v.prompt_tokens.observe(prompt)
            v.generation_tokens.observe(len(co.token_ids))
            v.prefill_kv_computed.observe(prompt - self.cached)
            if self.max_tokens:
                v.params_max_tokens.observe(self.max_tokens)
