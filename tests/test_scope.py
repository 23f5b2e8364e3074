"""sync.scope=node: every option at 2 nodes x 2 processes is the option at 2 processes, each with its node's whole
batch (exactly: the same sums in the same order), and the bookkeeping that keeps nodes whole."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.multiprocessing as mp
from _scope import run
from conftest import plain_cfg

from algorithms.scope import NodeScope, build_sync
from distributed.membership import Change, Membership
from distributed.nodes import NodeView, layout
from errors import ConfigError

CASES = {
    "allreduce": ["sync=allreduce", "sync.bucket_cap_mb=0.001"],
    "powersgd": ["sync=powersgd", "sync.start_powerSGD_iter=2", "sync.min_compression_rate=0.5",
                 "sync.bucket_cap_mb=0.001"],
    "localsgd": ["sync=localsgd", "sync.begin_step=2", "sync.k_steps=3"],
    "adaptive_localsgd": ["sync=adaptive_localsgd", "sync.begin_step=1", "sync.init_k_steps=2"],
    "diloco": ["sync=diloco", "sync.inner_steps=2"],
    "streaming_diloco": ["sync=diloco", "sync.inner_steps=4", "sync.fragments=2", "sync.delay=1", "sync.quantize=int8",
                         "sync.quant_block=64"],
    "dgc": ["sync=dgc", "sync.min_compress_numel=64", "sync.rampup_begin_step=0"],
    "sgp": ["sync=sgp"],
    "sgp_overlap": ["sync=sgp", "sync.overlap=true", "sync.synch_freq=2"],
    "crossover": ["sync=crossover", "sync.segments=2"],
    "relaxed_localsgd": ["sync=relaxed", "sync@sync.inner=localsgd", "sync.inner.k_steps=2",
                         "sync.relaxed_sync_threshold=-1", "sync.check_every=1"],
}  # fmt: skip


def _sections(scope: str) -> dict[str, dict]:
    common = ["trainer.device=cpu", "trainer.nproc=4", f"sync.scope={scope}"]
    return {name: plain_cfg(*overrides, *common)["sync"] for name, overrides in CASES.items()}


def _world(size: int, cases: dict[str, dict], out: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(run, args=(size, f"file://{tmp}/store", cases, out), nprocs=size, start_method="spawn")


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as out:
        _world(4, _sections("node"), out)
        _world(2, _sections("process"), out)
        yield {(world, rank): torch.load(f"{out}/{world}-{rank}.pt") for world, rank in
               [(4, 0), (4, 1), (4, 2), (4, 3), (2, 0), (2, 1)]}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_nodes_of_two_processes_are_two_processes_of_the_node_batch(runs, case):
    for rank in range(4):
        node = rank // 2
        reference = runs[(2, node)][case]
        assert torch.equal(runs[(4, rank)][case], reference), (
            f"{case}: rank {rank} (node {node}) differs from the process with its node's batch by "
            f"{(runs[(4, rank)][case] - reference).abs().max():.3g}"
        )
    assert not torch.equal(runs[(2, 0)][case], model_start()), f"{case}: the reference did not train"


def model_start() -> torch.Tensor:
    from _scope import model

    return torch.cat([p.detach().reshape(-1) for p in model().parameters()])


# ---- nodes in the membership (no process group needed) ------------------------------------------------------------
def _membership(rank: int, nodes: list[str]) -> Membership:
    return Membership(rank, len(nodes), group=object(), nodes=nodes)


def test_nodes_are_named_by_their_lowest_rank_and_stay_whole():
    m = _membership(3, ["a", "a", "b", "b", "c", "c"])
    assert m.node_ids() == [0, 2, 4] and m.node_ranks() == [2, 3] and layout(m) == (3, 2)
    assert m.with_their_nodes([3]) == [3]  # (process scope: a rank alone)
    m.whole_nodes = True
    assert m.with_their_nodes([3]) == [2, 3] and m.with_their_nodes([0, 5]) == [0, 1, 4, 5]
    view = NodeView(m)
    assert (view.rank, view.ranks, view.size, view.index, view.initial_size) == (2, [0, 2, 4], 3, 1, 3)
    assert (view.local_index, view.local_size, view.peer(4)) == (1, 2, 5)


def test_a_change_reads_in_nodes():
    m = _membership(0, ["a", "a", "b", "b", "c", "c"])
    m.ranks = [0, 1, 4, 5]  # (node b, ranks 2 and 3, removed)
    change = NodeView(m).in_nodes(Change(1, [2, 3], [0, 1, 4, 5], "died"))
    assert (change.removed, change.ranks, change.cause) == ([2], [0, 4], "died")


def test_unequal_nodes_have_no_layout_and_refuse_node_scope():
    m = _membership(0, ["a", "a", "b"])
    assert layout(m) is None
    section = plain_cfg("sync=localsgd", "trainer.device=cpu", "sync.scope=node")["sync"]
    with pytest.raises(ConfigError, match="sync.scope"):
        build_sync(section, m)


def test_auto_is_node_scope_only_with_several_nodes_of_several_processes():
    section = plain_cfg("sync=localsgd", "trainer.device=cpu")["sync"]
    assert section["scope"] == "auto"
    assert isinstance(build_sync(section, _membership(0, ["a", "a", "b", "b"])), NodeScope)
    for nodes in (["a", "b", "c", "d"], ["a", "a", "a", "a"]):
        assert not isinstance(build_sync(section, _membership(0, nodes)), NodeScope), nodes


@pytest.mark.parametrize(
    "overrides",
    [
        ["sync.scope=nodes"],
        ["sync=relaxed", "sync@sync.inner=localsgd", "sync.measure=link", "sync.scope=node"],
    ],
)
def test_a_scope_that_cannot_run_is_refused_before_any_worker(overrides):
    with pytest.raises(ConfigError, match="sync.scope"):
        plain_cfg("trainer.device=cpu", *overrides)
