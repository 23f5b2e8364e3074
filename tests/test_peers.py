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
    assert summary["top1"] == records(ours[case], "summary")[0]["top1"]  # the same average, evaluated alike
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
