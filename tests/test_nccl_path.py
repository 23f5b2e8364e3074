"""The failure path as NCCL fails, on the CPU. NCCL's ``Work.wait()`` with no timeout only makes the current CUDA
stream wait and returns at once, so a collective stuck on a lost peer raises nothing where it was waited for;
``wait(timeout)`` polls until the work ends and raises ``DistBackendError`` if it failed or passed the deadline.
:class:`NcclLikeWork` behaves so, and each place that waits for a collective under ``trainer.on_failure:
continue`` must raise at that collective (where the guard catches it), not return as if it had finished."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from algorithms.allreduce import AllReduce, HookState
from distributed.comm import Communicator, Pending
from distributed.membership import Membership

DEADLINE = datetime.timedelta(seconds=3)


class NcclLikeWork:
    """A collective that never finishes (its peer is gone), waited for as NCCL waits."""

    def __init__(self):
        self.waits: list[datetime.timedelta | None] = []

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if timeout is None:
            return True  # (NCCL: the stream waits, the CPU goes on)
        raise dist.DistBackendError("NCCL operation timed out")

    def is_completed(self) -> bool:
        return False


def membership(timeout: datetime.timedelta | None) -> Membership:
    """Of two ranks on NCCL, whose waits are the works' own (``wait(timeout)``)."""
    return Membership(0, 2, timeout=timeout, backend="nccl")


@pytest.mark.parametrize("deadline", [DEADLINE, None], ids=["continue", "abort"])
def test_a_collective_waited_for_under_a_deadline_raises_where_it_is_waited_for(deadline):
    comm = Communicator(membership(deadline))
    work = NcclLikeWork()
    if deadline is None:  # (on_failure=abort: the run ends at the watchdog's timeout, as torch decides)
        assert Pending(comm, [work], "result").wait() == "result"
    else:
        with pytest.raises(dist.DistBackendError, match="timed out"):
            Pending(comm, [work], "result").wait()
    assert work.waits == [deadline]


@pytest.mark.parametrize("collective", ["broadcast", "barrier"])
def test_the_communicators_blocking_collectives_wait_under_the_deadline_too(monkeypatch, collective):
    work = NcclLikeWork()
    monkeypatch.setattr(dist, collective, lambda *args, **kwargs: work)
    comm = Communicator(membership(DEADLINE))
    with pytest.raises(dist.DistBackendError):
        comm.broadcast(torch.zeros(2), src=0) if collective == "broadcast" else comm.barrier()
    assert work.waits == [DEADLINE]


def test_ddps_allreduces_are_waited_for_under_the_deadline_before_the_optimizer_step():
    """DDP waits for its hook's allreduces on the stream only; AllReduce waits for each under the deadline in
    after_backward, and a fresh backward starts with none left over."""
    sync = AllReduce()
    sync.ctx = SimpleNamespace(membership=membership(DEADLINE))
    sync.hook_state = HookState(comm=None)
    hung = NcclLikeWork()
    sync.hook_state.works = [hung]
    with pytest.raises(dist.DistBackendError):
        sync.after_backward(step=3, grads_finite=True)
    assert hung.waits == [DEADLINE] and sync.hook_state.works == []
    assert sync.after_backward(step=3, grads_finite=True).grads_finite  # (nothing in flight: nothing to wait for)


def test_a_heal_sends_the_fronts_state_from_the_cpu():
    """A pickled CUDA tensor comes back on the sender's device index, which the receiver may not have: the
    snapshot a rank left behind receives holds CPU copies (fake CUDA tensors stand in for a GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from engine.elastic.guard import SurvivingGuard, _tensors
    from engine.elastic.positions import Phase, Position

    guard = SurvivingGuard.__new__(SurvivingGuard)
    guard.history, guard._at = [], SimpleNamespace(position=Position(5, Phase.STEP))
    with FakeTensorMode(allow_non_fake_inputs=True):
        state = {"model": {"w": torch.zeros(2, device="cuda")}, "sync": [torch.ones(1, device="cuda")], "step": 5}
        guard.host = SimpleNamespace(state_dict=lambda: state)
        snapshot = guard._snapshot(Position(5, Phase.STEP), Position(5, Phase.EXCHANGE))
    sent = list(_tensors(snapshot["state"]))
    assert len(sent) == 2 and all(t.device.type == "cpu" for t in sent) and snapshot["state"]["step"] == 5
