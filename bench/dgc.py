"""DGC on ResNet-50, 2 processes: bytes per step vs dense allreduce, and the cost of compressing.

    python -m bench.dgc [--sparsity 0.999] [--threads 1] [--repeats 3]

1. Bytes: two real 2-process runs side by side (gloo), ``sync=allreduce`` and ``sync=dgc`` at ``--sparsity``,
   ResNet-50 (1000 classes) on small synthetic images (bytes do not depend on the image size); median
   ``bytes_sent`` per step as counted by the Communicator, against the theory for the defaults (tensors
   under 16384 entries dense).
2. Time: the compression work of one step (momentum correction, accumulation, sampled threshold, selection,
   residual update) on real ResNet-50 gradients, against one ResNet-50 forward+backward at batch 32, 224 px,
   same thread count, medians of ``--repeats``.
Results: bench/results/dgc.json.
"""

from __future__ import annotations

import argparse
import json
import time

import timm
import torch

from algorithms.base import SyncContext
from algorithms.dgc import DGC, keep_count
from bench.common import RESULTS, machine, median, run, train_records
from distributed.membership import Membership


def measure_bytes(sparsity: float) -> dict:
    common = [
        "model=resnet50",
        "data=synthetic",
        "data.num_classes=1000",  # ImageNet's head, as in the paper's ResNet-50
        "data.image_size=32",
        "data.batch_size=8",
        "trainer.max_steps=4",
    ]
    dense = median(r["bytes_sent"] for r in train_records(run([*common, "sync=allreduce"])))
    dgc_steps = train_records(run([*common, "sync=dgc", f"sync.sparsity=[{sparsity}]"]))
    sparse = median(r["bytes_sent"] for r in dgc_steps)
    sizes = [p.numel() for p in timm.create_model("resnet50", num_classes=1000).parameters()]
    small, k = sum(n for n in sizes if n < 16384), sum(keep_count(n, sparsity) for n in sizes if n >= 16384)
    n = 2
    theory = (2 * (n - 1) / n * 4 * (small + 1) + (n - 1) * 8 * k) / (2 * (n - 1) / n * 4 * sum(sizes))
    return {
        "dense_bytes_per_step": dense,
        "dgc_bytes_per_step": sparse,
        "ratio": sparse / dense,
        "theory_ratio": theory,
        "dgc_compress_s_in_run": median(r["compress_s"] for r in dgc_steps),
    }


def measure_time(sparsity: float, threads: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = timm.create_model("resnet50", num_classes=1000)
    x, y = torch.randn(32, 3, 224, 224), torch.randint(1000, (32,))
    fwd_bwd = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        fwd_bwd.append(time.perf_counter() - start)
    dgc = DGC(sparsity=[sparsity])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    dgc.setup(model, opt, SyncContext(comm=None, membership=Membership(0, 2), device=torch.device("cpu")))
    compress = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        dgc.accumulate_and_select([dgc._grad(i) for i in range(len(dgc.params))], sparsity)
        compress.append(time.perf_counter() - start)
    return {
        "threads": threads,
        "fwd_bwd_s": median(fwd_bwd),
        "compress_s": median(compress),
        "compress_fraction": median(compress) / median(fwd_bwd),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sparsity", type=float, default=0.999)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = {
        "benchmark": "dgc",
        "command": f"python -m bench.dgc --sparsity {args.sparsity} --threads {args.threads} --repeats {args.repeats}",
        "machine": machine(),
        "bytes": measure_bytes(args.sparsity),
        "time": measure_time(args.sparsity, args.threads, args.repeats),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "dgc.json").write_text(json.dumps(result, indent=1) + "\n")
    b, t = result["bytes"], result["time"]
    print(
        f"\nbytes/step: allreduce {b['dense_bytes_per_step']:.0f}, dgc {b['dgc_bytes_per_step']:.0f}, "
        f"ratio 1/{1 / b['ratio']:.0f} (theory 1/{1 / b['theory_ratio']:.0f})\n"
        f"ResNet-50 fwd+bwd (batch 32, 224 px, {t['threads']} thread): {t['fwd_bwd_s']:.2f} s; "
        f"compression {t['compress_s'] * 1e3:.0f} ms = {100 * t['compress_fraction']:.1f} %"
    )


if __name__ == "__main__":
    main()
