"""Failures and stops lose nothing: SIGTERM checkpoints every rank at one agreed step, a killed worker restarts the
world from the last step checkpoint, and both runs end where an undisturbed one does."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import FAST, ROOT, load_model_state, records, train

from engine.checkpoint import load
from engine.metrics import read_metrics

# 2 processes x 16 steps per epoch, 2 epochs
COMMON = [*FAST, "trainer.nproc=2", "data.num_samples=1024", "data.num_val_samples=64", "trainer.epochs=2"]


def parameters(run_dir: Path) -> dict[str, torch.Tensor]:
    """The trained parameters (BN running statistics left out: averaging them at a checkpoint is by design)."""
    return {k: v for k, v in load_model_state(run_dir).items() if "running" not in k and "num_batches" not in k}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


def cli(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *args]


def env() -> dict[str, str]:
    environ = dict(os.environ, WANDB_SILENT="true")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        environ.pop(key, None)
    return environ


def wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if metrics.exists() and len(records(read_metrics(str(metrics)), "train")) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} steps in {timeout} s")


def test_sigterm_checkpoints_every_rank_at_one_step_and_resume_ends_as_if_uninterrupted(tmp_path):
    train(tmp_path / "whole", *COMMON)

    run_dir = tmp_path / "stopped"
    args = [*COMMON, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cli(*args), cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(run_dir, 5, proc)
    proc.send_signal(signal.SIGTERM)  # to the launcher, as torchrun's agent, Slurm and kill do
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    stop = int(re.search(r"relaxsync: SIGTERM: every rank stops after step (\d+)", out).group(1))
    assert 5 < stop < 16  # mid-epoch, a little after the signal
    assert f"relaxsync: stopped by SIGTERM at step {stop} in epoch 1 of 2" in out
    assert f"continue with: trainer.resume=auto trainer.run_dir={run_dir}" in err
    checkpoint = load(str(run_dir / "checkpoints" / "last.pt"))
    assert (checkpoint["step"], checkpoint["step_in_epoch"], checkpoint["epoch"]) == (stop, stop, 0)
    for rank in (0, 1):  # every rank got to the same step: the logging rank's records say so for rank 0
        assert not (run_dir / "checkpoints" / f"sync_rank{rank}.pt").exists()  # allreduce keeps no own state

    resumed = subprocess.run(cli(*args, "trainer.resume=auto"), cwd=ROOT, env=env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"relaxsync: resumed from step {stop} (epoch 1 of 2)" in resumed.stdout
    metrics = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in records(metrics, "train")] == list(range(32))  # none lost, none repeated
    stopped, finished = records(metrics, "summary")
    assert stopped["stopped_by"] == "SIGTERM" and not stopped["finished"] and stopped["steps"] == stop
    assert finished["finished"] and finished["steps"] == 32
    assert_same(parameters(run_dir), parameters(tmp_path / "whole"))


def test_a_killed_worker_restarts_the_world_from_the_last_step_checkpoint(tmp_path):
    """``trainer.max_restarts``: rank 1 is SIGKILLed after step 7; the agent restarts both workers, which resume
    from the checkpoint of step 5 and end with the parameters of an undisturbed run checkpointed at the same steps."""
    from _workers import killed_once_at_step_7

    every = ["trainer.checkpoint_every_steps=5", "trainer.max_restarts=1"]
    train(tmp_path / "whole", *COMMON, *every)
    _, metrics = train(tmp_path / "killed", *COMMON, *every, entrypoint=killed_once_at_step_7)
    (summary,) = records(metrics, "summary")
    assert summary["finished"] and summary["steps"] == 32
    (resume,) = [e for e in records(metrics, "event") if e["event"] == "resume"]
    assert resume["restart"] == 1 and resume["step"] == 5
    steps = [r["step"] for r in records(metrics, "train")]
    assert steps[: steps.index(5, 6)] == list(range(steps.index(5, 6)))  # the first attempt, cut off after step 5
    assert steps[steps.index(5, 6) :] == list(range(5, 32))  # the restart redoes the steps after the checkpoint
    checkpoints = [e["step"] for e in records(metrics, "event") if e["event"] == "checkpoint"]
    assert checkpoints[:1] == [5] and 10 in checkpoints and 16 in checkpoints  # every 5 steps, and each epoch's end
    assert_same(parameters(tmp_path / "killed"), parameters(tmp_path / "whole"))
