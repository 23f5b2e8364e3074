"""DiLoCo's accuracy against allreduce, and its period H beside local SGD's k: ResNet-18 on digits.

    python -m bench.diloco [--nprocs 2,4] [--epochs 10,20] [--periods 8,16,32,64] [--out diloco.json]
    python -m bench.diloco --scopes [--seeds 0,1,2] [--epochs 10]     # sync.scope=node against process
    python -m bench.diloco --compare sparse,sparse_avg --nprocs 4 --epochs 20 [--seeds 0,1,2]  # ways of sending

For each world size (same seed, epochs and per-process batch for every algorithm): allreduce; DiLoCo (outer
Nesterov SGD, lr 0.7, momentum 0.9) at every period H; Streaming DiLoCo (H=32 in 4 fragments, delay 2, int8);
and local SGD (plain parameter averaging) at k = each H. Reported per run: final and best validation top-1,
median samples/s and mean bytes sent per step.
Target: DiLoCo and Streaming DiLoCo within 1 point of allreduce's final top-1.

The default epochs, 10 at 2 processes and 20 at 4, give both world sizes the same 440 optimizer steps: DiLoCo's
period H is counted in steps, so at 4 processes and 10 epochs a run would have only 7 outer steps at H=32, too
few for the outer momentum to matter (bench/results/diloco.json records that run: streaming DiLoCo 3 points
behind). Results: bench/results/<out>; read in docs/benchmarks/diloco.md.

``--compare``: streaming DiLoCo's schedule with each way of sending its pseudo-gradients (:data:`COMPARE_RUNS`:
int8, fp4, SparseLoCo with and without the outer Nesterov step) beside allreduce, at every seed (a seed's runs side
by side), each run's final top-1 against allreduce's at the same seed (bench/results/diloco_compare.json).

``--scopes``: DiLoCo (H=16) and local SGD (k=16) on 2 emulated nodes of 2 processes (``trainer.local_nodes=2``), at
``sync.scope=node`` (2 replicas, each node's processes agreeing every step) and at ``sync.scope=process`` (4
replicas), the same global batch and steps, for each seed; validation top-1 after every epoch, the mean over the
seeds side by side (bench/results/diloco_scope.json; docs/benchmarks/diloco.md, "Nodes or processes").
"""

from __future__ import annotations

import argparse
import json

from bench.common import RESULTS, machine, median, run, train_records
from bench.tta import OPTIONS


def summarize(metrics: list[dict]) -> dict:
    steps = train_records(metrics)
    summary = next(r for r in metrics if r["kind"] == "summary")
    return {
        "top1": summary["top1"],
        "best_top1": summary["best_top1"],
        "samples_per_s": median(r["samples_per_s"] for r in steps),
        "bytes_per_step": sum(r["bytes_sent"] for r in steps) / len(steps),
        "steps": len(steps),
    }


# ``--compare``'s runs, as bench/tta runs them: streaming DiLoCo's schedule with each way of sending its
# pseudo-gradients (int8, fp4, SparseLoCo at 2 % and 5 % with the outer Nesterov step and with plain averaging)
COMPARE = ("allreduce", "streaming", "streaming_fp4", "sparse", "sparse_avg", "sparse5", "sparse5_avg")
COMPARE_RUNS = {key: OPTIONS[key][1] for key in COMPARE}

SCOPE_RUNS = {
    "DiLoCo H=16": ["sync=diloco", "sync.inner_steps=16"],
    "local SGD k=16": ["sync=localsgd", "sync.begin_step=0", "sync.k_steps=16"],
}


def scopes(seeds: list[int], epochs: int, batch_size: int, model: str) -> dict:
    """Each of :data:`SCOPE_RUNS` at node and at process scope, 2 nodes x 2 processes, for every seed."""
    results: dict[str, dict[str, list[dict]]] = {}
    for name, overrides in SCOPE_RUNS.items():
        for scope in ("node", "process"):
            for seed in seeds:
                print(f"running: {name}, sync.scope={scope}, seed {seed}", flush=True)
                metrics = run([
                    f"model={model}", "data=digits", f"data.batch_size={batch_size}", "trainer.nproc=4",
                    "trainer.local_nodes=2", f"trainer.epochs={epochs}", f"trainer.seed={seed}", *overrides,
                    f"sync.scope={scope}",
                ])  # fmt: skip
                evals = [r for r in metrics if r["kind"] == "eval"]
                row = {**summarize(metrics), "seed": seed, "eval_top1": [r["top1"] for r in evals]}
                results.setdefault(name, {}).setdefault(scope, []).append(row)
    return results


def compare(keys: list[str], seeds: list[int], nproc: int, epochs: int, batch_size: int, model: str) -> dict:
    """Each of ``keys`` (:data:`COMPARE_RUNS`) at every seed, a seed's runs side by side: {key: {seed: summary}}."""
    results: dict[str, dict[str, dict]] = {}
    for seed in seeds:
        for key in keys:
            print(f"running: {key}, seed {seed}", flush=True)
            metrics = run([
                f"model={model}", "data=digits", f"data.batch_size={batch_size}", f"trainer.nproc={nproc}",
                f"trainer.epochs={epochs}", f"trainer.seed={seed}", *COMPARE_RUNS[key],
            ])  # fmt: skip
            results.setdefault(key, {})[str(seed)] = summarize(metrics)
    return results


def compare_table(results: dict) -> str:
    """Final top-1 seed by seed, and the mean of each run's difference from allreduce at the same seed."""
    seeds = list(results["allreduce"])
    head = f"| sync | {' | '.join(f'seed {s}' for s in seeds)} | mean vs allreduce | bytes/step |"
    lines = [head, "|" + "---|" * (len(seeds) + 3)]
    for key, by_seed in results.items():
        top1 = [by_seed[s]["top1"] for s in seeds if s in by_seed]
        diff = [by_seed[s]["top1"] - results["allreduce"][s]["top1"] for s in seeds if s in by_seed]
        mean = sum(top1) / len(top1) if key == "allreduce" else sum(diff) / len(diff)
        per_step = sum(r["bytes_per_step"] for r in by_seed.values()) / len(by_seed)
        cells = " | ".join(f"{by_seed[s]['top1']:.2f}" if s in by_seed else "" for s in seeds)
        shown = f"({mean:.2f})" if key == "allreduce" else f"{mean:+.2f}"
        lines.append(f"| {key} | {cells} | {shown} | {per_step / 1e6:.4f} MB |")
    return "\n".join(lines)


def scope_table(results: dict) -> str:
    """Mean top-1 over the seeds after each epoch, node scope beside process scope."""
    lines = []
    for name, by_scope in results.items():
        node, process = (
            [sum(col) / len(col) for col in zip(*(r["eval_top1"] for r in by_scope[s]))] for s in ("node", "process")
        )
        seeds = len(by_scope["node"])
        lines += [f"\n{name} (mean of {seeds} seeds):\n"]
        lines += ["| epoch | step | node scope | process scope | node - process |", "|---|---|---|---|---|"]
        steps_per_epoch = by_scope["node"][0]["steps"] // len(node)
        for epoch, (a, b) in enumerate(zip(node, process), 1):
            lines.append(f"| {epoch} | {epoch * steps_per_epoch} | {a:.2f} | {b:.2f} | {a - b:+.2f} |")
    return "\n".join(lines)


def write(benchmark: str, out: str, command: str, args: argparse.Namespace, fields: dict) -> None:
    """bench/results/``out``: the benchmark's name, the command that ran it, the machine and ``fields``."""
    command = f"python -m bench.diloco {command} --batch-size {args.batch_size} --model {args.model} --out {out}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": benchmark, "command": command, **fields, "machine": machine()}
    (RESULTS / out).write_text(json.dumps(record, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--epochs", default="10,20", help="per world size (one value: the same for all)")
    parser.add_argument("--periods", default="8,16,32,64", help="H for DiLoCo and k for local SGD")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--out", default="diloco.json", help="file name under bench/results")
    parser.add_argument("--scopes", action="store_true", help="node against process scope (2 nodes x 2 processes)")
    parser.add_argument("--seeds", default="0,1,2", help="--scopes, --compare: comma-separated trainer.seed values")
    parser.add_argument(
        "--compare",
        metavar="RUNS",
        help=f"only these runs (comma-separated: {', '.join(COMPARE_RUNS)}; allreduce always) at every seed, at the "
        "first of --nprocs and --epochs",
    )
    args = parser.parse_args()
    if args.compare:
        keys = ["allreduce", *(k for k in args.compare.split(",") if k != "allreduce")]
        if unknown := [k for k in keys if k not in COMPARE_RUNS]:
            parser.error(f"--compare: unknown run {', '.join(unknown)} (allowed: {', '.join(COMPARE_RUNS)})")
        seeds, nproc, epochs = (
            [int(s) for s in args.seeds.split(",")],
            int(args.nprocs.split(",")[0]),
            int(args.epochs.split(",")[0]),
        )
        results = compare(keys, seeds, nproc, epochs, args.batch_size, args.model)
        out = "diloco_compare.json" if args.out == "diloco.json" else args.out
        command = f"--compare {args.compare} --seeds {args.seeds} --nprocs {nproc} --epochs {epochs}"
        write("diloco-compare", out, command, args, {"nproc": nproc, "epochs": epochs, "results": results})
        print(compare_table(results))
        return
    if args.scopes:
        seeds, epochs = [int(s) for s in args.seeds.split(",")], int(args.epochs.split(",")[0])
        results = scopes(seeds, epochs, args.batch_size, args.model)
        out = "diloco_scope.json" if args.out == "diloco.json" else args.out
        fields = {"nodes": 2, "procs_per_node": 2, "epochs": epochs, "results": results}
        write("diloco-scope", out, f"--scopes --seeds {args.seeds} --epochs {epochs}", args, fields)
        print(scope_table(results))
        return
    nprocs = [int(n) for n in args.nprocs.split(",")]
    epochs = [int(e) for e in args.epochs.split(",")]
    if len(epochs) == 1:
        epochs *= len(nprocs)
    if len(epochs) != len(nprocs):
        parser.error(f"--epochs {args.epochs}: one value, or one per world size of --nprocs {args.nprocs}")
    periods = [int(h) for h in args.periods.split(",")]
    streaming = COMPARE_RUNS["streaming"]
    runs: dict[str, list[str]] = {"allreduce": ["sync=allreduce"]}
    runs.update({f"DiLoCo H={h}": ["sync=diloco", f"sync.inner_steps={h}"] for h in periods})
    runs["streaming DiLoCo H=32 P=4 int8"] = streaming
    runs.update({f"local SGD k={h}": ["sync=localsgd", "sync.begin_step=0", f"sync.k_steps={h}"] for h in periods})
    results: dict[str, dict[str, dict]] = {}
    for nproc, nepochs in zip(nprocs, epochs):
        common = [
            f"model={args.model}", "data=digits", f"data.batch_size={args.batch_size}", f"trainer.nproc={nproc}",
            f"trainer.epochs={nepochs}",
        ]  # fmt: skip
        for name, overrides in runs.items():
            print(f"running: {nproc} processes, {name}", flush=True)
            results.setdefault(str(nproc), {})[name] = summarize(run([*common, *overrides]))
    result = {
        "benchmark": "diloco",
        "command": (
            f"python -m bench.diloco --nprocs {args.nprocs} --epochs {args.epochs} --periods {args.periods} "
            f"--batch-size {args.batch_size} --model {args.model} --out {args.out}"
        ),
        "epochs": dict(zip(map(str, nprocs), epochs)),
        "machine": machine(),
        "results": results,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(result, indent=1) + "\n")
    for nproc, rows in results.items():
        base = rows["allreduce"]
        print(f"\n{nproc} processes, {result['epochs'][nproc]} epochs:\n")
        print("| sync | top-1 % (vs allreduce) | best | samples/s | bytes/step |\n|---|---|---|---|---|")
        for name, r in rows.items():
            print(
                f"| {name} | {r['top1']:.2f} ({r['top1'] - base['top1']:+.2f}) | {r['best_top1']:.2f} | "
                f"{r['samples_per_s']:.0f} | {r['bytes_per_step'] / 1e6:.3f} MB |"
            )


if __name__ == "__main__":
    main()
