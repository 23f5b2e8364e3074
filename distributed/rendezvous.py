"""torchrun's rendezvous on etcd's v3 API, through the run store's own client (:class:`distributed.etcd.EtcdStore`):

    torchrun --rdzv-backend etcd-v3 --rdzv-endpoint node1:2379,node2:2379,node3:2379 --rdzv-id $JOB ...

torch's ``etcd`` and ``etcd-v2`` backends speak etcd's v2 API, which etcd 3.6 removed; this one runs on
etcd 3.4 through 3.6. It is torch's own dynamic rendezvous (the ``c10d`` backend's joins, keep-alives, rounds and
closing), its state held in one etcd key written by compare-and-swap on the key's revision. Every member named in
``--rdzv-endpoint`` is asked in turn, the first one first (list the node's own member first), so an agent goes on
through any majority of the cluster. The state and the keys the agents write through the rendezvous's store (its
address exchange, the exit barrier) live on an etcd lease: gone ``ttl`` seconds after the last write (two hours, as
torch's etcd-v2 state), as no agent can tell it is the last one.

torch finds the backend through the ``torchrun.handlers`` entry point (pyproject.toml; ``make venv`` installs the
project into .venv for it). ``--rdzv-conf`` takes ``ttl`` (seconds), ``read_timeout`` (seconds, the store's waits)
and, for an etcd with TLS, ``ca_cert``, ``ssl_cert``, ``ssl_cert_key`` (torch's etcd-v2 names; see
docs/failures.md, "Who may talk to a run").
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist

from distributed.etcd import SCHEME, TLS_SCHEME, EtcdRefused, EtcdStore, Tls, parse

NAME = "etcd-v3"
STATE = "rendezvous-state"
TTL_S = 7200


def create_backend(params: Any) -> tuple[Any, EtcdStore]:
    """The backend holding the state of rendezvous ``params.run_id`` and the store handed to the agents, from
    torchrun's ``RendezvousParameters``."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    class EtcdV3Backend(RendezvousBackend):
        """The rendezvous's state in one etcd key; its fencing token the key's revision."""

        def __init__(self, store: EtcdStore):
            self.store = store

        @property
        def name(self) -> str:
            return NAME

        def _answer(self, call: Any, *args: Any) -> Any:
            try:
                return call(*args)
            except EtcdRefused as error:
                raise RendezvousStateError(str(error)) from error
            except dist.DistNetworkError as error:
                raise RendezvousConnectionError(str(error)) from error

        def get_state(self) -> tuple[bytes, Any] | None:
            return self._answer(self.store.versioned_get, STATE)

        def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
            if token is None:
                version = 0
            else:
                try:
                    version = int(token)
                except (TypeError, ValueError):  # (not one of ours: the state as it is)
                    found = self.get_state()
                    return None if found is None else (*found, False)
            return self._answer(self.store.versioned_set, STATE, state, version)

    if not params.run_id:
        raise ValueError("rendezvous etcd-v3: the run id must not be empty (--rdzv-id)")
    endpoint = params.endpoint.strip()
    names = ("ca_cert", "ssl_cert", "ssl_cert_key")
    try:
        tls = Tls.from_config(*(params.get(name) for name in names), names=names)
    except ValueError as error:
        raise ValueError(f"rendezvous etcd-v3: --rdzv-conf {error}") from None
    for scheme in (SCHEME, TLS_SCHEME):
        endpoint = endpoint.removeprefix(scheme)
    url = (TLS_SCHEME if tls else SCHEME) + endpoint
    ttl = params.get_as_int("ttl", TTL_S)
    read_timeout = params.get_as_int("read_timeout", 300)
    if ttl is None or ttl < 60 or read_timeout is None or read_timeout <= 0:
        raise ValueError(
            f"rendezvous etcd-v3: --rdzv-conf ttl={ttl} (seconds ≥ 60) and read_timeout={read_timeout} (seconds > 0)"
        )
    members, _ = parse(url)
    store = EtcdStore(
        members, f"rdzv/{params.run_id}", datetime.timedelta(seconds=read_timeout), ttl_s=ttl, tls=tls, first=0
    )
    return EtcdV3Backend(store), store


def create_handler(params: Any) -> Any:
    """torchrun's handler for ``--rdzv-backend etcd-v3``: torch's dynamic rendezvous on :func:`create_backend`.

    It does not have the first node's agent host a ``TCPStore`` for the workers (torch's "agent store", which takes
    any client that reaches it): workers on ``trainer.store`` meet in etcd and need none, and others start theirs
    as torchrun's workers did before it shared the agent's (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``, set here unless
    the environment sets it)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dynamic

    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    backend, store = create_backend(params)
    return dynamic(store, backend, params)


def handler_creator() -> Any:
    """The ``torchrun.handlers`` entry point: torch registers what this returns under the entry point's name."""
    return create_handler
