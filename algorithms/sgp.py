"""Stochastic Gradient Push: gossip with one peer per step over a time-varying directed graph.

Stochastic Gradient Push for Distributed Deep Learning (Assran, Loizou, Ballas, Rabbat; ICML 2019;
arXiv 1811.10792). After each local optimizer step every rank pushes a share of its parameters to
``peers_per_itr`` out-peers of a time-varying directed exponential graph (peer = rank + 2^i mod N, i rotating)
and mixes in what it receives. Push-sum keeps a weight beside the parameters: the parameters travel multiplied
by it (the "numerator") and the model used for computing is numerator / weight, which stays an unbiased
average even when the mixing is not doubly stochastic. One peer per step costs S bytes per rank whatever N,
against ~2S for ring allreduce. ``push_sum=false`` is D-PSGD (uniform mixing, no weight).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from algorithms.base import SyncContext
from algorithms.gossip import Gossip
from algorithms.topology import build_topology
from errors import is_int, require

GRAPHS = ("exponential", "ring")


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
    ):
        super().__init__(period, consensus_every)
        self.peers_per_itr, self.graph, self.push_sum = peers_per_itr, graph, push_sum
        self.weight = 1.0  # push-sum weight; the weights of all ranks sum to N

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

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: SyncContext) -> None:
        super().setup(model, optimizer, ctx)
        self.topology = build_topology(self.graph, ctx.membership.size, self.peers_per_itr)

    def on_membership_change(self) -> None:
        self.topology = build_topology(self.graph, self.ctx.membership.size, self.peers_per_itr)

    def gossip(self, step: int) -> dict[str, Any]:
        m, comm = self.ctx.membership, self.ctx.comm
        round_ = step // self.period
        outs = self.topology.out_peers(m.index, round_)
        ins = self.topology.in_peers(m.index, round_)
        share = 1.0 / (len(outs) + 1)
        numerator = self.flat_parameters().mul_(self.weight)  # the de-biased model times its weight
        parts = [numerator * share]
        if self.push_sum:
            parts.append(torch.tensor([self.weight * share], device=numerator.device))
        message = torch.cat(parts)
        received = [torch.empty_like(message) for _ in ins]
        comm.exchange([(message, m.ranks[o]) for o in outs], [(buf, m.ranks[i]) for buf, i in zip(received, ins)])
        mixed = message.clone()
        for buf in received:
            mixed.add_(buf)
        if self.push_sum:
            self.weight = float(mixed[-1])
            mixed = mixed[:-1]
        self.set_flat_parameters(mixed.div_(self.weight))
        return {"push_sum_weight": self.weight, "gossip_peer": m.ranks[outs[0]]}

    def before_eval(self) -> None:
        super().before_eval()
        self.weight = 1.0  # the replicas now hold the average itself

    def local_state_dict(self) -> dict[str, Any]:
        return {**super().local_state_dict(), "weight": self.weight}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        super().load_local_state_dict(state)
        self.weight = state["weight"]
