"""The rules of DiLoCo rounds that close on a quorum (algorithms/quorum.py), in float64 against hand computations:
the merge's weights, its equality with streaming DiLoCo's average where everyone is on time, what a learner that
missed a round keeps, when a learner behind skips a step, and the grace window."""

from __future__ import annotations

import pytest
import torch

from algorithms.diloco import DiLoCo
from algorithms.quorum import CatchUp, Grace, Header, Weights, carry, goodput, merge, quorum_of, weights

F64 = torch.float64


def _header(samples: int, missed: int = 0, contributes: bool = True) -> Header:
    return Header(contributes, samples, missed, 0.1, 1000)


def test_a_learner_late_by_a_round_brings_its_steps_discounted_once():
    # Learners 0 and 1 on time with 64 steps each (the round's span S); learner 2 missed the last round of the
    # fragment and brings 32 steps now. decay 0.5: weights 1, 1, 0.5 x 32 / 64 = 0.25.
    headers = [_header(64), _header(64), _header(32, missed=1)]
    w = weights(headers, 0.5)
    assert (w.shares, w.total) == ([1.0, 1.0, 0.25], 2.25)
    parts = [torch.tensor(v, dtype=F64) for v in ([0.5, 0.25], [0.25, -0.5], [1.0, 1.0])]
    merged = merge(parts, w)
    # By hand: (0.5 + 0.25 + 0.25 x 1) / 2.25 = 4/9 and (0.25 - 0.5 + 0.25 x 1) / 2.25 = 0.
    assert merged is not None and merged.dtype == F64
    assert merged.tolist() == [pytest.approx(4 / 9, rel=1e-15, abs=0), pytest.approx(0.0, abs=1e-16)]
    # The outer step on it (Nesterov, lr 0.7, momentum 0.9, from momentum 0.1, 0.2), by hand:
    theta, momentum = torch.tensor([1.0, -2.0], dtype=F64), torch.tensor([0.1, 0.2], dtype=F64)
    DiLoCo(outer_lr=0.7, outer_momentum=0.9)._outer_step(theta, momentum, merged)
    m0, m1 = 0.9 * 0.1 + 4 / 9, 0.9 * 0.2
    expected = [1.0 - 0.7 * (4 / 9 + 0.9 * m0), -2.0 - 0.7 * (0.0 + 0.9 * m1)]
    assert momentum.tolist() == [pytest.approx(m0, rel=1e-15), pytest.approx(m1, rel=1e-15)]
    assert theta.tolist() == [pytest.approx(expected[0], rel=1e-15), pytest.approx(expected[1], rel=1e-15)]


def test_a_slow_learner_weighs_by_its_steps_and_never_moves_a_round_further_than_its_learners():
    # Learner 2 computed a third of the round's 96 steps (it skipped to catch up): it weighs 1/3.
    headers = [_header(96), _header(96), _header(32)]
    w = weights(headers, 0.5)
    assert w.shares == [1.0, 1.0, 32 / 96]
    # Where its pseudo-gradient is as long as the others' (local models that settled within its steps, as measured
    # on bench/tta), the merge is that length: a convex combination, where scaling it up to a round's samples gave
    # (96 + 96 + 96) / (7/3) = 123.4.
    same = [torch.tensor([96.0], dtype=F64)] * 3
    assert merge(same, w).tolist() == [pytest.approx(96.0, rel=1e-15)]
    # Where it grew with its steps (1.0 per step): (96 + 96 + 32/3) / (7/3) = 86.857..., between its 32 and 96.
    parts = [torch.tensor([96.0], dtype=F64), torch.tensor([96.0], dtype=F64), torch.tensor([32.0], dtype=F64)]
    assert merge(parts, w).tolist() == [pytest.approx((192 + 32 / 3) / (7 / 3), rel=1e-15)]
    # BN statistics, states rather than sums: the mean weighted alike, the heaviest's factor exactly 1.
    assert w.buffer_factors() == [1.0, 1.0, 32 / 96]


def test_where_every_contributor_missed_a_round_the_span_is_the_most_any_holds():
    headers = [_header(64, missed=1), _header(32, missed=1), _header(0, contributes=False)]
    w = weights(headers, 0.5)
    assert w.shares == [0.5, 0.25, 0.0]
    parts = [torch.tensor([4.0], dtype=F64), torch.tensor([2.0], dtype=F64), torch.tensor([1e9], dtype=F64)]
    assert merge(parts, w).tolist() == [pytest.approx(2.5 / 0.75, rel=1e-15)]  # (0.5 x 4 + 0.25 x 2) / 0.75


def test_a_learner_not_in_the_round_adds_nothing_and_the_rest_average():
    headers = [_header(64), _header(0, contributes=False), _header(64)]
    assert weights(headers, 0.5) == Weights([1.0, 0.0, 1.0])
    parts = [torch.tensor([2.0], dtype=F64), torch.tensor([1e9], dtype=F64), torch.tensor([4.0], dtype=F64)]
    assert merge(parts, weights(headers, 0.5)).tolist() == [3.0]
    assert merge(parts, weights([_header(64, contributes=False)] * 3, 0.5)) is None  # (no one: no outer step)


@pytest.mark.parametrize("learners", [2, 3, 4])
def test_everyone_on_time_merges_to_streaming_diloco_average_to_the_bit(learners):
    g = torch.Generator().manual_seed(learners)
    parts = [torch.randn(1000, generator=g, dtype=F64) for _ in range(learners)]
    streaming = parts[0].clone()
    for p in parts[1:]:
        streaming += p  # (an allreduce's sum, in rank order)
    streaming /= learners
    merged = merge(parts, weights([_header(96)] * learners, 0.5))
    assert torch.equal(merged, streaming)


def test_a_learner_that_missed_the_round_keeps_its_progress():
    old, new = torch.tensor([1.0, 2.0], dtype=F64), torch.tensor([0.5, 2.5], dtype=F64)
    local = torch.tensor([0.75, 1.5], dtype=F64)  # progress since it took `old`: -0.25, -0.5
    carry(local, old, new)
    assert local.tolist() == [0.25, 2.0]  # the new global fragment plus its own progress
    assert (new - local).tolist() == [0.25, 0.5]  # its next pseudo-gradient still holds what it computed


def test_header_round_trip():
    h = Header(True, 128, 2, 0.0731, 4096)
    assert Header.of(h.tensor(torch.device("cpu")).tolist()) == h


def test_quorum_counts_learners_at_least_one():
    assert [quorum_of(0.5, n) for n in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 3]
    assert quorum_of(1.0, 4) == 4 and quorum_of(0.01, 4) == 1 and quorum_of(0.75, 4) == 3
    assert goodput(90, 100) == 0.9 and goodput(0, 0) == 1.0


@pytest.mark.parametrize("slower,computes", [(3.0, 100), (2.0, 150), (1.5, 200), (1.2, 300), (1.05, 300)])
def test_a_learner_k_times_slower_computes_one_step_in_k(slower, computes):
    learner, group = CatchUp(), 0.1
    computed = 0
    for _ in range(300):
        if learner.skip(group):
            learner.skipped(group)
        else:
            learner.computed(slower * group, group)
            computed += 1
    assert computed == computes  # (1.2 and 1.05: within the tolerance, on time: noise)


def test_a_learner_on_time_never_skips_and_banks_no_time():
    on_time = CatchUp()
    for pace in [0.09, 0.12, 0.105, 0.08] * 50:  # within the tolerance of the group's 0.1 s
        assert not on_time.skip(0.1)
        on_time.computed(pace, 0.1)
    assert on_time.debt == 0.0
    fast = CatchUp()
    for _ in range(50):
        fast.computed(0.01, 0.1)
    assert fast.debt == 0.0
    fast.computed(0.25, 0.1)  # then slower: behind by 0.15 s, more than a step, so it skips the next
    assert fast.skip(0.1)
    fast.skipped(0.1)
    assert not fast.skip(0.1) and fast.debt == pytest.approx(0.05)


def test_grace_is_a_step_until_measured_then_twice_the_median_wait_under_that_cap():
    grace = Grace(steps=1.0)
    assert grace.window(0.08) == pytest.approx(0.08)
    for wait in (0.01, 0.02, 0.015):
        grace.saw(wait)
    assert grace.window(0.08) == pytest.approx(0.03)
    for wait in (0.2, 0.3, 0.25, 0.4):
        grace.saw(wait)
    assert grace.window(0.08) == pytest.approx(0.08)  # (never past the cap)
