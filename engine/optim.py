"""Optimizers (timm's factory) and the per-step learning-rate schedule."""

from __future__ import annotations

import math
from typing import Any

import torch
from timm.optim import create_optimizer_v2
from torch import nn


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
    """Linear warm-up, then cosine, poly or step decay; evaluated at every optimizer step.

    ``scale`` multiplies the result (relaxed sync rescales the LR when the world shrinks).
    """

    def __init__(self, cfg_sched: dict[str, Any], base_lr: float, steps_per_epoch: int, total_steps: int):
        self.cfg = cfg_sched
        self.base_lr = base_lr
        self.steps_per_epoch = max(1, steps_per_epoch)
        self.total_steps = max(1, total_steps)
        self.warmup_steps = round(cfg_sched["warmup_epochs"] * self.steps_per_epoch)
        self.scale = 1.0

    def factor(self, step: int) -> float:
        c = self.cfg
        if step < self.warmup_steps:
            start = c["warmup_start_factor"]
            return start + (1.0 - start) * step / self.warmup_steps
        if c["name"] == "step":
            epoch = step / self.steps_per_epoch
            return c["gamma"] ** sum(1 for m in c["milestones"] if epoch >= m)
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = c["min_lr_factor"]
        if c["name"] == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * (1.0 - progress) ** c["power"]  # poly

    def lr(self, step: int) -> float:
        return self.base_lr * self.factor(step) * self.scale

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = state["scale"]


def effective_lr(cfg_opt: dict[str, Any], cfg_sched: dict[str, Any], global_batch: int) -> float:
    """``optimizer.lr`` is for the global batch; with ``schedule.scale_lr`` it is for ``base_batch_size``."""
    if cfg_sched["scale_lr"]:
        return cfg_opt["lr"] * global_batch / cfg_sched["base_batch_size"]
    return cfg_opt["lr"]
