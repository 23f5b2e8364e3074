"""The failure agreement among many ranks, in the simulation of bench/membership.py at a size the test suite affords:
every rank's real ``Heartbeat`` and ``Failures`` (threads for ranks) on one real c10d TCPStore, group formation
replaced by a placeholder."""

from __future__ import annotations

import os
import shutil

import pytest
import torch.distributed as dist

# CI installs etcd-server (.ci/run) and then requires the etcd half to run, as tests/test_store.py does
ETCD = shutil.which("etcd") is not None or bool(os.environ.get("RELAXSYNC_REQUIRE_ETCD"))


@pytest.fixture(autouse=True)
def _quick_name_lookups(monkeypatch):
    """c10d looks up the name of every connection's address; a lookup this machine's resolver leaves unanswered
    would hold a connection 5 s (bench/membership.py does the same for its processes)."""
    monkeypatch.setenv("RES_OPTIONS", "timeout:1 attempts:1")


def simulate(n: int, killed: list[int], window_s: float, etcd: str = "") -> dict:
    """``etcd``: the URL of an etcd cluster to simulate on (torch's TCPStore otherwise)."""
    from bench.membership import simulate

    if etcd:
        return simulate(n, etcd, killed, warmup_s=2.0, window_s=window_s, limit_s=60.0)
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


@pytest.mark.skipif(not ETCD, reason="etcd is not installed (Debian: apt install etcd-server)")
def test_in_a_large_world_on_etcd_only_the_deciders_and_the_relays_ask_the_store_in_an_agreement(tmp_path):
    """Beyond WATCHED + 1 ranks on a replicated store a survivor neither checks in nor writes where it was: the
    deciders (the ring's first ranks) decide from the watchers' reports and the relays read the decision in the
    store; every other survivor hears it from a neighbour (presence) and asks the store nothing, and all still adopt
    one decision, which names the killed rank alone."""
    from distributed.etcd import LocalCluster
    from engine.elastic.wide import roles

    n, killed = 40, [20]
    with LocalCluster(str(tmp_path / "etcd"), members=3, heartbeat_ms=100, election_ms=1000) as cluster:
        failure = simulate(n, killed, window_s=0.3, etcd=cluster.url)["failure"]
    assert failure["all_finished"] and failure["agreed_alike"] and failure["removed_exactly_killed"], failure
    deciders, relays = roles(list(range(n)), ["host"] * n)
    assert failure["asked"] and set(failure["asked"]) <= set(deciders) | set(relays), failure
    assert failure["survivors_asking"] <= len(set(deciders) | set(relays)) < (n - 1) / 4


def test_the_deciders_are_on_distinct_nodes_and_a_relay_is_a_few_hops_from_every_rank():
    from distributed.presence import ring_order
    from engine.elastic.wide import DECIDERS, RELAY_EVERY, roles

    ranks, nodes = list(range(128)), [f"node{r // 8}" for r in range(128)]  # 16 nodes of 8
    deciders, relays = roles(ranks, nodes)
    assert len(deciders) == DECIDERS and len({nodes[r] for r in deciders}) == DECIDERS  # (a node lost: one of them)
    assert set(deciders) <= set(relays)
    ring = ring_order(ranks, nodes)
    at = [i for i, r in enumerate(ring) if r in relays]
    assert max(b - a for a, b in zip(at, at[1:] + [at[0] + len(ring)])) <= RELAY_EVERY
    survivors = [r for r in ranks if nodes[r] != "node0"]  # (the first node lost: the next ones decide)
    assert not {nodes[r] for r in roles(survivors, nodes)[0]} & {"node0"}


def _gather(rank: int, init: str, out: str) -> None:
    import torch

    from engine.elastic.positions import Phase, Position
    from engine.elastic.wide import gather_positions

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3)
    try:
        group = dist.new_group([0, 2])  # (the survivors of rank 1)
        if rank != 1:
            at = Position(7, Phase.EXCHANGE) if rank == 2 else Position(8, Phase.EVALUATION)
            torch.save(gather_positions(group, at, lambda works: [w.wait() for w in works]), f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_survivors_positions_are_gathered_in_their_new_group(tmp_path):
    """A large world's survivors learn where each other was by one collective in the group they formed: every member
    gets every member's [step, phase], and all agree on the front and on who is behind it."""
    import torch
    import torch.multiprocessing as mp

    from engine.elastic.positions import left_behind

    mp.start_processes(_gather, args=(f"file://{tmp_path}/store", str(tmp_path)), nprocs=3, start_method="spawn")
    got = [torch.load(tmp_path / f"{r}.pt") for r in (0, 2)]
    assert got[0] == got[1] == {0: [8, "evaluation"], 2: [7, "exchange"]}
    assert left_behind(got[0]) == ([8, "evaluation"], [2])


def test_beyond_a_small_world_the_background_looks_are_spread_and_a_stop_leaves_room_for_them():
    """A stop's and the joins' watcher threads look in the store every 0.2 s up to 17 ranks and every N / 100 s beyond
    (100 looks a second in all, what the heartbeat's beats also keep to), and the stop step agreed on a signal is far
    enough ahead for every rank to have looked by then."""
    import math
    import time

    from distributed.membership import Membership, look_period
    from engine.stop import POLL_S, StopRequest

    assert look_period(POLL_S, 17) == POLL_S and look_period(POLL_S, 1024) == pytest.approx(10.24)
    membership = Membership(0, 1024)
    membership._store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    looks: list[float] = []
    loop = membership.every(0.02, lambda store: looks.append(time.monotonic()) and False, "looks", spread=True).start()
    time.sleep(0.5)
    loop.stop()
    assert len(looks) == 1  # (the first at once, the next 10.24 s later)
    request = StopRequest(membership)
    request.signalled = True
    assert request.due(step=3, step_s=0.1) is False
    assert request.step == 3 + 2 + math.ceil(2 * 10.24 / 0.1)
