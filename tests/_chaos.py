"""The chaos matrix: under ``trainer.on_failure=continue``, a node killed (``kill -9`` of its torchrun agent and
worker), hung (``SIGSTOP`` of its worker, continued once the others gave it up) or ringing a spurious alarm (no one
gone: the ranks agree that nothing changed and redo the part) at a moment drawn from a seed, in
every phase of the loop (:data:`tests._chaos_victim.PHASES`), under every sync option (:data:`OPTIONS`: each
``conf/sync`` option, the overlapped and streaming variants, and relaxed sync over other algorithms). A cell is one
(option, phase, fault); its run is a multi-node job on this machine (one torchrun agent per node, one worker each,
as the README's multi-node recipe) whose store is an etcd cluster of three members, one on each of the first nodes
(``trainer.store``; a killed node's member dies with it), so that the victim may be any node, the first one too;
``--store c10d`` runs on torch's store in node 0 instead, which then is never the victim. A cell passes when:

- the run finishes with the right world (the initial ranks less the victims) and ``rank_lost`` names the victims;
  after a spurious alarm a ``regrouped`` event says the ranks agreed that nobody was gone, and removed nobody;
- every step is recorded once and in order, and each epoch has the steps its world size gives;
- the survivors' replicas are identical where the algorithm keeps them so (``replica_spread`` 0);
- every worker left alive exits 0 (a hung one too, once continued) and no log holds a traceback;
- the fault landed in its phase (the victim reports where it was when it fired).

``recovery`` and ``loader rebuild`` lose a second node: it fails while the survivors agree on the first loss, or
while they rebuild their loaders after it (4 nodes).

    .venv/bin/python -m tests._chaos                         # the whole matrix, moments from seed 0
    .venv/bin/python -m tests._chaos --seed 7 --n 5          # 5 cells drawn with seed 7
    .venv/bin/python -m tests._chaos --seed 7 --only sgp-overlap:recovery:kill   # one cell again
    make chaos SEED=7 N=5 JOBS=2

Each run's logs are kept under ``--out`` (``chaos/``); ``chaos.json`` there has a row per cell.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distributed.etcd import LocalCluster  # noqa: E402
from engine.metrics import read_metrics  # noqa: E402
from tests._chaos_victim import PHASES  # noqa: E402

FAULTS = ("kill", "hang", "alarm")
BATCH, SAMPLES, EPOCHS = 32, 1152, 3  # 12 steps per epoch at 3 ranks, 18 at 2, 9 at 4
BASE = [
    "model=test_resnet", "data=synthetic", "logger=none", "trainer.progress=false",
    f"data.batch_size={BATCH}", f"data.num_samples={SAMPLES}", "data.num_val_samples=96", f"trainer.epochs={EPOCHS}",
    "trainer.on_failure=continue", "trainer.hang_timeout_s=3", "trainer.eval_every_steps=7",
    "trainer.checkpoint_every_steps=5",
]  # fmt: skip

DGC = ["optimizer=momentum", "sync.min_compress_numel=1024", "sync.rampup_begin_step=2"]
DGC_INNER = [o.replace("sync.", "sync.inner.") for o in DGC]


@dataclass(frozen=True)
class Option:
    """A sync option as a user sets it: its overrides, whether it keeps the replicas identical (checked at the end)
    and whether it keeps exchanges in flight across steps (the ``in flight`` phase applies)."""

    overrides: list[str]
    identical: bool
    overlapped: bool = False


OPTIONS = {
    "allreduce": Option(["sync=allreduce"], True),
    "none": Option(["sync=none"], True),
    "dgc": Option(["sync=dgc", *DGC], True),
    "powersgd": Option(["sync=powersgd", "sync.start_powerSGD_iter=2"], True),
    "localsgd": Option(["sync=localsgd", "sync.k_steps=4"], True),
    "adaptive_localsgd": Option(["sync=adaptive_localsgd", "sync.init_k_steps=2", "sync.max_k_steps=4"], True),
    "diloco": Option(["sync=diloco", "sync.inner_steps=4"], True),
    "diloco-streaming": Option(
        ["sync=diloco", "sync.inner_steps=4", "sync.fragments=2", "sync.delay=1", "sync.quantize=int8"], True, True
    ),
    "decoupled": Option(
        ["sync=decoupled", "sync.inner_steps=4", "sync.fragments=2", "sync.delay=1", "sync.quantize=int8"], True, True
    ),
    "sgp": Option(["sync=sgp"], False),
    "sgp-overlap": Option(["sync=sgp", "sync.overlap=true", "sync.synch_freq=2"], False, True),
    "crossover": Option(["sync=crossover"], False),
    "crossover-overlap": Option(["sync=crossover", "sync.overlap=true"], False, True),
    "relaxed": Option(["sync=relaxed"], True),
    "relaxed-dgc": Option(["sync=relaxed", "sync@sync.inner=dgc", *DGC_INNER], True),
    "relaxed-localsgd": Option(["sync=relaxed", "sync@sync.inner=localsgd", "sync.inner.k_steps=4"], True),
    "auto": Option(["sync=auto", "sync.probe_steps=2"], True),
}

SECOND = ("recovery", "loader rebuild")  # phases of a second loss, after a first one


@dataclass(frozen=True)
class Cell:
    option: str
    phase: str
    fault: str

    @property
    def name(self) -> str:
        return f"{self.option}:{self.phase.replace(' ', '-')}:{self.fault}"

    @classmethod
    def parse(cls, name: str) -> Cell:
        option, phase, fault = name.split(":")
        cell = cls(option, phase.replace("-", " "), fault)
        if cell not in matrix():
            raise SystemExit(f"--only {name}: not a cell of the matrix (option:phase:fault, e.g. sgp:step:kill)")
        return cell


def matrix() -> list[Cell]:
    """Every cell: each option, phase and fault (``in flight`` for the options that keep exchanges in flight)."""
    return [
        Cell(option, phase, fault)
        for option, o in OPTIONS.items()
        for phase in PHASES
        if phase != "in flight" or o.overlapped
        for fault in FAULTS
    ]


def draw(cells: list[Cell], seed: int, n: int | None) -> list[Cell]:
    """``n`` cells drawn with ``seed`` (all of them, in matrix order, when ``n`` is None)."""
    if n is None or n >= len(cells):
        return list(cells)
    return sorted(random.Random(seed).sample(cells, n), key=cells.index)


@dataclass
class Plan:
    """Where and when the faults of one run land (drawn from the seed and the cell)."""

    nodes: int
    faults: dict[int, dict]  # node -> its victim's plan (tests/_chaos_victim.py)

    @classmethod
    def draw(cls, cell: Cell, seed: int, out: Path, store: str = "etcd") -> Plan:
        rng = random.Random(zlib.crc32(f"{seed}/{cell.name}".encode()))
        second = cell.phase in SECOND
        nodes = 4 if second else 3
        # Any node, the first one too, under the run's store on etcd; under torch's store node 0 hosts it
        victims = rng.sample(range(0 if store == "etcd" else 1, nodes), 2 if second else 1)
        first = {"fault": cell.fault, "phase": cell.phase, "report": str(out / f"fault-node{victims[0]}.json")}
        if cell.phase == "step":
            first |= {"step": rng.randint(3, 20), "delay_ms": rng.uniform(0, 40)}
        elif cell.phase == "exchange":
            first |= {"step": rng.randint(3, 20), "delay_ms": rng.uniform(0, 5), "nth": rng.randint(0, 2)}
        elif cell.phase == "in flight":
            first |= {"step": rng.randint(3, 20), "delay_ms": rng.uniform(0, 30)}
        elif cell.phase == "epoch boundary":
            first |= {"step": rng.randint(1, 30), "delay_ms": rng.uniform(0, 40)}
        elif cell.phase in ("evaluation", "checkpoint"):
            first |= {"step": rng.randint(3, 16), "delay_ms": rng.uniform(0, 60)}
        if cell.option == "none":  # (it exchanges nothing in training: a collective of any part of the loop)
            first["anywhere"] = True
        faults = {victims[0]: first}
        if second:  # the first loss, in a step or its exchange; the second one in the phase
            fault = "kill" if cell.fault == "alarm" else cell.fault  # (a real loss, whose recovery an alarm meets)
            early = {"fault": fault, "step": rng.randint(3, 12), "report": first["report"]}
            early |= rng.choice([{"phase": "step", "delay_ms": 10.0}, {"phase": "exchange", "delay_ms": 1.0}])
            early["anywhere"] = cell.option == "none"
            report = str(out / f"fault-node{victims[1]}.json")
            later = {"fault": cell.fault, "phase": cell.phase, "report": report}
            if cell.phase == "recovery":
                later["delay_ms"] = rng.uniform(0, 2500)  # the agreement takes ~2 s: check-in, decision, regroup
            else:
                later["train"] = rng.random() < 0.5  # the val loader right after the loss, or the train loader
            faults = {victims[0]: early, victims[1]: later}
        return cls(nodes, faults)


@dataclass
class Result:
    cell: str
    seed: int
    ok: bool
    problems: list[str] = field(default_factory=list)
    fired: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    steps: int | None = None
    world_size: int | None = None
    log_dir: str = ""
    steps_recorded: int = 0
    restarted: bool = False  # its first start never reached a step (a failed rendezvous), and it ran again


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict[str, str]:
    environ = dict(os.environ, WANDB_SILENT="true", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CHAOS_PLAN"):
        environ.pop(key, None)
    return environ


def start(
    node: int, plan: Plan, port: int, run_dir: Path, overrides: list[str], etcd: LocalCluster | None = None
) -> subprocess.Popen:
    """Node ``node``'s torchrun agent and worker: on torch's c10d rendezvous and store (node 0 hosts both), or with
    ``etcd`` on its v3 rendezvous (distributed/rendezvous.py) and the run's store there, both over TLS with client
    certificates (node ``i`` holds member ``i``, the last member
    also serving the nodes after it; a victim node's member dies with it)."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    environ = environment()
    if etcd is None:
        rendezvous = ["c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", f"is_host={int(node == 0)}"]
        store = []
    else:
        rendezvous, store = etcd.rendezvous(node), etcd.overrides()
    if node in plan.faults:
        fault = dict(plan.faults[node])
        if etcd is not None and node < etcd.members and fault["fault"] == "kill":
            fault["member_pid"] = etcd.processes[node].pid
        environ["CHAOS_PLAN"] = json.dumps(fault)
    launcher = [
        torchrun, "--nnodes", str(plan.nodes), "--nproc-per-node", "1", "--max-restarts", "0",
        "--monitor-interval", "0.5", "--rdzv-id", run_dir.name, "--rdzv-backend", *rendezvous,
    ]  # fmt: skip
    script = [str(ROOT / "tests" / "_chaos_victim.py"), *overrides, *store, f"trainer.run_dir={run_dir}"]
    log = open(run_dir.parent / f"node{node}.log", "w")
    return subprocess.Popen(
        [*launcher, *script], cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def workers(agent: subprocess.Popen) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return read_metrics(str(path))


def kinds(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["kind"] == kind]


def default_store() -> str:
    """etcd where it is installed (any node may be the victim), else torch's store (never node 0)."""
    return "etcd" if shutil.which("etcd") else "c10d"


def run_cell(cell: Cell, seed: int, out: Path, timeout: float = 300, store: str | None = None) -> Result:
    """One run of ``cell``; its logs in ``out/<cell name>``. A job that never started training (its rendezvous
    failed, before any fault) is started once more, and the result says so."""
    store = store or default_store()
    result = _run_cell(cell, seed, out, timeout, store)
    if not result.ok and not result.fired and not result.steps_recorded:
        result = _run_cell(cell, seed, out, timeout, store)
        result.restarted = True
    return result


def _run_cell(cell: Cell, seed: int, out: Path, timeout: float, store: str) -> Result:
    log_dir = out / cell.name.replace(":", "_")
    if log_dir.exists():
        subprocess.run(["rm", "-rf", str(log_dir)], check=True)
    log_dir.mkdir(parents=True)
    run_dir = log_dir / "run"
    plan = Plan.draw(cell, seed, log_dir, store)
    overrides = [*BASE, *OPTIONS[cell.option].overrides]
    if cell.phase in SECOND:
        overrides.append("trainer.eval_every_steps=null")  # (4 ranks: fewer steps; fewer parts to wait through)
    (log_dir / "plan.json").write_text(
        json.dumps(
            {
                "cell": cell.name,
                "seed": seed,
                "nodes": plan.nodes,
                "faults": plan.faults,
                "overrides": overrides,
                "store": store,
            },  # fmt: skip
            indent=1,
        )
    )
    started = time.monotonic()
    port = free_port()
    etcd = LocalCluster(str(log_dir / "etcd"), tls=True).start() if store == "etcd" else None
    agents = [start(node, plan, port, run_dir, overrides, etcd) for node in range(plan.nodes)]
    result = Result(cell.name, seed, False, log_dir=str(log_dir))
    try:
        result.problems = watch(cell, plan, agents, run_dir, log_dir, timeout, result)
    finally:
        if etcd is not None:
            etcd.stop()
        for agent in agents:
            if agent.poll() is None:
                for pid in workers(agent):
                    _signal(pid, signal.SIGCONT)
                    _signal(pid, signal.SIGKILL)
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    result.seconds = round(time.monotonic() - started, 1)
    result.ok = not result.problems
    result.steps_recorded = len(kinds(read_records(run_dir), "train"))
    return result


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def watch(cell, plan: Plan, agents, run_dir: Path, log_dir: Path, timeout: float, result: Result) -> list[str]:
    """Follow the run to its end (continuing hung victims once the others gave them up) and check it."""
    deadline = time.monotonic() + timeout
    reports = {node: Path(f["report"]) for node, f in plan.faults.items()}
    fired: dict[int, dict] = {}
    woken: set[int] = set()
    summary = None
    while summary is None:
        if time.monotonic() > deadline:
            return [f"no finished summary in {timeout:.0f} s"]
        for node, path in reports.items():
            if node not in fired and path.exists():
                fired[node] = json.loads(path.read_text())
        result.fired = list(fired.values())
        records = read_records(run_dir)
        lost = {r for e in kinds(records, "event") if e["event"] == "rank_lost" for r in e["ranks"]}
        for node, report in fired.items():
            if report["fault"] == "hang" and report["rank"] in lost and node not in woken:
                _signal(report["pid"], signal.SIGCONT)  # given up by the others: it should leave, status 0
                woken.add(node)
        summary = next((s for s in kinds(records, "summary") if s["finished"]), None)
        survivors = [a for i, a in enumerate(agents) if i not in plan.faults]
        if summary is None and any(a.poll() not in (None, 0) for a in survivors):
            time.sleep(1)
            if not next((s for s in kinds(read_records(run_dir), "summary") if s["finished"]), None):
                return ["a surviving node's agent failed before the summary"]
        time.sleep(0.2)
    for node, path in reports.items():  # (a hang reported just before the end)
        if node not in fired and path.exists():
            fired[node] = json.loads(path.read_text())
    for node, report in fired.items():
        if report["fault"] == "hang" and node not in woken:
            _signal(report["pid"], signal.SIGCONT)
            woken.add(node)
    # every worker still alive exits (torchrun's agents then wait in their exit barrier for the dead node: not ours)
    while any(workers(a) for a in agents if a.poll() is None):
        if time.monotonic() > deadline:
            return ["a worker did not exit after the summary"]
        time.sleep(0.2)
    result.fired = [fired.get(node, {"node": node, "fired": False}) for node in sorted(plan.faults)]
    return check(cell, plan, fired, read_records(run_dir), log_dir, result)


def check(cell: Cell, plan: Plan, fired: dict[int, dict], records: list[dict], log_dir: Path, result) -> list[str]:
    problems = []
    for node, fault in plan.faults.items():
        report = fired.get(node)
        if report is None:
            problems.append(f"the fault planned on node {node} ({fault['phase']}) never fired")
        elif fault["phase"] not in landed(report):
            problems.append(f"node {node}'s fault was planned in the {fault['phase']} but fired in {report['where']}")
    victims = sorted(r["rank"] for r in fired.values() if r["fault"] != "alarm")
    alarms = [r for r in fired.values() if r["fault"] == "alarm"]
    summary = next(s for s in kinds(records, "summary") if s["finished"])
    result.steps, result.world_size = summary["steps"], summary["world_size"]
    if summary["world_size"] != plan.nodes - len(victims):
        problems.append(f"world size {summary['world_size']} at the end, not {plan.nodes - len(victims)}")
    if sorted(summary["lost_ranks"]) != victims:
        problems.append(f"lost_ranks {summary['lost_ranks']}, the victims were {victims}")
    lost = sorted(r for e in kinds(records, "event") if e["event"] == "rank_lost" for r in e["ranks"])
    if lost != victims:
        problems.append(f"rank_lost events name {lost}, the victims were {victims}")
    regrouped = [e for e in kinds(records, "event") if e["event"] == "regrouped"]
    if alarms and not regrouped:
        problems.append("a spurious alarm rang and no regrouped event says the ranks agreed that nobody was gone")
    if any(e["ranks"] for e in regrouped):
        problems.append(f"a regrouped event removed ranks: {regrouped}")
    train = kinds(records, "train")
    steps = [r["step"] for r in train]
    if steps != list(range(summary["steps"])):
        problems.append(f"steps recorded {_runs(steps)}, not each of 0..{summary['steps'] - 1} once in order")
    problems += _epochs(train, plan.nodes)
    if OPTIONS[cell.option].identical and summary["replica_spread"] != 0.0:
        problems.append(f"replica_spread {summary['replica_spread']}: the survivors' replicas differ")
    for log in sorted(log_dir.glob("node*.log")):
        text = log.read_text(errors="replace")
        if "Traceback" in text or "failed (exitcode" in text:
            at = text.find("Traceback") if "Traceback" in text else text.find("failed (exitcode")
            problems.append(f"{log.name}: {text[max(0, at - 200) : at + 1500]}")
    return problems


def landed(report: dict) -> set[str]:
    """The phases a fault that fired where ``report`` says counts for."""
    where = report["where"]
    phases = set(where)
    if "checkpoint write" in where:
        phases.add("checkpoint")
    if report["phase"] == "in flight" and where[-1:] == ["step"] and report["in_flight"]:
        phases.add("in flight")
    if report["phase"] == "exchange" and report.get("by") == "collective":
        phases.add("exchange")  # (just after it issued a collective, in the part that issued it)
    return phases


def _epochs(train: list[dict], nodes: int) -> list[str]:
    """Each epoch has the steps of the world its training data was sharded for: one between the world it started
    in and the one it ended with (a loss as it starts, before its first step, may shard for a world that never
    took a step; a loss during it leaves the shards as they were until the next epoch)."""
    problems, before = [], nodes
    for epoch in sorted({r["epoch"] for r in train}):
        rows = [r for r in train if r["epoch"] == epoch]
        worlds = range(min(r["world_size"] for r in rows), before + 1)
        allowed = {SAMPLES // w // BATCH for w in worlds}
        if len(rows) not in allowed:
            problems.append(f"epoch {epoch} has {len(rows)} steps; world sizes {sorted(worlds)} give {sorted(allowed)}")
        before = rows[-1]["world_size"]
    if train and train[-1]["epoch"] != EPOCHS:
        problems.append(f"the last step is in epoch {train[-1]['epoch']}, not {EPOCHS}")
    return problems


def _runs(steps: list[int]) -> str:
    return str(steps) if len(steps) < 12 else f"{steps[:5]}...{steps[-5:]} ({len(steps)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests._chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="draws the cells (with --n) and every moment")
    parser.add_argument("--n", type=int, default=None, help="run this many cells drawn with the seed (default: all)")
    parser.add_argument("--only", action="append", default=[], help="run this cell (option:phase:fault); repeatable")
    parser.add_argument("--jobs", type=int, default=1, help="cells run at once (each is 3-4 processes)")
    parser.add_argument("--out", type=Path, default=ROOT / "chaos")
    parser.add_argument("--list", action="store_true", help="print the cells and exit")
    parser.add_argument(
        "--store", choices=("etcd", "c10d"), default=default_store(),
        help="the run's store: an etcd cluster, any node a victim (default where etcd is installed), or torch's",
    )  # fmt: skip
    args = parser.parse_args(argv)
    cells = [Cell.parse(name) for name in args.only] or draw(matrix(), args.seed, args.n)
    if args.list:
        print("\n".join(c.name for c in cells))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"chaos: {len(cells)} of {len(matrix())} cells, seed {args.seed}, {args.jobs} at a time, store {args.store}; "
        f"logs in {args.out}"
    )
    results: list[Result] = []

    def one(cell: Cell) -> Result:
        result = run_cell(cell, args.seed, args.out, store=args.store)
        mark = ("ok  " if result.ok else "FAIL") + ("*" if result.restarted else " ")
        where = "; ".join(
            f"rank {f.get('rank')} {f.get('fault')} in {' > '.join(f.get('where', []))} at step {f.get('step')}"
            for f in result.fired
        )
        print(f"{mark} {cell.name:44s} {result.seconds:5.1f} s  {where}", flush=True)
        if result.restarted:
            print("       * started again: the first start never reached a step", flush=True)
        for problem in result.problems:
            print(f"       {problem}", flush=True)
        if not result.ok:
            print(f"       again: make chaos SEED={args.seed} ONLY={cell.name}", flush=True)
        return result

    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(one, cells))
    rows = [vars(r) for r in results]
    (args.out / "chaos.json").write_text(json.dumps({"seed": args.seed, "rows": rows}, indent=1))
    failed = [r.cell for r in results if not r.ok]
    print(f"chaos: {len(results) - len(failed)} of {len(results)} passed (seed {args.seed})")
    for name in failed:
        print(f"  failed: make chaos SEED={args.seed} ONLY={name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
