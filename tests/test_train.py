"""Real multi-process jobs (gloo, elastic launcher): bytes accounting, DDP equivalence, resume, AMP, LARS,
multirun, failures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from _rounding import assert_one_update_apart, keeps_initial_parameters
from conftest import FAST, ROOT, TEST_RESNET_PARAMS, load_model_state, plain_cfg, records, run_cli, train
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from engine.metrics import read_metrics


def test_allreduce_bytes_world_size_and_wandb_offline(tmp_path):
    """The acceptance command, as a user types it."""
    result = run_cli(
        "trainer.nproc=2", "model=test_resnet", "data=synthetic", "trainer.max_steps=5", f"hydra.run.dir={tmp_path}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(str(tmp_path / "metrics.jsonl"))
    steps = records(metrics, "train")
    assert [r["step"] for r in steps] == [0, 1, 2, 3, 4]
    n = 2
    expected = 2 * (n - 1) / n * 4 * TEST_RESNET_PARAMS  # ring allreduce of fp32 gradients
    for r in steps:
        assert r["world_size"] == 2
        assert r["bytes_sent"] == expected
        assert r["payload_bytes"] == 4 * TEST_RESNET_PARAMS
        assert r["comm_s"] > 0 and r["compute_s"] > 0
    assert records(metrics, "eval")[-1]["num_samples"] == 256  # synthetic val set, each sample once
    (summary,) = records(metrics, "summary")
    assert summary["num_params"] == TEST_RESNET_PARAMS
    assert summary["finished"] and summary["steps"] == 5 and summary["epoch"] == 1 and summary["epochs"] == 0
    assert summary["bytes_per_step"] == expected and summary["evictions"] == 0 and summary["evicted_ranks"] == []
    assert summary["samples_per_s"] > 0 and summary["best_top1"] == summary["top1"]
    # The end of the run, on the console and in train.log; the resolved config beside them.
    block = result.stdout[
        result.stdout.index("relaxsync: finished at step 5 (trainer.max_steps) in epoch 1 of 10; 5 steps in") :
    ]
    assert f"top-1     {summary['top1']:.2f}% final" in block and "evicted: none" in block
    assert f"run dir   {tmp_path}" in block and "continue" not in block
    log = (tmp_path / "train.log").read_text()
    assert "eval epoch 1: top1" in log and block.strip() in log
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["trainer"]["max_steps"] == 5

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    assert f"W&B offline run in {runs[0]}; upload it later with: wandb sync {runs[0]}" in result.stdout
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(  # as docs/outputs.md prints it
        [str(wandb_cli), "leet", "inspect", "--summary", "--json", str(runs[0])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    read_back = json.loads(out.stdout[out.stdout.index("{") :])
    assert read_back["state"] == "finished" and read_back["tags"] == ["allreduce"]
    wb = read_back["summary"]  # the latest value of every key
    last = steps[-1]
    assert wb["comm/bytes_sent"] == expected
    assert wb["train/world_size"] == 2
    assert wb["train/loss"] == pytest.approx(last["loss"])
    assert wb["eval/num_samples"] == 256
    assert wb["summary/evictions"] == 0 and wb["summary/top1"] == pytest.approx(summary["top1"])
    assert read_back["config"]["sync"]["_target_"] == "algorithms.allreduce.AllReduce"


def test_early_stop_resume_and_an_already_finished_run_say_what_happened(tmp_path):
    """(Run from a directory of the user's, not the repository: the workers' fork server imports the engine from
    anywhere.)"""
    args = [*FAST, "trainer.nproc=1", "data.num_samples=64", "data.num_val_samples=16", "trainer.epochs=2"]
    args.append(f"hydra.run.dir={tmp_path}")
    home = tmp_path / "home"
    home.mkdir()
    first = run_cli(*args, "trainer.max_epochs_per_run=1", cwd=home)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "relaxsync: stopped after epoch 1 of 2 (trainer.max_epochs_per_run=1) at step 2; 2 steps in" in first.stdout
    assert f"continue  the same command with: trainer.resume=auto trainer.run_dir={tmp_path}" in first.stdout
    second = run_cli(*args, "trainer.resume=auto", cwd=home)
    assert second.returncode == 0, second.stderr[-3000:]
    path = tmp_path / "checkpoints" / "last.pt"
    assert f"relaxsync: resumed from step 2 (epoch 2 of 2) of {path}" in second.stdout
    assert "relaxsync: finished epoch 2 of 2 at step 4; 2 steps in" in second.stdout
    third = run_cli(*args, "trainer.resume=auto", cwd=home)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"relaxsync: already finished: {path} is at step 4, epoch 2 of 2; final top-1" in third.stdout
    assert "relaxsync: finished" not in third.stdout
    metrics = read_metrics(str(tmp_path / "metrics.jsonl"))
    summaries = records(metrics, "summary")
    assert [(s["finished"], s["steps"], s["steps_this_run"]) for s in summaries] == [(False, 2, 2), (True, 4, 2)]
    assert [r["step"] for r in records(metrics, "train")] == [0, 1, 2, 3]
    assert [r["epoch"] for r in records(metrics, "train")] == [1, 1, 2, 2]  # from 1, as on the console
    assert [r["epoch"] for r in records(metrics, "eval")] == [1, 2]
    assert [r["event"] for r in records(metrics, "event")].count("resume") == 1
    log = (tmp_path / "train.log").read_text()
    assert log.count("relaxsync: stopped after") == 1 and log.count("already finished") == 1


def test_two_processes_equal_one_process_with_twice_the_batch(tmp_path):
    """DDP averaging is exact: 2 x batch B == 1 x batch 2B on a model without batch norm, same data order. Compared
    after one step, by the rounding of one update (see _rounding.py): the gradients are sums over the batch that the
    two split differently (16 samples x 5 tokens in one process, or 8 x 5 in each of two, then averaged), each
    within 80 x 2^-24 = 5e-6 of the magnitudes summed; 1e-4 of the tensor's largest update leaves room for
    cancellation in the sums (2e-6 measured)."""
    common = [
        *FAST,
        "model=test_vit",
        "data=digits",
        "optimizer=sgd",
        "schedule.warmup_epochs=0",
        "trainer.max_steps=1",
        "trainer.checkpoint_every=0",
    ]
    _, m2 = train(tmp_path / "two", *common, "trainer.nproc=2", "data.batch_size=8")
    one_process = [*common, "trainer.nproc=1", "data.batch_size=16"]
    _, m1 = train(tmp_path / "one", *one_process, entrypoint=keeps_initial_parameters)  # saves initial.pt
    two, one = load_model_state(tmp_path / "two"), load_model_state(tmp_path / "one")
    initial = torch.load(tmp_path / "one" / "initial.pt", weights_only=True)
    assert all(not torch.equal(initial[k], one[k]) for k in one if "weight" in k)  # the step moved every weight
    assert_one_update_apart(two, one, initial=initial, sums=1e-4)
    assert records(m2, "eval")[-1]["num_samples"] == 359  # odd-sized val set over 2 ranks: no duplicates
    assert records(m1, "eval")[-1]["num_samples"] == 359


@pytest.mark.full  # make test: test_contract (every sync option) and the cross-process resume in test_localsgd
def test_resume_matches_an_uninterrupted_run(tmp_path):
    common = [*FAST, "data=digits", "data.batch_size=64", "trainer.nproc=2", "trainer.epochs=2"]
    _, full = train(tmp_path / "full", *common)
    _, first = train(tmp_path / "split", *common, "trainer.max_epochs_per_run=1")
    assert records(first, "eval")[-1]["epoch"] == 1 and not records(first, "summary")[0]["epochs"] == 2
    _, both = train(tmp_path / "split", *common, "trainer.resume=auto")
    assert [r["event"] for r in records(both, "event")].count("resume") == 1
    resumed_steps = [r["step"] for r in records(both, "train")]
    assert resumed_steps == sorted(set(resumed_steps))  # no step trained twice
    a, b = load_model_state(tmp_path / "full"), load_model_state(tmp_path / "split")
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)
    assert records(full, "summary")[0]["top1"] == pytest.approx(records(both, "summary")[-1]["top1"])


@pytest.mark.full  # ~35 s; make test: TorchAmp's autocast, scaler and verdict (test_units) and amp in test_apex
def test_amp_torch_trains_in_bfloat16_on_cpu(tmp_path):
    summary, metrics = train(
        tmp_path, *FAST, "data=digits", "amp=torch", "trainer.nproc=2", "trainer.epochs=2", "data.batch_size=32"
    )
    losses = [r["loss"] for r in records(metrics, "train")]
    assert all(math.isfinite(x) for x in losses)
    assert summary["top1"] > 60.0  # far above chance (10 %) on real digits (83-92 % over seeds 0-2)


def test_lars_trains(tmp_path):
    summary, metrics = train(
        tmp_path, *FAST, "data=digits", "optimizer=lars", "trainer.nproc=2", "trainer.epochs=2", "data.batch_size=32"
    )
    losses = [r["loss"] for r in records(metrics, "train")]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert summary["top1"] > 60.0  # 92-95 % over seeds 0-2


def test_multirun_runs_one_world_per_job_and_ends_with_a_comparison(tmp_path):
    import csv

    result = run_cli(
        "-m",
        "sync=allreduce,localsgd",
        "model=test_resnet",
        "data=synthetic",
        "logger=none",
        "trainer.max_steps=3",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for job in ("0", "1"):
        metrics = read_metrics(str(tmp_path / job / "metrics.jsonl"))
        assert len(records(metrics, "train")) == 3
        assert all(r["world_size"] == 2 for r in records(metrics, "train"))
    overrides = [(tmp_path / job / ".hydra" / "overrides.yaml").read_text() for job in ("0", "1")]
    assert "sync=allreduce" in overrides[0] and "sync=localsgd" in overrides[1]
    # One row per job; the override that differs is a column; the rows differ in bytes per step.
    rows = list(csv.DictReader((tmp_path / "comparison.csv").open()))
    assert [(r["job"], r["sync"]) for r in rows] == [("0", "allreduce"), ("1", "localsgd")]
    assert "model" not in rows[0]  # the same in every job
    assert float(rows[1]["MB sent/step"]) < float(rows[0]["MB sent/step"])  # local SGD averages every 4 steps
    table = (tmp_path / "comparison.md").read_text()
    assert table.splitlines()[0].startswith("| job | sync | top-1 % |") and len(table.splitlines()) == 4
    assert f"comparison of the jobs in {tmp_path}" in result.stdout and table in result.stdout


def test_worker_exception_ends_the_run_without_hanging(tmp_path):
    from _workers import fail_on_rank1

    with pytest.raises(ChildFailedError) as info:
        train(tmp_path, *FAST, "trainer.nproc=2", entrypoint=fail_on_rank1)
    assert "injected failure on rank 1" in info.value.format_msg()


def test_worker_exception_cli_shows_traceback_and_exits_nonzero(tmp_path):
    # Valid config, but a batch larger than a rank's shard is only known once the data is built in the worker.
    result = run_cli(*FAST, "data.batch_size=4096", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 1
    assert "Traceback" in result.stderr
    assert "data.batch_size=4096: larger than a rank's shard" in result.stderr


@pytest.mark.full  # make test: the multirun test (Hydra sweeps) and hparams_search=optuna composing (test_config)
def test_optuna_sweep_receives_final_top1(tmp_path):
    """train.py returns the final validation top-1; the Optuna sweeper records it as the trial value."""
    result = run_cli(
        "-m",
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=2",
        *FAST,
        "trainer.max_steps=2",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    top1 = [records(read_metrics(str(tmp_path / j / "metrics.jsonl")), "summary")[0]["top1"] for j in ("0", "1")]
    best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())["best_value"]
    assert best == pytest.approx(max(top1))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("torchrun")), *args]


def test_local_workers_see_the_environment_of_each_launch_and_their_own_rank(tmp_path, monkeypatch):
    """Workers fork from a server started at the first launch of this process; each launch's environment, not the
    server's, is what they see, with the agent's variables on top."""
    from _workers import report_environment

    from engine.launch import launch

    cfg = plain_cfg(*FAST, "trainer.nproc=2")
    monkeypatch.setenv("RELAXSYNC_PROBE_CHANGED", "first")
    monkeypatch.setenv("RELAXSYNC_PROBE_REMOVED", "first")
    first = launch(cfg, str(tmp_path / "first"), entrypoint=report_environment)
    assert first == {
        "RELAXSYNC_PROBE_CHANGED": "first",
        "RELAXSYNC_PROBE_REMOVED": "first",
        "RANK": "0",
        "LOCAL_RANK": "0",
    }
    monkeypatch.setenv("RELAXSYNC_PROBE_CHANGED", "second")
    monkeypatch.delenv("RELAXSYNC_PROBE_REMOVED")
    second = launch(cfg, str(tmp_path / "second"), entrypoint=report_environment)
    assert second == {
        "RELAXSYNC_PROBE_CHANGED": "second",
        "RELAXSYNC_PROBE_REMOVED": None,
        "RANK": "0",
        "LOCAL_RANK": "0",
    }


def test_adopt_environment_takes_the_launchers_values_and_keeps_the_agents(monkeypatch):
    from engine.worker import adopt_environment

    inherited = {"KEPT": "k", "CHANGED": "old", "REMOVED": "r", "RANK": "7"}
    worker = {**inherited, "RANK": "1", "MASTER_PORT": "29500"}  # the agent set RANK and MASTER_PORT
    launcher = {"KEPT": "k", "CHANGED": "new", "ADDED": "a", "RANK": "7"}
    monkeypatch.setattr("os.environ", dict(worker))
    adopt_environment(launcher, inherited)
    assert os.environ == {"KEPT": "k", "CHANGED": "new", "ADDED": "a", "RANK": "1", "MASTER_PORT": "29500"}
    # imported in the worker, after the agent set its variables: they are what it found, and none goes
    late = {**worker, "LOCAL_RANK": "0"}
    monkeypatch.setattr("os.environ", dict(late))
    adopt_environment(launcher, dict(late))
    assert os.environ == {**late, "ADDED": "a"}


@pytest.mark.full  # ~12 s; make test: train.py under torchrun agents (the rendezvous below, test_faults, test_joins)
def test_runs_as_a_worker_under_torchrun(tmp_path):
    cmd = _torchrun("--standalone", "--nproc-per-node", "2", "train.py", *FAST, "trainer.max_steps=3")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [*cmd, f"trainer.run_dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    steps = records(read_metrics(str(tmp_path / "metrics.jsonl")), "train")
    assert len(steps) == 3 and all(r["world_size"] == 2 for r in steps)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["trainer"]["run_dir"] == str(tmp_path)
    assert "relaxsync: finished at step 3" in (tmp_path / "train.log").read_text()


@pytest.mark.full  # ~14 s; make test: test_network's two-node torchrun job (the same c10d rendezvous, in namespaces)
def test_two_node_torchrun_rendezvous_on_localhost(tmp_path):
    """Two torchrun agents (one per 'node') meeting at a c10d rendezvous endpoint: the multi-node path."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = [
        subprocess.Popen(
            _torchrun(
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "two-node-test",
                "train.py",
                *FAST,
                "trainer.max_steps=3",
                f"trainer.run_dir={tmp_path}",
            ),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    steps = records(read_metrics(str(tmp_path / "metrics.jsonl")), "train")
    assert len(steps) == 3 and all(r["world_size"] == 2 for r in steps)
    assert steps[0]["bytes_sent"] == 4 * TEST_RESNET_PARAMS


def test_netdev_records_what_the_interface_sent_each_step(tmp_path):
    """Both local ranks talk over the loopback interface, so each step it carries at least what they counted."""
    _, metrics = train(tmp_path, *FAST, "trainer.max_steps=3", "trainer.netdev=lo")
    steps = records(metrics, "train")
    assert len(steps) == 3
    for r in steps:
        assert 2 * r["bytes_sent"] <= r["wire_bytes"] <= 1.5 * 2 * r["bytes_sent"]  # two senders, S each, + headers
        assert r["bytes_sent"] == 4 * TEST_RESNET_PARAMS


def test_evaluations_on_the_side_leave_training_as_it_was_and_a_reached_target_ends_the_run(tmp_path):
    """Local SGD, whose regular evaluation averages the replicas in place, evaluated every 3 steps on the side
    (``trainer.eval_every_steps``) ends with the parameters of the same run without those evaluations; each is
    recorded with its duration. With ``trainer.target_top1`` reached at the first of them, the run ends there,
    finished."""
    from conftest import load_model_state, train_each

    common = [
        "model=test_resnet", "data=digits", "logger=none", "trainer.progress=false", "trainer.nproc=2",
        "sync=localsgd", "sync.begin_step=0", "sync.k_steps=4", "trainer.max_steps=10", "trainer.checkpoint_every=0",
    ]  # fmt: skip
    runs = {
        "plain": common,
        "peek": [*common, "trainer.eval_every_steps=3"],
        "target": [*common, "trainer.eval_every_steps=3", "trainer.target_top1=1"],
    }
    metrics = train_each(tmp_path, runs)
    plain, peek = load_model_state(tmp_path / "plain"), load_model_state(tmp_path / "peek")
    for name, value in plain.items():
        assert torch.equal(value, peek[name]), name
    evals = records(metrics["peek"], "eval")
    assert [(e["step"], e.get("on_the_side", False)) for e in evals] == [(3, True), (6, True), (9, True), (10, False)]
    assert all(e["eval_s"] > 0 and e["num_samples"] > 0 for e in evals)

    (summary,) = records(metrics["target"], "summary")
    assert summary["finished"] and summary["reached_target"] and summary["steps"] == 3
    assert [e["step"] for e in records(metrics["target"], "eval")] == [3]


def test_an_evaluation_records_what_the_logging_rank_waited_in_it_for_the_slowest(tmp_path):
    """Evaluations every few steps are barriers: under local SGD k=16 (nothing exchanged in these 4 steps) rank 0
    waits in each for rank 1, which sleeps 0.2 s a step. ``wait_s`` says so, a part of ``eval_s``: time that the
    exchange at step 16 would have waited without them, which bench/tta counts as training."""
    _, metrics = train(
        tmp_path, *FAST, "trainer.nproc=2", "sync=localsgd", "sync.begin_step=0", "sync.k_steps=16",
        "trainer.max_steps=4", "trainer.eval_every_steps=2", "trainer.checkpoint_every=0", "straggler=sleep",
        "straggler.ranks=[1]", "straggler.start_epoch=1", "straggler.sleep_s=0.2",
    )  # fmt: skip
    side = [e for e in records(metrics, "eval") if e.get("on_the_side")]
    assert side and all(0.2 <= e["wait_s"] <= e["eval_s"] for e in side), side  # (two steps' sleeps: 0.4 s)


def test_a_literal_hydra_run_dir_is_the_run_dir_under_torchrun_and_one_with_an_interpolation_is_said_unused(
    tmp_path, monkeypatch, capsys
):
    """Under torchrun (or srun) Hydra puts no output dir around the workers: a ``hydra.run.dir`` on the command line
    is the run dir as it would be under the local launcher. One that interpolates (``${now:...}``) would resolve to
    a directory of its own in each process: the job's run dir is used, and rank 0 says so."""
    import train

    given = tmp_path / "given"
    cmd = _torchrun("--standalone", "--nproc-per-node", "2", "train.py", *FAST, "trainer.max_steps=2")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([*cmd, f"hydra.run.dir={given}"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(records(read_metrics(str(given / "metrics.jsonl")), "train")) == 2

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    plain = {"trainer": {"run_dir": None}}
    argv = ["trainer.epochs=2", "hydra.run.dir=outputs/${now:%H-%M-%S}"]
    assert train.launched_run_dir(plain, argv, "0") == os.path.join("outputs", "torchrun", "job7")
    assert "hydra.run.dir=outputs/${now:%H-%M-%S} is not used under this launcher" in capsys.readouterr().err
    assert train.launched_run_dir(plain, argv, "1") == os.path.join("outputs", "torchrun", "job7")
    assert capsys.readouterr().err == ""  # (rank 0 says it, once)
    assert train.launched_run_dir({"trainer": {"run_dir": "/r"}}, argv, "0") == "/r"
