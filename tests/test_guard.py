"""The failure guard is chosen once: under ``trainer.on_failure=abort`` the trainer runs every part of its loop through
a guard that keeps nothing, so no recovery bookkeeping runs per step; under ``continue`` the surviving guard knows
where the loop is and keeps the records a healed logging rank would need."""

from __future__ import annotations

import json

from _workers import guard_bookkeeping
from conftest import FAST, train_each

from engine.failures import Phase, Position
from engine.guard import NoGuard

RUN = [*FAST, "trainer.nproc=2", "data.num_samples=256", "data.num_val_samples=64", "trainer.epochs=1"]


def test_the_null_guard_runs_each_part_as_it_is_and_keeps_nothing():
    guard, calls = NoGuard(), []
    assert guard.run(Phase.STEP, lambda: calls.append("step") or 7, epoch=1) == 7
    assert guard.repeat(lambda: "done") == "done" and guard.entry(None) is None
    assert calls == ["step"] and vars(guard) == {} and guard.lost_ranks == ()


def test_abort_uses_the_null_guard_and_records_no_position_or_history_while_continue_does(tmp_path):
    runs = train_each(
        tmp_path,
        {"abort": RUN, "continue": [*RUN, "trainer.on_failure=continue", "trainer.hang_timeout_s=30"]},
        entrypoint=guard_bookkeeping,
    )
    for rank in (0, 1):
        abort = json.loads((tmp_path / "abort" / f"guard_rank{rank}.json").read_text())
        assert abort == {"guard": "NoGuard", "attributes": [], "observers": 0, "history": []}, abort
        kept = json.loads((tmp_path / "continue" / f"guard_rank{rank}.json").read_text())
        assert kept["guard"] == "SurvivingGuard" and kept["observers"] == 1, kept
        if rank == 0:  # the logging rank kept every record it wrote but the summary, with where the loop was
            written = [r for r in runs["continue"] if r["kind"] != "summary"]
            assert [kind for _, _, kind in kept["history"]] == [r["kind"] for r in written]
        train = [(step, phase) for step, phase, kind in kept["history"] if kind == "train"]
        assert train == [(s, Phase.EXCHANGE.value) for s in range(len(train))] and train
        assert {phase for _, phase, _ in kept["history"]} <= {p.value for p in Phase}
    assert Position(3, Phase.EVALUATION).key < Position(3, Phase.STEP).key < Position(4, Phase.EVALUATION).key
