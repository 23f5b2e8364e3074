"""No synchronization: the compute-only floor.

Every rank trains its own replica on its own shard and sends nothing while it trains, so a step costs what
computing it costs and nothing else. It is the reference every benchmark reports against (a ``x floor``
column): no exchange can make a step faster than this. Evaluation and checkpoints see the average of the
replicas (one allreduce, outside the training steps), and the replicas' own accuracy beside it, as for gossip;
the average is where training then continues from, so with ``eval_every`` epochs between evaluations it is
local SGD with a period of an epoch or more.
"""

from __future__ import annotations

from algorithms.replicas import Replicas


class NoSync(Replicas):
    """``sync=none``."""

    name = "none"
