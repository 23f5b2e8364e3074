"""Every option of every config group composes and validates; bad input fails early with a clear message."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CONF_DIR, ROOT, compose_cfg, plain_cfg, run_cli

from engine.config import prepare
from errors import ConfigError

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]


def _fill_required(group: str, option: str, tmp_path: Path, digits_imagefolder: Path) -> list[str]:
    if (group, option) == ("data", "imagefolder"):
        return [f"data.root={digits_imagefolder}"]
    if (group, option) == ("data", "cifar10"):
        (tmp_path / "cifar-10-batches-py").mkdir()
        return [f"data.root={tmp_path}"]
    return []


def test_every_group_has_options():
    assert {"model", "optimizer", "schedule", "amp", "sync", "data", "logger"} <= set(GROUPS)
    assert len(OPTIONS) >= 20


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_validates(group, option, tmp_path, digits_imagefolder):
    overrides = [f"{group}={option}", *_fill_required(group, option, tmp_path, digits_imagefolder)]
    cfg = compose_cfg(*overrides)
    if (group, option) == ("amp", "apex"):
        from engine.amp import probe_apex

        if probe_apex() is not None:  # the usual case: no NVIDIA apex or no CUDA here
            with pytest.raises(ConfigError, match="amp='apex'"):
                prepare(cfg)
            return
    plain = prepare(cfg)
    assert "hydra" not in plain
    if group in ("model", "optimizer", "schedule", "sync", "amp", "data", "logger"):
        assert plain[group]  # the option put its keys in


BAD = [
    (["trainer.nproc=0"], "trainer.nproc", "0", "an integer >= 1"),
    (["optimizer.lr=-0.1"], "optimizer.lr", "-0.1", "a learning rate > 0"),
    (["data.batch_size=0"], "data.batch_size", "0", "an integer >= 1"),
    (["model.name=resnet_does_not_exist"], "model.name", "resnet_does_not_exist", "a timm model name"),
    (["amp=apex"], "amp", "apex", "NVIDIA apex"),
    (["data=imagefolder"], "data.root", "???", "this key is required"),
    (["data=imagefolder", "data.root=/no/such/folder"], "data.root", "/no/such/folder", "an existing directory"),
    (["data=cifar10", "data.root=/no/such/folder"], "data.root", "/no/such/folder", "cifar-10-batches-py"),
    (["data.rotate=-5"], "data.rotate", "-5", "degrees in [0, 180]"),
    (["data.translate=0.75"], "data.translate", "0.75", "a fraction of the side in [0, 0.5]"),
    (["data.scale=1"], "data.scale", "1", "a fraction in [0, 0.9]"),
    (["trainer.device=tpu"], "trainer.device", "tpu", "one of auto, cpu, cuda"),
    (["trainer.resume=/no/such.pt"], "trainer.resume", "/no/such.pt", "an existing checkpoint file"),
    (["optimizer=momentum", "optimizer.momentum=1.5"], "optimizer.momentum", "1.5", "[0, 1)"),
    (["schedule.name=linear"], "schedule.name", "linear", "one of cosine, poly, step"),
    (["amp=torch", "amp.dtype=float8"], "amp.dtype", "float8", "one of auto, bfloat16, float16"),
    (["logger.mode=sometimes"], "logger.mode", "sometimes", "one of offline, online, disabled"),
    (["sync=allreduce", "sync.bucket_cap_mb=0"], "sync.bucket_cap_mb", "0", "a number of MiB > 0, or null"),
    (["sync=powersgd", "sync.bucket_cap_mb=true"], "sync.bucket_cap_mb", "True", "a number of MiB > 0, or null"),
    (["sync=relaxed", "sync.relaxed_sync_threshold=0.5"], "sync.relaxed_sync_threshold", "0.5", "a factor > 1"),
    (["sync=relaxed", "sync.relaxed_sync_mode_threshold=1.5"], "sync.relaxed_sync_mode_threshold", "1.5", "(0, 1]"),
    (["sync=relaxed", "sync.relaxed_sync_mode_threshold=0"], "sync.relaxed_sync_mode_threshold", "0", "(0, 1]"),
    (["sync=relaxed", "sync.min_num_processes=0"], "sync.min_num_processes", "0", "an integer in [1, 2]"),
    (["sync=relaxed", "sync.min_num_processes=3"], "sync.min_num_processes", "3", "an integer in [1, 2]"),
    (["sync=relaxed", "sync.reference=max"], "sync.reference", "max", "one of median, mean, min"),
    (["sync=relaxed", "sync.lr_policy=cube"], "sync.lr_policy", "cube", "one of linear, sqrt, none"),
    (["sync=relaxed", "sync.check_every=0"], "sync.check_every", "0", "epoch, or a number of steps >= 1"),
    (["sync=relaxed", "sync.measure=wall"], "sync.measure", "wall", "one of compute, link"),
    (["sync=relaxed", "sync.measure=link"], "sync.measure", "link", "compute with 2 processes"),
    (["sync=relaxed", "sync.link_probe_bytes=0"], "sync.link_probe_bytes", "0", "an integer number of bytes >= 1"),
    # an inner algorithm's bad value is named under sync.inner; a wrapper does not wrap another wrapper
    (["sync=relaxed", "sync@sync.inner=dgc", "sync.inner.sparsity=[2.0]"], "sync.inner.sparsity", "[2.0]", "[0, 1)"),
    (["sync=relaxed", "sync@sync.inner=relaxed"], "sync.inner", "RelaxedSync", "an exchange algorithm, not another"),
    (["trainer.netdev=nosuchnic0"], "trainer.netdev", "nosuchnic0", "null or a network interface of this machine ("),
    (["sync=dgc", "sync.sparsity=[1.0]"], "sync.sparsity", "[1.0]", "fractions in [0, 1)"),
    (["sync=dgc", "sync.sparsity=[]"], "sync.sparsity", "[]", "a non-empty list"),
    (["sync=dgc", "sync.sparsity=[0.9,0.5]"], "sync.sparsity", "[0.9, 0.5]", "an increasing list"),
    (["sync=dgc", "sync.rampup_step=0"], "sync.rampup_step", "0", "an integer >= 1"),
    (["sync=dgc", "sync.sample_ratio=0"], "sync.sample_ratio", "0", "a fraction in (0, 1]"),
    (["sync=dgc", "optimizer=lars"], "optimizer", "lars", "momentum or sgd with sync=dgc"),
    (["sync=dgc", "trainer.nproc=1"], "trainer.nproc", "1", "at least 2 processes"),
    (["sync=localsgd", "sync.k_steps=0"], "sync.k_steps", "0", "an integer >= 1"),
    (["sync=localsgd", "sync.begin_step=-1"], "sync.begin_step", "-1", "a step >= 0"),
    (
        ["sync=adaptive_localsgd", "sync.init_k_steps=8", "sync.max_k_steps=4"],
        "sync.max_k_steps",
        "4",
        ">= sync.init_k_steps",
    ),
    (["sync=sgp", "trainer.nproc=1"], "trainer.nproc", "1", "at least 2 processes"),
    (["sync=sgp", "sync.peers_per_itr=2"], "sync.peers_per_itr", "2", "fewer than the world size"),
    (["sync=crossover", "trainer.nproc=4", "sync.group_size=3"], "sync.group_size", "3", "a divisor of the world size"),
    (["sync=crossover", "sync.segments=999999999"], "sync.segments", "999999999", "an integer in [1,"),
    (
        ["sync=crossover", "model=test_vit", "sync.segments=coarse"],
        "sync.segments",
        "coarse",
        "an integer for test_vit",
    ),
    (["trainer.checkpoint_every_steps=0"], "trainer.checkpoint_every_steps", "0", "null or an integer >= 1"),
    (["trainer.eval_every_steps=0"], "trainer.eval_every_steps", "0", "null or an integer >= 1"),
    (["trainer.target_top1=101"], "trainer.target_top1", "101", "null or a top-1 % in (0, 100]"),
    (["trainer.max_restarts=-1"], "trainer.max_restarts", "-1", "an integer >= 0"),
    (["trainer.on_failure=retry"], "trainer.on_failure", "retry", "abort or continue"),
    (["trainer.hang_timeout_s=3600"], "trainer.hang_timeout_s", "3600", "below trainer.timeout_s (1800)"),
    (["straggler=sleep", "straggler.ranks=[5]"], "straggler.ranks", "[5]", "ranks in [0, 1]"),
    (["straggler=sleep", "straggler.slowdown=0.5"], "straggler.slowdown", "0.5", "a factor >= 1"),
    (["trainer.join=true"], "trainer.join", "True", "only with trainer.on_failure=continue"),
    (
        ["trainer.join=true", "trainer.on_failure=continue", "trainer.run_dir=/no/run"],
        "trainer.run_dir",
        "/no/run",
        "it holds join.json while it trains",
    ),
]


@pytest.mark.parametrize("overrides,key,value,allowed", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_names_key_value_and_allowed(overrides, key, value, allowed):
    from engine.amp import probe_apex

    if overrides == ["amp=apex"] and probe_apex() is None:
        pytest.skip("NVIDIA apex with CUDA is installed here, so amp=apex is valid")
    with pytest.raises(ConfigError) as info:
        plain_cfg(*overrides)
    message = str(info.value)
    assert message.startswith(f"{key}=")
    assert value in message
    assert allowed in message
    assert "\n" not in message


def test_bad_value_stops_before_any_worker(tmp_path):
    result = run_cli("trainer.nproc=0", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["error: trainer.nproc=0: expected an integer >= 1"]
    assert "relaxsync:" not in result.stdout  # the worker banner never printed
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_worker_server_is_stopped_at_exit_in_the_middle_of_its_imports(tmp_path):
    """train.py starts the workers' fork server before it validates, so that their imports overlap; a config error
    then ends the process while the server still imports. The server is stopped at exit, not left to finish its
    imports (the command returned only then): here its preload sleeps for 10 minutes, and the process ends at
    once, the server gone with it."""
    (tmp_path / "slow_preload.py").write_text("import time\ntime.sleep(600)\n")
    script = f"""
import os, sys
sys.path.insert(0, {str(tmp_path)!r})
import engine.launch as launch
launch.WORKER_PRELOAD = ["slow_preload"]
launch.start_worker_server()
import multiprocessing.forkserver
print(multiprocessing.forkserver._forkserver._forkserver_pid, flush=True)
sys.exit(2)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    server = int(result.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(server, 0)


def test_unknown_group_option_lists_the_options(tmp_path):
    result = run_cli("sync=nope", "trainer.epochs=2", f"hydra.run.dir={tmp_path}")  # a key beside it: still Hydra's
    assert result.returncode != 0
    assert "Could not find 'sync/nope'" in result.stderr
    assert re.search(r"Available options in .sync.:(\s+\w+)*\s+allreduce\s", result.stderr)


def test_apex_error_says_what_is_missing_and_suggests_torch():
    from engine.amp import probe_apex

    missing = probe_apex()
    if missing is None:
        pytest.skip("NVIDIA apex with CUDA is installed here")
    assert "amp=torch" in missing
    assert any(word in missing for word in ("not installed", "apex.amp", "CUDA"))


@pytest.mark.parametrize("override", ["+trainer.epoch=3", "trainer.epoch=3"])
def test_unknown_key_names_the_key_meant(override):
    from engine.config import check_override_keys

    with pytest.raises(ConfigError) as info:
        check_override_keys([override, "sync=localsgd", "sync.k_steps=8"], str(CONF_DIR))
    assert str(info.value) == "trainer.epoch=3: expected a key of the config (did you mean trainer.epochs?)"
    check_override_keys(["sync=localsgd", "sync.k_steps=8", "+hydra.job.env_set.X=1", "-m"], str(CONF_DIR))
    with pytest.raises(ConfigError, match=r"sync.k_step=8: .*did you mean sync.k_steps\?"):
        check_override_keys(["-m", "sync=localsgd,adaptive_localsgd", "sync.k_step=8"], str(CONF_DIR))
    check_override_keys(["data=imagefolder", "data.root=/data/imagenet"], str(CONF_DIR))  # a required (???) key
    with pytest.raises(ConfigError, match=r"data.rot='/x': .*did you mean data.root\?"):
        check_override_keys(["data=imagefolder", "data.rot=/x"], str(CONF_DIR))


def test_unknown_key_stops_before_any_worker(tmp_path):
    result = run_cli("+trainer.epoch=3", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert (
        result.stderr.strip() == "error: trainer.epoch=3: expected a key of the config (did you mean trainer.epochs?)"
    )
    assert "relaxsync:" not in result.stdout and not (tmp_path / "metrics.jsonl").exists()


def test_more_local_processes_than_gpus_is_refused_before_any_worker(monkeypatch):
    """NCCL gives each rank a GPU of its own (two ranks on one GPU fail with a duplicate GPU), so on a machine with
    GPUs the local launcher's ``trainer.nproc`` is at most their number; CPU, or torchrun's world, is not limited."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for device in ("auto", "cuda"):
        with pytest.raises(ConfigError) as error:
            plain_cfg("model=test_resnet", "trainer.nproc=2", f"trainer.device={device}")
        assert "trainer.nproc=2" in str(error.value) and "at most 1 on CUDA" in str(error.value)
    assert plain_cfg("model=test_resnet", "trainer.nproc=1", "trainer.device=cuda")["trainer"]["nproc"] == 1
    assert plain_cfg("model=test_resnet", "trainer.nproc=2", "trainer.device=cpu")["trainer"]["nproc"] == 2
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")  # (under torchrun trainer.nproc is not the world: its --nproc-per-node is)
    assert plain_cfg("model=test_resnet", "trainer.nproc=2", "trainer.device=auto")["trainer"]["nproc"] == 2
