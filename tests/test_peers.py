"""bench/peers: each peer starts, exchanges, and, where its update is the same math as ours, trains exactly as ours.

The two runs of a pair execute the same kernels on the same batches on this machine and part only where the sync
does; the peers' exchanges here average over two processes, and a sum of two floats (and a halving) rounds the same
whatever the order. So the losses are compared exactly: a difference is a difference in the update, not rounding
(on any CPU: both runs round alike). torchft's peers need the peers extra and are skipped without it; torch's
peers need nothing more and always run.
"""

from __future__ import annotations

import pytest
from conftest import records, train_each

from engine.metrics import read_metrics

FAST = ["model=test_resnet", "data=digits", "logger=none", "trainer.progress=false", "trainer.checkpoint_every=0",
        "trainer.max_steps=7", "trainer.nproc=2"]  # fmt: skip
LOCALSGD = ["sync=localsgd", "sync.begin_step=0", "sync.k_steps=2", "sync.average_buffers=false"]
OURS = {
    "localsgd": LOCALSGD,
    "diloco": ["sync=diloco", "sync.inner_steps=3", "sync.average_buffers=false"],
    "powersgd": ["sync=powersgd", "sync.start_powerSGD_iter=2"],
}
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
    assert summary["top1"] == records(ours[case], "summary")[0]["top1"]  # the same average, evaluated alike


@pytest.mark.full
def test_a_peer_that_does_not_exchange_is_caught(ours, tmp_path):
    """The comparison can fail: torch's DDP (gradients averaged every step) against our local SGD parts at the
    first local step."""
    from bench.peers.launch import run_here

    run_here("ddp", [*FAST, *OURS["localsgd"]], tmp_path, replicas=2)
    peers, mine = records(read_metrics(str(tmp_path / "metrics.jsonl")), "train"), records(ours["localsgd"], "train")
    assert peers[0]["loss"] == mine[0]["loss"]  # the same start
    assert [r["loss"] for r in peers] != [r["loss"] for r in mine]
