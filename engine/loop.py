"""The worker: build every component from the resolved config, run the step loop, evaluate, checkpoint.

Nothing here depends on which sync algorithm runs; see ``algorithms/base.py`` for the hook order.
"""

from __future__ import annotations

import datetime
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
from engine.metrics import MetricsWriter
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
        self.total_steps = t["epochs"] * self.steps_per_epoch
        if t["max_steps"] is not None:
            self.total_steps = min(self.total_steps, t["max_steps"])
        base_lr = effective_lr(cfg["optimizer"], cfg["schedule"], self.batch_size * self.world_size)
        self.optimizer = build_optimizer(model, cfg["optimizer"], base_lr)
        self.schedule = LRSchedule(cfg["schedule"], base_lr, self.steps_per_epoch, self.total_steps)
        self.amp = instantiate(cfg["amp"])
        model, self.optimizer = self.amp.setup(model, self.optimizer, self.device)
        self.raw_model = model
        self.criterion = nn.CrossEntropyLoss()

        # Position in the run; overwritten by a resumed checkpoint.
        self.epoch, self.step, self.step_in_epoch = 0, 0, 0
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
        ctx = SyncContext(comm=self.comm, membership=self.membership, device=self.device, trainer=self)
        self.model = self.sync.setup(model, self.optimizer, ctx)
        if state is not None:
            self.sync.load_state_dict(state["sync"])
        self.build_loaders()

        self.writer = None
        self.logger = instantiate(cfg["logger"])
        if self.membership.is_logging_rank:
            self.writer = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"))
            self.logger.start(run_dir, cfg, self.sync.name)
        if state is not None:
            self.emit({"kind": "event", "event": "resume", "path": resume_path, "epoch": self.epoch, "step": self.step})
        self.console(
            f"relaxsync: {self.world_size} x {self.device.type}, model {cfg['model']['name']} "
            f"({self.num_params / 1e6:.2f} M params), sync {self.sync.name}, "
            f"{self.steps_per_epoch} steps/epoch, global batch {self.batch_size * self.world_size}, run dir {run_dir}"
        )

    # ---- helpers -------------------------------------------------------------------------------------------
    def build_loaders(self) -> None:
        """(Re)build both loaders over the active ranks (relaxed sync calls this after an eviction)."""
        m, d = self.membership, self.cfg["data"]
        self.train_loader = train_loader(
            self.data.train, self.batch_size, d["num_workers"], m.size, m.index, self.cfg["trainer"]["seed"]
        )
        self.val_loader = val_loader(self.data.val, self.batch_size, d["num_workers"], m.size, m.index)

    def rebuild_val_loader(self) -> None:
        m, d = self.membership, self.cfg["data"]
        self.val_loader = val_loader(self.data.val, self.batch_size, d["num_workers"], m.size, m.index)

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
        for event in report.events:
            self.emit({"kind": "event", "epoch": epoch, "step": self.step, **event})
            message = event.get("message")
            if message:
                self.console(message)
        report.events = []
        # Membership may have changed: the logging rank may be a new one.
        if self.membership.is_logging_rank and self.writer is None and self.membership.active:
            self.writer = MetricsWriter(os.path.join(self.run_dir, "metrics.jsonl"))
            self.logger.start(self.run_dir, self.cfg, self.sync.name)

    # ---- the loop ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any] | None:
        t = self.cfg["trainer"]
        epochs_this_run = 0
        train_start = time.perf_counter()
        while self.epoch < t["epochs"] and self.step < self.total_steps:
            epoch = self.epoch
            self.train_epoch(epoch)
            if not self.membership.active:
                return None  # evicted: leave quietly
            finished_epoch = self.step_in_epoch >= self.steps_per_epoch
            if finished_epoch:
                self.epoch, self.step_in_epoch = epoch + 1, 0
            last = self.epoch >= t["epochs"] or self.step >= self.total_steps
            epochs_this_run += 1
            stop = t["max_epochs_per_run"] is not None and epochs_this_run >= t["max_epochs_per_run"]
            if last or (finished_epoch and (epoch + 1) % t["eval_every"] == 0):
                self.evaluate(epoch)
            if last or stop or (t["checkpoint_every"] and finished_epoch and (epoch + 1) % t["checkpoint_every"] == 0):
                self.save_checkpoint()
            if stop:
                break
        return self.finish(time.perf_counter() - train_start)

    def train_epoch(self, epoch: int) -> None:
        t = self.cfg["trainer"]
        report = self.sync.on_epoch_start(epoch)
        self._handle_events(report, epoch)
        if not self.membership.active:
            return
        # Per-epoch, per-rank RNG: augmentation and dropout are reproducible on resume from an epoch boundary.
        torch.manual_seed(t["seed"] * 100_003 + epoch * 1_009 + self.rank)
        sampler = self.train_loader.sampler
        sampler.set_epoch(epoch)
        if self.step_in_epoch:
            sampler.skip(self.step_in_epoch * self.batch_size)
        self.model.train()
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
        tick = time.perf_counter()
        for x, y in self.train_loader:
            data_s = time.perf_counter() - tick
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            if self.cfg["model"].get("channels_last"):
                x = x.contiguous(memory_format=torch.channels_last)
            report = self.sync.before_step(self.step)
            start = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            with self.amp.autocast():
                loss = self.criterion(self.model(x), y)
            self.amp.backward(loss, self.optimizer)
            backward_end = time.perf_counter()
            report += self.sync.after_backward(self.step, self.amp.unscale(self.optimizer))
            lr = self.schedule.apply(self.optimizer, self.step)
            stepped = self.amp.step(self.optimizer, report.grads_finite)
            report += self.sync.after_optimizer_step(self.step)
            report += self.comm.take()
            end = time.perf_counter()

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
                "compute_s": (report.compute_end or backward_end) - start,
                "data_s": data_s,
                "step_s": end - tick,
            }
            if not stepped:
                record["skipped"] = True
            if self.amp.loss_scale != 1.0:
                record["loss_scale"] = self.amp.loss_scale
            record.update(report.extra)
            self.emit(record)
            self._handle_events(report, epoch)
            self.step += 1
            self.step_in_epoch += 1
            self.pbar.update(1)
            if self.step % t["log_every"] == 0:
                self.pbar.set_postfix(
                    loss=f"{record['loss']:.4f}", img_s=f"{record['samples_per_s']:.0f}", refresh=False
                )
            if not self.membership.active or self.step >= self.total_steps:
                break
            tick = time.perf_counter()
        self.pbar.close()
        self.pbar = None

    @torch.no_grad()
    def evaluate(self, epoch: int) -> dict[str, Any]:
        """Top-1/top-5 and loss over the whole validation set, each sample counted exactly once."""
        self.sync.before_eval()
        model = self.raw_model
        model.eval()
        sums = torch.zeros(4, dtype=torch.float64)  # loss, top1, top5, count
        k = min(5, self.data.num_classes)
        for x, y in self.val_loader:
            x, y = x.to(self.device), y.to(self.device)
            with self.amp.autocast():
                logits = model(x)
            logits = logits.float()
            topk = logits.topk(k, dim=1).indices
            hits = topk.eq(y.unsqueeze(1))
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
        loss_sum, top1, top5, count = sums.tolist()
        result = {
            "kind": "eval",
            "epoch": epoch,
            "step": self.step,
            "loss": loss_sum / count,
            "top1": 100.0 * top1 / count,
            "top5": 100.0 * top5 / count,
            "num_samples": int(count),
        }
        self.last_eval = result
        self.emit(result)
        self.console(
            f"eval epoch {epoch + 1}: top1 {result['top1']:.2f}% top5 {result['top5']:.2f}% "
            f"loss {result['loss']:.4f} ({result['num_samples']} samples)"
        )
        model.train()
        return result

    def save_checkpoint(self) -> str | None:
        self.sync.before_eval()
        self.comm.take()
        path = os.path.join(ckpt.checkpoint_dir(self.run_dir), ckpt.LAST)
        if self.membership.is_logging_rank:
            state = {
                "model": self.raw_model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "amp": self.amp.state_dict(),
                "schedule": self.schedule.state_dict(),
                "sync": self.sync.state_dict(),
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

    def finish(self, train_s: float) -> dict[str, Any] | None:
        self.sync.finalize()
        if not self.membership.is_logging_rank:
            return None
        totals = self.comm.totals
        summary = {
            "kind": "summary",
            "steps": self.step,
            "epochs": self.epoch,
            "world_size": self.membership.size,
            "initial_world_size": self.membership.initial_size,
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
        self.logger.finish(summary)
        return summary

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if dist.is_initialized():
            dist.destroy_process_group()


@record
def run_worker(cfg: dict[str, Any], run_dir: str) -> dict[str, Any] | None:
    """Entry point of every worker process (elastic launcher, torchrun or Slurm)."""
    trainer = Trainer(cfg, run_dir)
    try:
        return trainer.fit()
    finally:
        trainer.close()
