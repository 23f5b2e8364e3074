"""Which GPU a worker takes, under every launcher, checked on a CPU with a faked CUDA device count: one visible device
per task (Slurm's ``--gpus-per-task 1``, which binds each task to its GPU: every task sees one, numbered 0), all of a
node's devices visible (torchrun, ``--gpus-per-node``, the local launcher), a task's own set of several, and too few
devices for the processes of a node (a clear error, not CUDA's "invalid device ordinal")."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import ROOT

from distributed import world
from engine.launchers import tasks_on_node


@pytest.fixture
def fake_cuda(monkeypatch):
    """``torch.cuda`` with ``n`` devices (set ``fake_cuda.count``); ``set_device`` records what it was asked for and
    refuses an index past the count, as CUDA does."""

    class Fake:
        count = 1
        chosen: list[int] = []

    def set_device(index):
        if not 0 <= index < Fake.count:
            raise RuntimeError("CUDA error: invalid device ordinal")
        Fake.chosen.append(index)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: Fake.count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: Fake.count)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    for key in ("SLURM_GPUS_PER_TASK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    return Fake


def test_one_visible_gpu_per_task_is_that_tasks_own(fake_cuda):
    """srun --ntasks-per-node 4 --gpus-per-task 1: each task sees one device; local ranks 1-3 take it too (the
    local rank as the index was CUDA's 'invalid device ordinal' on every one of them)."""
    fake_cuda.count = 1
    devices = [world.select_device("cuda", local_rank, 4) for local_rank in range(4)]
    assert devices == [torch.device("cuda", 0)] * 4 and fake_cuda.chosen == [0, 0, 0, 0]


def test_all_of_a_nodes_gpus_visible_give_one_per_local_rank(fake_cuda):
    fake_cuda.count = 8
    assert [world.select_device("auto", r, 8).index for r in range(8)] == list(range(8))
    assert fake_cuda.chosen == list(range(8))
    fake_cuda.count = 4  # more GPUs than processes: the first ones
    assert [world.select_device("cuda", r, 2).index for r in range(2)] == [0, 1]


def test_a_tasks_own_set_of_gpus_starts_at_its_first(fake_cuda, monkeypatch):
    """srun --gpus-per-task 2: a task sees its two; its local rank (up to 3 of 4) is no index into them."""
    fake_cuda.count = 2
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "2")
    assert [world.select_device("cuda", r, 4).index for r in range(4)] == [0, 0, 0, 0]


def test_fewer_gpus_than_a_nodes_processes_is_a_clear_error(fake_cuda, monkeypatch):
    fake_cuda.count = 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match=r"4 processes on this node share 2 visible GPUs \(CUDA_VISIBLE_DEVICES=0,1\)"):
        world.select_device("cuda", 3, 4)
    fake_cuda.count = 0
    with pytest.raises(ValueError, match="no CUDA device is visible to local rank 0"):
        world.select_device("cuda", 0, 1)
    assert world.select_device("auto", 0, 1) == torch.device("cpu")  # auto without a GPU: the CPU
    assert world.select_device("cpu", 0, 1) == torch.device("cpu") and fake_cuda.chosen == []


def test_slurms_tasks_per_node_are_read_for_this_node():
    spec = {"SLURM_STEP_TASKS_PER_NODE": "4(x2),3"}
    assert [tasks_on_node({**spec, "SLURM_NODEID": str(n)}) for n in range(3)] == [4, 4, 3]
    assert tasks_on_node({"SLURM_TASKS_PER_NODE": "8", "SLURM_NODEID": "0"}) == 8
    assert tasks_on_node({}) == 1


def _sbatch_options(text: str) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))


def test_the_sbatch_example_and_the_readmes_srun_line_bind_one_gpu_per_task(fake_cuda, monkeypatch):
    """What the documented commands ask Slurm for is what select_device expects: each task bound to one GPU (so
    every task sees one), as many tasks per node as the node's processes."""
    options = _sbatch_options((ROOT / "examples" / "slurm" / "train-gpu.sbatch").read_text())
    assert options["gpus-per-task"] == "1"
    per_node = int(options["ntasks-per-node"])
    readme = (ROOT / "README.md").read_text()
    srun = next(line for line in readme.splitlines() if line.startswith("srun ") and "--gpus-per-task" in line)
    assert "--gpus-per-task 1" in srun
    fake_cuda.count = 1  # what each task sees under --gpus-per-task 1
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", options["gpus-per-task"])
    local = {"SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x2)", "SLURM_NODEID": "1"}
    assert tasks_on_node(local) == per_node
    assert {world.select_device("cuda", r, per_node).index for r in range(per_node)} == {0}
