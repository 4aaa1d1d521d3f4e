"""Load generator for any OpenAI-compatible server (``fluidserve bench``,
``benchmarks/serve_bench.py``), with ``vllm bench serve``'s flags and result
keys so its numbers sit beside the tooling vLLM users already have.

Owns the open-loop client: the workload (vLLM's datasets ``random``,
``sharegpt`` (real text from a ShareGPT JSON), ``burstgpt`` (a BurstGPT CSV's
lengths), ``custom`` (a JSONL of prompts); or our length sources: fixed /
uniform / lognormal lengths, or a CSV of real lengths scaled and clipped),
arrivals (Poisson, Gamma of a given burstiness or CV, or a trace's own times,
capped by ``--max-concurrency``), and the report. ``--dataset chat`` is
closed-loop multi-turn traffic: each turn resends its conversation's history
(the previous prompt, the reply's token ids as the server returned them, a
new message) after a think time that starts when the reply before it ends.

The report carries vLLM's flat keys (``mean_ttft_ms``, ``p99_tpot_ms``,
``output_throughput``, ``request_goodput``, ...: numpy mean / median / std /
percentiles, computed as ``vllm bench serve`` computes them) beside our own
figures: normalized latency (E2E per output token), latency bound (the
largest gap between two tokens of a request), SLO attainment, and with
``--offline-prompts`` the co-serving split (an offline backlog sent at t = 0
with vLLM's ``priority`` 1, its figures apart from the online requests').

Prompts without text (lengths only) go as token ids on /v1/completions, so
input lengths are exact whatever the tokenizer; the chat endpoint gets text.
``--endpoint /v1/embeddings`` loads an embedding model (vLLM's
``openai-embeddings`` backend): each prompt one unstreamed request, output
lengths unused, and the report's latency the end-to-end time (``e2el``).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fluidserve.scheduler.workloads import (
    ARXIV, AZURE_CODE, DEFAULT_WORKLOAD_DIR, LMSYS_CHAT, SHAREGPT, conversations, gamma_arrivals, read_rows,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DATASETS = {"sharegpt": SHAREGPT, "azure-code": AZURE_CODE, "arxiv": ARXIV}  # our lengths CSVs (--dataset)
VLLM_DATASETS = ("random", "sharegpt", "burstgpt", "custom")  # --dataset-name
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
# ShareGPT sequences vLLM keeps: at least 4 tokens each side, prompt <= 1024, both <= 2048.
MIN_SEQ_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass(frozen=True)
class RequestSpec:
    prompt_len: int
    output_len: int
    arrival_s: float  # offset from the start of the run
    prompt: str | list[int] | None = None  # text or token ids; None: random ids of prompt_len
    offline: bool = False  # sent with priority 1 (the co-serving backlog)
    # --dataset chat: the turns of one conversation go in order, each prompt
    # the history so far plus ``prompt`` (its new tokens), a follow-up
    # ``think_s`` after the reply before it ends (its arrival_s is unused).
    conversation: int | None = None
    think_s: float = 0.0


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int
    ok: bool = False
    error: str = ""
    start: float = 0.0  # time.perf_counter() when sent
    ttft: float = math.nan
    e2e: float = math.nan
    token_times: list[float] = field(default_factory=list)  # offsets from start
    completion_tokens: int = 0
    prompt_tokens: int = 0
    offline: bool = False
    token_ids: list[int] | None = None  # the reply's ids, kept for a conversation's next turn

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float:
        n = self.completion_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else math.nan


# -- workload: our length sources -------------------------------------------------


def load_lengths(path: Path) -> list[tuple[int, int, float | None]]:
    """(prompt_tokens, output_tokens, arrival_s or None) rows of a CSV."""
    rows = []
    for row in read_rows(path):
        arrival = float(row["arrival_s"]) if row.get("arrival_s") not in (None, "") else None
        rows.append((int(row["prompt_tokens"]), int(row["output_tokens"]), arrival))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def arrival_gaps(n: int, rate: float, cv: float, rng: random.Random) -> list[float]:
    """Inter-arrival gaps: Poisson (cv 1), Gamma with the given CV, evenly
    spaced (cv 0); rate inf sends everything at once."""
    if math.isinf(rate):
        return [0.0] * n
    if cv == 0:
        return [1.0 / rate] * n
    gap = gamma_arrivals(rate, cv)
    return [gap(rng) for _ in range(n)]


def _cv(args: argparse.Namespace) -> float:
    """vLLM's ``--burstiness`` is the Gamma shape: CV = 1 / sqrt(shape)."""
    if args.burstiness is not None:
        if args.burstiness <= 0:
            raise ValueError(f"--burstiness must be positive, got {args.burstiness}")
        return 0.0 if math.isinf(args.burstiness) else 1.0 / math.sqrt(args.burstiness)
    return 1.0 if args.arrival == "poisson" else args.cv


def _num_arrivals(args: argparse.Namespace) -> int:
    if args.duration is not None and not math.isinf(args.request_rate):
        return int(args.request_rate * args.duration * 1.5) + 10  # enough arrivals; cut at the duration later
    return args.num_requests


def build_workload(args: argparse.Namespace) -> list[RequestSpec]:
    """The requests of a run with their send times: ``--num-prompts`` of the
    online arrival process, then ``--offline-prompts`` sent at t = 0."""
    if args.use_trace_arrivals and args.dataset_name is not None:
        raise ValueError("--use-trace-arrivals reads the arrival_s column of --dataset CSVs, not --dataset-name")
    rng = random.Random(args.seed)
    if args.dataset == "chat" and args.dataset_name is None:
        return _chat_workload(args, rng)
    n_online = _num_arrivals(args)
    rows = _sample_requests(args, rng, n_online + args.offline_prompts)
    online, offline = rows[:n_online], rows[n_online:]
    if args.use_trace_arrivals:
        t0 = online[0][3] or 0.0
        times = [(a - t0) / args.time_scale for *_, a in online]
    else:
        times = _cumulative(arrival_gaps(len(online), args.request_rate, _cv(args), rng))
    specs = [RequestSpec(p, o, t, prompt) for (prompt, p, o, _), t in zip(online, times)]
    if args.duration is not None:
        specs = [s for s in specs if s.arrival_s < args.duration]
    return specs + [RequestSpec(p, o, 0.0, prompt, offline=True) for prompt, p, o, _ in offline]


def _chat_workload(args: argparse.Namespace, rng: random.Random) -> list[RequestSpec]:
    """``--num-prompts`` turns of LMSYS-Chat-like conversations
    (``workloads.LMSYS_CHAT``, lengths times ``--length-scale``), starting
    at ``--request-rate`` / (turns per conversation) so turns are offered at
    the given rate. A conversation ends before a turn whose prompt would pass
    ``--max-input-len`` (as a user starts afresh at the context limit)."""
    if args.use_trace_arrivals or args.offline_prompts or _endpoint(args) != "completions":
        raise ValueError("--dataset chat sends token ids to /v1/completions: no --use-trace-arrivals, "
                         "--offline-prompts or chat endpoint")
    mix, scale = LMSYS_CHAT, args.length_scale
    context = round(mix.context * scale) if args.chat_context_len is None else args.chat_context_len
    think = mix.think_s if args.chat_think_s is None else args.chat_think_s
    if context + 1 > args.max_input_len:
        raise ValueError(f"--dataset chat: the opening context ({context} tokens) leaves no room for a message "
                         f"under --max-input-len {args.max_input_len} (see --chat-context-len)")
    lo, hi = args.prompt_token_range
    want, num = _num_arrivals(args), _num_arrivals(args)
    while True:  # a longer list of the same seed starts with the shorter one
        convs = []
        for conv in conversations(num, 1.0, args.seed, mix):  # one start per second; rescaled below
            turns, history = [], context
            for turn in conv.turns:
                user = max(1, round(turn.user * scale))
                reply = _clip(turn.reply * scale, 1, args.max_output_len)
                if history + user > args.max_input_len:
                    break
                turns.append((history + user, reply, user + (context if not turns else 0),
                              turn.think_s * think / mix.think_s))
                history += user + reply
            if turns:
                convs.append((conv.start, turns))
        if sum(len(c) for _, c in convs) >= want:
            break
        num *= 2
    conv_rate = args.request_rate * len(convs) / sum(len(c) for _, c in convs)
    specs, n = [], 0
    for c, (start, turns) in enumerate(convs):
        t = 0.0 if math.isinf(conv_rate) else start / conv_rate
        if args.duration is not None and t >= args.duration:
            break
        for prompt_len, reply, new, think_s in turns[: want - n]:
            specs.append(RequestSpec(prompt_len, reply, t, [rng.randrange(lo, hi) for _ in range(new)],
                                     conversation=c, think_s=think_s))
        n = len(specs)
        if n >= want:
            break
    return specs


def _cumulative(gaps: list[float]) -> list[float]:
    out, t = [], 0.0
    for i, g in enumerate(gaps):
        t += g if i else 0.0
        out.append(t)
    return out


def _clip(x: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(x))))


Row = tuple[str | list[int] | None, int, int, float | None]  # (prompt, prompt_len, output_len, arrival)


def _sample_requests(args: argparse.Namespace, rng: random.Random, n: int) -> list[Row]:
    if args.dataset_name is not None:
        return _vllm_dataset(args, rng, n)
    return [(None, p, o, a) for p, o, a in _sample_lengths(args, rng, n)]


def _sample_lengths(args: argparse.Namespace, rng: random.Random, n: int) -> list[tuple[int, int, float | None]]:
    if args.dataset == "synthetic":
        def draw(mean: int) -> float:
            if args.length_dist == "fixed":
                return mean
            if args.length_dist == "uniform":
                return rng.uniform(mean * (1 - args.length_range), mean * (1 + args.length_range))
            sigma = args.length_range  # lognormal with the given mean
            return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)
        in_len = 32 if args.input_len is None else args.input_len
        out_len = 32 if args.output_len is None else args.output_len
        rows = [(draw(in_len), draw(out_len), None) for _ in range(n)]
    else:
        path = Path(args.dataset) if args.dataset not in DATASETS else Path(args.workloads_dir) / DATASETS[args.dataset]
        table = load_lengths(path)
        if args.use_trace_arrivals:
            if table[0][2] is None:
                raise ValueError(f"{path} has no arrival_s column")
            rows = table[: n]
        else:
            rows = [rng.choice(table) for _ in range(n)]
    return [(*scaled_lengths(p, o, args.length_scale, args.max_input_len, args.max_output_len), a)
            for p, o, a in rows]


def scaled_lengths(prompt: int, output: int, scale: float, max_input: int, max_output: int) -> tuple[int, int]:
    """A length row times ``--length-scale``, cut to ``--max-input-len`` and
    ``--max-output-len`` (benchmarks/swapping.py models the same load)."""
    return _clip(prompt * scale, 1, max_input), _clip(output * scale, 1, max_output)


# -- workload: vLLM's datasets ------------------------------------------------------


def load_tokenizer(args: argparse.Namespace, required: bool) -> Any:
    """The dataset's tokenizer, loaded once per run: ``--tokenizer``, else
    (where the dataset needs one to count tokens) ``--model``. Optional ones
    (random ids decoded for the chat endpoint) come from ``--tokenizer`` only,
    so a served model name is never looked up on the model hub."""
    cached = vars(args).get("_tokenizer")
    if cached is not None:
        return cached
    name = args.tokenizer or (args.model if required else None)
    if name is None:
        if required:
            raise ValueError(f"--dataset-name {args.dataset_name} counts prompt tokens: give --tokenizer "
                             "(a Hugging Face name or a local path)")
        return None
    from transformers import AutoTokenizer

    try:
        args._tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer {name}: cannot load it ({exc})") from None
    return args._tokenizer


def _vllm_dataset(args: argparse.Namespace, rng: random.Random, n: int) -> list[Row]:
    name = args.dataset_name
    if name == "random":
        if args.dataset_path is not None:
            raise ValueError("--dataset-name random takes no --dataset-path")
        return _random_rows(args, rng, n, load_tokenizer(args, required=False))
    if args.dataset_path is None:
        raise ValueError(f"--dataset-name {name} needs --dataset-path")
    if name == "burstgpt":
        return _burstgpt_rows(args, rng, n, load_tokenizer(args, required=False))
    tokenizer = load_tokenizer(args, required=True)
    rows = _sharegpt_rows(args, n, tokenizer) if name == "sharegpt" else _custom_rows(args, n, tokenizer)
    if not rows:
        raise ValueError(f"{args.dataset_path}: no usable {name} entries")
    return _oversample(rows, n, args)


def _token_pool(args: argparse.Namespace, tokenizer: Any) -> list[int]:
    """Token ids random prompts draw from: the tokenizer's vocabulary less its
    special tokens, else ``--prompt-token-range``."""
    if tokenizer is None:
        lo, hi = args.prompt_token_range
        return list(range(lo, hi))
    special = set(tokenizer.all_special_ids)
    return [t for t in range(tokenizer.vocab_size) if t not in special]


def _random_rows(args: argparse.Namespace, rng: random.Random, n: int, tokenizer: Any) -> list[Row]:
    """vLLM's ``random``: lengths uniform over [len * (1 - r), len * (1 + r)]
    (integers, floor and ceil), a shared random prefix, random token ids."""
    in_len = args.random_input_len if args.input_len is None else args.input_len
    out_len = args.random_output_len if args.output_len is None else args.output_len
    r = args.random_range_ratio
    if not 0.0 <= r < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {r}")
    in_lo, in_hi = math.floor(in_len * (1 - r)), math.ceil(in_len * (1 + r))
    out_lo, out_hi = max(1, math.floor(out_len * (1 - r))), max(1, math.ceil(out_len * (1 + r)))
    if args.random_prefix_len + in_lo < 1:
        raise ValueError("--random-input-len is too small: a prompt could be empty")
    pool = _token_pool(args, tokenizer)
    prefix = [rng.choice(pool) for _ in range(args.random_prefix_len)]
    rows: list[Row] = []
    for _ in range(n):
        ids = prefix + [rng.choice(pool) for _ in range(rng.randint(in_lo, in_hi))]
        rows.append((ids, len(ids), rng.randint(out_lo, out_hi), None))
    return rows


def _burstgpt_rows(args: argparse.Namespace, rng: random.Random, n: int, tokenizer: Any) -> list[Row]:
    """vLLM's ``burstgpt``: the GPT-4 rows of a BurstGPT CSV that got an
    answer, sampled (with replacement when too few); random prompt ids."""
    with open(args.dataset_path, newline="") as f:
        rows = [(int(float(r["Request tokens"])), int(float(r["Response tokens"])), r["Model"])
                for r in csv.DictReader(f)]
    table = [(p, o) for p, o, model in rows if model == "GPT-4" and o > 0]
    if not table:
        raise ValueError(f"{args.dataset_path}: no GPT-4 rows with response tokens")
    picked = rng.sample(table, n) if n <= len(table) else rng.choices(table, k=n)
    pool = _token_pool(args, tokenizer)
    return [([rng.choice(pool) for _ in range(max(1, p))], max(1, p), o, None) for p, o in picked]


def _shuffled(items: list, args: argparse.Namespace) -> list:
    if not args.disable_shuffle:
        random.Random(args.seed).shuffle(items)
    return items


def _sharegpt_rows(args: argparse.Namespace, n: int, tokenizer: Any) -> list[Row]:
    """vLLM's ``sharegpt``: each conversation's first turn is the prompt and
    its second the reference answer (its token count is the output length
    unless ``--sharegpt-output-len``); too short or too long pairs are skipped."""
    with open(args.dataset_path, encoding="utf-8") as f:
        data = [e for e in json.load(f) if len(e.get("conversations", ())) >= 2]
    rows: list[Row] = []
    for entry in _shuffled(data, args):
        if len(rows) >= n:
            break
        prompt, answer = entry["conversations"][0]["value"], entry["conversations"][1]["value"]
        prompt_len = len(tokenizer(prompt).input_ids)
        fixed = args.sharegpt_output_len
        output_len = len(tokenizer(answer).input_ids) if fixed is None else fixed
        if (prompt_len < MIN_SEQ_LEN or (fixed is None and output_len < MIN_SEQ_LEN)
                or prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN):
            continue
        rows.append((prompt, prompt_len, output_len, None))
    return rows


def _custom_rows(args: argparse.Namespace, n: int, tokenizer: Any) -> list[Row]:
    """vLLM's ``custom``: a JSONL of ``{"prompt": ...}``, rendered through the
    chat template for /v1/completions unless ``--skip-chat-template`` (the
    chat endpoint renders it server-side)."""
    with open(args.dataset_path, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    template = (not args.skip_chat_template and _endpoint(args) == "completions"
                and getattr(tokenizer, "chat_template", None))
    rows: list[Row] = []
    for prompt in _shuffled(prompts, args)[:n]:
        if template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   add_generation_prompt=True, tokenize=False)
        rows.append((prompt, len(tokenizer(prompt).input_ids), args.custom_output_len, None))
    return rows


def _oversample(rows: list[Row], n: int, args: argparse.Namespace) -> list[Row]:
    """Fewer usable entries than requests: repeat random ones (vLLM's
    oversampling), unless ``--no-oversample``."""
    if len(rows) >= n or args.no_oversample:
        return rows
    rng = random.Random(args.seed)
    return rows + rng.choices(rows, k=n - len(rows))


# -- client ---------------------------------------------------------------------


def _endpoint(args: argparse.Namespace) -> str:
    """``completions``, ``chat`` or ``embeddings``; vLLM's ``--endpoint`` paths are accepted."""
    e = args.endpoint.rstrip("/")
    for name in ("chat", "completions", "embeddings"):
        if e in (name, f"/v1/{'chat/completions' if name == 'chat' else name}"):
            return name
    raise ValueError(f"--endpoint {args.endpoint}: use /v1/completions, /v1/chat/completions or /v1/embeddings")


def _backend(args: argparse.Namespace) -> str:
    """vLLM's name for the endpoint's backend (result keys and file names)."""
    return {"chat": "openai-chat", "embeddings": "openai-embeddings"}.get(_endpoint(args), "openai")


def _base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def _ignore_eos(args: argparse.Namespace) -> bool:
    """Unless told: lengths-only workloads run every request to its output
    length (vLLM forces this for ``random``); real text may stop at EOS."""
    if args.ignore_eos is not None:
        return args.ignore_eos
    return args.dataset_name not in ("sharegpt", "custom")


def _payload(args: argparse.Namespace, model: str, spec: RequestSpec, rng: random.Random) -> tuple[str, dict]:
    if args.lora_modules:
        model = rng.choice(args.lora_modules)
    if _endpoint(args) == "embeddings":
        prompt = spec.prompt
        if prompt is None:
            lo, hi = args.prompt_token_range
            prompt = [rng.randrange(lo, hi) for _ in range(spec.prompt_len)]
        body: dict[str, Any] = {"model": model, "input": prompt, **({"priority": 1} if spec.offline else {})}
        return "/v1/embeddings", {**body, **(args.extra_body or {})}
    body = {
        "model": model, "max_tokens": spec.output_len, "stream": True, "stream_options": {"include_usage": True},
    }
    if _ignore_eos(args):  # vLLM's field: sent only when on, so servers without it still take the request
        body["ignore_eos"] = True
    if args.temperature is not None:
        body["temperature"] = args.temperature
    if args.logprobs is not None:
        body["logprobs"] = args.logprobs
    if spec.offline:
        body["priority"] = 1  # vLLM's meaning: after priority 0; ours: the offline class
    body.update(args.extra_body or {})
    prompt = spec.prompt
    if _endpoint(args) == "chat":
        if not isinstance(prompt, str):
            words = " ".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(spec.prompt_len))
            tokenizer = load_tokenizer(args, required=False) if prompt is not None else None
            prompt = words if tokenizer is None else tokenizer.decode(prompt)
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    if prompt is None:
        lo, hi = args.prompt_token_range
        prompt = [rng.randrange(lo, hi) for _ in range(spec.prompt_len)]
    body["prompt"] = prompt
    return "/v1/completions", body


async def send_one(client: Any, url: str, body: dict, result: RequestResult, headers: dict) -> None:
    result.start = time.perf_counter()
    if url == "/v1/embeddings":
        await _send_unstreamed(client, url, body, result, headers)
        return
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                _on_event(line[6:], result)
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        result.error = f"{type(exc).__name__}: {exc}"
        return
    result.e2e = time.perf_counter() - result.start
    result.ok = not result.error and result.completion_tokens > 0


async def _send_unstreamed(client: Any, url: str, body: dict, result: RequestResult, headers: dict) -> None:
    """An embeddings request: one reply, its latency the whole request's
    (which is also when its "first token", the vector, arrives)."""
    try:
        resp = await client.post(url, json=body, headers=headers)
        if resp.status_code != 200:
            result.error = f"HTTP {resp.status_code}: {resp.content[:200]!r}"
            return
        reply = resp.json()
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        result.error = f"{type(exc).__name__}: {exc}"
        return
    result.e2e = result.ttft = time.perf_counter() - result.start
    result.prompt_tokens = int((reply.get("usage") or {}).get("prompt_tokens") or 0)
    result.ok = bool(reply.get("data"))


def _on_event(data: str, result: RequestResult) -> None:
    now = time.perf_counter() - result.start
    if data == "[DONE]":
        return
    if '"error"' in data[:12]:
        result.error = data[:300]
    elif '"choices":[]' in data:  # the usage chunk
        usage = json.loads(data)["usage"]
        result.completion_tokens = usage["completion_tokens"]
        result.prompt_tokens = usage["prompt_tokens"]
    elif _carries_token(data):
        if not result.token_times:
            result.ttft = now
        result.token_times.append(now)
        if result.token_ids is not None:  # parsed only where a conversation needs the reply's ids
            result.token_ids += json.loads(data)["choices"][0].get("token_ids") or []


def _carries_token(data: str) -> bool:
    """Whether a streamed chunk brings generated output: a chat chunk whose
    delta holds no content, reasoning or tool call (the opening role chunk,
    a closing finish_reason chunk; servers spell them differently) is not a
    token, so it neither starts TTFT nor counts as an inter-token gap."""
    if '"delta"' not in data:
        return True  # completions: every text chunk is a step's output
    try:
        choices = json.loads(data).get("choices") or [{}]
    except ValueError:
        return True
    delta = choices[0].get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content")
                or delta.get("tool_calls"))


async def run_load(args: argparse.Namespace, specs: list[RequestSpec]) -> tuple[list[RequestResult], float]:
    import httpx

    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        tqdm = None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or 100_000, max_keepalive_connections=1024)
    rng = random.Random(args.seed + 1)
    async with httpx.AsyncClient(base_url=_base_url(args), timeout=httpx.Timeout(None), limits=limits) as client:
        model = args.served_model_name or args.model or await _first_model(client, headers)
        args._model = model  # for the result file's name
        bar = tqdm(total=len(specs), desc="requests", unit="req", disable=args.no_progress) if tqdm else None
        results = [RequestResult(s.prompt_len, s.output_len, offline=s.offline) for s in specs]
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        t0 = time.perf_counter()

        async def launch(spec: RequestSpec, result: RequestResult, history: list[int] | None = None) -> None:
            delay = spec.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            url, body = _payload(args, model, spec, rng)
            if history is not None:  # a conversation's turn: everything said so far, then the new message
                body["prompt"], body["return_token_ids"] = history + body["prompt"], True
                result.token_ids = []
            if gate is None:
                await send_one(client, url, body, result, headers)
            else:
                async with gate:
                    await send_one(client, url, body, result, headers)
            if bar is not None:
                bar.update(1)

        async def converse(turns: list[tuple[RequestSpec, RequestResult]]) -> None:
            history: list[int] = []
            for k, (spec, result) in enumerate(turns):
                if k:
                    await asyncio.sleep(spec.think_s)
                await launch(spec, result, history)
                if result.ok and len(result.token_ids or []) != result.completion_tokens:
                    result.ok, result.error = False, (
                        f"the reply carried {len(result.token_ids or [])} token ids for {result.completion_tokens} "
                        "tokens: --dataset chat needs a server that returns them (return_token_ids)")
                if not result.ok:  # the conversation cannot go on without the reply
                    for _, later in turns[k + 1:]:
                        later.error = "not sent: an earlier turn of its conversation failed"
                    if bar is not None:
                        bar.update(len(turns) - k - 1)
                    return
                history = history + list(spec.prompt or []) + (result.token_ids or [])

        chains: dict[int, list[tuple[RequestSpec, RequestResult]]] = {}
        singles = []
        for s, r in zip(specs, results):
            if s.conversation is None:
                singles.append(launch(s, r))
            else:
                chains.setdefault(s.conversation, []).append((s, r))
        await asyncio.gather(*singles, *(converse(turns) for turns in chains.values()))
        elapsed = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    return results, elapsed


async def _first_model(client: Any, headers: dict) -> str:
    resp = await client.get("/v1/models", headers=headers)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


# -- report: vLLM's keys ----------------------------------------------------------


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``--goodput ttft:MS tpot:MS e2el:MS`` -> {metric: milliseconds}."""
    out: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or name not in GOODPUT_METRICS or not ms >= 0:
            raise ValueError(f"--goodput {pair}: use KEY:MILLISECONDS with KEY one of {', '.join(GOODPUT_METRICS)}")
        out[name] = ms
    return out


def _stats(name: str, values: list[float], percentiles: list[float]) -> dict[str, float]:
    """vLLM's mean / median / std / pNN of one metric, in ms (0 when empty)."""
    xs = values or [0.0]
    out = {f"mean_{name}_ms": float(np.mean(xs)) * 1000, f"median_{name}_ms": float(np.median(xs)) * 1000,
           f"std_{name}_ms": float(np.std(xs)) * 1000}
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(xs, p)) * 1000
    return out


def vllm_metrics(results: list[RequestResult], elapsed: float, metrics: list[str], percentiles: list[float],
                 goodput: dict[str, float]) -> dict[str, Any]:
    """The flat figures ``vllm bench serve`` reports, over successful
    requests: TPOT over requests with more than one output token, ITL over
    every gap between streamed chunks, goodput the requests meeting every
    given SLO per second (None without ``--goodput``)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or r.prompt_len for r in ok)
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.completion_tokens > 1],
        "itl": [x for r in ok for x in r.itls],
        "e2el": [r.e2e for r in ok],
    }
    good = 0
    for r in ok:
        # A single-token request has no TPOT: it counts as meeting that SLO.
        got = {"ttft": r.ttft, "tpot": r.tpot if r.completion_tokens > 1 else 0.0, "e2el": r.e2e}
        good += all(got[k] * 1000 <= ms for k, ms in goodput.items())
    out: dict[str, Any] = {
        "duration": elapsed,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / elapsed,
        "request_goodput": good / elapsed if goodput else None,
        "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        **_peaks(ok),
    }
    for name in metrics:
        out.update(_stats(name, values[name], percentiles))
    return out


def _peaks(ok: list[RequestResult]) -> dict[str, float]:
    """Most output tokens in one wall-clock second, and most requests in flight at once."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start for r in ok)
    buckets: dict[int, int] = {}
    for r in ok:
        for t in r.token_times:
            second = int(r.start + t - t0)
            buckets[second] = buckets.get(second, 0) + 1
    # Half-open [start, end): an end at the same instant as a start comes first.
    events = sorted([(r.start, 1) for r in ok] + [(r.start + r.e2e, -1) for r in ok])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return {"max_output_tokens_per_s": float(max(buckets.values(), default=0)), "max_concurrent_requests": peak}


# -- report: our figures ----------------------------------------------------------


def summarize(xs: list[float], scale: float = 1000.0) -> dict[str, float]:
    """Mean, P50, P99 (numpy's linear-interpolation percentiles, as vLLM's)."""
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    return {"mean": float(np.mean(xs)) * scale, "p50": float(np.percentile(xs, 50)) * scale,
            "p99": float(np.percentile(xs, 99)) * scale}


def _slo_limits(args: argparse.Namespace) -> tuple[float | None, float | None, float | None]:
    """(TTFT, TPOT, E2E) limits in ms: ``--slo-*``, else ``--goodput``'s."""
    g = parse_goodput(args.goodput)
    return (args.slo_ttft_ms if args.slo_ttft_ms is not None else g.get("ttft"),
            args.slo_tpot_ms if args.slo_tpot_ms is not None else g.get("tpot"),
            args.slo_e2e_ms if args.slo_e2e_ms is not None else g.get("e2el"))


def _meets_slo(r: RequestResult, limits: tuple[float | None, float | None, float | None]) -> bool:
    checks = zip(limits, (r.ttft, r.tpot, r.e2e))
    return all(limit is None or math.isnan(value) or value * 1000 <= limit for limit, value in checks)


def our_figures(results: list[RequestResult], elapsed: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or r.prompt_len for r in ok)  # the server's count when it sent usage
    limits = _slo_limits(args)
    meets = [r for r in ok if _meets_slo(r, limits)]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_token_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft_ms": summarize([r.ttft for r in ok]),
        "tpot_ms": summarize([r.tpot for r in ok]),
        "itl_ms": summarize([x for r in ok for x in r.itls]),
        "e2e_ms": summarize([r.e2e for r in ok]),
        "normalized_latency_ms_per_token": summarize([r.e2e / r.completion_tokens for r in ok
                                                      if r.completion_tokens]),
        "latency_bound_ms": summarize([max(r.itls, default=r.ttft) for r in ok]),
        "slo": {"ttft_ms": limits[0], "tpot_ms": limits[1], "e2e_ms": limits[2]},
        "slo_attainment": len(meets) / len(results) if results else math.nan,
        "goodput_req_s": len(meets) / elapsed,
        "goodput_tok_s": sum(r.completion_tokens for r in meets) / elapsed,
    }


def percentile_flags(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    """``--percentile-metrics`` (vLLM's defaults: ttft,tpot,itl for
    generation, e2el for embeddings) and ``--metric-percentiles``."""
    default = "e2el" if _endpoint(args) == "embeddings" else "ttft,tpot,itl"
    metrics = [m.strip() for m in (args.percentile_metrics or default).split(",") if m.strip()]
    bad = [m for m in metrics if m not in PERCENTILE_METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(bad)} (use {', '.join(PERCENTILE_METRICS)})")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        percentiles = [-1.0]
    if not percentiles or not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles {args.metric_percentiles}: comma-separated numbers in [0, 100]")
    return metrics, percentiles


def report(results: list[RequestResult], elapsed: float, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's flat keys, then ours (the shared ones mean the same), then the
    co-serving split by class when an offline backlog ran."""
    metrics, percentiles = percentile_flags(args)
    rep = {**vllm_metrics(results, elapsed, metrics, percentiles, parse_goodput(args.goodput)),
           **our_figures(results, elapsed, args)}
    if any(r.offline for r in results):
        rep["coserving"] = {klass: our_figures([r for r in results if r.offline == (klass == "offline")],
                                               elapsed, args) for klass in ("online", "offline")}
    return rep


_STAT_KEY = re.compile(r"^(mean|median|std|p[0-9.]+)_(ttft|tpot|itl|e2el)_ms$")


def print_report(rep: dict[str, Any]) -> None:
    print("{:=^60}".format(" Serving Benchmark Result "))
    rows = [("Successful requests:", rep["completed"]), ("Failed requests:", rep["failed"]),
            ("Benchmark duration (s):", rep["duration"]), ("Total input tokens:", rep["total_input_tokens"]),
            ("Total generated tokens:", rep["total_output_tokens"]),
            ("Request throughput (req/s):", rep["request_throughput"])]
    if rep.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s):", rep["request_goodput"]))
    rows += [("Output token throughput (tok/s):", rep["output_throughput"]),
             ("Total token throughput (tok/s):", rep["total_token_throughput"])]
    for label, value in rows:
        print(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}")
    for k, value in rep.items():
        if _STAT_KEY.match(k):
            print(f"{k:<40} {value:<10.2f}")
    print("{:-^60}".format(" fluidserve figures "))
    # latency_bound_ms: each request's longest wait for a token (its max token gap; TTFT for one token).
    for key, label in (("normalized_latency_ms_per_token", "normalized_latency_ms_per_token"),
                       ("latency_bound_ms", "max_token_gap_ms (latency bound)")):
        s = rep[key]
        print(f"{label:34s} mean {s['mean']:9.2f}  p50 {s['p50']:9.2f}  p99 {s['p99']:9.2f}")
    print(f"goodput  {rep['goodput_req_s']:.2f} req/s  {rep['goodput_tok_s']:.1f} tok/s  "
          f"(SLO attainment {rep['slo_attainment']:.1%})")
    for klass, fig in rep.get("coserving", {}).items():
        print(f"{klass:8s} {fig['completed']} ok, {fig['output_token_throughput']:.1f} out tok/s, "
              f"TTFT p99 {fig['ttft_ms']['p99']:.1f} ms, TPOT p99 {fig['tpot_ms']['p99']:.1f} ms, "
              f"SLO attainment {fig['slo_attainment']:.1%}")
    for err in rep["errors"]:
        print("error:", err)
    print("=" * 60)


# -- entry point ----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fluidserve bench",
                                description="Open-loop load generator for an OpenAI-compatible server; "
                                            "flags and result keys follow `vllm bench serve`.")
    c = p.add_argument_group("server")
    c.add_argument("--base-url", default=None, help="default http://HOST:PORT")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, default=8000)
    c.add_argument("--endpoint", default="completions",
                   help="/v1/completions (or completions), /v1/chat/completions (or chat) or /v1/embeddings "
                        "(or embeddings: an embedding model, each prompt one request)")
    c.add_argument("--model", default=None, help="model name sent, and tokenizer when --tokenizer is not "
                                                 "given; default: the server's first model")
    c.add_argument("--served-model-name", default=None, help="model name sent, when it differs from --model")
    c.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapters the server serves: each request names one of them, drawn at random (vLLM's "
                        "flag; the base model's name among them sends some requests to it)")
    c.add_argument("--tokenizer", default=None, help="tokenizer to count dataset tokens (sharegpt, custom)")
    c.add_argument("--trust-remote-code", action="store_true")
    c.add_argument("--api-key", default=None)
    d = p.add_argument_group("workload (vLLM's datasets)")
    d.add_argument("--dataset-name", choices=VLLM_DATASETS, default=None,
                   help="vLLM's datasets; without it, --dataset picks one of ours")
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON, BurstGPT CSV or custom JSONL")
    d.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int, default=200)
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--random-prefix-len", type=int, default=0)
    d.add_argument("--sharegpt-output-len", type=int, default=None)
    d.add_argument("--custom-output-len", type=int, default=256)
    d.add_argument("--skip-chat-template", action="store_true")
    d.add_argument("--disable-shuffle", action="store_true")
    d.add_argument("--no-oversample", action="store_true")
    d.add_argument("--input-len", type=int, default=None, help="random: --random-input-len; ours: 32 by default")
    d.add_argument("--output-len", type=int, default=None, help="random: --random-output-len; ours: 32 by default")
    w = p.add_argument_group("workload (ours)")
    w.add_argument("--dataset", default="synthetic",
                   help=f"synthetic, one of {sorted(DATASETS)} (lengths CSVs from --workloads-dir), a CSV path, "
                        "or chat (closed-loop conversations: each turn resends the history)")
    w.add_argument("--chat-context-len", type=int, default=None,
                   help="chat: each conversation's opening context in tokens (default 1500 x --length-scale)")
    w.add_argument("--chat-think-s", type=float, default=None,
                   help="chat: mean think time before a follow-up turn (default 8 s)")
    w.add_argument("--workloads-dir", default=str(DEFAULT_WORKLOAD_DIR))
    w.add_argument("--use-trace-arrivals", action="store_true", help="use the CSV's arrival_s column")
    w.add_argument("--time-scale", type=float, default=1.0, help="trace arrivals sped up by this factor")
    w.add_argument("--duration", type=float, default=None, help="seconds of arrivals (instead of a count)")
    w.add_argument("--length-dist", choices=["fixed", "uniform", "lognormal"], default="fixed")
    w.add_argument("--length-range", type=float, default=0.5, help="uniform ±fraction, or lognormal sigma")
    w.add_argument("--length-scale", type=float, default=1.0, help="multiply dataset lengths (other tokenizers)")
    w.add_argument("--max-input-len", type=int, default=100_000)
    w.add_argument("--max-output-len", type=int, default=100_000)
    w.add_argument("--prompt-token-range", type=int, nargs=2, default=[100, 200], metavar=("LO", "HI"),
                   help="token ids of random prompts when no tokenizer is given")
    w.add_argument("--offline-prompts", type=int, default=0,
                   help="co-serving: this many more requests sent at t = 0 with priority 1 (offline)")
    a = p.add_argument_group("arrivals and requests")
    a.add_argument("--request-rate", type=float, default=float("inf"), help="req/s; inf = all at once")
    a.add_argument("--burstiness", type=float, default=None,
                   help="Gamma shape of the gaps (vLLM's): 1 Poisson, < 1 burstier, inf evenly spaced")
    a.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    a.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of gaps (--arrival gamma)")
    a.add_argument("--max-concurrency", type=int, default=None)
    a.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", default=None,
                   help="default: on for lengths-only workloads, off for sharegpt and custom")
    a.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    a.add_argument("--temperature", type=float, default=0.0, help="default greedy (vLLM leaves it to the server)")
    a.add_argument("--logprobs", type=int, default=None)
    a.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    a.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("metrics and SLOs")
    s.add_argument("--percentile-metrics", default=None, help="comma-separated of ttft,tpot,itl,e2el "
                                                              "(default ttft,tpot,itl)")
    s.add_argument("--metric-percentiles", default="99", help='comma-separated, e.g. "50,90,99"')
    s.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    s.add_argument("--slo-ttft-ms", type=float, default=None)
    s.add_argument("--slo-tpot-ms", type=float, default=None)
    s.add_argument("--slo-e2e-ms", type=float, default=None)
    o = p.add_argument_group("output")
    o.add_argument("--save-result", action="store_true", help="write vLLM's result JSON (see --result-dir)")
    o.add_argument("--save-detailed", action="store_true", help="with per-request lists")
    o.add_argument("--result-dir", default=None, help="default: the current directory")
    o.add_argument("--result-filename", default=None,
                   help="default {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json")
    o.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE")
    o.add_argument("--output", default=None, help="without --save-result: JSON path "
                                                  "(default benchmarks/results/serve_bench_<time>.json)")
    o.add_argument("--label", default="")
    o.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    specs = build_workload(args)
    results, elapsed = asyncio.run(run_load(args, specs))
    rep = report(results, elapsed, args)
    if args.save_detailed:
        rep.update(input_lens=[r.prompt_tokens or r.prompt_len for r in results],
                   output_lens=[r.completion_tokens for r in results], ttfts=[r.ttft for r in results],
                   itls=[r.itls for r in results], latencies=[r.e2e for r in results],
                   start_times=[r.start for r in results], request_errors=[r.error for r in results])
    rep["args"] = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                   for k, v in vars(args).items() if not k.startswith("_")}
    rep["model_id"] = vars(args).get("_model")
    return rep


def result_record(rep: dict[str, Any], args: argparse.Namespace, model: str) -> dict[str, Any]:
    """vLLM's result JSON: its run description first, then the figures."""
    backend = _backend(args)
    head: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend, "backend": backend,
        "label": args.label or None, "model_id": model, "tokenizer_id": args.tokenizer or args.model,
        "num_prompts": args.num_requests,
    }
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata {item}: use KEY=VALUE")
        head[key.strip()] = value.strip()
    head.update(request_rate="inf" if math.isinf(args.request_rate) else args.request_rate,
                burstiness=1.0 if args.burstiness is None else args.burstiness,
                max_concurrency=args.max_concurrency)
    return {**head, **rep}


def result_path(args: argparse.Namespace, model: str, date: str) -> Path:
    """vLLM's file name unless ``--result-filename``, in ``--result-dir``."""
    if args.result_filename:
        name = args.result_filename
    else:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        label = args.label or _backend(args)
        name = f"{label}-{args.request_rate}qps{concurrency}-{model.split('/')[-1]}-{date}.json"
    return Path(args.result_dir or ".") / name


def write_json(rep: dict[str, Any], path: str | Path | None, stem: str = "serve_bench") -> Path:
    # Named by what it measures: a rerun replaces the figures (history is in git).
    out = Path(path) if path else REPO_ROOT / "benchmarks" / "results" / f"{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2, default=_json_default))
    return out


def _json_default(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)
    return str(x)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        parse_goodput(args.goodput)  # flag errors before any request is sent
        percentile_flags(args)
        _endpoint(args)
        rep = run(args)
    except ValueError as exc:
        print(f"fluidserve bench: {exc}", file=sys.stderr)
        return 2
    print_report(rep)
    model = vars(args).get("_model") or "model"
    record = result_record(rep, args, model)
    if args.save_result:
        path = write_json(record, result_path(args, model, record["date"]))
    else:
        path = write_json(record, args.output)
    print("wrote", path)
    return 0 if rep["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
