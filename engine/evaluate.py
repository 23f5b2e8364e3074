"""Evaluation: accuracy over the whole validation set (each sample exactly once), the replicas' own accuracy,
and how far apart the replicas' parameters are.

Every rank evaluates its unpadded shard of the validation set (``data.common.ShardSampler``) and the sums are
allreduced over the active ranks, so ``num_samples`` is exactly the size of the set.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from algorithms.comm import Communicator


class Evaluator:
    def __init__(self, comm: Communicator, autocast: Any, device: torch.device, num_classes: int):
        self.comm, self.autocast, self.device = comm, autocast, device
        self.k = min(5, num_classes)

    @torch.no_grad()
    def measure(self, model: nn.Module, loader: Any) -> dict[str, float]:
        """Loss, top-1 and top-5 of ``model`` (this rank's replica) over the whole set, each sample once."""
        model.eval()
        sums = torch.zeros(4, dtype=torch.float64)
        for x, y in loader:
            x, y = x.to(self.device), y.to(self.device)
            with self.autocast():
                logits = model(x)
            logits = logits.float()
            hits = logits.topk(self.k, dim=1).indices.eq(y.unsqueeze(1))
            loss = nn.functional.cross_entropy(logits, y, reduction="sum")
            sums += torch.tensor(
                [loss.item(), hits[:, :1].sum().item(), hits.sum().item(), len(y)], dtype=torch.float64
            )
        model.train()
        sums = sums.to(self.device)
        self.comm.all_reduce(sums)
        self.comm.take()  # evaluation traffic is not a training step's; it stays in the totals
        loss_sum, top1, top5, count = sums.tolist()
        return {"loss": loss_sum / count, "top1": 100.0 * top1 / count, "top5": 100.0 * top5 / count, "count": count}

    def measure_average(self, model: nn.Module, loader: Any) -> dict[str, float]:
        """:meth:`measure` of the active replicas' average (parameters and floating-point buffers), formed in
        place by one allreduce and then undone: the model, and so training, is left exactly as it was. Its
        traffic is not a training step's (not counted in one)."""
        saved = {name: t.detach().clone() for name, t in model.state_dict().items()}
        tensors = [p.data for p in model.parameters()] + [b.data for b in model.buffers() if b.is_floating_point()]
        self.comm.all_reduce_coalesced(tensors, average=True)
        self.comm.take()
        try:
            return self.measure(model, loader)
        finally:
            model.load_state_dict(saved)

    def replica_spread(self, model: nn.Module) -> float:
        """Largest difference between any active rank's parameter fingerprint and the first one's (0.0: all
        replicas hold identical parameters). One small allgather."""
        flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device) / flat.numel()
        fingerprint = torch.stack([flat.sum(), (flat * flat).sum(), (flat * weights).sum()])
        prints = self.comm.all_gather(fingerprint)
        self.comm.take()
        return max(float((p - prints[0]).abs().max()) for p in prints)
