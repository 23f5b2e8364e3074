"""The emulated network of bench/network: real torchrun nodes in network namespaces (root only), and the
benchmark's behaviour where it cannot run."""

from __future__ import annotations

import json
import os

import pytest
from conftest import ROOT, TEST_RESNET_PARAMS, records

from bench import netns
from bench.network import main, median_cell, parse_args, run_job, steady_state

REASON = netns.unavailable()


def test_without_root_the_benchmark_says_so_and_exits_cleanly(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in netns.unavailable()
    assert main(["--rates", "100mbit"]) == 0
    assert "skipped: needs root" in capsys.readouterr().out


def test_without_tc_the_benchmark_names_the_missing_tool(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
    assert "iproute2's `tc`" in netns.unavailable()


def test_rates_and_token_bucket_sizes():
    assert netns.parse_rate("100mbit") == 1e8 and netns.parse_rate("1gbit") == 1e9
    assert netns.parse_rate("unlimited") is None
    with pytest.raises(ValueError, match="'fast'"):
        netns.parse_rate("fast")
    args = netns.tbf_args(1e8)  # 12.5 MB/s: 1.1 ms is 13.75 kB, below the 72 KiB floor (a 64 KiB GSO segment)
    assert args[args.index("burst") + 1] == str(72 * 1024)
    args = netns.tbf_args(1e9)  # 125 MB/s: 1.1 ms is 137.5 kB
    assert args[args.index("burst") + 1] == str(137_500)


def test_repeated_cells_report_the_median_run_and_every_step_time():
    tries = [{"step_s": s, "attempt": i, "bytes_per_step": 10 * i} for i, s in enumerate([0.50, 0.41, 0.45])]
    cell = median_cell([*tries, {"error": "timed out", "attempt": 3}])
    assert cell["step_s"] == 0.45 and cell["bytes_per_step"] == 20  # the median run, whole
    assert cell["step_s_runs"] == [0.41, 0.45, 0.50] and cell["failed_runs"] == 1 and "attempt" not in cell
    assert median_cell(tries[:1]) == tries[0]  # one run: the cell as it was
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])


def test_report_redraws_tables_and_plots_from_a_finished_runs_records(tmp_path):
    def cell(alg, step_s, comm_s, nbytes):
        return {
            "kind": "cell", "rate": "1gbit", "algorithm": alg, "name": alg, "nodes": 2, "step_s": step_s,
            "compute_s": 0.4, "comm_s": comm_s, "bytes_per_step": nbytes, "wire_over_counted": 1.01 if nbytes else None,
            "speedup": 0.6 / step_s, "x_floor": step_s / 0.4,
        }  # fmt: skip

    cells = [cell("none", 0.4, 0.0, 0.0), cell("allreduce", 0.6, 0.2, 19.7e6), cell("streaming", 0.42, 0.0, 1.5e5)]
    lines = [
        {"kind": "meta", "machine": "test machine",
         "command": "python -m bench.network --rates 1gbit --matched 1gbit --algorithms none,allreduce,streaming,dgc"},
        *cells, {"kind": "matched"}, {"kind": "cells", "cells": cells}, {"kind": "done", "wall_s": 60.0},
    ]  # fmt: skip
    (tmp_path / "network.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["--report", str(tmp_path)]) == 0
    text = (tmp_path / "network.md").read_text()
    assert "| 1gbit | 1.00 | 1.50 | 1.05 | not run |" in text  # x floor, in the run's order; dgc has no record
    assert "| 1gbit | 0.00 | 0.50 | 0.00 | not run |" in text  # exposed communication: comm_s / compute_s
    assert "test machine; 1.0 min in all." in text
    assert {p.name for p in tmp_path.glob("*.png")} == {
        "network_step_time.png",
        "network_speedup.png",
        "network_floor.png",
    }
    assert main(["--report", str(tmp_path / "missing")]) == 2


@pytest.mark.skipif(REASON is not None, reason=f"network emulation unavailable: {REASON}")
def test_two_node_torchrun_job_across_two_namespaces(tmp_path):
    """Two torchrun agents, each in its own namespace behind a 200 Mbit link, meet at a c10d rendezvous on the
    first node and train for a few steps; the bytes counted per step are what the interface saw, within 10 %."""
    with netns.EmulatedNetwork(2) as net:
        names = [net.ns(0), net.ns(1), net.bridge_ns]
        assert set(names) <= set(netns.namespaces())
        net.shape("200mbit")
        out = run_job(
            net, ["model=test_resnet", "data=synthetic", "trainer.max_steps=6", "trainer.epochs=1"], 6, "pytest",
            29400, tmp_path, timeout_s=240,
        )  # fmt: skip
    assert not set(names) & set(netns.namespaces())  # deleted on exit
    steps = records(out["metrics"], "train")
    assert len(steps) == 6 and all(r["world_size"] == 2 for r in steps)
    assert steps[0]["bytes_sent"] == 4 * TEST_RESNET_PARAMS  # ring allreduce of 2: each node sends S
    steady = steady_state(out["metrics"], warmup=1, window=5)
    # (within 10 % either way, not >= 1: a step's wire bytes are the interface's counter when its record is written,
    # and the last segments of a step may still wait in tbf's queue then, counted in the next step's)
    assert 0.90 <= steady["wire_over_counted"] <= 1.10
    assert all(tx >= 6 * 4 * TEST_RESNET_PARAMS for tx in out["node_tx_bytes"])  # both nodes sent every step


@pytest.mark.skipif(REASON is not None, reason=f"network emulation unavailable: {REASON}")
def test_ctrl_c_mid_run_stops_the_nodes_and_removes_the_namespaces(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    bench = subprocess.Popen(
        [sys.executable, "-m", "bench.network", "--rates", "100mbit", "--algorithms", "allreduce", "--no-straggler",
         "--out", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    mine = f"{netns.PREFIX}{bench.pid}-"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_pids_inside(mine)) < 2:
        time.sleep(0.5)
    inside = _pids_inside(mine)
    assert len(inside) >= 2, "the benchmark never started its nodes"
    bench.send_signal(signal.SIGINT)
    output, _ = bench.communicate(timeout=60)
    assert bench.returncode == 130, output
    assert "interrupted" in output
    assert not [ns for ns in netns.namespaces() if ns.startswith(mine)]
    assert not [pid for pid in inside if os.path.exists(f"/proc/{pid}")]  # every node's processes are gone


def _pids_inside(ns_prefix: str) -> list[int]:
    """Processes running inside the namespaces whose names start with ``ns_prefix``."""
    return [
        int(pid)
        for ns in netns.namespaces()
        if ns.startswith(ns_prefix)
        for pid in netns._run(["ip", "netns", "pids", ns], check=False).stdout.split()
    ]


def test_time_to_target_leaves_evaluations_out_of_the_clock_and_counts_bytes_up_to_the_crossing():
    from bench.tta import time_to_target

    # 3 steps per epoch, 1 s each, 100 MB sent per step; an evaluation of 0.5 s after steps 2, 4 and 6
    metrics, clock = [], 100.0
    for step in range(6):
        clock += 1.0
        metrics.append({"kind": "train", "step": step, "epoch": 1 + step // 3, "time": clock, "step_s": 1.0,
                        "bytes_sent": 100e6, "wire_bytes": 105e6, "samples_per_s": 32.0 * 2**step})  # fmt: skip
        if step % 2 == 1:
            clock += 0.5
            top1 = {1: 40.0, 3: 81.0, 5: 90.0}[step]
            metrics.append({"kind": "eval", "step": step + 1, "epoch": 1 + step // 3, "top1": top1, "time": clock,
                            "eval_s": 0.5})  # fmt: skip
    metrics.append({"kind": "summary", "evictions": 1})
    out = time_to_target(metrics, target=80.0)
    assert out["reached"] and out["steps"] == 4 and out["seconds"] == pytest.approx(4.0)  # 4 steps, no evaluation
    assert out["epochs"] == pytest.approx(4 / 3) and out["mb_per_node"] == pytest.approx(400.0)
    assert out["wire_mb_node0"] == pytest.approx(420.0)
    assert out["best_top1"] == 90.0 and out["trained_s"] == pytest.approx(6.0) and out["evictions"] == 1
    assert out["samples_per_s"] == pytest.approx(32 * 63 / 6)  # all samples over all seconds (not a median: 192)
    assert [c["s"] for c in out["curve"]] == pytest.approx([2.0, 4.0, 6.0])
    assert out["goodput"] is None  # (an option that does not report it)
    never = time_to_target(metrics, target=95.0)
    assert not never["reached"] and never["seconds"] is None and never["mb_per_node"] == pytest.approx(600.0)
    # sync=decoupled's goodput (steps that entered the model over steps computed): its latest by the crossing
    rounds = [
        {**r, "goodput": {1: 0.9, 3: 0.95, 5: 0.99}[r["step"]]} if r.get("step") in (1, 3, 5) else r for r in metrics
    ]
    assert time_to_target(rounds, target=80.0)["goodput"] == 0.95 and time_to_target(rounds, 95.0)["goodput"] == 0.99
    # What the logging rank waited in an evaluation for the slowest (an option exchanging every k steps would wait
    # it at its next exchange) is training time: 0.25 s of each evaluation's 0.5 counted in.
    waited = [{**r, "wait_s": 0.25} if r["kind"] == "eval" else r for r in metrics]
    assert [c["s"] for c in time_to_target(waited, target=80.0)["curve"]] == pytest.approx([2.25, 4.5, 6.75])


def test_the_second_job_runs_its_experiment_with_its_target_cap_and_change_epochs(monkeypatch):
    from dataclasses import replace

    from conftest import compose_cfg

    from bench import tta

    for name, job in tta.JOBS.items():  # (the bench's copy of each experiment's target, cap and batch)
        cfg = compose_cfg(f"experiment={name}")
        assert (cfg.trainer.target_top1, cfg.trainer.epochs, cfg.data.batch_size, cfg.trainer.eval_every_steps) == (
            job.target, job.epochs, job.node_batch, job.eval_every,
        )  # fmt: skip
    hard = tta.JOBS["tta_hard"]
    args = tta.parse_args(["--job", "tta_hard", "--scenarios", "uneven,drop,slowed", "--algorithms",
                           "allreduce,dgc", "--relaxed", "relaxed_streaming", "--sweep", ""])  # fmt: skip
    assert (args.name, args.target, args.epochs, args.eval_every) == ("tta_hard", hard.target, hard.epochs, 4)
    cells = {(s, k): overrides for s, k, _, overrides in tta.cells_of(args)}
    assert f"trainer.target_top1={hard.target}" in cells["drop", "allreduce"]
    assert f"trainer.epochs={hard.epochs}" in cells["drop", "allreduce"]
    assert f"straggler.start_epoch={hard.slow}" in cells["uneven", "allreduce"]
    assert f"straggler.start_epoch={hard.change}" in cells["slowed", "relaxed_streaming"]
    assert "sync.rampup_begin_step=22" in cells["drop", "dgc"]  # (DGC's dense first epoch: 1438 // 4 // 16 steps)
    plain = tta.cells_of(tta.parse_args(["--job", "tta_hard", "--scenarios", "1gbit", "--algorithms", "streaming_avg",
                                         "--sweep", ""]))  # fmt: skip
    assert {"sync.inner_steps=32", "sync.quantize=int8", "sync.outer_lr=1.0", "sync.outer_momentum=0.0"} <= set(
        plain[0][3]
    )
    assert tta.scenario_of("drop", hard)["then"]["epoch"] == hard.change
    # each job's uneven scenarios run its own relaxed cells (the second's: over the options that reach its target)
    for name, job in tta.JOBS.items():
        assert tta.parse_args(["--job", name]).relaxed == list(job.relaxed)
        assert set(job.relaxed) <= set(tta.RELAXED) and set(job.candidates) <= set(tta.OPTIONS | tta.RELAXED)
    assert f"epoch {hard.change}" in tta.label("drop", "tta_hard") and "epoch 3" in tta.label("drop", "tta")
    assert tta.job_of([{"scenario": "fleet"}]) == "tta"  # (records from before the second job)
    # sync=auto on a job is priced from that job's steps ratios: none recorded, the bench refuses before any cell.
    monkeypatch.setitem(tta.JOBS, "tta_hard", replace(hard, ratios="bench/results/no-such-ratios.jsonl"))
    with pytest.raises(SystemExit):
        tta.parse_args(["--job", "tta_hard", "--algorithms", "allreduce,auto"])


def test_sync_auto_on_a_job_adds_its_candidates_set_as_the_bench_runs_them(monkeypatch):
    """A job's extra candidates (``Job.candidates``) join sync=auto's defaults with the settings the bench runs
    them by (the steps ratios in the data are for those): each candidate's section is the option's own ``sync``
    section, DGC's warm-up and relaxed sync's inner option included; relaxed sync checks as auto's own do."""
    from dataclasses import replace

    from conftest import compose_cfg, plain_cfg
    from omegaconf import OmegaConf

    from bench import tta

    extra = ("sgp_overlap", "diloco_avg", "dgc", "relaxed_diloco_avg")
    monkeypatch.setitem(tta.JOBS, "tta_hard", replace(tta.JOBS["tta_hard"], candidates=extra))
    args = tta.parse_args(["--job", "tta_hard", "--scenarios", "1gbit", "--algorithms", "dgc,diloco_avg,auto",
                           "--steps-data", str(tta.ROOT / tta.JOBS["tta"].ratios), "--sweep", ""])  # fmt: skip
    cells = {k: overrides for _, k, _, overrides in tta.cells_of(args)}
    auto = compose_cfg("experiment=tta_hard", *cells["auto"]).sync.candidates
    assert {"allreduce", "localsgd16", "relaxed_streaming", *extra} <= set(auto)
    for key in extra:
        name, overrides = (tta.OPTIONS | tta.RELAXED)[key]
        alone = OmegaConf.to_container(compose_cfg("experiment=tta_hard", *cells.get(key, overrides)).sync)
        alone.pop("scope")  # (the run's, not an option's)
        if key in tta.RELAXED:
            alone |= {"relaxed_sync_threshold": tta.RELAXED_THRESHOLD, "check_every": 10}
        assert OmegaConf.to_container(auto[key]) == alone, key
    assert auto["dgc"]["rampup_begin_step"] == 22 and auto["diloco_avg"]["outer_momentum"] == 0.0
    assert auto["relaxed_diloco_avg"]["inner"]["outer_lr"] == 1.0
    plain_cfg("experiment=tta_hard", *cells["auto"])  # (and sync=auto's validation takes them)
    with pytest.raises(ValueError, match="trainer.seed=1"):
        tta.as_candidate("x", ["sync=sgp", "trainer.seed=1"])


def test_with_processes_per_node_each_cell_runs_at_both_scopes_with_the_nodes_batch_split():
    from bench.tta import cells_of, parse_args, scope_table

    args = parse_args(["--nodes", "2", "--procs", "2", "--scenarios", "fleet", "--algorithms", "allreduce,diloco",
                       "--sweep", ""])  # fmt: skip
    assert args.name == "tta_nodes"
    cells = cells_of(args)
    assert [key for _, key, _, _ in cells] == ["allreduce@node", "allreduce@process", "diloco@node", "diloco@process"]
    for _, key, _, overrides in cells:
        assert f"sync.scope={key.partition('@')[2]}" in overrides and "data.batch_size=16" in overrides
    with pytest.raises(SystemExit):
        parse_args(["--procs", "3"])  # (32 images a node are not split among 3)

    def row(key: str, seconds: float | None, wire: float) -> dict:
        return {"scenario": "fleet", "algorithm": key, "name": f"x [{key.partition('@')[2]}]", "procs_per_node": 2,
                "reached": seconds is not None, "seconds": seconds, "steps": 10, "best_top1": 90.0,
                "wire_mb_node0": wire}  # fmt: skip

    text = scope_table([row("diloco@node", 3.0, 1.0), row("diloco@process", 6.0, 2.0), row("dgc@node", None, 0)])
    assert "| (a) 100 Mbit | x | 3.0 s (10 steps) | 6.0 s (10 steps) | 0.50 | 1.0 / 2.0 |" in text
    assert "| x | not reached (90.0%) |  |  |  |" in text


def test_repeated_cells_report_the_median_run_and_every_runs_seconds():
    from bench.tta import auto_verdict, medians, parse_args, table

    assert parse_args(["--repeats", "3"]).repeats == 3
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])

    def run(key: str, seconds: float | None, attempt: int) -> dict:
        return {"scenario": "fleet", "algorithm": key, "name": key, "attempt": attempt, "reached": seconds is not None,
                "seconds": seconds, "steps": 10, "mb_per_node": 1.0, "best_top1": 90.0, "trained_s": 9.0,
                "syncs": []}  # fmt: skip

    rows = [run("allreduce", t, i) for i, t in enumerate((9.0, 8.0, 12.0))]
    rows += [run("auto", t, i) for i, t in enumerate((2.0, None, 3.0))]  # (one never reached it: the slowest)
    rows += [run("localsgd16", t, i) for i, t in enumerate((2.5, 2.4, 2.6))]
    kept = {r["algorithm"]: r for r in medians(rows)}
    assert kept["allreduce"]["seconds"] == 9.0 and kept["allreduce"]["runs_s"] == [9.0, 8.0, 12.0]
    assert kept["auto"]["seconds"] == 3.0 and kept["auto"]["runs_s"] == [2.0, None, 3.0]
    assert "3.0 s (0.33×) [2/3: 2.0–3.0 s]" in table(medians(rows))
    assert "auto: 1.20x the best static option's time (localsgd16)" in auto_verdict(list(kept.values()))


@pytest.mark.full  # ~35 s; make test: the emulated two-node job above and the time-to-target measure's unit test
@pytest.mark.skipif(REASON is not None, reason=f"network emulation unavailable: {REASON}")
def test_time_to_accuracy_miniature_two_algorithms_on_two_nodes(tmp_path):
    from bench import tta

    argv = ["--nodes", "2", "--scenarios", "1gbit", "--algorithms", "allreduce,localsgd4", "--target", "20",
            "--eval-every", "2", "--max-steps", "80", "--sweep", "localsgd16", "--sweep-epochs", "1",
            "--out", str(tmp_path)]  # fmt: skip
    assert tta.main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "tta.jsonl").read_text().splitlines()]
    sweep = rows.pop()  # (the period sweep runs last, without a target: one epoch of local SGD k=16)
    assert sweep["scenario"] == "sweep" and sweep["algorithm"] == "localsgd16" and sweep["trained_steps"] > 0, sweep
    assert [r["algorithm"] for r in rows] == ["allreduce", "localsgd4"]
    for r in rows:
        assert r["reached"] and r["steps"] % 2 == 0 and 0 < r["seconds"] < r["wall_s"], r
        assert r["curve"][-1]["top1"] >= 20 > max((c["top1"] for c in r["curve"][:-1]), default=0), r  # the crossing
        assert r["trained_steps"] == r["steps"] and r["mb_per_node"] > 0
        # Evaluations' traffic is kept apart (at most headers on top). Node 0's wire count may lag the records by
        # what is still queued in its socket and shaper when the last record before the target was taken: less
        # than one exchange (allreduce exchanges every step, local SGD every 4th).
        exchanges = (r["steps"] - 1) // (4 if r["algorithm"] == "localsgd4" else 1)
        assert 1 - 1 / exchanges <= r["wire_mb_node0"] / r["mb_per_node"] <= 1.15, r
    allreduce, local = rows
    assert local["mb_per_node"] / local["steps"] < allreduce["mb_per_node"] / allreduce["steps"] / 2
    assert (tmp_path / "tta.md").exists() and (tmp_path / "tta_1gbit.png").exists()
    assert not [ns for ns in netns.namespaces() if ns.startswith(netns.PREFIX)]
