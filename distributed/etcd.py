"""The run's store on an etcd cluster, so that no node's loss takes the store with it.

    trainer.store=etcd://node1:2379,node2:2379,node3:2379

torchrun's c10d store lives in one process on the first node: when that node goes, the others have nothing left to
agree through. An etcd cluster of 3 (or 5) members on distinct nodes keeps every key it has acknowledged as long as a
majority of its members live, and refuses to answer on a side that holds no majority, so a part of the run cut off
from the others stops instead of going on as a second run (docs/failures.md, "The store").

:class:`EtcdStore` is a c10d ``Store`` (gloo and NCCL groups form over it, and the elastic code uses it as it uses a
``TCPStore``) on etcd's v3 API through its HTTP gateway (JSON over one kept-alive connection, the standard library
only). Each call goes to one member; when that member does not answer (gone, or without a leader) the call moves to
the next, for up to ``reach_s`` in all, and then raises ``DistNetworkError``. Keys live under ``/relaxsync/<run>/``.

A call retried on another member may have been applied by the first one before it went. ``set``, ``compare_set``
and deletes give the same result applied twice; ``add`` and ``append`` would not (a check-in counted twice), so
each of their writes also writes a marker of its own (per client and key, overwritten by the next) in the same
transaction, and a retry whose comparison fails reads that marker to learn whether its first try was applied.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import functools
import http.client
import ipaddress
import itertools
import json
import os
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
import uuid
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from distributed.runstore import RunEnded, RunStore

SCHEME = "etcd://"
TLS_SCHEME = "etcds://"  # the members' client URLs are https://, and each client shows a certificate of the run's CA
TLS_KEYS = ("trainer.store_tls.ca", "trainer.store_tls.cert", "trainer.store_tls.key")
TLS_ENV = "RELAXSYNC_STORE_TLS"  # trainer.store_tls (JSON), for every part of a worker that opens the run's store
DEFAULT_PORT = 2379
ATTEMPT_S = 2.0  # one request to one member; etcd answers a write within its election time or says why not
# A heartbeat's request to one member (EtcdStore.hurried): a member that is restarting, catching up or without a leader
# can hold a request for seconds, and a beat held for SILENT_S would make a live rank look gone to the others.
HURRIED_S = 0.5
REACH_S = 6.0  # every member tried, again and again, before the store counts as unreachable
WATCH_S = 1.0  # a wait watches its key for this long at a time, then reads the keys again
# A run's end leaves one key for this long: a process that wakes later (continued after it hung) finds it, instead
# of waiting out the store's timeout for keys deleted with the run.
ENDED_TTL_S = 86400
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops: a transaction of more operations is refused
MAX_TXN_BYTES = 1 << 20  # under etcd's default --max-request-bytes (1.5 MiB), with room for the JSON around it
# gRPC codes of an answer that another member, or the same one later, would give again (the gateway's JSON has them):
# INVALID_ARGUMENT, PERMISSION_DENIED, RESOURCE_EXHAUSTED (the database is full: NOSPACE), FAILED_PRECONDITION,
# OUT_OF_RANGE (a compacted revision), UNAUTHENTICATED. Retrying them for REACH_S and calling the cluster unreachable
# would hide what etcd said.
REFUSED_CODES = {3, 7, 8, 9, 11, 16}
REFUSED_STATUSES = {401, 403, 413, 429}
_THREAD = threading.local()  # each thread's connections, one per member
_KEPT: list[EtcdStore] = []  # clones, alive with the process (EtcdStore.clone)


def parse(url: str) -> tuple[list[tuple[str, int]], str]:
    """``etcd://host[:port],host[:port],.../name`` (or ``etcds://``) -> the members' (host, port) and the run's
    name (may be "")."""
    scheme = next((s for s in (SCHEME, TLS_SCHEME) if url.startswith(s)), None)
    if scheme is None:
        raise ValueError(
            f"trainer.store={url!r}: expected {SCHEME}host:port,host:port,... (etcd's client URLs; "
            f"{TLS_SCHEME}... with TLS)"
        )
    where, _, name = url[len(scheme) :].partition("/")
    endpoints = []
    for part in filter(None, where.split(",")):
        parsed = urlparse(f"//{part}")
        try:
            port = parsed.port or DEFAULT_PORT
        except ValueError:
            raise ValueError(f"trainer.store={url!r}: {part!r} is not host[:port] (etcd://host:port,...)") from None
        if not parsed.hostname:
            raise ValueError(f"trainer.store={url!r}: {part!r} is not host[:port] (etcd://host:port,...)")
        endpoints.append((parsed.hostname, port))
    if not endpoints:
        raise ValueError(f"trainer.store={url!r}: no etcd member given ({SCHEME}host:port,host:port,...)")
    return endpoints, name.strip("/")


class TlsFileError(ValueError):
    """A TLS file of the store's client that cannot be used: ``key`` (what the user set), its ``value``, why."""

    def __init__(self, key: str, value: Any, problem: str):
        self.key, self.value, self.problem = key, value, problem
        super().__init__(f"{key}={value!r}: {problem}")


@dataclasses.dataclass(frozen=True)
class Tls:
    """A client's TLS for an etcd cluster that requires it (``etcds://``): the CA that signed the members'
    certificates, and this client's certificate and key, which the members check (``--client-cert-auth``)."""

    ca: str
    cert: str
    key: str

    @classmethod
    def from_config(
        cls,
        ca: Any,
        cert: Any,
        key: Any,
        names: tuple[str, str, str] = TLS_KEYS,
    ) -> Tls | None:
        """The three files, each checked (readable; the key readable by its owner only); None where none is given.
        :class:`TlsFileError` names the key (``names``: what the user calls them) and the file."""
        given = dict(zip(names, (ca, cert, key)))
        if all(v in (None, "") for v in given.values()):
            return None
        for name, path in given.items():
            if not isinstance(path, str) or not path:
                raise TlsFileError(name, path, "a path, as the two others (the CA, certificate and key go together)")
            if not os.path.isfile(path) or not os.access(path, os.R_OK):
                raise TlsFileError(name, path, "a readable file (there is none)")
        mode = os.stat(key).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            mine = f"a key only its owner may read (mode {stat.S_IMODE(mode):o}): chmod 600 {key}"
            raise TlsFileError(names[2], key, mine)
        return cls(os.path.abspath(ca), os.path.abspath(cert), os.path.abspath(key))

    @classmethod
    def from_environ(cls) -> Tls | None:
        """What :meth:`to_environ` put in this process's environment (its launcher's, inherited)."""
        given = os.environ.get(TLS_ENV)
        return cls(**json.loads(given)) if given else None

    def encoded(self) -> str:
        """What :data:`TLS_ENV` holds for it."""
        return json.dumps(dataclasses.asdict(self))

    def to_environ(self) -> None:
        os.environ[TLS_ENV] = self.encoded()

    def context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=self.ca)
            context.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as error:
            files = f"the CA {self.ca}, certificate {self.cert}, key {self.key}"
            raise ValueError(f"etcd store TLS: {files}: {error}") from None
        return context


_CONTEXTS: dict[Tls, ssl.SSLContext] = {}


def _connect(host: str, port: int, tls: Tls | None, timeout: float) -> http.client.HTTPConnection:
    if tls is None:
        return http.client.HTTPConnection(host, port, timeout=timeout)
    if tls not in _CONTEXTS:
        _CONTEXTS[tls] = tls.context()
    return http.client.HTTPSConnection(host, port, timeout=timeout, context=_CONTEXTS[tls])


def _drop(connections: dict[Any, http.client.HTTPConnection], endpoint: Any) -> None:
    connection = connections.pop(endpoint, None)
    if connection is not None:
        connection.close()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _range_end(prefix: bytes) -> bytes:
    """etcd's end of the range of keys starting with ``prefix``."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    end[-1] += 1
    return bytes(end)


class EtcdRefused(dist.DistStoreError):
    """etcd answered and refused the request (its database full, the client not authenticated or not allowed, a
    request too large): raised at once with etcd's own message, not retried on the other members, which would
    refuse it too."""


def _refusal(status: int, answer: dict[str, Any]) -> bool:
    return status in REFUSED_STATUSES or answer.get("code") in REFUSED_CODES


def _tls_hint(tls: Tls | None) -> str:
    if tls is None:
        return f" (if the members require TLS: {TLS_SCHEME}... with trainer.store_tls)"
    return f" (if they refuse this client's certificate: is {tls.cert} signed by the CA the members trust?)"


def _what_to_do(message: str) -> str:
    if "database space exceeded" in message:
        return (
            " (the members' database reached its quota, --quota-backend-bytes: compact its history (etcdctl compact "
            "<revision>), defragment it (etcdctl defrag) and disarm the alarm (etcdctl alarm disarm); the members "
            "of the recipes shipped compact it themselves, --auto-compaction-*)"
        )
    return ""


class EtcdStore(dist.Store, RunStore):
    """A c10d store on an etcd cluster's v3 API (see the module's docstring), and the run's store protocol
    (:class:`distributed.runstore.RunStore`) on it."""

    replicated = True

    @property
    def store(self) -> EtcdStore:
        return self

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        root: str,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        reach_s: float = REACH_S,
        attempt_s: float = ATTEMPT_S,
        ttl_s: int | None = None,
        tls: Tls | None = None,
        first: int | None = None,
    ):
        """``ttl_s``: every key this client writes lives at least ``ttl_s / 2`` and at most ``ttl_s`` seconds
        after its last write (an etcd lease, granted anew each half-life), for keys that no one deletes at the
        end (a rendezvous outlives every agent that could); None: until deleted."""
        super().__init__()  # (pybind's trampoline)
        self.endpoints, self.root, self.reach_s = list(endpoints), root.strip("/"), reach_s
        self.attempt_s, self.ttl_s, self.tls = attempt_s, ttl_s, tls
        self._lease: tuple[str, float] | None = None  # (id, when granted)
        self._data = f"/relaxsync/{self.root}/k/".encode()
        self._marks = f"/relaxsync/{self.root}/m/".encode()
        self._ended = f"/relaxsync-ended/{self.root}".encode()  # (outside the run's keys: :meth:`forget_run`)
        self._boards = f"/relaxsync/{self.root}/b/".encode()
        self._client, self._seq = uuid.uuid4().hex[:12], itertools.count(1)
        self._at = int(self._client, 16) % len(self.endpoints) if first is None else first
        self.set_timeout(timeout)

    @classmethod
    def from_url(
        cls, url: str, root: str, timeout: datetime.timedelta | None = None, tls: Tls | None = None
    ) -> EtcdStore:
        """The store at ``url`` (``etcd://...``, or ``etcds://...`` with the TLS files of ``tls`` or of this
        process's environment, :data:`TLS_ENV`; a name after the members goes before ``root``)."""
        endpoints, name = parse(url)
        if url.startswith(TLS_SCHEME):
            tls = tls or Tls.from_environ()
            if tls is None:
                raise ValueError(f"trainer.store={url!r}: {TLS_SCHEME} needs trainer.store_tls (ca, cert, key)")
        else:
            tls = None
        root = f"{name}/{root}" if name else root
        return cls(endpoints, root, timeout or datetime.timedelta(seconds=300), tls=tls)

    def clone(self) -> EtcdStore:
        """The same store (for another thread: connections are per thread anyway). A clone is kept alive with the
        process: c10d holds a store handed to it (a ``PrefixStore`` of it, a group formed over it) without holding
        its Python half, which a clone only referenced there would lose. A clone holds no connection."""
        twin = EtcdStore(
            self.endpoints, self.root, self.timeout, self.reach_s, self.attempt_s, self.ttl_s, self.tls, self._at
        )
        _KEPT.append(twin)
        return twin

    def hurried(self, attempt_s: float = HURRIED_S) -> EtcdStore:
        """A clone that gives each member ``attempt_s`` to answer before it asks the next one (for calls that must
        not be held long by one slow member, such as a heartbeat's)."""
        twin = self.clone()
        twin.attempt_s = attempt_s
        return twin

    def __repr__(self) -> str:
        return f"EtcdStore({self.url}, root={self.root!r})"

    @property
    def url(self) -> str:
        return (TLS_SCHEME if self.tls else SCHEME) + ",".join(f"{h}:{p}" for h, p in self.endpoints)

    # -- one request -------------------------------------------------------------------------------------------
    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first member that answers it; ``DistNetworkError`` after
        ``reach_s`` without an answer."""
        payload = json.dumps(body).encode()
        deadline, tried, last = time.monotonic() + self.reach_s, 0, "no answer"
        connections: dict[Any, http.client.HTTPConnection] = _THREAD.__dict__.setdefault("c", {})
        while True:
            host, port = self.endpoints[self._at]
            endpoint = (host, port, self.tls)
            try:
                if endpoint not in connections:
                    connections[endpoint] = _connect(host, port, self.tls, self.attempt_s)
                connection = connections[endpoint]
                connection.timeout = self.attempt_s  # (this client's: threads share a connection per member)
                if connection.sock is not None:
                    connection.sock.settimeout(self.attempt_s)
                connection.request("POST", f"/v3/{path}", payload, {"Content-Type": "application/json"})
                response = connection.getresponse()
                data = response.read()
                if response.status == 200:
                    return json.loads(data)
                answer = json.loads(data) if data.startswith(b"{") else {}
                message = answer.get("message") or answer.get("error") or data[:200].decode(errors="replace")
                last = f"{host}:{port} answered {response.status}: {message}"
                if response.status == 400 and b"HTTPS" in data and self.tls is None:
                    raise EtcdRefused(f"etcd store: {host}:{port} requires TLS: {TLS_SCHEME} with trainer.store_tls")
                if response.status == 400:  # (a request etcd cannot parse: ours, not the cluster's)
                    raise ValueError(f"etcd store: {last}")
                if _refusal(response.status, answer):
                    raise EtcdRefused(f"etcd store: {last}{_what_to_do(message)}")
            except ssl.SSLError as error:
                _drop(connections, endpoint)
                if not isinstance(error, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)):
                    # (a certificate refused either way, or TLS against plain HTTP: every member would answer so)
                    raise EtcdRefused(f"etcd store: {host}:{port} refused TLS: {error}{_tls_hint(self.tls)}") from None
                last = f"{host}:{port}: {type(error).__name__}: {error}"
            except (OSError, http.client.HTTPException) as error:
                last = f"{host}:{port}: {type(error).__name__}: {error}"
                _drop(connections, endpoint)
            self._at, tried = (self._at + 1) % len(self.endpoints), tried + 1
            if time.monotonic() >= deadline:
                hint = ""
                if "RemoteDisconnected" in last or "SSLEOFError" in last:  # (as TLS members do a client they refuse)
                    hint = _tls_hint(self.tls)
                raise dist.DistNetworkError(
                    f"etcd store {self.url} unreachable for {self.reach_s:.0f} s (no member answered, "
                    f"or none holds a majority): {last}{hint}"
                )
            if tried % len(self.endpoints) == 0:  # (every member tried once: give an election time to end)
                time.sleep(min(0.05 * tried / len(self.endpoints), 0.5))

    def _key(self, key: str | bytes) -> bytes:
        return self._data + _bytes(key)

    def _put(self, k: bytes, value: bytes) -> dict[str, Any]:
        """A put request (under this client's lease where it has a ``ttl_s``)."""
        put: dict[str, Any] = {"key": _b64(k), "value": _b64(value)}
        if self.ttl_s:
            if self._lease is None or time.monotonic() - self._lease[1] > self.ttl_s / 2:
                granted = self._call("lease/grant", {"TTL": str(self.ttl_s)})
                self._lease = (granted["ID"], time.monotonic())
            put["lease"] = self._lease[0]
        return put

    def _mark(self, key: str | bytes) -> bytes:
        return self._marks + self._client.encode() + b"/" + _bytes(key)

    def _range(self, keys: list[bytes]) -> list[dict[str, Any] | None]:
        """Each key's record (``value``, ``mod_revision``), or None where it is absent."""
        return self._read(keys)[0]

    def _read(self, keys: list[bytes]) -> tuple[list[dict[str, Any] | None], int]:
        """Each key's record, and the store's revision when they were read (the earliest, over several
        transactions): one transaction per ``MAX_TXN_OPS`` keys (a world's beats, one key per rank, are read in one
        call of the Store API)."""
        out: list[dict[str, Any] | None] = []
        revision = None
        for start in range(0, len(keys), MAX_TXN_OPS):
            reads = [{"request_range": {"key": _b64(k)}} for k in keys[start : start + MAX_TXN_OPS]]
            answer = self._call("kv/txn", {"success": reads})
            at = int(answer.get("header", {}).get("revision", 0))
            revision = at if revision is None else min(revision, at)
            for response in answer.get("responses", []):
                kvs = response.get("response_range", {}).get("kvs") or []
                out.append(kvs[0] if kvs else None)
        return out, revision or 0

    def _watch(self, k: bytes, revision: int, seconds: float) -> None:
        """Return once ``k`` is written after ``revision``, or after ``seconds``, or at once when the member asked
        does not answer (the caller reads the keys again, from another member if need be): etcd pushes the write
        on a watch stream of its own, so a thousand ranks waiting for one decision ask nothing while they wait."""
        host, port = self.endpoints[self._at]
        connection = _connect(host, port, self.tls, seconds)
        body = {"create_request": {"key": _b64(k), "start_revision": str(revision)}}
        end = time.monotonic() + seconds
        try:
            connection.request("POST", "/v3/watch", json.dumps(body).encode(), {"Content-Type": "application/json"})
            response = connection.getresponse()
            while response.status == 200 and time.monotonic() < end:
                line = response.readline()  # (one message a line: created, then events)
                result = json.loads(line).get("result", {}) if line.strip() else {"canceled": True}
                if result.get("events") or result.get("canceled"):
                    return
        except TimeoutError:  # (nothing written in time)
            return
        except (OSError, http.client.HTTPException, ValueError):
            time.sleep(0.01)  # (the read that follows moves on to a member that answers)
        finally:
            connection.close()

    def begin_run(self) -> None:
        """A run starts on this root: the end marker of an earlier one with the same root (its rendezvous id and
        restart, within :data:`ENDED_TTL_S`) goes, so that this run's waits wait."""
        self._call("kv/deleterange", {"key": _b64(self._ended)})

    def forget_run(self) -> int:
        """Delete every key of this store's run (its data, markers and boards), at the run's clean end: a run that
        ended leaves nothing in the cluster. Returns how many keys went."""
        prefix = f"/relaxsync/{self.root}/".encode()
        lease = self._call("lease/grant", {"TTL": str(ENDED_TTL_S)})["ID"]
        self._call("kv/put", {"key": _b64(self._ended), "value": _b64(b"1"), "lease": lease})
        answer = self._call("kv/deleterange", {"key": _b64(prefix), "range_end": _b64(_range_end(prefix))})
        return int(answer.get("deleted", 0))

    def count_keys(self, prefix: str = "") -> int:
        """How many keys the cluster holds under ``/relaxsync/<prefix>``."""
        k = f"/relaxsync/{prefix}".encode()
        answer = self._call("kv/range", {"key": _b64(k), "range_end": _b64(_range_end(k)), "count_only": True})
        return int(answer.get("count", 0))

    # -- the Store API -----------------------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._call("kv/put", self._put(self._key(key), _bytes(value)))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """The keys set in order: one transaction per ``MAX_TXN_OPS`` keys or ``MAX_TXN_BYTES`` of them (so a
        reader that waits for the last key finds every other one set)."""
        puts: list[dict[str, Any]] = []
        size = 0
        for k, v in zip(keys, values):
            put = {"request_put": self._put(self._key(k), _bytes(v))}
            grown = size + len(put["request_put"]["key"]) + len(put["request_put"]["value"])
            if puts and (len(puts) == MAX_TXN_OPS or grown > MAX_TXN_BYTES):
                self._call("kv/txn", {"success": puts})
                puts, grown = [], grown - size
            puts.append(put)
            size = grown
        if puts:
            self._call("kv/txn", {"success": puts})

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The keys' values, once all are set (``DistStoreError`` after the store's timeout)."""
        self.wait(keys)
        records = self._range([self._key(k) for k in keys])
        if any(r is None for r in records):  # (deleted between the wait and the read)
            return self.multi_get(keys)
        return [base64.b64decode(r.get("value", "")) for r in records]  # type: ignore[union-attr]

    def check(self, keys: list[str]) -> bool:
        return all(r is not None for r in self._range([self._key(k) for k in keys]))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Return once every key is set; ``DistStoreError`` after ``timeout`` (the store's by default). Between
        reads of the keys it watches the first one missing (:meth:`_watch`), for up to :data:`WATCH_S`."""
        limit = (timeout or self.timeout).total_seconds()
        deadline, pending = time.monotonic() + limit, [self._key(k) for k in keys]
        while True:
            records, revision = self._read([*pending, self._ended])
            if records.pop() is not None:
                raise RunEnded(f"etcd store: waited for {keys} of a run that has ended (its keys are deleted)")
            pending = [k for k, record in zip(pending, records) if record is None]
            if not pending:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"etcd store: wait for {keys} timed out after {limit:.1f} s")
            self._watch(pending[0], revision + 1, min(left, WATCH_S))

    def delete_key(self, key: str) -> bool:
        return int(self._call("kv/deleterange", {"key": _b64(self._key(key))}).get("deleted", 0)) > 0

    def num_keys(self) -> int:
        body = {"key": _b64(self._data), "range_end": _b64(_range_end(self._data)), "count_only": True}
        return int(self._call("kv/range", body).get("count", 0))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """``TCPStore``'s: ``desired`` is written when the key holds ``expected``, or is absent and ``expected`` is
        empty; returns the key's value after (``expected`` itself when the key is absent and was not written)."""
        k, expected, desired = self._key(key), _bytes(expected), _bytes(desired)
        while True:
            (record,) = self._range([k])
            current = None if record is None else base64.b64decode(record.get("value", ""))
            if current is None and expected:
                return expected
            if current is not None and current != expected:
                return current
            if self._swap(k, record, desired):
                return desired

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the key's decimal value (0 when absent); returns the sum. Applied once, even when
        retried on another member. Adding 0 to a key that is there (a counter read) reads it only."""
        if amount == 0:
            (record,) = self._range([self._key(key)])
            if record is not None:
                return int(base64.b64decode(record.get("value", "")) or b"0")
        return int(self._update(self._key(key), lambda old: str(int(old or b"0") + amount).encode()))

    def append(self, key: str, value: str | bytes) -> None:
        """Add ``value`` to the end of the key's value (creating it). Applied once, even when retried."""
        self._update(self._key(key), lambda old: (old or b"") + _bytes(value))

    # -- one versioned key (a rendezvous's state: distributed/rendezvous.py) ---------------------------------------
    def versioned_get(self, key: str) -> tuple[bytes, int] | None:
        """The key's value and the revision that wrote it (its version), or None where it is absent."""
        (record,) = self._range([self._key(key)])
        if record is None:
            return None
        return base64.b64decode(record.get("value", "")), int(record.get("mod_revision", 0))

    def versioned_set(self, key: str, value: bytes, version: int) -> tuple[bytes, int, bool] | None:
        """Write ``value`` where the key is still at ``version`` (0: absent), in one transaction that reads the key
        instead where it is not. Returns (value, version, whether written): the new ones, or the key's as found;
        None where the key is absent and was not written. (Retried on another member after the first applied it,
        the write reads back as found, not written: the caller reads the key again either way.)"""
        k = self._key(key)
        compare = [{"key": _b64(k), "target": "MOD", "result": "EQUAL", "mod_revision": str(version)}]
        body = {"compare": compare, "success": [{"request_put": self._put(k, value)}]}
        answer = self._call("kv/txn", {**body, "failure": [{"request_range": {"key": _b64(k)}}]})
        if answer.get("succeeded"):
            return value, int(answer["header"]["revision"]), True
        kvs = (answer.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        if not kvs:
            return None
        return base64.b64decode(kvs[0].get("value", "")), int(kvs[0].get("mod_revision", 0)), False

    # -- boards (distributed/board.py): one key per entry, no read-and-write that other posts could upset ----------
    def _board(self, name: str) -> dict[str, str]:
        prefix = self._boards + _bytes(name) + b"/"
        return {"key": _b64(prefix), "range_end": _b64(_range_end(prefix))}

    def post(self, name: str, member: str, value: str | bytes) -> int:
        """``member``'s entry on board ``name``; returns the number of entries there as of this write (its place in
        the order: etcd's revisions order every write; the count is read at the write's revision)."""
        key = self._boards + _bytes(name) + b"/" + _bytes(member)
        written = int(self._call("kv/put", self._put(key, _bytes(value)))["header"]["revision"])
        body = {**self._board(name), "count_only": True, "revision": str(written)}  # (as of this write)
        try:
            return int(self._call("kv/range", body).get("count", 0))
        except ValueError:  # (that revision compacted away already, by a cluster set to keep few: the count now)
            return self.count(name)

    def entries(self, name: str) -> list[tuple[str, str]]:
        """Board ``name``'s entries, (member, value), in the order they were first posted."""
        body = {**self._board(name), "sort_order": "ASCEND", "sort_target": "CREATE"}
        skip = len(self._boards + _bytes(name) + b"/")
        return [
            (base64.b64decode(kv["key"])[skip:].decode(), base64.b64decode(kv.get("value", "")).decode())
            for kv in self._call("kv/range", body).get("kvs") or []
        ]

    def count(self, name: str) -> int:
        """How many entries board ``name`` holds."""
        return int(self._call("kv/range", {**self._board(name), "count_only": True}).get("count", 0))

    def has_extended_api(self) -> bool:
        return True

    # -- read, change, write -----------------------------------------------------------------------------------
    def _swap(self, k: bytes, record: dict[str, Any] | None, value: bytes, mark: bytes | None = None) -> bool:
        """Write ``value`` at ``k`` if it is still as ``record`` (its revision) found it; whether it was."""
        revision = "0" if record is None else record.get("mod_revision", "0")
        puts = [{"request_put": self._put(k, value)}]
        if mark is not None:
            puts.append({"request_put": self._put(self._mark(k), mark)})
        compare = [{"key": _b64(k), "target": "MOD", "result": "EQUAL", "mod_revision": revision}]
        return bool(self._call("kv/txn", {"compare": compare, "success": puts}).get("succeeded", False))

    def _update(self, k: bytes, change: Any) -> bytes:
        """Replace the value at ``k`` with ``change(old value or None)``, once; returns the new value."""
        mark_base = f"{next(self._seq)} ".encode()
        while True:
            record, marked = self._range([k, self._mark(k)])
            if marked is not None:  # (a try of this very update applied before its answer was lost)
                seen = base64.b64decode(marked.get("value", ""))
                if seen.startswith(mark_base):
                    return seen[len(mark_base) :]
            new = change(None if record is None else base64.b64decode(record.get("value", "")))
            if self._swap(k, record, new, mark_base + (new if len(new) <= 64 else b"")):  # (a sum: short)
                return new


# Every beat is a revision etcd keeps until its history is compacted (3 ranks: ~15 revisions and ~2 KB a second), and
# past its quota (--quota-backend-bytes, 2 GiB by default) etcd refuses every write. The members of every recipe
# shipped keep the last five minutes of history; what was compacted away is reused, so the database stops growing.
COMPACTION = ["--auto-compaction-mode", "periodic", "--auto-compaction-retention", "5m"]


def make_certificates(directory: str, members: list[str], days: int = 30) -> Tls:
    """A CA of its own in ``directory`` (made 0700), a certificate for each member host (``<host>.crt``, for its
    clients and its peers: the names it is reached by) and one for the clients (``client.crt``), all signed by it
    (openssl, P-256): what a job's etcd members and workers need for ``etcds://`` and nothing else trusts. Returns
    the clients' :class:`Tls`. The keys are 0600; the CA's key never leaves ``directory``."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    at = functools.partial(os.path.join, directory)

    def openssl(*args: str) -> None:
        done = subprocess.run(["openssl", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args[:2])} in {directory}: {done.stderr.strip()[-500:]}")

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl(
        "req", "-x509", *key, "-keyout", at("ca.key"), "-out", at("ca.crt"), "-days", str(days),
        "-subj", f"/CN=relaxsync etcd CA {uuid.uuid4().hex[:8]}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    for name in [*dict.fromkeys(members), "client"]:
        names = {"DNS:localhost", "IP:127.0.0.1"}
        if name != "client":
            try:
                ipaddress.ip_address(name)
                names.add(f"IP:{name}")
            except ValueError:
                names.add(f"DNS:{name}")
        with open(at(f"{name}.ext"), "w") as f:
            f.write(
                f"subjectAltName={','.join(sorted(names))}\nextendedKeyUsage=serverAuth,clientAuth\n"
                "keyUsage=critical,digitalSignature,keyEncipherment\n"
            )
        openssl("req", *key, "-keyout", at(f"{name}.key"), "-out", at(f"{name}.csr"), "-subj", f"/CN={name}")
        openssl(
            "x509", "-req", "-in", at(f"{name}.csr"), "-CA", at("ca.crt"), "-CAkey", at("ca.key"),
            "-CAcreateserial", "-out", at(f"{name}.crt"), "-days", str(days), "-extfile", at(f"{name}.ext"),
        )  # fmt: skip
    for name in os.listdir(directory):
        os.chmod(at(name), 0o600 if name.endswith(".key") else 0o644)
    return Tls(at("ca.crt"), at("client.crt"), at("client.key"))


def tls_options(directory: str, host: str) -> list[str]:
    """etcd's flags for the member on ``host`` with the certificates of :func:`make_certificates`: TLS to its
    clients and its peers, each of which must show a certificate of the CA."""
    crt, key, ca = (os.path.join(directory, name) for name in (f"{host}.crt", f"{host}.key", "ca.crt"))
    return [
        "--cert-file", crt, "--key-file", key, "--client-cert-auth", "--trusted-ca-file", ca,
        "--peer-cert-file", crt, "--peer-key-file", key, "--peer-client-cert-auth", "--peer-trusted-ca-file", ca,
    ]  # fmt: skip


class LocalCluster:
    """An etcd cluster of ``members`` processes on this machine, one per emulated node (node ``i`` hosts member
    ``i``): the shape of a real deployment, where killing a node kills its member too. Used by the tests, the chaos
    matrix and the benches; on a real cluster each member is started on its own node (examples/slurm/)."""

    def __init__(
        self,
        directory: str,
        members: int = 3,
        heartbeat_ms: int = 20,
        election_ms: int = 200,
        hosts: list[str] | None = None,
        spawn: Any = None,
        in_memory: bool = True,
        options: list[str] | None = None,
        tls: bool = False,
    ):
        """``hosts``: member ``i``'s address (default: all on 127.0.0.1, on free ports; on hosts of their own, etcd's
        ports 2379 and 2380); ``spawn(i, command, **popen_kwargs)`` starts member ``i`` (default: here; e.g. inside
        an emulated node, ``bench.netns.EmulatedNetwork.popen``); ``options``: more of etcd's flags, for every
        member; ``tls``: the members speak TLS to clients and peers and require a certificate of the cluster's own
        CA (:func:`make_certificates`, in ``<directory>/tls``; :attr:`client` is what a client needs)."""
        os.makedirs(directory, exist_ok=True)
        self.directory, self.members, self.options = directory, members, list(options or [])
        self.heartbeat_ms, self.election_ms, self.in_memory = heartbeat_ms, election_ms, in_memory
        self.hosts, self.local = hosts or ["127.0.0.1"] * members, not hosts
        self.spawn = spawn or (lambda i, command, **kwargs: subprocess.Popen(command, start_new_session=True, **kwargs))
        if hosts:
            self.client_ports, self.peer_ports = [DEFAULT_PORT] * members, [DEFAULT_PORT + 1] * members
        else:
            holders = [socket.socket() for _ in range(2 * members)]
            for s in holders:
                s.bind(("127.0.0.1", 0))
            ports = [s.getsockname()[1] for s in holders]
            for s in holders:
                s.close()
            self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self.processes: list[Any] = [None] * members
        self.tls_dir = os.path.join(directory, "tls") if tls else None
        self.client = make_certificates(self.tls_dir, self.hosts) if self.tls_dir else None

    @property
    def url(self) -> str:
        return (TLS_SCHEME if self.client else SCHEME) + ",".join(self.endpoint(i) for i in range(self.members))

    def rendezvous(self, node: int) -> list[str]:
        """torchrun's arguments after ``--rdzv-backend`` for an agent on node ``node``: the v3 rendezvous
        (distributed/rendezvous.py) on every member, the node's own first (the last one for nodes past the
        members), with the cluster's TLS."""
        own = min(node, self.members - 1)
        order = [own, *(i for i in range(self.members) if i != own)]
        args = ["etcd-v3", "--rdzv-endpoint", ",".join(self.endpoint(i) for i in order)]
        if self.client:
            tls = self.client
            args += ["--rdzv-conf", f"ca_cert={tls.ca},ssl_cert={tls.cert},ssl_cert_key={tls.key}"]
        return args

    def overrides(self) -> list[str]:
        """train.py's overrides for a run whose store is this cluster (the URL quoted: Hydra reads commas as a
        list)."""
        tls = self.client
        secure = [
            f"trainer.store_tls.ca={tls.ca}",
            f"trainer.store_tls.cert={tls.cert}",
            f"trainer.store_tls.key={tls.key}",
        ]
        return [f"trainer.store='{self.url}'", *(secure if tls else [])]

    def store(self, root: str, members: list[int] | None = None, **kwargs: Any) -> EtcdStore:
        """A client of the cluster (of members ``members``: default all), with the cluster's TLS where it has it."""
        at = range(self.members) if members is None else members
        return EtcdStore([(self.hosts[i], self.client_ports[i]) for i in at], root, tls=self.client, **kwargs)

    def endpoint(self, i: int) -> str:
        return f"{self.hosts[i]}:{self.client_ports[i]}"

    def _peer(self, i: int) -> str:
        return f"{self._http}://{self.hosts[i]}:{self.peer_ports[i]}"

    @property
    def _http(self) -> str:
        return "https" if self.client else "http"

    def data_dir(self, i: int) -> str:
        """Member ``i``'s data: in memory (/dev/shm) where it is there, as a node's local SSD stands for here: a
        write's fsync then costs nothing, where this machine's disk made every store write 2 ms slower."""
        if self.in_memory and os.path.isdir("/dev/shm"):
            return os.path.join("/dev/shm", f"relaxsync-etcd-{os.getpid()}-{id(self)}", f"m{i}")
        return os.path.join(self.directory, f"m{i}")

    def command(self, i: int) -> list[str]:
        cluster = ",".join(f"m{j}={self._peer(j)}" for j in range(self.members))
        return [
            "etcd", "--name", f"m{i}", "--data-dir", self.data_dir(i),
            "--listen-client-urls", f"{self._http}://{self.endpoint(i)}",
            "--advertise-client-urls", f"{self._http}://{self.endpoint(i)}",
            "--listen-peer-urls", self._peer(i), "--initial-advertise-peer-urls", self._peer(i),
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", os.path.basename(self.directory.rstrip("/")) or "relaxsync",
            "--heartbeat-interval", str(self.heartbeat_ms), "--election-timeout", str(self.election_ms),
            *COMPACTION, "--logger", "zap", "--log-level", "error",
            *(tls_options(self.tls_dir, self.hosts[i]) if self.tls_dir else []), *self.options,
        ]  # fmt: skip

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        """Start every member; return once the cluster takes a write."""
        for i in range(self.members):
            log = open(os.path.join(self.directory, f"m{i}.log"), "ab")
            self.processes[i] = self.spawn(i, self.command(i), stdout=log, stderr=subprocess.STDOUT)
        if self.local:
            self.store("up", reach_s=timeout_s).set("up", "1")
            return self
        # (members inside nodes of their own, which this process may not reach: a write from the first node)
        if self.client:
            self.client.to_environ()
        write = [sys.executable, "-m", "distributed.etcd", "up", self.url, "--within", str(timeout_s)]
        if self.spawn(0, write, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).wait() != 0:
            raise RuntimeError(f"etcd cluster {self.url} took no write in {timeout_s:.0f} s ({self.directory})")
        return self

    def _status(self, i: int) -> dict[str, Any]:
        return self.store("status", [i], reach_s=ATTEMPT_S)._call("maintenance/status", {})

    def leader(self) -> int:
        """The member that leads the cluster now."""
        live = [i for i, p in enumerate(self.processes) if p is not None and p.poll() is None]
        statuses = {i: self._status(i) for i in live}
        ids = {status["header"]["member_id"]: i for i, status in statuses.items()}
        leaders = {status.get("leader") for status in statuses.values()}
        if len(leaders) != 1 or next(iter(leaders)) not in ids:
            raise RuntimeError(f"etcd: no one leader among the live members ({leaders})")
        return ids[next(iter(leaders))]

    def lead(self, i: int, timeout_s: float = 10.0) -> None:
        """Make member ``i`` the leader (etcd's leadership transfer), so that killing its node loses the leader."""
        deadline = time.monotonic() + timeout_s
        while (current := self.leader()) != i:
            target = self._status(i)["header"]["member_id"]
            self.store("status", [current])._call("maintenance/transfer-leadership", {"targetID": target})
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd member {i} did not become the leader in {timeout_s} s")

    def kill(self, i: int) -> None:
        """``kill -9`` member ``i`` (its node is lost)."""
        process = self.processes[i]
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def restart(self, i: int) -> None:
        """Start member ``i`` again on its data (its node came back): it rejoins the cluster and catches up."""
        self.kill(i)
        log = open(os.path.join(self.directory, f"m{i}.log"), "ab")
        self.processes[i] = self.spawn(i, self.command(i), stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        for i in range(self.members):
            self.kill(i)
        if self.in_memory:
            shutil.rmtree(os.path.dirname(self.data_dir(0)), ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


STORE_ENV = "RELAXSYNC_STORE"  # trainer.store, for every part of a worker that opens the run's store


def store_root(env: Any = None) -> str:
    """Where a run's keys live in etcd: its torchrun rendezvous id (or Slurm job) and restart, so that a run never
    reads another's keys or its own earlier attempt's (the group's addresses of processes now gone)."""
    env = os.environ if env is None else env
    run = env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or "run"
    restart = env.get("TORCHELASTIC_RESTART_COUNT") or env.get("SLURM_RESTART_COUNT") or "0"
    return f"{run}/restart{restart}"


def configured_store(timeout: datetime.timedelta | None = None) -> EtcdStore | None:
    """The run's etcd store where ``trainer.store`` names one (``RELAXSYNC_STORE``), a client of this caller's own;
    None where the run's store is torch's (``MASTER_ADDR``)."""
    url = os.environ.get(STORE_ENV)
    if not url:
        return None
    store = EtcdStore.from_url(url, store_root(), timeout)
    _KEPT.append(store)  # (c10d may hold it without its Python half, as a clone: EtcdStore.clone)
    return store


def _main(argv: list[str] | None = None) -> int:
    """``python -m distributed.etcd``: what a job script needs of its etcd cluster, without etcdctl."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m distributed.etcd", description=_main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="wait until the cluster at URL takes a write (TLS: RELAXSYNC_STORE_TLS)")
    up.add_argument("url", help="etcd://host:port,... or etcds://host:port,...")
    up.add_argument("--within", type=float, default=60.0, help="seconds to wait at most (default 60)")
    certificates = commands.add_parser("certificates", help="a CA, a certificate per member host, one for clients")
    certificates.add_argument("directory", help="made 0700; ca.crt, <host>.crt/.key, client.crt/.key")
    certificates.add_argument("hosts", nargs="+", help="the members' host names (or addresses)")
    flags = commands.add_parser("flags", help="etcd's TLS flags for the member on HOST, one a line")
    flags.add_argument("directory")
    flags.add_argument("host")
    args = parser.parse_args(argv)
    if args.command == "certificates":
        make_certificates(args.directory, args.hosts)
    elif args.command == "flags":
        print("\n".join(tls_options(args.directory, args.host)))
    else:
        deadline = time.monotonic() + args.within
        while True:
            try:
                EtcdStore.from_url(args.url, "up", datetime.timedelta(seconds=5)).set("up", "1")
                return 0
            except EtcdRefused as error:
                print(f"etcd: {error}", file=sys.stderr)
                return 1
            except dist.DistError as error:
                if time.monotonic() > deadline:
                    print(f"etcd: {args.url} took no write in {args.within:.0f} s: {error}", file=sys.stderr)
                    return 1
                time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
