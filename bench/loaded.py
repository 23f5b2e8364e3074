"""No rank removed while it is alive: a run under ``trainer.on_failure=continue`` on a machine kept busy, for minutes.

    python -m bench.loaded [--minutes 20] [--hogs 2] [--nodes 3] [--sync allreduce]

Failures are told from a silence (no beat for ``SILENT_S``), a collective's deadline, or a process seen to end
(``distributed/presence.py``); the first two are guesses that a loaded machine could fool. This runs ``train.py``
with ``--nodes`` emulated nodes of one process each (the local launcher, ``trainer.local_nodes``), test_resnet on
digits, for ``--minutes`` (``trainer.max_steps`` far out; a SIGTERM then stops it at an agreed step, checkpointed),
beside ``--hogs`` processes that each keep a core busy (a pure-Python loop at the same priority), so that the
ranks and their heartbeat threads wait for the CPU as on an oversubscribed node. Nothing is killed: any
``rank_lost`` event or eviction is a false removal. Reported: steps, the run's median and max step time, the
longest gap between two steps, ``rank_lost`` events and the ranks left at the end. Results:
bench/results/loaded.json; read in docs/failures.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, machine, median
from engine.metrics import read_metrics


def hog() -> None:
    """Keep one core busy until killed."""
    x = 0
    while True:
        x = (x * 31 + 7) % 1000003


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--hogs", type=int, default=2, help="processes that each keep a core busy beside the run")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--sync", default="allreduce")
    p.add_argument("--out", default=str(RESULTS / "loaded.json"))
    a = p.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="relaxsync-loaded-"))
    command = [
        sys.executable, "train.py", "model=test_resnet", "data=digits", "logger=none", "trainer.progress=false",
        f"trainer.nproc={a.nodes}", f"trainer.local_nodes={a.nodes}", "trainer.on_failure=continue",
        "trainer.epochs=100000", "trainer.checkpoint_every=0", f"sync={a.sync}", f"trainer.run_dir={run_dir}",
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    hogs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(a.hogs)]
    for h in hogs:
        h.start()
    log = open(run_dir / "bench.log", "w")
    started = time.monotonic()
    job = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    print(f"bench.loaded: {a.nodes} nodes under sync={a.sync} beside {a.hogs} busy processes for {a.minutes} min "
          f"(run dir {run_dir})", flush=True)  # fmt: skip
    try:
        while time.monotonic() - started < a.minutes * 60 and job.poll() is None:
            time.sleep(5)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)  # (a stop at an agreed step)
        job.wait(timeout=300)
    finally:
        for h in hogs:
            h.kill()
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        log.close()
    metrics = read_metrics(str(run_dir / "metrics.jsonl"))
    train = [r for r in metrics if r.get("kind") == "train"]
    events = [r for r in metrics if r.get("kind") == "event"]
    lost = [e for e in events if e["event"] in ("rank_lost", "rank_evicted")]
    times = [r["time"] for r in train]
    steps_s = [r["step_s"] for r in train]
    result = {
        "benchmark": "loaded", "command": " ".join(["python -m bench.loaded", *(argv or sys.argv[1:])]),
        "machine": machine(), "cpus": os.cpu_count(), "nodes": a.nodes, "hogs": a.hogs, "sync": a.sync,
        "minutes": round((time.monotonic() - started) / 60, 2), "steps": len(train),
        "median_step_s": median(steps_s), "max_step_s": max(steps_s, default=None),
        "longest_gap_s": max((later - earlier for earlier, later in zip(times, times[1:])), default=None),
        "false_removals": len(lost), "removal_events": lost, "exit_code": job.returncode,
        "world_size_at_end": train[-1]["world_size"] if train else None,
    }  # fmt: skip
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "removal_events"}, indent=1))
    return result


if __name__ == "__main__":
    main()
