"""Build any timm model by name for the data at hand."""

from __future__ import annotations

from typing import Any

import timm
import torch
from torch import nn


def create_model(
    name: str, num_classes: int, in_chans: int = 3, drop_rate: float = 0.0, kwargs: dict[str, Any] | None = None
) -> nn.Module:
    """``timm.create_model`` with random initialization (weights are never downloaded)."""
    return timm.create_model(
        name, pretrained=False, num_classes=num_classes, in_chans=in_chans, drop_rate=drop_rate, **(kwargs or {})
    )


# model.compile: torch.compile's modes that leave DDP's hooks alone (the others capture CUDA graphs)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def uses_channels_last(cfg_model: dict[str, Any], device: torch.device) -> bool:
    """``model.channels_last``: ``auto`` is NHWC on CUDA (tensor cores' layout), NCHW elsewhere."""
    value = cfg_model.get("channels_last", False)
    return device.type == "cuda" if value == "auto" else bool(value)


def compile_mode(cfg_model: dict[str, Any]) -> str | None:
    """``model.compile`` as torch.compile's mode, or None (not compiled)."""
    value = cfg_model.get("compile", False)
    if value is False or value is None:
        return None
    return "default" if value is True else value


def build_model(cfg_model: dict[str, Any], num_classes: int, in_chans: int, device: torch.device) -> nn.Module:
    """The model on ``device``, in its memory format, compiled in place when asked (``nn.Module.compile``: before
    any sync algorithm wraps it, as timm's train.py compiles before DDP; its parameters and state_dict keys stay the
    model's own, so checkpoints and every exchange see the same names)."""
    model = create_model(cfg_model["name"], num_classes, in_chans, cfg_model["drop_rate"], cfg_model.get("kwargs"))
    model = model.to(device)
    if uses_channels_last(cfg_model, device):
        model = model.to(memory_format=torch.channels_last)
    mode = compile_mode(cfg_model)
    if mode is not None:
        backend = cfg_model.get("compile_backend", "inductor")
        model.compile(backend=backend, **({"mode": mode} if backend == "inductor" else {}))
    return model


def num_trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
