"""The device contract, checked on a CPU: every sync option keeps its state on the training device, before and
after a resume, and never mixes CPU and CUDA tensors in an op.

Every option in ``conf/sync/`` (a new one is found there), with the variants that keep state of their own (SGP
and crossover overlap, Streaming DiLoCo with fragments, delay and int8, fp16 DiLoCo), alone and inside relaxed
sync, runs a few steps of the trainer's hook sequence on *fake* CUDA tensors (``FakeTensorMode``: shapes
and devices without a GPU; an op that mixes devices raises ``FakeTensorDeviceMismatchError``), its collectives on
torch's ``fake`` process group, then resumes as the trainer does (``engine/checkpoint.py``: the shared state read
back on the CPU, this rank's own with ``map_location`` the device) and takes one more step.

What this cannot run: DDP (``allreduce``, ``powersgd``) needs real storage, so there the bare model stands in for
DDP and only the algorithms' own code runs on fake tensors; PowerSGD's hook, its per-rank state included, is
driven here without DDP. Every tensor factory in ``algorithms/``, ``engine/`` and ``distributed/`` must name its
device (an AST check), which covers the code this test does not run. What only a GPU shows (NCCL, streams,
timings) is for a GPU smoke run.
"""

from __future__ import annotations

import ast
import inspect

import pytest
import timm
import torch
import torch.distributed as dist
from conftest import CONF_DIR, ROOT, plain_cfg
from hydra.utils import get_class
from omegaconf import OmegaConf
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401 - registers the "fake" backend
from torch.utils._python_dispatch import TorchDispatchMode

from algorithms.allreduce import AllReduce
from algorithms.base import StepResult, SyncContext
from distributed.comm import Communicator
from distributed.membership import Membership
from engine.optim import build_optimizer
from engine.scope import build_sync

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
# Two ranks, validated as CPU ones on any machine (one GPU refuses two NCCL ranks): the device here is the fake one.
COMMON = ["model=test_resnet", "data=synthetic", "logger=none", "trainer.nproc=2", "trainer.device=cpu"]
# Entries that torch itself keeps on the CPU (by the end of their path in the state), and why.
ON_CPU_BY_TORCH = {
    ("generator",): "Generator.get_state() is a CPU ByteTensor, for a CUDA generator too (DGC's sampling)",
    ("rng", "keys"): "PowerSGD's numpy MT19937 state (torch.from_numpy): numpy's, on no device",
}


# ---- a CUDA device without a GPU ------------------------------------------------------------------------------
class Answers(TorchDispatchMode):
    """What fake tensors cannot say, answered so that control flow goes on: a value (``.item()``, ``float()``) is
    0 (no overflow flag set, no rank evicted); ``nonzero`` finds every entry (a fixed shape, on the input's device).
    An op on the CPU with no fake input (bookkeeping: DGC's offsets, crossover's permutations) runs for real, as
    on a GPU machine; its result still meets fake CUDA tensors as a CPU tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default and isinstance(args[0], FakeTensor):
            return args[0].fake_device  # (what the fake mode answers, without its dispatch: most calls are this)
        kwargs = kwargs or {}
        if FakeTensor not in types and torch.device(kwargs.get("device") or "cpu").type == "cpu":
            with unset_fake_temporarily():  # (a real tensor here is a CPU one: there is no CUDA)
                return func(*args, **kwargs)
        try:
            return func(*args, **kwargs)
        except DataDependentOutputException:
            return 0
        except DynamicOutputShapeException:
            x = args[0]
            return torch.zeros((x.numel(), x.dim()), dtype=torch.long, device=x.device)


class CpuGenerator(torch.Generator):
    """Stands in for the CUDA generator DGC makes (there is no CUDA here). It keeps torch's rule that a state is a
    CPU ByteTensor (anything else raises torch's own error) and, since a fake one holds no bytes, takes that one
    without reading it."""

    def __new__(cls, device=None):
        return super().__new__(cls, "cpu")

    def set_state(self, state):
        if isinstance(state, FakeTensor) and state.device.type == "cpu" and state.dtype == torch.uint8:
            return self
        return super().set_state(state)


@pytest.fixture(scope="module")
def fake_world():
    """One process runs every collective of a two-rank group; a hash store answers membership agreement."""
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.fixture
def fake_cuda(fake_world, monkeypatch):
    """Inside: tensors made for ``cuda:0`` are fake ones, and the Communicator says what it says under NCCL."""
    monkeypatch.setattr(torch, "Generator", CpuGenerator)
    monkeypatch.setattr(Communicator, "device", property(lambda self: CUDA))  # NCCL's answer; the fake group's: CPU
    with FakeTensorMode(allow_non_fake_inputs=True), Answers():
        yield


# ---- the trainer's side, as engine/loop.py and engine/checkpoint.py do it -----------------------------------------
def _replica(cfg: dict) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model made on the device (``.to()`` of a fake CPU model would not move it) and its optimizer."""
    model = timm.create_model("test_resnet", num_classes=10, device=CUDA)
    optimizer = build_optimizer(model, cfg["optimizer"], 0.1)
    for group in optimizer.param_groups:
        group["foreach"] = True  # torch's default for CUDA parameters (it does not take fake ones for CUDA ones)
    return model, optimizer


def _sync(cfg: dict, model, optimizer, monkeypatch):
    """``cfg["sync"]`` built and set up as the trainer does; DDP (real storage only) stood in by the bare model."""
    for cls in (AllReduce, *AllReduce.__subclasses__()):
        monkeypatch.setattr(cls, "_wrap", lambda self, model: model)
    # (a link probe's seconds end with a device synchronize, which fake CUDA cannot: sync=auto's probe reads these)
    monkeypatch.setattr(Communicator, "probe_links", lambda self, nbytes: 1e-3 + nbytes / 1e9)
    membership = Membership(0, 2)
    sync = build_sync(cfg["sync"], membership)  # (two processes, each a node of its own: process scope)
    sync.setup(model, optimizer, SyncContext(Communicator(membership), membership, CUDA))
    return sync


def _train(sync, model, optimizer, steps: range, epoch: int) -> None:
    """The hook sequence of ``algorithms/base.py`` (gradients drawn, as nothing can run backward on fake CUDA), then
    what precedes a checkpoint."""
    sync.on_epoch_start(epoch)
    for step in steps:
        sync.before_step(step)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        report = sync.after_backward(step, True)
        if report.grads_finite:
            optimizer.step()
        sync.after_optimizer_step(StepResult(step, epoch, 1.0, 0.1, report.grads_finite, 0.0, 0.01))
    sync.drain()
    sync.before_eval()


def _loaded(state, location: torch.device):
    """What ``torch.load(map_location=location)`` gives back of a file holding ``state``: fresh copies there (a fake
    tensor cannot be written to a file)."""
    if isinstance(state, torch.Tensor):
        return state.to(location, copy=True)
    if isinstance(state, dict):
        return {key: _loaded(value, location) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_loaded(value, location) for value in state)
    return state


def _off_device(state, path: tuple = ()) -> list[str]:
    """Where in ``state`` a tensor is not on the device (but where torch keeps it on the CPU)."""
    if isinstance(state, torch.Tensor):
        exempt = any(path[-len(end) :] == end for end in ON_CPU_BY_TORCH)
        return [] if state.device == CUDA or exempt else [f"{'.'.join(map(str, path))} on {state.device}"]
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list | tuple) else ()
    return [where for key, value in items for where in _off_device(value, (*path, key))]


def _assert_on_device(sync, when: str) -> None:
    for name, state in (("state_dict", sync.state_dict()), ("local_state_dict", sync.local_state_dict())):
        off = _off_device(state)
        assert not off, f"{when}: {name}: {off}"


# ---- every option, alone and wrapped ---------------------------------------------------------------------------
OPTIONS = sorted(path.stem for path in (CONF_DIR / "sync").glob("*.yaml"))
WRAPPERS = [  # (the options around another, sync.inner; sync=auto chooses its own)
    o
    for o in OPTIONS
    if "inner" in inspect.signature(get_class(OmegaConf.load(CONF_DIR / "sync" / f"{o}.yaml")._target_)).parameters
]
# Options under which each algorithm's state matters within 3 + 1 steps: local SGD averages after the resume, DiLoCo
# takes an outer step before and after it, relaxed sync checks at every step (evicting nobody).
STATEFUL = {
    "localsgd": ["begin_step=1", "k_steps=3"],
    "adaptive_localsgd": ["begin_step=1", "init_k_steps=3"],
    "diloco": ["inner_steps=2"],
    "powersgd": ["start_powerSGD_iter=2"],
    "relaxed": ["relaxed_sync_threshold=-1", "check_every=1"],
    "auto": ["probe_steps=2", "start=localsgd4", "margin=1000"],  # (its probe, then local SGD k=4, averaging after)
}
# Rounds in flight across steps (mixed in later, or by drain()), streaming fragments with int8 quantization, fp16.
VARIANTS = {
    "sgp": [["overlap=true", "synch_freq=2"]],
    "crossover": [["overlap=true"]],
    "diloco": [
        ["inner_steps=4", "fragments=2", "delay=1", "quantize=int8"],
        ["quantize=fp16", "alpha=0.5"],
    ],
}
# sync=decoupled runs its rounds on a syncer thread of each rank, with peers that post: the fake tensors' mode is the
# test thread's own, and one process has no peers. The factory check below covers its tensors' devices; on a GPU
# (tests/test_gpu.py) it trains alone, and its syncers run where there are two GPUs.
THREADED = {"decoupled"}
ALONE = [(o, []) for o in OPTIONS if o not in WRAPPERS and o not in THREADED]
ALONE += [(o, v) for o, variants in VARIANTS.items() for v in variants]
# Inside a wrapper: relaxed sync's default inner (DDP), and one with per-rank state and rounds in flight that the
# wrapper's check drains (SGP overlap). The wrapper's own code is the same whatever the inner, and test_contract.py
# checks that it forwards every hook.
INNERS = [("allreduce", []), ("sgp", VARIANTS["sgp"][0])]
CASES = [(None, o, v) for o, v in ALONE] + [(w, o, v) for w in WRAPPERS for o, v in INNERS]


def _overrides(case: tuple) -> list[str]:
    wrapper, option, variant = case
    own = [f"sync.{kv}" for kv in STATEFUL.get(option, []) + variant]
    if wrapper is None:
        return [*COMMON, f"sync={option}", *own]
    wrapper_own = [f"sync.{kv}" for kv in STATEFUL.get(wrapper, [])]  # (relaxed: a check at every step)
    inner = [o.replace("sync.", "sync.inner.", 1) for o in own]
    return [*COMMON, f"sync={wrapper}", f"sync@sync.inner={option}", *wrapper_own, *inner]


def _id(case: tuple) -> str:
    wrapper, option, variant = case
    return " ".join([f"{wrapper}({option})" if wrapper else option, *variant])


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_state_stays_on_the_device_through_steps_and_a_resume(fake_cuda, monkeypatch, case):
    """Three steps, then the state read back as a resume reads it (the shared state from the checkpoint, on the CPU;
    this rank's own with ``map_location`` the device, DGC's generator state included) into a new algorithm, and a
    fourth step (a local SGD averaging, a DiLoCo outer step, a streaming fragment left in flight for ``drain()``).
    A CPU tensor meeting a CUDA one in any op raises ``FakeTensorDeviceMismatchError``; one that no op meets is
    found in the state."""
    cfg = plain_cfg(*_overrides(case))
    model, optimizer = _replica(cfg)
    sync = _sync(cfg, model, optimizer, monkeypatch)
    _train(sync, model, optimizer, range(3), epoch=1)
    _assert_on_device(sync, "after 3 steps")
    shared, own = _loaded(sync.state_dict(), CPU), _loaded(sync.local_state_dict(), CUDA)
    resumed = _sync(cfg, model, optimizer, monkeypatch)  # (the replica's own state is the trainer's to restore)
    resumed.load_state_dict(shared)
    if own:
        resumed.load_local_state_dict(own)
    _train(resumed, model, optimizer, range(3, 4), epoch=2)
    _assert_on_device(resumed, "after the resume and a step")


# ---- PowerSGD's own state, without DDP -------------------------------------------------------------------------
class Bucket:
    """What DDP hands its comm hook (``dist.GradBucket``), made by hand: a flat gradient buffer, its parameters'
    gradients as views of it."""

    def __init__(self, index: int, params: list[torch.Tensor], last: bool):
        self._index, self._params, self._last = index, params, last
        self._buffer = torch.cat([torch.randn_like(p).reshape(-1) for p in params])

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        sizes = [p.numel() for p in self._params]
        return [g.view_as(p) for g, p in zip(self._buffer.split(sizes), self._params)]

    def is_last(self) -> bool:
        return self._last


class Reduced:
    """An allreduce of the fake group done, with what a real group's future holds (the fake group's holds None):
    PowerSGD's hook reads the reduced tensor from it."""

    def __init__(self, tensor: torch.Tensor):
        self.future = torch.futures.Future()
        self.future.set_result([tensor])

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future


def _backward(sync) -> None:
    """DDP's part of a backward pass: the comm hook on each bucket (two, the last layers first, as DDP lays them)."""
    params = list(sync.model.parameters())
    buckets = [params[len(params) // 2 :], params[: len(params) // 2]]
    for index, bucket in enumerate(buckets):
        sync.comm_hook(sync.hook_state, Bucket(index, bucket, last=index == len(buckets) - 1)).wait()


def test_powersgd_state_stays_on_the_device_without_ddp(fake_cuda, monkeypatch):
    """PowerSGD's per-rank state (error feedback, warm-start P and Q, kept per parameter) is made by PyTorch's hook,
    which only DDP calls: called here as DDP would, past ``start_powerSGD_iter``, read back with ``map_location`` the
    device into a new instance, and used by the hook again."""
    fake_all_reduce = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        return Reduced(tensor) if fake_all_reduce(tensor, *args, **kwargs) else None  # (None: not async_op)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    cfg = plain_cfg(*COMMON, "sync=powersgd", "sync.start_powerSGD_iter=2")
    sync = _sync(cfg, *_replica(cfg), monkeypatch)
    for _ in range(3):  # plain allreduce twice, then compressed
        _backward(sync)
    own = sync.local_state_dict()
    assert own and all("error" in pieces for pieces in own.values())
    assert any("p" in pieces and "q" in pieces for pieces in own.values())  # some tensors were compressed
    _assert_on_device(sync, "after 3 steps")
    resumed = _sync(cfg, *_replica(cfg), monkeypatch)
    resumed.load_state_dict(_loaded(sync.state_dict(), CPU))
    resumed.load_local_state_dict(_loaded(own, CUDA))
    _backward(resumed)  # the error feedback read back is added to the gradients
    assert resumed.psgd.error_dict and all(e.device == CUDA for e in resumed.psgd.error_dict.values())
    _assert_on_device(resumed, "after the resume and a step")


# ---- what does not run here: every tensor factory names its device ----------------------------------------------
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "randn", "rand", "randint", "randperm"}
FACTORIES |= {"linspace", "eye", "from_numpy"}  # (``*_like`` take the device of their argument)
# Made on the CPU on purpose: (file, function, factory) -> why.
ON_CPU_ON_PURPOSE = {
    ("algorithms/dgc.py", "DGC.setup", "tensor"): "tensor sizes turned into Python offsets at once (.tolist())",
    ("algorithms/powersgd.py", "PowerSGD.state_dict", "from_numpy"): "numpy's RNG state: shared, read on the CPU",
    ("distributed/topology.py", "LoadBalancedRandom.permutation", "randperm"): "a CPU generator's draw, as ints",
}
SOURCES = sorted(path for folder in ("algorithms", "engine", "distributed") for path in (ROOT / folder).rglob("*.py"))


def unplaced(source: str) -> list[tuple[str, str, int]]:
    """(enclosing class and function, factory, line) of each ``torch.<factory>(...)`` call without ``device=``."""
    found = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, (*scope, child.name))
                continue
            func = getattr(child, "func", None)
            if (
                isinstance(child, ast.Call)
                and isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id == "torch"
                and func.attr in FACTORIES
                and not any(keyword.arg == "device" for keyword in child.keywords)
            ):
                found.append((".".join(scope), func.attr, child.lineno))
            visit(child, scope)

    visit(ast.parse(source), ())
    return found


def test_every_tensor_factory_names_its_device():
    """What the fake run cannot reach (DDP's side, evaluation, the comm layer) still makes its tensors on the device,
    or on the CPU for a reason given here."""
    found = {}
    for path in SOURCES:
        for scope, factory, line in unplaced(path.read_text()):
            found[(str(path.relative_to(ROOT)), scope, factory)] = line
    unexplained = [
        f"{f}:{line} {scope}: torch.{fn}"
        for (f, scope, fn), line in found.items()
        if (f, scope, fn) not in ON_CPU_ON_PURPOSE
    ]
    assert not unexplained, f"name the device (device=...), or say here why not: {unexplained}"
    assert set(ON_CPU_ON_PURPOSE) <= set(found), f"no longer there: {sorted(set(ON_CPU_ON_PURPOSE) - set(found))}"


def test_the_factory_check_finds_a_tensor_made_without_a_device():
    """The check above can fail: a CPU flag concatenated with device tensors (``*_like`` follow their argument)."""
    source = """
import torch
class Algo:
    def setup(self, ctx):
        self.u = torch.zeros(3, device=ctx.device)
        self.v = torch.zeros_like(self.u)
        self.flag = torch.cat([self.u, torch.tensor([0.0])])
"""
    assert unplaced(source) == [("Algo.setup", "tensor", 7)]
