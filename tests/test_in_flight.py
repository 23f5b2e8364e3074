"""Work in flight across a change of the active ranks: an exchange issued on a group that has since been replaced
is dropped alike on every survivor (``distributed.comm.Pending``), and each algorithm that keeps exchanges in
flight goes on as if it had not been issued."""

from __future__ import annotations

import torch
from torch import nn

from algorithms.base import SyncContext
from algorithms.crossover import Crossover
from algorithms.diloco import DiLoCo, FragmentSync
from algorithms.sgp import SGP, Round
from distributed.comm import Communicator, Pending
from distributed.membership import Membership


class OnTheOldGroup:
    """A collective of the group that was replaced: it may never finish there."""

    def wait(self) -> None:
        raise AssertionError("waited on the replaced group")

    def is_completed(self) -> bool:
        return False


def _context(size: int = 4) -> SyncContext:
    membership = Membership(0, size)
    return SyncContext(Communicator(membership), membership, torch.device("cpu"))


def _issued_then_replaced(ctx: SyncContext, result=None) -> Pending:
    """A collective issued on the active group, which a lost rank then replaces."""
    pending = Pending(ctx.comm, [OnTheOldGroup()], result)
    assert not pending.dropped and not pending.is_completed()
    ctx.membership.generation += 1  # (what Membership.adopt does on every survivor)
    return pending


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_collective_issued_before_the_ranks_changed_is_dropped_without_touching_the_old_group():
    ctx = _context()
    pending = _issued_then_replaced(ctx, result=[torch.ones(2)])
    assert pending.dropped and pending.is_completed()
    assert pending.wait() is None  # at once; OnTheOldGroup.wait would raise
    assert Pending(ctx.comm, [], torch.ones(1)).wait() is not None  # one issued on the new group lands


def test_sgp_a_dropped_round_gives_this_ranks_shares_back_so_the_survivors_mass_is_kept():
    ctx, model = _context(), _model()
    sgp = SGP(overlap=True)
    sgp.setup(model, None, ctx)
    before = _flat(model).clone()
    message, outs, _ = sgp._message(0)
    sgp.weight *= 1.0 / (len(outs) + 1)  # as _gossip_overlapped: the share this rank keeps
    round_ = Round(1, _issued_then_replaced(ctx), message, len(outs))
    sgp._mix(round_)
    assert sgp.weight == 1.0 and torch.equal(_flat(model), before)  # (shares of 1/2: exact in binary)


def test_crossover_a_dropped_round_changes_nothing():
    ctx, model = _context(), _model()
    crossover = Crossover(segments=2, overlap=True)
    crossover.setup(model, None, ctx)
    before = _flat(model).clone()
    crossover._mix(_issued_then_replaced(ctx), before.clone().add_(1.0))
    assert torch.equal(_flat(model), before)


def test_diloco_a_dropped_fragment_takes_no_outer_step():
    ctx, model = _context(), _model()
    diloco = DiLoCo(inner_steps=4, fragments=2, delay=1)
    diloco.setup(model, None, ctx)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # local progress since the last outer step
    local, outer, momentum = _flat(model).clone(), diloco.global_params.clone(), diloco.momentum.clone()
    assert diloco._apply(FragmentSync(2, 0, _issued_then_replaced(ctx))) is None
    assert torch.equal(_flat(model), local) and torch.equal(diloco.global_params, outer)
    assert torch.equal(diloco.momentum, momentum)


def test_sparse_diloco_a_dropped_round_gives_its_error_feedback_back():
    """What a rank took out of its error-feedback buffer for a round that was dropped went nowhere: the buffer is
    as before the round, and the fragment keeps its progress (its next pseudo-gradient holds it again)."""
    ctx, model = _context(), _model()
    diloco = DiLoCo(inner_steps=4, fragments=2, delay=1, quantize="sparse", density=0.5, chunk=4)
    diloco.setup(model, None, ctx)
    diloco.feedback.buffer.copy_(torch.linspace(-1.0, 1.0, diloco.feedback.buffer.numel()))
    before = diloco.feedback.buffer.clone()
    lo, hi = diloco.ranges[0]
    payload = diloco._send_sparse(0, torch.full((hi - lo,), 0.25))
    assert payload.numel() == diloco.codecs[0].bytes and not torch.equal(diloco.feedback.buffer, before)
    local = _flat(model).clone()
    assert diloco._apply(FragmentSync(2, 0, _issued_then_replaced(ctx))) is None
    assert torch.equal(diloco.feedback.buffer, before) and torch.equal(_flat(model), local)


def test_a_round_whose_exchange_fails_stays_in_flight_to_be_dropped_after_the_regroup():
    """The exchange of a due round raises (a peer is gone): the round is still in flight when the survivors redo
    the part on their new group, where it is dropped, giving this rank's shares back."""
    ctx, model = _context(), _model()
    sgp = SGP(overlap=True)
    sgp.setup(model, None, ctx)
    message, outs, _ = sgp._message(0)
    sgp.weight *= 1.0 / (len(outs) + 1)
    sgp._in_flight.append(Round(1, Pending(ctx.comm, [OnTheOldGroup()]), message, len(outs)))
    try:
        sgp.drain()
    except AssertionError:
        pass  # (the failed exchange)
    assert len(sgp._in_flight) == 1
    ctx.membership.generation += 1
    sgp.drain()
    assert not sgp._in_flight and sgp.weight == 1.0
