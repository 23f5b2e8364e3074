"""sync=powersgd: PyTorch's own hook, and every byte it sends counted: after the plain-allreduce steps, each
compressible gradient matrix travels as its rank-r factors P and Q, the rest as it is."""

from __future__ import annotations

import math

import timm
from _contract import case_dir
from conftest import records

from engine.metrics import read_metrics


def powersgd_elements(model, rank: int, min_compression_rate: float) -> int:
    """Elements PyTorch's powerSGD_hook allreduces per step: P and Q of each matrix worth compressing, and every
    other gradient as it is (the rule of its _should_compress)."""
    total = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        compressed = (n + m) * r
        total += compressed if compressed * min_compression_rate < n * m else n * m
    return total


def test_bytes_are_the_factors_after_the_plain_steps(contract_runs):
    """The contract test's sync=powersgd run (2 processes, plain allreduce for 2 steps, rank 1)."""
    metrics = read_metrics(str(case_dir(contract_runs, (None, "powersgd", [])) / "full" / "metrics.jsonl"))
    model = timm.create_model("test_resnet", num_classes=10)
    dense = 4 * sum(p.numel() for p in model.parameters())
    factors = 4 * powersgd_elements(model, rank=1, min_compression_rate=2.0)
    steps = records(metrics, "train")
    assert [r["bytes_sent"] for r in steps] == [dense] * 2 + [factors] * 4  # ring allreduce of 2 sends S
    assert factors < dense / 40
    assert all(math.isfinite(r["loss"]) for r in steps)  # the compressed steps train on
