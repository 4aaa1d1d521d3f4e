"""Data-parallel routing: which of N engine replicas serves a request.

Pure Python (no torch): the HTTP frontend calls it in front of the replicas
and ``scheduler/cluster.py`` runs the same code in the simulator.

A ``Router`` keeps, per replica,

* a load estimate: the replica's last ``ReplicaLoad`` report, moved by what
  the router routed there since and by the ``started``/``finished`` events
  it saw since, so a burst between two reports does not all land on one
  replica. It becomes a predicted backlog in seconds (``BacklogCost``):
  queued prefill tokens and running decodes weighted by their per-token costs
  from the replica's cost model, plus a penalty for a nearly full KV pool;
* an approximate prefix index (``AffinityIndex``): the prefix-cache keys of
  the prompts it sent there, chained over ``block_size``-token blocks exactly
  as the engine keys its cache (``kvcache/prefix_cache.block_keys``), LRU
  bounded by the blocks the replica can cache (device + host tier).

Policies (``ROUTING_POLICIES``, built by ``make_router``):

* ``round-robin``: the next healthy replica in turn;
* ``least-loaded``: the smallest predicted backlog;
* ``prefix-aware`` (default): the replica expected to hold the longest prefix
  of the prompt, unless its backlog exceeds the least-loaded replica's by more
  than ``balance_threshold_s`` plus the prefill time the hit saves; ties and
  misses go least-loaded. Offline requests (Batch API lines) go to the replica
  with the most idle capacity and still record their prefixes.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from fluidserve.kvcache.prefix_cache import ROOT_KEY
from fluidserve.scheduler.cost_model import CostModel, attn_pairs, default_cost_model

ROUTING_POLICIES = ("prefix-aware", "least-loaded", "round-robin")
DEFAULT_ROUTING_POLICY = ROUTING_POLICIES[0]
# Prefix-aware's balance threshold (seconds of backlog), from the sweep in
# benchmarks/routing.py (results/routing.md).
DEFAULT_BALANCE_THRESHOLD_S = 1.0


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica's own report of its load (the engine sends one every ~100 ms)."""

    queued_prefill_tokens: int  # prompt tokens admitted and not yet prefilled
    running: int  # requests decoding
    kv_usage: float  # device KV blocks used / total, 0..1
    # Of queued_prefill_tokens, those of offline requests: online work runs
    # ahead of them on the replica, so they do not delay an online arrival.
    queued_offline_prefill_tokens: int = 0


@dataclass(frozen=True)
class Route:
    replica: int
    reason: str  # "prefix", "load", "least-loaded", "round-robin", "offline"
    cached_tokens: int  # prompt tokens the router expects that replica to hold


class NoReplicaError(RuntimeError):
    """No healthy replica may take the request."""


@dataclass(frozen=True)
class BacklogCost:
    """Seconds of work a replica has queued, from counts.

    ``prefill_s_per_token``: a full prefill chunk's step time per token (the
    time a queued prompt token holds the replica). ``decode_s_per_seq``: what
    one running request still costs: the marginal time it adds to a decode
    step, times the decode steps it has left. A device KV pool used past
    ``kv_high`` adds up to ``kv_full_s`` (a full pool makes an arrival wait
    for running requests to leave or be swapped out)."""

    prefill_s_per_token: float
    decode_s_per_seq: float
    kv_high: float = 0.9
    kv_full_s: float = 1.0

    def __post_init__(self) -> None:
        if self.prefill_s_per_token < 0 or self.decode_s_per_seq < 0 or self.kv_full_s < 0:
            raise ValueError("backlog costs must be non-negative")
        if not 0.0 <= self.kv_high < 1.0:
            raise ValueError(f"kv_high must be in [0, 1), got {self.kv_high}")

    @classmethod
    def from_cost_model(cls, cost_model: CostModel, *, chunk_tokens: int = 2048, context_tokens: int = 1024,
                        batch: int = 64, remaining_tokens: int = 128, **kw: Any) -> BacklogCost:
        """From a cost model: a ``chunk_tokens`` prefill chunk's time per
        token; the marginal decode cost of one request at ``context_tokens``
        of context in a batch of ``batch``, over ``remaining_tokens`` more
        tokens (a running request is on average halfway through its output:
        half of a chat answer of ~250 tokens, between vLLM's first-turn
        ShareGPT sampling, ~180, and ShareGPT-8k's, ~440)."""
        per_token = cost_model.step_time(chunk_tokens, 0, chunk_tokens, attn_pairs(chunk_tokens, 0)) / chunk_tokens
        marginal = (cost_model.decode_time(batch + 1, (batch + 1) * context_tokens)
                    - cost_model.decode_time(batch, batch * context_tokens))
        return cls(per_token, max(0.0, marginal) * remaining_tokens, **kw)

    def backlog(self, queued_tokens: float, running: float, kv_usage: float) -> float:
        s = queued_tokens * self.prefill_s_per_token + running * self.decode_s_per_seq
        if kv_usage > self.kv_high:
            s += min(1.0, (kv_usage - self.kv_high) / (1.0 - self.kv_high)) * self.kv_full_s
        return s


class AffinityIndex:
    """Which replicas were sent each prefix-cache block key: key -> bit mask
    of replicas, and per replica an LRU of its keys bounded by
    ``capacity_blocks`` (the replica's cacheable blocks, both tiers)."""

    def __init__(self, num_replicas: int, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._holders: dict[int, int] = {}
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def __len__(self) -> int:
        return len(self._holders)

    def num_blocks(self, replica: int) -> int:
        return len(self._lru[replica])

    def insert(self, replica: int, keys: Sequence[int]) -> None:
        lru, bit, holders = self._lru[replica], 1 << replica, self._holders
        # Last block first, so the first block is the most recent: evicting
        # from the old end drops a prompt's tail before its root and leaves
        # the shorter prefix matchable (the engine frees tails first too).
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
                holders[k] = holders.get(k, 0) | bit
        while len(lru) > self.capacity:
            k, _ = lru.popitem(last=False)
            self._drop(k, bit)

    def clear(self, replica: int) -> None:
        bit = 1 << replica
        for k in self._lru[replica]:
            self._drop(k, bit)
        self._lru[replica].clear()

    def _drop(self, key: int, bit: int) -> None:
        left = self._holders[key] & ~bit
        if left:
            self._holders[key] = left
        else:
            del self._holders[key]

    def match(self, keys: Sequence[int], mask: int) -> dict[int, int]:
        """replica -> leading blocks of ``keys`` it holds, for the replicas in
        ``mask`` that hold at least the first one."""
        found: dict[int, int] = {}
        alive, holders = mask, self._holders
        for depth, k in enumerate(keys):
            held = holders.get(k, 0) & alive
            if held != alive:
                _record(found, alive & ~held, depth)
                alive = held
                if not alive:
                    return found
        _record(found, alive, len(keys))
        return found


def _record(found: dict[int, int], bits: int, depth: int) -> None:
    if depth == 0:
        return
    while bits:
        low = bits & -bits
        found[low.bit_length() - 1] = depth
        bits ^= low


def prompt_keys(token_ids: Sequence[int], block_size: int, root: int = ROOT_KEY) -> list[int]:
    """``block_keys(token_ids, block_size, root=root)``, the engine's
    prefix-cache keys, with ``chain_key`` inlined over one tuple of the
    prompt: this runs on every request."""
    ids = tuple(token_ids)
    keys: list[int] = []
    parent = root
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, ids[start:start + block_size]))
        keys.append(parent)
    return keys


@dataclass
class _Routed:
    replica: int
    tokens: int  # prompt tokens the replica is expected to prefill
    offline: bool
    started: bool = False


class Router:
    """Base router: health, load estimates, the prefix index and the
    bookkeeping every policy shares; a policy implements ``_choose``.

    ``index_blocks``: blocks the prefix index keeps per replica; size it as
    the replica's device + host KV blocks."""

    policy = "base"

    def __init__(self, num_replicas: int, *, block_size: int, cost: BacklogCost | None = None,
                 cost_model: CostModel | None = None, index_blocks: int = 1 << 16) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.cost = cost or BacklogCost.from_cost_model(cost_model or default_cost_model())
        self.index = AffinityIndex(num_replicas, index_blocks)
        self._healthy = [True] * num_replicas
        self._healthy_mask = (1 << num_replicas) - 1
        self._requests: dict[str, _Routed] = {}
        n = num_replicas
        # The router's own tally of what it routed and has not seen leave...
        self._queued = [0] * n
        self._queued_offline = [0] * n
        self._running = [0] * n
        # ...and, per replica, report minus tally when the report came: the
        # replica's truth (partial prefills, actual cache hits) carried
        # forward until the next report.
        self._adj_queued = [0] * n
        self._adj_queued_offline = [0] * n
        self._adj_running = [0] * n
        self._kv_usage = [0.0] * n
        self._turn = itertools.count()
        self._routed: dict[str, int] = {}
        self._routed_by_replica = [0] * n
        self._reasons_by_replica: list[dict[str, int]] = [{} for _ in range(n)]
        self._hit_tokens = [0] * n
        self._prompt_tokens = 0

    # -- the frontend's calls ------------------------------------------------
    def route(self, request_id: str, prompt_token_ids: Sequence[int], *, offline: bool = False,
              exclude: Collection[int] = (), root: int = ROOT_KEY) -> Route:
        """Pick a healthy replica not in ``exclude`` for a new request (or a
        request sent again: its earlier route is forgotten first); ``root``:
        its cache salt's, as the engines key its blocks."""
        self.finished(request_id)
        mask = self._healthy_mask
        for r in exclude:
            if 0 <= r < self.num_replicas:
                mask &= ~(1 << r)
        if not mask:
            raise NoReplicaError("no healthy replica to route to")
        keys = prompt_keys(prompt_token_ids, self.block_size, root)
        held = self.index.match(keys, mask)
        replica, reason = self._choose(mask, held, len(prompt_token_ids), offline)
        cached = min(held.get(replica, 0) * self.block_size, len(prompt_token_ids))
        self.index.insert(replica, keys)
        tokens = max(1, len(prompt_token_ids) - cached)
        self._requests[request_id] = _Routed(replica, tokens, offline)
        if offline:
            self._queued_offline[replica] += tokens
        else:
            self._queued[replica] += tokens
        self._routed[reason] = self._routed.get(reason, 0) + 1
        self._routed_by_replica[replica] += 1
        by_reason = self._reasons_by_replica[replica]
        by_reason[reason] = by_reason.get(reason, 0) + 1
        self._hit_tokens[replica] += cached
        self._prompt_tokens += len(prompt_token_ids)
        return Route(replica, reason, cached)

    def started(self, request_id: str) -> None:
        """Its first token came back: its prompt is no longer queued."""
        req = self._requests.get(request_id)
        if req is None or req.started:
            return
        req.started = True
        self._unqueue(req)
        self._running[req.replica] += 1

    def finished(self, request_id: str) -> None:
        """Finished, aborted or failed: forget it (unknown ids are ignored)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if req.started:
            self._running[req.replica] -= 1
        else:
            self._unqueue(req)

    def _unqueue(self, req: _Routed) -> None:
        if req.offline:
            self._queued_offline[req.replica] -= req.tokens
        else:
            self._queued[req.replica] -= req.tokens

    def report(self, replica: int, load: ReplicaLoad) -> None:
        online = load.queued_prefill_tokens - load.queued_offline_prefill_tokens
        self._adj_queued[replica] = online - self._queued[replica]
        self._adj_queued_offline[replica] = load.queued_offline_prefill_tokens - self._queued_offline[replica]
        self._adj_running[replica] = load.running - self._running[replica]
        self._kv_usage[replica] = load.kv_usage

    def report_kv_usage(self, replica: int, kv_usage: float) -> None:
        """Where the front end sees every request start and finish (the
        engine's own front end), its tally is already the replica's queue:
        only the KV usage is news."""
        self._kv_usage[replica] = kv_usage

    def set_healthy(self, replica: int, healthy: bool) -> None:
        """An unhealthy replica is never chosen. Either way its prefix index
        and its last report are dropped: a restarted engine has an empty
        cache and has not reported yet."""
        if self._healthy[replica] != healthy:
            self.index.clear(replica)
            self._adj_queued[replica] = self._adj_queued_offline[replica] = self._adj_running[replica] = 0
            self._kv_usage[replica] = 0.0
        self._healthy[replica] = healthy
        self._healthy_mask = sum(1 << r for r, ok in enumerate(self._healthy) if ok)

    def healthy(self, replica: int) -> bool:
        return self._healthy[replica]

    @property
    def num_healthy(self) -> int:
        return sum(self._healthy)

    @property
    def num_in_flight(self) -> int:
        """Requests routed and not yet finished."""
        return len(self._requests)

    def replica_of(self, request_id: str) -> int | None:
        """Where an unfinished request was routed."""
        req = self._requests.get(request_id)
        return None if req is None else req.replica

    def counters(self) -> dict:
        """Routed requests by reason, prefix hit tokens at routing, and per
        replica figures, for /metrics."""
        return {
            "policy": self.policy,
            "routed": dict(self._routed),
            "prefix_hit_tokens": sum(self._hit_tokens),
            "prompt_tokens": self._prompt_tokens,
            "replicas": [
                {"routed": self._routed_by_replica[r], "routed_by_reason": dict(self._reasons_by_replica[r]),
                 "prefix_hit_tokens": self._hit_tokens[r],
                 "healthy": self._healthy[r], "queued_prefill_tokens": self.queued_tokens(r),
                 "running": self.running(r), "backlog_s": self.backlog(r), "index_blocks": self.index.num_blocks(r)}
                for r in range(self.num_replicas)
            ],
        }

    # -- load estimates ------------------------------------------------------
    def queued_tokens(self, replica: int, offline: bool = False) -> int:
        q = max(0, self._queued[replica] + self._adj_queued[replica])
        if offline:
            q += max(0, self._queued_offline[replica] + self._adj_queued_offline[replica])
        return q

    def running(self, replica: int) -> int:
        return max(0, self._running[replica] + self._adj_running[replica])

    def backlog(self, replica: int, offline: bool = False) -> float:
        """Predicted seconds of work ahead of an arrival at ``replica``: online
        work only, or (``offline``) all of it, which is what an offline
        request waits behind."""
        return self.cost.backlog(self.queued_tokens(replica, offline), self.running(replica),
                                 self._kv_usage[replica])

    def _least_loaded(self, mask: int, offline: bool = False) -> tuple[int, dict[int, float]]:
        """The replica of ``mask`` with the smallest backlog (ties in turn, so
        an idle cluster spreads its arrivals), and every backlog."""
        # backlog() inlined: this runs for every replica on every request.
        n, cost = self.num_replicas, self.cost
        per_token, per_seq, kv_high = cost.prefill_s_per_token, cost.decode_s_per_seq, cost.kv_high
        q, aq, qo, aqo = self._queued, self._adj_queued, self._queued_offline, self._adj_queued_offline
        run, arun, kv = self._running, self._adj_running, self._kv_usage
        first = next(self._turn) % n
        best, best_load, loads = -1, 0.0, {}
        for r in itertools.chain(range(first, n), range(first)):
            if not mask >> r & 1:
                continue
            queued = max(0, q[r] + aq[r])
            if offline:
                queued += max(0, qo[r] + aqo[r])
            load = queued * per_token + max(0, run[r] + arun[r]) * per_seq
            if kv[r] > kv_high:
                load = cost.backlog(queued, max(0, run[r] + arun[r]), kv[r])
            loads[r] = load
            if best < 0 or load < best_load:
                best, best_load = r, load
        return best, loads

    def _choose(self, mask: int, held: dict[int, int], num_tokens: int, offline: bool) -> tuple[int, str]:
        raise NotImplementedError


class RoundRobinRouter(Router):
    policy = "round-robin"

    def _choose(self, mask: int, held: dict[int, int], num_tokens: int, offline: bool) -> tuple[int, str]:
        n = self.num_replicas
        for _ in range(n):
            r = next(self._turn) % n
            if mask >> r & 1:
                return r, "round-robin"
        raise AssertionError("mask has a replica")


class LeastLoadedRouter(Router):
    policy = "least-loaded"

    def _choose(self, mask: int, held: dict[int, int], num_tokens: int, offline: bool) -> tuple[int, str]:
        return self._least_loaded(mask, offline)[0], "offline" if offline else "least-loaded"


class PrefixAwareRouter(Router):
    """``balance_threshold_s``: how much more backlog (seconds) than the
    least-loaded replica the replica holding the longest prefix may have,
    beyond the prefill time the hit saves, and still be chosen."""

    policy = "prefix-aware"

    def __init__(self, num_replicas: int, *, block_size: int,
                 balance_threshold_s: float = DEFAULT_BALANCE_THRESHOLD_S,
                 **kw: Any) -> None:
        if balance_threshold_s < 0:
            raise ValueError(f"balance_threshold_s must be >= 0, got {balance_threshold_s}")
        super().__init__(num_replicas, block_size=block_size, **kw)
        self.balance_threshold_s = balance_threshold_s

    def _choose(self, mask: int, held: dict[int, int], num_tokens: int, offline: bool) -> tuple[int, str]:
        least, loads = self._least_loaded(mask, offline)
        if offline:
            return least, "offline"
        if not held:
            return least, "least-loaded"
        top = max(held.values())
        if held.get(least, 0) == top:
            return least, "prefix"
        best = min((r for r, n in held.items() if n == top), key=loads.__getitem__)
        saved = (top - held.get(least, 0)) * self.block_size * self.cost.prefill_s_per_token
        if loads[best] - loads[least] > self.balance_threshold_s + saved:
            return least, "load"
        return best, "prefix"


_ROUTERS: dict[str, type[Router]] = {
    "prefix-aware": PrefixAwareRouter,
    "least-loaded": LeastLoadedRouter,
    "round-robin": RoundRobinRouter,
}


def make_router(policy: str, num_replicas: int, *, block_size: int, **options: Any) -> Router:
    """A router of ``policy`` (one of ``ROUTING_POLICIES``) over
    ``num_replicas`` replicas. Options: ``cost_model`` (the replicas' cost
    model, for the backlog weights; default Llama-3-8B on an H100) or
    ``cost`` (a ``BacklogCost``), ``index_blocks``, and for prefix-aware
    ``balance_threshold_s``."""
    try:
        cls = _ROUTERS[policy]
    except KeyError:
        raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, got {policy!r}") from None
    return cls(num_replicas, block_size=block_size, **options)
