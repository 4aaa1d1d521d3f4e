"""SchedulerConfig: every setting of the scheduler, declared once with its
flag (kvcache/config.py's ``setting``). The engine and the simulator embed
the same config, so a policy, a budget or an SLO means the same in both.

Values the scheduler needs but nobody sets (the swap rate the host link
allows, the share of a step between two safepoints) are derived by its
owner and passed to ``Scheduler`` itself, not kept here.
"""

from __future__ import annotations

from dataclasses import dataclass

from fluidserve.kvcache.config import check_all, setting
from fluidserve.scheduler.policies import DEFAULT_POLICY, POLICIES

PREEMPTION_MODES = ("swap", "recompute")

# From benchmarks/preemption.py (results/preemption.md): on one rank a check
# is a host-side flag read (under 10 us inside a forward, below 0.01% of a
# layer at any k); under tensor parallelism it is one all-reduce of one int
# among the ranks (1.1-1.9 ms between two gloo processes on a 2-core CPU:
# about 0.5% of a cpu-small layer at k = 2). Not 1: on CUDA a safepoint
# also keeps the host at most one interval ahead of the device, and one layer
# of queued kernels is too little to hide the host's launch time; an
# interrupt waits at most 2 layers.
DEFAULT_SAFEPOINT_LAYERS = 2.0
# KV loans' cap (scheduler/loans.py): requests of up to 32 output tokens
# borrow. Not tuned: benchmarks/swapping.py's --loan-sweep puts caps of 1 to
# 128 within 6% of each other on mean latency.
DEFAULT_LOAN_TOKENS = 32


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = setting(2048, "token budget of one step")
    max_num_seqs: int = setting(256, "request cap of one step")
    enable_chunked_prefill: bool = setting(True, "split long prompts over several steps")
    # Fraction of the device pool a *new* request may not take: room for the
    # running ones to grow before anyone is preempted (vLLM's watermark).
    kv_watermark: float = setting(0.01, cli=False)
    scheduling_policy: str = setting(
        DEFAULT_POLICY, "order in which requests are offered each step: fcfs (vLLM/Orca), fixed-priority "
                        "(shortest prompt first), mlfq (naive, every job enters Q1), skip-join-mlfq (FastServe)",
        choices=tuple(sorted(POLICIES)))
    # make_policy(scheduling_policy, **policy_options); the --mlfq-* flags
    # (scheduler/options.py) fill it.
    policy_options: dict = setting(default_factory=dict, cli=False)
    preemption_mode: str = setting(
        "swap", "swap: a preempted request's KV moves to host memory and a request the scheduler ranks higher "
                "may evict lower-ranked ones (FastServe); recompute: KV is discarded and prefilled again, and a "
                "waiting request takes only free blocks (vLLM's behaviour)", choices=PREEMPTION_MODES)
    proactive_swap: bool = setting(
        True, "swap in a step ahead of a request's turn and keep free device blocks for arrivals "
              "(--no-proactive-swap: swap only when a step needs it)")
    # Blocks the host link moves per step (None: unbounded); the engine
    # derives it from the link, the simulator from its copy engine.
    max_swap_blocks_per_step: int | None = setting(None, cli=False)
    online_tpot_slo_ms: float | None = setting(
        None, "co-serving (ConServe): offline work in a step with online requests is cut so the step's "
              "predicted time stays within this time per output token (default: no cut)", metavar="MS")
    online_ttft_slo_ms: float | None = setting(
        None, "co-serving (ConServe): offline work is cut so an online request's first token comes within "
              "this time: beside its prefill, and in offline-only steps, whose safepoint interval an arrival "
              "waits for (any online arrival interrupts one; default: no cut)", metavar="MS")
    # Protection without SLOs: online requests keep close to the latency
    # they would have alone (scheduler/budget.py). The server turns it on
    # unless an SLO is given (serve/cli.py, COSERVING_SLOWDOWN_CAP).
    online_slowdown_cap: float | None = setting(
        None, "co-serving (ConServe) without SLOs: offline work in a step with online requests is cut so the "
              "step's predicted time stays within this multiple of its online part alone, and offline-only steps "
              "so that an online arrival's wait at a safepoint stays within the same share of its own prefill; "
              "explicit --online-*-slo-ms flags replace it; 0 turns it off (default: none; `fluidserve serve` "
              "takes 1.2 unless an SLO is given)", metavar="X")
    # The token-gap tail (scheduler/token_gap.py): a streaming request is
    # evicted only while its deadline leaves room for the round trip, and
    # runs ahead of its queue when skipping it would miss the deadline.
    swap_tpot_slack: float | None = setting(
        None, "swap mode: a request that has streamed tokens is evicted (or skipped) only while its time per output "
              "token stays within this multiple of its own pace (one token a step), counting the time it will be "
              "away; one that would exceed it runs ahead of its queue; --online-tpot-slo-ms, where set, is an "
              "absolute budget instead; 0 turns it off (default: none)", metavar="X")
    max_token_gap_ms: float | None = setting(
        None, "swap mode: also bound each wait between two tokens of a streaming online request: one whose next "
              "token would come later than this after its last is not evicted and runs ahead of its queue, and "
              "prompt chunks beside decodes are cut so the step's predicted time keeps it (never below the chunk "
              "whose fixed cost is half its time) (default: no bound)", metavar="MS")
    # KV loans (scheduler/loans.py): streams keep their place, except for
    # requests whose max_tokens cap bounds their stay on the device.
    # On by default: without it a request ranked higher may evict any
    # stream, and streams stall mid-answer (P99 TPOT 1.3-15x FCFS's in the
    # simulator, 2.9x on the real engine: benchmarks/results/swapping.md,
    # swap_serving.md), with a lower mean gain than loans give as well.
    swap_loan_tokens: int | None = setting(
        DEFAULT_LOAN_TOKENS,
        "swap mode: a request that has streamed its first token keeps its device KV against requests that "
        "have not (they take only free blocks, after swapped streams), except a request whose max_tokens is "
        "at most N: it may swap out streams that have streamed 4 tokens per step it will hold the device, and "
        "they come back when it ends (0: no such request; a negative N turns loans off: a request ranked "
        "higher may evict any stream, FastServe's rule)",
        metavar="N")
    # Backfilling under KV loans (Scheduler._backfills): blocks owed to
    # streams on the host go meanwhile to a request whose cap ends its stay
    # before they could come back.
    swap_backfill: bool = setting(
        True, "swap mode with KV loans: a request that has streamed nothing may take device blocks owed to streams "
              "on the host (or to a starving request) while they could not come back anyway: when its max_tokens "
              "ends its stay before the requests on the device, by their own max_tokens, free enough blocks for "
              "any of them, and its blocks fit beside theirs as they grow (--no-swap-backfill: it waits until "
              "they are back)")
    preemption_safepoint_layers: float = setting(
        DEFAULT_SAFEPOINT_LAYERS,
        "co-serving (ConServe): an offline-only step checks for an interrupt every K decoder layers, a whole or "
        "half number: 0.5 also checks between a layer's attention and its MLP, for a shorter wait where layers "
        "are slow, as on a CPU (fluidserve serve takes 0.5 on a CPU with --data-dir); 0 turns layer-wise "
        "preemption off", metavar="K")
    # ConServe §4.4: past this device-KV usage, offline requests' newly full
    # blocks are copied to the host as they run, so evicting one later costs
    # (almost) no copy. None (or 1) never.
    kv_checkpoint_threshold: float | None = setting(
        0.5, "co-serving (ConServe): past this device-KV usage, offline requests copy their newly full KV blocks "
             "to the host as they run, so evicting one for online work costs no copy (1 turns it off)",
        metavar="FRACTION")
    # False where KV copies run on the compute path before the forward (the
    # CPU): a copy made for later then lengthens a step that online requests
    # wait on, so such steps make none of the offline ones: no checkpoint,
    # no offline request swapped out to keep the arrival reserve free (an
    # online arrival takes offline blocks at once anyway), no offline
    # admission (which may swap others out) the SLO budget leaves no token
    # to run. Offline-only steps, plentiful in idle time, make them. A GPU
    # copies on its own stream, beside the forward. The engine sets it.
    copies_beside_online: bool = setting(True, cli=False)

    def __post_init__(self) -> None:
        k = self.preemption_safepoint_layers
        threshold = self.kv_checkpoint_threshold
        check_all(self, [
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, "must be positive"),
            ("max_num_seqs", self.max_num_seqs >= 1, "must be positive"),
            ("kv_watermark", 0.0 <= self.kv_watermark < 1.0, "must be in [0, 1)"),
            ("scheduling_policy", self.scheduling_policy in POLICIES, f"must be one of {sorted(POLICIES)}"),
            ("preemption_mode", self.preemption_mode in PREEMPTION_MODES, f"must be one of {PREEMPTION_MODES}"),
            ("max_swap_blocks_per_step", self.max_swap_blocks_per_step is None or self.max_swap_blocks_per_step >= 1,
             "must be positive"),
            ("online_tpot_slo_ms", self.online_tpot_slo_ms is None or self.online_tpot_slo_ms > 0, "must be positive"),
            ("online_ttft_slo_ms", self.online_ttft_slo_ms is None or self.online_ttft_slo_ms > 0, "must be positive"),
            ("online_slowdown_cap", self.online_slowdown_cap in (None, 0) or self.online_slowdown_cap > 1,
             "must be above 1 (or 0: off)"),
            ("swap_tpot_slack", self.swap_tpot_slack in (None, 0) or self.swap_tpot_slack >= 1,
             "must be at least 1 (or 0: off)"),
            ("max_token_gap_ms", self.max_token_gap_ms is None or self.max_token_gap_ms > 0, "must be positive"),
            ("preemption_safepoint_layers", k >= 0 and float(2 * k).is_integer(),
             "must be 0 (off) or a positive whole or half number of layers"),
            ("kv_checkpoint_threshold", threshold is None or 0.0 <= threshold <= 1.0, "must be in [0, 1]"),
        ])
        if threshold is not None and threshold >= 1.0:  # usage never passes it: off
            object.__setattr__(self, "kv_checkpoint_threshold", None)
        if self.swap_tpot_slack == 0:
            object.__setattr__(self, "swap_tpot_slack", None)
        if self.swap_loan_tokens is not None and self.swap_loan_tokens < 0:
            object.__setattr__(self, "swap_loan_tokens", None)
        if self.online_slowdown_cap == 0:
            object.__setattr__(self, "online_slowdown_cap", None)
