"""A sync algorithm for tests in which a peer's loss reaches the survivors as an error whose text names no known
failure (``sync._target_=tests._obscure.ObscureFailure``): rank :data:`VICTIM` hangs (stops itself with SIGSTOP, after
writing its pid to ``$OBSCURE_PID_FILE``) before the exchange of step ``$OBSCURE_STEP``, and each survivor's
exchange that fails is raised again as ``$OBSCURE_ERROR`` (``RuntimeError`` or ``DistBackendError``) with the text
``$OBSCURE_TEXT``: what gloo says at another moment (a pair closed by a timeout), or NCCL."""

from __future__ import annotations

import os
import signal

import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from algorithms.base import StepResult, SyncReport
from algorithms.none import NoSync

VICTIM = 2
ERRORS = {"RuntimeError": RuntimeError, "DistBackendError": dist.DistBackendError}


class ObscureFailure(NoSync):
    """Parameter averaging after every optimizer step (local SGD with k = 1), one allreduce."""

    name = "obscure_failure"

    def __init__(self):
        self.step = int(os.environ.get("OBSCURE_STEP", "6"))
        self.error = ERRORS[os.environ.get("OBSCURE_ERROR", "RuntimeError")]
        self.text = os.environ.get("OBSCURE_TEXT", "something went wrong")

    def after_optimizer_step(self, result: StepResult) -> SyncReport:
        m = self.ctx.membership
        if m.rank == VICTIM and result.step == self.step:
            with open(os.environ["OBSCURE_PID_FILE"], "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        params = list(self.model.parameters())
        flat = parameters_to_vector(params).detach()
        try:
            self.ctx.comm.all_reduce_mean(flat)
        except RuntimeError as error:
            if m.rank == VICTIM:
                raise  # (woken after the others removed it: it leaves)
            raise self.error(self.text) from error
        vector_to_parameters(flat, params)
        return SyncReport()
