"""Sampler tests: each stage against a hand-written or independent reference
(torch.log_softmax / topk, HF's logits processors, HF generate), on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from fluidserve.engine.sampler import (
    SampledToken,
    SamplingRow,
    _apply_presence_frequency_penalties,
    _apply_repetition_penalty,
    _exponential_noise,
    _inverse_cdf_draw,
    make_generator,
    sample,
)
from fluidserve.engine.sampling_params import SamplingParams

EOS = 7


def row(params: SamplingParams | None = None, prompt=(), output=(), generator=None) -> SamplingRow:
    return SamplingRow(
        params=params or SamplingParams(), prompt_token_ids=list(prompt),
        output_token_ids=list(output), generator=generator,
    )


def ids(tokens: list[SampledToken]) -> list[int]:
    return [t.token_id for t in tokens]


def logits_from_probs(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).contiguous()  # [rows, V]


# ---------------------------------------------------------------- greedy


def test_greedy_equals_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(6)]
    assert ids(sample(logits, rows, EOS)) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_greedy_any_float_dtype_and_input_untouched(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 64).to(dtype)
    before = logits.clone()
    rows = [row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[1, 2], output=[3])] * 3
    sample(logits, rows, EOS)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_plain_greedy_on_low_precision_logits_picks_what_the_fp32_path_picks(dtype: torch.dtype) -> None:
    """Plain greedy rows take the argmax without the working copy the stages
    use; rows the stages touch go through the copy. Both pick the same
    token, ties included (low-precision logits tie often): the first index."""
    torch.manual_seed(3)
    logits = (torch.randn(64, 500) * 3).to(dtype)
    logits[:, 7] = logits.max(dim=-1).values  # a tie with each row's maximum, earlier in the vocabulary
    plain = ids(sample(logits, [row(SamplingParams(temperature=0.0))] * 64, EOS))
    # A repetition penalty of 1 + tiny on a token no row favours: the fp32 path, same choice.
    copied = ids(sample(logits, [row(SamplingParams(temperature=0.0, repetition_penalty=1.0 + 1e-9),
                                     prompt=[499], output=[])] * 64, EOS))
    assert plain == copied == logits.float().argmax(-1).tolist()
    assert all(t <= 7 for t in plain)


def test_greedy_mixed_with_random_rows_keeps_argmax() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 100)
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=1.0, top_k=5)),
            row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=0.7, top_p=0.5))]
    out = ids(sample(logits, rows, EOS))
    assert out[0] == logits[0].argmax().item() and out[2] == logits[2].argmax().item()


def test_greedy_repetition_penalty_matches_hf_processor() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(3)
    logits = torch.randn(4, 50) * 3
    history = [[1, 5, 9, 9], [0, 2, 4], [10, 11, 12, 13], [49, 48]]
    for penalty in (0.5, 1.3, 2.0):
        rows = [row(SamplingParams(temperature=0.0, repetition_penalty=penalty), prompt=h[:2], output=h[2:])
                for h in history]
        ours = ids(sample(logits, rows, EOS))
        proc = RepetitionPenaltyLogitsProcessor(penalty)
        expected = [proc(torch.tensor([h]), logits[i:i + 1].clone()).argmax().item() for i, h in enumerate(history)]
        assert ours == expected


def test_greedy_matches_hf_generate_on_tiny_model(tmp_path) -> None:
    """Default params (plus repetition_penalty, which HF also applies) drive
    the same greedy continuation as HF generate(do_sample=False)."""
    import transformers

    from fluidserve.engine.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "m", "llama", seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    prompt = [104, 101, 108, 108, 111]
    for penalty in (1.0, 1.5):
        with torch.no_grad():
            hf = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                repetition_penalty=penalty, eos_token_id=257, pad_token_id=258,
            )[0, len(prompt):].tolist()
            params = SamplingParams(temperature=0.0, repetition_penalty=penalty, min_tokens=12, max_tokens=12)
            out: list[int] = []
            for _ in range(12):
                logits = model(torch.tensor([prompt + out])).logits[:, -1]  # [1, V]
                out.append(sample(logits, [row(params, prompt=prompt, output=out)], eos_token_id=257)[0].token_id)
        assert out == hf


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_hand_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0]])
    rows = [row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1, 3, 3])]
    _apply_repetition_penalty(logits, rows)
    # seen {0, 1, 3}: positives halved, negatives doubled; 2 and 4 untouched
    assert torch.allclose(logits, torch.tensor([[1.0, -2.0, 0.5, 1.5, -4.0]]))


def test_presence_frequency_penalty_hand_values() -> None:
    logits = torch.zeros(2, 5)
    rows = [
        row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[3, 3], output=[1, 1, 2]),
        row(SamplingParams(), prompt=[0], output=[0, 1]),  # no penalties: untouched
    ]
    _apply_presence_frequency_penalties(logits, rows)
    # token 1: 2*0.5 + 0.25; token 2: 0.5 + 0.25; prompt-only token 3: untouched
    assert torch.allclose(logits, torch.tensor([[0.0, -1.25, -0.75, 0.0, 0.0], [0.0] * 5]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_equal_the_dense_formulas_bit_for_bit(seed) -> None:
    """The penalties touch only the cells of seen tokens; the logits must come
    out exactly as the dense formulas over [R, V] give them (HF's repetition
    penalty, OpenAI's presence/frequency): rows with and without penalties,
    repeated tokens, ids past the vocabulary, negative and positive logits,
    negative penalties."""
    gen = torch.Generator().manual_seed(seed)
    vocab, num_rows = 97, 7
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    rows = []
    for r in range(num_rows):
        params = SamplingParams(repetition_penalty=[1.0, 1.3, 0.7][r % 3], frequency_penalty=[0.0, 0.35, -0.2][r % 3],
                                presence_penalty=[0.0, 0.6, 0.0, -0.4][r % 4])
        tokens = torch.randint(0, vocab + 5, (40,), generator=gen).tolist()  # a few past the vocabulary
        rows.append(row(params, prompt=tokens[:25], output=tokens[25:] if r != 4 else []))
    want = logits.clone()
    for r, rw in enumerate(rows):
        p = rw.params
        seen = torch.zeros(vocab, dtype=torch.bool)
        counts = torch.zeros(vocab)
        for t in rw.prompt_token_ids + rw.output_token_ids:
            if t < vocab:
                seen[t] = True
        for t in rw.output_token_ids:
            if t < vocab:
                counts[t] += 1
        if p.repetition_penalty != 1.0:
            pen = torch.tensor([p.repetition_penalty])
            want[r] = torch.where(seen, torch.where(want[r] > 0, want[r] / pen, want[r] * pen), want[r])
        if p.presence_penalty or p.frequency_penalty:
            want[r] = want[r] - torch.tensor([p.frequency_penalty]) * counts - torch.tensor([p.presence_penalty]) * (
                counts > 0).float()
    got = logits.clone()
    _apply_repetition_penalty(got, rows)
    _apply_presence_frequency_penalties(got, rows)
    assert torch.equal(got, want)


def test_penalties_take_logits_of_any_layout() -> None:
    """The penalties index the logits' fp32 copy flat: a transposed
    (non-contiguous) [R, V] gives the tokens its contiguous copy gives."""
    torch.manual_seed(1)
    logits = torch.randn(300, 5).t()  # [5, 300], column-major
    rows = [row(SamplingParams(temperature=0.0, repetition_penalty=3.0, frequency_penalty=1.0),
                prompt=logits[r].topk(3).indices.tolist(), output=logits[r].topk(5).indices.tolist()[3:])
            for r in range(5)]
    assert ids(sample(logits, rows, EOS)) == ids(sample(logits.contiguous(), rows, EOS))
    assert ids(sample(logits, rows, EOS)) != logits.argmax(-1).tolist()  # the penalties moved the choice


def test_negative_presence_penalty_encourages() -> None:
    logits = torch.tensor([[1.0, 0.0, 0.0]])
    rows = [row(SamplingParams(temperature=0.0, presence_penalty=-2.0), output=[2])]
    assert ids(sample(logits, rows, EOS)) == [2]


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    rows = [
        row(SamplingParams(temperature=0.0), output=[0]),
        row(SamplingParams(temperature=0.0, frequency_penalty=0.2), output=[0]),
        row(SamplingParams(temperature=0.0, repetition_penalty=1.1), prompt=[0]),
    ]
    assert ids(sample(logits, rows, EOS)) == [0, 1, 1]


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 10.0
    logits[0, 3] = 9.0
    logits[0, 5] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3])
    assert ids(sample(logits, [row(params, output=[1, 1])], EOS)) == [5]
    assert ids(sample(logits, [row(params, output=[1, 1, 1])], EOS)) == [EOS]
    # ignore_eos: EOS ends nothing, so there is nothing to mask
    ignore = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert ids(sample(logits, [row(ignore, output=[])], EOS)) == [EOS]


def test_min_tokens_masks_eos_when_sampling() -> None:
    logits = torch.zeros(500, 10)
    logits[:, EOS] = 5.0  # ~94% of the mass
    params = SamplingParams(temperature=1.0, min_tokens=1)
    assert EOS not in ids(sample(logits, [row(params)] * 500, EOS))


# ---------------------------------------------------------------- filters

PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.6), {0, 1}),  # mass before token 2 is 0.7 >= 0.6
        (SamplingParams(top_p=0.3), {0}),
        (SamplingParams(min_p=0.3), {0, 1, 2}),  # threshold 0.12
        (SamplingParams(top_k=3, top_p=0.9, min_p=0.5), {0, 1}),
        (SamplingParams(temperature=1.5, top_k=4), {0, 1, 2, 3}),
    ],
)
def test_filters_never_sample_outside_allowed_set(params: SamplingParams, allowed: set[int]) -> None:
    torch.manual_seed(4)
    n = 3000
    drawn = ids(sample(logits_from_probs(PROBS, n), [row(params)] * n, EOS))
    assert set(drawn) == allowed  # nothing outside, and every allowed token shows up


def test_filters_per_row_in_one_batch() -> None:
    torch.manual_seed(5)
    kinds = [(SamplingParams(top_k=1), {0}), (SamplingParams(top_p=0.6), {0, 1}),
             (SamplingParams(min_p=0.3), {0, 1, 2}), (SamplingParams(), {0, 1, 2, 3, 4})]
    reps = 800
    rows = [row(p) for p, _ in kinds for _ in range(reps)]
    drawn = ids(sample(logits_from_probs(PROBS, len(rows)), rows, EOS))
    for k, (_, allowed) in enumerate(kinds):
        assert set(drawn[k * reps:(k + 1) * reps]) == allowed


def test_sampling_frequencies_follow_distribution() -> None:
    """Plain sampling, after top_k renormalisation, and with temperature."""
    torch.manual_seed(6)
    n = 20000
    cases = [
        (SamplingParams(), PROBS),
        (SamplingParams(top_k=2), [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]),
        (SamplingParams(temperature=0.5), [p * p / sum(q * q for q in PROBS) for p in PROBS]),
    ]
    for params, expected in cases:
        drawn = torch.tensor(ids(sample(logits_from_probs(PROBS, n), [row(params)] * n, EOS)))
        freq = torch.bincount(drawn, minlength=5).float() / n
        # 4 standard errors at n=20000 is < 0.015 for every p here
        assert torch.allclose(freq, torch.tensor(expected), atol=0.015), (params, freq)


@pytest.mark.parametrize("draw", ["inverse cdf (CPU)", "exponential race (CUDA)"])
def test_both_draws_follow_the_distribution_and_skip_zeroed_tokens(draw: str) -> None:
    """The CPU's one-uniform-per-row draw and the exponential race the CUDA
    path runs pick token i with probability p_i / sum(p) from unnormalised,
    partly zeroed rows (filters zero tokens at either end and inside)."""
    torch.manual_seed(8)
    n = 20000
    unnormalised = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.1, 0.0, 0.2, 0.0]) * 0.7
    probs = unnormalised.expand(n, -1).contiguous()
    if draw.startswith("inverse"):
        drawn = _inverse_cdf_draw(probs, [None] * n)
    else:
        drawn = (probs / _exponential_noise(probs, [None] * n)).argmax(dim=-1)
    freq = torch.bincount(drawn, minlength=8).float() / n
    assert freq[unnormalised == 0].sum() == 0
    assert torch.allclose(freq, unnormalised / unnormalised.sum(), atol=0.015), freq


def test_inverse_cdf_draw_never_returns_a_zeroed_last_token(monkeypatch) -> None:
    """Where u * mass rounds up to the whole mass the draw falls past the
    end: it takes the last token with mass, not a filtered one."""
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.ones(*shape, dtype=torch.float64))  # u = 1
    assert _inverse_cdf_draw(probs, [None, None]).tolist() == [1, 2]


# ---------------------------------------------------------------- seeds


def test_seeded_rows_reproducible_and_batch_independent() -> None:
    torch.manual_seed(7)
    vocab = 1000
    base = torch.randn(1, vocab) * 0.1  # flat: a coincidental match is unlikely
    seeded = SamplingParams(temperature=0.9, seed=1234)

    def alone() -> list[int]:
        g = make_generator(seeded.seed, "cpu")
        return [sample(base, [row(seeded, generator=g)], EOS)[0].token_id for _ in range(8)]

    def in_batch() -> list[int]:
        g = make_generator(seeded.seed, "cpu")
        other_g = make_generator(99, "cpu")
        noise = torch.randn(4, vocab)
        logits = torch.cat([noise[:2], base, noise[2:]])  # the seeded row sits in the middle
        rows = [
            row(SamplingParams(temperature=1.0)),
            row(SamplingParams(top_k=5, top_p=0.5, seed=99), generator=other_g),  # forces the sorted path
            row(seeded, generator=g),
            row(SamplingParams(temperature=0.0)),
            row(SamplingParams(min_p=0.1)),
        ]
        return [sample(logits, rows, EOS)[2].token_id for _ in range(8)]

    first = alone()
    assert first == alone() == in_batch()
    assert len(set(first)) > 1  # the generator advances between steps

    other_seed = SamplingParams(temperature=0.9, seed=4321)
    g = make_generator(other_seed.seed, "cpu")
    assert [sample(base, [row(other_seed, generator=g)], EOS)[0].token_id for _ in range(8)] != first


def test_make_generator() -> None:
    assert make_generator(None, "cpu") is None
    a, b = make_generator(5, "cpu"), make_generator(5, "cpu")
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert make_generator(-1, "cpu") is not None  # out-of-range seeds are folded, not rejected


# ---------------------------------------------------------------- logprobs


def test_logprobs_top_n_and_sampled_rank() -> None:
    torch.manual_seed(8)
    logits = torch.randn(3, 50) * 2
    rows = [
        row(SamplingParams(temperature=1.0, logprobs=5)),
        row(SamplingParams(temperature=0.0, logprobs=3)),
        row(SamplingParams(temperature=1.0, logprobs=0)),
    ]
    out = sample(logits, rows, EOS)
    ref = torch.log_softmax(logits, -1)
    for i, (tok, n) in enumerate(zip(out, (5, 3, 0))):
        lp = tok.logprobs
        assert lp is not None
        values, indices = ref[i].topk(n)
        for rank, (v, t) in enumerate(zip(values.tolist(), indices.tolist()), start=1):
            assert lp[t].rank == rank and math.isclose(lp[t].logprob, v, abs_tol=1e-5)
        order = ref[i].argsort(descending=True).tolist()
        assert lp[tok.token_id].rank == order.index(tok.token_id) + 1
        assert math.isclose(lp[tok.token_id].logprob, ref[i, tok.token_id].item(), abs_tol=1e-5)
        assert set(lp) == set(indices.tolist()) | {tok.token_id}
        assert next(iter(lp)) == tok.token_id  # sampled token first


def test_logprobs_use_raw_logits_and_none_when_not_asked() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.5, -1.0]])
    params = SamplingParams(temperature=0.0, logprobs=1, repetition_penalty=10.0)
    out = sample(logits, [row(params, prompt=[0, 1])], EOS)[0]
    assert out.token_id == 2  # penalties moved the choice...
    ref = torch.log_softmax(logits[0], -1)
    assert math.isclose(out.logprobs[2].logprob, ref[2].item(), abs_tol=1e-6)  # ...not the logprobs
    assert out.logprobs[2].rank == 2 and out.logprobs[0].rank == 1
    assert set(out.logprobs) == {2, 0}
    assert sample(logits, [row(SamplingParams())], EOS)[0].logprobs is None


def test_empty_and_bad_shapes() -> None:
    assert sample(torch.zeros(0, 5), [], EOS) == []
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 5), [row()], EOS)
