"""A sync algorithm for tests whose exchange a dying rank can leave finished on one survivor and failed on another:
the case of a kill inside the last collective of a step, made deterministic (importable by torchrun's workers as
``sync._target_=tests._partial.PartialExchange``). Where and when, from the environment:
``PARTIAL_KILL_STEP`` (default 12) and ``PARTIAL_IN``: ``exchange`` (the parameters, after the optimizer step, as
local SGD does) or ``backward`` (the gradients, before it, as DDP does). :class:`PartialDGC` is DGC with its sparse
allgather of that step left so (``sync.inner._target_=tests._partial.PartialDGC`` under relaxed sync);
:class:`PartialSGP` is overlapped SGP whose victim dies before it posts that step's round."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from algorithms.base import StepResult, SyncContext, SyncReport
from algorithms.dgc import DGC
from algorithms.none import NoSync
from algorithms.sgp import SGP

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
        got = gather_leaving_one_behind(self.ctx, own, step == self.kill_step)
        total = torch.zeros_like(own)
        for tensor in got:
            total += tensor
        return total / len(got)


def gather_leaving_one_behind(ctx: SyncContext, own: torch.Tensor, kill: bool) -> list[torch.Tensor]:
    """Every active rank's ``own``, in rank order, by point-to-point sends to every other rank. With ``kill``,
    rank :data:`VICTIM` receives from everyone, sends to rank :data:`AHEAD` only, and kills its node."""
    m = ctx.membership
    peers = [r for r in m.ranks if r != m.rank]
    got = {r: torch.empty_like(own) for r in peers}
    if m.rank == VICTIM and kill:
        ctx.comm.exchange([], [(got[r], r) for r in peers])
        ctx.comm.exchange([(own, AHEAD)], [])
        time.sleep(0.5)  # (rank AHEAD reads it before the connection closes)
        os.kill(os.getppid(), signal.SIGKILL)  # the node goes: its agent, then this worker
        os.kill(os.getpid(), signal.SIGKILL)
    ctx.comm.exchange([(own, r) for r in peers], [(got[r], r) for r in peers])
    got[m.rank] = own
    return [got[r] for r in m.ranks]


class PartialDGC(DGC):
    """DGC whose sparse allgather of step ``PARTIAL_KILL_STEP`` (in the world it started with) is
    :func:`gather_leaving_one_behind`: rank AHEAD applies that step, the others fail in it."""

    def setup(self, model, optimizer, ctx: SyncContext) -> None:
        self.kill_step = int(os.environ.get("PARTIAL_KILL_STEP", "12"))
        self._step, self._world = -1, ctx.membership.size
        super().setup(model, optimizer, dataclasses.replace(ctx, comm=_Gather(ctx.comm, self)))

    def after_backward(self, step: int, grads_finite: bool) -> SyncReport:
        self._step = step
        return super().after_backward(step, grads_finite)


class _Gather:
    """The communicator, with its allgather replaced at the kill step."""

    def __init__(self, comm, dgc: PartialDGC):
        self._comm, self._dgc = comm, dgc

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        dgc = self._dgc
        if dgc._step != dgc.kill_step or dgc.ctx.membership.size != dgc._world:
            return self._comm.all_gather(tensor)
        return gather_leaving_one_behind(dataclasses.replace(dgc.ctx, comm=self._comm), tensor, kill=True)


class PartialSGP(SGP):
    """Overlapped SGP (``sync.overlap=true``) whose rank :data:`VICTIM` kills its node after the optimizer step of
    ``PARTIAL_KILL_STEP``, before posting that step's round: the others' round of that step, posted on the group
    that held it, is still in flight when they next wait for it (at the end of the epoch, its evaluation drains)."""

    def after_optimizer_step(self, result: StepResult) -> SyncReport:
        if self.ctx.membership.rank == VICTIM and result.step == int(os.environ.get("PARTIAL_KILL_STEP", "12")):
            # (alive a while yet, silent: the others post their round of this step on the old group before any of
            # its connections closes, so their failure is in the evaluation's drain, not in posting the round)
            time.sleep(2.0)
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().after_optimizer_step(result)
