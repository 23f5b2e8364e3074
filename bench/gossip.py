"""Gossip side by side: allreduce vs SGP vs Crossover-SGD (coarse, fine, hierarchical), 4 processes.

    python -m bench.gossip [--model resnet18] [--epochs 4]

ResNet-18 on digits, 4 processes (gloo), the same seed and epochs. Reported: median samples/s, median bytes
sent per rank per step (the Communicator's count), the consensus distance (mean L2 of the replicas to their
average) early and at the end, and the final top-1 of the averaged model. Results: bench/results/gossip.json.
"""

from __future__ import annotations

import argparse
import json

from bench.common import RESULTS, machine, median, run, train_records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    common = [f"model={args.model}", "data=digits", "trainer.nproc=4", f"trainer.epochs={args.epochs}"]
    gossip = ["sync.consensus_every=2"]
    runs = {
        "allreduce": ["sync=allreduce"],
        "sgp": ["sync=sgp", *gossip],
        "crossover coarse": ["sync=crossover", "sync.segments=coarse", *gossip],
        "crossover fine": ["sync=crossover", "sync.segments=fine", *gossip],
        "crossover hierarchical (2 groups of 2)": ["sync=crossover", "sync.group_size=2", *gossip],
    }
    rows = {}
    for name, overrides in runs.items():
        print(f"running: {name}", flush=True)
        metrics = run([*common, *overrides])
        steps = train_records(metrics)
        distances = [r["consensus_distance"] for r in steps if "consensus_distance" in r]
        summary = next(r for r in metrics if r["kind"] == "summary")
        rows[name] = {
            "samples_per_s": median(r["samples_per_s"] for r in steps[3:]),
            "bytes_per_step": median(r["bytes_sent"] for r in steps),
            "consensus_peak": max(distances) if distances else 0.0,
            "consensus_final": distances[-1] if distances else 0.0,
            "top1": summary["top1"],
        }
    result = {
        "benchmark": "gossip",
        "command": f"python -m bench.gossip --model {args.model} --epochs {args.epochs}",
        "machine": machine(),
        "runs": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gossip.json").write_text(json.dumps(result, indent=1) + "\n")
    print("\n| sync | samples/s | bytes/step | consensus peak | consensus final | top-1 |\n|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['samples_per_s']:.0f} | {r['bytes_per_step']:.0f} | {r['consensus_peak']:.3f} | "
            f"{r['consensus_final']:.4f} | {r['top1']:.2f} |"
        )


if __name__ == "__main__":
    main()
