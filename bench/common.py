"""Helpers shared by the benchmarks: compose a config as users do, run it, read its metrics, describe the machine."""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from engine.config import prepare
from engine.launch import launch
from engine.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def config(overrides: list[str]) -> dict[str, Any]:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return prepare(compose(config_name="train", overrides=overrides))


def run(overrides: list[str]) -> list[dict[str, Any]]:
    """Train with ``overrides`` (real launcher, real workers) in a temporary run dir; return metrics.jsonl."""
    cfg = config(["logger=none", "trainer.progress=false", "trainer.checkpoint_every=0", *overrides])
    with tempfile.TemporaryDirectory() as run_dir:
        launch(cfg, run_dir)
        return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def train_records(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in metrics if r["kind"] == "train"]


def wait_until(predicate: Callable[[], Any], timeout: float, failure: Callable[[], str]) -> None:
    """Poll ``predicate`` every 50 ms until it is true; after ``timeout`` s raise ``TimeoutError(failure())``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(failure())
        time.sleep(0.05)


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}"
