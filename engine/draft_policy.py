"""How many drafts each sequence verifies in a step, chosen per step for the
time per token they save: after SmartSpec (Liu et al. 2024, "Optimizing
Speculative Decoding for Serving Large Language Models Using Goodput"),
which chooses drafts per step from acceptance rates and step cost, with the
step's cost measured on this device rather than modelled, and the mean time
per output token as what is minimised. Pure Python, no torch.

A draft is worth its chance of standing. With a per-token acceptance rate
``a`` (each draft stands with probability ``a`` given the ones before it
did), a sequence's ``j``-th draft yields a token with probability ``a**j``,
so with ``k`` drafts it expects ``g = 1 + a + ... + a**k`` tokens from the
step, and its time per token is the step's time over ``g``. Drafts also
cost: a verifying step computes ``1 + k`` positions a sequence, and on a
device bound by compute (a CPU's matmuls at a few rows, a GPU past the
memory-bound batch sizes) or on a slower path (a GPU's verifying step runs
eager or piecewise, not in the decode graph) that is slower than the
decode it replaces, for every sequence in the step. So, per step, the
policy orders every offered draft by how much it cuts its sequence's steps
per token (``1/g`` before it less ``1/g`` after), and takes the number
``D`` of the largest cuts that minimises the step's predicted time times
the sum, over its sequences, of steps per token: the step's mean time per
output token, ``D = 0`` included (counting ``TRUST`` of each draft's
forecast token). At batch 1, where drafts are nearly
free, all go; in a burst, only those whose sequences gain more than the
slower step costs every sequence beside them, or none. (SmartSpec
maximises the step's tokens a second instead; that would let sequences
that copy their prompt slow the ones that cannot draft, whose replies then
end the burst later.)

What is measured (``StepTimes``): the seconds of decode-only steps, as two
tables by the step's tokens, one for steps that verify drafts and one for
those that do not, each a moving average per token-count bucket. A token
count is predicted from the measured buckets around it (linear between
them, the slope of the last two beyond them), so exploring is guided by
what was seen. A table goes stale where it is not measured (a burst that
always drafts never times a plain decode): where one kind of step has not
run for ``refresh`` decisions, it runs once (a verifying one with at most
as many drafts as sequences), so a change of context length, thread count
or load shows in both. Before any verifying step is
timed, the first takes as many drafts as there are sequences (two at batch
1), the likeliest, and the next decisions extrapolate from it.

What is estimated (``Acceptance``): each sequence's rate, from its own
verifications (decayed: text moves between copying and free writing), with
the engine-wide rate as a prior worth one observation.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

# A new measurement's weight in a bucket's moving average.
SMOOTHING = 0.25
# How fast a sequence forgets how its earlier drafts fared, per verification.
DECAY = 0.75
# The share of a draft's forecast tokens the choice counts on. The forecasts
# (acceptance rates) are picked where they look best, so they err high;
# the step's cost to the sequences beside is measured. Where drafts cost
# nothing, any gain still decides.
TRUST = 0.8
# Decisions after which the option not taken is taken once to time it again.
REFRESH = 64
# Token counts up to EXACT each have a bucket; beyond, a bucket per ~19% (2 ** 0.25).
EXACT = 8
PER_OCTAVE = 4


def bucket(tokens: int) -> int:
    if tokens <= EXACT:
        return tokens
    return EXACT + round(PER_OCTAVE * math.log2(tokens / EXACT))


@dataclass(slots=True)
class Acceptance:
    """One sequence's verifications: drafts that stood, and rejections
    (at most one a step, where a draft did not stand), both decayed."""
    stood: float = 0.0
    rejected: float = 0.0

    def update(self, drafted: int, stood: int) -> None:
        self.stood = self.stood * DECAY + stood
        self.rejected = self.rejected * DECAY + (stood < drafted)


@dataclass(slots=True)
class _Timed:
    tokens: float  # mean token count of the steps averaged here
    seconds: float


class StepTimes:
    """Moving averages of one kind of step's seconds, by token-count bucket."""

    def __init__(self) -> None:
        self._by_bucket: dict[int, _Timed] = {}
        self._points: list[tuple[float, float]] = []  # (tokens, seconds) by tokens, for predict

    def observe(self, tokens: int, seconds: float) -> None:
        b = bucket(tokens)
        t = self._by_bucket.get(b)
        if t is None:
            self._by_bucket[b] = _Timed(tokens, seconds)
        else:
            t.tokens += SMOOTHING * (tokens - t.tokens)
            t.seconds += SMOOTHING * (seconds - t.seconds)
        self._points = sorted((t.tokens, t.seconds) for t in self._by_bucket.values())

    def predict(self, tokens: int) -> float | None:
        """Seconds of a step of ``tokens``: linear between the measured
        buckets around it (each at its steps' mean token count), else from
        the nearest two on one side, never below the nearest beyond the
        last; None where nothing is measured."""
        points = self._points
        if len(points) < 2:
            return points[0][1] if points else None
        i = bisect.bisect_left(points, (tokens, -math.inf))
        if 0 < i < len(points):  # within the measured range
            (x0, y0), (x1, y1) = points[i - 1], points[i]
        elif i == 0:
            (x0, y0), (x1, y1) = points[0], points[1]
        else:
            (x0, y0), (x1, y1) = points[-2], points[-1]
        guess = y0 + (y1 - y0) / (x1 - x0) * (tokens - x0) if x1 > x0 else y1
        if i == 0:
            return min(max(guess, 0.0), y0)
        if i == len(points):
            return max(guess, y1)
        return guess


class DraftPolicy:
    """Per step, how many of its offered drafts each sequence verifies."""

    def __init__(self, refresh: int = REFRESH) -> None:
        self.refresh = refresh
        self.decode = StepTimes()  # decode-only steps without drafts, by sequences
        self.verify = StepTimes()  # decode-only steps with drafts, by sequences + drafts
        self.decisions = 0
        self._last_plain = self._last_verify = 0  # the decision count when each was last timed
        # Engine-wide verifications, undecayed: each sequence's prior.
        self._stood = 0
        self._rejected = 0
        self.withheld = 0  # offered drafts not verified, for the stats

    def observe_step(self, num_seqs: int, num_drafts: int, seconds: float) -> None:
        """A decode-only step ran: ``num_seqs`` sequences, ``num_drafts``
        drafts verified among them."""
        if num_drafts:
            self.verify.observe(num_seqs + num_drafts, seconds)
            self._last_verify = self.decisions
        else:
            self.decode.observe(num_seqs, seconds)
            self._last_plain = self.decisions

    def observe_verify(self, acceptance: Acceptance, drafted: int, stood: int) -> None:
        acceptance.update(drafted, stood)
        self._stood += stood
        self._rejected += stood < drafted

    def rate(self, acceptance: Acceptance) -> float:
        """A sequence's per-token acceptance rate: drafts that stood over
        those and the rejections, from its decayed record, with the
        engine-wide rate as one observation's worth of prior."""
        prior = (self._stood + 1) / (self._stood + self._rejected + 2)
        stood = acceptance.stood
        return min((stood + prior) / (stood + acceptance.rejected + 1), 0.99)

    def choose(self, num_seqs: int, offers: list[tuple[Acceptance, int]]) -> list[int]:
        """Drafts each offer verifies next step, of ``num_seqs`` sequences
        decoding (offers are the sequences with drafts: their record and how
        many drafts they have)."""
        self.decisions += 1
        counts = self._counts(num_seqs, offers)
        self.withheld += sum(n for _, n in offers) - sum(counts)
        return counts

    def pays(self, num_seqs: int, offers: list[tuple[Acceptance, int]]) -> bool:
        """Whether ``choose`` would verify any of these drafts now: asked
        before a step is queued blind (async scheduling), which can carry
        none. A decision, so the option not taken is timed again as often
        as where every step chooses; nothing is withheld."""
        self.decisions += 1
        return any(self._counts(num_seqs, offers))

    def _counts(self, num_seqs: int, offers: list[tuple[Acceptance, int]]) -> list[int]:
        # Each draft by how much it cuts its sequence's time per token (in
        # steps): 1/g before it less 1/g after, g the sequence's expected
        # tokens. A sequence's cuts fall draft by draft, so each takes a prefix.
        cuts: list[tuple[float, int]] = []
        for i, (acceptance, n) in enumerate(offers):
            a, p, g = self.rate(acceptance), TRUST, 1.0
            for _ in range(n):
                p *= a
                cuts.append((1 / g - 1 / (g + p), i))
                g += p
        if not cuts:
            return [0] * len(offers)
        cuts.sort(key=lambda c: -c[0])
        take = self._how_many(num_seqs, [c for c, _ in cuts])
        counts = [0] * len(offers)
        for _, i in cuts[:take]:
            counts[i] += 1
        return counts

    def _how_many(self, num_seqs: int, cuts: list[float]) -> int:
        """The number of the largest cuts that minimises the step's predicted
        seconds times the sum over its sequences of steps per token."""
        base = self.decode.predict(num_seqs)
        if self.verify.predict(num_seqs + 1) is None:
            # Drafts never timed: a step of a few, whose time the next
            # decisions extrapolate from, not every draft at once (a burst's
            # first verifying step would cost twice a decode).
            return self._a_few(num_seqs, len(cuts))
        if base is None:  # drafts timed, a plain step not yet: time one, to compare
            return 0
        best, best_cost = 0, math.inf
        per_token = float(num_seqs)
        # What the cuts not yet taken could still save: once even all of them
        # at this step's time cannot beat the best, more drafts cannot (a step
        # takes no less time for more tokens), so a burst of many sequences
        # stops after a few.
        left = sum(cuts)
        for d, cut in enumerate(cuts, 1):
            per_token -= cut
            left -= cut
            seconds = self.verify.predict(num_seqs + d)
            if seconds * per_token < best_cost:
                best, best_cost = d, seconds * per_token
            elif seconds * (per_token - left) >= best_cost:
                break
        if best_cost < base * num_seqs:
            return 0 if self.decisions - self._last_plain > self.refresh else best
        # Re-timing drafts that did not pay: a few of the likeliest, not the costliest candidate.
        return self._a_few(num_seqs, best) if self.decisions - self._last_verify > self.refresh else 0

    @staticmethod
    def _a_few(num_seqs: int, most: int) -> int:
        """Drafts for a step that times them: as many as there are sequences
        (two at batch 1), at most ``most``."""
        return min(most, max(2, num_seqs))
