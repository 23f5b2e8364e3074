"""DGC vs allreduce accuracy on digits: ResNet-18, 2 processes, the same epochs, side by side.

    python -m bench.dgc_accuracy [--epochs 10] [--repeats 1]

DGC uses Fleet's warm-up: dense for the first epoch, then sparsity 0.75, 0.9375, 0.984375, 0.996 over the next
two epochs, then 0.999. Reports final validation top-1 of each and the gap (target: within 1.5 points), plus
bytes per step. Results: bench/results/dgc_accuracy.json.
"""

from __future__ import annotations

import argparse
import json

from bench.common import RESULTS, machine, median, run, train_records

STEPS_PER_EPOCH = 1438 // 2 // 32  # digits train split, 2 processes, batch 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1, help="seeds per algorithm; the median top-1 is compared")
    args = parser.parse_args()
    common = ["model=resnet18", "data=digits", "trainer.nproc=2", f"trainer.epochs={args.epochs}"]
    dgc = [
        "sync=dgc",
        f"sync.rampup_begin_step={STEPS_PER_EPOCH}",
        f"sync.rampup_step={2 * STEPS_PER_EPOCH}",
        "sync.sparsity=[0.75,0.9375,0.984375,0.996,0.999]",
    ]
    runs = {"allreduce": [*common, "sync=allreduce"], "dgc": [*common, *dgc]}
    out: dict = {name: {"top1": [], "bytes_per_step": []} for name in runs}
    for seed in range(args.repeats):
        for name, overrides in runs.items():
            print(f"running: {name}, seed {seed}", flush=True)
            metrics = run([*overrides, f"trainer.seed={seed}"])
            summary = next(r for r in metrics if r["kind"] == "summary")
            out[name]["top1"].append(summary["top1"])
            out[name]["bytes_per_step"].append(median(r["bytes_sent"] for r in train_records(metrics)[-20:]))
    result = {
        "benchmark": "dgc_accuracy",
        "command": f"python -m bench.dgc_accuracy --epochs {args.epochs} --repeats {args.repeats}",
        "machine": machine(),
        **out,
        "top1_allreduce": median(out["allreduce"]["top1"]),
        "top1_dgc": median(out["dgc"]["top1"]),
    }
    result["gap_points"] = result["top1_allreduce"] - result["top1_dgc"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "dgc_accuracy.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"\nfinal top-1: allreduce {result['top1_allreduce']:.2f} %, dgc {result['top1_dgc']:.2f} % "
        f"(gap {result['gap_points']:.2f} points); bytes/step at the end: "
        f"allreduce {median(out['allreduce']['bytes_per_step']):.0f}, dgc {median(out['dgc']['bytes_per_step']):.0f}"
    )


if __name__ == "__main__":
    main()
