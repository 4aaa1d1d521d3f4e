"""ModelInput: a StepPlan resolved to plain lists, what the engine sends the
executor. Plain data (ints, lists, SamplingParams) so it crosses to a Ray
actor unchanged; the worker turns it into tensors on its own device.

Token layout of one step (flat, no padding)::

    input_ids   [ a0 a1 a2 a3 | b7 | c5 c6 ]   a: prefill chunk, b: decode, c: chunk
    positions   [ 0  1  2  3  | 7  | 5  6  ]
    query_start [ 0,            4,   5,     7 ]
    seq_lens    [ 4,            8,   7 ]        KV length after this step
    sample_idx  [ 3,            4  ]            c's chunk ends mid-prompt: no sample
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling_params import SamplingParams


@dataclass
class SampleSpec:
    """What the sampler needs of one row; token histories travel only when a
    penalty or min_tokens reads them."""

    params: SamplingParams
    seed: int | None  # derived per step, so generation is stateless across workers
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0


@dataclass
class ModelInput:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)  # token index of each sampling row
    samples: list[SampleSpec] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)
