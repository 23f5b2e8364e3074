"""Our allreduce loop vs a plain torch DDP loop: same model, data, batch, optimizer, seed and launcher.

    python -m bench.overhead [--runs 5] [--steps 40] [--model resnet18]

Runs the two side by side, alternating which goes first in each round, and reports the median samples/s of
each over the steady state (the first ``--warmup`` steps dropped) and the median of the per-round ratios.
Results: bench/results/overhead.json; read in docs/benchmarks/overhead.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from bench.common import ROOT, config, machine, median, train_records
from engine.launch import launch
from engine.metrics import read_metrics


def config_for(args: argparse.Namespace) -> dict:
    model = args.model if (ROOT / "conf" / "model" / f"{args.model}.yaml").exists() else None
    return config(
        [
            f"model={model}" if model else f"model.name={args.model}",
            "data=synthetic",
            f"data.image_size={args.image_size}",
            f"data.batch_size={args.batch_size}",
            "data.num_samples=4096",
            "optimizer=momentum",
            "schedule.warmup_epochs=0",
            "logger=none",
            "trainer.progress=false",
            f"trainer.nproc={args.nproc}",
            f"trainer.max_steps={args.steps}",
            "trainer.checkpoint_every=0",
        ]
    )


def run_ours(cfg: dict, warmup: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        launch(cfg, run_dir)
        steps = train_records(read_metrics(f"{run_dir}/metrics.jsonl"))[warmup:]
    return median(r["samples_per_s"] for r in steps)


def run_plain(cfg: dict, warmup: int) -> float:
    from bench.plain_ddp import plain_worker

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/plain.json"
        lc = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=cfg["trainer"]["nproc"],
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",
            max_restarts=0,
            start_method="spawn",
        )
        elastic_launch(lc, plain_worker)(cfg, out)
        result = json.loads(Path(out).read_text())
    return median(result["samples_per_step"] / s for s in result["step_s"][warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "overhead.json"))
    args = parser.parse_args()
    cfg = config_for(args)

    ours, plain, ratios = [], [], []
    for i in range(args.runs):
        if i % 2 == 0:
            o, p = run_ours(cfg, args.warmup), run_plain(cfg, args.warmup)
        else:
            p, o = run_plain(cfg, args.warmup), run_ours(cfg, args.warmup)
        ours.append(o)
        plain.append(p)
        ratios.append(o / p)
        print(f"round {i + 1}/{args.runs}: relaxsync {o:.1f} samples/s, plain DDP {p:.1f} samples/s, ratio {o / p:.3f}")

    result = {
        "benchmark": "overhead",
        "command": f"python -m bench.overhead --runs {args.runs} --steps {args.steps} --model {args.model}",
        "machine": machine(),
        "model": args.model,
        "image_size": args.image_size,
        "batch_size_per_proc": args.batch_size,
        "nproc": args.nproc,
        "ours_samples_per_s": ours,
        "plain_samples_per_s": plain,
        "ratios": ratios,
        "median_ours": statistics.median(ours),
        "median_plain": statistics.median(plain),
        "median_ratio": statistics.median(ratios),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\n| loop | samples/s (median of {args.runs}) |\n|---|---|\n"
        f"| plain torch DDP | {result['median_plain']:.1f} |\n"
        f"| relaxsync sync=allreduce | {result['median_ours']:.1f} |\n"
        f"| ratio (median of per-round ratios) | {result['median_ratio']:.3f} |"
    )


if __name__ == "__main__":
    main()
