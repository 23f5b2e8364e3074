"""Failures and stops on an emulated 3-node cluster, measured (needs root): relaxsync's shrink in place and its
SIGTERM stop, beside torchrun's own recovery (restart every worker from the last checkpoint).

    sudo make bench-faults
    python -m bench.faults [--rate 1gbit] [--algorithms allreduce,dgc,localsgd] [--at-step 20] [--hang-timeout 10]
                           [--scenarios died,hung,sigterm,rejoin,join,torchrun]

Three namespaces of ``bench/netns.py`` on links of ``--rate``, one ``torchrun --nproc-per-node 1`` each (as
``bench/network`` starts them), training ``experiment=network`` (ResNet-10-T on digits at 76 px, 15 steps per
epoch with 3 nodes) for 3 epochs. Once the run has completed ``--at-step`` steps (mid-epoch 2):

- ``died/<sync>``: ``trainer.on_failure=continue``; ``kill -9`` of node 2's torchrun and of its worker.
- ``hung``: ``trainer.on_failure=continue``; SIGSTOP of node 2's worker, SIGCONT once the others went 10 steps on.
- ``sigterm``: SIGTERM to every node's torchrun (a preemption); then the same command with ``trainer.resume=auto``.
- ``rejoin``: ``torchrun --nnodes 2:3`` on two nodes; after ``--at-step`` steps the third starts with the same
  command and joins through torchrun's scale-up (the others stop at an agreed step and the world restarts at 3).
- ``join``: ``torchrun --nnodes 2`` with ``trainer.on_failure=continue`` on two nodes; after ``--at-step`` steps the
  third runs ``train.py trainer.join=true`` on the run dir and is admitted at an agreed step, nobody restarted.
- ``torchrun``: today's default, ``trainer.on_failure=abort`` under ``torchrun --nnodes 2:3 --max-restarts 1``
  with a checkpoint every epoch: ``kill -9`` of node 2; the agents restart the other two workers, which resume
  from the last checkpoint.

Per scenario: seconds from the failure to the moment the survivors saw it (``visible_s``) and to the next
completed step (``recovery_s``), steps trained before the failure that were trained again (``lost_steps``) and
their time (``lost_s``), whether the run reached its end and the survivors' replica spread. Results:
bench/results/faults.json and faults.md (``faults-<scenarios>.json`` for some of them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, machine, median, wait_until
from bench.netns import EmulatedNetwork, parse_rate, unavailable
from bench.network import node_env
from engine.metrics import read_metrics

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
NODES = 3
EPOCHS = 3
SCENARIOS = ("died", "hung", "sigterm", "rejoin", "join", "torchrun")


class Job:
    """One training run across the emulated nodes: a torchrun per node, logs and metrics in ``run_dir``."""

    def __init__(
        self,
        net: EmulatedNetwork,
        run_dir: Path,
        port: int,
        overrides: list[str],
        nnodes: str,
        restarts: int,
        nodes: int | None = None,
        environ: dict[str, str] | None = None,
        epochs: int = EPOCHS,
    ):
        """Start torchrun on the first ``nodes`` nodes (all by default); :meth:`start` starts another later."""
        self.net, self.run_dir, self.port, self.procs = net, run_dir, port, []
        self.nnodes, self.restarts = nnodes, restarts
        run_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**node_env(), **(environ or {})}
        self.train = [
            "train.py", "experiment=network", "logger=none", "trainer.progress=false", f"trainer.epochs={epochs}",
            "trainer.eval_every=1", f"trainer.run_dir={run_dir}", *overrides,
        ]  # fmt: skip
        for node in range(net.nodes if nodes is None else nodes):
            self.start(node)

    def start(self, node: int) -> None:
        """Node ``node``'s torchrun (the first hosts the rendezvous)."""
        launcher = [
            TORCHRUN, "--nnodes", self.nnodes, "--nproc-per-node", "1", "--max-restarts", str(self.restarts),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.net.address(0)}:{self.port}",
            "--rdzv-id", self.run_dir.name, "--rdzv-conf", f"is_host={int(node == 0)},last_call_timeout=1",
            "--local-addr", self.net.address(node), "--monitor-interval", "0.5",
        ]  # fmt: skip
        log = open(self.run_dir / f"node{node}.log", "a")
        self.procs.append(
            self.net.popen(node, [*launcher, *self.train], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        )

    def metrics(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return read_metrics(str(path)) if path.exists() else []

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.metrics() if r["kind"] == "train"]

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        wait_until(predicate, timeout, lambda: f"{self.run_dir.name}: {what} not within {timeout:.0f} s\n{self.tail()}")

    def wait_steps(self, n: int, timeout: float = 300) -> None:
        self.wait_for(lambda: len(self.steps()) >= n, timeout, f"{n} steps")

    def worker(self, node: int) -> int:
        """The pid of the worker that node's torchrun started (in a session of its own)."""
        out = subprocess.run(["pgrep", "-P", str(self.procs[node].pid)], capture_output=True, text=True).stdout
        pids = [int(p) for p in out.split()]
        for pid in pids:  # the worker, not a helper process: it has RANK in its environment
            with open(f"/proc/{pid}/environ", "rb") as f:
                if b"\0RANK=" in b"\0" + f.read():
                    return pid
        raise RuntimeError(f"no worker under node {node}'s torchrun ({pids})")

    def node_of_rank(self, rank: int) -> int:
        for node in range(len(self.procs)):
            with open(f"/proc/{self.worker(node)}/environ", "rb") as f:
                if f"\0RANK={rank}\0".encode() in b"\0" + f.read():
                    return node
        raise RuntimeError(f"no node runs rank {rank}")

    def summary(self) -> dict[str, Any] | None:
        return next((r for r in reversed(self.metrics()) if r["kind"] == "summary"), None)

    def tail(self, lines: int = 25) -> str:
        out = []
        for path in sorted(self.run_dir.glob("node*.log")):
            out.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    def stop(self) -> None:
        self.net.stop_all(grace_s=2.0)


def kill_node(job: Job, node: int) -> float:
    """``kill -9`` of a node's torchrun and its worker (a node gone at once); returns the wall time."""
    worker = job.worker(node)
    now = time.time()
    os.killpg(job.procs[node].pid, signal.SIGKILL)
    os.kill(worker, signal.SIGKILL)
    return now


def shrink_row(job: Job, failed_at: float, scenario: str) -> dict[str, Any]:
    """What the survivors recorded after a loss under ``on_failure=continue``."""
    job.wait_for(lambda: job.summary() is not None, 600, "the survivors' summary")
    metrics = job.metrics()
    lost = next(r for r in metrics if r["kind"] == "event" and r["event"] == "rank_lost")
    steps = [r["step"] for r in metrics if r["kind"] == "train"]
    summary = job.summary()
    return {
        "scenario": scenario,
        "cause": lost["cause"],
        "visible_s": lost["detected_at"] - failed_at,
        "recovery_s": lost["detected_at"] + lost["recovery_s"] - failed_at,
        "lost_steps": len(steps) - len(set(steps)),  # steps recorded twice were trained twice
        "lost_s": 0.0 if len(steps) == len(set(steps)) else float("nan"),
        "redo": lost["redo"],
        "lost_state_bytes": lost["lost_state_bytes"],
        "finished": bool(summary and summary["finished"]),
        "steps_in_order": steps == list(range(len(steps))),
        "replica_spread": summary["replica_spread"] if summary else None,
        "world_size": summary["world_size"] if summary else None,
    }


def died(net: EmulatedNetwork, args: argparse.Namespace, workdir: Path, port: int, sync: str) -> dict[str, Any]:
    job = Job(net, workdir / f"died-{sync}", port, [f"sync={sync}", "trainer.on_failure=continue"], str(NODES), 0)
    try:
        job.wait_steps(args.at_step)
        failed_at = kill_node(job, job.node_of_rank(NODES - 1))
        return shrink_row(job, failed_at, f"died ({sync})")
    finally:
        job.stop()


def hung(net: EmulatedNetwork, args: argparse.Namespace, workdir: Path, port: int) -> dict[str, Any]:
    overrides = ["trainer.on_failure=continue", f"trainer.hang_timeout_s={args.hang_timeout}"]
    job = Job(net, workdir / "hung", port, overrides, str(NODES), 0)
    try:
        job.wait_steps(args.at_step)
        node = job.node_of_rank(NODES - 1)
        worker = job.worker(node)
        os.kill(worker, signal.SIGSTOP)
        failed_at = time.time()
        job.wait_steps(args.at_step + 10, timeout=args.hang_timeout + 300)
        os.kill(worker, signal.SIGCONT)
        row = shrink_row(job, failed_at, "hung")
        log = (job.run_dir / f"node{node}.log").read_text(errors="replace")
        row["woken_exits_cleanly"] = "was removed from the run as hung" in log
        return row
    finally:
        job.stop()


def rejoin(net: EmulatedNetwork, args: argparse.Namespace, workdir: Path, port: int) -> dict[str, Any]:
    """Two nodes under ``--nnodes 2:3``, then the third started with the same command: its agents stop the world
    (SIGTERM), which checkpoints at an agreed step and restarts one larger from there."""
    environ = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # (docs/failures.md: a shared store breaks a later join)
    job = Job(net, workdir / "rejoin", port, [], f"{NODES - 1}:{NODES}", 0, nodes=NODES - 1, environ=environ)
    try:
        job.wait_steps(args.at_step)
        started = time.time()
        job.start(NODES - 1)
        job.wait_for(lambda: (job.summary() or {}).get("finished"), 600, "the grown world's end")
        metrics = job.metrics()
        train = [r for r in metrics if r["kind"] == "train"]
        before = [r for r in train if r["world_size"] == NODES - 1]
        after = [r for r in train if r["world_size"] == NODES]
        resume = next(r for r in metrics if r["kind"] == "event" and r["event"] == "resume")
        steps = [r["step"] for r in train]
        return {
            "scenario": "rejoin",
            "recovery_s": after[0]["time"] - started,  # from the third node's start to its first step
            "paused_s": after[0]["time"] - before[-1]["time"],  # no step completed in between
            "stopped_at_step": resume["step"],
            "lost_steps": len(steps) - len(set(steps)),
            "steps_in_order": steps == list(range(len(steps))),
            "world_sizes": [resume["world_size_before"], job.summary()["world_size"]],
            "finished": True,
        }
    finally:
        job.stop()


def join(net: EmulatedNetwork, args: argparse.Namespace, workdir: Path, port: int) -> dict[str, Any]:
    """Two nodes under ``torchrun --nnodes 2`` with ``trainer.on_failure=continue``; after ``--at-step`` steps the third
    node runs ``train.py trainer.join=true`` on the run dir: admitted at an agreed step, nobody restarted."""
    # Two epochs more than the others: the joining process starts its interpreter and builds its model while two
    # nodes train on two cores (~1 min here), where a node of a cluster has cores of its own.
    overrides = ["trainer.on_failure=continue"]
    job = Job(net, workdir / "join", port, overrides, str(NODES - 1), 0, nodes=NODES - 1, epochs=EPOCHS + 2)
    try:
        job.wait_steps(args.at_step)
        started = time.time()
        # A torchrun of its own on the third node (a rendezvous of one, on its address), with trainer.join=true.
        alone = [
            TORCHRUN, "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "joiner",
            "--rdzv-endpoint", f"{net.address(NODES - 1)}:{port + 1}", "--local-addr", net.address(NODES - 1),
            "--rdzv-conf", "is_host=1",
        ]  # fmt: skip
        joiner = [*alone, *job.train, "trainer.on_failure=continue", "trainer.join=true"]
        log = open(job.run_dir / f"node{NODES - 1}.log", "a")
        job.procs.append(net.popen(NODES - 1, joiner, cwd=ROOT, env=job.env, stdout=log, stderr=subprocess.STDOUT))
        job.wait_for(lambda: (job.summary() or {}).get("finished"), 600, "the grown world's end")
        metrics = job.metrics()
        train = [r for r in metrics if r["kind"] == "train"]
        before = [r for r in train if r["world_size"] == NODES - 1]
        after = [r for r in train if r["world_size"] == NODES]
        joined = next((r for r in metrics if r["kind"] == "event" and r["event"] == "rank_joined"), None)
        if joined is None:
            raise RuntimeError(f"the run ended without admitting the third node\n{job.tail()}")
        steps, step_s = [r["step"] for r in train], sorted(r["step_s"] for r in train)
        return {
            "scenario": "join",
            "recovery_s": after[0]["time"] - started,  # from the third node's start to its first step
            "paused_s": after[0]["time"] - before[-1]["time"],  # no step completed in between
            "median_step_s": step_s[len(step_s) // 2],
            "admission_s": joined["admission_s"],  # the members' time in the admission itself, and its parts
            "admission": {k: joined.get(k) for k in ("settle_s", "group_s", "pack_s", "reshape_s")},
            "joined_at_step": joined["step"],
            "lost_steps": len(steps) - len(set(steps)),
            "steps_in_order": steps == list(range(len(steps))),
            "world_sizes": [NODES - 1, job.summary()["world_size"]],
            "replica_spread": job.summary()["replica_spread"],
            "finished": True,
        }
    finally:
        job.stop()


def sigterm(net: EmulatedNetwork, args: argparse.Namespace, workdir: Path, port: int) -> dict[str, Any]:
    run_dir = workdir / "sigterm"
    job = Job(net, run_dir, port, [], str(NODES), 0)
    try:
        job.wait_steps(args.at_step)
        signalled = time.time()
        for proc in job.procs:
            os.killpg(proc.pid, signal.SIGTERM)
        codes = [proc.wait(timeout=120) for proc in job.procs]
        exited_s = time.time() - signalled
    finally:
        job.stop()
    stopped = job.summary() or {}
    trained = len(job.steps())  # steps completed before the stop
    resumed = Job(net, run_dir, port + 1, ["trainer.resume=auto"], str(NODES), 0)
    try:
        resumed.wait_for(lambda: (resumed.summary() or {}).get("finished"), 600, "the resumed run's end")
    finally:
        resumed.stop()
    metrics = resumed.metrics()
    resume = next(r for r in metrics if r["kind"] == "event" and r["event"] == "resume")
    steps = [r["step"] for r in metrics if r["kind"] == "train"]
    return {
        "scenario": "sigterm",
        "exit_codes": codes,
        "stopped_at_step": stopped.get("steps"),
        "exited_s": exited_s,
        "resumed_at_step": resume["step"],
        "lost_steps": trained - resume["step"],  # trained before the stop, not in the checkpoint
        "steps_in_order": steps == list(range(len(steps))),
        "finished": bool(resumed.summary()["finished"]),
    }


def torchrun_restart(net: EmulatedNetwork, args: argparse.Namespace, workdir: Path, port: int) -> dict[str, Any]:
    job = Job(net, workdir / "torchrun", port, ["trainer.checkpoint_every=1"], f"2:{NODES}", 1)
    try:
        job.wait_steps(args.at_step)
        before = job.steps()
        failed_at = kill_node(job, job.node_of_rank(NODES - 1))
        job.wait_for(
            lambda: any(r["kind"] == "event" and r["event"] == "resume" for r in job.metrics()),
            600,
            "the restarted workers' resume",
        )
        resume = next(r for r in job.metrics() if r["kind"] == "event" and r["event"] == "resume")
        job.wait_for(lambda: job.steps()[-1]["time"] > resume["time"], 300, "a step after the restart")
        after = next(r for r in job.steps() if r["time"] > resume["time"])
        job.wait_for(lambda: job.summary() is not None, 600, "the restarted run's end")
        trained = max(r["step"] for r in before if r["time"] < failed_at) + 1
        step_s = median(r["step_s"] for r in before)
        lost = trained - resume["step"]
        return {
            "scenario": "torchrun restart",
            "recovery_s": after["time"] - failed_at,
            "lost_steps": lost,
            "lost_s": lost * step_s,
            "resumed_at_step": resume["step"],
            "finished": bool(job.summary()["finished"]),
            "world_size": job.summary()["world_size"],
        }
    finally:
        job.stop()


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def num(value: Any, fmt: str = "{:.1f}") -> str:
        return "–" if value is None or value != value else fmt.format(value)

    lines = [
        "| scenario | failure visible after (s) | next step after (s) | lost steps | lost time (s) | redone | "
        "run finished | replica spread |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['scenario']} | failed: {(r['error'].splitlines() or [''])[0][:100]} |||||||")
            continue
        redo = r.get("redo") or {
            "sigterm": "stop at an agreed step",
            "rejoin": f"stop at an agreed step, restart at {r.get('world_sizes', ['?', '?'])[1]} nodes",
            "join": f"admitted at an agreed step, {r.get('world_sizes', ['?', '?'])[1]} nodes, nobody restarted",
        }.get(r["scenario"], "from the checkpoint")
        lines.append(
            f"| {r['scenario']} | {num(r.get('visible_s'))} | {num(r.get('recovery_s'))} | {r['lost_steps']} | "
            f"{num(r.get('lost_s'))} | {redo} | {'yes' if r['finished'] else 'no'} | "
            f"{num(r.get('replica_spread'), '{:g}')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="1gbit", help="every link's rate (tc units, or unlimited)")
    parser.add_argument("--algorithms", default="allreduce,dgc,localsgd", help="sync options of the died scenario")
    parser.add_argument("--at-step", type=int, default=20, help="the failure comes after this many steps")
    parser.add_argument("--hang-timeout", type=float, default=10.0, help="trainer.hang_timeout_s of the hung scenario")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"which of {', '.join(SCENARIOS)}")
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    parse_rate(args.rate)
    chosen = args.scenarios.split(",")
    if any(c not in SCENARIOS for c in chosen):
        parser.error(f"--scenarios={args.scenarios}: each must be one of {', '.join(SCENARIOS)}")
    reason = unavailable()
    if reason:
        print(f"bench.faults: skipped: {reason}", flush=True)
        return 0
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="relaxsync-faults-"))
    runs = {
        "died": [
            (f"died ({s})", lambda net, port, s=s: died(net, args, workdir, port, s))
            for s in args.algorithms.split(",")
        ],
        "hung": [("hung", lambda net, port: hung(net, args, workdir, port))],
        "sigterm": [("sigterm", lambda net, port: sigterm(net, args, workdir, port))],
        "rejoin": [("rejoin", lambda net, port: rejoin(net, args, workdir, port))],
        "join": [("join", lambda net, port: join(net, args, workdir, port))],
        "torchrun": [("torchrun restart", lambda net, port: torchrun_restart(net, args, workdir, port))],
    }
    scenarios = [run for name in SCENARIOS if name in chosen for run in runs[name]]
    rows = []
    try:
        with EmulatedNetwork(NODES) as net:
            net.shape(args.rate if args.rate != "unlimited" else None)
            for i, (name, scenario) in enumerate(scenarios):
                print(f"bench.faults: {name}", flush=True)
                try:
                    rows.append(scenario(net, args.port + 2 * i))
                except (TimeoutError, RuntimeError, StopIteration, subprocess.TimeoutExpired) as error:
                    rows.append({"scenario": name, "error": str(error)})
                    print(f"bench.faults: {name} failed: {error}", flush=True)
                print(json.dumps(rows[-1], default=str), flush=True)
    except KeyboardInterrupt:
        print("bench.faults: interrupted; processes stopped and namespaces removed", flush=True)
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    command = "python -m bench.faults " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "benchmark": "faults",
        "command": command.strip(),
        "machine": machine(),
        "rate": args.rate,
        "hang_timeout_s": args.hang_timeout,
        "wall_s": time.perf_counter() - started,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "faults.json" if set(chosen) == set(SCENARIOS) else f"faults-{'-'.join(chosen)}.json"
    (out / name).write_text(json.dumps(result, indent=1, default=str) + "\n")
    text = table(rows, args)
    (out / name.replace(".json", ".md")).write_text(text + "\n")
    print(text)
    print(f"bench.faults: {result['wall_s'] / 60:.1f} min; results in {out}/{name} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
