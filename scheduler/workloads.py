"""Workloads for the simulator: arrival processes, length distributions, and
the real length files and trace the repository ships in
``benchmarks/workloads/`` (their sources and licenses in its README), or any
directory of the same files (``--workload-dir``).

A workload is a list of ``Job`` (arrival time, prompt and output length);
a conversation's turns share their history token by token and may each
follow the reply before it (``Job.conversation``, ``Job.follows``). The
multi-turn mix (``conversations``, ``LMSYS_CHAT``) is shared with the load
generator (serve/bench_client.py ``--dataset chat``), so the simulator and a
real server hear the same conversations.
Everything is seeded (``random.Random``), so the same arguments give the same
jobs.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from fluidserve.scheduler.request_state import RequestClass

# <repo>/scheduler/workloads.py -> <repo>/benchmarks/workloads
DEFAULT_WORKLOAD_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "workloads"
SHAREGPT = "sharegpt8k_llama2tok_lengths.csv"
ARXIV = "arxiv_summarization_llama2tok_lengths.csv"
AZURE_CODE = "azure_llm2023_code_trace.csv"


@dataclass(frozen=True)
class Job:
    request_id: str
    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    klass: RequestClass = RequestClass.ONLINE
    # (group, tokens): the prompt starts with ``tokens`` tokens shared by every
    # job of the group (a system prompt); the rest is the job's own.
    shared_prefix: tuple[int, int] | None = None
    # The turns of one conversation: each prompt is the one before it plus
    # the reply and a new message, so past the shared prefix they agree
    # token by token for as long as both run.
    conversation: int | None = None
    # A turn that answers ``follows``'s reply arrives ``think_time`` seconds
    # after that request finishes (the simulator sets its arrival_time then),
    # so a server that answers later also hears the next turn later.
    follows: str | None = None
    think_time: float = 0.0

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Stand-in tokens at positions ``start`` to ``end`` (the prompt's
        end by default; past it, the reply's), equal where prompts are
        (prefix caching): a conversation's next turn repeats this reply."""
        group, shared = self.shared_prefix or (0, 0)
        shared = min(shared, self.prompt_tokens)
        own = self.request_id if self.conversation is None else ("conversation", self.conversation)
        end = self.prompt_tokens if end is None else end
        return [hash(("prefix", group, i) if i < shared else (own, i)) for i in range(start, end)]


LengthSampler = Callable[[random.Random], tuple[int, int]]


# -- conversations ------------------------------------------------------------


@dataclass(frozen=True)
class ChatMix:
    """A multi-turn mix: turns per conversation geometric with mean
    ``turns``; user messages and replies exponential with means ``user`` and
    ``reply`` tokens (replies at most ``max_reply``); each conversation opens
    with ``context`` tokens of its own; a follow-up comes ``think_s`` on
    average (exponential) after the reply before it; conversations start as
    a gamma process with coefficient of variation ``cv``."""

    turns: float
    user: float
    reply: float
    context: int
    think_s: float
    cv: float
    max_reply: int = 2048


# Per turn, LMSYS-Chat-1M (Zheng et al. 2023, Table 1) reports 2.0 turns per
# conversation, 69.5 tokens per user message and 214.5 per response on
# average. The opening context is an assumption (instructions, retrieved
# documents and tool schemas: each conversation's own, so a prefix cache
# shares it only between the turns of one conversation), as are the think
# time and the burstiness of conversation starts. With one system prompt for
# every conversation a cache holds it once and memory binds far less.
LMSYS_CHAT = ChatMix(turns=2.0, user=69.5, reply=214.5, context=1500, think_s=8.0, cv=3.0)


@dataclass(frozen=True)
class Turn:
    user: int  # tokens of the new message
    reply: int  # tokens of the answer
    think_s: float  # after the previous reply ends (0 for the first turn)


@dataclass(frozen=True)
class Conversation:
    start: float  # the first turn's arrival
    turns: tuple[Turn, ...]


def conversations(num: int, rate: float, seed: int = 0, mix: ChatMix = LMSYS_CHAT) -> list[Conversation]:
    """``num`` conversations starting at ``rate`` per second. The lengths do
    not depend on ``rate`` (a gamma draw's scale only multiplies it), so the
    same seed gives the same conversations at every rate."""
    if rate <= 0 or num < 0:
        raise ValueError(f"rate must be positive and num non-negative, got {rate}, {num}")
    rng = random.Random(seed)
    shape = 1.0 / mix.cv**2
    out, t = [], 0.0
    for _ in range(num):
        count = 1
        while rng.random() > 1.0 / mix.turns:
            count += 1
        turns = []
        for k in range(count):
            user = max(1, round(rng.expovariate(1 / mix.user)))
            reply = max(1, min(mix.max_reply, round(rng.expovariate(1 / mix.reply))))
            think = rng.expovariate(1 / mix.think_s)
            turns.append(Turn(user, reply, think if k else 0.0))
        out.append(Conversation(t, tuple(turns)))
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
    return out


# -- files --------------------------------------------------------------------
def read_rows(path: str | Path) -> Iterator[dict[str, str]]:
    """The rows of a workload CSV as dicts (header row first)."""
    with open(path, newline="") as f:
        yield from csv.DictReader(f)


def load_lengths(path: str | Path) -> list[tuple[int, int]]:
    """(prompt_tokens, output_tokens) rows of a length file."""
    return [(int(r["prompt_tokens"]), int(r["output_tokens"])) for r in read_rows(path)]


def load_trace(path: str | Path) -> list[tuple[float, int, int]]:
    """(arrival_s, prompt_tokens, output_tokens) rows of a trace, by arrival."""
    rows = [(float(r["arrival_s"]), int(r["prompt_tokens"]), int(r["output_tokens"])) for r in read_rows(path)]
    rows.sort(key=lambda r: r[0])
    return rows


# -- lengths ------------------------------------------------------------------
def empirical_lengths(pairs: list[tuple[int, int]]) -> LengthSampler:
    """Draw (prompt, output) pairs, with replacement, from real data."""
    if not pairs:
        raise ValueError("empty length data")
    return lambda rng: pairs[rng.randrange(len(pairs))]


def scale_ratio(pairs: list[tuple[int, int]], ratio: float) -> list[tuple[int, int]]:
    """FastServe §6.3: change the ratio of mean input to mean output length to
    ``ratio`` while keeping each distribution's shape (every prompt scaled by
    one factor, every output by another) and the mean total length."""
    if ratio <= 0:
        raise ValueError(f"ratio must be positive, got {ratio}")
    mp = sum(p for p, _ in pairs) / len(pairs)
    mo = sum(o for _, o in pairs) / len(pairs)
    # a*mp / (b*mo) = ratio and a*mp + b*mo = mp + mo
    total = mp + mo
    new_mp = total * ratio / (1 + ratio)
    a, b = new_mp / mp, (total - new_mp) / mo
    return [(max(1, round(p * a)), max(1, round(o * b))) for p, o in pairs]


def clamp_lengths(pairs: list[tuple[int, int]], max_model_len: int) -> list[tuple[int, int]]:
    """Cut prompts (then outputs) so prompt + output fits ``max_model_len``."""
    out = []
    for p, o in pairs:
        p = min(p, max_model_len - 1)
        out.append((p, max(1, min(o, max_model_len - p))))
    return out


# -- arrivals -----------------------------------------------------------------
def poisson_arrivals(rate: float) -> Callable[[random.Random], float]:
    """Inter-arrival sampler of a Poisson process (exponential gaps)."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    return lambda rng: rng.expovariate(rate)


def gamma_arrivals(rate: float, cv: float) -> Callable[[random.Random], float]:
    """Gamma inter-arrivals with mean 1/rate and coefficient of variation cv
    (cv = 1 is Poisson; larger is burstier)."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be positive, got {rate}, {cv}")
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    return lambda rng: rng.gammavariate(shape, scale)


def synthesize(
    num_jobs: int, lengths: LengthSampler, gaps: Callable[[random.Random], float], seed: int = 0,
    klass: RequestClass = RequestClass.ONLINE, prefix: str = "r",
) -> list[Job]:
    """``num_jobs`` jobs: lengths drawn from ``lengths``, arrivals from the
    gap sampler, starting at t = 0."""
    rng = random.Random(seed)
    jobs, t = [], 0.0
    for i in range(num_jobs):
        p, o = lengths(rng)
        jobs.append(Job(f"{prefix}{i}", t, p, o, klass))
        t += gaps(rng)
    return jobs


def replay_trace(
    rows: list[tuple[float, int, int]], speed: float = 1.0, limit: int | None = None,
    max_model_len: int | None = None,
) -> list[Job]:
    """Jobs of a trace, arrivals divided by ``speed`` and shifted to t = 0."""
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    rows = rows[:limit] if limit else rows
    t0 = rows[0][0] if rows else 0.0
    jobs = []
    for i, (t, p, o) in enumerate(rows):
        if max_model_len:
            (p, o), = clamp_lengths([(p, o)], max_model_len)
        jobs.append(Job(f"t{i}", (t - t0) / speed, p, max(1, o)))
    return jobs
