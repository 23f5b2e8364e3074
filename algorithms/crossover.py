"""Crossover-SGD: gossip each segment of the model with a different peer, on a load-balanced random topology.

Crossover-SGD: A gossip-based communication in distributed deep learning for alleviating large mini-batch
problem and enhancing scalability (Yeo, Bae, Jeong, Kim, Lee; arXiv 2012.15198). Plain gossip spreads model
updates slowly because each step mixes a whole replica with a single peer. Crossover-SGD splits the model
into segments (``coarse``: stem, each ResNet stage, head; ``fine``: stem, every residual block, head; or N
equal chunks of the flat parameters, for any model) and mixes each segment with a different peer: for every
(round, segment) all ranks draw the same random permutation without fixed points from a shared seed, so
every rank sends exactly one and receives exactly one copy of each segment and sets
``p = 1/2 (own + received)``. Bytes per rank per round: S, whatever N. Hierarchical mode (``group_size`` > 1)
averages inside groups of consecutive ranks, gossips among the group leaders, and broadcasts back, which caps
the number of gossiping workers. ``sync_grad`` gossips gradients (before the optimizer step) instead of
parameters; ``load_balanced=false`` sends every segment to the same exponential-graph peer (the paper's
ablation).

``overlap=true`` (flat only) runs each round in the background, as SGP's overlap mode: the segments sent after
step t are a snapshot, and after step t + ``synch_freq`` each segment becomes ``p + 1/2 (received - snapshot)``:
the crossover average of the snapshots plus this rank's own progress since. Each rank receives exactly one
copy of each segment from a permutation, so the mean over ranks is unchanged, as without overlap.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import nn

from algorithms.base import SyncContext, SyncReport
from algorithms.gossip import Gossip
from algorithms.replicas import segment_ranges
from distributed.comm import Pending
from distributed.membership import Change
from distributed.topology import ExponentialGraph, LoadBalancedRandom
from errors import ConfigError, is_int, require
from models.factory import create_model


class Crossover(Gossip):
    """``sync=crossover``."""

    name = "crossover"

    def __init__(
        self,
        segments: str | int = "coarse",
        load_balanced: bool = True,
        group_size: int = 1,
        period: int = 1,
        sync_grad: bool = False,
        consensus_every: int = 10,
        seed: int = 0,
        overlap: bool = False,
        synch_freq: int = 1,
    ):
        super().__init__(period, consensus_every)
        self.segments, self.load_balanced, self.group_size = segments, load_balanced, group_size
        self.sync_grad, self.seed = sync_grad, seed
        self.overlap, self.synch_freq = overlap, synch_freq
        # rounds in flight: (the step after which it is mixed in, its exchange, the snapshot sent)
        self._in_flight: deque[tuple[int, Pending, torch.Tensor]] = deque()

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        super().validate(section, cfg, world_size)
        g = section["group_size"]
        require(
            is_int(g) and g >= 1 and world_size % g == 0 and world_size // g >= 2,
            "sync.group_size",
            g,
            f"a divisor of the world size {world_size} leaving >= 2 groups (1 = flat)",
        )
        f = section["synch_freq"]
        require(is_int(f) and f >= 1, "sync.synch_freq", f, "an integer >= 1 (steps a round may run in the background)")
        if section["overlap"]:
            require(g == 1, "sync.group_size", g, "1 with sync.overlap=true (hierarchical rounds do not overlap)")
            require(not section["sync_grad"], "sync.sync_grad", True, "false with sync.overlap=true")
        s = section["segments"]
        model = create_model(cfg["model"]["name"], 10, kwargs=cfg["model"].get("kwargs"))
        numel = sum(p.numel() for p in model.parameters())
        if is_int(s):
            require(1 <= s <= numel, "sync.segments", s, f"coarse, fine, or an integer in [1, {numel}] (parameters)")
        elif s in ("coarse", "fine"):
            try:
                segment_ranges(model, s)
            except ValueError as exc:
                raise ConfigError(
                    "sync.segments", s, f"an integer for {cfg['model']['name']}: coarse/fine need ResNet stages ({exc})"
                ) from exc
        else:
            raise ConfigError("sync.segments", s, "coarse, fine, or a number of equal chunks")

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: SyncContext) -> None:
        super().setup(model, optimizer, ctx)
        self.ranges = segment_ranges(model, self.segments)
        self._build_groups()

    def on_membership_change(self, change: Change) -> SyncReport:
        self._build_groups()
        return super().on_membership_change(change)

    def _build_groups(self) -> None:
        m = self.ctx.membership
        g = self.group_size
        self.groups = [m.ranks[i : i + g] for i in range(0, m.size, g)]
        self.leaders = [group[0] for group in self.groups]
        self.my_group = next(group for group in self.groups if m.rank in group)
        self.subgroup = None
        if g > 1:
            # Only the members create their group: ranks evicted by relaxed sync (sync.inner=crossover) are
            # never waited for.
            self.subgroup = m.subgroup(self.my_group)
        n = len(self.leaders)
        self.topology = LoadBalancedRandom(n, self.seed) if self.load_balanced else ExponentialGraph(n)

    # ---- the round ---------------------------------------------------------------------------------------------
    def gossip(self, step: int) -> dict[str, Any]:
        if self.sync_grad or self.ctx.membership.size == 1:  # (gradients: in after_backward; alone: no peer)
            return {}
        if self.overlap:
            return self._gossip_overlapped(step)
        flat = self.flat_parameters()
        events = self._round(flat, step)
        self.set_flat_parameters(flat)
        return {"events": events}

    def _gossip_overlapped(self, step: int) -> dict[str, Any]:
        while self._in_flight and self._in_flight[0][0] <= step:
            self._mix(*self._in_flight[0][1:])  # (left in flight if its exchange fails: dropped after the regroup)
            self._in_flight.popleft()
        snapshot = self.flat_parameters()
        sends, recvs = self._segments(snapshot, step)
        pending = self.ctx.comm.exchange_async(sends, recvs)
        self._in_flight.append((step + self.synch_freq, pending, snapshot))
        return {"events": self._gossip_event(step), "rounds_in_flight": len(self._in_flight)}

    def _mix(self, pending: Pending, snapshot: torch.Tensor) -> None:
        """Move each segment halfway to the copy received (by what the peer's changed since the snapshot). A
        dropped round (issued before the ranks changed) changes nothing."""
        received = pending.wait()
        if received is None:
            return
        flat = self.flat_parameters()
        for (_, lo, hi), buf in zip(self.ranges, received):
            flat[lo:hi].add_(buf.sub_(snapshot[lo:hi]), alpha=0.5)
        self.set_flat_parameters(flat)

    def drain(self) -> None:
        while self._in_flight:
            self._mix(*self._in_flight[0][1:])
            self._in_flight.popleft()

    def after_backward(self, step: int, grads_finite: bool) -> SyncReport:
        if not self.sync_grad or step % self.period or self.ctx.membership.size == 1:  # (alone: no peer)
            return SyncReport(grads_finite=grads_finite)
        params = [p for p in self.model.parameters()]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        events = self._round(flat, step)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        # Gradients are mixed, not agreed: each rank steps (or skips) on its own verdict.
        return SyncReport(grads_finite=grads_finite and bool(torch.isfinite(flat).all()), events=events)

    def _segments(self, flat: torch.Tensor, step: int) -> tuple[list, list]:
        """This leader's sends (a copy of each segment, to that segment's out-peer) and receive buffers."""
        me, round_ = self.leaders.index(self.ctx.membership.rank), step // self.period
        sends, recvs = [], []
        for s, (_, lo, hi) in enumerate(self.ranges):
            buf = torch.empty(hi - lo, dtype=flat.dtype, device=flat.device)
            recvs.append((buf, self.leaders[self.topology.in_peers(me, round_, s)[0]]))
            sends.append((flat[lo:hi].clone(), self.leaders[self.topology.out_peers(me, round_, s)[0]]))
        return sends, recvs

    def _round(self, flat: torch.Tensor, step: int) -> list[dict[str, Any]]:
        """Mix ``flat`` in place: average in the group, crossover among leaders, broadcast in the group."""
        m, comm = self.ctx.membership, self.ctx.comm
        if self.subgroup is not None:
            comm.all_reduce(flat, group=self.subgroup)
            flat.div_(len(self.my_group))
        if m.rank in self.leaders:
            sends, recvs = self._segments(flat, step)
            comm.exchange(sends, recvs, mean_fraction=len(self.leaders) / m.size)
            for (_, lo, hi), (buf, _) in zip(self.ranges, recvs):
                flat[lo:hi].add_(buf).mul_(0.5)
        if self.subgroup is not None:
            comm.broadcast(flat, src=self.my_group[0], group=self.subgroup)
        return self._gossip_event(step)

    def _gossip_event(self, step: int) -> list[dict[str, Any]]:
        """Every ``consensus_every`` steps: who sent which segment to whom in this round."""
        if step % self.consensus_every:
            return []
        round_ = step // self.period
        mapping = {
            name: {
                str(self.leaders[i]): self.leaders[self.topology.out_peers(i, round_, s)[0]]
                for i in range(len(self.leaders))
            }
            for s, (name, _, _) in enumerate(self.ranges)
        }
        return [{"event": "gossip", "round": round_, "senders_to_receivers": mapping}]
