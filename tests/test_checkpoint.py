"""Checkpoint faults lose nothing: a process killed while writing, a full disk, a file that cannot be read."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT, records, train

from engine import checkpoint as ckpt


def _saved_twice(run_dir: Path) -> ckpt.Checkpointer:
    """A run dir whose logging rank checkpointed at step 4, then at step 8, with its own sync state each time."""
    saver = ckpt.Checkpointer(str(run_dir), 0, 1, None)
    for step in (4, 8):
        saver.save({"step": step, "w": torch.full((3,), float(step))}, {"residual": torch.ones(2) * step}, step, None)
    return saver


def _killed_while_saving(run_dir: Path, moment: str) -> subprocess.CompletedProcess:
    """A process that checkpoints at step 4 and is killed (SIGKILL) while it writes the one of step 8: halfway
    through the file, or between the two renames of the write (the old one kept, the new one not yet in place)."""
    script = textwrap.dedent(f"""
        import os, signal, torch
        from engine import checkpoint as ckpt
        saver = ckpt.Checkpointer({str(run_dir)!r}, 0, 1, None)
        saver.save({{"step": 4, "w": torch.full((3,), 4.0)}}, {{}}, 4, None)
        def die():
            os.kill(os.getpid(), signal.SIGKILL)
        if {moment!r} == "mid-write":
            def half(obj, f):
                f.write(b"PK" + b"x" * 4096)
                f.flush()
                die()
            torch.save = half
        else:
            replace = os.replace
            def once_then_die(src, dst):
                replace(src, dst)
                die()
            os.replace = once_then_die
        saver.save({{"step": 8, "w": torch.full((3,), 8.0)}}, {{}}, 8, None)
    """)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.parametrize("moment", ["mid-write", "between the renames"])
def test_a_process_killed_while_checkpointing_leaves_the_checkpoint_before_and_resume_uses_it(tmp_path, moment):
    proc = _killed_while_saving(tmp_path, moment)
    assert proc.returncode == -signal.SIGKILL
    resumer = ckpt.Checkpointer(str(tmp_path), 0, 1, "auto")
    state = resumer.load()
    assert state["step"] == 4 and torch.equal(state["w"], torch.full((3,), 4.0))
    expected = ckpt.LAST if moment == "mid-write" else ckpt.PREVIOUS
    assert os.path.basename(resumer.resume_path) == expected
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the killed write's leftover, removed at start


def test_a_full_disk_is_one_clear_error_and_the_checkpoint_before_it_is_intact(tmp_path, monkeypatch):
    saver = _saved_twice(tmp_path)

    def no_space(obj, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(ckpt.CheckpointError) as raised:
        saver.save({"step": 12}, {"residual": torch.zeros(2)}, 12, None)
    monkeypatch.undo()
    message = str(raised.value)
    assert message.startswith("no space left to write ") and "\n" not in message
    assert "sync_rank0.pt" in message and "MiB free" in message and "trainer.resume=auto" in message
    assert not isinstance(raised.value, RuntimeError)  # never taken for a lost peer under on_failure=continue
    resumer = ckpt.Checkpointer(str(tmp_path), 0, 1, "auto")
    assert resumer.load()["step"] == 8 and resumer.load_local(8)[0]["residual"].tolist() == [8.0, 8.0]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["last.pt", "previous.pt", "sync_rank0.previous.pt", "sync_rank0.pt"]  # no temporary file


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_an_unreadable_last_checkpoint_is_named_and_auto_resume_falls_back_to_the_one_before(tmp_path, damage):
    _saved_twice(tmp_path)
    last = tmp_path / "checkpoints" / "last.pt"
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2] if damage == "truncated" else data[:100] + b"\0" * 64 + data[164:])

    resumer = ckpt.Checkpointer(str(tmp_path), 0, 1, "auto")
    state = resumer.load()
    assert state["step"] == 4 and resumer.resume_path.endswith("previous.pt")
    assert resumer.load_local(4)[0]["residual"].tolist() == [4.0, 4.0]  # this rank's own state of that step
    event, line = resumer.resumed(None, 1, types.SimpleNamespace(step=4, epoch=0), 1)
    assert event["path"].endswith("previous.pt") and event["unreadable"].startswith(f"cannot read checkpoint {last}")
    assert f"of {resumer.resume_path} (cannot read checkpoint {last}" in line

    explicit = ckpt.Checkpointer(str(tmp_path), 0, 1, str(last))
    with pytest.raises(ckpt.CheckpointError, match=f"cannot read checkpoint {last}.*the one before it: "):
        explicit.load()


def test_with_no_checkpoint_before_it_an_unreadable_one_is_an_error_naming_it(tmp_path):
    path = tmp_path / "checkpoints" / "last.pt"
    ckpt.save_atomic({"step": 4}, str(path))
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(ckpt.CheckpointError, match=f"cannot read checkpoint {path}"):
        ckpt.Checkpointer(str(tmp_path), 0, 1, "auto").load()


@pytest.mark.full  # ~12 s; make test: the fallback itself, named in the event and the line (the test above)
def test_a_run_resumes_from_the_checkpoint_before_an_unreadable_last_one_and_finishes(tmp_path):
    """A real run checkpoints every 4 steps; its last checkpoint is then truncated: ``trainer.resume=auto`` names it,
    goes on from the one before (step 8 of 12) and finishes."""
    common = [*FAST, "trainer.nproc=2", "data.num_samples=768", "trainer.epochs=2", "trainer.checkpoint_every_steps=4"]
    train(tmp_path, *common, "trainer.max_steps=12")
    last = tmp_path / "checkpoints" / "last.pt"
    assert torch.load(last, weights_only=True)["step"] == 12
    last.write_bytes(last.read_bytes()[:1000])
    _, metrics = train(tmp_path, *common, "trainer.resume=auto")
    resume = [e for e in records(metrics, "event") if e["event"] == "resume"][-1]
    assert resume["path"].endswith("previous.pt") and resume["unreadable"].startswith(f"cannot read checkpoint {last}")
    summaries = records(metrics, "summary")
    assert summaries[-1]["finished"] and summaries[-1]["steps"] == 24
    log = (tmp_path / "train.log").read_text()
    assert "resumed from step 8 (epoch 1 of 2) of " in log and f"(cannot read checkpoint {last}" in log
