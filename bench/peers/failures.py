"""A node lost and a node back, ours beside torchft, on three emulated nodes, for each algorithm both have.

Ours: the pair's sync with ``trainer.on_failure=continue``, one torchrun per node (as bench/faults starts it); node
2's torchrun and worker are killed (``kill -9``) once ``at`` steps are done; ``back`` steps later node 2 runs
``train.py trainer.join=true`` and is admitted while the others train. torchft: the peer (its fault-tolerant DDP,
``LocalSGD`` or ``DiLoCo``), one replica group per node on a lighthouse in node 0 (a quorum needs 2 replicas, a
replica is given up after 2 s without a heartbeat: our ``SILENT_S``), the same kill, then node 2's torchrun started
again with the same command: it joins a quorum and is healed from a live replica. Both run the same job for
``steps`` steps.

Per side: the survivors' standstill after the kill and around the join, steps lost, the steps at each world size,
and the final top-1. The standstill is the longest wait for a step among the ``window`` steps after the moment,
beyond what such a step takes in the run (a window of two periods of local SGD or DiLoCo: a loss is seen at the
next synchronisation, and a joining replica that is late holds the others up there, which is where either side
stands still; the kill's window ends where the node is started again, whose new process's start is the join's).
Steps lost: ours, steps trained again (what was redone); torchft's DDP, steps
trained and not committed; its local SGD and DiLoCo, the steps since the last synchronisation thrown away at each
one whose vote failed (the replica goes back to its backup).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, median, wait_until
from bench.faults import Job, kill_node
from bench.netns import EmulatedNetwork
from bench.network import node_env, torchrun
from bench.peers import launch
from engine.metrics import read_metrics

NODES = 3
HEARTBEAT_TIMEOUT_MS = 2000  # = SILENT_S (distributed/world.py): both give a silent peer up after 2 s


def device_time(seconds: float) -> list[str]:
    """Overrides for both sides that make each step spend ``seconds`` asleep before its forward pass, every rank
    (a joining one too) from the first step: a GPU's compute, during which the host's cores are free. On this
    machine's two cores, three nodes that compute all the time drift apart between synchronisations by more than
    a join costs; with device time they share the cores less."""
    if not seconds:
        return []
    return ["straggler=sleep", "straggler.ranks=all", "straggler.start_epoch=1", f"straggler.sleep_s={seconds}"]


def _events(metrics: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in metrics if r["kind"] == "event" and r["event"] == name]


def window(period: int) -> int:
    """Steps after a moment among which its standstill is looked for: two synchronisations, 8 steps at least."""
    return max(8, 2 * period)


def synced(record: dict[str, Any]) -> bool:
    """Whether a train record's step synchronised (ours: local SGD's ``synced``, DiLoCo's ``outer_fragment``;
    torchft's: a vote)."""
    return bool(record.get("synced")) or "outer_fragment" in record


def standstill(train: list[dict[str, Any]], at: float, steps: int) -> float | None:
    """The survivors' standstill after ``at``: of the ``steps`` steps completed after it, the longest time from one
    step's end to the next beyond what such a step takes in the run (the median: a synchronising step and a local
    one apart)."""
    gaps = [(r, r["time"] - prev["time"]) for prev, r in zip(train, train[1:])]
    after = [(r, gap) for r, gap in gaps if r["time"] > at][:steps]
    if len(after) < steps:
        return None
    typical = {kind: median(gap for r, gap in gaps if synced(r) == kind) for kind in (False, True)}
    return max(0.0, max(gap - typical[synced(r)] for r, gap in after))


def standstills(
    train: list[dict[str, Any]], killed_at: float, join_at: float | None, period: int, back: int
) -> dict[str, Any]:
    """A side's standstill after the kill and for the join (None where it did not join), and their moments. The
    kill's window ends where the node is started again (``back`` steps after it), so that the new process's start
    (two cores shared by three nodes) is not counted to the kill."""
    w = window(period)
    return {
        "killed_at": killed_at,
        "join_at": join_at,
        "kill_standstill_s": standstill(train, killed_at, min(w, back)),
        "join_standstill_s": standstill(train, join_at, w) if join_at is not None else None,
    }


def ours(
    net: EmulatedNetwork, workdir: Path, port: int, steps: int, at: int, back: int, sync: list[str], period: int
) -> dict[str, Any]:
    overrides = [
        *sync,
        "trainer.on_failure=continue",
        f"trainer.max_steps={steps}",
        "trainer.eval_every=1000",
        "trainer.checkpoint_every=0",  # (the peer's worker writes none: no epoch-end checkpoint in the standstill)
    ]
    job = Job(net, workdir / "failures-ours", port, overrides, str(NODES), 0, epochs=100)
    try:
        job.wait_steps(at)
        killed_at = kill_node(job, job.node_of_rank(NODES - 1))
        job.wait_for(lambda: _events(job.metrics(), "rank_lost"), 120, "the loss")
        job.wait_steps(at + back)
        alone = [*torchrun(net, NODES - 1, "joiner", port + 1, nnodes=1)]
        joiner = [*alone, *job.train, "trainer.on_failure=continue", "trainer.join=true"]
        with open(job.run_dir / f"node{NODES - 1}.log", "a") as log:
            job.procs.append(net.popen(NODES - 1, joiner, cwd=ROOT, env=job.env, stdout=log, stderr=subprocess.STDOUT))
        job.wait_for(lambda: (job.summary() or {}).get("finished"), 600, "the run's end")
    finally:
        job.stop()
    metrics = job.metrics()
    train = [r for r in metrics if r["kind"] == "train"]
    numbers = [r["step"] for r in train]
    joined = _events(metrics, "rank_joined")
    join_at = joined[0]["time"] - joined[0]["admission_s"] if joined else None
    return {
        "side": "ours",
        **standstills(train, killed_at, join_at, period, back),
        "lost_steps": len(numbers) - len(set(numbers)),
        "world_sizes": _sizes(train, "world_size"),
        "median_step_s": median(r["step_s"] for r in train),
        "top1": job.summary()["top1"],
        "steps": len(set(numbers)),
    }


class Replicas:
    """torchft's side: a lighthouse and one replica group (a torchrun of one worker) per node."""

    def __init__(self, net: EmulatedNetwork, run_dir: Path, port: int, steps: int, peer: str, sync: list[str]):
        self.net, self.run_dir, self.port = net, run_dir, port
        run_dir.mkdir(parents=True)
        self.at = f"{net.address(0)}:{port}"
        with open(run_dir / "lighthouse.log", "w") as log:
            command = [*launch.lighthouse(2, self.at), "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)]
            net.popen(0, command, stdout=log, stderr=subprocess.STDOUT)
        overrides = ["experiment=network", *sync, f"trainer.max_steps={steps}"]
        self.command = launch.worker(peer, run_dir, overrides)
        self.procs: dict[int, subprocess.Popen] = {}
        for node in range(net.nodes):
            self.start(node)

    def start(self, node: int) -> None:
        env = {**node_env(), **launch.torchft_env(node, self.net.nodes, self.at, self.net.address(node)),
               "PEER_MIN_REPLICAS": "2", "PEER_TIMEOUT_S": "30"}  # fmt: skip
        rendezvous = torchrun(self.net, node, f"replica{node}-{time.monotonic_ns()}", self.port + 1 + node, nnodes=1)
        with open(self.run_dir / f"node{node}.log", "a") as log:
            self.procs[node] = self.net.popen(
                node, [*rendezvous, *self.command], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def metrics(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return read_metrics(str(path)) if path.exists() else []

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        """Until ``predicate()``; fails after ``timeout`` s, or as soon as every replica's torchrun has exited."""

        def done() -> bool:
            if predicate():
                return True
            codes = [proc.poll() for proc in self.procs.values()]
            if all(code is not None for code in codes):
                raise RuntimeError(f"torchft: every replica exited (status {codes}) before {what}")
            return False

        wait_until(done, timeout, lambda: f"torchft: {what} not within {timeout:.0f} s")

    def steps(self, size: int | None = None) -> int:
        """Steps the first replica completed (DDP: committed; with ``size``, by that many participants; local SGD
        and DiLoCo: trained, or, with ``size``, trained since the first synchronisation of that many)."""
        train = [r for r in self.metrics() if r["kind"] == "train"]
        if "committed" in (train[0] if train else {}) and "synced" not in train[0]:  # DDP's every record
            return len([r for r in train if r["committed"] and (size is None or r["participants"] == size)])
        if size is None:
            return len(train)
        first = next((i for i, r in enumerate(train) if r.get("synced") and r["participants"] == size), None)
        return 0 if first is None else len(train) - first

    def kill(self, node: int) -> float:
        out = subprocess.run(["pgrep", "-P", str(self.procs[node].pid)], capture_output=True, text=True).stdout
        now = time.time()
        os.killpg(self.procs[node].pid, signal.SIGKILL)
        for pid in map(int, out.split()):
            os.kill(pid, signal.SIGKILL)
        return now


def torchft(
    net: EmulatedNetwork, workdir: Path, port: int, steps: int, at: int, back: int, sync: list[str], period: int,
    peer: str,
) -> dict[str, Any]:  # fmt: skip
    replicas = Replicas(net, workdir / "failures-torchft", port, steps, peer, sync)
    try:
        replicas.wait_for(lambda: replicas.steps(NODES) >= at, 300, f"{at} steps of all {NODES}")
        killed_at = replicas.kill(NODES - 1)
        replicas.wait_for(lambda: replicas.steps() >= at + back, 300, f"{at + back} steps")
        started = time.time()
        replicas.start(NODES - 1)
        summary = lambda: [r for r in replicas.metrics() if r["kind"] == "summary"]  # noqa: E731
        replicas.wait_for(summary, 600, "the run's end")
    finally:
        net.stop_all(grace_s=2.0)
    metrics = replicas.metrics()
    train = [r for r in metrics if r["kind"] == "train"]
    ddp = peer == "torchft_ddp"
    votes = train if ddp else [r for r in train if r.get("synced")]
    if ddp:
        lost = sum(1 for r in train if not r["committed"])
    else:  # each failed vote throws away the steps since the vote before it
        lost, previous = 0, -1
        for r in votes:
            lost += 0 if r["committed"] else r["step"] - previous
            previous = r["step"]
    rejoined = next((r for r in votes if r["time"] > started and r["participants"] == NODES), None)
    join_at = rejoined["time"] - rejoined["step_s"] if rejoined else None  # (just before the step that took it in)
    return {
        "side": "torchft",
        "restarted_at": started,
        **standstills(train, killed_at, join_at, period, back),
        "lost_steps": lost,
        "world_sizes": _sizes([r for r in votes if r["committed"]], "participants", 1 if ddp else period),
        "median_step_s": median(r["step_s"] for r in train),
        "top1": next(r for r in metrics if r["kind"] == "summary")["top1"],
        "steps": len(train) - (lost if ddp else 0),
    }


def _sizes(train: list[dict[str, Any]], key: str, steps: int = 1) -> list[list[int]]:
    """[world size, steps at it] in the order they came (each record stands for ``steps`` steps: a
    synchronisation's vote for the period before it)."""
    runs: list[list[int]] = []
    for r in train:
        if runs and runs[-1][0] == r[key]:
            runs[-1][1] += steps
        else:
            runs.append([r[key], steps])
    return runs


def run(
    net: EmulatedNetwork, workdir: Path, port: int, steps: int, at: int, back: int, sync: list[str], period: int,
    peer: str, attempt: int = 0,
) -> list[dict[str, Any]]:  # fmt: skip
    """Both sides (``sync``: both sides' settings, ``period``: steps between synchronisations), ours first in even
    ``attempt``s and second in odd ones; a side that fails is reported with its error."""
    rows: list[dict[str, Any]] = []
    sides = {"ours": lambda p, d: ours(net, d, p, steps, at, back, sync, period),
             "torchft": lambda p, d: torchft(net, d, p, steps, at, back, sync, period, peer)}  # fmt: skip
    order = list(sides) if attempt % 2 == 0 else list(reversed(sides))
    for side in order:
        print(f"[{time.strftime('%H:%M:%S')}] failures: {side} (run {attempt + 1})", flush=True)
        try:
            rows.append({**sides[side](port + 10 * len(rows), workdir / f"run{attempt + 1}"), "attempt": attempt})
            print(f"  {rows[-1]}", flush=True)
        except (TimeoutError, RuntimeError) as error:
            print(f"  failed: {error}", flush=True)
            rows.append({"side": side, "error": str(error), "attempt": attempt})
    return rows


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per pair and side from the runs of each: the median of each standstill and of the top-1 (and every
    run's value), the most steps any run lost, the sizes of the first run that finished; a side none of whose runs
    finished keeps the first error."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r.get("pair", ""), r["side"])
        out.setdefault(key, {**{k: r[k] for k in ("pair", "ours_name", "peer_name", "side") if k in r}, "runs": []})
        out[key]["runs"].append(r)
    for row in out.values():
        done = [r for r in row["runs"] if "error" not in r]
        if not done:
            row["error"] = row["runs"][0]["error"]
            continue
        for name in ("kill_standstill_s", "join_standstill_s", "top1"):
            values = [r[name] for r in done if r.get(name) is not None]
            row[name], row[f"{name}_runs"] = (median(values) if values else None), values
        row["lost_steps"] = max(r["lost_steps"] for r in done)
        row["world_sizes"], row["finished"] = done[0]["world_sizes"], len(done)
        row["failed"] = [r["error"] for r in row["runs"] if "error" in r]
    return list(out.values())
