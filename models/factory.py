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


def build_model(cfg_model: dict[str, Any], num_classes: int, in_chans: int, device: torch.device) -> nn.Module:
    model = create_model(cfg_model["name"], num_classes, in_chans, cfg_model["drop_rate"], cfg_model.get("kwargs"))
    model = model.to(device)
    if cfg_model.get("channels_last"):
        model = model.to(memory_format=torch.channels_last)
    return model


def num_trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
