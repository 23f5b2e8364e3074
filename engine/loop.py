"""The worker: build every component from the resolved config, run the step loop, evaluate, checkpoint.

Nothing here depends on which sync algorithm runs; see ``algorithms/base.py`` for the hook order.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from algorithms.base import SyncContext, SyncReport
from algorithms.comm import Communicator
from algorithms.membership import Membership
from data.common import build_data, steps_per_epoch, train_loader, val_loader
from engine import checkpoint as ckpt
from engine.metrics import MetricsWriter, NetdevCounter
from engine.optim import LRSchedule, build_optimizer, effective_lr
from models.factory import build_model, num_trainable_parameters


def select_device(name: str, local_rank: int) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


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
            dist.init_process_group(
                backend="nccl" if self.device.type == "cuda" else "gloo",
                timeout=datetime.timedelta(seconds=t["timeout_s"]),
            )
        self.membership = Membership(self.rank, self.world_size)
        self.comm = Communicator(self.membership)

        # Same seed on every rank: identical initial replicas (algorithms without DDP rely on it).
        torch.manual_seed(t["seed"])
        self.data = build_data(cfg["data"])
        self.batch_size = cfg["data"]["batch_size"]
        model = build_model(cfg["model"], self.data.num_classes, self.data.channels, self.device)
        self.raw_model = model
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
        model, self.optimizer = self.amp.setup(model, self.optimizer, self.device)
        self.raw_model = model
        self.criterion = nn.CrossEntropyLoss()

        # Position in the run; overwritten by a resumed checkpoint.
        self.epoch, self.step, self.step_in_epoch = 0, 0, 0
        self._agreed_at_step: int | None = None  # the step at which sync.before_eval() last ran
        self.last_eval: dict[str, Any] | None = None
        resume_path = ckpt.resolve_resume(t["resume"], run_dir)
        state = ckpt.load(resume_path) if resume_path else None
        if state is not None:
            self.raw_model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.amp.load_state_dict(state["amp"])
            self.schedule.load_state_dict(state["schedule"])
            self.epoch, self.step, self.step_in_epoch = state["epoch"], state["step"], state["step_in_epoch"]
            self.last_eval = state.get("last_eval")

        self.sync = instantiate(cfg["sync"])
        ctx = SyncContext(
            comm=self.comm,
            membership=self.membership,
            device=self.device,
            rebuild_loaders=self.rebuild_loaders,
            set_lr_scale=self.set_lr_scale,
            get_loss=lambda: float(self._loss.item()),
            get_lr=lambda: self._lr,
        )
        self.sync.setup(model, self.optimizer, ctx)
        if state is not None:
            self.sync.load_state_dict(self._sync_state_to_resume(state, resume_path))
        self.build_loaders()

        self.writer = None
        self.events: list[dict[str, Any]] = []
        self.logger = instantiate(cfg["logger"])
        self._become_logging_rank_if_needed()
        if state is not None:
            self.emit({"kind": "event", "event": "resume", "path": resume_path, "epoch": self.epoch, "step": self.step})
        self.console(
            f"relaxsync: {self.world_size} x {self.device.type}, model {cfg['model']['name']} "
            f"({self.num_params / 1e6:.2f} M params), sync {self.sync.name}, "
            f"{self.steps_per_epoch} steps/epoch, global batch {self.batch_size * self.world_size}, run dir {run_dir}"
        )

    # ---- helpers -------------------------------------------------------------------------------------------
    def build_loaders(self) -> None:
        """Build both loaders over the active ranks."""
        m, d = self.membership, self.cfg["data"]
        self.train_loader = train_loader(
            self.data.train, self.batch_size, d["num_workers"], m.size, m.index, self.cfg["trainer"]["seed"]
        )
        self.steps_per_epoch = steps_per_epoch(len(self.data.train), m.size, self.batch_size)
        self.val_loader = val_loader(self.data.val, self.batch_size, d["num_workers"], m.size, m.index)

    def rebuild_loaders(self, train: bool) -> None:
        """After the active ranks changed: the val loader always, the train loader if ``train`` (takes effect at
        the start of the next epoch when called mid-epoch)."""
        if train:
            self.build_loaders()
            return
        m, d = self.membership, self.cfg["data"]
        self.val_loader = val_loader(self.data.val, self.batch_size, d["num_workers"], m.size, m.index)

    def _sync_state_path(self, checkpoint_path: str) -> str:
        return os.path.join(os.path.dirname(checkpoint_path), f"sync_rank{self.rank}.pt")

    def _sync_state_to_resume(self, state: dict[str, Any], checkpoint_path: str) -> dict[str, Any]:
        if not self.sync.per_rank_state:
            return state["sync"]
        path = self._sync_state_path(checkpoint_path)
        if not os.path.isfile(path):
            print(f"relaxsync: rank {self.rank}: no {path}; {self.sync.name} state starts empty", flush=True)
            return {}
        own = ckpt.load(path, map_location=self.device)
        if own["step"] != state["step"]:
            raise ValueError(f"{path} is from step {own['step']}, the checkpoint from step {state['step']}")
        return own["sync"]

    def set_lr_scale(self, scale: float) -> None:
        self.schedule.scale = scale

    def _become_logging_rank_if_needed(self) -> None:
        """Open metrics.jsonl and the logger on the logging rank (again after the previous one left)."""
        if self.writer is None and self.membership.active and self.membership.is_logging_rank:
            self.writer = MetricsWriter(os.path.join(self.run_dir, "metrics.jsonl"))
            self.logger.start(self.run_dir, self.cfg, self.sync.name)

    def console(self, message: str) -> None:
        if self.membership.is_logging_rank:
            pbar = getattr(self, "pbar", None)
            if pbar is not None:
                pbar.write(message)
            else:
                print(message, flush=True)

    def emit(self, record: dict[str, Any]) -> None:
        """Write one record to metrics.jsonl and the logger (logging rank only)."""
        if self.writer is None:
            return
        self.writer.write(record)
        if record["kind"] != "summary":
            self.logger.log(record, step=self.step)

    def _handle_events(self, report: SyncReport, epoch: int) -> None:
        if not self.membership.active:
            return  # this rank left the run: it writes nothing more
        self._become_logging_rank_if_needed()  # the membership may have changed
        for event in report.events:
            record = {"kind": "event", "epoch": epoch, "step": self.step, **event}
            self.events.append(record)
            self.emit(record)
            message = event.get("message")
            if message:
                self.console(message)
        report.events = []

    # ---- the loop ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any] | None:
        t = self.cfg["trainer"]
        epochs_this_run = 0
        self.netdev = NetdevCounter(t["netdev"]) if t.get("netdev") else None
        train_start = time.perf_counter()
        while self.epoch < t["epochs"] and self.step < self.max_steps:
            epoch = self.epoch
            finished_epoch = self.train_epoch(epoch)
            if not self.membership.active:
                return None  # evicted: leave quietly
            if finished_epoch:
                self.epoch, self.step_in_epoch = epoch + 1, 0
            last = self.epoch >= t["epochs"] or self.step >= self.max_steps
            epochs_this_run += 1
            stop = t["max_epochs_per_run"] is not None and epochs_this_run >= t["max_epochs_per_run"]
            if last or (finished_epoch and (epoch + 1) % t["eval_every"] == 0):
                self.evaluate(epoch)
            if last or stop or (t["checkpoint_every"] and finished_epoch and (epoch + 1) % t["checkpoint_every"] == 0):
                self.save_checkpoint()
            if stop:
                break
        return self.finish(time.perf_counter() - train_start)

    def train_epoch(self, epoch: int) -> bool:
        """Train one epoch (or its rest, after a mid-epoch resume); return whether it ran to its end."""
        t = self.cfg["trainer"]
        self._handle_events(self.sync.on_epoch_start(epoch), epoch)  # may change the ranks and the loaders
        if not self.membership.active:
            return False
        # Per-epoch, per-rank RNG: augmentation and dropout are reproducible on resume from an epoch boundary.
        torch.manual_seed(t["seed"] * 100_003 + epoch * 1_009 + self.rank)
        sampler = self.train_loader.sampler
        sampler.set_epoch(epoch)
        if self.step_in_epoch:
            sampler.skip(self.step_in_epoch * self.batch_size)
        self.sync.module.train()
        from tqdm import tqdm

        show = self.membership.is_logging_rank and t["progress"]
        self.pbar = tqdm(
            total=self.steps_per_epoch,
            initial=self.step_in_epoch,
            desc=f"epoch {epoch + 1}/{t['epochs']}",
            unit="step",
            disable=not show,
            dynamic_ncols=True,
            mininterval=0.5 if sys.stderr.isatty() else 30.0,
            file=sys.stderr,
        )
        # Every rank runs the same number of steps, whatever the length of its own shard.
        batches = itertools.islice(self.train_loader, self.steps_per_epoch - self.step_in_epoch)
        tick = time.perf_counter()
        for x, y in batches:
            data_s = time.perf_counter() - tick
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            if self.cfg["model"].get("channels_last"):
                x = x.contiguous(memory_format=torch.channels_last)
            report = self.sync.before_step(self.step)
            if not self.membership.active:
                break
            start = time.perf_counter()
            slept = self.straggler.delay(epoch, self.rank, self.world_size)
            self.optimizer.zero_grad(set_to_none=True)
            with self.amp.autocast():
                loss = self.criterion(self.sync.module(x), y)
            self.amp.backward(loss, self.optimizer)
            backward_end = time.perf_counter()
            report += self.sync.after_backward(self.step, self.amp.unscale(self.optimizer))
            lr = self.schedule.apply(self.optimizer, epoch + self.step_in_epoch / self.steps_per_epoch)
            stepped = self.amp.step(self.optimizer, report.grads_finite)
            self._loss, self._lr = loss.detach(), lr
            report += self.sync.after_optimizer_step(self.step)
            report += self.comm.take()
            end = time.perf_counter()
            compute_s = (report.compute_end or backward_end) - start
            self.straggler.observe(compute_s - slept)

            world = self.membership.size
            record = {
                "kind": "train",
                "step": self.step,
                "epoch": epoch,
                "loss": loss.item(),
                "lr": lr,
                "world_size": world,
                "samples_per_s": self.batch_size * world / max(end - tick, 1e-9),
                "bytes_sent": report.bytes_sent,
                "payload_bytes": report.payload_bytes,
                "comm_s": report.comm_seconds,
                "compute_s": compute_s,
                "data_s": data_s,
                "step_s": end - tick,
            }
            if self.netdev is not None:
                record["wire_bytes"] = self.netdev.delta()  # this node's own, not a mean over ranks
            if not stepped:
                record["skipped"] = True
            if self.amp.loss_scale != 1.0:
                record["loss_scale"] = self.amp.loss_scale
            record.update(report.extra)
            self._handle_events(report, epoch)
            self.emit(record)
            self.step += 1
            self.step_in_epoch += 1
            self.pbar.update(1)
            if self.step % t["log_every"] == 0:
                self.pbar.set_postfix(
                    loss=f"{record['loss']:.4f}", img_s=f"{record['samples_per_s']:.0f}", refresh=False
                )
            if not self.membership.active or self.step >= self.max_steps:
                break
            tick = time.perf_counter()
        self.pbar.close()
        self.pbar = None
        return self.membership.active and self.step_in_epoch >= self.steps_per_epoch

    @torch.no_grad()
    def _eval_sums(self) -> list[float]:
        """loss sum, top-1 hits, top-5 hits, count over the whole validation set (each sample once)."""
        model = self.raw_model
        model.eval()
        sums = torch.zeros(4, dtype=torch.float64)
        k = min(5, self.data.num_classes)
        for x, y in self.val_loader:
            x, y = x.to(self.device), y.to(self.device)
            with self.amp.autocast():
                logits = model(x)
            logits = logits.float()
            hits = logits.topk(k, dim=1).indices.eq(y.unsqueeze(1))
            sums += torch.tensor(
                [
                    nn.functional.cross_entropy(logits, y, reduction="sum").item(),
                    hits[:, :1].sum().item(),
                    hits.sum().item(),
                    len(y),
                ],
                dtype=torch.float64,
            )
        sums = sums.to(self.device)
        self.comm.all_reduce(sums)
        self.comm.take()  # evaluation traffic is not a training step's; it stays in the totals
        model.train()
        return sums.tolist()

    def evaluate(self, epoch: int) -> dict[str, Any]:
        """Top-1/top-5 and loss over the whole validation set, each sample counted exactly once."""
        extra = {}
        if self.sync.evaluates_replicas:
            # Each rank's own replica on its shard: an unbiased estimate of the replicas' mean accuracy.
            loss_sum, top1, top5, count = self._eval_sums()
            extra = {"replica_loss": loss_sum / count, "replica_top1": 100.0 * top1 / count}
        self._bring_replicas_together()
        loss_sum, top1, top5, count = self._eval_sums()
        result = {
            "kind": "eval",
            "epoch": epoch,
            "step": self.step,
            "loss": loss_sum / count,
            "top1": 100.0 * top1 / count,
            "top5": 100.0 * top5 / count,
            "num_samples": int(count),
            **extra,
        }
        self.last_eval = result
        self.emit(result)
        replica = f", replicas' own top1 {extra['replica_top1']:.2f}%" if extra else ""
        self.console(
            f"eval epoch {epoch + 1}: top1 {result['top1']:.2f}% top5 {result['top5']:.2f}% "
            f"loss {result['loss']:.4f} ({result['num_samples']} samples){replica}"
        )
        return result

    def _bring_replicas_together(self) -> None:
        """``sync.before_eval()`` once per step: a checkpoint right after an evaluation reuses its agreement."""
        if self._agreed_at_step != self.step:
            self.sync.before_eval()
            self.comm.take()
            self._agreed_at_step = self.step

    def save_checkpoint(self) -> str | None:
        self._bring_replicas_together()
        path = os.path.join(ckpt.checkpoint_dir(self.run_dir), ckpt.LAST)
        if self.sync.per_rank_state:
            ckpt.save_atomic({"sync": self.sync.state_dict(), "step": self.step}, self._sync_state_path(path))
        if self.membership.is_logging_rank:
            state = {
                "model": self.raw_model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "amp": self.amp.state_dict(),
                "schedule": self.schedule.state_dict(),
                "sync": {} if self.sync.per_rank_state else self.sync.state_dict(),
                "epoch": self.epoch,
                "step": self.step,
                "step_in_epoch": self.step_in_epoch,
                "world_size": self.membership.size,
                "last_eval": self.last_eval,
                "config": self.cfg,
            }
            ckpt.save_atomic(state, path)
            self.emit({"kind": "event", "event": "checkpoint", "path": path, "epoch": self.epoch, "step": self.step})
        return path

    def replica_spread(self) -> float:
        """Largest difference between any active rank's parameter fingerprint and the first one's (0.0: all
        replicas hold identical parameters). One small allgather."""
        flat = torch.cat([p.detach().reshape(-1).double() for p in self.raw_model.parameters()])
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device) / flat.numel()
        fingerprint = torch.stack([flat.sum(), (flat * flat).sum(), (flat * weights).sum()])
        prints = self.comm.all_gather(fingerprint)
        self.comm.take()
        return max(float((p - prints[0]).abs().max()) for p in prints)

    def finish(self, train_s: float) -> dict[str, Any] | None:
        self.sync.finalize()
        spread = self.replica_spread()
        summary = self._summarize(train_s, spread) if self.membership.is_logging_rank else None
        # Every rank waits for the logging rank to finish logging before any of them closes its connections:
        # gloo can abort a process whose peer disappears while it still works.
        self.comm.barrier()
        return summary

    def _summarize(self, train_s: float, spread: float) -> dict[str, Any]:
        totals = self.comm.totals
        summary = {
            "kind": "summary",
            "steps": self.step,
            "epochs": self.epoch,
            "world_size": self.membership.size,
            "initial_world_size": self.membership.initial_size,
            "ranks": self.membership.ranks,
            "replica_spread": spread,
            "train_s": train_s,
            "bytes_sent": totals["bytes_sent"],
            "payload_bytes": totals["payload_bytes"],
            "comm_s": totals["comm_s"],
            "num_params": self.num_params,
            "top1": self.last_eval["top1"] if self.last_eval else None,
            "top5": self.last_eval["top5"] if self.last_eval else None,
            "val_loss": self.last_eval["loss"] if self.last_eval else None,
        }
        self.emit(summary)
        self._log_event_tables()
        self.logger.finish(summary)
        return summary

    def _log_event_tables(self) -> None:
        """One W&B table per event type (e.g. ``events/evict``), a row per occurrence."""
        by_name: dict[str, list[dict[str, Any]]] = {}
        for event in self.events:
            by_name.setdefault(event["event"], []).append(event)
        for name, rows in by_name.items():
            columns = sorted({k for row in rows for k in row if k not in ("kind", "event", "message")})
            self.logger.log_table(f"events/{name}", columns, [[_cell(row.get(c)) for c in columns] for row in rows])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if not self.membership.active:
            # Evicted: keep what was logged (finish the W&B run) and never touch the world group again.
            self.logger.finish(None)
            return
        if dist.is_initialized():
            dist.destroy_process_group()


def _cell(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool)) or value is None else json.dumps(value)


@record
def run_worker(cfg: dict[str, Any], run_dir: str) -> dict[str, Any] | None:
    """Entry point of every worker process (elastic launcher, torchrun or Slurm)."""
    trainer = Trainer(cfg, run_dir)
    try:
        return trainer.fit()
    finally:
        trainer.close()
