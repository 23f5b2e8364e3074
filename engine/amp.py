"""Mixed precision behind one interface: ``amp=none``, ``amp=torch`` (autocast + GradScaler) or ``amp=apex``.

The loop calls, in order: ``autocast()`` around the forward pass, ``backward(loss, optimizer)``,
``unscale(optimizer) -> grads_finite`` (gradients are unscaled from here on, so sync algorithms see true
values), then ``step(optimizer, grads_finite)`` with the verdict every rank agreed on.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from errors import is_number, require


class AmpBackend:
    name = "base"

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        """Raise ``ConfigError`` before any worker starts."""

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        self.device = device
        return model, optimizer

    def autocast(self):
        return contextlib.nullcontext()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Clear the gradients before a step's backward (as ``None``: no memset, and a skipped parameter stays
        without one)."""
        optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale gradients in place; return whether this rank's gradients are all finite."""
        return True

    def step(self, optimizer: torch.optim.Optimizer, grads_finite: bool) -> bool:
        """Apply the optimizer step unless the agreed verdict is an overflow; return whether it stepped."""
        if grads_finite:
            optimizer.step()
        return grads_finite

    @property
    def loss_scale(self) -> float:
        return 1.0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class NoAmp(AmpBackend):
    """Full precision."""

    name = "none"


class TorchAmp(AmpBackend):
    """``torch.autocast`` and, for float16, ``torch.amp.GradScaler`` built for the real device."""

    name = "torch"
    DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

    def __init__(self, dtype: str = "auto", scaler: str | bool = "auto", init_scale: float = 65536.0):
        self.dtype_name, self.scaler_mode, self.init_scale = dtype, scaler, init_scale

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        require(
            section["dtype"] in ("auto", *cls.DTYPES), "amp.dtype", section["dtype"], "one of auto, bfloat16, float16"
        )
        require(section["scaler"] in ("auto", True, False), "amp.scaler", section["scaler"], "one of auto, true, false")
        s = section["init_scale"]
        require(is_number(s) and s > 0, "amp.init_scale", s, "a number > 0")

    def setup(self, model, optimizer, device):
        super().setup(model, optimizer, device)
        if self.dtype_name == "auto":  # bfloat16 where the device computes in it (no loss scaling), else float16
            cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
            self.dtype = torch.float16 if device.type == "cuda" and not cuda_bf16 else torch.bfloat16
        else:
            self.dtype = self.DTYPES[self.dtype_name]
        use_scaler = self.dtype == torch.float16 if self.scaler_mode == "auto" else bool(self.scaler_mode)
        # GradScaler("cuda") on a machine without CUDA silently disables itself: build it for the real device.
        self.scaler = torch.amp.GradScaler(device.type, init_scale=self.init_scale, enabled=use_scaler)
        return model, optimizer

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss, optimizer):
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer) -> bool:
        if not self.scaler.is_enabled():
            return True
        self.scaler.unscale_(optimizer)
        found = self._found_inf(optimizer)
        return not bool(sum(v.item() for v in found.values()))

    def step(self, optimizer, grads_finite: bool) -> bool:
        if not self.scaler.is_enabled():
            return super().step(optimizer, grads_finite)
        if not grads_finite:
            # Another rank overflowed: make this rank's scaler see it too, so that it skips the step and
            # backs off the scale exactly like the others.
            for v in self._found_inf(optimizer).values():
                v.fill_(1.0)
        else:
            # The agreed verdict is "finite": gradients were exchanged after unscaling and every rank holds the
            # same finite values now, so clear a local flag raised before the exchange.
            for v in self._found_inf(optimizer).values():
                v.zero_()
        self.scaler.step(optimizer)
        self.scaler.update()
        return grads_finite

    def _found_inf(self, optimizer) -> dict:
        # GradScaler keeps the per-device overflow flags it found in unscale_() here; step() and update()
        # read them. There is no public setter.
        return self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    @property
    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler.is_enabled() else 1.0

    def state_dict(self):
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state):
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


class AutoAmp(TorchAmp):
    """``amp=auto`` (the default): on CUDA, ``amp=torch``'s autocast (bfloat16 where the GPU supports it, else
    float16 with the GradScaler); elsewhere full precision, as ``amp=none``."""

    name = "auto"

    def setup(self, model, optimizer, device):
        self.active = device.type == "cuda"
        if not self.active:
            self.scaler = torch.amp.GradScaler(device.type, enabled=False)
            return AmpBackend.setup(self, model, optimizer, device)
        return super().setup(model, optimizer, device)

    def autocast(self):
        return super().autocast() if self.active else contextlib.nullcontext()


def probe_apex() -> str | None:
    """Return what is missing for ``amp=apex``, or None when NVIDIA apex with ``apex.amp`` and CUDA are there."""
    try:
        import apex  # noqa: F401
    except ImportError:
        return (
            "NVIDIA apex is not installed (it is not on PyPI; the PyPI package 'apex' is unrelated). "
            "Install apex 25.04 from its source with make apex APEX_SRC=<dir or .tar.gz> (docs/multinode.md), "
            "or use amp=torch"
        )
    try:
        from apex import amp  # noqa: F401
    except ImportError:
        return (
            "the installed apex has no apex.amp (NVIDIA removed it in apex 25.07; the last release with it is "
            "25.04), or it is not NVIDIA apex. Use amp=torch"
        )
    if not torch.cuda.is_available():
        return "apex.amp needs a CUDA device and none is available. Use amp=torch (bfloat16 on CPU)"
    return None


def _exchange(sync: dict[str, Any]) -> tuple[type | None, str]:
    """The class of the algorithm that exchanges (a wrapper's inner one), and how the config names it; None for a
    class that does not import (the sync group's own validation says so)."""
    from hydra.utils import get_class

    from algorithms.base import Wrapper

    try:
        algorithm = get_class(sync["_target_"])
        if issubclass(algorithm, Wrapper) and "inner" in sync:  # (sync=auto has candidates: itself, then)
            inner = get_class(sync["inner"]["_target_"])
            return inner, f"sync={algorithm.name} with sync.inner={inner.name}"
    except Exception:
        return None, ""
    return algorithm, f"sync={algorithm.name}"


def _writes_parameters(algorithm: type) -> bool:
    """Whether a sync algorithm may write the model's parameters itself, not only through the optimizer's step: the
    hooks where the contract (``algorithms/base.py``) puts a model exchange are its own, ``after_optimizer_step``
    (an average, a gossip mix, an outer step) or ``before_eval`` (the base's averages only BN statistics)."""
    from algorithms.base import SyncAlgorithm

    hooks = ("after_optimizer_step", "before_eval")
    return any(getattr(algorithm, hook) is not getattr(SyncAlgorithm, hook) for hook in hooks)


class ApexAmp(AmpBackend):
    """Legacy NVIDIA ``apex.amp`` (apex 25.04, the last release with it): ``amp.initialize`` and ``amp.scale_loss``.

    On leaving ``scale_loss`` apex unscales the gradients, checks them for overflow and updates its loss scale: on an
    overflow (dynamic scaling) it halves the scale and replaces ``optimizer.step`` with a skip that puts the real
    one back; otherwise it counts the step and doubles the scale after 2000 of them. ``unscale`` reports that local
    verdict. The verdict every rank agreed on decides: where it is an overflow that this rank did not see (DGC
    exchanges after unscaling, and another rank overflowed), ``step`` skips too and redoes apex's scale update as an
    overflow, from the state it saved before ``scale_loss``, so every rank keeps the same loss scale.

    Opt levels: O0 trains in float32 (a loss scale still applies); O1 patches torch functions to run in float16 where
    safe, the model stays float32 (the casts are on inside ``autocast()`` only); O2 casts the model to float16 (batch
    norm stays float32) and the optimizer steps float32 master copies, which apex copies into the model after each
    step; O3 casts the whole model to float16, no masters. Under O2 the masters are made at ``setup`` (apex makes them
    at the first ``zero_grad`` or backward), so a sync algorithm that reads the optimizer's parameters (DGC) holds
    those the optimizer steps, and they travel in ``state_dict``: a resumed, healed or joined process continues from
    them exactly. A sync algorithm that writes the model itself is rejected under O2 (``validate``): the masters
    would overwrite what it wrote.
    """

    name = "apex"
    OPT_LEVELS = ("O0", "O1", "O2", "O3")

    def __init__(self, opt_level: str = "O1", loss_scale: str | float = "dynamic"):
        self.opt_level, self.loss_scale_cfg = opt_level, loss_scale
        self.master_weights = opt_level == "O2"  # apex's O2 properties: float32 masters in the optimizer
        self.before_update: dict[str, Any] = {}  # apex's loss scaler state before this step's scale_loss
        self.unfinished = False  # a backward has run and its step() has not

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        level = section["opt_level"]
        require(level in cls.OPT_LEVELS, "amp.opt_level", level, "one of O0, O1, O2, O3")
        ls = section["loss_scale"]
        require(ls == "dynamic" or (is_number(ls) and ls > 0), "amp.loss_scale", ls, "dynamic or a number > 0")
        algorithm, sync = _exchange(cfg["sync"])
        if algorithm is not None and level == "O2":
            why = (
                "it writes the model's parameters itself; apex's float32 masters would overwrite them at the next step"
            )
            require(not _writes_parameters(algorithm), "amp.opt_level", level, f"O0, O1 or O3 with {sync} ({why})")
        if algorithm is not None and level == "O3":  # (the algorithm says so: the engine imports no plugin)
            why = (
                "O3 casts every parameter to float16 and DGC compresses only float32 ones: nothing would be compressed"
            )
            float32_only = getattr(algorithm, "compresses_float32_only", False)
            require(not float32_only, "amp.opt_level", level, f"O0, O1 or O2 with {sync} ({why})")
        missing = probe_apex()
        require(missing is None, "amp", "apex", f"NVIDIA apex with apex.amp and CUDA: {missing}")

    def setup(self, model, optimizer, device):
        super().setup(model, optimizer, device)
        from apex import amp

        self.amp = amp
        model, optimizer = amp.initialize(
            model, optimizer, opt_level=self.opt_level, loss_scale=self.loss_scale_cfg, verbosity=0
        )
        if self.master_weights:
            optimizer._amp_lazy_init()  # the float32 masters replace the model's parameters in the optimizer
        self.optimizer = optimizer
        self._casts_off()
        return model, optimizer

    def autocast(self):
        return self._casting() if self.opt_level == "O1" else contextlib.nullcontext()

    @contextlib.contextmanager
    def _casting(self):
        """O1's casts, on where the other backends autocast (the forward pass and the loss). apex patches torch's
        functions for the whole process, and on everywhere they would break code around the model: an evaluation's
        float64 sums (apex refuses to promote float32 with float64). Its cache of float16 weights is dropped after
        each forward, so a forward after the weights changed in place (an average before an evaluation) casts anew."""
        handle = self.amp._amp_state.handle
        handle._is_active = True
        try:
            yield
        finally:
            handle._is_active = False
            handle._clear_cache()

    def _casts_off(self) -> None:
        if self.opt_level == "O1":  # (apex's O1 optimizer step turns them on again when it returns)
            self.amp._amp_state.handle._is_active = False

    def zero_grad(self, optimizer):
        if not self.master_weights:
            # O0, O1, O3 leave torch's: gradients as None, so scale_loss has none to stash and add back.
            super().zero_grad(optimizer)
            return
        # apex's O2 zero_grad (it takes no arguments) zeroes the model's gradients in place with detach_(), which
        # raises on gradients that are views of DDP's buckets (gradient_as_bucket_view), from the second step on.
        # What it zeroes goes to None here (scale_loss sets the float16 ones to None anyway), and the masters'
        # gradients, which it drops, too.
        stash = optimizer._amp_stash
        for p in (*stash.all_fp16_params, *stash.all_fp32_from_fp32_params, *stash.all_fp32_from_fp16_params):
            p.grad = None

    def backward(self, loss, optimizer):
        if self.unfinished:
            # The step is redone (a peer was lost after this backward, trainer.on_failure=continue): apex's update of
            # the first try is undone, and a skip it left in place of step() is spent (it only puts the step back).
            self.amp.load_state_dict(self.before_update)
            if optimizer._amp_stash.already_patched:
                optimizer.step()
        else:
            self.before_update = self.amp.state_dict()  # each loss scaler's loss_scale and unskipped
        self.unfinished = True
        with self.amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()

    def unscale(self, optimizer) -> bool:
        # scale_loss has unscaled already; report what apex's scaler found.
        return not self._scaler()._has_overflow

    def step(self, optimizer, grads_finite: bool) -> bool:
        self.unfinished = False
        if optimizer._amp_stash.already_patched:
            # apex overflowed here: step() is its skip, which puts the real step back. (Its Python unscale stops at
            # the first non-finite gradient, so no verdict could make these gradients fit to step on.)
            assert not grads_finite, "an overflow on one rank makes the agreed verdict an overflow on every rank"
            optimizer.step()
            return False
        if not grads_finite:
            self._skip_as_apex(optimizer)
            return False
        optimizer.step()
        self._casts_off()
        return True

    def _skip_as_apex(self, optimizer) -> None:
        """What apex does on an overflow of its own, where only the agreed verdict is one: the loss scale update redone
        as an overflow from the state before ``scale_loss`` (halved, its count of finite steps reset), and under O2
        the masters' gradients dropped, as apex's skip drops them; the optimizer does not step."""
        scaler = self._scaler()
        self.amp.load_state_dict(self.before_update)
        scaler._has_overflow = True
        scaler.update_scale()
        for master in getattr(optimizer._amp_stash, "all_fp32_from_fp16_params", []):
            master.grad = None

    def _scaler(self):
        return self.amp._amp_state.loss_scalers[0]

    @property
    def loss_scale(self) -> float:
        return float(self._scaler().loss_scale())

    def state_dict(self):
        state: dict[str, Any] = {"apex_amp": self.amp.state_dict()}
        if self.master_weights:
            state["master_params"] = [p.detach() for p in self.optimizer._amp_stash.all_fp32_from_fp16_params]
        return state

    def load_state_dict(self, state):
        """Called after the model's own (``load_replica``): under O2 the masters come from ``state``, or from
        the model just loaded where ``state`` has none (a checkpoint of another opt level)."""
        if self.optimizer._amp_stash.already_patched:  # (a rank healed from a peer: the skip its own overflow left)
            self.optimizer.step()
        self.unfinished = False
        if state.get("apex_amp"):
            self.amp.load_state_dict(state["apex_amp"])
        if self.master_weights:
            stash = self.optimizer._amp_stash
            saved = state.get("master_params") or stash.all_fp16_params
            with torch.no_grad():
                for master, value in zip(stash.all_fp32_from_fp16_params, saved, strict=True):
                    master.copy_(value)
