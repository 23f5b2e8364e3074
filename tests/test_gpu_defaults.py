"""What a GPU run gets by default, checked on a CPU: bfloat16 autocast where the GPU has it (float16 with the
GradScaler where not), channels_last, cudnn.benchmark, and ``model.compile`` (compiled before the sync algorithm wraps
the model; DDP's counted comm hook still sees every bucket). On a CPU the defaults are what they were: full precision,
NCHW, nothing compiled."""

from __future__ import annotations

import pytest
import torch
from conftest import plain_cfg, records, train_each

from distributed.world import configure_device
from engine.amp import AutoAmp, TorchAmp
from models.factory import compile_mode, uses_channels_last

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_defaults_are_the_gpus_on_cuda_and_unchanged_on_a_cpu():
    cfg = plain_cfg()
    assert cfg["amp"]["_target_"] == "engine.amp.AutoAmp" and cfg["trainer"]["cudnn_benchmark"] is True
    assert uses_channels_last(cfg["model"], CUDA) and not uses_channels_last(cfg["model"], CPU)
    assert compile_mode(cfg["model"]) is None  # (compiling costs minutes at the start: asked for, not default)
    assert not uses_channels_last({"channels_last": False}, CUDA) and uses_channels_last({"channels_last": True}, CPU)

    assert compile_mode({"compile": True}) == "default" and compile_mode({"compile": "max-autotune-no-cudagraphs"})


def test_auto_amp_is_full_precision_on_a_cpu():
    model = torch.nn.Linear(4, 2)
    amp = AutoAmp()
    amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU)
    with amp.autocast():
        assert model(torch.randn(3, 4)).dtype == torch.float32
    assert amp.loss_scale == 1.0 and amp.unscale(None) is True and amp.state_dict() in ({}, {"scaler": {}})


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-gpu", "fp16-only-gpu"])
@pytest.mark.parametrize("backend", [AutoAmp, TorchAmp])
def test_on_cuda_autocast_is_bfloat16_where_supported_else_float16_with_the_scaler(monkeypatch, bf16, backend):
    scalers = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.amp, "GradScaler", lambda device, **kw: scalers.append((device, kw["enabled"])))
    amp = backend()
    amp.setup(torch.nn.Linear(2, 2), None, CUDA)
    assert amp.dtype == (torch.bfloat16 if bf16 else torch.float16)
    assert scalers == [("cuda", not bf16)]  # loss scaling for float16 only


def test_cudnn_benchmark_is_switched_on_cuda_only(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    configure_device(CPU, True)
    assert torch.backends.cudnn.benchmark is False
    configure_device(CUDA, True)
    assert torch.backends.cudnn.benchmark is True


def test_a_compiled_model_trains_as_the_eager_one_and_every_bucket_is_counted(tmp_path):
    """torch.compile with the ``eager`` backend traces the model (dynamo, DDP's graph split by buckets) and runs the
    same operations: the first step's loss is the same to float32 rounding, and DDP's counted comm hook sees every
    bucket of every step (bytes equal). A 1 MiB cap makes two buckets of the model's 1.5 MB."""
    common = ["model=test_resnet", "data=digits", "logger=none", "trainer.progress=false", "trainer.nproc=2",
              "trainer.max_steps=2", "trainer.checkpoint_every=0", "sync.bucket_cap_mb=1"]  # fmt: skip
    runs = train_each(
        tmp_path, {"eager": common, "compiled": [*common, "model.compile=true", "model.compile_backend=eager"]}
    )
    eager, compiled = (records(runs[name], "train") for name in ("eager", "compiled"))
    assert [r["bytes_sent"] for r in compiled] == [r["bytes_sent"] for r in eager] and eager[0]["bytes_sent"] > 0
    assert compiled[0]["loss"] == pytest.approx(eager[0]["loss"], rel=1e-5)


def test_compile_settings_are_validated_before_any_worker():
    from engine.config import validate
    from errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.compile='fast': expected one of false, true, default"):
        validate(plain_cfg("model.compile=fast"))
    with pytest.raises(ConfigError, match=r"model.compile_backend='nope': expected one of torch.compile's backends"):
        validate(plain_cfg("model.compile=true", "model.compile_backend=nope"))
    with pytest.raises(ConfigError, match=r"sync.bucket_cap_mb=0.5: expected >= 1 under model.compile"):
        validate(plain_cfg("model.compile=true", "sync.bucket_cap_mb=0.5"))
    with pytest.raises(ConfigError, match=r"model.channels_last='yes': expected one of auto, true, false"):
        validate(plain_cfg("model.channels_last=yes"))
    with pytest.raises(ConfigError, match=r"trainer.cudnn_benchmark=1: expected true or false"):
        validate(plain_cfg("trainer.cudnn_benchmark=1"))
