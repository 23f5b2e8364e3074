"""What algorithms whose replicas differ share (:class:`Replicas`: a flat view of the parameters, evaluation of
the averaged model, each rank's own optimizer state), and what the gossip algorithms (SGP, Crossover-SGD) add
(:class:`Gossip`: a round every ``period`` steps, consensus distance).

Gossip replicas are never exactly equal during training. ``consensus_distance`` (the mean L2 distance of the
replicas' parameters to their average) is measured every ``consensus_every`` steps with one extra allreduce
that is kept out of ``bytes_sent`` and reported as ``consensus_bytes``. Before evaluation and checkpoints the
replicas are averaged (one allreduce), so both see the averaged model; the replicas' own accuracy is reported
beside it.
"""

from __future__ import annotations

from typing import Any

import torch

from algorithms.base import StepResult, SyncAlgorithm, SyncReport
from errors import is_int, require


class Replicas(SyncAlgorithm):
    """Replicas that differ between agreements: evaluation reports the averaged model and the replicas' own
    accuracy; each rank checkpoints its own optimizer state."""

    evaluates_replicas = True

    def parameters(self) -> list[torch.Tensor]:
        return [p.data for p in self.model.parameters()]

    def flat_parameters(self) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in self.parameters()])

    def set_flat_parameters(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def read_range(self, lo: int, hi: int) -> torch.Tensor:
        """A copy of elements ``[lo, hi)`` of the flat parameter vector."""
        return torch.cat([view[a:b] for view, a, b in self._overlaps(lo, hi)])

    def write_range(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """Set elements ``[lo, hi)`` of the flat parameter vector."""
        offset = 0
        for view, a, b in self._overlaps(lo, hi):
            view[a:b].copy_(values[offset : offset + b - a])
            offset += b - a

    def _overlaps(self, lo: int, hi: int) -> list[tuple[torch.Tensor, int, int]]:
        """(flat view of a parameter, start, end within it) for every parameter that ``[lo, hi)`` touches."""
        out, offset = [], 0
        for p in self.parameters():
            n = p.numel()
            if offset < hi and offset + n > lo:
                out.append((p.view(-1), max(lo - offset, 0), min(hi - offset, n)))
            offset += n
        return out

    def before_eval(self) -> None:
        """Average the replicas (and BN statistics) so evaluation and checkpoints see one model."""
        comm = self.ctx.comm
        tensors = self.parameters() + [b.data for b in self.model.buffers() if b.is_floating_point()]
        comm.all_reduce_coalesced(tensors, average=True)

    def local_state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}  # this rank's own momentum buffers

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


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
