"""The trainer: it builds its components from the resolved config and runs epochs of steps; every other job is a
component with its own *when* and *what* (torchtitan's shape): the run's position (``engine.state``), checkpoints
(``engine.checkpoint``), evaluation (``engine.evaluate``), records (``engine.metrics``), the failure guard chosen
once (``engine.guard``), joins (``engine.joins``), a stop on SIGTERM (``engine.stop``). :meth:`Trainer.state_dict` is
the one way state is checkpointed and sent to a healed or joining rank; :meth:`Trainer.apply` carries out every
hook's report (``engine.reports``). Nothing here depends on which sync algorithm runs: ``algorithms/base.py``
states the contract.
"""

from __future__ import annotations

import itertools
import os
import time
from functools import partial
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn

from algorithms.base import StepResult, SyncContext, SyncReport
from data.common import Loaders, build_data
from distributed.clock import build_clock
from distributed.comm import Communicator
from distributed.world import configure_device, select_device
from engine.checkpoint import Checkpointer
from engine.ending import close, finish
from engine.evaluate import Evaluation, Evaluator, reached_target
from engine.failures import Phase
from engine.guard import Site, build_guard
from engine.joins import Joins, worker_membership
from engine.launchers import launcher_name
from engine.metrics import NoLogger, Recorder, progress_bar, shown
from engine.optim import build_replica
from engine.reports import carry_out
from engine.state import LoopState, RunState
from engine.stop import StopRequest
from models.factory import compile_mode, uses_channels_last


class Trainer:
    """One worker process of a data-parallel run."""

    def __init__(self, cfg: dict[str, Any], run_dir: str):
        self.cfg, self.run_dir, t = cfg, run_dir, cfg["trainer"]
        torch.set_num_threads(t["threads"])
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.device = select_device(t["device"], *local)
        configure_device(self.device, t["cudnn_benchmark"])
        self.clock = build_clock(self.device)  # compute and communication timed where they run (on a GPU: there)
        self.joining = bool(t["join"])  # a process that joins a running world (engine/joins.py)
        self.membership = worker_membership(t, self.device, self.rank, self.world_size, run_dir)
        if self.joining:  # (its id comes with its ticket)
            self.rank, self.world_size = -1, self.membership.initial_size
        self.comm = Communicator(self.membership, self.clock)
        torch.manual_seed(t["seed"])  # the same on every rank: identical initial replicas (without DDP too)
        self.data = data = build_data(cfg["data"])
        self.batch_size = cfg["data"]["batch_size"]
        self.raw_model, self.optimizer, self.amp, self.schedule, self.num_params, self.max_steps = build_replica(
            cfg, data, self.device, self.world_size
        )
        self.straggler, self.criterion = instantiate(cfg["straggler"]), nn.CrossEntropyLoss()
        channels_last = uses_channels_last(cfg["model"], self.device)  # (the batches' memory format is the model's)
        self.loaders = Loaders(data, self.batch_size, cfg["data"]["num_workers"], t["seed"], self.device, channels_last)
        self.run = RunState()
        every, every_steps = t["checkpoint_every"], t["checkpoint_every_steps"]
        self.checkpointer = Checkpointer(run_dir, self.rank, every, t["resume"], every_steps, config=cfg)
        self.stop = StopRequest(self.membership)
        state, resumed = None if self.joining else self.checkpointer.load(), None
        if state is not None:
            self.load_replica(state)
            self.run.resume(state, len(data.train), self.world_size, self.batch_size)
            resumed = self.checkpointer.resumed(state.get("world_size"), self.world_size, self.run, t["epochs"])
            # The LR scale an eviction or a lost rank set (survivors / initial ranks) belonged to the shrunk world
            # it was set in; a resumed world has all its processes, at whatever size, and the LR its size gives.
            self.schedule.scale = 1.0
        self.sync = instantiate(cfg["sync"])  # (and again where a join reshapes the run: engine/joins.py)
        self.loop = LoopState()
        if not self.joining:  # (a joining process sets up its algorithm and loaders once admitted: joins.reshape)
            self.sync.setup(self.raw_model, self.optimizer, self.context())
            if state is not None:
                self.checkpointer.restore_sync(self.sync, state, self.device)
            self.loaders.build(self.membership.size, self.membership.index)
        logger = instantiate(cfg["logger"]) if not self.done() else NoLogger()  # nothing to train, nothing to log
        self.recorder = Recorder(run_dir, cfg, self.sync.name, self.membership, logger)
        evaluator = Evaluator(self.comm, self.amp.autocast, self.device, data.num_classes)
        self.evaluation = Evaluation(t, evaluator, self.run, self.recorder)
        self.guard = build_guard(t["on_failure"], self.membership, t["hang_timeout_s"], self)
        self.joins = Joins(self.membership, t["hang_timeout_s"], self) if t["on_failure"] == "continue" else None
        if not self.done() and not self.joining:  # (a run resumed at its end writes nothing more)
            self.recorder.start(self.membership.hosts, self.run.epoch + 1, self.step, resumed)
        m = cfg["model"]
        model = [f"{self.num_params / 1e6:.2f} M params"] + ["channels_last"] * uses_channels_last(m, self.device)
        model += [f"compiled ({m['compile_backend']})"] if compile_mode(m) else []
        self.recorder.console(
            f"relaxsync: {self.world_size} x {self.device.type} ({launcher_name()}), model {m['name']} "
            f"({', '.join(model)}), sync {self.sync.name}, {self.loaders.steps_per_epoch} "
            f"steps/epoch, global batch {self.batch_size * self.world_size}, run dir {shown(run_dir)}"
        )

    @property
    def step(self) -> int:
        return self.run.step

    def state_dict(self) -> dict[str, Any]:
        """The replica, the sync algorithm's shared state and the position in the run (a checkpoint's content, the
        config aside); under ``loop``, what the loop of this invocation carries (never checkpointed)."""
        self.complete()
        return {
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "amp": self.amp.state_dict(),
            "schedule": self.schedule.state_dict(),
            "sync": self.sync.state_dict(),
            **self.run.state_dict(),
            "world_size": self.membership.size,
            "loop": self.loop.state_dict(),
        }

    def context(self, replicas_agree: bool = False) -> SyncContext:
        """What the sync algorithm works with (here, and again where a join reshapes the run)."""
        guests = (lambda steps: self.joins.guests(steps)) if self.cfg["trainer"]["on_failure"] == "continue" else None
        return SyncContext(self.comm, self.membership, self.device, replicas_agree, guests)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Become the replica of a peer's :meth:`state_dict` (this rank's own algorithm state stays its own)."""
        self.complete()  # (what arrives later must not overwrite it)
        self.load_replica(state)
        self.run.load_state_dict(state)
        self.sync.load_state_dict(state["sync"])
        self.loop.load_state_dict(state["loop"])

    def load_replica(self, state: dict[str, Any]) -> None:
        """Take the model, optimizer and AMP state of ``state`` (a checkpoint's or a peer's; a process that joins
        takes the optimizer's later, :meth:`complete`)."""
        self.raw_model.load_state_dict(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.amp.load_state_dict(state["amp"])

    def complete(self) -> None:
        """On a process that joined, before it first steps, settles or hands its state on: the rest of its state,
        which arrived while it computed (``engine/joins.py``); nothing anywhere else."""
        if self.joins is not None:
            self.joins.complete()

    def done(self) -> bool:
        """Whether the run has reached its end (``trainer.epochs``, ``trainer.max_steps`` or ``target_top1``)."""
        t = self.cfg["trainer"]
        return self.run.epoch >= t["epochs"] or self.run.step >= self.max_steps or reached_target(self.run, t)

    def fit(self) -> dict[str, Any] | None:
        """Train until the end of the run or ``max_epochs_per_run``; return the summary (logging rank)."""
        if self.done():  # resumed from a checkpoint at its end: train nothing, write no summary; return the top-1
            self.recorder.console(self.checkpointer.finished(self.run, self.cfg["trainer"]["epochs"]))
            self.comm.barrier()
            return {"top1": (self.run.last_eval or {}).get("top1"), "already_finished": True}
        self.recorder.count_wire_bytes(self.cfg["trainer"].get("netdev"))
        train_start = time.perf_counter()
        self.stop.arm()
        try:
            if self.joining:
                self.joins.enter()  # (starts the guard once this process has its id)
            else:
                self.guard.start()
            if self.joins is not None:
                self.joins.start(self.step)
            self.guard.repeat(self.train_epochs)  # (a rank healed from a peer enters again where the peer is)
        finally:
            self.stop.disarm()
            if self.joins is not None:
                self.joins.close()  # (a process still waiting to join is told)
        return finish(self, time.perf_counter() - train_start)

    def train_epochs(self) -> None:
        """Epochs, each followed by its evaluation and checkpoint, until the run ends or stops."""
        t = self.cfg["trainer"]
        while self.guard.entry(Site.END) is None:
            carried = self.guard.entry(Site.EPOCH_END)
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
                per_run = t["max_epochs_per_run"]
                stop = self.stop.reached(self.step) or (per_run is not None and self.loop.epochs_this_run >= per_run)
            carry = {"loop": {"epoch": epoch, "finished_epoch": finished, "stop": stop}}
            if self.evaluation.due_at_epoch_end(epoch, finished, self.done()):
                self.guard.run(Phase.EVALUATION, partial(self.evaluate, epoch), epoch, Site.EPOCH_END, carry)
            if self.checkpointer.due(epoch, finished, self.done(), stop):
                self.guard.run(Phase.CHECKPOINT, partial(self.save_checkpoint, epoch), epoch, Site.EPOCH_END, carry)
            if stop or self.done():
                return

    def train_epoch(self, epoch: int) -> bool | None:
        """Train epoch ``epoch`` (from 1; or its rest, after a mid-epoch resume); return whether it ran to its end
        (None: processes joined mid-epoch, and the rest of it is sharded again)."""
        t = self.cfg["trainer"]
        if self.joins is not None:
            self.joins.admit_if_due(epoch, Site.NONE)
        start = self.guard.run(Phase.EPOCH_START, lambda: self.sync.on_epoch_start(epoch), epoch)
        if start is not None:  # (None on a rank healed from a peer already past the start of this epoch)
            self.apply(start, epoch, at_epoch_start=True)  # may change ranks and loaders
        # Per-epoch, per-rank RNG: augmentation and dropout are reproducible on resume from an epoch boundary.
        torch.manual_seed(t["seed"] * 100_003 + epoch * 1_009 + self.rank)
        self.loaders.start_epoch(epoch, self.run.epoch_samples if self.run.step_in_epoch else 0)  # (mid-epoch resume)
        self.sync.module.train()
        run, show = self.run, self.membership.is_logging_rank and t["progress"]
        total = min(self.loaders.steps_per_epoch, run.step_in_epoch + self.max_steps - run.step)  # (max_steps)
        with progress_bar(total, run.step_in_epoch, f"epoch {epoch}/{t['epochs']}", show) as bar:
            carried = self.guard.entry(Site.BETWEEN_STEPS)  # a rank healed from a peer that is between two steps
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
                if self.joins is not None and self.joins.admit_if_due(epoch, Site.BETWEEN_STEPS):
                    return None
                tick = time.perf_counter()
        return self.run.step_in_epoch >= self.loaders.steps_per_epoch

    def between_steps(self, epoch: int, step_s: float) -> bool:
        """After a step (the last taking ``step_s`` seconds): an evaluation on the side, a step checkpoint; returns
        whether the epoch's steps end here (``max_steps``, a stop, the target top-1)."""
        carry, run = {"loop": {"step_s": step_s}}, self.run
        if self.evaluation.due_on_the_side(run.step):
            self.guard.run(Phase.EVALUATION, partial(self.evaluate, epoch, True), epoch, Site.BETWEEN_STEPS, carry)
        if run.step >= self.max_steps or self.stop.due(run.step, step_s) or self.evaluation.reached_target():
            return True
        if self.checkpointer.due_between_steps(run.step, run.step_in_epoch, self.loaders.steps_per_epoch):
            self.guard.run(Phase.CHECKPOINT, lambda: self.save_checkpoint(epoch), epoch, Site.BETWEEN_STEPS, carry)
        return False

    def train_step(self, x: torch.Tensor, y: torch.Tensor, epoch: int, tick: float) -> dict[str, Any]:
        """One optimizer step on batch ``(x, y)``, fetched since ``tick``; returns its train record."""
        data_s = time.perf_counter() - tick  # (the loaders yield it ready: on the device, normalized, in its layout)
        report, result, slept = self.guard.run(Phase.STEP, lambda: self._compute(x, y, epoch, data_s), epoch)
        exchange = lambda: self.sync.after_optimizer_step(result)  # noqa: E731
        report += self.guard.run(Phase.EXCHANGE, exchange, epoch, carry={Phase.STEP: (report, result, slept)})
        counts, step_s, world = self.comm.take(), time.perf_counter() - tick, self.membership.size
        self.straggler.observe(result.compute_s - slept)
        record = self.recorder.train_record(
            result, counts, report.metrics, world, self.batch_size, step_s, self.amp.loss_scale
        )
        self.apply(report, epoch)
        self.recorder.write(record, self.step)
        self.run.stepped(self.batch_size * self.loaders.train.sampler.num_replicas)
        return record

    def _compute(self, x: torch.Tensor, y: torch.Tensor, epoch: int, data_s: float):
        """The step up to and including the optimizer step: (report, StepResult, seconds slept by the straggler)."""
        self.apply(self.sync.before_step(self.step), epoch)  # before the forward: the group may have changed
        start = self.clock.mark()
        slept = self.straggler.delay(epoch, self.rank, self.world_size, self.clock)
        self.amp.zero_grad(self.optimizer)
        with self.amp.autocast():
            loss = self.criterion(self.sync.module(x), y)
        self.amp.backward(loss, self.optimizer)
        backward_end = self.clock.mark()
        report = self.sync.after_backward(self.step, self.amp.unscale(self.optimizer))
        self.complete()  # (before the LR is set: the optimizer's state a joining process loads has the sender's)
        lr = self.schedule.apply(self.optimizer, self.run.epoch + self.run.step_in_epoch / self.loaders.steps_per_epoch)
        stepped = self.amp.step(self.optimizer, report.grads_finite)
        loss_value = loss.item()  # the step's one drain: on a GPU, every mark above has been reached after it
        compute_s = self.clock.seconds(start, report.compute_end or backward_end)
        return report, StepResult(self.step, epoch, loss_value, lr, stepped, data_s, compute_s), slept

    def apply(self, report: SyncReport, epoch: int, at_epoch_start: bool = False) -> None:
        """Carry out a hook's report (``engine/reports.py``), following the membership changes since the last."""
        carry_out(self, report, epoch, at_epoch_start)

    def settle(self) -> None:
        """Complete the exchanges in flight and bring the replicas into agreement (``drain()``, ``before_eval()``),
        once per step: a checkpoint right after an evaluation reuses its agreement."""
        self.complete()
        if self.loop.agreed_at_step != self.step:
            self.sync.drain()
            self.sync.before_eval()
            self.comm.take()
            self.loop.agreed_at_step = self.step

    def evaluate(self, epoch: int, on_the_side: bool = False) -> dict[str, Any]:
        model, replicas, val = self.raw_model, self.sync.evaluates_replicas, self.loaders.val
        return self.evaluation.evaluate(epoch, model, replicas, val, self.settle, on_the_side)

    def save_checkpoint(self, epoch: int) -> None:
        """Checkpoint during or at the end of epoch ``epoch`` (from 1); the logging rank writes the main file."""
        self.settle()
        writes, stopped_by = self.membership.is_logging_rank, self.stop.stopped_by(self.step)
        if self.checkpointer.save_stateful(self, self.sync.local_state_dict(), self.step, stopped_by, writes):
            self.recorder.event({"event": "checkpoint", "path": self.checkpointer.path}, epoch, self.step)

    def close(self, left: bool = False) -> None:
        """Close files and process groups (``engine/ending.py``)."""
        close(self, left)
