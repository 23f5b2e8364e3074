"""A rotating sample of the chaos matrix (tests/_chaos.py): each day draws other cells and other moments from a seed
of its own (``CHAOS_SEED`` picks one), so the suite walks the whole matrix over time while ``make chaos`` runs
all of it at once. A failure names the command that runs that cell again with the same moments."""

from __future__ import annotations

import os
import time

import pytest
from _chaos import BASE, Cell, draw, matrix, run_cell
from _chaos_victim import PHASES
from conftest import CONF_DIR, plain_cfg

from engine.config import check_override_keys

SEED = int(os.environ.get("CHAOS_SEED", int(time.time() // 86400)))  # the day's, unless given
SAMPLE = 1  # (make chaos runs every cell; make test one a day, so that it stays within its 15 minutes)


@pytest.mark.parametrize("cell", draw(matrix(), SEED, SAMPLE), ids=lambda c: f"seed{SEED}-{c.name}")
def test_a_node_lost_at_a_seeded_moment_is_survived(tmp_path, cell: Cell):
    """The run finishes with the right world, every step once and in order, identical replicas where the algorithm
    keeps them, every worker left exiting 0 and no traceback; the fault landed in its phase."""
    result = run_cell(cell, SEED, tmp_path)
    again = f"make chaos SEED={SEED} ONLY={cell.name}"
    assert result.ok, f"{cell.name} (seed {SEED}; again: {again}):\n" + "\n".join(result.problems)


@pytest.mark.full  # ~5 min; make test: the day's chaos cell (an alarm among its faults), and a spurious failure in
# each part of the loop (tests/test_strangers.py)
@pytest.mark.parametrize("phase", PHASES)
def test_a_spurious_alarm_in_each_phase_of_the_matrix_is_survived(tmp_path, phase):
    """A rank rings an alarm with no one gone (its own membership's, as a collective failing on its own would), in
    each phase of the chaos matrix: the ranks agree that nobody is gone, regroup, redo the part and finish with
    every rank, every step once, identical replicas and a ``regrouped`` event (tests/_chaos.py's checks)."""
    option = "diloco-streaming" if phase == "in flight" else "allreduce"
    cell = Cell(option, phase, "alarm")
    result = run_cell(cell, SEED, tmp_path)
    assert result.ok, f"{cell.name} (seed {SEED}; again: make chaos SEED={SEED} ONLY={cell.name}):\n" + "\n".join(
        result.problems
    )


def test_the_matrix_has_every_option_phase_and_fault():
    from _chaos import OPTIONS, PHASES, ROOT

    cells = matrix()
    every_option = {p.stem for p in (ROOT / "conf" / "sync").glob("*.yaml")}
    assert {o.overrides[0].removeprefix("sync=") for o in OPTIONS.values()} == every_option
    assert {c.option for c in cells} == set(OPTIONS)
    assert {c.phase for c in cells} == set(PHASES) and {c.fault for c in cells} == {"kill", "hang", "alarm"}
    assert {c.option for c in cells if c.phase == "in flight"} == {n for n, o in OPTIONS.items() if o.overlapped}
    assert all(Cell.parse(c.name) == c for c in cells)
    for option in OPTIONS.values():  # every option's overrides are keys of the config and compose
        check_override_keys([*BASE, *option.overrides], str(CONF_DIR))
        plain_cfg(*BASE, *option.overrides)
    assert draw(cells, 3, 5) == draw(cells, 3, 5) and len(set(draw(cells, 3, 5))) == 5


def test_the_checks_of_a_run_fail_on_each_thing_that_can_go_wrong(tmp_path):
    """A run's records as a 3-node run that lost rank 2 in step 5 writes them, checked as they are and then with
    one thing wrong at a time: each is named."""
    from _chaos import EPOCHS, Plan, Result, check

    cell = Cell("allreduce", "step", "kill")
    plan = Plan(3, {2: {"fault": "kill", "phase": "step", "report": ""}})
    fired = {2: {"rank": 2, "fault": "kill", "phase": "step", "where": ["step"], "in_flight": 0}}
    steps = [(1, 3, s) for s in range(6)] + [(1, 2, s) for s in range(6, 12)]  # epoch 1 started at 3 ranks
    steps += [(e, 2, 12 + 18 * (e - 2) + i) for e in range(2, EPOCHS + 1) for i in range(18)]
    train = [{"kind": "train", "epoch": e, "world_size": w, "step": s} for e, w, s in steps]
    lost = {"kind": "event", "event": "rank_lost", "ranks": [2]}
    summary = {"kind": "summary", "finished": True, "steps": len(train), "world_size": 2, "lost_ranks": [2]}
    summary["replica_spread"] = 0.0
    (tmp_path / "node0.log").write_text("relaxsync: finished\n")

    def problems(records=None, fired_=fired, log="") -> list[str]:
        (tmp_path / "node1.log").write_text(log)
        records = records if records is not None else [*train, lost, summary]
        return check(cell, plan, fired_, records, tmp_path, Result(cell.name, 0, False))

    assert problems() == []
    assert "steps recorded" in problems([*train[:7], train[6], *train[7:], lost, summary])[0]  # one step twice
    assert "epoch 1 has 11 steps" in problems([*train[:11], *train[12:], lost, {**summary, "steps": 65}])[-1]
    assert "world size 3" in problems([*train, lost, {**summary, "world_size": 3}])[0]
    assert "replicas differ" in problems([*train, lost, {**summary, "replica_spread": 1e-3}])[0]
    assert "rank_lost events name []" in problems([*train, summary])[0]
    assert "Traceback" in problems(log="Traceback (most recent call last):\n  boom")[0]
    assert "never fired" in problems(fired_={})[0]
    elsewhere = {2: {**fired[2], "where": ["evaluation"]}}
    assert "fired in ['evaluation']" in problems(fired_=elsewhere)[0]
    alarm = {**fired, 1: {"rank": 1, "fault": "alarm", "phase": "step", "where": ["step"], "in_flight": 0}}
    assert "no regrouped event" in problems(fired_=alarm)[0]  # (an alarm as well as the loss: not agreed on)
    regrouped = {"kind": "event", "event": "regrouped", "ranks": []}
    assert problems([*train, lost, regrouped, summary], fired_=alarm) == []
    assert "removed ranks" in problems([*train, lost, {**regrouped, "ranks": [1]}, summary], fired_=alarm)[0]
