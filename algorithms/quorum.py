"""The rules of DiLoCo rounds that close on a quorum (Decoupled DiLoCo, arXiv 2604.21428): who a round waits for,
how the pseudo-gradients that made it are weighted, what a learner whose contribution missed a round keeps, and when
a learner behind the others skips a step to catch up. Pure functions and small state, the same on every rank; the
exchange that applies them runs them identically everywhere, so the merged fragments are bit-identical.

**A round** of fragment f is the exchange of the learners' pseudo-gradients Δ_i = θ_f − θ_i,f (the global fragment
they last took minus their own). Each learner sends, with its Δ_i, a :class:`Header`: whether it contributes (its
Δ_i was ready when the round closed), the samples its Δ_i holds (computed since its last contribution to f) and how
many rounds of f closed without it since then (``missed``).

**The merge: a weighted mean, by the steps each pseudo-gradient holds.**

    Δ = Σ w_i Δ_i / Σ w_i,    w_i = d_i s_i / S,    d_i = decay ** missed_i (0 where learner i is not in the round)

with s_i the steps Δ_i holds (every rank's batch is the same size: a step is its samples) and S the round's span,
the steps of a learner on time (the most any contributor that missed no round holds; the most any contributor
holds where all missed one). The merge is a convex combination of the pseudo-gradients: it never moves a round
further than its learners did. A learner k times slower that computed S/k steps weighs 1/k. Where every learner
contributes on time with the same steps, every w_i is exactly 1 and the merge is the plain sum over the learners
divided by their count: streaming DiLoCo's average, to the bit. The outer optimizer then steps on Δ as streaming
DiLoCo's does. BN statistics, states rather than sums, are merged with the same weights.

Why not scale a short pseudo-gradient up to a round's (Σ d_i Δ_i / Σ w_i, every sample counted as if a
pseudo-gradient grew with its steps): it does not. On bench/tta's first job, a learner 3x slower that computed a
fifth of a round's steps sent a pseudo-gradient 0.85-0.97x the others' norm, cosine 0.96-0.99 with their mean (a
fragment's local models settle within a few steps of high learning rate), so that rule moved every round about
1.2x as far as any learner had, and (outer step: plain averaging) took 66, 84 and 88 steps to the target at three
seeds where this one took 62, 74 and 68 (docs/benchmarks/tta.md).

**A learner that missed the round** keeps its own progress: its fragment moves by the global step,
``θ_i,f += θ_f,new − θ_f,old``, so its pseudo-gradient in the next round of f is what it computed since it last
contributed (counted in ``samples``, discounted by ``decay ** missed``). A learner that contributed takes the
global fragment as streaming DiLoCo does (``alpha`` mixes its own in).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import astuple, dataclass

import torch

QUORUM_BY = ("learners", "samples")
# A learner whose pace is within this share of the learners' median is on time: the noise of shared machines (steps
# 10-20 % apart on a node of 2 cores and 4 processes), or a slowdown the quorum absorbs, costs no skipped step.
CATCH_UP_TOLERANCE = 0.25


@dataclass(frozen=True)
class Header:
    """One learner's part in a round, sent beside its pseudo-gradient."""

    contributes: bool  # its pseudo-gradient was ready when the round closed
    samples: int  # samples its pseudo-gradient holds: computed since its last contribution to this fragment
    missed: int  # rounds of this fragment closed without it since its last contribution
    pace_s: float  # its seconds per computed step (data and compute), lately: what catching up compares
    computed: int  # samples it computed in the run so far (goodput's denominator)

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([float(v) for v in astuple(self)], dtype=torch.float64, device=device)

    @classmethod
    def of(cls, values: Sequence[float]) -> Header:
        c, s, m, p, n = (float(v) for v in values)
        return cls(bool(c), int(s), int(m), p, int(n))


@dataclass(frozen=True)
class Weights:
    """A round's weights (:func:`weights`): ``shares``, each learner's w_i = d_i s_i / S (its steps over the
    round's span, discounted), what its pseudo-gradient is multiplied by; their sum divides."""

    shares: list[float]

    @property
    def total(self) -> float:
        return sum(self.shares)

    def buffer_factors(self) -> list[float]:
        """The BN statistics' factors: the shares over the largest (exactly 1.0 for each where all weigh the same)."""
        top = max(self.shares, default=0.0)
        return [s / top for s in self.shares] if top > 0 else list(self.shares)


def weights(headers: Sequence[Header], decay: float) -> Weights:
    """The module docstring's ``w_i = d_i s_i / S`` for one round's ``headers`` (in rank order)."""
    decays = [decay**h.missed if h.contributes else 0.0 for h in headers]
    on_time = [h.samples for h in headers if h.contributes and not h.missed]
    span = max(on_time or [h.samples for h in headers if h.contributes] or [0])
    shares = [d * h.samples / span if d and span else 0.0 for d, h in zip(decays, headers)]
    return Weights(shares)


def merge(parts: Sequence[torch.Tensor], w: Weights) -> torch.Tensor | None:
    """The merged pseudo-gradient ``Σ w_i Δ_i / Σ w_i`` of the learners' ``parts`` (in rank order, the same
    on every rank), or None where no one contributed samples. A part weighing 1 is added as it is."""
    total = w.total
    if total <= 0:
        return None
    summed = sum(p if d == 1.0 else p * d for p, d in zip(parts, w.shares) if d > 0)
    return summed / total


def carry(local: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """A learner that missed the round keeps its progress: its fragment ``local`` moves by the global step
    ``new − old`` (in place; returned)."""
    return local.add_(new - old)


def quorum_of(quorum: float, learners: int) -> int:
    """The learners a round needs before it may close: ``quorum`` (a share in (0, 1]) of ``learners``, at least one."""
    return max(1, min(learners, math.ceil(quorum * learners - 1e-9)))


def goodput(entered: int, computed: int) -> float:
    """Samples that entered the model over samples computed (1 before any were)."""
    return entered / computed if computed else 1.0


class CatchUp:
    """When a learner behind the others skips a step's compute (DyLU, arXiv 2401.09135, as a rule of time). Where
    its pace (its median step lately) is more than ``tolerance`` longer than the group's (the learners' median
    step), each step it computes puts it ``pace - group`` behind, and it skips a step (which takes it about no time)
    whenever it is a whole group step behind; within the tolerance it is on time (noise, not slowness) and owes
    nothing. A learner k times slower than the others computes one step in k; one on time, every step."""

    def __init__(self, tolerance: float = CATCH_UP_TOLERANCE) -> None:
        self.tolerance, self.debt = tolerance, 0.0

    def skip(self, group_s: float) -> bool:
        return group_s > 0 and self.debt >= group_s

    def computed(self, pace_s: float, group_s: float) -> None:
        """A step computed, at this learner's pace ``pace_s``."""
        if group_s > 0:
            self.debt = self.debt + pace_s - group_s if pace_s > (1 + self.tolerance) * group_s else 0.0

    def skipped(self, group_s: float) -> None:
        self.debt = max(0.0, self.debt - group_s)


class Grace:
    """How long a learner due to apply a round waits for the learners not in it yet, once the quorum has sent: the
    smaller of ``steps`` group steps and twice the median of the waits that brought everyone in lately (the last
    ``keep``); ``steps`` group steps until it has seen one."""

    def __init__(self, steps: float, keep: int = 16):
        self.steps = steps
        self.waits: deque[float] = deque(maxlen=keep)

    def window(self, group_s: float) -> float:
        cap = self.steps * group_s
        return min(cap, 2 * statistics.median(self.waits)) if self.waits else cap

    def saw(self, seconds: float) -> None:
        """Everyone was in after a wait of ``seconds``."""
        self.waits.append(seconds)
