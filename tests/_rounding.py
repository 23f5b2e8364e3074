"""What two float32 computations of the same step may differ by on any CPU, for the tests that compare two different
computations (one algorithm with another, one process with two); and worker entry points for them.

Every float32 operation is correctly rounded on every x86 CPU, to within 2^-24 of its result (half an ulp), whatever
the vector width or fused multiply-adds; but two computations of the same update in another order round differently,
and training amplifies the difference from step to step, by a factor that depends on the model, the data and the CPU
(at sparsity 0, DGC and allreduce are 1.5e-8 apart after one step and 3.5e-4 after six on one Xeon). So these tests
never compare after several steps of training: they compare after the one step in which the two computations differ
(:func:`assert_one_update_apart`), or they check every exchange of a longer run against its own inputs
(:func:`each_config_checking_averages`), or they feed an algorithm fixed gradients and follow a bound of the rounding
over the steps (tests/test_dgc.py). A resumed run against an uninterrupted one repeats the very same operations in
the same order and may be compared bit for bit instead.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

EPS = 2.0**-24  # float32's unit roundoff: the largest relative error of one correctly rounded operation
ONE_UPDATE = 1e-6  # about 16 x EPS, relative to a tensor's largest entry: see assert_one_update_apart


def assert_one_update_apart(
    a: dict[str, torch.Tensor],
    b: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor] | None = None,
    sums: float = 0.0,
    skip: tuple[str, ...] = (),
) -> None:
    """``a`` and ``b`` (state dicts) are two computations of the same single update from the same parameters.

    When the two compute the same gradients and differ only in the elementwise arithmetic of the update (where weight
    decay is added, averaging gradients or parameters, a momentum buffer that is the gradient on the first step),
    each entry passes through at most ~5 different float32 roundings, each within EPS of an operand that is, in these
    runs, no larger than the tensor's largest entry: ``ONE_UPDATE`` (16 EPS) of that entry bounds it with room to
    spare (1.5 ulp measured). When the gradients themselves are sums the two split differently (a batch of 2B in one
    process against two of B averaged), their rounding is relative to the sums instead: ``sums`` bounds the difference
    as a fraction of the tensor's largest update, ``|a - initial|``. Floating-point entries whose name contains one of
    ``skip`` are left out."""
    assert a.keys() == b.keys()
    for name, x in a.items():
        y = b[name]
        if not x.is_floating_point() or any(s in name for s in skip):
            continue
        bound = ONE_UPDATE * float(torch.maximum(x.abs(), y.abs()).max())
        if initial is not None:
            bound += sums * float((x.double() - initial[name].double()).abs().max())
        torch.testing.assert_close(x, y, rtol=0, atol=bound, msg=lambda m, name=name: f"{name}: {m}")


@record
def keeps_initial_parameters(cfg: dict, run_dir: str) -> None:
    """A whole run, after the logging rank saved the initial model state to ``<run_dir>/initial.pt``."""
    from engine.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    if trainer.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        torch.save(trainer.raw_model.state_dict(), os.path.join(run_dir, "initial.pt"))
    try:
        trainer.fit()
    finally:
        trainer.close()


@record
def each_config_checking_averages(cfg: dict, run_dir: str) -> None:
    """For every config of ``configs.json`` (see ``conftest.train_each``): around every ``after_optimizer_step``, each
    rank gathers every rank's parameters and floating-point buffers (uncounted), and records in
    ``<run_dir>/<name>/averages_rank<r>.json`` whether the hook changed its own, and how far they are then from the
    float64 average of everyone's before the hook, in units of EPS times the largest magnitude it averaged (each
    rank's entry before, and the entry after the previous change: the anchor an outer optimizer subtracts from)."""
    from _workers import _each

    _each(run_dir, _check_averages)


def _check_averages(cfg: dict, run_dir: str) -> None:
    from engine.loop import Trainer

    trainer = Trainer(cfg, run_dir)
    group, after = trainer.membership.group, trainer.sync.after_optimizer_step
    model = trainer.raw_model

    def flat() -> torch.Tensor:
        tensors = [p.detach() for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
        return torch.cat([t.reshape(-1) for t in tensors]).clone()

    anchor, log = flat(), []

    def watch(result):
        nonlocal anchor
        before = flat()
        everyone = [torch.empty_like(before) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, before, group=group)
        report = after(result)
        now = flat()
        stacked = torch.stack([e.double() for e in everyone])
        magnitude = torch.maximum(stacked.abs().amax(0), anchor.double().abs())
        error = (now.double() - stacked.mean(0)).abs()
        moved = not torch.equal(now, before)
        log.append(
            {
                "step": result.step,
                "moved": moved,
                "replicas_differed": any(not torch.equal(everyone[0], e) for e in everyone[1:]),
                "error_eps": float((error / (EPS * magnitude).clamp_min(torch.finfo(torch.float64).tiny)).max()),
            }
        )
        if moved:
            anchor = now
        return report

    trainer.sync.after_optimizer_step = watch
    trainer.fit()
    trainer.recorder.close()
    with open(os.path.join(run_dir, f"averages_rank{trainer.rank}.json"), "w") as f:
        json.dump(log, f)
