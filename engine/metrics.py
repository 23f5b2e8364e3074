"""Metrics: ``metrics.jsonl`` (always) and an optional experiment logger (W&B), on the logging rank only.

One JSON object per line, ``kind`` in {train, eval, event, summary}; the logger receives the same values under
``<kind>/<key>`` names (``train/loss``, ``comm/bytes_sent``, ...). :class:`Recorder` is the trainer's side of
it: which rank writes, the records, the console lines and the W&B event tables.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

from errors import ConfigError, require

# Train-record keys that W&B files under comm/ rather than train/ (summary totals stay under summary/).
COMM_KEYS = ("bytes_sent", "payload_bytes", "comm_s", "wire_bytes")


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
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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


class NoLogger(ExperimentLogger):
    """``logger=none``: metrics.jsonl only."""


def wandb_keys(record: dict[str, Any]) -> dict[str, Any]:
    """``{"kind": "train", "loss": 1.0, "bytes_sent": 8}`` -> ``{"train/loss": 1.0, "comm/bytes_sent": 8}``."""
    kind = record.get("kind", "train")
    out = {}
    for key, value in record.items():
        if key == "kind" or not isinstance(value, (int, float, bool)):
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
            self.run.log(wandb_keys(record), step=step)

    def log_table(self, name, columns, rows):
        if self.run is not None and rows:
            import wandb

            self.run.log({name: wandb.Table(columns=columns, data=rows)})

    def finish(self, summary):
        if self.run is not None:
            for key, value in wandb_keys(summary or {}).items():
                self.run.summary[key] = value
            self.run.finish()
            self.run = None


class Recorder:
    """The trainer's records and console lines, written by the logging rank (the lowest active one) only.

    Every rank holds one; when the logging rank leaves the run, the next lowest opens ``metrics.jsonl`` (in
    append mode) and the same W&B run (its id is a function of the run dir) at the next membership change."""

    def __init__(self, run_dir: str, cfg: dict[str, Any], sync_name: str, membership: Any, logger: ExperimentLogger):
        self.run_dir, self.cfg, self.sync_name = run_dir, cfg, sync_name
        self.membership, self.logger = membership, logger
        self.writer: MetricsWriter | None = None
        self.events: list[dict[str, Any]] = []  # every event record, for the W&B tables at the end
        self.elect()

    def elect(self) -> None:
        """Open metrics.jsonl and the logger if this rank is (now) the logging rank."""
        if self.writer is None and self.membership.is_logging_rank:
            self.writer = MetricsWriter(os.path.join(self.run_dir, "metrics.jsonl"))
            self.logger.start(self.run_dir, self.cfg, self.sync_name)

    def write(self, record: dict[str, Any], step: int) -> None:
        """One record to metrics.jsonl and the logger (a no-op off the logging rank)."""
        if self.writer is None:
            return
        self.writer.write(record)
        if record["kind"] != "summary":
            self.logger.log(record, step=step)

    def event(self, event: dict[str, Any], epoch: int, step: int) -> None:
        """An event record; its ``message``, if any, also goes to the console."""
        record = {"kind": "event", "epoch": epoch, "step": step, **event}
        self.events.append(record)
        self.write(record, step)
        if event.get("message"):
            self.console(event["message"])

    def console(self, message: str) -> None:
        """A line on the logging rank's console, above the progress bar if one is showing."""
        if self.membership.is_logging_rank:
            from tqdm import tqdm

            tqdm.write(message, file=sys.stdout)
            sys.stdout.flush()

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
        """Close metrics.jsonl; a rank that ``left`` the run also ends its logger's run (keeping what it logged)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if left:
            self.logger.finish(None)


def _cell(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool)) or value is None else json.dumps(value)
