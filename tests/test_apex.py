"""``amp=apex``: NVIDIA apex's legacy ``apex.amp`` behind the AMP interface, checked on the CPU.

Two ways in. A stand-in for ``apex.amp`` (:class:`StubAmp`) that does what apex 25.04 does where ``ApexAmp`` drives
it: always runs. And the real apex (``make apex APEX_SRC=...``), run on the CPU: ``amp.initialize`` and O2's
masters accept only tensors that say they are on CUDA, and the loss scaler allocates one CUDA int, so while the
backend is set up the tensors say so, and the int is made on the CPU; everything else (``scale_loss``, unscaling,
the loss scale update, the skip of an overflow step, O2's masters and their step) is apex's own code, on its Python
path. apex's O1 patches torch functions for the whole process, so its real runs here take O0: no masters, and the
same loss scaling and optimizer patches as O1.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import types

import pytest
import torch
from conftest import CONF_DIR, FAST, plain_cfg
from torch import nn

from engine.amp import ApexAmp
from errors import ConfigError

try:
    from apex.amp._amp_state import _amp_state
except ImportError:
    _amp_state = None
NO_APEX = "NVIDIA apex not installed (make apex APEX_SRC=...)"
pytestmark = pytest.mark.filterwarnings("ignore:apex.amp is deprecated", "ignore:An input tensor was not cuda")


# ---- the stand-in: apex 25.04's apex.amp where ApexAmp drives it, without CUDA ----------------------------------
class StubScaler:
    """``apex.amp.scaler.LossScaler``'s state and its ``update_scale`` rule, as apex 25.04 has them."""

    def __init__(self, loss_scale, init_scale=2.0**16, scale_window=2000, min_loss_scale=None, max_loss_scale=2.0**24):
        self.dynamic = loss_scale == "dynamic"
        self._loss_scale = min(max_loss_scale, init_scale) if self.dynamic else loss_scale
        self._max_loss_scale, self._min_loss_scale, self._scale_seq_len = max_loss_scale, min_loss_scale, scale_window
        self._unskipped, self._has_overflow = 0, False

    def loss_scale(self):
        return self._loss_scale

    def update_scale(self):
        if self._has_overflow and self.dynamic:
            should_skip = True
            if self._min_loss_scale:
                self._loss_scale = max(self._min_loss_scale, self._loss_scale / 2.0)
            else:
                self._loss_scale = self._loss_scale / 2.0
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * 2.0)
            self._unskipped = 0
        return should_skip


class StubHandle:
    """``apex.amp.handle.AmpHandle`` (O1): the switch of apex's patched torch functions, and their float16 casts."""

    def __init__(self):
        self._is_active, self.cache = True, {}

    def is_active(self):
        return self._is_active

    def _clear_cache(self):
        self.cache.clear()


class StubAmp(types.ModuleType):
    """``apex.amp``: ``initialize`` (O2 casts the model to float16, batch norm aside, and patches the optimizer for
    float32 masters: ``step``, a ``zero_grad`` without arguments), ``scale_loss`` (unscales, stops at the first
    non-finite gradient, updates the scale, patches ``step`` into a skip that restores itself), ``state_dict``."""

    def initialize(self, model, optimizer, opt_level, loss_scale, verbosity):
        self._amp_state = types.SimpleNamespace(loss_scalers=[StubScaler(loss_scale)])
        self.master_weights = opt_level == "O2"
        optimizer._amp_stash = types.SimpleNamespace(already_patched=False, lazy_init_called=False)
        if opt_level == "O1":  # apex.amp.init: torch's functions patched, on; the step runs with them off
            handle = self._amp_state.handle = StubHandle()
            real_step = optimizer.step

            def step(closure=None):
                handle._is_active = False
                real_step()
                handle._is_active = True

            optimizer.step = step
        if self.master_weights:
            model.half()
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.float()
            forward = model.forward
            model.forward = lambda x: forward(x.half()).float()
            _patch_for_masters(optimizer)
        return model, optimizer

    @contextlib.contextmanager
    def scale_loss(self, loss, optimizer):
        scaler, stash = self._amp_state.loss_scalers[0], optimizer._amp_stash
        if self.master_weights:
            optimizer._amp_lazy_init()
            pairs = list(zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params))
            pairs += [(p, p) for p in stash.all_fp32_from_fp32_params]
        else:
            pairs = [(p, p) for group in optimizer.param_groups for p in group["params"]]
        for model_param, _ in pairs:
            model_param.grad = None
        yield loss.float() * scaler.loss_scale()
        scaler._has_overflow = False
        for model_param, master in pairs:
            if model_param.grad is None:
                continue
            if not torch.isfinite(model_param.grad).all():
                scaler._has_overflow = True
                break
            if master is model_param:
                model_param.grad.mul_(1.0 / scaler.loss_scale())
            else:
                master.grad = model_param.grad.float() * (1.0 / scaler.loss_scale())
        if scaler.update_scale() and not stash.already_patched:
            real_step = optimizer.step

            def skip_step(closure=None):
                for master in getattr(stash, "all_fp32_from_fp16_params", []):
                    master.grad = None
                optimizer.step, stash.already_patched = real_step, False

            optimizer.step, stash.already_patched = skip_step, True

    def state_dict(self):
        return {"loss_scaler0": {"loss_scale": self._amp_state.loss_scalers[0]._loss_scale,
                                 "unskipped": self._amp_state.loss_scalers[0]._unskipped}}  # fmt: skip

    def load_state_dict(self, state):
        scaler = self._amp_state.loss_scalers[0]
        scaler._loss_scale, scaler._unskipped = state["loss_scaler0"]["loss_scale"], state["loss_scaler0"]["unskipped"]


def _patch_for_masters(optimizer):
    """apex's ``_process_optimizer`` with master weights: float32 masters made lazily, ``step`` copies them into the
    model, ``zero_grad`` (no arguments) zeroes the model's gradients in place and drops the masters'."""
    stash, real_step = optimizer._amp_stash, optimizer.step

    def lazy_init():
        if stash.lazy_init_called:
            return
        stash.all_fp16_params, stash.all_fp32_from_fp16_params, stash.all_fp32_from_fp32_params = [], [], []
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if p.dtype == torch.float16:
                    master = p.detach().clone().float().requires_grad_()
                    group["params"][i] = master
                    stash.all_fp16_params.append(p)
                    stash.all_fp32_from_fp16_params.append(master)
                else:
                    stash.all_fp32_from_fp32_params.append(p)
        stash.lazy_init_called = True

    def step(closure=None):
        real_step()
        with torch.no_grad():
            for p, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
                p.copy_(master)
        for master in stash.all_fp32_from_fp16_params:
            master.grad = None

    def zero_grad():
        lazy_init()
        for p in stash.all_fp16_params + stash.all_fp32_from_fp32_params:
            if p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()
        for master in stash.all_fp32_from_fp16_params:
            master.grad = None

    optimizer._amp_lazy_init, optimizer.step, optimizer.zero_grad = lazy_init, step, zero_grad


# ---- building a backend on either ---------------------------------------------------------------------------------
def _as_on_cuda(tensor, *args, **kwargs):
    name = torch._C.TensorBase.type(tensor, *args, **kwargs)
    return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs else name


def use(flavor: str, monkeypatch) -> None:
    """Make ``from apex import amp`` give the real apex (skip where it is not installed) or the stand-in."""
    if flavor == "apex":
        if _amp_state is None:
            pytest.skip(NO_APEX)
        monkeypatch.setattr(torch.cuda, "IntTensor", lambda data: torch.tensor(data, dtype=torch.int32))
        monkeypatch.setattr(_amp_state, "allow_incoming_model_not_fp32", True)
    else:
        stub, package = StubAmp("apex.amp"), types.ModuleType("apex")
        package.amp = stub
        monkeypatch.setitem(sys.modules, "apex", package)
        monkeypatch.setitem(sys.modules, "apex.amp", stub)


def build(flavor: str, level: str, monkeypatch, scale: float = 256.0, window: int = 2000):
    """A small model with batch norm, SGD and ``ApexAmp`` set up on it; apex's loss scale set to ``scale``, doubled
    after ``window`` finite steps."""
    use(flavor, monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    backend = ApexAmp(opt_level=level)
    with monkeypatch.context() as m:
        if flavor == "apex":
            m.setattr(torch.Tensor, "type", _as_on_cuda)
        model, optimizer = backend.setup(model, optimizer, torch.device("cpu"))
        if flavor == "apex":
            optimizer._amp_lazy_init()  # (what apex does at the first backward under O0, O1, O3; O2's at setup)
    scaler = backend.amp._amp_state.loss_scalers[0]
    scaler._loss_scale, scaler._scale_seq_len = scale, window
    return model, optimizer, backend


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def train_step(model, optimizer, backend, step: int, agreed: bool | None = None, overflow: bool = False):
    """One step of the loop's order (engine/loop.py): zero_grad, backward, unscale (the local verdict), step with the
    agreed verdict (the local one where None). ``overflow``: this rank's loss is infinite. Returns (local, stepped)."""
    x, y = batch(step)
    backend.zero_grad(optimizer)
    loss = nn.functional.cross_entropy(model(x), y)
    backend.backward(loss * float("inf") if overflow else loss, optimizer)
    local = backend.unscale(optimizer)
    return local, backend.step(optimizer, local if agreed is None else agreed)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


CASES = [("apex", "O0"), ("apex", "O2"), ("stub", "O1"), ("stub", "O2")]
IDS = [f"{flavor}-{level}" for flavor, level in CASES]


# ---- zero_grad ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flavor", ["apex", "stub"])
def test_o2_zero_grad_clears_what_apexs_would_without_its_call_that_fails_on_ddp_buckets(flavor, monkeypatch):
    model, optimizer, backend = build(flavor, "O2", monkeypatch)
    train_step(model, optimizer, backend, 0)
    stash = optimizer._amp_stash
    for params in (stash.all_fp16_params, stash.all_fp32_from_fp32_params):
        # DDP with gradient_as_bucket_view (sync=allreduce) leaves each gradient a view of its bucket.
        bucket = torch.ones(sum(p.numel() for p in params), dtype=params[0].dtype)
        for p, view in zip(params, bucket.split([p.numel() for p in params])):
            p.grad = view.view_as(p)
    for master in stash.all_fp32_from_fp16_params:
        master.grad = torch.ones_like(master)
    with pytest.raises(RuntimeError, match="Can't detach views in-place"):
        optimizer.zero_grad()  # apex's own under O2 (it takes no arguments)
    backend.zero_grad(optimizer)
    everything = stash.all_fp16_params + stash.all_fp32_from_fp32_params + stash.all_fp32_from_fp16_params
    assert all(p.grad is None for p in everything)
    assert train_step(model, optimizer, backend, 1) == (True, True)  # and the next step goes on from there


# ---- the agreed verdict ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flavor,level", CASES, ids=IDS)
def test_an_overflow_on_another_rank_skips_the_step_and_backs_off_the_scale_as_apex_does(flavor, level, monkeypatch):
    """Two ranks of a DGC-like exchange (the agreed verdict is an overflow where either rank's is), one after the
    other (apex's state is the process's): rank 1 overflows at step 2, rank 0 does not. Step 2 reaches apex's
    window of 3 finite steps on rank 0, where apex doubles the scale: the back-off starts from before that."""
    ranks = []
    for overflow_at in (None, 2):
        model, optimizer, backend = build(flavor, level, monkeypatch, scale=256.0, window=3)
        history = []
        for step in range(4):
            before = flat(model)
            local, stepped = train_step(model, optimizer, backend, step, agreed=step != 2, overflow=step == overflow_at)
            scaler = backend.amp._amp_state.loss_scalers[0]
            masters = getattr(optimizer._amp_stash, "all_fp32_from_fp16_params", [])
            history.append(
                {
                    "local": local,
                    "stepped": stepped,
                    "changed": not torch.equal(before, flat(model)),
                    "scale": (scaler.loss_scale(), scaler._unskipped),
                    "skip_patched": optimizer._amp_stash.already_patched,
                    "master_grads": [m.grad is not None for m in masters],
                }
            )
        ranks.append((history, flat(model)))
    (finite, params_0), (overflowing, params_1) = ranks
    assert [h["local"] for h in finite] == [True, True, True, True]
    assert [h["local"] for h in overflowing] == [True, True, False, True]
    for rank in (finite, overflowing):
        assert [h["stepped"] for h in rank] == [True, True, False, True]
        assert [h["changed"] for h in rank] == [True, True, False, True]
        assert [h["scale"] for h in rank] == [(256.0, 1), (256.0, 2), (128.0, 0), (128.0, 1)]
        assert not any(h["skip_patched"] for h in rank)  # apex's skip ran and put the real step back
        assert not any(any(h["master_grads"]) for h in rank)  # O2: dropped after a step, and after a skip
    torch.testing.assert_close(params_0, params_1, rtol=0, atol=0)


@pytest.mark.parametrize("flavor,level", CASES, ids=IDS)
def test_loss_scale_is_apexs(flavor, level, monkeypatch):
    model, optimizer, backend = build(flavor, level, monkeypatch, scale=1024.0)
    assert backend.loss_scale == 1024.0
    train_step(model, optimizer, backend, 0, overflow=True)
    assert backend.loss_scale == 512.0 == backend.amp._amp_state.loss_scalers[0].loss_scale()


@pytest.mark.parametrize("flavor,level", CASES, ids=IDS)
def test_a_step_redone_after_a_lost_peer_counts_once_in_apexs_scale(flavor, level, monkeypatch):
    """Under trainer.on_failure=continue a step whose exchange failed is redone from its start: the first try's
    backward has updated apex's scale (halved it and left its skip in place of step() where it saw an overflow)."""
    model, optimizer, backend = build(flavor, level, monkeypatch, scale=256.0, window=3)
    scaler = backend.amp._amp_state.loss_scalers[0]
    train_step(model, optimizer, backend, 0)
    x, y = batch(1)
    backend.zero_grad(optimizer)
    backend.backward(nn.functional.cross_entropy(model(x), y) * float("inf"), optimizer)  # the first try: overflow
    assert optimizer._amp_stash.already_patched
    before = flat(model)
    assert train_step(model, optimizer, backend, 1) == (True, True)  # the redo, finite, steps
    assert not torch.equal(before, flat(model))
    assert (scaler.loss_scale(), scaler._unskipped) == (256.0, 2)  # one finite step each
    backend.zero_grad(optimizer)
    backend.backward(nn.functional.cross_entropy(model(x), y), optimizer)  # a finite first try, at the window
    train_step(model, optimizer, backend, 2)
    assert (scaler.loss_scale(), scaler._unskipped) == (512.0, 0)  # doubled once

    # A rank healed from a peer after its own overflow: the peer's state, and its own skip spent.
    state = copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": backend.state_dict()}
    )
    backend.zero_grad(optimizer)
    backend.backward(nn.functional.cross_entropy(model(x), y) * float("inf"), optimizer)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    backend.load_state_dict(state["amp"])
    assert not optimizer._amp_stash.already_patched and (scaler.loss_scale(), scaler._unskipped) == (512.0, 0)
    assert train_step(model, optimizer, backend, 3) == (True, True)
    assert (scaler.loss_scale(), scaler._unskipped) == (512.0, 1)


def test_o1_casts_only_inside_autocast_and_casts_weights_anew_each_time(monkeypatch):
    """apex's O1 patches torch's functions for the whole process, and refuses to promote float32 with float64 (an
    evaluation's sums): its casts are on where the other backends autocast, and nowhere else."""
    model, optimizer, backend = build("stub", "O1", monkeypatch)
    handle = backend.amp._amp_state.handle
    assert not handle.is_active()
    with backend.autocast():
        assert handle.is_active()
        handle.cache["weight"] = "its float16 cast"
    assert not handle.is_active() and not handle.cache  # (weights changed in place before the next forward)
    train_step(model, optimizer, backend, 0)  # apex's O1 step turns them on again as it returns
    assert not handle.is_active()


# ---- O2's masters ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flavor", ["apex", "stub"])
def test_o2_masters_are_the_optimizers_from_setup_and_travel_in_the_state(flavor, monkeypatch):
    model, optimizer, backend = build(flavor, "O2", monkeypatch)
    # From setup on, the optimizer holds float32 tensors (a sync algorithm that reads them, DGC, holds those stepped).
    assert all(p.dtype == torch.float32 for group in optimizer.param_groups for p in group["params"])
    for step in range(3):
        train_step(model, optimizer, backend, step)
    masters = [m.detach().clone() for m in optimizer._amp_stash.all_fp32_from_fp16_params]
    assert any(not torch.equal(m, m.half().float()) for m in masters)  # more than the float16 model holds
    state = copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": backend.state_dict()}
    )

    # A resumed, healed or joining process: the model, the optimizer, then the AMP state (engine.state.load_replica).
    model_2, optimizer_2, backend_2 = build(flavor, "O2", monkeypatch)
    model_2.load_state_dict(state["model"])
    optimizer_2.load_state_dict(state["optimizer"])
    backend_2.load_state_dict(state["amp"])
    for master, expected in zip(optimizer_2._amp_stash.all_fp32_from_fp16_params, masters, strict=True):
        torch.testing.assert_close(master, expected, rtol=0, atol=0)
    train_step(model, optimizer, backend, 3)
    train_step(model_2, optimizer_2, backend_2, 3)
    assert torch.equal(flat(model), flat(model_2))

    # A state without masters (a checkpoint of another opt level): they come from the model just loaded.
    model_3, optimizer_3, backend_3 = build(flavor, "O2", monkeypatch)
    model_3.load_state_dict(state["model"])
    backend_3.load_state_dict({"apex_amp": state["amp"]["apex_amp"]})
    stash = optimizer_3._amp_stash
    for master, p in zip(stash.all_fp32_from_fp16_params, stash.all_fp16_params, strict=True):
        assert torch.equal(master, p.float())


# ---- validation: which sync options take which opt level --------------------------------------------------------
# The sync options that write the model's parameters themselves (an average, a gossip mix, an outer step; sync=none
# averages the replicas at each evaluation and goes on from there): apex O2's float32 masters would overwrite it.
WRITES_PARAMETERS = {"localsgd", "adaptive_localsgd", "diloco", "decoupled", "sgp", "crossover", "none", "auto"}
SYNC_OPTIONS = sorted(p.stem for p in (CONF_DIR / "sync").glob("*.yaml"))


def test_o2_takes_every_sync_option_but_those_that_write_the_model(monkeypatch):
    monkeypatch.setattr("engine.amp.probe_apex", lambda: None)  # (no CUDA here: the compatibility is checked)
    outcomes = {}
    for sync in SYNC_OPTIONS:
        try:
            outcomes[sync] = plain_cfg("amp=apex", "amp.opt_level=O2", f"sync={sync}", *FAST)["amp"]["opt_level"]
        except ConfigError as error:
            outcomes[sync] = str(error)
    why = "(it writes the model's parameters itself; apex's float32 masters would overwrite them at the next step)"
    expected = {sync: f"amp.opt_level='O2': expected O0, O1 or O3 with sync={sync} {why}" for sync in WRITES_PARAMETERS}
    # sync=powersgd refuses amp=apex at any opt level, in its own validation.
    expected["powersgd"] = "amp='apex': expected none or torch with sync=powersgd (apex.amp's patched optimizer "
    expected["powersgd"] += "conflicts with the comm hook)"
    assert outcomes == {sync: expected.get(sync, "O2") for sync in SYNC_OPTIONS}


REFUSED = [
    (["amp.opt_level=O2", "sync=relaxed", "sync@sync.inner=localsgd"], "O2", "sync=relaxed with sync.inner=localsgd"),
    (["amp.opt_level=O3", "sync=dgc"], "O3", "sync=dgc (O3 casts every parameter to float16 and DGC compresses"),
    (["amp.opt_level=O3", "sync=relaxed", "sync@sync.inner=dgc"], "O3", "sync=relaxed with sync.inner=dgc"),
]


@pytest.mark.parametrize("overrides,level,expected", REFUSED, ids=[" ".join(r[0]) for r in REFUSED])
def test_a_wrapped_exchange_and_dgc_under_o3_are_refused_by_name(overrides, level, expected, monkeypatch):
    monkeypatch.setattr("engine.amp.probe_apex", lambda: None)
    with pytest.raises(ConfigError) as info:
        plain_cfg("amp=apex", *overrides, *FAST)
    assert str(info.value).startswith(f"amp.opt_level='{level}': expected ")
    assert expected in str(info.value)
    plain_cfg("amp=apex", "amp.opt_level=O1", *overrides[1:], *FAST)  # O1 takes them
