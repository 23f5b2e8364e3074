"""What the gossip algorithms (SGP, Crossover-SGD) add to replicas that differ (``algorithms/replicas.py``):
:class:`Gossip`, a round every ``period`` steps and the consensus distance.

Gossip replicas are never exactly equal during training. ``consensus_distance`` (the mean L2 distance of the
replicas' parameters to their average) is measured every ``consensus_every`` steps with one extra allreduce
that is kept out of ``bytes_sent`` and reported as ``consensus_bytes``. Before evaluation and checkpoints the
replicas are averaged (one allreduce), so both see the averaged model; the replicas' own accuracy is reported
beside it.
"""

from __future__ import annotations

from typing import Any

import torch

from algorithms.base import StepResult, SyncReport
from algorithms.replicas import Replicas
from errors import is_int, require


class Gossip(Replicas):
    def __init__(self, period: int = 1, consensus_every: int = 10):
        self.period, self.consensus_every = period, consensus_every

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        require(world_size >= 2, "trainer.nproc", world_size, f"at least 2 processes for sync={cls.name} (gossip)")
        for key in ("period", "consensus_every"):
            require(is_int(section[key]) and section[key] >= 1, f"sync.{key}", section[key], "an integer >= 1 (steps)")

    def gossip(self, step: int) -> dict[str, Any]:
        """One gossip round on the parameters; returns extra metrics (may hold ``events``)."""
        raise NotImplementedError

    def after_optimizer_step(self, result: StepResult) -> SyncReport:
        report = SyncReport()
        if result.step % self.period == 0:
            metrics = self.gossip(result.step)
            report.events.extend(metrics.pop("events", []))
            report.metrics.update(metrics)
        if result.step % self.consensus_every == 0:
            report.metrics.update(self.consensus())
        return report

    def consensus(self) -> dict[str, float]:
        """Mean L2 distance of the replicas to their average (uncounted measurement traffic)."""
        comm = self.ctx.comm
        before = comm.side_bytes
        with comm.uncounted():
            flat = self.flat_parameters()
            average = flat.clone()
            comm.all_reduce(average)
            average.div_(comm.size)
            distance = torch.linalg.vector_norm((flat - average).double()).reshape(1)
            comm.all_reduce(distance)
        return {"consensus_distance": float(distance) / comm.size, "consensus_bytes": comm.side_bytes - before}
