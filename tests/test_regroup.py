"""bench/regroup: ours and torch's reconfiguration, each regroup checked by an allreduce over the survivors."""

from __future__ import annotations

import json

import pytest

from bench import regroup


def test_the_summary_takes_every_survivors_times_and_the_ratio_of_the_medians():
    every = [{"ours": [0.01, 0.03], "torch": [0.02, 0.02]}, {"ours": [0.02, 0.05], "torch": [0.01, 0.03]}]
    out = regroup.summarize(every)
    assert out["ours"]["n"] == out["torch"]["n"] == 4
    assert out["ours"]["median_s"] == pytest.approx(0.025) and out["torch"]["median_s"] == pytest.approx(0.02)
    assert out["ratio_torch_over_ours"] == pytest.approx(0.8)


@pytest.mark.full  # ~15 s (3 processes); make test: the summary above (the bench is measured, not shipped)
def test_both_ways_regroup_the_survivors_and_the_lost_one_comes_back(tmp_path):
    result = regroup.main(["--procs", "3", "--repeats", "2", "--port", "29911", "--out", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == result
    assert result["survivors"] == 2 and result["ours"]["n"] == result["torch"]["n"] == 4  # 2 survivors x 2
