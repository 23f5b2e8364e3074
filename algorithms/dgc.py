"""Deep Gradient Compression: send only the largest gradients, accumulate the rest locally.

Deep Gradient Compression: Reducing the Communication Bandwidth for Distributed Training (Lin, Han, Mao, Wang,
Dally; ICLR 2018; arXiv 1712.01887), with PaddlePaddle Fleet's option names and warm-up schedule. Each rank
accumulates its momentum-corrected gradient in a residual ``v`` and sends only the entries above a threshold
(the top 0.1 % at sparsity 0.999) as (value, index) pairs; everything else stays in ``v`` until it grows large
enough, so nothing is lost, only delayed. Four corrections keep accuracy: momentum correction (accumulate
``u = m*u + g`` rather than ``g``), local gradient clipping (at ``clip_norm / sqrt(N)``), momentum factor
masking (clear ``u`` where ``v`` was sent, so stale momentum does not push twice) and weight-decay correction
(the weight decay is added to the local gradient before accumulation). The threshold is estimated from a
sample of each tensor, then the exact top-k is taken among the few candidates above it (computed with fixed
sizes, see :func:`select`: a step reads back from the device only the overflow flag and, once the exchange is
queued, the number of entries sent, however many tensors there are). Sparsity warms up
through ``sparsity`` over ``rampup_step`` steps from ``rampup_begin_step``; before that, and for tensors smaller
than ``min_compress_numel``, it is exactly dense momentum SGD with allreduce.

DGC owns the momentum: it sets the optimizer's momentum and weight decay to 0 and hands it the averaged update,
so the optimizer is plain SGD (``optimizer=momentum`` or ``optimizer=sgd``; LARS is rejected).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from algorithms.base import SyncAlgorithm, SyncContext, SyncReport
from errors import ConfigError, is_int, is_number, require


def sparsity_at(step: int, rampup_begin_step: int, rampup_step: int, sparsity: list[float]) -> float | None:
    """Fleet's warm-up: None (dense) before ``rampup_begin_step``; then ``sparsity`` entries in equal slices of
    ``rampup_step`` steps; then the last entry forever."""
    if step < rampup_begin_step:
        return None
    k = step - rampup_begin_step
    if k >= rampup_step:
        return sparsity[-1]
    return sparsity[int(k * len(sparsity) / rampup_step)]


def keep_count(numel: int, sparsity: float) -> int:
    """Entries sent from a tensor of ``numel``: ``ceil(numel * (1 - sparsity))``, at least 1 (rounded first, so
    that 100000 * (1 - 0.999) is 100, not 101)."""
    return max(1, math.ceil(round(numel * (1.0 - sparsity), 6)))


BLOCK = 64  # the largest block that top_magnitudes scans by, see there


def top_magnitudes(v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices and magnitudes of ``k`` entries of ``v`` of largest magnitude, in no order (ties: any of them).

    Fixed sizes throughout, so nothing is read back to the host. When ``k`` is small against ``v``, the tensor is
    cut into blocks (of up to 64 entries, so that k blocks hold at most a quarter of it) and the top k are taken
    among the entries of the k blocks of largest magnitude only, which hold them: an entry of a block left out has
    k blocks above it, each with an entry at least as large. On a CPU at sparsity 0.999 that is 8x faster than
    ``topk`` over the whole tensor."""
    n = v.numel()
    block = min(BLOCK, 1 << max(0, (n // (4 * k)).bit_length() - 1))  # the largest power of 2 with 4 k block <= n
    if block < 4:  # (blocks would scan a quarter of the tensor or more again: one topk over all of it is faster)
        top = v.abs().topk(k, sorted=False)
        return top.indices, top.values
    full = n // block * block
    head = v[:full].view(-1, block)
    blocks = torch.maximum(head.amax(1), head.amin(1).neg_()).topk(k, sorted=False).indices
    candidates = head[blocks].view(-1)
    if full == n:
        top = candidates.abs_().topk(k, sorted=False)
        return blocks[top.indices // block] * block + top.indices % block, top.values
    # The n % block entries of the tail are candidates too, after the k blocks.
    top = torch.cat([candidates, v[full:]]).abs_().topk(k, sorted=False)
    at = top.indices
    in_block = blocks[(at // block).clamp_(max=k - 1)] * block + at % block
    return torch.where(at < k * block, in_block, at - k * block + full), top.values


def select(
    v: torch.Tensor, sparsity: float, sample_ratio: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (into ``v``) of the ``k = ceil(numel * (1 - sparsity))`` entries of largest magnitude, and a mask of
    those sent: all of them, or fewer when the sampled threshold is above the k-th largest magnitude.

    The threshold comes from a random sample of ``sample_ratio`` of the tensor, set low enough that about 3 k
    entries reach it; the exact top-k among the candidates above it is what is sent. That is the top-k of the
    tensor less the entries under the threshold, which is how it is computed here: with fixed sizes, so that
    nothing of any tensor is read back to the host (a GPU would wait for each). On a CPU that costs about what a scan
    for the candidates costs at sparsity 0.999, and up to twice as much at the warm-up's 0.94 to 0.99, where the
    top-k is taken among many more entries than the ~3 k candidates."""
    n = v.numel()
    k = keep_count(n, sparsity)
    if k >= n:
        return torch.arange(n, device=v.device), torch.ones(n, dtype=torch.bool, device=v.device)
    # The sample must hold enough entries above the threshold for a stable estimate (>= 16 expected at 1.5 k), which
    # for extreme sparsity means more than sample_ratio of a small tensor.
    m = min(n, max(math.ceil(n * sample_ratio), math.ceil(16 / (1.5 * (1.0 - sparsity)))))
    sample = v[torch.randint(n, (m,), device=v.device, generator=generator)].abs()
    threshold = sample.topk(min(m, max(1, math.ceil(3.0 * m * (1.0 - sparsity)))), sorted=False).values.amin()
    indices, magnitudes = top_magnitudes(v, k)
    return indices, magnitudes >= threshold


def pack(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """int32 indices then values, as one byte tensor (indices first: both then start at aligned offsets)."""
    return torch.cat([indices.view(torch.uint8), values.view(torch.uint8)])


def unpack(buffer: torch.Tensor, count: int, value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack` for ``count`` pairs."""
    return buffer[: 4 * count].view(torch.int32), buffer[4 * count :].view(value_dtype)


class DGC(SyncAlgorithm):
    """``sync=dgc``: sparse, error-compensated gradient exchange by allgather of (value, index) pairs."""

    name = "dgc"
    compresses_float32_only = True  # float16 parameters (apex's O3) would all go the dense way: refused there

    def __init__(
        self,
        rampup_begin_step: int = 0,
        rampup_step: int = 1,
        sparsity: list[float] | tuple[float, ...] = (0.999,),
        sample_ratio: float = 0.01,
        min_compress_numel: int = 16384,
        clip_norm: float | None = None,
        momentum_masking: bool = True,
        fp16_values: bool = False,
    ):
        self.rampup_begin_step, self.rampup_step = rampup_begin_step, rampup_step
        self.sparsity = list(sparsity)
        self.sample_ratio, self.min_compress_numel = sample_ratio, min_compress_numel
        self.clip_norm, self.momentum_masking, self.fp16_values = clip_norm, momentum_masking, fp16_values

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        s = section["sparsity"]
        require(
            isinstance(s, list) and bool(s),
            "sync.sparsity",
            s,
            "a non-empty list of fractions dropped, e.g. [0.75, 0.9375, 0.999]",
        )
        require(all(is_number(x) and 0 <= x < 1 for x in s), "sync.sparsity", s, "fractions in [0, 1)")
        require(
            all(b > a for a, b in zip(s, s[1:])),
            "sync.sparsity",
            s,
            "an increasing list (the warm-up only ever sends less)",
        )
        r = section["rampup_step"]
        require(is_int(r) and r >= 1, "sync.rampup_step", r, "an integer >= 1 (warm-up length in steps)")
        b = section["rampup_begin_step"]
        require(is_int(b) and b >= 0, "sync.rampup_begin_step", b, "a step >= 0")
        q = section["sample_ratio"]
        require(is_number(q) and 0 < q <= 1, "sync.sample_ratio", q, "a fraction in (0, 1]")
        n = section["min_compress_numel"]
        require(is_int(n) and n >= 1, "sync.min_compress_numel", n, "an integer >= 1")
        c = section["clip_norm"]
        require(c is None or (is_number(c) and c > 0), "sync.clip_norm", c, "null (off) or a norm > 0")
        opt = cfg["optimizer"]
        require(
            opt["name"] in ("momentum", "sgd"),
            "optimizer",
            opt["name"],
            "momentum or sgd with sync=dgc (DGC applies its own momentum correction)",
        )
        if opt["nesterov"]:
            raise ConfigError("optimizer.nesterov", True, "false with sync=dgc (DGC's momentum is heavy-ball)")
        require(world_size >= 2, "trainer.nproc", world_size, "at least 2 processes for sync=dgc (nothing to compress)")

    # ---- setup -------------------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: SyncContext) -> None:
        super().setup(model, optimizer, ctx)
        params, self.weight_decay = [], []
        self.momentum = 0.0
        for group in optimizer.param_groups:
            # DGC takes over momentum and weight decay; the originals are kept in the group (and so in
            # checkpoints), where a resumed run finds them again.
            group.setdefault("dgc_momentum", group.get("momentum", 0.0))
            group.setdefault("dgc_weight_decay", group.get("weight_decay", 0.0))
            group["momentum"], group["weight_decay"] = 0.0, 0.0
            if "nesterov" in group:
                group["nesterov"] = False
            self.momentum = group["dgc_momentum"]
            for p in group["params"]:
                if p.requires_grad:
                    params.append(p)
                    self.weight_decay.append(group["dgc_weight_decay"])
        self.params = params
        self.compressed = [
            i for i, p in enumerate(params) if p.numel() >= self.min_compress_numel and p.dtype == torch.float32
        ]
        self.small = [i for i in range(len(params)) if i not in set(self.compressed)]
        sizes = [params[i].numel() for i in self.compressed]
        self.offsets = [0, *torch.tensor(sizes).cumsum(0).tolist()] if sizes else [0]
        numel_c = self.offsets[-1]
        device = ctx.device
        self.u = torch.zeros(numel_c, device=device)  # momentum of the compressed tensors
        self.v = torch.zeros(numel_c, device=device)  # residual: accumulated, not yet sent
        # The averaged sparse update, reused every step (a fresh buffer of the model's size costs page faults on
        # every step on CPU); the compressed parameters' grads are views of it.
        self._update = torch.zeros_like(self.v)
        self.u_dense = {i: torch.zeros_like(params[i]) for i in range(len(params))}  # dense-path momentum
        self._accumulated: int | None = None  # the step whose gradient is in the residuals
        self._taken: list = []  # (indices, values, momenta) selected from the residuals, until the exchange succeeds
        self.num_params = sum(p.numel() for p in params)
        self.generator = torch.Generator(device=device).manual_seed(1234 + ctx.membership.rank)

    # ---- the exchange ------------------------------------------------------------------------------------------
    def after_backward(self, step: int, grads_finite: bool) -> SyncReport:
        comm, n = self.ctx.comm, self.ctx.comm.size
        clock = comm.clock  # (on a GPU, marks on its stream: the compute's end, the compression's span)
        compute_end = clock.mark()
        self._settle(step)
        sparsity = sparsity_at(step, self.rampup_begin_step, self.rampup_step, self.sparsity)
        dense_ids = list(range(len(self.params))) if sparsity is None else self.small
        grads = [self._grad(i) for i in range(len(self.params))]
        if sparsity is not None and self.clip_norm is not None and grads_finite:
            # Local gradient clipping: the sum of N clipped gradients keeps the global clip_norm.
            self._clip(grads, self.clip_norm / math.sqrt(n))

        # 1) Dense tensors (all of them before the warm-up) + the overflow flag, in one allreduce. Deciding the
        #    overflow from the reduced flag gives every rank the same verdict and the same collectives.
        flat = torch.cat(
            [grads[i].reshape(-1) for i in dense_ids]
            + [torch.full((1,), 0.0 if grads_finite else 1.0, device=self.ctx.device)]  # (a fill: no copy to a GPU)
        )
        if not grads_finite:
            flat[:-1].zero_()  # never ship inf/NaN; the step is skipped anyway
        comm.all_reduce(flat)
        if flat[-1].item() > 0:  # (read back: the branch depends on it; the selection below reads nothing back)
            return SyncReport(grads_finite=False, compute_end=compute_end, metrics={"sparsity": sparsity or 0.0})
        # The dense momenta are committed only once every exchange of the step succeeded: a step redone after a
        # lost peer (trainer.on_failure: continue) must not apply them twice.
        offset, dense_u = 0, {}
        for i in dense_ids:
            numel = self.params[i].numel()
            g = flat[offset : offset + numel].view_as(self.params[i]).div_(n)
            offset += numel
            dense_u[i] = self.u_dense[i].mul(self.momentum).add_(g)
            self.params[i].grad = dense_u[i]  # (_commit copies it into u_dense; the grad stays a tensor of its own)
        dense_bytes = 2 * (n - 1) / n * 4 * self.num_params  # what allreduce of every gradient would send
        if sparsity is None:
            self._commit(dense_u)
            sent_bytes = 2 * (n - 1) / n * 4 * flat.numel()
            metrics = {"sparsity": 0.0, "density": 1.0, "compress_s": 0.0}
            if sent_bytes:  # (a rank alone, after losses, sends nothing: no ratio)
                metrics["compression"] = dense_bytes / sent_bytes
            return SyncReport(compute_end=compute_end, metrics=metrics)

        # 2) Compressed tensors: momentum correction, accumulation, selection, sparse allgather.
        start = clock.mark()
        if self._accumulated != step:  # (a redo of this step finds its gradient already in the residuals)
            self.accumulate(grads)
            self._accumulated = step
        indices, values, k_total, sent = self._compress(sparsity)
        compressed = clock.mark()
        # If the allgather fails, what was taken out to be sent stays out until the step is settled (_settle).
        gathered = comm.all_gather(pack(indices, values))  # values and indices in one allgather
        self._commit(dense_u)
        all_indices, all_values = zip(*(unpack(g, indices.numel(), values.dtype) for g in gathered))
        update = self._update.zero_()  # grads were read above, so backward may have accumulated into these views
        update.index_add_(0, torch.cat(all_indices).long(), torch.cat(all_values).float())
        update.div_(n)
        for j, i in enumerate(self.compressed):
            self.params[i].grad = update[self.offsets[j] : self.offsets[j + 1]].view_as(self.params[i])
        sent = int(sent)  # (the step's second read back, after the overflow flag; all else is queued by now)
        compress_s = clock.seconds(start, compressed)  # (on a GPU, reached by now: read back without a wait)
        sent_bytes = 2 * (n - 1) / n * 4 * flat.numel() + (n - 1) * (
            indices.numel() * indices.element_size() + values.numel() * values.element_size()
        )
        dense_numel = flat.numel() - 1
        metrics = {
            "sparsity": sparsity,
            "density": (sent + dense_numel) / self.num_params,  # fraction of all gradient entries sent
            "compress_s": compress_s,
        }
        if sent_bytes:  # (a rank alone, after losses, sends nothing: no ratio)
            metrics["compression"] = dense_bytes / sent_bytes  # vs dense allreduce of every gradient
        return SyncReport(compute_end=compute_end, metrics=metrics)

    def accumulate_and_select(
        self, grads: list[torch.Tensor], sparsity: float
    ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """Momentum correction and accumulation of the compressed tensors' gradients, then ``_compress``."""
        self.accumulate(grads)
        return self._compress(sparsity)

    def accumulate(self, grads: list[torch.Tensor]) -> None:
        """Momentum correction and accumulation of the compressed tensors' gradients into the residuals."""
        for j, i in enumerate(self.compressed):
            u = self.u[self.offsets[j] : self.offsets[j + 1]]
            torch.add(grads[i].reshape(-1), u, alpha=self.momentum, out=u)  # u = m * u + g, in one pass
        self.v.add_(self.u)

    def _commit(self, dense_u: dict[int, torch.Tensor]) -> None:
        """The step's exchanges all succeeded: keep its dense momenta; nothing is left to put back."""
        for i, u in dense_u.items():
            self.u_dense[i].copy_(u)
        self._taken = []

    def _settle(self, step: int) -> None:
        """Settle a selection whose allgather failed on this rank (``trainer.on_failure: continue``), at the next
        call. The same step again is a redo: nobody finished that exchange, so nothing of it was applied anywhere
        and the selection goes back into the residuals. A later step means this rank was healed from a peer that
        did finish it (engine/elastic): that peer applied this rank's share, which must not be sent twice."""
        if self._taken and self._accumulated == step:
            self._restore_selected()
        self._taken = []

    def _restore_selected(self) -> None:
        """Undo ``_compress``: return the selected values to the residual (and the momentum, when masking)."""
        for chosen, values, momenta in self._taken:
            self.v[chosen] = values
            if momenta is not None:
                self.u[chosen] = momenta
        self._taken = []

    def _grad(self, i: int) -> torch.Tensor:
        """The local gradient with weight decay added (DGC's weight-decay correction: before accumulation), in
        place: the parameter's ``.grad`` is replaced by the exchanged update afterwards anyway."""
        p = self.params[i]
        if p.grad is None:
            return p.detach().mul(self.weight_decay[i])
        if self.weight_decay[i]:
            p.grad.add_(p.detach(), alpha=self.weight_decay[i])
        return p.grad

    @staticmethod
    def _clip(grads: list[torch.Tensor], max_norm: float) -> None:
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        scale = max_norm / (float(total) + 1e-6)
        if scale < 1.0:
            for g in grads:
                g.mul_(scale)

    def _compress(self, sparsity: float) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """Select from each compressed tensor's residual; clear what is sent (and its momentum, when masking).

        Returns global int32 indices and values, exactly ``k`` per tensor (``sum(k)`` in all, so that every rank's
        allgather has the same size), an entry not sent being padding (0.0 at the tensor's first index), plus
        ``sum(k)`` and the number of entries sent: a 0-d tensor, to be read once the exchange is queued."""
        chosen_parts, sent_parts, wire_parts = [], [], []
        for j in range(len(self.compressed)):
            lo, hi = self.offsets[j], self.offsets[j + 1]
            chosen, sent = select(self.v[lo:hi], sparsity, self.sample_ratio, self.generator)
            chosen = chosen + lo
            chosen_parts.append(chosen)
            sent_parts.append(sent)
            wire_parts.append(torch.where(sent, chosen, lo))
        # All tensors at once from here on: they are slices of the same residual and momentum.
        chosen, sent = torch.cat(chosen_parts), torch.cat(sent_parts)
        values = self.v[chosen]
        self.v[chosen] = torch.where(sent, 0.0, values)  # error feedback: what is sent leaves the residual
        momenta = None
        if self.momentum_masking:
            momenta = self.u[chosen]
            self.u[chosen] = torch.where(sent, 0.0, momenta)
        self._taken = [(chosen, values, momenta)]  # until the exchange succeeds (_commit)
        indices = torch.cat(wire_parts).to(torch.int32)
        values = torch.where(sent, values, 0.0)
        if self.fp16_values:
            values = values.half()
        return indices, values, chosen.numel(), sent.sum()

    # ---- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The dense tensors' momentum: the same on every rank (accumulated from averaged gradients), so it is the
        replica's, saved once and taken over by a rank healed from a peer with the peer's parameters."""
        return {"u_dense": [self.u_dense[i] for i in range(len(self.params))]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_dense_momentum(state)

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's own: the compressed tensors' momentum and residuals, and its sampling generator."""
        return {
            "u": self.u,
            "v": self.v,
            "generator": self.generator.get_state(),  # the threshold samples: resume draws what it would have
        }

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        self.u.copy_(state["u"])
        self.v.copy_(state["v"])
        self._load_dense_momentum(state)  # (checkpoints written before it moved to state_dict hold it here)
        # A CPU ByteTensor, for a CUDA generator too; a resume reads this rank's state onto the device.
        self.generator.set_state(state["generator"].cpu())

    def _load_dense_momentum(self, state: dict[str, Any]) -> None:
        for i, t in enumerate(state.get("u_dense", ())):
            self.u_dense[i].copy_(t)
