"""Under Slurm, on a real one: a two-node cluster on this machine (``scripts/local-slurm.sh``, Debian's slurm-wlm and
munge). Where it cannot start (not root, no packages) these tests skip and say why, except where
``RELAXSYNC_REQUIRE_SLURM=1`` (CI, whose ``.ci/run`` installs the packages): there they fail instead."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, load_model_state, records, train

from engine.metrics import read_metrics

SCRIPT = ROOT / "scripts" / "local-slurm.sh"
REQUIRED = os.environ.get("RELAXSYNC_REQUIRE_SLURM") == "1"
NO_ETCD = shutil.which("etcd") is None and not os.environ.get("RELAXSYNC_REQUIRE_ETCD")  # (CI installs it)
RUN = ["model=test_resnet", "data=digits", "logger=none", "trainer.progress=false", "trainer.max_steps=3"]


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (munged, slurmd)"
    if not (shutil.which("slurmctld") and shutil.which("munged")):
        return "Debian's slurm-wlm and munge are not installed"
    return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> dict[str, str]:
    """The environment that reaches a running two-node cluster (n1, n2)."""
    why = _unavailable()
    if why is not None:
        if REQUIRED:
            pytest.fail(f"RELAXSYNC_REQUIRE_SLURM=1 but {why}")
        pytest.skip(why)
    state = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, RELAXSYNC_SLURM_DIR=str(state), WANDB_SILENT="true")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    started = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr
    env["SLURM_CONF"] = str(state / "slurm.conf")
    yield env
    subprocess.run([str(SCRIPT), "stop"], env=env, capture_output=True, timeout=60)


def srun(env: dict[str, str], *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    command = ["srun", "-N2", "-n2", sys.executable, str(ROOT / "train.py"), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.full  # ~14 s; make test: srun worlds trained in the requeue and task-kill tests below, ranks from Slurm
def test_srun_forms_one_world_of_its_tasks_and_trains_as_two_local_workers_do(slurm, tmp_path):
    """``srun -N2 -n2 python train.py``: each task is one worker (rank, world and rendezvous from Slurm), the world
    event names the nodes n1 and n2 and the launcher, every step is recorded once, and the parameters are
    bit-identical to ``trainer.nproc=2`` on the same config."""
    run_dir = tmp_path / "srun"
    done = srun(slurm, *RUN, "trainer.nproc=4", f"trainer.run_dir={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trainer.nproc=4 is ignored under srun: each of its 2 tasks is one worker" in done.stderr
    assert done.stdout.count("relaxsync: 2 x cpu (srun)") == 1  # one world, not one per task
    metrics = read_metrics(str(run_dir / "metrics.jsonl"))
    (world,) = [e for e in records(metrics, "event") if e["event"] == "world"]
    assert world["hosts"] == {"0": "n1", "1": "n2"} and world["launcher"] == "srun"
    assert [r["step"] for r in records(metrics, "train")] == [0, 1, 2]

    train(tmp_path / "local", *RUN, "trainer.nproc=2")
    on_slurm, local = load_model_state(run_dir), load_model_state(tmp_path / "local")
    assert on_slurm.keys() == local.keys()
    assert all(torch.equal(on_slurm[k], local[k]) for k in local), "srun and trainer.nproc=2 differ"


@pytest.mark.full  # ~26 s; make test: the lease itself (taken, refused, taken over: the test below)
def test_a_second_world_started_into_a_run_dir_in_use_stops_before_writing_anything(tmp_path):
    """The same command launched again into a run dir while its first world trains there: the second stops at
    once, naming the world that holds the dir; the first trains on, every step recorded once, and releases the dir
    when it stops (SIGTERM here: it would train for 100 s)."""
    import signal
    import time

    run_dir = tmp_path / "twice"
    slow = ["straggler=sleep", "straggler.ranks=[0]", "straggler.sleep_s=0.5", "trainer.max_steps=200"]
    command = [sys.executable, str(ROOT / "train.py"), *RUN, *slow, "trainer.nproc=1", f"trainer.run_dir={run_dir}"]
    env = dict(os.environ, WANDB_SILENT="true", HYDRA_FULL_ERROR="0")
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    first = subprocess.Popen(command, cwd=ROOT, env=env, **pipes)
    deadline = time.monotonic() + 120
    while not (run_dir / "run.lease").exists() or not (run_dir / "metrics.jsonl").exists():
        assert time.monotonic() < deadline and first.poll() is None, first.communicate()[1][-2000:]
        time.sleep(0.1)
    second = subprocess.run(command, cwd=ROOT, env=env, timeout=300, **pipes)
    assert first.poll() is None, "the first world ended before the second was refused"
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert second.returncode == 1, second.stdout[-2000:]
    assert f"run dir {run_dir} is in use by another world" in second.stderr and "launched by local" in second.stderr
    metrics = read_metrics(str(run_dir / "metrics.jsonl"))
    (summary,) = records(metrics, "summary")  # the first world's only
    assert [r["step"] for r in records(metrics, "train")] == list(range(summary["steps"]))
    assert not (run_dir / "run.lease").exists()  # released when it stopped


def test_a_world_coming_back_takes_its_lease_over_and_a_stale_one_is_taken_over(tmp_path, monkeypatch):
    """The same world (a restart, a requeued job) holds its dir again at once; another world only once the lease has
    gone unrenewed for STALE_S (its world died without releasing it), or at once when its holder on this host has
    exited."""
    from engine import rundir

    monkeypatch.setenv("WORLD_SIZE", "2")
    first = rundir.Lease(str(tmp_path), "slurm-7")
    first.take()
    first._done.set()  # (it died: no more renewals, no release)
    again = rundir.Lease(str(tmp_path), "slurm-7")
    again.take()  # requeued: the same job
    again._done.set()
    with pytest.raises(rundir.RunDirInUse, match=r"in use by another world \(slurm-7, 2 ranks"):
        rundir.Lease(str(tmp_path), "slurm-8").take()
    old = Path(tmp_path / rundir.LEASE).stat().st_mtime - rundir.STALE_S - 1
    os.utime(tmp_path / rundir.LEASE, (old, old))
    taken = rundir.Lease(str(tmp_path), "slurm-8")
    taken.take()
    taken._done.set()
    # a holder on this host that has exited (a crash, then a resume at once) is not waited for
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lease = json.loads((tmp_path / rundir.LEASE).read_text())
    (tmp_path / rundir.LEASE).write_text(json.dumps({**lease, "pid": int(dead.stdout)}))
    after_a_crash = rundir.Lease(str(tmp_path), "local-after-a-crash")
    after_a_crash.take()
    after_a_crash.release()
    assert not (tmp_path / rundir.LEASE).exists()


TASK = {
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "gpu[07-08,11]",
    "SLURM_JOB_NODELIST": "gpu[07-08,11]",
}


def test_the_launcher_reads_a_slurm_task_and_leaves_the_batch_script_and_torchrun_alone():
    from engine.launchers import external_run_dir, launcher_name, slurm_task, under_external_launcher

    batch = {k: v for k, v in TASK.items() if k != "SLURM_STEP_ID"}  # sbatch's script: no step
    assert slurm_task(TASK) and under_external_launcher(TASK) and launcher_name(TASK) == "srun"
    assert not slurm_task(batch) and not under_external_launcher(batch)
    assert not slurm_task({**TASK, "RANK": "3", "WORLD_SIZE": "8"})  # a worker of torchrun under srun
    assert external_run_dir(TASK) == os.path.join("outputs", "slurm", "4242")


def test_a_slurm_tasks_world_comes_from_slurm_and_its_first_node(slurm, monkeypatch):
    """The rendezvous host is the step's first node, from a compressed list (Slurm's own ``scontrol`` expands it);
    the port is the job's (the same for every task, and after a requeue) unless MASTER_PORT is set."""
    from engine.launchers import slurm_world

    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    world = slurm_world(TASK)
    assert world["MASTER_ADDR"] == "gpu07" and (world["RANK"], world["WORLD_SIZE"]) == ("3", "8")
    assert world["LOCAL_RANK"] == "1" and world["MASTER_PORT"] == slurm_world(dict(TASK))["MASTER_PORT"]
    assert slurm_world({**TASK, "MASTER_PORT": "29500"})["MASTER_PORT"] == "29500"


def _job_state(env: dict[str, str], job: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True)
    return dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f)


def _submit(slurm: dict[str, str], run_dir: Path, sbatch: list[str], overrides: list[str]) -> str:
    script = run_dir / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH -N2 -n2 --requeue --open-mode=append\n"
        f"srun {sys.executable} {ROOT / 'train.py'} {' '.join(overrides)}\n"
    )
    submitted = subprocess.run(
        ["sbatch", "--parsable", "-o", str(run_dir / "slurm-%j.out"), *sbatch, str(script)],
        cwd=ROOT, env=slurm, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return submitted.stdout.strip().split(";")[0]


def _output(run_dir: Path, job: str) -> str:
    out = run_dir / f"slurm-{job}.out"
    return out.read_text() if out.exists() else ""


ENDED = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}


def _until_completed(slurm: dict[str, str], job: str, run_dir: Path, deadline: float) -> None:
    """Wait for the job to complete, starting each requeued incarnation 2 s after the requeue instead of Slurm's
    ~2 min hold (not ours to test). Not at once: a node refuses a credential issued in the same second (its clock
    has whole seconds) as the kill of the job's previous incarnation, and the job fails ("Job credential revoked");
    Slurm's hold is there for that."""
    import time

    held = 0
    while (state := _job_state(slurm, job)).get("JobState") != "COMPLETED":
        assert state.get("JobState") not in ENDED and time.monotonic() < deadline, (
            f"job {job} {state.get('JobState')} ({state.get('Reason')}):\n" + _output(run_dir, job)[-3000:]
        )
        restarts = int(state.get("Restarts", 0))
        if state.get("JobState") == "PENDING" and restarts > held:
            time.sleep(2.0)
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm, check=True)
            held = restarts
        time.sleep(0.5)


def _one_run_every_step_once(run_dir: Path, steps: int) -> list[dict]:
    rows = read_metrics(str(run_dir / "metrics.jsonl"))
    *stopped, finished = records(rows, "summary")
    assert stopped and all(s["stopped_by"] == "SIGTERM" and not s["finished"] for s in stopped) and finished["finished"]
    resumes = [e for e in records(rows, "event") if e["event"] == "resume"]
    assert [e["restart"] for e in resumes] == list(range(1, len(stopped) + 1))
    assert [e["step"] for e in resumes] == [s["steps"] for s in stopped]
    assert [r["step"] for r in records(rows, "train")] == list(range(steps))  # none lost, none repeated
    runs = {p.name.rsplit("-", 1)[-1] for p in (run_dir / "wandb").glob("offline-run-*")}
    assert len(runs) == 1, runs  # every incarnation continued the same W&B run
    return rows


# 16 steps per epoch at 2 ranks; W&B offline
JOB = [
    "model=test_resnet", "data=synthetic", "data.num_samples=1024", "data.num_val_samples=64", "trainer.epochs=2",
    "trainer.progress=false", "straggler=sleep", "straggler.ranks=[0,1]",
]  # fmt: skip


def test_a_job_signalled_mid_run_checkpoints_is_requeued_resumes_and_finishes_with_every_step_once(slurm, tmp_path):
    """A 2-node sbatch job gets SIGTERM mid-run (``scancel --signal=TERM``, as a time limit's ``--signal`` or a
    preemption would send it): every rank stops at an agreed step and checkpoints, rank 0 requeues the job, which
    runs again, resumes from that step by itself and finishes: every step once, no step lost, one W&B run."""
    import time

    run_dir = tmp_path / "job"
    run_dir.mkdir()
    job = _submit(slurm, run_dir, [], [*JOB, "straggler.sleep_s=0.25", f"trainer.run_dir={run_dir}"])
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.exists() and len(records(read_metrics(str(metrics)), "train")) >= 5):
        assert time.monotonic() < deadline, (run_dir / f"slurm-{job}.out").read_text()[-3000:]
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=TERM", job], env=slurm, check=True)
    _until_completed(slurm, job, run_dir, deadline)
    out = (run_dir / f"slurm-{job}.out").read_text()
    assert f"relaxsync: Slurm job {job} requeued" in out and "Traceback" not in out, out[-3000:]
    assert _job_state(slurm, job)["Restarts"] == "1"
    _one_run_every_step_once(run_dir, 32)


@pytest.mark.full  # ~2 min; make test signals the job with scancel (above)
def test_a_job_at_its_time_limit_stops_before_it_requeues_and_finishes_over_several_incarnations(slurm, tmp_path):
    """``--time=1 --signal=TERM@45``: Slurm sends SIGTERM 45 s before each incarnation's limit (or earlier: its
    events have a resolution of up to a minute, so maybe while the workers still start), the job checkpoints at an
    agreed step, requeues itself and goes on, until it finishes with every step once; a signal that comes after the
    last step, while the workers close, ends nothing."""
    import time

    run_dir = tmp_path / "job"
    run_dir.mkdir()
    sbatch = ["--time=1", "--signal=TERM@45"]
    overrides = [*JOB, "trainer.epochs=4", "straggler.sleep_s=1.0", f"trainer.run_dir={run_dir}"]  # ~40 s of steps
    job = _submit(slurm, run_dir, sbatch, overrides)
    _until_completed(slurm, job, run_dir, time.monotonic() + 600)
    assert int(_job_state(slurm, job)["Restarts"]) >= 1
    _one_run_every_step_once(run_dir, 64)


def _task_pid(job: str, rank: int) -> int | None:
    """The pid of task ``rank`` of Slurm job ``job`` (the local cluster runs every task on this machine)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = dict(kv.split(b"=", 1) for kv in (entry / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if environ.get(b"SLURM_JOB_ID") == job.encode() and environ.get(b"SLURM_PROCID") == str(rank).encode():
            if b"train.py" in (entry / "cmdline").read_bytes():
                return int(entry.name)
    return None


@pytest.mark.parametrize(
    "store",
    [
        pytest.param("c10d", marks=pytest.mark.full),  # (~16 s; make test: the same loss, of task 0, under etcd)
        pytest.param("etcd", marks=pytest.mark.skipif(NO_ETCD, reason="no etcd (apt install etcd-server)")),
    ],
)  # fmt: skip
def test_a_task_killed_under_srun_is_survived_by_the_others_with_on_failure_continue(slurm, tmp_path, store):
    """``srun -n3`` with ``trainer.on_failure=continue``: a task is killed with ``kill -9`` mid-run; srun keeps the
    others running (its default ``--kill-on-bad-exit=0``), and they agree it died, regroup and finish every step.
    With torch's store (in task 0) that is task 2; with the run's store on etcd (``trainer.store``) it is task 0,
    the first node's, which under torch's store would have taken the store with it."""
    import signal
    import time

    from distributed.etcd import LocalCluster

    victim = 0 if store == "etcd" else 2
    run_dir = tmp_path / "continue"
    overrides = [
        "model=test_resnet",
        "data=synthetic",
        "data.num_samples=1536",
        "data.num_val_samples=96",
        "trainer.epochs=2",
        "trainer.progress=false",
        "logger=none",
        "trainer.on_failure=continue",
        "trainer.hang_timeout_s=5",
        "straggler=sleep",
        f"straggler.ranks=[{victim}]",
        "straggler.sleep_s=0.3",
        f"trainer.run_dir={run_dir}",
    ]  # fmt: skip  (16 steps per epoch at 3 ranks, 24 at 2)
    etcd = LocalCluster(str(tmp_path / "etcd"), tls=True).start() if store == "etcd" else None
    if etcd is not None:  # (TLS and client certificates, as examples/slurm/train-any-node.sbatch's)
        overrides += etcd.overrides()
    try:
        command = ["srun", "-N2", "-n3", "--kill-on-bad-exit=0", sys.executable, str(ROOT / "train.py"), *overrides]
        out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        job_run = subprocess.Popen(command, cwd=ROOT, env=slurm, **out)
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
        while not (metrics.exists() and len(records(read_metrics(str(metrics)), "train")) >= 5):
            assert time.monotonic() < deadline and job_run.poll() is None, job_run.communicate()[0][-3000:]
            time.sleep(0.2)
        job = next(e for e in records(read_metrics(str(metrics)), "event") if e["event"] == "world")
        assert job["launcher"] == "srun" and job["world_size"] == 3
        squeue = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm, capture_output=True, text=True).stdout.split()
        pid = next(p for j in squeue if (p := _task_pid(j, victim)) is not None)
        os.kill(pid, signal.SIGKILL)
        output = job_run.communicate(timeout=240)[0]
    finally:
        if etcd is not None:
            etcd.stop()

    rows = read_metrics(str(metrics))
    (lost,) = [e for e in records(rows, "event") if e["event"] == "rank_lost"]
    assert lost["ranks"] == [victim] and lost["cause"] == "died" and lost["world_size"] == 2, output[-3000:]
    (summary,) = records(rows, "summary")
    assert summary["finished"] and summary["world_size"] == 2 and summary["lost_ranks"] == [victim]
    assert [r["step"] for r in records(rows, "train")] == list(range(summary["steps"]))
    assert summary["replica_spread"] == 0.0
    assert f"task {victim}: Killed" in output and output.count("Traceback") == 0, output[-3000:]


@pytest.mark.full  # ~25 s (two jobs of two fresh workers); make test: the sbatch job of srun tasks that form one
# world (the requeue test above), a sweep's jobs and comparison table (test_train's multirun), a sweep point's task
# checked against its job's world (below)
def test_a_multirun_sends_each_sweep_point_to_slurm_as_a_job_of_its_workers(slurm, tmp_path):
    """``train.py -m hydra/launcher=slurm sync=allreduce,localsgd``: two Slurm jobs (hydra-submitit-launcher), each
    of ``trainer.nproc`` tasks that form its world, and the sweep's comparison table of both."""
    sweep = tmp_path / "sweep"
    command = [
        sys.executable, str(ROOT / "train.py"), "-m", "hydra/launcher=slurm", "sync=allreduce,localsgd", *RUN,
        "trainer.nproc=2", f"hydra.sweep.dir={sweep}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=slurm, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for job, sync in ((0, "allreduce"), (1, "localsgd")):
        metrics = read_metrics(str(sweep / str(job) / "metrics.jsonl"))
        (world,) = [e for e in records(metrics, "event") if e["event"] == "world"]
        assert world["launcher"] == "srun" and world["world_size"] == 2 and set(world["hosts"].values()) <= {"n1", "n2"}
        (summary,) = records(metrics, "summary")
        assert summary["finished"] and summary["steps"] == 3
        assert f"sync {sync}," in (sweep / str(job) / "train.log").read_text()
    table = (sweep / "comparison.md").read_text()
    assert "| 0 | allreduce |" in table and "| 1 | localsgd |" in table
    assert len(list((sweep / ".submitit").glob("*_0"))) + len(list((sweep / ".submitit").glob("*_1"))) == 2


def test_a_sigterm_before_the_training_loop_arms_its_stop_is_acted_on_not_fatal():
    """Slurm may signal a job step while its workers still import and build: the worker keeps the signal from its
    first line, and the stop request, once armed, counts it as received (the run stops at its first agreed step)."""
    import signal

    import torch.distributed as dist

    from distributed.membership import Membership
    from engine import launchers
    from engine.stop import StopRequest

    before = signal.getsignal(signal.SIGTERM)
    try:
        launchers.catch_early_signals()
        os.kill(os.getpid(), signal.SIGTERM)  # (would end this process under the default action)
        assert launchers.EARLY_SIGNALS == [signal.SIGTERM]
        membership = Membership(0, 1)
        membership._store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
        request = StopRequest(membership)
        request.arm()
        try:
            assert request.signalled and request.due(step=3, step_s=0.1) is False and request.step == 3 + 2 + 4
        finally:
            request.disarm()
    finally:
        launchers.EARLY_SIGNALS.clear()
        signal.signal(signal.SIGTERM, before)


def test_a_slurm_tasks_config_is_checked_against_the_jobs_world_not_trainer_nproc(monkeypatch):
    """Under srun the world is the job's tasks: a straggler rank among them is valid whatever trainer.nproc says,
    and one beyond them is refused naming the ranks there are."""
    from conftest import plain_cfg

    from errors import ConfigError

    for key, value in {**TASK, "SLURM_NTASKS": "3"}.items():
        monkeypatch.setenv(key, value)
    plain_cfg("straggler=sleep", "straggler.ranks=[2]")  # trainer.nproc is 2
    with pytest.raises(ConfigError, match=r"ranks in \[0, 2\]"):
        plain_cfg("straggler=sleep", "straggler.ranks=[3]")


@pytest.mark.skipif(NO_ETCD, reason="etcd is not installed (Debian: apt install etcd-server)")
def test_the_any_node_example_runs_its_etcd_members_with_tls_and_trains(slurm, tmp_path):
    """examples/slurm/train-any-node.sbatch as a user submits it, on both nodes: the job makes its CA and
    certificates in a 0700 job directory, starts a member on each node that speaks TLS to clients and peers and
    requires a client certificate, and its workers train on the run's store there (etcds://) with the run's
    secret, to the end. Its members start on data of their own, whatever an earlier job with the same id left in
    /tmp (a fresh Slurm cluster numbers its jobs from 1 again: on such data a member looks for that job's peers),
    and the job removes them at its end."""
    import glob

    job_dir = tmp_path / "job"
    env = dict(
        slurm, RELAXSYNC_JOB_DIR=str(job_dir), RELAXSYNC_ETCD_PORT=str(_free_port_pair()), RELAXSYNC_ETCD_PORT_STEP="2"
    )  # fmt: skip  (n1 and n2 share this host: ports of their own)
    script = ROOT / "examples" / "slurm" / "train-any-node.sbatch"
    planted = [Path(f"/tmp/relaxsync-etcd-{j}-{i}") for j in range(1, 100) for i in range(2)]
    planted = [p for p in planted if not p.exists()]
    try:
        for p in planted:
            (p / "member").mkdir(parents=True)
        submitted = subprocess.run(
            ["sbatch", "--parsable", "--nodes", "2", "--cpus-per-task", "1", "--time", "10", "-o",
             str(tmp_path / "slurm-%j.out"), str(script), *RUN[:-1], "trainer.max_steps=6",
             "trainer.hang_timeout_s=20"],
            cwd=ROOT, env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        job = submitted.stdout.strip().split(";")[0]
        _until_completed(slurm, job, tmp_path, time.monotonic() + 240)
        out = (tmp_path / f"slurm-{job}.out").read_text()
        rows = read_metrics(str(job_dir / "metrics.jsonl"))
        (summary,) = records(rows, "summary")
        assert summary["finished"] and summary["world_size"] == 2 and summary["steps"] == 6, out[-3000:]
        config = (job_dir / "config.yaml").read_text()
        assert "store: etcds://n1:" in config and "/tls/client.key" in config
        assert (job_dir / "tls" / "ca.crt").exists() and os.stat(job_dir / "tls").st_mode & 0o777 == 0o700
        assert os.stat(job_dir / "tls" / "ca.key").st_mode & 0o077 == 0 and os.stat(job_dir).st_mode & 0o077 == 0
        deadline = time.monotonic() + 30  # (the job's end removes them)
        while glob.glob(f"/tmp/relaxsync-etcd-{job}-*") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not glob.glob(f"/tmp/relaxsync-etcd-{job}-*")
    finally:
        for p in planted:
            shutil.rmtree(p, ignore_errors=True)


def _free_port_pair() -> int:
    """A port whose next three are free too (two members' client and peer ports)."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 3 < 65536 and all(_free(base + k) for k in range(1, 4)):
            return base
    raise RuntimeError("no four free ports in a row")


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
