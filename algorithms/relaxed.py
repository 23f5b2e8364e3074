"""Relaxed synchronization: evict straggler processes from the group and train on with the rest.

After Fujitsu's CAC library (``cac.relaxed_sync.RelaxedSyncDistributedDataParallel``; no paper). In synchronous
data parallelism every rank waits at each allreduce for the slowest one, so one slow process (a throttled GPU,
a busy host) sets the pace of all. Relaxed sync measures each rank's *own* time per step (data, forward and
backward up to its last gradient bucket, not the step's wall time, which is the same everywhere because all
wait for the slowest), shares the times at each check, and evicts the ranks slower than ``threshold`` times a
reference (median; the minimum when two ranks remain). Eviction itself is the membership service's
(``distributed/membership.py``): the ranks agree on the verdict through the c10d store, the survivors form a new
process group and continue with identical parameters, the evicted ones exit 0. Once the group has shrunk below
``relaxed_sync_mode_threshold`` of its initial size, this policy asks the trainer to reshard the training data
over the survivors and rescale the learning rate; above it, as in CAC, the evicted ranks' shards are simply not
trained on.

What is measured is ``measure``. ``compute`` (CAC's) sees slow processes but not slow links: a rank whose
network link is slow computes as fast as the others, and every rank waits alike in the allreduce. ``link``
times a pairwise exchange of ``link_probe_bytes`` with every other active rank at each check
(``Communicator.probe_links``) and takes the *fastest* of a rank's exchanges: a transfer crosses both ends'
links, so only a rank whose own link is slow is slow with every peer. Attributing a slow link needs three ranks
or more (with two, both see the same one exchange).

``RelaxedSync`` is ``sync=relaxed`` (a :class:`~algorithms.base.Wrapper` around the exchange ``inner``);
``compat/cac.py`` is the CAC-compatible API on the same :class:`Eviction` rule.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from algorithms.base import RebuildTrainLoader, Request, ScaleLR, StepResult, SyncAlgorithm, SyncReport, Wrapper
from distributed.comm import Communicator
from distributed.membership import Change
from errors import is_int, is_number, require

REFERENCES = ("median", "mean", "min")
LR_POLICIES = ("linear", "sqrt", "none")
MEASURES = ("compute", "link")
EVICTED = "slow"  # the cause of a membership change made by an eviction


@dataclass
class Verdict:
    """The outcome of one check; its ``evicted`` ranks are what the ranks agreed on."""

    check: int
    ranks: list[int]  # the active ranks that were measured
    times: list[float]  # their measured times (own compute per step, or link probe), seconds, in ``ranks`` order
    reference: float  # the reference time the threshold multiplies, seconds
    evicted: list[int]

    @property
    def survivors(self) -> list[int]:
        return [r for r in self.ranks if r not in self.evicted]


def reference_time(times: list[float], reference: str) -> float:
    """CAC's reference: the median, but the minimum when only two ranks remain (a median of two is their mean,
    and a rank 3x slower than its peer is only 1.5x that mean)."""
    if reference == "min" or len(times) <= 2:
        return min(times)
    if reference == "mean":
        return statistics.fmean(times)
    return statistics.median(times)


def decide(
    ranks: list[int],
    times: list[float],
    threshold: float,
    reference: str,
    min_num_processes: int,
    protected: tuple[int, ...] = (),
    check: int = 0,
) -> Verdict:
    """Evict ranks slower than ``threshold`` x the reference, slowest first, never below ``min_num_processes``."""
    ref = reference_time(times, reference)
    evicted: list[int] = []
    if threshold >= 0:
        slow = sorted(
            ((t, r) for r, t in zip(ranks, times) if t > threshold * ref and r not in protected), reverse=True
        )
        budget = max(0, len(ranks) - min_num_processes)
        evicted = sorted(r for _, r in slow[:budget])
    return Verdict(check=check, ranks=list(ranks), times=list(times), reference=ref, evicted=evicted)


class Eviction:
    """The rule and its check, shared by ``sync=relaxed`` and the CAC drop-in."""

    def __init__(
        self, threshold: float, reference: str = "median", min_num_processes: int = 1, protected: tuple[int, ...] = ()
    ):
        self.threshold, self.reference = threshold, reference
        self.min_num_processes, self.protected = min_num_processes, protected
        self.num_checks = 0

    def check(self, comm: Communicator, own_time: float, what: str, when: str, min_num_processes: int | None = None):
        """Collective over the active ranks, each with its own measured time: share the times, decide, and have
        the membership remove the slow ranks (on those, this raises ``LeftRun``). Returns the verdict."""
        m = comm.membership
        own = torch.tensor([own_time], dtype=torch.float64, device=comm.device)
        times = comm.all_gather(comm.within_node(own, dist.ReduceOp.MAX))  # (node scope: a node is its slowest)
        verdict = decide(
            m.ranks,
            [float(t.item()) for t in times],
            self.threshold,
            self.reference,
            self.min_num_processes if min_num_processes is None else min_num_processes,
            self.protected,
            check=self.num_checks,
        )
        self.num_checks += 1
        reasons = {
            r: f"evicted {when} ({what} {t * 1e3:.1f} ms > {self.threshold:g} x reference "
            f"{verdict.reference * 1e3:.1f} ms)"
            for r, t in zip(verdict.ranks, verdict.times)
        }
        change = m.remove(verdict.evicted, cause=EVICTED, reasons=reasons)  # every rank takes part, even if none
        verdict.evicted = change.removed if change else []
        return verdict


class RelaxedSync(Wrapper):
    """``sync=relaxed``: evict stragglers at each check; the exchange among survivors is ``inner``."""

    name = "relaxed"
    # Its own shared state, the evictions so far, grows at an eviction, which may come in any step: a process that
    # joins takes it (and so the inner algorithm's) before its first forward, whatever the inner algorithm's flag.
    late_shared_state = False  # type: ignore[assignment]

    def __init__(
        self,
        inner: SyncAlgorithm,
        relaxed_sync_threshold: float = 3.0,
        relaxed_sync_mode_threshold: float = 0.8,
        min_num_processes: int = 1,
        reference: str = "median",
        check_every: str | int = "epoch",
        lr_policy: str = "linear",
        protect_rank0: bool = False,
        measure: str = "compute",
        link_probe_bytes: int = 1 << 20,
    ):
        super().__init__(inner)
        self.eviction = Eviction(relaxed_sync_threshold, reference, min_num_processes, (0,) if protect_rank0 else ())
        self.threshold = relaxed_sync_threshold
        self.mode_threshold = relaxed_sync_mode_threshold
        self.check_every, self.lr_policy = check_every, lr_policy
        self.measure, self.link_probe_bytes = measure, link_probe_bytes
        self.evictions: list[dict[str, Any]] = []
        self._times: list[float] = []  # this rank's own time of each step since the last check

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        t = section["relaxed_sync_threshold"]
        require(
            is_number(t) and not 0 <= t <= 1,
            "sync.relaxed_sync_threshold",
            t,
            "a factor > 1 (in [0, 1] healthy ranks would be evicted), or < 0 to disable",
        )
        m = section["relaxed_sync_mode_threshold"]
        require(is_number(m) and 0 < m <= 1, "sync.relaxed_sync_mode_threshold", m, "a fraction in (0, 1]")
        n = section["min_num_processes"]
        require(
            is_int(n) and 1 <= n <= world_size,
            "sync.min_num_processes",
            n,
            f"an integer in [1, {world_size}] (the world size)",
        )
        for key, allowed in (("reference", REFERENCES), ("lr_policy", LR_POLICIES), ("measure", MEASURES)):
            require(section[key] in allowed, f"sync.{key}", section[key], f"one of {', '.join(allowed)}")
        require(
            section["measure"] != "link" or world_size >= 3,
            "sync.measure",
            "link",
            f"compute with {world_size} processes (a slow link needs 3 or more to be told)",
        )
        b = section["link_probe_bytes"]
        require(is_int(b) and b >= 1, "sync.link_probe_bytes", b, "an integer number of bytes >= 1")
        c = section["check_every"]
        require(c == "epoch" or (is_int(c) and c >= 1), "sync.check_every", c, "epoch, or a number of steps >= 1")
        super().validate(section, cfg, world_size)

    # ---- hooks -----------------------------------------------------------------------------------------------
    def on_epoch_start(self, epoch: int) -> SyncReport:
        report = super().on_epoch_start(epoch)
        if self.check_every == "epoch" and self._times:
            report += self._check(f"at epoch {epoch}")
        return report

    def before_step(self, step: int) -> SyncReport:
        report = super().before_step(step)
        if self.check_every != "epoch" and step > 0 and step % self.check_every == 0 and self._times:
            report += self._check(f"at step {step}")
        return report

    def after_optimizer_step(self, result: StepResult) -> SyncReport:
        self._times.append(result.data_s + result.compute_s)
        return super().after_optimizer_step(result)

    def on_membership_change(self, change: Change) -> SyncReport:
        """After an eviction, as CAC: below ``relaxed_sync_mode_threshold`` of the initial ranks, reshard the
        training data and rescale the LR by ``lr_policy``. After a rank is lost (``trainer.on_failure=continue``),
        always: the lost rank's shard must be covered."""
        super().on_membership_change(change)  # the exchange rebinds to the new group; its answer is replaced
        m = self.ctx.membership
        fraction = m.size / m.initial_size
        if change.cause == EVICTED and fraction >= self.mode_threshold:
            return SyncReport()
        requests: list[Request] = [RebuildTrainLoader()]
        if self.lr_policy != "none":
            scale = fraction if self.lr_policy == "linear" else math.sqrt(fraction)
            requests.append(ScaleLR(scale, self.lr_policy))
        return SyncReport(requests=requests)

    def state_dict(self) -> dict[str, Any]:
        # A resumed job starts with all its processes again; only the history is kept.
        return {**super().state_dict(), "evictions": self.evictions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.evictions = list(state.get("evictions", []))

    # ---- the check -------------------------------------------------------------------------------------------
    def check_now(self, own_time: float, when: str) -> SyncReport:
        """The check, at once, with ``own_time`` as this rank's time (``measure=link`` probes the links anew).
        Collective: every active rank calls it at the same step."""
        self._times = [own_time]
        return self._check(when)

    def _check(self, when: str) -> SyncReport:
        m, comm = self.ctx.membership, self.ctx.comm
        self.inner.drain()  # nothing of the exchange may be in flight if the group changes
        own = statistics.fmean(self._times)
        self._times = []
        if self.measure == "link":
            if m.size < 3:
                return SyncReport()  # two ranks time the same one exchange: which end is slow cannot be told
            own = comm.probe_links(self.link_probe_bytes)
        what = "own compute" if self.measure == "compute" else "link probe"
        verdict = self.eviction.check(comm, own, what, when)  # raises LeftRun on an evicted rank
        times = {str(r): t for r, t in zip(verdict.ranks, verdict.times)}
        check = {
            "event": "relaxed_check",
            "measure": self.measure,
            "times": times,
            "reference": verdict.reference,
            "evicted": verdict.evicted,
            "check": verdict.check,
        }
        if not verdict.evicted:
            return SyncReport(events=[check])
        evict = {
            "event": "evict",
            "ranks": verdict.evicted,
            "hosts": {str(r): m.hosts[r] for r in verdict.evicted},
            "times": times,
            "reference": verdict.reference,
            "threshold": self.threshold,
            "world_size": m.processes,  # (processes: at node scope m.size counts nodes)
            "check": verdict.check,
            "measure": self.measure,
        }
        self.evictions.append(dict(evict))
        evict["message"] = (
            f"relaxsync: evicted rank(s) {verdict.evicted} {when} by {what} "
            f"({', '.join(f'{times[str(r)] * 1e3:.1f}' for r in verdict.evicted if str(r) in times)} ms vs reference "
            f"{verdict.reference * 1e3:.1f} ms, threshold {self.threshold:g}x); world size now {m.processes}"
        )
        return SyncReport(events=[check, evict])  # what follows is on_membership_change's to say
