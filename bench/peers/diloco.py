"""DiLoCo's accuracy at short periods, ours beside torchft's, on bench/diloco's job (no emulated network needed).

    python -m bench.peers.diloco [--periods 8,16] [--seeds 0,1,2] [--settings 0.7/0.9,0.7/0.5,1.0/0.0]

bench/diloco's job at 2 processes (ResNet-18 on digits, batch 16 per process, 10 epochs: 440 steps): allreduce,
then for each period H and each outer setting (outer lr / momentum, Nesterov) our ``sync=diloco``, and at the
default setting (0.7 / 0.9, torchft's and the paper's) torchft's ``DiLoCo`` on the same job through
``bench/peers/worker.py``, for every seed. Reported: the final top-1 of each run and, per row, the mean over the
seeds against allreduce's mean. Results: bench/results/peers-diloco.json and peers-diloco.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, machine, run
from bench.peers.launch import run_here
from engine.metrics import read_metrics

DEFAULT = "0.7/0.9"


def job(args: argparse.Namespace, seed: int) -> list[str]:
    return [f"model={args.model}", "data=digits", f"data.batch_size={args.batch_size}", "trainer.nproc=2",
            f"trainer.epochs={args.epochs}", f"trainer.seed={seed}"]  # fmt: skip


def diloco(period: int, setting: str) -> list[str]:
    lr, momentum = setting.split("/")
    return ["sync=diloco", f"sync.inner_steps={period}", f"sync.outer_lr={lr}", f"sync.outer_momentum={momentum}"]


def top1(metrics: list[dict[str, Any]]) -> float:
    return next(r for r in reversed(metrics) if r["kind"] == "summary")["top1"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--periods", default="8,16", help="DiLoCo's H")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--settings", default=f"{DEFAULT},0.7/0.5,1.0/0.0", help="outer lr / momentum, ours")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--no-torchft", action="store_true", help="ours only")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    periods, seeds = [int(h) for h in args.periods.split(",")], [int(s) for s in args.seeds.split(",")]
    settings = args.settings.split(",")
    rows: dict[str, dict[int, float]] = {}
    started, workdir = time.perf_counter(), Path(tempfile.mkdtemp(prefix="relaxsync-peers-diloco-"))
    for seed in seeds:
        runs: dict[str, Any] = {"allreduce": lambda s=seed: top1(run([*job(args, s), "sync=allreduce"]))}
        for h in periods:
            for setting in settings:
                runs[f"ours H={h} {setting}"] = lambda s=seed, h=h, o=setting: top1(run([*job(args, s), *diloco(h, o)]))
            if not args.no_torchft:

                def peer(s: int = seed, h: int = h) -> float:
                    run_dir = workdir / f"torchft-{h}-{s}"
                    run_here(
                        "torchft_diloco", [*job(args, s), *diloco(h, DEFAULT)], run_dir, replicas=2, timeout_s=1800
                    )
                    return top1(read_metrics(str(run_dir / "metrics.jsonl")))

                runs[f"torchft H={h} {DEFAULT}"] = peer
        for name, fn in runs.items():
            print(f"[{time.strftime('%H:%M:%S')}] seed {seed}: {name}", flush=True)
            rows.setdefault(name, {})[seed] = fn()
            print(f"  top-1 {rows[name][seed]:.2f}", flush=True)
    base = sum(rows["allreduce"].values()) / len(seeds)
    lines = ["| run | " + " | ".join(f"seed {s}" for s in seeds) + " | mean vs allreduce |",
             "|---|" + "---|" * (len(seeds) + 1)]  # fmt: skip
    for name, by_seed in rows.items():
        mean = sum(by_seed.values()) / len(by_seed)
        delta = f"({base:.2f})" if name == "allreduce" else f"{mean - base:+.2f}"
        lines.append(f"| {name} | " + " | ".join(f"{by_seed[s]:.2f}" for s in seeds) + f" | {delta} |")
    command = "python -m bench.peers.diloco " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"benchmark": "peers-diloco", "command": command.strip(), "machine": machine(),
              "wall_s": time.perf_counter() - started, "rows": rows}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers-diloco.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "peers-diloco.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
