"""The worker script of a chaos run (``tests/_chaos.py``): ``train.py`` as torchrun starts it, with a fault planted
in the worker of a victim node. The plan comes from ``$CHAOS_PLAN`` (JSON; set on the victims' nodes only):

- ``fault``: ``kill`` (the node goes: its torchrun agent, this worker and, at ``member_pid``, its etcd member,
  ``SIGKILL``), ``hang`` (this worker stops itself with ``SIGSTOP``; the harness continues it once the others have
  given it up) or ``alarm`` (a spurious alarm, with no one gone: this worker rings its own membership's alarm, as a
  collective that failed on its own, or an alarm passed on by mistake, would; in a recovery, the next generation's);
- ``phase``: where the fault lands, one of :data:`PHASES`; ``step``: not before this step; ``delay_ms``: how long
  after the phase's start (a moment inside it); ``nth``: which collective of the step (phase ``exchange``);
- ``report``: a file that gets, when the fault fires, where this worker was (its rank, step, and the part of the loop
  it was in) and its pid.

A timer that fires after the part it was armed in has ended does not fire elsewhere: it is armed again at the
next occurrence of the phase with half the delay, and at its start after :data:`TRIES` tries, so every fault lands
in its phase. Without ``$CHAOS_PLAN`` this is ``train.py``."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Where a fault can land: the label this worker is in when it fires. "in flight" is a step with an exchange of an
# earlier step still in flight; "recovery" and "loader rebuild" follow another node's loss.
PHASES = ("step", "exchange", "in flight", "epoch boundary", "evaluation", "checkpoint", "loader rebuild", "recovery")
TRIES = 4
PARTS = ("step", "exchange", "evaluation", "checkpoint", "epoch boundary")  # the loop's parts, as labelled here


class Injector:
    def __init__(self, plan: dict):
        self.plan = plan
        self.fault, self.phase = plan["fault"], plan["phase"]
        self.delay_s = plan.get("delay_ms", 0.0) / 1000
        self.tries, self.by = 0, ""
        self.fired = False
        self.where: list[str] = []  # the parts of the loop this worker is in, innermost last
        self.rounds = lambda: 0  # rounds a syncer thread runs for the algorithm, in flight (set once it is known)
        self.step = -1
        self.membership = None  # (the worker's, once the loop runs: what an alarm rings)
        self.nth = plan.get("nth", 0)  # phase exchange: the collective of the step it lands in, from 0
        self.collectives = 0  # issued in the current step
        self.in_flight: weakref.WeakSet = weakref.WeakSet()  # Pending exchanges issued and not yet waited for
        self._lock = threading.Lock()
        self._armed: tuple | None = None  # (token, label, depth) of the part a timer was armed in

    # ---- where this worker is ----------------------------------------------------------------------------------
    def enter(self, label: str) -> None:
        self.where.append(label)

    def leave(self, label: str) -> None:
        if self.where and self.where[-1] == label:
            self.where.pop()
        with self._lock:
            if self._armed is not None and self._armed[1] == label and self._armed[2] == len(self.where) + 1:
                self._armed = None  # the part ended before the timer fired: try again at the next one

    # ---- firing -------------------------------------------------------------------------------------------------
    def due(self) -> bool:
        return not self.fired and self.step >= self.plan.get("step", 0) and self._armed is None

    def arm(self, label: str, tries: int = TRIES, by: str = "part") -> None:
        """Fire ``delay`` after now if this worker is still in ``label`` (at the same depth) then; at once after
        ``tries`` timers that came too late. ``by``: what armed it (the part's start, or a collective in it)."""
        delay = self.delay_s / 2**self.tries if self.tries < tries else 0.0
        self.tries, self.by = self.tries + 1, by
        if delay <= 0:
            self.fire()
            return
        token = (object(), label, len(self.where))
        with self._lock:
            self._armed = token

        def later() -> None:
            time.sleep(delay)
            with self._lock:  # (held while it fires: the part cannot end in between)
                if self._armed is token:
                    self.fire()

        threading.Thread(target=later, daemon=True).start()

    def fire(self) -> None:
        if self.fired:
            return
        self.fired = True
        report = {
            "rank": int(os.environ["RANK"]),
            "pid": os.getpid(),
            "fault": self.fault,
            "phase": self.phase,
            "step": self.step,
            "where": list(self.where),
            "in_flight": len(self.in_flight) + self.rounds(),
            "by": self.by,
            "time": time.time(),
        }
        path = Path(self.plan["report"])
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(report, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if self.fault == "alarm":
            m = self.membership
            generation = m.generation if m.alarm.rung(m.generation) is None else m.generation + 1  # (in a recovery)
            m.ring(generation, f"chaos: a spurious alarm (failure {generation}), no one is gone")
        elif self.fault == "kill":
            if self.plan.get("member_pid"):  # (the run's store on etcd: the node's member goes with it)
                os.kill(self.plan["member_pid"], signal.SIGKILL)
            os.kill(os.getppid(), signal.SIGKILL)  # the node goes: its agent, then this worker
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            os.kill(os.getpid(), signal.SIGSTOP)


def _rounds(host) -> int:
    """Rounds a syncer thread runs for the algorithm (sync=decoupled, or one wrapped), posted and not yet applied:
    exchanges in flight that no ``Pending`` stands for."""
    sync = getattr(host, "sync", None)
    while sync is not None and not hasattr(sync, "rounds_in_flight"):
        sync = getattr(sync, "inner", None)
    return sync.rounds_in_flight if sync is not None else 0


def install(plan: dict) -> Injector:
    """Wrap the parts of the engine the plan's phase needs, to know where this worker is and to fire there."""
    import torch.distributed as dist

    from data.common import Loaders
    from distributed import comm
    from engine import checkpoint
    from engine.elastic import guard
    from engine.elastic.failures import Failures
    from engine.elastic.positions import Phase

    chaos = Injector(plan)
    phase = chaos.phase
    labels = {
        Phase.STEP: "step",
        Phase.EXCHANGE: "exchange",
        Phase.EVALUATION: "evaluation",
        Phase.CHECKPOINT: "checkpoint",
        Phase.EPOCH_START: "epoch boundary",
    }

    run = guard.SurvivingGuard.run

    def guarded(self, part_phase, part, epoch, site=guard.Site.NONE, carry=None):
        label = labels.get(part_phase, part_phase.value)
        if site is guard.Site.EPOCH_END:
            label = "epoch boundary"  # the epoch's evaluation and checkpoint, then the next one's start
        chaos.step, chaos.membership = self.host.run.step, self.failures.membership
        chaos.rounds = lambda: _rounds(self.host)
        if part_phase is Phase.STEP:
            if 0 < chaos.collectives <= chaos.nth:  # fewer collectives in a step than planned: the last one
                chaos.nth = chaos.collectives - 1
            chaos.collectives = 0
        chaos.enter(label)
        try:
            if chaos.due() and label == phase:
                if phase in ("step", "checkpoint", "evaluation"):
                    chaos.arm(label)  # (an evaluation on the side, a step checkpoint: the epoch's are its boundary)
                elif phase == "epoch boundary":
                    chaos.arm(label, tries=1)  # (its parts are short: at the start of the next one)
            elif chaos.due() and phase == "in flight" and label == "step" and (chaos.in_flight or _rounds(self.host)):
                chaos.arm(label)
            return run(self, part_phase, part, epoch, site, carry)
        finally:
            chaos.leave(label)

    guard.SurvivingGuard.run = guarded

    def collective(name: str):
        original = getattr(dist, name)

        def issue(*args, **kwargs):
            # A training exchange: the step's or the exchange after it; with ``anywhere``, in any part of the loop
            # (sync=none exchanges only to average the replicas for an evaluation or a checkpoint).
            parts = PARTS if plan.get("anywhere") else ("step", "exchange")
            if phase == "exchange" and chaos.due() and chaos.where[-1:] and chaos.where[-1] in parts:
                chaos.collectives += 1
                if chaos.collectives > chaos.nth:
                    work = original(*args, **kwargs)
                    chaos.arm(chaos.where[-1], by="collective")  # after it was issued, while the peers take part
                    return work
            return original(*args, **kwargs)

        setattr(dist, name, issue)

    for name in ("all_reduce", "all_gather", "batch_isend_irecv", "broadcast", "barrier"):
        collective(name)

    pending_init, pending_wait = comm.Pending.__init__, comm.Pending.wait

    def issued(self, *args, **kwargs):
        pending_init(self, *args, **kwargs)
        chaos.in_flight.add(self)

    def waited(self):
        chaos.in_flight.discard(self)
        return pending_wait(self)

    comm.Pending.__init__, comm.Pending.wait = issued, waited

    write_atomic = checkpoint.write_atomic

    def writing(path, write, keep_previous=False):
        def write_slowly(f):
            write(f)
            if chaos.where[-1:] == ["checkpoint"] and phase == "checkpoint" and not chaos.fired:
                chaos.where.append("checkpoint write")
                try:
                    chaos.fire()  # written to the temporary file, not yet renamed
                finally:
                    chaos.where.pop()

        return write_atomic(path, write_slowly, keep_previous)

    checkpoint.write_atomic = writing

    recover = Failures.recover

    def recovering(self, error, at):
        chaos.enter("recovery")
        try:
            if phase == "recovery" and not chaos.fired:
                chaos.arm("recovery")
            recovery = recover(self, error, at)
            if phase == "recovery" and not chaos.fired:
                chaos.fire()  # the agreement ended before the moment: at its end, before the regrouped part
            return recovery
        finally:
            chaos.leave("recovery")

    Failures.recover = recovering

    build = Loaders.build

    def rebuilding(self, num_replicas, rank, train=True):
        chaos.enter("loader rebuild")
        try:
            shrunk = num_replicas < int(os.environ["WORLD_SIZE"])
            if phase == "loader rebuild" and not chaos.fired and shrunk and train == plan.get("train", False):
                chaos.fire()
            return build(self, num_replicas, rank, train)
        finally:
            chaos.leave("loader rebuild")

    Loaders.build = rebuilding
    return chaos


if __name__ == "__main__":
    if os.environ.get("CHAOS_PLAN"):
        install(json.loads(os.environ["CHAOS_PLAN"]))
    import train

    train.worker_main(sys.argv[1:])
