"""A worker entry point for tests/test_decoupled.py: sync=decoupled runs with one learner stalled once, and every
round's inputs and outcome logged on every rank, for the test to compute the rule by hand."""

from __future__ import annotations

import os
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import record

STALLED_RANK, STALL_AT, STALL_S = 2, 4, 3.0  # (after step 4, rank 2's learner stops for 3 s; its syncer does not)
WINDOW_S = 1.0  # (a fixed grace window: the stall passes it, an on-time learner is well within it)


@record
def stalled_once_logging_rounds(cfg: dict, run_dir: str) -> None:
    """One run of ``cfg`` (through ``configs.json``, as ``conftest.train_each`` writes it) in which the learner of
    rank ``STALLED_RANK`` sleeps ``STALL_S`` after step ``STALL_AT``; each rank saves to
    ``<run>/rounds_rank<r>.pt`` what its syncer exchanged in every round (its own pseudo-gradient where it posted
    one, the headers, the global fragment and outer momentum before, the fragment after) and every carry of its
    learner (its fragment before and after, the global fragment before and after)."""
    from _workers import _each

    _each(run_dir, _run)


def _run(cfg: dict, run_dir: str) -> None:
    from _workers import fit_saving

    import algorithms.decoupled as decoupled

    rounds, carries = [], []
    exchange, carry, after = decoupled.Syncer.exchange, decoupled.carry, decoupled.DecoupledDiLoCo.after_optimizer_step
    window = decoupled.Grace.window

    def logged_exchange(self, index, posted):
        lo, hi = self.owner.ranges[index % self.owner.fragments]
        momentum = self.momentum[lo:hi].clone()
        delta = posted[0].clone() if posted is not None else None  # (before the allreduce sums it in place)
        outcome = exchange(self, index, posted)
        rounds.append(
            {
                "index": index,
                "delta": delta,
                "headers": [tuple(h.tensor(torch.device("cpu")).tolist()) for h in outcome.headers],
                "old": outcome.old,
                "momentum": momentum,
                "new": outcome.new,
            }
        )
        return outcome

    def logged_carry(local, old, new):
        before = local.clone()
        out = carry(local, old, new)
        carries.append({"before": before, "old": old.clone(), "new": new.clone(), "after": out.clone()})
        return out

    def stalling(self, result):
        report = after(self, result)
        if result.step == STALL_AT and int(os.environ["RANK"]) == STALLED_RANK:
            time.sleep(STALL_S)
        return report

    decoupled.Syncer.exchange, decoupled.carry = logged_exchange, logged_carry
    decoupled.DecoupledDiLoCo.after_optimizer_step = stalling
    decoupled.Grace.window = lambda self, group_s: WINDOW_S
    try:
        fit_saving(cfg, run_dir, "rounds", {"rounds": rounds, "carries": carries})
    finally:
        decoupled.Syncer.exchange, decoupled.carry = exchange, carry
        decoupled.DecoupledDiLoCo.after_optimizer_step, decoupled.Grace.window = after, window
