"""Boards (distributed/board.py): each member's post, read in the order they came, with the same answers on torch's
TCPStore (one value appended to) and on etcd (a key per post, no read-and-write between posts)."""

from __future__ import annotations

import datetime
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from distributed import board, runstore

# CI installs etcd-server (.ci/run) and then requires the etcd half to run, as tests/test_store.py does
ETCD = shutil.which("etcd") is not None or bool(os.environ.get("RELAXSYNC_REQUIRE_ETCD"))


def _stores(tmp_path):
    yield "tcp", dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10))
    if ETCD:
        from distributed.etcd import EtcdStore, LocalCluster

        with LocalCluster(str(tmp_path / "etcd")) as cluster:
            yield "etcd", EtcdStore.from_url(cluster.url, "board")


def test_posts_come_in_order_each_with_its_own_place_and_a_later_post_replaces_a_members_entry(tmp_path):
    for kind, store in _stores(tmp_path):
        assert board.entries(store, "b") == {} and board.count(store, "b") == 0, kind
        posts = [(store.clone(), r) for r in range(24)]
        with ThreadPoolExecutor(8) as pool:  # (at the same moment: every place given once)
            places = list(pool.map(lambda p: board.post(p[0], "b", p[1], f"cause {p[1]}"), posts))
        assert sorted(places) == list(range(1, 25)), kind
        posted = board.entries(store, "b")
        assert set(posted) == {str(r) for r in range(24)} and posted["5"] == "cause 5", kind
        if kind == "etcd":  # (read in the order of their places; on TCPStore an append and an add may interleave)
            assert list(posted) == [str(r) for r in sorted(range(24), key=lambda r: places[r])]
        board.post(store, "words", "3.1", "+")
        board.post(store, "words", "3.1", "-")  # (the same member's word again: the later one counts)
        assert board.entries(store, "words") == {"3.1": "-"}, kind
        protocol = runstore.of(store)  # (the run's store protocol each store implements)
        assert protocol.replicated == (kind == "etcd") and protocol.store is store, kind
        assert runstore.of(store.clone()).hurried() is not None and runstore.of(protocol) is protocol, kind


@pytest.mark.skipif(not ETCD, reason="etcd is not installed (Debian: apt install etcd-server)")
def test_on_etcd_a_post_is_one_write_that_no_other_post_can_upset(tmp_path):
    """A thousand ranks checking in at once: with append and add, each a read and a conditional write on one key,
    they would retry each other's writes; a post is a put of a key of its own and a count read at its revision."""
    from distributed.etcd import EtcdStore, LocalCluster

    with LocalCluster(str(tmp_path / "etcd")) as cluster:
        store = EtcdStore.from_url(cluster.url, "writes")
        paths = []
        call = store._call
        store._call = lambda path, body: paths.append(path) or call(path, body)
        assert board.post(store, "in", 7, "died") == 1
        assert paths == ["kv/put", "kv/range"]
