"""Local SGD: take several optimizer steps locally, then average the parameters.

Post-local SGD (Lin, Stich, Patel, Jaggi: "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020,
arXiv 1808.07217), with PaddlePaddle Fleet's option names. Until ``begin_step`` the ranks run synchronous SGD
(gradients averaged by allreduce every step); from then on each rank steps on its own batches and the
parameters (and BN statistics) are averaged every ``k_steps`` steps, which divides the bytes sent by k. The
replicas drift apart between averagings; ``replica_distance`` (this rank's parameter L2 distance to the average,
measured at each averaging) shows how far.

``AdaptiveLocalSGD`` is ADACOMM (Wang & Joshi, "Adaptive Communication Strategies to Achieve the Best
Error-Runtime Trade-off in Local-Update SGD", SysML 2019, arXiv 1810.08313): at each averaging the period
becomes ``k = ceil(sqrt(lr_0 * loss_t / (lr_t * loss_0) * init_k_steps))`` clamped to [1, ``max_k_steps``], with
the loss averaged over the ranks and ``lr_0``, ``loss_0`` taken at ``begin_step``: averaging gets more frequent as
the loss falls relative to the LR and rarer as the LR decays faster than the loss.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from algorithms.base import StepResult, SyncAlgorithm, SyncReport
from errors import is_int, require


def adaptive_period(lr_0: float, loss_0: float, lr_t: float, loss_t: float, init_k_steps: int, max_k_steps: int) -> int:
    """ADACOMM's period: ``ceil(sqrt(lr_0 * loss_t / (lr_t * loss_0) * init_k_steps))`` in [1, max_k_steps]."""
    if lr_t <= 0 or loss_0 <= 0 or not math.isfinite(loss_t):
        return max_k_steps if lr_t <= 0 else 1
    k = math.ceil(math.sqrt(lr_0 * loss_t / (lr_t * loss_0) * init_k_steps))
    return min(max(k, 1), max_k_steps)


class LocalSGD(SyncAlgorithm):
    """``sync=localsgd``: synchronous SGD until ``begin_step``, then parameter averaging every ``k_steps``."""

    name = "localsgd"

    def __init__(
        self, begin_step: int = 1, k_steps: int = 4, average_buffers: bool = True, average_momentum: bool = False
    ):
        self.begin_step, self.k_steps = begin_step, k_steps
        self.average_buffers, self.average_momentum = average_buffers, average_momentum
        self.next_sync: int | None = None  # the step after which the next averaging happens
        self.num_syncs = 0
        self._agreed = False  # averaged, and no local step since

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        b = section["begin_step"]
        require(is_int(b) and b >= 0, "sync.begin_step", b, "a step >= 0 (synchronous SGD before it)")
        for key in ("k_steps", "init_k_steps"):
            if key in section:
                k = section[key]
                require(is_int(k) and k >= 1, f"sync.{key}", k, "an integer >= 1 (local steps between averagings)")

    # ---- hooks ---------------------------------------------------------------------------------------------
    def after_backward(self, step: int, grads_finite: bool) -> SyncReport:
        if step >= self.begin_step:
            return SyncReport(grads_finite=grads_finite)  # a local step: nothing to exchange
        # Synchronous phase: average the gradients; an overflow flag rides along, so every rank agrees.
        comm = self.ctx.comm
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flag = torch.tensor([0.0 if grads_finite else 1.0], device=self.ctx.device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [flag])
        if not grads_finite:
            flat[:-1].zero_()
        comm.all_reduce(flat)
        if flat[-1].item() > 0:
            return SyncReport(grads_finite=False)
        flat.div_(comm.size)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(p).clone()
            offset += g.numel()
        return SyncReport()

    def after_optimizer_step(self, result: StepResult) -> SyncReport:
        step = result.step
        if step < self.begin_step:
            return SyncReport()
        if self.next_sync is None:
            self.next_sync = step + self.k_steps
        self._agreed = False
        metrics: dict[str, float] = {"k_steps": self.k_steps}
        events: list[dict[str, Any]] = []
        if step + 1 >= self.next_sync:
            metrics.update(self.average(self.sync_payload(result), steps=step + 1))
            events = self.on_sync(result, metrics)
            self.next_sync = step + 1 + self.k_steps
        return SyncReport(metrics=metrics, events=events)

    @property
    def steps_apart(self) -> bool:  # type: ignore[override]
        return self.begin_step == 0  # (before begin_step the replicas take the same steps: the gradients' average)

    def take_local_steps(self, agreed: list[torch.Tensor], since: int) -> bool:
        if since < self.begin_step:  # (the synchronous phase needs replicas that agree)
            return False
        self.next_sync = since + self.k_steps  # (at once, at the next step's end, where that is past)
        return True

    def on_sync(self, result: StepResult, metrics: dict[str, float]) -> list[dict[str, Any]]:
        """After an averaging (subclasses adapt the period here)."""
        return []

    def sync_payload(self, result: StepResult) -> list[torch.Tensor]:
        """Extra scalars to average with the parameters (appended to the same allreduce)."""
        return []

    def average(self, extras: list[torch.Tensor] = (), steps: int | None = None) -> dict[str, float]:
        """Average parameters (+ buffers, + momentum, + ``extras``) over the active ranks in one allreduce (the
        averaged extras land in ``averaged_extras``); return this rank's L2 distance to the average before it.
        The averaging that completes ``steps`` steps, where processes join, is their model too (``ctx.guests``):
        they add nothing to the sum, which is divided by the members alone."""
        comm = self.ctx.comm
        named = self.averaged(self.model)
        tensors = [t.data for _, t in named]
        if self.average_momentum:
            tensors += [
                s["momentum_buffer"]
                for s in self.optimizer.state.values()
                if isinstance(s.get("momentum_buffer"), torch.Tensor)
            ]
        flat = torch.cat([t.reshape(-1).float() for t in tensors] + [e.reshape(-1).float() for e in extras])
        local = flat[: sum(p.numel() for p in self.model.parameters())].clone()
        guests = self.ctx.guests(steps) if self.ctx.guests is not None and steps is not None else None
        if guests is None or self.average_momentum or not guests.sum(flat, [name for name, _ in named]):
            comm.all_reduce(flat)
        flat.div_(comm.size)
        distance = float((local - flat[: local.numel()]).double().norm())
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        self.averaged_extras = flat[offset:]
        self.num_syncs += 1
        self._agreed = True
        return {"replica_distance": distance, "synced": 1.0}

    def averaged(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """The model's tensors an averaging covers, by name, in the order it sends them: the parameters, then the
        floating-point buffers (``average_buffers``)."""
        named = list(model.named_parameters())
        if self.average_buffers:
            named += [(name, b) for name, b in model.named_buffers() if b.is_floating_point()]
        return named

    def before_eval(self) -> None:
        if self.next_sync is None:  # still synchronous: parameters agree, only BN statistics may not
            self.ctx.comm.average_buffers(self.model)
            return
        # Evaluate and checkpoint the averaged model (the averaging schedule itself is unchanged); right after an
        # averaging the replicas are that average already.
        if not self._agreed:
            self.average()

    def agreement_at(self, steps: int) -> int:
        """The next averaging's step count, or one after it (the period as it is now), from ``steps`` on."""
        first = self.next_sync
        if first is None:  # synchronous until begin_step (any step agrees), averaging k steps after it
            if steps <= self.begin_step:
                return steps
            first = self.begin_step + self.k_steps
        return first if steps <= first else first + -(-(steps - first) // self.k_steps) * self.k_steps

    def take_share(self, model: torch.nn.Module, summed: torch.Tensor, asked: dict[str, Any], state: Any) -> None:
        """On a process joining at an averaging (``ctx.guests``): the members' average, tensor by tensor, by name."""
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        average, offset = summed / asked["contributors"], 0
        with torch.no_grad():
            for name in asked["names"]:
                t = tensors[name]
                t.copy_(average[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    # ---- state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "next_sync": -1 if self.next_sync is None else self.next_sync,
            "k_steps": self.k_steps,
            "num_syncs": self.num_syncs,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_sync = None if state["next_sync"] < 0 else state["next_sync"]
        self.k_steps = state["k_steps"]
        self.num_syncs = state["num_syncs"]

    def local_state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}  # this rank's own momentum buffers

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


class AdaptiveLocalSGD(LocalSGD):
    """``sync=adaptive_localsgd``: ADACOMM's period, recomputed at every averaging from the averaged loss."""

    name = "adaptive_localsgd"

    def __init__(
        self,
        init_k_steps: int = 4,
        begin_step: int = 1,
        max_k_steps: int = 16,
        average_buffers: bool = True,
        average_momentum: bool = False,
    ):
        super().__init__(begin_step, init_k_steps, average_buffers, average_momentum)
        self.init_k_steps, self.max_k_steps = init_k_steps, max_k_steps
        self.lr_0: float | None = None
        self.loss_0: float | None = None

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        super().validate(section, cfg, world_size)
        m, i = section["max_k_steps"], section["init_k_steps"]
        require(is_int(m) and m >= i, "sync.max_k_steps", m, f"an integer >= sync.init_k_steps ({i})")

    def after_optimizer_step(self, result: StepResult) -> SyncReport:
        if self.lr_0 is None and result.step >= self.begin_step:
            # lr_0 and loss_0 at the first local step (after any LR warm-up that the synchronous phase covers);
            # the loss averaged over the ranks (one scalar allreduce, once).
            loss = torch.tensor([result.loss], dtype=torch.float64, device=self.ctx.device)
            self.lr_0, self.loss_0 = result.lr, float(self.ctx.comm.all_reduce_mean(loss).item())
        return super().after_optimizer_step(result)

    def sync_payload(self, result: StepResult) -> list[torch.Tensor]:
        return [torch.tensor([result.loss], device=self.ctx.device)]

    def on_sync(self, result: StepResult, metrics: dict[str, float]) -> list[dict[str, Any]]:
        loss_t, lr_t = float(self.averaged_extras[0]), result.lr
        k = adaptive_period(self.lr_0, self.loss_0, lr_t, loss_t, self.init_k_steps, self.max_k_steps)
        metrics["avg_loss"] = loss_t
        if k == self.k_steps:
            return []
        old, self.k_steps = self.k_steps, k
        metrics["k_steps"] = k
        return [
            {
                "event": "k_changed",
                "from": old,
                "to": k,
                "loss": loss_t,
                "lr": lr_t,
                "loss_0": self.loss_0,
                "lr_0": self.lr_0,
            }
        ]

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(lr_0=-1.0 if self.lr_0 is None else self.lr_0, loss_0=-1.0 if self.loss_0 is None else self.loss_0)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.lr_0 = None if state["lr_0"] < 0 else state["lr_0"]
        self.loss_0 = None if state["loss_0"] < 0 else state["loss_0"]
