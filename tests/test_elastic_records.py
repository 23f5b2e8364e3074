"""The join's wire (engine/elastic/records.py) and the one reader of the membership's changes: what one party
writes, the other reads back as it was, every key either party builds is its own, and each change is taken once."""

from __future__ import annotations

import json

from distributed.membership import Change, Membership
from engine.elastic.records import Admission, Decision, Keys, Notice, Offer, ticket_rank


def test_each_record_reads_back_as_it_was_written():
    decision = Decision(at=12, tickets=3)
    assert Decision.read(json.loads(json.dumps(decision.wire()))) == decision
    notice = Notice(generation=4, ranks=[0, 1, 5])
    assert Notice.read(notice.wire().encode()) == notice
    offer = Offer(contributors=2, names=["fc.weight", "fc.bias"], numel=42, advance=True)
    assert Offer.read(json.loads(json.dumps(offer.wire()))) == offer and Offer.read(None) is None
    view = {"ranks": [0, 1], "generation": 4, "initial_size": 2, "hosts": ["a", "b"], "agreements": 7}
    admission = Admission(view, {5: "node-c"}, at=12, round=2, admitted=3, ahead=True, inline=False)
    read = Admission.read(admission.wire().encode())
    assert read == admission and read.generation == 4 and list(read.added) == [5]  # (ids, not JSON's strings)


def test_every_key_of_the_protocol_is_distinct_and_under_the_runs_prefix():
    keys = Keys(Membership(0, 2, prefix="run-a"))
    built = [
        keys.tickets(), keys.closed(), keys.promise(1, 0), keys.promise(1, 1), keys.promise(2, 0),
        keys.advance_sent(1), keys.offer(1, 0), keys.offer(1, 1), keys.host(1), keys.host(2), keys.notice(1),
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
