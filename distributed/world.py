"""The default process group and the device of a worker process."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from distributed.etcd import STORE_ENV, configured_store


def cuda_index(local_rank: int, local_world_size: int, visible: int, env: os._Environ | dict = os.environ) -> int:
    """Which of the ``visible`` CUDA devices the process of local rank ``local_rank`` (of ``local_world_size`` on its
    node) trains on.

    - One visible device: it is this process's own (Slurm's ``--gpus-per-task 1`` binds each task to its GPU, so every
      task sees one, numbered 0; or ``CUDA_VISIBLE_DEVICES`` set per process).
    - The devices of this task alone (``SLURM_GPUS_PER_TASK`` of them visible): the first.
    - Otherwise the node's devices are shared among its processes (torchrun, ``--gpus-per-node``, the local launcher):
      one each, by local rank; fewer devices than local processes is an error (NCCL refuses two ranks on one GPU).
    """
    where = f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '(unset)')}"
    if visible < 1:
        raise ValueError(f"trainer.device=cuda: no CUDA device is visible to local rank {local_rank} ({where})")
    per_task = env.get("SLURM_GPUS_PER_TASK", "")
    if visible == 1 or (per_task.isdigit() and int(per_task) == visible):
        return 0
    if local_world_size > visible:
        raise ValueError(
            f"trainer.device=cuda: {local_world_size} processes on this node share {visible} visible GPUs ({where}): "
            f"one GPU per process is needed (NCCL refuses two ranks on one GPU). Start at most {visible} processes "
            f"per node, give each task its own GPU (srun --gpus-per-task 1), or use trainer.device=cpu"
        )
    return local_rank


def select_device(name: str, local_rank: int, local_world_size: int = 1) -> torch.device:
    """``cuda`` (this process's GPU, :func:`cuda_index`), ``cpu``, or ``auto``: CUDA when there is a GPU."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        index = cuda_index(local_rank, local_world_size, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def node_name(env: os._Environ | dict = os.environ) -> str:
    """The name of the node this process runs on, the same for every process of that node and distinct between
    nodes, joiners' included: torchrun's node (``GROUP_RANK`` of its run ``TORCHELASTIC_RUN_ID``), else Slurm's
    (``SLURM_NODEID`` of ``SLURM_JOB_ID``), else the host name. ``RELAXSYNC_NODE`` splits one of those further:
    the local launcher sets it per worker under ``trainer.local_nodes`` (emulated nodes on one machine)."""
    if env.get("TORCHELASTIC_RUN_ID") and "GROUP_RANK" in env:
        name = f"{env['TORCHELASTIC_RUN_ID']}/node{env['GROUP_RANK']}"
    elif "SLURM_NODEID" in env:
        name = f"slurm{env.get('SLURM_JOB_ID', '')}/node{env['SLURM_NODEID']}"
    else:
        name = env.get("SLURMD_NODENAME") or socket.gethostname()
    emulated = env.get("RELAXSYNC_NODE")
    return f"{name}/{emulated}" if emulated else name


def configure_device(device: torch.device, cudnn_benchmark: bool) -> None:
    """Backend switches of the training device: on CUDA, ``torch.backends.cudnn.benchmark`` (cuDNN times its
    convolution algorithms for each new input shape once and keeps the fastest, as timm and NVIDIA's ResNet-50 do)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = cudnn_benchmark


# How torch's NCCL watchdog handles a collective that failed or passed its deadline. Modes 1 (tear down) and 3
# (skip clean-up, torch's default) end the process, which would end every survivor of a lost peer; 2 (clean up
# only) aborts the communicator and lets the process live to agree with the others through the store; 0 does
# nothing. torchrun's agent (and the local launcher's) sets 1 for its workers; under trainer.on_failure=continue a
# worker sets 2 over it, before its process group reads it, unless the mode already is one that survives.
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
SURVIVING_NCCL_MODES = ("0", "2")
# On a failed collective the watchdog of the group asks for torch's flight-recorder dump, then sleeps four times
# TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 s by default: 60 s) whether or not a dump was asked for, and only then
# cleans up. The group's destructor waits for its watchdog: on a GPU (torch 2.11) the survivors of a killed node
# stood still 60 s after agreeing, where DDP let the replaced group go (its reducer held the last reference), and
# before that a peer frozen as long was taken for hung. A run that survives failures expects them: it asks for no
# dump and no such wait, unless the user set the variables.
NCCL_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
NCCL_DUMP_WAIT_MS = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"
NCCL_TIMING = "TORCH_NCCL_ENABLE_TIMING"


def nccl_environment(survive_failures: bool, env: os._Environ | dict = os.environ) -> dict[str, str]:
    """What a worker sets in its environment before an NCCL process group."""
    if not survive_failures:
        return {}
    out = {}
    if env.get(NCCL_ERROR_HANDLING) not in SURVIVING_NCCL_MODES:
        out[NCCL_ERROR_HANDLING] = "2"
    if NCCL_DUMP_ON_TIMEOUT not in env:
        out[NCCL_DUMP_ON_TIMEOUT] = "0"
    if NCCL_DUMP_WAIT_MS not in env:
        out[NCCL_DUMP_WAIT_MS] = "0"
    return out


def init_distributed(backend: str, timeout_s: float, survive_failures: bool = False, store: str | None = None) -> None:
    """The default process group (on NCCL, with the environment :func:`nccl_environment` gives). A world restarted
    by the elastic agent meets in a fresh part of the agent's store: the first attempt's keys are still there, and
    gloo would try to reach a previous rank's address. With ``store`` (``trainer.store``, an etcd cluster's URL) the
    group meets there instead, and every later part of the run that opens its store opens that one
    (:func:`distributed.etcd.configured_store`): no process hosts the store, so none takes it with it."""
    if backend == "nccl":
        os.environ.update(nccl_environment(survive_failures))
        # Each collective's start and end events on NCCL's stream: its time on the GPU (distributed/clock.py)
        os.environ.setdefault(NCCL_TIMING, "1")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store:
        os.environ[STORE_ENV] = store
        etcd = configured_store(timeout)
        etcd.begin_run()  # (a rank starting: a run that ended on this root earlier is not this one)
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore("world", etcd),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
        return
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
