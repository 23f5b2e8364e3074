"""sync.scope=node: every option at 2 nodes x 2 processes is the option at 2 processes, each with its node's whole
batch (exactly: the same sums in the same order), and the bookkeeping that keeps nodes whole."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from _scope import run, run_alone
from conftest import ROOT, plain_cfg, records, train

from distributed.membership import Change, Membership
from distributed.nodes import NodeView, layout
from engine.scope import NodeScope, build_sync
from errors import ConfigError

CASES = {
    "allreduce": ["sync=allreduce", "sync.bucket_cap_mb=0.001"],
    "powersgd": ["sync=powersgd", "sync.start_powerSGD_iter=2", "sync.min_compression_rate=0.5",
                 "sync.bucket_cap_mb=0.001"],
    "localsgd": ["sync=localsgd", "sync.begin_step=2", "sync.k_steps=3"],
    "adaptive_localsgd": ["sync=adaptive_localsgd", "sync.begin_step=1", "sync.init_k_steps=2"],
    "diloco": ["sync=diloco", "sync.inner_steps=2"],
    "streaming_diloco": ["sync=diloco", "sync.inner_steps=4", "sync.fragments=2", "sync.delay=1", "sync.quantize=int8",
                         "sync.quant_block=64"],
    "dgc": ["sync=dgc", "sync.min_compress_numel=64", "sync.rampup_begin_step=0"],
    "sgp": ["sync=sgp"],
    "sgp_overlap": ["sync=sgp", "sync.overlap=true", "sync.synch_freq=2"],
    "crossover": ["sync=crossover", "sync.segments=2"],
    "relaxed_localsgd": ["sync=relaxed", "sync@sync.inner=localsgd", "sync.inner.k_steps=2",
                         "sync.relaxed_sync_threshold=-1", "sync.check_every=1"],
}  # fmt: skip


def _sections() -> dict[str, dict[str, dict]]:
    """Each case's sync section at each scope."""
    sections = {
        name: plain_cfg(*overrides, "trainer.device=cpu", "trainer.nproc=4")["sync"]
        for name, overrides in CASES.items()
    }
    return {scope: {name: {**s, "scope": scope} for name, s in sections.items()} for scope in ("node", "process")}


def _run_all(fn, nprocs: int, args: tuple, timeout_s: float = 300) -> None:
    """``fn(index, *args)`` in ``nprocs`` processes of the launcher's fork server; a hang fails within ``timeout_s``."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver", join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{fn.__name__}: its processes still ran after {timeout_s:.0f} s (a collective waits forever)")


@pytest.fixture(scope="module")
def runs():
    from engine.launch import start_worker_server

    start_worker_server()  # (the launcher's: its processes have torch and the engine imported already)
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as stores:
        _run_all(run, 6, (stores, _sections(), out))
        yield {(world, rank): torch.load(f"{out}/{world}-{rank}.pt") for world, rank in
               [(4, 0), (4, 1), (4, 2), (4, 3), (2, 0), (2, 1)]}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_nodes_of_two_processes_are_two_processes_of_the_node_batch(runs, case):
    for rank in range(4):
        node = rank // 2
        reference = runs[(2, node)][case]
        assert torch.equal(runs[(4, rank)][case], reference), (
            f"{case}: rank {rank} (node {node}) differs from the process with its node's batch by "
            f"{(runs[(4, rank)][case] - reference).abs().max():.3g}"
        )
    assert not torch.equal(runs[(2, 0)][case], model_start()), f"{case}: the reference did not train"


@pytest.fixture(scope="module")
def alone():
    from engine.launch import start_worker_server

    start_worker_server()
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as stores:
        _run_all(run_alone, 3, (stores, _sections(), out))
        yield {(world, rank): torch.load(f"{out}/alone{world}-{rank}.pt") for world, rank in [(1, 0), (2, 0), (2, 1)]}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_option_trains_on_when_one_node_or_one_process_is_left(alone, case):
    """What is left after losses: a process alone, or one node of 2 processes alone at node scope, trains every option
    on (gossip with nobody to gossip with, a ring of one, a group of one); the node is exactly the process with its
    batch, as two nodes were above."""
    for rank in range(2):
        assert torch.equal(alone[(2, rank)][case], alone[(1, 0)][case]), (
            f"{case}: rank {rank} of the node alone differs from the process alone by "
            f"{(alone[(2, rank)][case] - alone[(1, 0)][case]).abs().max():.3g}"
        )
    assert torch.isfinite(alone[(1, 0)][case]).all() and not torch.equal(alone[(1, 0)][case], model_start())


def model_start() -> torch.Tensor:
    from _scope import model

    return torch.cat([p.detach().reshape(-1) for p in model().parameters()])


# ---- nodes in the membership (no process group needed) ------------------------------------------------------------
def _membership(rank: int, nodes: list[str]) -> Membership:
    return Membership(rank, len(nodes), group=object(), nodes=nodes)


def test_nodes_are_named_by_their_lowest_rank_and_stay_whole():
    m = _membership(3, ["a", "a", "b", "b", "c", "c"])
    assert m.node_ids() == [0, 2, 4] and m.node_ranks() == [2, 3] and layout(m) == (3, 2)
    assert m.with_their_nodes([3]) == [3]  # (process scope: a rank alone)
    m.whole_nodes = True
    assert m.with_their_nodes([3]) == [2, 3] and m.with_their_nodes([0, 5]) == [0, 1, 4, 5]
    view = NodeView(m)
    assert (view.rank, view.ranks, view.size, view.index, view.initial_size) == (2, [0, 2, 4], 3, 1, 3)
    assert (view.local_index, view.local_size, view.peer(4)) == (1, 2, 5)


def test_a_change_reads_in_nodes():
    m = _membership(0, ["a", "a", "b", "b", "c", "c"])
    m.ranks = [0, 1, 4, 5]  # (node b, ranks 2 and 3, removed)
    change = NodeView(m).in_nodes(Change(1, [2, 3], [0, 1, 4, 5], "died"))
    assert (change.removed, change.ranks, change.cause) == ([2], [0, 4], "died")


def test_unequal_nodes_have_no_layout_and_refuse_node_scope():
    m = _membership(0, ["a", "a", "b"])
    assert layout(m) is None
    section = plain_cfg("sync=localsgd", "trainer.device=cpu", "sync.scope=node")["sync"]
    with pytest.raises(ConfigError, match="sync.scope"):
        build_sync(section, m)


def test_auto_is_node_scope_only_with_several_nodes_of_several_processes():
    section = plain_cfg("sync=localsgd", "trainer.device=cpu")["sync"]
    assert section["scope"] == "auto"
    assert isinstance(build_sync(section, _membership(0, ["a", "a", "b", "b"])), NodeScope)
    for nodes in (["a", "b", "c", "d"], ["a", "a", "a", "a"]):
        assert not isinstance(build_sync(section, _membership(0, nodes)), NodeScope), nodes


@pytest.mark.parametrize(
    "overrides",
    [
        ["sync.scope=nodes"],
        ["sync=relaxed", "sync@sync.inner=localsgd", "sync.measure=link", "sync.scope=node"],
    ],
)
def test_a_scope_that_cannot_run_is_refused_before_any_worker(overrides):
    with pytest.raises(ConfigError, match="sync.scope"):
        plain_cfg("trainer.device=cpu", *overrides)


# ---- a run of nodes end to end ----------------------------------------------------------------------------------
@pytest.mark.full  # ~20 s; make test: relaxed over local SGD at node scope in the exactness cases (a node's times, its
# checks), a whole node leaving in the killed-node test below, and test_relaxed's evictions of a process
def test_relaxed_sync_evicts_a_node_slowed_by_one_of_its_processes(tmp_path):
    """2 emulated nodes x 2 processes, rank 3 slowed 3x from epoch 2: its node steps at its pace, and the check at
    the start of epoch 3 evicts the whole node (ranks 2 and 3, both exiting 0); node 0 trains on, its two
    processes one replica."""
    summary, metrics = train(
        tmp_path, "sync=relaxed", "sync.relaxed_sync_threshold=2.0", "straggler=sleep", "straggler.start_epoch=2",
        "straggler.slowdown=3.0", "straggler.ranks=[3]", "model=test_resnet", "data=digits", "logger=none",
        "trainer.progress=false", "trainer.nproc=4", "trainer.local_nodes=2", "trainer.epochs=3",
    )  # fmt: skip
    (world,) = [r for r in records(metrics, "event") if r["event"] == "world"]
    assert world["scope"] == "node" and len(set(world["nodes"].values())) == 2
    (evict,) = [r for r in records(metrics, "event") if r["event"] == "evict"]
    assert evict["ranks"] == [2, 3] and evict["epoch"] == 3 and set(evict["times"]) == {"0", "2"}  # (node 2: 2, 3)
    assert evict["world_size"] == 2
    assert evict["times"]["2"] > 2.0 * evict["reference"]
    assert {r["world_size"] for r in records(metrics, "train") if r["epoch"] >= 3} == {2}
    assert summary["ranks"] == [0, 1] and summary["evicted_ranks"] == [2, 3]
    assert summary["replica_spread"] == 0.0 and summary["top1"] > 30.0


NODE_KILL = {  # every option, with settings that make its state matter within the run
    "allreduce": ["sync=allreduce"],
    "powersgd": ["sync=powersgd", "sync.start_powerSGD_iter=2"],
    "dgc": ["sync=dgc", "sync.min_compress_numel=1024"],
    "localsgd": ["sync=localsgd", "sync.k_steps=4"],
    "adaptive_localsgd": ["sync=adaptive_localsgd", "sync.init_k_steps=4"],
    "diloco": ["sync=diloco", "sync.inner_steps=4"],
    "streaming_diloco": ["sync=diloco", "sync.inner_steps=8", "sync.fragments=2", "sync.delay=1", "sync.quantize=int8"],
    "sgp": ["sync=sgp", "sync.overlap=true"],
    "crossover": ["sync=crossover"],
    "relaxed": ["sync=relaxed", "sync@sync.inner=localsgd", "sync.check_every=4", "sync.relaxed_sync_threshold=-1"],
}


KILL_SEED = int(os.environ.get("CHAOS_SEED", int(time.time() // 86400)))  # (the day's, as tests/test_chaos.py)


def _kill_case(sync: str, moment: str):
    if sync == "allreduce" and moment == "between-steps":
        return pytest.param(sync, moment)
    return pytest.param(sync, moment, marks=pytest.mark.full)


# (make test: allreduce between two steps, its in-backward exchange the most entangled with a loss; the rest in
# test-full: every option between two steps and at a moment drawn from the day's seed)
@pytest.mark.parametrize("sync,moment", [_kill_case(s, m) for s in NODE_KILL for m in ("between-steps", "seeded")])
def test_a_whole_node_killed_leaves_and_the_other_node_finishes_with_every_step_once(tmp_path, sync, moment):
    """2 torchrun agents on this machine, 2 workers each, at node scope; node 1's agent and both its workers
    ``kill -9``ed between two steps, or at a moment drawn from the day's seed (``CHAOS_SEED`` picks one) within
    the steps that follow the 8th (in a forward, a backward, an exchange or a wait for one): node 0 agrees that its
    peers died, regroups as a node alone and finishes, every step recorded once, its two processes one replica."""
    from test_faults import SHRINK, finish, start_nodes, wait_for_train_steps, workers_of

    run_dir = tmp_path / "run"
    pace = ["straggler=sleep", "straggler.ranks=[3]", "straggler.start_epoch=1", "straggler.sleep_s=0.3"]
    nodes = start_nodes(2, run_dir, *SHRINK, "trainer.epochs=2", *NODE_KILL[sync], *pace, procs=2)
    wait_for_train_steps(run_dir, 8)
    victim = nodes[1]
    workers = workers_of(victim)
    assert [rank for _, rank in workers] == [2, 3]
    if moment == "seeded":
        delay = random.Random(f"{KILL_SEED}-{sync}").uniform(0.0, 1.5)  # (a few steps of 0.3 s and more)
        print(f"killing node 1 {delay:.3f} s after step 8 (CHAOS_SEED={KILL_SEED})")
        time.sleep(delay)
    deadline = time.monotonic() + 30
    while moment == "between-steps" and "nanosleep" not in Path(f"/proc/{workers[1][0]}/wchan").read_text():
        assert time.monotonic() < deadline, "rank 3 never sleeps"
        time.sleep(0.005)
    os.killpg(victim.pid, signal.SIGKILL)
    for pid, _ in workers:
        os.kill(pid, signal.SIGKILL)
    try:
        metrics = finish([nodes[0]], run_dir)
    finally:  # (a survivor that never finishes is not left running)
        if nodes[0].poll() is None:
            for pid, _ in workers_of(nodes[0]):  # (each in a session of its own)
                os.kill(pid, signal.SIGKILL)
            os.killpg(nodes[0].pid, signal.SIGKILL)
    victim.wait()

    (world,) = [r for r in records(metrics, "event") if r["event"] == "world"]
    assert world["scope"] == "node"
    (lost,) = [e for e in records(metrics, "event") if e["event"] == "rank_lost"]
    assert lost["ranks"] == [2, 3] and lost["cause"] == "died" and lost["world_size"] == 2
    assert lost["noticed"] == "ended"  # (their ends were seen: no wait for their silence)
    (summary,) = records(metrics, "summary")
    epoch = lost["epoch"]  # 12 steps per epoch with 4 processes until the loss's epoch ends, then 24 (2 epochs)
    assert summary["finished"] and summary["steps"] == 12 * epoch + 24 * (2 - epoch)
    assert [r["step"] for r in records(metrics, "train")] == list(range(summary["steps"]))
    assert summary["lost_ranks"] == [2, 3] and summary["ranks"] == [0, 1] and summary["replica_spread"] == 0.0


@pytest.mark.full  # ~2 min (6 processes); make test: the whole-node admission rule (test_elastic_records), a
# process's join (test_joins) and a node's loss (above)
def test_a_node_of_two_processes_joins_two_nodes_whole_without_stopping_them(tmp_path):
    """Two torchrun nodes of 2 processes train at node scope; ``train.py trainer.join=true trainer.nproc=2`` starts a
    node of 2 that asks to join: its two processes are admitted together (a node never joins in part), every step
    is recorded once, and the three nodes end as one replica."""
    from test_faults import env, finish, start_nodes, tail, wait_for_train_steps
    from test_joins import MEMBERS, _join_file

    run_dir = tmp_path / "run"
    # (paced: 4 epochs of 24 steps at >= 0.25 s each, so that the run still trains when the joiner has started)
    pace = ["trainer.epochs=4", "straggler=sleep", "straggler.ranks=[0,1,2,3]", "straggler.start_epoch=1",
            "straggler.sleep_s=0.25"]  # fmt: skip
    nodes = start_nodes(2, run_dir, *MEMBERS, *pace, procs=2)
    _join_file(run_dir)
    wait_for_train_steps(run_dir, 4)
    log = open(tmp_path / "run-node2.log", "w")
    joiner = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *MEMBERS, *pace, "trainer.join=true", f"trainer.run_dir={run_dir}",
         "trainer.nproc=2"],
        cwd=ROOT, env=dict(env(), OMP_NUM_THREADS="1"), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    metrics = finish(nodes, run_dir, timeout=400)
    assert joiner.wait(timeout=120) == 0, tail(run_dir)
    events = records(metrics, "event")
    (world,) = [e for e in events if e["event"] == "world"]
    assert world["scope"] == "node"
    (join,) = [e for e in events if e["event"] == "rank_joined"]
    assert join["ranks"] == [4, 5] and join["world_size"] == 6
    steps = records(metrics, "train")
    assert [r["step"] for r in steps] == list(range(len(steps)))
    assert {r["world_size"] for r in steps if r["step"] >= join["step"]} == {6}
    summary = records(metrics, "summary")[-1]
    assert summary["finished"] and summary["world_size"] == 6 and summary["replica_spread"] == 0.0
