"""A sync algorithm for tests whose exchange a dying rank can leave finished on one survivor and failed on another:
the case of a kill inside the last collective of a step, made deterministic (importable by torchrun's workers as
``sync._target_=tests._partial.PartialExchange``). Where and when, from the environment:
``PARTIAL_KILL_STEP`` (default 12) and ``PARTIAL_IN``: ``exchange`` (the parameters, after the optimizer step, as
local SGD does) or ``backward`` (the gradients, before it, as DDP does)."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from algorithms.base import StepResult, SyncReport
from algorithms.none import NoSync

VICTIM, AHEAD = 2, 1


class PartialExchange(NoSync):
    """Each rank sends its parameters (or gradients) to every other one and takes the mean, summed in rank order
    (identical on every rank). In the exchange of step ``PARTIAL_KILL_STEP``, rank :data:`VICTIM` receives from
    everyone but sends only to rank :data:`AHEAD`, then kills its torchrun agent and itself: rank AHEAD finishes
    that exchange and goes on, the others fail in it."""

    name = "partial_exchange"

    def __init__(self):
        self.kill_step = int(os.environ.get("PARTIAL_KILL_STEP", "12"))
        self.where = os.environ.get("PARTIAL_IN", "exchange")

    def after_backward(self, step: int, grads_finite: bool) -> SyncReport:
        if self.where == "backward":
            grads = [p.grad for p in self.model.parameters()]
            mean = self._mean(parameters_to_vector(grads), step)
            vector_to_parameters(mean, grads)
        return SyncReport(grads_finite=grads_finite)

    def after_optimizer_step(self, result: StepResult) -> SyncReport:
        if self.where == "exchange":
            params = list(self.model.parameters())
            vector_to_parameters(self._mean(parameters_to_vector(params).detach(), result.step), params)
        return SyncReport()

    def _mean(self, own: torch.Tensor, step: int) -> torch.Tensor:
        m = self.ctx.membership
        peers = [r for r in m.ranks if r != m.rank]
        got = {r: torch.empty_like(own) for r in peers}
        if m.rank == VICTIM and step == self.kill_step:
            self.ctx.comm.exchange([], [(got[r], r) for r in peers])
            self.ctx.comm.exchange([(own, AHEAD)], [])
            time.sleep(0.5)  # (rank AHEAD reads it before the connection closes)
            os.kill(os.getppid(), signal.SIGKILL)  # the node goes: its agent, then this worker
            os.kill(os.getpid(), signal.SIGKILL)
        self.ctx.comm.exchange([(own, r) for r in peers], [(got[r], r) for r in peers])
        got[m.rank] = own
        total = torch.zeros_like(own)
        for r in m.ranks:
            total += got[r]
        return total / len(m.ranks)
