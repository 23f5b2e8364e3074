"""The contract between the trainer and a sync algorithm: the single statement of it.

The trainer calls the hooks of exactly one :class:`SyncAlgorithm` in a fixed order and never asks which
algorithm it runs. First, once, ``setup(model, optimizer, ctx)``: the algorithm keeps ``self.model`` (the model to
train), ``self.optimizer`` and ``self.ctx`` (a :class:`SyncContext`) and sets ``self.module``. Per optimizer step::

    trainer.apply(sync.before_step(step))                  # e.g. a straggler check every N steps
    with amp.autocast(): loss = criterion(sync.module(x), y)
    amp.backward(loss, optimizer)                          # DDP (if setup() wrapped the model) syncs here
    grads_finite = amp.unscale(optimizer)                  # gradients seen below are unscaled
    report = sync.after_backward(step, grads_finite)       # gradient exchange (DGC, synchronous local SGD)
    amp.step(optimizer, report.grads_finite)               # skipped on every rank when False
    report += sync.after_optimizer_step(StepResult(...))   # model exchange (local SGD, gossip)
    trainer.apply(report)                                  # then the step's record, with report.metrics

plus ``trainer.apply(sync.on_epoch_start(epoch))`` before each epoch's loader is iterated, ``drain()`` then
``before_eval()`` before each evaluation and checkpoint, ``trainer.apply(sync.on_membership_change(change))``
after each change of the active ranks, and ``drain()`` then ``finalize()`` once at the end (or where ``sync=auto``
leaves the algorithm for another). The forward pass runs through ``sync.module``, read at every step, so an
algorithm may rewrap the model. Two class attributes describe the algorithm: ``name``, its W&B tag and config
option name, and ``evaluates_replicas``, True where the replicas differ (gossip): evaluation then also reports the
replicas' own accuracy, measured before ``before_eval()`` brings them into agreement.

**One way.** A hook receives what it needs as arguments (``after_optimizer_step`` gets the finished step: its
loss, learning rate, timings) and returns a :class:`SyncReport` with what it measured (``metrics``), what
happened (``events``) and what it wants the trainer to do (``requests``: :class:`RebuildTrainLoader`,
:class:`ScaleLR`; from ``before_step``, :class:`SkipCompute`). The trainer applies the requests after the hook
returns. An algorithm never calls into the trainer; :class:`SyncContext` holds only runtime objects: ``comm``,
``membership``, ``device``, ``replicas_agree`` (the replicas are known to be identical at ``setup()``: a wrapper
need not broadcast them) and ``guests`` (see Joins). ``apply`` follows a membership change, records the events
and carries out the requests, in that order.

**Membership.** ``ctx.membership`` (:class:`distributed.membership.Membership`) owns the active ranks, their
process group, store-based agreement and regrouping. A policy that wants ranks gone (relaxed sync: too slow)
asks it to remove them; on a removed rank that call raises :class:`distributed.membership.LeftRun`, which
unwinds to where the worker runs and ends it with status 0. After any change, whoever caused it (an eviction,
a rank lost under ``trainer.on_failure=continue``), the trainer calls ``on_membership_change(change)``: the
algorithm rebinds whatever holds the old group (e.g. DDP) and answers with a :class:`SyncReport` whose requests
the trainer applies like any other hook's. The default answer is the policy after a loss: the survivors cover
the training set from the next epoch on (:class:`RebuildTrainLoader`) and the LR scales by active / initial
ranks (:class:`ScaleLR`); relaxed sync answers with its own ``lr_policy``. The trainer reshards evaluation at
once, and training when asked. It never reads an algorithm's config. Algorithms run every collective
on ``ctx.comm`` (the :class:`distributed.comm.Communicator` over the active group), never on the world group,
so bytes and seconds are counted the same way for all of them; the trainer reads and resets those counts
after every step.

**Exchanges in flight.** An algorithm may leave an exchange running across steps (``ctx.comm``'s ``*_async``
collectives return a ``Pending`` whose bytes are counted when issued). ``drain()`` completes and applies every
exchange in flight; the trainer calls it before each evaluation, checkpoint and the end, and a wrapper before
it asks for a membership change, so all of those see a settled state and a resumed run continues from it.
When an exchange is applied must not depend on timing (only on the step), so that every rank, and a resumed
run, applies it at the same point. After a lost rank (``trainer.on_failure=continue``) an exchange issued on the
replaced group is dropped, alike on every survivor: its ``Pending.wait()`` returns None, and the algorithm goes
on as if it had not been issued (SGP takes back the shares it sent, crossover and DiLoCo skip that mix or outer
step); keep a due exchange in flight until its ``wait()`` returned, so that one whose wait fails is dropped too.

**State.** ``state_dict()`` is what every rank holds identically (counters, periods): saved once, by the
logging rank, in the main checkpoint. ``local_state_dict()`` is this rank's own state (DGC residuals, local
momenta): each rank saves it beside the checkpoint and loads its own on resume; a rank that finds none (it
was evicted before that checkpoint, or the world grew) keeps the fresh state of ``setup()``, so nothing
identical-on-every-rank may live there. On a resume the trainer loads the model and optimizer, calls
``setup()``, then ``load_state_dict(state)`` and, where this rank saved its own, ``load_local_state_dict(state)``.

**Wrapping.** An algorithm that wraps another (``sync=relaxed`` wraps ``sync.inner``) derives from
:class:`Wrapper`, which forwards every hook, capability flag, module and state of the inner algorithm; a
subclass overrides a hook to add to it and calls ``super()``.

**Switching (``sync=auto``).** An algorithm may be set up on a model and optimizer that another trained, at a step
where that one drained. Two members say what such a start needs: ``steps_apart``, True where the replicas step on
their own between exchanges of the model, each with its own optimizer state (local SGD, DiLoCo, gossip), so that a
switch into it averages the parameters but not the optimizer's state (default False: the gradients are exchanged,
and replicas that agree in both stay identical); and ``take_local_steps(agreed, since)``, called after ``setup()``
where the replicas were identical ``since`` steps in (parameters ``agreed``) and have stepped on their own since:
an algorithm whose exchanges average the models takes those steps as its first period's and returns True (no
averaging before it); the default returns False, and the replicas are averaged after ``setup()``, which therefore
reads no parameter.

**Overflow steps** (AMP with dynamic loss scaling): ``grads_finite`` is this rank's own verdict on its
unscaled gradients. Every rank must take the same branch, so an algorithm that communicates gradients returns
in ``SyncReport.grads_finite`` a verdict derived from communicated data, identical on every rank (for DDP the
gradients are averaged before unscaling, so the local verdict on the averaged gradients already is). An
algorithm whose ranks step independently (local SGD between syncs) may return the local verdict. On a
skipped step the algorithm leaves its own state (residuals, momenta) as it was before the step.

**Validation.** ``validate(section, cfg, world_size)`` raises ``errors.ConfigError`` before any worker starts
(the signature every config group shares; see ``errors.py``).

**Joins (optional).** Under ``trainer.on_failure=continue`` a process may join a running run: it is admitted at a
step all members agree on, where they settle the replicas as for a checkpoint and it receives the trainer's state
by transfer, as a run resumed at the new size would have it. That needs none of the hooks below. With them an
admission costs less: it is aligned to a step where the replicas agree anyway, and the joining process takes its
model in the algorithm's own averaging there (the transfer then carries only the rest of the state):

- ``agreement_at(steps)``: the next count of completed steps, at or after ``steps``, after which the replicas
  agree by the algorithm's own exchange (local SGD's averaging, DiLoCo's whole outer step), so that an admission
  can be aligned to it and the members settle there with no averaging of their own. Default: ``steps``.
- ``ctx.guests(steps)``: a :class:`Guests` where processes are admitted at the averaging that completes ``steps``
  steps, else None. An averaging of the whole model there sums its flat tensor with
  ``Guests.sum(flat, names, advance)`` over the members and those processes (each adding nothing) and divides by
  the members' count as ever; on False (``flat`` as it was) it sums on ``ctx.comm`` as it would have without
  them. ``ctx.guests`` is given by the runtime (the engine implements :class:`Guests`): a runtime object like
  ``ctx.comm``, so the algorithm still never calls into the trainer.
- ``take_share(model, summed, asked, state)``: on the joining process (the algorithm not set up), how it sets
  ``model``'s tensors named ``asked["names"]`` from ``summed``, the members' sum of that averaging, having taken
  part in it adding nothing (``asked["contributors"]``: the members' count). An algorithm that calls
  ``ctx.guests`` implements it; the default raises ``NotImplementedError``, as an algorithm that never asks
  ``ctx.guests`` is never asked to take a share.
- ``guest_state(at, steps)``: the state a process admitted at ``at`` steps needs before the averaging of that step
  (DiLoCo's outer parameters and momentum, to take the outer step itself), sent to it in advance while the
  members train; asked at each step until ``steps`` completed steps have made it final (None until then, and where none
  is needed: the default). The averaging then sums with ``Guests.sum(..., advance=True)``.
- ``late_shared_state``: True where the shared state (``state_dict()``) is read only at a step (DiLoCo's outer
  state, at its outer step), so that it may reach a joining process after its first forward, while it computes
  its first step. Default: False; a wrapper with shared state of its own that may change at any step says False
  whatever its inner algorithm's (relaxed sync).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from distributed.comm import Communicator
from distributed.membership import Change, Membership
from errors import ConfigError


# ---- what the trainer hands in ----------------------------------------------------------------------------
@dataclass(frozen=True)
class StepResult:
    """The finished optimizer step, the argument of ``after_optimizer_step``."""

    step: int  # global optimizer step, from 0
    epoch: int  # from 1, as everywhere a user reads or sets epochs
    loss: float  # this rank's training loss
    lr: float  # the learning rate this step used
    stepped: bool  # False on an overflow step (skipped on every rank)
    data_s: float  # this rank's wait for its batch, seconds
    compute_s: float  # this rank's forward + backward up to its last gradient bucket, seconds
    computed: bool = True  # False where ``before_step`` asked this rank to skip the step (:class:`SkipCompute`)


@dataclass
class SyncContext:
    """Runtime objects a sync algorithm works with; built by the trainer (or the CAC drop-in)."""

    comm: Communicator  # counted collectives on the active group
    membership: Membership
    device: torch.device
    # The replicas are known to be identical when the algorithm is set up (the world grew by a join, after a
    # checkpoint's agreement): a wrapper need not broadcast them again.
    replicas_agree: bool = False
    # Processes admitted at a step count (joins, under ``trainer.on_failure: continue``; given by the runtime):
    # called with the steps an averaging completes, a :class:`Guests` that sums it over the members and those
    # processes (each adding nothing and taking the result as its model), or None. Only an average of the whole
    # model may ask.
    guests: Callable[[int], Guests | None] | None = None


class Guests(Protocol):
    """Processes that join at an averaging's step and take the model from it (``SyncContext.guests``)."""

    def sum(self, flat: torch.Tensor, names: list[str], advance: bool = False) -> bool:
        """Sum ``flat`` in place over the members and the guests, from which each guest sets the model's tensors
        named ``names`` (:meth:`SyncAlgorithm.take_share`); False, with ``flat`` as it was, where the members sum it
        without them. ``advance``: the guests need the state :meth:`SyncAlgorithm.guest_state` gives, sent to them
        before this step, and take part only where it arrived."""
        ...


# ---- what a hook hands back ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RebuildTrainLoader:
    """Reshard the training data over the active ranks (asked mid-epoch: from the next epoch on)."""


@dataclass(frozen=True)
class ScaleLR:
    """Multiply the scheduled learning rate by ``scale`` from now on (replacing any earlier scale)."""

    scale: float
    policy: str  # why, for the record: e.g. "linear" (scale = active / initial ranks)


@dataclass(frozen=True)
class SkipCompute:
    """From ``before_step``: this rank computes nothing this step (its batch is dropped, its optimizer does not step,
    ``after_optimizer_step`` gets ``computed=False`` and a NaN loss); only for an algorithm whose ranks exchange
    nothing in the step's own hooks that the others would wait for (a learner behind catching up, sync=decoupled)."""


Request = RebuildTrainLoader | ScaleLR | SkipCompute


@dataclass
class SyncReport:
    """What a hook returns: the agreed overflow verdict, measurements, events and requests to the trainer."""

    grads_finite: bool = True  # the agreed overflow verdict (identical on every rank)
    compute_end: Any = None  # ctx.comm.clock's mark when this rank's own compute ended, if known
    events: list[dict[str, Any]] = field(default_factory=list)  # e.g. {"event": "evict", ...}
    metrics: dict[str, float] = field(default_factory=dict)  # algorithm metrics, e.g. {"sparsity": 0.999}
    requests: list[Request] = field(default_factory=list)

    def __iadd__(self, other: SyncReport) -> SyncReport:
        self.grads_finite = self.grads_finite and other.grads_finite
        if other.compute_end is not None:
            self.compute_end = other.compute_end
        self.events.extend(other.events)
        self.metrics.update(other.metrics)
        self.requests.extend(other.requests)
        return self


# ---- the plugin -----------------------------------------------------------------------------------------------
class SyncAlgorithm:
    """Base class: every hook is a no-op that reports nothing.

    Subclasses are built by Hydra from ``conf/sync/<name>.yaml`` (``_target_``) with only their own keys, then
    receive runtime objects in :meth:`setup`.
    """

    #: the W&B tag and the config option name
    name: str = "base"
    #: True when replicas differ (gossip): evaluation then also reports the replicas' own accuracy, measured
    #: before ``before_eval()`` brings them into agreement.
    evaluates_replicas: bool = False
    #: True when the shared state (:meth:`state_dict`) is first read after an optimizer step (DiLoCo's outer state, at
    #: its outer step): a process that joins may load it once it has computed its first step's gradients, and so
    #: need not wait for it before its first forward (see Joins, above).
    late_shared_state: bool = False

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        """Raise ``ConfigError`` for bad options; ``section`` is this algorithm's own (``sync``)."""

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: SyncContext) -> None:
        """Take the model to train; ``self.module`` is what the forward pass runs (possibly a DDP wrapper)."""
        self.ctx, self.model, self.optimizer = ctx, model, optimizer
        self.module: nn.Module = model

    def on_membership_change(self, change: Change) -> SyncReport:
        """The active ranks changed (``change``; ``ctx.membership`` holds the new group): rebind whatever holds
        the old group and say what the trainer should do. Default: reshard the training data from the next epoch
        and scale the LR linearly by active / initial ranks (a subclass that rebinds returns ``super()``'s)."""
        m = self.ctx.membership
        return SyncReport(requests=[RebuildTrainLoader(), ScaleLR(m.size / m.initial_size, "linear")])

    def on_epoch_start(self, epoch: int) -> SyncReport:
        return SyncReport()

    def before_step(self, step: int) -> SyncReport:
        return SyncReport()

    def after_backward(self, step: int, grads_finite: bool) -> SyncReport:
        return SyncReport(grads_finite=grads_finite)

    def after_optimizer_step(self, result: StepResult) -> SyncReport:
        return SyncReport()

    def drain(self) -> None:
        """Complete and apply every exchange still in flight (none by default)."""

    def before_eval(self) -> None:
        """Bring what evaluation and checkpoints read into agreement; default: average BN buffers."""
        self.ctx.comm.average_buffers(self.model)

    #: True where the replicas step on their own between exchanges of the model, each with its own optimizer state
    #: (local SGD, DiLoCo, gossip); False where every replica takes the same step (the gradients are exchanged), so
    #: that replicas whose parameters and optimizer state agree stay identical.
    steps_apart = False

    def take_local_steps(self, agreed: list[torch.Tensor], since: int) -> bool:
        """After ``setup()``, where the replicas were identical ``since`` steps in (their parameters then:
        ``agreed``, in ``model.parameters()`` order) and have each stepped on their own since, with nothing
        exchanged: an option whose exchanges average the replicas' models (local SGD, DiLoCo) takes those steps as
        its first period's and returns True; the default, False, leaves the caller to make the replicas agree (after
        ``setup()``, which therefore must not read the parameters where this returns False)."""
        return False

    def agreement_at(self, steps: int) -> int:
        """The first count of completed steps from ``steps`` on after which the replicas agree by the algorithm's
        own exchange, so that ``before_eval()`` has nothing to do there (a join admitted there costs the others
        no averaging, and no waiting for each other: they have just exchanged). Default: any step."""
        return steps

    def guest_state(self, at: int, steps: int) -> dict[str, Any] | None:
        """The shared state a process admitted at ``at`` steps needs before it takes part in the averaging there
        (``Guests.sum(advance=True)``), once ``steps`` steps completed have made it final: the joining process
        receives it while the members train. None: none is needed (the default), or not final yet."""
        return None

    def take_share(self, model: nn.Module, summed: torch.Tensor, asked: dict[str, Any], state: Any) -> None:
        """On a process joining (this algorithm not set up): set ``model``'s tensors named ``asked["names"]`` from
        ``summed``, the sum over the members of what they averaged, where it took part adding nothing (``state``:
        what :meth:`guest_state` gave, if anything). Not offered by default: only an algorithm that calls
        ``ctx.guests`` is asked, and it implements this."""
        raise NotImplementedError(
            f"sync={self.name} takes no share of an averaging: it never asks ctx.guests, so a joining process "
            "takes its model by transfer"
        )

    def state_dict(self) -> dict[str, Any]:
        """State identical on every rank (saved once)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's own state (saved per rank); empty when the algorithm keeps none."""
        return {}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def finalize(self) -> None:
        pass


class Wrapper(SyncAlgorithm):
    """An algorithm around another: every hook, flag, module and state is the inner algorithm's unless a
    subclass adds to it (and calls ``super()``). ``tests/test_contract.py`` checks that every hook and flag of
    :class:`SyncAlgorithm` is forwarded here."""

    def __init__(self, inner: SyncAlgorithm):
        self.inner = inner

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        from hydra.utils import get_class

        inner = section["inner"]
        inner_cls = get_class(inner["_target_"])
        if issubclass(inner_cls, Wrapper):
            raise ConfigError("sync.inner", inner["_target_"], f"an exchange algorithm, not another {inner_cls.name}")
        try:
            inner_cls.validate(inner, cfg, world_size)
        except ConfigError as error:
            raise error.under("sync.inner") from None

    @property
    def evaluates_replicas(self) -> bool:  # type: ignore[override]
        return self.inner.evaluates_replicas

    @property
    def late_shared_state(self) -> bool:  # type: ignore[override]
        return self.inner.late_shared_state

    @property
    def module(self) -> nn.Module:  # type: ignore[override]
        return self.inner.module

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: SyncContext) -> None:
        self.setup_around(model, optimizer, ctx)
        self.inner.setup(model, optimizer, ctx)

    def setup_around(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: SyncContext) -> None:
        """Set up this wrapper alone, around an inner algorithm already set up on ``model``, which keeps its state
        (``sync=auto`` puts relaxed sync around the option running)."""
        self.ctx, self.model, self.optimizer = ctx, model, optimizer

    def on_membership_change(self, change: Change) -> SyncReport:
        return self.inner.on_membership_change(change)

    def on_epoch_start(self, epoch: int) -> SyncReport:
        return self.inner.on_epoch_start(epoch)

    def before_step(self, step: int) -> SyncReport:
        return self.inner.before_step(step)

    def after_backward(self, step: int, grads_finite: bool) -> SyncReport:
        return self.inner.after_backward(step, grads_finite)

    def after_optimizer_step(self, result: StepResult) -> SyncReport:
        return self.inner.after_optimizer_step(result)

    def drain(self) -> None:
        self.inner.drain()

    def before_eval(self) -> None:
        self.inner.before_eval()

    @property
    def steps_apart(self) -> bool:  # type: ignore[override]
        return self.inner.steps_apart

    def take_local_steps(self, agreed: list[torch.Tensor], since: int) -> bool:
        return self.inner.take_local_steps(agreed, since)

    def agreement_at(self, steps: int) -> int:
        return self.inner.agreement_at(steps)

    def guest_state(self, at: int, steps: int) -> dict[str, Any] | None:
        return self.inner.guest_state(at, steps)

    def take_share(self, model: nn.Module, summed: torch.Tensor, asked: dict[str, Any], state: Any) -> None:
        self.inner.take_share(model, summed, asked, state)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])

    def local_state_dict(self) -> dict[str, Any]:
        return self.inner.local_state_dict()  # a wrapper's own state is the same on every rank

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_local_state_dict(state)

    def finalize(self) -> None:
        self.inner.finalize()
