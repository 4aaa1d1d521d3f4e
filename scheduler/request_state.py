"""SeqState: what the scheduler knows of one request.

The engine's ``Request`` holds token ids, sampling parameters and detokenizer
state; it owns a ``SeqState`` that carries only counts and policy bookkeeping,
so the scheduler and the simulator never see torch or a tokenizer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from fluidserve.kvcache.prefix_cache import ROOT_KEY


class RequestClass(str, enum.Enum):
    ONLINE = "online"
    OFFLINE = "offline"


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # holds no KV yet (new, or preempted by recompute)
    RUNNING = "running"  # holds KV on the device
    SWAPPED = "swapped"  # KV on the host only: must be swapped in to run
    SWAPPING_IN = "swapping_in"  # swap-in issued ahead of being scheduled (proactive)
    FINISHED = "finished"


@dataclass(eq=False)
class SeqState:
    request_id: str
    num_prompt_tokens: int
    max_new_tokens: int
    arrival_time: float
    klass: RequestClass = RequestClass.ONLINE
    num_output_tokens: int = 0
    # Tokens whose KV is in the cache. During decode the newest sampled token
    # is not yet computed: num_computed_tokens == num_tokens - 1.
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0  # recomputes and swap-outs
    # Prefix-cache keys of the full blocks of prompt + outputs so far (the
    # scheduler appends one as each block of tokens fills); empty: not cached.
    block_keys: list[int] = field(default_factory=list)
    # False: the request computes every position (it scores its prompt), so it
    # takes no cache hits, but its blocks are still offered to the cache.
    reads_cache: bool = True
    cache_root: int = ROOT_KEY  # the parent of its first block's key: its cache_salt's (kvcache/prefix_cache.py)
    # Where admission's last walk of ``block_keys`` through the prefix cache
    # ended (-1: never walked): KVCacheManager.admission_floor's hint.
    prefix_stop: int = -1
    # Prompt tokens found cached: at arrival an estimate (for the policy), at
    # admission what was actually shared.
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    last_scheduled_time: float | None = None
    # Free-form per-policy bookkeeping (queue level, attained service, ...).
    policy_state: dict = field(default_factory=dict)
    # Order of joining the scheduler: the last tie-break of every policy's
    # sort, so a ranking sorted again equals one sorted from scratch.
    arrival_index: int = 0
    # Speculative decoding: draft tokens the engine holds for this request's
    # next decode, which the step may verify beside it (engine/speculative.py).
    num_draft_tokens: int = 0
    # The scheduler's plan entry for one decode token with no new block: the
    # same every such step, so made once (a ScheduledSeq; plans never change it).
    decode_item: object = None
    # A one-token step that leaves num_computed_tokens at or below this needs
    # no ``Policy.on_step_done``: the policy knows what such steps cost it and
    # charges them at its next call (0: every step is reported). The
    # scheduler rewinds it to 0 with num_computed_tokens.
    policy_due: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
