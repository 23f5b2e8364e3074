"""A soak: failures that keep coming, survived one after another, until ``--failures`` in all.

    make bench-soak                                   # python -m bench.soak; about an hour for 1000 failures
    python -m bench.soak [--failures 1000] [--syncs allreduce,localsgd,dgc,sgp,diloco] [--nodes 3] [--epochs 150]
                         [--store etcd|c10d]

One run per sync option (in turn, each taking its share of the failures) under ``trainer.on_failure=continue``, on
this machine, in ``--nodes`` node slots: two ``torchrun`` nodes start it and the driver fills the other slots, and
keeps every slot filled, with processes that join the running world (``trainer.join=true``, forked from a server that
has imported the engine once, as the local launcher's workers are). With ``--store etcd`` (the default where etcd is
installed) the run's store is an etcd cluster of one member per slot (``trainer.store``, over TLS with client
certificates; torchrun's etcd-v3 rendezvous), and the victim of each failure is drawn uniformly over every slot, the
first node's too: a node killed takes its member with it, and the process that joins in its place brings the member
back. With ``--store c10d``
node 0 hosts torch's store, as torchrun's first node does, and is never failed. Three steps after each change, a
victim fails: ``kill -9`` (a node gone: its torchrun agent if it has one, its worker, its member) or, every
``--hang-every``-th time, SIGSTOP (a node that hangs; SIGCONT once the others gave it up, and it exits by itself).
A process joins in its place at once. Every failure and every join is waited for in the run's records before the
next one comes.

Reported per run and in all: failures injected and survived (a ``rank_lost`` event names the rank), joins, steps
recorded more than once or never (lost steps), the members' standstill per failure and per join (the gap between
the last step completed before it and the first completed after, less the run's median step: median, p95, max),
the final top-1 against an undisturbed run of the same config and length at ``--nodes`` ranks, and the wall time;
and how often the victim was the first node's slot, the logging rank (the lowest active one, which writes the
records) and the etcd leader's node, with the standstill of those kills apart.
With the store on etcd, each member's database size (in use, and on disk) is read every ``--db-every`` seconds
(``db`` of each run): flat once the members' history is compacted (``distributed.etcd.COMPACTION``, five minutes
kept), where without compaction it grows by every beat.
Results: bench/results/soak.json and soak.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, machine, median
from distributed.etcd import LocalCluster
from engine.metrics import read_metrics

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SYNCS = ("allreduce", "localsgd", "dgc", "sgp", "diloco")
# (allreduce in 0.25 MiB buckets: a kill lands among several, some of which only some ranks issued)
EXTRA = {"allreduce": ["sync.bucket_cap_mb=0.25"], "localsgd": ["sync.k_steps=4"], "diloco": ["sync.inner_steps=8"],
         "dgc": ["sync.min_compress_numel=1024"],
         "decoupled": ["sync.inner_steps=8", "sync.fragments=2", "sync.delay=1"]}  # fmt: skip
# (sync=decoupled, not in the default SYNCS: a round every 4 steps, applied a step after it is posted)
# Runs whose failures come fewer to an epoch (a join enters at the next averaging, every 4 or 8 steps) train longer
# than --epochs, so that their share fits: in the first 1000-failure soak, 150 epochs held 188 of local SGD's 200
# failures and 150 of DiLoCo's.
LONGER = {"localsgd": 1.4, "diloco": 1.6}


def epochs(sync: str, args: argparse.Namespace) -> int:
    """How long ``sync``'s run (and its undisturbed run) trains."""
    return math.ceil(args.epochs * LONGER.get(sync, 1.0))


def overrides(sync: str, args: argparse.Namespace) -> list[str]:
    return [
        "model=test_resnet", "data=digits", "logger=none", "trainer.progress=false",
        f"trainer.epochs={epochs(sync, args)}", "trainer.on_failure=continue",
        f"trainer.hang_timeout_s={args.hang_timeout}", "trainer.checkpoint_every=0", f"sync={sync}",
        *EXTRA.get(sync, []),
    ]  # fmt: skip


def _joiner(cfg: dict[str, Any], run_dir: str, log: str) -> None:
    """A process that joins the run (forked from the warm server): one worker, the run's store in join.json."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    from engine.worker import run_worker

    run_worker(cfg, run_dir)


class Run:
    """One soak run: its processes, its records."""

    def __init__(self, sync: str, args: argparse.Namespace, workdir: Path, port: int):
        self.sync, self.args, self.run_dir = sync, args, workdir / sync
        self.run_dir.mkdir(parents=True)
        self.overrides = [*overrides(sync, args), f"trainer.run_dir={self.run_dir}"]
        self.etcd: LocalCluster | None = None
        if args.store == "etcd":
            self.etcd = LocalCluster(str(workdir / f"{sync}-etcd"), members=args.nodes, tls=True).start()
            self.overrides += self.etcd.overrides()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(key, None)
        self.nodes = []
        for node in range(2):
            if self.etcd is None:
                rendezvous = [
                    "c10d",
                    "--rdzv-endpoint",
                    f"127.0.0.1:{port}",
                    "--rdzv-conf",
                    f"is_host={int(node == 0)}",
                ]
            else:
                rendezvous = self.etcd.rendezvous(node)
            launcher = [
                TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0", "--monitor-interval", "0.5",
                "--rdzv-id", sync, "--rdzv-backend", *rendezvous,
            ]  # fmt: skip
            log = open(self.run_dir / f"node{node}.log", "w")
            self.nodes.append(
                subprocess.Popen(
                    [*launcher, "train.py", *self.overrides], cwd=ROOT, env=env, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True,
                )
            )  # fmt: skip
        self.members: dict[int, int] = {}  # rank -> pid of its worker
        self.slots: dict[int, int] = {}  # rank -> its node slot (0 and 1: torchrun's nodes; member i of etcd in slot i)
        self.agents: dict[int, subprocess.Popen] = {}  # rank -> its torchrun agent, where it has one
        self._records: list[dict[str, Any]] = []
        self._read = 0  # bytes of metrics.jsonl read
        self.injected: list[dict[str, Any]] = []  # every failure and join, with its wall time
        self.joiners: list[Any] = []
        self.db: list[dict[str, Any]] = []  # the members' database sizes, sampled (etcd)
        self._sampling = threading.Event()
        if self.etcd is not None:
            threading.Thread(target=self._sample_db, args=(args.db_every,), daemon=True).start()

    def _sample_db(self, every_s: float) -> None:
        """Every ``every_s``: each live member's database size, on disk and in use (etcd's status)."""
        start = time.time()
        while not self._sampling.wait(every_s):
            for i in range(self.etcd.members):
                with contextlib.suppress(Exception):  # (a member killed with its slot: back with the joiner)
                    status = self.etcd._status(i)
                    sample = {"t": round(time.time() - start, 1), "member": i, "revision":
                              int(status["header"]["revision"]), "db_size": int(status.get("dbSize", 0)),
                              "db_in_use": int(status.get("dbSizeInUse", 0))}  # fmt: skip
                    self.db.append(sample)
                    with open(self.run_dir / "etcd-db.jsonl", "a") as f:  # (kept if the soak is cut short)
                        f.write(json.dumps(sample) + "\n")

    def metrics(self) -> list[dict[str, Any]]:
        """The run's records so far, read from where the last call stopped (polled every 50 ms for an hour)."""
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            with open(path) as f:
                f.seek(self._read)
                text = f.read()
            complete = text[: text.rfind("\n") + 1]  # (a line being written is read next time)
            self._read += len(complete.encode())
            self._records += [json.loads(line) for line in complete.splitlines() if line.strip()]
        return self._records

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.metrics() if r["kind"] == "event" and r["event"] == kind]

    def finished(self) -> bool:
        return any(r["kind"] == "summary" and r.get("finished") for r in self.metrics())

    def wait_for(self, predicate, timeout: float, what: str) -> bool:
        """Until ``predicate()``; False if the run finished first."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.finished():
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.sync}: {what} not within {timeout:.0f} s")
            time.sleep(0.05)
        return True

    def worker_of(self, node: int) -> tuple[int, int]:
        """(pid, rank) of the worker under torchrun node ``node``."""
        out = subprocess.run(["pgrep", "-P", str(self.nodes[node].pid)], capture_output=True, text=True).stdout
        for pid in map(int, out.split()):
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            if b"RANK" in environ:
                return pid, int(environ[b"RANK"])
        raise RuntimeError(f"no worker under node {node}'s torchrun")

    def spawn(self, ctx: Any, cfg: dict[str, Any], slot: int) -> tuple[Any, float, int, int]:
        """Fork a process that joins into node slot ``slot`` (it asks once it has built its model); returns it, when,
        the joins so far and its slot."""
        process = ctx.Process(target=_joiner, args=(cfg, str(self.run_dir), str(self.run_dir / "joiners.log")))
        started, before = time.time(), len(self.events("rank_joined"))
        process.start()
        self.joiners.append(process)
        return process, started, before, slot

    def admitted(self, spawned: tuple[Any, float, int, int]) -> bool:
        """Wait until the process ``spawned`` is admitted; False if the run ended first."""
        process, started, before, slot = spawned
        if not self.wait_for(lambda: len(self.events("rank_joined")) > before, 120, "a join"):
            return False
        event = self.events("rank_joined")[before]
        self.members[event["ranks"][0]] = process.pid
        self.slots[event["ranks"][0]] = slot
        admission = event["time"] - event["admission_s"]  # (the others stand still from here, not from its start)
        self.injected.append({"kind": "join", "time": admission, "started": started, "rank": event["ranks"][0]})
        self.injected[-1]["event"] = event
        return True

    def fail(self, rng: random.Random, ctx: Any, cfg: dict[str, Any]) -> bool:
        """Fail a victim drawn over the node slots (the first node's only with the store on etcd) and start a process
        in its place at once (it builds its model while the others recover); wait until the others removed the one
        and admitted the other."""
        # A few steps first: the gap around each failure and each admission is then its own.
        trained = len([r for r in self.metrics() if r["kind"] == "train"])
        if not self.wait_for(
            lambda: len([r for r in self.metrics() if r["kind"] == "train"]) >= trained + 3, 60, "steps"
        ):
            return False
        candidates = sorted(r for r in self.members if self.etcd is not None or self.slots[r] != 0)
        rank = rng.choice(candidates)
        logging = rank == min(self.members)  # (the lowest active rank writes the records)
        pid, slot, before = self.members.pop(rank), self.slots.pop(rank), len(self.events("rank_lost"))
        agent = self.agents.pop(rank, None)
        hang = len(self.events("rank_lost")) % self.args.hang_every == self.args.hang_every - 1  # (every n-th)
        leader = self.etcd is not None and self.etcd.leader() == slot
        at = time.time()
        if not hang:
            if agent is not None:  # the node: its agent (torchrun's workers have a session of their own)...
                os.killpg(agent.pid, signal.SIGKILL)
            if self.etcd is not None:  # ...its etcd member...
                self.etcd.kill(slot)
        os.kill(pid, signal.SIGSTOP if hang else signal.SIGKILL)  # ...and its worker
        what = f"{'hang' if hang else 'kill'} of rank {rank} (pid {pid}, slot {slot}{', logging' if logging else ''})"
        print(f"bench.soak: {self.sync}: {what}", flush=True)
        spawned = self.spawn(ctx, cfg, slot)
        removed = lambda: any(rank in e["ranks"] for e in self.events("rank_lost")[before:])  # noqa: E731
        if not self.wait_for(removed, self.args.hang_timeout + 60, f"rank {rank}'s removal"):
            return False
        if self.etcd is not None and not hang:
            self.etcd.restart(slot)  # (the node that takes its place brings its member back)
        event = next(e for e in self.events("rank_lost")[before:] if rank in e["ranks"])
        self.injected.append(
            {"kind": "hang" if hang else "kill", "time": at, "rank": rank, "slot": slot, "logging": logging,
             "leader": leader, "event": event}
        )  # fmt: skip
        if hang:
            os.kill(pid, signal.SIGCONT)  # given up: it wakes, finds itself removed and exits
        return self.admitted(spawned)

    def close(self) -> None:
        self._sampling.set()
        for node in self.nodes:
            if node.poll() is None:
                # Its workers first (a session of their own): with the agent gone, a worker still running waits in
                # its store's reconnection for the store's timeout.
                workers = subprocess.run(["pgrep", "-P", str(node.pid)], capture_output=True, text=True).stdout
                for pid in map(int, workers.split()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                os.killpg(node.pid, signal.SIGKILL)
        for process in self.joiners:
            if process.is_alive():
                process.kill()
            process.join()
        if self.etcd is not None:
            self.etcd.stop()


def standstill(steps: list[dict[str, Any]], at: float, step_s: float) -> float | None:
    """The gap between the last step completed before ``at`` and the first completed after, less one step."""
    before = [r["time"] for r in steps if r["time"] <= at]
    after = [r["time"] for r in steps if r["time"] > at]
    if not before or not after:
        return None
    return max(0.0, after[0] - before[-1] - step_s)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def soak(sync: str, share: int, args: argparse.Namespace, workdir: Path, port: int, ctx: Any) -> dict[str, Any]:
    """One run with ``share`` failures (fewer if it ends first), and what its records say."""
    from bench.common import config

    rng, run, started = random.Random(f"{args.seed}/{sync}"), Run(sync, args, workdir, port), time.time()
    try:
        run.wait_for(lambda: (run.run_dir / "join.json").exists() and run.metrics(), 300, "the run's start")
        for node in range(2):
            pid, rank = run.worker_of(node)
            run.members[rank], run.slots[rank], run.agents[rank] = pid, node, run.nodes[node]
        cfg = config([*run.overrides, "trainer.join=true", "trainer.nproc=1"])
        while len(run.members) < args.nodes:  # (the world the driver keeps: a process in every slot)
            if not run.admitted(run.spawn(ctx, cfg, len(run.members))):
                break
        failures = 0
        while failures < share and not run.finished():
            if not run.fail(rng, ctx, cfg):
                break
            failures += 1
        cut = None
        try:
            run.wait_for(lambda: False, args.end_within, "the run's end") if not run.finished() else None
        except TimeoutError as error:  # (every failure survived, still training: what was recorded counts)
            cut = str(error)
    except TimeoutError as error:
        return {"sync": sync, "error": str(error)}
    finally:
        run.close()
    row = analyse(run.metrics())
    row.update(sync=sync, failures=len([i for i in run.injected if i["kind"] != "join"]), wall_s=time.time() - started)
    if cut:
        row["cut_short"] = cut
    row["victims"] = victims(run.injected, row.pop("pauses"))
    if run.db:
        row["db"] = run.db
        row["db_in_use"] = db_summary(run.db)
    return row


def db_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The members' database in use (the largest member's) at 6 minutes (after the first compaction of five
    minutes' history), at the end and at most after 6 minutes; and the growth per minute before and after."""
    by_t: dict[float, int] = {}
    for sample in samples:
        by_t[sample["t"]] = max(by_t.get(sample["t"], 0), sample["db_in_use"])
    times = sorted(by_t)
    after = [t for t in times if t >= 360]

    def rate(ts: list[float]) -> float | None:
        return (by_t[ts[-1]] - by_t[ts[0]]) / ((ts[-1] - ts[0]) / 60) if len(ts) > 1 and ts[-1] > ts[0] else None

    return {
        "at_6min": by_t[after[0]] if after else None,
        "end": by_t[times[-1]] if times else None,
        "max_after_6min": max((by_t[t] for t in after), default=None),
        "bytes_per_min_before": rate([t for t in times if t < 300]),
        "bytes_per_min_after": rate(after),
        "minutes": times[-1] / 60 if times else 0,
    }


def victims(injected: list[dict[str, Any]], pauses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each failure's victim (its rank, slot, whether it was the logging rank and the etcd leader's node) with the
    standstill it cost (:func:`analyse`'s, matched by the ``rank_lost`` event)."""
    by_event = {(p["time"], tuple(p["ranks"])): p["standstill_s"] for p in pauses}
    return [
        {k: i[k] for k in ("kind", "rank", "slot", "logging", "leader")}
        | {"standstill_s": by_event.get((i["event"]["time"], tuple(i["event"]["ranks"])))}
        for i in injected
        if i["kind"] != "join"
    ]


def analyse(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """What a soak run's records say: failures survived (a ``rank_lost`` event each), joins, lost steps, the
    standstill each cost the members, the final top-1.

    A failure's standstill is the longest gap between two steps (less the run's median step) from the first step
    after the previous admission to the first step after its ``rank_lost`` event: the members stall wherever
    they next need the lost rank, at once under allreduce, at their next exchange (steps after the failure) under
    local SGD and DiLoCo, and the event may be written before or after the step that follows the stall. A
    join's is the gap around the start of its admission."""
    steps = [r for r in metrics if r["kind"] == "train"]
    times = [r["time"] for r in steps]
    events = [r for r in metrics if r["kind"] == "event"]
    # (a run cut short at the soak's deadline has no summary: its last evaluation, and not finished)
    summary = next((r for r in reversed(metrics) if r["kind"] == "summary"), None)
    last_eval = next((r for r in reversed(metrics) if r["kind"] == "eval"), {"top1": float("nan")})
    step_s = median([r["step_s"] for r in steps])
    numbers = [r["step"] for r in steps]
    pauses: dict[str, list[float]] = {"kill": [], "hang": [], "join": []}
    each: list[dict[str, Any]] = []  # every loss's standstill, by its event
    since = times[0]  # the first step after the previous admission
    for event in events:
        if event["event"] == "rank_lost":
            until = next((t for t in times if t > event["time"]), None)
            gaps = [b - a for a, b in zip(times, times[1:]) if a >= since and until is not None and b <= until]
            if gaps:
                pause = max(0.0, max(gaps) - step_s)
                pauses["hang" if event["cause"] == "hung" else "kill"].append(pause)
                each.append({"time": event["time"], "ranks": event["ranks"], "standstill_s": pause})
        elif event["event"] == "rank_joined":
            pause = standstill(steps, event["time"] - event["admission_s"], step_s)  # (they stand still from here)
            if pause is not None:
                pauses["join"].append(pause)
            since = next((t for t in times if t > event["time"]), since)
    return {
        "survived": len([e for e in events if e["event"] == "rank_lost"]),
        "kills": len(pauses["kill"]),
        "hangs": len(pauses["hang"]),
        "joins": len(pauses["join"]),
        "lost_steps": (len(numbers) - len(set(numbers))) + (max(numbers) + 1 - len(set(numbers))),
        "steps": len(numbers),
        "median_step_s": step_s,
        "standstill_s": pauses,
        "pauses": each,
        "top1": (summary or last_eval)["top1"],
        "finished": bool(summary and summary["finished"]),
    }


def undisturbed(sync: str, args: argparse.Namespace, workdir: Path) -> float:
    """The same config and length at ``--nodes`` ranks, nothing failed: its final top-1."""
    from bench.common import run as train

    del workdir
    metrics = train([*overrides(sync, args), f"trainer.nproc={args.nodes}"])
    return next(r for r in reversed(metrics) if r["kind"] == "summary")["top1"]


def table(rows: list[dict[str, Any]]) -> str:
    def stats(values: list[float]) -> str:
        if not values:
            return "–"
        return f"{median(values):.2f} / {percentile(values, 0.95):.2f} / {max(values):.2f}"

    lines = [
        "| sync | failures survived (kill + hang) | joins | lost steps | standstill per kill, s (median / p95 / max) "
        "| per hang, s | per join, s | top-1 (undisturbed) | wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['sync']} | failed: {r['error'][:100]} ||||||||")
            continue
        standstill = r["standstill_s"]
        injected = "?" if r["failures"] is None else r["failures"]
        lines.append(
            f"| {r['sync']} | {r['survived']} of {injected} ({r['kills']} + {r['hangs']}) | {r['joins']} | "
            f"{r['lost_steps']} | {stats(standstill['kill'])} | {stats(standstill['hang'])} | "
            f"{stats(standstill['join'])} | {r['top1']:.2f}% ({r.get('undisturbed_top1', float('nan')):.2f}%) | "
            f"{r['wall_s'] / 60:.1f} min |"
        )
    for r in rows:
        if r.get("cut_short"):
            why = r["cut_short"]
            lines += ["", f"{r['sync']}: cut short, every failure survived and the run still training ({why})."]
    sized = [r for r in rows if r.get("db_in_use")]
    if sized:
        lines += ["", "The etcd members' database in use (the largest member's; kB):", "",
                  "| sync | minutes read | at 6 min | at the end | most after 6 min | kB/min before 5 min "
                  "| kB/min after 6 |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip

        def kb(v: float | None) -> str:
            return "–" if v is None else f"{v / 1000:.0f}"

        for r in sized:
            d = r["db_in_use"]
            lines.append(f"| {r['sync']} | {d['minutes']:.1f} | {kb(d['at_6min'])} | {kb(d['end'])} | "
                         f"{kb(d['max_after_6min'])} | {kb(d['bytes_per_min_before'])} | "
                         f"{kb(d['bytes_per_min_after'])} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--failures", type=int, default=1000, help="failures (kills and hangs) in all")
    parser.add_argument("--syncs", default=",".join(SYNCS), help="the sync options, one run each, in turn")
    parser.add_argument("--nodes", type=int, default=3, help="the world size the driver keeps")
    parser.add_argument(
        "--epochs",
        type=int,
        default=150,
        help="each run's length (and its undisturbed run's; local SGD's and DiLoCo's are longer: LONGER)",
    )
    parser.add_argument("--hang-every", type=int, default=5, help="one failure in this many is a hang")
    parser.add_argument("--hang-timeout", type=float, default=3.0, help="trainer.hang_timeout_s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--store", choices=("etcd", "c10d"), default="etcd" if shutil.which("etcd") else "c10d",
        help="the run's store: an etcd cluster, a member per slot, every slot a victim (default where etcd is "
        "installed); or torch's, in node 0, which is then never failed",
    )  # fmt: skip
    parser.add_argument(
        "--undisturbed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train each run undisturbed, for its top-1 (as long again)",
    )
    parser.add_argument("--db-every", type=float, default=15.0, help="seconds between reads of the members' size")
    parser.add_argument(
        "--end-within", type=float, default=3600.0,
        help="seconds the run has to end after its last failure; past them it is stopped and what it recorded is "
        "analysed, marked cut short (default 3600)",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=29700)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--report",
        metavar="WORKDIR",
        help="analyse a finished soak's run dirs again (its soak.json "
        "in --out gives what the records do not: failures injected, wall times, undisturbed top-1)",
    )
    args = parser.parse_args(argv)
    command = ("python -m bench.soak " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    if args.report:
        return report(Path(args.report), Path(args.out), command)
    syncs = args.syncs.split(",")
    from engine.launch import START_METHOD, start_worker_server

    start_worker_server()
    ctx = multiprocessing.get_context(START_METHOD)
    started, workdir = time.perf_counter(), Path(tempfile.mkdtemp(prefix="relaxsync-soak-"))
    rows = []
    for i, sync in enumerate(syncs):
        left = args.failures - sum(r.get("failures", 0) for r in rows)  # (a run that ended early leaves its rest)
        share = math.ceil(left / (len(syncs) - i))
        print(f"bench.soak: {sync}, {share} failures (run dir {workdir / sync})", flush=True)
        row = soak(sync, share, args, workdir, args.port + i, ctx)
        if "error" not in row and args.undisturbed:
            row["undisturbed_top1"] = undisturbed(sync, args, workdir)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "standstill_s"}), flush=True)
    write({"command": command, "wall_s": time.perf_counter() - started}, rows, Path(args.out))
    return 0


def report(workdir: Path, out: Path, command: str) -> int:
    """Re-analyse the run dirs of the soak recorded in ``out/soak.json`` (:func:`analyse`)."""
    old = json.loads((out / "soak.json").read_text())
    rows = []
    for row in old["rows"]:
        run_dir = workdir / row["sync"]
        if "error" in row and "the run's end not within" in row["error"] and (run_dir / "metrics.jsonl").exists():
            # (stopped at the deadline of a soak without --end-within, every failure survived: cut short; the
            # failures injected were not recorded, the rank_lost events say how many were survived)
            row = {"sync": row["sync"], "cut_short": row["error"], "failures": None, "wall_s": None}
        if "error" not in row:
            kept = {k: row[k] for k in ("sync", "failures", "wall_s", "undisturbed_top1", "cut_short") if k in row}
            row = {**kept, **analyse(read_metrics(str(run_dir / "metrics.jsonl")))}
            if (run_dir / "etcd-db.jsonl").exists():
                row["db"] = [json.loads(line) for line in open(run_dir / "etcd-db.jsonl")]
                row["db_in_use"] = db_summary(row["db"])
                row["wall_s"] = row["wall_s"] or max(s["t"] for s in row["db"])
        rows.append(row)
    write({"command": old["command"], "analysed_by": command, "wall_s": old["wall_s"]}, rows, out)
    return 0


def write(head: dict[str, Any], rows: list[dict[str, Any]], out: Path) -> None:
    def spread(kinds: tuple[str, ...]) -> dict[str, float | None]:
        every = [p for r in rows if "error" not in r for k in kinds for p in r["standstill_s"][k]]
        return {"median": median(every), "p95": percentile(every, 0.95), "max": max(every, default=None)}

    result = {
        "benchmark": "soak",
        **head,
        "machine": machine(),
        "failures_survived": sum(r.get("survived", 0) for r in rows),
        "failures_injected": None  # (not recorded: a run re-analysed after the soak's deadline stopped it)
        if any("failures" in r and r["failures"] is None for r in rows)
        else sum(r.get("failures", 0) for r in rows),
        "lost_steps": sum(r.get("lost_steps", 0) for r in rows),
        # (every failure; then kills and hangs apart: a kill is seen at once, a hang at trainer.hang_timeout_s)
        "standstill_s": {**spread(("kill", "hang")), "kill": spread(("kill",)), "hang": spread(("hang",))},
        "rows": rows,
    }
    every = [v for r in rows if "error" not in r for v in r.get("victims", [])]
    kills = [v for v in every if v["kind"] == "kill"]

    def of(kind: str) -> dict[str, Any]:
        values = [v["standstill_s"] for v in kills if v[kind] and v["standstill_s"] is not None]
        return {"kills": len([v for v in kills if v[kind]]), "median_s": median(values),
                "p95_s": percentile(values, 0.95), "max_s": max(values, default=None)}  # fmt: skip

    for v in kills:
        v["first_node"] = v["slot"] == 0
    slots = sorted({v["slot"] for v in every})
    result["victims"] = {
        "by_slot": {str(slot): len([v for v in every if v["slot"] == slot]) for slot in slots},
        "first_node": of("first_node"),  # (slot 0: torchrun's first node, which hosts torch's store when it is used)
        "logging_rank": of("logging"),
        "etcd_leader": of("leader"),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    text = table(rows)
    (out / "soak.md").write_text(text + "\n")
    print(text)
    if every:
        shares = ", ".join(f"slot {k}: {n}" for k, n in result["victims"]["by_slot"].items())
        apart = "; ".join(
            f"{name.replace('_', ' ')} {v['kills']} (median {v['median_s'] or 0:.2f} s)"
            for name, v in result["victims"].items() if name != "by_slot"
        )  # fmt: skip
        print(f"bench.soak: victims by slot: {shares}; kills of the {apart}")
    print(f"bench.soak: {result['failures_survived']} of {result['failures_injected']} failures survived, "
          f"{result['wall_s'] / 60:.1f} min; results in {out}/soak.json and soak.md")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
