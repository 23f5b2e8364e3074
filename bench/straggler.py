"""One straggler, three ways, side by side: allreduce with it, relaxed sync with it, and a healthy 2-process run.

    python -m bench.straggler [--model resnet18] [--epochs 4] [--slowdown 3.0]

3 processes, the last one slowed ``--slowdown`` x from epoch 2 (``straggler=sleep``; epochs count from 1). Relaxed
sync checks at each epoch start, so it evicts the straggler at the start of epoch 3. Reported per run, as medians
over steps: samples/s before the straggler (epoch 1), with it (epoch 2; for allreduce epochs 2+), and after the
eviction (relaxed, epochs 3+), against the healthy 2-process run. A plot of samples/s over steps goes to
bench/results/straggler.png, raw numbers to bench/results/straggler.json.
"""

from __future__ import annotations

import argparse
import json

from bench.common import RESULTS, machine, median, run, train_records


def phase(steps: list[dict], first: int, last: int | None = None) -> float:
    return median(r["samples_per_s"] for r in steps if r["epoch"] >= first and (last is None or r["epoch"] <= last))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--batch-size", type=int, default=32)
    # 64 px makes compute dominate the gradient exchange (ResNet-18, 3 processes on 2 cores: ~0.5 s of
    # compute vs ~0.1 s of exposed allreduce per step here), so a 3x slower compute shows up in the
    # synchronous step time.
    parser.add_argument("--image-size", type=int, default=64)
    args = parser.parse_args()

    common = [
        f"model={args.model}",
        "data=digits",
        f"data.image_size={args.image_size}",
        f"data.batch_size={args.batch_size}",
        f"trainer.epochs={args.epochs}",
    ]
    straggler = ["straggler=sleep", "straggler.start_epoch=2", f"straggler.slowdown={args.slowdown}"]
    runs = {
        "allreduce, 3 procs, straggler": [*common, *straggler, "trainer.nproc=3", "sync=allreduce"],
        "relaxed, 3 procs, straggler": [*common, *straggler, "trainer.nproc=3", "sync=relaxed"],
        "allreduce, 2 procs, healthy": [*common, "trainer.nproc=2", "sync=allreduce"],
    }
    steps = {}
    for name, overrides in runs.items():
        print(f"running: {name}", flush=True)
        steps[name] = train_records(run(overrides))

    healthy = phase(steps["allreduce, 2 procs, healthy"], 1)
    allreduce, relaxed = steps["allreduce, 3 procs, straggler"], steps["relaxed, 3 procs, straggler"]
    result = {
        "benchmark": "straggler",
        "command": (
            f"python -m bench.straggler --model {args.model} --epochs {args.epochs} --slowdown {args.slowdown} "
            f"--image-size {args.image_size} --batch-size {args.batch_size}"
        ),
        "machine": machine(),
        "healthy_2proc_samples_per_s": healthy,
        "allreduce": {"before": phase(allreduce, 1, 1), "with_straggler": phase(allreduce, 2)},
        "relaxed": {
            "before": phase(relaxed, 1, 1),
            "with_straggler": phase(relaxed, 2, 2),
            "after_eviction": phase(relaxed, 3),
        },
        "world_size_after": relaxed[-1]["world_size"],
        "steps": {name: [(r["step"], r["samples_per_s"], r["world_size"]) for r in s] for name, s in steps.items()},
    }
    result["allreduce_slowdown"] = result["allreduce"]["before"] / result["allreduce"]["with_straggler"]
    result["relaxed_after_vs_healthy"] = result["relaxed"]["after_eviction"] / healthy
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "straggler.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(steps, RESULTS / "straggler.png", args.slowdown)

    a, r = result["allreduce"], result["relaxed"]
    print(
        "\n| run | before (epoch 1) | with straggler | after eviction |\n|---|---|---|---|\n"
        f"| allreduce, 3 procs | {a['before']:.0f} | {a['with_straggler']:.0f} | - |\n"
        f"| relaxed, 3 procs | {r['before']:.0f} | {r['with_straggler']:.0f} | {r['after_eviction']:.0f} |\n"
        f"| allreduce, 2 procs, healthy | {healthy:.0f} | | |\n\n"
        f"allreduce slowdown with the straggler: {result['allreduce_slowdown']:.2f}x; "
        f"relaxed after eviction / healthy 2 procs: {result['relaxed_after_vs_healthy']:.3f}"
    )


def plot(steps: dict[str, list[dict]], path, slowdown: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, records in steps.items():
        ax.plot([r["step"] for r in records], [r["samples_per_s"] for r in records], label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s (global)")
    ax.set_yscale("log")
    ax.set_title(f"One rank slowed {slowdown:g}x from epoch 2: allreduce waits, relaxed sync evicts it")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
