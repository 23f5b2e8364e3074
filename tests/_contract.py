"""The contract test's cases: every sync option (and its stateful variants), alone and inside every wrapper,
each run uninterrupted and resumed from a checkpoint, all in one launch. Shared by the tests that read those
runs (``conftest.contract_runs``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CONF_DIR, plain_cfg

OPTIONS = sorted(p.stem for p in (CONF_DIR / "sync").glob("*.yaml"))
# (composed for the CPU: a GPU machine with fewer GPUs than trainer.nproc refuses the config)
SECTIONS = {o: plain_cfg(f"sync={o}", "trainer.device=cpu")["sync"] for o in OPTIONS}
WRAPPERS = [o for o in OPTIONS if "inner" in SECTIONS[o]]  # (the options around another, sync.inner)
CHOOSERS = [o for o in OPTIONS if "candidates" in SECTIONS[o]]  # (sync=auto: it runs the others, none runs it)
# Options that make each algorithm's state matter within 2 x 3 steps (an averaging period that straddles the
# checkpoint, more tensors compressed); a wrapped algorithm takes them under sync.inner.
STATEFUL = {
    "localsgd": ["begin_step=1", "k_steps=3"],
    "adaptive_localsgd": ["begin_step=1", "init_k_steps=3"],
    "dgc": ["min_compress_numel=1024"],
    "sgp": ["consensus_every=1"],
    "crossover": ["consensus_every=1"],
    "diloco": ["inner_steps=2"],
    # A round every 2 steps, applied a step later, closed by everyone (no quorum nor catching up: both runs alike).
    "decoupled": ["inner_steps=4", "fragments=2", "delay=1", "quorum=1.0", "catch_up=false"],
    "powersgd": ["start_powerSGD_iter=2"],  # compressing (with error feedback) before the checkpoint
    # No eviction (a negative threshold), so both runs keep their ranks; every check still agrees a verdict.
    "relaxed": ["relaxed_sync_threshold=-1", "check_every=1"],
    # Its probe, then local SGD k=4 whatever it measured (the margin holds the start): the choice and the option's
    # state both straddle the checkpoint.
    "auto": ["probe_steps=2", "start=localsgd4", "margin=1000"],
}
# Modes beyond an option's defaults with state of their own (rounds in flight across steps, fragments, ...).
VARIANTS = {
    "sgp": [["overlap=true", "synch_freq=2"]],
    "crossover": [["overlap=true"]],
    "diloco": [
        ["inner_steps=4", "fragments=2", "delay=1", "quantize=int8"],
        ["quantize=fp16", "alpha=0.5"],
        # (the error-feedback buffers, each rank's own, straddle the checkpoint; a joiner starts with an empty one)
        ["inner_steps=4", "fragments=2", "delay=1", "quantize=sparse", "chunk=512", "ef_decay=0.9"],
    ],
}
ALONE = [(o, []) for o in OPTIONS] + [(o, v) for o, variants in VARIANTS.items() for v in variants]
CASES = [(None, o, v) for o, v in ALONE] + [
    (w, o, v) for w in WRAPPERS for o, v in ALONE if o not in WRAPPERS + CHOOSERS
]


def _id(case: tuple) -> str:
    wrapper, option, variant = case
    keys = "".join(f" sync{'.inner' if wrapper else ''}.{kv}" for kv in variant)
    return (f"sync={wrapper} sync@sync.inner={option}" if wrapper else f"sync={option}") + keys


IDS = [_id(c) for c in CASES]
# Run in make test-full only, in a launch of their own (make test: relaxed sync around each option with its defaults
# and each variant alone; a wrapper hands its inner option's state through as it does for the defaults).
FULL_CASES = [(w, o, v) for w, o, v in CASES if w is not None and v]
# 2 processes x 3 steps per epoch x 2 epochs; the resumed run starts from the checkpoint after epoch 1.
COMMON = [
    "model=test_resnet", "data=synthetic", "data.num_samples=96", "data.num_val_samples=32", "data.batch_size=16",
    "logger=none", "trainer.progress=false", "trainer.nproc=2", "trainer.epochs=2", "trainer.checkpoint_every=1",
]  # fmt: skip
RESUME_STEP, LAST_STEP = 3, 6


def overrides(case: tuple) -> list[str]:
    wrapper, option, variant = case
    if wrapper is None:
        return [*COMMON, f"sync={option}", *(f"sync.{kv}" for kv in STATEFUL.get(option, []) + variant)]
    own = [f"sync.{kv}" for kv in STATEFUL.get(wrapper, [])]
    inner = [f"sync.inner.{kv}" for kv in STATEFUL.get(option, []) + variant]
    return [*COMMON, f"sync={wrapper}", f"sync@sync.inner={option}", *own, *inner]


def run_all(root: Path, full: bool = False) -> Path:
    """Every case of make test (``full``: of make test-full only, :data:`FULL_CASES`) run uninterrupted and
    resumed, in one launch (``_workers.uninterrupted_and_resumed``)."""
    from _workers import uninterrupted_and_resumed

    from engine.launch import launch

    chosen = [c for c in CASES if (c in FULL_CASES) == full]
    cases = {case_dir(root, case).name: plain_cfg(*overrides(case)) for case in chosen}
    (root / "cases.json").write_text(json.dumps({"cases": cases, "resume_step": RESUME_STEP}))
    launch(next(iter(cases.values())), str(root), entrypoint=uninterrupted_and_resumed)
    return root


def params(cases: list[tuple], full_cases: list[tuple], ids: list[str]) -> list:
    """``cases`` as pytest parameters, those of ``full_cases`` marked ``full``."""
    return [pytest.param(c, id=i, marks=[pytest.mark.full] if c in full_cases else []) for c, i in zip(cases, ids)]


def case_dir(root: Path, case: tuple) -> Path:
    """Where ``case`` ran: ``full/`` and ``resumed/`` inside."""
    return root / f"case{CASES.index(case)}"


# ---- a join ------------------------------------------------------------------------------------------------------
# Every option alone, and relaxed sync around the one that keeps replicas identical and the one that does not.
JOIN_CASES = [(None, o, v) for o, v in ALONE] + [("relaxed", "allreduce", []), ("relaxed", "sgp", [])]
JOIN_IDS = [_id(c) for c in JOIN_CASES]
# In make test-full only, in a launch of their own (make test: the int8 variant, quantized with rounds in flight, and
# DiLoCo alone; relaxed sync alone and around SGP; SGP's overlap).
FULL_JOIN_CASES = [
    (None, "diloco", ["quantize=fp16", "alpha=0.5"]),
    ("relaxed", "allreduce", []),
    (None, "crossover", ["overlap=true"]),
]
assert all(c in JOIN_CASES for c in FULL_JOIN_CASES), "a full-only join case that is no join case"
# 2 processes x 6 steps per epoch x 2 epochs; a third joins a few steps in: the rest of epoch 1 and epoch 2 are
# sharded over 3 (what is left split over 3 ranks, whole batches of 16 each, then 4 steps).
JOIN_OVERRIDES = ["data.num_samples=192", "trainer.on_failure=continue", "trainer.hang_timeout_s=30"]


def join_last_step(at: int) -> int:
    """The last step of a join case whose third process was admitted at step ``at``."""
    return at + (192 - 32 * at) // 3 // 16 + 192 // 48


def join_overrides(case: tuple) -> list[str]:
    return [*overrides(case), *JOIN_OVERRIDES]


def run_joins(root: Path, full: bool = False) -> Path:
    """Every join case of make test (``full``: of make test-full only, :data:`FULL_JOIN_CASES`), joined mid-run and
    resumed from the admission's checkpoint at 3, in one launch of three processes (``_workers.joined_and_resumed``)."""
    from _workers import joined_and_resumed

    from engine.launch import launch

    chosen = [c for c in JOIN_CASES if (c in FULL_JOIN_CASES) == full]
    cases = {f"case{JOIN_CASES.index(c)}": plain_cfg(*join_overrides(c)) for c in chosen}
    (root / "cases.json").write_text(json.dumps({"cases": cases}))
    launch(plain_cfg(*join_overrides(chosen[0]), "trainer.nproc=3"), str(root), entrypoint=joined_and_resumed)
    return root
