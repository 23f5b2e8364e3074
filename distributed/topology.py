"""Peer schedules: who sends to whom at each gossip step (and, for Crossover-SGD, for each segment), and the
round-robin pairing of link probes.

Ranks here are positions ``0..n-1`` among the active ranks; the caller maps them to global ranks. Every
schedule is a function of (step, segment) alone, so all ranks compute the same graph without talking.
"""

from __future__ import annotations

import torch


class Topology:
    """A directed graph per (step, segment): ``out_peers`` and ``in_peers`` of each position."""

    def __init__(self, n: int):
        self.n = n

    def out_peers(self, position: int, step: int, segment: int = 0) -> list[int]:
        raise NotImplementedError

    def in_peers(self, position: int, step: int, segment: int = 0) -> list[int]:
        raise NotImplementedError

    def mapping(self, step: int, segment: int = 0) -> list[int]:
        """The first out-peer of every position (for logging who sends to whom)."""
        return [self.out_peers(p, step, segment)[0] for p in range(self.n)]


class ExponentialGraph(Topology):
    """SGP's time-varying directed exponential graph: at step t position r sends to r + 2^i mod n, with
    i = t mod (floor(log2(n - 1)) + 1) rotating; ``peers_per_itr`` consecutive exponents per step."""

    def __init__(self, n: int, peers_per_itr: int = 1):
        super().__init__(n)
        self.peers_per_itr = peers_per_itr
        self.offsets = [2**i for i in range((n - 1).bit_length())] if n > 1 else []

    def _offsets(self, step: int) -> list[int]:
        count = len(self.offsets)
        if count == 0:  # (a member alone, after losses: no peer to gossip with)
            return []
        return [self.offsets[(step * self.peers_per_itr + j) % count] for j in range(self.peers_per_itr)]

    def out_peers(self, position, step, segment=0):
        return [(position + o) % self.n for o in self._offsets(step)]

    def in_peers(self, position, step, segment=0):
        return [(position - o) % self.n for o in self._offsets(step)]


class Ring(Topology):
    """Position r sends to r + 1 and receives from r - 1, every step."""

    def out_peers(self, position, step, segment=0):
        return [(position + 1) % self.n] if self.n > 1 else []

    def in_peers(self, position, step, segment=0):
        return [(position - 1) % self.n] if self.n > 1 else []


class LoadBalancedRandom(Topology):
    """Crossover-SGD's load-balanced random topology: for each (step, segment) a random permutation without
    fixed points drawn from a shared seed, so every position sends exactly one and receives exactly one copy
    of each segment, never to itself."""

    def __init__(self, n: int, seed: int = 0):
        super().__init__(n)
        self.seed = seed
        self._cache: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def permutation(self, step: int, segment: int) -> tuple[list[int], list[int]]:
        if self.n < 2:
            raise ValueError(f"a permutation without fixed points of {self.n} position(s) does not exist")
        key = (step, segment)
        if key not in self._cache:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 10_007 + segment)
            while True:  # rejection sampling of a derangement (accepted with probability ~1/e)
                perm = torch.randperm(self.n, generator=g).tolist()
                if all(perm[i] != i for i in range(self.n)):
                    break
            inverse = [0] * self.n
            for src, dst in enumerate(perm):
                inverse[dst] = src
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = (perm, inverse)
        return self._cache[key]

    def out_peers(self, position, step, segment=0):
        return [self.permutation(step, segment)[0][position]]

    def in_peers(self, position, step, segment=0):
        return [self.permutation(step, segment)[1][position]]


def build_topology(name: str, n: int, peers_per_itr: int = 1, seed: int = 0) -> Topology:
    if name == "exponential":
        return ExponentialGraph(n, peers_per_itr)
    if name == "ring":
        return Ring(n)
    if name == "load_balanced":
        return LoadBalancedRandom(n, seed)
    raise ValueError(f"unknown topology {name!r}: expected exponential, ring or load_balanced")


def round_robin(ranks: list[int]) -> list[list[tuple[int, int]]]:
    """Rounds in which every pair of ``ranks`` meets exactly once and no rank is in two pairs of a round (the
    circle method: one rank fixed, the others rotating; with an odd count, one rank sits each round out)."""
    order: list[int | None] = list(ranks) + ([None] if len(ranks) % 2 else [])
    n = len(order)
    rounds = []
    for _ in range(n - 1):
        pairs = [(order[i], order[n - 1 - i]) for i in range(n // 2)]
        rounds.append([(a, b) for a, b in pairs if a is not None and b is not None])
        order = [order[0], order[-1], *order[1:-1]]
    return rounds
