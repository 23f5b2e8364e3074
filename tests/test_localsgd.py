"""sync=localsgd and sync=adaptive_localsgd: k=1 is allreduce SGD, replicas agree after each averaging, the
adaptive period follows ADACOMM's formula, and resume keeps the counters."""

from __future__ import annotations

import json
import math

import torch
from _rounding import assert_one_update_apart
from conftest import load_model_state, records, train, train_each

from algorithms.localsgd import adaptive_period

FAST = ["model=test_resnet", "data=digits", "logger=none", "trainer.progress=false", "trainer.nproc=2"]


def test_k1_plain_sgd_equals_allreduce(tmp_path):
    """Two synchronous steps, then one local step averaged at once (k=1): allreduce SGD. The synchronous steps
    average gradients as DDP does, exactly (halving is exact), so the two runs part only in the local step, by the
    rounding of one update (see _rounding.py): compared there, before training amplifies it. The averaging must
    happen in that step (the final checkpoint averages the replicas anyway)."""
    common = [*FAST, "optimizer=sgd", "trainer.max_steps=3", "data.batch_size=16", "trainer.checkpoint_every=0"]
    local = [*common, "sync=localsgd", "sync.begin_step=2", "sync.k_steps=1"]
    metrics = train_each(tmp_path, {"local": local, "ar": [*common, "sync=allreduce"]})
    steps = records(metrics["local"], "train")
    assert [(r["step"], r.get("synced")) for r in steps] == [(0, None), (1, None), (2, 1.0)]
    assert steps[2]["replica_distance"] > 0  # the replicas had parted, and were averaged
    assert_one_update_apart(load_model_state(tmp_path / "local"), load_model_state(tmp_path / "ar"), skip=("running",))


def test_replicas_identical_after_every_sync_and_drift_between(tmp_path):
    from _workers import localsgd_watch_replicas

    _, metrics = train(
        tmp_path, *FAST, "sync=localsgd", "sync.begin_step=3", "sync.k_steps=4", "trainer.max_steps=19",
        entrypoint=localsgd_watch_replicas,
    )  # fmt: skip
    log = json.loads((tmp_path / "replicas.json").read_text())
    assert all(e["identical"] for e in log if e["step"] < 3)  # synchronous phase
    synced = [e["step"] for e in log if e["synced"]]
    assert synced == [6, 10, 14, 18]  # every 4 steps from begin_step
    assert all(e["identical"] for e in log if e["synced"])
    assert any(not e["identical"] for e in log if not e["synced"] and e["step"] >= 3)
    steps = {r["step"]: r for r in records(metrics, "train")}
    assert all(steps[s]["bytes_sent"] == 0 for s in (3, 4, 5, 7, 8, 9))  # local steps send nothing
    assert all(steps[s]["bytes_sent"] > 0 and steps[s]["replica_distance"] > 0 for s in synced)


def test_adaptive_period_follows_the_formula_on_a_trace():
    lr_0, loss_0, init_k = 0.1, 2.3, 4
    trace = [(0.1, 2.3), (0.1, 1.2), (0.05, 1.0), (0.01, 0.8), (0.001, 0.5), (1e-5, 0.4), (0.1, 0.01)]
    for lr_t, loss_t in trace:
        k = adaptive_period(lr_0, loss_0, lr_t, loss_t, init_k, 16)
        expected = min(16, max(1, math.ceil(math.sqrt(lr_0 * loss_t / (lr_t * loss_0) * init_k))))
        assert k == expected and 1 <= k <= 16
    assert adaptive_period(lr_0, loss_0, 1e-6, 2.0, init_k, 16) == 16  # clamped
    assert adaptive_period(lr_0, loss_0, 0.1, 0.0001, init_k, 16) == 1


def test_adaptive_period_in_a_run_matches_the_formula(tmp_path):
    _, metrics = train(
        tmp_path, *FAST, "sync=adaptive_localsgd", "sync.init_k_steps=4", "sync.begin_step=0",
        "schedule.warmup_epochs=0", "trainer.epochs=2",
    )  # fmt: skip
    changes = [e for e in records(metrics, "event") if e["event"] == "k_changed"]
    assert changes  # the period adapted as the loss fell and the LR decayed
    for e in changes:
        assert e["to"] == adaptive_period(e["lr_0"], e["loss_0"], e["lr"], e["loss"], 4, 16) != e["from"]
    steps = records(metrics, "train")
    syncs = [r for r in steps if r.get("synced")]
    for before, after in zip(syncs, syncs[1:]):
        # The gap to the next averaging is the period chosen at this one.
        assert after["step"] - before["step"] == before["k_steps"]
        assert before["k_steps"] == adaptive_period(
            changes[0]["lr_0"], changes[0]["loss_0"], before["lr"], before["avg_loss"], 4, 16
        )
    assert max(r["k_steps"] for r in steps) <= 16


def test_resume_keeps_step_counter_and_period(tmp_path):
    common = [
        *FAST, "sync=adaptive_localsgd", "sync.init_k_steps=3", "sync.begin_step=5",
        "schedule.warmup_epochs=0", "trainer.epochs=2", "data.batch_size=64",
    ]  # fmt: skip
    train(tmp_path, *common, "trainer.max_epochs_per_run=1")
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["sync"]  # shared by every rank
    assert saved["next_sync"] > 11 and saved["lr_0"] > 0
    _, metrics = train(tmp_path, *common, "trainer.resume=auto")
    resumed = [r for r in records(metrics, "train") if r["epoch"] == 2]
    assert resumed[0]["step"] == 11  # the step counter carried over
    assert resumed[0]["k_steps"] == saved["k_steps"]  # so did the period
    first_sync = next(r["step"] for r in resumed if r.get("synced"))
    assert first_sync + 1 == saved["next_sync"]  # the averaging schedule continued
    assert all(r["bytes_sent"] == 0 for r in resumed if r["step"] < first_sync)  # no synchronous warm-up again


def test_right_after_an_averaging_the_replicas_agree_without_another_exchange():
    """Evaluation, checkpoints and joins settle the replicas with ``before_eval()``: right after an averaging it has
    nothing to exchange, after a local step it averages; ``agreement_at`` names the averagings' step counts, where
    a join is admitted when one is near."""
    from _counting import set_up, step

    from algorithms.localsgd import LocalSGD

    sgd = LocalSGD(begin_step=0, k_steps=4)
    comm = set_up(sgd)
    # Before the first local step: the first averaging, k steps after begin_step (synchronous until then: any step).
    assert sgd.agreement_at(0) == 0 and sgd.agreement_at(3) == 4
    assert [LocalSGD(begin_step=2, k_steps=4).agreement_at(n) for n in (1, 2, 3, 7)] == [1, 2, 6, 10]
    for index in range(4):  # the fourth step completed averages
        step(sgd, index)
    assert comm.calls == ["all_reduce"]
    sgd.before_eval()
    assert comm.calls == ["all_reduce"]
    step(sgd, 4)
    sgd.before_eval()
    assert comm.calls == ["all_reduce", "all_reduce"]
    assert [sgd.agreement_at(n) for n in (5, 8, 9, 12, 13)] == [8, 8, 12, 12, 16]
