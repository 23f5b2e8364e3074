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
        if self.dtype_name == "auto":
            self.dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
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


def probe_apex() -> str | None:
    """Return what is missing for ``amp=apex``, or None when NVIDIA apex with ``apex.amp`` and CUDA are there."""
    try:
        import apex  # noqa: F401
    except ImportError:
        return (
            "NVIDIA apex is not installed (it is not on PyPI; the PyPI package 'apex' is unrelated). "
            "Build apex <= 25.04 from source (see docs/multinode.md), or use amp=torch"
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


class ApexAmp(AmpBackend):
    """Legacy NVIDIA ``apex.amp``: ``amp.initialize(opt_level=...)`` and ``amp.scale_loss``.

    apex unscales and checks for overflow when ``scale_loss`` exits and then skips ``optimizer.step()`` itself
    on overflow. Gradients are averaged by DDP during backward, before that check, so every rank decides alike.
    """

    name = "apex"
    OPT_LEVELS = ("O0", "O1", "O2", "O3")

    def __init__(self, opt_level: str = "O1", loss_scale: str | float = "dynamic"):
        self.opt_level, self.loss_scale_cfg = opt_level, loss_scale

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        require(section["opt_level"] in cls.OPT_LEVELS, "amp.opt_level", section["opt_level"], "one of O0, O1, O2, O3")
        ls = section["loss_scale"]
        require(ls == "dynamic" or (is_number(ls) and ls > 0), "amp.loss_scale", ls, "dynamic or a number > 0")
        missing = probe_apex()
        require(missing is None, "amp", "apex", f"NVIDIA apex with apex.amp and CUDA: {missing}")

    def setup(self, model, optimizer, device):
        super().setup(model, optimizer, device)
        from apex import amp

        self.amp = amp
        model, optimizer = amp.initialize(
            model, optimizer, opt_level=self.opt_level, loss_scale=self.loss_scale_cfg, verbosity=0
        )
        return model, optimizer

    def backward(self, loss, optimizer):
        with self.amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()

    def unscale(self, optimizer) -> bool:
        # scale_loss has already unscaled; report what apex's scaler found.
        scaler = self.amp._amp_state.loss_scalers[0]
        return not scaler._has_overflow

    def step(self, optimizer, grads_finite: bool) -> bool:
        optimizer.step()  # apex's patched step() is a no-op on overflow
        return grads_finite

    def state_dict(self):
        return {"apex_amp": self.amp.state_dict()}

    def load_state_dict(self, state):
        if state.get("apex_amp"):
            self.amp.load_state_dict(state["apex_amp"])
