"""bench/peers: each peer starts, exchanges, and, where its update is the same math as ours, trains exactly as ours.

The two runs of a pair execute the same kernels on the same batches on this machine and part only where the sync
does; the peers' exchanges here average over two processes, and a sum of two floats (and a halving) rounds the same
whatever the order. So the losses are compared exactly: a difference is a difference in the update, not rounding
(on any CPU: both runs round alike). torchft's peers need the peers extra and are skipped without it; torch's
peers need nothing more and always run.
"""

from __future__ import annotations

import pytest
from conftest import records, train, train_each

from engine.metrics import read_metrics

FAST = ["model=test_resnet", "data=digits", "logger=none", "trainer.progress=false", "trainer.checkpoint_every=0",
        "trainer.max_steps=7", "trainer.nproc=2"]  # fmt: skip
LOCALSGD = ["sync=localsgd", "sync.begin_step=0", "sync.k_steps=2", "sync.average_buffers=false"]
OURS = {
    "localsgd": LOCALSGD,
    "diloco": ["sync=diloco", "sync.inner_steps=3", "sync.average_buffers=false"],
    "powersgd": ["sync=powersgd", "sync.start_powerSGD_iter=2"],
}
PERIOD = {"localsgd": 2, "diloco": 3}  # steps between synchronisations, above
CASES = [
    pytest.param("post_localsgd", "localsgd", id="post_localsgd"),
    pytest.param("ddp_powersgd_fixed", "powersgd", id="powersgd_hook", marks=pytest.mark.full),
    pytest.param("torchft_localsgd", "localsgd", id="torchft_localsgd"),
    pytest.param("torchft_diloco", "diloco", id="torchft_diloco", marks=pytest.mark.full),
]


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> dict[str, list[dict]]:
    """Our runs of every case, side by side in one launch of two processes."""
    return train_each(tmp_path_factory.mktemp("ours"), {name: [*FAST, *o] for name, o in OURS.items()})


@pytest.mark.parametrize("peer,case", CASES)
def test_peer_trains_exactly_as_ours(peer, case, ours, tmp_path):
    from bench.peers.launch import run_here

    if peer.startswith("torchft"):
        pytest.importorskip("torchft", reason="torchft is the peers extra: pip install -r requirements-peers.txt")
    run_here(peer, [*FAST, *OURS[case]], tmp_path, replicas=2)
    theirs = read_metrics(str(tmp_path / "metrics.jsonl"))
    mine, peers = records(ours[case], "train"), records(theirs, "train")
    assert [r["step"] for r in peers] == list(range(7))  # every step, once
    assert [r["loss"] for r in peers] == [r["loss"] for r in mine]  # exactly: the same update
    assert [r["lr"] for r in peers] == [r["lr"] for r in mine]
    (summary,) = records(theirs, "summary")
    # Both evaluate their replicas' average over the whole set, but not with the same BN running statistics (a peer's
    # stock DDP broadcasts rank 0's buffers at each forward, ours keeps each rank's own, average_buffers=false): the
    # top-1 of a model near chance can differ by a sample or two with the CPU's rounding. The updates are the same,
    # step for step, above.
    assert 0.0 <= summary["top1"] <= 100.0 and records(ours[case], "summary")[0]["top1"] is not None
    if peer.startswith("torchft"):  # each synchronisation's vote, as the failure runs read them
        votes = [r for r in peers if r.get("synced")]
        assert len(votes) == 7 // PERIOD[case] and all(r["committed"] and r["participants"] == 2 for r in votes)


def test_the_standstill_is_the_longest_wait_for_a_step_beyond_what_such_a_step_takes():
    from bench.peers.failures import standstill, window

    # local steps 1 s apart, synchronising ones (every 4th) 2 s; 4 s more at the synchronisation after 10 s
    times = [1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13, 19, 20, 21, 22, 24]
    train = [{"time": float(t), "synced": i % 4 == 3} for i, t in enumerate(times)]
    assert standstill(train, 13.5, 8) is None  # (fewer steps after it than the window)
    assert standstill(train, 10.5, 4) == 4.0
    assert standstill(train, 1.5, 8) == 0.0  # (a window before the stall: its synchronisations take what they do)
    assert (window(1), window(4), window(16)) == (8, 8, 32)


def test_the_kills_window_ends_where_the_node_is_started_again():
    """The kill's standstill is looked for among the steps before the node comes back (``back`` steps on): the new
    process's start, on cores the nodes share, belongs to the join."""
    from bench.peers.failures import standstills

    times = [float(t) for t in range(1, 31)]
    times[25:] = [t + 3.0 for t in times[25:]]  # a 3 s stall 24 steps after the kill, after the node came back
    train = [{"time": t, "synced": i % 16 == 15} for i, t in enumerate(times)]
    assert standstills(train, 0.5, None, 16, back=20)["kill_standstill_s"] == 0.0  # (20 steps, before the stall)
    assert standstills(train, 0.5, None, 16, back=26)["kill_standstill_s"] == 3.0  # (26 steps: the stall is in)


def test_the_failure_table_gives_each_sides_medians_over_its_runs_and_the_most_steps_any_lost():
    from bench.peers.__main__ import failure_table
    from bench.peers.failures import summary

    def run(side, kill, join, lost, top1):
        return {"pair": "localsgd", "ours_name": "local SGD", "peer_name": "torchft LocalSGD", "side": side,
                "kill_standstill_s": kill, "join_standstill_s": join, "lost_steps": lost, "top1": top1,
                "world_sizes": [[3, 20], [2, 40]]}  # fmt: skip

    rows = [run("ours", 0.3, 0.5, 0, 94.0), run("torchft", 1.0, 0.4, 4, 93.0), run("ours", 0.1, None, 0, 95.0),
            run("torchft", 2.0, 0.6, 0, 92.0), run("ours", 0.2, 0.7, 1, 96.0),
            {"pair": "localsgd", "side": "torchft", "error": "every replica exited"}]  # fmt: skip
    ours, theirs = summary(rows)
    assert (ours["kill_standstill_s"], ours["join_standstill_s"], ours["lost_steps"], ours["top1"]) == (
        0.2,
        0.6,
        1,
        95.0,
    )  # fmt: skip  (a run without a join leaves it out)
    assert (theirs["kill_standstill_s"], theirs["lost_steps"], theirs["finished"]) == (1.5, 4, 2)
    assert theirs["failed"] == ["every replica exited"]
    table = failure_table([ours, theirs])
    assert "| 0.20 (0.30, 0.10, 0.20) | 1 | 0.60 (0.50, 0.70) |" in table and "(1 run(s) failed)" in table
    (failed,) = summary([{"pair": "allreduce", "side": "torchft", "error": "crashed"}])
    assert "failed: crashed" in failure_table([failed])


NODES = ["model=test_resnet", "data=digits", "logger=none", "trainer.progress=false", "trainer.checkpoint_every=0",
         "trainer.max_steps=7", "data.batch_size=16"]  # fmt: skip


# HierarchicalModelAverager averages after its steps that its period divides (from warmup_steps on); ours after step
# begin + k - 1 and every k after: the same steps where begin = 1 (mod k). torchft's LocalSGD: after every k-th.
HIERARCHICAL = ["sync=localsgd", "sync.begin_step=1", "sync.k_steps=2", "sync.average_buffers=false"]


@pytest.mark.full  # ~1 min (8 processes); make test: post_localsgd above (the same worker and hook, one level)
@pytest.mark.parametrize("peer,sync", [("hierarchical_localsgd", HIERARCHICAL), ("torchft_localsgd", LOCALSGD)])
def test_nodes_of_two_processes_train_as_ours_at_node_scope(peer, sync, tmp_path):
    """2 nodes of 2 processes: ours at sync.scope=node beside torchft with a replica group of 2 per node (DDP inside,
    LocalSGD across) and beside torch's two-level recipe (the post-local-SGD hook over each node's subgroup,
    HierarchicalModelAverager over every process), the same update.

    torchft's sums are ours (a node's 2 gradients halved then summed, 2 groups' parameters halved then summed): the
    losses are equal, step for step. Torch's recipe sums 4 quarters where ours sums 2 node halves (step 0's gradient,
    each averaging): the update after step 0 rounds apart (1e-7 of the loss at step 1 here), and training amplifies
    it about 20x a step (5e-5 at step 3, 4e-2 at step 6). So its curve is compared up to step 3, the first loss
    after the first averaging (after step 2): an averaging at another step parts them by more than 1e-2 there."""
    from bench.peers.launch import run_here

    if peer.startswith("torchft"):
        pytest.importorskip("torchft", reason="torchft is the peers extra: pip install -r requirements-peers.txt")
    _, mine = train(tmp_path / "ours", *NODES, *sync, "trainer.nproc=4", "trainer.local_nodes=2",
                    "sync.scope=node")  # fmt: skip
    run_here(peer, [*NODES, *sync], tmp_path / "peer", replicas=2, procs=2)
    theirs = read_metrics(str(tmp_path / "peer" / "metrics.jsonl"))
    ours_losses, peer_losses = ([r["loss"] for r in records(m, "train")] for m in (mine, theirs))
    assert len(peer_losses) == 7
    if peer == "torchft_localsgd":
        assert peer_losses == ours_losses
        return
    assert peer_losses[0] == ours_losses[0]  # (the same model and batch)
    assert peer_losses[1] == pytest.approx(ours_losses[1], rel=1e-5)  # (one update: its gradient's sum rounded apart)
    assert peer_losses[:4] == pytest.approx(ours_losses[:4], rel=1e-3)  # (and the first averaging, at the same step)
