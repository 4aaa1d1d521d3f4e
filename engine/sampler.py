"""Sampler: one step's logits in, one next token (and its logprobs) per row out.

Owns the per-step sampling pipeline and nothing else: logprobs of the raw
distribution, allowed_token_ids / logit_bias / bad_words, min_tokens masking,
repetition / presence / frequency penalties, a thinking budget's forced end,
the grammar's token mask of
constrained rows (structured output), then greedy argmax or
temperature -> top_k -> top_p -> min_p -> draw. Rows are
independent sequences; each may carry its own ``torch.Generator`` so a seeded
request draws the same token whatever else shares its batch.

Order of operations follows vLLM: logprobs come from the logits the model
produced (before any penalty or temperature), so they describe the model, not
the request's sampling knobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fluidserve.engine.outputs import Logprob
from fluidserve.engine.sampling_params import SamplingParams
from fluidserve.engine.structured import TokenMask

_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF  # torch.Generator.manual_seed takes 64-bit seeds


@dataclass
class SamplingRow:
    """One row of logits = one sequence that samples this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (before this step)
    generator: torch.Generator | None  # per-request, seeded from params.seed; None = global RNG
    # prompt_token_ids + output_token_ids as numpy, kept by the worker
    # (engine/token_history.py); None: converted here when a penalty counts them.
    history: np.ndarray | None = None

    def tokens(self, with_prompt: bool) -> np.ndarray:
        """The row's prompt and output tokens, or its output tokens alone."""
        if self.history is not None:
            return self.history if with_prompt else self.history[len(self.prompt_token_ids):]
        ids = self.prompt_token_ids + self.output_token_ids if with_prompt else self.output_token_ids
        return np.fromiter(ids, np.int64, len(ids))


def reads_outputs(p: SamplingParams) -> bool:
    """Whether a row's sampling reads the sequence's outputs so far: a
    penalty, a bad word of more than one token, min_tokens, or a thinking
    budget (the thinking tokens are counted in them)."""
    return bool(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.min_tokens
                or any(len(w) > 1 for w in p.bad_words_token_ids) or p.thinking_token_budget is not None)


@dataclass
class SampledToken:
    token_id: int
    # The sampled token plus the top-N (params.logprobs) alternatives, with
    # ranks in the raw distribution; None when the request asked for no logprobs.
    logprobs: dict[int, Logprob] | None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator for one request's draws, or None to use the global RNG.

    Must live on the device the logits live on: the draws refuse a
    generator of another device."""
    if seed is None:
        return None
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed & _SEED_MASK)
    return generator


def sample(logits: torch.Tensor, rows: list[SamplingRow], eos_token_id: int | None,
           token_mask: TokenMask | None = None) -> list[SampledToken]:
    """Choose the next token of every row. ``logits``: [num_rows, vocab], any
    float dtype. ``token_mask``: the grammar's allowed tokens of the
    constrained rows (engine/structured.py)."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}")
    if not rows:
        return []
    if token_mask is None and all(_plain_greedy(row.params) for row in rows):
        # No stage below would touch these rows: the argmax of the logits
        # themselves (fp32: no copy of [R, V] every step; a lower precision
        # is cast, exactly, since torch's argmax over bf16 is 2-4x slower
        # than the cast and an fp32 argmax together).
        return [SampledToken(t, None) for t in logits.float().argmax(dim=-1).tolist()]
    # One fp32 copy that every later stage may modify in place; the caller's
    # tensor is left untouched.
    logits = logits.to(torch.float32, copy=True, memory_format=torch.contiguous_format)  # [R, V], flat-indexable
    raw_logprobs = None
    if any(row.params.logprobs is not None for row in rows):
        raw_logprobs = torch.log_softmax(logits, dim=-1)  # [R, V]

    _apply_allowed_and_bias(logits, rows)
    _mask_bad_words(logits, rows)
    _mask_stop_tokens_before_min(logits, rows, eos_token_id)
    _apply_repetition_penalty(logits, rows)
    _apply_presence_frequency_penalties(logits, rows)
    _force_thinking_end(logits, rows)
    if token_mask is not None:
        token_mask.apply(logits)  # last: no later stage may lift a -inf the grammar set
    token_ids = _choose_tokens(logits, rows)  # [R] int64

    chosen = token_ids.tolist()
    logprobs = _gather_logprobs(raw_logprobs, token_ids, rows) if raw_logprobs is not None else {}
    return [SampledToken(token_id=tok, logprobs=logprobs.get(i)) for i, tok in enumerate(chosen)]


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[R] int64 next tokens, left on the logits' device (nothing is read
    back), for a step whose tokens are read after the next one is queued.
    Every row must be ``device_only`` (the engine decides that once per
    request): no stage of ``sample`` but the draw applies to it."""
    if all(row.params.greedy for row in rows):
        return logits.float().argmax(dim=-1)
    return _choose_tokens(logits.to(torch.float32, copy=True), rows)


def device_only(p: SamplingParams) -> bool:
    """The row's token depends on its logits alone (and the global RNG):
    no per-request seed or grammar, and no logits stage."""
    return _no_logits_stage(p) and p.seed is None and p.structured_outputs is None


def _plain_greedy(p: SamplingParams) -> bool:
    """Greedy, and nothing of the stages below applies to the row."""
    return p.greedy and _no_logits_stage(p)


def _no_logits_stage(p: SamplingParams) -> bool:
    """No logprobs to gather, and nothing that masks, biases or penalises logits."""
    return (p.logprobs is None and p.allowed_token_ids is None and not p.logit_bias and not p.bad_words_token_ids
            and not p.min_tokens and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and p.thinking_token_budget is None)


# ---------------------------------------------------------------- logits stages


def _apply_allowed_and_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """allowed_token_ids: every other token to -inf; logit_bias: added to the
    named tokens' logits. Both gathered into one index list for the batch."""
    vocab = logits.shape[1]
    allowed = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if allowed:
        keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=logits.device)  # [A, V]
        row_of = [r for r, i in enumerate(allowed) for t in rows[i].params.allowed_token_ids if t < vocab]
        toks = [t for i in allowed for t in rows[i].params.allowed_token_ids if t < vocab]
        if toks:
            keep[_index(row_of, logits), _index(toks, logits)] = True
        sel_t = _index(allowed, logits)
        logits[sel_t] = logits[sel_t].masked_fill(~keep, float("-inf"))
    row_idx: list[int] = []
    tok_idx: list[int] = []
    bias: list[float] = []
    for i, row in enumerate(rows):
        for tok, value in (row.params.logit_bias or {}).items():
            if tok < vocab:
                row_idx.append(i)
                tok_idx.append(tok)
                bias.append(value)
    if row_idx:
        logits.index_put_((_index(row_idx, logits), _index(tok_idx, logits)),
                          torch.tensor(bias, dtype=logits.dtype, device=logits.device), accumulate=True)


def _mask_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Ban the last token of each bad word whose other tokens end the output
    so far (a one-token word is always banned)."""
    vocab = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, row in enumerate(rows):
        out = row.output_token_ids
        for word in row.params.bad_words_token_ids:
            head, last = word[:-1], word[-1]
            if last < vocab and (not head or (len(out) >= len(head) and out[len(out) - len(head):] == head)):
                row_idx.append(i)
                tok_idx.append(last)
    if row_idx:
        logits[_index(row_idx, logits), _index(tok_idx, logits)] = float("-inf")


def _force_thinking_end(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """A thinking row at its ``thinking_token_budget`` without the end of its
    thinking: that end marker is its one allowed token. Thinking tokens are
    counted as usage counts reasoning tokens, start markers left out. Rows
    short of the budget cost nothing; past it, the look for the marker stops
    where it sits (just past the budget)."""
    for i, row in enumerate(rows):
        p = row.params
        out = row.output_token_ids
        if p.thinking_token_budget is None or len(out) < p.thinking_token_budget:
            continue
        if p.thinking_end_token_id in out:
            continue
        if len(out) - out.count(p.thinking_start_token_id) >= p.thinking_token_budget:
            logits[i].fill_(float("-inf"))
            logits[i, p.thinking_end_token_id] = 0.0


def _mask_stop_tokens_before_min(logits: torch.Tensor, rows: list[SamplingRow], eos_token_id: int | None) -> None:
    """While a row has fewer than min_tokens outputs, it may not pick a token
    that would end it: EOS (unless ignore_eos, where EOS does not end anything)
    and its stop_token_ids."""
    vocab = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, row in enumerate(rows):
        params = row.params
        if len(row.output_token_ids) >= params.min_tokens:
            continue
        stops = list(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stops.append(eos_token_id)
        for tok in stops:
            if 0 <= tok < vocab:  # a stop id past the vocabulary can never be sampled anyway
                row_idx.append(i)
                tok_idx.append(tok)
    if row_idx:
        logits[_index(row_idx, logits), _index(tok_idx, logits)] = float("-inf")


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """HF semantics over prompt + output tokens: a seen token's logit is divided
    by the penalty when positive and multiplied when negative, so penalty > 1
    always makes it less likely."""
    sel = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not sel:
        return
    # A token seen twice is gathered twice and written twice, the same value
    # both times (as HF's gather and scatter do): no need to find each once.
    cells, of_row = _seen_cells(logits, sel, [rows[i].tokens(with_prompt=True) for i in sel], distinct=False)
    if cells is None:
        return
    penalty = torch.tensor([rows[i].params.repetition_penalty for i in sel], device=logits.device)[of_row]
    flat = logits.view(-1)
    seen = flat[cells]
    flat[cells] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _apply_presence_frequency_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """OpenAI semantics over output tokens only:
    logit -= frequency_penalty * count + presence_penalty * (count > 0)."""
    sel = [
        i for i, row in enumerate(rows)
        if (row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0) and row.output_token_ids
    ]
    if not sel:
        return
    cells, of_row, counts = _seen_cells(logits, sel, [rows[i].tokens(with_prompt=False) for i in sel], distinct=True)
    if cells is None:
        return
    freq = torch.tensor([rows[i].params.frequency_penalty for i in sel], device=logits.device)[of_row]
    pres = torch.tensor([rows[i].params.presence_penalty for i in sel], device=logits.device)[of_row]
    flat = logits.view(-1)
    flat[cells] = flat[cells] - freq * counts - pres


def _seen_cells(logits: torch.Tensor, sel: list[int], token_arrays: list[np.ndarray], distinct: bool
                ) -> tuple[torch.Tensor | None, ...]:
    """The logits cells (flat indices into ``logits`` [R, V]) of the tokens
    row ``sel[j]`` has seen (``token_arrays[j]``), and the ``sel`` position of
    each cell's row; with ``distinct``, each cell once and how often it was
    seen (float). Nones when no row has seen a token of the vocabulary.

    A penalty then touches only those cells: no [R, V] count or mask, and the
    indices are worked out in numpy (a Python loop over the tokens cost the
    host ~0.1 us each, every step). Each cell gets the arithmetic the dense
    form gave it, so the logits come out bit for bit as they did."""
    vocab = logits.shape[1]
    lens = np.fromiter(map(len, token_arrays), dtype=np.int64, count=len(token_arrays))
    tokens = np.concatenate(token_arrays).astype(np.int64) if lens.sum() else np.empty(0, dtype=np.int64)
    of_row = np.repeat(np.arange(len(sel)), lens)
    cells = np.asarray(sel, dtype=np.int64)[of_row] * vocab + tokens  # row * V + token
    known = (tokens >= 0) & (tokens < vocab)  # ids past the model's vocab cannot be penalised
    cells, of_row = cells[known], of_row[known]
    if not len(cells):
        return (None, None, None) if distinct else (None, None)
    device = logits.device
    if not distinct:
        return torch.from_numpy(cells).to(device), torch.from_numpy(of_row).to(device)
    cells, first, counts = np.unique(cells, return_index=True, return_counts=True)
    return (torch.from_numpy(cells).to(device), torch.from_numpy(of_row[first]).to(device),
            torch.from_numpy(counts).to(device, torch.float32))


# ---------------------------------------------------------------- choosing


def _choose_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[R] int64: argmax for greedy rows, a filtered random draw for the rest."""
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    if len(greedy) == len(rows):
        return logits.argmax(dim=-1)
    random = [i for i, row in enumerate(rows) if not row.params.greedy]
    token_ids = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
    if greedy:
        greedy_t = _index(greedy, logits)
        token_ids[greedy_t] = logits[greedy_t].argmax(dim=-1)
    random_t = _index(random, logits)
    params = [rows[i].params for i in random]
    temperature = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
    probs = _filtered_probs(logits[random_t] / temperature, params)  # [S, V]
    generators = [rows[i].generator for i in random]
    if probs.device.type == "cpu":
        token_ids[random_t] = _inverse_cdf_draw(probs, generators)
        return token_ids
    noise = _exponential_noise(probs, generators)  # [S, V]
    # Exponential race: argmax_i p_i / q_i with q_i ~ Exp(1) picks i with
    # probability p_i / sum(p). Zeroed (filtered) tokens can never win, and
    # no renormalisation is needed after filtering.
    token_ids[random_t] = (probs / noise).argmax(dim=-1)
    return token_ids


def _inverse_cdf_draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """[S] int64: one draw per row with probability p_i / sum(p), from one
    uniform per row (the first token whose running mass exceeds u * sum(p)).

    The CPU's draw: the exponential race needs a random number per
    vocabulary entry, and CPU ``exponential_`` makes them one at a time
    (about 40 ms for 64 rows of a 32k vocabulary, longer than the step's
    layers; this is about 1 ms). The running mass is summed in float64 so
    rounding cannot move mass between tokens; a zeroed (filtered) token adds
    nothing to it, so it is never the first to exceed anything."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)  # [S, V]
    u = torch.empty(len(generators), 1, dtype=torch.float64)
    for i, generator in enumerate(generators):
        if generator is not None:
            u[i] = torch.rand(1, dtype=torch.float64, generator=generator)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        u[shared] = torch.rand(len(shared), 1, dtype=torch.float64)
    token_ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    # u * mass may round up to the whole mass (u < 1 by a hair): the last
    # token with any mass is then the one drawn.
    over = token_ids >= probs.shape[1]
    if bool(over.any()):
        last = probs.shape[1] - 1 - (probs[over].flip(-1) > 0).to(torch.int8).argmax(dim=-1)
        token_ids[over] = last
    return token_ids


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[S, V] probabilities (not renormalised) after top_k, top_p and min_p.

    Rows whose filter is disabled pass through each stage bit-for-bit, so a
    row's result does not depend on what other rows in the batch ask for."""
    vocab = logits.shape[1]
    device = logits.device
    need_k = any(0 < p.top_k < vocab for p in params)
    need_p = any(p.top_p < 1.0 for p in params)
    if need_k or need_p:
        # Filter in sorted order, then scatter back: vocabulary order is what
        # the per-row noise is drawn in, so it must not change between paths.
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [S, V]
        if need_k:
            k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
            position = torch.arange(vocab, device=device)
            sorted_logits.masked_fill_(position.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))
        if need_p:
            # Keep the smallest head whose mass reaches top_p: drop a token
            # when the mass strictly before it already does. Disabled rows get
            # a threshold of inf so rounding in cumsum cannot drop their tail.
            top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            # The most likely token always survives: the mass before it is 0.
            sorted_logits.masked_fill_(mass_before >= top_p.unsqueeze(1), float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _exponential_noise(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """[S, V] Exp(1) noise. Rows with a generator draw a full row from it (so
    the draw is independent of batch composition); the rest share one draw
    from the global RNG."""
    noise = torch.empty_like(probs)
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        return noise.exponential_()
    if shared:
        shared_t = _index(shared, probs)
        noise[shared_t] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)  # in place on a row view
    return noise


# ---------------------------------------------------------------- logprobs


def _gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]
) -> dict[int, dict[int, Logprob]]:
    """Row index -> {token id: Logprob} for rows that asked for logprobs: the
    sampled token first, then the top-N by raw logprob."""
    sel = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    sel_t = _index(sel, raw_logprobs)
    lp = raw_logprobs[sel_t]  # [S, V]
    chosen = token_ids[sel_t]  # [S]
    chosen_lp = lp.gather(1, chosen.unsqueeze(1))  # [S, 1]
    # Rank = 1 + number of strictly more likely tokens (ties share the best rank).
    chosen_rank = (lp > chosen_lp).sum(dim=-1) + 1  # [S]
    top_n = max(rows[i].params.logprobs for i in sel)
    top_vals: list[list[float]] = [[] for _ in sel]
    top_ids: list[list[int]] = [[] for _ in sel]
    if top_n > 0:
        values, indices = lp.topk(min(top_n, lp.shape[1]), dim=-1)  # [S, N]
        top_vals, top_ids = values.tolist(), indices.tolist()

    asked = _asked_token_logprobs(lp, [rows[i].params.logprob_token_ids for i in sel])
    out: dict[int, dict[int, Logprob]] = {}
    rows_lp = zip(sel, chosen.tolist(), chosen_lp.squeeze(1).tolist(), chosen_rank.tolist(), top_vals, top_ids)
    for k, (i, tok, tok_lp, tok_rank, vals, ids) in enumerate(rows_lp):
        entry = {tok: Logprob(logprob=tok_lp, rank=tok_rank)}
        n = rows[i].params.logprobs
        for rank, (alt, alt_lp) in enumerate(zip(ids[:n], vals[:n]), start=1):
            entry.setdefault(alt, Logprob(logprob=alt_lp, rank=rank))
        for alt, (alt_lp, alt_rank) in asked.get(k, {}).items():
            entry.setdefault(alt, Logprob(logprob=alt_lp, rank=alt_rank))
        out[i] = entry
    return out


def _asked_token_logprobs(lp: torch.Tensor, asked: list[list[int] | None]) -> dict[int, dict[int, tuple[float, int]]]:
    """Row k of ``lp`` ([S, V]) -> {token id: (logprob, rank)} for the ids
    ``asked[k]`` names (``logprob_token_ids``); ids past the logits' width
    are skipped."""
    out: dict[int, dict[int, tuple[float, int]]] = {}
    for k, ids in enumerate(asked):
        ids = [t for t in ids or () if t < lp.shape[1]]
        if not ids:
            continue
        vals = lp[k, _index(ids, lp)]  # [K]
        ranks = (lp[k].unsqueeze(0) > vals.unsqueeze(1)).sum(dim=-1) + 1  # [K]
        out[k] = dict(zip(ids, zip(vals.tolist(), ranks.tolist())))
    return out


def _index(values: list[int], like: torch.Tensor) -> torch.Tensor:
    """An int64 index tensor on ``like``'s device."""
    return torch.tensor(values, dtype=torch.int64, device=like.device)
