"""Metrics: ``metrics.jsonl`` (always) and an optional experiment logger (W&B), on the logging rank only.

One JSON object per line, ``kind`` in {train, eval, event, summary}; the logger receives the same values under
``<kind>/<key>`` names (``train/loss``, ``comm/bytes_sent``, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

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
    def validate(cls, cfg_logger: dict[str, Any]) -> None:
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
    def validate(cls, cfg_logger: dict[str, Any]) -> None:
        from engine.config import ConfigError

        if cfg_logger["mode"] not in cls.MODES:
            raise ConfigError("logger.mode", cfg_logger["mode"], "one of offline, online, disabled")
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
