"""bench/soak's analysis of a run's records, on records written by hand: a run that the soak's deadline cut short
(every failure survived, still training, no summary) is analysed from what it recorded."""

from __future__ import annotations

from bench.soak import analyse


def _train(step: int, t: float) -> dict:
    return {"kind": "train", "step": step, "epoch": 1, "time": t, "step_s": 0.1}


def test_a_run_cut_short_is_analysed_from_its_records_and_marked_unfinished():
    records = [_train(s, 0.1 * s) for s in range(5)]
    records.append({"kind": "event", "event": "rank_lost", "ranks": [2], "cause": "died", "time": 0.45})
    records += [_train(s, 2.0 + 0.1 * s) for s in range(5, 9)]  # (steps 4 and 5: 0.4 s and 2.5 s)
    records.append({"kind": "eval", "step": 9, "epoch": 1, "top1": 97.5, "time": 3.0})
    records += [_train(9, 3.1), _train(9, 3.2)]  # (step 9 twice: one lost step)
    row = analyse(records)
    assert row["finished"] is False and row["top1"] == 97.5  # (the last evaluation: no summary)
    assert row["survived"] == 1 and row["kills"] == 1 and row["lost_steps"] == 1 and row["steps"] == 11
    assert abs(row["standstill_s"]["kill"][0] - 2.0) < 1e-9  # (the longest gap, 2.1 s, less the median step)
    finished = analyse([*records, {"kind": "summary", "finished": True, "top1": 98.0}])
    assert finished["finished"] is True and finished["top1"] == 98.0
