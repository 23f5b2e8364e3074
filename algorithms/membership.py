"""The active process group.

Every collective of the trainer and of the sync algorithms runs on ``Membership.group``, never on the world
group directly, so an algorithm that evicts ranks (relaxed sync) changes one object and everything else
(samplers, metric reductions, the checkpoint writer, the logging rank) follows.
"""

from __future__ import annotations

import torch.distributed as dist


class Membership:
    """The set of active global ranks and their process group."""

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None = None):
        self.rank = rank
        self.initial_size = world_size
        self.ranks: list[int] = list(range(world_size))
        self.group = group if group is not None else dist.group.WORLD

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> int:
        """This rank's position among the active ranks (its rank inside ``group``)."""
        return self.ranks.index(self.rank)

    @property
    def active(self) -> bool:
        return self.rank in self.ranks

    @property
    def logging_rank(self) -> int:
        """The lowest active rank writes logs, metrics and checkpoints."""
        return min(self.ranks)

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == self.logging_rank

    def replace(self, ranks: list[int], group: dist.ProcessGroup | None) -> None:
        """Switch to a new set of active ranks (``group`` is None on ranks that left)."""
        self.ranks = sorted(ranks)
        self.group = group

    def __repr__(self) -> str:
        return f"Membership(rank={self.rank}, ranks={self.ranks}, initial_size={self.initial_size})"
