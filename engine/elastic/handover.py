"""The trainer's state on its way to a joiner (step 5 of the protocol, ``engine/elastic/__init__.py``): in the order
it needs it (:func:`split`), from the sender's thread (:class:`Sending`) over a connection of the two processes' own
(:func:`pipe_store`, ``distributed.transfer.Pipe``), while everyone trains (:class:`Receiving`)."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch.distributed as dist

from distributed.membership import LeftRun, Membership
from distributed.transfer import Parcel, Pipe
from engine.elastic.records import Keys


def split(state: dict[str, Any], late_shared_state: bool) -> list[dict[str, Any]]:
    """A state for a joiner, in the order it needs it: what it needs before its first forward (the
    model, the position, AMP's state, the sync algorithm's shared state unless that is read only at a step), then
    what it needs only at its first optimizer step (the optimizer's state, and a late shared state)."""
    late = {"optimizer", "sync"} if late_shared_state else {"optimizer"}
    return [{k: v for k, v in state.items() if k not in late}, {k: v for k, v in state.items() if k in late}]


def pipe_store(membership: Membership, source: int, joiner: int, advance: int | None = None) -> dist.Store:
    """Where the sender and a joiner meet for the state (a connection to the store of its own: the sender's thread
    never waits behind the main thread's store calls); ``advance``: for the advance state, sent before the admission
    (:func:`receive_advance`), in the members' generation then."""
    at = membership.generation if advance is None else f"advance-{advance}"
    return dist.PrefixStore(Keys(membership).pipe(at, source, joiner), membership.store.clone())


def receive_advance(membership: Membership, source: int, generation: int) -> Any:
    """On a joiner before its admission: the advance state the sender sends it (``SyncAlgorithm.guest_state``, a
    :class:`Sending` with ``advance``), members in ``generation``."""
    timeout = membership.timeout or datetime.timedelta(seconds=300)
    pipe = Pipe(pipe_store(membership, source, membership.rank, generation), membership.rank, source, timeout)
    return Parcel.receive(pipe)


class Sending:
    """The sender's side of a state's way to a joiner: the parcels (packed at the admission)
    sent in order from a thread, over a :class:`Pipe` of the two, while this member trains. A failure is not this
    member's to handle: the joiner it sent to is gone (the members find it lost as any other)."""

    def __init__(self, membership: Membership, joiner: int, parcels: list[Parcel], advance: bool = False):
        self.joiner, self.parcels, self.error = joiner, parcels, None
        self._store = pipe_store(membership, membership.rank, joiner, membership.generation if advance else None)
        self._args = (membership.rank, membership.timeout or datetime.timedelta(seconds=300))
        self._thread = threading.Thread(target=self._send, name="relaxsync-join-send", daemon=True)

    def start(self) -> Sending:
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _send(self) -> None:
        try:
            pipe = Pipe(self._store, self._args[0], self.joiner, self._args[1])
            for parcel in self.parcels:
                parcel.send(pipe)
        except Exception as error:
            self.error = error
            print(f"relaxsync: rank {self._args[0]} could not send rank {self.joiner} its state: {error}", flush=True)


class Receiving:
    """A joiner's side: the first part of the state, waited for; the rest, received by a thread while
    this process computes its first step (:meth:`start`, :meth:`rest`). The sender lost before the whole state
    arrived makes this process leave the run (``LeftRun``): nobody else has this point's state to give."""

    def __init__(self, membership: Membership, source: int):
        self.membership, self.source = membership, source
        self._timeout = membership.timeout or datetime.timedelta(seconds=300)
        self._pipe: Pipe | None = None
        self._rest: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._receive_rest, name="relaxsync-join-receive", daemon=True)
        self._clock = {"asked": time.perf_counter()}

    def first(self) -> dict[str, Any]:
        m = self.membership
        try:
            self._pipe = Pipe(pipe_store(m, self.source, m.rank), m.rank, self.source, self._timeout)
            first = Parcel.receive(self._pipe)
        except Exception as error:
            raise self._lost(error) from error
        self._clock["first"] = time.perf_counter()
        return first

    def start(self) -> Receiving:
        self._thread.start()
        return self

    def rest(self) -> dict[str, Any]:
        self._clock["needed"] = time.perf_counter()
        self._thread.join()
        self._clock["loaded"] = time.perf_counter()
        if self._error is not None:
            raise self._lost(self._error) from self._error
        assert self._rest is not None
        return self._rest

    def _receive_rest(self) -> None:
        try:
            self._rest = Parcel.receive(self._pipe)
        except Exception as error:
            self._error = error
        self._clock["rest"] = time.perf_counter()

    def _lost(self, error: BaseException) -> LeftRun:
        reason = f"lost rank {self.source} before it had sent the whole state ({type(error).__name__}: {error})"
        print(f"relaxsync: rank {self.membership.rank} {reason}; exiting (start it again to ask again)", flush=True)
        return LeftRun(self.membership.rank, reason)

    def __str__(self) -> str:
        c = self._clock
        return (
            f"the first part in {c['first'] - c['asked']:.2f} s, the rest {c['rest'] - c['first']:.2f} s later, "
            f"{c['loaded'] - c['needed']:.2f} s waited for it"
        )
