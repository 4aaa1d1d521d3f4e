"""ModelInput and StepResult: what crosses between the engine and the
executor. ModelInput is a StepPlan resolved to plain lists (ints, lists,
SamplingParams) so it crosses to a Ray actor unchanged; the worker turns it
into tensors on its own device. StepResult is keyed by request id, never
matched by position.

Token layout of one step (flat, no padding)::

    input_ids   [ a0 a1 a2 a3 | b7 | c5 c6 ]   a: prefill chunk, b: decode, c: chunk
    positions   [ 0  1  2  3  | 7  | 5  6  ]
    query_start [ 0,            4,   5,     7 ]
    seq_lens    [ 4,            8,   7 ]        KV length after this step
    sample_idx  [ 3,            4  ]            c's chunk ends mid-prompt: no sample
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fluidserve.engine.sampling_params import SamplingParams


@dataclass
class SampleSpec:
    """What the sampler needs of one row; token histories travel only when a
    penalty or min_tokens reads them. The engine keeps one per sequence and
    updates it in place each step, and ``output_token_ids`` is its live
    output list: a worker in the engine's process reads both within
    ``execute`` and keeps neither. The Ray executor sends what the sampling
    rank lacks of them instead (``SampleWire``)."""

    params: SamplingParams
    seed: int | None  # derived per step, so generation is stateless across workers
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class SampleWire:
    """A step's SampleSpecs as the Ray executor sends them to the rank that
    samples, which keeps every sequence's spec it has been sent
    (engine/sample_specs.py): a row's parameters and prompt cross once, its
    outputs from the first token the rank lacks. Dicts are by row index."""

    seeds: list[int | None]
    # Rows of sequences the rank does not hold: (params, prompt_token_ids).
    new: dict[int, tuple[SamplingParams, list[int]]] = field(default_factory=dict)
    # Rows whose outputs grew: (index of the first token sent, the tokens).
    tails: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    # Sequence ids the rank forgets before taking the step in.
    dropped: list[str] = field(default_factory=list)


@dataclass
class PromptLogprobSpec:
    """Prompt positions of one request to score this step: the hidden states
    at ``first_index`` .. ``first_index + len(targets) - 1`` of the flat step
    predict ``targets`` (the prompt tokens one position later)."""

    request_id: str
    first_index: int
    targets: list[int]
    top_n: int


@dataclass
class PoolSpec:
    """Rows of one embedding request to pool this step: the float32 sum of
    the final hidden states at ``first_index`` .. ``first_index + count - 1``
    of the flat step (``count`` may be 0). ``final``: the step computes the
    prompt's last position, and the request's vector is complete with it."""

    request_id: str
    first_index: int
    count: int
    final: bool


@dataclass
class ModelInput:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    # The KV manager's key of each row's table (kvcache/manager.py): under one
    # key a table only grows, so the worker converts only what it gained
    # (engine/block_tables.py). Empty: every table is copied whole.
    table_keys: list[int] = field(default_factory=list)
    # With keys, where each row's list starts in its table: the worker holds
    # the blocks before it (how the Ray executor sends tables). Empty: whole.
    table_starts: list[int] = field(default_factory=list)
    # Keys whose tables are gone since the last step: the worker drops them.
    retired_keys: list[int] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)  # token index of each sampling row
    samples: list[SampleSpec] = field(default_factory=list)
    # Set instead of ``samples`` by the Ray executor; the worker turns it
    # back into ``samples`` as it takes the step in.
    sample_wire: SampleWire | None = None
    sample_ids: list[str] = field(default_factory=list)  # request id of each sampling row
    # Speculative decoding: sequence id -> the drafts its step verifies. Such
    # a sequence has a sampling row at each of its positions, all under its
    # id, in order (engine/speculative.py).
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # Only requests that asked for prompt logprobs: others keep one logits row each.
    prompt_logprobs: list[PromptLogprobSpec] = field(default_factory=list)
    # Embedding requests' rows (engine/pooling.py); they have no sampling row.
    pooling: list[PoolSpec] = field(default_factory=list)
    # KV moves, applied before the forward: swap-outs first, then swap-ins.
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    wait_for_swap_in: bool = False  # the forward reads blocks this step's swap-ins fill
    # Offline work only: the forward may stop at a layer safepoint when the
    # engine interrupts step ``step_id`` (engine/preemption.py).
    preemptible: bool = False
    step_id: int = -1
    # The step id of a paused forward this step continues (the same inputs,
    # sent again): the worker starts at the layer where it stopped.
    resume_of: int = -1
    # Constrained sequences that finished or were aborted since the last
    # step: the worker drops their grammar matchers.
    finished_ids: list[str] = field(default_factory=list)
    # Async scheduling: a row whose input id is ``-j - 1`` is fed, on the
    # device, the token the step launched before this one sampled in its
    # sample row ``j`` (its value is not known on the host yet).
    fed: bool = False
    # LoRA (engine/lora.py): each row's adapter slot, -1 for the base model
    # (empty where no row has an adapter); and adapters to put into slots
    # before the step, (slot, lora.Adapter), sent once to every worker.
    lora_slots: list[int] = field(default_factory=list)
    lora_loads: list[tuple] = field(default_factory=list)

    def longest_table(self) -> int:
        """Blocks in the step's longest table (a row sent from block ``s`` on
        holds ``s`` more than its list)."""
        if self.table_starts:
            return max((s + len(t) for s, t in zip(self.table_starts, self.block_tables)), default=0)
        return max(map(len, self.block_tables), default=0)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


class StepFailed(RuntimeError):
    """A launched step's forward or sampling raised, and the device is still
    sound (``Worker.launch``; ``execute`` reports it as ``StepResult.failed``)."""


@dataclass
class StepResult:
    # request id -> SampledToken (rank 0 only); of a sequence verifying drafts, its last row's.
    sampled: dict = field(default_factory=dict)
    # A sequence verifying drafts: the SampledTokens of its rows before the
    # last; once the engine has compared them with the drafts, of all its
    # rows those that stand (the tokens it appends).
    drafted: dict = field(default_factory=dict)
    # engine request id -> one {token id: Logprob} per scored prompt position (rank 0 only)
    prompt_logprobs: dict = field(default_factory=dict)
    # engine request id -> (sum of the pooled rows or None, their count, final) (rank 0 only)
    pooled: dict = field(default_factory=dict)
    swap_stall_s: float = 0.0  # time the step waited on KV copies
    # The safepoint (layer index; x.5: before layer x's MLP) where an
    # interrupted step stopped: no tokens, and none of the step's KV writes
    # count. None: it ran to the end.
    abandoned_at_layer: float | None = None
    # The worker kept the interrupted forward's state: sending the same input
    # again with ``resume_of`` set continues it from that layer.
    paused: bool = False
    # The forward raised and the device is still sound: no tokens; the
    # engine fails the step's requests and serves on. The exception, as
    # ``"TypeName: message"``. None: the step did not fail.
    failed: str | None = None
    # Rows whose sampling raised, sampled alone (request id -> the
    # exception): their requests fail, the other rows' tokens stand.
    failed_rows: dict = field(default_factory=dict)
    # Requests whose prompt logprobs raised, scored alone (engine request id
    # -> the exception): they fail whole, the step's other requests stand.
    failed_requests: dict = field(default_factory=dict)

    @property
    def abandoned(self) -> bool:
        return self.abandoned_at_layer is not None
