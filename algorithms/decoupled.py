"""``sync=decoupled``: streaming DiLoCo whose rounds close on a quorum, so that no learner waits for a slow one.

Decoupled DiLoCo (Douillard et al., arXiv 2604.21428) with Async Local-SGD's dynamic local updates (DyLU, arXiv
2401.09135). The schedule is streaming DiLoCo's (:mod:`algorithms.diloco`): round r syncs fragment r mod P; every
learner posts its pseudo-gradient for it after step t (every H/P steps) and applies the merged fragment after step
t + delay. What differs is who a round waits for:

- **The exchange runs off the training thread.** Each rank runs a *syncer* thread with a process group of its own
  (``Membership.subgroup``). A learner hands its pseudo-gradient to its syncer and goes on training. The syncers
  enter round r's collectives together once the round is *closed* (a key in the run's store), each sending what its
  learner posted by then, or nothing: a learner late for a round never holds the others up, as its syncer does not
  wait for it.
- **A round closes** when every learner has posted, or when a learner is due to apply it (after step t + delay)
  and a quorum has posted (``quorum``: a share of the learners, or of the steps a round holds with
  ``quorum_by=samples``); that learner then waits for the rest at most a grace window sized from the waits that
  brought everyone in lately (never more than ``grace_steps`` of the learners' median step). Every learner applies
  round r after step t + delay, as streaming DiLoCo does, so it waits at most for the quorum and the network.
- **The merge** (:mod:`algorithms.quorum`) is the mean of the pseudo-gradients weighted by the steps each holds
  (every rank's batch is the same size: a step is its samples), each contribution discounted by ``late_decay`` per
  round it missed; a learner whose pseudo-gradient missed the round keeps its progress (its fragment moves by the
  global step) and brings it to the next round of that fragment.
  Every header travels with the round, so the merge is computed alike on every rank: the global fragments stay
  bit-identical, and with everyone on time the mode is streaming DiLoCo, step for step.
- **Catching up** (``catch_up``, DyLU as a rule of time): a learner whose median step is more than 25 % longer than
  the learners' median step skips a step's compute (its batch is dropped) whenever it is a whole step behind, so a
  learner k times slower computes one step in k and stays within a step of the others: it is never evicted and its
  work counts, each step it computed as any other learner's.

Goodput (``goodput`` in the records): the steps that entered the merged model over the steps computed up to each
fragment's latest round (those since are in no round yet), from every learner's header. Below 1 by ``delay / H``
with everyone on time (a fragment's steps between a round's post and its apply are overwritten by the global
fragment, as in streaming DiLoCo), and by what a learner lost took with it. BN statistics are merged as the
pseudo-gradients are, with the last fragment's round.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from dataclasses import astuple, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from algorithms.base import SkipCompute, StepResult, SyncContext, SyncReport
from algorithms.compress import dequantize_int8, quantize_int8
from algorithms.diloco import DiLoCo, fragment_due
from algorithms.quorum import (
    QUORUM_BY,
    CatchUp,
    Grace,
    Header,
    Weights,
    carry,
    goodput,
    merge,
    quorum_of,
    weights,
)
from distributed.membership import DEFAULT_TIMEOUT, Change
from errors import is_number, require

MERGED = ("none", "fp16", "int8")  # (what a round's weighted merge decodes)
SLICE_S = 0.2  # (the learner waiting for a round's outcome looks at the alarm this often)
STOP = b"stop"  # (a round closed with this ends the syncer)


@dataclass
class Round:
    """Round ``index``'s outcome, handed by the syncer to the learner, which applies it after step ``due``."""

    index: int
    fragment: int
    generation: int  # of the group it ran on: one of a replaced group is dropped
    old: torch.Tensor | None = None  # the global fragment before its outer step, and after it
    new: torch.Tensor | None = None
    momentum: torch.Tensor | None = None  # the fragment's outer momentum after it
    buffers: torch.Tensor | None = None  # the merged BN statistics (the last fragment's round)
    contributed: bool = False  # this rank's pseudo-gradient was in it
    norm: float = 0.0  # the merged pseudo-gradient's
    headers: list[Header] = field(default_factory=list)
    error: BaseException | None = None


@dataclass
class InFlight:
    index: int
    fragment: int
    due: int  # the step after which it is applied


class DecoupledDiLoCo(DiLoCo):
    """``sync=decoupled``: streaming DiLoCo whose rounds close on a quorum (see the module docstring)."""

    name = "decoupled"
    late_shared_state = False  # (the outer state changes on the syncer's thread: a joiner takes it by transfer)

    def __init__(
        self,
        quorum: float = 0.5,
        quorum_by: str = "learners",
        late_decay: float = 0.5,
        grace_steps: float = 1.0,
        catch_up: bool = True,
        **diloco: Any,
    ):
        super().__init__(**diloco)
        self.quorum, self.quorum_by, self.late_decay = quorum, quorum_by, late_decay
        self.grace_steps, self.catch_up = grace_steps, catch_up
        self._syncer: Syncer | None = None  # (none before setup: a joiner's algorithm may be finalized unset)

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        super().validate(section, cfg, world_size)
        q = section["quantize"]
        require(q in MERGED, "sync.quantize", q, f"one of {', '.join(MERGED)} under sync=decoupled")
        q = section["quorum"]
        require(is_number(q) and 0 < q <= 1, "sync.quorum", q, "a share of the learners in (0, 1]")
        by = section["quorum_by"]
        require(by in QUORUM_BY, "sync.quorum_by", by, f"one of {', '.join(QUORUM_BY)}")
        d = section["late_decay"]
        require(is_number(d) and 0 < d <= 1, "sync.late_decay", d, "a factor in (0, 1] per round missed")
        g = section["grace_steps"]
        require(is_number(g) and g >= 0, "sync.grace_steps", g, "a number of median steps >= 0")
        c = section["catch_up"]
        require(isinstance(c, bool), "sync.catch_up", c, "true or false")

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: SyncContext) -> None:
        super().setup(model, optimizer, ctx)
        self._lock = threading.Lock()  # (what the learner posts and the syncer takes)
        self._posted: dict[int, tuple[torch.Tensor, Header, torch.Tensor | None]] = {}
        self._results: dict[int, Round] = {}
        self._arrived = threading.Condition(self._lock)
        self._rounds: deque[InFlight] = deque()
        self._held = [0] * self.fragments  # steps computed since the last contribution to each fragment
        self._missed = [0] * self.fragments  # rounds of each fragment closed without this learner since then
        self._computed = 0  # steps this learner computed in the run
        self._paces: deque[float] = deque(maxlen=16)  # its seconds per computed step, lately
        self._group_s = 0.0  # the learners' median step (from the last round's headers)
        self._entered = 0  # steps that entered the merged model (summed over fragments), all learners
        self._computed_at = [0] * self.fragments  # steps computed by all learners up to each fragment's last round
        self._computed_all = 0
        self._catch, self._grace = CatchUp(), Grace(self.grace_steps)
        self._skipping = False
        self._counted = -1  # the step last counted
        self._interval = self.inner_steps // self.fragments  # steps between rounds (round r after step (r+1)H/P - 1)
        floating = [b for b in model.buffers() if b.is_floating_point()]
        self._buffer_numel = sum(b.numel() for b in floating)
        self._buffer_dtype = floating[0].dtype if floating else torch.float32
        self._form_side_group()

    def _form_side_group(self) -> None:
        """Collective over the active ranks: the syncers' own group (replaced, and the syncer with it, at a change)."""
        m = self.ctx.membership
        self._side = m.subgroup(list(m.ranks)) if m.size > 1 else None
        self._generation = m.generation

    def _ensure_syncer(self, first_round: int) -> Syncer:
        """This rank's syncer, started with the first round it posts (after any resume or change: it takes the global
        parameters then); a learner alone runs its rounds on its own thread."""
        if self._syncer is None:
            alone = self._side is None
            self._syncer = Syncer(self, None if alone else self.ctx.membership.store.clone(), first_round)
            if not alone:
                self._syncer.start()
        return self._syncer

    # ---- a learner's step -----------------------------------------------------------------------------------
    def before_step(self, step: int) -> SyncReport:
        self._skipping = self.catch_up and self.ctx.comm.size > 1 and self._catch.skip(self._group_s)
        return SyncReport(requests=[SkipCompute()] if self._skipping else [])

    def after_optimizer_step(self, result: StepResult) -> SyncReport:
        step, metrics = result.step, {"skipped": float(self._skipping)}
        self._agreed = False
        if step != self._counted:  # (once a step: the exchange is run again after a change of the ranks)
            self._counted = step
            if result.computed:
                self._paces.append(result.data_s + result.compute_s)
                self._catch.computed(statistics.median(self._paces), self._group_s)
            else:
                self._catch.skipped(self._group_s)
            if result.computed and result.stepped:
                self._computed += 1
                self._held = [h + 1 for h in self._held]
        fragment = fragment_due(step, self.inner_steps, self.fragments)
        if fragment is not None:
            index = (step + 1) // self._interval - 1
            self._post(index, fragment)
            self._rounds.append(InFlight(index, fragment, step + self.delay))
            metrics["outer_fragment"] = fragment
        while self._rounds and self._rounds[0].due <= step:
            metrics.update(self._apply_round(self._rounds[0]))
            self._rounds.popleft()
        if self._computed_all:  # (steps computed since a fragment's last round are not yet due to enter it)
            metrics["goodput"] = goodput(self._entered, sum(self._computed_at))
        return SyncReport(metrics=metrics)

    def _post(self, index: int, fragment: int) -> None:
        """Hand this learner's pseudo-gradient for round ``index`` to its syncer and count it in the store."""
        lo, hi = self.ranges[fragment]
        delta = self.global_params[lo:hi] - self.read_range(lo, hi).float()
        pace = statistics.median(self._paces) if self._paces else 0.0
        header = Header(True, self._held[fragment], self._missed[fragment], pace, self._computed)
        buffers = self._buffers() if self._merges_buffers(fragment) else None
        syncer = self._ensure_syncer(index)
        self.ctx.comm.record(*self._traffic(fragment), 0.0)  # (counted as streaming DiLoCo counts it: when posted)
        if self._side is None:  # (alone: the round is its own)
            self._results[index] = syncer.exchange(index, (delta, header, buffers))
            syncer.next_round = index + 1
            return
        with self._lock:
            late = index < syncer.next_round  # (closed and taken without it: its progress stays in its fragment)
            if not late:
                self._posted[index] = (delta, header, buffers)
        if not late:
            syncer.count(index, header.samples)

    def _traffic(self, fragment: int) -> tuple[float, float]:
        """The modeled wire bytes and payload this rank's syncer sends in a round of ``fragment`` (whether or not its
        learner's pseudo-gradient is in it): the headers' allgather, the pseudo-gradients' allgather (int8) or
        allreduce, and the BN statistics' allreduce with the last fragment's."""
        learners = self.ctx.comm.size
        if learners < 2:
            return 0.0, 0.0
        ring = 2 * (learners - 1) / learners
        lo, hi = self.ranges[fragment]
        n, header = hi - lo, len(astuple(Header(False, 0, 0, 0.0, 0))) * 8
        sent, payload = (learners - 1) * header, header
        if self.quantize == "int8":
            packed = 8 * math.ceil(n / self.quant_block) + n
            sent, payload = sent + (learners - 1) * packed, payload + packed
        else:
            size = n * (2 if self.quantize == "fp16" else self.global_params.element_size())
            sent, payload = sent + ring * size, payload + size
        if self._merges_buffers(fragment) and self._buffer_numel:
            size = self._buffer_numel * torch.finfo(self._buffer_dtype).bits // 8
            sent, payload = sent + ring * size, payload + size
        return sent, payload

    def _merges_buffers(self, fragment: int) -> bool:
        return self.average_buffers and fragment == self.fragments - 1

    def _buffers(self) -> torch.Tensor | None:
        buffers = [b.data.reshape(-1) for b in self.model.buffers() if b.is_floating_point()]
        return torch.cat(buffers) if buffers else None

    def _apply_round(self, due: InFlight) -> dict[str, float]:
        """Wait for round ``due`` (closing it, after the grace window, where the quorum is in) and apply it."""
        syncer = self._ensure_syncer(due.index)
        start = time.perf_counter()
        outcome = syncer.outcome(due.index)
        self.ctx.comm.record(0.0, 0.0, time.perf_counter() - start)
        if outcome.error is not None:
            raise outcome.error
        if outcome.generation != self.ctx.membership.generation or outcome.new is None:
            return {}  # (dropped with its group, or no one's pseudo-gradient: no outer step)
        lo, hi = self.ranges[due.fragment]
        local = self.read_range(lo, hi)
        if outcome.contributed:
            mixed = local.mul_(self.alpha).add_(outcome.new, alpha=1.0 - self.alpha) if self.alpha else outcome.new
            self._held[due.fragment], self._missed[due.fragment] = 0, 0
        else:
            mixed = carry(local, outcome.old.to(local.dtype), outcome.new.to(local.dtype))
            self._missed[due.fragment] += 1
        self.write_range(lo, hi, mixed)
        self.global_params[lo:hi], self.momentum[lo:hi] = outcome.new, outcome.momentum
        if outcome.buffers is not None:
            self._set_buffers(outcome.buffers)
        headers = outcome.headers
        paces = [h.pace_s for h in headers if h.pace_s > 0]
        self._group_s = statistics.median(paces) if paces else 0.0
        self._entered += sum(h.samples for h in headers if h.contributes)
        self._computed_all = sum(h.computed for h in headers)
        self._computed_at[due.fragment] = self._computed_all
        self._agreed = self._whole and all(h.contributes for h in headers)  # (a learner that missed it kept its own)
        return {
            "round_contributors": float(sum(h.contributes for h in headers)),
            "pseudo_grad_norm": outcome.norm,
            # (the learners' steps computed over the steps they ran: below 1 where a learner behind skips to catch up)
            "computed_share": self._computed_all / max(len(headers) * (due.index + 1) * self._interval, 1),
        }

    def _set_buffers(self, merged: torch.Tensor) -> None:
        offset = 0
        for b in self.model.buffers():
            if b.is_floating_point():
                n = b.numel()
                b.data.copy_(merged[offset : offset + n].view_as(b))
                offset += n

    @property
    def rounds_in_flight(self) -> int:
        """Rounds this learner posted (or was due to) and has not applied yet."""
        return len(self._rounds)

    def agreement_at(self, steps: int) -> int:
        return steps  # (no averaging a joiner takes part in: it is admitted by transfer, and enters the next round)

    def guest_state(self, at: int, steps: int) -> dict[str, Any] | None:
        return None

    def drain(self) -> None:
        while self._rounds:
            self._apply_round(self._rounds[0])
            self._rounds.popleft()

    def on_membership_change(self, change: Change) -> SyncReport:
        """The rounds in flight are dropped (their group is replaced), the syncer with them; the survivors form the
        syncers' new group and go on from the global fragments they all applied."""
        self._stop_syncer()
        self._rounds.clear()
        with self._lock:
            self._posted.clear()
            self._results.clear()
        self._form_side_group()
        return super().on_membership_change(change)

    def finalize(self) -> None:
        self._stop_syncer()
        super().finalize()

    def _stop_syncer(self) -> None:
        if self._syncer is not None:
            self._syncer.stop()
            self._syncer = None

    # ---- state -----------------------------------------------------------------------------------------------
    def local_state_dict(self) -> dict[str, Any]:
        own = {"held": list(self._held), "missed": list(self._missed), "computed": self._computed}
        own |= {"entered": self._entered, "computed_at": list(self._computed_at)}  # (goodput's, alike on every rank)
        return {**super().local_state_dict(), "decoupled": own}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        super().load_local_state_dict(state)
        own = state.get("decoupled")
        if own is not None:
            self._held, self._missed, self._computed = list(own["held"]), list(own["missed"]), own["computed"]
            self._entered = own.get("entered", 0)
            self._computed_at = list(own.get("computed_at", [0] * self.fragments))


class Syncer(threading.Thread):
    """A rank's syncer: runs the rounds in order, each once the store says it closed, on the syncers' group."""

    def __init__(self, owner: DecoupledDiLoCo, store: dist.Store | None, first_round: int):
        super().__init__(name=f"relaxsync-syncer-{owner.ctx.membership.rank}", daemon=True)
        self.owner, self.store, self.next_round = owner, store, first_round
        self.learner_store = store.clone() if store is not None else None  # (the learner's waits: a connection apart)
        m = owner.ctx.membership
        self.generation, self.learners, self.group = owner._generation, m.size, owner._side
        self.needed = quorum_of(owner.quorum, self.learners)
        # The global parameters and outer momentum as the rounds complete (the learner's copies follow at each
        # round's due step: a learner behind may apply a round after the syncer ran the next, and a round dropped at
        # a change leaves them as they were).
        self.theta, self.momentum = owner.global_params.clone(), owner.momentum.clone()
        self._stopping = threading.Event()

    def key(self, index: int, name: str) -> str:
        return self.owner.ctx.membership.key(f"decoupled/{self.generation}/{index}/{name}")

    # ---- the learner's side ----------------------------------------------------------------------------------
    def count(self, index: int, samples: int) -> None:
        """This learner posted round ``index`` (``samples`` steps in it): the last one closes the round."""
        store, owner = self.learner_store, self.owner
        posted = store.add(self.key(index, "learners"), 1)
        held = store.add(self.key(index, "samples"), samples)
        expected = owner.quorum * self.learners * owner.inner_steps
        if posted >= self.needed if owner.quorum_by == "learners" else held >= expected:
            store.set(self.key(index, "quorum"), "1")
        if posted >= self.learners:
            store.set(self.key(index, "close"), "1")

    def outcome(self, index: int) -> Round:
        """Round ``index``'s outcome, for the learner due to apply it: where the round is open, it waits for the
        quorum, then for the rest within the grace window, and closes it."""
        owner = self.owner
        with owner._lock:
            done = owner._results.pop(index, None)
        if done is not None:
            return done
        store = self.learner_store
        if self.group is not None and not self._closed(index):
            self._wait_key(index, "quorum", None)
            start = time.perf_counter()
            if self._wait_key(index, "close", owner._grace.window(owner._group_s)):
                if store.add(self.key(index, "learners"), 0) >= self.learners:  # (everyone came within the window)
                    owner._grace.saw(time.perf_counter() - start)
            store.set(self.key(index, "close"), "1")
        with owner._arrived:
            while index not in owner._results:
                owner.ctx.membership.alarm.check(self.generation)
                owner._arrived.wait(SLICE_S)
            return owner._results.pop(index)

    def _closed(self, index: int) -> bool:
        return self.learner_store.check([self.key(index, "close")])

    def _wait_key(self, index: int, name: str, within: float | None) -> bool:
        """Wait on the learner's thread for key ``name`` of round ``index``, at most ``within`` seconds (None: until
        it comes, the alarm rings or the membership's deadline passes); whether it came. It looks every millisecond
        or few (a grace window is a step at most), so that a loss seen elsewhere ends the wait."""
        m, key = self.owner.ctx.membership, self.key(index, name)
        timeout = m.timeout or DEFAULT_TIMEOUT
        deadline = time.perf_counter() + (within if within is not None else timeout.total_seconds())
        pause = 0.0005
        while not self.learner_store.check([key]):
            m.alarm.check(self.generation)
            left = deadline - time.perf_counter()
            if left <= 0:
                if within is None:
                    raise TimeoutError(f"round {index} of sync=decoupled: no quorum within {timeout}")
                return False
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.01)
        return True

    # ---- the syncer's thread -----------------------------------------------------------------------------------
    def stop(self) -> None:
        """End the thread: the round it waits for is closed as ``stop`` (every rank stops its syncer alike: at the
        end of the run, after every round was applied, or at a change, which replaces the group)."""
        self._stopping.set()
        if self.store is not None:
            with self.owner._lock:
                index = self.next_round
            self.learner_store.set(self.key(index, "close"), STOP)
        self.join(timeout=10.0)

    def run(self) -> None:
        owner = self.owner
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while not self._stopping.is_set():
            index = self.next_round
            try:
                self.store.wait([self.key(index, "close")])  # (a blocking wait: stop() closes it too)
                stopped = self.store.get(self.key(index, "close")) == STOP
            except BaseException as error:  # noqa: BLE001 - the learner raises it where it applies the round
                stopped, failed = False, error
            else:
                failed = None
            if stopped or self._stopping.is_set():
                return
            with owner._lock:
                posted = owner._posted.pop(index, None)
                self.next_round = index + 1
            try:
                if failed is not None:
                    raise failed
                outcome = self.exchange(index, posted)
            except BaseException as error:  # noqa: BLE001 - the learner raises it where it applies the round
                outcome = Round(index, index % owner.fragments, self.generation, error=error)
            with owner._arrived:
                owner._results[index] = outcome
                owner._arrived.notify_all()
            if outcome.error is not None:
                return

    def exchange(self, index: int, posted: tuple[torch.Tensor, Header, torch.Tensor | None] | None) -> Round:
        """Round ``index`` on the syncers' group: the headers, then the weighted pseudo-gradients (and BN statistics
        with the last fragment's), merged alike on every rank; the outer step on this syncer's global parameters."""
        owner = self.owner
        fragment = index % owner.fragments
        lo, hi = owner.ranges[fragment]
        if posted is None:
            delta, mine, buffers = None, Header(False, 0, 0, 0.0, owner._computed), None
        else:
            delta, mine, buffers = posted
        outcome = Round(index, fragment, self.generation, contributed=mine.contributes)
        if self.group is None:  # (a learner alone: its own pseudo-gradient is the merge)
            headers = [mine]
            merged = merge([delta], weights(headers, owner.late_decay)) if delta is not None else None
            merged_buffers = buffers
        else:
            headers = [Header.of(h.tolist()) for h in self._all_gather(mine.tensor(self.device))]
            w = weights(headers, owner.late_decay)
            merged = self._merge(delta, w, hi - lo)
            merged_buffers = (
                self._merge_buffers(buffers, w.buffer_factors()) if owner._merges_buffers(fragment) else None
            )
        outcome.headers = headers
        if merged is None:
            return outcome
        theta = self.theta[lo:hi]
        outcome.old, outcome.norm = theta.clone(), float(merged.norm())
        owner._outer_step(theta, self.momentum[lo:hi], merged)
        outcome.new, outcome.momentum = theta.clone(), self.momentum[lo:hi].clone()
        outcome.buffers = merged_buffers
        return outcome

    @property
    def device(self) -> torch.device:
        return self.owner.global_params.device

    def _index(self) -> int:
        m = self.owner.ctx.membership
        return list(m.ranks).index(m.rank)

    def _wait(self, work: Any) -> None:
        m = self.owner.ctx.membership
        timeout = m.timeout or DEFAULT_TIMEOUT
        if self.device.type == "cuda":  # (NCCL's wait polls the GPU up to the deadline; a loss aborts the group)
            work.wait(timeout)
        else:
            m.alarm.wait([work], self.generation, timeout)

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.learners)]
        self._wait(dist.all_gather(out, tensor, group=self.group, async_op=True))
        return out

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._wait(dist.all_reduce(tensor, group=self.group, async_op=True))
        return tensor

    def _merge(self, delta: torch.Tensor | None, w: Weights, n: int) -> torch.Tensor | None:
        """The merged pseudo-gradient, exchanged as streaming DiLoCo exchanges it (``quantize``), weighted by ``w``
        (this rank sends its pseudo-gradient times its weight, nothing where 0; the sum is divided by ``w.total``)."""
        owner, total, mine = self.owner, w.total, w.shares[self._index()]
        if total <= 0:
            return None
        own = delta if delta is not None and mine > 0 else torch.zeros(n, device=self.device)
        if owner.quantize == "int8":  # (each part decoded, then weighted: merge() in rank order, as streaming sums)
            packed = self._all_gather(quantize_int8(own, owner.quant_block))
            return merge([dequantize_int8(p, n, owner.quant_block) for p in packed], w)
        sent = own if mine == 1.0 else own * mine
        if owner.quantize == "fp16":
            return self._all_reduce(sent.half()).float() / total
        return self._all_reduce(sent).float() / total

    def _merge_buffers(self, buffers: torch.Tensor | None, factor: list[float]) -> torch.Tensor | None:
        """The BN statistics weighted as the pseudo-gradients (a learner not in the round sends zeros)."""
        total, mine = sum(factor), factor[self._index()]
        size = self.owner._buffer_numel
        if total <= 0 or not size:
            return None
        zeros = torch.zeros(size, dtype=self.owner._buffer_dtype, device=self.device)
        own = buffers if buffers is not None and mine > 0 else zeros
        sent = own if mine == 1.0 else own * mine
        return self._all_reduce(sent) / total
