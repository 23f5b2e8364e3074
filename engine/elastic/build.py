"""The elastic component a worker holds, chosen once from the trainer's config: its membership
(:func:`worker_membership`) and its face (:func:`build_elastic`)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from distributed.etcd import Tls
from distributed.membership import Membership
from distributed.secret import agree, run_secret
from distributed.world import init_distributed
from engine.elastic.face import Fixed, Surviving
from engine.elastic.guard import training_membership
from engine.elastic.joiner import Joiner, joiner_membership


def worker_membership(t: dict[str, Any], device: Any, rank: int, world_size: int, run_dir: str) -> Membership:
    """A worker's membership (``t``: the trainer section): the active ranks and their group; on a joiner
    (``trainer.join``), the run's store and no ranks yet (rank -1, the run's initial size)."""
    tls = t.get("store_tls") or {}
    if tls.get("ca"):  # (every part of this process that opens the run's store reads it: distributed/etcd.py)
        Tls(tls["ca"], tls["cert"], tls["key"]).to_environ()
    if t["join"]:
        membership = joiner_membership(run_dir, t["hang_timeout_s"], t["timeout_s"])
    else:
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            init_distributed(backend, t["timeout_s"], t["on_failure"] == "continue", t.get("store"))
        membership = training_membership(t["on_failure"], t["hang_timeout_s"], rank, world_size)
    if t["on_failure"] == "continue":  # (the ranks' own connections, which prove it: distributed/presence.py)
        membership.secret = run_secret(run_dir, t.get("secret_file"))
        agree(membership.store, membership.key("secret"), membership.secret, rank)
    return membership


def build_elastic(t: dict[str, Any], membership: Membership, comm: Any, run_dir: str, model: Any) -> Any:
    """:class:`Fixed` under ``trainer.on_failure=abort``; under ``continue``, :class:`Surviving` on a member and
    :class:`Joiner` on a joiner."""
    if t["on_failure"] != "continue":
        return Fixed()
    if t["join"]:
        return Joiner(membership, comm, t["hang_timeout_s"], run_dir, model)
    return Surviving(membership, comm, t["hang_timeout_s"], run_dir)
