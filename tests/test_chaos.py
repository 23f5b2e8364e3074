"""A rotating sample of the chaos matrix (tests/_chaos.py): each day draws other cells and other moments from a seed
of its own (``CHAOS_SEED`` picks one), so the suite walks the whole matrix over time while ``make chaos`` runs
all of it at once. A failure names the command that runs that cell again with the same moments."""

from __future__ import annotations

import os
import time

import pytest
from _chaos import Cell, draw, matrix, run_cell

SEED = int(os.environ.get("CHAOS_SEED", int(time.time() // 86400)))  # the day's, unless given
SAMPLE = 2


@pytest.mark.parametrize("cell", draw(matrix(), SEED, SAMPLE), ids=lambda c: f"seed{SEED}-{c.name}")
def test_a_node_lost_at_a_seeded_moment_is_survived(tmp_path, cell: Cell):
    """The run finishes with the right world, every step once and in order, identical replicas where the algorithm
    keeps them, every worker left exiting 0 and no traceback; the fault landed in its phase."""
    result = run_cell(cell, SEED, tmp_path)
    again = f"make chaos SEED={SEED} ONLY={cell.name}"
    assert result.ok, f"{cell.name} (seed {SEED}; again: {again}):\n" + "\n".join(result.problems)


def test_the_matrix_has_every_option_phase_and_fault():
    from _chaos import OPTIONS, PHASES, ROOT

    cells = matrix()
    every_option = {p.stem for p in (ROOT / "conf" / "sync").glob("*.yaml")}
    assert {o.overrides[0].removeprefix("sync=") for o in OPTIONS.values()} == every_option
    assert {c.option for c in cells} == set(OPTIONS)
    assert {c.phase for c in cells} == set(PHASES) and {c.fault for c in cells} == {"kill", "hang"}
    assert {c.option for c in cells if c.phase == "in flight"} == {n for n, o in OPTIONS.items() if o.overlapped}
    assert all(Cell.parse(c.name) == c for c in cells)
    assert draw(cells, 3, 5) == draw(cells, 3, 5) and len(set(draw(cells, 3, 5))) == 5
