"""Failures and stops lose nothing: SIGTERM checkpoints every rank at one agreed step, a killed worker restarts the
world from the last step checkpoint, and both runs end where an undisturbed one does."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FAST, ROOT, load_model_state, node_environ, records, start_processes, train

from bench.netns import unavailable as _netns_unavailable
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


@pytest.mark.full  # ~30 s; make test: test_slurm's SIGTERM stop at one step and resume, test_contract's exact resume
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
    assert 5 < stop < 32  # a little after the signal (how many steps depends on the step time), before the end
    completed, within = divmod(stop, 16)
    assert f"relaxsync: stopped by SIGTERM at step {stop} in epoch {completed + (within > 0)} of 2" in out
    assert f"continue with: trainer.resume=auto trainer.run_dir={run_dir}" in err
    checkpoint = load(str(run_dir / "checkpoints" / "last.pt"))
    assert (checkpoint["step"], checkpoint["step_in_epoch"], checkpoint["epoch"]) == (stop, within, completed)
    for rank in (0, 1):  # every rank got to the same step: the logging rank's records say so for rank 0
        assert not (run_dir / "checkpoints" / f"sync_rank{rank}.pt").exists()  # allreduce keeps no own state

    resumed = subprocess.run(cli(*args, "trainer.resume=auto"), cwd=ROOT, env=env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"relaxsync: resumed from step {stop} (epoch {completed + 1} of 2)" in resumed.stdout
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

    every = ["data.num_samples=512", "trainer.checkpoint_every_steps=5", "trainer.max_restarts=1"]  # 8 steps/epoch
    train(tmp_path / "whole", *COMMON, *every)
    _, metrics = train(tmp_path / "killed", *COMMON, *every, entrypoint=killed_once_at_step_7)
    (summary,) = records(metrics, "summary")
    assert summary["finished"] and summary["steps"] == 16
    (resume,) = [e for e in records(metrics, "event") if e["event"] == "resume"]
    assert resume["restart"] == 1 and resume["step"] == 5
    steps = [r["step"] for r in records(metrics, "train")]
    assert steps[: steps.index(5, 6)] == list(range(steps.index(5, 6)))  # the first attempt, cut off after step 5
    assert steps[steps.index(5, 6) :] == list(range(5, 16))  # the restart redoes the steps after the checkpoint
    checkpoints = [e["step"] for e in records(metrics, "event") if e["event"] == "checkpoint"]
    assert checkpoints[:1] == [5] and 8 in checkpoints and 10 in checkpoints  # every 5 steps, and each epoch's end
    assert_same(parameters(tmp_path / "killed"), parameters(tmp_path / "whole"))


# ---- shrink in place (trainer.on_failure: continue) ----------------------------------------------------------------
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# 3 processes x 16 steps per epoch, 3 epochs; a hung peer is given up after 3 s
SHRINK = [
    *FAST, "data.num_samples=1536", "data.num_val_samples=96", "trainer.epochs=3", "trainer.on_failure=continue",
    "trainer.hang_timeout_s=3",
]  # fmt: skip


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(n: int, run_dir: Path, *overrides: str, procs: int = 1, etcd: Any = None) -> list[subprocess.Popen]:
    """``n`` torchrun agents on this machine, ``procs`` workers each, meeting at a c10d rendezvous hosted by the
    first: a multi-node job in which one "node" can be killed without the others' agents noticing. With ``etcd`` (a
    running :class:`distributed.etcd.LocalCluster`) they meet in its v3 rendezvous instead, and the run's store
    is the cluster (``trainer.store``): no node is special, and killing one kills its member too."""
    port = free_port()
    return [start_node(node, str(n), port, run_dir, overrides, procs=procs, etcd=etcd) for node in range(n)]


def start_node(
    node: int,
    nnodes: str,
    port: int,
    run_dir: Path,
    overrides,
    rdzv_conf: str = "",
    procs: int = 1,
    etcd: Any = None,
    **environ: str,
) -> subprocess.Popen:
    """Node ``node``'s torchrun agent, ``procs`` workers (the first hosts the rendezvous at ``port``; with ``etcd``,
    the agent speaks to the member on its node, or the last member where there are more nodes than members)."""
    environ = dict(env(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **environ)
    environ.update(node_environ(node))  # (make test-gpu: each node a GPU, or a host for NCCL, of its own)
    if etcd is None:
        rendezvous = [
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-conf",
            f"is_host={int(node == 0)}{rdzv_conf}",
        ]
        store = []
    else:
        rendezvous, store = etcd.rendezvous(node), etcd.overrides()
    launcher = [
        TORCHRUN, "--nnodes", nnodes, "--nproc-per-node", str(procs), "--max-restarts", "0",
        "--monitor-interval", "0.5", "--rdzv-id", run_dir.name, "--rdzv-backend", *rendezvous,
    ]  # fmt: skip
    log = open(run_dir.parent / f"{run_dir.name}-node{node}.log", "w")
    train_py = ["train.py", *overrides, *store, f"trainer.run_dir={run_dir}"]
    return subprocess.Popen(
        [*launcher, *train_py], cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def worker_of(node: subprocess.Popen) -> tuple[int, int]:
    """(pid, global rank) of the (first) worker a torchrun agent started."""
    workers = workers_of(node)
    assert workers, f"no worker under agent {node.pid}"
    return workers[0]


def workers_of(node: subprocess.Popen) -> list[tuple[int, int]]:
    """(pid, global rank) of each worker a torchrun agent started, by rank."""
    children = subprocess.run(["pgrep", "-P", str(node.pid)], capture_output=True, text=True).stdout.split()
    workers = []
    for pid in map(int, children):
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        if b"RANK" in environ:
            workers.append((pid, int(environ[b"RANK"])))
    return sorted(workers, key=lambda w: w[1])


def finish(nodes: list[subprocess.Popen], run_dir: Path, timeout: float = 240) -> list[dict]:
    """Wait for the run's final summary, then for the surviving workers to exit with status 0; returns the metrics.
    The agents are then stopped: torchrun's own exit barrier waits 300 s for the agent that is gone."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and any(r["finished"] for r in records(read_metrics(str(metrics)), "summary"))):
        assert time.monotonic() < deadline, "no summary:\n" + tail(run_dir)
        time.sleep(0.2)
    for node in nodes:
        while node.poll() is None and subprocess.run(["pgrep", "-P", str(node.pid)], capture_output=True).stdout:
            assert time.monotonic() < deadline, "a worker did not exit:\n" + tail(run_dir)
            time.sleep(0.2)
    for log in sorted(run_dir.parent.glob(f"{run_dir.name}-node*.log")):  # torchrun reports a worker's failure
        assert "failed (exitcode" not in log.read_text(), f"a worker exited non-zero:\n{tail(run_dir)}"
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
    return read_metrics(str(metrics))


def tail(run_dir: Path) -> str:
    return "\n".join(p.read_text()[-2500:] for p in sorted(run_dir.parent.glob(f"{run_dir.name}-node*.log")))


def expected_steps(lost: dict) -> int:
    """3 epochs: 16 steps each with 3 ranks, until the epoch of the loss ends; 24 each (2 ranks cover the whole
    training set) from the next epoch on."""
    epoch = lost["epoch"]  # the epoch in which the loss was recovered from
    return 16 * epoch + 24 * (3 - epoch)


def wait_for_train_steps(run_dir: Path, n: int, timeout: float = 180) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    while not (metrics.exists() and len(records(read_metrics(str(metrics)), "train")) >= n):
        assert time.monotonic() < deadline, f"fewer than {n} steps:\n" + tail(run_dir)
        time.sleep(0.05)


# All in make test-full; make test: test_scope's node killed under allreduce (the same kill -9 of an agent and its
# workers between two steps, a whole node of two, every step once) and test_chaos's seeded losses at process scope
@pytest.mark.full
@pytest.mark.parametrize("sync", ["allreduce", "dgc", "localsgd"])
def test_a_killed_node_leaves_and_the_others_finish_the_run(tmp_path, sync):
    """``kill -9`` of one node's agent and worker mid-epoch: the other two agree it died, regroup, redo the step
    and finish; the summary and the ``rank_lost`` event say what happened, and their replicas agree. (DGC's put-back
    of a failed exchange also has a unit test in test_dgc.py.)"""
    run_dir = tmp_path / "run"
    extra = {"dgc": ["sync.min_compress_numel=1024", "sync.rampup_begin_step=2"], "localsgd": ["sync.k_steps=4"]}
    # Rank 2 sleeps 0.3 s before each step; it is killed in that sleep, when it has finished the last step and
    # started no collective of the next. (Killed inside a step's last collective, one survivor may finish it and
    # the other not: the one behind is healed from the front, a case of its own below.)
    pace = ["straggler=sleep", "straggler.ranks=[2]", "straggler.start_epoch=1", "straggler.sleep_s=0.3"]
    nodes = start_nodes(3, run_dir, *SHRINK, f"sync={sync}", *extra.get(sync, []), *pace)
    wait_for_train_steps(run_dir, 10)
    victim = next(node for node in nodes if worker_of(node)[1] == 2)
    worker_pid, _ = worker_of(victim)
    deadline = time.monotonic() + 30
    while "nanosleep" not in Path(f"/proc/{worker_pid}/wchan").read_text():
        assert time.monotonic() < deadline, "rank 2 never sleeps"
        time.sleep(0.005)
    os.killpg(victim.pid, signal.SIGKILL)  # the agent, and the worker in its own session
    os.kill(worker_pid, signal.SIGKILL)
    metrics = finish([n for n in nodes if n is not victim], run_dir)
    victim.wait()

    (lost,) = [e for e in records(metrics, "event") if e["event"] == "rank_lost"]
    assert lost["ranks"] == [2] and lost["cause"] == "died" and lost["world_size"] == 2 and lost["noticed"] == "ended"
    assert lost["failed_step"] >= 10 and lost["recovery_s"] > 0
    # what was in flight: local SGD communicates only in its exchange (and at evaluations and checkpoints)
    assert lost["redo"] in {"exchange" if sync == "localsgd" else "step", "evaluation", "checkpoint"}
    if sync == "dgc":
        assert lost["lost_state_bytes"] > 0  # its residuals died with it
    (summary,) = records(metrics, "summary")
    assert summary["finished"] and summary["steps"] == expected_steps(lost) and summary["world_size"] == 2
    assert summary["lost_ranks"] == [2] and summary["evicted_ranks"] == [] and summary["evictions"] == 0
    steps = [r["step"] for r in records(metrics, "train")]
    assert steps == list(range(summary["steps"]))  # the lost step was redone once, not skipped, not repeated
    assert [r["world_size"] for r in records(metrics, "train")][-1] == 2
    assert summary["replica_spread"] == 0.0  # the survivors end with identical parameters
    events = [e["event"] for e in records(metrics, "event")]
    assert "loader_rebuilt" in events and "lr_adjusted" in events


@pytest.mark.full  # ~30 s; make test: test_alarm (a wait nothing fails ends) and the losses above; test-gpu runs it
def test_a_node_lost_in_a_ring_of_four_is_seen_at_once_by_the_survivor_not_beside_it(tmp_path):
    """Four nodes, ``kill -9`` of the third: in gloo's ring the first node exchanges with the second and the fourth
    only, so nothing it waits for fails; its two neighbours, which saw the loss, check in, and that wakes its wait.
    The run goes on well before ``hang_timeout_s`` (120 s) would have ended that wait."""
    run_dir = tmp_path / "run"
    overrides = [
        *FAST, "data.num_samples=1024", "data.num_val_samples=64", "trainer.epochs=2", "trainer.on_failure=continue",
        "trainer.hang_timeout_s=120", "straggler=sleep", "straggler.ranks=[2]", "straggler.start_epoch=1",
        "straggler.sleep_s=0.3",
    ]  # fmt: skip
    nodes = start_nodes(4, run_dir, *overrides)
    wait_for_train_steps(run_dir, 3)
    victim = next(node for node in nodes if worker_of(node)[1] == 2)
    worker_pid, _ = worker_of(victim)
    killed_at = time.time()
    os.killpg(victim.pid, signal.SIGKILL)
    os.kill(worker_pid, signal.SIGKILL)
    metrics = finish([n for n in nodes if n is not victim], run_dir)
    victim.wait()

    (lost,) = [e for e in records(metrics, "event") if e["event"] == "rank_lost"]
    assert lost["ranks"] == [2] and lost["cause"] == "died" and lost["world_size"] == 3 and lost["noticed"] == "ended"
    # Agreed once its end was seen, not after the deadline (a margin of 60 s for a loaded machine).
    assert lost["time"] - killed_at < 60, lost
    (summary,) = records(metrics, "summary")
    assert summary["finished"] and summary["world_size"] == 3 and summary["replica_spread"] == 0.0
    assert [r["step"] for r in records(metrics, "train")] == list(range(summary["steps"]))


@pytest.mark.full  # ~2 min; in make test, the sampler's test_units case covers the resume at another world size
def test_a_node_started_later_joins_through_torchrun_scale_up_and_nothing_is_lost_or_repeated(tmp_path):
    """``torchrun --nnodes 2:3`` on two nodes, then a third: the agents stop the two workers with SIGTERM, which
    checkpoint at an agreed step; the world restarts at 3 (the restart count stays 0), resumes from that step on its
    own, trains the rest of the epoch on the samples not yet seen, and finishes."""
    run_dir, port = tmp_path / "run", free_port()
    overrides = [
        *FAST,
        "data.num_samples=3072",
        "data.num_val_samples=96",
        "trainer.epochs=2",
        "straggler=sleep",
        "straggler.ranks=[0,1]",
        "straggler.start_epoch=1",
        "straggler.sleep_s=0.5",
    ]  # fmt: skip  (48 steps per epoch at 2 ranks, 32 at 3; half a second each: the third node joins mid-epoch 1)
    start = partial(start_node, nnodes="2:3", port=port, run_dir=run_dir, overrides=overrides)
    # torch's agents reuse the first round's store address when a node joins later; a store per round works
    share = {"rdzv_conf": ",last_call_timeout=1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    nodes = [start(0, **share), start(1, **share)]
    wait_for_train_steps(run_dir, 6)
    nodes.append(start(2, **share))
    metrics = finish(nodes, run_dir, timeout=300)

    (resume,) = [e for e in records(metrics, "event") if e["event"] == "resume"]
    assert resume["world_size_before"] == 2 and resume["restart"] == 0
    stopped = resume["step"]  # the agreed stop step
    assert 6 <= stopped < 48
    summary = records(metrics, "summary")[-1]  # (the first world's stop wrote one too)
    # at 3 ranks: the rest of epoch 1 (3072 - 64 * stopped samples over 3 ranks of 32), then 32 steps
    expected = stopped + (3072 - 64 * stopped) // 3 // 32 + 32
    assert summary["finished"] and summary["world_size"] == 3 and summary["steps"] == expected
    steps = [r["step"] for r in records(metrics, "train")]
    assert steps == list(range(expected))  # every step once, in order, across the two worlds
    worlds = [r["world_size"] for r in records(metrics, "train")]
    assert set(worlds[:stopped]) == {2} and set(worlds[stopped:]) == {3}
    assert summary["replica_spread"] == 0.0
    assert "resumed in torchrun job run after its stop" in tail(run_dir)


@pytest.mark.full  # ~2 min; the two halves (a killed node, a node that joins) are tested apart above
def test_a_killed_node_started_again_rejoins_the_survivors(tmp_path):
    """``--nnodes 2:3`` with ``on_failure=continue``: a node is killed, the two others go on; the same torchrun
    command started again on it joins, and the run finishes at 3 with every step once."""
    run_dir, port = tmp_path / "run", free_port()
    overrides = [
        *FAST, "data.num_samples=3072", "data.num_val_samples=96", "trainer.epochs=2",
        "trainer.on_failure=continue", "trainer.hang_timeout_s=10",
        "straggler=sleep", "straggler.ranks=[0,1]", "straggler.start_epoch=1", "straggler.sleep_s=0.5",
    ]  # fmt: skip
    start = partial(start_node, nnodes="2:3", port=port, run_dir=run_dir, overrides=overrides)
    share = {"rdzv_conf": ",last_call_timeout=5", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    nodes = [start(node, **share) for node in range(3)]
    wait_for_train_steps(run_dir, 6)
    victim = nodes[2]  # (not the first node: it hosts the store)
    worker_pid, rank = worker_of(victim)
    os.killpg(victim.pid, signal.SIGKILL)
    os.kill(worker_pid, signal.SIGKILL)
    victim.wait()
    deadline = time.monotonic() + 60
    while not [e for e in records(read_metrics(str(run_dir / "metrics.jsonl")), "event") if e["event"] == "rank_lost"]:
        assert time.monotonic() < deadline, "no rank_lost:\n" + tail(run_dir)
        time.sleep(0.2)
    nodes[2] = start(2, **share)
    metrics = finish(nodes, run_dir, timeout=300)

    (lost,) = [e for e in records(metrics, "event") if e["event"] == "rank_lost"]
    assert lost["ranks"] == [rank] and lost["cause"] == "died" and lost["world_size"] == 2
    (resume,) = [e for e in records(metrics, "event") if e["event"] == "resume"]
    assert resume["world_size_before"] == 2 and resume["step"] > lost["failed_step"]
    summary = records(metrics, "summary")[-1]
    assert summary["finished"] and summary["world_size"] == 3 and summary["replica_spread"] == 0.0
    steps = [r["step"] for r in records(metrics, "train")]
    assert steps == list(range(summary["steps"]))  # every step once, in order: 3 ranks, 2, then 3 again
    worlds = [r["world_size"] for r in records(metrics, "train")]
    assert worlds[0] == 3 and 2 in worlds and worlds[-1] == 3


@pytest.mark.parametrize("where", ["step", pytest.param("evaluation", marks=pytest.mark.full)])
def test_a_hung_worker_is_given_up_and_exits_cleanly_when_it_wakes(tmp_path, where):
    """SIGSTOP of one worker (local launcher, 3 processes) in a step, or as the first evaluation begins: after
    ``hang_timeout_s`` the others remove it as hung, redo what was in flight and finish; continued afterwards, it
    finds itself removed and exits 0 without disturbing them. (The evaluation case runs in ``make test-full``; the
    step case covers the same recovery in ``make test``.)"""
    import threading

    from _workers import rank2_stops_in_first_evaluation, writes_its_pid

    run_dir = tmp_path / "run"
    woke: list[float] = []

    def stop_then_continue():
        wait_for_train_steps(run_dir, 6)
        pid = int((run_dir / "pid2").read_text())
        if where == "step":
            os.kill(pid, signal.SIGSTOP)
        wait_for_train_steps(run_dir, 24)  # the others went on without it
        os.kill(pid, signal.SIGCONT)
        woke.append(time.time())

    poke = threading.Thread(target=stop_then_continue, daemon=True)
    poke.start()
    entry = writes_its_pid if where == "step" else rank2_stops_in_first_evaluation
    _, metrics = train(run_dir, *SHRINK, "trainer.nproc=3", entrypoint=entry)  # raises if a worker fails
    poke.join(timeout=60)
    assert woke, "the stopped worker was never continued"
    (lost,) = [e for e in records(metrics, "event") if e["event"] == "rank_lost"]
    assert lost["ranks"] == [2] and lost["cause"] == "hung" and lost["world_size"] == 2 and lost["redo"] == where
    assert lost["noticed"] == "silence"  # (a stopped process keeps its connections: only its silence tells)
    (summary,) = records(metrics, "summary")
    assert summary["finished"] and summary["lost_ranks"] == [2] and summary["replica_spread"] == 0.0
    assert summary["steps"] == expected_steps(lost)
    assert [r["step"] for r in records(metrics, "train")] == list(range(summary["steps"]))
    evals = records(metrics, "eval")
    assert [e["epoch"] for e in evals] == [1, 2, 3] and all(e["num_samples"] == 96 for e in evals)
    log = (run_dir / "train.log").read_text()
    assert f"relaxsync: rank(s) [2] hung at step {lost['failed_step']}; 2 ranks go on and redo the {where}" in log


OBSCURE_TEXTS = {  # what a survivor's failed collective said, in cases the fault tests did not meet first
    "gloo pair closed by a timeout": ("RuntimeError", "[pair.cc:598] Application timeout caused pair closure"),
    "NCCL communicator aborted": ("DistBackendError", "NCCL communicator was aborted on rank 0."),
}  # fmt: skip


@pytest.mark.parametrize(
    "case", [c if c.startswith("gloo") else pytest.param(c, marks=pytest.mark.full) for c in OBSCURE_TEXTS]
)  # (in make test gloo's text; the unit test below covers NCCL's type, which the run checks in make test-full)
def test_a_hung_peer_is_survived_whatever_the_error_the_survivors_collective_raised(tmp_path, monkeypatch, case):
    """Rank 2 hangs before the exchange of step 6; the survivors' exchange fails with an error whose text names
    neither a timeout nor a closed connection (tests/_obscure.py): the store, not the text, says rank 2 is gone,
    and the run goes on at 2 ranks; rank 2, continued, leaves with status 0."""
    import threading

    kind, text = OBSCURE_TEXTS[case]
    run_dir, pid_file = tmp_path / "run", tmp_path / "victim.pid"
    for key, value in {"OBSCURE_PID_FILE": str(pid_file), "OBSCURE_ERROR": kind, "OBSCURE_TEXT": text}.items():
        monkeypatch.setenv(key, value)

    def wake_the_victim() -> None:
        wait_for_train_steps(run_dir, 12)  # the others went on without it
        os.kill(int(pid_file.read_text()), signal.SIGCONT)

    threading.Thread(target=wake_the_victim, daemon=True).start()
    overrides = [*SHRINK, "trainer.nproc=3", "sync=none", "sync._target_=tests._obscure.ObscureFailure"]
    _, metrics = train(run_dir, *overrides)  # raises if a worker fails
    (lost,) = [e for e in records(metrics, "event") if e["event"] == "rank_lost"]
    assert lost["ranks"] == [2] and lost["cause"] == "hung" and lost["failed_step"] == 6, lost
    (summary,) = records(metrics, "summary")
    assert summary["finished"] and summary["lost_ranks"] == [2] and summary["replica_spread"] == 0.0
    assert [r["step"] for r in records(metrics, "train")] == list(range(summary["steps"]))
    assert summary["steps"] == expected_steps(lost)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("[gloo/transport/tcp/pair.cc:598] Application timeout caused pair closure"),
        RuntimeError("NCCL operation failed"),
        RuntimeError("ncclRemoteError: a call failed possibly due to a remote process exiting prematurely"),
        torch.distributed.DistBackendError("NCCL communicator was aborted on rank 1."),
        torch.OutOfMemoryError("CUDA out of memory"),  # (on one rank: its peers' collectives fail next)
    ],
    ids=lambda e: type(e).__name__ + ": " + str(e)[:40],
)
def test_any_error_torch_raises_may_be_a_loss_and_the_store_decides(error):
    from engine.elastic.failures import may_be_a_loss

    assert may_be_a_loss(error)


@pytest.mark.parametrize("error", [KeyError("lr"), ValueError("bad"), NotImplementedError("todo"), SystemExit(0)])
def test_python_errors_of_a_ranks_own_are_never_a_loss(error):
    from distributed.membership import LeftRun
    from engine.elastic.failures import may_be_a_loss

    assert not may_be_a_loss(error) and not may_be_a_loss(LeftRun(2, "evicted"))


def _two_ranks_on_one_store(hang_timeout_s: float):
    """Rank 0's ``Failures`` over a store on which a thread plays rank 1's heartbeat."""
    import threading

    import torch.distributed as dist

    from distributed.membership import Membership
    from engine.elastic.failures import BEAT_S, Failures

    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    membership = Membership(0, 2)
    membership._store = store
    failures = Failures(membership, hang_timeout_s=hang_timeout_s)
    done = threading.Event()

    def rank1_beats() -> None:
        while not done.is_set():
            store.add(failures.heartbeat.key(1), 1)
            done.wait(BEAT_S)

    threading.Thread(target=rank1_beats, daemon=True).start()
    return failures, store, done


@pytest.mark.parametrize(
    "error",
    [torch.distributed.DistBackendError("NCCL communicator was aborted on rank 0."), RuntimeError("CUDA error")],
    ids=["DistBackendError", "RuntimeError"],
)
def test_when_no_peer_is_gone_at_a_part_regrouped_too_often_the_error_is_raised_again_as_it_was(error):
    """Rank 1 beats and saw the failure too: nobody is gone. The same ranks regroup and redo the part, a few times
    at most at one part of one step (tests/test_strangers.py: a run survives one); past that, rank 0 raises its own
    error again, itself, with a note, not a report that the store is unreachable (an NCCL error is a DistError, as
    the store's are)."""
    from engine.elastic.failures import RENEWALS
    from engine.elastic.positions import Phase, Position

    failures, store, done = _two_ranks_on_one_store(hang_timeout_s=5)
    try:
        failures._check_in(0, 1, "hung")  # rank 1 saw the failure too
        failures.renewals[(3, Phase.STEP.value)] = RENEWALS  # (regrouped there as often as it may be)
        with pytest.raises(type(error)) as raised:
            failures.recover(error, Position(3, Phase.STEP))
        assert raised.value is error
        assert any(f"the {RENEWALS} regroups at the step of step 3" in n for n in error.__notes__)
    finally:
        done.set()


def test_a_peer_that_keeps_beating_elsewhere_leaves_the_error_as_it_was_with_a_note():
    """This rank's part failed, rank 1 beats but never reaches a failure: after ``hang_timeout_s`` + ``SILENT_S``
    rank 0's own error goes on up, saying that no peer is gone."""
    from engine.elastic.positions import Phase, Position

    error = RuntimeError("an error of rank 0's own")
    failures, _, done = _two_ranks_on_one_store(hang_timeout_s=0.5)
    try:
        with pytest.raises(RuntimeError) as raised:
            failures.recover(error, Position(3, Phase.STEP))
        assert raised.value is error
        assert any("rank(s) [1] kept beating but never reached this failure" in n for n in error.__notes__)
    finally:
        done.set()


@pytest.mark.full
def test_when_the_store_host_dies_the_others_exit_with_a_clear_error(tmp_path):
    """The c10d store lives with the first node's agent: without it there is nothing to agree through, so the
    survivors exit non-zero at once, saying so, instead of hanging. (``make test-full``; ``make test`` reaches the
    store's agreement path in the killed-node test.)"""
    run_dir = tmp_path / "run"
    nodes = start_nodes(3, run_dir, *SHRINK)
    wait_for_train_steps(run_dir, 6)
    host = nodes[0]  # is_host=1
    worker_pid, _ = worker_of(host)
    os.killpg(host.pid, signal.SIGKILL)
    os.kill(worker_pid, signal.SIGKILL)
    codes = [node.wait(timeout=120) for node in nodes[1:]]
    host.wait()
    assert all(code != 0 for code in codes)
    logs = [p.read_text() for p in sorted(tmp_path.glob("run-node*.log"))[1:]]
    assert all("cannot reach the c10d store to agree with the others" in log for log in logs), tail(run_dir)


def test_a_peer_silent_before_the_failure_is_recognised_without_watching_it_again(monkeypatch):
    """The heartbeat thread keeps each peer's last beat change: when a collective times out, a peer that stopped
    beating long before is known to be gone at once; a peer that beats is not (rank 0 of 3, peers 1 and 2 played by
    threads on one store)."""
    import threading

    import torch.distributed as dist

    from distributed.membership import Membership
    from engine.elastic import failures as failures_module
    from engine.elastic.failures import BEAT_S, SILENT_S, Failures

    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    membership = Membership(0, 3)
    membership._store = store
    failures = Failures(membership, hang_timeout_s=5)
    store.add(failures.heartbeat.key(2), 1)  # rank 2 beat once, then hung
    done = threading.Event()

    def rank1_beats() -> None:
        while not done.is_set():
            store.add(failures.heartbeat.key(1), 1)
            done.wait(BEAT_S)

    beating = threading.Thread(target=rank1_beats, daemon=True)
    beating.start()
    failures.heartbeat.start()
    try:
        time.sleep(SILENT_S + 1)  # rank 2 silent for longer than SILENT_S while the heartbeat thread watched
        seen = failures.heartbeat.seen()
        assert time.monotonic() - seen[2][1] >= SILENT_S and time.monotonic() - seen[1][1] < SILENT_S
        failures._check_in(0, 1, "hung")  # rank 1 saw the failure too

        def no_waiting(seconds: float) -> None:
            raise AssertionError("waited to watch a peer that was known to be silent")

        monkeypatch.setattr(failures_module.time, "sleep", no_waiting)
        assert failures._silent_peers(0) == ([2], [])
    finally:
        done.set()
        failures.heartbeat.stop()
        beating.join()


def test_a_peer_its_watchers_report_silent_is_taken_for_gone_without_watching_its_beats(monkeypatch):
    """Beyond 17 ranks the store hears a rank's beat only every few seconds; its watchers report its silence on the
    generation's board instead (distributed/presence.py), and a survivor takes a peer reported silent, and not
    heard since, for gone at once. A report withdrawn (heard again) does not count."""
    import torch.distributed as dist

    from distributed import board
    from distributed.membership import Membership
    from engine.elastic import failures as failures_module
    from engine.elastic.failures import Failures
    from engine.elastic.heartbeat import BEAT_S, store_period

    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    membership = Membership(0, 40)
    membership._store = store
    failures = Failures(membership, hang_timeout_s=5)
    failures.heartbeat.period_s = store_period(40)
    assert store_period(17) == BEAT_S and store_period(40) > BEAT_S and store_period(1024) == 1024 / 100
    for r in range(1, 40):
        if r != 7:
            failures._check_in(0, r, "hung")  # (everyone but rank 7 saw the failure)
    silences = membership.key("presence/silent/0")
    board.post(store, silences, "7.6", "+")  # rank 6 reports rank 7 silent...
    board.post(store, silences, "12.11", "+")
    board.post(store, silences, "12.11", "-")  # ...and rank 11 heard rank 12 again

    def no_waiting(seconds: float) -> None:
        raise AssertionError("waited to watch a peer its watchers report silent")

    monkeypatch.setattr(failures_module.time, "sleep", no_waiting)
    assert failures._silent_peers(0) == ([7], [])


def test_beyond_17_ranks_the_heartbeat_beats_in_the_store_once_a_period_and_reads_no_peers():
    import torch.distributed as dist

    from distributed.membership import Membership
    from engine.elastic.heartbeat import Heartbeat, store_period

    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    membership = Membership(0, 60)
    membership._store = store
    heartbeat = Heartbeat(membership)
    heartbeat.start()
    try:
        time.sleep(1.0)
        assert heartbeat.period_s == store_period(60) and heartbeat._loop.period_s == store_period(60)
        assert int(store.get(heartbeat.key(0))) <= 2  # (at 0 s and 0.6 s; every 0.2 s it would be 5)
        assert heartbeat.seen() == {}  # (no peer's beat read: their watchers report their silences)
    finally:
        heartbeat.stop()


NETNS = _netns_unavailable()


@pytest.mark.full  # ~5 min; make test covers each case with torchrun agents on localhost (above)
@pytest.mark.skipif(NETNS is not None, reason=f"network emulation unavailable: {NETNS}")
def test_in_network_namespaces_a_dead_node_a_hung_one_and_one_that_joins_later(tmp_path):
    """bench/faults' scenarios on 3 emulated nodes at 1 Gbit: ``kill -9`` of a node (allreduce), SIGSTOP of a
    worker (5 s deadline), and a node started after the other two under ``--nnodes 2:3``."""
    from bench import faults

    argv = ["--scenarios", "died,hung,rejoin", "--algorithms", "allreduce", "--hang-timeout", "5"]
    assert faults.main([*argv, "--port", str(free_port()), "--out", str(tmp_path)]) == 0
    rows = {r["scenario"]: r for r in json.loads((tmp_path / "faults-died-hung-rejoin.json").read_text())["rows"]}
    assert not [r for r in rows.values() if "error" in r], rows
    for name, cause in (("died (allreduce)", "died"), ("hung", "hung")):
        row = rows[name]
        assert row["cause"] == cause and row["finished"] and row["world_size"] == 2, row
        assert row["lost_steps"] == 0 and row["steps_in_order"] and row["replica_spread"] == 0.0, row
        assert row["recovery_s"] >= row["visible_s"] > 0, row
    assert rows["hung"]["visible_s"] >= 5 and rows["hung"]["woken_exits_cleanly"]  # seen at the deadline, not before
    joined = rows["rejoin"]
    assert joined["world_sizes"] == [2, 3] and joined["finished"], joined
    assert joined["lost_steps"] == 0 and joined["steps_in_order"], joined


def test_survivors_one_collective_apart_agree_on_the_front_and_who_is_behind_it():
    """The peer died inside the last collective of a step that rank 0 finished and rank 1 did not: rank 0 is in the
    next step, rank 1 still in the exchange of the last; rank 0 is the front, rank 1 is healed from it. The loop's
    order at one step count: evaluation, checkpoint and epoch start (after the previous step), then the step, its
    exchange."""
    from engine.elastic.positions import left_behind

    assert left_behind({0: [11, "step"], 1: [10, "exchange"], 3: [11, "step"]}) == ([11, "step"], [1])
    assert left_behind({0: [10, "step"], 1: [10, "exchange"]}) == ([10, "exchange"], [0])
    assert left_behind({0: [12, "evaluation"], 1: [11, "exchange"]}) == ([12, "evaluation"], [1])
    assert left_behind({0: [12, "checkpoint"], 1: [12, "evaluation"]}) == ([12, "checkpoint"], [1])
    assert left_behind({0: [12, "step"], 1: [12, "epoch start"]}) == ([12, "step"], [1])
    assert left_behind({0: [5, "step"], 1: [5, "step"]}) == ([5, "step"], [])


# (kill step, where the exchange is, extra overrides) -> (the front's part redone, its step). 16 steps per epoch.
HEAL_CASES = {
    "step": ((12, "backward", []), ("step", 13)),  # DDP's case: gradients, before the optimizer step
    "exchange": ((12, "exchange", []), ("exchange", 13)),  # local SGD's: parameters, after it
    "evaluation on the side": ((12, "exchange", ["trainer.eval_every_steps=13"]), ("evaluation", 13)),
    "step checkpoint": ((12, "exchange", ["trainer.checkpoint_every_steps=13"]), ("checkpoint", 13)),
    "epoch end": ((15, "exchange", []), ("evaluation", 16)),  # the last step of epoch 1: its evaluation fails
}


@pytest.mark.parametrize(
    "case", [c if c == "step" else pytest.param(c, marks=pytest.mark.full) for c in HEAL_CASES]
)  # (in make test the step case; the others enter the loop at the other places, in make test-full)
def test_a_survivor_one_collective_behind_is_healed_from_the_front_and_the_run_goes_on_with_every_step_once(
    tmp_path, case
):
    """A node dies inside an exchange that one survivor (rank 1) finishes and the other (rank 0, the logging rank)
    does not (tests/_partial.py makes the kill land there): rank 1 goes on to its next collective, so the two are
    one collective apart. Rank 0 takes rank 1's state and the records it missed, enters the loop where rank 1 is
    (the next step, its exchange, an evaluation or checkpoint between steps, the end of the epoch), and both
    finish: every step recorded once, identical replicas, both workers exit 0."""
    (kill_step, where, extra), (redo, front_step) = HEAL_CASES[case]
    run_dir, port = tmp_path / "run", free_port()
    overrides = [*SHRINK, "sync=none", "sync._target_=tests._partial.PartialExchange", *extra]
    environ = {"PARTIAL_KILL_STEP": str(kill_step), "PARTIAL_IN": where}
    nodes = [start_node(node, "3", port, run_dir, overrides, **environ) for node in range(3)]
    wait_for_train_steps(run_dir, 1)
    node_of = {worker_of(node)[1]: node for node in nodes}
    metrics = finish([node_of[0], node_of[1]], run_dir)
    assert node_of[2].wait(timeout=30) == -signal.SIGKILL  # the victim killed its agent

    (lost,) = [e for e in records(metrics, "event") if e["event"] == "rank_lost"]
    assert lost["ranks"] == [2] and lost["cause"] == "died" and lost["world_size"] == 2, lost
    assert lost["caught_up"] == [0] and lost["redo"] == redo and lost["step"] == front_step, lost
    (summary,) = records(metrics, "summary")
    assert summary["finished"] and summary["steps"] == expected_steps(lost) and summary["world_size"] == 2
    assert summary["lost_ranks"] == [2] and summary["evictions"] == 0
    train = records(metrics, "train")
    assert [r["step"] for r in train] == list(range(summary["steps"]))  # the kill step's record came from rank 1
    assert [r["world_size"] for r in train][kill_step + 1 :] == [2] * (summary["steps"] - kill_step - 1)
    assert summary["replica_spread"] == 0.0  # the healed replica is the front's, and both go on averaging
    if redo == "evaluation":
        assert [e["step"] for e in records(metrics, "eval")].count(front_step) == 1  # written once, after the redo
    assert "take rank 1's state" in (run_dir / "train.log").read_text()


# (~20 s each, in make test-full; make test: the heal from the front in the step case above, and DGC's own part of it
# in test_dgc, a rank healed in the sparse exchange going on bit for bit as without the failure)
DGC_HEAL = {
    "relaxed-wrapped": pytest.param(
        ["sync=relaxed", "sync@sync.inner=dgc", "sync.inner._target_=tests._partial.PartialDGC"],
        marks=pytest.mark.full,
    ),
    "alone": pytest.param(["sync=dgc", "sync._target_=tests._partial.PartialDGC"], marks=pytest.mark.full),
}


@pytest.mark.parametrize("sync", DGC_HEAL.values(), ids=DGC_HEAL.keys())
def test_a_survivor_healed_in_dgcs_sparse_exchange_ends_bit_identical_to_the_front(tmp_path, sync):
    """DGC keeps replicas identical, and must after a heal too: a node dies inside the sparse allgather of step 12,
    which rank 1 finishes and rank 0 does not (tests/_partial.py). Rank 0 takes rank 1's replica with the dense
    momentum every rank shares, and drops the share it had selected (rank 1 applied it). A rank that kept its own
    dense momentum drifted from the others for the rest of the run."""
    run_dir, port = tmp_path / "run", free_port()
    overrides = [*SHRINK, *sync, "optimizer=momentum"]
    nodes = [start_node(node, "3", port, run_dir, overrides, PARTIAL_KILL_STEP="12") for node in range(3)]
    wait_for_train_steps(run_dir, 1)
    node_of = {worker_of(node)[1]: node for node in nodes}
    metrics = finish([node_of[0], node_of[1]], run_dir)
    (lost,) = [e for e in records(metrics, "event") if e["event"] == "rank_lost"]
    assert lost["ranks"] == [2] and lost["caught_up"] == [0] and lost["step"] == 13, lost
    (summary,) = records(metrics, "summary")
    assert summary["finished"] and summary["steps"] == expected_steps(lost)
    assert [r["step"] for r in records(metrics, "train")] == list(range(summary["steps"]))
    assert summary["replica_spread"] == 0.0


@pytest.mark.full  # ~25 s; make test: test_in_flight (dropped alike by every algorithm) and chaos's overlap cells
def test_a_gossip_round_in_flight_on_the_lost_ranks_group_is_dropped_when_the_epoch_end_drains_it(tmp_path):
    """Overlapped SGP: a node dies after the last step of epoch 1, before posting its round of that step
    (tests/_partial.py). The others' round of that step, posted on the group that held it, is waited for when the
    epoch's evaluation drains the rounds in flight: that wait fails, they regroup and redo the evaluation, and the
    round is dropped (its shares come back) instead of waited for on the old group until the deadline."""
    run_dir, port = tmp_path / "run", free_port()
    overrides = [*SHRINK, "sync=sgp", "sync.overlap=true", "sync._target_=tests._partial.PartialSGP"]
    nodes = [start_node(node, "3", port, run_dir, overrides, PARTIAL_KILL_STEP="15") for node in range(3)]
    wait_for_train_steps(run_dir, 1)
    node_of = {worker_of(node)[1]: node for node in nodes}
    metrics = finish([node_of[0], node_of[1]], run_dir)
    (lost,) = [e for e in records(metrics, "event") if e["event"] == "rank_lost"]
    assert lost["ranks"] == [2] and lost["redo"] == "evaluation", lost
    # (one survivor may have finished the evaluation's next collective before the other's drain failed: it is then
    # a collective ahead and heals the other, as in any exchange; which happens depends on the machine's load)
    assert lost["caught_up"] in ([], [0], [1]), lost
    (summary,) = records(metrics, "summary")
    assert summary["finished"] and summary["steps"] == expected_steps(lost)
    assert [r["step"] for r in records(metrics, "train")] == list(range(summary["steps"]))
    assert [e["epoch"] for e in records(metrics, "eval")] == [1, 2, 3]  # epoch 1's written once, after the redo


def test_survivors_abort_each_group_they_replace_after_a_loss_and_never_the_default_one():
    """What NCCL needs after a loss (a collective of an old group may still wait on the lost rank): every survivor
    aborts the groups it replaces, the active one and the subgroups formed from it (crossover's), once per change
    and before anything runs on the new group; the default group (the first change of a run that trained on it)
    is never aborted, or no group could be formed again. Every group is formed with one collective on it at once
    (NCCL's communicators are made at their first collective, by all members). Checked on torch's ``fake``
    backend, in a process of its own, with spies on ``_abort_process_group`` and ``all_reduce``."""
    script = """
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from distributed.membership import Membership, form_group
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
log, abort, all_reduce = [], dist.distributed_c10d._abort_process_group, dist.all_reduce
dist.distributed_c10d._abort_process_group = lambda group=None: (log.append(("abort", group)), abort(group))
def spy(tensor, group=None, **kw):
    log.append(("first", group))
    return all_reduce(tensor, group=group, **kw)
dist.all_reduce = spy
m = Membership(0, 4, form_group([0, 1, 2, 3]))
assert log == [("first", m.group)], log
sub = m.subgroup([0, 1])
assert log[-1] == ("first", sub), log
groups, log[:] = [m.group], []
for lost, cause in ((3, "died"), (2, "hung")):
    m.adopt({"ranks": [lost], "cause": cause}, abort_replaced=True)
    groups.append(m.group)
expected = [("abort", groups[0]), ("abort", sub), ("first", groups[1]), ("abort", groups[1]), ("first", groups[2])]
assert log == expected and m.ranks == [0, 1], (log, groups)
log[:] = []
on_world = Membership(0, 3)
on_world.subgroup([0, 1])
on_world.adopt({"ranks": [2], "cause": "died"}, abort_replaced=True)
evicted = Membership(0, 3, dist.new_group([0, 1, 2]))
evicted.adopt({"ranks": [2], "cause": "slow"})
assert [kind for kind, _ in log] == ["first", "abort", "first", "first"], log  # WORLD and an eviction's: none
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=dict(env(), PYTHONPATH=str(ROOT)), capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_a_group_is_built_and_registered_where_torch_has_the_registry_helper_under_its_older_name():
    """The groups a run forms after a change are entered in torch's registry by a private helper of torch's, named
    ``_register_pg_in_world`` in torch 2.15 and ``_update_process_group_global_state`` in 2.11 (a cluster's torch
    may be older than the pinned one; on 2.11 every run under ``on_failure=continue`` stopped at its first group).
    With only the older name there, a group of a rank that joined later (global rank 5, group rank 0) is built,
    runs its collective, maps its ranks as new_group's do, and is destroyed cleanly. In a process of its own."""
    script = """
import datetime
import torch, torch.distributed as dist
from distributed.membership import build_group, retire
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
c10d = dist.distributed_c10d  # (as on torch 2.11, from here on)
c10d._update_process_group_global_state = c10d._register_pg_in_world
del c10d._register_pg_in_world
group = build_group(dist.HashStore(), [5], 5, "gloo", datetime.timedelta(seconds=30))
assert dist.get_process_group_ranks(group) == [5] and dist.get_backend(group) == "gloo"
assert c10d.get_group_rank(group, 5) == 0 and group in c10d._world.pg_map
box = torch.ones(3)
dist.broadcast(box, src=5, group=group)
retire([group])
assert group not in c10d._world.pg_map
dist.destroy_process_group()  # (the default group too: its threads are not left to the interpreter's exit)
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=dict(env(), PYTHONPATH=str(ROOT)), capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_under_continue_nccl_is_kept_from_ending_the_survivors():
    """torch's NCCL watchdog ends a process whose collective failed unless its mode is 0 or 2; torchrun's agent
    gives its workers 1. A worker of a run that survives failures sets 2 over it (and over torch's default, 3).
    It also asks for no flight-recorder dump on a failure and for no wait for one (the watchdog sleeps 60 s by
    default, dump or not, and the group's destructor waits for it: seen on a GPU), unless the user chose."""
    from distributed.world import NCCL_DUMP_ON_TIMEOUT, NCCL_DUMP_WAIT_MS, NCCL_ERROR_HANDLING, nccl_environment

    no_dump = {NCCL_DUMP_ON_TIMEOUT: "0", NCCL_DUMP_WAIT_MS: "0"}
    assert nccl_environment(True, {}) == {NCCL_ERROR_HANDLING: "2", **no_dump}
    assert nccl_environment(True, {NCCL_ERROR_HANDLING: "1"}) == {NCCL_ERROR_HANDLING: "2", **no_dump}  # torchrun's
    assert nccl_environment(True, {NCCL_ERROR_HANDLING: "3"}) == {NCCL_ERROR_HANDLING: "2", **no_dump}
    assert nccl_environment(True, {NCCL_ERROR_HANDLING: "0"}) == no_dump
    users = {NCCL_ERROR_HANDLING: "2", NCCL_DUMP_ON_TIMEOUT: "1", NCCL_DUMP_WAIT_MS: "15000"}
    assert nccl_environment(True, users) == {}  # the user's choice
    assert nccl_environment(False, {NCCL_ERROR_HANDLING: "1"}) == {}  # under abort, torchrun's choice stands


def _survivors_form_ahead(rank: int, port: int, out: str) -> None:
    """Three members of one group; rank 2 beats, then dies. Ranks 0 and 1 wait until their heartbeats have formed
    the group without it, adopt its removal as a recovery would propose it, and record what they got."""
    import datetime

    import torch.distributed as dist

    from distributed.membership import Membership
    from engine.elastic.failures import Heartbeat

    timeout = datetime.timedelta(seconds=30)
    m = Membership(rank, 3, timeout=timeout, backend="gloo", prefix="ahead-test")
    m._store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    m.group = m.form([0, 1, 2])
    heartbeat = Heartbeat(m)
    heartbeat.start()
    if rank == 2:
        time.sleep(0.5)
        os._exit(0)  # (as killed)
    deadline = time.monotonic() + 20
    while not m.ready([0, 1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    ready, formed = m.ready([0, 1]), dict(m._formed)
    ahead = m._ahead[(0, (0, 1))].group if ready else None
    change = m.adopt({"ranks": [2], "cause": "died", "ahead": ready}, abort_replaced=True)
    t = torch.ones(3) * (rank + 1)
    dist.all_reduce(t, group=m.group)
    heartbeat.stop()
    result = {"ready": ready, "taken": m.group is ahead, "formed_after": dict(m._formed) != formed}
    with open(f"{out}.{rank}", "w") as f:
        json.dump({**result, "ranks": change.ranks, "sum": t.tolist()}, f)


def test_survivors_form_their_group_while_a_silent_peer_is_still_in_the_run_and_a_recovery_takes_it(tmp_path):
    """A peer silent for SILENT_S is most likely gone: each survivor's heartbeat forms, in the background, the group
    the others would have without it, and a removal agreed with ``ahead`` takes that group instead of forming one
    while the survivors stand still (one collective on it: it works for both)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    out = str(tmp_path / "rank")
    start_processes(_survivors_form_ahead, (store.port, out), 3)
    for rank in (0, 1):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        assert got["ready"] and got["taken"] and not got["formed_after"], got
        assert got["ranks"] == [0, 1] and got["sum"] == [3.0, 3.0, 3.0]


def test_a_group_prepared_ahead_that_not_every_member_prepares_is_called_off_and_ends_its_thread():
    """A group formed ahead starts forming only once every member prepares it; one that some never prepare (a
    change came first) is called off at the next change or at the end of the process, and its thread ends (it is
    not a daemon: the interpreter must never end while it forms in C++)."""
    import datetime

    import torch.distributed as dist

    from distributed.membership import Membership

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout)
    m = Membership(0, 3, timeout=timeout, backend="gloo", prefix="called-off")
    m._store = store
    m.prepare([0, 1], 0)  # (rank 1 never prepares it)
    [ahead] = m._ahead.values()
    time.sleep(0.2)
    assert ahead.alive() and not m.ready([0, 1])
    started = time.monotonic()
    m.cancel_ahead()
    ahead._thread.join(timeout=5)
    assert not ahead.alive() and ahead.group is None and time.monotonic() - started < 5
    m.cancel_ahead()  # (kept until its thread ended, to retire its group if it had formed: none)
    assert m._ahead == {} and m._dropped == []


def test_a_member_called_off_after_another_decided_to_form_the_group_ahead_forms_it_too():
    """Whether a group prepared ahead forms is decided once for all its members (the first to see them all prepared,
    or to be called off, decides): a member called off after another saw them all prepared still forms it, or the
    others would wait in gloo's forming for it until the group's timeout, their non-daemon threads holding their
    processes at the end."""
    import datetime

    import torch.distributed as dist

    from distributed.membership import Membership

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout)
    members = [Membership(r, 2, timeout=timeout, backend="gloo", prefix="decided") for r in (0, 1)]
    for m in members:
        m._store = store.clone()
    members[0].prepare([0, 1], 0)
    [ahead] = members[0]._ahead.values()
    time.sleep(0.2)
    decided = dist.PrefixStore(members[0].key("ahead/0/0-1/"), store)
    decided.set("fate", "form")  # (as if rank 1 had seen both prepared first)
    members[0].cancel_ahead()  # (a change came first on rank 0)
    members[1].prepare([0, 1], 0)
    [other] = members[1]._ahead.values()
    for thread in (ahead._thread, other._thread):
        thread.join(timeout=30)
    assert ahead.group is not None and members[1].ready([0, 1]), (ahead.error, other.error)
    members[0].cancel_ahead()  # (its group, formed after it was dropped, is let go at the next change)
    assert members[0]._dropped == []
    members[1].cancel_ahead()
