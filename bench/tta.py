"""Time to accuracy on emulated clusters (needs root): which sync option reaches a validation top-1 first, and at
what cost in bytes, on the same runs.

    sudo make bench-tta   # python -m bench.tta with its defaults: 4 nodes, 3 scenarios, the period sweep; ~34 min
    python -m bench.tta [--scenarios fleet,1gbit,uneven] [--algorithms allreduce,dgc,...] [--relaxed ...]
                        [--target 95] [--eval-every 2] [--epochs 25] [--sweep localsgd1,...] [--sweep-epochs 8]
    python -m bench.tta --report bench/results      # redraw the tables and plots from a run's records
    python -m bench.tta --nodes 2 --procs 2 --scenarios fleet --sweep ''    # sync.scope=node against process
    python -m bench.tta --repeats 3 ...    # every cell at seeds 0, 1, 2 (a scenario's cells side by side each time)
    python -m bench.tta --job tta_hard ...  # the second job: ~400 steps to 97 %, where long periods cost steps

Every cell is one multi-node torchrun job on the emulated network of ``bench/network`` (one namespace and one
worker per node), training ``experiment=tta`` (timm's test_resnet on digits at 32 px; docs/benchmarks/tta.md says
why), or ``--job``'s experiment (:data:`JOBS`: ``tta_hard``, the same model at 64 px on augmented digits), from
seed 0 with ``trainer.eval_every_steps`` and ``trainer.target_top1``: it stops at the first evaluation that reaches
the target, or after ``--epochs`` (the cap, which the LR schedule spans). Evaluations run on the side
(the replicas' average on a copy; training is unchanged by them) and their seconds are left out of the clock,
but for what a rank waited in them for the slowest (``wait_s``), which a straggler would otherwise hide there.
Scenarios, rows of the table:

- ``fleet``: every node at 100 Mbit (the tier that matches Fleet's 1 Gbit tables: communication ~5x compute);
- ``1gbit``: every node at 1 Gbit;
- ``uneven``: 1 Gbit, but the last node sits behind a 10x slower link (100 Mbit) and rank 1 computes 3x slower
  from epoch 2; each algorithm alone, and some under ``sync=relaxed`` (compute or link measure).

Per cell: seconds of training to the target, steps and epochs to it, MB sent per node to it (counted, and on
the first node's interface), final and best top-1, evictions, samples/s. Then the period sweep, the shape of
Fleet's local SGD table: local SGD k = 1..16, adaptive, and DiLoCo's H = 8..64 at 100 Mbit for ``--sweep-epochs``
without a target (throughput, steps and seconds to the target, final top-1). Results: bench/results/tta.jsonl
(one line per run, with its evaluations), tta.md and tta_<scenario>.png (top-1 against training seconds, target
marked).

``--procs 2`` (processes per node, in the node's namespace): every cell runs twice, at ``sync.scope=node`` and at
``sync.scope=process``, with the node's batch split among its processes (``data.batch_size`` = 32 / procs, so a
node trains what one process per node trains); the table gains a column per scope and the comparison of the two.
Results then go to ``tta_nodes.jsonl`` and ``tta_nodes.md`` (``--name``), beside the one-process-per-node ones.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import RESULTS, machine
from bench.netns import EmulatedNetwork, unavailable
from bench.network import ALGORITHMS, CellFailed, run_job
from data.common import steps_per_epoch

SCENARIOS: dict[str, dict[str, Any]] = {
    "fleet": {"label": "(a) 100 Mbit", "rates": ["100mbit"]},
    "1gbit": {"label": "(b) 1 Gbit", "rates": ["1gbit"]},
    "uneven": {
        "label": "(c) uneven: 1 Gbit, one node at 100 Mbit, one 3x slower from epoch {slow}",
        "rates": ["1gbit", "1gbit", "1gbit", "100mbit"],  # the last node's link (the others' for fewer nodes)
        "overrides": ["straggler=sleep", "straggler.ranks=[1]", "straggler.slowdown=3", "straggler.start_epoch={slow}"],
    },
    # The cluster changes mid-run (at the job's change epoch): what sync=auto decides again for.
    "drop": {
        "label": "(d) every link 1 Gbit, dropped to 100 Mbit at epoch {change}",
        "rates": ["1gbit"],
        "then": {"rates": ["100mbit"]},  # (tc, as the first record of the change epoch is written)
    },
    "slowed": {
        "label": "(e) 1 Gbit, one node 3x slower from epoch {change}",
        "rates": ["1gbit"],
        "overrides": [
            "straggler=sleep",
            "straggler.ranks=[1]",
            "straggler.slowdown=3",
            "straggler.start_epoch={change}",
        ],  # fmt: skip
    },
    # A node slow but useful: 1.75x, below relaxed sync's eviction threshold (2x), so that evicting it is not the way.
    "mild": {
        "label": "(f) 1 Gbit, one node 1.75x slower from epoch {slow}",
        "rates": ["1gbit"],
        "overrides": [
            "straggler=sleep",
            "straggler.ranks=[1]",
            "straggler.slowdown=1.75",
            "straggler.start_epoch={slow}",
        ],  # fmt: skip
    },
}


@dataclass(frozen=True)
class Job:
    """What every cell trains (``experiment``), its target and cap (the experiment's own ``trainer.target_top1`` and
    ``trainer.epochs``), the epochs at which its scenarios change (``slow``: the uneven cluster's node slows;
    ``change``: the links drop or a node slows, a third to a half of the way), the steps ratios sync=auto reads on
    it, the options its auto cell adds to sync=auto's candidates, and its uneven scenarios' relaxed-sync cells."""

    experiment: str
    target: float
    epochs: int
    slow: int
    change: int
    ratios: str  # (a bench/tta result file, relative to the project)
    eval_every: int = 2  # (steps between evaluations: the crossing is placed within them)
    train_images: int = 1438  # (digits' training split)
    node_batch: int = 32  # (one process per node)
    # sync=auto's cell on this job adds these options (bench keys) to its default candidates, each set as the bench
    # runs it (:func:`as_candidate`): where they reach the target and the defaults do not, or first
    candidates: tuple[str, ...] = ()
    relaxed: tuple[str, ...] = ("relaxed_allreduce", "relaxed_link_allreduce", "relaxed_dgc", "relaxed_streaming")


JOBS = {
    # timm's test_resnet on digits at 32 px to 95 %: 60-70 steps, 3-5 s of training at 1 Gbit.
    "tta": Job("tta", target=95.0, epochs=25, slow=2, change=3, ratios="bench/results/tta_ratios.jsonl"),
    # The same model at 64 px on augmented digits, batch 16, lr 0.6, to 97 %: ~400 steps; local updates cost steps.
    "tta_hard": Job(
        "tta_hard",
        target=97.0,
        epochs=40,
        slow=2,
        change=7,
        node_batch=16,
        eval_every=4,
        ratios="bench/results/tta_hard_ratios.jsonl",
        # gossip, first at 1 Gbit on this job, and DiLoCo as it reaches the target here (plain averaging outside)
        candidates=("sgp_overlap", "diloco_avg", "relaxed_sgp_overlap", "relaxed_diloco_avg"),
        relaxed=("relaxed_allreduce", "relaxed_link_allreduce", "relaxed_sgp_overlap", "relaxed_diloco_avg"),
    ),
}
ROOT = Path(__file__).resolve().parents[1]


def scenario_of(name: str, job: Job) -> dict[str, Any]:
    """Scenario ``name`` for ``job``: its epochs filled in (the uneven node slows at ``job.slow``, drop and slowed
    change at ``job.change``)."""
    spec = SCENARIOS[name]
    epochs = {"slow": job.slow, "change": job.change}
    out = dict(spec, label=spec["label"].format(**epochs))
    if "overrides" in spec:
        out["overrides"] = [o.format(**epochs) for o in spec["overrides"]]
    if "then" in spec:
        out["then"] = dict(spec["then"], epoch=job.change)
    return out


DEFAULT_SCENARIOS = ("fleet", "1gbit", "uneven")  # the table's; drop and slowed are for sync=auto (--repeats)
UNEVEN = ("uneven", "slowed", "mild")  # the scenarios that also run the relaxed-sync cells
# sync=auto reads the steps ratios from bench/tta's results: a copy of those there when the run starts (this run
# rewrites the file as it goes).
AUTO = "auto"
DEFAULT_ALGORITHMS = (
    "none,allreduce,powersgd,dgc,localsgd4,localsgd16,adaptive_localsgd,diloco,streaming,sgp_overlap,crossover_overlap,"
    "auto"
)
# DiLoCo and streaming DiLoCo with plain averaging for their outer step (outer lr 1, no momentum): on the second
# job the papers' outer Nesterov step (lr 0.7, momentum 0.9) never reaches the target (docs/benchmarks/tta.md).
PLAIN_OUTER = ["sync.outer_lr=1.0", "sync.outer_momentum=0.0"]
OPTIONS: dict[str, tuple[str, list[str]]] = {
    **ALGORITHMS,
    "diloco_avg": ("DiLoCo H=16, averaging", [*ALGORITHMS["diloco"][1], *PLAIN_OUTER]),
    "streaming_avg": ("streaming DiLoCo, averaging", [*ALGORITHMS["streaming"][1], *PLAIN_OUTER]),
    # SparseLoCo's own variant: no outer momentum (its error-feedback buffer carries what momentum would)
    "sparse_avg": ("SparseLoCo 2 %, averaging", [*ALGORITHMS["sparse"][1], *PLAIN_OUTER]),
    # The density the docs recommend on CNN jobs (docs/benchmarks/diloco.md's sweep), with and without the outer step
    "sparse5": ("SparseLoCo 5 %", [*ALGORITHMS["sparse"][1], "sync.density=0.05"]),
    "sparse5_avg": ("SparseLoCo 5 %, averaging", [*ALGORITHMS["sparse"][1], "sync.density=0.05", *PLAIN_OUTER]),
    # Rounds that close on a quorum: streaming DiLoCo's settings (the first job's), and DiLoCo H=16 with plain
    # averaging (the second job's DiLoCo that reaches its target).
    "decoupled": ("decoupled DiLoCo", ["sync=decoupled"]),
    "decoupled_streaming_avg": ("decoupled DiLoCo, averaging", ["sync=decoupled", *PLAIN_OUTER]),
    "decoupled_avg": (
        "decoupled DiLoCo H=16, averaging",
        ["sync=decoupled", "sync.inner_steps=16", "sync.fragments=1", "sync.delay=0", "sync.quantize=none"]
        + PLAIN_OUTER,
    ),
}
SCOPES = ("node", "process")  # (--procs > 1: each cell at both)
FLEET_SPARSITY = "[0.75,0.9375,0.984375,0.996,0.999]"
WARMED_UP = {"dgc": "sync", "relaxed_dgc": "sync.inner"}  # the cells that run DGC, and where its section is
# The uneven scenario also runs these under relaxed sync: eviction composed with an exchange, evicting ranks slower
# than RELAXED_THRESHOLD x the median.
RELAXED_THRESHOLD = 2.0
RELAXED_STREAMING = [
    "sync=relaxed",
    "sync@sync.inner=diloco",
    "sync.measure=compute",
    "sync.inner.inner_steps=32",
    "sync.inner.fragments=4",
    "sync.inner.delay=2",
    "sync.inner.quantize=int8",
]
RELAXED: dict[str, tuple[str, list[str]]] = {
    "relaxed_allreduce": ("relaxed (compute) + allreduce", ["sync=relaxed", "sync.measure=compute"]),
    "relaxed_link_allreduce": ("relaxed (link) + allreduce", ["sync=relaxed", "sync.measure=link"]),
    "relaxed_dgc": ("relaxed (compute) + DGC", ["sync=relaxed", "sync@sync.inner=dgc", "sync.measure=compute"]),
    "relaxed_streaming": ("relaxed (compute) + streaming DiLoCo", RELAXED_STREAMING),
    # (streaming DiLoCo's settings with plain averaging for the outer step, which never falls back on the first job)
    "relaxed_streaming_avg": (
        "relaxed (compute) + streaming DiLoCo, averaging",
        [*RELAXED_STREAMING, "sync.inner.outer_lr=1.0", "sync.inner.outer_momentum=0.0"],
    ),
    # (the second job's: DiLoCo H=16 with plain averaging for its outer step, the DiLoCo that reaches its target)
    "relaxed_diloco_avg": (
        "relaxed (compute) + DiLoCo H=16, averaging",
        [
            "sync=relaxed",
            "sync@sync.inner=diloco",
            "sync.measure=compute",
            "sync.inner.inner_steps=16",
            "sync.inner.outer_lr=1.0",
            "sync.inner.outer_momentum=0.0",
        ],
    ),
    "relaxed_sgp_overlap": (
        "relaxed (compute) + SGP overlap",
        [
            "sync=relaxed",
            "sync@sync.inner=sgp",
            "sync.measure=compute",
            "sync.inner.overlap=true",
            "sync.inner.consensus_every=1000000",
        ],
    ),
}
# Fleet's local SGD table in our terms, at the 100 Mbit tier: the averaging period against throughput and top-1,
# for a fixed number of epochs (no target), with DiLoCo's H beside it. k=1 averages after every step.
SWEEP: dict[str, tuple[str, list[str]]] = {
    **{
        f"localsgd{k}": (f"local SGD k={k}", ["sync=localsgd", "sync.begin_step=0", f"sync.k_steps={k}"])
        for k in (1, 2, 4, 8, 16)
    },
    "adaptive_localsgd": ("adaptive (k0=16)", ["sync=adaptive_localsgd", "sync.begin_step=0", "sync.init_k_steps=16"]),
    **{f"diloco{h}": (f"DiLoCo H={h}", ["sync=diloco", f"sync.inner_steps={h}"]) for h in (8, 16, 32, 64)},
}


def time_to_target(metrics: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """What a run's records say about reaching ``target`` top-1: the training clock starts when the first step
    starts and leaves every evaluation's own seconds out, but what the logging rank waited in it for the slowest
    (``wait_s``): evaluations every few steps are barriers, and an option that exchanges every k steps would wait
    that long at its next exchange without them (a straggler's cost, else hidden in the evaluations)."""
    train = [r for r in metrics if r["kind"] == "train"]
    evals = [r for r in metrics if r["kind"] == "eval"]
    if not train or not evals:
        raise CellFailed("no train or eval records")
    start = train[0]["time"] - train[0]["step_s"]
    curve, spent = [], 0.0
    for e in evals:
        spent += e["eval_s"] - e.get("wait_s", 0.0)
        curve.append({"step": e["step"], "epoch": e["epoch"], "top1": e["top1"], "s": e["time"] - start - spent})
    hit = next((c for c in curve if c["top1"] >= target), None)
    to = [r for r in train if hit is None or r["step"] < hit["step"]]
    summary = next((r for r in reversed(metrics) if r["kind"] == "summary"), {})
    trained_s = sum(r["step_s"] for r in train)
    whole_epoch = any(r["epoch"] > 1 for r in train)  # (steps per epoch are known once the first one ended)
    steps_per_epoch = sum(1 for r in train if r["epoch"] == 1)
    return {
        "reached": hit is not None,
        "seconds": hit["s"] if hit else None,
        "steps": hit["step"] if hit else None,
        "epochs": hit["step"] / steps_per_epoch if hit and whole_epoch else None,
        "mb_per_node": sum(r["bytes_sent"] for r in to) / 1e6,
        "wire_mb_node0": sum(r.get("wire_bytes", 0) for r in to) / 1e6,
        "final_top1": evals[-1]["top1"],
        "best_top1": max(e["top1"] for e in evals),
        "trained_s": curve[-1]["s"],
        "trained_steps": len(train),
        "samples_per_s": sum(r["samples_per_s"] * r["step_s"] for r in train) / trained_s,  # all samples / all time
        "evictions": summary.get("evictions", 0),
        "evicted_ranks": summary.get("evicted_ranks", []),
        "syncs": summary.get("syncs", []),  # (sync=auto: what it chose, when and why)
        # (sync=decoupled: steps that entered the model over steps computed, by the target)
        "goodput": next((r["goodput"] for r in reversed(to) if "goodput" in r), None),
        "curve": curve,
    }


def fleet_warmup(nodes: int, section: str, job: Job = JOBS["tta"]) -> list[str]:
    """DGC's sparsity warm-up as Fleet's examples and bench/dgc_accuracy run it: dense for the first epoch, then
    0.75, 0.9375, 0.984375 and 0.996 over the next two, then 0.999 (``section``: ``sync`` or ``sync.inner``)."""
    epoch = steps_per_epoch(job.train_images, nodes, job.node_batch)
    return [
        f"{section}.rampup_begin_step={epoch}",
        f"{section}.rampup_step={2 * epoch}",
        f"{section}.sparsity={FLEET_SPARSITY}",
    ]


def as_candidate(key: str, overrides: list[str]) -> list[str]:
    """The overrides that add the option bench/tta runs as ``key`` (its ``overrides``, of ``sync``) to sync=auto's
    candidates under that key, set as the bench runs it, so that the steps ratio the data holds for ``key`` is for
    those settings: ``sync=X`` adds the group there, ``sync@sync.inner=X`` sets its inner option, ``sync.a=v`` its
    setting."""
    out = []
    for override in overrides:
        name, _, value = override.partition("=")
        if name == "sync":
            out.append(f"+sync@sync.candidates.{key}={value}")
        elif name.startswith("sync@sync."):
            out.append(f"sync@sync.candidates.{key}.{name.removeprefix('sync@sync.')}={value}")
        elif name.startswith("sync."):
            out.append(f"sync.candidates.{key}.{name.removeprefix('sync.')}={value}")
        else:
            raise ValueError(f"{key}: {override} is not a setting of sync")
    return out


def job_candidates(job: Job, nodes: int) -> list[str]:
    """The overrides that add ``job.candidates`` to sync=auto's, each set as this bench runs it on ``job``."""
    out = []
    for key in job.candidates:
        settings = (OPTIONS | RELAXED)[key][1]
        if key in WARMED_UP:
            settings = [*settings, *fleet_warmup(nodes, WARMED_UP[key], job)]
        if key in RELAXED:  # (as sync=auto's own relaxed candidates: it checks every 10 steps)
            settings = [*settings, f"sync.relaxed_sync_threshold={RELAXED_THRESHOLD}", "sync.check_every=10"]
        out += as_candidate(key, settings)
    return out


def cells_of(args: argparse.Namespace) -> list[tuple[str, str, str, list[str]]]:
    """(scenario, algorithm key, column name, overrides) for every run, in the order they run; the period sweep
    (scenario ``sweep``) last, on the 100 Mbit tier, for ``--sweep-epochs`` without a target."""
    out, job = [], JOBS[args.job]
    for scenario in args.scenarios:
        keys = list(args.algorithms) + (list(args.relaxed) if scenario in UNEVEN else [])
        for key in keys:
            name, overrides = (OPTIONS | RELAXED)[key]
            if key in WARMED_UP:  # (bench/network's DGC compresses from step 0)
                name, overrides = f"{name} (warm-up)", [*overrides, *fleet_warmup(args.nodes, WARMED_UP[key], job)]
            run = [f"trainer.epochs={args.epochs}", f"trainer.target_top1={args.target}"]
            if key in RELAXED:  # (the node is 3x slower: the default threshold, 3x the median, is a coin toss)
                run.append(f"sync.relaxed_sync_threshold={RELAXED_THRESHOLD}")
            if key == AUTO:
                run += [f"sync.steps_data={args.steps_data}", *job_candidates(job, args.nodes)]
            out.append((scenario, key, name, [*overrides, *scenario_of(scenario, job).get("overrides", []), *run]))
    fixed = [f"trainer.epochs={args.sweep_epochs}", "trainer.target_top1=null"]
    out += [("sweep", key, SWEEP[key][0], [*SWEEP[key][1], *fixed]) for key in args.sweep]
    if args.procs == 1:
        return out
    per_process = [f"data.batch_size={job.node_batch // args.procs}"]
    return [
        (scenario, f"{key}@{scope}", f"{name} [{scope}]", [*overrides, *per_process, f"sync.scope={scope}"])
        for scenario, key, name, overrides in out
        for scope in SCOPES
    ]


def rates_for(scenario: str, nodes: int) -> list[str]:
    rates = SCENARIOS["fleet" if scenario == "sweep" else scenario]["rates"]
    return rates * nodes if len(rates) == 1 else [*rates[: nodes - 1], rates[-1]]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / f"{args.name}.jsonl"
    jsonl.write_text("")
    workdir = Path(tempfile.mkdtemp(prefix="relaxsync-tta-"))
    if args.steps_data is None and AUTO in args.algorithms:  # (sync=auto's data: the job's, before this run)
        args.steps_data = str(workdir / "steps-data.jsonl")
        shutil.copyfile(ROOT / JOBS[args.job].ratios, args.steps_data)
    rows = []
    common = [
        f"experiment={args.job}", f"trainer.eval_every_steps={args.eval_every}",
    ]  # fmt: skip
    cells = cells_of(args)  # (with --repeats: a scenario's cells once each, then again, side by side in time)
    runs = [
        (scenario, key, name, overrides, attempt)
        for scenario in dict.fromkeys(c[0] for c in cells)
        for attempt in range(1, args.repeats + 1)
        for s, key, name, overrides in cells
        if s == scenario
    ]
    try:
        with EmulatedNetwork(args.nodes) as net:
            shaped = None
            for i, (scenario, key, name, overrides, attempt) in enumerate(runs):
                if shaped != scenario:
                    net.shape(rates_for(scenario, args.nodes))
                    shaped = scenario
                of = f" ({attempt} of {args.repeats})" if args.repeats > 1 else ""
                print(f"[{time.strftime('%H:%M:%S')}] {scenario:>7}  {name}{of}", flush=True)
                row = {"job": args.job, "run": args.name, "scenario": scenario, "algorithm": key, "name": name,
                       "nodes": args.nodes,
                       "target": args.target,
                       "procs_per_node": args.procs, "scope": key.partition("@")[2] or "process"}  # fmt: skip
                if args.repeats > 1:
                    row["attempt"], row["seed"] = attempt, args.seed + attempt - 1
                try:
                    # (the sweep is no scenario: it stays as shaped)
                    then = scenario_of(scenario, JOBS[args.job]).get("then") if scenario in SCENARIOS else None
                    change = None
                    if then is not None:
                        change = (then["epoch"], lambda rates=then["rates"]: net.shape(rates * args.nodes))
                        shaped = None  # (the next cell starts from the scenario's own rates again)
                    seed = args.seed + attempt - 1  # (each attempt its own seed, alike for the cells side by side)
                    job = run_job(
                        net, [*common, f"trainer.seed={seed}", *overrides], args.max_steps or 10**9,
                        f"{scenario}-{key.replace('@', '-')}-{attempt}",
                        args.port + i, workdir, args.cell_timeout, procs=args.procs, at_epoch=change,
                    )  # fmt: skip
                    row.update(time_to_target(job["metrics"], args.target), wall_s=job["wall_s"])
                    world = next(r for r in job["metrics"] if r["kind"] == "event" and r["event"] == "world")
                    row["node_of_rank"] = {r: net.node_of(h) for r, h in world["hosts"].items()}
                    reached = f"{row['seconds']:.0f} s, {row['steps']} steps" if row["reached"] else "not reached"
                    print(f"  {reached}; best top-1 {row['best_top1']:.2f}%", flush=True)
                except CellFailed as error:
                    row["error"] = str(error)
                    print(f"  failed: {str(error).splitlines()[0]}", flush=True)
                rows.append(row)
                with open(jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per scenario and algorithm: with ``--repeats`` (a seed each), the run of median seconds to the target
    (one that never reached it counts as the slowest), with every run's seconds beside it (``runs_s``: None where it
    did not reach the target)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["algorithm"]), []).append(r)
    out = []
    for runs in groups.values():
        if len(runs) == 1:
            out.append(runs[0])
            continue
        ranked = sorted(runs, key=lambda r: r["seconds"] if r.get("reached") else math.inf)
        median = dict(ranked[(len(ranked) - 1) // 2])
        median["runs_s"] = [r["seconds"] if r.get("reached") else None for r in runs]
        out.append(median)
    return out


def label(scenario: str, job: str = "tta") -> str:
    """A scenario's name in the tables (its epochs those of ``job``)."""
    if scenario == "sweep":
        return "period sweep at 100 Mbit, fixed epochs"
    return scenario_of(scenario, JOBS[job])["label"]


def job_of(rows: list[dict[str, Any]]) -> str:
    """The job a run's records trained (records before the second job: ``tta``)."""
    return rows[0].get("job", "tta") if rows else "tta"


def table(rows: list[dict[str, Any]]) -> str:
    """Scenarios down, algorithms across: seconds to the target (x allreduce's), steps, MB sent per node; then, per
    scenario, which algorithm got there first and by how much against allreduce."""
    rows = [r for r in rows if r["scenario"] != "sweep"]
    if not rows:
        return ""
    names: dict[str, str] = {}
    for r in rows:
        names.setdefault(r["algorithm"], r["name"])
    lines = ["| scenario | " + " | ".join(names.values()) + " |", "|---|" + "---|" * len(names)]
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        cells = {r["algorithm"]: r for r in rows if r["scenario"] == scenario}
        base = cells.get("allreduce", cells.get("allreduce@process", {})).get("seconds")
        out = []
        for key in names:
            r = cells.get(key)
            if r is None:
                out.append("")
            elif "error" in r:
                out.append("failed")
            elif not r["reached"]:
                out.append(f"not reached ({r['best_top1']:.1f}% in {r['trained_s']:.0f} s)")
            else:
                ratio = f" ({r['seconds'] / base:.2f}×)" if base else ""
                spread = ""
                if r.get("runs_s"):
                    reached = [t for t in r["runs_s"] if t is not None]
                    spread = f" [{len(reached)}/{len(r['runs_s'])}: {min(reached):.1f}–{max(reached):.1f} s]"
                out.append(f"{r['seconds']:.1f} s{ratio}{spread}, {r['steps']} steps, {r['mb_per_node']:.0f} MB")
        lines.append(f"| {label(scenario, job_of(rows))} | " + " | ".join(out) + " |")
    lines.append("")
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        lines.append(f"- {label(scenario, job_of(rows))}: {verdict([r for r in rows if r['scenario'] == scenario])}")
    return "\n".join(lines)


def verdict(cells: list[dict[str, Any]]) -> str:
    """The first to the target and its ratio to allreduce; the algorithms that never got there."""
    reached = sorted((r for r in cells if r.get("reached")), key=lambda r: r["seconds"])
    missed = [r["name"] for r in cells if "error" not in r and not r["reached"]]
    failed = [r["name"] for r in cells if "error" in r]
    base = next((r["seconds"] for r in reached if r["algorithm"] in ("allreduce", "allreduce@process")), None)
    if reached:
        first = reached[0]
        ratio = (
            f", {base / first['seconds']:.1f}x faster than allreduce"
            if base and first["algorithm"].partition("@")[0] != "allreduce"
            else ""
        )
        text = f"first to the target: {first['name']} ({first['seconds']:.1f} s{ratio})"
    else:
        text = "no algorithm reached the target"
    if missed:
        text += f"; never reached it: {', '.join(missed)}"
    if failed:
        text += f"; failed: {', '.join(failed)}"
    return text + auto_verdict(cells)


def auto_verdict(cells: list[dict[str, Any]]) -> str:
    """sync=auto's time against the best static option's in the same scenario, and what it chose when."""
    auto = next((r for r in cells if r["algorithm"] == AUTO and r.get("reached")), None)
    static = sorted((r for r in cells if r.get("reached") and r["algorithm"] != AUTO), key=lambda r: r["seconds"])
    if auto is None or not static:
        return ""
    chose = "; ".join(
        f"{c['option']} at step {c['at_steps']} ({c['why']})"
        for c in auto.get("syncs", [])
        if c["option"] != c["previous"]
    )
    best = static[0]
    return (
        f". auto: {auto['seconds'] / best['seconds']:.2f}x the best static option's time ({best['name']}), "
        f"choosing {chose or 'nothing'}"
    )


def scope_table(rows: list[dict[str, Any]]) -> str:
    """``--procs`` > 1: each algorithm at node scope beside process scope, per scenario: seconds to the target, their
    ratio, and the MB that node 0 sent on its link (its interface) until then."""
    rows = [r for r in rows if r.get("procs_per_node", 1) > 1 and r["scenario"] != "sweep"]
    if not rows:
        return ""
    lines = ["| scenario | sync | node scope: s to target | process scope | node / process | MB on node 0's link "
             "(node / process) |", "|---|---|---|---|---|---|"]  # fmt: skip

    def seconds(r: dict[str, Any] | None) -> str:
        if r is None or "error" in r:
            return "failed" if r else ""
        return f"{r['seconds']:.1f} s ({r['steps']} steps)" if r["reached"] else f"not reached ({r['best_top1']:.1f}%)"

    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        cells, where = {r["algorithm"]: r for r in rows if r["scenario"] == scenario}, label(scenario, job_of(rows))
        for key in dict.fromkeys(k.partition("@")[0] for k in cells):
            node, process = cells.get(f"{key}@node"), cells.get(f"{key}@process")
            both = node and process and node.get("reached") and process.get("reached")
            ratio = f"{node['seconds'] / process['seconds']:.2f}" if both else ""
            wire = f"{node['wire_mb_node0']:.1f} / {process['wire_mb_node0']:.1f}" if both else ""
            name = (node or process)["name"].rsplit(" [", 1)[0]
            lines.append(f"| {where} | {name} | {seconds(node)} | {seconds(process)} | {ratio} | {wire} |")
    return "\n".join(lines)


def sweep_table(rows: list[dict[str, Any]]) -> str:
    """Fleet's local SGD table in our terms: throughput against top-1 per averaging period, DiLoCo's H beside."""
    rows = [r for r in rows if r["scenario"] == "sweep" and "error" not in r]
    if not rows:
        return ""
    base = next((r["samples_per_s"] for r in rows if r["algorithm"] == "localsgd1"), None)
    head = "| period | samples/s | × k=1 | MB per node and step | steps to target | s to target | final top-1 | best |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = f"{r['samples_per_s'] / base:.2f}" if base else ""
        per_step = r["mb_per_node"] / max(r["steps"] or r["trained_steps"], 1)  # (bytes up to the target, or all)
        to = (f"{r['steps']}", f"{r['seconds']:.1f}") if r["reached"] else ("not reached", "")
        lines.append(
            f"| {r['name']} | {r['samples_per_s']:.0f} | {speed} | {per_step:.3f} | {to[0]} | {to[1]} "
            f"| {r['final_top1']:.2f} | {r['best_top1']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path, name: str = "tta") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        fig, ax = plt.subplots(figsize=(9, 5))
        target = None
        for r in rows:
            if r["scenario"] != scenario or "error" in r:
                continue
            target = r["target"]
            xs, ys = [c["s"] for c in r["curve"]], [c["top1"] for c in r["curve"]]
            style = {  # (the floor, and sync=auto, which the colour cycle would give allreduce's colour)
                "none": {"color": "black", "linewidth": 2.5},
                AUTO: {"color": "black", "linewidth": 2.0, "linestyle": "-."},
            }.get(r["algorithm"], {})
            style.setdefault("linestyle", "--" if "relaxed" in r["algorithm"] else "-")
            ax.plot(xs, ys, marker=".", label=r["name"], **style)
        if target is not None:
            ax.axhline(target, color="grey", linewidth=1, linestyle=":", label=f"target {target:g}%")
        ax.set_xlabel("training seconds (evaluations left out, but for their waits for the slowest rank)")
        ax.set_ylabel("validation top-1 (%)")
        ax.set_title(f"time to accuracy: {label(scenario, job_of(rows))}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = out / f"{name}_{scenario}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def report(rows: list[dict[str, Any]], out: Path, command: str, name: str = "tta") -> str:
    rows = medians(rows)
    text = "\n\n".join(part for part in (table(rows), scope_table(rows), sweep_table(rows)) if part)
    (out / f"{name}.md").write_text(f"{text}\n\n{command}; {machine()}\n")
    plot(rows, out, name)
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--scenarios",
        default=",".join(DEFAULT_SCENARIOS),
        help=f"comma-separated: {', '.join(SCENARIOS)} (default: the table's three; drop and slowed change mid-run)",
    )
    parser.add_argument("--algorithms", default=DEFAULT_ALGORITHMS, help=f"comma-separated: {', '.join(OPTIONS)}")
    parser.add_argument(
        "--relaxed", help=f"the uneven scenarios' relaxed-sync cells: {', '.join(RELAXED)} (default: the job's)"
    )
    parser.add_argument(
        "--steps-data", help="sync=auto's steps ratios: a bench/tta result file (default: a copy of sync=auto's own)"
    )
    parser.add_argument(
        "--job", default="tta", choices=tuple(JOBS), help="what every cell trains: experiment=<job> (default: tta)"
    )
    parser.add_argument("--nodes", type=int, default=4, choices=(2, 3, 4))
    parser.add_argument("--target", type=float, help="validation top-1 (%%) to reach (default: the job's)")
    parser.add_argument("--eval-every", type=int, help="steps between evaluations (default: the job's)")
    parser.add_argument(
        "--epochs", type=int, help="the cap: a run that has not reached the target stops (default: the job's)"
    )
    parser.add_argument("--max-steps", type=int, default=None, help="also stop a run after this many steps")
    parser.add_argument("--sweep", default=",".join(SWEEP), help="the period sweep's cells ('' for none)")
    parser.add_argument("--sweep-epochs", type=int, default=8, help="epochs each sweep cell trains, without a target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every cell, seeds --seed, --seed + 1, ... (tables: the median's)",
    )
    parser.add_argument("--cell-timeout", type=float, default=900.0, help="seconds before a run counts as failed")
    parser.add_argument("--port", type=int, default=29700)
    parser.add_argument("--procs", type=int, default=1, help="processes per node (> 1: each cell at both scopes)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--name", help="the results' file names (default: tta, or tta_nodes with --procs > 1)")
    parser.add_argument("--report", metavar="DIR", help="only redraw the table and plots from DIR/<name>.jsonl")
    args = parser.parse_args(argv)
    job = JOBS[args.job]
    args.target = job.target if args.target is None else args.target
    args.epochs = job.epochs if args.epochs is None else args.epochs
    args.eval_every = job.eval_every if args.eval_every is None else args.eval_every
    args.relaxed = ",".join(job.relaxed) if args.relaxed is None else args.relaxed
    if args.procs < 1 or job.node_batch % args.procs:
        parser.error(f"--procs={args.procs}: a divisor of the node's batch, {job.node_batch}")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: 1 or more")
    args.name = args.name or (args.job if args.procs == 1 else f"{args.job}_nodes")
    if AUTO in args.algorithms and args.steps_data is None and not (ROOT / job.ratios).is_file():
        parser.error(f"--algorithms={','.join(args.algorithms)}: sync=auto on --job {args.job} reads {job.ratios} "
                     "(not there yet: run its candidates first, or give --steps-data)")  # fmt: skip
    for flag, value, allowed in (
        ("--scenarios", args.scenarios, SCENARIOS),
        ("--algorithms", args.algorithms, OPTIONS),
        ("--relaxed", args.relaxed, RELAXED),
        ("--sweep", args.sweep, SWEEP),
    ):
        chosen = [v for v in value.split(",") if v]
        bad = [v for v in chosen if v not in allowed]
        if bad:
            parser.error(f"{flag}={value}: {', '.join(bad)} not among {', '.join(allowed)}")
        setattr(args, flag[2:], chosen)
    if not 0 < args.target <= 100:
        parser.error(f"--target={args.target}: a top-1 % in (0, 100]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        out = Path(args.report)
        rows = [json.loads(line) for line in (out / f"{args.name}.jsonl").read_text().splitlines() if line]
        print(report(rows, out, "python -m bench.tta --report", args.name))
        return 0
    reason = unavailable()
    if reason:
        print(f"bench.tta: skipped: {reason}", flush=True)
        return 0
    started = time.perf_counter()
    try:
        rows = run(args)
    except KeyboardInterrupt:
        print("bench.tta: interrupted; processes stopped and namespaces removed", flush=True)
        return 130
    command = "python -m bench.tta " + " ".join(argv if argv is not None else sys.argv[1:])
    print(report(rows, Path(args.out), command.strip(), args.name))
    minutes = (time.perf_counter() - started) / 60
    print(f"bench.tta: {minutes:.1f} min; results in {args.out}/{args.name}.jsonl and {args.name}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
