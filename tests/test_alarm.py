"""The alarm that ends a wait on a collective nothing will fail on this rank (distributed/alarm.py): two gloo ranks
of one process, one waiting on a receive the other never sends."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from distributed.alarm import Alarm, PeerLost

DEADLINE = datetime.timedelta(seconds=60)


@pytest.fixture
def pair():
    """Two gloo process groups of two ranks, in this process (each formed on its own thread: they connect)."""
    store, groups = dist.HashStore(), [None, None]

    def form(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, DEADLINE)

    threads = [threading.Thread(target=form, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    yield groups


def ring_later(alarm: Alarm, generation: int, after_s: float = 0.2) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(after_s), alarm.ring(generation, "peer 2 is lost")))
    thread.start()
    return thread


@pytest.mark.parametrize("kind", ["collective", "point to point"])
def test_a_ring_ends_a_wait_that_nothing_else_would_end_before_the_deadline(pair, kind):
    """A collective's work wakes its wait through its future; a receive's has none and is waited for on a thread."""
    alarm, box = Alarm(), torch.zeros(4)

    def issue(tag: int):  # a work rank 1 takes no part in
        return pair[0].allreduce([box]) if kind == "collective" else pair[0].recv([box], 1, tag)

    work = issue(0)
    ringer = ring_later(alarm, 3)
    started = time.monotonic()
    with pytest.raises(PeerLost, match="peer 2 is lost"):
        alarm.wait([work], 3, DEADLINE)
    assert time.monotonic() - started < DEADLINE.total_seconds() / 2  # woken by the ring, not by the deadline
    ringer.join()
    with pytest.raises(PeerLost):  # and a wait of that generation that starts later fails at once
        alarm.wait([issue(1)], 3, DEADLINE)
    for tag in (0, 1):  # (what was abandoned is still posted: end it, or closing the groups waits for it)
        (pair[1].allreduce([torch.zeros(4)]) if kind == "collective" else pair[1].send([box], 0, tag)).wait()


def test_a_ring_of_another_generation_leaves_a_wait_alone_and_a_finished_collective_returns(pair):
    alarm, box = Alarm(), torch.zeros(4)
    assert alarm.ring(1, "an old group's loss") and not alarm.ring(1, "twice")  # once per generation
    send = pair[1].send([torch.arange(4.0)], 0, 0)
    alarm.wait([pair[0].recv([box], 1, 0)], 2, DEADLINE)
    send.wait()
    assert box.tolist() == [0.0, 1.0, 2.0, 3.0] and alarm.rung(2) is None


@pytest.mark.parametrize("kind", ["collective", "point to point"])
def test_the_deadline_ends_a_wait_nobody_rings_for_even_when_the_groups_own_timeout_is_longer(pair, kind):
    alarm = Alarm()
    work = pair[0].allreduce([torch.zeros(1)]) if kind == "collective" else pair[0].recv([torch.zeros(1)], 1, 0)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        alarm.wait([work], 0, datetime.timedelta(seconds=0.3))  # nobody takes part and nobody rings
    assert not isinstance(error.value, PeerLost)
    assert time.monotonic() - started < DEADLINE.total_seconds() / 2  # the wait's deadline, not the group's (60 s)
    if kind == "collective":  # (rank 1 takes its part, or closing the groups would wait for it; a timed-out receive
        pair[1].allreduce([torch.zeros(1)]).wait()  # is over, its pair closed)


def test_a_relayed_future_carries_the_result_or_the_alarm(pair):
    """What a DDP comm hook returns: DDP waits for it in C++, where only completing the future ends the wait."""
    alarm = Alarm()
    done: torch.futures.Future = torch.futures.Future()
    relayed = alarm.relay(done, 5)
    done.set_result(torch.ones(2))
    assert relayed.wait().tolist() == [1.0, 1.0]

    never: torch.futures.Future = torch.futures.Future()
    relayed = alarm.relay(never, 5)
    ring_later(alarm, 5).join()
    with pytest.raises(RuntimeError, match="peer 2 is lost"):
        relayed.wait()
    never.set_result(torch.ones(2))  # the collective finishing after the alarm changes nothing
    with pytest.raises(RuntimeError, match="peer 2 is lost"):
        relayed.wait()
    with pytest.raises(RuntimeError, match="peer 2 is lost"):  # relayed after the ring: failed at once
        alarm.relay(torch.futures.Future(), 5).wait()
