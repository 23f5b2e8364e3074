"""Sending a whole state (a checkpoint's content) from one rank to another, point to point: what a joining process
and a survivor healed from the front receive.

``dist.send_object_list`` pickles the state, tensors and all, into one byte tensor and the receiver unpickles it:
two copies of every byte besides the wire (about 0.15 s for 40 MB on one core). Here the tensors travel as they
are: each dtype's tensors are packed into one flat buffer (a :class:`Parcel`) sent tensor by tensor, and only the
rest (the structure, the shapes, the plain values) is pickled, a few kilobytes. A tensor that appears more than once in
the state (the same object) is sent once and comes back as one object, as pickle would have it.

On the receiving rank every tensor is on the CPU and contiguous, whatever it was on the sender; the caller's
``load_state_dict`` copies it where it belongs. A parcel travels over a :class:`Wire`: a process group's
point-to-point operations (:class:`GroupWire`; on NCCL the buffers travel on the current CUDA device and are brought
back to the CPU on arrival), or a :class:`Pipe`, a gloo connection two processes hold on their own, which a thread
can use while the main thread trains.
"""

from __future__ import annotations

import datetime
import pickle
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from distributed.connections import forget, keep, noted, store_port


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


class Wire(Protocol):
    """One end of a point-to-point link: tensors sent arrive in order, each into a tensor of its size."""

    def send(self, tensor: torch.Tensor) -> None: ...
    def recv(self, tensor: torch.Tensor) -> None: ...


class GroupWire:
    """To or from global rank ``peer`` of ``group`` (``dist.send`` and ``dist.recv``). On NCCL the tensors travel on
    the current CUDA device (NCCL sends nothing else)."""

    def __init__(self, peer: int, group: Any = None):
        self.peer, self.group = peer, group
        nccl = dist.get_backend(group) == dist.Backend.NCCL
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def send(self, tensor: torch.Tensor) -> None:
        dist.send(tensor.to(self.device), dst=self.peer, group=self.group)

    def recv(self, tensor: torch.Tensor) -> None:
        if tensor.device == self.device:
            dist.recv(tensor, src=self.peer, group=self.group)
            return
        arrived = torch.empty_like(tensor, device=self.device)
        dist.recv(arrived, src=self.peer, group=self.group)
        tensor.copy_(arrived)


class Pipe:
    """A gloo connection of two processes' own, met through ``store`` (a prefix only they use), outside torch's
    registry and every group the run trains on: a thread can send over it while the main thread goes on with its
    collectives, on any backend (on NCCL, collectives issued from two threads in different orders would deadlock).
    ``me`` and ``peer`` are the two processes' ids; either may create it first."""

    def __init__(self, store: dist.Store, me: int, peer: int, timeout: datetime.timedelta):
        index = int(me > peer)
        with noted(store_port()) as made:  # (kept while it lives, so that no group let go meanwhile cuts it)
            self._gloo = dist.ProcessGroupGloo(store, index, 2, timeout)
        keep(id(self), made)
        weakref.finalize(self, forget, id(self))
        self._peer = 1 - index

    def send(self, tensor: torch.Tensor) -> None:
        self._gloo.send([tensor.contiguous()], self._peer, 0).wait()

    def recv(self, tensor: torch.Tensor) -> None:
        self._gloo.recv([tensor], self._peer, 0).wait()


@dataclass
class Parcel:
    """A state packed to be sent (:func:`pack`): its buffers are copies, so the sender may go on changing its
    tensors (training) while the parcel travels, from another thread."""

    skeleton: Any
    buffers: list[torch.Tensor]

    @classmethod
    def of(cls, state: Any) -> Parcel:
        return cls(*pack(state))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def send(self, wire: Wire) -> None:
        """The header (the skeleton and each buffer's dtype and size, pickled, after its length), then each
        buffer."""
        header = pickle.dumps({"skeleton": self.skeleton, "buffers": [(b.dtype, b.numel()) for b in self.buffers]})
        wire.send(torch.tensor([len(header)], dtype=torch.int64, device="cpu"))  # (a wire moves it where it goes)
        wire.send(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        for buffer in self.buffers:
            if buffer.numel():
                wire.send(buffer)

    @staticmethod
    def receive(wire: Wire) -> Any:
        """The state a :meth:`send` at the other end sent; its tensors on the CPU."""
        length = torch.empty(1, dtype=torch.int64, device="cpu")  # (what arrives is on the CPU: the module's doc)
        wire.recv(length)
        header = torch.empty(int(length.item()), dtype=torch.uint8, device="cpu")
        wire.recv(header)
        head = pickle.loads(header.numpy().tobytes())
        buffers = []
        for dtype, numel in head["buffers"]:
            buffer = torch.empty(numel, dtype=dtype, device="cpu")
            if numel:
                wire.recv(buffer)
            buffers.append(buffer)
        return unpack(head["skeleton"], buffers)


def send_state(state: Any, dst: int, group: Any = None) -> None:
    """Send ``state`` to global rank ``dst`` of ``group`` (it calls :func:`recv_state`)."""
    Parcel.of(state).send(GroupWire(dst, group))


def recv_state(src: int, group: Any = None) -> Any:
    """The state global rank ``src`` of ``group`` sends with :func:`send_state`; its tensors on the CPU."""
    return Parcel.receive(GroupWire(src, group))
