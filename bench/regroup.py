"""Regrouping after a loss: the group the survivors form, ours against torch's own reconfiguration, side by side.

    python -m bench.regroup [--procs 4] [--repeats 20] [--backend gloo]

After a loss the survivors need a process group of their own. Ours builds a new one over the run's store
(``distributed.membership.build_group``: a ``ProcessGroupGloo`` on a store prefix of the change, then one collective),
as every change does today. torch 2.15 can instead reconfigure a group in place: ``init_process_group(...,
enable_reconfigure=True)``, each survivor's ``dist._get_reconfigure_handle()`` exchanged out of band (here through the
same store), then ``dist._reconfigure(uuid, handles)`` on the group (torchft's Manager moved onto it in 0.3.0).

``--procs`` processes start (torch's multiprocessing, one thread each). Each repetition, the last process plays the
lost one (it takes no part), and the others regroup both ways, in alternating order, each timed from the moment all
of them start it (a barrier over the store) to the end of a first allreduce on the result, whose value is checked.
Reported: the median and p95 seconds of each, per survivor's own clock, and the ratio. Results:
bench/results/regroup.json; read in docs/failures.md ("Regrouping: ours or torch's").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import RESULTS, machine

TIMEOUT = datetime.timedelta(seconds=60)


def _barrier(store: dist.Store, name: str, size: int) -> None:
    """Every one of ``size`` processes reaches ``name`` before any goes on (over the store, not a group)."""
    if int(store.add(f"{name}/count", 1)) == size:
        store.set(f"{name}/go", "1")
    store.wait([f"{name}/go"], TIMEOUT)


def _check(group: Any, size: int) -> None:
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    if t.item() != size:
        raise RuntimeError(f"an allreduce over the regrouped {size} gave {t.item()}")


def _ours(store: dist.Store, survivors: list[int], rank: int, i: int) -> Any:
    from distributed.membership import build_group

    return build_group(dist.PrefixStore(f"ours/{i}/", store), survivors, rank, "gloo", TIMEOUT)


def _torch(store: dist.Store, survivors: list[int], rank: int, i: int) -> Any:
    handle = dist._get_reconfigure_handle()
    store.set(f"torch/{i}/handle/{rank}", handle)
    handles = [store.get(f"torch/{i}/handle/{r}").decode() for r in survivors]
    dist._reconfigure(uuid=1000 + i, handles=handles, timeout=TIMEOUT).wait()
    return dist.group.WORLD


def _worker(rank: int, procs: int, repeats: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    store = dist.TCPStore("127.0.0.1", port, procs, is_master=rank == 0, timeout=TIMEOUT)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("init/", store), rank=rank, world_size=procs, timeout=TIMEOUT,
        enable_reconfigure=True,
    )  # fmt: skip
    survivors = list(range(procs - 1))
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    try:
        if rank in survivors:
            for i in range(repeats):
                order = ("ours", "torch") if i % 2 == 0 else ("torch", "ours")
                for way in order:
                    _barrier(store, f"go/{i}/{way}", len(survivors))
                    start = time.perf_counter()
                    group = (_ours if way == "ours" else _torch)(store, survivors, rank, i)
                    _check(group, len(survivors))
                    times[way].append(time.perf_counter() - start)
                # the default group is now the survivors': put the lost one back for the next repetition
                _barrier(store, f"back/{i}", procs)
                _restore(store, rank, procs, i)
        else:
            for i in range(repeats):
                _barrier(store, f"back/{i}", procs)
                _restore(store, rank, procs, i)
        store.set(f"times/{rank}", json.dumps(times))
        _barrier(store, "end", procs)
        if rank == 0:
            every = [json.loads(store.get(f"times/{r}")) for r in survivors]
            Path(out).write_text(json.dumps(every))
    finally:
        dist.destroy_process_group()


def _restore(store: dist.Store, rank: int, procs: int, i: int) -> None:
    """Reconfigure the default group back to every process (the lost one included)."""
    store.set(f"back/{i}/handle/{rank}", dist._get_reconfigure_handle())
    handles = [store.get(f"back/{i}/handle/{r}").decode() for r in range(procs)]
    dist._reconfigure(uuid=5000 + i, handles=handles, timeout=TIMEOUT).wait()
    _check(dist.group.WORLD, procs)


def summarize(every: list[dict[str, list[float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for way in ("ours", "torch"):
        values = sorted(t for rank in every for t in rank[way])
        out[way] = {
            "median_s": statistics.median(values), "p95_s": values[int(0.95 * (len(values) - 1))], "n": len(values),
        }  # fmt: skip
    out["ratio_torch_over_ours"] = out["torch"]["median_s"] / out["ours"]["median_s"]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--port", type=int, default=29870)
    p.add_argument("--out", default=str(RESULTS / "regroup.json"))
    a = p.parse_args(argv)
    if a.procs < 2:
        p.error(f"--procs={a.procs}: at least 2 (one is the lost one)")
    raw = Path(f"/tmp/relaxsync-regroup-{os.getpid()}.json")
    mp.start_processes(_worker, args=(a.procs, a.repeats, a.port, str(raw)), nprocs=a.procs, start_method="spawn")
    result = {
        "benchmark": "regroup", "command": " ".join(["python -m bench.regroup", *(argv or sys.argv[1:])]),
        "machine": machine(), "procs": a.procs, "survivors": a.procs - 1, "repeats": a.repeats, "backend": "gloo",
        **summarize(json.loads(raw.read_text())),
    }  # fmt: skip
    raw.unlink()
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    o, t = result["ours"], result["torch"]
    print(f"bench.regroup: {a.procs - 1} survivors, {a.repeats} repetitions each way (gloo, {result['machine']})")
    print(f"  ours  (build_group):      median {o['median_s'] * 1e3:.1f} ms, p95 {o['p95_s'] * 1e3:.1f} ms")
    print(f"  torch (_reconfigure):     median {t['median_s'] * 1e3:.1f} ms, p95 {t['p95_s'] * 1e3:.1f} ms")
    print(f"  torch / ours: {result['ratio_torch_over_ours']:.2f}")
    return result


if __name__ == "__main__":
    main()
