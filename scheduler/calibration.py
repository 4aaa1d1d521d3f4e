"""A cost model that learns from the steps it predicts.

The SLO-aware budget (ConServe §4.2) and the preemption rule (§4.3) are only
as good as the predicted step time. ConServe profiles the model offline; a
daemon started without a profile (``--profile``) has only the roofline, which
on a CPU or an unlisted GPU is off by 2-4x, in both directions depending on
the step's shape (it misses per-step overhead, and it assumes a sustained
FLOP rate the small GEMMs of a decode step never reach). So the engine
reports every step it ran (its shape and measured seconds) and this model
keeps a linear fit of them -- the same five terms as ``LinearCostModel`` --
which replaces the prior once enough steps have been seen.

The fit is least squares of the *relative* error (each step weighted by one
over its squared time: a 20 ms decode step, whose time is what the TPOT budget
decides, counts as much as a 600 ms prefill, instead of being noise beside
it), with exponential forgetting (old steps fade with a
half-life, so the model follows a machine whose speed drifts), a light ridge
pull toward the prior's own best linear fit of the same steps (directions
the observed steps do not vary in keep the prior's slope, instead of
whatever noise makes of them), and non-negative coefficients (a term that
fits negative is dropped and the rest refit). Pure Python: five features,
O(25) work a step, a 5x5 solve every ``refit_every`` steps.

It also keeps how far off its predictions run: the root mean square of the
relative error of each step's prediction (made before that step was seen),
with the same forgetting. The SLO budget plans against a step that much
slower than predicted, so noise in step times does not turn a budget aimed
exactly at the SLO into half the steps over it.
"""

from __future__ import annotations

import math
from typing import Any

from fluidserve.scheduler.cost_model import CostModel, LinearCoefficients, LinearCostModel, _StepShapeMixin

_N = 5  # base, prefill tokens, decode requests, context tokens, prefill attention pairs
_EAGER_STEPS = 64
# The relative error assumed of predictions not yet checked against enough
# steps: the prior scaled by one measured ratio (a roofline misses per-step
# overhead and small-GEMM speed, unevenly across step shapes).
_UNMEASURED_ERROR = 0.5


def _features(shape: tuple[int, int, int, int]) -> list[float]:
    prefill, decodes, context, pairs = shape
    return [1.0, float(prefill), float(decodes), float(context), float(pairs)]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b (Gaussian elimination, partial pivoting); None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class CalibratingCostModel(_StepShapeMixin):
    """Predicts with ``prior``, scaled by the mean ratio of measured to
    predicted time of the steps seen, until ``min_steps`` steps have been
    observed; then with a linear fit of the observed steps (refit after
    every step for the first 64, then every ``refit_every``). Anything else a caller asks
    of a cost model (``transfer_time``, ``describe``) is the prior's."""

    def __init__(self, prior: CostModel, half_life_steps: float = 512.0, refit_every: int = 16,
                 min_steps: int = 8, ridge: float = 0.001) -> None:
        if half_life_steps <= 0 or refit_every < 1 or min_steps < 1 or ridge < 0:
            raise ValueError("half_life_steps and ridge must be positive, refit_every and min_steps >= 1")
        self.prior = prior
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.refit_every = refit_every
        self.min_steps = min_steps
        self.ridge = ridge
        self.fitted: LinearCostModel | None = None
        self.num_observed = 0
        self._xx = [[0.0] * _N for _ in range(_N)]  # sum of w x x^T
        self._xy = [0.0] * _N  # sum of w x y (measured)
        self._xp = [0.0] * _N  # sum of w x y (the prior's prediction)
        self._scale = [1.0] * _N  # largest |feature| seen: conditions the solve
        # Measured / prior, averaged: until the fit takes over the prior is
        # scaled by it (the roofline's overall speed is its largest error).
        self._ratio_sum = 0.0
        self._ratio_n = 0.0
        self._sq_err = 0.0  # forgetting sums of squared relative errors of fitted predictions
        self._sq_n = 0.0

    def __getattr__(self, name: str) -> Any:  # only called for what this class lacks
        if name == "prior":
            raise AttributeError(name)
        return getattr(self.prior, name)

    def step_time(self, num_prefill_tokens: int, num_decode_seqs: int, total_context: int,
                  prefill_attn_pairs: int | None = None) -> float:
        if self.fitted is not None:
            return self.fitted.step_time(num_prefill_tokens, num_decode_seqs, total_context, prefill_attn_pairs)
        t = self.prior.step_time(num_prefill_tokens, num_decode_seqs, total_context, prefill_attn_pairs)
        return t * self._ratio_sum / self._ratio_n if self._ratio_n else t

    def observe(self, shape: tuple[int, int, int, int], seconds: float) -> None:
        """A step of ``shape`` (``plan_shape``'s tuple) took ``seconds``."""
        if shape[0] + shape[1] == 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        x = _features(shape)
        prior = self.prior.step_time(*shape)
        d = self.decay
        if self.fitted is not None:
            err = self.fitted.step_time(*shape) / seconds - 1.0
            self._sq_err = d * self._sq_err + err * err
            self._sq_n = d * self._sq_n + 1.0
        w = 1.0 / (seconds * seconds)  # relative error: see the module docstring
        xx, xy, xp, scale = self._xx, self._xy, self._xp, self._scale
        for i in range(_N):
            xi = x[i]
            if xi > scale[i]:
                scale[i] = xi
            row = xx[i]
            wxi = w * xi
            for j in range(_N):
                row[j] = d * row[j] + wxi * x[j]
            xy[i] = d * xy[i] + wxi * seconds
            xp[i] = d * xp[i] + wxi * prior
        self.num_observed += 1
        self._ratio_sum = d * self._ratio_sum + seconds / prior if prior > 0 else self._ratio_sum
        self._ratio_n = d * self._ratio_n + (prior > 0)
        n = self.num_observed
        # Refit every step while the fit is young (the first online requests
        # are served by it), then every refit_every steps.
        if n >= self.min_steps and (n < _EAGER_STEPS or n % self.refit_every == 0):
            self.refit()

    def uncertainty(self) -> float:
        """Relative RMS error of the fitted predictions so far; until the
        fit has predicted ``min_steps`` steps, ``_UNMEASURED_ERROR``: the
        first steps are planned with the least evidence, so they get the
        widest margin, not none (the first online request of a benchmark
        run, arriving a few steps in, took 27 ms per token against a 25.5 ms
        SLO the budget had planned for as if its predictions were exact)."""
        if self._sq_n < self.min_steps:
            return _UNMEASURED_ERROR
        return math.sqrt(self._sq_err / self._sq_n)

    def refit(self) -> None:
        """Refit from the steps observed so far (called every ``refit_every``)."""
        s = self._scale
        # In scaled units (feature / its largest value) the normal equations
        # are well conditioned whatever the magnitudes (1 vs 1e6 pairs).
        a = [[self._xx[i][j] / (s[i] * s[j]) for j in range(_N)] for i in range(_N)]
        y = [self._xy[i] / s[i] for i in range(_N)]
        p = [self._xp[i] / s[i] for i in range(_N)]
        prior_w = self._nonneg_fit(a, p, [0.0] * _N, 0.0)
        if prior_w is None:
            return
        # Pulled toward the prior's shape at the measured overall speed.
        scale = self._ratio_sum / self._ratio_n if self._ratio_n else 1.0
        w = self._nonneg_fit(a, y, [v * scale for v in prior_w], self.ridge)
        if w is None:
            return
        self.fitted = LinearCostModel(LinearCoefficients(*(w[i] / s[i] for i in range(_N))),
                                      {"calibrated_steps": self.num_observed})

    @staticmethod
    def _nonneg_fit(a: list[list[float]], y: list[float], toward: list[float], ridge: float) -> list[float] | None:
        """argmin |X w - y|^2 + ridge * sum_i a_ii (w_i - toward_i)^2 with
        w >= 0: the unconstrained solve, dropping (fixing at 0) any term that
        comes out negative, until none does."""
        active = list(range(_N))
        while active:
            sub = [[a[i][j] + (ridge * a[i][i] + 1e-9 if i == j else 0.0) for j in active] for i in active]
            rhs = [y[i] + ridge * a[i][i] * toward[i] for i in active]
            sol = _solve(sub, rhs)
            if sol is None:
                return None
            if min(sol) >= 0:
                w = [0.0] * _N
                for i, v in zip(active, sol):
                    w[i] = v
                return w
            del active[sol.index(min(sol))]
        return None

    def describe(self) -> dict:
        out = {"kind": "calibrating", "observed_steps": self.num_observed,
               "prior": self.prior.describe() if hasattr(self.prior, "describe") else type(self.prior).__name__}
        if self.fitted is not None:
            out["fitted"] = self.fitted.to_json()
        return out
