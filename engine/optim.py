"""The replica a worker trains (model, optimizer, AMP backend, LR schedule), optimizers from timm's factory, and the
per-step learning-rate schedule."""

from __future__ import annotations

import math
import random
from typing import Any, NamedTuple

import numpy as np
import torch
from hydra.utils import instantiate
from timm.optim import create_optimizer_v2
from torch import nn

from data.common import DataBundle, steps_per_epoch
from models.factory import build_model, num_trainable_parameters


def build_optimizer(model: nn.Module, cfg_opt: dict[str, Any], lr: float) -> torch.optim.Optimizer:
    """sgd: plain SGD; momentum: heavy-ball (or Nesterov); lars: timm.optim.Lars.

    Bias and normalization parameters (1-d) get no weight decay and, for LARS, no trust-ratio adaptation
    (timm skips adaptation in groups with weight_decay 0).
    """
    name = cfg_opt["name"]
    momentum = 0.0 if name == "sgd" else cfg_opt["momentum"]
    kwargs: dict[str, Any] = {}
    if name == "lars":
        kwargs["trust_coeff"] = cfg_opt["trust_coeff"]
        opt = "nlars" if cfg_opt["nesterov"] else "lars"
    else:
        opt = "nesterov" if cfg_opt["nesterov"] and momentum > 0 else "momentum"
    return create_optimizer_v2(
        model,
        opt=opt,
        lr=lr,
        weight_decay=cfg_opt["weight_decay"],
        momentum=momentum,
        filter_bias_and_bn=True,
        **kwargs,
    )


class LRSchedule:
    """Linear warm-up, then cosine, poly or step decay, as a function of training progress in (fractional)
    epochs, evaluated at every optimizer step. Progress in epochs, not steps, keeps the schedule right when the
    number of steps per epoch changes (relaxed sync rebuilds the train loader over fewer ranks).

    ``scale`` multiplies the result (relaxed sync rescales the LR when the world shrinks).
    """

    def __init__(self, cfg_sched: dict[str, Any], base_lr: float, total_epochs: float):
        self.cfg = cfg_sched
        self.base_lr = base_lr
        self.total_epochs = max(total_epochs, 1e-9)
        self.warmup_epochs = min(cfg_sched["warmup_epochs"], self.total_epochs)
        self.scale = 1.0

    def factor(self, epoch: float) -> float:
        c = self.cfg
        if epoch < self.warmup_epochs:
            start = c["warmup_start_factor"]
            return start + (1.0 - start) * epoch / self.warmup_epochs
        if c["name"] == "step":
            return c["gamma"] ** sum(1 for m in c["milestones"] if epoch >= m)
        span = max(self.total_epochs - self.warmup_epochs, 1e-9)
        progress = min(1.0, (epoch - self.warmup_epochs) / span)
        floor = c["min_lr_factor"]
        if c["name"] == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * (1.0 - progress) ** c["power"]  # poly

    def lr(self, epoch: float) -> float:
        return self.base_lr * self.factor(epoch) * self.scale

    def apply(self, optimizer: torch.optim.Optimizer, epoch: float) -> float:
        lr = self.lr(epoch)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}


def effective_lr(cfg_opt: dict[str, Any], cfg_sched: dict[str, Any], global_batch: int) -> float:
    """``optimizer.lr`` is for the global batch; with ``schedule.scale_lr`` it is for ``base_batch_size``."""
    if cfg_sched["scale_lr"]:
        return cfg_opt["lr"] * global_batch / cfg_sched["base_batch_size"]
    return cfg_opt["lr"]


class Replica(NamedTuple):
    model: nn.Module  # unwrapped (the sync algorithm may wrap it)
    optimizer: torch.optim.Optimizer
    amp: Any  # engine.amp.AmpBackend
    schedule: LRSchedule
    num_params: int  # trainable
    max_steps: float  # trainer.max_steps, or inf


def build_schedule(cfg: dict[str, Any], num_train: int, world_size: int) -> LRSchedule:
    """The LR schedule of a world of ``world_size`` ranks over the run's length (what a run started or resumed at that
    size gets; a world that grows by a join takes it too)."""
    t, batch = cfg["trainer"], cfg["data"]["batch_size"]
    max_steps = t["max_steps"] if t["max_steps"] is not None else float("inf")
    steps = steps_per_epoch(num_train, world_size, batch)
    base_lr = effective_lr(cfg["optimizer"], cfg["schedule"], batch * world_size)
    return LRSchedule(cfg["schedule"], base_lr, min(t["epochs"], max_steps / steps))


def build_replica(cfg: dict[str, Any], data: DataBundle, device: torch.device, world_size: int) -> Replica:
    """The model for ``data``, its optimizer through the AMP backend, and the LR schedule over the run's length."""
    t, batch = cfg["trainer"], cfg["data"]["batch_size"]
    model = build_model(cfg["model"], data.num_classes, data.channels, device)
    num_params = num_trainable_parameters(model)
    steps = steps_per_epoch(len(data.train), world_size, batch)
    if steps < 1:
        raise ValueError(
            f"data.batch_size={batch}: larger than a rank's shard ({len(data.train)} samples / {world_size} ranks); "
            f"lower it"
        )
    max_steps = t["max_steps"] if t["max_steps"] is not None else float("inf")
    schedule = build_schedule(cfg, len(data.train), world_size)
    optimizer = build_optimizer(model, cfg["optimizer"], schedule.base_lr)
    amp = instantiate(cfg["amp"])
    model, optimizer = amp.setup(model, optimizer, device)
    return Replica(model, optimizer, amp, schedule, num_params, max_steps)


def rehearse(model: nn.Module, criterion: nn.Module, amp: Any, optimizer: Any, batch: tuple, device: torch.device):
    """One forward and backward pass of ``model`` on ``batch`` (an example, shaped like the training data), thrown
    away: the next step runs at a trained process's pace (kernels chosen, memory allocated). What it changes is
    replaced afterwards (the model, its gradients) or restored here (every random generator it may draw from)."""
    devices = [device] if device.type == "cuda" else []
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=devices):
        x, y = batch
        with amp.autocast():
            loss = criterion(model(x), y)
        loss.backward()
    random.setstate(python)
    np.random.set_state(numpy)
    amp.zero_grad(optimizer)
