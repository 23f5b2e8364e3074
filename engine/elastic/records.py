"""The join's wire: every store key either party reads or writes, built in one place (:class:`Keys`), and the records
they exchange, each a small frozen dataclass with ``wire()`` (its JSON-able form) and ``read()`` (back from it).

The parties are the *members* (the ranks training) and the *joiner* (a process started with ``trainer.join=true``);
*ahead* means one thing: the group of the next membership, formed in the background before the admission step
(``Membership.prepare``). A state the sender sends before the admission step is the *advance* state.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from distributed import runstore
from distributed.etcd import STORE_ENV
from distributed.membership import Membership
from engine.launchers import world_id

JOIN_FILE = "join.json"


def ticket_rank(initial_size: int, ticket: int) -> int:
    """The id in the run of the joiner that took ``ticket`` (from 1): never one a rank had before."""
    return initial_size + ticket - 1


class Keys:
    """Every store key of the join protocol, under the membership's prefix and ``join/``. ``round`` counts the
    admissions (from 1), ``ticket`` the joiners (from 1), ``generation`` the membership's changes."""

    def __init__(self, membership: Membership):
        self.membership = membership

    def key(self, name: str) -> str:
        return self.membership.key(f"join/{name}")

    # ---- the run's: the joiners' counter and its end
    def tickets(self) -> str:
        return self.key("tickets")

    def closed(self) -> str:
        return self.key("closed")

    # ---- an admission round's, on the members' side
    def promise(self, round_: int, rank: int) -> str:
        return self.key(f"{round_}/promise/{rank}")

    @staticmethod
    def decision(round_: int) -> str:
        """The topic the members agree the admission on (``Membership.propose``: prefixed there)."""
        return f"join/{round_}/decision"

    def advance_sent(self, round_: int) -> str:
        """The generation in which the sender sent the advance state."""
        return self.key(f"{round_}/advance")

    def offer(self, round_: int, generation: int) -> str:
        """The members' decision whether the joiners take part in the averaging of the admission step."""
        return self.key(f"{round_}/inline/{generation}")

    # ---- a ticket's: what its joiner reads or writes
    def host(self, ticket: int) -> str:
        return self.key(f"ticket/{ticket}/host")

    def node(self, ticket: int) -> str:
        """The joiner's node: its name and how many processes it starts (``NodeTicket``)."""
        return self.key(f"ticket/{ticket}/node")

    def notice(self, ticket: int) -> str:
        """The admission is agreed: the :class:`Notice` of the group to form ahead."""
        return self.key(f"ticket/{ticket}/ahead")

    def admission(self, ticket: int) -> str:
        return self.key(f"ticket/{ticket}/admission")

    def ticket_offer(self, ticket: int, generation: int) -> str:
        return self.key(f"ticket/{ticket}/inline/{generation}")

    def advance_from(self, ticket: int, generation: int) -> str:
        """The rank that sends this ticket's joiner the advance state."""
        return self.key(f"ticket/{ticket}/advance/{generation}")

    def prepared(self, ticket: int, generation: int) -> str:
        """This ticket's joiner has the advance state."""
        return self.key(f"ticket/{ticket}/prepared/{generation}")

    # ---- the connection the state travels on
    def pipe(self, at: int | str, source: int, joiner: int) -> str:
        return self.key(f"pipe/{at}/{source}-{joiner}/")


@dataclass(frozen=True)
class JoinFile:
    """Where a run's store is, for a joiner: ``<run dir>/join.json``."""

    address: str
    port: int
    prefix: str  # the membership's keys
    initial_size: int
    backend: str
    store: str = ""  # trainer.store's URL, where the run's store is an etcd cluster
    store_root: str = ""  # and the run's place in it
    world: str = ""  # the run's world (engine.launchers.world_id): a joiner that comes to log holds the run dir as it

    @staticmethod
    def path(run_dir: str) -> str:
        return os.path.join(run_dir, JOIN_FILE)

    def write(self, run_dir: str) -> None:
        """Atomically (a joiner never reads half a file)."""
        path = self.path(run_dir)
        with open(f"{path}.tmp", "w") as f:
            json.dump(asdict(self), f)
        os.replace(f"{path}.tmp", path)

    @classmethod
    def read(cls, run_dir: str) -> JoinFile:
        with open(cls.path(run_dir)) as f:
            return cls(**json.load(f))

    @classmethod
    def of(cls, membership: Membership) -> JoinFile | None:
        """The file for ``membership``'s run; None where its store cannot be reached from elsewhere."""
        address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        etcd = os.environ.get(STORE_ENV, "")
        if not ((address and port) or etcd) or not membership.backend:
            return None
        root = runstore.of(membership.store).root if etcd else ""
        m = membership
        return cls(address or "", int(port or 0), m.prefix, m.initial_size, m.backend, etcd, root, world_id())


@dataclass(frozen=True)
class Decision:
    """The next admission, as the members agreed it."""

    at: int  # the admission step: no member has passed it
    tickets: int  # the tickets admitted: those after the previous admission's, up to this one

    def wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def read(cls, wire: dict[str, Any]) -> Decision:
        return cls(int(wire["at"]), int(wire["tickets"]))


@dataclass(frozen=True)
class Notice:
    """To a joiner, once its admission is agreed: the group it will have, to form now (ahead)."""

    generation: int
    ranks: list[int]

    def wire(self) -> str:
        return json.dumps([self.generation, self.ranks])

    @classmethod
    def read(cls, wire: str | bytes) -> Notice:
        generation, ranks = json.loads(wire)
        return cls(int(generation), [int(r) for r in ranks])


@dataclass(frozen=True)
class Offer:
    """The members' offer to the joiners of an admission to take part in the averaging that ends at its step."""

    contributors: int  # the members: the sum is divided by their count
    names: list[str]  # the model's tensors averaged, in order
    numel: int
    advance: bool  # the joiners need the advance state for their share (``SyncAlgorithm.guest_state``)

    def wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def read(cls, wire: dict[str, Any] | None) -> Offer | None:
        """None: not offered."""
        return None if wire is None else cls(**wire)


@dataclass(frozen=True)
class NodeTicket:
    """What a joiner says of its node with its ticket: the node's name and how many processes it starts there."""

    node: str
    processes: int

    def wire(self) -> str:
        return json.dumps({"node": self.node, "processes": self.processes})

    @classmethod
    def read(cls, wire: str | bytes) -> NodeTicket:
        return cls(**json.loads(wire))


def whole_nodes(admitted: int, tickets: list[NodeTicket]) -> int:
    """How many tickets may be admitted where nodes join whole (node scope): the most, counted from ticket
    ``admitted + 1`` (``tickets[0]``) on, such that every node they name has all its processes among them
    (``admitted`` where none has yet)."""
    for last in range(len(tickets), 0, -1):
        taken = tickets[:last]
        counts: dict[str, int] = {}
        for t in taken:
            counts[t.node] = counts.get(t.node, 0) + 1
        if all(counts[t.node] == t.processes for t in taken):
            return admitted + last
    return admitted


@dataclass(frozen=True)
class Admission:
    """What the members write to each ticket at the admission step (the first writer's, for all)."""

    view: dict[str, Any]  # the membership just before it (``Membership.view``), which the joiner enters
    added: dict[int, str]  # the ids admitted, each with its host
    at: int  # the admission step
    round: int  # admissions carried out with this one
    admitted: int  # tickets admitted with this one
    ahead: bool  # the new group was formed ahead, on every party
    inline: bool  # the joiners took the model's averaged tensors in the averaging of the admission step
    nodes: dict[int, str] = field(default_factory=dict)  # the ids admitted, each with its node's name

    @property
    def generation(self) -> int:
        """The members' generation just before it."""
        return self.view["generation"]

    def wire(self) -> str:
        added = {str(r): host for r, host in self.added.items()}
        record = {"added": added, "at": self.at, "round": self.round, "admitted": self.admitted}
        nodes = {str(r): node for r, node in self.nodes.items()}
        return json.dumps({**record, "ahead": self.ahead, "inline": self.inline, "view": self.view, "nodes": nodes})

    @classmethod
    def read(cls, wire: str | bytes) -> Admission:
        r = json.loads(wire)
        added = {int(rank): host for rank, host in r["added"].items()}
        nodes = {int(rank): node for rank, node in r.get("nodes", {}).items()}
        return cls(r["view"], added, r["at"], r["round"], r["admitted"], r["ahead"], r["inline"], nodes)
