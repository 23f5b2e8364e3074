"""Local SGD periods side by side: k = 1, 2, 4, 8, 16 and adaptive (ADACOMM), ResNet-18 on digits, 2 processes.

    python -m bench.localsgd [--epochs 6] [--begin-epochs 1]

Every run: synchronous SGD for ``--begin-epochs`` epochs, then local steps with averaging every k. Reported:
median samples/s and mean bytes sent per step over the local phase, and the final validation top-1.
The shape to expect (Fleet's ResNet-50 table): fewer bytes and more samples/s as k grows, accuracy falling
with k, adaptive in between. Results: bench/results/localsgd.json.
"""

from __future__ import annotations

import argparse
import json

from bench.common import RESULTS, machine, median, run, train_records

STEPS_PER_EPOCH = 1438 // 2 // 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--begin-epochs", type=int, default=1)
    parser.add_argument("--model", default="resnet18")
    args = parser.parse_args()
    begin = args.begin_epochs * STEPS_PER_EPOCH
    common = [f"model={args.model}", "data=digits", "trainer.nproc=2", f"trainer.epochs={args.epochs}"]
    runs = {f"k={k}": ["sync=localsgd", f"sync.begin_step={begin}", f"sync.k_steps={k}"] for k in (1, 2, 4, 8, 16)}
    runs["adaptive (init k=4)"] = ["sync=adaptive_localsgd", f"sync.begin_step={begin}", "sync.init_k_steps=4"]
    rows = {}
    for name, overrides in runs.items():
        print(f"running: {name}", flush=True)
        metrics = run([*common, *overrides])
        local = [r for r in train_records(metrics) if r["step"] >= begin]
        summary = next(r for r in metrics if r["kind"] == "summary")
        rows[name] = {
            "samples_per_s": median(r["samples_per_s"] for r in local),
            "bytes_per_step": sum(r["bytes_sent"] for r in local) / len(local),
            "top1": summary["top1"],
            "mean_k": sum(r.get("k_steps", 0) for r in local) / len(local),
        }
    result = {
        "benchmark": "localsgd",
        "command": (
            f"python -m bench.localsgd --epochs {args.epochs} --begin-epochs {args.begin_epochs} --model {args.model}"
        ),
        "machine": machine(),
        "runs": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "localsgd.json").write_text(json.dumps(result, indent=1) + "\n")
    print("\n| sync | samples/s | bytes/step | top-1 |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['samples_per_s']:.0f} | {r['bytes_per_step']:.0f} | {r['top1']:.2f} |")


if __name__ == "__main__":
    main()
