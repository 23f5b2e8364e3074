"""The failure agreement among many ranks, in the simulation of bench/membership.py at a size the test suite affords:
every rank's real ``Heartbeat`` and ``Failures`` (threads for ranks) on one real c10d TCPStore, group formation
replaced by a placeholder."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _quick_name_lookups(monkeypatch):
    """c10d looks up the name of every connection's address; a lookup this machine's resolver leaves unanswered
    would hold a connection 5 s (bench/membership.py does the same for its processes)."""
    monkeypatch.setenv("RES_OPTIONS", "timeout:1 attempts:1")


def simulate(n: int, killed: list[int], window_s: float) -> dict:
    from bench.membership import simulate

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    return simulate(n, store.port, killed, warmup_s=2.0, window_s=window_s, limit_s=60.0)


def test_every_survivor_among_many_ranks_adopts_one_decision_that_names_exactly_the_killed_ranks():
    """32 ranks, two of which die at once: each of the 30 others adopts the same change (the killed ranks removed,
    the same event) and the same positions (the one survivor a collective behind is behind for all), and forms the
    new group once."""
    failure = simulate(32, [16, 17], window_s=0.5)["failure"]
    assert failure["all_finished"] and failure["errors"] == [], failure
    assert failure["agreed_alike"] and failure["removed_exactly_killed"] and failure["behind_agreed"], failure
    assert failure["groups_formed"] == 30


def test_what_a_rank_asks_of_the_store_per_heartbeat_tick_does_not_grow_with_the_number_of_ranks():
    """Store calls and keys per rank and heartbeat tick, counted client side, at 24 and at 48 ranks: the same (every
    peer's counter every tick would be twice the keys at 48, and more than WATCHED + 3 at either)."""
    from engine.elastic.heartbeat import WATCHED

    small, large = (simulate(n, [], window_s=1.5)["steady"] for n in (24, 48))
    for steady in (small, large):
        # its own counter, WATCHED peers' and whether a failure was checked in to (+ first checks)
        assert steady["keys_per_tick"] <= WATCHED + 3, steady
        assert steady["calls_per_tick"] <= 3.1, steady  # add, multi_get, check
    assert large["calls_per_tick"] == pytest.approx(small["calls_per_tick"], rel=0.1), (small, large)
    assert large["keys_per_tick"] == pytest.approx(small["keys_per_tick"], rel=0.1), (small, large)
