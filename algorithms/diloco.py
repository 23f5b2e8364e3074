"""DiLoCo and Streaming DiLoCo: rare, fragmented, overlapped and quantized outer synchronization.

DiLoCo: Distributed Low-Communication Training of Language Models (Douillard et al., arXiv 2311.08105). Every
rank takes ``inner_steps`` (H) steps of the configured optimizer from the shared parameters theta; then the
pseudo-gradients Delta_m = theta - theta_m are averaged over the ranks and an *outer* optimizer, SGD with
Nesterov momentum (lr 0.7, momentum 0.9, as in the paper and torchft), applies the average to theta, and every
rank continues from the new theta. With outer lr 1 and no momentum it is exactly local SGD with period H.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) adds: ``fragments`` (P): the parameters are split into P
contiguous parts (the flat parameter vector cut into P equal chunks, as Crossover-SGD's integer segments), and
one part is synchronized every H/P steps on a staggered schedule, so the peak traffic drops P-fold;
``delay`` (tau < H/P): a part's exchange starts after step t and is applied after step t + tau, overlapped with
the inner steps in between; ``alpha``: on apply, the part becomes alpha x local + (1 - alpha) x global (0, the
default, takes the global); ``quantize``: the pseudo-gradients travel as ``fp16`` (an allreduce in half
precision), ``int8`` (blockwise min-max with one fp32 minimum and scale per block of ``quant_block`` values) or
``fp4`` (4-bit floats with a scale per block), exchanged by allgather and averaged after decoding; the outer step
itself stays fp32. Counted bytes are those of what actually travels (the payload).

SparseLoCo (Sarfi et al., arXiv 2508.15706), ``quantize=sparse``: each rank keeps an error-feedback buffer e of
its pseudo-gradients, ``e ← ef_decay · e + Δ``; it sends the ``density`` largest of each ``chunk`` of e, values
in 2 bits with indices packed (:mod:`algorithms.compress`), and takes what it sent out of e. The ranks average
what all sent (an allgather of the payloads, each decoded alike everywhere, summed in rank order) and the outer
optimizer steps on it (the paper's variant without outer momentum: ``outer_lr=1 outer_momentum=0``). The
buffer is each rank's own: checkpointed per rank, zero for a rank that joins. Which part syncs when depends only on the
step, identically on every rank, so collectives always match, and a resumed run continues the same schedule.

A CNN with BatchNorm is new ground for DiLoCo (it was shown on transformers). The choice here: BN running
statistics are not pseudo-gradients; they are averaged over the ranks once per H steps (with the last part's
sync), as local SGD does at each averaging. The inner optimizer's state (momentum) stays each rank's own; the
outer parameters and momentum are the same on every rank and are checkpointed once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from algorithms.base import StepResult, SyncContext, SyncReport
from algorithms.compress import (
    CODECS,
    ErrorFeedback,
    TopK,
    dequantize_fp4,
    dequantize_int8,
    quantize_fp4,
    quantize_int8,
)
from algorithms.replicas import Replicas, segment_ranges
from distributed.comm import Pending
from errors import is_int, is_number, require

QUANTIZE = CODECS


def fragment_due(step: int, inner_steps: int, fragments: int) -> int | None:
    """The fragment whose outer sync starts after ``step`` (the same on every rank), or None: one every
    ``inner_steps / fragments`` steps, in turn, so each fragment once per ``inner_steps`` steps."""
    interval = inner_steps // fragments
    if (step + 1) % interval:
        return None
    return ((step + 1) // interval - 1) % fragments


@dataclass
class FragmentSync:
    """One fragment's outer synchronization in flight."""

    due: int  # the step after which it is applied
    fragment: int
    pending: Pending  # the exchange of the pseudo-gradients (or their quantized form)


class DiLoCo(Replicas):
    """``sync=diloco``: inner steps of the configured optimizer, outer Nesterov SGD on averaged pseudo-gradients."""

    name = "diloco"
    late_shared_state = True  # (the outer parameters and momentum: read at the outer step)

    def __init__(
        self,
        inner_steps: int = 32,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        fragments: int = 1,
        delay: int = 0,
        alpha: float = 0.0,
        quantize: str = "none",
        quant_block: int = 1024,
        density: float = 0.02,
        chunk: int = 4096,
        ef_decay: float = 0.95,
        average_buffers: bool = True,
    ):
        self.inner_steps, self.fragments, self.delay = inner_steps, fragments, delay
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.alpha, self.quantize, self.quant_block = alpha, quantize, quant_block
        self.density, self.chunk, self.ef_decay = density, chunk, ef_decay
        self.feedback: ErrorFeedback | None = None  # (quantize=sparse: this rank's error-feedback buffer)
        self._unsent: dict[int, torch.Tensor] = {}  # (its fragments' buffers before the rounds in flight)
        self.average_buffers = average_buffers
        self._in_flight: deque[FragmentSync] = deque()
        self._agreed = False  # the model's parameters are the global ones (every rank's), no inner step since

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        h, p, d = section["inner_steps"], section["fragments"], section["delay"]
        require(is_int(h) and h >= 1, "sync.inner_steps", h, "an integer >= 1 (H, inner steps per outer step)")
        require(
            is_int(p) and p >= 1 and h % p == 0,
            "sync.fragments",
            p,
            f"an integer >= 1 that divides sync.inner_steps ({h})",
        )
        require(
            is_int(d) and 0 <= d < h // p,
            "sync.delay",
            d,
            f"an integer in [0, {h // p}) (less than inner_steps / fragments: a fragment lands before its next sync)",
        )
        lr, mu = section["outer_lr"], section["outer_momentum"]
        require(is_number(lr) and lr > 0, "sync.outer_lr", lr, "a learning rate > 0")
        require(is_number(mu) and 0 <= mu < 1, "sync.outer_momentum", mu, "a number in [0, 1)")
        a = section["alpha"]
        require(is_number(a) and 0 <= a <= 1, "sync.alpha", a, "a number in [0, 1] (0: take the global parameters)")
        q = section["quantize"]
        require(q in QUANTIZE, "sync.quantize", q, f"one of {', '.join(QUANTIZE)}")
        b = section["quant_block"]
        require(is_int(b) and b >= 1, "sync.quant_block", b, "an integer >= 1 (values per int8 or fp4 scale)")
        k = section.get("density", 0.02)
        require(is_number(k) and 0 < k <= 1, "sync.density", k, "a share of each chunk in (0, 1] (quantize=sparse)")
        c = section.get("chunk", 4096)
        require(is_int(c) and 2 <= c <= 2**16, "sync.chunk", c, "an integer in [2, 65536] (quantize=sparse)")
        e = section.get("ef_decay", 0.95)
        require(is_number(e) and 0 <= e <= 1, "sync.ef_decay", e, "a number in [0, 1] (quantize=sparse)")

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: SyncContext) -> None:
        super().setup(model, optimizer, ctx)
        self.ranges = [(lo, hi) for _, lo, hi in segment_ranges(model, self.fragments)]
        # The outer parameters and momentum (fp32, the same on every rank: every rank starts from the same seed).
        self.global_params = self.flat_parameters().float()  # (a new tensor: torch.cat copies)
        self.momentum = torch.zeros_like(self.global_params)
        if self.quantize == "sparse":
            self.codecs = [TopK.of(hi - lo, self.chunk, self.density) for lo, hi in self.ranges]
            self.feedback = ErrorFeedback(torch.zeros_like(self.global_params), self.ef_decay)

    def take_local_steps(self, agreed: list[torch.Tensor], since: int) -> bool:
        # The outer parameters are those the replicas agreed on: each fragment's next outer step averages every
        # step since. (Fragments fall due by the run's step count, as they would have from step 0.)
        self.global_params = torch.cat([p.reshape(-1) for p in agreed]).float()
        return True

    # ---- the schedule --------------------------------------------------------------------------------------
    def after_optimizer_step(self, result: StepResult) -> SyncReport:
        step, metrics = result.step, {}
        self._agreed = False
        fragment = fragment_due(step, self.inner_steps, self.fragments)
        if fragment is not None:
            self._in_flight.append(FragmentSync(step + self.delay, fragment, self._start(fragment, step + 1)))
            metrics["outer_fragment"] = fragment
        while self._in_flight and self._in_flight[0].due <= step:
            norm = self._apply(self._in_flight[0])  # (left in flight if it fails: dropped after the regroup)
            self._in_flight.popleft()
            if norm is not None:
                metrics["pseudo_grad_norm"] = norm
        self._agreed = self._whole and "pseudo_grad_norm" in metrics  # (not after an exchange dropped)
        if (step + 1) % self.inner_steps == 0 and self.average_buffers:
            self.ctx.comm.average_buffers(self.model)
        return SyncReport(metrics=metrics)

    @property
    def _whole(self) -> bool:
        """Whether an outer step sets every parameter to the global one at once: one fragment, no delay, no
        mixing."""
        return self.fragments == 1 and self.delay == 0 and not self.alpha

    def before_eval(self) -> None:
        if not self._agreed:
            super().before_eval()  # the replicas' parameters and BN statistics
        elif not self.average_buffers:  # (right after a whole outer step the parameters are the global ones)
            self.ctx.comm.average_buffers(self.model)

    def agreement_at(self, steps: int) -> int:
        """The next outer step's count of steps, from ``steps`` on, where an outer step sets every parameter."""
        return -(-steps // self.inner_steps) * self.inner_steps if self._whole else steps

    def drain(self) -> None:
        while self._in_flight:
            self._apply(self._in_flight[0])
            self._in_flight.popleft()

    # ---- one fragment's outer step ---------------------------------------------------------------------------
    def _start(self, fragment: int, steps: int) -> Pending:
        """Issue the exchange of this rank's pseudo-gradient for ``fragment`` (at ``steps`` steps completed). A
        whole outer step where processes join (``ctx.guests``) is summed with them, at once: they add nothing, and
        take the outer step with the outer state sent to them before it (:meth:`guest_state`, :meth:`take_share`)."""
        lo, hi = self.ranges[fragment]
        delta = self.global_params[lo:hi] - self.read_range(lo, hi).float()
        comm = self.ctx.comm
        guests = self.ctx.guests(steps) if self.ctx.guests is not None and self._whole else None
        if guests is not None and self.quantize == "none":
            names = [name for name, _ in self.model.named_parameters()]
            if guests.sum(delta, names, advance=True):
                return Pending(comm, [], delta)
        if self.quantize == "int8":
            return comm.all_gather_async(quantize_int8(delta, self.quant_block))
        if self.quantize == "fp4":
            return comm.all_gather_async(quantize_fp4(delta, self.quant_block))
        if self.feedback is not None:
            return comm.all_gather_async(self._send_sparse(fragment, delta))
        if self.quantize == "fp16":
            return comm.all_reduce_async(delta.half())
        return comm.all_reduce_async(delta)

    def _apply(self, sync: FragmentSync) -> float | None:
        """Average the pseudo-gradients, take the outer step on the fragment and set the local fragment from the
        new global one; returns the averaged pseudo-gradient's norm. A dropped exchange (issued before the ranks
        changed) takes no outer step (None): the fragment keeps its local progress, and its next outer step, on
        the survivors, brings the replicas together again."""
        lo, hi = self.ranges[sync.fragment]
        result, n = sync.pending.wait(), self.ctx.comm.size
        unsent = self._unsent.pop(sync.fragment, None)
        if result is None:
            if unsent is not None:  # (what it took out of its buffer went nowhere: back, as before the round)
                self.feedback.buffer[lo:hi] = unsent
            return None
        if isinstance(result, list):  # (an allgather of payloads: each decoded, summed in rank order)
            delta = sum(self._decode(payload, sync.fragment) for payload in result) / n
        else:
            delta = result.float() / n
        theta = self._outer_step(self.global_params[lo:hi], self.momentum[lo:hi], delta)
        local = self.read_range(lo, hi)
        self.write_range(lo, hi, local.mul_(self.alpha).add_(theta, alpha=1.0 - self.alpha) if self.alpha else theta)
        return float(delta.norm())

    def _send_sparse(self, fragment: int, delta: torch.Tensor) -> torch.Tensor:
        """Fold ``delta`` into the buffer and take out the payload; the buffer as it was is kept until the round
        lands (a round dropped with its group gives it back)."""
        lo, hi = self.ranges[fragment]
        self._unsent[fragment] = self.feedback.buffer[lo:hi].clone()
        payload, _ = self.feedback.send(lo, hi, delta, self.codecs[fragment])
        return payload

    def _decode(self, payload: torch.Tensor, fragment: int) -> torch.Tensor:
        lo, hi = self.ranges[fragment]
        if self.quantize == "int8":
            return dequantize_int8(payload, hi - lo, self.quant_block)
        if self.quantize == "fp4":
            return dequantize_fp4(payload, hi - lo, self.quant_block)
        return self.codecs[fragment].decode(payload)

    def _outer_step(self, theta: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The outer optimizer's step, in place on ``theta`` (returned) and ``momentum``, from the averaged
        pseudo-gradient ``delta`` (the members' and a joining process's, alike: :meth:`take_share`)."""
        if self.outer_momentum:
            momentum.mul_(self.outer_momentum).add_(delta)
            # (torch.optim.SGD's own operations, so it rounds as an outer SGD optimizer does, torchft's among them)
            update = delta.add(momentum, alpha=self.outer_momentum) if self.nesterov else momentum
        else:
            update = delta
        return theta.sub_(update, alpha=self.outer_lr)

    # ---- a process joining at a whole outer step (engine/elastic) --------------------------------------------
    def guest_state(self, at: int, steps: int) -> dict[str, Any] | None:
        """The outer parameters and momentum, final from the outer step before ``at`` on (they change at outer
        steps only; the sender packs copies). None before that step, or where the outer step at ``at`` is not
        whole (no process takes part in it)."""
        if not self._whole or at % self.inner_steps or steps < at - self.inner_steps:
            return None
        return {"global_params": self.global_params, "momentum": self.momentum}

    def take_share(self, model: nn.Module, summed: torch.Tensor, asked: dict[str, Any], state: Any) -> None:
        """The outer step the members take, from their summed pseudo-gradient and the outer state before it
        (``state``, :meth:`guest_state`'s): the model's parameters become the new outer parameters, theirs."""
        theta = self._outer_step(state["global_params"], state["momentum"], summed.float() / asked["contributors"])
        offset = 0
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(theta[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    # ---- state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The outer parameters and momentum; the parameters as None right after a whole outer step, where they are
        the model's own (fp32): a checkpoint, or the state a joining process receives, holds them once."""
        own = self._agreed and all(p.dtype == torch.float32 for p in self.parameters())
        return {"global_params": None if own else self.global_params, "momentum": self.momentum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """(After the model's own state: the outer parameters may be its parameters.)"""
        shared = state["global_params"]
        self.global_params.copy_(self.flat_parameters() if shared is None else shared)
        self.momentum.copy_(state["momentum"])

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's own: its inner optimizer's state and its error-feedback buffer (``quantize=sparse``)."""
        own = super().local_state_dict()
        return {**own, "error_feedback": self.feedback.buffer} if self.feedback is not None else own

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        super().load_local_state_dict(state)
        if self.feedback is not None and "error_feedback" in state:
            self.feedback.buffer.copy_(state["error_feedback"])
