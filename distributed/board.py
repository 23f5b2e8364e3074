"""A board: entries that ranks post under one name, one each, read as a whole in the order they came.

The survivors of a failure check in on one (``engine/elastic/failures.py``), and write where they were on another.
On torch's ``TCPStore`` a board is one value that each post appends to and a counter beside it (the server applies
both in memory, one after the other). On etcd an append or an add is a read and a conditional write, and a thousand
ranks appending to one key at the same moment would retry each other's writes a million times over; there each post
is a key of its own under the board's name (:meth:`distributed.etcd.EtcdStore.post`), which no other post touches, and
a post's place in the order is the number of entries created up to its own write. Each store does it its way
behind the run's store protocol (:class:`distributed.runstore.RunStore`).
"""

from __future__ import annotations

from typing import Any

from distributed import runstore


def post(store: Any, name: str, member: int | str, value: str) -> int:
    """Post ``value`` as ``member``'s entry on board ``name`` (replacing the member's earlier one, if any); returns how
    many entries it holds with this one (its place in the order, from 1, for a member's first post)."""
    return int(runstore.of(store).post(name, str(member), value))


def entries(store: Any, name: str) -> dict[str, str]:
    """Every member's entry on board ``name``, member -> value, in the order the members first posted (none:
    empty)."""
    return dict(runstore.of(store).entries(name))  # (a member's later post replaces its earlier one)


def count(store: Any, name: str) -> int:
    """How many posts board ``name`` holds (members, where each posts once)."""
    return int(runstore.of(store).count(name))
