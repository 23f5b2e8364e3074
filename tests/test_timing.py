"""Device-true timing (``distributed/clock.py``): on a GPU, compute and communication are read from events on the GPU,
not from the CPU's clock (which there sees launch times). Checked on a CPU with fake device clocks and fake NCCL works:
what the Communicator counts as a step's communication (each collective's own time on the device, read once it
completed, a step later at the latest; a replaced group's dropped), and, end to end, relaxed sync evicting a rank that
is slow on its device and not on its CPU (``straggler=device``, whose sleep on a CPU is simulated on the device clock,
so the slowed rank is slow *only* in what the clock measures)."""

from __future__ import annotations

import os
import statistics

import pytest
from conftest import records, train

from distributed.clock import Clock, device_seconds
from distributed.comm import Communicator, Pending
from distributed.membership import Membership


class FakeEvent:
    """A CUDA event on a device timeline the test moves by hand: ``query()`` is whether the device reached it."""

    def __init__(self, at: float, device: FakeDevice):
        self.at, self.device = at, device

    def query(self) -> bool:
        return self.device.now >= self.at

    def elapsed_time(self, end: FakeEvent) -> float:  # milliseconds, as torch.cuda.Event's
        return (end.at - self.at) * 1e3


class FakeDevice(Clock):
    """A device clock whose marks are :class:`FakeEvent`; the device's time runs only when the test says."""

    on_device = True

    def __init__(self):
        super().__init__()
        self.now, self.queued = 0.0, 0.0  # what the device has run; where the stream's next mark lands

    def mark(self) -> FakeEvent:
        return FakeEvent(self.queued, self)

    def seconds(self, start: FakeEvent, end: FakeEvent) -> float:
        assert end.query(), "read before the device reached the mark"
        return start.elapsed_time(end) / 1e3


class FakeWork:
    """An NCCL work with timing on: its duration (ms) is known once it completed."""

    def __init__(self, ms: float, done: bool = False):
        self.ms, self.done = ms, done

    def is_completed(self) -> bool:
        return self.done

    def _get_duration(self) -> float:
        if not self.done:
            raise RuntimeError("getDuration can only be called after work is succeeded.")
        return self.ms


def test_a_device_sleep_on_the_cpu_clock_lengthens_later_spans_only():
    clock = Clock()
    before = clock.mark()
    clock.sleep_on_device(5.0)  # simulated: returns at once
    after = clock.mark()
    assert 5.0 <= clock.seconds(before, after) < 6.0
    assert clock.seconds(after, clock.mark()) < 1.0  # the sleep is not counted again


def test_on_a_device_each_collective_counts_its_own_time_there_once_it_completed():
    comm = Communicator(Membership(0, 2), FakeDevice())
    first, second = FakeWork(30.0, done=True), FakeWork(20.0)
    comm.time_on_device([first, second])
    assert comm.take().comm_s == pytest.approx(0.030)  # the second has not completed: not read, nor waited for
    second.done = True
    assert comm.take().comm_s == pytest.approx(0.020)  # read in the next step
    assert comm.take().comm_s == 0.0  # and once only
    assert comm.totals.comm_s == pytest.approx(0.050)


def test_collectives_waiting_to_be_read_stay_few_where_nothing_takes_the_counts():
    """The CAC drop-in never takes a step's counts: completed collectives are read (and let go) as they pile up."""
    comm = Communicator(Membership(0, 2), FakeDevice())
    for _ in range(3000):
        comm.time_on_device([FakeWork(1.0, done=True)])
    assert len(comm._on_device) <= 1025 and comm.totals.comm_s > 2.0


def test_off_a_device_no_collective_waits_to_be_read():
    comm = Communicator(Membership(0, 2))  # the CPU's clock: gloo's works have no device time
    comm.time_on_device([FakeWork(5.0, done=True)])
    assert comm._on_device == [] and comm.take().comm_s == 0.0


def test_a_collective_of_a_replaced_group_is_dropped_with_it():
    membership = Membership(0, 2)
    comm = Communicator(membership, FakeDevice())
    lost = FakeWork(1000.0)  # never completes: its group lost a peer
    comm.time_on_device([lost])
    assert comm.take().comm_s == 0.0
    membership.generation += 1  # the survivors' new group
    lost.done = True
    assert comm.take().comm_s == 0.0 and comm.take().comm_s == 0.0


def test_a_completed_collective_without_device_time_is_let_go():
    """A gloo group's work on a GPU run, or NCCL with its timing turned off: done, with no time on the device."""

    class Untimed(FakeWork):
        def _get_duration(self):
            raise RuntimeError("Enable timing first")

    comm = Communicator(Membership(0, 2), FakeDevice())
    comm.time_on_device([Untimed(0.0, done=True), FakeWork(10.0, done=True)])
    assert comm.take().comm_s == pytest.approx(0.010) and comm._on_device == []


def test_a_span_between_two_device_marks_is_read_when_the_device_passed_its_end():
    device = FakeDevice()
    comm = Communicator(Membership(0, 2), device)
    start = device.mark()
    device.queued = 0.25  # the exchange queued a quarter second of device time
    comm.time_span(start, device.mark())
    assert comm.take().comm_s == 0.0  # the device is still behind
    device.now = 1.0
    assert comm.take().comm_s == pytest.approx(0.25)


def test_on_a_device_the_cpus_blocked_wait_is_not_counted_again(monkeypatch):
    """NCCL's wait is a stream wait (or, under a deadline, a CPU poll): the collective's time is its own, once."""
    membership = Membership(0, 2)
    monkeypatch.setattr(membership, "wait", lambda works: None)
    comm = Communicator(membership, FakeDevice())
    work = FakeWork(40.0, done=True)
    comm.time_on_device([work])
    Pending(comm, [work], "result").wait()
    assert comm.take().comm_s == pytest.approx(0.040)
    cpu = Communicator(membership)  # on the CPU the blocked time is the measure, and there is no device time
    Pending(cpu, [work], "result").wait()
    assert 0.0 <= cpu.take().comm_s < 0.040


def test_device_seconds_reads_only_a_completed_timed_collective():
    assert device_seconds(FakeWork(12.5, done=True)) == pytest.approx(0.0125)
    assert device_seconds(FakeWork(12.5)) is None

    class GlooWork:  # no device events: torch raises
        def is_completed(self):
            return True

        def _get_duration(self):
            raise RuntimeError("not supported")

    assert device_seconds(GlooWork()) is None


def test_relaxed_sync_evicts_a_rank_slow_on_its_device_and_not_on_its_cpu(tmp_path):
    """``straggler=device`` slows rank 2's device 5x from epoch 2; its CPU runs at full speed, so nobody waits for it
    (on a CPU the device sleep exists only on the device clock). Relaxed sync's measure, read from that clock, evicts
    it at the first check after (step 21: steps 14-20, the first of epoch 2, all slowed); the CPU's step time did not
    move."""
    summary, metrics = train(
        tmp_path,
        "sync=relaxed", "sync.relaxed_sync_threshold=2.0", "sync.check_every=7", "straggler=device",
        "straggler.start_epoch=2", "straggler.slowdown=5.0", "model=test_resnet", "data=digits", "logger=none",
        "trainer.progress=false", "trainer.nproc=3", "trainer.epochs=2", "trainer.checkpoint_every=0",
    )  # fmt: skip
    (evict,) = [r for r in records(metrics, "event") if r["event"] == "evict"]
    assert evict["ranks"] == [2] and evict["step"] == 21 and evict["measure"] == "compute"
    assert evict["times"]["2"] > 2.0 * evict["reference"]
    steps = records(metrics, "train")
    normal = statistics.median(r["step_s"] for r in steps if r["epoch"] == 1)
    slowed = statistics.median(r["step_s"] for r in steps if 14 <= r["step"] < 21)
    # A sleep on the CPU (straggler=sleep) would hold everyone at the allreduce: >= 5x the normal step.
    assert slowed < 2.5 * normal, (slowed, normal)
    assert summary["ranks"] == [0, 1] and summary["replica_spread"] == 0.0


def test_an_nccl_world_asks_for_each_collectives_device_time(monkeypatch):
    import torch.distributed as dist

    from distributed import world

    monkeypatch.setenv(world.NCCL_TIMING, "unset")  # (recorded as it was, restored after)
    monkeypatch.delenv(world.NCCL_TIMING)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: None)
    world.init_distributed("gloo", 60.0)
    assert world.NCCL_TIMING not in os.environ  # (gloo has no device events)
    world.init_distributed("nccl", 60.0)
    assert os.environ[world.NCCL_TIMING] == "1"
