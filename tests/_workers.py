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
