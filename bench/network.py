"""Every sync algorithm on emulated slow links, as real multi-node torchrun jobs (needs root).

    sudo make bench-network
    python -m bench.network [--nodes 2] [--rates unlimited,1gbit,100mbit]
                            [--algorithms none,allreduce,dgc,...] [--warmup 4] [--window 16] [--no-straggler]
                            [--repeats 1]
    python -m bench.network --report bench/results      # redraw tables and plots from a run's records

Each "node" is a network namespace with its own shaped link into a switch (``bench/netns.py``). For each link
rate and each algorithm, one ``torchrun --nnodes N --nproc-per-node 1`` is started in every namespace, all
meeting at a c10d rendezvous endpoint on the first node: the path a user takes on a real cluster. The job is
``experiment=network`` (ResNet-10-T, digits at 76 px, batch 32 per node; its config explains why).

Per cell: mean step time over ``--window`` steady-state steps after ``--warmup`` (a whole number of local SGD
and DiLoCo periods; a median would hide their averaging steps), samples/s, speedup over allreduce at the same
rate, the step time over the compute-only floor (``sync=none`` at the same rate: what no exchange can beat),
bytes sent per step as counted by the Communicator, and bytes the first rank's node actually sent on its
interface over the same steps (``trainer.netdev``), so the accounting is checked against the wire, and the
communication left exposed (seconds blocked in communication over compute seconds, within the run: a ratio the
machine's drift between runs does not move). ``--repeats R`` runs every cell R times, in alternating order, and
reports its median run.

The straggler-link scenario: 3 nodes, one on a much slower link, allreduce vs relaxed sync measuring compute
(CAC's measure) vs relaxed sync measuring links (``sync.measure=link``).

Results: bench/results/network.jsonl (one line per run), network.md (the tables), network_step_time.png,
network_speedup.png and network_floor.png.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, machine, median
from bench.netns import IFACE, EmulatedNetwork, parse_rate, unavailable
from engine.metrics import read_metrics

ALGORITHMS: dict[str, tuple[str, list[str]]] = {
    # key: (column name, overrides)
    "none": ("none (floor)", ["sync=none"]),
    "allreduce": ("allreduce", ["sync=allreduce"]),
    "powersgd": ("PowerSGD r=1", ["sync=powersgd", "sync.start_powerSGD_iter=2"]),
    "dgc": ("DGC", ["sync=dgc"]),
    "localsgd4": ("local SGD k=4", ["sync=localsgd", "sync.begin_step=0", "sync.k_steps=4"]),
    "localsgd16": ("local SGD k=16", ["sync=localsgd", "sync.begin_step=0", "sync.k_steps=16"]),
    "adaptive_localsgd": (
        "adaptive (k0=16)",
        ["sync=adaptive_localsgd", "sync.begin_step=0", "sync.init_k_steps=16"],
    ),
    # Consensus distance (a diagnostic allreduce of the whole model every 10 steps by default) off: it would
    # cost a tenth of the gossip traffic again, uncounted in bytes_sent by design.
    "diloco": ("DiLoCo H=16", ["sync=diloco", "sync.inner_steps=16"]),
    # H=32 in 4 fragments (one every 8 steps, overlapped with 2), int8: 1/128 of allreduce's bytes per step.
    "streaming": (
        "streaming DiLoCo",
        ["sync=diloco", "sync.inner_steps=32", "sync.fragments=4", "sync.delay=2", "sync.quantize=int8"],
    ),
    # The same schedule, sent as SparseLoCo sends it: the top 2 % of each chunk of 4,096 of an error-feedback
    # buffer, 2-bit values and 12-bit indices (about 1/110 of int8's bytes).
    "sparse": (
        "SparseLoCo 2 %",
        ["sync=diloco", "sync.inner_steps=32", "sync.fragments=4", "sync.delay=2", "sync.quantize=sparse"],
    ),
    "streaming_fp4": (
        "streaming DiLoCo fp4",
        ["sync=diloco", "sync.inner_steps=32", "sync.fragments=4", "sync.delay=2", "sync.quantize=fp4"],
    ),
    "sgp": ("SGP", ["sync=sgp", "sync.consensus_every=1000000"]),
    "sgp_overlap": ("SGP overlap", ["sync=sgp", "sync.overlap=true", "sync.consensus_every=1000000"]),
    "crossover": ("crossover", ["sync=crossover", "sync.consensus_every=1000000"]),
    "crossover_overlap": (
        "crossover overlap",
        ["sync=crossover", "sync.overlap=true", "sync.consensus_every=1000000"],
    ),
    "auto": ("auto", ["sync=auto"]),  # (it measures, chooses and switches: docs/algorithms.md)
}
DEFAULT_RATES = "unlimited,1gbit,100mbit"
FLEET_1G = {"dense_s": 2.45, "dgc_s": 0.375}  # Paddle's FasterRCNN, 2 machines, seconds per step
# Fleet's DGC speedups (dense / DGC s/step) at 1G and 10G, drawn at a tenth of the bandwidth: our matched tier.
FLEET_DGC_SPEEDUPS = {100e6: 2.45 / 0.375, 1e9: 0.55 / 0.375}
STRAGGLER_RUNS: dict[str, list[str]] = {
    "allreduce": ["sync=allreduce"],
    "relaxed, measure=compute": ["sync=relaxed", "sync.measure=compute"],
    "relaxed, measure=link": ["sync=relaxed", "sync.measure=link"],
}
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


class CellFailed(RuntimeError):
    pass


def node_env() -> dict[str, str]:
    """The environment of a node's torchrun: this one's without a worker's variables, gloo on the namespace's
    interface, one thread per worker."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(GLOO_SOCKET_IFNAME=IFACE, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR", PYTHONUNBUFFERED="1")
    return env


def torchrun(
    net: EmulatedNetwork, node: int, job_id: str, port: int, nnodes: int | None = None, procs: int = 1
) -> list[str]:
    """The launcher line of ``node`` (``procs`` processes) in a job of ``nnodes`` nodes (all of ``net``'s by default)
    meeting at a c10d rendezvous on the first of them (``nnodes=1``: on ``node`` itself, a job of its own)."""
    host = net.address(0 if nnodes is None or nnodes > 1 else node)
    return [
        TORCHRUN, "--nnodes", str(nnodes or net.nodes), "--nproc-per-node", str(procs), "--max-restarts", "0",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", job_id,
        # the first node hosts the rendezvous store; addresses are the namespaces' own
        "--rdzv-conf", f"is_host={int(net.address(node) == host)}", "--local-addr", net.address(node),
    ]  # fmt: skip


def run_job(
    net: EmulatedNetwork,
    overrides: list[str],
    steps: int,
    job_id: str,
    port: int,
    workdir: Path,
    timeout_s: float,
    procs: int = 1,
    at_epoch: tuple[int, Callable[[], None]] | None = None,
) -> dict[str, Any]:
    """``train.py OVERRIDES`` as one job across all nodes of ``net`` (one torchrun per node, ``procs`` workers each,
    which reach each other over the node's loopback); returns its metrics and the bytes each node sent (the node
    logs stay in the run dir). ``at_epoch``: (epoch, what to do once the first record of that epoch is written),
    e.g. reshape the links mid-run."""
    run_dir = workdir / job_id
    run_dir.mkdir(parents=True)
    train = [
        "train.py", "logger=none", "trainer.progress=false", "trainer.checkpoint_every=0",
        f"trainer.max_steps={steps}", f"trainer.run_dir={run_dir}", f"trainer.netdev={IFACE}", *overrides,
    ]  # fmt: skip
    commands = [[*torchrun(net, node, job_id, port, procs=procs), *train] for node in range(net.nodes)]
    if at_epoch is None:
        return run_nodes(net, run_dir, commands, [node_env()] * net.nodes, timeout_s)
    done = threading.Event()
    watcher = threading.Thread(target=_when_epoch, args=(run_dir / "metrics.jsonl", *at_epoch, done), daemon=True)
    watcher.start()
    try:
        return run_nodes(net, run_dir, commands, [node_env()] * net.nodes, timeout_s)
    finally:
        done.set()
        watcher.join()


def _when_epoch(path: Path, epoch: int, act: Callable[[], None], done: threading.Event) -> None:
    """``act()`` once a train record of ``epoch`` or later is in ``path`` (looked at every 0.1 s until ``done``)."""
    while not done.wait(0.1):
        if not path.exists():
            continue
        with open(path) as f:
            lines = f.read().splitlines()
        for line in lines:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("kind") == "train" and record.get("epoch", 0) >= epoch:
                    act()
                    return


def run_nodes(
    net: EmulatedNetwork, run_dir: Path, commands: list[list[str]], envs: list[dict[str, str]], timeout_s: float
) -> dict[str, Any]:
    """``commands[i]`` in node ``i`` (its output in ``run_dir/node<i>.log``) until every one exits; the records in
    ``run_dir/metrics.jsonl``, the bytes each node sent meanwhile and the wall time. Fails on a non-zero exit."""
    tx_before = [net.tx_bytes(i) for i in range(net.nodes)]
    procs, logs = [], []
    start = time.perf_counter()
    for node, (command, env) in enumerate(zip(commands, envs)):
        log_path = run_dir / f"node{node}.log"
        logs.append(log_path)
        with open(log_path, "w") as log:
            procs.append(net.popen(node, command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - start))) for p in procs]
    except subprocess.TimeoutExpired:
        net.stop_all()
        raise CellFailed(f"{run_dir.name}: no result after {timeout_s:.0f} s\n{_tail(logs)}") from None
    wall_s = time.perf_counter() - start
    net.stop_all()  # nothing left, but make sure
    if any(codes):
        raise CellFailed(f"{run_dir.name}: exit codes {codes}\n{_tail(logs)}")
    tx = [net.tx_bytes(i) - b for i, b in enumerate(tx_before)]
    return {
        "metrics": read_metrics(str(run_dir / "metrics.jsonl")),
        "node_tx_bytes": tx,
        "wall_s": wall_s,
    }


def _tail(logs: list[Path], lines: int = 40) -> str:
    out = []
    for path in logs:
        text = path.read_text().splitlines() if path.exists() else []
        out.append(f"--- {path.name} (last {lines} lines)\n" + "\n".join(text[-lines:]))
    return "\n".join(out)


def steady_state(metrics: list[dict[str, Any]], warmup: int, window: int) -> dict[str, Any]:
    """Numbers over train steps [warmup, warmup + window)."""
    steps = [r for r in metrics if r["kind"] == "train" and warmup <= r["step"] < warmup + window]
    if len(steps) < window:
        raise CellFailed(f"only {len(steps)} steady-state steps recorded, expected {window}")
    step_s = sum(r["step_s"] for r in steps) / len(steps)
    counted = sum(r["bytes_sent"] for r in steps)
    wire = sum(r["wire_bytes"] for r in steps)
    return {
        "step_s": step_s,
        "step_s_median": median(r["step_s"] for r in steps),
        "samples_per_s": sum(r["samples_per_s"] * r["step_s"] for r in steps) / sum(r["step_s"] for r in steps),
        "compute_s": median(r["compute_s"] for r in steps),
        "comm_s": sum(r["comm_s"] for r in steps) / len(steps),
        "bytes_per_step": counted / len(steps),
        "wire_bytes_per_step": wire / len(steps),
        "wire_over_counted": wire / counted if counted else None,
    }


def record(
    result: dict[str, Any],
    job: Callable[[], dict[str, Any]],
    summarize: Callable[[dict[str, Any]], dict[str, Any]],
    describe: Callable[[dict[str, Any]], str],
    emit: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Run ``job``, add ``summarize(its output)`` (or the error) to ``result``, write it out, say how it went."""
    try:
        result.update(summarize(job()))
    except CellFailed as e:
        print(f"  failed: {e}", flush=True)
        result["error"] = str(e)
    emit(result)
    if "error" not in result:
        print(f"  {describe(result)}", flush=True)
    return result


# ---- the two scenarios --------------------------------------------------------------------------------------
def links(args: argparse.Namespace, net: EmulatedNetwork, workdir: Path, emit) -> list[dict[str, Any]]:
    cells, runs = [], 0
    steps = args.warmup + args.window
    for rate in args.rates:
        net.shape(rate)
        tries: dict[str, list[dict[str, Any]]] = {key: [] for key in args.algorithms}
        for attempt in range(args.repeats):  # rounds in alternating order: no algorithm always runs first
            for key in args.algorithms if attempt % 2 == 0 else reversed(args.algorithms):
                name, overrides = ALGORITHMS[key]
                job = f"n{args.nodes}-{rate}-{key}-{attempt}"
                print(f"[{time.strftime('%H:%M:%S')}] {rate:>9}  {name}" + _of(attempt, args.repeats), flush=True)
                cell = {"kind": "cell", "rate": rate, "algorithm": key, "name": name, "nodes": args.nodes}
                run = functools.partial(
                    run_job, net, ["experiment=network", *overrides], steps, job, args.port + runs, workdir,
                    args.cell_timeout,
                )  # fmt: skip
                runs += 1
                tries[key].append(
                    record(
                        {**cell, "attempt": attempt} if args.repeats > 1 else cell, run,
                        lambda out: {
                            **steady_state(out["metrics"], args.warmup, args.window),
                            "node_tx_bytes": out["node_tx_bytes"], "wall_s": out["wall_s"],
                        },
                        lambda c: f"{c['step_s']:.3f} s/step, {c['samples_per_s']:.0f} samples/s, "
                        f"{c['bytes_per_step'] / 1e6:.3f} MB/step counted, "
                        f"wire/counted {_ratio(c['wire_over_counted'])}",
                        emit,
                    )
                )  # fmt: skip
        cells.extend(median_cell(tries[key]) for key in args.algorithms)
    base = {c["rate"]: c for c in cells if c["algorithm"] == "allreduce" and "error" not in c}
    floor = {c["rate"]: c for c in cells if c["algorithm"] == "none" and "error" not in c}
    for c in cells:
        if "error" not in c and c["rate"] in base:
            c["speedup"] = base[c["rate"]]["step_s"] / c["step_s"]
            c["bytes_vs_allreduce"] = base[c["rate"]]["bytes_per_step"] / max(c["bytes_per_step"], 1e-9)
        if "error" not in c and c["rate"] in floor:
            c["x_floor"] = c["step_s"] / floor[c["rate"]]["step_s"]  # 1.0: as fast as computing alone
    return cells


def _of(attempt: int, repeats: int) -> str:
    return f"  ({attempt + 1} of {repeats})" if repeats > 1 else ""


def median_cell(tries: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from repeated runs: the run with the median step time, with every run's step time beside it."""
    good = sorted((c for c in tries if "error" not in c), key=lambda c: c["step_s"])
    if len(tries) == 1 or not good:
        return tries[0]
    cell = {k: v for k, v in good[(len(good) - 1) // 2].items() if k != "attempt"}
    return {**cell, "step_s_runs": [c["step_s"] for c in good], "failed_runs": len(tries) - len(good)}


def straggler(args: argparse.Namespace, workdir: Path, emit) -> list[dict[str, Any]]:
    rates = args.straggler_rates
    runs = []
    with EmulatedNetwork(len(rates)) as net:
        net.shape(rates)
        slow_node = min(range(len(rates)), key=lambda i: parse_rate(rates[i]) or float("inf"))
        for i, (name, overrides) in enumerate(STRAGGLER_RUNS.items()):
            print(f"[{time.strftime('%H:%M:%S')}] straggler link {rates}: {name}", flush=True)
            common = [f"sync.check_every={args.check_every}"] if "sync=relaxed" in overrides else []
            run = {"kind": "straggler", "name": name, "rates": rates, "slow_node": slow_node}
            job = functools.partial(
                run_job, net, ["experiment=network", *overrides, *common], args.straggler_steps, f"straggler-{i}",
                args.port + 500 + i, workdir, args.cell_timeout,
            )  # fmt: skip
            runs.append(
                record(
                    run, job,
                    lambda out: straggler_summary(out, args.check_every, net.node_of),
                    lambda r: f"{r['step_s_before']:.3f} s/step before the first check, {r['step_s_after']:.3f} "
                    f"after; evicted node(s): {r['evicted_nodes']}",
                    emit,
                )
            )  # fmt: skip
    return runs


def straggler_summary(out: dict[str, Any], check_every: int, node_of: Callable[[str], int]) -> dict[str, Any]:
    metrics = out["metrics"]
    steps = [r for r in metrics if r["kind"] == "train"]
    checks = [r for r in metrics if r["kind"] == "event" and r["event"] == "relaxed_check"]
    evictions = [r for r in metrics if r["kind"] == "event" and r["event"] == "evict"]
    before = [r["step_s"] for r in steps if 1 <= r["step"] < check_every]
    after = [r["step_s"] for r in steps if r["step"] > check_every]
    evicted_nodes = sorted(node_of(host) for e in evictions for host in e["hosts"].values())
    return {
        "step_s_before": median(before),
        "step_s_after": median(after),
        "compute_s": median(r["compute_s"] for r in steps if r["step"] >= 1),
        "first_check": {"times": checks[0]["times"], "reference": checks[0]["reference"]} if checks else None,
        "evictions": [{"ranks": e["ranks"], "step": e["step"], "times": e["times"]} for e in evictions],
        "evicted_nodes": evicted_nodes,
        "final_world_size": steps[-1]["world_size"],
        "wall_s": out["wall_s"],
    }


# ---- output -------------------------------------------------------------------------------------------------
def tables(cells: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The four tables, rates down and algorithms across, each cell written by its own formatter."""
    names = [ALGORITHMS[k][0] for k in args.algorithms]
    by = {(c["rate"], c["algorithm"]): c for c in cells}
    head = "| link | " + " | ".join(names) + " |\n|---|" + "---|" * len(names)
    n = f"{args.nodes} nodes"
    specs: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        (
            f"Seconds per step (speedup over allreduce at the same rate), {n}",
            lambda c: f"{c['step_s']:.3f} ({c.get('speedup', float('nan')):.2f}x)",
        ),
        (
            f"Step time over the compute-only floor (sync=none at the same rate; 1.00 = no cost), {n}",
            lambda c: f"{c.get('x_floor', float('nan')):.2f}",
        ),
        (
            "Communication left exposed: seconds per step blocked in communication over compute seconds per step, "
            f"within each run (0.00 = hidden; immune to the machine's drift between runs), {n}",
            lambda c: f"{c['comm_s'] / c['compute_s']:.2f}",
        ),
        (
            f"Bytes sent per node per step, counted (wire/counted on the interface), {n}",
            lambda c: f"{_mb(c['bytes_per_step'])} ({_ratio(c['wire_over_counted'])})",
        ),
    ]
    out = []
    for title, fmt in specs:
        out += [("\n" if out else "") + f"{title}:\n", head]
        for rate in args.rates:
            cs = (by.get((rate, k), {}) for k in args.algorithms)
            row = ["not run" if not c else "failed" if "error" in c else fmt(c) for c in cs]
            out.append(f"| {rate} | " + " | ".join(row) + " |")
    return "\n".join(out) + "\n"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"  # None: nothing counted (sync=none)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} kB"


def matched_tier(cells: list[dict[str, Any]], rate: str) -> dict[str, Any] | None:
    """Our numbers at ``rate`` next to Fleet's 1G row."""
    by = {c["algorithm"]: c for c in cells if c["rate"] == rate and "error" not in c}
    if "allreduce" not in by:
        return None
    dense = by["allreduce"]
    result = {
        "rate": rate,
        "compute_s": dense["compute_s"],
        "dense_step_s": dense["step_s"],
        "comm_over_compute": (dense["step_s"] - dense["compute_s"]) / dense["compute_s"],
        "fleet_comm_over_compute": (FLEET_1G["dense_s"] - FLEET_1G["dgc_s"]) / FLEET_1G["dgc_s"],
        "fleet_dgc_speedup": FLEET_1G["dense_s"] / FLEET_1G["dgc_s"],
    }
    if "dgc" in by:
        result["dgc_speedup"] = by["dgc"]["speedup"]
    return result


def plot(cells: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    shaped = [parse_rate(r) for r in args.rates if parse_rate(r) is not None]
    unlimited_x = 4 * max(shaped) / 1e6 if shaped else 10_000.0  # where "unlimited" is drawn, Mbit/s
    paths = []
    for key, ylabel, fname in (
        ("step_s", "seconds per step", "network_step_time.png"),
        ("speedup", "speedup over allreduce", "network_speedup.png"),
        ("x_floor", "step time / compute-only step (sync=none)", "network_floor.png"),
    ):
        fig, ax = plt.subplots(figsize=(9, 5))
        palette = plt.get_cmap("tab20").colors
        for alg in args.algorithms:
            pts = sorted(
                ((parse_rate(c["rate"]) or unlimited_x * 1e6) / 1e6, c[key])
                for c in cells
                if c["algorithm"] == alg and key in c
            )
            if pts:  # one colour per algorithm for every run and plot; overlapped variants dashed, the floor black
                style = (
                    {"color": "black", "linewidth": 2.5}
                    if alg == "none"
                    else {"color": palette[list(ALGORITHMS).index(alg) % 20]}
                )
                ax.plot(
                    *zip(*pts),
                    marker="o",
                    linestyle="--" if "overlap" in alg else "-",
                    label=ALGORITHMS[alg][0],
                    **style,
                )
        if key == "speedup" and args.matched == "100mbit":
            xs = [bps / 1e6 for bps in FLEET_DGC_SPEEDUPS]
            ax.plot(
                xs,
                list(FLEET_DGC_SPEEDUPS.values()),
                "kx",
                markersize=9,
                label="Fleet DGC: 1G, 10G rows at 1/10 the rate",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ticks = sorted({(parse_rate(r) or unlimited_x * 1e6) / 1e6 for r in args.rates})
        ax.set_xticks(ticks)
        ax.set_xticklabels(["unlimited" if t == unlimited_x else f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("link rate per node, Mbit/s (log)")
        ax.set_ylabel(f"{ylabel} (log)")
        ax.set_title(f"{ylabel} vs bandwidth\n{args.nodes} nodes, ResNet-10-T, batch 32/node", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2, choices=(2, 3, 4))
    parser.add_argument("--rates", default=DEFAULT_RATES, help="comma-separated link rates (tc units, or unlimited)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help=f"comma-separated: {', '.join(ALGORITHMS)}")
    parser.add_argument("--warmup", type=int, default=4, help="steps left out at the start of each run")
    parser.add_argument("--window", type=int, default=16, help="steady-state steps measured (a multiple of 16)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per cell, in alternating order; a cell reports the median run"
    )
    parser.add_argument("--matched", default="100mbit", help="the rate whose row is matched to Fleet's 1G row")
    parser.add_argument("--no-straggler", action="store_true", help="skip the straggler-link scenario")
    parser.add_argument("--straggler-rates", default="1gbit,1gbit,100mbit", help="one link rate per node (3 nodes)")
    parser.add_argument("--straggler-steps", type=int, default=25)
    parser.add_argument("--check-every", type=int, default=5, help="relaxed sync's check period in the scenario")
    parser.add_argument("--cell-timeout", type=float, default=600.0, help="seconds before a run counts as failed")
    parser.add_argument("--port", type=int, default=29400, help="first rendezvous port (inside the namespaces)")
    parser.add_argument("--out", default=str(RESULTS), help="results directory")
    parser.add_argument(
        "--report", metavar="DIR", help="only redraw DIR's tables and plots from its network.jsonl (no runs, no root)"
    )
    args = parser.parse_args(argv)
    args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    args.straggler_rates = [r.strip() for r in args.straggler_rates.split(",") if r.strip()]
    for rate in [*args.rates, *args.straggler_rates]:
        try:
            parse_rate(rate)
        except ValueError as e:
            parser.error(str(e))
    if args.repeats < 1:
        parser.error(f"--repeats: {args.repeats}; expected 1 or more")
    unknown = [a for a in args.algorithms if a not in ALGORITHMS]
    if unknown:
        parser.error(f"--algorithms: unknown {', '.join(unknown)}; expected some of {', '.join(ALGORITHMS)}")
    if args.matched not in args.rates:
        parser.error(f"--matched {args.matched}: not one of --rates ({', '.join(args.rates)})")
    if "allreduce" not in args.algorithms:
        parser.error("--algorithms: allreduce is needed (speedups are relative to it)")
    if len(args.straggler_rates) != 3 and not args.no_straggler:
        parser.error(f"--straggler-rates: expected 3 rates (one per node), got {len(args.straggler_rates)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        return rereport(Path(args.report))
    reason = unavailable()
    if reason:
        print(f"bench.network: skipped: {reason}", flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "network.jsonl"
    command = "python -m bench.network " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"kind": "meta", "command": command.strip(), "machine": machine(), "date": time.strftime("%Y-%m-%d")}
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="relaxsync-network-"))
    with open(jsonl, "w") as f:

        def emit(record: dict[str, Any]) -> None:
            f.write(json.dumps(record) + "\n")
            f.flush()

        emit(meta)
        try:
            with EmulatedNetwork(args.nodes) as net:
                cells = links(args, net, workdir, emit)
            runs = [] if args.no_straggler else straggler(args, workdir, emit)
        except KeyboardInterrupt:
            print("bench.network: interrupted; processes stopped and namespaces removed", flush=True)
            return 130
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        matched = matched_tier(cells, args.matched)
        emit({"kind": "matched", **(matched or {})})
        emit({"kind": "cells", "cells": cells})  # with speedups, computed once every rate has run
        total = time.perf_counter() - started
        emit({"kind": "done", "wall_s": total})

    return report(cells, runs, matched, args, meta["machine"], total, out)


def report(
    cells: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    matched: dict[str, Any] | None,
    args: argparse.Namespace,
    machine_line: str,
    total: float,
    out: Path,
) -> int:
    """Write network.md and the plots from the results; print the tables."""
    text = tables(cells, args)
    if matched:
        text += (
            f"\nMatched tier {matched['rate']}: compute {matched['compute_s']:.3f} s/step, dense step "
            f"{matched['dense_step_s']:.3f} s, communication/compute {matched['comm_over_compute']:.2f} "
            f"(Fleet 1G: {matched['fleet_comm_over_compute']:.2f})"
        )
        if "dgc_speedup" in matched:
            text += f"; DGC speedup {matched['dgc_speedup']:.2f}x (Fleet 1G: {matched['fleet_dgc_speedup']:.2f}x)"
        text += "\n"
    if runs:
        text += "\nStraggler link (" + ", ".join(args.straggler_rates) + "):\n\n"
        text += (
            "| run | s/step before first check | s/step after | times at the first check, ms by rank (reference) "
            "| evicted node | world size at end |\n|---|---|---|---|---|---|\n"
        )
        for r in runs:
            if "error" in r:
                text += f"| {r['name']} | failed | | | | |\n"
                continue
            first = r["first_check"]
            seen = (
                ", ".join(f"{t * 1e3:.0f}" for _, t in sorted(first["times"].items(), key=lambda kv: int(kv[0])))
                + f" ({first['reference'] * 1e3:.0f})"
                if first
                else "(no checks)"
            )
            text += (
                f"| {r['name']} | {r['step_s_before']:.3f} | {r['step_s_after']:.3f} | {seen} | "
                f"{r['evicted_nodes'] or 'none'} | {r['final_world_size']} |\n"
            )
    text += f"\n{machine_line}; {total / 60:.1f} min in all.\n"
    (out / "network.md").write_text(text)
    pngs = plot(cells, args, out)
    print("\n" + text + "\nplots: " + ", ".join(str(p) for p in pngs), flush=True)
    failed = [c for c in [*cells, *runs] if "error" in c]
    return 1 if failed else 0


def rereport(out: Path) -> int:
    """Tables and plots again from a finished run's records, with that run's own options."""
    path = out / "network.jsonl"
    if not path.is_file():
        print(f"bench.network: --report {out}: no network.jsonl there", flush=True)
        return 2
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_kind = {r["kind"]: r for r in records}
    if "cells" not in by_kind:
        print(f"bench.network: --report {out}: the run did not finish (no cells record)", flush=True)
        return 2
    meta = by_kind["meta"]
    args = parse_args(shlex.split(meta["command"])[3:])
    runs = [r for r in records if r["kind"] == "straggler"]
    matched = by_kind.get("matched") or None
    matched = {k: v for k, v in matched.items() if k != "kind"} if matched and "rate" in matched else None
    total = by_kind.get("done", {}).get("wall_s", 0.0)
    return report(by_kind["cells"]["cells"], runs, matched, args, meta["machine"], total, out)


if __name__ == "__main__":
    sys.exit(main())
