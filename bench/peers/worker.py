"""One process of a peer's run: our data, model, optimizer, LR schedule and seeds, the peer's way of syncing.

    torchrun ... -m bench.peers.worker PEER RUN_DIR [train.py overrides]

Everything but the sync is built by the functions our trainer builds it with (``build_data``, ``build_replica``,
``Loaders``), seeded as our trainer seeds it, stepped in the same order (zero_grad, forward, backward, the LR of
the moment, the optimizer step): a difference in the loss curves is the sync's. PEER is one of :data:`PEERS`.
Torch's peers run as one torch.distributed world (one torchrun across the nodes); torchft's as one replica
group per node (a torchrun of the node's processes) that a lighthouse (``TORCHFT_LIGHTHOUSE``) joins into a
quorum, as torchft's own examples run. With several processes per node (``LOCAL_WORLD_SIZE`` > 1) a torchft replica
group is the node's processes, their gradients averaged by torch DDP over the group's own process group every step
(torchft's Manager then runs on local rank r with the r-th process of every other group), and
``hierarchical_localsgd`` is torch's recipe for two levels: the post-local-SGD hook averaging gradients over the
node's subgroup every step, and ``HierarchicalModelAverager`` averaging parameters over every process each period.
The first replica writes ``RUN_DIR/metrics.jsonl`` in our records' format (``kind: train`` per step, with the
bytes its node's interface sent; one ``kind: summary`` at the end with the top-1 of the replicas' average), so a
peer's run reads like ours.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn

from bench.common import config
from data.common import Loaders, build_data
from engine.metrics import MetricsWriter, NetdevCounter
from engine.optim import build_replica

TORCH_PEERS = ("ddp", "ddp_powersgd", "ddp_powersgd_fixed", "post_localsgd", "hierarchical_localsgd")
TORCHFT_PEERS = ("torchft_ddp", "torchft_localsgd", "torchft_diloco")
PEERS = TORCH_PEERS + TORCHFT_PEERS


# ---- torch's own ---------------------------------------------------------------------------------------------
class TorchPeer:
    """DDP as its tutorial has it (stock arguments), with the comm hook and averager ``name`` adds."""

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer, sync: dict[str, Any]):
        from torch.nn.parallel import DistributedDataParallel

        self.optimizer = optimizer
        self.replica, self.replicas = dist.get_rank(), dist.get_world_size()
        fixed = name == "ddp_powersgd_fixed"  # DDP set up as ours sets it up (see bench.peers.PAIRS)
        if name.startswith("ddp_powersgd"):
            self.ddp = DistributedDataParallel(model, bucket_cap_mb=sync["bucket_cap_mb"], broadcast_buffers=not fixed)
        else:
            self.ddp = DistributedDataParallel(model)
        if name.startswith("ddp_powersgd"):
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power

            if fixed:  # buckets in parameter order for good
                self.ddp.reducer._push_all_rebuilt_params()
                self.ddp.reducer._rebuild_buckets()
            keys = ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate", "use_error_feedback",
                    "warm_start", "orthogonalization_epsilon", "random_seed")  # fmt: skip
            self.ddp.register_comm_hook(power.PowerSGDState(None, **{k: sync[k] for k in keys}), power.powerSGD_hook)
        elif name == "post_localsgd":
            from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
            from torch.distributed.optim import PostLocalSGDOptimizer

            begin, k = sync["begin_step"], sync["k_steps"]
            # Gradients allreduced for the first ``begin`` steps, then none (one process per node: no intra-node
            # group to reduce over). The averager averages after its step ``warmup_steps`` and every k after; ours
            # after local step k, 2k, ... from ``begin``: the same steps when warmup = begin + k - 1.
            state = post.PostLocalSGDState(None, None, start_localSGD_iter=begin, post_local_gradient_allreduce=False)
            self.ddp.register_comm_hook(state, post.post_localSGD_hook)
            averager = PeriodicModelAverager(period=k, warmup_steps=begin + k - 1)
            self.optimizer = PostLocalSGDOptimizer(optim=optimizer, averager=averager)
        elif name == "hierarchical_localsgd":
            from collections import OrderedDict

            from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post
            from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
                HierarchicalModelAverager,
            )
            from torch.distributed.optim import PostLocalSGDOptimizer

            # torchrun numbers a node's processes consecutively: the subgroups of LOCAL_WORLD_SIZE are the nodes.
            # Gradients over the whole world for the first ``begin`` steps, then over the node's processes every
            # step; the parameters over every process after each step from begin + k - 1 on that k divides (ours
            # after step begin + k - 1 and every k after: the same steps where begin = 1 mod k).
            begin, k = sync["begin_step"], sync["k_steps"]
            node, _ = dist.new_subgroups(group_size=int(os.environ["LOCAL_WORLD_SIZE"]))
            state = post.PostLocalSGDState(None, node, start_localSGD_iter=begin, post_local_gradient_allreduce=True)
            self.ddp.register_comm_hook(state, post.post_localSGD_hook)
            averager = HierarchicalModelAverager(OrderedDict([(k, self.replicas)]), warmup_steps=begin + k - 1)
            self.optimizer = PostLocalSGDOptimizer(optim=optimizer, averager=averager)
        self.module = self.ddp

    def position(self, step: int) -> int:
        """The step of the run this replica takes next (what the LR follows and the run's end counts)."""
        return step

    def report(self, at: int) -> dict[str, Any]:
        return {}

    def evaluate(self, model: nn.Module, loaders: Loaders) -> float:
        """Top-1 of the replicas' average (parameters and BN statistics), each replica on its shard, as ours."""
        average(model, self.sum, self.replicas)
        return top1(model, loaders.val, self.sum)

    def sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    def close(self) -> None:
        dist.destroy_process_group()


# ---- torchft's -------------------------------------------------------------------------------------------------
class TorchftPeer:
    """One replica group (a node's processes): a torchft Manager on the lighthouse, and the algorithm ``name``."""

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer, sync: dict[str, Any]):
        from torchft import Manager, ProcessGroupGloo

        self.replica, self.replicas = int(os.environ["PEER_REPLICA"]), int(os.environ["PEER_REPLICAS"])
        self.local, self.group_size = int(os.environ.get("LOCAL_RANK", 0)), group_size()
        timeout = datetime.timedelta(seconds=float(os.environ.get("PEER_TIMEOUT_S", 60)))
        self.model, self.optimizer, self.name = model, optimizer, name
        self.period = sync.get("inner_steps") if name == "torchft_diloco" else sync.get("k_steps", 1)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self.load_state_dict,
            state_dict=self.state_dict,
            min_replica_size=int(os.environ.get("PEER_MIN_REPLICAS", self.replicas)),
            use_async_quorum=False,  # (DiLoCo requires it; the same for all three keeps them comparable)
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=self.local,
            world_size=self.group_size,
            replica_id=f"replica{self.replica}",
            hostname=os.environ.get("PEER_HOST", "localhost"),  # (the node's own address: what the others reach)
            # Our replicas start identical (seeded), the case torchft's docs give init_sync=False for; with True,
            # the first quorum (after the first k local steps in LocalSGD) heals the others from the first
            # replica instead of averaging with them.
            init_sync=False,
        )
        self.module: nn.Module = model
        if self.group_size > 1 and name != "torchft_ddp":  # (the group's processes agree every step: DDP inside)
            from torch.nn.parallel import DistributedDataParallel as GroupDDP

            self.module = GroupDDP(model, broadcast_buffers=False)
        if name == "torchft_ddp":
            from torchft.ddp import DistributedDataParallel
            from torchft.optim import OptimizerWrapper

            self.module = DistributedDataParallel(self.manager, model)
            self.optimizer = OptimizerWrapper(self.manager, optimizer)
            self.context = None
        elif name == "torchft_localsgd":
            from torchft.local_sgd import LocalSGD

            self.context = LocalSGD(self.manager, model, optimizer, sync_every=sync["k_steps"])
        else:
            from torchft.local_sgd import DiLoCo

            outer = torch.optim.SGD(
                model.parameters(), lr=sync["outer_lr"], momentum=sync["outer_momentum"], nesterov=sync["nesterov"]
            )
            self.context = DiLoCo(
                self.manager, [model], optimizer, outer, sync_every=sync["inner_steps"],
                backup_device=torch.device("cpu"), pin_memory=False, fragment_sync_delay=sync["delay"],
                fragment_update_alpha=sync["alpha"],
            )  # fmt: skip
        if self.context is not None:
            self.context.__enter__()
        # Local SGD and DiLoCo vote at each synchronisation (should_commit): kept for report(); a step whose vote
        # failed is thrown away with everything trained since the last one that passed (the backup is restored).
        self._votes: list[tuple[bool, int]] = []
        self._reported = 0
        vote = self.manager.should_commit

        def recorded(*args: Any, **kwargs: Any) -> bool:
            passed = vote(*args, **kwargs)
            self._votes.append((passed, self.manager.num_participants()))
            return passed

        self.manager.should_commit = recorded  # type: ignore[method-assign]

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def position(self, step: int) -> int:
        """DDP: the steps the replicas committed. Local SGD and DiLoCo: this replica's own steps, moved by a period
        for each synchronisation the Manager counts beyond the votes this replica took part in (torchft counts
        synchronisations). Either way a replica that joined late takes the run's position once it is healed, and
        a replica whose vote failed trains the steps it threw away again."""
        if self.name == "torchft_ddp":
            return self.manager.current_step()
        return step + self.period * (self.manager.current_step() - len(self._votes))

    def report(self, at: int) -> dict[str, Any]:
        """Whether the step was kept (DDP: committed by every participant), and by how many replicas; local SGD and
        DiLoCo: at a step that synchronised, whether its vote passed and how many replicas took part."""
        if self.name == "torchft_ddp":
            return {"committed": self.manager.current_step() > at, "participants": self.manager.num_participants()}
        if len(self._votes) == self._reported:
            return {}
        self._reported = len(self._votes)
        passed, participants = self._votes[-1]
        return {"synced": True, "committed": passed, "participants": participants}

    def evaluate(self, model: nn.Module, loaders: Loaders) -> float:
        if self.name != "torchft_ddp":  # (over the replicas there at the end: some may have left)
            average(model, self.sum, lambda: self.manager.num_participants())  # (a group's processes agree)
            return top1(model, loaders.val, self.sum_all)
        # DDP's replicas agree; some may have left: the BN statistics of those still here, the whole set on each.
        average(model, self.sum, self.manager.num_participants(), buffers_only=True)
        loaders.build(1, 0, train=False)
        return top1(model, loaders.val, lambda counts: None)

    def sum(self, tensor: torch.Tensor) -> None:
        from torch.distributed import ReduceOp

        self.manager.start_quorum()
        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        self.manager.should_commit()

    def sum_all(self, tensor: torch.Tensor) -> None:
        """Over every process: the groups' (the same local rank of each), then the group's own."""
        self.sum(tensor)
        if self.group_size > 1:
            dist.all_reduce(tensor)

    def close(self) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        if self.group_size > 1:
            dist.destroy_process_group()


def group_size() -> int:
    """Processes in this torchft replica group (torchrun's on this node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


# ---- the loop ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def average(
    model: nn.Module,
    total: Callable[[torch.Tensor], None],
    replicas: int | Callable[[], int],
    buffers_only: bool = False,
) -> None:
    """The replicas' average, parameters and BN statistics, in place (``total`` sums a tensor over them; ``replicas``
    is how many, or gives it once the sum is done)."""
    tensors = [] if buffers_only else [p.data for p in model.parameters()]
    tensors += [b for b in model.buffers() if b.is_floating_point()]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    total(flat)
    flat.div_(replicas if isinstance(replicas, int) else replicas())
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


@torch.no_grad()
def top1(model: nn.Module, loader: Any, total: Callable[[torch.Tensor], None]) -> float:
    """Top-1 over the whole validation set, each replica on its shard, as our evaluation."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64)
    for x, y in loader:
        counts += torch.tensor([float(model(x).argmax(1).eq(y).sum()), len(y)], dtype=torch.float64)
    total(counts)
    hits, count = counts.tolist()
    return 100.0 * hits / count


def main(argv: list[str]) -> int:
    name, run_dir, overrides = argv[0], argv[1], argv[2:]
    if name not in PEERS:
        raise SystemExit(f"bench.peers.worker: peer {name!r}: one of {', '.join(PEERS)}")
    cfg = config(overrides)
    t = cfg["trainer"]
    torch.set_num_threads(t["threads"])
    if name in TORCH_PEERS:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=t["timeout_s"]))
        replica, replicas = dist.get_rank(), dist.get_world_size()
    else:  # (a process of its group: the data shard of its place among every group's processes)
        size = group_size()
        if size > 1:  # (the group's own process group, for DDP inside it)
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=t["timeout_s"]))
        replica = int(os.environ["PEER_REPLICA"]) * size + int(os.environ.get("LOCAL_RANK", 0))
        replicas = int(os.environ["PEER_REPLICAS"]) * size
    torch.manual_seed(t["seed"])  # as our trainer: the same initial model on every replica
    data = build_data(cfg["data"])
    batch = cfg["data"]["batch_size"]
    model, optimizer, _, schedule, _, max_steps = build_replica(cfg, data, torch.device("cpu"), replicas)
    peer = (TorchPeer if name in TORCH_PEERS else TorchftPeer)(name, model, optimizer, cfg["sync"])
    loaders = Loaders(data, batch, cfg["data"]["num_workers"], t["seed"])
    loaders.build(replicas, replica)
    criterion, straggler = nn.CrossEntropyLoss(), instantiate(cfg["straggler"])  # (a sleep: device time, as ours)
    writer = MetricsWriter(os.path.join(run_dir, "metrics.jsonl")) if replica == 0 else None
    netdev = NetdevCounter(t["netdev"]) if t.get("netdev") else None
    step, epoch, started = 0, 0, time.perf_counter()
    spe = loaders.steps_per_epoch
    while peer.position(step) < max_steps and epoch < t["epochs"]:
        epoch += 1
        torch.manual_seed(t["seed"] * 100_003 + epoch * 1_009 + replica)  # as our trainer, per epoch and rank
        loaders.start_epoch(epoch)
        peer.module.train()
        tick = time.perf_counter()
        for i, (x, y) in enumerate(loaders.train):
            if i >= spe or peer.position(step) >= max_steps:
                break
            slept = straggler.delay(epoch, replica, replicas)  # (where our trainer sleeps: before the forward)
            peer.optimizer.zero_grad(set_to_none=True)  # (torchft's DDP: the quorum, and a heal, happen here)
            loss = criterion(peer.module(x), y)
            loss.backward()
            compute_s = time.perf_counter() - tick
            straggler.observe(compute_s - slept)
            at = peer.position(step)  # the LR of the run's position, in our trainer's expression of it
            lr = schedule.apply(optimizer, at // spe + (at % spe) / spe)
            peer.optimizer.step()
            now = time.perf_counter()
            if writer is not None:
                record = {"kind": "train", "step": step, "epoch": epoch, "loss": loss.item(), "lr": lr,
                          "world_size": replicas, "samples_per_s": batch * replicas / (now - tick),
                          "compute_s": compute_s, "step_s": now - tick, "time": time.time()}  # fmt: skip
                record.update(peer.report(at))
                if netdev is not None:
                    record["wire_bytes"] = netdev.delta()
                writer.write(record)
            step, tick = step + 1, time.perf_counter()
    train_s = time.perf_counter() - started
    accuracy = peer.evaluate(model, loaders)
    if writer is not None:
        writer.write({"kind": "summary", "top1": accuracy, "steps": step, "train_s": train_s})
        writer.close()
    peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
