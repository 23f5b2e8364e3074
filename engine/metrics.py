"""Metrics: ``metrics.jsonl`` (always) and an optional experiment logger, on the logging rank only.

One JSON object per line, ``kind`` in {train, eval, event, summary}; the logger (:class:`ExperimentLogger`, W&B's in
``engine.wandb_logger``) receives the same values. :class:`Recorder` is the trainer's side of it: which rank writes,
the records, the console lines and the W&B event tables; the summary that ends a run is ``engine.summary``'s.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from engine.launchers import launcher_name, world_id
from engine.rundir import Lease
from engine.summary import StepStats, format_summary, run_summary

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


RECENT = 64  # records each rank keeps, for the one that takes over logging from a logging rank that ended


def _identity(record: dict[str, Any]) -> tuple[Any, ...]:
    """What tells a record from the others of its run: a rank's copy of a record has its own ``time``."""
    return record["kind"], record.get("step"), record.get("epoch"), record.get("event")


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
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT)  # as written, every rank
        self.elect()

    def elect(self) -> None:
        """Open metrics.jsonl, train.log and the logger if this rank is (now) the logging rank; save the resolved
        config beside them (under any launcher)."""
        if self.writer is not None or not self.membership.is_logging_rank:
            return
        # One world per run dir: a second one started into it stops here, before writing anything (engine.rundir).
        self.lease = Lease(self.run_dir, world_id())
        self.lease.take()
        path = os.path.join(self.run_dir, "metrics.jsonl")
        unwritten = self._unwritten(path) if self.recent else []
        self.writer = MetricsWriter(path)
        for record in unwritten:  # (the previous logging rank ended before it wrote them)
            self.writer.write(record)
            if record["kind"] != "summary":
                self.logger.log(record, step=record["step"])
        self._log = open(os.path.join(self.run_dir, "train.log"), "a", buffering=1)
        save_config(self.cfg, os.path.join(self.run_dir, CONFIG_FILE))
        self.logger.start(self.run_dir, self.cfg, self.sync_name)
        where = self.logger.describe()
        if where:
            self.console(f"relaxsync: {where}")

    def _unwritten(self, path: str) -> list[dict[str, Any]]:
        """On a rank that becomes the logging rank mid-run: the records it holds that the previous one did not
        write (the previous logging rank may have ended between a step every rank finished and its record; a line
        it left half written is cut off). Each record held is looked for in ``path`` itself, not only after the
        last one there: the ranks need not hold their records in one order (a checkpoint's event may come before
        or after the next step's record)."""
        if not os.path.exists(path):
            return list(self.recent)
        with open(path, "rb+") as f:
            text = f.read()
            f.truncate(text.rfind(b"\n") + 1)
        first = min((r.get("step", -1) for r in self.recent), default=0)
        written = collections.Counter(
            _identity(r) for r in read_metrics(path) if r["kind"] != "summary" and r.get("step", -1) >= first
        )
        unwritten = []
        for record in self.recent:
            if written[_identity(record)] > 0:
                written[_identity(record)] -= 1
            else:
                unwritten.append(record)
        return unwritten

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
        self.recent.append(stamped)
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
        if counts.node_bytes:  # (node scope: traffic between a node's processes, on its fast link)
            record["node_bytes"] = counts.node_bytes
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
        m = self.membership
        world["nodes"], world["scope"] = dict(enumerate(m.nodes[: len(hosts)])), "node" if m.whole_nodes else "process"
        self.event(world, epoch, step)
        if m.whole_nodes:
            shape = f"{len(m.node_ids())} nodes x {len(m.node_ranks())} processes"
            self.console(f"relaxsync: sync.scope=node: {shape}, the option's exchange runs among the nodes")
        if resumed is not None:
            event, line = resumed
            self.event(event, epoch, step)
            self.console(line)

    def summarize(self, run: Any, totals: Any, lost_ranks: list[int], **fields: Any) -> dict[str, Any] | None:
        """On the logging rank: the summary record of this invocation (:func:`run_summary`), the console block and
        the end of the logger's run; returns the summary (None on the other ranks)."""
        if not self.membership.is_logging_rank:
            return None
        syncs = [  # (sync=auto: what it chose, when and why)
            {"at_steps": e["at_steps"], "option": e["option"], "previous": e["previous"], "why": e["why"]}
            for e in self.events
            if e.get("event") == "sync_chosen"
        ]
        summary = run_summary(run, self.membership, totals, self.steps, lost_ranks, syncs=syncs, **fields)
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


def _cell(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool)) or value is None else json.dumps(value)
