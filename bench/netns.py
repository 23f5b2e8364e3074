"""An emulated cluster on one machine: one network namespace per node, bandwidth-shaped links, counted bytes.

Topology: node ``i`` lives in namespace ``<tag>-n<i>`` with one interface, ``eth0``, address ``10.213.0.<i+1>/24``.
Its veth peer sits in a bridge namespace ``<tag>-br`` and is enslaved to the bridge there, so every node reaches
every other through a switch and through its own link only. A link's rate is shaped with ``tc tbf`` on both
ends of its veth pair (the node side shapes what the node sends, the bridge side what it receives), with
burst = max(72 KiB, 1.1 ms x rate): smaller bursts cap throughput well below the rate, and one below a 64 KiB GSO
segment has tbf split it (:data:`MIN_BURST`). Only bandwidth is shaped
(``netem``, and so latency, is not available everywhere). The namespaces hold the only addresses used; nothing
touches the host's own interfaces.

Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN), iproute2's ``ip`` and ``tc``, and util-linux's ``unshare`` (each node
runs under a host name of its own); ``unavailable()`` says what is missing. Namespaces are deleted on exit, on
Ctrl-C and on SIGTERM; a run killed outright leaves its namespaces named with its pid, and the next run deletes
those whose pid is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any

PREFIX = "relaxsync"
ETC_NETNS = "/etc/netns"  # per-namespace files that ``ip netns exec`` mounts over /etc
IFACE = "eth0"
SUBNET = "10.213.0"
# The bucket holds at least one 64 KiB GSO segment and its headers: tbf splits a larger segment into packets, and after
# a rate dropped mid-run (bench/tta's "drop") a connection that last ran fast sends such segments; with a 32 KiB floor
# sync=auto's runs there stalled in 4 of 10, with this one in none of 8.
MIN_BURST = 72 * 1024
BURST_SECONDS = 1.1e-3
QUEUE_SECONDS = 0.05  # tbf's queue: packets may wait this long behind the rate before being dropped
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


class NetworkError(RuntimeError):
    pass


def parse_rate(rate: str | None) -> float | None:
    """``'100mbit'`` -> 1e8 bits/s; ``'unlimited'`` or None -> None."""
    if rate is None or str(rate).lower() in ("unlimited", "none", "inf"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?bit)", str(rate).strip().lower())
    if not match:
        raise ValueError(f"rate {rate!r}: expected a number with a unit (bit, kbit, mbit, gbit), or 'unlimited'")
    return float(match.group(1)) * UNITS[match.group(2)]


def tbf_args(rate_bps: float) -> list[str]:
    """``tc`` arguments of a token bucket at ``rate_bps`` with the burst rule above."""
    rate_bytes = rate_bps / 8
    burst = max(MIN_BURST, int(BURST_SECONDS * rate_bytes))
    limit = burst + int(QUEUE_SECONDS * rate_bytes)
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]


def unavailable() -> str | None:
    """Why this machine cannot emulate a network here, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc); run it with sudo"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2's `{tool}`, which is not on PATH (Debian/Ubuntu: apt install iproute2)"
    if shutil.which("unshare") is None:
        return "needs util-linux's `unshare` (each node's own host name), which is not on PATH"
    probe = f"{PREFIX}-probe{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
    except NetworkError as e:
        return f"cannot create a network namespace here ({e})"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and out.returncode != 0:
        raise NetworkError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.returncode}")
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete namespaces left by runs of this module that were killed outright (their pid is gone)."""
    removed = []
    for name in namespaces():
        match = re.fullmatch(rf"{PREFIX}(\d+)-(?:br|n\d+)", name)
        if match and not _pid_alive(int(match.group(1))):
            _run(["ip", "netns", "del", name], check=False)
            shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
            removed.append(name)
    return removed


class EmulatedNetwork:
    """``with EmulatedNetwork(3) as net:`` three nodes on a switch; ``net.shape([...])`` sets each link's rate.

    ``net.popen(i, cmd)`` starts ``cmd`` inside node ``i``; every process started that way is stopped before
    the namespaces are deleted."""

    def __init__(self, nodes: int):
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes={nodes}: expected 1..250")
        self.nodes = nodes
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge_ns = f"{self.tag}-br"
        self.rates: list[float | None] = [None] * nodes
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._previous_handlers: dict[int, Any] = {}

    # ---- names -----------------------------------------------------------------------------------------
    def ns(self, node: int) -> str:
        return f"{self.tag}-n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program inside ``node``."""
        return ["ip", "netns", "exec", self.ns(node)]

    # ---- lifetime --------------------------------------------------------------------------------------
    def __enter__(self) -> EmulatedNetwork:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._previous_handlers[sig] = signal.signal(sig, _raise_interrupt)
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)

    def create(self) -> None:
        remove_stale()
        self._add_ns(self.bridge_ns)
        _run(["ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.bridge_ns, "link", "set", "br0", "up"])
        _run(["ip", "-n", self.bridge_ns, "link", "set", "lo", "up"])
        for i in range(self.nodes):
            ns = self.ns(i)
            self._add_ns(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(
                ["ip", "-n", self.bridge_ns, "link", "add", f"p{i}", "type", "veth", "peer", "name", IFACE, "netns", ns]
            )
            _run(["ip", "-n", self.bridge_ns, "link", "set", f"p{i}", "master", "br0", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFACE])
            _run(["ip", "-n", ns, "link", "set", IFACE, "up"])
        self._write_hosts()

    def _write_hosts(self) -> None:
        """Every node's host name resolves, inside every node, to its address: ``ip netns exec`` mounts
        ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts`` (what a cluster's DNS does for its nodes; a process
        that advertises its host name, as torchft's checkpoint server does, is then reachable by it)."""
        with open("/etc/hosts") as f:
            base = f.read().rstrip("\n")
        nodes = "\n".join(f"{self.address(i)} {self.hostname(i)}" for i in range(self.nodes))
        for i in range(self.nodes):
            os.makedirs(os.path.join(ETC_NETNS, self.ns(i)), exist_ok=True)
            with open(os.path.join(ETC_NETNS, self.ns(i), "hosts"), "w") as f:
                f.write(f"{base}\n{nodes}\n")

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)

    def destroy(self) -> None:
        self.stop_all()
        for name in reversed(self._created):
            _run(["ip", "netns", "del", name], check=False)
            shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
        self._created = []

    # ---- links -----------------------------------------------------------------------------------------
    def shape(self, rates: Sequence[str | None] | str | None) -> None:
        """Set every node's link rate (one rate for all, or one per node); 'unlimited' removes the shaping."""
        if rates is None or isinstance(rates, str):
            rates = [rates] * self.nodes
        if len(rates) != self.nodes:
            raise ValueError(f"{len(rates)} rates for {self.nodes} nodes")
        for i, rate in enumerate(rates):
            bps = parse_rate(rate)
            for ns, dev in ((self.ns(i), IFACE), (self.bridge_ns, f"p{i}")):
                if bps is None:
                    _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                else:
                    _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(bps)])
            self.rates[i] = bps

    def cut(self, node: int, cut: bool = True) -> None:
        """Cut ``node`` off the switch (its port down on the bridge: nothing it sends arrives, nothing reaches it),
        or (``cut=False``) connect it again. The node and its processes stay up and see their own link up: a
        partition, not a death."""
        _run(["ip", "-n", self.bridge_ns, "link", "set", f"p{node}", "down" if cut else "up"])

    def tx_bytes(self, node: int) -> int:
        """Bytes node ``node`` has sent on its link, read from /sys/class/net/eth0/statistics inside it."""
        out = _run([*self.prefix(node), "cat", f"/sys/class/net/{IFACE}/statistics/tx_bytes"])
        return int(out.stdout)

    # ---- processes -------------------------------------------------------------------------------------
    def hostname(self, node: int) -> str:
        """The host name processes of ``node`` see (each node has a UTS namespace of its own)."""
        return self.ns(node)

    def node_of(self, hostname: str) -> int:
        """The node whose processes report ``hostname``."""
        return next(i for i in range(self.nodes) if self.hostname(i) == hostname)

    def popen(self, node: int, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``cmd`` inside ``node``, under the node's own host name, in a session of its own (so it can be
        stopped with its children)."""
        named = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname(node), *cmd]
        proc = subprocess.Popen([*self.prefix(node), *named], start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process started here (and its children), then SIGKILL what is left after ``grace_s``."""
        live = [p for p in self._procs if p.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self._procs:
            _signal_group(p, signal.SIGKILL)  # the group may outlive its leader
            if p.poll() is None:
                p.wait()
        self._procs = []


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
