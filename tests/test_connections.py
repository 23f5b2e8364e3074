"""A gloo group replaced after a loss is cut off at once (distributed/connections.py): its destructor would wait for
whatever was abandoned on it until the group's timeout."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distributed.connections import cut, keep, noted

TIMEOUT = datetime.timedelta(seconds=120)


def test_the_connections_opened_in_the_block_are_noted_less_listeners_and_the_stores_and_shut_down_once():
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_server(("127.0.0.1", 0)) as store:
        with noted(store_port=store.getsockname()[1]) as made:
            listener = socket.create_server(("127.0.0.1", 0))  # (a listener: left out)
            ours = socket.create_connection(server.getsockname())
            to_store = socket.create_connection(store.getsockname())  # (the run's store: left out)
        peer, _ = server.accept()
        try:
            (connections,) = made
            assert [fd for fd, _ in connections.sockets] == [ours.fileno()]
            assert connections.shut_down() == 1
            peer.settimeout(30)
            assert peer.recv(1) == b""  # the peer sees the connection end at once
            ours.close()  # (its descriptor may now be reused: nothing noted is touched again)
            assert connections.shut_down() == 0
        finally:
            for s in (listener, to_store, peer, ours):
                s.close()


def test_a_set_let_go_never_cuts_a_socket_that_a_live_set_noted_at_an_overlapping_moment_holds():
    """Two blocks in two threads at once (a group formed ahead while another forms) each note both sockets."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        with noted() as first:
            with noted() as second:
                a = socket.create_connection(server.getsockname())
            b = socket.create_connection(server.getsockname())
        peers = [server.accept()[0] for _ in range(2)]
        try:
            assert {fd for fd, _ in first[0].sockets} == {a.fileno(), b.fileno()}
            assert [fd for fd, _ in second[0].sockets] == [a.fileno()]
            keep("first", first)
            keep("second", second)
            assert cut(["second"]) == 0  # (a is the first's as much as the second's: the first set lives on)
            peers[0].setblocking(False)
            with contextlib.suppress(BlockingIOError):
                assert peers[0].recv(1) != b""  # (still open)
            assert cut(["first"]) == 2  # (no other set holds them now)
            for peer in peers:
                peer.settimeout(30)
                assert peer.recv(1) == b""
        finally:
            for s in (a, b, *peers):
                s.close()


def _abandon(rank: int, init: str, out: str) -> None:
    """Each rank issues a collective the other never issues (an allreduce, a broadcast), then lets the group go."""
    from distributed.membership import build_group, retire

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    store = dist.PrefixStore("replaced/", dist.distributed_c10d._get_default_store())
    group = build_group(store, [0, 1], rank, "gloo", TIMEOUT)
    box = torch.ones(1000)
    work = dist.all_reduce(box, group=group, async_op=True) if rank == 0 else dist.broadcast(box, 1, group, True)
    time.sleep(0.5)  # (both are in flight, each waiting for the other)
    started = time.monotonic()
    retire([group])
    del work, group
    took = time.monotonic() - started
    with open(f"{out}.{rank}", "w") as f:
        f.write(str(took))
    dist.barrier()
    dist.destroy_process_group()


def test_two_survivors_each_holding_a_collective_the_other_never_issued_let_their_group_go_at_once():
    """Without the connections cut, each destructor waits for its own collective until the group's timeout (120 s
    here, 20 s of 20 s when measured): each waits on the other, whose side stays open while it waits too."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "took")
        mp.start_processes(_abandon, args=(f"file://{tmp}/store", out), nprocs=2, start_method="spawn")
        took = [float(open(f"{out}.{rank}").read()) for rank in (0, 1)]
    assert max(took) < TIMEOUT.total_seconds() / 2, took  # let go at once, not at the group's timeout
