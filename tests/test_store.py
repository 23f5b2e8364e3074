"""The run's store on an etcd cluster (trainer.store=etcd://...): a c10d store with TCPStore's semantics that no
node's loss takes away, and runs that survive the loss of any node, the first one too."""

from __future__ import annotations

import datetime
import http.client
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist
from conftest import FAST, ROOT, records
from test_scope import NODE_KILL

from bench.netns import unavailable as netns_unavailable
from distributed.etcd import COMPACTION, TLS_ENV, EtcdRefused, EtcdStore, LocalCluster, parse, store_root

# CI installs etcd-server (.ci/run) and then requires these tests to run
pytestmark = pytest.mark.skipif(
    shutil.which("etcd") is None and not os.environ.get("RELAXSYNC_REQUIRE_ETCD"),
    reason="etcd is not installed (Debian: apt install etcd-server)",
)


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """Three members that speak TLS only and require a client certificate of their own CA, as
    examples/slurm/train-any-node.sbatch's; this process's clients (``EtcdStore.from_url``) hold one."""
    with LocalCluster(str(tmp_path / "etcd"), tls=True) as c:
        monkeypatch.setenv(TLS_ENV, c.client.encoded())
        yield c


def test_urls_name_their_members_and_bad_ones_say_what_is_expected():
    assert parse("etcd://a:1,b,c:3/job7") == ([("a", 1), ("b", 2379), ("c", 3)], "job7")
    for bad in ("http://a:1", "etcd://", "etcd://a:x"):
        with pytest.raises(ValueError, match="etcd://host:port"):
            parse(bad)
    assert store_root({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "2"}) == "r/restart2"
    assert store_root({"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "1"}) == "41/restart1"


def test_a_full_database_is_reported_with_etcds_own_message_at_once(tmp_path):
    """A member whose database reached its quota refuses every write ("mvcc: database space exceeded"): the store
    says so at once, with etcd's message and what to do, never as a cluster out of reach or without a majority; the
    members of every recipe compact their history (LocalCluster's, the sbatch example's)."""
    quota = ["--quota-backend-bytes", str(1 << 20)]
    with LocalCluster(str(tmp_path / "etcd"), members=1, options=quota) as small:
        store = EtcdStore(parse(small.url)[0], "full")
        start = time.monotonic()
        with pytest.raises(EtcdRefused, match="database space exceeded.*etcdctl defrag") as refused:
            for i in range(1000):
                store.set(f"k{i}", "x" * 50_000)
        assert time.monotonic() - start < 5 and "majority" not in str(refused.value)
        assert store.get("k0") == b"x" * 50_000  # (reads go on)
        assert all(flag in small.command(0) for flag in COMPACTION)
    sbatch = (ROOT / "examples" / "slurm" / "train-any-node.sbatch").read_text()
    assert "--auto-compaction-mode" in sbatch and "--auto-compaction-retention" in sbatch


def test_a_run_that_ends_cleanly_leaves_no_key_in_the_cluster(cluster, tmp_path):
    """Two local ranks under on_failure=continue with their store on etcd: while they train the cluster holds their
    beats, decisions and groups' keys; once the run has ended, none (the last rank to close deletes them)."""
    from conftest import train

    probe = cluster.store("probe")
    before = probe.count_keys()
    summary, _ = train(
        tmp_path / "run", *FAST, "trainer.nproc=2", "trainer.on_failure=continue", "trainer.max_steps=4",
        *cluster.overrides(),
    )  # fmt: skip
    assert summary["finished"] and summary["world_size"] == 2
    assert probe.count_keys() == before  # (LocalCluster's own key; the run's are gone)


def test_a_wait_on_a_run_that_has_ended_ends_at_once_instead_of_at_the_stores_timeout(cluster):
    """A process that wakes after the run ended (continued once it hung, the others finished) finds its keys
    deleted: its wait ends with RunEnded within a read, not the store's timeout; the recovery it was in turns that
    into leaving the run with status 0 (LeftRun). Another run of the same cluster is not affected, nor a later run
    on the same root (the same rendezvous id and restart), whose ranks take the marker away as they start."""
    import datetime
    import time

    from distributed.runstore import RunEnded

    store, other = cluster.store("ended-run", timeout=datetime.timedelta(seconds=60)), cluster.store("other-run")
    store.set("beat/0", "1")
    other.set("beat/0", "1")
    assert store.forget_run() >= 1
    started = time.monotonic()
    with pytest.raises(RunEnded, match="has ended"):
        store.multi_get(["beat/0"])
    with pytest.raises(RunEnded):
        store.clone().wait(["beat/1"])
    assert time.monotonic() - started < 10  # (the store's timeout is 60 s)
    assert other.get("beat/0") == b"1"
    # A later run on the same root (the same rendezvous id and restart) begins by taking the marker away: it waits.
    again = cluster.store("ended-run", timeout=datetime.timedelta(seconds=60))
    again.begin_run()
    again.set("beat/0", "2")
    assert again.multi_get(["beat/0"]) == [b"2"] and store.get("beat/0") == b"2"


def test_the_store_has_tcpstores_semantics(cluster):
    s = EtcdStore.from_url(cluster.url, "semantics", datetime.timedelta(seconds=1))
    s.set("a", "x")
    assert s.get("a") == b"x" and s.check(["a"]) and not s.check(["a", "b"])
    assert [s.add("n", 1), s.add("n", 2), s.add("n", 0)] == [1, 3, 3]
    s.append("l", "1,")
    s.append("l", b"2,")
    assert s.multi_get(["a", "l"]) == [b"x", b"1,2,"]
    # compare_set: written when absent and expected is empty, or when it holds expected; returns the value after
    assert s.compare_set("d", "", "first") == b"first" and s.compare_set("d", "", "second") == b"first"
    assert s.compare_set("d", "first", "third") == b"third"
    assert s.compare_set("e", "z", "q") == b"z" and not s.check(["e"])
    assert s.delete_key("a") and not s.check(["a"]) and not s.delete_key("a")
    assert s.num_keys() == 3  # n, l, d (an update's marker is not a key)
    other = EtcdStore.from_url(cluster.url, "another run")
    assert not other.check(["n"])  # runs do not see each other's keys

    threading.Timer(0.3, lambda: s.clone().set("late", "1")).start()
    started = time.monotonic()
    s.wait(["late"])
    assert time.monotonic() - started >= 0.25
    with pytest.raises(dist.DistStoreError, match="timed out"):
        s.wait(["never"], datetime.timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError):
        s.get("never")  # (after the store's timeout, 1 s)


def test_a_thousand_ranks_keys_are_read_and_written_in_one_call_past_etcds_transaction_limits(cluster):
    """A world's beats (a key per rank) in one ``multi_get``, and a ``multi_set`` larger than etcd's request
    limit: etcd refuses a transaction of more than 128 operations (``--max-txn-ops``) or 1.5 MiB."""
    s = EtcdStore.from_url(cluster.url, "many")
    keys = [f"beat/{r}" for r in range(1024)]
    s.multi_set(keys, [str(r) for r in range(1024)])
    assert s.multi_get(keys) == [str(r).encode() for r in range(1024)]
    assert s.check(keys) and not s.check([*keys, "beat/1024"])
    big = [bytes([65 + i]) * 400_000 for i in range(6)]  # (2.4 MB in all)
    s.multi_set([f"big/{i}" for i in range(6)], big)
    assert s.multi_get([f"big/{i}" for i in range(6)]) == big


def test_a_wait_asks_nothing_while_it_waits_and_outlives_the_member_it_watches(cluster, monkeypatch):
    """A wait is told of the write by etcd (a watch) instead of reading again and again: a thousand ranks waiting
    for one decision would otherwise keep the store busy answering them. When the member it watches on goes, the
    wait goes on through another."""
    s = EtcdStore.from_url(cluster.url, "watch")
    asked, call = [], EtcdStore._call
    monkeypatch.setattr(EtcdStore, "_call", lambda self, *a: (self is s and asked.append(a[0]), call(self, *a))[1])
    threading.Timer(2.5, lambda: EtcdStore.from_url(cluster.url, "watch").set("k", "1")).start()
    s.wait(["k"])
    assert s.check(["k"]) and len(asked) <= 5, asked  # (a read, one a WATCH_S, the last; reads every 10 ms: 250)

    done = threading.Event()
    waiting = threading.Thread(target=lambda: (s.wait(["j"]), done.set()))
    waiting.start()
    time.sleep(0.3)
    cluster.kill(s._at)
    EtcdStore.from_url(cluster.url, "watch").set("j", "1")
    waiting.join(timeout=15)
    assert done.is_set()


def test_a_gloo_group_forms_over_it(cluster):
    store = EtcdStore.from_url(cluster.url, "gloo")
    group = dist.ProcessGroupGloo(dist.PrefixStore("g/", store.clone()), 0, 1, datetime.timedelta(seconds=10))
    import torch

    t = torch.ones(3)
    group.allreduce([t]).wait()
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_an_update_whose_answer_was_lost_is_applied_once(cluster, monkeypatch):
    """The member applies an add and its answer is lost (the member goes): the retry, on another member, finds the
    add's own marker and does not add again."""
    s = EtcdStore.from_url(cluster.url, "once")
    s.add("n", 5)
    s.append("l", "a")
    real, swap = http.client.HTTPConnection.getresponse, s._swap
    lose = []  # answers to lose: one, that of the next write

    def answer_lost(self):
        response = real(self)
        if lose:
            lose.pop()
            response.read()  # applied by the member...
            raise ConnectionResetError("the member went away")  # ...and its answer never arrives
        return response

    def swap_once_unanswered(*args):
        lose.append(1)
        return swap(*args)

    monkeypatch.setattr(http.client.HTTPConnection, "getresponse", answer_lost)
    monkeypatch.setattr(s, "_swap", swap_once_unanswered)
    assert s.add("n", 1) == 6
    monkeypatch.setattr(s, "_swap", swap_once_unanswered)
    s.append("l", "b")
    calls = []
    monkeypatch.setattr(s, "_swap", lambda *args: calls.append(args) or swap(*args))
    assert s.add("n", 1) == 7 and len(calls) == 1  # (the marker of the last update is not taken for this one's)
    monkeypatch.undo()
    assert int(s.get("n")) == 7 and s.get("l") == b"ab"


def test_it_survives_a_minority_and_refuses_without_a_majority(cluster):
    s = EtcdStore.from_url(cluster.url, "majority")
    s.set("before", "1")
    cluster.lead(0)
    cluster.kill(0)  # the leader
    assert s.get("before") == b"1" and s.add("n", 1) == 1  # a new leader, the same keys
    cluster.kill(1)
    s.reach_s = 1.0
    with pytest.raises(dist.DistNetworkError, match="no member answered, or none holds a majority"):
        s.add("n", 1)


def _guard(store: EtcdStore, hang_timeout_s: float):
    """Rank 0's surviving guard (of 2 ranks) over ``store``, with a stand-in for the trainer."""
    import types

    from distributed.membership import Membership
    from engine.elastic.guard import SurvivingGuard

    membership = Membership(0, 2)
    membership._store = store
    host = types.SimpleNamespace(recorder=types.SimpleNamespace(observers=[]), run=types.SimpleNamespace(step=5))
    return SurvivingGuard(membership, hang_timeout_s, host)


def test_a_rank_cut_off_from_the_stores_majority_trains_nothing_more_and_stops(cluster, monkeypatch):
    """Its beats stop reaching the store (the two other members gone: this rank's side of a partition holds no
    majority): the next part of the loop does not run, and after ``hang_timeout_s`` of asking the rank stops with a
    line that says why. (On the other side, the majority gives it up after its silence: the partition test.)"""
    from engine.elastic.failures import StoreUnreachable
    from engine.elastic.heartbeat import FENCE_S
    from engine.elastic.positions import Phase

    monkeypatch.setenv("RELAXSYNC_STORE", cluster.url)
    store = EtcdStore.from_url(cluster.url, "fence")
    store.reach_s = 1.0
    guard = _guard(store, hang_timeout_s=1.0)
    guard.start()
    ran = []
    try:
        guard.run(Phase.STEP, lambda: ran.append("before"), 1)
        cluster.kill(1)
        cluster.kill(2)
        deadline = time.monotonic() + 20
        while guard.failures.heartbeat.silent_for() <= FENCE_S:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(StoreUnreachable, match="has no majority on this side"):
            guard.run(Phase.STEP, lambda: ran.append("after"), 1)
    finally:
        guard.stop()
    assert ran == ["before"]


def test_a_rank_whose_beats_were_late_goes_on_once_the_store_answers_and_nobody_was_removed(cluster, monkeypatch):
    """A beat late for another reason (a busy machine, an election) costs one store read and nothing more."""
    from engine.elastic.heartbeat import FENCE_S
    from engine.elastic.positions import Phase

    monkeypatch.setenv("RELAXSYNC_STORE", cluster.url)
    guard = _guard(EtcdStore.from_url(cluster.url, "late"), hang_timeout_s=1.0)
    monkeypatch.setattr(guard.failures.heartbeat, "silent_for", lambda: FENCE_S + 1)
    ran = []
    guard.run(Phase.STEP, lambda: ran.append("step"), 1)
    assert ran == ["step"]


def test_a_rank_stopped_for_seconds_asks_the_store_before_its_next_part_though_its_beats_came_back(cluster):
    """A process stopped for seconds (SIGSTOP, a stalled machine) whose heartbeat thread beats again before its loop
    goes on: the beats do not end its silence, so the loop's next part asks the store what the others decided
    first (a rank they removed meanwhile leaves instead of training local steps and writing their records)."""
    from engine.elastic.heartbeat import BEAT_S, FENCE_S
    from engine.elastic.positions import Phase

    guard = _guard(EtcdStore.from_url(cluster.url, "stopped"), hang_timeout_s=1.0)
    guard.start()
    heartbeat = guard.failures.heartbeat
    asked, decided = [], guard.failures.decided
    guard.failures.decided = lambda generation: asked.append(generation) or decided(generation)
    try:
        guard.run(Phase.STEP, lambda: None, 1)
        assert asked == []  # (beating: nothing asked)
        heartbeat.beaten_at = time.monotonic() - FENCE_S - 1  # (stopped until now)
        time.sleep(4 * BEAT_S)  # (its thread beats again)
        assert heartbeat.silent_for() > FENCE_S
        guard.run(Phase.STEP, lambda: None, 1)
        assert asked == [0] and heartbeat.silent_for() < FENCE_S  # (nothing decided: it goes on, beating)
    finally:
        guard.stop()


def test_a_heartbeat_is_not_held_by_a_member_that_does_not_answer(cluster):
    """A member that takes requests and answers none (restarting, catching up, without a leader): a hurried client,
    the heartbeat's, asks the next member after ``HURRIED_S``, not the ``ATTEMPT_S`` that other calls wait, so
    that no live rank's beats stop for ``SILENT_S`` because of one member."""
    from distributed.etcd import ATTEMPT_S, HURRIED_S
    from engine.elastic.heartbeat import SILENT_S

    assert HURRIED_S * 2 < SILENT_S <= ATTEMPT_S  # (two members held in a row still leave a beat in time)
    mute = socket.create_server(("127.0.0.1", 0))  # (the kernel accepts connections; nobody answers)
    try:
        store = EtcdStore.from_url(cluster.url, "hurried")
        store.endpoints = [("127.0.0.1", mute.getsockname()[1]), *store.endpoints]
        hurried = store.hurried()
        assert hurried.attempt_s == HURRIED_S and store.attempt_s == ATTEMPT_S and hurried.endpoints == store.endpoints
        hurried._at = 0  # (its first member is the mute one)
        hurried.set("beat/0", "1")
        assert hurried._at != 0 and store.get("beat/0") == b"1"  # (answered by the next member)
    finally:
        mute.close()
    guard = _guard(EtcdStore.from_url(cluster.url, "hurried-beats"), hang_timeout_s=1.0)
    guard.start()
    try:
        assert guard.failures.heartbeat._loop.store.attempt_s == HURRIED_S  # (the heartbeat's own connection)
    finally:
        guard.stop()


# ---- runs that lose the store's host -------------------------------------------------------------------------------
def stop_nodes(nodes: list[subprocess.Popen]) -> None:
    """Whatever is left of a test's torchrun nodes (the survivors' agents wait in torchrun's exit barrier)."""
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()


def kill_node(node, worker_pid: int, etcd: LocalCluster, member: int | None) -> None:
    """``kill -9`` of a node: its torchrun agent, its worker and its etcd member (if it has one)."""
    os.killpg(node.pid, signal.SIGKILL)
    os.kill(worker_pid, signal.SIGKILL)
    if member is not None:
        etcd.kill(member)


KILL_SEED = int(os.environ.get("CHAOS_SEED", int(time.time() // 86400)))  # (the day's, as tests/test_chaos.py)


# All in make test-full (~25 s each); make test: rank 0's task killed under srun with the store on etcd
# (test_slurm.py), the daily chaos cell (on etcd, node 0 among the victims) and the fence's unit test above
@pytest.mark.full
@pytest.mark.parametrize("sync", list(NODE_KILL))
def test_the_node_of_rank_0_and_of_the_stores_leader_is_killed_and_the_others_finish(tmp_path, sync):
    """Three torchrun nodes on the etcd-v3 rendezvous, the run's store the 3-member cluster (one per node, TLS and
    client certificates). The node
    that holds rank 0 (the logging rank, torchrun's first node) is killed with its agent, its worker and its etcd
    member, made the cluster's leader just before, at a moment drawn from the day's seed within the steps after the
    8th: the other agents go on, the other workers agree through the two members left and finish, every step
    recorded once (the ones the logging rank ended before writing are written by the next), one replica."""
    from test_faults import SHRINK, finish, start_nodes, wait_for_train_steps, worker_of

    run_dir = tmp_path / "run"
    with LocalCluster(str(tmp_path / "etcd"), tls=True) as etcd:
        nodes = start_nodes(3, run_dir, *SHRINK, *NODE_KILL[sync], etcd=etcd)
        try:
            wait_for_train_steps(run_dir, 8)
            victim = next(i for i, node in enumerate(nodes) if worker_of(node)[1] == 0)
            etcd.lead(victim)  # (node i hosts member i)
            delay = random.Random(f"{KILL_SEED}-{sync}").uniform(0.0, 1.0)
            print(f"killing rank 0's node {delay:.3f} s after step 8 (CHAOS_SEED={KILL_SEED})")
            time.sleep(delay)
            killed_at = time.time()
            kill_node(nodes[victim], worker_of(nodes[victim])[0], etcd, victim)
            metrics = finish([n for i, n in enumerate(nodes) if i != victim], run_dir)
        finally:
            stop_nodes(nodes)

    (lost,) = [e for e in records(metrics, "event") if e["event"] == "rank_lost"]
    assert lost["ranks"] == [0] and lost["cause"] == "died" and lost["world_size"] == 2, lost
    assert lost["noticed"] == "ended"  # (seen at once, as any other node's end)
    assert lost["time"] - killed_at < 30, lost
    (summary,) = records(metrics, "summary")
    assert summary["finished"] and summary["world_size"] == 2 and summary["lost_ranks"] == [0]
    assert summary["ranks"] == [1, 2]
    steps = [r["step"] for r in records(metrics, "train")]
    assert steps == list(range(summary["steps"]))  # every step once: none lost with the logging rank, none twice
    assert summary["replica_spread"] == 0.0


@pytest.mark.full  # ~40 s; make test: rank 0's task killed under srun (test_slurm.py), the daily chaos cell
def test_in_a_ring_of_four_the_node_of_rank_0_is_killed_and_the_three_others_finish(tmp_path):
    """Four nodes, three etcd members (on the first three; the fourth node's agent speaks to the third's): rank 0's
    node is killed with its member where it has one. In gloo's ring rank 2 exchanges with ranks 1 and 3 only, and
    learns of the loss from the others' check-ins; the three finish with every step once, one replica."""
    from test_faults import finish, start_nodes, wait_for_train_steps, worker_of

    run_dir = tmp_path / "run"
    overrides = [
        *FAST, "data.num_samples=1024", "data.num_val_samples=64", "trainer.epochs=2", "sync=allreduce",
        "trainer.on_failure=continue", "trainer.hang_timeout_s=120",
    ]  # fmt: skip
    with LocalCluster(str(tmp_path / "etcd"), tls=True) as etcd:
        nodes = start_nodes(4, run_dir, *overrides, etcd=etcd)
        try:
            wait_for_train_steps(run_dir, 5)
            victim = next(i for i, node in enumerate(nodes) if worker_of(node)[1] == 0)
            killed_at = time.time()
            kill_node(nodes[victim], worker_of(nodes[victim])[0], etcd, victim if victim < etcd.members else None)
            metrics = finish([n for i, n in enumerate(nodes) if i != victim], run_dir)
        finally:
            stop_nodes(nodes)
    (lost,) = [e for e in records(metrics, "event") if e["event"] == "rank_lost"]
    assert lost["ranks"] == [0] and lost["world_size"] == 3 and lost["noticed"] == "ended", lost
    assert lost["time"] - killed_at < 60, lost  # (seen once it ended, not at the 120 s deadline)
    (summary,) = records(metrics, "summary")
    assert summary["finished"] and summary["ranks"] == [1, 2, 3] and summary["replica_spread"] == 0.0
    assert [r["step"] for r in records(metrics, "train")] == list(range(summary["steps"]))


NETNS = netns_unavailable()


def running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, ended and not yet reaped by its agent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.full  # ~1 min; make test: a rank cut off from the majority stops (above), rank 0's task killed
@pytest.mark.skipif(NETNS is not None, reason=f"no emulated network here: {NETNS}")
def test_a_node_cut_off_stops_and_the_majority_finishes_with_no_step_recorded_twice(tmp_path):
    """Three nodes in network namespaces, each with its torchrun agent, its worker and its etcd member; under local
    SGD (steps without a collective between averagings, so a cut-off rank could go on alone) the node of rank 0, the
    logging rank, is cut off the switch: alive, unreachable. The side without the cluster's majority stops with a
    line that says so and writes nothing more; the majority removes it after its silence and finishes, every step
    in metrics.jsonl once."""
    from test_faults import SHRINK, TORCHRUN, env, finish, tail, wait_for_train_steps, worker_of

    from bench.netns import EmulatedNetwork

    run_dir = tmp_path / "run"
    with EmulatedNetwork(3) as net:
        hosts = [net.address(i) for i in range(3)]
        etcd = LocalCluster(str(tmp_path / "etcd"), hosts=hosts, spawn=net.popen, tls=True).start()
        overrides = [
            *SHRINK,
            "sync=localsgd",
            "sync.k_steps=8",
            *etcd.overrides(),
            f"trainer.run_dir={run_dir}",
        ]
        nodes = []
        for i in range(3):
            launcher = [
                TORCHRUN, "--nnodes", "3", "--nproc-per-node", "1", "--max-restarts", "0", "--monitor-interval", "0.5",
                "--rdzv-id", run_dir.name, "--rdzv-backend", *etcd.rendezvous(i),
                "--local-addr", hosts[i],
            ]  # fmt: skip
            log = open(tmp_path / f"run-node{i}.log", "w")
            environ = dict(env(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="eth0")
            nodes.append(
                net.popen(
                    i, [*launcher, "train.py", *overrides], cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT
                )
            )
        wait_for_train_steps(run_dir, 8)
        victim = next(i for i, node in enumerate(nodes) if worker_of(node)[1] == 0)
        worker_pid = worker_of(nodes[victim])[0]
        net.cut(victim)
        cut_at = time.time()
        metrics = finish([n for i, n in enumerate(nodes) if i != victim], run_dir)
        deadline = time.monotonic() + 60
        while running(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(worker_pid), "the cut-off worker still runs:\n" + tail(run_dir)
        victim_log = (tmp_path / f"run-node{victim}.log").read_text()

    assert "has no majority on this side" in victim_log, victim_log[-3000:]
    (lost,) = [e for e in records(metrics, "event") if e["event"] == "rank_lost"]
    assert lost["ranks"] == [0] and lost["noticed"] == "silence" and lost["time"] - cut_at < 30, lost
    (summary,) = records(metrics, "summary")
    assert summary["finished"] and summary["ranks"] == [1, 2] and summary["lost_ranks"] == [0]
    steps = [r["step"] for r in records(metrics, "train")]
    assert steps == list(range(summary["steps"]))  # no step recorded by both sides, none lost between them


def test_a_client_without_the_clusters_certificate_reads_and_writes_nothing(cluster, tmp_path):
    """The members speak TLS only and require a client certificate signed by their CA: a client in plain HTTP, one
    with no certificate and one with a certificate of another CA are each refused before a key is read or
    written, and told so, never as a cluster out of reach for long; the cluster's own client is served."""
    import ssl

    from distributed.etcd import make_certificates

    (host, port), *_ = parse(cluster.url)[0]
    cluster.store("secret").set("k", "v")
    with pytest.raises(dist.DistNetworkError, match="if the members require TLS: etcds://"):
        EtcdStore([(host, port)], "secret", reach_s=1).get("k")
    stranger = make_certificates(str(tmp_path / "stranger"), ["127.0.0.1"])
    with pytest.raises(EtcdRefused, match="refused TLS: .*CERTIFICATE_VERIFY_FAILED"):  # (not the cluster's either)
        EtcdStore([(host, port)], "secret", tls=stranger).get("k")
    trusting = ssl.create_default_context(cafile=cluster.client.ca)  # (knows the members; shows no certificate)
    shown = ssl.create_default_context(cafile=cluster.client.ca)
    shown.load_cert_chain(stranger.cert, stranger.key)  # (shows one of another CA)
    key = '{"key": "L3JlbGF4c3luYy9zZWNyZXQvay9r"}'  # (/relaxsync/secret/k/k)
    for context in (trusting, shown):
        connection = http.client.HTTPSConnection(host, port, timeout=5, context=context)
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            connection.request("POST", "/v3/kv/range", key.encode(), {"Content-Type": "application/json"})
            connection.getresponse().read()
    assert cluster.store("secret").get("k") == b"v"
    for path in ("ca.key", "client.key", "127.0.0.1.key"):
        assert os.stat(os.path.join(cluster.tls_dir, path)).st_mode & 0o077 == 0, path
    assert os.stat(cluster.tls_dir).st_mode & 0o777 == 0o700


def test_the_v3_rendezvous_holds_torchs_state_by_compare_and_swap_and_torchrun_finds_it(cluster):
    """torchrun's etcd-v3 backend (distributed/rendezvous.py): absent state reads None; a write without a token
    creates it once; a write with a stale token is refused and returns the state as it is, with its token; the
    keys live on a lease. torchrun's registry has it from the project's entry point (from another directory)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from distributed.rendezvous import create_backend

    tls = cluster.client
    conf = {"ca_cert": tls.ca, "ssl_cert": tls.cert, "ssl_cert_key": tls.key}
    params = RendezvousParameters("etcd-v3", ",".join(cluster.endpoint(i) for i in range(3)), "job", 2, 2, **conf)
    backend, store = create_backend(params)
    other, _ = create_backend(params)
    assert backend.get_state() is None
    state, token, written = backend.set_state(b"first")
    assert (state, written) == (b"first", True)
    assert other.set_state(b"second") == (b"first", token, False)  # (exists: not created again)
    assert other.set_state(b"second", token)[1:] != (token,) and other.get_state()[0] == b"second"
    assert backend.set_state(b"third", token)[::2] == (b"second", False)  # (stale token: the state as it is)
    assert backend.set_state(b"x", "not a token")[::2] == (b"second", False)
    (record,) = store._range([store._key("rendezvous-state")])
    assert int(record["lease"]) > 0  # (gone two hours after the last agent's write: no agent knows it is last)
    without_tls = RendezvousParameters("etcd-v3", cluster.endpoint(0), "job", 2, 2, ssl_cert=tls.cert)
    with pytest.raises(ValueError, match="--rdzv-conf ca_cert=None: a path, as the two others"):
        create_backend(without_tls)
    registry = subprocess.run(
        [sys.executable, "-c", "import torch.distributed.elastic.rendezvous as r; print(r.rendezvous_handler_registry"
         "._registry['etcd-v3'].__module__)"], cwd="/", capture_output=True, text=True,
    )  # fmt: skip
    assert registry.stdout.strip() == "distributed.rendezvous", registry.stderr[-2000:]
