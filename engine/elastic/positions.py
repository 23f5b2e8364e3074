"""Where a rank is in the loop, in the terms every part of the elastic component shares: the :class:`Phase` of a
step a collective can fail in, a :class:`Position` (the step and its phase, with its form in the store), the
:class:`Site` of a part that runs at more than one place, and the :class:`Entry` of a rank healed from the front."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Phase(Enum):
    """The parts of the loop a collective can fail in, in the order the loop goes through them at one value of the
    step counter: the evaluation, checkpoint, admission of joiners and start of an epoch that follow step
    s - 1, then step s up to the optimizer step and its exchange after it; at the end of the run the replicas'
    spread and the exit barrier."""

    EVALUATION = "evaluation"
    CHECKPOINT = "checkpoint"
    JOIN = "join"
    EPOCH_START = "epoch start"
    STEP = "step"
    EXCHANGE = "exchange"
    END = "end"
    EXIT = "exit"


_ORDER = {phase: i for i, phase in enumerate(Phase)}


@dataclass(frozen=True)
class Position:
    """Where a rank is in the run: the step counter and the part of the loop at it."""

    step: int
    phase: Phase

    @classmethod
    def read(cls, wire: Sequence) -> Position:
        """From its form in the store, ``[step, phase]``."""
        return cls(int(wire[0]), Phase(wire[1]))

    def wire(self) -> list:
        return [self.step, self.phase.value]

    @property
    def key(self) -> tuple[int, int]:
        """Sorts positions in the order the loop reaches them."""
        return self.step, _ORDER[self.phase]


def left_behind(where: dict[int, Sequence]) -> tuple[Sequence, list[int]]:
    """The furthest ``[step, phase]`` of the survivors (the front), and the ranks that were not there. (A thousand
    survivors stand at one or two places: each distinct one is read once.)"""
    front = max({tuple(w) for w in where.values()}, key=lambda w: Position.read(w).key)
    return list(front), sorted(r for r, w in where.items() if tuple(w) != front)


class Site(Enum):
    """Where in the loop a part runs, for the parts that run at more than one place."""

    NONE = ""
    BETWEEN_STEPS = "between steps"  # an evaluation on the side or a step checkpoint
    EPOCH_END = "epoch end"  # the epoch's evaluation and checkpoint
    END = "end"  # the end of the run: the replicas' spread and the exit barrier


@dataclass(frozen=True)
class Entry:
    """Where a rank healed from the front enters the loop: the front's part, and ``carry``, what the parts before it
    would have handed on (by :class:`Phase`) and the loop's own values there (under ``"loop"``)."""

    position: Position
    site: Site
    carry: dict[Any, Any] = field(default_factory=dict)
