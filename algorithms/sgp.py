"""Stochastic Gradient Push: gossip with one peer per step over a time-varying directed graph.

Stochastic Gradient Push for Distributed Deep Learning (Assran, Loizou, Ballas, Rabbat; ICML 2019;
arXiv 1811.10792). After each local optimizer step every rank pushes a share of its parameters to
``peers_per_itr`` out-peers of a time-varying directed exponential graph (peer = rank + 2^i mod N, i rotating)
and mixes in what it receives. Push-sum keeps a weight beside the parameters: the parameters travel multiplied
by it (the "numerator") and the model used for computing is numerator / weight, which stays an unbiased
average even when the mixing is not doubly stochastic. One peer per step costs S bytes per rank whatever N,
against ~2S for ring allreduce. ``push_sum=false`` is D-PSGD (uniform mixing, no weight).

``overlap=true`` is the paper's overlap mode (1-OSGP for ``synch_freq=1``): the round started after step t runs
in the background while the next steps compute and is mixed in after step t + ``synch_freq`` (the rank waits
then if it has not arrived), so up to ``synch_freq`` rounds are in flight. At the start of a round a rank keeps
its own share of the push-sum weight (the model it computes with, numerator / weight, is unchanged); when the
round lands it adds the received numerators to its *current* numerator (weight x current model) and the
received weights to its weight. Numerators and weights only move between ranks, so the weights still sum to N
and, with no gradient steps, the replicas still reach the exact average. When a round is mixed in depends on
the step only, never on timing, so every rank and a resumed run do the same.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from algorithms.base import SyncContext, SyncReport
from algorithms.gossip import Gossip
from distributed.comm import Pending
from distributed.membership import Change
from distributed.topology import build_topology
from errors import is_int, require

GRAPHS = ("exponential", "ring")


@dataclass
class Round:
    """A gossip round in flight."""

    due: int  # the step after which it is mixed in
    pending: Pending  # its exchange (the result: the received messages)
    message: torch.Tensor  # what this rank sent to each out-peer (kept alive until the send is done)
    copies: int  # how many out-peers it was sent to


class SGP(Gossip):
    """``sync=sgp``: push-sum gossip with ``peers_per_itr`` peers every ``period`` steps."""

    name = "sgp"

    def __init__(
        self,
        peers_per_itr: int = 1,
        graph: str = "exponential",
        push_sum: bool = True,
        period: int = 1,
        consensus_every: int = 10,
        overlap: bool = False,
        synch_freq: int = 1,
    ):
        super().__init__(period, consensus_every)
        self.peers_per_itr, self.graph, self.push_sum = peers_per_itr, graph, push_sum
        self.overlap, self.synch_freq = overlap, synch_freq
        self.weight = 1.0  # push-sum weight; the weights of all ranks sum to N
        self._in_flight: deque[Round] = deque()

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        super().validate(section, cfg, world_size)
        graph = section["graph"]
        require(graph in GRAPHS, "sync.graph", graph, f"one of {', '.join(GRAPHS)}")
        p = section["peers_per_itr"]
        require(
            is_int(p) and 1 <= p < world_size,
            "sync.peers_per_itr",
            p,
            f"an integer in [1, {world_size - 1}] (fewer than the world size)",
        )
        require(graph != "ring" or p == 1, "sync.peers_per_itr", p, "1 with sync.graph=ring")
        f = section["synch_freq"]
        require(is_int(f) and f >= 1, "sync.synch_freq", f, "an integer >= 1 (steps a round may run in the background)")
        require(
            not section["overlap"] or section["push_sum"],
            "sync.overlap",
            True,
            "false with sync.push_sum=false (mixing a late round keeps the mean only with push-sum weights)",
        )

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: SyncContext) -> None:
        super().setup(model, optimizer, ctx)
        self.topology = build_topology(self.graph, ctx.membership.size, self.peers_per_itr)

    def on_membership_change(self, change: Change) -> SyncReport:
        self.topology = build_topology(self.graph, self.ctx.membership.size, self.peers_per_itr)
        return super().on_membership_change(change)

    def _message(self, step: int) -> tuple[torch.Tensor, list[int], list[int]]:
        """This round's message (a share of the numerator, and of the weight with push-sum), out- and in-peers."""
        m = self.ctx.membership
        round_ = step // self.period
        outs = self.topology.out_peers(m.index, round_)
        ins = self.topology.in_peers(m.index, round_)
        share = 1.0 / (len(outs) + 1)
        numerator = self.flat_parameters().mul_(self.weight * share)  # the de-biased model times its weight
        parts = [numerator]
        if self.push_sum:
            parts.append(torch.tensor([self.weight * share], device=numerator.device))
        return torch.cat(parts), [m.ranks[o] for o in outs], [m.ranks[i] for i in ins]

    def gossip(self, step: int) -> dict[str, Any]:
        if self.overlap:
            return self._gossip_overlapped(step)
        if self.ctx.membership.size == 1:  # (alone after losses: no peer, the model is its own average)
            return {"push_sum_weight": self.weight}
        message, outs, ins = self._message(step)
        received = [torch.empty_like(message) for _ in ins]
        self.ctx.comm.exchange([(message, o) for o in outs], list(zip(received, ins)))
        mixed = message.clone()
        for buf in received:
            mixed.add_(buf)
        if self.push_sum:
            self.weight = float(mixed[-1])
            mixed = mixed[:-1]
        self.set_flat_parameters(mixed.div_(self.weight))
        return {"push_sum_weight": self.weight, "gossip_peer": outs[0]}

    def _gossip_overlapped(self, step: int) -> dict[str, Any]:
        while self._in_flight and self._in_flight[0].due <= step:
            self._mix(self._in_flight[0])  # (left in flight if its exchange fails: dropped after the regroup)
            self._in_flight.popleft()
        if self.ctx.membership.size == 1:  # (alone after losses: nothing to send, rounds issued before still land)
            return {"push_sum_weight": self.weight, "rounds_in_flight": len(self._in_flight)}
        message, outs, ins = self._message(step)
        self.weight *= 1.0 / (len(outs) + 1)  # the share this rank keeps; its model is unchanged
        received = [torch.empty_like(message) for _ in ins]
        pending = self.ctx.comm.exchange_async([(message, o) for o in outs], list(zip(received, ins)))
        self._in_flight.append(Round(step + self.synch_freq, pending, message, len(outs)))
        return {"push_sum_weight": self.weight, "gossip_peer": outs[0], "rounds_in_flight": len(self._in_flight)}

    def _mix(self, round_: Round) -> None:
        """Add a landed round's numerators and weights to this rank's current ones. A dropped round (issued before
        the ranks changed) was never received: the shares this rank sent come back to it, so the survivors' mass
        is what it was."""
        received = round_.pending.wait()
        landed = received if received is not None else [round_.message] * round_.copies
        numerator = self.flat_parameters().mul_(self.weight)
        for buf in landed:
            numerator.add_(buf[:-1])
            self.weight += float(buf[-1])
        self.set_flat_parameters(numerator.div_(self.weight))

    def drain(self) -> None:
        while self._in_flight:
            self._mix(self._in_flight[0])
            self._in_flight.popleft()

    def before_eval(self) -> None:
        super().before_eval()
        self.weight = 1.0  # the replicas now hold the average itself

    def local_state_dict(self) -> dict[str, Any]:
        return {**super().local_state_dict(), "weight": self.weight}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        super().load_local_state_dict(state)
        self.weight = state["weight"]
