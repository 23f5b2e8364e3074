"""Shared helpers: compose configs exactly as users do, and run real multi-process jobs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# `make test-gpu` (RELAXSYNC_TEST_GPU=1) runs tests on this machine's GPUs. Every other run keeps them out of sight,
# so that trainer.device=auto means the CPU and gloo on any machine: the suite is written for 2-4 CPU ranks.
ON_GPU = os.environ.get("RELAXSYNC_TEST_GPU") == "1"
if not ON_GPU:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# c10d looks up the name of every connection's address, and a resolver that leaves a lookup unanswered holds the
# connection for its timeout (5 s by default; about one lookup in 25 on these machines). The suite asks it to give
# up after 1 s, for itself and every process it starts, before any lookup: the resolver reads this once per
# process, so a test that sets it later finds it ignored once an earlier test has looked a name up.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

import torch  # noqa: E402  (after CUDA_VISIBLE_DEVICES: CUDA reads it once)
from hydra import compose, initialize_config_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
# Small and fast on 2 CPU cores: a tiny timm model, no W&B, no progress bar.
TEST_RESNET_PARAMS = 373_658  # trainable parameters of timm's test_resnet with 10 classes
FAST = ["model=test_resnet", "data=synthetic", "logger=none", "trainer.progress=false"]

os.environ.setdefault("WANDB_SILENT", "true")


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def plain_cfg(*overrides: str) -> dict:
    from engine.config import prepare

    return prepare(compose_cfg(*overrides))


def need_gpus(n: int) -> None:
    """Under ``make test-gpu``: skip a test of ``n`` processes where there are fewer GPUs (NCCL: one per rank)."""
    if ON_GPU and torch.cuda.device_count() < n:
        pytest.skip(f"{n} NCCL ranks need {n} GPUs; this machine has {torch.cuda.device_count()}")


def node_environ(node: int) -> dict[str, str]:
    """Under ``make test-gpu``, what makes process ``node`` of a multi-node test a node of its own: a GPU of its own
    where there are enough; else a GPU shared with other nodes, and a host of its own for NCCL (``NCCL_HOSTID``),
    which then connects the nodes over sockets, as it connects hosts. (NCCL refuses two ranks on one GPU of one
    host.) Elsewhere nothing: the nodes run on the CPU with gloo."""
    if not ON_GPU:
        return {}
    count = torch.cuda.device_count()
    if count > node:
        return {"CUDA_VISIBLE_DEVICES": str(node)}
    if count == 0:
        pytest.skip("make test-gpu with no GPU in sight: the nodes run on CPU in make test")
    return {"CUDA_VISIBLE_DEVICES": str(node % count), "NCCL_HOSTID": f"relaxsync-test-node{node}",
            "NCCL_SOCKET_IFNAME": "lo"}  # fmt: skip


def train(run_dir: Path, *overrides: str, entrypoint=None) -> tuple[dict | None, list[dict]]:
    """Launch a real job (elastic launcher; gloo, or NCCL under ``make test-gpu``) in-process; return (summary,
    metrics records)."""
    from engine.launch import launch
    from engine.metrics import read_metrics

    need_gpus(compose_cfg(*overrides).trainer.nproc)
    cfg = plain_cfg(*overrides)
    kwargs = {"entrypoint": entrypoint} if entrypoint else {}
    summary = launch(cfg, str(run_dir), **kwargs)
    path = run_dir / "metrics.jsonl"
    return summary, (read_metrics(str(path)) if path.exists() else [])


def train_each(root: Path, runs: dict[str, list[str]], entrypoint=None) -> dict[str, list[dict]]:
    """Several runs of one world size side by side in a single launch (``_workers.each_config``, or another
    entrypoint that reads ``configs.json`` the same way), each in ``root/<name>``; returns their metrics."""
    import json

    from _workers import each_config

    from engine.launch import launch
    from engine.metrics import read_metrics

    configs = {name: plain_cfg(*overrides) for name, overrides in runs.items()}
    sizes = {c["trainer"]["nproc"] for c in configs.values()}
    assert len(sizes) == 1, f"one launch is one world size, not {sorted(sizes)}"
    root.mkdir(parents=True, exist_ok=True)
    (root / "configs.json").write_text(json.dumps(configs))
    launch(next(iter(configs.values())), str(root), entrypoint=entrypoint or each_config)
    return {name: read_metrics(str(root / name / "metrics.jsonl")) for name in runs}


def start_processes(fn, args: tuple, nprocs: int, **kwargs):
    """``torch.multiprocessing.start_processes`` from the launcher's fork server, whose processes have torch and the
    engine imported already (a spawned process imports them again: ~5 s each here, three at once on two cores).
    The processes inherit the server's environment, not this process's as it is now: pass what differs in ``args``."""
    import torch.multiprocessing as mp

    from engine.launch import start_worker_server

    start_worker_server()  # (once per process)
    return mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver", **kwargs)


def load_model_state(run_dir: Path) -> dict[str, torch.Tensor]:
    from engine.checkpoint import load

    return load(str(run_dir / "checkpoints" / "last.pt"))["model"]


def run_cli(*args: str, cwd: Path = ROOT, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` as a user runs it."""
    env = dict(os.environ, WANDB_SILENT="true", HYDRA_FULL_ERROR="0")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def records(metrics: list[dict], kind: str) -> list[dict]:
    return [r for r in metrics if r["kind"] == kind]


@pytest.fixture(scope="session")
def contract_runs(tmp_path_factory) -> Path:
    """The contract test's runs (``_contract.py``): every sync option, alone and wrapped, uninterrupted and
    resumed, in one launch; other tests read the same runs for properties of their own."""
    from _contract import run_all

    return run_all(tmp_path_factory.mktemp("contract"))


@pytest.fixture(scope="session")
def contract_runs_full(tmp_path_factory) -> Path:
    """The contract cases of make test-full only (``_contract.FULL_CASES``), in a launch of their own."""
    from _contract import run_all

    return run_all(tmp_path_factory.mktemp("contract-full"), full=True)


@pytest.fixture
def digits_imagefolder(tmp_path: Path) -> Path:
    """A real ImageNet-layout folder: digits written as PNGs, 12 train and 4 val images per class."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    root = tmp_path / "digits_if"
    counts: dict[tuple[str, int], int] = {}
    for image, label in zip(digits.images, digits.target):
        for split, limit in (("train", 12), ("val", 4)):
            if counts.get((split, label), 0) < limit:
                counts[(split, label)] = counts.get((split, label), 0) + 1
                folder = root / split / f"class_{label}"
                folder.mkdir(parents=True, exist_ok=True)
                pixels = (image * 255 / 16).astype("uint8")
                Image.fromarray(pixels).convert("RGB").save(folder / f"{len(list(folder.iterdir()))}.png")
                break
    return root
