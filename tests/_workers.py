"""Worker entry points for launcher tests (importable by spawned workers)."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def _fit(trainer) -> None:
    try:
        trainer.fit()
    finally:
        trainer.close()


def _all_params(trainer) -> list:
    """Every active rank's flat parameters (an uncounted allgather on the active group)."""
    import torch

    flat = torch.cat([p.detach().reshape(-1) for p in trainer.raw_model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(trainer.membership.size)]
    dist.all_gather(everyone, flat, group=trainer.membership.group)
    return everyone


def _fit_here(cfg: dict, run_dir: str) -> int:
    """A whole run in this worker process, leaving its process group up for the next one; returns its rank."""
    from engine.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    trainer.fit()
    trainer.recorder.close()
    return trainer.rank


def fit_saving(cfg: dict, run_dir: str, stem: str, log: dict) -> None:
    """:func:`_fit_here`, then ``log`` (filled while it ran) saved to ``<run_dir>/<stem>_rank<r>.pt``."""
    import torch

    rank = _fit_here(cfg, run_dir)
    torch.save(log, os.path.join(run_dir, f"{stem}_rank{rank}.pt"))


def _each(run_dir: str, run) -> None:
    """``run(config, <run_dir>/<name>)`` for every config of ``<run_dir>/configs.json`` (``{name: resolved
    config}``, one world size), one after another in these worker processes."""
    import json

    with open(os.path.join(run_dir, "configs.json")) as f:
        configs = json.load(f)
    for name, config in configs.items():
        run(config, os.path.join(run_dir, name))
    dist.destroy_process_group()


@record
def each_config(cfg: dict, run_dir: str) -> None:
    """Every config of ``configs.json`` trained side by side in one launch (see ``conftest.train_each``)."""
    _each(run_dir, _fit_here)


@record
def uninterrupted_and_resumed(cfg: dict, run_dir: str) -> None:
    """For every case in ``<run_dir>/cases.json`` (``{name: resolved config}``, one world size): an uninterrupted
    run in ``<name>/full`` that keeps a copy of every checkpoint file under ``checkpoints/step<N>/``, then a run in
    ``<name>/resumed`` that starts from the copy of step ``resume_step`` with ``trainer.resume=auto``. All cases
    run in these same worker processes, one after another (a new Trainer, membership and sync each time)."""
    import json
    import shutil

    from engine import checkpoint

    save_atomic = checkpoint.save_atomic

    def save_and_keep(state: dict, path: str, keep_previous: bool = False) -> None:
        save_atomic(state, path, keep_previous)
        kept = os.path.join(os.path.dirname(path), f"step{state['step']}")
        os.makedirs(kept, exist_ok=True)
        shutil.copy(path, kept)

    with open(os.path.join(run_dir, "cases.json")) as f:
        spec = json.load(f)
    rank = int(os.environ["RANK"])
    for name, case in spec["cases"].items():
        full, resumed = os.path.join(run_dir, name, "full"), os.path.join(run_dir, name, "resumed")
        checkpoint.save_atomic = save_and_keep
        _fit_here(case, full)
        checkpoint.save_atomic = save_atomic
        # Each rank copies what it wrote: its own sync state, and the logging rank the checkpoint too.
        kept = os.path.join(full, "checkpoints", f"step{spec['resume_step']}")
        os.makedirs(os.path.join(resumed, "checkpoints"), exist_ok=True)
        for file in os.listdir(kept):
            if file == f"sync_rank{rank}.pt" or (file == checkpoint.LAST and rank == 0):
                shutil.copy(os.path.join(kept, file), os.path.join(resumed, "checkpoints", file))
        dist.barrier()
        _fit_here({**case, "trainer": {**case["trainer"], "resume": "auto"}}, resumed)
    dist.destroy_process_group()


@record
def fail_on_rank1(cfg: dict, run_dir: str) -> None:
    """Rank 1 raises; rank 0 waits in a barrier that rank 1 never reaches."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    if int(os.environ["RANK"]) == 1:
        raise RuntimeError("injected failure on rank 1")
    dist.barrier()


@record
def die_mid_run(cfg: dict, run_dir: str) -> None:
    """A real training run in which rank 1 crashes (not slow) at step 3."""
    from engine.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    if trainer.rank == 1:
        original = trainer.sync.after_optimizer_step

        def crash(result):
            if result.step == 3:
                raise RuntimeError("worker died at step 3")
            return original(result)

        trainer.sync.after_optimizer_step = crash
    _fit(trainer)


@record
def dgc_with_overflow(cfg: dict, run_dir: str) -> None:
    """sync=dgc with amp=torch: rank 1's gradient gets an inf at step 3. Every rank records what it saw."""
    import json

    import torch

    from engine.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    seen = {"rank": trainer.rank}
    unscale, after_backward = trainer.amp.unscale, trainer.sync.after_backward

    def inject(optimizer):
        if trainer.rank == 1 and trainer.step == 3:
            next(trainer.raw_model.parameters()).grad.view(-1)[0] = float("inf")
        return unscale(optimizer)

    def watch(step, grads_finite):
        if step != 3:
            return after_backward(step, grads_finite)
        before = [t.clone() for t in (trainer.sync.u, trainer.sync.v)]
        report = after_backward(step, grads_finite)
        after = (trainer.sync.u, trainer.sync.v)
        seen.update(
            local_finite=grads_finite,
            agreed_finite=report.grads_finite,
            residuals_untouched=all(torch.equal(a, b) for a, b in zip(before, after)),
        )
        return report

    trainer.amp.unscale, trainer.sync.after_backward = inject, watch
    _fit(trainer)
    with open(f"{run_dir}/overflow_rank{seen['rank']}.json", "w") as f:
        json.dump(seen, f)


@record
def localsgd_watch_replicas(cfg: dict, run_dir: str) -> None:
    """Record, after every optimizer step, whether all replicas hold identical parameters, and whether the
    step averaged them. Uses its own uncounted allgather on the active group."""
    import json

    import torch

    from engine.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    log = []
    after = trainer.sync.after_optimizer_step

    def watch(result):
        report = after(result)
        everyone = _all_params(trainer)
        identical = all(torch.equal(everyone[0], other) for other in everyone[1:])
        log.append({"step": result.step, "synced": bool(report.metrics.get("synced")), "identical": identical})
        return report

    trainer.sync.after_optimizer_step = watch
    _fit(trainer)
    if trainer.rank == 0:
        with open(f"{run_dir}/replicas.json", "w") as f:
            json.dump(log, f)


@record
def gossip_from_spread_replicas(cfg: dict, run_dir: str) -> None:
    """For every config of ``configs.json``: gossip with the LR at 0 from replicas made different on purpose;
    record, after every step, each rank's distance to the initial average and the sum of the push-sum weights
    (with SGP's overlap, the weights of the messages still in flight included)."""
    _each(run_dir, _spread_and_watch)


def _spread_and_watch(cfg: dict, run_dir: str) -> None:
    import json

    import torch

    from engine.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    trainer.schedule.scale = 0.0  # no gradient steps: only gossip moves the parameters
    group, sync = trainer.membership.group, trainer.sync
    with torch.no_grad():
        g = torch.Generator().manual_seed(100 + trainer.rank)
        for p in trainer.raw_model.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.raw_model.parameters()])
    average = flat.clone()
    dist.all_reduce(average, group=group)
    average /= trainer.membership.size
    log = []
    after = sync.after_optimizer_step

    def watch(result):
        report = after(result)
        now = torch.cat([p.detach().reshape(-1) for p in trainer.raw_model.parameters()])
        in_flight = sum(float(r.message[-1]) for r in getattr(sync, "_in_flight", []) if hasattr(r, "message"))
        weights = torch.tensor([getattr(sync, "weight", 1.0) + in_flight], dtype=torch.float64)
        dist.all_reduce(weights, group=group)
        log.append({"step": result.step, "error": float((now - average).abs().max()), "weight_sum": float(weights)})
        return report

    sync.after_optimizer_step = watch
    trainer.fit()
    trainer.recorder.close()
    with open(f"{run_dir}/gossip_rank{trainer.rank}.json", "w") as f:
        json.dump(log, f)


@record
def crossover_watch(cfg: dict, run_dir: str) -> None:
    """For every config of ``configs.json``: record every point-to-point exchange (segment sizes, peers) and,
    after every step, whether this rank's parameters equal those of every other rank of its group."""
    _each(run_dir, _crossover_watch)


def _crossover_watch(cfg: dict, run_dir: str) -> None:
    import json

    import torch

    from engine.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    sync, comm = trainer.sync, trainer.comm
    rounds, same_in_group = [], []
    exchange = comm.exchange

    def watch_exchange(sends, recvs, mean_fraction=1.0):
        rounds.append(
            {
                "step": trainer.step,
                "sends": [[int(t.numel()), int(peer)] for t, peer in sends],
                "recvs": [[int(t.numel()), int(peer)] for t, peer in recvs],
            }
        )
        return exchange(sends, recvs, mean_fraction)

    after = sync.after_optimizer_step

    def watch_step(result):
        report = after(result)
        everyone = _all_params(trainer)
        group = [trainer.membership.ranks.index(r) for r in sync.my_group]
        same_in_group.append(all(torch.equal(everyone[group[0]], everyone[i]) for i in group))
        return report

    comm.exchange, sync.after_optimizer_step = watch_exchange, watch_step
    trainer.fit()
    trainer.recorder.close()
    comm.exchange = exchange
    with open(f"{run_dir}/crossover_rank{trainer.rank}.json", "w") as f:
        json.dump({"rounds": rounds, "same_in_group": same_in_group, "segments": len(sync.ranges)}, f)


@record
def slow_link_on_rank2(cfg: dict, run_dir: str) -> None:
    """For every config of ``configs.json`` (one evicting rank 2, if any, last): rank 2's point-to-point
    transfers take 0.3 s longer, in both directions: its peers wait for its sends, and it waits before
    receiving. Its compute is as fast as anyone's (a slow network link, not a slow host)."""
    _each(run_dir, _slow_link_run)


def _slow_link_run(cfg: dict, run_dir: str) -> None:
    import time

    from engine.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    if trainer.rank == 2:
        original = trainer.comm.exchange

        def slow_exchange(sends, recvs, mean_fraction=1.0):
            time.sleep(0.3)
            return original(sends, recvs, mean_fraction)

        trainer.comm.exchange = slow_exchange
    trainer.fit()
    trainer.recorder.close()


@record
def killed_once_at_step_7(cfg: dict, run_dir: str) -> None:
    """A real run in which rank 1 is killed (SIGKILL, as by the OOM killer) after step 7, in the first attempt only."""
    import signal

    from engine.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    if trainer.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        original = trainer.sync.after_optimizer_step

        def kill(result):
            if result.step == 7:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(result)

        trainer.sync.after_optimizer_step = kill
    _fit(trainer)


@record
def writes_its_pid(cfg: dict, run_dir: str):
    """``run_worker``, after writing this process's pid to ``<run_dir>/pid<rank>`` (for tests that signal a worker)."""
    from engine.worker import run_worker

    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, f"pid{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    return run_worker(cfg, run_dir)


@record
def rank2_stops_in_first_evaluation(cfg: dict, run_dir: str) -> None:
    """A real run whose rank 2 stops itself (SIGSTOP, as a hang) as the first evaluation begins, after writing
    its pid to ``<run_dir>/pid2`` for the test to continue it."""
    import signal

    from engine.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    if trainer.rank == 2:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "pid2"), "w") as f:
            f.write(str(os.getpid()))
        original = trainer.evaluate

        def hang_then_evaluate(epoch):
            if epoch == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            return original(epoch)

        trainer.evaluate = hang_then_evaluate
    _fit(trainer)


@record
def guard_bookkeeping(cfg: dict, run_dir: str) -> None:
    """For every config of ``configs.json``: train, then record which failure guard the trainer used and what it kept
    (its attributes, the recorder's observers, the records in its history) in ``<run>/guard_rank<r>.json``."""
    _each(run_dir, _guard_bookkeeping)


def _guard_bookkeeping(cfg: dict, run_dir: str) -> None:
    import json

    from engine.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    trainer.fit()
    trainer.elastic.stop()  # (its heartbeat thread; the process group stays up for the next config)
    trainer.recorder.close()
    guard = getattr(trainer.elastic, "guard", trainer.elastic)
    seen = {
        "guard": type(guard).__name__,
        "attributes": sorted(vars(guard)),
        "observers": len(trainer.recorder.observers),
        "history": [[at.step, at.phase.value, r["kind"]] for at, r in getattr(guard, "history", [])],
    }
    with open(os.path.join(run_dir, f"guard_rank{trainer.rank}.json"), "w") as f:
        json.dump(seen, f)


ENV_PROBES = ("RELAXSYNC_PROBE_CHANGED", "RELAXSYNC_PROBE_REMOVED", "RANK", "LOCAL_RANK")


@record
def report_environment(cfg: dict, run_dir: str) -> dict:
    """What a local worker sees of the environment."""
    return {key: os.environ.get(key) for key in ENV_PROBES}


@record
def joined_and_resumed(cfg: dict, run_dir: str) -> None:
    """Three processes; for every case in ``<run_dir>/cases.json``: ranks 0 and 1 train in ``<name>/joined`` and
    admit the third process (``trainer.join=true``) mid-run, keeping a copy of the checkpoint they write at the
    admission step; then all three resume that copy in ``<name>/resumed`` as one world of 3. Each run's default
    group is made here on a store prefix of its own (two worlds of different sizes in one launch)."""
    import itertools
    import json
    import shutil
    import time

    import distributed.membership as membership_module
    from engine.elastic.records import JoinFile
    from engine.loop import Trainer

    with open(os.path.join(run_dir, "cases.json")) as f:
        cases = json.load(f)["cases"]
    rank = int(os.environ["RANK"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)

    def world(name: str, size: int) -> None:
        os.environ["WORLD_SIZE"] = str(size)
        dist.init_process_group("gloo", store=dist.PrefixStore(name, base), rank=rank, world_size=size)

    def all_three(name: str) -> None:
        base.add(name, 1)
        while int(base.add(name, 0)) < 3:
            time.sleep(0.05)

    for i, (name, case) in enumerate(cases.items()):
        joined, resumed = os.path.join(run_dir, name, "joined"), os.path.join(run_dir, name, "resumed")
        kept = os.path.join(resumed, "checkpoints")
        os.makedirs(kept, exist_ok=True)
        membership_module._instances = itertools.count(1000 * i)  # (every process: the same membership keys)
        if rank < 2:
            world(f"{name}/joined", 2)
            trainer = Trainer({**case, "trainer": {**case["trainer"], "run_dir": joined}}, joined)
            admit = trainer.elastic.admit

            def admit_after_a_checkpoint(decision, epoch, trainer=trainer, admit=admit, kept=kept):
                trainer.save_checkpoint(epoch)
                written = os.path.dirname(trainer.checkpointer.path)
                for file in (f"sync_rank{rank}.pt", "last.pt" if rank == 0 else None):
                    if file and os.path.exists(os.path.join(written, file)):  # (no file: no state of its own)
                        shutil.copy(os.path.join(written, file), kept)
                admit(decision, epoch)

            trainer.elastic.admit = admit_after_a_checkpoint
            if rank == 0:
                JoinFile.of(trainer.membership).write(joined)
            tickets = trainer.membership.key("join/tickets")
            while int(trainer.membership.store.add(tickets, 0)) < 1:  # the third one asked: admitted at step 2
                time.sleep(0.05)
        else:
            while not os.path.exists(JoinFile.path(joined)):
                time.sleep(0.05)
            trainer = Trainer({**case, "trainer": {**case["trainer"], "join": True, "run_dir": joined}}, joined)
        _fit(trainer)
        all_three(f"{name}/joined/done")
        membership_module._instances = itertools.count(1000 * i + 500)
        world(f"{name}/resumed", 3)
        _fit(Trainer({**case, "trainer": {**case["trainer"], "resume": "auto", "run_dir": resumed}}, resumed))
        all_three(f"{name}/resumed/done")


@record
def auto_switch_walk(cfg: dict, run_dir: str) -> None:
    """sync=auto made to switch, once its probe has decided, to ``<run_dir>/walk.json``'s first candidate and then
    every 2 steps to the next; after each switch, record whether every replica holds identical parameters, and
    before it whether they still did after the option's 2 steps."""
    import json

    import torch

    from engine.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    with open(f"{run_dir}/walk.json") as f:
        walk = json.load(f)
    auto, log = trainer.sync, []
    after = auto.after_optimizer_step

    def walk_on(result):
        report = after(result)
        steps, at = result.step + 1, len(log) + 1
        since = steps - auto.probe_steps
        if since == 0 and auto.key != walk[0]:
            auto._switch(walk[0])
        elif since > 0 and since % 2 == 0 and at < len(walk):
            before, running = auto.key, auto.inner
            everyone = _all_params(trainer)  # (2 steps of the option since the switch into it)
            stayed = all(torch.equal(everyone[0], other) for other in everyone[1:])
            auto._switch(walk[at])
            everyone = _all_params(trainer)
            identical = all(torch.equal(everyone[0], other) for other in everyone[1:])
            # (relaxed sync put around the option running, or taken off it: that option goes on, with its state)
            kept = getattr(auto.inner, "inner", None) is running or getattr(running, "inner", None) is auto.inner
            log.append(
                {"step": result.step, "from": before, "to": auto.key, "identical": identical, "stayed": stayed,
                 "kept": kept}
            )  # fmt: skip
        return report

    auto.after_optimizer_step = walk_on
    _fit(trainer)
    if trainer.rank == 0:
        with open(f"{run_dir}/switches.json", "w") as f:
            json.dump(log, f)


@record
def spurious_failure(cfg: dict, run_dir: str) -> None:
    """A real run in which rank 1 raises, once, a ``RuntimeError`` as a failed collective does, in the part of the
    loop ``$SPURIOUS_PHASE`` names (step, exchange, evaluation, checkpoint, epoch boundary; settle: just after the
    replicas' settle before an evaluation completed on every rank) at step 5 or after, with every rank alive: an
    alarm that finds nobody gone."""
    from engine.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    phase, fired = os.environ["SPURIOUS_PHASE"], []

    def once(original, when=lambda *a: True, after=False):
        def part(*args, **kwargs):
            if not fired and trainer.step >= 5 and when(*args):
                fired.append(trainer.step)
                if after:  # (its collective completed everywhere; only this rank takes it for failed)
                    original(*args, **kwargs)
                raise RuntimeError(f"a collective of rank 1 failed on its own ({phase})")
            return original(*args, **kwargs)

        return part

    if trainer.rank == 1:
        if phase == "step":
            trainer.sync.before_step = once(trainer.sync.before_step)
        elif phase == "exchange":
            trainer.sync.after_optimizer_step = once(trainer.sync.after_optimizer_step)
        elif phase == "evaluation":
            trainer.evaluate = once(trainer.evaluate)
        elif phase == "checkpoint":
            trainer.save_checkpoint = once(trainer.save_checkpoint)
        elif phase == "epoch boundary":
            trainer.sync.on_epoch_start = once(trainer.sync.on_epoch_start)
        elif phase == "settle":
            trainer.sync.before_eval = once(trainer.sync.before_eval, after=True)
    _fit(trainer)
