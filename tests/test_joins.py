"""A process joins a running world without stopping it (``engine/elastic``): for every sync option, a world of 2
that admits a third process mid-epoch ends exactly where the same world checkpointed at the admission step and
resumed at 3 ends (parameters, optimizer, shared and per-rank sync state, the last evaluation). All cases run in
one launch of three processes (``_workers.joined_and_resumed``)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _contract import FULL_JOIN_CASES, JOIN_CASES, JOIN_IDS, join_last_step, params, run_joins
from conftest import FAST, ROOT, node_environ, records, start_processes
from test_contract import _assert_same, _load
from test_faults import cli, env, finish, start_nodes, tail, wait_for_train_steps

from engine.elastic.records import JoinFile
from engine.metrics import read_metrics


@pytest.fixture(scope="module")
def join_runs(tmp_path_factory) -> Path:
    return run_joins(tmp_path_factory.mktemp("joins"))


@pytest.fixture(scope="module")
def join_runs_full(tmp_path_factory) -> Path:
    return run_joins(tmp_path_factory.mktemp("joins-full"), full=True)


@pytest.mark.parametrize("case", params(JOIN_CASES, FULL_JOIN_CASES, JOIN_IDS))
def test_a_join_ends_where_a_resume_at_the_new_size_ends(request, case):
    runs = request.getfixturevalue("join_runs_full" if case in FULL_JOIN_CASES else "join_runs")
    where = runs / f"case{JOIN_CASES.index(case)}"
    joined, resumed = where / "joined", where / "resumed"
    joined_metrics, resumed_metrics = (
        read_metrics(str(joined / "metrics.jsonl")),
        read_metrics(str(resumed / "metrics.jsonl")),
    )
    [join] = [r for r in records(joined_metrics, "event") if r["event"] == "rank_joined"]
    assert join["ranks"] == [2] and join["world_size"] == 3
    # Local SGD admits at an averaging, and the new process takes the model in it (InAveraging);
    # DiLoCo's whole outer step too: the new process takes the outer step with the outer state sent ahead of it.
    whole = case[1] == "diloco" and not case[2]  # (one fragment, no delay, no mixing, no quantization)
    assert join["in_averaging"] == (case[0] is None and (case[1] in ("localsgd", "adaptive_localsgd") or whole))
    at = join["step"]
    last = join_last_step(at)
    assert 0 < at < 6  # (in epoch 1)
    assert [r["step"] for r in records(joined_metrics, "train")] == list(range(last))  # each step once
    assert [r["world_size"] for r in records(joined_metrics, "train")] == [2] * at + [3] * (last - at)
    assert [r["step"] for r in records(resumed_metrics, "train")] == list(range(at, last))
    a, b = _load(joined / "checkpoints" / "last.pt"), _load(resumed / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == last and a["world_size"] == b["world_size"] == 3
    for key in ("model", "optimizer", "sync", "schedule", "amp"):
        _assert_same(a[key], b[key], key)
    own = sorted(p.name for p in (joined / "checkpoints").glob("sync_rank*.pt"))
    assert own == sorted(p.name for p in (resumed / "checkpoints").glob("sync_rank*.pt"))
    for name in own:  # every rank's own state, the new one's (started fresh in both) included
        _assert_same(_load(joined / "checkpoints" / name), _load(resumed / "checkpoints" / name), name)
    clocks = ("time", "eval_s", "wait_s")
    last_evals = (records(joined_metrics, "eval")[-1], records(resumed_metrics, "eval")[-1])
    _assert_same(*[{k: v for k, v in r.items() if k not in clocks} for r in last_evals], "eval")


# ---- joins of real processes, started as a user would -----------------------------------------------------------
MEMBERS = [
    *FAST,
    "data.num_samples=3072",
    "data.num_val_samples=96",
    "trainer.epochs=2",
    "trainer.on_failure=continue",
    "trainer.hang_timeout_s=10",
    "straggler=sleep",
    "straggler.ranks=[0,1]",
    "straggler.sleep_s=0.2",
]  # fmt: skip  (48 steps per epoch at 2 ranks, 32 at 3; a fifth of a second each: ~20 s for a joiner to start)


def _join_file(run_dir: Path, timeout: float = 120) -> JoinFile:
    deadline = time.monotonic() + timeout
    while not Path(JoinFile.path(str(run_dir))).exists():
        assert time.monotonic() < deadline, "no join.json:\n" + tail(run_dir)
        time.sleep(0.1)
    return JoinFile.read(str(run_dir))


def test_a_process_that_joins_is_admitted_without_stopping_the_others(tmp_path):
    """Two torchrun nodes train; ``train.py trainer.join=true`` on the run dir joins them mid-epoch: the members are
    never restarted (one world, no resume), the joiner takes the state from rank 0 and trains as rank 2, the rest of
    the epoch is sharded over 3, every step is recorded once, and all three end with the same replica."""
    run_dir = tmp_path / "run"
    nodes = start_nodes(2, run_dir, *MEMBERS)
    _join_file(run_dir)
    wait_for_train_steps(run_dir, 4)
    log = open(tmp_path / "run-node2.log", "w")  # (read by tail() and finish() with the nodes' logs)
    joiner = subprocess.Popen(
        cli(*MEMBERS, "trainer.join=true", f"trainer.run_dir={run_dir}", "trainer.nproc=1"),
        cwd=ROOT, env=dict(env(), OMP_NUM_THREADS="1", **node_environ(2)), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    metrics = finish(nodes, run_dir, timeout=300)
    assert joiner.wait(timeout=120) == 0, tail(run_dir)
    events = records(metrics, "event")
    assert [e["event"] for e in events].count("world") == 1 and "resume" not in [e["event"] for e in events]
    [join] = [e for e in events if e["event"] == "rank_joined"]
    assert join["ranks"] == [2] and join["world_size"] == 3
    at, steps = join["step"], records(metrics, "train")
    epochs, in_epoch = divmod(at, 48)  # (epochs done at 2 ranks, and steps of the one in progress)
    assert at >= 4 and epochs < 2, at
    expected = at + (3072 - 64 * in_epoch) // 3 // 32 + 32 * (1 - epochs)  # the rest at 3 ranks, 32 steps an epoch
    assert [r["step"] for r in steps] == list(range(expected))  # every step once, in order
    assert [r["world_size"] for r in steps] == [2] * at + [3] * (expected - at)
    summary = records(metrics, "summary")[-1]
    assert summary["finished"] and summary["world_size"] == 3 and summary["replica_spread"] == 0.0


@pytest.mark.full  # ~35 s; in make test the admission of a live process, and any loss in a part (test_faults), cover it
def test_a_process_that_asks_to_join_and_dies_before_its_admission_is_given_up(tmp_path):
    """A ticket taken by a process that never comes (it died after asking): the members admit it at the agreed step,
    find it silent when the new group does not form, remove it as lost and go on at 2; nothing is trained twice."""
    run_dir = tmp_path / "run"
    nodes = start_nodes(2, run_dir, *MEMBERS)
    where = _join_file(run_dir)
    wait_for_train_steps(run_dir, 4)
    store = dist.TCPStore(where.address, where.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    ticket = int(store.add(f"{where.prefix}/join/tickets", 1))
    store.set(f"{where.prefix}/join/ticket/{ticket}/host", "gone")
    metrics = finish(nodes, run_dir, timeout=300)
    events = records(metrics, "event")
    [join] = [e for e in events if e["event"] == "rank_joined"]
    [lost] = [e for e in events if e["event"] == "rank_lost"]
    assert join["ranks"] == lost["ranks"] == [2] and lost["world_size"] == 2 and lost["cause"] == "hung"
    steps = records(metrics, "train")
    assert [r["step"] for r in steps] == list(range(len(steps))) and len(steps) == 96  # every step once, at 2
    summary = records(metrics, "summary")[-1]
    assert summary["finished"] and summary["world_size"] == 2 and summary["replica_spread"] == 0.0


def test_a_process_that_joins_a_run_that_has_ended_says_so_within_the_deadline(tmp_path):
    """The join file names a store no one serves any more (the run ended, or its first node is gone): the joiner
    fails within ``hang_timeout_s`` naming the address, instead of waiting out the store's timeout."""
    from test_faults import free_port

    from engine.elastic.joiner import joiner_membership as joining_membership

    JoinFile("localhost", free_port(), "relaxsync/restart0/membership0", 2, "gloo").write(str(tmp_path))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"trainer.join=true: the run in .* is not reachable at localhost:\d+"):
        joining_membership(str(tmp_path), hang_timeout_s=1, timeout_s=1800)
    assert time.monotonic() - started < 600  # (the store's own timeout, 1800 s, would be the wait without it)


def test_a_process_that_joins_a_run_on_nccl_sets_the_nccl_environment_the_members_have(tmp_path, monkeypatch):
    """A joining process makes no default group (whose set-up gives the members theirs), yet its groups must
    survive a failure as the members' do: the watchdog's mode that lets a survivor live, and no dump to wait for."""
    from test_faults import free_port

    from distributed.world import NCCL_DUMP_ON_TIMEOUT, NCCL_DUMP_WAIT_MS, NCCL_ERROR_HANDLING
    from engine.elastic.joiner import joiner_membership as joining_membership

    monkeypatch.setenv(NCCL_ERROR_HANDLING, "1")  # (torchrun's, as a worker it starts has)
    monkeypatch.delenv(NCCL_DUMP_ON_TIMEOUT, raising=False)
    monkeypatch.delenv(NCCL_DUMP_WAIT_MS, raising=False)
    port = free_port()
    store = dist.TCPStore("localhost", port, is_master=True, timeout=datetime.timedelta(seconds=30))
    JoinFile("localhost", port, "relaxsync/restart0/membership0", 2, "nccl").write(str(tmp_path))
    membership = joining_membership(str(tmp_path), hang_timeout_s=5, timeout_s=30)
    assert membership.backend == "nccl" and membership.group is None
    assert os.environ[NCCL_ERROR_HANDLING] == "2" and os.environ[NCCL_DUMP_ON_TIMEOUT] == "0"
    assert os.environ[NCCL_DUMP_WAIT_MS] == "0"
    del membership, store


def test_a_promise_goes_to_the_algorithms_next_agreement_when_it_is_near():
    """A member promises MARGIN steps on, or the sync algorithm's next agreement when that is at most ALIGN steps
    further; the largest promise is then such a step as well (the period is the same on every rank)."""
    from engine.elastic.admissions import ALIGN, MARGIN, Admissions

    anywhere = Admissions(None, 1.0)
    assert anywhere.promise(10) == 10 + MARGIN
    every_4 = Admissions(None, 1.0, lambda n: -(-n // 4) * 4)
    promises = [every_4.promise(at) for at in (8, 9, 10, 13)]
    assert promises == [12, 12, 16, 16] and all(p % 4 == 0 for p in promises)
    far = Admissions(None, 1.0, lambda n: n + ALIGN + 1)
    assert far.promise(10) == 10 + MARGIN


def test_diloco_sends_its_outer_state_ahead_only_once_it_is_final_and_only_for_a_whole_outer_step():
    """What a process joining at DiLoCo's outer step needs before it (``guest_state``): the outer parameters and
    momentum, which change at outer steps only, so final once the outer step before the admission's is taken (the
    sender packs copies: the members go on changing theirs). None for an admission that is not at an outer step,
    or where the outer step is not whole (fragments, delay, mixing: no process takes part in it)."""
    from algorithms.diloco import DiLoCo

    def diloco(**kw):
        algorithm = DiLoCo(inner_steps=4, **kw)
        algorithm.setup(torch.nn.Linear(3, 2), None, ctx=None)
        return algorithm

    whole = diloco()
    assert whole.guest_state(8, 3) is None  # (the outer step at 4 steps is still to come)
    state = whole.guest_state(8, 4)
    assert state["global_params"] is whole.global_params and state["momentum"] is whole.momentum
    assert whole.guest_state(10, 8) is None  # (no outer step at 10)
    assert diloco(fragments=2).guest_state(8, 4) is None and diloco(alpha=0.5).guest_state(8, 4) is None


def test_the_members_take_a_joining_process_into_their_averaging_only_with_the_state_sent_ahead_of_it():
    """``Admissions.prepared``: the lowest member says in which generation it sent the state ahead, each process
    admitted says it has it; the members offer the averaging only where both hold for the generation they are in
    (a state sent before a loss may not be the one of the admission step), within the wait."""
    from distributed.membership import Membership
    from engine.elastic.admissions import Admissions
    from engine.elastic.records import Decision

    m = Membership(0, 2, timeout=datetime.timedelta(seconds=5), backend="gloo", prefix="prepared")
    m._store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5))
    admissions, decision = Admissions(m, 5.0), Decision(at=8, tickets=2)  # (tickets 1 and 2)
    assert not admissions.prepared(decision, 0, 0.1)  # nothing sent
    m.store.set(admissions.keys.advance_sent(1), "1")
    assert not admissions.prepared(decision, 0, 0.1)  # sent in another generation
    m.store.set(admissions.keys.advance_sent(1), "0")
    m.store.set(admissions.keys.prepared(1, 0), "1")
    assert not admissions.prepared(decision, 0, 0.1)  # ticket 2 does not have it yet
    m.store.set(admissions.keys.prepared(2, 0), "1")
    assert admissions.prepared(decision, 0, 0.1)


def test_the_state_comes_in_the_order_a_joining_process_needs_it():
    """The model and everything read before the first forward come first; the optimizer's state (and a shared
    state read only at a step, DiLoCo's) second, loaded at the first optimizer step."""
    from engine.elastic.handover import split

    state = {"model": 1, "optimizer": 2, "amp": 3, "schedule": 4, "sync": 5, "step": 6, "loop": 7}
    first, rest = split(state, late_shared_state=False)
    assert set(first) == {"model", "amp", "schedule", "sync", "step", "loop"} and set(rest) == {"optimizer"}
    first, rest = split(state, late_shared_state=True)
    assert "sync" not in first and set(rest) == {"optimizer", "sync"}
    assert {**first, **rest} == state


def _sender_lost_midway(rank: int, port: int, out: str) -> None:
    """Rank 0 sends a joining rank 1 the first part of a state over their pipe, then dies; rank 1 records what
    it got and how it left."""
    from distributed.membership import LeftRun, Membership
    from distributed.transfer import Parcel, Pipe
    from engine.elastic.handover import Receiving, pipe_store

    timeout = datetime.timedelta(seconds=30)
    membership = Membership(rank, 2, timeout=timeout, backend="gloo", prefix="test")
    membership._store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    if rank == 0:
        pipe = Pipe(pipe_store(membership, 0, 1), 0, 1, timeout)
        Parcel.of({"model": {"w": torch.arange(6.0)}}).send(pipe)
        os._exit(0)  # (as killed: the second part never comes)
    receiving = Receiving(membership, source=0)
    first = receiving.first()
    receiving.start()
    try:
        receiving.rest()
        left = None
    except LeftRun as error:
        left = str(error)
    torch.save({"first": first, "left": left}, out)


def test_a_joining_process_whose_sender_is_lost_before_the_rest_of_the_state_leaves_the_run(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    out = str(tmp_path / "joiner.pt")
    start_processes(_sender_lost_midway, (store.port, out), 2, join=True)
    got = torch.load(out, weights_only=False)
    assert torch.equal(got["first"]["model"]["w"], torch.arange(6.0))
    assert got["left"] is not None and got["left"].startswith("rank 1 lost rank 0 before it had sent the whole state")


def _admission_formed_ahead(role: int, port: int, out: str) -> None:
    """Two members (roles 0, 1) step once a second and admit the process that asks (role 2); each writes whether
    the admission took the group formed ahead, and a sum over it."""
    from distributed.membership import Membership
    from engine.elastic.admissions import Admissions
    from engine.elastic.joiner import Request

    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    if role < 2:
        m = Membership(role, 2, timeout=timeout, backend="gloo", prefix="ahead-join")
        m._store = store
        m.group = m.form([0, 1])
        admissions = Admissions(m, 30.0)
        admissions.start(0)
        step, record = 0, None
        while record is None:
            decision = admissions.due(step)
            if decision is None:
                time.sleep(1.0)
                step += 1
                continue
            joiners = admissions.joiners(decision)
            record = admissions.announce(decision, joiners)
            m.admit(list(joiners), joiners, ahead=record.ahead and record.generation == m.generation)
        admissions.stop()
    else:
        m = Membership(-1, 0, hosts=[], timeout=timeout, backend="gloo", prefix="ahead-join")
        m.initial_size, m.group, m._store = 2, None, store
        request = Request(m)
        m.rank = request.ask()
        record = request.admission()
        m.enter(record.view)
        m.admit([m.rank], {m.rank: record.added[m.rank]}, ahead=record.ahead)
    t = torch.ones(2)
    dist.all_reduce(t, group=m.group)
    with open(f"{out}.{role}", "w") as f:
        json.dump({"ahead": record.ahead, "ranks": m.ranks, "sum": t.tolist(), "rank": m.rank}, f)
    m.cancel_ahead()


def test_an_admission_takes_the_group_its_members_and_the_new_process_formed_while_the_members_trained(tmp_path):
    """Once the members know the admission, each forms the new group in the background, and the process admitted,
    told through its ticket, does the same: at the admission step they take it (the record says so), and it works
    for all three."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    out = str(tmp_path / "role")
    start_processes(_admission_formed_ahead, (store.port, out), 3)
    got = [json.loads(Path(f"{out}.{role}").read_text()) for role in range(3)]
    assert all(g["ahead"] for g in got), got
    assert [g["ranks"] for g in got] == [[0, 1, 2]] * 3 and [g["rank"] for g in got] == [0, 1, 2]
    assert all(g["sum"] == [3.0, 3.0] for g in got)


def _join_in_averaging(role: int, port: int, out: str, joiner_dies: bool) -> None:
    """Two members (roles 0, 1) step once a second and, at the step that ends where they admit the process that
    asks (role 2), sum their models in an averaging it takes part in (``InAveraging``); each writes what it got.
    With ``joiner_dies`` the process asked to take part exits instead."""
    from algorithms.localsgd import LocalSGD
    from distributed.comm import Communicator
    from distributed.membership import Membership
    from engine.elastic.admissions import Admissions, InAveraging
    from engine.elastic.joiner import Request, take_average

    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    torch.manual_seed(role)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3))
    if role < 2:
        m = Membership(role, 2, timeout=timeout, backend="gloo", prefix="in-averaging")
        m._store = store
        m.group = m.form([0, 1])
        admissions, comm = Admissions(m, 30.0), Communicator(m)
        admissions.start(0)
        step, summed, held = 0, None, None
        while True:
            decision = admissions.due(step)
            if decision is not None:
                break
            if admissions.decision is not None and admissions.decision.at == step + 1:  # the step ending there
                named = list(model.named_parameters()) + list(model.named_buffers())[:2]
                summed = torch.cat([t.detach().reshape(-1) for _, t in named])
                held = InAveraging(admissions, admissions.decision, comm).sum(summed, [n for n, _ in named])
                if not held:
                    comm.all_reduce(summed)  # (as local SGD does: on the members' own group)
            time.sleep(0.5)
            step += 1
        record = admissions.announce(decision, admissions.joiners(decision))
        admissions.stop()
        got = {"held": held, "summed": summed, "inline": record.inline, "ahead": record.ahead}
    else:
        m = Membership(-1, 0, hosts=[], timeout=timeout, backend="gloo", prefix="in-averaging")
        m.initial_size, m.group, m._store = 2, None, store

        def average(asked, ranks, generation):
            if joiner_dies:
                os._exit(0)
            share = partial(LocalSGD().take_share, model, asked=asked.wire(), state=None)  # (an average, by name)
            got["took"] = take_average(m, asked, ranks, generation, share)

        got = {}
        request = Request(m, averaging=average)
        m.rank = request.ask()
        record = request.admission()
        got.update(state=model.state_dict(), inline=record.inline)
    torch.save(got, f"{out}.{role}")
    m.cancel_ahead()


@pytest.mark.parametrize(
    "joiner_dies",
    [False, pytest.param(True, marks=pytest.mark.full)],  # (~17 s; make test: held, and a process lost mid-join
    ids=["held", "joiner-gone"],  # in test_a_joining_process_whose_sender_is_lost_...)
)
def test_a_process_admitted_at_an_averaging_takes_its_model_in_it_bit_for_bit(tmp_path, joiner_dies):
    """The averaging that ends at the admission step runs over the members and the process they admit, on the group
    formed ahead: it adds -0.0 (nothing, bit for bit) and takes the members' sum divided by their count, so it has
    exactly the replica the members go on with, and nothing of the model comes after the averaging. Where that
    collective fails (the process gone), the members agree so and sum on their own group, as without it, and the
    admission says the process did not take the model there (nor takes the group, which may be broken)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    out = str(tmp_path / "role")
    start_processes(_join_in_averaging, (store.port, out, joiner_dies), 3)
    members = [torch.load(f"{out}.{role}", weights_only=False) for role in (0, 1)]
    models = []
    for role in (0, 1):
        torch.manual_seed(role)
        models.append(torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3)))
    named = [list(m.named_parameters()) + list(m.named_buffers())[:2] for m in models]
    expected = torch.cat([t.detach().reshape(-1) for _, t in named[0]]) + torch.cat(
        [t.detach().reshape(-1) for _, t in named[1]]
    )
    for got in members:
        assert torch.equal(got["summed"], expected)  # the members' sum, with or without the process
        assert got["held"] is not joiner_dies and got["inline"] is not joiner_dies
    assert members[0]["ahead"] is not joiner_dies
    if joiner_dies:
        return
    joiner = torch.load(f"{out}.2", weights_only=False)
    assert joiner["took"] and joiner["inline"]
    average, offset = expected / 2, 0
    for name, t in named[0]:  # averaged: bit for bit the members' result
        assert torch.equal(joiner["state"][name], average[offset : offset + t.numel()].view_as(t)), name
        offset += t.numel()
    assert joiner["state"]["1.num_batches_tracked"] == 0  # (not averaged: its own, until the state comes)
