"""``make bench-gpu`` on the CPU (``--smoke``): every step of the GPU bench runs (the plain loop, train.py through the
loaders, the JPEG folder through the imagefolder loader, the NCCL kill cases collected), so it cannot rot between
the times a GPU is at hand; the results carry the fields a GPU run is read by."""

from __future__ import annotations

import json

import pytest

from bench import gpu


@pytest.mark.full  # ~30 s, ~50 s with the JPEGs (three processes that import torch); make test: the kill cases
# it collects (below), bench/decode's smoke (the decode, its agreement, the loader), train.py on JPEGs (test_images)
@pytest.mark.parametrize("images", [0, 48], ids=["synthetic", "and-real-jpegs"])
def test_the_gpu_bench_runs_on_the_cpu_and_writes_its_results(tmp_path, images):
    result = gpu.main(["--smoke", "--images", str(images), "--out", str(tmp_path)])
    assert result["errors"] == {}, result["errors"]
    (written,) = tmp_path.glob("gpu-*.json")
    assert json.loads(written.read_text()) == result
    for key in ("device", "torch", "cpus", "ours_img_s", "plain_img_s", "ratio", "recovery_s", "loader_img_s",
                "synthetic_img_s", "real_img_s", "decode_img_s"):  # fmt: skip
        assert key in result, key
    assert result["ours_img_s"] > 0 and result["plain_img_s"] > 0
    assert result["synthetic_img_s"] == result["ours_img_s"]
    assert result["ratio"] == result["ours_img_s"] / result["plain_img_s"]
    assert result["ours_steps"] == result["steps"] - result["skip"]  # the medians are over the steps asked for
    if images:  # real JPEGs through train.py (on the CPU: its CPU decode), the device path alone, and its agreement
        assert result["real_cpu_img_s"] > 0 and result["loader_img_s"] > 0
        assert result["real"]["cpu"]["steps"] == result["steps"] - result["skip"]
        assert result["decode_img_s"] > 0 and result["agree_failed_batches"] == 0 and result["agree_batches"] == 2
    else:
        assert result["real"] == {} and result["real_cpu_img_s"] is None and result["loader_img_s"] is None
    # the kill cases a GPU run times (allreduce, DGC and local SGD losing a node of three, the ring of four) and the
    # GPU tests beside them (the defaults, apex O1 and O2 under relaxed sync, a GPU straggler evicted, train.py decoding
    # JPEGs on the GPU)
    assert_the_timed_cases(result["faults"]["cases"])
    assert result["recovery_s"] == []  # (collected, not run, on the CPU)
    assert "| ratio (ours / plain) |" in (tmp_path / "gpu.md").read_text()


def test_the_cases_a_gpu_run_times_are_still_there(tmp_path):
    """The NCCL kill cases and the GPU tests ``make bench-gpu`` runs, collected as its smoke collects them: a renamed
    test fails here, not on the next GPU."""
    faults = gpu.fault_recoveries(True, tmp_path / "faults", 120.0, gpu.GPU_TESTS, tmp_path / "log")
    assert faults["exit"] == 0, (tmp_path / "log").read_text()[-3000:]
    assert_the_timed_cases(faults["cases"])


def assert_the_timed_cases(cases: list[str]) -> None:
    assert len([c for c in cases if c.startswith("tests/test_faults.py")]) == 4, cases
    assert len([c for c in cases if c.startswith("tests/test_gpu.py")]) == 5, cases


def test_each_tests_outcome_is_read_from_pytests_lines_as_they_come():
    text = """bringing up nodes...
[gw1] [ 12%] PASSED tests/test_faults.py::test_a_killed_node_leaves_and_the_others_finish_the_run[allreduce]
[gw0] [ 25%] FAILED tests/test_gpu.py::test_relaxed_sync_trains_with_apex[O1]
tests/test_gpu.py::test_relaxed_sync_evicts_a_gpu_slow_on_its_device SKIPPED (no GPU) [ 37%]
"""
    assert gpu.outcomes_of(text) == {
        "tests/test_faults.py::test_a_killed_node_leaves_and_the_others_finish_the_run[allreduce]": "PASSED",
        "tests/test_gpu.py::test_relaxed_sync_trains_with_apex[O1]": "FAILED",
        "tests/test_gpu.py::test_relaxed_sync_evicts_a_gpu_slow_on_its_device": "SKIPPED",
    }


def test_the_decode_bench_runs_and_compares_our_cpu_path_with_plain_torchvision(tmp_path):
    from bench import decode

    result = decode.main(["--smoke", "--out", str(tmp_path)])
    (row,) = result["cpu"]
    assert row["ours_img_s"] > 0 and row["plain_img_s"] > 0 and row["ratio"] == row["ours_img_s"] / row["plain_img_s"]
    assert result["decode_img_s"] > 0 and result["agree_failed_batches"] == 0
    assert "| workers | ours (images/s) |" in (tmp_path / "decode.md").read_text()
