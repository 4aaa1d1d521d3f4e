"""Scheduler: turns the set of unfinished requests into one StepPlan per step,
and is the one writer of what a step changed (``update_from_output``).

Owns admission into the step (the per-step token budget, the request cap) and
where each request's KV lives (device, host, or nowhere). The *order* in
which requests are offered comes from a ``Policy``; the online class always
goes ahead of the offline class.

Memory, FastServe §4.2 (``preemption_mode="swap"``, the default when a host
pool exists):

* Eviction by priority: a request the policy ranks above resident ones may
  push them out to host memory, the one with the largest estimated next
  scheduled time (ENST) first, and run in their place. A running request that
  must grow evicts the same way.
* Proactive moves: a swapped request comes back a step before it runs, so
  the copy overlaps the current step, unless the copy is so short that the
  whole batch waiting for it costs less than delaying the request a step.
  After the step is filled: swap in, smallest ENST first,
  the KV of swapped requests the device has room for (so they are resident
  when their turn comes and the copy overlaps this step), and swap out,
  largest ENST first, until a reserve of free device blocks sized from recent
  arrivals is free (so a burst of arrivals finds room without waiting on a copy).
* Incremental checkpointing (ConServe §4.4): past a device-KV usage
  threshold, the offline requests a step runs copy their newly full blocks
  to the host within the swap budget, so evicting one later copies (almost)
  nothing and frees its device blocks at once.
* Token deadlines (scheduler/token_gap.py, off by default): with
  ``--swap-tpot-slack``, ``--max-token-gap-ms`` or an online TPOT SLO, a
  streaming request is evicted only when its deadline leaves room for the
  round trip and for staying away until its requester could give way in
  turn; one that would miss its deadline if skipped runs first (earliest
  deadline first) and may evict requests with slack; a request with no
  token out yet takes only device blocks that streaming requests away on
  the host, due soon, do not need back; and a request swapped in is not
  evicted again for a higher-priority one before it has run its quantum.
  A gap bound also sizes the step: prompt chunks beside decodes are cut so
  the step's predicted time keeps it, since every stream's next token
  waits for the step's end (``_gap_room``).
* KV loans (scheduler/loans.py, on by default): with ``--swap-loan-tokens
  N`` (32) a request that has streamed keeps its place against requests that
  have not, which take only free blocks not owed to swapped streams, except
  a request whose ``max_tokens`` is at most ``N``: its stay is bounded, so it
  may evict streams whose streamed tokens cover the time away. Owed blocks
  are backfilled (``--swap-backfill``): a request whose ``max_tokens`` ends
  its stay before the residents, by theirs, could free enough for any claim
  on them takes them meanwhile.
* Recompute (discard the KV, prefill again later) only when the host pool is
  full, counted apart. ``preemption_mode="recompute"`` keeps vLLM's behaviour
  as a baseline: no host tier, a waiting request takes only free blocks, and
  a running one that must grow discards the KV of the lowest-ranked.

Blocks a swap-out frees are the source of a copy in flight: they become
free for the *next* step (the requester that evicted waits one step, and no
step stalls on a swap-out). Swap traffic is bounded by a token bucket that
fills by ``max_swap_blocks_per_step`` a step (sized by the engine from the
cost model, so copies hide behind compute) and holds a few steps' worth; a
move larger than the bucket goes once the bucket is full.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fluidserve.kvcache.config import CacheConfig
from fluidserve.kvcache.manager import KVCacheManager
from fluidserve.kvcache.prefix_cache import ROOT_KEY, block_keys, chain_key
from fluidserve.scheduler.budget import SloBudget
from fluidserve.scheduler.cost_model import CostModel, StepShape, attn_pairs, tokens_for_time
from fluidserve.scheduler.loans import Backfill, KVLoans
from fluidserve.scheduler.plan import PausedStep, ScheduledSeq, StepOutcome, StepPlan
from fluidserve.scheduler.config import SchedulerConfig
from fluidserve.scheduler.policies import Policy, make_policy
from fluidserve.scheduler.request_state import RequestClass, SeqState, SeqStatus
from fluidserve.scheduler.token_gap import INF, TokenDeadlines

_RESERVE_WINDOW_STEPS = 16  # arrivals remembered for the reserve
_RESERVE_CAP = 0.25  # the reserve never exceeds this share of the device pool
# KV loans: a request with no bound on its stay is admitted only with a block
# to spare for each resident request that needs a new one within this many
# decodes, so their growth over the next steps evicts no one. At the block
# size (16) it covers every resident; fewer admit more in a burst and leave
# later growth to the eviction rules. 8 is the midpoint, not a fit:
# benchmarks/swapping.py --growth-sweep moves the P99 TTFT of arXiv lengths
# and the chat mix by a few hundredths, within the seeds' spread.
GROWTH_STEPS = 8
_NO_BLOCKS: list[int] = []  # shared, never mutated
_SWAP_BUCKET_STEPS = 2  # a move may run one step ahead of compute, no more
# A paused offline step waits for online work to drain; under online traffic
# that never drains it is dropped after this many steps (its tokens are then
# computed again, in steps the SLO budget sizes).
_MAX_PAUSED_STEPS = 512
# Under --max-token-gap-ms a prefill chunk is cut so the step stays within
# the bound, but never below the chunk whose fixed per-step cost (the
# weights' read, the launch) is this share of its time: prefill then runs at
# half its full-chunk rate or better.
GAP_FLOOR_OVERHEAD = 0.5


@dataclass
class SchedulerCounters:
    num_recomputes: int = 0  # preemptions that discarded KV
    num_swap_outs: int = 0  # preemptions that moved KV to the host
    num_swap_ins: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    checkpoint_blocks: int = 0  # blocks copied to the host by incremental checkpointing
    num_checkpoint_evictions: int = 0  # swap-outs of requests that had a checkpoint
    num_resumes: int = 0  # paused steps resumed where they stopped
    num_dropped_pauses: int = 0  # paused steps given up (their requests recompute that chunk)
    num_backfills: int = 0  # admissions into device blocks owed to others (KV loans)
    dropped_pause_tokens: int = 0

    @property
    def num_preemptions(self) -> int:
        return self.num_recomputes + self.num_swap_outs


class _Step:
    """Scratch state of one ``schedule`` call."""

    def __init__(self, plan: StepPlan, ranked: list[SeqState], now: float, held: frozenset[str]) -> None:
        self.plan = plan
        self.now = now
        self.ranked = ranked
        # Evicted or swapped in this step, or held by a paused step: not touched again.
        self.moved: set[str] = set(held)
        self.freeing = 0  # device blocks this step's swap-outs free for the next step
        self.batch: int | None = None  # resident requests when first asked
        self.growth: int | None = None  # resident requests a block short within GROWTH_STEPS, when first asked
        self.enst: list[float] | None = None
        self.victims: list[int] | None = None  # positions, largest ENST first
        # decodes_below[i]: resident decodes ranked at position i or after,
        # as the step began (see Scheduler._decodes_below).
        self.decodes_below: list[int] | None = None
        self.cursor = 0
        # The first num_urgent of ``ranked`` run ahead of their queue to meet
        # their token deadlines: they may evict any request with slack.
        self.num_urgent = 0
        # Per ``spare_unrun`` and loan (index spare_unrun + 2 * loan): the
        # fewest steps away a victim search found no one for; asking for as
        # many or more finds no one either.
        self.exhausted = [INF] * 4
        # Device blocks that streaming requests away from the device need
        # back before a request admitted now could give way to them: one
        # with no token out yet takes only blocks beyond these.
        self.owed = 0
        self.owing: dict[str, int] = {}  # request id -> its blocks in ``owed``
        self.offline_cursor: int | None = None  # next offline victim, walking up from the bottom
        self.starving: int | None = None  # KV loans: a starving request's blocks, already in ``owed``
        self.backfill: Backfill | None = None  # the residents as backfilling reads them, while they stay so


class Scheduler:
    """``policy`` overrides ``config.scheduling_policy``; otherwise the
    policy is built from the config with ``cost_model`` (None: the analytic
    default). ``safepoint_interval_share``: the longest share of a step
    between two layer safepoints, which the owner derives from
    ``config.preemption_safepoint_layers`` and its model (None: none);
    ``safepoint_attention_share``: the share of a step's attention time in
    that stretch (``budget.safepoint_attention_share``; None: the same)."""

    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, policy: Policy | None = None,
        cost_model: CostModel | None = None, safepoint_interval_share: float | None = None,
        safepoint_attention_share: float | None = None,
    ) -> None:
        if safepoint_interval_share is not None and not 0.0 < safepoint_interval_share <= 1.0:
            raise ValueError(f"safepoint_interval_share must be in (0, 1], got {safepoint_interval_share}")
        self.config = config
        self.kv = kv
        self.policy = policy or make_policy(config.scheduling_policy, cost_model=cost_model, **config.policy_options)
        self.policy.set_step_tokens(config.max_num_batched_tokens)
        self.seqs: dict[str, SeqState] = {}
        self.counters = SchedulerCounters()
        self.swap = config.preemption_mode == "swap" and kv.host is not None
        self._watermark_blocks = int(config.kv_watermark * kv.num_blocks)
        self._arrived_blocks = 0  # prompt blocks of online arrivals since the last step
        self._recent_arrivals: deque[int] = deque(maxlen=_RESERVE_WINDOW_STEPS)
        per_step = config.max_swap_blocks_per_step
        self._swap_refill = float("inf") if per_step is None else float(per_step)
        self._swap_bucket = self._swap_refill * _SWAP_BUCKET_STEPS
        self._swap_credit = self._swap_bucket
        # Swapped in, and the computed-token count it must reach before it
        # may be evicted again for a request of higher priority (or the copy
        # there and back bought nothing).
        self._guard: dict[str, int] = {}
        min_iter = getattr(self.policy.cost, "min_iteration_time", None)
        min_iter = min_iter() if min_iter is not None else self.policy.cost.decode_time(1, 1)
        # Seconds one block takes over the host link: the engine and the
        # simulator size the per-step allowance as what moves in one minimum iteration.
        self._block_time = 0.0 if per_step is None else min_iter / per_step
        self.deadlines = TokenDeadlines.from_config(config, min_iter) if self.swap else None
        # The fewest prompt tokens a gap bound leaves a step (None: no bound).
        self._gap_floor = (min(config.max_num_batched_tokens, tokens_for_time(
            self.policy.cost, self.policy.cost.min_iteration_time() / GAP_FLOOR_OVERHEAD))
            if self.deadlines is not None and self.deadlines.gap_s is not None else None)
        self.loans = (KVLoans(config.swap_loan_tokens, config.max_num_batched_tokens,
                              min_wait=getattr(self.policy, "starve_limit", 0.0))
                      if self.swap and config.swap_loan_tokens is not None else None)
        self.num_deadline_promotions = 0  # requests run ahead of their queue to meet a token deadline
        # Layer-wise preemption keeps an interrupted step's state on the worker:
        # the plan waits here and its requests are held (not run, not evicted)
        # until it resumes.
        self.paused: PausedStep | None = None
        self._num_online = 0  # unfinished online requests
        # The last ranking, kept between steps (Policy.sort_key): None after
        # an arrival; departures are filtered out of it, and moves between
        # queues sort it again.
        self._ranking: list[SeqState] | None = None
        self._ranking_epoch = -1
        self._ranking_has_finished = False
        self._num_added = 0
        tpot, ttft, slowdown = config.online_tpot_slo_ms, config.online_ttft_slo_ms, config.online_slowdown_cap
        self.budget = (SloBudget(self.policy.cost, None if tpot is None else tpot / 1e3,
                                 None if ttft is None else ttft / 1e3, safepoint_interval_share, slowdown=slowdown,
                                 attention_share=safepoint_attention_share)
                       if tpot is not None or ttft is not None or slowdown is not None else None)
        # The engine feeds measured step times back to a calibrating cost
        # model: plans then carry their shape (free when the budget builds it).
        self._observe = getattr(self.policy.cost, "observe", None)
        self.record_shapes = self.budget is not None or self._observe is not None

    @property
    def num_preemptions(self) -> int:
        return self.counters.num_preemptions

    # -- membership -------------------------------------------------------
    @classmethod
    def create(cls, config: SchedulerConfig, cache: CacheConfig, num_blocks: int, num_host_blocks: int = 0,
               cost_model: CostModel | None = None, policy: Policy | None = None,
               safepoint_interval_share: float | None = None,
               safepoint_attention_share: float | None = None) -> Scheduler:
        """A scheduler with its own KV manager over ``num_blocks`` device and
        ``num_host_blocks`` host blocks (what the executor found room for),
        as ``cache`` configures it: the engine and the simulator build theirs
        so, and reach the KV accounting only through the scheduler."""
        kv = KVCacheManager(num_blocks, cache.block_size, num_host_blocks,
                            enable_prefix_caching=cache.enable_prefix_caching, cache_on_host=cache.cache_on_host)
        return cls(config, kv, policy=policy, cost_model=cost_model, safepoint_interval_share=safepoint_interval_share,
                   safepoint_attention_share=safepoint_attention_share)

    # -- prefix-cache keys ----------------------------------------------------------
    def prompt_block_keys(self, prompt_token_ids: list[int], root: int = ROOT_KEY) -> list[int]:
        """The prefix-cache keys of a prompt's full blocks (none when the
        cache is off), hung from ``root`` (a cache salt's): a new SeqState's
        ``block_keys``."""
        return block_keys(prompt_token_ids, self.kv.block_size, root=root) if self.kv.prefix_caching else []

    def block_filled(self, seq: SeqState, block_tokens: list[int], num_tokens: int) -> None:
        """Prompt + outputs of ``seq`` just reached ``num_tokens``, filling a
        block whose tokens are ``block_tokens``: key it, so a later prompt
        that repeats this conversation shares it."""
        keys = seq.block_keys
        if self.kv.prefix_caching and len(keys) == num_tokens // self.kv.block_size - 1:
            keys.append(chain_key(keys[-1] if keys else seq.cache_root, block_tokens))

    def add(self, seq: SeqState, now: float) -> None:
        if seq.request_id in self.seqs:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        self.seqs[seq.request_id] = seq
        seq.arrival_index = self._num_added
        self._num_added += 1
        self._ranking = None
        if seq.klass is RequestClass.ONLINE:  # the reserve is for latency-critical arrivals
            self._arrived_blocks += self.kv.blocks_for(seq.num_prompt_tokens)
            self._num_online += 1
            if self.budget is not None:
                self.budget.note_online_arrival(seq.num_prompt_tokens)
        # A cached prompt is a short job: the policy places it by what is
        # left to compute (prefix caching).
        seq.num_cached_tokens = (self.kv.cached_prefix_tokens(seq.block_keys, seq.num_prompt_tokens)
                                 if seq.reads_cache else 0)
        self.policy.on_arrival(seq, now)

    def finish(self, request_id: str) -> None:
        """Remove a finished or aborted request and release its KV in both tiers."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return
        seq.status = SeqStatus.FINISHED
        self._ranking_has_finished = True
        self._num_online -= seq.klass is RequestClass.ONLINE
        if request_id in self.held:  # its blocks are freed: the paused step must not write them
            self._drop_pause()
        self._guard.pop(request_id, None)
        if self.deadlines is not None:
            self.deadlines.forget(request_id)
        if self.loans is not None:
            self.loans.forget(request_id)
        self.kv.free(request_id)
        self.policy.on_finish(seq)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # -- one step ---------------------------------------------------------
    def ranked(self, now: float) -> list[SeqState]:
        """Every unfinished request, highest priority first: online ahead of
        offline, the policy's order inside each class. The list is shared
        with the next call: callers read it and never change it.

        With a policy that sorts by a key it changes only where it says so
        (``Policy.sort_key``, ``order_epoch``), the ranking is kept between
        steps: departures are filtered out, and only a move between queues
        sorts it again, a nearly sorted list. Gathering and sorting a
        thousand requests from scratch each step was a third of the
        scheduler's time."""
        policy = self.policy
        ranking = self._ranking
        if ranking is not None:
            policy.age(self.seqs.values(), now)
            if self._ranking_has_finished:
                ranking = [s for s in ranking if s.status is not SeqStatus.FINISHED]
                self._ranking_has_finished = False
            if policy.order_epoch != self._ranking_epoch:  # some moved between queues: nearly sorted still
                k = self._num_online
                online, offline = ranking[:k], ranking[k:]
                online.sort(key=policy.sort_key)
                offline.sort(key=policy.sort_key)
                ranking = online + offline
                self._ranking_epoch = policy.order_epoch
            self._ranking = ranking
            return ranking
        online: list[SeqState] = []
        offline: list[SeqState] = []
        for s in self.seqs.values():
            (offline if s.klass is RequestClass.OFFLINE else online).append(s)
        ranking = policy.order(online, now) + policy.order(offline, now)
        if policy.sort_key is not None:
            self._ranking, self._ranking_epoch, self._ranking_has_finished = ranking, policy.order_epoch, False
        return ranking

    def schedule(self, now: float) -> StepPlan:
        """Fill one step from the top of the ranking down. A prefill chunk
        never takes the token that a lower-ranked running decode needs: a
        decode adds one token to a step another request's prefill makes
        compute-bound, so it rides along almost free, and only the request
        cap or KV memory preempts it (FastServe's batch-slot semantics).
        Without this a demoted job's decodes starve behind every new
        prompt and the lost free rides cost throughput (measured in
        benchmarks/scheduling.py)."""
        self._recent_arrivals.append(self._arrived_blocks)
        self._arrived_blocks = 0
        self._swap_credit = min(self._swap_bucket, self._swap_credit + self._swap_refill)
        if self.paused is not None:
            if not self._num_online:
                self.counters.num_resumes += 1
                return self.paused.resume()
            self.paused.steps_waited += 1
            if self.paused.steps_waited > _MAX_PAUSED_STEPS:
                self._drop_pause()
        plan = self._fill(now)
        if plan.is_empty and self.seqs and self._swap_credit < self._swap_bucket:
            # Nothing runs for copies to hide behind: the swap budget must
            # not leave the device idle. (An empty plan changed no state.)
            self._swap_credit = self._swap_bucket
            plan = self._fill(now)
        return plan

    def continue_decodes(self, plan: StepPlan, keep: list[str]) -> StepPlan | None:
        """The step after ``plan`` planned before ``plan``'s tokens are back
        (async scheduling: the engine queues it while the device still runs
        ``plan``): the requests in ``keep``, each one decode token further,
        with KV for that token allocated here. Only where ``plan`` decoded
        every unfinished request and nothing else could run: None when
        another request waits, is swapped or paused, ``plan`` moved KV, or a
        block is lacking; ``schedule`` then plans the step after the tokens
        are read, as always. Called before ``update_from_output(plan)``."""
        seqs = self.seqs
        if self.paused is not None or plan.has_copies or plan.preemptible or not keep:
            return None
        # Every unfinished request decoded in ``plan``: none waits for a step of its own.
        live = 0
        for item in plan.scheduled:
            if item.request_id in seqs:
                if item.num_tokens != 1:
                    return None
                live += 1
        if live != len(seqs):
            return None
        running, tables, block_size = SeqStatus.RUNNING, self.kv.block_tables, self.kv.block_size
        scheduled, grow = [], []
        for rid in keep:
            seq = seqs.get(rid)
            if seq is None or seq.status is not running:
                return None
            # ``plan``'s token and this step's: two past what update_from_output has counted.
            total = seq.num_computed_tokens + 2
            if len(tables.get(rid, _NO_BLOCKS)) * block_size < total:  # most have room: no call for them
                grow.append((rid, total))
            item = seq.decode_item
            if item is None:
                item = seq.decode_item = ScheduledSeq(rid, 1, True)
            scheduled.append(item)
        if sum(self.kv.num_new_blocks(rid, total) for rid, total in grow) > self.kv.num_free_blocks:
            return None
        for rid, total in grow:
            if not self.kv.allocate(rid, total):
                raise AssertionError(f"{rid!r}: the blocks counted free are not")
        return StepPlan(scheduled=scheduled)

    def _fill(self, now: float) -> StepPlan:
        cfg = self.config
        ranked = self.ranked(now)
        step = _Step(StepPlan(), ranked, now, self.held)
        if self.deadlines is not None and self.deadlines.first_token:
            self._deadline_first(step)
            ranked = step.ranked
        if self.loans is not None and self.kv.num_swapped:
            self._owe_swapped_streams(step)
        if self.budget is not None:
            self.budget.begin_step()
        plan = step.plan
        budget = cfg.max_num_batched_tokens
        # Prompt tokens a gap bound leaves the step: asked at its first chunk (None: not yet, or no bound).
        room = None
        bounded = self._gap_floor is not None
        shape = StepShape()  # of what is in the step so far (for the SLO budget)
        running = SeqStatus.RUNNING
        offline = RequestClass.OFFLINE
        slo = self.budget
        record_shapes = self.record_shapes
        # This loop runs once per unfinished request per step: what it reads
        # on every pass is bound here.
        scheduled, moved, max_seqs = plan.scheduled, step.moved, cfg.max_num_seqs
        add = scheduled.append
        waiting = SeqStatus.WAITING
        tables, block_size = self.kv.block_tables, self.kv.block_size
        for i, seq in enumerate(ranked):
            if len(scheduled) >= max_seqs or budget <= 0:
                break
            rid = seq.request_id
            if rid in moved:
                continue  # gave its KV away this step
            status = seq.status
            if status is waiting:
                if room is not None and room <= 0:
                    continue  # no prefill token left to run it: it would hold blocks and compute nothing
                # Admission may swap others out to make room: where that copy
                # lengthens the step (copies_beside_online off), not for an
                # offline request the budget then leaves no token to run.
                if (not cfg.copies_beside_online and slo is not None and seq.klass is offline
                        and slo.offline_tokens(shape, seq, seq.num_prompt_tokens + seq.num_output_tokens, now) <= 0):
                    continue
                if not self._admit(seq, i, step):
                    continue
                status = seq.status
            uncomputed = n = seq.num_prompt_tokens + seq.num_output_tokens - seq.num_computed_tokens
            if n == 1:
                if seq.num_draft_tokens and budget > 1:  # verify the drafts beside the decode
                    n += min(seq.num_draft_tokens, budget - 1)
            elif n > 1:
                if not cfg.enable_chunked_prefill:
                    if n > budget:
                        continue
                else:
                    # Hold back a token per lower-ranked decode, at most half
                    # of the step's budget, so the top prefill always progresses.
                    held = min(self._decodes_below(step)[i + 1], max_seqs - len(scheduled) - 1,
                               cfg.max_num_batched_tokens // 2)
                    n = min(n, budget - held)
                    if bounded:
                        if room is None:
                            room = self._gap_room(seq, step)
                        n = min(n, room)
                    if n <= 0:
                        continue
            if slo is not None and seq.klass is offline:
                n = slo.offline_tokens(shape, seq, n, now)
                if n <= 0:
                    continue
            resident_with_room = (status is running
                                  and len(tables.get(rid, _NO_BLOCKS)) * block_size >= seq.num_computed_tokens + n)
            # Most decodes are resident with room: no call for them.
            if not resident_with_room and not self._make_resident(seq, seq.num_computed_tokens + n, i, step):
                continue
            if record_shapes:
                shape.add(seq, n)
            if n == 1 == uncomputed:  # a decode: the same item every step
                item = seq.decode_item
                if item is None:
                    item = seq.decode_item = ScheduledSeq(rid, 1, True)
                add(item)
            elif uncomputed == 1:  # a decode and drafts
                add(ScheduledSeq(rid, n, True, drafts=n - 1))
            else:
                add(ScheduledSeq(rid, n, n == uncomputed))
                if room is not None and n > 1:
                    room -= n
            budget -= n
        # Online requests rank above offline ones: the step carries online
        # work exactly when its first request is online.
        online = bool(scheduled) and self.seqs[scheduled[0].request_id].klass is not offline
        offline_copies = cfg.copies_beside_online or not online
        if self.swap and cfg.proactive_swap:
            self._prefetch(step)
            self._keep_reserve(step, offline_copies)
        if (self.swap and cfg.kv_checkpoint_threshold is not None and len(self.seqs) > self._num_online
                and offline_copies and self.kv.usage >= cfg.kv_checkpoint_threshold):
            self._checkpoint(step)
        spare = self._spare_credit() if self.swap else 0
        if spare > 0:
            # Freed cached blocks go to the host while copies are in budget,
            # so a prefix the device reuses survives there. A copy nobody
            # waits for yet: it takes only the spare credit, as checkpoints do.
            demoted = self.kv.demote(spare)
            plan.swap_out.extend(demoted)
            self._swap_credit -= len(demoted)
        if self.record_shapes:
            plan.shape = shape.astuple()
            plan.prefills_online = shape.first_online_prefill_arrival is not None
        plan.preemptible = bool(plan.scheduled) and not online
        return plan

    # -- residency ----------------------------------------------------------
    def _make_resident(self, seq: SeqState, num_tokens: int, pos: int, step: _Step) -> bool:
        """Make room for ``seq`` (``ranked[pos]``, resident or swapped) to
        hold ``num_tokens`` tokens of KV on the device; True when it can run
        this step. A resident request may evict any lower-ranked one. A
        swapped one may evict only ones of strictly lower priority, and only
        to the host."""
        rid = seq.request_id
        if seq.status in (SeqStatus.RUNNING, SeqStatus.SWAPPING_IN):
            need = self.kv.num_new_blocks(rid, num_tokens)
            if not need:  # most decodes: the last block has room
                return True
            if need <= self.kv.num_free_blocks:  # what _room would say, without looking for victims
                return self.kv.allocate(rid, num_tokens)
            room = self._room(need, pos, step, allow_recompute=True, online=seq.klass is RequestClass.ONLINE)
            if room is None:  # nothing below it holds KV: give way to the requests above
                self._evict(seq, step, allow_recompute=True)
            return bool(room) and self.kv.allocate(rid, num_tokens)
        above = self._priority(seq) if pos >= step.num_urgent else None
        if seq.status is SeqStatus.SWAPPED:
            n = self.kv.num_blocks_of(rid)
            need = max(n, self.kv.blocks_for(num_tokens)) + self._watermark()
            if not seq.num_output_tokens:
                need += step.owed
            # With loans it takes only free blocks (they are owed to it): streams keep their place.
            if not self._can_move(n) or not self._room(need, pos, step, allow_recompute=False, above=above,
                                                       online=seq.klass is RequestClass.ONLINE,
                                                       loan=None if self._loans_for(seq) is None else INF):
                return False
            self._swap_in(seq, step)
            if not self.config.proactive_swap or n * self._batch_size(step) <= self._swap_refill:
                # Runs now: every request of the step waits for the copy
                # (n / refill of a step each), which costs them all less than
                # one step of delay costs this one (or the mode is reactive).
                return self.kv.allocate(rid, num_tokens)
            return False  # runs next step: the copy overlaps this one
        raise AssertionError(f"request {rid!r} is {seq.status.value}: admit it first")

    def _admit(self, seq: SeqState, pos: int, step: _Step) -> bool:
        """Give a waiting request KV for its whole prompt (and its outputs,
        after a recompute), sharing its cached prefix: those tokens count as
        computed. A priority policy that starts many prompts must not commit
        memory chunk by chunk and then evict to finish them."""
        kv = self.kv
        keys = seq.block_keys if kv.prefix_caching and seq.reads_cache else []
        # The blocks it takes (``need``) walk its prompt's keys through the
        # prefix index. Under a long queue that memory holds back, every
        # waiting request is tried each step, and a floor under ``need``
        # (its prefix up to where its last walk ended taken as shared) refuses
        # most before the index, or backfilling, is asked: the same answers
        # and side effects as with ``need`` itself.
        floor = kv.admission_floor(keys, seq.num_tokens, seq.prefix_stop)
        free = kv.num_free_blocks
        # Offline work also leaves the arrival reserve free: it is there for online bursts.
        reserve = self._watermark()
        if kv.num_used_blocks and seq.klass is RequestClass.OFFLINE and self.swap and self.config.proactive_swap:
            reserve = self.reserve_blocks()
        # KV loans: the steps it would hold the device (inf: no bound, it evicts no one).
        loans = self._loans_for(seq)
        loan = loans.stay(seq) if loans is not None and not seq.num_output_tokens else None
        if loan == INF:  # a block for each resident request that needs one soon
            reserve += self._growth_blocks(step)
        online = seq.klass is RequestClass.ONLINE
        # Blocks owed to others only add to the reserve: where all that can
        # happen is a comparison with the free blocks (no host tier to evict
        # to; or no bound on its stay, so it evicts no one, and no offline KV
        # it would take first), the floor may say no.
        if floor + reserve > free and (not self.swap or (
                loan == INF and not (online and self._offline_kv_to_take(step)))):
            return self._refuse(seq, keys, loan, step)
        need, seq.prefix_stop = kv.admission(keys, seq.num_tokens)
        backfill = False
        if step.owed and not seq.num_output_tokens and (loan is None or loan == INF):
            # (A borrower's victims come back when it ends.)
            backfill = need + reserve + step.owed > free and self._backfills(seq, step)
            if not backfill:
                reserve += step.owed
        if need + reserve > free and not self.swap:
            return False
        above = self._priority(seq) if pos >= step.num_urgent else None
        if not self._room(need + reserve, pos, step, allow_recompute=False, above=above, online=online, loan=loan):
            return self._refuse(seq, keys, loan, step, need)
        # A prefix found on the host comes back by copy, within the swap budget.
        host = self.swap and self._can_move(need)
        got = self.kv.admit(seq.request_id, keys, seq.num_tokens, host=host)
        if got is None:  # an eviction freed a block it meant to share: next step
            return False
        if got.swap_in:  # the step that runs it waits for the copy (it is short)
            step.plan.swap_in.extend(got.swap_in)
            step.plan.swapped_in.append(seq.request_id)
            step.moved.add(seq.request_id)  # no victim while its copy is planned
            self._swap_credit -= len(got.swap_in)
            self.counters.swap_in_blocks += len(got.swap_in)
        seq.num_computed_tokens = got.cached_tokens
        seq.num_cached_tokens = got.cached_tokens
        seq.status = SeqStatus.RUNNING
        self.counters.num_backfills += backfill
        if step.growth is not None and self._grows_soon(seq):
            step.growth += 1
        if loan is not None:
            self.loans.note_admitted(seq, step.now)
        return True

    def _refuse(self, seq: SeqState, keys: list[int], loan: float | None, step: _Step,
                need: int | None = None) -> bool:
        """Not admitted this step (False). A request with no bound on its
        stay that has waited too long claims its blocks: requests ranked
        below without a bound leave them free."""
        if loan == INF and step.starving is None and self.loans.starving(seq, step.now):
            if need is None:
                need, seq.prefix_stop = self.kv.admission(keys, seq.num_tokens)
            step.starving = need
            step.owed += need
        return False

    def _room(
        self, need: int, pos: int, step: _Step, allow_recompute: bool, above: tuple[bool, float] | None = None,
        online: bool = False, loan: float | None = None,
    ) -> bool | None:
        """Evict requests below ``pos`` until ``need`` device blocks are free
        now or once this step's swap-outs have left. True: free now. False:
        not this step (blocks in flight, or no one may be evicted for it).
        None: nothing below holds KV any more. For an ``online`` requester,
        offline victims give their blocks up at once (ConServe: online work
        never waits on offline KV): back to their checkpoint, else discarded.
        ``loan`` (KV loans): the steps the requester holds the device; a
        stream lends only what its streamed tokens cover; inf: only offline
        requests give way."""
        if online:  # offline KV first, whatever the ENST order says of the online requests
            while self.kv.num_free_blocks + step.freeing < need:
                victim = self._next_offline_victim(step)
                if victim is None:
                    if not self.held:
                        break
                    # Only the paused step's requests are left: give it up.
                    step.moved -= self.held
                    step.offline_cursor = None
                    self._drop_pause()
                    continue
                self._evict_now(victim, step)
        if loan == INF:  # KV loans: a request with no bound on its stay evicts no one
            return self.kv.num_free_blocks >= need
        # Under token deadlines a streaming victim must afford the round trip
        # and to stay away until the requester could give way in turn: its
        # quantum, and the steps it takes to earn slack itself.
        away = -1.0
        while self.kv.num_free_blocks + step.freeing < need:
            if away < 0:
                away = (max(self.policy.quantum_tokens(step.ranked[pos]), self.deadlines.steps_to_slack())
                        if self.deadlines is not None else 0.0)
                if loan is not None and loan < INF:
                    away = max(away, float(loan))
            lending = loan is not None
            victim = self._next_victim(pos, step, spare_unrun=True, away=away, loan=lending)
            if victim is None and above is None:
                # A request that must run now (it grows, or its deadline is
                # here) takes one that can afford just the round trip, and
                # one that grows takes a request swapped in before its
                # quantum rather than give its own place up.
                victim = self._next_victim(pos, step, spare_unrun=True, loan=lending)
                if victim is None and pos >= step.num_urgent:
                    victim = self._next_victim(pos, step, spare_unrun=False, loan=lending)
            if victim is None:
                return None if above is None else False
            if above is not None and self._priority(victim) <= above:
                # ENST order follows priority: the candidates after this one
                # are no lower, so nothing below may be evicted for it.
                return False
            if not self._evict(victim, step, allow_recompute):
                return False
            if lending:
                self.loans.note_lent(victim, away)
        return self.kv.num_free_blocks >= need

    def _loans_for(self, seq: SeqState) -> KVLoans | None:
        """KV loans where they apply to ``seq``. They protect what a user
        watches stream: an offline request neither keeps a place nor is
        bounded by them, and ranks its evictions by priority alone."""
        return None if seq.klass is RequestClass.OFFLINE else self.loans

    def _batch_size(self, step: _Step) -> int:
        """Requests the step will run, about: those holding device KV."""
        if step.batch is None:
            step.batch = sum(1 for q in step.ranked if self.kv.holds(q.request_id))
        return max(1, min(step.batch, self.config.max_num_seqs))

    def _backfills(self, seq: SeqState, step: _Step) -> bool:
        """KV loans: whether ``seq``, with no token out, may take device
        blocks owed to others (EASY backfilling, Lifka 1995: a job may jump
        the queue into a reservation it ends before). Its ``max_new_tokens``
        cap bounds its stay, the residents' caps when they leave: it may
        when it leaves the device before the residents leaving meanwhile
        could free enough for the smallest claim on ``owed`` (a stream on
        the host, a starving request), so it delays none of them, and when
        its blocks, to its cap, fit beside what the residents grow through
        its stay, so it evicts no one."""
        if self.loans is None or not self.config.swap_backfill:
            return False
        kv, fill = self.kv, step.backfill
        free = kv.num_free_blocks + step.freeing
        key = (len(step.moved), step.owed)
        if fill is None or fill.free != free or fill.key != key:  # changed since: look again
            # Blocks are owed (the caller asks only then): to a stream on the host or a starving request.
            claim = min([*step.owing.values(), *([] if step.starving is None else [step.starving])])
            residents = [(q.num_tokens, kv.num_blocks_of(q.request_id), self.loans.steps_left(q))
                         for q in step.ranked if kv.holds(q.request_id)]
            fill = step.backfill = Backfill.of(key, residents, free, claim + self._watermark(), kv.block_size)
        stay = self.loans.steps_left(seq)
        if stay > fill.shadow:
            return False
        to_cap = kv.blocks_for(seq.num_tokens + seq.max_new_tokens - seq.num_output_tokens)
        return fill.fits(to_cap - kv.num_blocks_of(seq.request_id), stay)

    def _growth_blocks(self, step: _Step) -> int:
        """Resident requests that need a new block within ``GROWTH_STEPS``
        decodes: those as the step began, and those it admitted."""
        if step.growth is None:
            step.growth = sum(1 for q in step.ranked if self.kv.holds(q.request_id) and self._grows_soon(q))
        return step.growth

    def _grows_soon(self, seq: SeqState) -> bool:
        return self.kv.num_blocks_of(seq.request_id) * self.kv.block_size - seq.num_tokens < GROWTH_STEPS

    def _spare_credit(self) -> int | float:
        """Swap credit for the link's lowest-priority uses (checkpoints,
        demoting freed cached blocks): the credit beyond one step's refill,
        so the next step never waits behind them, whether for its own
        swap-ins or for a short step's copies to land."""
        if self._swap_refill == float("inf"):
            return self._swap_credit
        return self._swap_credit - self._swap_refill

    def _can_move(self, n: int) -> bool:
        return n <= self._swap_credit or self._swap_credit >= self._swap_bucket

    def _priority(self, seq: SeqState) -> tuple[bool, float]:
        return seq.klass is RequestClass.OFFLINE, self.policy.priority(seq)

    def _next_victim(
        self, pos: int, step: _Step, spare_unrun: bool, away: float = 0.0, loan: bool = False,
    ) -> SeqState | None:
        """The resident request below ``pos`` to evict next, largest ENST
        first, never a streaming one whose token deadline leaves no room for
        the round trip and ``away`` more steps. ``spare_unrun``: not one
        whose KV came back from the host and has not run a quantum's worth
        since (evicting it would waste both copies); a request that must
        grow to keep running may still take it. ``loan`` (KV loans): only
        a request that can lend for ``away`` steps (KVLoans.can_lend)."""
        slot = spare_unrun + 2 * loan
        if away >= step.exhausted[slot]:
            return None
        if step.victims is None:
            if self.swap:
                enst = self._enst(step)
                step.victims = sorted(range(len(step.ranked)), key=lambda j: (enst[j], j), reverse=True)
            else:  # recompute baseline: lowest-ranked first, as before
                step.victims = list(range(len(step.ranked) - 1, -1, -1))
        victims = step.victims
        # The cursor only moves forward: a request skipped now (ranked above
        # the requester, or holding nothing) is never a victim later this step,
        # because later requesters are ranked lower still. Spared requests are
        # skipped without moving it: a running requester may still take them.
        i = step.cursor
        while i < len(victims):
            j = victims[i]
            s = step.ranked[j]
            if j > pos and self.kv.holds(s.request_id) and s.request_id not in step.moved:
                if (not (spare_unrun and self._guarded(s)) and self._can_be_away(s, step.now, away)
                        and not (loan and not self.loans.can_lend(s, away))):
                    return s
            elif i == step.cursor:
                step.cursor += 1
            i += 1
        step.exhausted[slot] = away
        return None

    def _guarded(self, seq: SeqState) -> bool:
        g = self._guard.get(seq.request_id)
        return g is not None and seq.num_computed_tokens < g

    def _can_be_away(self, seq: SeqState, now: float, away: float) -> bool:
        """Whether ``seq``, evicted now, still meets its token deadline: its
        copy out and back, the steps of the round trip (this one, the one
        its copy back overlaps, the one that runs it) and ``away`` more."""
        d = self.deadlines
        if d is None:
            return True
        due = d.deadline(seq, now)
        if due == INF:
            return True
        copy = 2 * self.kv.num_blocks_of(seq.request_id) * self._block_time
        return now + copy + (3 + away) * d.step_time <= due

    def _gap_room(self, seq: SeqState, step: _Step) -> int:
        """Prefill tokens a step may carry under ``--max-token-gap-ms``:
        the most whose step, beside every resident decode, the cost model
        predicts within the bound, since each stream's next token waits for
        the step's end. Never fewer than the chunk whose fixed cost is
        ``GAP_FLOOR_OVERHEAD`` of its time alone: where the decodes leave
        less, the bound gives way, since prompts cut finer would be computed
        slower than they arrive and the queue would grow without end."""
        budget = self.config.max_num_batched_tokens
        decodes = self._decodes_below(step)[0]
        if not decodes:
            return budget
        gap, cost, floor = self.deadlines.gap_s, self.policy.cost, self._gap_floor
        bs = self.kv.block_size
        context, cached = self.kv.num_used_blocks * bs, seq.num_computed_tokens

        def fits(n: int) -> bool:
            return cost.step_time(n, decodes, context, attn_pairs(n, cached)) <= gap

        if fits(budget):
            return budget
        if not fits(floor):
            return floor
        lo, hi = floor, budget  # fits(lo), not fits(hi)
        while hi - lo > bs:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _deadline_first(self, step: _Step) -> None:
        """Move the streaming requests that would miss their token deadline
        if skipped this step to the front of ``step.ranked``, earliest
        deadline first, and count what those away from the device, due
        before a request admitted now could be evicted, need back
        (``step.owed``). Skipped now, a resident request's next token comes
        at the end of the next step at best; a swapped one (or one waiting
        again after a recompute) also needs its copy back, which overlaps a
        step."""
        d, now = self.deadlines, step.now
        est, seqs = d.step_time, self.seqs
        horizon = now + (3 + d.steps_to_slack()) * est
        resident, arriving = SeqStatus.RUNNING, SeqStatus.SWAPPING_IN
        urgent: list[tuple[float, int, SeqState]] = []
        for rid in d.first_token:
            seq = seqs.get(rid)
            if seq is None:
                continue
            due = d.deadline(seq, now)
            if due == INF:
                continue
            status = seq.status
            if status is resident or status is arriving:
                late = now + 2 * est > due
            else:
                blocks = (self.kv.num_blocks_of(rid) if status is SeqStatus.SWAPPED
                          else self.kv.blocks_for(seq.num_tokens))
                late = now + 3 * est + blocks * self._block_time > due
                if due < horizon:
                    step.owing[rid] = blocks
                    step.owed += blocks
            if late:
                urgent.append((due, seq.arrival_index, seq))
        if not urgent:
            return
        urgent.sort(key=lambda u: (u[0], u[1]))
        self.num_deadline_promotions += len(urgent)
        first = [u[2] for u in urgent]
        ids = {id(s) for s in first}
        step.ranked = first + [s for s in step.ranked if id(s) not in ids]
        step.num_urgent = len(first)

    def _owe_swapped_streams(self, step: _Step) -> None:
        """KV loans: every online stream on the host is owed its blocks back
        before a request with no token out takes device memory."""
        owing, swapped, online = step.owing, SeqStatus.SWAPPED, RequestClass.ONLINE
        for seq in self.seqs.values():
            rid = seq.request_id
            if seq.status is swapped and seq.num_output_tokens and seq.klass is online and rid not in owing:
                n = owing[rid] = self.kv.num_blocks_of(rid)
                step.owed += n

    def _offline_kv_to_take(self, step: _Step) -> bool:
        """Whether an online request short of blocks may find offline KV
        to take (``_room``): a paused step's, or an offline request's that
        this step's search has not yet found gone."""
        return bool(self.held) or (step.offline_cursor != -1 and self._num_online != len(self.seqs))

    def _next_offline_victim(self, step: _Step) -> SeqState | None:
        """The lowest-ranked offline request still holding device KV (offline
        requests rank below every online one); None when none is left."""
        ranked = step.ranked
        i = len(ranked) - 1 if step.offline_cursor is None else step.offline_cursor
        while i >= 0 and ranked[i].klass is RequestClass.OFFLINE:
            s = ranked[i]
            i -= 1
            if self.kv.holds(s.request_id) and s.request_id not in step.moved:
                step.offline_cursor = i
                return s
        step.offline_cursor = -1
        return None

    def _decodes_below(self, step: _Step) -> list[int]:
        """Counted when the first prefill chunk asks, or before the first
        eviction changes a lower-ranked request, whichever is first: the same
        counts as at the step's start (earlier changes are all above), and a
        decode-only step never pays for them."""
        if step.decodes_below is None:
            step.decodes_below = _decodes_below(step.ranked)
        return step.decodes_below

    def _evict(self, seq: SeqState, step: _Step, allow_recompute: bool) -> bool:
        self._decodes_below(step)  # counted before this changes a lower-ranked request
        n = self.kv.swap_out_blocks(seq.request_id)
        if self.swap and self.kv.can_swap_out(seq.request_id) and self._can_move(n):
            self._swap_out(seq, step)
            return True
        if not allow_recompute:
            return False
        self._recompute(seq, step)
        return True

    def _evict_now(self, seq: SeqState, step: _Step) -> None:
        """Free every device block of ``seq`` this step: keep what its
        checkpoint holds on the host (the rest is recomputed), or discard."""
        self._decodes_below(step)  # counted before this changes a lower-ranked request
        rid = seq.request_id
        if not (self.swap and self.kv.num_checkpointed(rid)):
            self._recompute(seq, step)
            return
        self._rewind(seq, min(seq.num_computed_tokens, self.kv.drop_to_checkpoint(rid)))
        self.counters.num_checkpoint_evictions += 1
        self._swapped_out(seq, step)

    def _swap_out(self, seq: SeqState, step: _Step) -> None:
        rid = seq.request_id
        pending = self.kv.allocator.num_pending
        self.counters.num_checkpoint_evictions += self.kv.num_checkpointed(rid) > 0
        moves = self.kv.swap_out(rid)
        step.plan.swap_out.extend(moves)
        step.freeing += self.kv.allocator.num_pending - pending  # the rest are free now
        self._swap_credit -= len(moves)
        self.counters.swap_out_blocks += len(moves)
        self._swapped_out(seq, step)

    def _swapped_out(self, seq: SeqState, step: _Step) -> None:
        """``seq``'s KV has left the device for the host this step."""
        step.plan.swapped_out.append(seq.request_id)
        step.moved.add(seq.request_id)
        seq.status = SeqStatus.SWAPPED
        self._guard.pop(seq.request_id, None)
        seq.num_preemptions += 1
        self.counters.num_swap_outs += 1

    def _swap_in(self, seq: SeqState, step: _Step, status: SeqStatus = SeqStatus.RUNNING) -> None:
        rid = seq.request_id
        moves = self.kv.swap_in(rid)
        step.plan.swap_in.extend(moves)
        step.plan.swapped_in.append(rid)
        self._swap_credit -= len(moves)
        step.moved.add(rid)
        seq.status = status
        # Under token deadlines a victim must afford a long absence, so the
        # copies are worth a quantum; without them one step, as the eviction
        # order alone decides (a longer guard there moved more KV, not less).
        self._guard[rid] = seq.num_tokens - 1 + (self.policy.quantum_tokens(seq) if self.deadlines is not None else 1)
        if rid in step.owing:
            step.owed -= step.owing.pop(rid)
        self.counters.num_swap_ins += 1
        self.counters.swap_in_blocks += len(moves)

    def _recompute(self, seq: SeqState, step: _Step) -> None:
        step.moved.add(seq.request_id)
        self._guard.pop(seq.request_id, None)
        self.kv.free(seq.request_id)
        self._rewind(seq, 0)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.counters.num_recomputes += 1
        step.plan.preempted.append(seq.request_id)

    def _rewind(self, seq: SeqState, num_computed: int) -> None:
        """Its KV beyond ``num_computed`` tokens is gone: the policy first
        settles the steps it has not been told of (``SeqState.policy_due``)."""
        if seq.policy_due:
            self.policy.settle(seq)
            seq.policy_due = 0
        seq.num_computed_tokens = num_computed

    def _checkpoint(self, step: _Step) -> None:
        """Copy the newly full blocks of the offline requests this step runs
        to the host, within the swap budget (ConServe §4.4): they are the
        ones an online arrival evicts, and a checkpointed one leaves the
        device without a copy."""
        spare = self._spare_credit()
        for item in step.plan.scheduled:
            if spare <= 0:
                return
            seq = self.seqs[item.request_id]
            # Copies that fill its blocks this step run after the checkpoint's
            # (swap-outs go first): a moved request waits a step.
            if seq.klass is not RequestClass.OFFLINE or seq.request_id in step.moved:
                continue
            copies = self.kv.checkpoint(seq.request_id, seq.num_computed_tokens, spare)
            step.plan.swap_out.extend(copies)
            spare -= len(copies)
            self._swap_credit -= len(copies)
            self.counters.checkpoint_blocks += len(copies)

    # -- paused steps -------------------------------------------------------
    @property
    def held(self) -> frozenset[str]:
        """Requests of the paused step: not run, not evicted, until it resumes."""
        return self.paused.held if self.paused is not None else frozenset()

    def _drop_pause(self) -> None:
        """Give the paused step up: its requests run again like any others,
        that chunk computed again (the worker's kept state is never asked for)."""
        p = self.paused
        if p is None:
            return
        self.counters.num_dropped_pauses += 1
        self.counters.dropped_pause_tokens += p.plan.num_batched_tokens
        self._clear_pause()

    def _clear_pause(self) -> None:
        self.paused = None

    @property
    def paused_requests(self) -> int:
        return len(self.held)

    # -- proactive moves ------------------------------------------------------
    def _enst(self, step: _Step) -> list[float]:
        if step.enst is None:
            step.enst = self.policy.enst(step.ranked, step.now, self.config.max_num_seqs)
        return step.enst

    def _watermark(self) -> int:
        """Free blocks kept for the running requests' growth: with none
        resident, a request that fits the pool at all must get in."""
        return self._watermark_blocks if self.kv.num_used_blocks else 0

    def reserve_blocks(self) -> int:
        """Free device blocks to keep for online arrivals: the largest burst
        of their prompt blocks between two recent steps, capped."""
        burst = max(self._recent_arrivals, default=0)
        return min(burst, int(_RESERVE_CAP * self.kv.num_blocks)) + self._watermark_blocks

    def _prefetch(self, step: _Step) -> None:
        """Swap in the swapped requests most likely to run next (smallest
        ENST first) while the device keeps its reserve free."""
        if not self.kv.num_swapped:
            return
        swapped = [j for j, s in enumerate(step.ranked)
                   if s.status is SeqStatus.SWAPPED and s.request_id not in step.moved]
        if not swapped:
            return
        enst = self._enst(step)
        arrivals = self.reserve_blocks()
        for j in sorted(swapped, key=lambda j: (enst[j], j)):
            seq = step.ranked[j]
            n = self.kv.num_blocks_of(seq.request_id)
            # A stream under loans is owed its blocks: no arrival takes them
            # first. Anything else (offline work) leaves the arrival reserve free.
            reserve = self._watermark() if self._loans_for(seq) is not None else arrivals
            if self.kv.num_free_blocks - n < reserve or not self._can_move(n):
                break
            self._swap_in(seq, step, status=SeqStatus.SWAPPING_IN)

    def _keep_reserve(self, step: _Step, offline_copies: bool) -> None:
        """Swap out resident requests not in this step, largest ENST first,
        until the reserve is free (or the host is full); offline ones only
        with ``offline_copies``."""
        reserve = self.reserve_blocks()
        # Blocks this step's swap-outs free count: they are free next step,
        # when the reserve is needed.
        if self.kv.num_free_blocks + step.freeing >= reserve:
            return
        enst = self._enst(step)
        running = {s.request_id for s in step.plan.scheduled}
        for j in sorted(range(len(step.ranked)), key=lambda j: (enst[j], j), reverse=True):
            if self.kv.num_free_blocks + step.freeing >= reserve:
                return
            seq = step.ranked[j]
            rid = seq.request_id
            if rid in running or rid in step.moved or self._guarded(seq) or not self.kv.holds(rid):
                continue
            if self.deadlines is not None and not self._can_be_away(seq, step.now, self.policy.quantum_tokens(seq)):
                continue
            if self.loans is not None and not self.loans.can_lend(seq, 0.0):  # a stream keeps its place
                continue
            if not offline_copies and seq.klass is RequestClass.OFFLINE:
                continue
            if not self.kv.can_swap_out(rid) or not self._can_move(self.kv.num_blocks_of(rid)):
                return
            self._swap_out(seq, step)
            if self.loans is not None:
                self.loans.note_lent(seq, 0.0)

    # -- after the step -------------------------------------------------------
    def update_from_output(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """The one writer of what a step changed: the copies it carried are
        done, tokens it computed are in the cache, each sampling request has
        one more output token, and the requests the engine saw stop leave."""
        self.kv.release_pending()
        # A resumed step ran only its last layers: its time says nothing of its shape.
        if plan.shape is not None and not outcome.abandoned and not plan.resumes:
            if self.budget is not None and plan.scheduled and not plan.preemptible:  # online work
                self.budget.note_online_step(plan.shape, outcome.step_time, plan.prefills_online)
            if self._observe is not None:
                self._observe(plan.shape, outcome.step_time)
        if plan.resumes:
            self._clear_pause()
        if outcome.paused:
            held = {item.request_id for item in plan.scheduled}
            if held.issubset(self.seqs):  # none was aborted while it ran
                self.paused = PausedStep(plan, frozenset(held), outcome.paused_input)
        for rid in plan.swapped_in:
            seq = self.seqs.get(rid)
            if seq is not None and seq.status is SeqStatus.SWAPPING_IN:
                seq.status = SeqStatus.RUNNING
        now, step_time = outcome.now, outcome.step_time
        bs = self.kv.block_size
        get, guard, running = self.seqs.get, self._guard, SeqStatus.RUNNING
        deadlines = self.deadlines
        if deadlines is not None and plan.scheduled and not outcome.abandoned:
            deadlines.observe(step_time)
        step_done = self.policy.on_step_done
        # An abandoned step (layer-wise preemption) computed nothing: its
        # tokens run again later and its blocks stay out of the prefix cache.
        rejected = outcome.rejected
        for item in () if outcome.abandoned else plan.scheduled:
            seq = get(item.request_id)
            if seq is None:  # aborted while the step ran
                continue
            n = item.num_tokens
            if item.drafts:
                # The decode and the drafts that stood are the sequence's tokens now.
                kept = n - rejected.get(item.request_id, item.drafts)
                seq.num_output_tokens += kept - 1  # and one more below, as for any sampling step
                n = kept
            done = seq.num_computed_tokens = seq.num_computed_tokens + n
            seq.status = running
            if guard:
                g = guard.get(item.request_id)
                if g is not None and done >= g:
                    del guard[item.request_id]
            # Index the blocks this step filled (most decode steps fill none).
            if seq.block_keys and done // bs != (done - n) // bs:
                self.kv.cache_blocks(seq.request_id, seq.block_keys, done)
            if item.samples:
                seq.num_output_tokens += 1
                if deadlines is not None and seq.klass is not RequestClass.OFFLINE:
                    deadlines.note_token(seq, now)
                if seq.num_output_tokens == 1 and self.budget is not None and seq.klass is RequestClass.ONLINE:
                    self.budget.note_first_token(now + step_time - seq.arrival_time)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            seq.last_scheduled_time = now
            if n != 1 or done > seq.policy_due:  # most decodes are charged by the policy later, in one go
                step_done(seq, n, step_time, now)
        for rid in outcome.finished:
            self.finish(rid)

    # -- figures ----------------------------------------------------------
    def counts(self) -> dict[tuple[str, str, str], int]:
        """Number of unfinished requests by (class, status, policy queue)."""
        out: dict[tuple[str, str, str], int] = {}
        for s in self.seqs.values():
            key = (s.klass.value, s.status.value, self.policy.queue_label(s))
            out[key] = out.get(key, 0) + 1
        return out


def _decodes_below(ranked: list[SeqState]) -> list[int]:
    """out[i]: the resident decodes at position i of ``ranked`` or after."""
    out = [0] * (len(ranked) + 1)
    running = SeqStatus.RUNNING
    for i in range(len(ranked) - 1, -1, -1):
        s = ranked[i]
        is_decode = s.status is running and s.num_prompt_tokens + s.num_output_tokens - s.num_computed_tokens == 1
        out[i] = out[i + 1] + is_decode
    return out
