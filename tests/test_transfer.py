"""A whole state sent point to point with its tensors as tensors (distributed/transfer.py): what arrives is the state
that was sent, bit for bit, shape for shape, and a tensor the state holds twice is one object again."""

from __future__ import annotations

import collections
import datetime
import os
import tempfile
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distributed.transfer import Parcel, Pipe, Slot, pack, unpack

Point = collections.namedtuple("Point", "x y")


def a_state() -> dict:
    """Something shaped like a checkpoint's content: several dtypes, a non-contiguous tensor, a 0-d and an empty one,
    a tensor held twice, containers of several kinds, and values that are not tensors."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 3, generator=g, dtype=torch.float64)
    return {
        "model": collections.OrderedDict(
            [("w", weight), ("b", torch.randn(3, generator=g)), ("steps", torch.tensor(7))]
        ),
        "optimizer": {"state": {0: {"momentum_buffer": weight.t(), "step": torch.tensor(3.0)}}, "lr": 0.1},
        "tied": weight,  # the same tensor object as model.w
        "rng": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=g),
        "half": torch.randn(4, generator=g).half(),
        "empty": torch.zeros(0, 2),
        "flags": torch.tensor([True, False]),
        "point": Point(torch.ones(2), "label"),
        "history": [1, 2.5, "three", None, (torch.arange(4),)],
    }


def assert_same(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert type(got) is type(want) and list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for a, b in zip(got, want):
            assert_same(a, b)
    else:
        assert got == want


def test_pack_leaves_no_tensor_in_what_is_pickled_and_unpack_gives_the_state_back():
    state = a_state()
    skeleton, buffers = pack(state)
    assert skeleton["model"]["w"] == skeleton["tied"]  # one slot for the tensor held twice
    assert len(buffers) == 6  # float64, float32, int64, uint8, float16, bool: one buffer per dtype
    leaves = [skeleton]
    while leaves:  # nothing left in the skeleton is a tensor
        leaf = leaves.pop()
        assert not isinstance(leaf, torch.Tensor)
        if isinstance(leaf, dict):
            leaves += list(leaf.values())
        elif isinstance(leaf, (list, tuple)):
            leaves += list(leaf)
    back = unpack(skeleton, buffers)
    assert_same(back, state)
    assert back["tied"] is back["model"]["w"]
    assert back["optimizer"]["state"][0]["momentum_buffer"].is_contiguous()  # (sent transposed)
    assert isinstance(skeleton["point"].x, Slot)


def _exchange(rank: int, init: str, out: str) -> None:
    from distributed.transfer import recv_state, send_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        if rank == 0:
            send_state(a_state(), dst=1)
        else:
            torch.save(recv_state(src=0), out)
    finally:
        dist.destroy_process_group()


def _run_pair(fn) -> Any:
    """``fn(rank, init, out)`` in two spawned processes; what the receiver saved in ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "received.pt")
        mp.start_processes(fn, args=(f"file://{tmp}/store", out), nprocs=2, start_method="spawn")
        return torch.load(out, weights_only=False)


def test_a_state_sent_over_gloo_arrives_as_it_was_sent():
    got = _run_pair(_exchange)
    assert_same(got, a_state())
    assert got["tied"] is got["model"]["w"]


def test_a_parcel_is_a_copy_the_sender_may_change_its_tensors_after_packing():
    state = a_state()
    parcel = Parcel.of(state)
    want = a_state()
    state["model"]["w"].add_(1.0)  # (training goes on while the parcel travels)
    state["model"]["b"].zero_()
    assert_same(unpack(parcel.skeleton, parcel.buffers), want)


def _pipe_beside_collectives(rank: int, init: str, out: str) -> None:
    """Each process sends or receives a state over a Pipe in a thread while its main thread runs all-reduces on the
    default group; rank 1 saves what it received and the all-reduces' results."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        store = dist.PrefixStore("pipe/", dist.distributed_c10d._get_default_store())
        got: dict = {}

        def move() -> None:
            pipe = Pipe(store, rank, 1 - rank, datetime.timedelta(seconds=60))
            if rank == 0:
                for _ in range(3):
                    Parcel.of(a_state()).send(pipe)
            else:
                got["states"] = [Parcel.receive(pipe) for _ in range(3)]

        thread = threading.Thread(target=move)
        thread.start()
        sums = []
        for i in range(50):
            t = torch.full((1000,), float(rank + i))
            dist.all_reduce(t)
            sums.append(t[0].item())
        thread.join()
        if rank == 1:
            torch.save({"sums": sums, **got}, out)
    finally:
        dist.destroy_process_group()


def test_a_pipe_carries_states_from_a_thread_while_the_main_thread_runs_collectives():
    got = _run_pair(_pipe_beside_collectives)
    assert got["sums"] == [float(2 * i + 1) for i in range(50)]
    assert len(got["states"]) == 3
    for state in got["states"]:
        assert_same(state, a_state())
