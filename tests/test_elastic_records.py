"""The join's wire (engine/elastic/records.py) and the one reader of the membership's changes: what one party
writes, the other reads back as it was, every key either party builds is its own, and each change is taken once."""

from __future__ import annotations

import json
import types

from distributed.membership import Change, Membership
from engine.elastic.records import Admission, Decision, Keys, NodeTicket, Notice, Offer, ticket_rank, whole_nodes


def test_each_record_reads_back_as_it_was_written():
    decision = Decision(at=12, tickets=3)
    assert Decision.read(json.loads(json.dumps(decision.wire()))) == decision
    notice = Notice(generation=4, ranks=[0, 1, 5])
    assert Notice.read(notice.wire().encode()) == notice
    offer = Offer(contributors=2, names=["fc.weight", "fc.bias"], numel=42, advance=True)
    assert Offer.read(json.loads(json.dumps(offer.wire()))) == offer and Offer.read(None) is None
    view = {"ranks": [0, 1], "generation": 4, "initial_size": 2, "hosts": ["a", "b"], "agreements": 7}
    admission = Admission(view, {5: "node-c"}, at=12, round=2, admitted=3, ahead=True, inline=False, nodes={5: "n2"})
    read = Admission.read(admission.wire().encode())
    assert read == admission and read.generation == 4 and list(read.added) == [5]  # (ids, not JSON's strings)
    assert list(read.nodes) == [5]
    ticket = NodeTicket("run/node2", processes=2)
    assert NodeTicket.read(ticket.wire().encode()) == ticket


def test_at_node_scope_only_nodes_all_of_whose_processes_asked_are_admitted():
    x, y = NodeTicket("x", 2), NodeTicket("y", 2)
    assert whole_nodes(3, []) == 3
    assert whole_nodes(3, [x]) == 3  # (half of node x)
    assert whole_nodes(3, [x, x]) == 5
    assert whole_nodes(3, [x, y, x]) == 3  # (x whole, but not as a prefix: y's other half has not asked)
    assert whole_nodes(3, [x, y, x, y]) == 7
    assert whole_nodes(3, [x, x, y]) == 5  # (x now, y at a later admission)


def test_every_key_of_the_protocol_is_distinct_and_under_the_runs_prefix():
    keys = Keys(Membership(0, 2, prefix="run-a"))
    built = [
        keys.tickets(), keys.closed(), keys.promise(1, 0), keys.promise(1, 1), keys.promise(2, 0),
        keys.advance_sent(1), keys.offer(1, 0), keys.offer(1, 1), keys.host(1), keys.host(2), keys.node(1),
        keys.notice(1),
        keys.admission(1), keys.ticket_offer(1, 0), keys.advance_from(1, 0), keys.prepared(1, 0),
        keys.pipe(0, 0, 2), keys.pipe("advance-0", 0, 2),
    ]  # fmt: skip
    assert len(set(built)) == len(built) and all(k.startswith("run-a") for k in built)
    assert ticket_rank(initial_size=4, ticket=1) == 4  # (a joiner's id: never a rank used before)


def test_the_changes_reader_hands_each_change_once_from_when_it_was_made():
    m = Membership(0, 3)
    m.changes.append(Change(1, [2], [0, 1], "died"))
    follow = m.follow()
    assert follow.take() == []  # (what came before it was made is not its)
    m.changes.append(Change(2, [], [0, 1, 3], "joined", [3]))
    m.changes.append(Change(3, [1], [0, 3], "slow"))
    assert [c.generation for c in follow.take()] == [2, 3] and follow.take() == []


def test_a_joiner_is_of_the_runs_world_and_finds_its_store_on_etcd(tmp_path, monkeypatch):
    """join.json carries the run's world, so that a joiner that comes to log (the logging rank lost) holds the run
    dir as the run's own, not as a second world; and the run's store where it is an etcd cluster."""
    from engine.elastic.records import JoinFile
    from engine.launchers import WORLD_ENV, world_id

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("RELAXSYNC_STORE", "etcd://a:1,b:2")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    from distributed.etcd import EtcdStore

    store = EtcdStore([("a", 1), ("b", 2)], "job7/restart0")  # (not reached: only its root is read)
    membership = types.SimpleNamespace(prefix="p", initial_size=3, backend="gloo", store=store)
    JoinFile.of(membership).write(str(tmp_path))
    where = JoinFile.read(str(tmp_path))
    assert (where.world, where.store, where.store_root) == ("torchelastic-job7", "etcd://a:1,b:2", "job7/restart0")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv(WORLD_ENV, where.world)  # (what joiner_membership sets from it)
    assert world_id() == "torchelastic-job7"
