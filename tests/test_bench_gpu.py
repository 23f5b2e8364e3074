"""``make bench-gpu`` on the CPU (``--smoke``): every step of the GPU bench runs (the plain loop, train.py through the
loaders, the JPEG folder through the imagefolder loader, the NCCL kill cases collected), so it cannot rot between
the times a GPU is at hand; the results carry the fields a GPU run is read by."""

from __future__ import annotations

import json

import pytest

from bench import gpu


@pytest.mark.parametrize(
    "images",
    # (~20 s more: train.py on the JPEG folder; make test: bench/decode's smoke below, the decode, its agreement and
    # the loader, and train.py on a JPEG folder in test_images)
    [0, pytest.param(48, marks=pytest.mark.full)],
    ids=["synthetic", "and-real-jpegs"],
)
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
    cases = result["faults"]["cases"]
    assert len([c for c in cases if c.startswith("tests/test_faults.py")]) == 4, cases
    assert len([c for c in cases if c.startswith("tests/test_gpu.py")]) == 5, cases
    assert result["recovery_s"] == []  # (collected, not run, on the CPU)
    assert "| ratio (ours / plain) |" in (tmp_path / "gpu.md").read_text()


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
