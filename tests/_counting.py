"""A communicator of one rank that counts the exchanges asked of it: for tests of what an algorithm exchanges, and
when, without a process group."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from algorithms.base import StepResult, SyncContext


class CountingComm:
    size = 1

    def __init__(self):
        self.calls: list[str] = []

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_reduce")
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor):
        self.calls.append("all_reduce_async")
        return SimpleNamespace(wait=lambda: tensor)

    def all_reduce_coalesced(self, tensors: list[torch.Tensor], average: bool = True) -> None:
        self.calls.append("all_reduce_coalesced")

    def average_buffers(self, model: nn.Module) -> None:
        self.calls.append("average_buffers")


def set_up(algorithm, model: nn.Module | None = None) -> CountingComm:
    """``algorithm`` set up on a small BN model with SGD and a :class:`CountingComm`; returns the comm."""
    model = model or nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    comm = CountingComm()
    ctx = SyncContext(comm, None, torch.device("cpu"))
    algorithm.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ctx)
    return comm


def step(algorithm, index: int):
    """``after_optimizer_step`` of step ``index`` (from 0)."""
    return algorithm.after_optimizer_step(StepResult(index, 1, 1.0, 0.1, True, 0.0, 0.0))
