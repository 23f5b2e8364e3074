"""The default process group and the device of a worker process."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def select_device(name: str, local_rank: int) -> torch.device:
    """``cuda`` (this process's GPU), ``cpu``, or ``auto``: CUDA when there is a GPU."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(backend: str, timeout_s: float) -> None:
    """The default process group. A world restarted by the elastic agent meets in a fresh part of the agent's
    store: the first attempt's keys are still there, and gloo would try to reach a previous rank's address."""
    timeout = datetime.timedelta(seconds=timeout_s)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"relaxsync/restart{restart}", agent_store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )
