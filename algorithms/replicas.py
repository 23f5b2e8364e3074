"""What algorithms whose replicas differ between agreements share (gossip, DiLoCo, ``sync=none``): :class:`Replicas`
(a flat view of the parameters and ranges of it, the replicas' average before evaluations and checkpoints, each rank's
own optimizer state), and the model's segments as ranges of that flat view (:func:`segment_ranges`: what
Crossover-SGD gossips segment by segment and streaming DiLoCo syncs fragment by fragment)."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from algorithms.base import SyncAlgorithm


class Replicas(SyncAlgorithm):
    """Replicas that differ between agreements: evaluation reports the averaged model and the replicas' own
    accuracy; each rank checkpoints its own optimizer state."""

    steps_apart = True
    evaluates_replicas = True

    def parameters(self) -> list[torch.Tensor]:
        return [p.data for p in self.model.parameters()]

    def flat_parameters(self) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in self.parameters()])

    def set_flat_parameters(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def read_range(self, lo: int, hi: int) -> torch.Tensor:
        """A copy of elements ``[lo, hi)`` of the flat parameter vector."""
        return torch.cat([view[a:b] for view, a, b in self._overlaps(lo, hi)])

    def write_range(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """Set elements ``[lo, hi)`` of the flat parameter vector."""
        offset = 0
        for view, a, b in self._overlaps(lo, hi):
            view[a:b].copy_(values[offset : offset + b - a])
            offset += b - a

    def _overlaps(self, lo: int, hi: int) -> list[tuple[torch.Tensor, int, int]]:
        """(flat view of a parameter, start, end within it) for every parameter that ``[lo, hi)`` touches."""
        out, offset = [], 0
        for p in self.parameters():
            n = p.numel()
            if offset < hi and offset + n > lo:
                out.append((p.view(-1), max(lo - offset, 0), min(hi - offset, n)))
            offset += n
        return out

    def before_eval(self) -> None:
        """Average the replicas (and BN statistics) so evaluation and checkpoints see one model."""
        comm = self.ctx.comm
        tensors = self.parameters() + [b.data for b in self.model.buffers() if b.is_floating_point()]
        comm.all_reduce_coalesced(tensors, average=True)

    def local_state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}  # this rank's own momentum buffers

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


_STAGE = re.compile(r"^(layer\d+)\.(\d+)\.")


def segment_key(name: str, mode: str) -> str | None:
    """The segment of a ResNet-style parameter name (timm/torchvision naming), or None if it has none."""
    if name.startswith(("conv1.", "bn1.")):
        return "stem"
    if name.startswith("fc."):
        return "head"
    match = _STAGE.match(name)
    if match:
        return match.group(1) if mode == "coarse" else f"{match.group(1)}.{match.group(2)}"
    return None


def segment_ranges(model: nn.Module, segments: str | int) -> list[tuple[str, int, int]]:
    """``(name, start, end)`` ranges over the flat parameter vector (``torch.cat`` of ``model.parameters()``)."""
    named = [(n, p.numel()) for n, p in model.named_parameters()]
    total = sum(size for _, size in named)
    if isinstance(segments, int):
        bounds = [round(i * total / segments) for i in range(segments + 1)]
        return [(f"chunk{i}", bounds[i], bounds[i + 1]) for i in range(segments)]
    ranges: list[tuple[str, int, int]] = []
    offset = 0
    for name, size in named:
        key = segment_key(name, segments)
        if key is None:
            raise ValueError(f"parameter {name!r} is in no {segments} segment")
        if ranges and ranges[-1][0] == key:
            ranges[-1] = (key, ranges[-1][1], offset + size)
        elif any(r[0] == key for r in ranges):
            raise ValueError(f"segment {key!r} is not contiguous in the parameter order")
        else:
            ranges.append((key, offset, offset + size))
        offset += size
    return ranges
