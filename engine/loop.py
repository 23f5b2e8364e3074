"""The trainer: it builds its components from the resolved config and runs epochs of steps; every other job is a
component with its own *when* and *what* (torchtitan's shape): the run's position and state (``engine.state``),
checkpoints, evaluation, records (``engine.metrics``), the elastic component chosen once (``engine.elastic``: losses
survived, joiners admitted), a stop on SIGTERM. :meth:`Trainer.apply` carries out every hook's report
(``engine.reports``), :meth:`Trainer.resize` an admission. Nothing here depends on which sync algorithm runs.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from functools import partial
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn

from algorithms.base import SkipCompute, StepResult, SyncContext, SyncReport
from data.common import Loaders, build_data
from distributed.clock import build_clock
from distributed.comm import Communicator
from distributed.world import configure_device, select_device
from engine.checkpoint import Checkpointer
from engine.elastic.build import build_elastic, worker_membership
from engine.elastic.face import Resize
from engine.elastic.positions import Phase, Site
from engine.ending import close, finish, finished_already
from engine.evaluate import Evaluation, Evaluator, reached_target
from engine.metrics import NoLogger, Recorder, progress_bar
from engine.optim import build_replica, rehearse
from engine.reports import carry_out, report_skipped, resize
from engine.scope import build_sync
from engine.state import LoopState, RunState, load_replica, load_trainer_state, trainer_state
from engine.stop import StopRequest
from engine.summary import banner
from models.factory import uses_channels_last


class Trainer:
    """One worker process of a data-parallel run."""

    def __init__(self, cfg: dict[str, Any], run_dir: str):
        self.cfg, self.run_dir, t = cfg, run_dir, cfg["trainer"]
        torch.set_num_threads(t["threads"])
        local = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.device = select_device(t["device"], *local)
        configure_device(self.device, t["cudnn_benchmark"])
        self.clock = build_clock(self.device)  # compute and communication timed where they run (on a GPU: there)
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.membership = worker_membership(t, self.device, rank, world_size, run_dir)
        self.rank, self.world_size = self.membership.rank, self.membership.initial_size  # (a joiner: rank -1)
        self.changes = self.membership.follow()  # the one reader of the membership's changes
        self.comm = Communicator(self.membership, self.clock)
        torch.manual_seed(t["seed"])  # the same on every rank: identical initial replicas (without DDP too)
        self.data = data = build_data(cfg["data"])
        self.batch_size = cfg["data"]["batch_size"]
        self.raw_model, self.optimizer, self.amp, self.schedule, self.num_params, self.max_steps = build_replica(
            cfg, data, self.device, self.world_size
        )
        self.straggler, self.criterion = instantiate(cfg["straggler"]), nn.CrossEntropyLoss()
        self.elastic = build_elastic(t, self.membership, self.comm, run_dir, self.raw_model)
        self.awaiting = None  # a joiner's: the rest of its state, still on its way (complete())
        channels_last = uses_channels_last(cfg["model"], self.device)  # (the batches' memory format is the model's)
        self.loaders = Loaders(data, self.batch_size, cfg["data"]["num_workers"], t["seed"], self.device, channels_last)
        self.run = RunState()
        every, every_steps = t["checkpoint_every"], t["checkpoint_every_steps"]
        self.checkpointer = Checkpointer(run_dir, self.rank, every, t["resume"], every_steps, config=cfg)
        self.stop = StopRequest(self.membership)
        state, resumed = self.elastic.resume(self.checkpointer.load), None  # (a joiner's comes with its admission)
        if state is not None:
            load_replica(self, state)
            self.run.resume(state, len(data.train), self.world_size, self.batch_size)
            resumed = self.checkpointer.resumed(state.get("world_size"), self.world_size, self.run, t["epochs"])
            self.schedule.scale = 1.0  # (an eviction's or a loss's LR scale was the shrunk world's, not this one's)
        self.sync = build_sync(cfg["sync"], self.membership)  # (again where an admission resizes the world: resize)
        self.loop = LoopState()
        logger = instantiate(cfg["logger"]) if not self.done() else NoLogger()  # nothing to train, nothing to log
        self.recorder = Recorder(run_dir, cfg, self.sync.name, self.membership, logger)
        counts = {"skipped_files": self.loaders.skipped_count}  # (summed over the ranks at each evaluation)
        counts["rejected_connections"] = self.elastic.rejected_connections
        evaluator = Evaluator(self.comm, self.amp.autocast, self.device, data.num_classes, counts)
        self.evaluation = Evaluation(t, evaluator, self.run, self.recorder)
        self.elastic.attach(self, partial(self.begin, state, resumed))  # (a joiner begins at its admission: resize)
        at = self.loaders.steps_per_epoch, self.batch_size, run_dir
        self.recorder.console(banner(cfg["model"], self.device, self.world_size, self.num_params, self.sync.name, *at))

    @property
    def step(self) -> int:
        return self.run.step

    def state_dict(self) -> dict[str, Any]:
        """The one way state is checkpointed and sent to a healed rank or a joiner (``engine/state.py``)."""
        self.complete()
        return trainer_state(self)

    def context(self, replicas_agree: bool = False) -> SyncContext:
        """What the sync algorithm works with (here, and again where a join reshapes the run)."""
        return SyncContext(self.comm, self.membership, self.device, replicas_agree, self.elastic.guests)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Become the replica of a peer's :meth:`state_dict` (this rank's own algorithm state stays its own)."""
        self.complete()  # (what arrives later must not overwrite it)
        load_trainer_state(self, state)

    def complete(self) -> None:
        """On a joiner, before it first steps, settles or hands its state on: the rest of its state, sent meanwhile."""
        awaiting, self.awaiting = self.awaiting, None
        if awaiting is not None:
            awaiting(self.optimizer, self.sync)

    def begin(self, state: dict[str, Any] | None, resumed: Any) -> None:
        """Set up the sync algorithm and loaders for the world as it is, from the checkpoint ``state`` if any."""
        self.sync.setup(self.raw_model, self.optimizer, self.context())
        if state is not None:
            self.checkpointer.restore_sync(self.sync, state, self.device)
        self.loaders.build(self.membership.size, self.membership.index)
        if not self.done():  # (a run resumed at its end writes nothing more)
            self.recorder.start(self.membership.hosts, self.run.epoch + 1, self.step, resumed)

    def resize(self, change: Resize) -> None:
        """Go on as a run resumed from ``change.state`` at the membership's new size (``engine/reports.py``)."""
        resize(self, change)

    def joined_at(self, step: int) -> None:
        self.run.step = step  # a joiner is where the members are: at the admission step (before its state comes)

    def rehearse(self) -> None:
        """On a joiner about to ask: a step thrown away, so that its first once admitted runs at the members' pace."""
        example = self.loaders.example_batch(self.batch_size)
        rehearse(self.raw_model, self.criterion, self.amp, self.optimizer, example, self.device)

    def done(self) -> bool:
        """Whether the run has reached its end (``trainer.epochs``, ``trainer.max_steps`` or ``target_top1``)."""
        t = self.cfg["trainer"]
        return self.run.epoch >= t["epochs"] or self.run.step >= self.max_steps or reached_target(self.run, t)

    def fit(self) -> dict[str, Any] | None:
        """Train until the end of the run or ``max_epochs_per_run``; return the summary (logging rank)."""
        if self.done():  # resumed from a checkpoint at its end: train nothing, write no summary
            return finished_already(self)
        self.recorder.count_wire_bytes(self.cfg["trainer"].get("netdev"))
        train_start = time.perf_counter()
        self.stop.arm()
        try:
            self.elastic.start(self.step)  # (a joiner asks here, and begins once admitted)
            self.elastic.repeat(self.train_epochs)  # (a rank healed from a peer enters again where the peer is)
        finally:
            self.stop.disarm()
            self.elastic.close()  # (a joiner still waiting is told)
        spread = partial(self.evaluation.evaluator.replica_spread, self.raw_model)
        return finish(self, time.perf_counter() - train_start, spread)

    def train_epochs(self) -> None:
        """Epochs, each followed by its evaluation and checkpoint, until the run ends or stops."""
        while self.elastic.entry(Site.END) is None:
            carried = self.elastic.entry(Site.EPOCH_END)
            if carried is not None:  # a rank healed from a peer that is past this epoch's steps
                epoch, finished, stop = carried["epoch"], carried["finished_epoch"], carried["stop"]
            elif self.done():
                return
            else:
                epoch = self.run.epoch + 1  # the epoch in progress, from 1
                finished = self.train_epoch(epoch)
                if finished is None:  # a join resharded the rest of the epoch: go on in it as a resumed run does
                    continue
                if finished:
                    self.run.finish_epoch(epoch)
                self.loop.epochs_this_run += 1
                per_run = self.cfg["trainer"]["max_epochs_per_run"]
                stop = self.stop.reached(self.step) or (per_run is not None and self.loop.epochs_this_run >= per_run)
            carry = {"loop": {"epoch": epoch, "finished_epoch": finished, "stop": stop}}
            if self.evaluation.due_at_epoch_end(epoch, finished, self.done()):
                self.elastic.run(Phase.EVALUATION, partial(self.evaluate, epoch), epoch, Site.EPOCH_END, carry)
            if self.checkpointer.due(epoch, finished, self.done(), stop):
                self.elastic.run(Phase.CHECKPOINT, partial(self.save_checkpoint, epoch), epoch, Site.EPOCH_END, carry)
            if stop or self.done():
                return

    def train_epoch(self, epoch: int) -> bool | None:
        """Train epoch ``epoch`` (from 1; or its rest); return whether it ran to its end (None: a join resharded it)."""
        t = self.cfg["trainer"]
        self.elastic.admit_if_due(epoch, Site.NONE)
        start = self.elastic.run(Phase.EPOCH_START, lambda: self.sync.on_epoch_start(epoch), epoch)
        if start is not None:  # (None on a rank healed from a peer already past the start of this epoch)
            self.apply(start, epoch, at_epoch_start=True)  # may change ranks and loaders
        torch.manual_seed(t["seed"] * 100_003 + epoch * 1_009 + self.rank)  # (per epoch and rank: reproducible)
        self.loaders.start_epoch(epoch, self.run.epoch_samples if self.run.step_in_epoch else 0)  # (mid-epoch resume)
        self.sync.module.train()
        run, show = self.run, self.membership.is_logging_rank and t["progress"]
        total = min(self.loaders.steps_per_epoch, run.step_in_epoch + self.max_steps - run.step)  # (max_steps)
        with progress_bar(total, run.step_in_epoch, f"epoch {epoch}/{t['epochs']}", show) as bar:
            carried = self.elastic.entry(Site.BETWEEN_STEPS)  # a rank healed from a peer that is between two steps
            if carried is not None and self.between_steps(epoch, carried["step_s"]):
                return self.run.step_in_epoch >= self.loaders.steps_per_epoch
            # Every rank runs the same number of steps, whatever the length of its own shard.
            batches = itertools.islice(self.loaders.train, self.loaders.steps_per_epoch - self.run.step_in_epoch)
            tick = time.perf_counter()
            for x, y in batches:
                record = self.train_step(x, y, epoch, tick)
                bar.update(1)
                if self.step % t["log_every"] == 0:
                    bar.set_postfix(loss=f"{record['loss']:.4f}", img_s=f"{record['samples_per_s']:.0f}", refresh=False)
                if self.between_steps(epoch, record["step_s"]):
                    break
                if self.run.step_in_epoch < self.loaders.steps_per_epoch:  # (else the next epoch's start admits)
                    if self.elastic.admit_if_due(epoch, Site.BETWEEN_STEPS):
                        return None
                tick = time.perf_counter()
        return self.run.step_in_epoch >= self.loaders.steps_per_epoch

    def between_steps(self, epoch: int, step_s: float) -> bool:
        """After a step of ``step_s`` seconds: an evaluation on the side, a step checkpoint; whether the epoch ends."""
        carry, run = {"loop": {"step_s": step_s}}, self.run
        if self.evaluation.due_on_the_side(run.step):
            self.elastic.run(Phase.EVALUATION, partial(self.evaluate, epoch, True), epoch, Site.BETWEEN_STEPS, carry)
        if run.step >= self.max_steps or self.stop.due(run.step, step_s) or self.evaluation.reached_target():
            return True
        if self.checkpointer.due_between_steps(run.step, run.step_in_epoch, self.loaders.steps_per_epoch):
            self.elastic.run(Phase.CHECKPOINT, lambda: self.save_checkpoint(epoch), epoch, Site.BETWEEN_STEPS, carry)
        return False

    def train_step(self, x: torch.Tensor, y: torch.Tensor, epoch: int, tick: float) -> dict[str, Any]:
        """One optimizer step on batch ``(x, y)``, fetched since ``tick``; returns its train record."""
        data_s = time.perf_counter() - tick  # (the loaders yield it ready: on the device, normalized, in its layout)
        report, result, slept = self.elastic.run(Phase.STEP, lambda: self._compute(x, y, epoch, data_s), epoch)
        exchange = lambda: self.sync.after_optimizer_step(result)  # noqa: E731
        report += self.elastic.run(Phase.EXCHANGE, exchange, epoch, carry={Phase.STEP: (report, result, slept)})
        counts, step_s, world = self.comm.take(), time.perf_counter() - tick, self.membership.size
        if result.computed:
            self.straggler.observe(result.compute_s - slept)
        loss_scale = self.amp.loss_scale
        record = self.recorder.train_record(result, counts, report.metrics, world, self.batch_size, step_s, loss_scale)
        self.apply(report, epoch)
        self.recorder.write(record, self.step)
        self.run.stepped(self.batch_size * self.loaders.train.sampler.num_replicas)
        report_skipped(self, epoch)
        return record

    def _compute(self, x: torch.Tensor, y: torch.Tensor, epoch: int, data_s: float):
        """The step up to and including the optimizer step: (report, StepResult, seconds slept by the straggler)."""
        before = self.sync.before_step(self.step)
        self.apply(before, epoch)  # before the forward: the group may have changed
        if any(isinstance(r, SkipCompute) for r in before.requests):  # (a learner catching up: its batch dropped)
            self.complete()
            lr = self.optimizer.param_groups[0]["lr"]
            return SyncReport(), StepResult(self.step, epoch, math.nan, lr, False, data_s, 0.0, computed=False), 0.0
        start = self.clock.mark()
        slept = self.straggler.delay(epoch, self.rank, self.world_size, self.clock)
        self.amp.zero_grad(self.optimizer)
        with self.amp.autocast():
            loss = self.criterion(self.sync.module(x), y)
        self.amp.backward(loss, self.optimizer)
        backward_end = self.clock.mark()
        report = self.sync.after_backward(self.step, self.amp.unscale(self.optimizer))
        self.complete()  # (before the LR is set: the optimizer's state a joiner loads has the sender's)
        lr = self.schedule.apply(self.optimizer, self.run.epoch + self.run.step_in_epoch / self.loaders.steps_per_epoch)
        stepped = self.amp.step(self.optimizer, report.grads_finite)
        loss_value = loss.item()  # the step's one drain: on a GPU, every mark above has been reached after it
        compute_s = self.clock.seconds(start, report.compute_end or backward_end)
        return report, StepResult(self.step, epoch, loss_value, lr, stepped, data_s, compute_s), slept

    def apply(self, report: SyncReport, epoch: int, at_epoch_start: bool = False) -> None:
        """Carry out a hook's report (``engine/reports.py``), following the membership changes since the last."""
        self.loop.reshard_next_epoch, scale = carry_out(self, report, epoch, at_epoch_start)
        if scale is not None:
            self.schedule.scale = scale

    def settle(self) -> None:
        """Complete the exchanges in flight and agree the replicas (``drain``, ``before_eval``), once per step."""
        self.complete()
        if self.loop.agreed_at_step != self.step:
            self.sync.drain()
            self.sync.before_eval()
            self.comm.take()
            self.loop.agreed_at_step = self.step

    def evaluate(self, epoch: int, on_the_side: bool = False) -> dict[str, Any]:
        val, replicas = self.loaders.val, self.sync.evaluates_replicas
        result = self.evaluation.evaluate(epoch, self.raw_model, replicas, val, self.settle, on_the_side)
        report_skipped(self, epoch)  # (the validation files it skipped)
        return result

    def save_checkpoint(self, epoch: int) -> None:
        """Checkpoint during or at the end of epoch ``epoch`` (from 1); the logging rank writes the main file."""
        self.settle()
        writes, stopped_by = self.membership.is_logging_rank, self.stop.stopped_by(self.step)
        if self.checkpointer.save_stateful(self, self.sync.local_state_dict(), self.step, stopped_by, writes):
            self.recorder.event({"event": "checkpoint", "path": self.checkpointer.path}, epoch, self.step)

    def close(self, left: bool = False, planned: bool = True) -> None:
        """Close files and process groups (``engine/ending.py``); ``planned``: not on an error's way out."""
        close(self, left, planned)
