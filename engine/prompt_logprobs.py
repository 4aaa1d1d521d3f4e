"""Prompt logprobs on the worker: the logprob of each prompt token under the
model, plus the top-N alternatives, from the hidden states a prefill step
already computed.

Only requests that asked for them (``SamplingParams.prompt_logprobs``, or
echo with logprobs) have rows here; every other request keeps its single
logits row per step. The engine decides which positions a step scores
(``engine.py``: never a position twice, none lost across chunks or a
recompute); this module only turns hidden states into numbers.

Logits are projected in slices of ``ROWS_PER_SLICE`` rows so a long prompt
chunk never holds ``[chunk, vocab]`` fp32 logits at once.
"""

from __future__ import annotations

from typing import Callable

import torch

from fluidserve.engine.batch import PromptLogprobSpec
from fluidserve.engine.outputs import Logprob, TokenLogprobs

ROWS_PER_SLICE = 256


def score_prompts(
    hidden: torch.Tensor,
    specs: list[PromptLogprobSpec],
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
) -> dict[str, list[TokenLogprobs]] | None:
    """Request id -> one ``{token id: Logprob}`` per scored position: the
    prompt token (its rank: 1 + the number of strictly likelier tokens) and
    the top ``spec.top_n`` tokens (ranks 1..N). ``hidden`` is the step's
    ``[T, hidden]``. None on ranks without logits (``compute_logits`` is a
    collective under tensor parallelism: every rank calls it alike)."""
    index: list[int] = []
    targets: list[int] = []
    for spec in specs:
        index.extend(range(spec.first_index, spec.first_index + len(spec.targets)))
        targets.extend(spec.targets)
    top_n = max(spec.top_n for spec in specs)
    index_t = torch.tensor(index, dtype=torch.int64, device=hidden.device)
    target_t = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
    target_lp, target_rank, top_lp, top_ids = [], [], [], []
    for lo in range(0, len(index), ROWS_PER_SLICE):
        rows = slice(lo, lo + ROWS_PER_SLICE)
        logits = compute_logits(hidden[index_t[rows]])  # [R, V]
        if logits is None:  # not rank 0: keep calling, the gather needs every rank each slice
            continue
        # logprob = logit - logsumexp, in fp32 whatever the model's dtype;
        # ranks and the top N read the logits themselves (same order), so
        # no second [R, V] tensor of logprobs is written.
        x = logits.float()  # [R, V]
        lse = torch.logsumexp(x, dim=-1, keepdim=True)  # [R, 1]
        chosen = x.gather(1, target_t[rows].unsqueeze(1))  # [R, 1]
        target_lp.append((chosen - lse).squeeze(1))
        target_rank.append((x > chosen).sum(dim=-1, dtype=torch.int32) + 1)
        if top_n > 0:
            values, ids = x.topk(min(top_n, x.shape[1]), dim=-1)  # [R, N]
            top_lp.append(values - lse)
            top_ids.append(ids)
    if not target_lp:
        return None
    # One device-to-host copy per quantity, after all slices.
    lps = torch.cat(target_lp).tolist()
    ranks = torch.cat(target_rank).tolist()
    alt_lps = torch.cat(top_lp).tolist() if top_lp else [[] for _ in index]
    alt_ids = torch.cat(top_ids).tolist() if top_ids else [[] for _ in index]

    out: dict[str, list[TokenLogprobs]] = {}
    row = 0
    for spec in specs:
        entries = out.setdefault(spec.request_id, [])
        for target in spec.targets:
            entry = {target: Logprob(logprob=lps[row], rank=ranks[row])}
            for rank, (alt, alt_lp) in enumerate(zip(alt_ids[row][:spec.top_n], alt_lps[row][:spec.top_n]), 1):
                entry.setdefault(alt, Logprob(logprob=alt_lp, rank=rank))
            entries.append(entry)
            row += 1
    return out
