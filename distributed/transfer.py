"""Sending a whole state (a checkpoint's content) from one rank to another, point to point: what a joining process
and a survivor healed from the front receive.

``dist.send_object_list`` pickles the state, tensors and all, into one byte tensor and the receiver unpickles it:
two copies of every byte besides the wire (about 0.15 s for 40 MB on one core). Here the tensors travel as they
are: each dtype's tensors are packed into one flat buffer sent with ``dist.send``, and only the rest (the
structure, the shapes, the plain values) is pickled, a few kilobytes. A tensor that appears more than once in
the state (the same object) is sent once and comes back as one object, as pickle would have it.

On the receiving rank every tensor is on the CPU and contiguous, whatever it was on the sender; the caller's
``load_state_dict`` copies it where it belongs. On NCCL the buffers travel on the current CUDA device (NCCL sends
nothing else) and are brought back to the CPU on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Slot:
    """Where a tensor of the state is in the buffers: the buffer of its dtype, its offset there and its shape."""

    buffer: int
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


def pack(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``state`` with each tensor replaced by its :class:`Slot`, and one flat buffer per dtype holding them all."""
    slots: dict[int, Slot] = {}  # id of a tensor seen -> its slot
    parts: dict[torch.dtype, list[torch.Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}
    index: dict[torch.dtype, int] = {}  # dtype -> its buffer
    keep: list[torch.Tensor] = []  # (the tensors whose ids are in slots stay alive while packing)

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            slot = slots.get(id(value))
            if slot is None:
                if value.dtype not in index:
                    parts[value.dtype], sizes[value.dtype], index[value.dtype] = [], 0, len(index)
                slot = Slot(index[value.dtype], sizes[value.dtype], tuple(value.shape))
                parts[value.dtype].append(value.detach().reshape(-1).cpu())
                sizes[value.dtype] += value.numel()
                slots[id(value)] = slot
                keep.append(value)
            return slot
        return _rebuild(value, walk)

    skeleton = walk(state)
    buffers = [torch.cat(parts[dtype]) for dtype in index]  # (in the order of index's values)
    return skeleton, buffers


def unpack(skeleton: Any, buffers: list[torch.Tensor]) -> Any:
    """The state :func:`pack` took apart: each :class:`Slot` becomes its tensor again (a view of its buffer; the
    same object wherever the same slot appears)."""
    made: dict[Slot, torch.Tensor] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, Slot):
            if value not in made:
                flat = buffers[value.buffer][value.offset : value.offset + value.numel]
                made[value] = flat.view(value.shape)
            return made[value]
        return _rebuild(value, walk)

    return walk(skeleton)


def _rebuild(value: Any, walk: Any) -> Any:
    """``value`` with ``walk`` applied to each item of a container (of the same type: an OrderedDict or a named
    tuple stays one); anything else as it is."""
    if isinstance(value, dict):
        out = value.copy()
        for key, item in value.items():
            out[key] = walk(item)
        return out
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(walk(item) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(walk(item) for item in value)
    return value


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def send_state(state: Any, dst: int, group: Any = None) -> None:
    """Send ``state`` to global rank ``dst`` of ``group`` (it calls :func:`recv_state`)."""
    skeleton, buffers = pack(state)
    header = {"skeleton": skeleton, "buffers": [(b.dtype, b.numel()) for b in buffers]}
    device = _device(group)
    dist.send_object_list([header], dst=dst, group=group, device=device)
    for buffer in buffers:
        if buffer.numel():
            dist.send(buffer.to(device), dst=dst, group=group)


def recv_state(src: int, group: Any = None) -> Any:
    """The state global rank ``src`` of ``group`` sends with :func:`send_state`; its tensors on the CPU."""
    box: list[Any] = [None]
    device = _device(group)
    dist.recv_object_list(box, src=src, group=group, device=device)
    buffers = []
    for dtype, numel in box[0]["buffers"]:
        buffer = torch.empty(numel, dtype=dtype, device=device)
        if numel:
            dist.recv(buffer, src=src, group=group)
        buffers.append(buffer.cpu())
    return unpack(box[0]["skeleton"], buffers)
