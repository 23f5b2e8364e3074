"""What the run's agreement needs of its store beyond c10d's ``Store`` API, as one protocol: :class:`RunStore`.

The run's store is torch's ``TCPStore`` (one process, on torchrun's first node, holding every key in memory) or an
etcd cluster (``trainer.store``: :class:`distributed.etcd.EtcdStore`, which implements this protocol itself). The two
differ in what the membership code must do differently, and only there: boards (entries many ranks post at once,
:mod:`distributed.board`), whether the store is a replicated cluster (it outlives every rank, serves about a thousand
requests a second, answers only where a majority of its members is), a client for calls one slow member must not
hold (heartbeats), where the run's keys live, and their deletion at a clean end. :func:`of` gives the protocol
of any c10d store: the store itself where it implements it, else :class:`TorchStore` around it.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class RunEnded(dist.DistStoreError):
    """A wait on a run that has ended and deleted its keys (``forget_run``): they will not come. What a process
    that wakes after the end (continued once it hung) gets, instead of waiting out the store's timeout."""


class RunStore:
    """The protocol (a plain base class: c10d's ``Store`` is a pybind class, whose metaclass an ABC's would clash
    with). :attr:`store` is the c10d store the protocol is of."""

    replicated: bool = False  # a cluster of its own: outlives every rank, answers only with a majority
    root: str = ""  # where the run's keys live in it ("" where they are the whole store's)

    @property
    def store(self) -> Any:
        raise NotImplementedError

    def post(self, name: str, member: str, value: str) -> int:
        """``member``'s entry on board ``name`` (replacing its earlier one); the number of entries as of this post
        (its place in the order)."""
        raise NotImplementedError

    def entries(self, name: str) -> list[tuple[str, str]]:
        """Board ``name``'s entries, (member, value), in the order the members first posted."""
        raise NotImplementedError

    def count(self, name: str) -> int:
        """How many posts board ``name`` holds."""
        raise NotImplementedError

    def hurried(self) -> Any:
        """A c10d store for calls that one slow member of a replicated store must not hold long (a heartbeat's)."""
        raise NotImplementedError

    def forget_run(self) -> int:
        """Delete every key of the run, at its clean end (what a store that outlives the run would keep); how many
        went."""
        raise NotImplementedError


class TorchStore(RunStore):
    """The protocol on torch's ``TCPStore`` (or any c10d store whose server applies each call in memory, one after
    another): a board is one value each post appends to and a counter beside it; the store goes with its process,
    and its keys with it."""

    def __init__(self, store: Any):
        self._store = store

    @property
    def store(self) -> Any:
        return self._store

    def post(self, name: str, member: str, value: str) -> int:
        self._store.append(name, f"{member} {value}\n")
        return int(self._store.add(f"{name}/count", 1))

    def entries(self, name: str) -> list[tuple[str, str]]:
        if not self._store.check([name]):
            return []
        lines = self._store.get(name).decode().splitlines()
        return [tuple(line.split(" ", 1)) for line in lines if line]  # type: ignore[misc]

    def count(self, name: str) -> int:
        return int(self._store.add(f"{name}/count", 0))

    def hurried(self) -> Any:
        return self._store  # (one server: no other member to move to)

    def forget_run(self) -> int:
        return 0  # (its keys end with the process that holds them)


def of(store: Any) -> RunStore:
    """The :class:`RunStore` protocol of c10d store ``store``."""
    return store if isinstance(store, RunStore) else TorchStore(store)
