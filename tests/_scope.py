"""The node-scope reference runs (``tests/test_scope.py``): every option, driven through its hooks in the trainer's
order, in a world of 2 nodes x 2 processes at ``sync.scope=node`` (each process a half of its node's batch), and
in a world of 2 processes, each with its node's whole batch as two micro-batches whose gradients it averages
(the gradient a node's processes agree on). Run in processes of their own: ``run(world, cases, out)``."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEPS, MICRO, FEATURES, CLASSES = 8, 4, 8, 4  # steps; samples per micro-batch; MLP input and output sizes


def batch(step: int, node: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro`` of node ``node``'s batch at ``step``: the same in both worlds."""
    g = torch.Generator().manual_seed(1000 * step + 10 * node + micro)
    return torch.randn(MICRO, FEATURES, generator=g), torch.randint(0, CLASSES, (MICRO,), generator=g)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def train(section: dict[str, Any], rank: int, nodes: list[str], micros: list[int], node: int) -> torch.Tensor:
    """One option for :data:`STEPS` steps on this process; its parameters at the end, flat."""
    from algorithms.base import StepResult, SyncContext
    from distributed.comm import Communicator
    from distributed.membership import Membership
    from engine.scope import build_sync

    membership = Membership(rank, len(nodes), nodes=list(nodes))
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    sync = build_sync(section, membership)
    sync.setup(net, optimizer, SyncContext(Communicator(membership), membership, torch.device("cpu")))
    sync.on_epoch_start(1)
    for step in range(STEPS):
        sync.before_step(step)
        optimizer.zero_grad(set_to_none=True)
        losses = []
        for i, micro in enumerate(micros):  # (each micro-batch's gradient halved: halving is exact in floating point)
            x, y = batch(step, node, micro)
            last = i == len(micros) - 1
            with sync.module.no_sync() if hasattr(sync.module, "no_sync") and not last else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(sync.module(x), y)
                (loss / len(micros)).backward()
            losses.append(loss.item())
        report = sync.after_backward(step, True)
        if report.grads_finite:
            optimizer.step()
        lr = optimizer.param_groups[0]["lr"]
        result = StepResult(step, 1, sum(losses) / len(losses), lr, report.grads_finite, 0.0, 0.001)
        sync.after_optimizer_step(result)
    sync.drain()
    sync.before_eval()
    sync.finalize()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def run(index: int, stores: str, cases: dict[str, dict[str, dict[str, Any]]], out: str) -> None:
    """Process ``index`` of 6: the first 4 a world of 2 nodes x 2 processes (``cases["node"]``), the last 2 a world
    of a process per node (``cases["process"]``); each saves every case's final parameters in ``out``."""
    world, rank = (4, index) if index < 4 else (2, index - 4)
    cases = cases["node" if world == 4 else "process"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{stores}/world{world}", rank=rank, world_size=world)
    if world == 4:
        nodes, micros, node = ["a", "a", "b", "b"], [rank % 2], rank // 2
    else:
        nodes, micros, node = ["a", "b"], [0, 1], rank
    results = {name: train(section, rank, nodes, micros, node) for name, section in cases.items()}
    torch.save(results, f"{out}/{world}-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def run_alone(index: int, stores: str, cases: dict[str, dict[str, dict[str, Any]]], out: str) -> None:
    """What is left after losses, for every option: process 0 of 3 alone in a world of its own (``cases["process"]``,
    both micro-batches), the other 2 one node alone (``cases["node"]``, a micro-batch each)."""
    world, rank = (1, 0) if index == 0 else (2, index - 1)
    cases = cases["process" if world == 1 else "node"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{stores}/alone{world}", rank=rank, world_size=world)
    nodes, micros = (["a"], [0, 1]) if world == 1 else (["a", "a"], [rank])
    results = {name: train(section, rank, nodes, micros, 0) for name, section in cases.items()}
    torch.save(results, f"{out}/alone{world}-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
