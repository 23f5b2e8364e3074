"""The comparison across the jobs of a multirun: one row per job, the overrides that differ as columns.

``python train.py -m sync=allreduce,localsgd,sgp`` ends with this table on the console and in the sweep dir as
``comparison.md`` and ``comparison.csv``. It is a Hydra callback (``hydra.callbacks.compare`` in
``conf/train.yaml``), so it runs at the end of every multirun, whichever sweeper ran it (basic, Optuna).
Each job's numbers come from the ``summary`` record of its ``metrics.jsonl``; a job without one is ``failed``.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from engine.metrics import read_metrics

# (column, summary key, format) after the differing overrides
COLUMNS = [
    ("top-1 %", "top1", "{:.2f}"),
    ("best top-1 %", "best_top1", "{:.2f}"),
    ("samples/s", "samples_per_s", "{:.0f}"),
    ("MB sent/step", "bytes_per_step", "{:.3f}"),
    ("comm s/step", "comm_s_per_step", "{:.4f}"),
    ("evictions", "evictions", "{:d}"),
    ("world size", "world_size", "{:d}"),
    ("train s", "train_s", "{:.0f}"),
]
SCALE = {"bytes_per_step": 1e-6}


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The job dirs of a sweep (those Hydra wrote its overrides into), in job order."""
    jobs = [p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")]
    return sorted(jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else p.name))


def read_job(job: Path) -> tuple[dict[str, str], dict[str, Any] | None]:
    """A job's overrides (key -> value, as typed) and its last summary record (None if it has none)."""
    import yaml

    overrides = {}
    for line in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []:
        key, _, value = str(line).partition("=")
        overrides[key.lstrip("+~")] = value
    path = job / "metrics.jsonl"
    summaries = [r for r in read_metrics(str(path)) if r["kind"] == "summary"] if path.exists() else []
    return overrides, (summaries[-1] if summaries else None)


def comparison(sweep_dir: Path) -> tuple[list[str], list[list[str]]]:
    """The header and one row per job: job, the overrides that differ between jobs, then ``COLUMNS``."""
    jobs = [(job, *read_job(job)) for job in job_dirs(sweep_dir)]
    keys = sorted({k for _, o, _ in jobs for k in o})
    differing = [k for k in keys if len({o.get(k) for _, o, _ in jobs}) > 1]
    header = ["job", *differing, *(name for name, _, _ in COLUMNS)]
    rows = []
    for job, overrides, summary in jobs:
        row = [job.name, *(overrides.get(k, "") for k in differing)]
        for _, key, fmt in COLUMNS:
            value = (summary or {}).get(key)
            row.append("" if value is None else fmt.format(value * SCALE.get(key, 1)))
        if summary is None:
            row[len(differing) + 1] = "failed"
        rows.append(row)
    return header, rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_comparison(sweep_dir: str | os.PathLike) -> str | None:
    """Write ``comparison.md`` and ``comparison.csv`` into ``sweep_dir``; return the Markdown (None: no jobs)."""
    sweep_dir = Path(sweep_dir)
    header, rows = comparison(sweep_dir)
    if not rows:
        return None
    table = markdown(header, rows)
    (sweep_dir / "comparison.md").write_text(table)
    with open(sweep_dir / "comparison.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    return table


class CompareRuns(Callback):
    """Hydra callback: at the end of a multirun, the comparison table of its jobs."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = config.hydra.sweep.dir
        table = write_comparison(sweep_dir)
        if table:
            print(f"\nrelaxsync: comparison of the jobs in {sweep_dir} (comparison.md, comparison.csv)\n{table}")
