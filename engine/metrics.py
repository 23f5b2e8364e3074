"""Metrics: ``metrics.jsonl`` (always) and an optional experiment logger (W&B), on the logging rank only.

One JSON object per line, ``kind`` in {train, eval, event, summary}; the logger receives the same values under
``<kind>/<key>`` names (``train/loss``, ``comm/bytes_sent``, ...). :class:`Recorder` is the trainer's side of
it: which rank writes, the records, the console lines and the W&B event tables.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from engine.launchers import launcher_name, world_id
from engine.rundir import Lease
from errors import ConfigError, require

# Train-record keys that W&B files under comm/ rather than train/ (summary totals stay under summary/).
COMM_KEYS = ("bytes_sent", "payload_bytes", "comm_s", "wire_bytes")
CONFIG_FILE = "config.yaml"  # the resolved config, saved in the run dir


class NetdevCounter:
    """Bytes a network interface has sent since the previous reading (``trainer.netdev``).

    Reads the kernel's counter, ``/sys/class/net/<name>/statistics/tx_bytes``: everything this machine (or
    network namespace) sent on it, protocol headers and other processes included, so a check of ``bytes_sent``
    against it is exact only with one worker per node and the interface used for nothing else."""

    def __init__(self, name: str, root: str = "/sys/class/net"):
        self.path = os.path.join(root, name, "statistics", "tx_bytes")
        self._last = self._read()

    def _read(self) -> int:
        with open(self.path) as f:
            return int(f.read())

    def delta(self) -> int:
        now = self._read()
        delta, self._last = now - self._last, now
        return delta


class MetricsWriter:
    """Append-only JSON lines, flushed per record so a crash loses nothing written."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._file = open(path, "a", buffering=1)  # line-buffered

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, default=float) + "\n")

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``, which may be read while it is written: a last line without its newline
    is a record still being written (an append that crosses a page boundary is not atomic against a reader), or
    one a crash cut short, and is left out."""
    with open(path) as f:
        text = f.read()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


class ExperimentLogger:
    """Do-nothing logger; subclasses send records somewhere."""

    def __init__(self, **_: Any):
        pass

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        pass

    def start(self, run_dir: str, config: dict[str, Any], sync_name: str) -> None:
        pass

    def log(self, record: dict[str, Any], step: int | None = None) -> None:
        pass

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        pass

    def finish(self, summary: dict[str, Any] | None) -> None:
        """End the run; ``summary`` is None on a rank that leaves early (evicted)."""

    def describe(self) -> str | None:
        """Where this logger's run is, and how to read it, for the console; None if there is nothing to say."""
        return None


class NoLogger(ExperimentLogger):
    """``logger=none``: metrics.jsonl only."""


def wandb_keys(record: dict[str, Any], lists: bool = False) -> dict[str, Any]:
    """``{"kind": "train", "loss": 1.0, "bytes_sent": 8}`` -> ``{"train/loss": 1.0, "comm/bytes_sent": 8}``;
    numbers only, and with ``lists`` also lists of numbers (e.g. a summary's evicted ranks)."""
    kind = record.get("kind", "train")
    out = {}
    for key, value in record.items():
        number = isinstance(value, (int, float, bool))
        numbers = lists and isinstance(value, list) and all(isinstance(v, (int, float)) for v in value)
        if key in ("kind", "time") or not (number or numbers):  # (W&B stamps its own time)
            continue
        prefix = "comm" if kind == "train" and key in COMM_KEYS else kind
        out[f"{prefix}/{key}"] = value
    return out


class WandbLogger(ExperimentLogger):
    """Weights & Biases (offline by default). The run config is the resolved Hydra config."""

    MODES = ("offline", "online", "disabled")

    def __init__(
        self,
        project: str = "relaxsync",
        entity: str | None = None,
        group: str | None = None,
        mode: str = "offline",
        tags: list[str] | None = None,
    ):
        self.project, self.entity, self.group, self.mode = project, entity, group, mode
        self.tags = list(tags or [])
        self.run = None

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        require(section["mode"] in cls.MODES, "logger.mode", section["mode"], "one of offline, online, disabled")
        try:
            import wandb  # noqa: F401
        except ImportError as exc:
            raise ConfigError("logger", "wandb", "the wandb package installed (or logger=none)") from exc

    def start(self, run_dir, config, sync_name):
        import wandb

        # The id is a function of the run dir: a resumed run, or a new logging rank after the previous one
        # was evicted, continues the same W&B run.
        run_id = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:16]
        self.run = wandb.init(
            id=run_id,
            resume="allow",
            project=self.project,
            entity=self.entity,
            group=self.group or sync_name,
            tags=[sync_name, *self.tags],
            mode=self.mode,
            dir=run_dir,
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, record, step=None):
        if self.run is not None:
            self._guarded(lambda: self.run.log(wandb_keys(record), step=step))

    def log_table(self, name, columns, rows):
        if self.run is not None and rows:
            import wandb

            self._guarded(lambda: self.run.log({name: wandb.Table(columns=columns, data=rows)}))

    def finish(self, summary):
        if self.run is not None:

            def finish() -> None:
                for key, value in wandb_keys(summary or {}, lists=True).items():
                    self.run.summary[key] = value
                self.run.finish()

            self._guarded(finish)
            self.run = None

    def _guarded(self, call: Callable[[], Any]) -> None:
        """W&B is a copy of metrics.jsonl: its failure (Slurm signals every process of a job step, W&B's service
        process among them, and it ends on SIGTERM) ends the W&B run for this process, never the training run."""
        try:
            call()
        except Exception as error:
            run, self.run = self.run, None
            print(
                f"relaxsync: W&B run {run.id} stopped logging ({type(error).__name__}: {error}); metrics.jsonl keeps "
                "every record, and a resumed run continues the W&B run",
                file=sys.stderr,
                flush=True,
            )

    def describe(self):
        if self.run is None:
            return None
        where = shown(os.path.dirname(self.run.dir))  # <run dir>/wandb/<mode>-run-<time>-<id>
        if self.mode == "offline":
            return f"W&B offline run in {where}; upload it later with: wandb sync {where}"
        return f"W&B {self.mode} run {self.run.id} ({where})"


class Recorder:
    """The trainer's records and console lines, written by the logging rank (the lowest active one) only.

    Every rank holds one; when the logging rank leaves the run, the next lowest opens ``metrics.jsonl`` and
    ``train.log`` (in append mode) and the same W&B run (its id is a function of the run dir) at the next
    membership change. Every rank also keeps the run's step statistics, so whichever rank ends up logging can
    summarize the whole run, and hands every record it writes to its :attr:`observers` (the failure guard keeps
    the latest, for a logging rank healed from a peer that must write the ones it missed)."""

    def __init__(self, run_dir: str, cfg: dict[str, Any], sync_name: str, membership: Any, logger: ExperimentLogger):
        self.run_dir, self.cfg, self.sync_name = run_dir, cfg, sync_name
        self.membership, self.logger = membership, logger
        self.writer: MetricsWriter | None = None
        self._log: Any = None  # <run dir>/train.log, the console's copy
        self.events: list[dict[str, Any]] = []  # every event record, for the W&B tables at the end
        self.steps = StepStats()
        self.observers: list[Callable[[dict[str, Any]], None]] = []  # called with every record, on every rank
        self.netdev: NetdevCounter | None = None  # trainer.netdev: the interface whose bytes records carry
        self.lease: Lease | None = None  # the logging rank's hold on the run dir
        self.elect()

    def elect(self) -> None:
        """Open metrics.jsonl, train.log and the logger if this rank is (now) the logging rank; save the resolved
        config beside them (under any launcher)."""
        if self.writer is not None or not self.membership.is_logging_rank:
            return
        # One world per run dir: a second one started into it stops here, before writing anything (engine.rundir).
        self.lease = Lease(self.run_dir, world_id())
        self.lease.take()
        self.writer = MetricsWriter(os.path.join(self.run_dir, "metrics.jsonl"))
        self._log = open(os.path.join(self.run_dir, "train.log"), "a", buffering=1)
        save_config(self.cfg, os.path.join(self.run_dir, CONFIG_FILE))
        self.logger.start(self.run_dir, self.cfg, self.sync_name)
        where = self.logger.describe()
        if where:
            self.console(f"relaxsync: {where}")

    def write(self, record: dict[str, Any], step: int) -> None:
        """One record to metrics.jsonl and the logger (a no-op off the logging rank)."""
        if record["kind"] == "train":
            self.steps.add(record)
        # The wall clock (seconds since the epoch), for time-to-X measures; in the file only (the record itself
        # may be kept, e.g. the last evaluation in the checkpoint, and must not depend on when it was written).
        stamped = {**record, "time": record.get("time", time.time())}
        if self.writer is not None:
            self.writer.write(stamped)
            if record["kind"] != "summary":
                self.logger.log(record, step=step)
        for observe in self.observers:
            observe(stamped)

    def event(self, event: dict[str, Any], epoch: int, step: int) -> None:
        """An event record (``epoch`` 1-based, as everywhere a user reads); its ``message``, if any, also goes to
        the console."""
        record = {"kind": "event", "epoch": epoch, "step": step, **event}
        self.events.append(record)
        self.write(record, step)
        if event.get("message"):
            self.console(event["message"])

    def count_wire_bytes(self, interface: str | None) -> None:
        """From now on, records carry what ``interface`` sent since the previous one (``trainer.netdev``)."""
        self.netdev = NetdevCounter(interface) if interface else None

    def train_record(
        self,
        result: Any,
        counts: Any,
        metrics: dict[str, float],
        world: int,
        batch: int,
        step_s: float,
        loss_scale: float,
    ) -> dict[str, Any]:
        """The record of a finished step (``result``, an ``algorithms.base.StepResult``) whose traffic is
        ``counts``, with the algorithm's ``metrics``, in a world of ``world`` ranks of ``batch`` samples each."""
        record = {
            "kind": "train",
            "step": result.step,
            "epoch": result.epoch,
            "loss": result.loss,
            "lr": result.lr,
            "world_size": world,
            "samples_per_s": batch * world / max(step_s, 1e-9),
            "bytes_sent": counts.bytes_sent,
            "payload_bytes": counts.payload_bytes,
            "comm_s": counts.comm_s,
            "compute_s": result.compute_s,
            "data_s": result.data_s,
            "step_s": step_s,
        }
        if self.netdev is not None:
            record["wire_bytes"] = self.netdev.delta()  # this node's own, not a mean over ranks
        if not result.stepped:
            record["skipped"] = True
        if loss_scale != 1.0:
            record["loss_scale"] = loss_scale
        record.update(metrics)
        return record

    def start(self, hosts: list[str], epoch: int, step: int, resumed: tuple[dict[str, Any], str] | None) -> None:
        """The ``world`` event (``hosts``: rank -> host name; the launcher that formed it) and, for a resumed run, its
        ``resume`` event and line."""
        world = {"event": "world", "world_size": len(hosts), "hosts": dict(enumerate(hosts))}
        world["launcher"] = launcher_name()
        self.event(world, epoch, step)
        if resumed is not None:
            event, line = resumed
            self.event(event, epoch, step)
            self.console(line)

    def summarize(self, run: Any, totals: Any, lost_ranks: list[int], **fields: Any) -> dict[str, Any] | None:
        """On the logging rank: the summary record of this invocation (:func:`run_summary`), the console block and
        the end of the logger's run; returns the summary (None on the other ranks)."""
        if not self.membership.is_logging_rank:
            return None
        summary = run_summary(run, self.membership, totals, self.steps, lost_ranks, **fields)
        self.finish(summary, run.step)
        self.console(format_summary(summary, self.cfg["trainer"], self.run_dir))
        return summary

    def replay(self, records: list[dict[str, Any]]) -> None:
        """Write records a peer wrote (with their time) as if this rank had: what it missed while behind."""
        for record in records:
            if record["kind"] == "event":
                self.events.append(record)
            self.write(record, record["step"])

    def console(self, message: str) -> None:
        """A line on the logging rank's console (above the progress bar if one is showing) and in train.log."""
        if self.membership.is_logging_rank:
            from tqdm import tqdm

            tqdm.write(message, file=sys.stdout)
            sys.stdout.flush()
            if self._log is not None:
                self._log.write(message + "\n")

    def finish(self, summary: dict[str, Any], step: int) -> None:
        """The summary record, one W&B table per event type (``events/evict``, a row per occurrence), and the
        end of the logger's run."""
        self.write(summary, step)
        by_name: dict[str, list[dict[str, Any]]] = {}
        for event in self.events:
            by_name.setdefault(event["event"], []).append(event)
        for name, rows in by_name.items():
            columns = sorted({k for row in rows for k in row if k not in ("kind", "event", "message")})
            self.logger.log_table(f"events/{name}", columns, [[_cell(row.get(c)) for c in columns] for row in rows])
        self.logger.finish(summary)

    def close(self, left: bool = False) -> None:
        """Close the files; a rank that ``left`` the run also ends its logger's run (keeping what it logged)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if left:
            self.logger.finish(None)


class StepStats:
    """What the train records of this invocation add up to."""

    def __init__(self):
        self.count, self.bytes_sent, self.comm_s = 0, 0.0, 0.0
        self.samples_per_s: list[float] = []

    def add(self, record: dict[str, Any]) -> None:
        self.count += 1
        self.bytes_sent += record["bytes_sent"]
        self.comm_s += record["comm_s"]
        self.samples_per_s.append(record["samples_per_s"])

    def summary(self) -> dict[str, float | None]:
        """Median samples/s of a step, and bytes sent and seconds communicating per step (means per rank)."""
        if not self.count:
            return {"samples_per_s": None, "bytes_per_step": None, "comm_s_per_step": None}
        return {
            "samples_per_s": statistics.median(self.samples_per_s),
            "bytes_per_step": self.bytes_sent / self.count,
            "comm_s_per_step": self.comm_s / self.count,
        }


def run_summary(run: Any, membership: Any, totals: Any, steps: StepStats, lost_ranks: list[int], **fields: Any):
    """The summary record of an invocation at ``run`` (an ``engine.state.RunState``) whose active ranks are
    ``membership``'s, with ``totals`` of traffic, this invocation's ``steps`` and the ``lost_ranks``; ``fields``:
    finished, replica_spread, stopped_by, train_s, num_params, reached_target."""
    m, last, best = membership, run.last_eval or {}, run.best_eval or {}
    gone = set(range(m.initial_size)) - set(m.ranks)
    return {
        "kind": "summary",
        "finished": fields["finished"],
        "steps": run.step,
        "epochs": run.epoch,  # completed
        "epoch": run.last_epoch,
        "world_size": m.size,
        "initial_world_size": m.initial_size,
        "ranks": m.ranks,
        "evictions": m.initial_size - m.size - len(lost_ranks),
        "evicted_ranks": sorted(gone - set(lost_ranks)),
        "lost_ranks": sorted(lost_ranks),  # died or hung (trainer.on_failure: continue)
        "replica_spread": fields["replica_spread"],
        "stopped_by": fields["stopped_by"],
        "train_s": fields["train_s"],
        "steps_this_run": steps.count,
        **steps.summary(),
        "bytes_sent": totals.bytes_sent,
        "payload_bytes": totals.payload_bytes,
        "comm_s": totals.comm_s,
        "num_params": fields["num_params"],
        "top1": last.get("top1"),
        "top5": last.get("top5"),
        "val_loss": last.get("loss"),
        "best_top1": best.get("top1"),
        "best_epoch": best.get("epoch"),
        "reached_target": fields["reached_target"],
    }


def progress_bar(total: int, initial: int, description: str, show: bool) -> Any:
    """A tqdm bar on stderr (``show``: the logging rank, ``trainer.progress``), refreshed sparsely when stderr is a
    file."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=description,
        unit="step",
        disable=not show,
        dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 30.0,
        file=sys.stderr,
    )


def save_config(cfg: dict[str, Any], path: str) -> None:
    """The resolved config as YAML (what this run trained with, whatever launched it)."""
    import yaml

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)


def format_summary(summary: dict[str, Any], trainer: dict[str, Any], run_dir: str) -> str:
    """The console block that ends a run (``trainer`` is the trainer section of the config)."""
    s, of = summary, f"of {trainer['epochs']}"
    if s.get("stopped_by"):
        head = f"stopped by {s['stopped_by']} at step {s['steps']} in epoch {s['epoch']} {of}"
    elif not s["finished"]:
        head = (
            f"stopped after epoch {s['epoch']} {of} (trainer.max_epochs_per_run={trainer['max_epochs_per_run']}) "
            f"at step {s['steps']}"
        )
    elif trainer["max_steps"] is not None and s["steps"] >= trainer["max_steps"]:
        head = f"finished at step {s['steps']} (trainer.max_steps) in epoch {s['epoch']} {of}"
    else:
        head = f"finished epoch {s['epoch']} {of} at step {s['steps']}"
    lines = [f"relaxsync: {head}; {s['steps_this_run']} steps in {_duration(s['train_s'])} this run"]
    if s["top1"] is not None:
        best = f", best {s['best_top1']:.2f}% (epoch {s['best_epoch']})" if s["best_top1"] is not None else ""
        lines.append(f"  top-1     {s['top1']:.2f}% final{best}; top-5 {s['top5']:.2f}%")
    if s["samples_per_s"] is not None:
        lines.append(
            f"  speed     {s['samples_per_s']:.0f} samples/s (median step); "
            f"{s['comm_s_per_step']:.3f} s/step communicating"
        )
        lines.append(
            f"  traffic   {_bytes(s['bytes_per_step'])} sent per rank and step, {_bytes(s['bytes_sent'])} in all"
        )
    evicted = ", ".join(str(r) for r in s["evicted_ranks"]) or "none"
    lost = f"; lost: {', '.join(str(r) for r in s['lost_ranks'])}" if s.get("lost_ranks") else ""
    lines.append(f"  ranks     {s['world_size']} of {s['initial_world_size']} at the end; evicted: {evicted}{lost}")
    lines.append(f"  run dir   {shown(run_dir)}")
    if not s["finished"]:
        lines.append(f"  continue  the same command with: trainer.resume=auto trainer.run_dir={shown(run_dir)}")
    return "\n".join(lines)


def shown(path: str) -> str:
    """``path`` relative to the working directory when it is below it, else absolute."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _cell(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool)) or value is None else json.dumps(value)
