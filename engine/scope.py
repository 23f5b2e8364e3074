"""``sync.scope``: whether a sync option's members are processes or nodes.

At ``process`` scope every process is a member of the algorithm, as it was written. At ``node`` scope
(:class:`NodeScope`, around the option) the processes of a node agree on their gradients every step over the
node's fast link, so that they hold one replica between them and step alike, and the option runs among the nodes
(``distributed/nodes.py``): one replica, one set of residuals, one gossip peer per node, and the bytes each node
sends on the slow link are those of one process per node, however many processes it has. L processes of batch b
per node are then the same algorithm as one process of batch L·b per node.

What "per node" means for each option: allreduce wraps DDP over the node's processes, and its comm hook averages
each bucket across nodes, each process its chunk, while the backward pass goes on; PowerSGD compresses the node's
gradient, each bucket by one of the node's processes in turn (its factors go whole), with one error feedback per
bucket; local SGD and DiLoCo (streaming included) average one replica per node,
each process carrying the 1/L chunk of the average that matches its local index; DGC takes the top-k of the
node's gradient, with one set of residuals per node (held alike by its processes), and gathers the node's sparse
values across nodes in L chunks; SGP and Crossover gossip between nodes, a message crossing in L chunks; adaptive
local SGD measures the node's loss; relaxed sync times a node by its slowest process (the node waits for it every
step) and evicts the whole node, keeping CAC's meaning: it evicts the slow unit of data parallelism, which is now
a node. ``auto`` (the default) is ``node`` where the run has more than one node and more than one process on each;
``process`` otherwise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from algorithms.base import StepResult, SyncAlgorithm, SyncContext, SyncReport, Wrapper
from distributed.membership import Change, Membership
from distributed.nodes import NodeCommunicator, NodeView, layout
from errors import ConfigError

SCOPES = ("auto", "node", "process")


class NodeScope(Wrapper):
    """An option run among nodes (the module docstring); every hook, flag and state is the option's own."""

    def __init__(self, inner: SyncAlgorithm):
        super().__init__(inner)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: SyncContext) -> None:
        self.ctx, self.model, self.optimizer = ctx, model, optimizer
        ctx.membership.whole_nodes = True
        self.view = NodeView(ctx.membership)
        self.comm = NodeCommunicator(ctx.comm, self.view)
        self.comm.levels()
        # (no guests: a process that joins takes its model by transfer)
        node_ctx = SyncContext(self.comm, self.view, ctx.device, ctx.replicas_agree)  # type: ignore[arg-type]
        self.inner.setup(model, optimizer, node_ctx)
        self._own: dict[str, Any] | None = None  # this process's own state as loaded, until the node agrees on one
        self._settled = False

    @property
    def in_backward(self) -> bool:
        """DDP, over the node's processes, averages the gradients in backward, and its comm hook across nodes
        (asked at each step: an option that changes its module, ``sync=auto``, may start or stop using DDP)."""
        return isinstance(self.inner.module, DistributedDataParallel)

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        self._own = state  # (taken at the first hook: _settle)

    def local_state_dict(self) -> dict[str, Any]:
        return self._own if self._own is not None else self.inner.local_state_dict()  # (before _settle: as loaded)

    def _settle(self) -> None:
        """Once after setup, at the first hook (every process of the node is there): the node's processes take one
        own state, the first of theirs that loaded one. The same where the checkpoint was written at node scope
        (they saved the same); where it was not (another scope, or another grouping of ranks into nodes), one
        process's residuals or momenta become the node's, so that the node is one replica from its first step."""
        if self._settled:
            return
        self._settled = True
        had = torch.tensor([int(self._own is not None)], dtype=torch.int32, device=self.comm.device)
        had = self.comm.gather_in_node(had).cpu()
        first = next((i for i, flag in enumerate(had.reshape(-1).tolist()) if flag), None)
        if first is None:
            return
        shared = [self._own if self.view.local_index == first else None]
        if self.view.local_size > 1:
            owner = self.view.membership.node_ranks()[first]
            dist.broadcast_object_list(shared, src=owner, group=self.comm.node_group, device=self.comm.device)
        self.inner.load_local_state_dict(shared[0])
        self._own = None

    def on_epoch_start(self, epoch: int) -> SyncReport:
        self._settle()
        return self.inner.on_epoch_start(epoch)

    def before_step(self, step: int) -> SyncReport:
        self._settle()
        return self.inner.before_step(step)

    def after_backward(self, step: int, grads_finite: bool) -> SyncReport:
        if self.in_backward:  # (DDP over the node's processes averaged them there, and across nodes by its hook)
            report = self.inner.after_backward(step, grads_finite)
            self.comm.gather_buckets()
            return report
        return self.inner.after_backward(step, self.comm.average_gradients(self.model, grads_finite))

    def after_optimizer_step(self, result: StepResult) -> SyncReport:
        """The option sees the node's step: its loss (the mean of its processes', that of the node's whole batch)
        and times (the slowest process's: the node waits for it every step)."""
        if self.view.local_size > 1:
            own = [result.loss, result.data_s, result.compute_s]
            own = torch.tensor(own, dtype=torch.float64, device=self.comm.device)
            every = self.comm.gather_in_node(own).cpu()
            loss, data_s, compute_s = every[:, 0].mean().item(), every[:, 1].max().item(), every[:, 2].max().item()
            result = replace(result, loss=loss, data_s=data_s, compute_s=compute_s)
        return self.inner.after_optimizer_step(result)

    def on_membership_change(self, change: Change) -> SyncReport:
        self.comm.levels()
        return self.inner.on_membership_change(self.view.in_nodes(change))

    def agreement_at(self, steps: int) -> int:
        return steps  # (a joiner takes its model by transfer at node scope: no averaging to align an admission to)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()  # (the option's own: a checkpoint reads the same at either scope)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def resolve_scope(scope: str, membership: Membership) -> str:
    """``node`` or ``process`` for this run (``scope``: ``sync.scope``)."""
    shape = layout(membership)
    if scope == "process":
        return "process"
    if scope == "auto":
        return "node" if shape is not None and shape[0] > 1 and shape[1] > 1 else "process"
    if shape is None:
        sizes = {membership.nodes[n]: len(membership.node_ranks(n)) for n in membership.node_ids()}
        raise ConfigError("sync.scope", scope, f"process: the nodes run unequal numbers of processes ({sizes})")
    return "node"


def validate_scope(section: dict[str, Any]) -> None:
    scope = section.get("scope", "auto")
    if scope not in SCOPES:
        raise ConfigError("sync.scope", scope, " | ".join(SCOPES))
    if scope == "node" and section.get("measure") == "link":
        raise ConfigError("sync.scope", scope, "process or auto under sync.measure=link (it probes processes' links)")
    if scope == "node" and _probes_processes(section):
        raise ConfigError("sync.scope", scope, "process or auto under sync=auto (it probes processes' links)")


def _probes_processes(section: dict[str, Any]) -> bool:
    """Whether the option ``section`` times the links between processes (relaxed sync's link measure, sync=auto's
    probe): it runs at process scope."""
    return section.get("measure") == "link" or str(section.get("_target_", "")).endswith(".AutoSync")


def build_sync(section: dict[str, Any], membership: Membership) -> SyncAlgorithm:
    """The sync option ``section`` configures (``sync``), at the scope ``sync.scope`` resolves to for this run."""
    from hydra.utils import instantiate

    section = dict(section)
    scope = section.pop("scope", "auto")
    if scope == "auto" and _probes_processes(section):
        scope = "process"
    algorithm = instantiate(section)
    return NodeScope(algorithm) if resolve_scope(scope, membership) == "node" else algorithm
