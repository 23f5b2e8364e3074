"""The run's summary: what this invocation's train records add up to (:class:`StepStats`), the ``summary`` record
(:func:`run_summary`) and the console block that ends a run (:func:`format_summary`).
"""

from __future__ import annotations

import os
import statistics
from typing import Any


class StepStats:
    """What the train records of this invocation add up to."""

    def __init__(self):
        self.count, self.bytes_sent, self.comm_s = 0, 0.0, 0.0
        self.samples_per_s: list[float] = []

    def add(self, record: dict[str, Any]) -> None:
        self.count += 1
        self.bytes_sent += record["bytes_sent"]
        self.comm_s += record["comm_s"]
        self.samples_per_s.append(record["samples_per_s"])

    def summary(self) -> dict[str, float | None]:
        """Median samples/s of a step, and bytes sent and seconds communicating per step (means per rank)."""
        if not self.count:
            return {"samples_per_s": None, "bytes_per_step": None, "comm_s_per_step": None}
        return {
            "samples_per_s": statistics.median(self.samples_per_s),
            "bytes_per_step": self.bytes_sent / self.count,
            "comm_s_per_step": self.comm_s / self.count,
        }


def run_summary(run: Any, membership: Any, totals: Any, steps: StepStats, lost_ranks: list[int], **fields: Any):
    """The summary record of an invocation at ``run`` (an ``engine.state.RunState``) whose active ranks are
    ``membership``'s, with ``totals`` of traffic, this invocation's ``steps`` and the ``lost_ranks``; ``fields``:
    finished, replica_spread, stopped_by, train_s, num_params, reached_target, and syncs (sync=auto's decisions)."""
    m, last, best = membership, run.last_eval or {}, run.best_eval or {}
    gone = set(range(m.initial_size)) - set(m.ranks)
    return {
        "kind": "summary",
        "finished": fields["finished"],
        "steps": run.step,
        "epochs": run.epoch,  # completed
        "epoch": run.last_epoch,
        "world_size": m.size,
        "initial_world_size": m.initial_size,
        "ranks": m.ranks,
        "evictions": m.initial_size - m.size - len(lost_ranks),
        "evicted_ranks": sorted(gone - set(lost_ranks)),
        "lost_ranks": sorted(lost_ranks),  # died or hung (trainer.on_failure: continue)
        "replica_spread": fields["replica_spread"],
        "stopped_by": fields["stopped_by"],
        "train_s": fields["train_s"],
        "steps_this_run": steps.count,
        **steps.summary(),
        "bytes_sent": totals.bytes_sent,
        "payload_bytes": totals.payload_bytes,
        "comm_s": totals.comm_s,
        "num_params": fields["num_params"],
        "top1": last.get("top1"),
        "top5": last.get("top5"),
        "val_loss": last.get("loss"),
        "best_top1": best.get("top1"),
        "best_epoch": best.get("epoch"),
        "reached_target": fields["reached_target"],
        "syncs": fields.get("syncs", []),
        # image files every rank skipped in this invocation (data.on_bad_file=skip), and connections to the ranks'
        # ports refused for not proving the run's secret, as its last evaluation counted them
        "skipped_files": last.get("skipped_files", 0),
        "rejected_connections": last.get("rejected_connections", 0),
    }


def format_summary(summary: dict[str, Any], trainer: dict[str, Any], run_dir: str) -> str:
    """The console block that ends a run (``trainer`` is the trainer section of the config)."""
    s, of = summary, f"of {trainer['epochs']}"
    if s.get("stopped_by"):
        head = f"stopped by {s['stopped_by']} at step {s['steps']} in epoch {s['epoch']} {of}"
    elif not s["finished"]:
        head = (
            f"stopped after epoch {s['epoch']} {of} (trainer.max_epochs_per_run={trainer['max_epochs_per_run']}) "
            f"at step {s['steps']}"
        )
    elif trainer["max_steps"] is not None and s["steps"] >= trainer["max_steps"]:
        head = f"finished at step {s['steps']} (trainer.max_steps) in epoch {s['epoch']} {of}"
    else:
        head = f"finished epoch {s['epoch']} {of} at step {s['steps']}"
    lines = [f"relaxsync: {head}; {s['steps_this_run']} steps in {_duration(s['train_s'])} this run"]
    if s["top1"] is not None:
        best = f", best {s['best_top1']:.2f}% (epoch {s['best_epoch']})" if s["best_top1"] is not None else ""
        lines.append(f"  top-1     {s['top1']:.2f}% final{best}; top-5 {s['top5']:.2f}%")
    if s["samples_per_s"] is not None:
        lines.append(
            f"  speed     {s['samples_per_s']:.0f} samples/s (median step); "
            f"{s['comm_s_per_step']:.3f} s/step communicating"
        )
        lines.append(
            f"  traffic   {_bytes(s['bytes_per_step'])} sent per rank and step, {_bytes(s['bytes_sent'])} in all"
        )
    switches = [c for c in s.get("syncs", []) if c["option"] != c["previous"]]
    if switches:
        chosen = "; ".join(f"{c['option']} from step {c['at_steps']} ({c['why']})" for c in switches)
        lines.append(f"  sync      auto: {chosen}")
    if s.get("skipped_files"):
        lines.append(f"  data      {s['skipped_files']} unreadable files skipped (file_skipped events)")
    if s.get("rejected_connections"):
        lines.append(f"  network   {s['rejected_connections']} connections to the ranks' ports refused (no run secret)")
    evicted = ", ".join(str(r) for r in s["evicted_ranks"]) or "none"
    lost = f"; lost: {', '.join(str(r) for r in s['lost_ranks'])}" if s.get("lost_ranks") else ""
    lines.append(f"  ranks     {s['world_size']} of {s['initial_world_size']} at the end; evicted: {evicted}{lost}")
    lines.append(f"  run dir   {shown(run_dir)}")
    if not s["finished"]:
        lines.append(f"  continue  the same command with: trainer.resume=auto trainer.run_dir={shown(run_dir)}")
    return "\n".join(lines)


def shown(path: str) -> str:
    """``path`` relative to the working directory when it is below it, else absolute."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def banner(model: dict[str, Any], device: Any, world_size: int, num_params: int, sync: str, steps_per_epoch: int,
           batch_size: int, run_dir: str) -> str:  # fmt: skip
    """The console line that starts a run."""
    # (imported here: reading records, this module's other use, needs no timm)
    from engine.launchers import launcher_name
    from models.factory import compile_mode, uses_channels_last

    features = [f"{num_params / 1e6:.2f} M params"] + ["channels_last"] * uses_channels_last(model, device)
    features += [f"compiled ({model['compile_backend']})"] if compile_mode(model) else []
    return (
        f"relaxsync: {world_size} x {device.type} ({launcher_name()}), model {model['name']} ({', '.join(features)}), "
        f"sync {sync}, {steps_per_epoch} steps/epoch, global batch {batch_size * world_size}, run dir {shown(run_dir)}"
    )
