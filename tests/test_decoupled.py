"""sync=decoupled: with every learner on time it is streaming DiLoCo, step for step and bit for bit (its rounds
close on everyone, its merge adds each pseudo-gradient once and divides by the learners' count); a learner late for
a round is left out of it, keeps its progress and counts in the fragment's next round, every round merged by the
written rule (checked in float64); the rules alone against hand computations: tests/test_quorum.py. (Resume, alone
and inside relaxed sync: test_contract.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import FAST, records, train_each

COMMON = [*FAST, "trainer.nproc=2", "data.num_samples=256", "data.batch_size=16", "trainer.epochs=1"]
COMMON += ["trainer.checkpoint_every=1", "optimizer=momentum"]
ON_TIME = ["sync.quorum=1.0", "sync.catch_up=false"]  # (rounds close on everyone, nobody skips a step)
# (the mode's and streaming DiLoCo's settings, each once without BN statistics, whose merge comes a delay later)
MODES = {
    "streaming": ["sync.inner_steps=4", "sync.fragments=2", "sync.delay=1", "sync.quantize=int8"],
    "whole": ["sync.inner_steps=4", "sync.fragments=1", "sync.delay=0", "sync.quantize=none"],
}
BUFFERS = {"streaming": ["sync.average_buffers=false"], "whole": []}


def _load(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_everyone_on_time_is_streaming_diloco_step_for_step(tmp_path, mode):
    settings = [*MODES[mode], *BUFFERS[mode]]
    runs = {
        "diloco": [*COMMON, "sync=diloco", *settings],
        "decoupled": [*COMMON, "sync=decoupled", *settings, *ON_TIME],
    }
    metrics = train_each(tmp_path, runs)
    losses = {name: [r["loss"] for r in records(m, "train")] for name, m in metrics.items()}
    assert len(losses["diloco"]) == 8 and losses["decoupled"] == losses["diloco"]  # (every step: bit for bit)
    rounds = [r for r in records(metrics["decoupled"], "train") if "round_contributors" in r]
    assert rounds and all(r["round_contributors"] == 2 and r["computed_share"] == 1.0 for r in rounds)
    # Goodput, by hand: steps that entered a round over those computed up to each fragment's latest round. With
    # delay 1, step 2 (computed after round 0 was posted, before it was applied, which overwrote fragment 0 with the
    # global one, as streaming DiLoCo does) never enters fragment 0: once round 2 (steps 3-5) is applied at step 6,
    # 2 x (2 + 3) of fragment 0's 2 x 6 and 2 x 4 of fragment 1's 2 x 4: 18 of 20. Without delay, every step enters.
    goodputs = [(r["step"], r["goodput"]) for r in records(metrics["decoupled"], "train") if "goodput" in r]
    if mode == "streaming":
        assert goodputs == [(2, 1.0), (3, 1.0), (4, 1.0), (5, 1.0), (6, 0.9), (7, 0.9)]
    else:
        assert goodputs and all(g == 1.0 for _, g in goodputs)
    assert all(r["skipped"] == 0 for r in records(metrics["decoupled"], "train"))
    a, b = (_load(tmp_path / name / "checkpoints" / "last.pt") for name in runs)
    assert a["step"] == b["step"] == 8
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for key in ("global_params", "momentum"):
        x, y = a["sync"][key], b["sync"][key]
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), key
    # Counted when posted, as streaming DiLoCo counts its exchange when issued, plus each round's headers (an
    # allgather of 5 float64 values from each of the 2 learners).
    steps = zip(records(metrics["diloco"], "train"), records(metrics["decoupled"], "train"))
    for r, d in steps:
        headers = 5 * 8 if "outer_fragment" in r else 0
        assert d["bytes_sent"] == r["bytes_sent"] + headers, r["step"]


def test_a_learner_late_for_a_round_counts_in_the_next_by_the_written_rule(tmp_path):
    """3 learners, H=8 in 2 fragments (a round every 4 steps, applied 3 steps later), 12 steps an epoch; rank 2's
    learner stops for 3 s after step 4 (tests/_decoupled.py), so round 1 (fragment 1, posted after step 7) closes on
    the quorum at step 10 without it, and it keeps its progress (carried); after the epoch's evaluation, which waits
    for everyone, it is on time and brings fragment 1's 16 steps, one round missed, to round 3. Every round, on every
    rank, is checked in float64 against the rule computed here from the logged pseudo-gradients and headers: the
    pseudo-gradients' mean weighted by their steps (steps x 0.25 ** missed / the steps of those on time), then
    Nesterov (lr 0.7, momentum 0.9), within float32's rounding."""
    from _decoupled import STALLED_RANK, stalled_once_logging_rounds
    from _rounding import EPS

    settings = ["sync=decoupled", "sync.inner_steps=8", "sync.fragments=2", "sync.delay=3", "sync.quantize=none"]
    settings += ["sync.quorum=0.5", "sync.late_decay=0.25", "sync.catch_up=false", "sync.average_buffers=false"]
    common = [*FAST, "trainer.nproc=3", "data.num_samples=576", "data.batch_size=16", "trainer.epochs=2"]
    train_each(tmp_path, {"late": [*common, *settings, "trainer.checkpoint_every=0"]}, stalled_once_logging_rounds)
    logs = [_load(tmp_path / "late" / f"rounds_rank{r}.pt") for r in range(3)]
    assert [[r["index"] for r in log["rounds"]] for log in logs] == [list(range(6))] * 3
    # By hand, per round: who was in, with how many steps (since its last contribution to the fragment, or the
    # start), having missed how many rounds of the fragment since; each decay d = 0.25 ** missed and weight d x steps
    # over the round's span (the steps of those on time).
    expected = {
        0: ([1, 1, 1], [4, 4, 4], [0, 0, 0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]),  # fragment 0, steps 0-3
        1: ([1, 1, 0], [8, 8, 0], [0, 0, 0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]),  # fragment 1, steps 0-7; rank 2 out
        2: ([1, 1, 1], [5, 5, 5], [0, 0, 0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]),  # fragment 0, steps 7-11
        3: ([1, 1, 1], [5, 5, 16], [0, 0, 1], [1.0, 1.0, 0.25], [1.0, 1.0, 0.8]),  # rank 2: 16 steps x 0.25 / 5
        4: ([1, 1, 1], [8, 8, 8], [0, 0, 0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]),
        5: ([1, 1, 1], [5, 5, 5], [0, 0, 0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]),
    }
    for index in range(6):
        on = [log["rounds"][index] for log in logs]
        for other in on[1:]:  # (every rank merged alike: the global fragments are bit-identical)
            assert other["headers"] == on[0]["headers"]
            assert all(torch.equal(other[k], on[0][k]) for k in ("old", "momentum", "new")), index
        contributes, steps, missed = ([h[i] for h in on[0]["headers"]] for i in range(3))
        decays = [0.25**m if c else 0.0 for c, m in zip(contributes, missed)]
        span = max(s for c, s, m in zip(contributes, steps, missed) if c and not m)
        shares = [d * s / span for d, s in zip(decays, steps)]
        assert (contributes, steps, missed, decays, [pytest.approx(x) for x in shares]) == expected[index], index
        merged = sum(w * r["delta"].double() for w, r in zip(shares, on) if w > 0) / sum(shares)
        momentum = 0.9 * on[0]["momentum"].double() + merged
        update = 0.7 * (merged + 0.9 * momentum)
        theta = on[0]["old"].double() - update
        bound = 64 * EPS * max(float(on[0]["old"].abs().max()), float(update.abs().max()))
        assert float((on[0]["new"].double() - theta).abs().max()) <= bound, index
    carries = logs[STALLED_RANK]["carries"]
    assert len(carries) == 1 and all(not log["carries"] for r, log in enumerate(logs) if r != STALLED_RANK)
    (c,) = carries  # round 1, on the learner that missed it: its fragment moved by the global step
    assert torch.equal(c["old"], logs[0]["rounds"][1]["old"]) and torch.equal(c["new"], logs[0]["rounds"][1]["new"])
    moved = c["before"].double() + (c["new"].double() - c["old"].double())
    bound = 4 * EPS * float(c["before"].abs().max() + (c["new"] - c["old"]).abs().max())
    assert float((c["after"].double() - moved).abs().max()) <= bound
