"""SLO-aware token budget (ConServe §4.2): how much offline work a step may
carry beside online work without making the online requests miss their
latency SLOs.

Online requests are offered first (strict class priority), so when the first
offline request is reached the step's online part is known. From then on each
offline item is cut to the largest number of tokens whose addition keeps the
step's predicted time (the cost model's) within the step's cap; a decode that
does not fit waits. The cap is the tightest of:

* the TPOT SLO, when online requests decode in the step (the step's time is
  the gap between their tokens);
* the TTFT SLO less the time already waited by the longest-waiting online
  request whose prefill the step runs (the step's end is when its first
  token, or the next chunk's start, comes).

With no online work in the step, offline work takes the whole token budget,
except where layer-wise preemption bounds it: an online arrival waits for
the running offline-only step's next safepoint (the step pauses there), so
one safepoint interval is what the arrival's TTFT pays on top of its own
prefill. With a TTFT SLO and safepoints every ``interval_share`` of a step
(of its work other than attention; of its attention, ``attention_share``:
a layer's attention runs whole between two safepoints), an offline-only
step is cut so that its longest interval fits the SLO less the
prefill of a typical online prompt (a running mean of the arrivals'), as
slow as the recent online prefills' tail ran against their predictions,
but never below the time of the step whose fixed per-step cost (the
cheapest step's time) is ``overhead_share`` of it: below that, offline
throughput would pay more than the SLO gains (on a GPU, whose layers are
short, the cut rarely binds; on a CPU it is what keeps offline work going).

Each cap is planned against a step slower than predicted by the cost
model's own measured error (``uncertainty``, when it keeps one: the
calibrating model does): a budget aimed at the SLO itself would put about
half of the steps over it wherever step times are noisy. The offline-only
cap plans the arrival's own prefill against the tail of how online
prefills actually ran, not one RMS error: the SLO is kept or missed per
arrival, and the slow prefills are what set the tail (on a CPU, online
prefills ran up to 1.4x their prediction while the RMS error over all
steps was 4-13%, and an interval planned against that put the P99 TTFT
past the SLO).
**Without SLOs** (``slowdown``, the default): the caps are relative to
what the online work would cost alone. A step with online work may carry
offline tokens while its predicted time stays within ``slowdown`` times its
online part's (the cost model predicts both, so an error both share
cancels; the one only steps with offline work beside online work show,
measured against online steps alone, is planned for), less, where it runs an online prompt, the time that prompt has
already waited: the wait for a safepoint and the offline tokens beside the
prefill share one first token's slowdown; an offline-only step is cut so that one safepoint interval, what
an online arrival waits for, is at most ``slowdown - 1`` of the predicted
time of a typical online prefill plus a step, never below the time of a
``min_step_tokens`` prefill (its fixed cost ``slowdown - 1`` of it: offline
work pays the share online work is asked to). Explicit SLOs replace these
caps.

Pure Python.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from fluidserve.scheduler.cost_model import CostModel, StepShape, attn_pairs, tokens_for_time
from fluidserve.scheduler.request_state import SeqState

# A TTFT SLO is kept by the engine's first token with this share of it to
# spare: what comes after (handing the token to the event loop, the SSE
# write, the client's read) took 3-8 ms of a 60-70 ms TTFT on a CPU.
TTFT_ENGINE_SHARE = 0.9
# How the offline-only cap follows the first tokens measured against the
# SLO: cut by this factor at each miss, grown back by this step at each hit.
# The cap settles where misses are a share a / (1 - c + a) of first tokens
# (cut c, step a): 0.5%. A P99 over a hundred requests allows one miss; at
# a 1% share the P99 TTFT through the server sat at the SLO (63 ms of 65 in
# one round, 55 of 53 in the next; benchmarks/coserving_server.py).
TTFT_MISS_CUT = 0.7
TTFT_HIT_STEP = 0.0015
TTFT_MIN_SCALE = 0.05


class SloBudget:
    """``tpot_slo_s`` / ``ttft_slo_s``: the online SLOs; where both are
    None, ``slowdown`` (> 1) sets relative caps instead."""

    def __init__(self, cost: CostModel, tpot_slo_s: float | None, ttft_slo_s: float | None = None,
                 interval_share: float | None = None, overhead_share: float | None = None,
                 min_chunk_beside_online: int = 32, slowdown: float | None = None,
                 attention_share: float | None = None) -> None:
        for name, slo in (("TPOT", tpot_slo_s), ("TTFT", ttft_slo_s)):
            if slo is not None and not slo > 0:
                raise ValueError(f"online {name} SLO must be positive, got {slo}")
        if slowdown is not None and not slowdown > 1:
            raise ValueError(f"the online slowdown cap must be above 1, got {slowdown}")
        if tpot_slo_s is None and ttft_slo_s is None and slowdown is None:
            raise ValueError("an SLO budget needs a TPOT or a TTFT SLO, or a slowdown cap")
        # Relative caps only where no SLO is given: an explicit SLO is the user's word.
        self.slowdown = slowdown if tpot_slo_s is None and ttft_slo_s is None else None
        self._online_alone: float | None = None  # this step's online part, predicted, once asked
        if interval_share is not None and not 0 < interval_share <= 1:
            raise ValueError(f"interval_share must be in (0, 1], got {interval_share}")
        if overhead_share is None:
            # Under a slowdown cap offline steps pay in fixed cost the share
            # the online requests are asked to pay (1.2: 20%); with SLOs, the
            # same 20%. At 10% the floor was a 150 ms step on a CPU, and an
            # online arrival's wait for its safepoint alone took a 70 ms TTFT
            # SLO's spare time; at 20% the batch still ran at 72% of its
            # speed alone (benchmarks/coserving_server.py).
            overhead_share = min(0.5, self.slowdown - 1) if self.slowdown is not None else 0.2
        if not 0 < overhead_share < 1:
            raise ValueError(f"overhead_share must be in (0, 1), got {overhead_share}")
        self.cost = cost
        self.tpot_slo = tpot_slo_s
        self.ttft_slo = ttft_slo_s
        # Safepoints every this share of a step (None: no layer-wise
        # preemption, offline-only steps are not cut), and the share of the
        # step's attention time (what grows with context) in the longest
        # interval: all of one layer's sits between two safepoints, so
        # where the attention dominates (many offline decodes over long
        # contexts) the longest interval is one layer's attention, not an
        # even slice of the step (on a CPU, 64 offline decodes of ~550
        # tokens spent 25 of a 90 ms step's 4 layers in one attention).
        # None: spread like the rest.
        if attention_share is not None and not 0 < attention_share <= 1:
            raise ValueError(f"attention_share must be in (0, 1], got {attention_share}")
        self.interval_share = interval_share
        self.attention_share = attention_share if attention_share is not None else interval_share
        self.overhead_share = overhead_share
        # Beside online work an offline prompt chunk is cut to what fits, but
        # one cut below this many tokens is not run: a chunk costs the step
        # more than its tokens (its own attention call per layer, the gather
        # of its context), which the cost model's per-token terms miss. On
        # a CPU, where an online decode step leaves a few ms of room, such
        # chunks ran 5-15 ms over their prediction and pushed TPOT past the
        # SLO for a couple of percent of the offline work.
        self.min_chunk_beside_online = min_chunk_beside_online
        self._online_prompt: float | None = None  # running mean of online prompt tokens
        # Measured / predicted time of the recent steps that ran an online prefill.
        self._online_prefill_ratios: deque[float] = deque(maxlen=64)
        self._offline_only: tuple[float, float] | None = None  # this step's offline-only cap and floor, once asked
        # Measured / predicted time of recent steps with online work, with
        # offline work beside it and without (the slowdown cap's margin).
        self._beside_ratios: deque[float] = deque(maxlen=64)
        self._alone_ratios: deque[float] = deque(maxlen=64)
        self._beside_tail: float | None = None  # their 90th percentile, once 8 ran
        self._alone_median: float | None = None  # their median, once 8 ran
        self._offline_beside = False  # this step carries offline tokens beside online work
        # The offline-only cap's share of what the plan allows, steered by
        # measured first tokens (1: as planned; see note_first_token).
        self.ttft_scale = 1.0

    def begin_step(self) -> None:
        """A new step is being filled: the offline-only limits are worked out
        again, once, when its first offline request asks."""
        self._offline_only = None
        self._online_alone = None
        self._offline_beside = False

    def note_online_arrival(self, prompt_tokens: int) -> None:
        """An online request of ``prompt_tokens`` arrived (the offline-only
        cap reserves time for a typical one's prefill)."""
        m = self._online_prompt
        self._online_prompt = float(prompt_tokens) if m is None else m + 0.1 * (prompt_tokens - m)

    def note_online_step(self, shape: tuple[int, int, int, int], seconds: float, prefills_online: bool) -> None:
        """The step just filled, of ``shape`` and with online work, took
        ``seconds`` (read before the cost model learns from it, so each
        ratio is the error the plan was made with). Only ``update_from_output``
        calls it, after the step and before the next is filled."""
        predicted = self.cost.step_time(*shape)
        if not (predicted > 0 and math.isfinite(seconds) and seconds > 0):
            return
        ratio = seconds / predicted
        if prefills_online:
            self._online_prefill_ratios.append(ratio)
        # The figures the caps read, worked out here, once a step, not at
        # each of the step's offline requests that asks.
        if self._offline_beside:
            self._beside_ratios.append(ratio)
            if len(self._beside_ratios) >= 8:
                self._beside_tail = _percentile(self._beside_ratios, 0.9)
        else:
            self._alone_ratios.append(ratio)
            if len(self._alone_ratios) >= 8:
                self._alone_median = statistics.median(self._alone_ratios)

    def note_first_token(self, ttft_s: float) -> None:
        """An online request's first token came ``ttft_s`` after its arrival
        (the HTTP request's, in the server). With a TTFT SLO the offline-only
        cap follows what first tokens really take, not only the plan: what
        the plan leaves out (the head of a step after its last safepoint,
        the frontend's time before the engine, a wait behind other online
        steps) shows up here, and each first token past
        ``TTFT_ENGINE_SHARE`` of the SLO cuts the cap."""
        if self.ttft_slo is None or not math.isfinite(ttft_s):
            return
        if ttft_s > TTFT_ENGINE_SHARE * self.ttft_slo:
            self.ttft_scale = max(TTFT_MIN_SCALE, self.ttft_scale * TTFT_MISS_CUT)
        else:
            self.ttft_scale = min(1.0, self.ttft_scale + TTFT_HIT_STEP)

    def beside_online_margin(self) -> float:
        """How much more the cost model underestimates steps that carry
        offline work beside online work than steps of online work alone:
        the 90th percentile of the first's measured / predicted time over
        the median of the second's, at least 1 (1 until 8 of each ran).

        The slowdown cap compares two predictions, so an error both share
        cancels; one only the mixed steps have does not. On a CPU an offline
        decode beside an online one (a second attention group per layer, a
        long context) ran 1.4x the online step alone where 1.2x was
        planned."""
        if self._beside_tail is None or self._alone_median is None:
            return 1.0
        return max(1.0, self._beside_tail / self._alone_median)

    def slo_margin(self) -> float:
        """How much slower than predicted a step with online work is planned
        for against an absolute SLO: the cost model's margin, or the 90th
        percentile of measured / predicted time of the steps that carried
        offline work beside online work, whichever is larger."""
        margin = prediction_margin(self.cost)
        return margin if self._beside_tail is None else max(margin, self._beside_tail)

    def online_prefill_margin(self) -> float:
        """How much slower than predicted an online prefill is planned for:
        the 95th percentile of the recent ones' measured / predicted time
        (the slowest while fewer than 20 ran), never below the cost model's
        margin."""
        margin = prediction_margin(self.cost)
        ratios = self._online_prefill_ratios
        if not ratios:
            return margin
        return max(margin, _percentile(ratios, 0.95))

    def min_step_tokens(self) -> int:
        """The fewest prefill tokens of an offline-only step: the smallest
        step whose fixed cost is at most ``overhead_share`` of its time."""
        return tokens_for_time(self.cost, self.cost.min_iteration_time() / self.overhead_share)

    def min_step_time(self) -> float:
        """The shortest an offline-only step is cut to: a ``min_step_tokens``
        prefill; where measured first tokens have cut the cap
        (``ttft_scale``), that much shorter, down to twice the fixed cost
        (an SLO the user set outranks offline throughput)."""
        # At least the time whose fixed cost is that share: a fit in which
        # prompt tokens cost nothing (the calibration of a tiny model's CPU
        # steps gave base 7.2 ms, 68 us a decode, nothing per token) has no
        # such prefill, and its longest one is only the fixed cost.
        floor = max(self.cost.prefill_time(self.min_step_tokens()),
                    self.cost.min_iteration_time() / self.overhead_share)
        if self.ttft_scale < 1.0:
            floor = max(2 * self.cost.min_iteration_time(), self.ttft_scale * floor)
        return floor

    def offline_only_cap(self) -> float:
        """Predicted seconds an offline-only step may take (inf: no cap)."""
        if self.slowdown is not None and self.interval_share is not None:
            if self._online_prompt is None:  # no online traffic yet: no one to wait
                return float("inf")
            # What an arrival may wait: a share of its own prefill and first step.
            own = self.cost.prefill_time(round(self._online_prompt))
            return (self.slowdown - 1) * (own + self.cost.min_iteration_time()) / self.interval_share
        if self.ttft_slo is None or self.interval_share is None:
            return float("inf")
        own = self.cost.prefill_time(round(self._online_prompt)) if self._online_prompt else 0.0
        room = self.ttft_slo - own * self.online_prefill_margin()
        return self.ttft_scale * max(0.0, room) / (prediction_margin(self.cost) * self.interval_share)

    def cap(self, shape: StepShape, now: float) -> float:
        """Predicted seconds a step of ``shape`` (its online part) may take."""
        if self.slowdown is not None:
            if self._online_alone is None:  # the first offline request asks with the online part alone
                self._online_alone = self.cost.step_time(shape.prefill_tokens, shape.decode_seqs, shape.context,
                                                         shape.pairs)
            cap = self.slowdown * self._online_alone
            if shape.first_online_prefill_arrival is not None:
                # A first token's budget is the same slowdown of what the step
                # alone takes, less what the prompt has already waited (for
                # a safepoint, or behind the online steps before it).
                cap -= max(0.0, now - shape.first_online_prefill_arrival)
            return cap / self.beside_online_margin()
        cap = float("inf")
        if self.tpot_slo is not None and shape.online:
            cap = self.tpot_slo
        if self.ttft_slo is not None and shape.first_online_prefill_arrival is not None:
            cap = min(cap, self.ttft_slo - (now - shape.first_online_prefill_arrival))
        return cap / self.slo_margin()

    def _time_with(self, shape: StepShape, seq: SeqState, m: int) -> float:
        done = seq.num_computed_tokens
        if StepShape.is_decode(seq, m):
            return self.cost.step_time(shape.prefill_tokens, shape.decode_seqs + 1, shape.context + done + 1,
                                       shape.pairs)
        return self.cost.step_time(shape.prefill_tokens + m, shape.decode_seqs, shape.context + done + m,
                                   shape.pairs + attn_pairs(m, done))

    def offline_tokens(self, shape: StepShape, seq: SeqState, n: int, now: float = 0.0) -> int:
        """How many of the ``n`` tokens offline ``seq`` may run in a step of
        ``shape``: the most that keep the predicted step time within the cap
        (0: none); without online work, within the offline-only cap, which
        is never below ``min_step_time``.

        The floor is a time, not a token count: a decode costs a step far
        more than a prompt token (its own attention over its context, its
        row of the LM head, its draw), so a floor of tokens let 64 offline
        decodes through (on a CPU, about three times the cap) and an online
        arrival waited for their non-preemptible head and sampling."""
        if shape.online:
            cap = self.cap(shape, now)

            def fits(m: int) -> bool:
                return self._time_with(shape, seq, m) <= cap
        else:
            if self._offline_only is None:  # a binary search over the cost model: once a step
                cap = self.offline_only_cap()
                self._offline_only = (cap, self.min_step_time() if cap != float("inf") else cap)
            cap, floor = self._offline_only
            if cap == float("inf"):
                return n

            def fits(m: int) -> bool:
                return self._offline_only_fits(shape, seq, m, cap, floor)
        if fits(n):
            self._offline_beside |= shape.online
            return n
        lo, hi = 0, n - 1  # the largest m in [0, n) that fits; step time grows with m
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        if shape.online and lo < self.min_chunk_beside_online:
            return 0
        if lo == 0 and not shape.online and shape.prefill_tokens == shape.decode_seqs == 0:
            # The cap bounds how much an offline-only step carries, never
            # whether it runs: an empty step changes none of the figures the
            # cap is worked out from (no step time to learn from), so a cap
            # no lone item fits -- a calibrated fit that puts a step's cost
            # in its context can make one -- would hold the offline work
            # back forever. The first item runs, as small as a chunk beside
            # online work may be.
            return min(n, self.min_chunk_beside_online)
        self._offline_beside |= shape.online and lo > 0
        return lo

    def _offline_only_fits(self, shape: StepShape, seq: SeqState, m: int, cap: float, floor: float) -> bool:
        """Whether an offline-only step with ``m`` of ``seq``'s tokens added
        is within the offline-only cap: its longest safepoint interval
        within the cap's share, or the whole step within the floor."""
        total = self._time_with(shape, seq, m)
        if total <= floor:
            return True
        # (A finite cap implies safepoints: offline_only_cap is inf without them.)
        # The step's time without its attention terms (no context, no pairs).
        if StepShape.is_decode(seq, m):
            flat = self.cost.step_time(shape.prefill_tokens, shape.decode_seqs + 1, 0, 0)
        else:
            flat = self.cost.step_time(shape.prefill_tokens + m, shape.decode_seqs, 0, 0)
        attention = max(0.0, total - flat)
        longest = self.interval_share * (total - attention) + self.attention_share * attention
        return longest <= cap * self.interval_share


def _percentile(values: deque[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the largest while they are few)."""
    return sorted(values)[math.ceil(q * len(values)) - 1]


def prediction_margin(cost: CostModel) -> float:
    """How much slower than predicted a step is planned for: 1 + the cost
    model's measured relative error (1 when it keeps none)."""
    uncertainty = getattr(cost, "uncertainty", None)
    return 1.0 + (uncertainty() if uncertainty is not None else 0.0)


def safepoint_attention_share(every_layers: float, num_layers: int) -> float | None:
    """The share of a step's attention time in the longest stretch between
    safepoints every ``every_layers`` layers (None: no safepoints): the
    layers whose attention the stretch holds whole, of ``num_layers``."""
    if every_layers <= 0 or num_layers <= 0:
        return None
    return min(1.0, math.ceil(int(2 * every_layers) / 2) / num_layers)


def safepoint_interval_share(every_layers: float, num_layers: int, mlp_share: float = 0.5) -> float | None:
    """The longest stretch of a step between two safepoints every
    ``every_layers`` layers, as a share of the step (None: no safepoints).
    Where safepoints split layers, the intervals alternate between ending
    after an attention and after an MLP (``mlp_share`` of a layer); the
    longer of the two is what an interrupted arrival may wait."""
    if every_layers <= 0 or num_layers <= 0:
        return None
    halves = int(2 * every_layers)
    longest = halves // 2
    if halves % 2:
        longest += max(mlp_share, 1.0 - mlp_share)
    return min(1.0, longest / num_layers)
