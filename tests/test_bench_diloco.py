"""bench/diloco --compare's table, on results written by hand: each run is set against allreduce at its own seed,
and an unknown run is refused before anything trains."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.diloco import compare_table

ROOT = Path(__file__).resolve().parents[1]


def _run(top1: float, bytes_per_step: float = 1e3) -> dict:
    return {"top1": top1, "best_top1": top1, "samples_per_s": 100.0, "bytes_per_step": bytes_per_step, "steps": 440}


def test_each_run_is_set_against_allreduce_at_its_own_seed():
    results = {
        "allreduce": {"0": _run(99.0, 67e6), "1": _run(98.0, 67e6)},
        "sparse": {"0": _run(98.5, 40e3), "1": _run(98.5, 42e3)},
        "fp4": {"1": _run(98.5, 0.5e6)},  # (one seed only: against allreduce's 98.0 there, not its mean 98.5)
    }
    lines = compare_table(results).splitlines()
    assert lines[0] == "| sync | seed 0 | seed 1 | mean vs allreduce | bytes/step |"
    assert lines[2] == "| allreduce | 99.00 | 98.00 | (98.50) | 67.0000 MB |"
    assert lines[3] == "| sparse | 98.50 | 98.50 | +0.00 | 0.0410 MB |"
    assert lines[4] == "| fp4 |  | 98.50 | +0.50 | 0.5000 MB |"


def test_an_unknown_run_is_refused_before_anything_trains():
    out = subprocess.run(
        [sys.executable, "-m", "bench.diloco", "--compare", "sparse,nope"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 2 and "--compare: unknown run nope (allowed: allreduce, streaming," in out.stderr
