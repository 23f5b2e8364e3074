"""Worker entry points for launcher tests (importable by spawned workers)."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


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

        def crash(step: int):
            if step == 3:
                raise RuntimeError("worker died at step 3")
            return original(step)

        trainer.sync.after_optimizer_step = crash
    try:
        trainer.fit()
    finally:
        trainer.close()


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
    try:
        trainer.fit()
    finally:
        trainer.close()
    with open(f"{run_dir}/overflow_rank{seen['rank']}.json", "w") as f:
        json.dump(seen, f)
