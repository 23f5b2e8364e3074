"""Weights & Biases as the experiment logger (``logger=wandb``): a copy of ``metrics.jsonl``, each record's numbers
under ``<kind>/<key>`` names (``train/loss``, ``comm/bytes_sent``, ...), and the run's events as tables.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Callable
from typing import Any

from engine.metrics import ExperimentLogger
from engine.summary import shown
from errors import ConfigError, require

# Train-record keys that W&B files under comm/ rather than train/ (summary totals stay under summary/).
COMM_KEYS = ("bytes_sent", "payload_bytes", "comm_s", "wire_bytes", "node_bytes")


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
            import wandb

            # Its connection to the service is closed here, as W&B's exit function would close it at the process's
            # end, failing the same way there, with a traceback under the run's last lines.
            with contextlib.suppress(Exception):
                wandb.teardown()

    def describe(self):
        if self.run is None:
            return None
        where = shown(os.path.dirname(self.run.dir))  # <run dir>/wandb/<mode>-run-<time>-<id>
        if self.mode == "offline":
            return f"W&B offline run in {where}; upload it later with: wandb sync {where}"
        return f"W&B {self.mode} run {self.run.id} ({where})"
