"""The membership service at scale, simulated: N ranks' :class:`Heartbeat` and :class:`Failures`
(engine/elastic/failures.py, the code a worker runs) against one real c10d ``TCPStore``, at the sizes of a
cluster of a thousand nodes, on one machine.

    python -m bench.membership [--sizes 64,256,1024] [--code tree,REV] [--processes 4] [--kill 1] [--limit 150]

Each size runs in processes of its own: one holds the store's server (as torchrun's agent holds it, away from the
workers), and ``--processes`` others share the N simulated ranks, as threads: per rank a ``Membership`` with a store
connection of its own, its ``Failures`` and the heartbeat thread that ``Heartbeat.start`` starts on a second
connection (``Membership.every`` clones it), at the real period ``BEAT_S``, and a thread that stands for the rank's
training loop. Threads, not a process per rank: a thousand Python processes with torch (~100 MB each) do not fit
this machine, two thousand threads that wait on sockets most of the time do; a few processes, because one
interpreter runs one thread at a time and a thousand ranks' client-side work needs more than one core here. What a
real rank has and a simulated one has not is a core of its own: the ranks' own work shares this machine's cores, so
the beats per rank and second (5 at the period) and the cores busy are reported with every number.

Only the group is replaced: ``distributed.membership.form_group`` (``new_group`` and a first collective) returns a
placeholder, and the one collective run on it in a large world (``failures.gather_positions``: the survivors'
positions, gathered in their new group) hands each survivor the positions the simulation gave the ranks; everything
else in ``Membership.propose/adopt`` and ``Failures.recover`` is the real code.
What forming a real gloo group costs is measured apart, at the sizes this machine can start (``--form-group``), and
so is what the store's server serves at most here (``--server-capacity``).

Measured per size, after ``--warmup`` s (long enough for every heartbeat to have read every peer once): (a) the
steady state over ``--window`` s: every call the ranks make on their store connections, counted client side by a
thin wrapper (one call is one request to the server: ``multi_get`` of k keys is one call naming k keys), as calls/s
and keys/s, per rank and heartbeat tick, and the server process's CPU; (b) a failure: ``--kill`` ranks stop beating
and close their watched connections without a farewell (as a killed process's kernel closes them:
``distributed/presence.py``) and, at the same moment, every other rank's collective fails with gloo's "Connection
closed by peer" (as a dead peer's closed sockets make it fail); each survivor runs ``Failures.recover`` at once.
Reported: seconds from the failure until each survivor holds the agreed decision (``Membership.adopt`` called:
median, max) and until the last survivor's ``recover`` returned (the change adopted and the positions exchanged),
each survivor's own CPU in it, and whether every survivor agreed on exactly the killed ranks. A size that has not
finished ``--limit`` s after the failure is reported as not finished, with what it reached.

``--code`` names the engine/elastic/failures.py to run: ``tree`` (the working tree's) and git revisions, whose file is
loaded in place of the tree's (everything else as in the working tree); with several, each size runs with each, side by
side, alternating which goes first. Results: bench/results/membership.json, membership.md and membership.png
(``--merge`` keeps the rows there of other sizes and code); read in docs/benchmarks/membership.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.util
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, machine
from distributed import runstore
from distributed.runstore import RunStore

POSITION_STEP = 10  # the step every survivor was in when its collective failed (one of them is a collective behind)
FORM_GROUP_REPEATS = 5
STAGES = ("connected", "steady", "result")
# Seconds a simulating process lets one thread run before another may take the interpreter (Python's default: 0.005).
# With a thousand threads in a process the default has the waiting ones wake 200 times a second each for nothing; a
# worker has a handful of threads, so this changes the simulation's cost, not what the ranks do.
SWITCH_S = 0.05


# ---- the store and the counting of what is asked of it -------------------------------------------------------------
class Tally:
    """What one store connection was asked: calls (one request each) and the keys they named, by method."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.keys = 0

    def count(self, method: str, args: tuple) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        first = args[0] if args else None
        self.keys += len(first) if isinstance(first, list) else 1

    def snapshot(self) -> tuple[dict[str, int], int]:
        return dict(self.calls), self.keys


class CountingStore(RunStore):
    """A c10d store client that counts every call made through it (client side; each is one request to the server).
    ``clone()`` (a heartbeat thread's own connection) counts on a tally of its own, kept in ``clones``. It is the
    run's store protocol of the store it counts (:class:`distributed.runstore.RunStore`): on etcd each board call is
    one counted call; on torch's store a board's appends and adds are counted one by one, as they are made."""

    def __init__(self, store: Any, tally: Tally | None = None):
        self._store, self.tally, self.clones = store, tally or Tally(), []

    def clone(self) -> CountingStore:
        clone = CountingStore(self._store.clone())
        self.clones.append(clone.tally)
        return clone

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if not callable(method):
            return method
        tally = self.tally

        def counted(*args: Any, **kwargs: Any) -> Any:
            tally.count(name, args)
            return method(*args, **kwargs)

        return counted

    # -- the run's store protocol, counted ------------------------------------------------------------------------
    @property
    def replicated(self) -> bool:  # type: ignore[override]
        return runstore.of(self._store).replicated

    @property
    def root(self) -> str:  # type: ignore[override]
        return runstore.of(self._store).root

    @property
    def store(self) -> Any:
        return self

    def post(self, name: str, member: str, value: str) -> int:
        if isinstance(self._store, RunStore):
            return self.__getattr__("post")(name, member, value)
        return runstore.TorchStore(self).post(name, member, value)

    def entries(self, name: str) -> list[tuple[str, str]]:
        if isinstance(self._store, RunStore):
            return self.__getattr__("entries")(name)
        return runstore.TorchStore(self).entries(name)

    def count(self, name: str) -> int:
        if isinstance(self._store, RunStore):
            return self.__getattr__("count")(name)
        return runstore.TorchStore(self).count(name)

    def hurried(self) -> Any:
        """(a heartbeat's clone, its calls hurried: EtcdStore.hurried; counted on this tally)"""
        return CountingStore(runstore.of(self._store).hurried(), self.tally)

    def forget_run(self) -> int:
        return runstore.of(self._store).forget_run()


def client(address: int | str) -> Any:
    """A client of the store at ``address``: a ``TCPStore``'s port here, or an etcd cluster's URL
    (``--store etcd``: ``distributed/etcd.py``'s ``EtcdStore``, as a worker under ``trainer.store`` opens it)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=600)
    if isinstance(address, str):
        from distributed.etcd import EtcdStore

        return EtcdStore.from_url(address, "bench", timeout)
    return dist.TCPStore("127.0.0.1", address, None, False, timeout=timeout, wait_for_workers=False)


def raise_file_limit() -> None:
    """Two connections per simulated rank, on both ends: up to the hard limit of open files."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve() -> None:
    """The store's server, in a process of its own: prints its port, serves until stdin closes."""
    import torch.distributed as dist

    raise_file_limit()
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=600), wait_for_workers=False)
    print(store.port, flush=True)
    sys.stdin.read()


def cpu_s(pid: int | list[int]) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads); of several, summed."""
    if isinstance(pid, list):
        return sum(cpu_s(p) for p in pid)
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def failures_at(rev: str) -> tuple[str, str]:
    """engine/elastic/failures.py (engine/failures.py before the package) as it was at git revision ``rev``, in a
    temporary file: its path, and the commit."""
    shown = [
        subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
        for path in ("engine/elastic/failures.py", "engine/failures.py")
    ]
    source = next(s.stdout for s in shown if s.returncode == 0)
    path = Path(tempfile.mkdtemp(prefix="relaxsync-failures-")) / "failures.py"
    path.write_text(source)
    return str(path), git("rev-parse", rev)


def load_failures(path: str) -> None:
    """Import the engine/elastic/failures.py at ``path`` in place of the working tree's (before anything imports
    that)."""
    spec = importlib.util.spec_from_file_location("engine.elastic.failures", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine.elastic.failures"] = module
    spec.loader.exec_module(module)
    import engine.elastic

    engine.elastic.failures = module


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def code_version() -> str:
    """The working tree's engine/failures.py: the commit, and whether the file differs from it."""
    dirty = git("status", "--porcelain", "engine/elastic/failures.py")
    return git("rev-parse", "HEAD") + (" + uncommitted changes" if dirty else "")


NICE = 10  # the simulating processes' niceness (the store's server keeps 0)


# ---- the simulation ------------------------------------------------------------------------------------------------
class PlaceholderGroup:
    """What ``form_group`` returns in the simulation: the group's ranks, and nothing to run a collective on."""

    def __init__(self, ranks: list[int]):
        self.ranks = list(ranks)


class Shard:
    """Some of the simulated ranks, in one process: per rank a ``Membership`` on a store connection of its own
    (counted), its ``Failures`` and their heartbeat thread, and a thread that stands for the rank's training loop: it
    waits in its "collective" until :meth:`fail` makes it fail as a dead peer's closed connection does, then runs
    ``Failures.recover`` at ``Position(10, STEP)`` (``behind`` at ``Position(9, EXCHANGE)``, a collective short).
    ``distributed.membership.form_group`` is a placeholder until :meth:`close`."""

    def __init__(
        self, ranks: list[int], n: int, port: int, prefix: str, killed: list[int], behind: int, hang_timeout_s: float
    ):
        import distributed.membership as membership_module
        from distributed.membership import LeftRun, Membership

        failures_module = importlib.import_module("engine.elastic.failures")
        from engine.elastic import positions  # (a revision before the package defines them in failures.py)

        Failures = failures_module.Failures
        Phase = getattr(failures_module, "Phase", positions.Phase)
        Position = getattr(failures_module, "Position", positions.Position)
        self._module, self._form_group, self._stack = membership_module, membership_module.form_group, None
        self.formed = 0

        def position(rank: int) -> Any:
            behind_it = rank == behind  # (a collective short of the others)
            return Position(POSITION_STEP - 1, Phase.EXCHANGE) if behind_it else Position(POSITION_STEP, Phase.STEP)

        front_wire, behind_wire = position(-1).wire(), position(behind).wire()

        def placeholder_group(ranks: list[int], timeout: Any = None, wait: Any = None) -> object:
            self.formed += 1
            return PlaceholderGroup(ranks)

        def gathered_positions(group: Any, at: Any, wait: Any) -> dict[int, list]:
            # (the collective over the placeholder: each member's position, as every simulated rank holds it)
            # (two wire forms made once: what a real gather's tensors become, at the cost of a dict of them)
            return {r: (behind_wire if r == behind else front_wire) for r in group.ranks}

        membership_module.form_group = placeholder_group
        self._gather = getattr(failures_module, "gather_positions", None)  # (a revision before it: none)
        if self._gather is not None:
            failures_module.gather_positions = gathered_positions
        self._failures_module = failures_module
        self._stack = threading.stack_size(512 * 1024)  # (two threads per rank: the default 8 MiB stacks add up)

        class SimulatedMembership(Membership):
            """A rank's membership on a connection of its own, keeping when it was handed the agreed change."""

            def __init__(self, rank: int, store: CountingStore):
                super().__init__(rank, n, group=None)
                self._store = store
                self.group = None
                self.decided_at: float | None = None

            def key(self, name: str) -> str:
                return f"{prefix}/{name}"  # (every rank's, as across processes: here one process makes several)

            def adopt(self, agreed: dict[str, Any], reasons: Any = None, abort_replaced: bool = False) -> Any:
                self.decided_at = time.monotonic()
                return super().adopt(agreed, reasons, abort_replaced)

        first = client(port)  # (a new client takes ~0.2 s to connect here, a clone of one under 1 ms)
        with ThreadPoolExecutor(32) as pool:  # (connections in parallel: see run_size on name lookups)
            stores = dict(zip(ranks, pool.map(lambda _: CountingStore(first.clone()), ranks)))
        self.memberships = {r: SimulatedMembership(r, stores[r]) for r in ranks}
        self.failures = {r: Failures(m, hang_timeout_s=hang_timeout_s) for r, m in self.memberships.items()}
        with ThreadPoolExecutor(32) as pool:  # (each start connects: Membership.every clones the store)
            list(pool.map(lambda f: f.heartbeat.start(), self.failures.values()))
        self.tallies = [s.tally for s in stores.values()] + [t for s in stores.values() for t in s.clones]
        self.beats = [t for s in stores.values() for t in s.clones]
        self.own = [s.tally for s in stores.values()]
        self._own = {r: s.tally for r, s in stores.items()}
        self._asked_before: dict[int, int] = {}

        self.collective = threading.Event()
        self.outcomes: dict[int, dict[str, Any]] = {}

        def rank_main(rank: int) -> None:
            self.collective.wait()
            out = self.outcomes[rank] = {"entered": time.monotonic()}
            at = position(rank)
            cpu = time.thread_time()
            try:
                rec = self.failures[rank].recover(RuntimeError("Connection closed by peer [127.0.0.1]:29500"), at)
                out.update(recovered=time.monotonic(), cpu_s=time.thread_time() - cpu)
                # (the survivors' list by its digest: copying a thousand ranks' list per rank would cost the
                # simulation more than the agreement does)
                change = {**vars(rec.change), "ranks": zlib.crc32(json.dumps(rec.change.ranks).encode())}
                agreed = {"change": change, "event": rec.event, "behind": rec.behind}
                out["agreed"] = json.dumps(agreed, sort_keys=True)
            except LeftRun as left:
                out["error"] = f"left: {left}"
            except BaseException as error:  # noqa: BLE001 - reported, not raised: the other ranks go on
                out["error"] = f"{type(error).__name__}: {error}"

        survivors = [r for r in ranks if r not in killed] if killed else []  # (no failure, no training loops)
        self.threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in survivors]
        for t in self.threads:
            t.start()

    def totals(self) -> dict[str, Any]:
        """What this shard's connections were asked so far, and its process's CPU seconds."""
        calls: dict[str, int] = {}
        keys = 0
        for t in self.tallies:
            by_method, k = t.snapshot()
            keys += k
            for method, v in by_method.items():
                calls[method] = calls.get(method, 0) + v
        beats, own = [t.snapshot() for t in self.beats], [t.snapshot() for t in self.own]
        return {
            "calls": calls,
            "keys": keys,
            "agreement_calls": sum(sum(c.values()) for c, _ in own),  # (a rank's own connection: the agreement's)
            "agreement_keys": sum(k for _, k in own),
            "beat_calls": sum(sum(c.values()) for c, _ in beats),
            "beat_keys": sum(k for _, k in beats),
            "ticks": sum(c.get("set", 0) + c.get("add", 0) for c, _ in beats),  # a write of its own counter a tick
            "cpu_s": time.process_time(),
            "cpu_by_thread": cpu_by_thread(),
        }

    def kill(self, killed: list[int]) -> None:
        """The ``killed`` ranks stop beating and their connections close without a farewell, as a process's do when
        it is killed (its watchers report it: ``distributed/presence.py``)."""
        for r in killed:
            if r in self.failures:
                self.failures[r].heartbeat.stop(farewell=False)

    def _asked(self) -> dict[int, int]:
        return {r: sum(t.snapshot()[0].values()) for r, t in self._own.items()}

    def fail(self) -> None:
        self._asked_before = self._asked()
        self.collective.set()

    def outcome(self, deadline: float) -> dict[str, Any]:
        """Once every survivor here is done, or at ``deadline``: each one's times and what it agreed."""
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        ranks = {}
        for r, out in list(self.outcomes.items()):
            ranks[r] = {**out, "decided": self.memberships[r].decided_at}
        after = self._asked()  # (the survivors whose own connection asked the store anything in the agreement)
        asked = sorted(r for r in ranks if after[r] > self._asked_before.get(r, 0))
        return {"ranks": ranks, "formed": self.formed, "asked": asked}

    def close(self) -> None:
        """Stop the heartbeats (when no survivor is still in the store) and put ``form_group`` back."""
        if all(not t.is_alive() for t in self.threads):
            with ThreadPoolExecutor(32) as pool:
                list(pool.map(lambda f: f.heartbeat.stop(), self.failures.values()))
        self._module.form_group = self._form_group
        if self._gather is not None:
            self._failures_module.gather_positions = self._gather
        threading.stack_size(self._stack or 0)


def cpu_by_thread() -> dict[str, float]:
    """CPU seconds so far of this process's threads still running, summed by what they do (a thread's name, its
    numbers left out), from /proc: where the simulation's cores go. (A rank's training loop has ended by the time
    the failure's totals are taken: its own CPU is ``survivor_cpu_s``.)"""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick, cpu = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            name = names.get(int(tid), "other")
            kind = re.sub(r"[-_ ]?\d+", "", name) or "other"
            cpu[kind] = cpu.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return cpu


def _shard_main(conn: Any, failures_path: str | None, switch_s: float, *args: Any) -> None:
    """A shard's process: builds it, says so, then answers ``(method, args)`` requests until ``close``. It runs at a
    lower priority than the store's server(s): on a cluster the store runs on cores of its own, and the ranks'
    simulation, which can keep every core here busy, should not slow it as no real rank would."""
    raise_file_limit()
    os.nice(NICE)
    if failures_path:
        load_failures(failures_path)
    sys.setswitchinterval(switch_s)
    shard = Shard(*args)
    conn.send("ready")
    while True:
        name, call_args = conn.recv()
        conn.send(getattr(shard, name)(*call_args))
        if name == "close":
            os._exit(0)  # (survivors that never finished are threads blocked in the store: nothing to wait for)


class Remote:
    """A shard in a process of its own: :meth:`ask` sends a request, :meth:`answer` waits for its answer, so that
    several shards work on one request at once."""

    def __init__(self, failures_path: str | None, switch_s: float, *args: Any):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_shard_main, args=(theirs, failures_path, switch_s, *args), daemon=True)
        self.process.start()

    def ready(self) -> None:
        assert self.conn.recv() == "ready"

    def ask(self, name: str, *args: Any) -> None:
        self.conn.send((name, args))

    def answer(self) -> Any:
        return self.conn.recv()


class Local:
    """A shard in this process, asked as a :class:`Remote` one is."""

    def __init__(self, *args: Any):
        self.shard, self._answer = Shard(*args), None

    def ready(self) -> None:
        pass

    def ask(self, name: str, *args: Any) -> None:
        self._answer = getattr(self.shard, name)(*args)

    def answer(self) -> Any:
        return self._answer


def simulate(
    n: int,
    port: int,
    killed: list[int],
    warmup_s: float = 15.0,
    window_s: float = 5.0,
    limit_s: float = 150.0,
    hang_timeout_s: float = 60.0,
    processes: int = 1,
    server_pid: int | None = None,
    failures_path: str | None = None,
    report: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """``n`` simulated ranks on the store at ``port``, in ``processes`` processes (1: in this one, as it is): the
    steady state over ``window_s`` after ``warmup_s``, then, unless ``killed`` is empty, the failure of the ``killed``
    ranks. ``report(stage, what)`` hears of each stage as it ends ("connected", "steady")."""
    report = report or (lambda stage, what: None)
    survivors = [r for r in range(n) if r not in killed]
    common = (n, port, f"relaxsync/bench/{time.time_ns()}/membership", killed, survivors[-1], hang_timeout_s)
    started = time.monotonic()
    if processes == 1:
        if failures_path:
            load_failures(failures_path)
        shards: list[Any] = [Local(list(range(n)), *common)]
    else:
        shards = [Remote(failures_path, SWITCH_S, list(range(i, n, processes)), *common) for i in range(processes)]
    for shard in shards:
        shard.ready()

    def ask(name: str, *args: Any) -> list[Any]:
        for shard in shards:
            shard.ask(name, *args)
        return [shard.answer() for shard in shards]

    def totals() -> dict[str, Any]:
        parts, server = ask("totals"), cpu_s(server_pid) if server_pid else float("nan")
        calls: dict[str, int] = {}
        for part in parts:
            for method, v in part["calls"].items():
                calls[method] = calls.get(method, 0) + v
        summed = ("keys", "agreement_calls", "agreement_keys", "beat_calls", "beat_keys", "ticks", "cpu_s")
        total = {k: sum(p[k] for p in parts) for k in summed}
        by_thread: dict[str, float] = {}
        for part in parts:
            for kind, v in part.get("cpu_by_thread", {}).items():
                by_thread[kind] = by_thread.get(kind, 0.0) + v
        return {**total, "calls": calls, "time": time.monotonic(), "server_cpu_s": server, "by_thread": by_thread}

    report("connected", {"setup_s": time.monotonic() - started})
    time.sleep(warmup_s)
    first = totals()
    time.sleep(window_s)
    last = totals()
    result = {"n": n, "processes": processes, "setup_s": first["time"] - started - warmup_s}
    result["steady"] = steady(first, last, n)
    report("steady", result)
    if not killed:
        ask("close")
        return {**result, "failure": None}

    ask("kill", killed)
    failed_at = time.monotonic()
    ask("fail")
    outcomes = ask("outcome", failed_at + limit_s)
    end = totals()
    ranks = {r: out for part in outcomes for r, out in part["ranks"].items()}
    ask("close")
    done = {r: out["recovered"] - failed_at for r, out in ranks.items() if "recovered" in out}
    agreed = [json.loads(out["agreed"]) for out in ranks.values() if "agreed" in out]
    failure = {
        "killed": killed,
        "survivors": len(survivors),
        "finished": len(done),
        "all_finished": len(done) == len(survivors),
        "errors": sorted({out["error"] for out in ranks.values() if "error" in out})[:5],
        "agreed_alike": len({out["agreed"] for out in ranks.values() if "agreed" in out}) == 1
        and len(done) == len(survivors),
        "removed": sorted({r for a in agreed for r in a["change"]["removed"]}),
        "removed_exactly_killed": bool(agreed) and all(a["change"]["removed"] == killed for a in agreed),
        "behind_agreed": bool(agreed) and all(a["behind"] == [survivors[-1]] for a in agreed),
        "groups_formed": sum(part["formed"] for part in outcomes),
        # the survivors that asked the store anything in the agreement (the rest heard the decision from a neighbour)
        "survivors_asking": sum(len(part.get("asked", [])) for part in outcomes),
        "asked": sorted(r for part in outcomes for r in part.get("asked", []))[:128],
        "entered_s": summary(out["entered"] - failed_at for out in ranks.values()),  # the simulation's own lag
        "decided_s": summary(out["decided"] - failed_at for out in ranks.values() if out["decided"] is not None),
        "recovered_s": summary(done.values()),
        "survivor_cpu_s": summary(out["cpu_s"] for out in ranks.values() if "cpu_s" in out),  # its own, in recover
        # what the agreement itself asked (the ranks' own connections; the heartbeats have theirs), and all calls
        "agreement_calls": end["agreement_calls"] - last["agreement_calls"],
        "agreement_keys": end["agreement_keys"] - last["agreement_keys"],
        "recovery_calls": sum(end["calls"].values()) - sum(last["calls"].values()),
        "recovery_keys": end["keys"] - last["keys"],
        "recovery_wall_s": end["time"] - failed_at,
        "recovery_beats_per_rank_s": (end["ticks"] - last["ticks"]) / n / (end["time"] - last["time"]),
        # cores busy from the end of the window to the last survivor's recovery: simulating it, serving it
        "recovery_simulation_cpu": (end["cpu_s"] - last["cpu_s"]) / (end["time"] - last["time"]),
        "recovery_server_cpu": (end["server_cpu_s"] - last["server_cpu_s"]) / (end["time"] - last["time"]),
        # ... and the simulation's CPU seconds in it by kind of thread (a rank's training loop, its presence...)
        "recovery_cpu_s_by_thread": {
            kind: round(v - last["by_thread"].get(kind, 0.0), 2) for kind, v in sorted(end["by_thread"].items())
        },
    }
    failure["recovery_calls_per_survivor"] = failure["agreement_calls"] / max(len(survivors), 1)
    return {**result, "failure": failure}


def steady(first: dict[str, Any], last: dict[str, Any], n: int) -> dict[str, Any]:
    """The steady state between two :func:`simulate` totals."""
    elapsed = last["time"] - first["time"]
    calls = {m: last["calls"].get(m, 0) - first["calls"].get(m, 0) for m in last["calls"]}
    ticks = last["ticks"] - first["ticks"]
    return {
        "window_s": elapsed,
        "calls_per_s": sum(calls.values()) / elapsed,
        "keys_per_s": (last["keys"] - first["keys"]) / elapsed,
        "calls_per_s_by_method": {m: v / elapsed for m, v in sorted(calls.items())},
        "beats_per_rank_s": ticks / n / elapsed,  # the period asks for 1 / BEAT_S
        "calls_per_tick": (last["beat_calls"] - first["beat_calls"]) / max(ticks, 1),  # per rank, its heartbeat
        "keys_per_tick": (last["beat_keys"] - first["beat_keys"]) / max(ticks, 1),
        "simulation_cpu": (last["cpu_s"] - first["cpu_s"]) / elapsed,  # cores busy in the simulating processes
        "server_cpu": (last["server_cpu_s"] - first["server_cpu_s"]) / elapsed,  # ... in the store's server
    }


def summary(values: Any) -> dict[str, float] | None:
    values = sorted(values)
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "p90": values[int(0.9 * (len(values) - 1))],
        "max": values[-1],
        "min": values[0],
    }


# ---- one size in processes of its own ------------------------------------------------------------------------------
def one(args: argparse.Namespace) -> None:
    """``--one N``: the simulation of one size; prints each stage's result as a JSON line as it ends (``connected``,
    ``steady``, ``result``), so that a size cut off by its time limit still says how far it got."""
    raise_file_limit()
    path, version = failures_at(args.failures_from) if args.failures_from else (None, code_version())
    n = args.one
    killed = list(range(n // 2, n // 2 + args.kill))  # (sorted, as a decision names them)

    def report(stage: str, what: dict[str, Any]) -> None:
        print(f"{stage} " + json.dumps({**what, "failures_code": version}), flush=True)

    pids = [int(p) for p in args.server_pid.split(",")] if args.server_pid else None
    result = simulate(
        n, args.store_url or args.port, killed, args.warmup, args.window, args.limit, args.hang_timeout,
        args.processes, pids, path, report,
    )  # fmt: skip
    report("result", result)
    os._exit(0)


@contextlib.contextmanager
def serving(store: str, env: dict[str, str] | None = None) -> Iterator[tuple[list[str], list[int]]]:
    """The store's server(s) for one measurement: ``tcp``, a ``TCPStore`` in a process of its own (as torchrun's
    agent holds it); ``etcd``, a cluster of three etcd members (``distributed.etcd.LocalCluster``, its data in
    memory, at etcd's default heartbeat and election timeout: the simulation keeps this machine's cores busy, and
    members at LocalCluster's 20 and 200 ms, starved of them, change leaders over and over). Yields the arguments
    that name it to ``--one``/``--capacity`` and the server processes' pids."""
    if store == "etcd":
        from distributed.etcd import LocalCluster

        with tempfile.TemporaryDirectory(prefix="membership-etcd-") as directory:
            with LocalCluster(directory, members=3, heartbeat_ms=100, election_ms=1000) as cluster:
                yield ["--store-url", cluster.url], [p.pid for p in cluster.processes]
        return
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.membership", "--serve"], cwd=ROOT, env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        yield ["--port", server.stdout.readline().decode().strip()], [server.pid]
    finally:
        server.stdin.close()
        server.wait()


def run_size(n: int, rev: str | None, args: argparse.Namespace, store: str = "tcp") -> dict[str, Any]:
    """Start the store's server and the simulation of ``n`` ranks (engine/failures.py at ``rev``, or the working
    tree's), each in processes of their own; return the simulation's result, or as much of it as it reached within
    ``--setup-limit`` + ``--warmup`` + ``--window`` + ``--limit`` seconds.

    c10d looks up the name of the address of every connection it makes, at both ends, and this machine's resolver
    leaves about one lookup in 25 unanswered for 5 s: its processes are told to give up after 1 s (``RES_OPTIONS``),
    which only shortens the setup (the name is for c10d's own logs)."""
    env = dict(os.environ, RES_OPTIONS="timeout:1 attempts:1")
    with serving(store, env) as (address, pids):
        command = [
            sys.executable, "-m", "bench.membership", "--one", str(n), *address,
            "--server-pid", ",".join(map(str, pids)), "--kill", str(args.kill), "--warmup", str(args.warmup),
            "--window", str(args.window), "--limit", str(args.limit), "--hang-timeout", str(args.hang_timeout),
            "--processes", str(args.processes),
        ]  # fmt: skip
        if rev:
            command += ["--failures-from", rev]
        budget = args.setup_limit + args.warmup + args.window + args.limit
        sim = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = sim.communicate(timeout=budget)
        except subprocess.TimeoutExpired:
            sim.kill()
            out, err = sim.communicate()
        stages = dict(line.split(" ", 1) for line in out.splitlines() if line.split(" ", 1)[0] in STAGES)
        if "result" in stages:
            return json.loads(stages["result"])
        if "steady" in stages:
            row = json.loads(stages["steady"])
            return {**row, "failure": None, "error": f"the failure was not agreed on within {budget:.0f} s"}
        if "connected" in stages:
            return {"n": n, "error": f"no steady state within {budget:.0f} s", **json.loads(stages["connected"])}
        return {"n": n, "error": err[-2000:] or f"no result within {budget:.0f} s"}


# ---- what the store's server can serve -------------------------------------------------------------------------
def capacity(
    port: int | str, server_pid: int | list[int], threads: int = 8, seconds: float = 3.0
) -> list[dict[str, Any]]:
    """What the server at ``port`` serves when ``threads`` connections ask as fast as they can (the client side, one
    process here, may be the limit: the server's CPU says which): calls/s and keys/s of single-key ``add`` and ``set``
    (a beat), of ``multi_get`` of 16 keys (a heartbeat tick's read) and of ``multi_get`` and ``check`` of 1023 keys,
    what a heartbeat tick that read every peer would ask at 1024 ranks."""
    first = client(port)
    stores = [first.clone() for _ in range(threads)]
    keys = [f"relaxsync/restart0/membership0/beat/{r}" for r in range(1023)]
    for key in keys:
        first.add(key, 1)
    asks = {
        "add": (lambda store, i: store.add(f"relaxsync/restart0/membership0/beat/{i}", 1), 1),
        "set": (lambda store, i: store.set(f"relaxsync/restart0/membership0/beat/{i}", "1"), 1),  # (a beat)
        "multi_get of 16": (lambda store, i: store.multi_get(keys[:16]), 16),  # (a heartbeat tick's read)
        "multi_get of 1023": (lambda store, i: store.multi_get(keys), len(keys)),
        "check of 1023": (lambda store, i: store.check(keys), len(keys)),
    }
    rows = []
    for name, (ask, per_call) in asks.items():
        counts = [0] * threads
        stop = time.monotonic() + seconds

        def hammer(i: int, ask=ask, stop=stop, counts=counts) -> None:
            while time.monotonic() < stop:
                ask(stores[i], i)
                counts[i] += 1

        cpu, start = cpu_s(server_pid), time.monotonic()
        workers = [threading.Thread(target=hammer, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.monotonic() - start
        calls = sum(counts) / elapsed
        rows.append(
            {
                "ask": name,
                "calls_per_s": calls,
                "keys_per_s": calls * per_call,
                "server_cpu": (cpu_s(server_pid) - cpu) / elapsed,
            }
        )
    return rows


def run_capacity(store: str = "tcp") -> list[dict[str, Any]]:
    with serving(store) as (address, pids):
        command = [
            sys.executable,
            "-m",
            "bench.membership",
            "--capacity",
            *address,
            "--server-pid",
            ",".join(map(str, pids)),
        ]
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        return [{**row, "store": store} for row in json.loads(out.stdout.splitlines()[-1])]


# ---- what forming a real group costs -------------------------------------------------------------------------------
def _form_group_rank(rank: int, n: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from distributed.membership import form_group

    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timeout)
    times: dict[str, list[float]] = {"all": [], "survivors": []}
    # Every group of all ranks first: the last rank forms none after them, as a removed rank forms none (a rank that
    # skipped a group and formed the next would name it differently from the others).
    for name, ranks in (("all", list(range(n))), ("survivors", list(range(n - 1)))):
        for _ in range(FORM_GROUP_REPEATS):
            dist.barrier()
            if rank in ranks:
                start = time.perf_counter()
                form_group(ranks, timeout)
                times[name].append(time.perf_counter() - start)
    dist.barrier()
    Path(out, f"{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def form_group_cost(sizes: list[int]) -> list[dict[str, Any]]:
    """Seconds to form a gloo group (``form_group``: ``new_group`` of the ranks alone, then a first collective) in ``n``
    real processes, of all of them and of all but one (a survivors' group): the median over repeats of the slowest
    rank."""
    import socket

    import torch.multiprocessing as mp

    rows = []
    for n in sizes:
        with socket.socket() as s, tempfile.TemporaryDirectory() as out:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            mp.start_processes(_form_group_rank, args=(n, port, out), nprocs=n, start_method="spawn")
            per_rank = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(n)]
        row = {"n": n}
        for name in ("all", "survivors"):
            slowest = [max(p[name][i] for p in per_rank if p[name]) for i in range(FORM_GROUP_REPEATS)]
            row[name] = statistics.median(slowest)
        rows.append(row)
        print(f"bench.membership: form_group at {n} processes: {row}", flush=True)
    return rows


# ---- tables and the command line -----------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]]) -> str:
    def num(value: Any, fmt: str = "{:.2f}") -> str:
        return "–" if value is None or value != value else fmt.format(value)

    lines = [
        "| engine/failures.py | store | ranks | store calls/s | keys/s | calls per rank per tick | "
        "keys per rank per tick | beats per rank/s | server CPU | decided median (s) | decided max (s) | "
        "last recovered (s) | agreed on the killed rank | agreement's calls per survivor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        code = r.get("failures_code", r["code"])[:7] + ("*" if "uncommitted" in r.get("failures_code", "") else "")
        s, f = r.get("steady"), r.get("failure")
        store = r.get("store", "tcp")
        if s is None:
            lines.append(f"| {code} | {store} | {r['n']} | {r['error'].splitlines()[-1][:200]} |" + " |" * 10)
            continue
        steady = (
            f"| {code} | {store} | {r['n']} | {s['calls_per_s']:,.0f} | {s['keys_per_s']:,.0f} | "
            f"{s['calls_per_tick']:.2f} | {s['keys_per_tick']:.1f} | {s['beats_per_rank_s']:.2f} | "
            f"{s['server_cpu']:.2f} |"
        )
        if f is None:
            lines.append(f"{steady} {r['error']} | | | | |")
            continue
        decided, recovered = f["decided_s"] or {}, f["recovered_s"] or {}
        last = num(recovered.get("max"))
        if not f["all_finished"]:
            last = f"not finished ({f['finished']}/{f['survivors']} in {num(f['recovery_wall_s'], '{:.0f}')} s)"
        agreed = "yes" if f["removed_exactly_killed"] and f["agreed_alike"] else f"no: {str(f['removed'])[:40]}"
        agreed = agreed if f["finished"] else "–"
        lines.append(
            f"{steady} {num(decided.get('median'))} | {num(decided.get('max'))} | {last} | {agreed} | "
            f"{f['recovery_calls_per_survivor']:,.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Ranks against agreement time and against what the store was asked, one line per engine/failures.py."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (agree, asked) = plt.subplots(1, 2, figsize=(11, 4.2))

    def line_of(r: dict[str, Any]) -> str:
        return r.get("failures_code", r["code"])[:7] + (" etcd" if r.get("store") == "etcd" else "")

    for code in sorted({line_of(r) for r in rows}):
        mine = sorted((r for r in rows if line_of(r) == code), key=lambda r: r["n"])
        done = [r for r in mine if r.get("failure") and r["failure"]["all_finished"]]
        line = agree.plot(
            [r["n"] for r in done], [r["failure"]["decided_s"]["max"] for r in done], "o-", label=f"{code}: decided"
        )[0]
        agree.plot(
            [r["n"] for r in done],
            [r["failure"]["recovered_s"]["max"] for r in done],
            "s--",
            color=line.get_color(),
            label=f"{code}: last survivor done",
        )
        for r in mine:
            if r.get("steady") and not (r.get("failure") and r["failure"]["all_finished"]):
                limit = r["limit_s"]
                agree.plot([r["n"]], [limit], "x", color=line.get_color(), markersize=10)
                agree.annotate(f"no decision\nin {limit:.0f} s", (r["n"], limit), (-8, -30), "data", "offset points",
                               ha="right", color=line.get_color())  # fmt: skip
        steady = [r for r in mine if r.get("steady")]
        asked.plot([r["n"] for r in steady], [r["steady"]["keys_per_s"] for r in steady], "o-", label=f"{code}: keys/s")
        asked.plot(
            [r["n"] for r in steady],
            [r["steady"]["calls_per_s"] for r in steady],
            "s--",
            color=line.get_color(),
            label=f"{code}: calls/s",
        )
        asked.plot(  # what the heartbeats ask at their period, served or not
            [r["n"] for r in steady],
            [r["steady"]["keys_per_tick"] * r["n"] * 5 for r in steady],
            ":",
            color=line.get_color(),
            label=f"{code}: keys/s at 5 beats/s",
        )
    agree.set(xscale="log", yscale="log", xlabel="ranks", ylabel="seconds after the failure")
    agree.set_title("agreement after a rank dies")
    asked.set(xscale="log", yscale="log", xlabel="ranks", ylabel="per second, all ranks")
    asked.set_title("store, steady state (counted client side)")  # (the period: 1 / BEAT_S = 5 ticks a second)
    for ax in (agree, asked):
        ax.set_xticks([64, 256, 1024], ["64", "256", "1024"])
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,256,1024", help="numbers of simulated ranks")
    parser.add_argument("--code", default="tree", help="engine/failures.py to run: tree (the working tree's), git revs")
    parser.add_argument(
        "--store", default="tcp", help="the store(s), one row each: tcp (torch's TCPStore), etcd (a 3-member cluster)"
    )
    parser.add_argument("--kill", type=int, default=1, help="ranks that fail at once (from the middle rank on)")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of heartbeats before the window")
    parser.add_argument("--window", type=float, default=5.0, help="seconds over which the steady state is counted")
    parser.add_argument("--limit", type=float, default=150.0, help="seconds after the failure before giving up")
    parser.add_argument("--setup-limit", type=float, default=240.0, help="seconds to connect and start every rank")
    parser.add_argument("--processes", type=int, default=4, help="processes the simulated ranks are spread over")
    parser.add_argument("--hang-timeout", type=float, default=60.0, help="trainer.hang_timeout_s (its default)")
    parser.add_argument("--form-group", default="2,4,8", help="process counts at which to time real gloo groups")
    parser.add_argument("--server-capacity", type=int, default=1, help="1: also measure what the store serves")
    parser.add_argument("--merge", action="store_true", help="keep the rows of other sizes and code in --out")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--capacity", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--store-url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--failures-from", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return 0
    if args.one is not None:
        one(args)
        return 0
    if args.capacity:
        pids = [int(p) for p in args.server_pid.split(",")]
        print(json.dumps(capacity(args.store_url or args.port, pids)), flush=True)
        return 0
    started = time.perf_counter()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    versions = [c for c in args.code.split(",") if c]
    stores = [s for s in args.store.split(",") if s]
    for store in stores:
        if store not in ("tcp", "etcd"):
            parser.error(f"--store: {store!r} is not one of tcp, etcd")
    command = "python -m bench.membership " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = []
    for i, n in enumerate(sizes):
        for code, store in [(c, s) for c in versions for s in stores][:: 1 if i % 2 == 0 else -1]:
            print(f"bench.membership: {n} ranks, engine/failures.py {code}, store {store}", flush=True)
            load = os.getloadavg()[0]  # (other work on the machine, for the record)
            row = {"code": code, "store": store, "command": command.strip()}
            row.update(run_size(n, None if code == "tree" else code, args, store))
            row["load_average"] = [load, os.getloadavg()[0]]  # (1 min, before and after)
            row["limit_s"] = args.limit
            rows.append(row)
            print(json.dumps(row), flush=True)
    groups = form_group_cost([int(s) for s in args.form_group.split(",") if s]) if args.form_group else []
    served = [row for store in stores for row in run_capacity(store)] if args.server_capacity else []
    out = Path(args.out)
    result = {"benchmark": "membership", "machine": machine(), "rows": [], "form_group": []}
    if args.merge and (out / "membership.json").exists():
        result = json.loads((out / "membership.json").read_text())
    ran = {(r["code"], r["n"], r["store"]) for r in rows}
    result["rows"] = [r for r in result["rows"] if (r["code"], r["n"], r.get("store", "tcp")) not in ran] + rows
    result["rows"].sort(key=lambda r: (r["n"], r["code"] != "tree", r["code"], r.get("store", "tcp")))
    if groups:
        result["form_group"] = groups
    if served:
        kept = [row for row in result.get("capacity", []) if row.get("store", "tcp") not in stores]
        result["capacity"] = kept + served
    result["machine"] = machine()
    out.mkdir(parents=True, exist_ok=True)
    (out / "membership.json").write_text(json.dumps(result, indent=1) + "\n")
    text = table(result["rows"])
    (out / "membership.md").write_text(text + "\n")
    plot(result["rows"], out / "membership.png")
    print(text)
    minutes = (time.perf_counter() - started) / 60
    print(f"bench.membership: {minutes:.1f} min; results in {out}/membership.json and membership.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
