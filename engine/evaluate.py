"""Evaluation: when to evaluate and what an evaluation records (:class:`Evaluation`), and the measures themselves
(:class:`Evaluator`): accuracy over the whole validation set (each sample exactly once), the replicas' own accuracy,
and how far apart the replicas' parameters are.

Every rank evaluates its unpadded shard of the validation set (``data.common.ShardSampler``) and the sums are
allreduced over the active ranks, so ``num_samples`` is exactly the size of the set.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distributed.comm import Communicator


class Evaluator:
    def __init__(
        self,
        comm: Communicator,
        autocast: Any,
        device: torch.device,
        num_classes: int,
        counts: dict[str, Callable[[], int]] | None = None,
    ):
        self.comm, self.autocast, self.device = comm, autocast, device
        self.k = min(5, num_classes)
        # This rank's counts of what went wrong so far, summed over the ranks by the evaluation's own allreduce:
        # name -> its reader (the image files skipped, the connections refused for not proving the run's secret)
        self.counts = counts or {}

    @torch.no_grad()
    def measure(self, model: nn.Module, loader: Any) -> dict[str, float]:
        """Loss, top-1 and top-5 of ``model`` (this rank's replica) over the whole set, each sample once. The sums
        stay on the device (float64) until the one read after the allreduce: no host sync per batch. The same
        allreduce sums each of ``counts`` over the ranks (in the result under its name when any rank has some)."""
        model.eval()
        names = sorted(self.counts)
        sums = torch.zeros(4 + len(names), dtype=torch.float64, device=self.device)  # loss, top-1, top-5, samples
        for x, y in loader:  # (the loaders yield batches on the device already: these moves are no-ops)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self.autocast():
                logits = model(x)
            logits = logits.float()
            hits = logits.topk(self.k, dim=1).indices.eq(y.unsqueeze(1))
            sums[0] += nn.functional.cross_entropy(logits, y, reduction="sum")
            sums[1] += hits[:, 0].sum()
            sums[2] += hits.sum()
            sums[3] += len(y)
        model.train()
        for i, name in enumerate(names):  # (after the pass: what it skipped too)
            sums[4 + i] = self.counts[name]()
        self.comm.all_reduce(sums)
        self.comm.take()  # evaluation traffic is not a training step's; it stays in the totals
        loss_sum, top1, top5, count, *counted = sums.tolist()
        result = {"loss": loss_sum / count, "top1": 100.0 * top1 / count, "top5": 100.0 * top5 / count, "count": count}
        result.update({name: int(n) for name, n in zip(names, counted) if n})
        return result

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


def reached_target(run: Any, trainer_cfg: dict[str, Any]) -> bool:
    """Whether an evaluation of ``run`` (an ``engine.state.RunState``) reached ``trainer.target_top1``."""
    target, best = trainer_cfg["target_top1"], run.best_eval
    return target is not None and best is not None and best["top1"] >= target


class Evaluation:
    """When the trainer evaluates and what it records: every ``trainer.eval_every`` epochs and at the end of the run,
    on the side every ``trainer.eval_every_steps`` steps (of the replicas' average formed on a copy, leaving training
    untouched), the best evaluation, and ``trainer.target_top1``, which ends the run at the first evaluation that
    reaches it. Results go to ``run`` (an ``engine.state.RunState``: last and best) and to ``recorder``."""

    def __init__(self, trainer_cfg: dict[str, Any], evaluator: Evaluator, run: Any, recorder: Any):
        self.every, self.every_steps = trainer_cfg["eval_every"], trainer_cfg["eval_every_steps"]
        self.trainer_cfg, self.target = trainer_cfg, trainer_cfg["target_top1"]
        self.evaluator, self.run, self.recorder = evaluator, run, recorder

    def reached_target(self) -> bool:
        """Whether an evaluation reached ``trainer.target_top1`` (kept in the checkpoint's best evaluation)."""
        return reached_target(self.run, self.trainer_cfg)

    def due_on_the_side(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def due_at_epoch_end(self, epoch: int, finished_epoch: bool, last: bool) -> bool:
        """After epoch ``epoch`` (from 1), ``last`` when the run ends there. Not again when the run reached its
        target (it ends on the evaluation that showed it), nor when one on the side just measured this step."""
        last_eval = self.run.last_eval
        again = self.reached_target() or (last_eval is not None and last_eval["step"] == self.run.step)
        return (last or (finished_epoch and epoch % self.every == 0)) and not again

    def evaluate(
        self, epoch: int, model: Any, replicas: bool, loader: Any, settle: Callable, on_the_side: bool
    ) -> dict:
        """Top-1/top-5 and loss of ``model`` over the whole validation set, each sample counted exactly once; with
        ``replicas`` that differ (gossip), also each replica's own accuracy before they are brought together
        (``settle()``, or on the side their average on a copy)."""
        start = time.perf_counter()
        if self.evaluator.comm.size > 1:  # (what this rank waits here for the slowest is training's: see wait_s)
            self.evaluator.comm.barrier()
        waited = time.perf_counter() - start
        extra = {}
        if replicas:
            replica = self.evaluator.measure(model, loader)
            extra = {"replica_loss": replica["loss"], "replica_top1": replica["top1"]}
        if on_the_side:
            whole = self.evaluator.measure_average(model, loader)
        else:
            settle()
            whole = self.evaluator.measure(model, loader)
        result = {
            "kind": "eval",
            "epoch": epoch,
            "step": self.run.step,
            "loss": whole["loss"],
            "top1": whole["top1"],
            "top5": whole["top5"],
            "num_samples": int(whole["count"]),
            **extra,
            **{name: whole[name] for name in sorted(self.evaluator.counts) if name in whole},
            "eval_s": time.perf_counter() - start,  # (time-to-accuracy measures leave it out, but for wait_s)
            # The part of it this rank waited for the slowest to reach the evaluation: an option that exchanges
            # every k steps waits so at its next exchange when nothing evaluates in between; it is training time
            "wait_s": waited,
        }
        if on_the_side:
            result["on_the_side"] = True
        if self.recorder.netdev is not None:  # what the interface sent for it, kept out of the next step's
            result["wire_bytes"] = self.recorder.netdev.delta()
        self._keep(result)
        note = f", replicas' own top1 {extra['replica_top1']:.2f}%" if extra else ""
        self.recorder.console(
            f"eval epoch {epoch}: top1 {result['top1']:.2f}% top5 {result['top5']:.2f}% "
            f"loss {result['loss']:.4f} ({result['num_samples']} samples){note}"
        )
        return result

    def _keep(self, result: dict[str, Any]) -> None:
        """Last and best evaluation; the record; a line when it reaches the target."""
        reached = self.reached_target()
        self.run.last_eval = result
        if self.run.best_eval is None or result["top1"] > self.run.best_eval["top1"]:
            self.run.best_eval = result
        if self.reached_target() and not reached:
            self.recorder.console(
                f"relaxsync: target top-1 {self.target}% reached at step {self.run.step}; the run ends here"
            )
        self.recorder.write(result, self.run.step)
