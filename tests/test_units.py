"""Single-process unit tests: schedule, samplers, checkpoints, AMP backends, metric names, LARS groups."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest
import torch
from conftest import plain_cfg

from data.common import ShardSampler, TrainSampler, resumed_step_in_epoch, steps_per_epoch
from engine import checkpoint as ckpt
from engine.amp import TorchAmp, probe_apex
from engine.metrics import MetricsWriter, read_metrics
from engine.optim import LRSchedule, build_optimizer, effective_lr
from engine.wandb_logger import wandb_keys


def _sched(name: str, **kw) -> LRSchedule:
    cfg = plain_cfg(f"schedule={name}")["schedule"]
    cfg.update(kw)
    return LRSchedule(cfg, base_lr=1.0, total_epochs=10)


def test_warmup_is_linear_then_cosine_reaches_floor():
    s = _sched("cosine", warmup_epochs=1, warmup_start_factor=0.1, min_lr_factor=0.0)
    assert s.lr(0) == pytest.approx(0.1)
    assert s.lr(0.5) == pytest.approx(0.55)
    assert s.lr(1.0) == pytest.approx(1.0)
    assert s.lr(5.5) == pytest.approx(0.5)  # halfway through the decay
    assert s.lr(10) == pytest.approx(0.0, abs=1e-12)


def test_poly_and_step_schedules():
    poly = _sched("poly", warmup_epochs=0, power=2.0, min_lr_factor=0.0)
    assert poly.lr(5.0) == pytest.approx(0.25)
    step = _sched("step", warmup_epochs=0, milestones=[3, 6], gamma=0.1)
    assert [step.lr(e) for e in (2.9, 3.0, 5.9, 6.0)] == pytest.approx([1.0, 0.1, 0.1, 0.01])


def test_scale_lr_is_the_linear_scaling_rule():
    cfg = plain_cfg("schedule.scale_lr=true", "schedule.base_batch_size=256", "optimizer.lr=0.1")
    assert effective_lr(cfg["optimizer"], cfg["schedule"], global_batch=512) == pytest.approx(0.2)
    cfg = plain_cfg("optimizer.lr=0.1")
    assert effective_lr(cfg["optimizer"], cfg["schedule"], global_batch=512) == pytest.approx(0.1)


def test_shard_sampler_covers_every_sample_exactly_once():
    for n, shards in ((10, 3), (359, 2), (5, 4), (3, 4)):
        seen = sorted(i for r in range(shards) for i in ShardSampler(n, shards, r))
        assert seen == list(range(n))


def test_train_shards_partition_the_dataset():
    for n, replicas in ((1438, 2), (1438, 3), (10, 4)):
        shards = [TrainSampler(n, replicas, r, seed=0) for r in range(replicas)]
        for s in shards:
            s.set_epoch(2)
        seen = sorted(i for s in shards for i in s)
        assert seen == list(range(n))  # each sample exactly once, no padding duplicates
        assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1


def test_train_sampler_skip_resumes_mid_epoch():
    full = TrainSampler(20, num_replicas=2, rank=1, seed=3)
    full.set_epoch(4)
    order = list(full)
    part = TrainSampler(20, num_replicas=2, rank=1, seed=3)
    part.set_epoch(4)
    part.skip(8)  # 4 samples of each of the 2 shards: the epoch's first 8
    assert list(part) == order[4:]
    assert list(part) == order  # the skip applies to one epoch only
    assert steps_per_epoch(1438, 3, 32) == 479 // 32


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2), (2, 2)])
def test_an_epoch_resumed_at_another_world_size_trains_no_sample_twice_and_drops_fewer_than_a_batch_per_rank(
    before, after
):
    """A world stopped after ``s`` steps of an epoch and resumed at another size (torchrun scale-up or down):
    the new ranks skip what was trained, shard the rest, and the step count continues where the epoch stands."""
    n, batch, s = 1000, 16, 7

    def shards(replicas: int, skip: int = 0) -> list[list[int]]:
        out = []
        for r in range(replicas):
            sampler = TrainSampler(n, replicas, r, seed=5)
            sampler.set_epoch(3)
            sampler.skip(skip)
            out.append(list(sampler))
        return out

    trained = [i for shard in shards(before) for i in shard[: s * batch]]
    consumed = s * batch * before
    step_in_epoch = resumed_step_in_epoch(n, consumed, after, batch)
    left = steps_per_epoch(n, after, batch) - step_in_epoch
    rest = [i for shard in shards(after, consumed) for i in shard[: left * batch]]
    assert len(set(trained)) == len(trained) and not set(trained) & set(rest)  # nothing twice
    assert n - len(trained) - len(rest) < after * batch + after  # at most the ragged end of one step per rank
    if before == after:
        assert step_in_epoch == s and rest == [i for sh in shards(before) for i in sh[s * batch : (s + left) * batch]]
    assert abs(step_in_epoch / steps_per_epoch(n, after, batch) - consumed / n) < 0.05  # the LR schedule's position


def test_atomic_save_leaves_old_checkpoint_intact_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    ckpt.save_atomic({"step": 1, "w": torch.ones(3)}, str(path))

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_atomic({"step": 2}, str(path))
    monkeypatch.undo()
    assert ckpt.load(str(path))["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left behind


def test_checkpoint_loads_with_weights_only(tmp_path):
    path = tmp_path / "c.pt"
    ckpt.save_atomic({"config": {"a": [1, 2]}, "t": torch.zeros(2)}, str(path))
    assert ckpt.load(str(path))["config"] == {"a": [1, 2]}
    torch.save({"evil": types.SimpleNamespace()}, str(path))
    with pytest.raises(Exception, match="[Ww]eights only"):
        ckpt.load(str(path))


def test_resolve_resume(tmp_path):
    assert ckpt.resolve_resume(None, str(tmp_path)) is None
    assert ckpt.resolve_resume("auto", str(tmp_path)) is None  # nothing to resume yet
    ckpt.save_atomic({}, str(tmp_path / "checkpoints" / "last.pt"))
    assert ckpt.resolve_resume("auto", str(tmp_path)).endswith("checkpoints/last.pt")


def test_a_torchrun_world_resumes_by_itself_after_a_restart_or_its_own_jobs_stop(tmp_path, monkeypatch):
    """A restart (TORCHELASTIC_RESTART_COUNT > 0), or a world of the torchrun job whose stop wrote the checkpoint
    (a scale-up restart keeps the count at 0), resumes without trainer.resume; another job or no stop does not."""
    run_dir = str(tmp_path)
    for var in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    first = ckpt.Checkpointer(run_dir, 0, 1, None)
    first.save({"step": 7}, {}, 7, stopped_by=None)
    assert ckpt.Checkpointer(run_dir, 0, 1, None).resume_path is None  # a checkpoint, but no stop: a fresh run
    first.save({"step": 9}, {}, 9, stopped_by="SIGTERM")
    assert ckpt.Checkpointer(run_dir, 1, 1, None).resume_path == first.path  # the job's next world
    assert ckpt.Checkpointer(run_dir, 1, 1, None).rejoined
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    assert ckpt.Checkpointer(run_dir, 0, 1, None).resume_path is None  # another job starts over
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert ckpt.Checkpointer(run_dir, 0, 1, None).resume_path == first.path  # any job's restart resumes


def test_wandb_key_names_follow_the_metrics_contract():
    rec = {"kind": "train", "step": 3, "loss": 1.5, "bytes_sent": 8.0, "comm_s": 0.1, "tag": "x"}
    assert wandb_keys(rec) == {"train/step": 3, "train/loss": 1.5, "comm/bytes_sent": 8.0, "comm/comm_s": 0.1}
    assert wandb_keys({"kind": "eval", "top1": 50.0, "time": 1.7e9}) == {"eval/top1": 50.0}  # W&B has its own


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))


def test_metrics_read_while_written_leave_out_the_record_still_being_written(tmp_path):
    """Tests and benches poll metrics.jsonl while a run appends to it; an append that crosses a page boundary can
    be seen half written, and reading it must not fail (nor return half a record)."""
    path = str(tmp_path / "metrics.jsonl")
    writer = MetricsWriter(path)
    writer.write({"kind": "train", "step": 1})
    writer.close()
    with open(path, "a") as f:
        f.write('{"kind": "train", "step": 2, "lo')
    assert read_metrics(path) == [{"kind": "train", "step": 1}]
    with open(path, "a") as f:
        f.write('ss": 1.5}\n')
    assert read_metrics(path) == [{"kind": "train", "step": 1}, {"kind": "train", "step": 2, "loss": 1.5}]


def test_torch_amp_autocasts_to_bfloat16_on_cpu():
    model = _tiny()
    amp = TorchAmp(dtype="auto", scaler="auto")
    amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))
    assert amp.dtype == torch.bfloat16
    assert not amp.scaler.is_enabled()  # bf16 needs no loss scaling
    with amp.autocast():
        assert model[0](torch.randn(2, 4)).dtype == torch.bfloat16


@pytest.mark.parametrize("local_inf", [True, False], ids=["own-overflow", "other-rank-overflow"])
def test_overflow_step_is_skipped_and_scale_backs_off(local_inf):
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = TorchAmp(dtype="bfloat16", scaler=True, init_scale=1024.0)
    amp.setup(model, opt, torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    amp.backward(model(torch.randn(8, 4)).sum(), opt)
    if local_inf:
        next(model.parameters()).grad[0, 0] = float("inf")
    finite = amp.unscale(opt)
    assert finite is (not local_inf)
    assert amp.step(opt, grads_finite=False) is False  # the agreed verdict: some rank overflowed
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert amp.loss_scale == 512.0


def test_finite_step_with_scaler_updates_parameters():
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = TorchAmp(dtype="bfloat16", scaler=True, init_scale=1024.0)
    amp.setup(model, opt, torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    amp.backward(model(torch.randn(8, 4)).sum(), opt)
    assert amp.unscale(opt) is True
    grads = [p.grad.clone() for p in model.parameters()]
    assert amp.step(opt, grads_finite=True) is True
    for b, g, p in zip(before, grads, model.parameters()):
        torch.testing.assert_close(p.detach(), b - 0.1 * g)  # gradients were unscaled before the step


def test_probe_apex_rejects_the_unrelated_pypi_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))  # no apex.amp inside
    monkeypatch.delitem(sys.modules, "apex.amp", raising=False)
    message = probe_apex()
    assert "apex.amp" in message and "amp=torch" in message


def test_lars_exempts_bias_and_norm_from_decay_and_adaptation():
    import timm

    model = timm.create_model("test_resnet", num_classes=10)
    cfg = plain_cfg("optimizer=lars")["optimizer"]
    opt = build_optimizer(model, cfg, lr=1.0)
    assert type(opt).__name__ == "Lars"
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.ndim > 1), name
    assert all(g["trust_coeff"] == cfg["trust_coeff"] for g in opt.param_groups)


def test_plain_sgd_has_no_momentum():
    model = torch.nn.Linear(3, 1)
    opt = build_optimizer(model, plain_cfg("optimizer=sgd")["optimizer"], lr=0.5)
    assert all(g["momentum"] == 0 and not g["nesterov"] for g in opt.param_groups)
    opt = build_optimizer(model, plain_cfg("optimizer=momentum")["optimizer"], lr=0.5)
    assert all(math.isclose(g["momentum"], 0.9) for g in opt.param_groups)


def test_a_sleep_straggler_on_all_ranks_slows_every_rank_one_that_joins_later_too():
    """``straggler.ranks=all`` (device time each step, as bench/peers models it): every rank sleeps, one whose id
    is past the world it started with (a process that joined) included; ``all`` is the only word allowed."""
    from engine.straggler import SleepStraggler
    from errors import ConfigError

    every = SleepStraggler(ranks="all", start_epoch=1, sleep_s=0.0)
    assert all(every.slowed(1, rank, 3) for rank in (0, 2, 3, 7)) and not every.slowed(0, 0, 3)
    assert not SleepStraggler(ranks=[1], start_epoch=1).slowed(1, 3, 3)
    section = {"ranks": "all", "start_epoch": 1, "slowdown": 5.0, "sleep_s": 0.3}
    SleepStraggler.validate(section, {}, 3)
    with pytest.raises(ConfigError, match="straggler.ranks"):
        SleepStraggler.validate({**section, "ranks": "some"}, {}, 3)


def test_a_rank_that_takes_over_logging_writes_the_records_the_ended_one_did_not(tmp_path):
    """The logging rank is killed after a step every rank finished and before (or while) writing its record: the
    rank that logs next writes it, once, and cuts off the half-written line, so that every step is in metrics.jsonl
    once."""
    from engine.metrics import NoLogger, Recorder

    class Member:
        def __init__(self, rank: int, logging: list[int]):
            self.rank, self.logging = rank, logging

        @property
        def is_logging_rank(self) -> bool:
            return self.rank == self.logging[0]

    def recorder(rank: int, logging: list[int]) -> Recorder:
        return Recorder(str(tmp_path), {"trainer": {}}, "allreduce", Member(rank, logging), NoLogger())

    def train(step: int, rank: int) -> dict:
        return {"kind": "train", "step": step, "epoch": 0, "loss": 1.0 + rank, "bytes_sent": 8, "comm_s": 0.1,
                "samples_per_s": 100.0}  # fmt: skip

    logging = [0]
    first, second = recorder(0, logging), recorder(1, logging)
    for step in range(3):
        for r in (first, second):
            r.write(train(step, r.membership.rank), step)
    second.write(train(3, 1), 3)  # (the first ended before its record)
    second.event({"event": "checkpoint"}, 1, 3)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')  # ...in the middle of writing it
    logging[0] = 1
    second.elect()
    second.write(train(4, 1), 4)
    written = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [(r["kind"], r["step"]) for r in written] == [
        ("train", 0), ("train", 1), ("train", 2), ("train", 3), ("event", 3), ("train", 4)
    ]  # fmt: skip
    assert open(tmp_path / "metrics.jsonl").read().count("\n") == 6  # (the half line is gone, not kept as a line)


def test_a_rank_that_takes_over_logging_writes_a_record_it_held_in_another_order(tmp_path):
    """The ranks need not hold their records in one order: the logging rank wrote a checkpoint's event and ended
    before the next step's record, which the next logging rank holds before that event. It writes that step's
    record, once, and nothing twice (it looks each record up, not only the ones after the file's last)."""
    from engine.metrics import NoLogger, Recorder

    class Member:
        rank, is_logging_rank = 1, False

    def train(step: int, epoch: int) -> dict:
        return {"kind": "train", "step": step, "epoch": epoch, "loss": 1.0, "bytes_sent": 8, "comm_s": 0.1,
                "samples_per_s": 100.0}  # fmt: skip

    member = Member()
    second = Recorder(str(tmp_path), {"trainer": {}}, "allreduce", member, NoLogger())
    with open(tmp_path / "metrics.jsonl", "w") as f:  # (what the first logging rank wrote before it ended)
        for step in range(16):
            f.write(json.dumps(train(step, 1)) + "\n")
        f.write(json.dumps({"kind": "eval", "step": 16, "epoch": 1, "top1": 10.0}) + "\n")
        f.write(json.dumps({"kind": "event", "step": 16, "epoch": 1, "event": "checkpoint"}) + "\n")
    for step in range(14, 16):
        second.write(train(step, 1), step)
    second.write({"kind": "eval", "step": 16, "epoch": 1, "top1": 10.0}, 16)
    second.write(train(16, 2), 16)  # (before the event, on this rank)
    second.event({"event": "checkpoint"}, 1, 16)
    second.write(train(17, 2), 17)
    member.is_logging_rank = True
    second.elect()
    written = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in written if r["kind"] == "train"] == list(range(18))
    assert [r["kind"] for r in written].count("event") == 1 and [r["kind"] for r in written].count("eval") == 1
