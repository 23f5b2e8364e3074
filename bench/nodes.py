"""Nodes of several processes on the emulated cluster: the bytes each node sends on its link per step, for every
option at ``sync.scope=node`` beside ``sync.scope=process`` and beside one process per node (needs root).

    sudo make bench-nodes
    python -m bench.nodes [--nodes 2,4] [--procs 2] [--rate 1gbit] [--algorithms localsgd16,dgc,...]
    python -m bench.nodes --report bench/results      # redraw the table from a run's records

Each node is a network namespace with a shaped link (``bench/netns.py``); each runs one ``torchrun --nproc-per-node
P``, so the processes of a node reach each other over its loopback and the others over its link, as the GPUs of a
node do over NVLink and the network. The job is bench/network's (``experiment=network``: ResNet-10-T, 4.93 M
parameters, so a ring allreduce of its gradient is 19.7 MB) with a small input (bytes do not depend on it, and two
cores run 8 processes): a batch of 8 per process, and each node's batch the same in every shape (one process per
node takes 8 x P), so that node scope and one process per node are the same algorithm (adaptive local SGD's period
follows the loss, which follows the batch). Per cell, over ``--window`` steady-state steps:
``wire_bytes_per_node_step``, what the first node's interface sent per step (the kernel's counter, not a model), and
the Communicator's count per process.

Results: bench/results/nodes.jsonl, docs/benchmarks/nodes.md (the table).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, machine
from bench.netns import EmulatedNetwork, parse_rate, unavailable
from bench.network import ALGORITHMS as NETWORK
from bench.network import CellFailed, run_job, steady_state

OPTIONS = ["localsgd16", "adaptive_localsgd", "diloco", "streaming", "dgc", "powersgd", "sgp", "crossover", "allreduce"]
SMALL = ["experiment=network", "data.image_size=32"]  # (bytes are the model's, not the input's)
BATCH = 8  # per process
SHAPES = [  # (column, processes per node, scope)
    ("1 process per node", 1, "process"),
    ("process scope", None, "process"),
    ("node scope", None, "node"),
]
DOC = ROOT / "docs" / "benchmarks" / "nodes.md"
READING = [
    "## Reading it",
    "",
    "Node scope sends what one process per node sends (*node/1* about 1), at every node count. How much it saves",
    "against process scope depends on how the option exchanges:",
    "",
    "- What is gathered or sent point to point (DGC's sparse values, streaming DiLoCo's int8 fragments, SGP's and",
    "  crossover's messages) grows with the processes at process scope, so node scope's saving grows with the nodes.",
    "- What is averaged by a ring allreduce (local SGD, DiLoCo, PowerSGD's factors, allreduce) crosses each node's",
    "  link once per direction at process scope too, where the ranks are numbered node by node (torchrun and Slurm",
    "  number them so): a node sends 2(NL-1)/(NL) of the tensor against node scope's 2(N-1)/N. That is 0.67 at 2",
    "  nodes of 2 and 0.86 at 4 nodes of 2 (1.5/1.75), as measured for local SGD, DiLoCo and allreduce. No design",
    "  brings it to 0.75 at 4 nodes: node scope's bytes are already one process per node's. Its gain there is in the",
    "  replicas: N, not NL.",
    "- Adaptive local SGD's period follows the run's loss, so its bytes over a few dozen steps move from run to run.",
]


def cell(net: EmulatedNetwork, key: str, procs: int, scope: str, args: argparse.Namespace, job: str, port: int,
         workdir: Path) -> dict[str, Any]:  # fmt: skip
    name, overrides = NETWORK[key]
    out = {"kind": "cell", "algorithm": key, "name": name, "nodes": net.nodes, "procs_per_node": procs,
           "scope": scope, "rate": args.rate}  # fmt: skip
    steps = args.warmup + args.window
    # (each node's batch the same in every shape: one process per node takes the batch of its node's processes)
    batch = [f"data.batch_size={BATCH * (args.procs if procs == 1 else 1)}"]
    try:
        run = run_job(
            net, [*SMALL, *batch, *overrides, f"sync.scope={scope}"], steps, job, port, workdir, args.timeout, procs
        )
    except CellFailed as error:
        return {**out, "error": str(error).splitlines()[0][:300], "log": str(error)[-2000:]}
    steady = steady_state(run["metrics"], args.warmup, args.window)
    world = next(r for r in run["metrics"] if r.get("event") == "world")
    return {
        **out,
        "scope_run": world.get("scope"),  # (what the run says it ran: auto and explicit agree)
        "wire_bytes_per_node_step": steady["wire_bytes_per_step"],
        "counted_bytes_per_process_step": steady["bytes_per_step"],
        "step_s": steady["step_s"],
    }


def run(args: argparse.Namespace, emit) -> list[dict[str, Any]]:
    cells, port = [], args.port
    workdir = Path(tempfile.mkdtemp(prefix="relaxsync-nodes-"))
    try:
        for nodes in args.nodes:
            with EmulatedNetwork(nodes) as net:
                net.shape(args.rate)
                for key in args.algorithms:
                    for column, procs, scope in SHAPES:
                        procs = procs or args.procs
                        job = f"n{nodes}x{procs}-{key}-{scope}"
                        print(f"[{time.strftime('%H:%M:%S')}] {nodes} nodes x {procs}  {key:<18} {column}", flush=True)
                        result = cell(net, key, procs, scope, args, job, port, workdir)
                        port += 1
                        emit(result)
                        cells.append(result)
                        if "error" in result:
                            print(f"  failed: {result['error']}", flush=True)
                        else:
                            print(f"  {result['wire_bytes_per_node_step'] / 1e6:.3f} MB per node and step", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return cells


def _row(row: dict[str, dict[str, Any]]) -> str:
    """One option's line: its three shapes (``one``, ``process``, ``node``) and node scope's ratios."""
    mb = {k: c.get("wire_bytes_per_node_step") for k, c in row.items() if "error" not in c}

    def shown(k: str) -> str:
        if k not in row:
            return ""
        return f"{mb[k] / 1e6:.3f}" if k in mb else "fails: " + row[k]["error"][:60]

    def ratio(a: str, b: str) -> str:
        return f"{mb[a] / mb[b]:.2f}" if mb.get(a) and mb.get(b) else ""

    name = next(iter(row.values()))["name"]
    cols = [name, shown("one"), shown("process"), shown("node"), ratio("node", "one"), ratio("node", "process")]
    return "| " + " | ".join(cols) + " |"


def table(cells: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The doc: per node count, each option's wire bytes per node and step in the three shapes, and the ratios."""
    lines = [
        "# Nodes of several processes: bytes on each node's link",
        "",
        "Generated by `bench/nodes.py`; do not edit by hand.",
        f"Command: `{meta.get('command', '')}`; machine: {meta.get('machine', '')}; {meta.get('date', '')}"
        + (f"; run time {meta['wall_s'] / 60:.1f} min." if "wall_s" in meta else "."),
        "",
        "Megabytes each node sent on its link per training step (its interface's counter over the steady-state",
        "steps), for the same job run three ways. *node/1* and *node/process*: node scope's bytes over the other two",
        "(the aim: <= 1.1 and <= 0.75).",
    ]
    header = "| option | 1 process per node | process scope | node scope | node/1 | node/process |"
    for nodes in sorted({c["nodes"] for c in cells}):
        procs = max(c["procs_per_node"] for c in cells if c["nodes"] == nodes)
        lines += ["", f"## {nodes} nodes at {cells[0]['rate']}, {procs} processes per node", ""]
        lines += [header, "|---|---|---|---|---|---|"]
        for key in dict.fromkeys(c["algorithm"] for c in cells if c["nodes"] == nodes):
            of = [c for c in cells if c["nodes"] == nodes and c["algorithm"] == key]
            lines.append(_row({c["scope"] if c["procs_per_node"] > 1 else "one": c for c in of}))
    lines += ["", *READING]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="2,4", help="comma-separated node counts (2 to 4)")
    parser.add_argument("--procs", type=int, default=2, help="processes per node (>= 2)")
    parser.add_argument("--rate", default="1gbit", help="every link's rate (tc units)")
    parser.add_argument("--algorithms", default=",".join(OPTIONS), help=f"comma-separated: {', '.join(OPTIONS)}")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--window", type=int, default=32, help="steady-state steps (a multiple of 32: every period)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a run counts as failed")
    parser.add_argument("--port", type=int, default=29600)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--report", metavar="DIR", help="only rewrite the doc from DIR/nodes.jsonl")
    args = parser.parse_args(argv)
    args.nodes = [int(n) for n in args.nodes.split(",")]
    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    parse_rate(args.rate)
    unknown = [a for a in args.algorithms if a not in NETWORK]
    if unknown or not all(2 <= n <= 4 for n in args.nodes) or args.procs < 2:
        parser.error(f"--algorithms of {', '.join(NETWORK)}; --nodes in 2..4; --procs >= 2 (unknown: {unknown})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        records = [json.loads(line) for line in open(Path(args.report) / "nodes.jsonl")]
        done = next((r for r in records if r["kind"] == "done"), {})
        DOC.write_text(table([r for r in records if r["kind"] == "cell"], {**records[0], **done}))
        return 0
    reason = unavailable()
    if reason:
        print(f"bench.nodes: skipped: {reason}", flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.nodes " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"kind": "meta", "command": command.strip(), "machine": machine(), "date": time.strftime("%Y-%m-%d")}
    with open(out / "nodes.jsonl", "w") as f:

        def emit(record: dict[str, Any]) -> None:
            f.write(json.dumps(record) + "\n")
            f.flush()

        emit(meta)
        started = time.perf_counter()
        cells = run(args, emit)
        emit({"kind": "done", "wall_s": time.perf_counter() - started})
    DOC.write_text(table(cells, {**meta, "wall_s": time.perf_counter() - started}))
    print(f"bench.nodes: {DOC}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
