"""The failure guard is chosen once: under ``trainer.on_failure=abort`` the trainer runs every part of its loop through
a guard that keeps nothing, so no recovery bookkeeping runs per step; under ``continue`` the surviving guard knows
where the loop is and keeps the records a healed logging rank would need."""

from __future__ import annotations

import json

import pytest
from _workers import guard_bookkeeping
from conftest import FAST, train_each

from engine.elastic.face import Fixed
from engine.elastic.positions import Phase, Position

RUN = [*FAST, "trainer.nproc=2", "data.num_samples=256", "data.num_val_samples=64", "trainer.epochs=1"]


def test_the_fixed_face_runs_each_part_as_it_is_and_keeps_nothing():
    guard, calls = Fixed(), []
    assert guard.run(Phase.STEP, lambda: calls.append("step") or 7, epoch=1) == 7
    assert guard.repeat(lambda: "done") == "done" and guard.entry(None) is None
    assert not guard.admit_if_due(1, None) and guard.guests is None
    assert calls == ["step"] and vars(guard) == {} and guard.lost_ranks == ()


def test_abort_uses_the_null_guard_and_records_no_position_or_history_while_continue_does(tmp_path):
    runs = train_each(
        tmp_path,
        {"abort": RUN, "continue": [*RUN, "trainer.on_failure=continue", "trainer.hang_timeout_s=30"]},
        entrypoint=guard_bookkeeping,
    )
    for rank in (0, 1):
        abort = json.loads((tmp_path / "abort" / f"guard_rank{rank}.json").read_text())
        assert abort == {"guard": "Fixed", "attributes": [], "observers": 0, "history": []}, abort
        kept = json.loads((tmp_path / "continue" / f"guard_rank{rank}.json").read_text())
        assert kept["guard"] == "SurvivingGuard" and kept["observers"] == 1, kept
        if rank == 0:  # the logging rank kept every record it wrote but the summary, with where the loop was
            written = [r for r in runs["continue"] if r["kind"] != "summary"]
            assert [kind for _, _, kind in kept["history"]] == [r["kind"] for r in written]
        train = [(step, phase) for step, phase, kind in kept["history"] if kind == "train"]
        assert train == [(s, Phase.EXCHANGE.value) for s in range(len(train))] and train
        assert {phase for _, phase, _ in kept["history"]} <= {p.value for p in Phase}
    assert Position(3, Phase.EVALUATION).key < Position(3, Phase.STEP).key < Position(4, Phase.EVALUATION).key


class _Host:
    """What the surviving guard uses of the trainer, recording the changes it is asked to follow."""

    def __init__(self):
        from types import SimpleNamespace

        from engine.state import RunState

        self.run, self.applied, self.lines = RunState(), [], []
        self.recorder = SimpleNamespace(observers=[], console=self.lines.append)
        self.sync = SimpleNamespace(local_state_dict=dict)

    def apply(self, report, epoch: int) -> None:
        self.applied.append(epoch)


def _agreeing(membership, outcomes: list):
    """A stand-in for ``Failures.recover``: each call removes the next ranks as ``Membership.adopt`` does (the
    change holds before the group forms) and then raises the next outcome, or returns the recovery."""
    from distributed.membership import Change
    from engine.elastic.failures import Recovery

    def recover(error, at):
        ranks, outcome = outcomes.pop(0)
        membership.generation += 1
        membership.ranks = [r for r in membership.ranks if r not in ranks]
        change = Change(membership.generation, ranks, list(membership.ranks), "died")
        membership.changes.append(change)
        if outcome is not None:
            raise outcome
        where = {r: [at.step, at.phase.value] for r in membership.ranks}
        event = {"event": "rank_lost", "ranks": ranks, "cause": "died", "failed_step": at.step, "redo": "step"}
        return Recovery(change, event, where)

    return recover


def test_a_peer_lost_while_the_survivors_agree_is_agreed_on_in_turn_and_each_loss_is_written_once():
    """Rank 3 dies in a step; while the survivors form their group, rank 2 dies too (the new group's first
    collective fails): they agree again, over ranks 0 and 1, redo the step once, and one rank_lost event names
    both. A recovery that ended without another loss writes its own event (two losses, two events)."""
    import torch.distributed as dist

    from distributed.membership import Membership
    from engine.elastic.guard import SurvivingGuard

    host, membership = _Host(), Membership(0, 4)
    guard = SurvivingGuard(membership, 3.0, host)
    lost_again = dist.DistBackendError("the new group's first collective failed: rank 2 is gone")
    guard.failures.recover = _agreeing(membership, [([3], lost_again), ([2], None)])
    attempts = []

    def step():
        attempts.append(membership.generation)
        if len(attempts) == 1:
            raise RuntimeError("Connection closed by peer")
        return "stepped"

    assert guard.run(Phase.STEP, step, epoch=1) == "stepped"
    assert attempts == [0, 2] and membership.ranks == [0, 1]  # redone once, on the group after both changes
    (event,) = guard._lost
    assert event["ranks"] == [2, 3] and guard.lost_ranks == [2, 3] and host.applied == [1]
    assert "rank(s) [2, 3] died at step 0; 2 ranks go on" in host.lines[0]

    guard.failures.recover = _agreeing(membership, [([1], None)])  # a later loss: an event of its own
    attempts.clear()
    assert guard.run(Phase.STEP, step, epoch=1) == "stepped"
    assert [e["ranks"] for e in guard._lost] == [[2, 3], [1]] and guard.lost_ranks == [2, 3, 1]


def test_an_error_of_pythons_own_is_a_loss_once_the_alarm_of_its_generation_rang():
    """On NCCL the alarm aborts the generation's groups, and a bucket DDP's hook issues afterwards on one raises
    ``ValueError`` (the group has left torch's registry: seen on a GPU, where it ended a survivor). Once another
    rank rang the alarm of the generation such an error is a loss like a failed collective; before, or for a
    generation gone by, it is this rank's own and ends the run."""
    from distributed.membership import Membership
    from engine.elastic.guard import SurvivingGuard

    unregistered = ValueError("Process group <...> is not initialized in the world group map.")
    host, membership = _Host(), Membership(0, 3)
    guard = SurvivingGuard(membership, 3.0, host)
    guard.failures.recover = _agreeing(membership, [([2], None)])
    attempts = []

    def step():
        attempts.append(membership.generation)
        if len(attempts) == 1:
            membership.alarm.ring(membership.generation, "rank 1 saw rank 2 lost")  # (and aborted the group)
            raise unregistered
        return "stepped"

    assert guard.run(Phase.STEP, step, epoch=1) == "stepped"
    assert attempts == [0, 1] and membership.ranks == [0, 1] and guard.lost_ranks == [2]

    membership.alarm.ring(0, "an old generation's alarm")  # (rung already: nothing changes)

    def own_error():
        raise unregistered  # no alarm of generation 1 has rung

    with pytest.raises(ValueError, match="world group map"):
        guard.run(Phase.STEP, own_error, epoch=1)


def test_an_error_of_the_recovery_that_is_no_loss_ends_the_run_and_an_unreachable_store_is_never_retried():
    from distributed.membership import Membership
    from engine.elastic.failures import StoreUnreachable
    from engine.elastic.guard import SurvivingGuard

    for outcome in (KeyError("front"), StoreUnreachable("cannot reach the c10d store")):
        host, membership = _Host(), Membership(0, 3)
        guard = SurvivingGuard(membership, 3.0, host)
        guard.failures.recover = _agreeing(membership, [([2], outcome), ([1], None)])

        def step():
            raise RuntimeError("Connection closed by peer")

        with pytest.raises(type(outcome)):
            guard.run(Phase.STEP, step, epoch=1)
        assert host.applied == [] and not guard._lost


def test_an_error_after_which_the_survivors_agree_that_no_peer_is_gone_ends_the_run_at_once():
    """``Failures.recover`` raises the error itself when every peer is still there (it was this rank's own, or its
    group's): that ends the run, where agreeing again would find the same and go round for ever."""
    from distributed.membership import Membership
    from engine.elastic.guard import SurvivingGuard

    host, membership = _Host(), Membership(0, 3)
    guard = SurvivingGuard(membership, 3.0, host)
    closed, calls = RuntimeError("Connection closed by peer"), []

    def recover(error, at):
        calls.append(error)
        assert len(calls) == 1, "agreed again on the same error"
        raise error  # (no peer is gone)

    guard.failures.recover = recover

    def step():
        raise closed

    with pytest.raises(RuntimeError, match="closed by peer"):
        guard.run(Phase.STEP, step, epoch=1)
    assert calls == [closed] and host.applied == [] and not guard._lost


def test_a_rank_healed_after_a_second_loss_writes_no_loss_the_front_has_written():
    """Rank 0 is a collective behind when rank 2 is lost; rank 1, its source, hangs while it heals it. The others
    agree on rank 1, and rank 3 (which went on and redid what was in flight, writing rank 2's loss) heals rank 0,
    which takes rank 3's records, rank 2's loss among them, and writes only rank 1's of its own."""
    from distributed.membership import Membership
    from engine.elastic.guard import CatchUp, SurvivingGuard
    from engine.elastic.positions import Phase

    host, membership = _Host(), Membership(0, 4)
    replayed = []
    host.recorder.replay = replayed.extend
    host.load_state_dict = lambda state: None
    guard = SurvivingGuard(membership, 3.0, host)
    agreed = _agreeing(membership, [([2], None), ([1], None)])

    def behind(error, at):  # rank 0 failed a collective before the others
        recovery = agreed(error, at)
        where = {r: [at.step, "exchange" if r == 0 else "checkpoint"] for r in recovery.change.ranks}
        return recovery.__class__(recovery.change, {**recovery.event, "redo": "checkpoint"}, where)

    guard.failures.recover = behind
    front_wrote = {"kind": "event", "event": "rank_lost", "ranks": [2]}
    snapshot = {"state": {}, "records": [front_wrote], "entry": guard._at}
    heals = [RuntimeError("Connection closed by peer"), snapshot]  # rank 1 hangs as it sends; then rank 3 heals

    def heal(recovery, build):
        outcome = heals.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    guard.failures.heal = heal

    def exchange():
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(CatchUp):
        guard.run(Phase.EXCHANGE, exchange, epoch=1)
    assert replayed == [front_wrote] and [e["ranks"] for e in guard._lost] == [[1]]
