"""Train an image classifier data-parallel; the sync algorithm is a config group.

    python train.py sync=allreduce                   # 2 local workers on the defaults (README)
    python train.py -m sync=allreduce optimizer=sgd,lars
    torchrun --nnodes 2 --nproc-per-node 4 ... train.py trainer.epochs=90   # external launcher

The config is composed and validated once, here, before any worker starts; workers get a plain dict.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import hydra
from omegaconf import DictConfig

from errors import ConfigError

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")


def fail(error: Exception) -> None:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Launch local workers; return the final validation top-1 (what sweepers optimize)."""
    from hydra.core.hydra_config import HydraConfig
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from engine.config import prepare
    from engine.launch import launch
    from engine.launchers import slurm_task

    try:
        plain = prepare(cfg)
    except ConfigError as error:
        fail(error)
    run_dir = plain["trainer"]["run_dir"] or HydraConfig.get().runtime.output_dir
    if slurm_task():  # a sweep point's Slurm job (hydra/launcher=slurm): each of its tasks is one worker
        summary = slurm_worker(plain, run_dir).summary
        return summary["top1"] if summary else None
    try:
        summary = launch(plain, run_dir)
    except ChildFailedError as error:
        print(error.format_msg(), file=sys.stderr)
        sys.exit(1)
    except SignalException as error:  # the workers checkpointed at an agreed step (engine/stop.py) and exited
        print(
            f"relaxsync: stopped by {error.sigval.name}; continue with: trainer.resume=auto trainer.run_dir={run_dir}",
            file=sys.stderr,
        )
        sys.exit(128 + error.sigval)
    return summary["top1"] if summary else None


def worker_config(argv: list[str]) -> dict[str, Any]:
    """Under torchrun/Slurm: the same config as ``main`` composes, without Hydra's per-process output dirs."""
    from hydra import compose, initialize_config_dir

    from engine.config import check_override_keys, prepare

    try:
        check_override_keys(argv, CONF_DIR)
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="train", overrides=argv)
        return prepare(cfg)
    except ConfigError as error:
        fail(error)


def launched_run_dir(plain: dict[str, Any], argv: list[str], rank: str) -> str:
    """The run dir of a worker torchrun or srun started: ``trainer.run_dir``, else a literal ``hydra.run.dir`` on
    the command line (what Hydra would have used, without Hydra's output dir around the workers), else the job's
    (:func:`engine.launchers.external_run_dir`). A ``hydra.run.dir`` with an interpolation (``${now:...}``) would
    resolve to another directory in each process: it is left, and rank ``"0"`` says so."""
    from engine.launchers import external_run_dir

    if plain["trainer"]["run_dir"]:
        return plain["trainer"]["run_dir"]
    given = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+") == "hydra.run.dir" and "=" in a]
    if given and "${" not in given[-1]:
        return given[-1]
    run_dir = external_run_dir()
    if given and rank == "0":
        print(
            f"relaxsync: hydra.run.dir={given[-1]} is not used under this launcher (each process would resolve it "
            f"to a directory of its own); the run dir is {run_dir}: set trainer.run_dir to choose it",
            file=sys.stderr,
        )
    return run_dir


def worker_main(argv: list[str]) -> Any:
    """A worker torchrun started: train."""
    from engine.worker import exit_if_left, run_worker

    plain = worker_config(argv)
    return exit_if_left(run_worker(plain, launched_run_dir(plain, argv, os.environ.get("RANK", "0"))))


def slurm_worker(plain: dict[str, Any], run_dir: str) -> Any:
    """A task of a Slurm job: one worker of the job's world (rank, size and rendezvous from Slurm's environment);
    after a stop on a signal, task 0 puts the job back in the queue, where it resumes."""
    from engine.launchers import requeue_slurm_job, slurm_world
    from engine.worker import exit_if_left, run_worker

    world = slurm_world()
    os.environ.update(world)
    result = exit_if_left(run_worker(plain, run_dir))
    if result.stopped_by and world["RANK"] == "0":  # every rank has checkpointed the agreed step and left the loop
        print(f"relaxsync: {requeue_slurm_job()}", flush=True)
    return result


def slurm_worker_main(argv: list[str]) -> None:
    """A task ``srun`` started."""
    nproc = [a for a in argv if a.split("=")[0].lstrip("+") == "trainer.nproc"]
    if nproc and os.environ["SLURM_PROCID"] == "0":
        print(
            f"relaxsync: {nproc[0]} is ignored under srun: each of its {os.environ['SLURM_NTASKS']} tasks is one "
            "worker (srun --ntasks-per-node sets the workers per node)",
            file=sys.stderr,
        )
    plain = worker_config(argv)
    slurm_worker(plain, launched_run_dir(plain, argv, os.environ["SLURM_PROCID"]))


def end_now() -> None:
    """End a process whose run went well as a local worker ends (multiprocessing's ``os._exit`` after its exit
    functions): the other threads are waited for, the ``atexit`` functions run (logging's, W&B's, the fork server's
    stop) and the streams are flushed; the interpreter's teardown of torch's thousands of modules is not, about
    1.5 s on 2 cores that every ``python train.py``, and every worker torchrun or srun started, spent after its last
    line. What the run wrote is closed by then (``Trainer.close``, Hydra's logs by logging's exit function)."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    from engine.launchers import catch_early_signals, slurm_task, under_external_launcher

    if under_external_launcher():
        catch_early_signals()
    if slurm_task():
        slurm_worker_main(sys.argv[1:])
    elif under_external_launcher():
        worker_main(sys.argv[1:])
    else:
        from engine.launch import start_worker_server

        # First: the server imports torch and the engine for the workers while this process imports its own and
        # validates (a config error stops the server at once).
        start_worker_server()
        from engine.config import check_override_keys

        try:
            check_override_keys(sys.argv[1:], CONF_DIR)
        except ConfigError as error:
            fail(error)
        main()
    end_now()  # (an error's way out, SystemExit or an exception, ends as Python does)
