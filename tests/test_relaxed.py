"""sync=relaxed: stragglers are evicted, survivors continue identically, the CAC API runs under torchrun."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST, ROOT, records, train, train_each

from algorithms.relaxed import decide, reference_time
from distributed.topology import round_robin

RELAXED = [
    "sync=relaxed",
    "sync.relaxed_sync_threshold=2.0",
    "straggler=sleep",
    "straggler.start_epoch=2",
    "straggler.slowdown=3.0",
    "model=test_resnet",
    "data=digits",
    "logger=none",
    "trainer.progress=false",
    "trainer.nproc=3",
    "trainer.epochs=3",
]
STEPS_3, STEPS_2 = 1438 // 3 // 32, 1438 // 2 // 32  # steps per epoch with 3 and with 2 ranks


def _evictions(metrics: list[dict]) -> list[dict]:
    return [r for r in records(metrics, "event") if r["event"] == "evict"]


# make test evicts rank 0 (the logging rank: the harder case); the last rank runs in make test-full
@pytest.mark.parametrize("slow_rank", [pytest.param(2, marks=pytest.mark.full), 0], ids=["last-rank", "rank0"])
def test_straggler_is_evicted_at_the_first_check_after_it_slows(tmp_path, slow_rank):
    summary, metrics = train(tmp_path, *RELAXED, f"straggler.ranks=[{slow_rank}]")
    # launch() returned normally: every worker, the evicted one included, exited 0.
    (evict,) = _evictions(metrics)
    assert evict["ranks"] == [slow_rank]
    assert evict["epoch"] == 3  # slowed during epoch 2, evicted by the check at the start of epoch 3
    assert evict["world_size"] == 2
    assert set(evict["times"]) == {"0", "1", "2"}
    assert evict["times"][str(slow_rank)] > 2.0 * evict["reference"]
    steps = records(metrics, "train")
    assert {r["world_size"] for r in steps if r["epoch"] < 3} == {3}
    assert {r["world_size"] for r in steps if r["epoch"] >= 3} == {2}
    # Below the mode threshold (2/3 < 0.8): train loader rebuilt over the survivors, LR rescaled (linear).
    events = {r["event"]: r for r in records(metrics, "event")}
    assert events["loader_rebuilt"]["loaders"] == ["train", "val"]
    assert events["lr_adjusted"]["scale"] == pytest.approx(2 / 3)
    assert len([r for r in steps if r["epoch"] == 3]) == STEPS_2  # the larger shards of two ranks
    assert records(metrics, "eval")[-1]["num_samples"] == 359
    assert summary["ranks"] == sorted({0, 1, 2} - {slow_rank})
    assert summary["evictions"] == 1 and summary["evicted_ranks"] == [slow_rank]
    assert summary["replica_spread"] == 0.0  # survivors end with identical parameters
    assert summary["top1"] > 50.0


def test_check_every_steps_evicts_mid_epoch_and_defers_the_train_rebuild(tmp_path):
    summary, metrics = train(tmp_path, *RELAXED, "sync.check_every=5", "trainer.epochs=2")
    (evict,) = _evictions(metrics)
    first_slow_check = ((STEPS_3 + 1) // 5 + 1) * 5  # the first check whose whole window was slowed
    assert evict["ranks"] == [2] and STEPS_3 < evict["step"] <= first_slow_check
    rebuilt = next(r for r in records(metrics, "event") if r["event"] == "loader_rebuilt")
    assert rebuilt["deferred_to_next_epoch"] is True
    assert summary["world_size"] == 2 and summary["replica_spread"] == 0.0


@pytest.mark.full  # make test covers the rule in test_verdict_rules and a run in the two-slow-ranks test
def test_min_num_processes_equal_to_world_size_keeps_everyone(tmp_path):
    summary, metrics = train(tmp_path, *RELAXED, "sync.min_num_processes=3")
    assert _evictions(metrics) == []
    assert {r["world_size"] for r in records(metrics, "train")} == {3}
    assert summary["world_size"] == 3


def test_two_slow_ranks_with_min_two_processes_evicts_only_one(tmp_path):
    summary, metrics = train(
        tmp_path, *RELAXED, "straggler.ranks=[1,2]", "sync.reference=min", "sync.min_num_processes=2"
    )
    (evict,) = _evictions(metrics)
    assert len(evict["ranks"]) == 1 and evict["ranks"][0] in (1, 2)
    assert summary["world_size"] == 2 and 0 in summary["ranks"]


def test_verdict_rules():
    assert reference_time([1.0, 3.0], "median") == 1.0  # two ranks: the minimum, as CAC
    assert reference_time([1.0, 1.2, 3.0], "median") == 1.2
    v = decide([0, 1, 2], [1.0, 1.1, 3.0], threshold=2.0, reference="median", min_num_processes=1)
    assert v.evicted == [2] and v.survivors == [0, 1]
    v = decide([0, 1, 2], [1.0, 5.0, 3.0], threshold=2.0, reference="min", min_num_processes=2)
    assert v.evicted == [1]  # the slowest first, within the budget
    v = decide([0, 1, 2], [3.0, 1.0, 1.0], threshold=2.0, reference="median", min_num_processes=1, protected=(0,))
    assert v.evicted == []
    v = decide([0, 1, 2], [1.0, 1.0, 30.0], threshold=-1.0, reference="median", min_num_processes=1)
    assert v.evicted == []  # a negative threshold disables eviction


@pytest.mark.full  # the straggler simulation itself; bench/straggler measures the same
def test_allreduce_under_the_same_straggler_keeps_everyone_and_slows_down(tmp_path):
    _, metrics = train(tmp_path, *[o for o in RELAXED if not o.startswith("sync")], "trainer.epochs=2")
    steps = records(metrics, "train")
    assert {r["world_size"] for r in steps} == {3}
    healthy = statistics.median(r["step_s"] for r in steps if r["epoch"] == 1)
    straggling = statistics.median(r["step_s"] for r in steps if r["epoch"] == 2)
    assert straggling > 1.5 * healthy  # everyone waits for the straggler


def test_cac_example_runs_under_torchrun_with_a_straggler(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [
            str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "3",
            "examples/relaxed_sync_cac.py", "--epochs", "2", "--simulate-slow-process", "1",
            "--sleep-process-start-epoch", "1", "--sleep-time", "0.2",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "epoch 1: processes 3, lr 0.1000" in out.stdout
    assert "relaxsync: rank 2 evicted at epoch 2 (own compute" in out.stdout and "; exiting" in out.stdout
    assert "epoch 2: processes 2, lr 0.0667" in out.stdout  # adjust_lr_by_procs below the mode threshold
    assert "done: 2 of 3 processes finished" in out.stdout


def test_a_worker_that_dies_still_ends_the_run_with_an_error(tmp_path):
    from _workers import die_mid_run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with pytest.raises(ChildFailedError) as info:
        train(tmp_path, *RELAXED, "trainer.timeout_s=120", entrypoint=die_mid_run)
    assert "worker died at step 3" in info.value.format_msg()


def test_relaxed_composes_with_another_exchange(tmp_path):
    """sync.inner is any algorithm: here a gossip whose rounds overlap the next steps (SGP, two rounds in flight).
    The check every 5 steps evicts mid-epoch, so the rounds in flight are drained first; the survivors go on
    gossiping, and their push-sum weights still add up (the replicas end averaged and identical)."""
    summary, metrics = train(
        tmp_path, *RELAXED, "trainer.epochs=2", "sync.check_every=5", "sync@sync.inner=sgp", "sync.inner.overlap=true",
        "sync.inner.synch_freq=2",
    )  # fmt: skip
    (evict,) = _evictions(metrics)
    assert evict["ranks"] == [2] and STEPS_3 < evict["step"]
    steps = records(metrics, "train")
    assert {r["world_size"] for r in steps if r["step"] >= evict["step"]} == {2}
    in_flight = {r["step"]: r["rounds_in_flight"] for r in steps}
    assert min(in_flight.values()) >= 1 and max(in_flight.values()) == 2  # rounds overlapped steps throughout
    assert in_flight[evict["step"]] == 1  # nothing was in flight when the group changed: only this step's round
    assert summary["world_size"] == 2 and summary["replica_spread"] == 0.0 and summary["top1"] > 30.0


@pytest.mark.parametrize("n", range(1, 8))
def test_round_robin_meets_every_pair_once_with_one_pair_per_rank_per_round(n):
    rounds = round_robin(list(range(10, 10 + n)))
    pairs = [frozenset(p) for r in rounds for p in r]
    assert sorted(map(sorted, pairs)) == sorted([a, b] for a in range(10, 10 + n) for b in range(a + 1, 10 + n))
    for r in rounds:
        busy = [x for p in r for x in p]
        assert len(busy) == len(set(busy))
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)


def test_a_slow_link_is_seen_by_the_link_measure_only(tmp_path):
    """Rank 2's link is slow, its compute is not: CAC's compute measure keeps it (and everyone waits for it);
    the link probe finds it, because it is slow with every peer while the others are fast with each other.
    Both in one launch: the compute measure first (it evicts no one), then the link measure."""
    from _workers import slow_link_on_rank2

    common = [
        "sync=relaxed", "sync.check_every=3", "sync.link_probe_bytes=65536", *FAST, "trainer.nproc=3",
        "trainer.max_steps=7",
    ]  # fmt: skip
    runs = {measure: [*common, f"sync.measure={measure}"] for measure in ("compute", "link")}
    for measure, metrics in train_each(tmp_path, runs, entrypoint=slow_link_on_rank2).items():
        checks = [r for r in records(metrics, "event") if r["event"] == "relaxed_check"]
        assert checks and all(c["measure"] == measure for c in checks)
        (summary,) = records(metrics, "summary")
        first = checks[0]["times"]
        healthy = max(first["0"], first["1"])
        if measure == "link":
            assert first["2"] > 0.3 > 3 * healthy  # the probe saw the 0.3 s with every peer of rank 2, with none else
            (evict,) = _evictions(metrics)
            assert evict["ranks"] == [2] and evict["measure"] == "link" and evict["step"] == 3
            assert summary["ranks"] == [0, 1]
            assert len(checks) == 1  # with two ranks left, the link measure stops checking (it cannot attribute)
        else:
            assert first["2"] < 3 * checks[0]["reference"]  # rank 2 computes as fast as the others
            assert not _evictions(metrics) and summary["ranks"] == [0, 1, 2]


def test_membership_agreement_adopts_the_first_proposal_and_a_removed_rank_leaves_with_status_0(capsys):
    """Two ranks' memberships over one store: the first proposal written wins on both, whatever the second
    proposes; the rank removed raises LeftRun, a SystemExit with status 0, after saying why."""
    import torch.distributed as dist

    from distributed.membership import LeftRun, Membership

    store = dist.HashStore()
    first, second = Membership(rank=2, world_size=3), Membership(rank=0, world_size=3)
    for m in (first, second):
        m._store, m.prefix = store, "test"
    assert first.agree("verdict", {"evicted": [2]}) == {"evicted": [2]}
    assert second.agree("verdict", {"evicted": []}) == {"evicted": [2]}  # divergent, yet the same verdict
    with pytest.raises(LeftRun) as left:
        first.remove([2], cause="slow", reasons={2: "evicted at epoch 4 (own compute 9.0 ms > 3 x 1.0 ms)"})
    assert isinstance(left.value, SystemExit) and left.value.code == 0
    assert "relaxsync: rank 2 evicted at epoch 4 (own compute 9.0 ms > 3 x 1.0 ms); exiting" in capsys.readouterr().out
    assert first.ranks == [0, 1] and first.group is None and first.generation == 1
    alone = Membership(rank=0, world_size=3)
    alone._store = store
    assert alone.remove([], cause="slow") is None  # nobody proposed a removal: nothing changes
    assert alone.ranks == [0, 1, 2] and alone.generation == 0


def test_a_membership_change_is_answered_through_the_contract_by_cause_and_mode_threshold():
    """The trainer reads no plugin's keys: after any change it applies what ``on_membership_change`` answers. Any
    algorithm's default after a loss: reshard and scale the LR linearly; relaxed sync after its own eviction: reshard
    and rescale by its ``lr_policy`` only below ``relaxed_sync_mode_threshold`` (as CAC), after a loss always."""
    import math

    import torch

    from algorithms.base import RebuildTrainLoader, ScaleLR, SyncContext
    from algorithms.none import NoSync
    from algorithms.relaxed import EVICTED, RelaxedSync
    from distributed.membership import Change, Membership

    membership = Membership(0, 4, group=object())
    plain, relaxed = NoSync(), RelaxedSync(NoSync(), relaxed_sync_mode_threshold=0.8, lr_policy="sqrt")
    for sync in (plain, relaxed):
        sync.setup(torch.nn.Linear(2, 2), None, SyncContext(None, membership, torch.device("cpu")))
    membership.ranks = [0, 1, 2]  # 3 of 4 left: 0.75
    evicted, lost = Change(1, [3], [0, 1, 2], EVICTED), Change(1, [3], [0, 1, 2], "died")
    assert plain.on_membership_change(lost).requests == [RebuildTrainLoader(), ScaleLR(0.75, "linear")]
    answer = [RebuildTrainLoader(), ScaleLR(math.sqrt(0.75), "sqrt")]
    assert relaxed.on_membership_change(evicted).requests == answer
    assert relaxed.on_membership_change(lost).requests == answer
    relaxed.mode_threshold = 0.7  # 0.75 of the ranks is above it: CAC goes on without resharding
    assert relaxed.on_membership_change(evicted).requests == []
    assert relaxed.on_membership_change(lost).requests == answer  # a lost rank's shard must be covered
    relaxed.lr_policy = "none"
    assert relaxed.on_membership_change(lost).requests == [RebuildTrainLoader()]
