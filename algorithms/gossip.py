"""What the gossip algorithms (SGP, Crossover-SGD) share: a flat view of the parameters, consensus distance,
evaluation of the averaged model, and checkpointing of each rank's own optimizer state.

Gossip replicas are never exactly equal during training. ``consensus_distance`` (the mean L2 distance of the
replicas' parameters to their average) is measured every ``consensus_every`` steps with one extra allreduce
that is kept out of ``bytes_sent`` and reported as ``consensus_bytes``. Before evaluation and checkpoints the
replicas are averaged (one allreduce), so both see the averaged model; the replicas' own accuracy is reported
beside it.
"""

from __future__ import annotations

from typing import Any

import torch

from algorithms.base import SyncAlgorithm, SyncReport


class Gossip(SyncAlgorithm):
    per_rank_state = True
    evaluates_replicas = True

    def __init__(self, period: int = 1, consensus_every: int = 10):
        self.period, self.consensus_every = period, consensus_every

    @classmethod
    def validate(cls, sync_cfg: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        from engine.config import ConfigError

        if world_size < 2:
            raise ConfigError("trainer.nproc", world_size, f"at least 2 processes for sync={cls.name} (gossip)")
        for key in ("period", "consensus_every"):
            v = sync_cfg[key]
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ConfigError(f"sync.{key}", v, "an integer >= 1 (steps)")

    def parameters(self) -> list[torch.Tensor]:
        return [p.data for p in self.model.parameters()]

    def flat_parameters(self) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in self.parameters()])

    def set_flat_parameters(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def gossip(self, step: int) -> dict[str, Any]:
        """One gossip round on the parameters; returns extra metrics (may hold ``events``)."""
        raise NotImplementedError

    def after_optimizer_step(self, step: int) -> SyncReport:
        report = SyncReport()
        if step % self.period == 0:
            extra = self.gossip(step)
            report.events.extend(extra.pop("events", []))
            report.extra.update(extra)
        if step % self.consensus_every == 0:
            report.extra.update(self.consensus())
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

    def before_eval(self) -> None:
        """Average the replicas (and BN statistics) so evaluation and checkpoints see one model."""
        comm = self.ctx.comm
        tensors = self.parameters() + [b.data for b in self.model.buffers() if b.is_floating_point()]
        comm.all_reduce_coalesced(tensors, average=True)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.optimizer.load_state_dict(state["optimizer"])
