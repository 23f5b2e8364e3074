"""Ours beside what a user would pick instead, on the same job, in one invocation (needs root and the peers extra).

    pip install -r requirements-peers.txt && sudo make bench-peers
    python -m bench.peers [--nodes 2,4] [--rates 1gbit,100mbit] [--pairs allreduce,powersgd,localsgd,...]
                          [--warmup 4] [--window 16] [--compare 20]
    python -m bench.peers --procs 2 --nodes 2 --rates 1gbit --no-failures   # nodes of 2 processes

The job is bench/network's (``experiment=network``: ResNet-10-T on digits at 76 px, batch 32 per node, momentum
SGD) on its emulated nodes (``bench/netns.py``, one process per node). Each pair is one run of ours
(``train.py``, one ``torchrun --nnodes N``) and one of the peer (``bench/peers/worker.py``: our data, model,
optimizer, schedule and seeds, the peer's sync; torch's peers as one torchrun across the nodes, torchft's as one
replica group per node on a lighthouse in the first node), side by side at each link rate, with a compute-only
floor (``sync=none``) at that rate. Ours and the peer alternate which runs first from one pair to the next.

Per run: mean step time over steps [warmup, warmup + window) and over the floor's, bytes the first node's
interface sent per step over the same steps (both counted the same way, by the kernel: torchft counts none of its
own), the loss of the first replica at every step, and the top-1 of the replicas' average at the end. Where the
pair's update is the same math (:data:`PAIRS`), the loss curves are compared over the first ``--compare`` steps.
Results: bench/results/peers.json and peers.md.

``--procs 2``: nodes of 2 processes (a node's batch of 32 split between them), ours at ``sync.scope=node`` beside
PyTorch's ``HierarchicalModelAverager`` (gradients averaged in the node every step by the post-local-SGD hook over
the node's subgroup, parameters over every process each period) and torchft with one replica group of 2 per node
(DDP inside, LocalSGD or DiLoCo across the groups); results in peers_nodes.json and peers_nodes.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import RESULTS, machine
from bench.netns import IFACE, EmulatedNetwork, unavailable
from bench.network import CellFailed, node_env, run_job, run_nodes, torchrun
from bench.peers import failures, launch
from bench.peers.worker import TORCH_PEERS

POWERSGD = ("sync=powersgd", "sync.start_powerSGD_iter=2")
LOCALSGD = ["sync=localsgd", "sync.begin_step=0", "sync.k_steps=4", "sync.average_buffers=false"]
# HierarchicalModelAverager averages after the steps its period divides (from warmup_steps on): ours after step
# begin + k - 1 and every k after, the same steps where begin = 1 (mod k).
HIERARCHICAL = ["sync=localsgd", "sync.begin_step=1", "sync.k_steps=4", "sync.average_buffers=false"]


@dataclass(frozen=True)
class Pair:
    ours: str  # what the table calls ours
    overrides: tuple[str, ...]  # ours, and the peer's settings (read from the same config)
    peer: str  # bench.peers.worker's name of the peer
    peer_name: str
    same_math: str = ""  # why the updates are the same; empty: they differ by design (``differs`` says how)
    differs: str = ""
    period: int = 1  # steps from one synchronisation to the next


PAIRS: dict[str, Pair] = {
    "allreduce": Pair(
        "allreduce",
        ("sync=allreduce",),
        "ddp",
        "torch DDP",
        same_math="both average gradients every step (DDP: stock arguments, BN buffers broadcast from rank 0)",
    ),
    "allreduce_torchft": Pair(
        "allreduce",
        ("sync=allreduce",),
        "torchft_ddp",
        "torchft DDP",
        same_math="both average gradients every step; torchft adds a quorum and a commit vote per step",
    ),
    "powersgd": Pair(
        "PowerSGD r=1",
        POWERSGD,
        "ddp_powersgd",
        "DDP + powerSGD_hook",
        differs="the same hook and arguments, but stock DDP lays its buckets out again after step 1 (in the order "
        "gradients became ready) and overlaps a bucket's exchange with the rest of the backward pass; ours keeps them "
        "in parameter order (a resumed run ends bit for bit where an uninterrupted one does) and finishes each "
        "bucket before the next. PowerSGD draws its first Q per bucket: the two draw different ones",
    ),
    "powersgd_fixed": Pair(
        "PowerSGD r=1",
        POWERSGD,
        "ddp_powersgd_fixed",
        "DDP + powerSGD_hook, buckets as ours",
        same_math="ours is torch's powerSGD_hook on DDP; this peer lays DDP's buckets out in parameter order and "
        "broadcasts no BN buffers, as ours does",
    ),
    "localsgd": Pair(
        "local SGD k=4",
        tuple(LOCALSGD),
        "torchft_localsgd",
        "torchft LocalSGD",
        same_math="both average the parameters after every 4th step (ours without BN buffers, as torchft)",
        period=4,
    ),
    "post_localsgd": Pair(
        "local SGD k=4",
        tuple(LOCALSGD),
        "post_localsgd",
        "PostLocalSGDOptimizer",
        same_math="PeriodicModelAverager(period=4, warmup_steps=3): its first averaging after step 3, as ours",
        period=4,
    ),
    "hierarchical": Pair(
        "local SGD k=4",
        tuple(HIERARCHICAL),
        "hierarchical_localsgd",
        "HierarchicalModelAverager",
        same_math="both average gradients in the node every step (over all processes at step 0) and parameters across "
        "every process after steps 4, 8, ...; ours sends each node's average once across nodes, torch's averager "
        "every process's",
        period=4,
    ),
    "diloco": Pair(
        "DiLoCo H=16",
        ("sync=diloco", "sync.inner_steps=16", "sync.average_buffers=false"),
        "torchft_diloco",
        "torchft DiLoCo",
        same_math="both take outer Nesterov SGD (0.7, 0.9) on the averaged pseudo-gradient every 16 steps",
        period=16,
    ),
}
FLOOR = ("sync=none",)
NODE_PAIRS = ("hierarchical", "localsgd", "diloco")  # (--procs > 1: what has a peer with nodes of processes)
NODE_BATCH = 32  # experiment=network's batch: one process per node


@dataclass
class Cell:
    nodes: int
    rate: str
    tries: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # "ours:<overrides>", "peer:<name>", "floor"

    def run(self, key: str) -> dict[str, Any]:
        return median_run(self.tries[key])


class Jobs:
    """The runs of one invocation, each with its own name, rendezvous port and run dir."""

    def __init__(self, args: argparse.Namespace, steps: int, workdir: Path):
        self.args, self.steps, self.workdir, self.count = args, steps, workdir, 0

    def _next(self, cell: Cell) -> tuple[str, int]:
        self.count += 1
        return f"n{cell.nodes}-{cell.rate}-{self.count}", self.args.port + 3 * self.count

    def ours(self, net: EmulatedNetwork, cell: Cell, overrides: tuple[str, ...]) -> Callable[[], dict[str, Any]]:
        name, port = self._next(cell)
        a = self.args
        own = ["experiment=network", *overrides, *per_node(a.procs)]
        if a.procs > 1:
            own.append("sync.scope=node")
        return lambda: run_job(net, own, self.steps, name, port, self.workdir, a.cell_timeout, procs=a.procs)

    def peer(self, net: EmulatedNetwork, cell: Cell, pair: Pair) -> Callable[[], dict[str, Any]]:
        name, port = self._next(cell)
        a = self.args
        return lambda: run_peer(net, pair, self.steps, name, port, self.workdir, a.cell_timeout, a.procs)


def per_node(procs: int) -> list[str]:
    """The node's batch split among its processes."""
    return [] if procs == 1 else [f"data.batch_size={NODE_BATCH // procs}"]


def summary(out: dict[str, Any], warmup: int, window: int) -> dict[str, Any]:
    """A run's numbers: steady-state step time and bytes on the first node's interface, losses, final top-1."""
    train = [r for r in out["metrics"] if r["kind"] == "train"]
    steady = [r for r in train if warmup <= r["step"] < warmup + window]
    if len(steady) < window:
        raise CellFailed(f"only {len(steady)} steady-state steps recorded, expected {window}")
    end = next(r for r in reversed(out["metrics"]) if r["kind"] == "summary")
    return {
        "step_s": sum(r["step_s"] for r in steady) / window,
        "wire_bytes_per_step": sum(r["wire_bytes"] for r in steady) / window,
        "losses": [r["loss"] for r in train],
        "top1": end["top1"],
        "wall_s": out["wall_s"],
    }


def run_peer(
    net: EmulatedNetwork,
    pair: Pair,
    steps: int,
    job_id: str,
    port: int,
    workdir: Path,
    timeout_s: float,
    procs: int = 1,
) -> dict[str, Any]:
    """The peer of ``pair`` on every node of ``net`` (``procs`` processes each): one torchrun across them (torch) or
    one per node and a lighthouse on the first (torchft)."""
    run_dir = workdir / job_id
    run_dir.mkdir(parents=True)
    overrides = ["experiment=network", f"trainer.max_steps={steps}", f"trainer.netdev={IFACE}", *pair.overrides]
    command = launch.worker(pair.peer, run_dir, [*overrides, *per_node(procs)])
    if pair.peer in TORCH_PEERS:
        commands = [[*torchrun(net, node, job_id, port, procs=procs), *command] for node in range(net.nodes)]
        return run_nodes(net, run_dir, commands, [node_env()] * net.nodes, timeout_s)
    at = f"{net.address(0)}:{port + 1}"
    with open(run_dir / "lighthouse.log", "w") as log:  # (stopped with the nodes' processes)
        net.popen(0, launch.lighthouse(net.nodes, at), stdout=log, stderr=subprocess.STDOUT)
    envs = [{**node_env(), **launch.torchft_env(node, net.nodes, at, net.address(node))} for node in range(net.nodes)]
    commands = [
        [*torchrun(net, node, f"{job_id}-{node}", port, nnodes=1, procs=procs), *command] for node in range(net.nodes)
    ]
    return run_nodes(net, run_dir, commands, envs, timeout_s)


def measure(
    key: str, job: Callable[[], dict[str, Any]], cell: Cell, args: argparse.Namespace, label: str, attempt: int
) -> None:
    """Run ``job`` for ``key`` once per attempt (ours is shared by the pairs that name the same overrides)."""
    tries = cell.tries.setdefault(key, [])
    if len(tries) > attempt:
        return
    of = f"  ({attempt + 1} of {args.repeats})" if args.repeats > 1 else ""
    print(f"[{time.strftime('%H:%M:%S')}] {cell.nodes} nodes {cell.rate:>8}  {label}{of}", flush=True)
    try:
        tries.append(summary(job(), args.warmup, args.window))
        print(f"  {tries[-1]['step_s']:.3f} s/step, {tries[-1]['wire_bytes_per_step'] / 1e6:.2f} MB/step on the wire, "
              f"top-1 {tries[-1]['top1']:.2f}%", flush=True)  # fmt: skip
    except CellFailed as error:
        print(f"  failed: {error}", flush=True)
        tries.append({"error": str(error)})


def median_run(tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median step time, with every run's step time beside it."""
    good = sorted((t for t in tries if "error" not in t), key=lambda t: t["step_s"])
    if not good:
        return tries[0]
    return {
        **good[(len(good) - 1) // 2],
        "step_s_runs": [t["step_s"] for t in good],
        "failed_runs": len(tries) - len(good),
    }


def agreement(ours: list[float], peer: list[float], steps: int) -> dict[str, Any]:
    """How far the peer's first ``steps`` losses are from ours: the first step at which they differ, by how much
    there (relative), and the largest relative difference over the steps. Two updates that round differently part
    by one rounding and then grow apart, as training amplifies any perturbation (a one-ulp difference in DiLoCo's
    outer step became 3e-3 of the loss three steps later on digits): where the math is the same, the first
    difference is the one to read."""
    pairs = list(zip(ours[:steps], peer[:steps]))
    rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in pairs]
    first = next((i for i, r in enumerate(rel) if r > 0), None)
    return {
        "steps": len(pairs),
        "first_differs_at": first,
        "first_rel": rel[first] if first is not None else 0.0,
        "max_abs": max(abs(a - b) for a, b in pairs),
        "max_rel": max(rel),
    }


def compare(cell: Cell, key: str, pair: Pair, args: argparse.Namespace) -> dict[str, Any]:
    ours, peer, floor = cell.run(f"ours:{pair.overrides}"), cell.run(f"peer:{pair.peer}"), cell.run("floor")
    row: dict[str, Any] = {"nodes": cell.nodes, "rate": cell.rate, "pair": key, "ours_name": pair.ours,
                           "peer_name": pair.peer_name, "ours": ours, "peer": peer}  # fmt: skip
    if "error" in ours or "error" in peer:
        return row
    row["ours_over_peer"] = ours["step_s"] / peer["step_s"]
    if "error" not in floor:
        row["ours_x_floor"], row["peer_x_floor"] = ours["step_s"] / floor["step_s"], peer["step_s"] / floor["step_s"]
    if pair.same_math:
        row["agreement"] = agreement(ours["losses"], peer["losses"], args.compare)
    return row


def runs(side: dict[str, Any]) -> str:
    """How many runs a row's step time is the median of, where more than one."""
    n = len(side.get("step_s_runs") or [])
    return f" (median of {n})" if n > 1 else ""


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        "| nodes | link | ours | peer | s/step ours (× floor) | s/step peer (× floor) | ours / peer | MB/step on the "
        f"wire, ours / peer | top-1 ours / peer | losses over the first {args.compare} steps (relative difference) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['nodes']} | {r['rate']} | {r['ours_name']} | {r['peer_name']} |"
        if "ours_over_peer" not in r:
            failed = [side for side in ("ours", "peer") if "error" in r[side]]
            lines.append(f"{head} failed: {', '.join(failed)} ||||||")
            continue
        o, p = r["ours"], r["peer"]
        floor = {side: f" ({r[side + '_x_floor']:.2f}×)" if side + "_x_floor" in r else "" for side in ("ours", "peer")}
        agree = "differs by design"
        if "agreement" in r:
            a = r["agreement"]
            agree = (
                "identical"
                if a["max_abs"] == 0
                else (f"from step {a['first_differs_at']} ({a['first_rel']:.0e}); max {a['max_rel']:.0e}")
            )
        lines.append(
            f"{head} {o['step_s']:.3f}{floor['ours']} | {p['step_s']:.3f}{floor['peer']} | {r['ours_over_peer']:.2f}"
            f"{runs(o)} | "
            f"{o['wire_bytes_per_step'] / 1e6:.2f} / {p['wire_bytes_per_step'] / 1e6:.2f} | "
            f"{o['top1']:.2f} / {p['top1']:.2f} | {agree} |"
        )
    return "\n".join(lines)


def failure_table(rows: list[dict[str, Any]]) -> str:
    def seconds(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}"

    lines = [
        "| algorithm | side | standstill after the kill, s | lost steps | standstill for the join, s | "
        "steps at each size | top-1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        side = r.get("ours_name", "") if r["side"] == "ours" else r.get("peer_name", r["side"])
        name = f"| {r.get('ours_name', '')} | {'ours' if r['side'] == 'ours' else side} |"
        if "error" in r:
            lines.append(f"{name} failed: {r['error'][:120]} |||||")
            continue
        sizes = ", ".join(f"{n} × {size}" for size, n in r["world_sizes"])
        failed = f" ({len(r['failed'])} run(s) failed)" if r.get("failed") else ""
        kill, join = (seconds(r[k]) + each_run(r, k) for k in ("kill_standstill_s", "join_standstill_s"))
        lines.append(f"{name} {kill} | {r['lost_steps']} | {join} | {sizes} | {r['top1']:.2f}%{failed} |")
    return "\n".join(lines)


def each_run(row: dict[str, Any], name: str) -> str:
    """Each run's value of a median shown, where there was more than one."""
    values = row.get(f"{name}_runs", [])
    return f" ({', '.join(f'{v:.2f}' for v in values)})" if len(values) > 1 else ""


def report(out: Path, args: argparse.Namespace) -> int:
    """Compare the losses of a finished run's rows again and write its tables (``--compare`` steps)."""
    result = json.loads((out / f"{args.name}.json").read_text())
    for row in result["rows"]:
        pair = PAIRS.get(row["pair"])
        if pair is not None and pair.same_math and "ours_over_peer" in row:
            row["agreement"] = agreement(row["ours"]["losses"], row["peer"]["losses"], args.compare)
    write(out, args.name, result, table(result["rows"], args))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="2,4", help="node counts, each its own emulated network")
    parser.add_argument("--rates", default="1gbit,100mbit", help="link rates")
    parser.add_argument("--pairs", help=f"of {', '.join(PAIRS)} (default: all; --procs > 1: {','.join(NODE_PAIRS)})")
    parser.add_argument("--procs", type=int, default=1, help="processes per node (> 1: ours at sync.scope=node)")
    parser.add_argument("--warmup", type=int, default=4, help="steps before the steady state")
    parser.add_argument("--window", type=int, default=16, help="steady-state steps (step time, bytes)")
    parser.add_argument("--compare", type=int, default=20, help="steps whose losses are compared")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every cell (alternating order; median run)")
    parser.add_argument("--failures", action=argparse.BooleanOptionalAction, default=True,
                        help="also a node killed and back, ours beside torchft's DDP (3 nodes)")  # fmt: skip
    parser.add_argument("--failure-rate", default="1gbit", help="the links' rate in the failure runs")
    parser.add_argument("--failure-pairs", default="allreduce_torchft,localsgd,diloco",
                        help="pairs whose peer is torchft's, each run with a node killed and back")  # fmt: skip
    parser.add_argument("--failure-steps", type=int, default=130,
                        help="steps of each failure run (two periods after the join, for its standstill)")  # fmt: skip
    parser.add_argument("--failure-repeats", type=int, default=3,
                        help="runs of each failure pair (alternating which side runs first; medians)")  # fmt: skip
    parser.add_argument("--kill-at", type=int, default=20, help="a node is killed after this many steps")
    parser.add_argument("--back-after", type=int, default=20, help="and comes back this many steps later")
    parser.add_argument("--failure-device-s", type=float, default=0.0,
                        help="seconds of device time per step in the failure runs, both sides: a sleep before each "
                        "forward, as a GPU's compute leaves the host's cores free (0: none)")  # fmt: skip
    parser.add_argument("--report", action="store_true", help="the tables again from --out's peers.json")
    parser.add_argument("--port", type=int, default=29800)
    parser.add_argument("--cell-timeout", type=float, default=600.0, help="seconds for one run")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    args.nodes = [int(n) for n in args.nodes.split(",") if n]  # (--nodes "": the failure runs alone)
    if args.procs < 1 or NODE_BATCH % args.procs:
        parser.error(f"--procs={args.procs}: a divisor of the node's batch, {NODE_BATCH}")
    args.rates = args.rates.split(",")
    default = [k for k in PAIRS if k != "hierarchical"] if args.procs == 1 else NODE_PAIRS  # (one level, or two)
    args.pairs = args.pairs.split(",") if args.pairs else list(default)
    args.name = "peers" if args.procs == 1 else "peers_nodes"
    if args.procs > 1 and args.failures:
        parser.error("--procs > 1: the failure runs have one process per node; add --no-failures")
    unknown = [p for p in args.pairs if p not in PAIRS]
    if unknown:
        parser.error(f"--pairs: {', '.join(unknown)} not one of {', '.join(PAIRS)}")
    args.failure_pairs = [p for p in args.failure_pairs.split(",") if p]
    torchft = [k for k, pair in PAIRS.items() if pair.peer.startswith("torchft_")]
    unknown = [p for p in args.failure_pairs if p not in torchft]
    if unknown:
        parser.error(f"--failure-pairs: {', '.join(unknown)} not one of {', '.join(torchft)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        return report(Path(args.out), args)
    why = unavailable()
    if why is not None:
        print(f"bench.peers: skipped: {why}")
        return 0
    try:
        import torchft  # noqa: F401
    except ImportError:
        print("bench.peers: skipped: torchft is not installed (pip install -r requirements-peers.txt)")
        return 0
    steps, rows, started = max(args.warmup + args.window, args.compare), [], time.perf_counter()
    jobs = Jobs(args, steps, Path(tempfile.mkdtemp(prefix="relaxsync-peers-")))
    for nodes in args.nodes:
        with EmulatedNetwork(nodes) as net:
            for rate in args.rates:
                net.shape(rate)
                cell = Cell(nodes, rate)
                for attempt in range(args.repeats):  # rounds in alternating order: no side always runs first
                    measure("floor", jobs.ours(net, cell, FLOOR), cell, args, "floor (sync=none)", attempt)
                    for i, key in enumerate(args.pairs):
                        pair = PAIRS[key]
                        ours = (f"ours:{pair.overrides}", jobs.ours(net, cell, pair.overrides), f"ours: {pair.ours}")
                        peer = (f"peer:{pair.peer}", jobs.peer(net, cell, pair), f"peer: {pair.peer_name}")
                        sides = [ours, peer]
                        for run_key, job, label in sides if (i + attempt) % 2 == 0 else reversed(sides):
                            measure(run_key, job, cell, args, label, attempt)
                rows += [compare(cell, key, PAIRS[key], args) for key in args.pairs]
    command = ("python -m bench.peers " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = {"command": command, "machine": machine()}
    if rows:
        result = {
            "benchmark": "peers", **head, "steps": steps, "warmup": args.warmup, "window": args.window,
            "procs_per_node": args.procs, "scope": "node" if args.procs > 1 else "process",
            "repeats": args.repeats, "wall_s": time.perf_counter() - started,
            "pairs": {k: vars(PAIRS[k]) for k in args.pairs}, "rows": rows,
        }  # fmt: skip
        write(out, args.name, result, table(rows, args))
    if args.failures:
        started = time.perf_counter()
        failed = []
        device = failures.device_time(args.failure_device_s)
        with EmulatedNetwork(failures.NODES) as net:
            net.shape(args.failure_rate)
            for attempt in range(args.failure_repeats):
                for i, key in enumerate(args.failure_pairs):
                    pair = PAIRS[key]
                    print(f"bench.peers: failures, {pair.ours} beside {pair.peer_name}", flush=True)
                    rows = failures.run(
                        net, jobs.workdir / f"failures-{key}", args.port + 2000 + 100 * i + 20 * attempt,
                        args.failure_steps, args.kill_at, args.back_after, [*pair.overrides, *device], pair.period,
                        pair.peer, attempt,
                    )  # fmt: skip
                    failed += [{"pair": key, "ours_name": pair.ours, "peer_name": pair.peer_name, **r} for r in rows]
        result = {
            "benchmark": "peers-failures", **head, "rate": args.failure_rate, "steps": args.failure_steps,
            "kill_at": args.kill_at, "back_after": args.back_after, "repeats": args.failure_repeats,
            "device_s": args.failure_device_s,
            "wall_s": time.perf_counter() - started, "rows": failed,
        }  # fmt: skip
        write(out, "peers-failures", result, failure_table(failures.summary(failed)))
    return 0


def write(out: Path, name: str, result: dict[str, Any], text: str) -> None:
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(text + "\n")
    print(text)
    print(f"bench.peers: {result['wall_s'] / 60:.1f} min; results in {out}/{name}.json and {name}.md", flush=True)


if __name__ == "__main__":
    sys.exit(main())
