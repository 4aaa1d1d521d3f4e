"""The calibrating cost model: it predicts with its prior until it has seen
enough steps, then learns the machine's step times from them (the shapes the
SLO budget predicts), follows a machine that slows down, never fits a
negative coefficient, and the engine feeds it every step it ran."""

from __future__ import annotations

import random

import pytest

from fluidserve.scheduler.calibration import CalibratingCostModel
from fluidserve.scheduler.cost_model import (
    LinearCoefficients, LinearCostModel, attn_pairs, cost_model_for_engine, default_cost_model,
)

# A machine whose steps cost 18 ms of overhead, unlike the H100 roofline prior.
TRUTH = LinearCostModel(LinearCoefficients(0.018, 1.5e-4, 3e-4, 2e-6, 1e-8))
PROBES = [(0, 1, 100, 0), (64, 0, 64, attn_pairs(64, 0)), (1024, 0, 1024, attn_pairs(1024, 0)),
          (64, 23, 64 + 23 * 1056, attn_pairs(64, 0)), (300, 12, 300 + 12 * 700, attn_pairs(300, 400))]


def _shapes(rng: random.Random, n: int):
    for _ in range(n):  # decode-only steps and mixed steps, as co-serving runs them
        if rng.random() < 0.5:
            d = rng.randint(1, 30)
            yield (0, d, d * rng.randint(50, 1100), 0)
        else:
            p, c, d = rng.randint(1, 1024), rng.randint(0, 500), rng.randint(0, 20)
            yield (p, d, p + c + d * 500, attn_pairs(p, c))


def _feed(model: CalibratingCostModel, truth, n: int, seed: int = 0, noise: float = 0.1) -> None:
    rng = random.Random(seed)
    for shape in _shapes(rng, n):
        model.observe(shape, truth.step_time(*shape) * rng.uniform(1 - noise, 1 + noise))


def test_predicts_with_the_scaled_prior_until_it_has_seen_enough_steps():
    prior = default_cost_model()
    model = CalibratingCostModel(prior, min_steps=32, refit_every=16)
    assert [model.step_time(*s) for s in PROBES] == [prior.step_time(*s) for s in PROBES]  # nothing seen yet
    _feed(model, TRUTH, 31)
    assert model.fitted is None
    # The prior's shape at the measured speed: one factor for every shape.
    ratios = [model.step_time(*s) / prior.step_time(*s) for s in PROBES]
    assert ratios == pytest.approx([ratios[0]] * len(PROBES)) and ratios[0] > 1.5


def test_learns_the_machine_within_a_few_percent_from_noisy_steps():
    prior = default_cost_model()
    off = [prior.step_time(*s) / TRUTH.step_time(*s) for s in PROBES]
    assert max(abs(r - 1) for r in off) > 0.5  # the prior is far off: the test can fail
    model = CalibratingCostModel(prior)
    _feed(model, TRUTH, 2000)  # +-10% noise on every step
    for s in PROBES:
        assert model.step_time(*s) == pytest.approx(TRUTH.step_time(*s), rel=0.05)
    # decode_time / prefill_time / min_iteration_time follow the fit too.
    assert model.min_iteration_time() == pytest.approx(TRUTH.min_iteration_time(), rel=0.05)


def test_follows_a_machine_that_slows_down():
    model = CalibratingCostModel(default_cost_model(), half_life_steps=128)
    _feed(model, TRUTH, 1000)
    slow = LinearCostModel(LinearCoefficients(*(2 * v for v in vars(TRUTH.c).values())))
    _feed(model, slow, 1500, seed=1)
    for s in PROBES:
        assert model.step_time(*s) == pytest.approx(slow.step_time(*s), rel=0.08)


def test_coefficients_stay_non_negative():
    # Step times that fall as prefill grows (nonsense a noisy machine can
    # produce): the fit drops the term instead of predicting negative times.
    inverted = CalibratingCostModel(default_cost_model(), min_steps=8, refit_every=8)
    for p in range(1, 400):
        inverted.observe((p, 0, p, attn_pairs(p, 0)), 0.05 - 1e-4 * p)
    assert inverted.fitted is not None
    assert all(v >= 0 for v in vars(inverted.fitted.c).values())
    assert all(inverted.step_time(*s) > 0 for s in PROBES)


def test_ignores_empty_and_unmeasurable_steps():
    model = CalibratingCostModel(default_cost_model(), min_steps=1, refit_every=1)
    for bad in ((0, 0, 0, 0), (4, 0, 4, 10)):
        model.observe(bad, float("nan") if bad[0] else 0.01)
    model.observe((4, 0, 4, 10), -1.0)
    assert model.num_observed == 0 and model.fitted is None


def test_the_engine_calibrates_when_an_slo_needs_the_model():
    class Cfg:
        profile_path = None
        dtype = "float32"
        online_tpot_slo_ms = None
        online_ttft_slo_ms = None
        calibrate_cost_model = None

    hf = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
    cfg = Cfg()
    assert not isinstance(cost_model_for_engine(cfg, hf, "cpu"), CalibratingCostModel)
    cfg.online_tpot_slo_ms = 50.0
    model = cost_model_for_engine(cfg, hf, "cpu")
    assert isinstance(model, CalibratingCostModel)
    assert model.transfer_time(1 << 20) == model.prior.transfer_time(1 << 20)  # the rest is the prior's
    cfg.calibrate_cost_model = False
    assert not isinstance(cost_model_for_engine(cfg, hf, "cpu"), CalibratingCostModel)


def test_engine_steps_reach_the_model(tiny_model, make_llm):
    from fluidserve.engine import SamplingParams

    llm = make_llm(tiny_model(), online_tpot_slo_ms=1000.0)
    cost = llm.engine.cost_model
    assert isinstance(cost, CalibratingCostModel)
    steps = llm.engine.stats().num_steps
    llm.generate([[1, 2, 3, 4, 5]] * 3, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    ran = llm.engine.stats().num_steps - steps
    assert ran >= 40 and cost.num_observed == ran
    assert cost.fitted is not None and all(v >= 0 for v in vars(cost.fitted.c).values())


def test_fits_the_relative_error_so_small_steps_stay_accurate():
    """A machine the five linear terms cannot express exactly (a decode row
    reads its context slower than a prefill does; bigger prefills run faster
    per token): fitted on relative error, the 20-50 ms steps the TPOT budget
    decides keep their accuracy instead of absorbing the misfit of 600 ms
    prefills (fitted on absolute error they were off 2.7% on average here)."""
    def truth(shape):
        p, d, c, pairs = shape
        return 0.020 + 2.4e-4 * p ** 0.93 + 3e-4 * d + (c - p) * 5e-6 * (d > 0) + 2e-8 * pairs

    rng = random.Random(0)
    model = CalibratingCostModel(default_cost_model())
    for shape in _shapes(rng, 3000):
        model.observe(shape, truth(shape) * rng.uniform(0.95, 1.05))
    errors = {"small": [], "big": []}
    for shape in _shapes(random.Random(1), 400):
        errors["small" if truth(shape) < 0.05 else "big"].append(abs(model.step_time(*shape) / truth(shape) - 1))
    assert len(errors["small"]) > 50 and len(errors["big"]) > 50
    assert sum(errors["small"]) / len(errors["small"]) < 0.015
    assert max(errors["small"]) < 0.05 and max(errors["big"]) < 0.05


def test_measures_how_far_off_its_predictions_run():
    """The relative RMS error of its predictions: about the noise of the
    step times (uniform +-10%: 5.8%), near zero without noise; before the
    fit has predicted a few steps, a wide margin is assumed, not none."""
    noisy, exact = CalibratingCostModel(default_cost_model()), CalibratingCostModel(default_cost_model())
    assert noisy.uncertainty() == 0.5
    _feed(noisy, TRUTH, 3, noise=0.1)
    assert noisy.uncertainty() == 0.5  # three steps: not yet measured
    _feed(noisy, TRUTH, 2000, noise=0.1)
    _feed(exact, TRUTH, 2000, noise=0.0)
    assert 0.045 < noisy.uncertainty() < 0.075
    assert exact.uncertainty() < 0.01
