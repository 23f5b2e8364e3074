"""The plugin contract, for every sync option there is: alone and wrapped by relaxed sync, a run resumed from a
checkpoint with ``trainer.resume=auto`` ends exactly where an uninterrupted run of the same length ends
(parameters, optimizer, shared and per-rank sync state), and a wrapper forwards every hook and flag.

All cases (``_contract.py``) run in one launch of two worker processes, one case after another
(``_workers.uninterrupted_and_resumed``): each resumed run builds a new Trainer, membership and sync algorithm that
know only what the checkpoint holds. A resume across processes, as a restarted job does it, is tested in
``test_train.py`` and ``test_localsgd.py``.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from _contract import CASES, FULL_CASES, IDS, LAST_STEP, RESUME_STEP, case_dir, overrides, params
from conftest import plain_cfg, records
from hydra.utils import get_class

from algorithms.base import StepResult, SyncAlgorithm, SyncReport, Wrapper
from distributed.membership import Change
from engine.metrics import read_metrics

# Every option resumes bit for bit: a resumed run repeats the uninterrupted run's operations in the same order, on
# any CPU (PowerSGD fixes DDP's bucket layout for that, algorithms/powersgd.py). No tolerance hides a difference.
TOLERANCE: dict[str, float] = {}


def _assert_same(a, b, where: str, atol: float = 0.0) -> None:
    """Equal, recursively (tensors, dicts, lists, numbers): exactly, or tensors within ``atol``."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, where
        assert torch.equal(a, b) if not atol else torch.allclose(a.double(), b.double(), rtol=0, atol=atol), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}", atol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]", atol)
    elif atol and isinstance(a, float):
        assert abs(a - b) <= atol * max(1.0, abs(a)), f"{where}: {a!r} vs {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("case", params(CASES, FULL_CASES, IDS))
def test_resume_ends_where_an_uninterrupted_run_ends(request, case):
    runs = request.getfixturevalue("contract_runs_full" if case in FULL_CASES else "contract_runs")
    full, resumed = case_dir(runs, case) / "full", case_dir(runs, case) / "resumed"
    full_metrics = read_metrics(str(full / "metrics.jsonl"))
    resumed_metrics = read_metrics(str(resumed / "metrics.jsonl"))
    assert [r["event"] for r in records(resumed_metrics, "event")].count("resume") == 1
    assert [r["step"] for r in records(resumed_metrics, "train")] == list(range(RESUME_STEP, LAST_STEP))  # once
    a, b = _load(full / "checkpoints" / "last.pt"), _load(resumed / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == LAST_STEP
    atol = TOLERANCE.get(case[1], 0.0)
    for key in ("model", "optimizer", "sync", "schedule", "amp"):
        _assert_same(a[key], b[key], key, atol)
    own = sorted(p.name for p in (full / "checkpoints").glob("sync_rank*.pt"))
    assert own == sorted(p.name for p in (resumed / "checkpoints").glob("sync_rank*.pt"))
    for name in own:  # every rank's own state, e.g. DGC residuals and local momenta
        _assert_same(_load(full / "checkpoints" / name), _load(resumed / "checkpoints" / name), name, atol)
    final_eval = records(full_metrics, "eval")[-1]
    clocks = ("time", "eval_s", "wait_s")
    last_evals = (final_eval, records(resumed_metrics, "eval")[-1])
    timeless = [{k: v for k, v in r.items() if k not in clocks} for r in last_evals]
    _assert_same(*timeless, "eval", atol)  # every field but the wall clock and the evaluation's duration
    # Replicas that differ are evaluated as such, whether or not a wrapper sits around the exchange.
    sync = plain_cfg(*overrides(case))["sync"]
    section = sync.get("inner", sync)
    section = section["candidates"][section["start"]] if "candidates" in section else section  # (auto: its start)
    exchange = get_class(section["_target_"])
    assert ("replica_top1" in final_eval) == exchange.evaluates_replicas


def test_none_sends_nothing_while_training(contract_runs):
    """sync=none, the compute-only floor: not a byte while training; its replicas are evaluated as such."""
    metrics = read_metrics(str(case_dir(contract_runs, (None, "none", [])) / "full" / "metrics.jsonl"))
    steps = records(metrics, "train")
    assert steps and all(r["bytes_sent"] == 0 and r["payload_bytes"] == 0 for r in steps)
    assert "replica_top1" in records(metrics, "eval")[-1]


# ---- a wrapper forwards everything -----------------------------------------------------------------------------
HOOKS = sorted(
    name for name, member in vars(SyncAlgorithm).items() if inspect.isfunction(member) and not name.startswith("_")
)
FLAGS = sorted(
    name
    for name, value in vars(SyncAlgorithm).items()
    if isinstance(value, bool) and not name.startswith("_")  # capability flags, e.g. evaluates_replicas
)


class _Recording(SyncAlgorithm):
    """Records every hook call and answers with something a no-op would not return."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if name in HOOKS and callable(attr):

            def recorded(*args):
                object.__getattribute__(self, "calls").append((name, args))
                return attr(*args)

            return recorded
        return attr

    def on_epoch_start(self, epoch):
        return SyncReport(events=[{"event": "inner"}])

    def before_step(self, step):
        return SyncReport(events=[{"event": "inner"}])

    def after_backward(self, step, grads_finite):
        return SyncReport(grads_finite=False)

    def after_optimizer_step(self, result):
        return SyncReport(metrics={"inner": 1.0})

    def on_membership_change(self, change):
        return SyncReport(events=[{"event": "changed", "removed": change.removed}])

    def before_eval(self):
        pass

    def state_dict(self):
        return {"shared": 1}

    def local_state_dict(self):
        return {"own": torch.ones(1)}


def test_a_wrapper_overrides_every_hook_of_the_contract():
    assert {"setup", "after_backward", "state_dict", "local_state_dict", "finalize"} <= set(HOOKS)
    assert FLAGS == ["evaluates_replicas", "late_shared_state", "steps_apart"]
    missing = [name for name in HOOKS if name != "validate" and name not in vars(Wrapper)]
    assert not missing, f"Wrapper does not forward {missing}"


def test_a_wrapper_forwards_calls_state_and_flags_to_the_inner_algorithm():
    inner = _Recording()
    for flag in FLAGS:
        setattr(inner, flag, not getattr(SyncAlgorithm, flag))
    wrapper = Wrapper(inner)
    for flag in FLAGS:
        assert getattr(wrapper, flag) == getattr(inner, flag), flag
    wrapper.setup(torch.nn.Linear(2, 2), None, ctx=None)
    assert wrapper.module is inner.module
    result = StepResult(step=3, epoch=1, loss=0.5, lr=0.1, stepped=True, data_s=0.0, compute_s=0.1)
    assert wrapper.on_epoch_start(1).events == [{"event": "inner"}]
    assert wrapper.before_step(3).events == [{"event": "inner"}]
    assert wrapper.after_backward(3, True).grads_finite is False
    assert wrapper.after_optimizer_step(result).metrics == {"inner": 1.0}
    change = Change(generation=1, removed=[2], ranks=[0, 1], cause="died")
    assert wrapper.on_membership_change(change).events == [{"event": "changed", "removed": [2]}]
    wrapper.drain()
    wrapper.before_eval()
    assert wrapper.state_dict() == {"inner": {"shared": 1}}
    assert torch.equal(wrapper.local_state_dict()["own"], torch.ones(1))
    wrapper.load_state_dict({"inner": {"shared": 2}})
    wrapper.load_local_state_dict({"own": torch.zeros(1)})
    wrapper.finalize()
    called = [name for name, _ in inner.calls]
    assert called == [
        "setup", "on_epoch_start", "before_step", "after_backward", "after_optimizer_step",
        "on_membership_change", "drain", "before_eval", "state_dict", "local_state_dict", "load_state_dict",
        "load_local_state_dict", "finalize",
    ]  # fmt: skip
    assert dict(inner.calls)["after_optimizer_step"] == (result,)
    assert dict(inner.calls)["load_state_dict"] == ({"shared": 2},)
