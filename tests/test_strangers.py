"""Nothing a run listens on trusts a connection it has not authenticated (distributed/presence.py): a stranger on
the network who writes to a rank's port what a peer writes (alarms, the survivors' decisions), garbage, or a flood
of connections, is refused and counted, and the run goes on as if nothing came; a presence of another run's secret
is refused both ways."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import FAST
from test_presence import SECRET, key, store  # noqa: F401  (the store fixture)

from distributed.presence import HANDSHAKE_S, MAX_HANDSHAKES, Presence
from engine.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def forgeries(generations: int = 40) -> list[bytes]:
    """What a stranger writes: an HTTP request, random bytes, a peer's beats and farewell, alarms and decisions that
    name rank 1 for every generation up to ``generations``."""
    decision = {"ranks": [1], "cause": "died", "noticed": "ended", "step": 0, "time": time.time(), "ahead": {}}
    lines = [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", os.urandom(512), b"." * 64, b"bye"]
    for g in range(generations):
        lines += [b"!%d\n" % g, b"=%d %s\n" % (g, json.dumps(decision).encode())]
    return lines


def write_forgeries(address: tuple[str, int], lines: list[bytes]) -> bool:
    """One stranger's connection: everything in ``lines``, in a stream, as far as the other end takes it; whether it
    got through the connect."""
    try:
        s = socket.create_connection(address, timeout=1.0)
    except OSError:
        return False
    with s, contextlib.suppress(OSError):  # (closed on the stranger midway: what it sent before is what counts)
        s.settimeout(1.0)
        for line in lines:
            s.sendall(line)
        time.sleep(0.05)
    return True


def test_a_strangers_alarms_decisions_and_garbage_are_never_read_and_are_counted(store):  # noqa: F811
    heard: list = []
    rank0 = Presence(0, store.clone(), key, address="127.0.0.1", secret=SECRET, on_alarm=heard.append,
                     on_decision=lambda g, d: heard.append((g, d))).start()  # fmt: skip
    rank1 = Presence(1, store.clone(), key, address="127.0.0.1", secret=SECRET).start()
    other = Presence(2, store.clone(), key, address="127.0.0.1", secret=b"another run's secret").start()
    try:
        rank0.watch([1, 2])
        port = rank0._listener.getsockname()[1]
        for _ in range(3):
            assert write_forgeries(("127.0.0.1", port), forgeries())
        silent = socket.create_connection(("127.0.0.1", port))  # (says nothing: closed at the deadline)
        deadline = time.monotonic() + HANDSHAKE_S + 3
        while rank0.rejected < 4 + 1 or 1 not in rank0._watching:  # (3 strangers, one silent, rank 2 refused)
            assert time.monotonic() < deadline, (rank0.rejected, rank0._watching)
            time.sleep(0.05)
        assert heard == [] and 2 not in rank0._watching and rank0.reported == []
        assert silent.recv(16) == b""  # (closed by rank 0, never answered)
        assert rank0._accepted == [] and len(rank1._accepted) == 1 and rank0._greeting == {}  # (rank 0 dialled 1)
        rank1.alarm(7)  # the peer's own alarm is heard
        deadline = time.monotonic() + 5
        while 7 not in heard:
            assert time.monotonic() < deadline, heard
            time.sleep(0.02)
    finally:
        for p in (rank0, rank1, other):
            p.stop(farewell=True)


def test_a_flood_of_connections_is_bounded_and_the_peer_still_gets_in(store):  # noqa: F811
    rank0 = Presence(0, store.clone(), key, address="127.0.0.1", secret=SECRET).start()
    rank1 = Presence(1, store.clone(), key, address="127.0.0.1", secret=SECRET).start()
    flood = []
    try:
        port = rank0._listener.getsockname()[1]
        for _ in range(3 * MAX_HANDSHAKES):
            flood.append(socket.create_connection(("127.0.0.1", port)))
        time.sleep(0.5)
        assert len(rank0._greeting) <= MAX_HANDSHAKES
        rank1.watch([0])
        deadline = time.monotonic() + HANDSHAKE_S + 5
        while 0 not in rank1._watching:  # (once the flood's handshakes expired, at the latest)
            assert time.monotonic() < deadline, "the peer never got in"
            time.sleep(0.05)
        assert rank0.rejected >= 2 * MAX_HANDSHAKES
    finally:
        for s in flood:
            s.close()
        rank0.stop(farewell=True)
        rank1.stop(farewell=True)


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def listening_ports(pids: set[int]) -> set[int]:
    """The TCP ports the processes ``pids`` listen on (/proc: their sockets' inodes, the kernel's table)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with_target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if with_target.startswith("socket:["):
                    inodes.add(with_target[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # (LISTEN)
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_a_run_attacked_on_every_port_its_ranks_listen_on_finishes_with_every_rank(tmp_path):
    """Three ranks under ``on_failure=continue``; for 10 s a stranger connects to every port their processes listen
    on and writes forged alarms and decisions for every generation, garbage and a flood: the run finishes with all
    three, no rank removed, every step once, and the summary counts the refused connections."""
    steps = 90
    overrides = [*FAST, "trainer.nproc=3", "trainer.on_failure=continue", "trainer.epochs=1",
                 f"trainer.max_steps={steps}", "data.num_samples=3000", "data.batch_size=8", "data.image_size=16",
                 "trainer.checkpoint_every=0", f"trainer.run_dir={tmp_path / 'run'}"]  # fmt: skip
    run = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *overrides], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True,
                           env=dict(os.environ, WANDB_SILENT="true"))  # fmt: skip
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(run.stdout), daemon=True)
    reader.start()
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and any(r["kind"] == "train" for r in read_metrics(str(metrics)))):
            assert run.poll() is None, "".join(output)[-3000:]
            assert time.monotonic() < deadline, "".join(output)[-3000:]
            time.sleep(0.2)
        ports = listening_ports(_descendants(run.pid))
        assert ports, "no port found that the run's processes listen on"
        written, held, end = 0, [], time.monotonic() + 10
        while time.monotonic() < end and run.poll() is None:
            for port in ports:
                written += write_forgeries(("127.0.0.1", port), forgeries())
                if len(held) < 200:  # (the flood: connections opened and left open)
                    try:
                        held.append(socket.create_connection(("127.0.0.1", port), timeout=1.0))
                    except OSError:
                        pass
        for s in held:
            s.close()
        assert written > 0
        assert run.wait(timeout=240) == 0, "".join(output)[-3000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    records = read_metrics(str(metrics))
    summary = [r for r in records if r["kind"] == "summary"][-1]
    assert summary["finished"] and summary["world_size"] == 3 and summary["lost_ranks"] == []
    assert summary["evictions"] == 0
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(steps))  # every step once
    assert summary["rejected_connections"] > 0
    assert not [r for r in records if r.get("event") == "rank_lost"]


def test_ranks_holding_different_secrets_stop_at_once_saying_why(tmp_path):
    from distributed.secret import SecretError, agree, make, run_secret

    server = dist.TCPStore("127.0.0.1", 0, is_master=True)
    first, second = run_secret(str(tmp_path / "a")), run_secret(str(tmp_path / "b"))
    assert first != second and run_secret(str(tmp_path / "a")) == first  # (made once, then read)
    assert oct(os.stat(make(str(tmp_path / "a"))).st_mode & 0o777) == "0o600"
    agree(server, "run/secret", first, 0)
    agree(server, "run/secret", first, 1)
    with pytest.raises(SecretError, match="trainer.secret_file"):
        agree(server, "run/secret", second, 2)
    loose = tmp_path / "loose"
    loose.write_text("x" * 64)
    loose.chmod(0o644)
    with pytest.raises(SecretError, match="chmod 600"):
        run_secret(str(tmp_path), str(loose))


@pytest.mark.parametrize("phase", ["step", "exchange", "evaluation", "checkpoint", "epoch boundary", "settle"])
def test_a_failure_that_finds_every_rank_alive_is_survived_by_a_regroup(tmp_path, monkeypatch, phase):
    """Rank 1 raises, once, what a failed collective raises, with every rank alive (a spurious alarm: before, the
    run ended): the three ranks agree that nobody is gone, regroup, redo the part and finish, every step once, a
    ``regrouped`` event and no rank lost. ``settle``: the replicas' settle before an evaluation completed on every
    rank, and rank 1 alone takes it for failed; the others settled at this step already, and must settle again with
    it (else it settles alone while they are in the evaluation's allreduce, and gloo aborts on the mismatch)."""
    from _workers import spurious_failure
    from conftest import records, train

    monkeypatch.setenv("SPURIOUS_PHASE", phase)
    steps = 12
    # (settle: in the epoch's evaluation, where the others wait in its allreduce; one on the side settles nothing)
    every = "trainer.eval_every_steps=null" if phase == "settle" else "trainer.eval_every_steps=6"
    _, metrics = train(
        tmp_path, *FAST, "trainer.nproc=3", "trainer.on_failure=continue", "trainer.epochs=2", "data.num_samples=144",
        "data.batch_size=8", "data.image_size=16", every, "trainer.checkpoint_every_steps=6",
        entrypoint=spurious_failure,
    )  # fmt: skip
    (summary,) = records(metrics, "summary")
    assert summary["finished"] and summary["world_size"] == 3 and summary["lost_ranks"] == []
    assert summary["replica_spread"] == 0.0  # (identical replicas: no collective was paired with another)
    assert [r["step"] for r in records(metrics, "train")] == list(range(steps))
    regrouped = [r for r in metrics if r.get("event") == "regrouped"]
    assert len(regrouped) == 1 and regrouped[0]["cause"] == "nobody gone" and regrouped[0]["world_size"] == 3
    assert not [r for r in metrics if r.get("event") == "rank_lost"]


def test_a_secret_file_others_may_read_or_that_does_not_exist_is_refused_before_any_worker_starts(tmp_path):
    from conftest import plain_cfg

    from errors import ConfigError

    loose = tmp_path / "loose"
    loose.write_text("x" * 64)
    loose.chmod(0o644)
    for path, why in ((loose, "chmod 600"), (tmp_path / "none", "No such file")):
        with pytest.raises(ConfigError, match=f"trainer.secret_file=.*{why}"):
            plain_cfg("trainer.on_failure=continue", f"trainer.secret_file={path}")
    kept = tmp_path / "kept"
    kept.write_text("y" * 64)
    kept.chmod(0o600)
    assert plain_cfg(f"trainer.secret_file={kept}")["trainer"]["secret_file"] == str(kept)


def test_the_stores_tls_files_are_checked_before_any_worker_starts(tmp_path):
    """``trainer.store='etcds://...'`` needs ``trainer.store_tls`` (the CA, a certificate and its key), each a
    readable file and the key its owner's only; TLS files with a plain ``etcd://`` store are refused too (they would
    be ignored): each error names the key and what is wrong."""
    from conftest import plain_cfg

    from errors import ConfigError

    files = {}
    for name in ("ca", "cert", "key"):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_text("-----BEGIN-----\n")
    files["key"].chmod(0o600)
    tls = [f"trainer.store_tls.{name}={path}" for name, path in files.items()]
    secure = "trainer.store='etcds://a:2379,b:2379'"
    assert plain_cfg(secure, *tls)["trainer"]["store_tls"]["key"] == str(files["key"])
    with pytest.raises(ConfigError, match=r"trainer.store_tls=None: expected the CA, certificate and key files"):
        plain_cfg(secure)
    with pytest.raises(ConfigError, match="trainer.store_tls=.*exactly where trainer.store is etcds://"):
        plain_cfg("trainer.store='etcd://a:2379'", *tls)
    files["key"].chmod(0o644)
    with pytest.raises(ConfigError, match=r"store_tls.key=.*expected a key only its owner may read \(mode 644\)"):
        plain_cfg(secure, *tls)
    with pytest.raises(ConfigError, match=r"trainer.store_tls.ca='.*none.pem': expected a readable file \(there"):
        plain_cfg(secure, f"trainer.store_tls.ca={tmp_path / 'none.pem'}", *tls[1:])
    with pytest.raises(ConfigError, match="trainer.store_tls.key=None: expected a path, as the two others"):
        plain_cfg(secure, *tls[:2])
