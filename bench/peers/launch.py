"""How a peer's run is started: the worker's command line, the lighthouse's, and a run on this machine alone (no
emulated network: what the tests and a user without root can run)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT
from bench.peers.worker import TORCH_PEERS

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LIGHTHOUSE = str(Path(sys.executable).with_name("torchft_lighthouse"))


def worker(peer: str, run_dir: Path, overrides: list[str]) -> list[str]:
    """What each node's torchrun runs (after its own arguments)."""
    return ["-m", "bench.peers.worker", peer, str(run_dir), *overrides]


def lighthouse(replicas: int, bind: str) -> list[str]:
    """A torchft lighthouse that forms a quorum once ``replicas`` replica groups have joined."""
    return [LIGHTHOUSE, "--min_replicas", str(replicas), "--bind", bind]


def torchft_env(replica: int, replicas: int, lighthouse_at: str, host: str) -> dict[str, str]:
    """What a torchft replica group's process reads: which replica it is, where the lighthouse is, and the address
    the others reach it at."""
    return {"TORCHFT_LIGHTHOUSE": f"http://{lighthouse_at}", "PEER_REPLICA": str(replica),
            "PEER_REPLICAS": str(replicas), "PEER_HOST": host}  # fmt: skip


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on the loopback now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_here(
    peer: str, overrides: list[str], run_dir: Path, replicas: int, timeout_s: float = 300, procs: int = 1
) -> None:
    """The peer with ``replicas`` nodes of ``procs`` processes on this machine (loopback); raises with the logs'
    tails if one fails."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command, running, logs = worker(peer, run_dir, overrides), [], []
    if peer in TORCH_PEERS and procs == 1:
        launches, helper = [([TORCHRUN, "--standalone", "--nproc-per-node", str(replicas), *command], env)], None
    elif peer in TORCH_PEERS:  # (one torchrun a node, the first hosting the rendezvous, as on a cluster)
        (port,), helper = free_ports(1), None
        launches = [
            ([TORCHRUN, "--nnodes", str(replicas), "--nproc-per-node", str(procs), "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "peer", "--rdzv-conf", f"is_host={int(i == 0)}",
              *command], env)
            for i in range(replicas)
        ]  # fmt: skip
    else:
        port, *rendezvous = free_ports(1 + replicas)
        bind = f"127.0.0.1:{port}"
        with open(run_dir / "lighthouse.log", "w") as log:
            helper = subprocess.Popen(lighthouse(replicas, bind), stdout=log, stderr=subprocess.STDOUT)
        launches = [
            ([TORCHRUN, "--nnodes", "1", "--nproc-per-node", str(procs), "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{rendezvous[i]}", "--rdzv-id", f"replica{i}", *command],
             {**env, **torchft_env(i, replicas, bind, "127.0.0.1")})
            for i in range(replicas)
        ]  # fmt: skip
    try:
        for i, (cmd, launch_env) in enumerate(launches):
            logs.append(run_dir / f"node{i}.log")
            with open(logs[-1], "w") as log:
                running.append(subprocess.Popen(cmd, cwd=ROOT, env=launch_env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in running]
    finally:
        for p in [*running, *([helper] if helper else [])]:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        tails = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-30:]) for p in logs)
        raise RuntimeError(f"peer {peer}: exit codes {codes}\n{tails}")
