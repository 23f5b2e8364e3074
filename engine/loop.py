"""The worker: build every component from the resolved config, then run the step loop.

Nothing here depends on which sync algorithm runs: ``algorithms/base.py`` states the contract (hook order,
reports and requests, membership). The trainer delegates the rest, in the manner of torchtitan's trainer:
checkpoints to ``engine.checkpoint.Checkpointer``, records and console lines to ``engine.metrics.Recorder``,
evaluation to ``engine.evaluate.Evaluator``. A rank that leaves the run (``LeftRun``) unwinds to
:func:`run_worker`, which ends it with status 0.
"""

from __future__ import annotations

import datetime
import itertools
import os
import sys
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from algorithms.base import RebuildTrainLoader, ScaleLR, StepResult, SyncContext, SyncReport
from algorithms.comm import CommCounts, Communicator
from algorithms.membership import LeftRun, Membership, host_names
from data.common import build_data, resumed_step_in_epoch, steps_per_epoch, train_loader, val_loader
from engine.checkpoint import Checkpointer
from engine.evaluate import Evaluator
from engine.failures import CatchUp, Failures, is_collective_failure, position
from engine.metrics import NetdevCounter, NoLogger, Recorder, format_summary, shown
from engine.optim import LRSchedule, build_optimizer, effective_lr
from engine.stop import StopRequest
from models.factory import build_model, num_trainable_parameters


def select_device(name: str, local_rank: int) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(backend: str, timeout_s: float) -> None:
    """The default process group. A world restarted by the elastic agent meets in a fresh part of the agent's
    store: the first attempt's keys are still there, and gloo would try to reach a previous rank's address."""
    timeout = datetime.timedelta(seconds=timeout_s)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"relaxsync/restart{restart}", agent_store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


class Trainer:
    """One worker process of a data-parallel run."""

    def __init__(self, cfg: dict[str, Any], run_dir: str):
        self.cfg, self.run_dir = cfg, run_dir
        t = cfg["trainer"]
        torch.set_num_threads(t["threads"])
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.device = select_device(t["device"], int(os.environ.get("LOCAL_RANK", 0)))
        if not dist.is_initialized():
            init_distributed("nccl" if self.device.type == "cuda" else "gloo", t["timeout_s"])
        hosts, self.failures = host_names(), None
        if t["on_failure"] == "continue":
            # Every training collective gets a deadline: a hung peer makes it fail instead of waiting timeout_s.
            deadline = datetime.timedelta(seconds=t["hang_timeout_s"])
            group = dist.new_group(list(range(self.world_size)), timeout=deadline)
            self.membership = Membership(self.rank, self.world_size, group, hosts, timeout=deadline)
            self.failures = Failures(self.membership, t["hang_timeout_s"])
        else:
            self.membership = Membership(self.rank, self.world_size, hosts=hosts)
        self.comm = Communicator(self.membership)

        # Same seed on every rank: identical initial replicas (algorithms without DDP rely on it).
        torch.manual_seed(t["seed"])
        self.data = build_data(cfg["data"])
        self.batch_size = cfg["data"]["batch_size"]
        model = build_model(cfg["model"], self.data.num_classes, self.data.channels, self.device)
        self.num_params = num_trainable_parameters(model)
        self.steps_per_epoch = steps_per_epoch(len(self.data.train), self.world_size, self.batch_size)
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"data.batch_size={self.batch_size}: larger than a rank's shard "
                f"({len(self.data.train)} samples / {self.world_size} ranks); lower it"
            )
        self.max_steps = t["max_steps"] if t["max_steps"] is not None else float("inf")
        total_epochs = min(t["epochs"], self.max_steps / self.steps_per_epoch)
        base_lr = effective_lr(cfg["optimizer"], cfg["schedule"], self.batch_size * self.world_size)
        self.optimizer = build_optimizer(model, cfg["optimizer"], base_lr)
        self.schedule = LRSchedule(cfg["schedule"], base_lr, total_epochs)
        self.straggler = instantiate(cfg["straggler"])
        self.amp = instantiate(cfg["amp"])
        self.raw_model, self.optimizer = self.amp.setup(model, self.optimizer, self.device)
        self.criterion = nn.CrossEntropyLoss()

        # Position in the run (epochs and steps completed; epochs are numbered from 1 wherever a user reads
        # or sets them, so the epoch in progress is self.epoch + 1); overwritten by a resumed checkpoint.
        self.epoch, self.step, self.step_in_epoch = 0, 0, 0
        self.epoch_samples = 0  # samples the world trained on in the epoch in progress: a prefix of its permutation
        self.last_eval: dict[str, Any] | None = None
        self.best_eval: dict[str, Any] | None = None
        self.checkpointer = Checkpointer(run_dir, self.rank, t["checkpoint_every"], t["resume"])
        self.stop = StopRequest(self.membership)
        state = self.checkpointer.load()
        if state is not None:
            self._load_training_state(state)
            self._resume_position(state)

        self.sync = instantiate(cfg["sync"])
        self.sync.setup(self.raw_model, self.optimizer, SyncContext(self.comm, self.membership, self.device))
        if state is not None:
            self._resume_sync(state)
        self._generation = self.membership.generation  # the membership change last applied
        self._agreed_at_step: int | None = None  # the step at which sync.before_eval() last ran
        self._reshard_next_epoch = False
        self._lost: list[dict[str, Any]] = []  # rank_lost events waiting for the next completed step
        self._epochs_this_run = 0
        # The part of the loop in progress, (phase, site, carry): what a survivor left behind needs to enter there.
        self._at: tuple[str, str, dict[str, Any]] = ("step", "", {})
        self._entering: CatchUp | None = None  # set on a rank healed from the front until it reaches the front's part
        self.lost_ranks: list[int] = []
        self.build_loaders()

        logger = instantiate(cfg["logger"]) if not self.done() else NoLogger()  # nothing to train, nothing to log
        self.recorder = Recorder(run_dir, cfg, self.sync.name, self.membership, logger)
        self.evaluator = Evaluator(self.comm, self.amp.autocast, self.device, self.data.num_classes)
        if not self.done():  # (a run resumed at its end writes nothing more)
            now, hosts = self.epoch + 1, dict(enumerate(self.membership.hosts))
            self.recorder.event({"event": "world", "world_size": self.world_size, "hosts": hosts}, now, self.step)
            if state is not None:
                path, restart = self.checkpointer.resume_path, self.checkpointer.restart
                before = state.get("world_size", self.world_size)
                event = {"event": "resume", "path": path, "restart": restart, "world_size_before": before}
                self.recorder.event(event, now, self.step)
                after = f" after restart {restart}" if restart else ""
                if self.checkpointer.rejoined:
                    after = f" in torchrun job {self.checkpointer.job} after its stop"
                grown = f", {before} -> {self.world_size} ranks" if before != self.world_size else ""
                self.recorder.console(
                    f"relaxsync: resumed{after} from step {self.step} (epoch {now} of {t['epochs']}{grown}) of {path}"
                )
        self.recorder.console(
            f"relaxsync: {self.world_size} x {self.device.type}, model {cfg['model']['name']} "
            f"({self.num_params / 1e6:.2f} M params), sync {self.sync.name}, {self.steps_per_epoch} steps/epoch, "
            f"global batch {self.batch_size * self.world_size}, run dir {shown(run_dir)}"
        )

    def _training_state(self) -> dict[str, Any]:
        """What every replica needs to go on from here: the checkpoint's content (the config aside)."""
        return {
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "amp": self.amp.state_dict(),
            "schedule": self.schedule.state_dict(),
            "sync": self.sync.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "step_in_epoch": self.step_in_epoch,
            "epoch_samples": self.epoch_samples,
            "world_size": self.membership.size,
            "last_eval": self.last_eval,
            "best_eval": self.best_eval,
        }

    def _load_training_state(self, state: dict[str, Any]) -> None:
        """The replica and the position in the run of a checkpoint or of a peer (:meth:`_training_state`)."""
        self.raw_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.amp.load_state_dict(state["amp"])
        self.epoch, self.step = state["epoch"], state["step"]
        self.last_eval, self.best_eval = state.get("last_eval"), state.get("best_eval")

    def _resume_position(self, state: dict[str, Any]) -> None:
        """Where a resumed world stands in its epoch, at the checkpoint's world size or another one (torchrun grew
        or shrank the world between the stop and the restart): it skips the samples already trained on and runs
        the steps of the rest; the LR is the new world's, its schedule at the same fraction of the epoch."""
        before = state.get("world_size", self.world_size)
        self.epoch_samples = state.get("epoch_samples", state["step_in_epoch"] * self.batch_size * before)
        self.step_in_epoch = 0
        if state["step_in_epoch"]:
            n = len(self.data.train)
            self.step_in_epoch = resumed_step_in_epoch(n, self.epoch_samples, self.world_size, self.batch_size)
            if self.step_in_epoch >= self.steps_per_epoch:  # less than a step per rank was left: the epoch is done
                self.epoch, self.step_in_epoch, self.epoch_samples = self.epoch + 1, 0, 0
        # The LR scale an eviction or a lost rank set (survivors / initial ranks) applies to the shrunk world it
        # was set in; a resumed world has all its processes, at whatever size, and the LR its own size gives.
        self.schedule.scale = 1.0

    def _resume_sync(self, state: dict[str, Any]) -> None:
        self.sync.load_state_dict(state["sync"])
        own, where = self.checkpointer.load_local(state["step"], self.device)
        if own is not None:
            self.sync.load_local_state_dict(own)
        elif self.sync.local_state_dict():
            print(f"relaxsync: rank {self.rank}: {where}; {self.sync.name}'s own state starts fresh", flush=True)

    def build_loaders(self, train: bool = True) -> None:
        """Shard the validation set (and, if ``train``, the training set) over the active ranks."""
        m, d = self.membership, self.cfg["data"]
        if train:
            self.train_loader = train_loader(
                self.data.train, self.batch_size, d["num_workers"], m.size, m.index, self.cfg["trainer"]["seed"]
            )
            self.steps_per_epoch = steps_per_epoch(len(self.data.train), m.size, self.batch_size)
        self.val_loader = val_loader(self.data.val, self.batch_size, d["num_workers"], m.size, m.index)

    # ---- what hooks report, applied -------------------------------------------------------------------------
    def apply(self, report: SyncReport, epoch: int, at_epoch_start: bool = False) -> None:
        """Follow a membership change, record the hook's events and carry out its requests."""
        changed = self.membership.generation != self._generation
        if changed:
            self._generation = self.membership.generation
            self.sync.on_membership_change()
            self.recorder.elect()  # the logging rank may have left
        for event in report.events:
            self.recorder.event(event, epoch, self.step)
        reshard = any(isinstance(r, RebuildTrainLoader) for r in report.requests)
        # The training shards change only between epochs: asked mid-epoch, the epoch finishes on the old ones.
        train_now = at_epoch_start and (reshard or self._reshard_next_epoch)
        if changed or train_now:
            self.build_loaders(train=train_now)
        self._reshard_next_epoch = (self._reshard_next_epoch or reshard) and not train_now
        if changed or reshard:
            loaders = ["train", "val"] if reshard else ["val"]
            event = {"event": "loader_rebuilt", "loaders": loaders, "world_size": self.membership.size}
            self.recorder.event({**event, "deferred_to_next_epoch": reshard and not at_epoch_start}, epoch, self.step)
        for request in report.requests:
            if isinstance(request, ScaleLR):
                self.schedule.scale = request.scale
                event = {"event": "lr_adjusted", "scale": request.scale, "policy": request.policy}
                self.recorder.event({**event, "world_size": self.membership.size}, epoch, self.step)

    # ---- the loop ------------------------------------------------------------------------------------------
    def done(self) -> bool:
        """Whether the run has reached its end (``trainer.epochs``, ``trainer.max_steps`` or ``target_top1``)."""
        return self.epoch >= self.cfg["trainer"]["epochs"] or self.step >= self.max_steps or self.reached_target()

    def reached_target(self) -> bool:
        """Whether an evaluation reached ``trainer.target_top1`` (kept in the checkpoint's best evaluation)."""
        target = self.cfg["trainer"]["target_top1"]
        return target is not None and self.best_eval is not None and self.best_eval["top1"] >= target

    @property
    def last_epoch(self) -> int:
        """The last epoch trained in, from 1 (the one in progress when a run stopped within it)."""
        return self.epoch + (1 if self.step_in_epoch else 0)

    def fit(self) -> dict[str, Any] | None:
        """Train until the end of the run or ``max_epochs_per_run``; return the summary (logging rank)."""
        t = self.cfg["trainer"]
        if self.done():
            return self.already_finished()
        self.netdev = NetdevCounter(t["netdev"]) if t.get("netdev") else None
        train_start = time.perf_counter()
        self.stop.arm()
        if self.failures is not None:
            self.failures.heartbeat.start()
        try:
            while True:
                try:
                    self.train_epochs()
                    break
                except CatchUp:
                    pass  # this rank now holds the state of the survivors ahead of it: enter where they are
        finally:
            self.stop.disarm()
        return self.finish(time.perf_counter() - train_start)

    def train_epochs(self) -> None:
        """Epochs, each followed by its evaluation and checkpoint, until the run ends or stops."""
        t = self.cfg["trainer"]
        while True:
            entering = self._entering
            if entering is not None and entering.phase in ("end", "exit"):
                return
            if entering is not None and entering.site == "epoch end":  # the front is past this epoch's steps
                epoch, finished_epoch, stop = (entering.carry["loop"][k] for k in ("epoch", "finished_epoch", "stop"))
            else:
                if self.done():
                    return
                epoch = self.epoch + 1  # the epoch in progress, from 1
                finished_epoch = self.train_epoch(epoch)
                if finished_epoch:
                    self.epoch, self.step_in_epoch, self.epoch_samples = epoch, 0, 0
                self._epochs_this_run += 1
                stop = self.stop.reached(self.step) or (
                    t["max_epochs_per_run"] is not None and self._epochs_this_run >= t["max_epochs_per_run"]
                )
            carry = {"loop": {"epoch": epoch, "finished_epoch": finished_epoch, "stop": stop}}
            # (a run that reached its target top-1 ends on the evaluation that showed it; one on the side at this
            # very step measured the replicas' average already)
            again = self.reached_target() or (self.last_eval is not None and self.last_eval["step"] == self.step)
            if (self.done() or (finished_epoch and epoch % t["eval_every"] == 0)) and not again:
                self._survive(partial(self.evaluate, epoch), epoch, "evaluation", "epoch end", carry)
            if self.checkpointer.due(epoch, finished_epoch, self.done(), stop):
                self._survive(partial(self.save_checkpoint, epoch), epoch, "checkpoint", "epoch end", carry)
            if stop or self.done():
                return

    def already_finished(self) -> dict[str, Any]:
        """A resumed run whose checkpoint is at its end: say so, train nothing, write no summary; return the
        final top-1 (what a sweeper reads)."""
        t, last = self.cfg["trainer"], self.last_eval or {}
        top1 = f"; final top-1 {last['top1']:.2f}%" if last else ""
        self.recorder.console(
            f"relaxsync: already finished: {self.checkpointer.resume_path} is at step {self.step}, "
            f"epoch {self.last_epoch} of {t['epochs']}{top1}; nothing to train"
        )
        self.comm.barrier()
        return {"top1": last.get("top1"), "already_finished": True}

    def train_epoch(self, epoch: int) -> bool:
        """Train epoch ``epoch`` (from 1; or its rest, after a mid-epoch resume); return whether it ran to its end."""
        from tqdm import tqdm

        t = self.cfg["trainer"]
        start = self._survive(partial(self.sync.on_epoch_start, epoch), epoch, "epoch start")
        if start is not None:  # (None on a rank catching up with survivors already past the start of this epoch)
            self.apply(start, epoch, at_epoch_start=True)  # may change ranks and loaders
        # Per-epoch, per-rank RNG: augmentation and dropout are reproducible on resume from an epoch boundary.
        torch.manual_seed(t["seed"] * 100_003 + epoch * 1_009 + self.rank)
        sampler = self.train_loader.sampler
        sampler.set_epoch(epoch)
        if self.step_in_epoch:  # resumed mid-epoch
            sampler.skip(self.epoch_samples)
        self.sync.module.train()
        steps = min(self.steps_per_epoch, self.step_in_epoch + self.max_steps - self.step)  # max_steps may cap it
        bar = tqdm(
            total=steps,
            initial=self.step_in_epoch,
            desc=f"epoch {epoch}/{t['epochs']}",
            unit="step",
            disable=not (self.membership.is_logging_rank and t["progress"]),
            dynamic_ncols=True,
            mininterval=0.5 if sys.stderr.isatty() else 30.0,
            file=sys.stderr,
        )
        with bar:
            entering = self._entering
            if entering is not None and entering.site == "between steps":  # the front is between two steps
                if self.between_steps(epoch, entering.carry["loop"]["step_s"]):
                    return self.step_in_epoch >= self.steps_per_epoch
            # Every rank runs the same number of steps, whatever the length of its own shard.
            batches = itertools.islice(self.train_loader, self.steps_per_epoch - self.step_in_epoch)
            tick = time.perf_counter()
            for x, y in batches:
                record = self.train_step(x, y, epoch, tick)
                bar.update(1)
                if self.step % t["log_every"] == 0:
                    bar.set_postfix(loss=f"{record['loss']:.4f}", img_s=f"{record['samples_per_s']:.0f}", refresh=False)
                if self.between_steps(epoch, record["step_s"]):
                    break
                tick = time.perf_counter()
        return self.step_in_epoch >= self.steps_per_epoch

    def between_steps(self, epoch: int, step_s: float) -> bool:
        """After a step (the last taking ``step_s`` seconds): an evaluation on the side, a step checkpoint; returns
        whether the epoch's steps end here (``max_steps``, a stop, the target top-1)."""
        t = self.cfg["trainer"]
        every, peek = t["checkpoint_every_steps"], t["eval_every_steps"]
        carry = {"loop": {"step_s": step_s}}
        if peek and self.step % peek == 0:
            evaluate = partial(self.evaluate, epoch, on_the_side=True)
            self._survive(evaluate, epoch, "evaluation", "between steps", carry)
        if self.step >= self.max_steps or self.stop.due(self.step, step_s) or self.reached_target():
            return True
        if every and self.step % every == 0 and self.step_in_epoch < self.steps_per_epoch:
            # (at the end of an epoch, the epoch's own checkpoint follows)
            self._survive(partial(self.save_checkpoint, epoch), epoch, "checkpoint", "between steps", carry)
        return False

    def train_step(self, x: torch.Tensor, y: torch.Tensor, epoch: int, tick: float) -> dict[str, Any]:
        """One optimizer step on batch ``(x, y)``, fetched since ``tick``; returns its train record."""
        data_s = time.perf_counter() - tick
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if self.cfg["model"].get("channels_last"):
            x = x.contiguous(memory_format=torch.channels_last)
        # Each phase is redone on the survivors' group if a peer is lost in it (trainer.on_failure: continue).
        report, result, slept = self._survive(lambda: self._compute(x, y, epoch, data_s), epoch, "step")
        exchange = partial(self.sync.after_optimizer_step, result)
        report += self._survive(exchange, epoch, "exchange", carry={"step": (report, result, slept)})
        counts = self.comm.take()
        step_s = time.perf_counter() - tick
        self.straggler.observe(result.compute_s - slept)
        record = self._train_record(result, counts, report, step_s)
        self.apply(report, epoch)
        self.recorder.write(record, self.step)
        self._record_losses(epoch)
        self.step += 1
        self.step_in_epoch += 1
        self.epoch_samples += self.batch_size * self.train_loader.sampler.num_replicas
        return record

    def _compute(self, x: torch.Tensor, y: torch.Tensor, epoch: int, data_s: float):
        """The step up to and including the optimizer step: (report, StepResult, seconds slept by the straggler)."""
        self.apply(self.sync.before_step(self.step), epoch)  # before the forward: the group may have changed
        start = time.perf_counter()
        slept = self.straggler.delay(epoch, self.rank, self.world_size)
        self.optimizer.zero_grad(set_to_none=True)
        with self.amp.autocast():
            loss = self.criterion(self.sync.module(x), y)
        self.amp.backward(loss, self.optimizer)
        backward_end = time.perf_counter()
        report = self.sync.after_backward(self.step, self.amp.unscale(self.optimizer))
        compute_s = (report.compute_end or backward_end) - start
        lr = self.schedule.apply(self.optimizer, self.epoch + self.step_in_epoch / self.steps_per_epoch)
        stepped = self.amp.step(self.optimizer, report.grads_finite)
        return report, StepResult(self.step, epoch, loss.item(), lr, stepped, data_s, compute_s), slept

    def _survive(self, run, epoch: int, phase: str, site: str = "", carry: dict[str, Any] | None = None):
        """``run()``; if a collective in it fails because a peer is gone, agree with the other survivors on who is
        gone, regroup, and run it again. ``phase`` names what is redone: the ``step`` up to the optimizer, the
        ``exchange`` after it (the optimizer has stepped), an ``evaluation``, a ``checkpoint``, the ``end`` (the
        replicas' spread), the ``exit`` barrier (after the summary: a loss there is not recorded). ``site`` tells
        apart the places an evaluation or a checkpoint happens (``between steps``, ``epoch end``); ``carry`` is what
        a rank healed from this one needs to enter here: what the parts before it would have handed on, by phase.

        On a rank catching up with the front (:class:`CatchUp`), every part before the front's returns at once
        with what the front carried from it (None for most), and the front's own part runs."""
        entering = self._entering
        if entering is not None:
            if (phase, site) != (entering.phase, entering.site):
                return entering.carry.get(phase)
            if self.step != entering.step:
                raise RuntimeError(f"rank {self.rank} entered the {phase} at step {self.step}, not {entering.step}")
            self._entering = None
        self._at = (phase, site, carry or {})
        self.recorder.at = [self.step, phase]
        while True:
            try:
                result = run()
                # (a step records its losses after its train record; after the summary nothing is recorded)
                if phase not in ("step", "exchange", "exit"):
                    self._record_losses(epoch)
                return result
            except Exception as error:
                if self.failures is None or not is_collective_failure(error):
                    raise
                self._recover(error, epoch, phase)

    def _recover(self, error: BaseException, epoch: int, phase: str) -> None:
        """After ``error`` in ``phase``: agree on who is gone and regroup; on a survivor one collective behind the
        others, take the state of the first of them and raise :class:`CatchUp`."""
        detected = time.time()
        recovery = self.failures.recover(error, self.step, phase)
        change, event = recovery.change, recovery.event
        self._lost.append({**event, "detected_at": detected, "lost_state_bytes": self._local_state_bytes()})
        self.lost_ranks += change.removed
        healed = ""
        if recovery.behind:
            healed = f"; rank(s) {recovery.behind} were a collective behind: they take rank {recovery.source}'s state"
        self.recorder.console(
            f"relaxsync: rank(s) {change.removed} {event['cause']} at step {event['failed_step']}; "
            f"{len(change.ranks)} ranks go on and redo the {event['redo']} of step {recovery.front[0]}{healed}"
        )
        self.apply(SyncReport(requests=self._shrink_requests()), epoch)
        snapshot = self.failures.heal(recovery, partial(self._snapshot, front=recovery.front))
        if snapshot is not None:
            self._catch_up(snapshot)

    def _snapshot(self, behind: list, front: list) -> dict[str, Any]:
        """What a survivor that failed at ``behind`` needs to go on from here, the ``front``: this replica's state
        and position, the records written since ``behind`` (it may be the logging rank) and this part's carry."""
        phase, site, carry = self._at
        records = [r for at, r in self.recorder.history if position(behind) <= position(at) < position(front)]
        return {
            "state": self._training_state(),
            "loop": {
                "agreed_at_step": self._agreed_at_step,
                "reshard_next_epoch": self._reshard_next_epoch,
                "epochs_this_run": self._epochs_this_run,
            },
            "records": records,
            "entry": {"step": self.step, "phase": phase, "site": site, "carry": carry},
        }

    def _catch_up(self, snapshot: dict[str, Any]) -> None:
        """Become the replica the front sent (its own per-rank algorithm state stays this rank's), write the records
        it missed and enter the loop where the front is."""
        state, loop = snapshot["state"], snapshot["loop"]
        self._load_training_state(state)
        self.step_in_epoch, self.epoch_samples = state["step_in_epoch"], state["epoch_samples"]
        self.sync.load_state_dict(state["sync"])
        self._agreed_at_step = loop["agreed_at_step"]
        self._reshard_next_epoch = self._reshard_next_epoch or loop["reshard_next_epoch"]
        self._epochs_this_run = loop["epochs_this_run"]
        self.recorder.replay(snapshot["records"])
        entry = snapshot["entry"]
        self._entering = CatchUp(entry["step"], entry["phase"], entry["site"], entry["carry"])
        raise self._entering

    def _record_losses(self, epoch: int) -> None:
        """Write the ``rank_lost`` events of losses recovered from, now that what was in flight is done again."""
        for event in self._lost:
            event["recovery_s"] = time.time() - event["detected_at"]  # from the failure to this completion
            self.recorder.event(event, epoch, self.step)
        self._lost.clear()

    def _shrink_requests(self) -> list:
        """After a loss, as after an eviction: the survivors cover the training set from the next epoch on, and
        the learning rate follows the relaxed-sync policy (``sync.lr_policy`` when set, else linear)."""
        policy = self.cfg["sync"].get("lr_policy", "linear")
        requests: list = [RebuildTrainLoader()]
        if policy != "none":
            fraction = self.membership.size / self.membership.initial_size
            requests.append(ScaleLR(fraction if policy == "linear" else fraction**0.5, policy))
        return requests

    def _local_state_bytes(self) -> int:
        """Bytes of this rank's own algorithm state (DGC residuals, local momenta): what a lost rank took with it."""
        state = self.sync.local_state_dict()
        return sum(v.numel() * v.element_size() for v in _tensors(state))

    def _train_record(self, r: StepResult, counts: CommCounts, report: SyncReport, step_s: float) -> dict[str, Any]:
        world = self.membership.size
        record = {
            "kind": "train",
            "step": r.step,
            "epoch": r.epoch,
            "loss": r.loss,
            "lr": r.lr,
            "world_size": world,
            "samples_per_s": self.batch_size * world / max(step_s, 1e-9),
            "bytes_sent": counts.bytes_sent,
            "payload_bytes": counts.payload_bytes,
            "comm_s": counts.comm_s,
            "compute_s": r.compute_s,
            "data_s": r.data_s,
            "step_s": step_s,
        }
        if self.netdev is not None:
            record["wire_bytes"] = self.netdev.delta()  # this node's own, not a mean over ranks
        if not r.stepped:
            record["skipped"] = True
        if self.amp.loss_scale != 1.0:
            record["loss_scale"] = self.amp.loss_scale
        record.update(report.metrics)
        return record

    # ---- evaluation, checkpoints, the end --------------------------------------------------------------------
    def _agree_replicas(self) -> None:
        """``sync.drain()`` and ``sync.before_eval()`` once per step: a checkpoint right after an evaluation reuses
        its agreement."""
        if self._agreed_at_step != self.step:
            self.sync.drain()
            self.sync.before_eval()
            self.comm.take()
            self._agreed_at_step = self.step

    def evaluate(self, epoch: int, on_the_side: bool = False) -> dict[str, Any]:
        """Top-1/top-5 and loss over the whole validation set, each sample counted exactly once; with replicas
        that differ (gossip), also each replica's own accuracy before they are brought together. ``on_the_side``
        (``trainer.eval_every_steps``): of the replicas' average formed on a copy, leaving training untouched."""
        start = time.perf_counter()
        extra = {}
        if self.sync.evaluates_replicas:
            replica = self.evaluator.measure(self.raw_model, self.val_loader)
            extra = {"replica_loss": replica["loss"], "replica_top1": replica["top1"]}
        if on_the_side:
            whole = self.evaluator.measure_average(self.raw_model, self.val_loader)
        else:
            self._agree_replicas()
            whole = self.evaluator.measure(self.raw_model, self.val_loader)
        result = {
            "kind": "eval",
            "epoch": epoch,
            "step": self.step,
            "loss": whole["loss"],
            "top1": whole["top1"],
            "top5": whole["top5"],
            "num_samples": int(whole["count"]),
            **extra,
            "eval_s": time.perf_counter() - start,  # (time-to-accuracy measures leave it out)
        }
        if on_the_side:
            result["on_the_side"] = True
        if getattr(self, "netdev", None) is not None:  # what the interface sent for it, kept out of the next step's
            result["wire_bytes"] = self.netdev.delta()
        self.last_eval = result
        reached = self.reached_target()
        if self.best_eval is None or result["top1"] > self.best_eval["top1"]:
            self.best_eval = result
        if self.reached_target() and not reached:
            target = self.cfg["trainer"]["target_top1"]
            self.recorder.console(f"relaxsync: target top-1 {target}% reached at step {self.step}; the run ends here")
        self.recorder.write(result, self.step)
        replica_note = f", replicas' own top1 {extra['replica_top1']:.2f}%" if extra else ""
        self.recorder.console(
            f"eval epoch {epoch}: top1 {result['top1']:.2f}% top5 {result['top5']:.2f}% "
            f"loss {result['loss']:.4f} ({result['num_samples']} samples){replica_note}"
        )
        return result

    def save_checkpoint(self, epoch: int) -> None:
        """Checkpoint during or at the end of epoch ``epoch`` (from 1)."""
        self._agree_replicas()
        state = None
        if self.membership.is_logging_rank:
            state = {**self._training_state(), "config": self.cfg}
        stopped_by = self.stop.name if self.stop.reached(self.step) else None
        self.checkpointer.save(state, self.sync.local_state_dict(), self.step, stopped_by)
        if state is not None:
            self.recorder.event({"event": "checkpoint", "path": self.checkpointer.path}, epoch, self.step)

    def finish(self, train_s: float) -> dict[str, Any] | None:
        """End of this invocation: the summary record and the console block (logging rank), then a barrier."""
        self.sync.drain()
        self.sync.finalize()
        while True:
            try:
                spread = self._survive(lambda: self.evaluator.replica_spread(self.raw_model), self.last_epoch, "end")
                break
            except CatchUp:
                pass  # the others measured the spread and wait at the exit: enter there
        summary = None
        if self.membership.is_logging_rank:
            m, totals, last, best = self.membership, self.comm.totals, self.last_eval or {}, self.best_eval or {}
            summary = {
                "kind": "summary",
                "finished": self.done(),
                "steps": self.step,
                "epochs": self.epoch,  # completed
                "epoch": self.last_epoch,
                "world_size": m.size,
                "initial_world_size": m.initial_size,
                "ranks": m.ranks,
                "evictions": m.initial_size - m.size - len(self.lost_ranks),
                "evicted_ranks": sorted(set(range(m.initial_size)) - set(m.ranks) - set(self.lost_ranks)),
                "lost_ranks": sorted(self.lost_ranks),  # died or hung (trainer.on_failure: continue)
                "replica_spread": spread,
                "stopped_by": self.stop.name if self.stop.reached(self.step) and not self.done() else None,
                "train_s": train_s,
                "steps_this_run": self.recorder.steps.count,
                **self.recorder.steps.summary(),
                "bytes_sent": totals.bytes_sent,
                "payload_bytes": totals.payload_bytes,
                "comm_s": totals.comm_s,
                "num_params": self.num_params,
                "top1": last.get("top1"),
                "top5": last.get("top5"),
                "val_loss": last.get("loss"),
                "best_top1": best.get("top1"),
                "best_epoch": best.get("epoch"),
                "reached_target": self.reached_target() if self.cfg["trainer"]["target_top1"] is not None else None,
            }
            self.recorder.finish(summary, self.step)
            self.recorder.console(format_summary(summary, self.cfg["trainer"], self.run_dir))
        # Every rank waits for the logging rank to finish logging before any of them closes its connections:
        # gloo can abort a process whose peer disappears while it still works.
        self._survive(self.comm.barrier, self.last_epoch, "exit", carry={"end": spread})
        return summary

    def close(self, left: bool = False) -> None:
        """Close files; a rank that ``left`` the run never touches a process group again."""
        if self.failures is not None:
            self.failures.heartbeat.stop()
        self.recorder.close(left)
        if not left and dist.is_initialized():
            dist.destroy_process_group()


def _tensors(state: Any):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _tensors(value)


@record
def run_worker(cfg: dict[str, Any], run_dir: str) -> dict[str, Any] | None:
    """Entry point of every worker process (elastic launcher, torchrun or Slurm)."""
    trainer = Trainer(cfg, run_dir)
    left = False
    try:
        return trainer.fit()
    except LeftRun:
        left = True  # it said why when it left; it exits 0
        return None
    finally:
        trainer.close(left)
