"""``sync=auto``: measure the cluster, train on with the option predicted to reach the target first, and decide
again when the cluster changes.

Its first ``probe_steps`` steps are local (each replica steps on its own: ``sync=none``) while it measures what the
decision needs (:mod:`algorithms.auto.model`): each replica's pace, the seconds of a step without the exchange after
its optimizer step (its data, forward, backward and the step itself: the median, the first step after a decision
left out: it sets things up), then, in one collective, every replica's link (an exchange of ``probe_bytes`` with
every peer, the fastest kept) and the latency (the same with a few bytes). Every rank decides from the same gathered
numbers, so all of them choose alike at the same step. The chosen option is set up on the model and optimizer as
they are; one that averages the replicas' models (local SGD, DiLoCo) takes the probe's local steps as its first
period's, from the parameters the replicas agreed on when the probe started (``take_local_steps``), and any other
starts after the replicas are averaged (they agree). It decides again, and switches if another option is predicted
faster by ``margin``:

- after a change of the ranks (a loss, an eviction), ``probe_steps`` steps later (their paces measured, the first
  left out: it rebuilt what the change asked for), but for the eviction a decision chose relaxed sync for: that
  decision predicted the ranks kept;
- every ``check_every`` steps, when the measured seconds per step (the slowest rank's mean, its data and the step to
  the end of its exchange, over the steps since the last decision, or the median of its latest ``probe_steps``
  steps where that is longer) are ``drift`` times the predicted ones or more, or less than their ``1 / drift``.
  Where the paces measured since explain the latest steps' time under the option running, with the links as last
  measured, it decides by them without probing the links again;
- after a join, or a resume at another size (the state it loads was decided for another number of replicas).

A switch drains the option running, averages the replicas (parameters, floating-point buffers and, where the next
option exchanges gradients, the optimizer's momenta, which local steps made differ), drops the option's own per-rank
state (DGC residuals, DiLoCo's outer state) and sets up the next; relaxed sync is put around the option running, or
taken off it, which keeps that option's state. Relaxed sync chosen for whom the measurement says it evicts checks at
once. Each decision is a ``sync_chosen`` event (the option, its settings, why, the measurements and every candidate's
prediction) and a console line.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from algorithms.auto.model import Choice, Measured, decide, read_step_ratios, step_seconds
from algorithms.base import StepResult, SyncAlgorithm, SyncContext, SyncReport, Wrapper
from algorithms.none import NoSync
from algorithms.relaxed import EVICTED, RelaxedSync
from distributed.membership import Change
from errors import ConfigError, is_int, is_number, require

DATA = Path(__file__).resolve().parents[2] / "bench" / "results" / "tta_ratios.jsonl"
LATENCY_BYTES = 8  # the exchange the latency is timed with


def _plain(section: Any) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)


def _parameter_order(model: Any) -> Any:
    """A sort key that puts a model's parameters in the order of ``model.parameters()``: the same on every rank."""
    order = {id(p): i for i, p in enumerate(model.parameters())}
    return lambda p: order.get(id(p), len(order))


def build(section: dict[str, Any]) -> SyncAlgorithm:
    """The option ``section`` configures (relaxed sync with its inner option)."""
    from hydra.utils import instantiate

    return instantiate(section)


def build_around(section: dict[str, Any], inner: SyncAlgorithm) -> Wrapper:
    """The wrapper ``section`` configures (relaxed sync), around ``inner``, an option already running."""
    from hydra.utils import get_class

    settings = {k: v for k, v in section.items() if k not in ("_target_", "inner")}
    return get_class(section["_target_"])(inner, **settings)


class AutoSync(Wrapper):
    """``sync=auto`` (the module docstring). ``candidates``: key -> sync section (keys as bench/tta names them);
    ``steps_data``: bench/tta's result file the steps ratios are read from (default: the project's)."""

    name = "auto"

    def __init__(
        self,
        candidates: dict[str, Any],
        steps_data: str | None = None,
        probe_steps: int = 3,
        probe_bytes: int = 1 << 18,
        margin: float = 1.1,
        check_every: int = 10,
        drift: float = 1.5,
        start: str = "allreduce",
    ):
        super().__init__(NoSync())
        self.candidates = {str(k): _plain(v) for k, v in candidates.items()}
        self.ratios = read_step_ratios(steps_data or DATA)
        self.probe_steps, self.probe_bytes, self.margin = probe_steps, probe_bytes, margin
        self.check_every, self.drift, self.start = check_every, drift, start
        self.key: str | None = None  # the candidate running (None while probing)
        self.predicted_s: float | None = None  # its predicted seconds per step
        self.decided_at = 0  # the step count of the last decision
        self._due = False  # a change of the ranks: decide again once probe_steps steps measured the new ones
        self._pace: list[float] = []  # this rank's steps' seconds without the exchange, since the last decision
        self._steps: list[float] = []  # ... and its whole steps' seconds (data, then before_step to the exchange's end)
        self._started: float | None = None  # when this step started (time.perf_counter)
        self.replicas = 0  # the replicas the last decision measured
        self._own_pace = 0.0  # this rank's pace at the last measurement
        # While probing: the parameters the replicas last agreed on, and after how many steps (None: not known)
        self._agreed: tuple[int, list[torch.Tensor]] | None = None
        self._done = 0  # steps completed
        self._measured: Measured | None = None  # what the last decision measured (None: not of the ranks now)
        self._evicting: int | None = None  # the replicas the decision of this step chose relaxed sync to keep

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        from hydra.utils import get_class

        p = section["probe_steps"]
        require(is_int(p) and p >= 1, "sync.probe_steps", p, "an integer number of steps >= 1")
        b = section["probe_bytes"]
        require(is_int(b) and b >= 1, "sync.probe_bytes", b, "an integer number of bytes >= 1")
        c = section["check_every"]
        require(is_int(c) and c >= 2, "sync.check_every", c, "an integer number of steps >= 2")
        for key, low in (("margin", 1.0), ("drift", 1.0)):
            v = section[key]
            require(is_number(v) and v >= low and (key == "margin" or v > low), f"sync.{key}", v, f"a number > {low}")
        data = section["steps_data"] or DATA
        require(Path(data).is_file(), "sync.steps_data", section["steps_data"], "null or a bench/tta result file")
        ratios = read_step_ratios(data)
        candidates = section["candidates"]
        usable = sorted(k for k in candidates if k in ratios)
        require(bool(usable), "sync.candidates", sorted(candidates), f"options with a steps ratio in {data}")
        require(section["start"] in usable, "sync.start", section["start"], f"one of the candidates: {usable}")
        for key, candidate in candidates.items():
            candidate = _plain(candidate)
            target = get_class(candidate["_target_"])
            require(not issubclass(target, AutoSync), f"sync.candidates.{key}", "auto", "an option, not auto itself")
            try:
                target.validate(candidate, cfg, world_size)
            except ConfigError as error:
                try:  # (one that needs more ranks than this run has is never chosen at this size: kept)
                    target.validate(candidate, cfg, max(world_size, 1024))
                except ConfigError:
                    raise error.under(f"sync.candidates.{key}") from None

    # ---- hooks -----------------------------------------------------------------------------------------------
    def setup(self, model: Any, optimizer: Any, ctx: SyncContext) -> None:
        super().setup(model, optimizer, ctx)
        self._agreed = (0, self._snapshot())  # (every rank starts from the same seed)

    def _snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def before_eval(self) -> None:
        super().before_eval()
        if self.key is None and self._agreed is not None:  # (the probe's replicas were averaged: they agree now)
            self._agreed = (self._done, self._snapshot())

    def before_step(self, step: int) -> SyncReport:
        self._started = time.perf_counter()
        self._evicting = None  # (the eviction a decision asked for comes in the step it was decided)
        return super().before_step(step)

    def on_membership_change(self, change: Change) -> SyncReport:
        expected, self._evicting = self._evicting, None
        self._agreed, self._measured = None, None  # (one that joined did not start from it; the ranks are others)
        self._pace, self._steps = [], []  # (measured again from here: the steps before ran on other ranks)
        report = super().on_membership_change(change)
        if expected is not None and change.cause == EVICTED and not change.added and self.ctx.comm.size == expected:
            # (the eviction this step's decision chose relaxed sync for: its prediction was for the ranks kept, so
            # it holds; the drift check measures them from here)
            self.replicas = expected
            self._restart(self._done)
        else:
            self._due = True
        return report

    def after_optimizer_step(self, result: StepResult) -> SyncReport:
        started, self._started = self._started, None  # (evaluations and checkpoints between steps are not a step's)
        if started is not None:
            self._pace.append(result.data_s + time.perf_counter() - started)
        report = super().after_optimizer_step(result)
        steps = self._done = result.step + 1
        if started is not None:
            self._steps.append(result.data_s + time.perf_counter() - started)
        if self.key is None:
            if len(self._pace) >= self.probe_steps:
                report += self._decide(steps, "probe")
        elif self._due:
            if len(self._pace) >= self.probe_steps:
                report += self._decide(steps, "the ranks changed")
        elif steps - self.decided_at >= self.check_every:
            drifted = self._drift()
            if drifted:
                report += self._decide(steps, *drifted)
            else:
                self._restart(steps)
        return report

    # ---- deciding ------------------------------------------------------------------------------------------
    def _recent_pace(self) -> float:
        """This rank's pace: the median of its latest ``probe_steps`` steps without the exchange (the first after a
        decision, which sets things up, left out; after a drift, the steps since the cluster changed)."""
        warm = (self._pace[1:] or self._pace)[-self.probe_steps :]
        return statistics.median(warm) if warm else 0.0

    def _drift(self) -> tuple[str, Measured | None] | None:
        """Collective: why the measured step time says to decide again (None: it does not), and the measurement to
        decide by where the paces alone explain it: the paces measured since, with the links last measured, predict
        the latest steps' time under the option running (within ``drift``). The links are then not probed again
        (a slowed node, not a slowed link); else (None) the decision measures everything anew."""
        window = self._steps[1:] or self._steps  # (the first step after a decision sets things up: left out)
        recent = window[-self.probe_steps :]
        own = [statistics.fmean(window) if window else 0.0, statistics.median(recent) if recent else 0.0]
        mine = torch.tensor([*own, self._recent_pace()], dtype=torch.float64, device=self.ctx.comm.device)
        gathered = [t.tolist() for t in self.ctx.comm.all_gather(mine)]
        if self.predicted_s is None:  # (resumed: the step time measured now is the reference from here on)
            self.predicted_s = max(g[0] for g in gathered)
            return None
        # (the window's mean counts an exchange every k steps; the latest steps' median sees a change late in the
        # window, a straggler that appeared two steps ago, which the mean dilutes)
        slowest = max(max(g[0], g[1]) for g in gathered)
        ratio = slowest / max(self.predicted_s, 1e-9)
        if self.drift > ratio > 1 / self.drift:
            return None
        why = f"a step took {slowest:.3f} s, {ratio:.2f}x the {self.predicted_s:.3f} s predicted"
        last = self._measured
        if last is None or last.replicas != len(gathered):  # (not of these ranks: measure anew)
            return why, None
        now = dataclasses.replace(last, compute_s=tuple(g[2] for g in gathered))
        expected, latest = step_seconds(self.candidates[self.key], now), max(g[1] for g in gathered)
        if self.drift > latest / max(expected, 1e-9) > 1 / self.drift:
            self._own_pace = self._recent_pace()
            return f"{why}; the paces explain it (latest {latest:.3f} s, {expected:.3f} s by them)", now
        return why, None

    def _measure(self) -> Measured:
        """Collective: what the decision needs, alike on every rank."""
        comm = self.ctx.comm
        self._own_pace = self._recent_pace()
        link, latency = comm.probe_links(self.probe_bytes), comm.probe_links(LATENCY_BYTES)
        own = torch.tensor([self._own_pace, link, latency], dtype=torch.float64, device=comm.device)
        compute, links, latencies = zip(*(t.tolist() for t in comm.all_gather(own)))  # (one collective for the three)
        finite = [t for t in latencies if t != float("inf")]
        shapes = tuple(tuple(p.shape) for p in self.model.parameters())
        return Measured(shapes, tuple(compute), tuple(links), self.probe_bytes, statistics.median(finite or [0.0]))

    def _decide(self, steps: int, why: str, measured: Measured | None = None) -> SyncReport:
        """Decide (``measured``: by these measurements, else by new ones), switch if the choice is another option,
        and say so."""
        measured = self._measured = measured or self._measure()
        choice = decide(self.candidates, self.ratios, measured, current=self.key or self.start, margin=self.margin)
        before = self.key
        if choice.key != before:
            self._switch(choice.key, probed_from=self._agreed if before is None else None)
        self._agreed = None
        self.predicted_s, self.replicas = choice.predicted(choice.key).step_s, measured.replicas
        self._restart(steps)
        self._due = False
        report = SyncReport(events=[self._event(choice, measured, before, steps, why)])
        if (
            isinstance(self.inner, RelaxedSync)
            and choice.key != before
            and choice.predicted(choice.key).replicas < measured.replicas
        ):
            # (relaxed sync, chosen for whom it evicts: the pace just measured names them; its check, now)
            self._evicting = choice.predicted(choice.key).replicas
            report += self.inner.check_now(self._own_pace, f"at step {steps}, as sync=auto chose it")
        return report

    def _restart(self, steps: int) -> None:
        self.decided_at, self._pace, self._steps = steps, [], []

    def _context(self) -> SyncContext:
        """The context an option is set up in after a switch or a resume: the replicas agree there."""
        ctx = self.ctx
        return SyncContext(ctx.comm, ctx.membership, ctx.device, True, ctx.guests)

    def _switch(self, key: str, probed_from: tuple[int, list[torch.Tensor]] | None = None) -> None:
        """Drain the option running, settle (average the replicas: parameters, floating-point buffers and, unless
        the next option's replicas step apart, the optimizer's floating-point state, which local steps made differ
        and which an option that exchanges gradients, allreduce, would otherwise step apart on), then set up
        ``key``'s option. Relaxed sync is put around the option running, or taken off it, which keeps its state.
        From the probe (``probed_from``: the steps after which the replicas last agreed, and their parameters then,
        where known), an option that takes the probe's local steps as its own (``take_local_steps``) is set up
        without the settle: its first exchange is that; any other settles once it is set up."""
        self.inner.drain()
        section, running = self.candidates[key], self.candidates.get(self.key or "")
        if running is not None and section.get("inner") == running:  # X -> relaxed sync over X
            kept: SyncAlgorithm | None = build_around(section, self.inner)
        elif running is not None and running.get("inner") == section:  # relaxed sync over X -> X on its own
            kept = self.inner.inner
        else:
            kept = None
        chosen = kept if kept is not None else build(section)
        optimizer = not chosen.steps_apart
        if probed_from is None:
            self._settle(optimizer)
        if kept is not None:
            if isinstance(kept, Wrapper):
                kept.setup_around(self.model, self.optimizer, self._context())
            self.inner, self.key = kept, key
            return
        if self.inner is not None:
            self.inner.finalize()  # (the option left ends: sync=decoupled's syncer thread)
        self.inner = None  # (its hooks on the model, DDP's, go with it before the next one's)
        chosen.setup(self.model, self.optimizer, self._context())
        if probed_from is not None and not chosen.take_local_steps(probed_from[1], probed_from[0]):
            self._settle(optimizer)
        self.inner, self.key = chosen, key

    def _settle(self, optimizer: bool = True) -> None:
        """Average the replicas: parameters, floating-point buffers and (``optimizer``) the optimizer's floating-point
        state."""
        comm = self.ctx.comm
        tensors = [p.data for p in self.model.parameters()] + [
            b.data for b in self.model.buffers() if b.is_floating_point()
        ]
        if optimizer and self.optimizer is not None:  # (momenta; a step counter is the same on every rank already)
            state = self.optimizer.state
            tensors += [
                t
                for p in sorted(state, key=_parameter_order(self.model))
                for t in state[p].values()
                if torch.is_tensor(t) and t.is_floating_point() and t.dim() > 0
            ]
        if comm.size > 1:
            comm.all_reduce_coalesced(tensors, average=True)

    def _event(self, choice: Choice, measured: Measured, before: str | None, steps: int, why: str) -> dict[str, Any]:
        chosen = choice.predicted(choice.key)
        did = f"keeps {before}" if choice.key == before else f"switches from {before or 'its probe'} to {choice.key}"
        others = ", ".join(
            f"{p.key} {p.score / chosen.score:.2f}x"
            for p in sorted(choice.predictions, key=lambda p: p.score)
            if p.key != choice.key
        )
        return {
            "event": "sync_chosen",
            "option": choice.key,
            "previous": before,
            "settings": self.candidates[choice.key],
            "why": why,
            "at_steps": steps,
            "measured": measured.as_dict(),
            "predicted": {
                p.key: {"step_s": p.step_s, "steps_ratio": p.steps_ratio, "score": p.score, "replicas": p.replicas}
                for p in choice.predictions
            },
            "message": (
                f"relaxsync: sync=auto {did} after {steps} steps ({why}): predicted "
                f"{chosen.step_s:.3f} s/step x {chosen.steps_ratio:.2f} of allreduce's steps; the others, in time "
                f"to the target: {others or 'none'}"
            ),
        }

    # ---- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "decided_at": self.decided_at,
            "replicas": self.replicas,
            "steps": self._done,
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["key"] != self.key:
            self.inner = None
            chosen = build(self.candidates[state["key"]]) if state["key"] is not None else NoSync()
            chosen.setup(self.model, self.optimizer, self._context())
            self.inner, self.key = chosen, state["key"]
        # (resumed in the probe: the replicas agree on the parameters loaded, those of the step it was saved at)
        self._done = state.get("steps", state["decided_at"])
        self._agreed = (self._done, self._snapshot()) if self.key is None else None
        # (its predicted step time is a measurement's, not state: the first check after this takes its reference)
        self.predicted_s, self.decided_at = None, state["decided_at"]
        self.replicas = state.get("replicas", self.ctx.comm.size)
        # (a world of another size, after a join or a resume at another size: decide again, probe_steps steps on)
        self._due = self.key is not None and self.replicas != self.ctx.comm.size
        self.inner.load_state_dict(state["inner"])

    def local_state_dict(self) -> dict[str, Any]:
        return {"key": self.key, "inner": self.inner.local_state_dict()}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("key") == self.key:  # (saved under another option: that option's own state is dropped)
            self.inner.load_local_state_dict(state["inner"])
