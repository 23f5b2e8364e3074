"""The plugin contract, for every sync option there is: alone and wrapped by relaxed sync, a run resumed from a
checkpoint with ``trainer.resume=auto`` ends exactly where an uninterrupted run of the same length ends
(parameters, optimizer, shared and per-rank sync state), and a wrapper forwards every hook and flag.

All cases run in one launch of two worker processes, one case after another (``_workers.uninterrupted_and_resumed``):
each resumed run builds a new Trainer, membership and sync algorithm that know only what the checkpoint holds. A
resume across processes, as a restarted job does it, is tested in ``test_train.py`` and ``test_localsgd.py``.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from conftest import CONF_DIR, plain_cfg, records
from hydra.utils import get_class

from algorithms.base import StepResult, SyncAlgorithm, SyncReport, Wrapper
from engine.metrics import read_metrics

OPTIONS = sorted(p.stem for p in (CONF_DIR / "sync").glob("*.yaml"))
WRAPPERS = [o for o in OPTIONS if issubclass(get_class(plain_cfg(f"sync={o}")["sync"]["_target_"]), Wrapper)]
# Options that make each algorithm's state matter within 2 x 3 steps (an averaging period that straddles the
# checkpoint, more tensors compressed); a wrapped algorithm takes them under sync.inner.
STATEFUL = {
    "localsgd": ["begin_step=1", "k_steps=3"],
    "adaptive_localsgd": ["begin_step=1", "init_k_steps=3"],
    "dgc": ["min_compress_numel=1024"],
    "sgp": ["consensus_every=1"],
    "crossover": ["consensus_every=1"],
    "diloco": ["inner_steps=2"],
    "powersgd": ["start_powerSGD_iter=2"],  # compressing (with error feedback) before the checkpoint
    # No eviction (a negative threshold), so both runs keep their ranks; every check still agrees a verdict.
    "relaxed": ["relaxed_sync_threshold=-1", "check_every=1"],
}
# Modes beyond an option's defaults with state of their own (rounds in flight across steps, fragments, ...).
VARIANTS = {
    "sgp": [["overlap=true", "synch_freq=2"]],
    "crossover": [["overlap=true"]],
    "diloco": [["inner_steps=4", "fragments=2", "delay=1", "quantize=int8"], ["quantize=fp16", "alpha=0.5"]],
}
ALONE = [(o, []) for o in OPTIONS] + [(o, v) for o, variants in VARIANTS.items() for v in variants]
CASES = [(None, o, v) for o, v in ALONE] + [(w, o, v) for w in WRAPPERS for o, v in ALONE if o not in WRAPPERS]


def _id(case: tuple) -> str:
    wrapper, option, variant = case
    keys = "".join(f" sync{'.inner' if wrapper else ''}.{kv}" for kv in variant)
    return (f"sync={wrapper} sync@sync.inner={option}" if wrapper else f"sync={option}") + keys


IDS = [_id(c) for c in CASES]
# 2 processes x 3 steps per epoch x 2 epochs; the resumed run starts from the checkpoint after epoch 1.
COMMON = [
    "model=test_resnet", "data=synthetic", "data.num_samples=96", "data.num_val_samples=32", "data.batch_size=16",
    "logger=none", "trainer.progress=false", "trainer.nproc=2", "trainer.epochs=2", "trainer.checkpoint_every=1",
]  # fmt: skip
RESUME_STEP, LAST_STEP = 3, 6


def _overrides(case: tuple) -> list[str]:
    wrapper, option, variant = case
    if wrapper is None:
        return [*COMMON, f"sync={option}", *(f"sync.{kv}" for kv in STATEFUL.get(option, []) + variant)]
    own = [f"sync.{kv}" for kv in STATEFUL.get(wrapper, [])]
    inner = [f"sync.inner.{kv}" for kv in STATEFUL.get(option, []) + variant]
    return [*COMMON, f"sync={wrapper}", f"sync@sync.inner={option}", *own, *inner]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every case run uninterrupted and resumed, in one launch; returns the directory holding ``<case>/``."""
    from _workers import uninterrupted_and_resumed

    from engine.launch import launch

    root = tmp_path_factory.mktemp("contract")
    cases = {f"case{i}": plain_cfg(*_overrides(case)) for i, case in enumerate(CASES)}
    (root / "cases.json").write_text(json.dumps({"cases": cases, "resume_step": RESUME_STEP}))
    launch(next(iter(cases.values())), str(root), entrypoint=uninterrupted_and_resumed)
    return root


# PowerSGD's matrix products in a resumed process's first step run on DDP's initial bucket layout, not on the
# rebuilt one the uninterrupted run has by then, which moves results by about one unit in the last place
# (algorithms/powersgd.py); every other option resumes bit for bit.
TOLERANCE = {"powersgd": 1e-6}


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


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_resume_ends_where_an_uninterrupted_run_ends(runs, case):
    full, resumed = runs / f"case{CASES.index(case)}" / "full", runs / f"case{CASES.index(case)}" / "resumed"
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
    _assert_same(final_eval, records(resumed_metrics, "eval")[-1], "eval", atol)
    # Replicas that differ are evaluated as such, whether or not a wrapper sits around the exchange.
    sync = plain_cfg(*_overrides(case))["sync"]
    exchange = get_class(sync.get("inner", sync)["_target_"])
    assert ("replica_top1" in final_eval) == exchange.evaluates_replicas


def test_none_sends_nothing_while_training(runs):
    """sync=none, the compute-only floor: not a byte while training; its replicas are evaluated as such."""
    metrics = read_metrics(str(runs / f"case{CASES.index((None, 'none', []))}" / "full" / "metrics.jsonl"))
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

    def before_eval(self):
        pass

    def state_dict(self):
        return {"shared": 1}

    def local_state_dict(self):
        return {"own": torch.ones(1)}


def test_a_wrapper_overrides_every_hook_of_the_contract():
    assert {"setup", "after_backward", "state_dict", "local_state_dict", "finalize"} <= set(HOOKS)
    assert FLAGS == ["evaluates_replicas"]
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
    wrapper.on_membership_change()
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
