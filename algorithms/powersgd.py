"""PowerSGD: low-rank gradient compression, as PyTorch ships it for DDP.

PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization (Vogels, Karimireddy, Jaggi;
NeurIPS 2019; arXiv 1905.13727). Each gradient matrix M (n x m, a conv kernel flattened to its output channels)
is approximated as P Q^T with P (n x r) and Q (m x r) from one step of power iteration warm-started from the
previous step's Q; only P and Q are allreduced (two sequential allreduces), and what the approximation missed
stays in a local error-feedback buffer that is added to the next gradient. Tensors that would not compress by
``min_compression_rate`` (biases, BN weights, small layers) are allreduced as they are, and the first
``start_powerSGD_iter`` steps run plain allreduce.

This is PyTorch's own ``powerSGD_hook`` and ``PowerSGDState`` on DDP, not a reimplementation: the comm hook
around it only counts what it sends (the allreduced elements PyTorch's compression statistics report, or the
whole bucket in the plain phase) and marks when this rank's compute ended. The state is checkpointed:
the iteration counter and the random generator that draws the first Q are the same on every rank (shared); the
error feedback and the warm-start P and Q are each rank's own.

PyTorch keeps that per-rank state per DDP *bucket*, and DDP lays its buckets out anew after its first step (in the
order gradients became ready): a process resumed from a checkpoint would take its first step on another layout than
the uninterrupted run, and PowerSGD's matrix products round by where a tensor lies in memory. So every DDP this
algorithm builds has its layout fixed when it is built, in parameter order, and never changes it: a resumed run
ends bit for bit where the uninterrupted one ends. The state is also kept per *parameter* (:class:`BucketState`),
saved that way, and assembled for whichever bucket holds the parameter, so it follows the parameters whatever the
buckets (a checkpoint written with another layout, a new DDP over the survivors of a membership change).

The same products must also run with the same number of threads. PyTorch's hook computes a bucket's Q and its
decompressed gradient in completion callbacks, on whichever thread completes an allreduce: often one of gloo's worker
threads, which ``torch.set_num_threads`` (``trainer.threads``) never reached, since it sets MKL's thread count for
the calling thread only. Such a thread runs MKL with one thread per core until something there happens to set it, so
whether a product ran split over cores (rounding otherwise) depended on timing and on the thread's history, and a
resumed run did not end where the uninterrupted one did. PowerSGD's per-bucket dicts (:class:`_ThreadsDict`), read
by each of those callbacks before its first product, give the thread reading them the process's thread count.
"""

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

# No `from __future__ import annotations` in this file: DDP checks the comm hook's signature at registration.
from algorithms.allreduce import AllReduce, HookState, counted
from algorithms.base import SyncContext, SyncReport
from distributed.comm import Communicator
from distributed.membership import Change
from errors import is_int, is_number, require


def compressed_shape(tensor: torch.Tensor, rank: int, min_compression_rate: float) -> tuple[int, int] | None:
    """(n x r, m x r), the sizes of P and Q for a gradient PyTorch's hook compresses, or None if it sends it as it
    is (its ``_should_compress`` rule on the tensor viewed as ``shape[0] x rest``)."""
    n = tensor.shape[0]
    m = tensor.numel() // n
    r = min(n, m, rank)
    return (n * r, m * r) if (n + m) * r * min_compression_rate < n * m else None


def factor_order(params: list[torch.Tensor], rank: int, min_compression_rate: float) -> list[tuple[int, int, int]]:
    """(position in ``params``, P size, Q size) of each compressed gradient, in the order PyTorch's hook lays out
    a bucket's P and Q memory: grouped by matrix shape (shapes in order of first appearance), then in bucket
    order within a shape."""
    by_shape: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for i, p in enumerate(params):
        sizes = compressed_shape(p, rank, min_compression_rate)
        if sizes is not None:
            by_shape.setdefault((p.shape[0], p.numel() // p.shape[0]), []).append((i, *sizes))
    return [entry for group in by_shape.values() for entry in group]


class _ThreadsDict(dict):
    """One of ``PowerSGDState``'s per-bucket dicts (error feedback, P, Q) that gives whichever thread reads or writes
    it the intra-op thread count of the thread that made it (``trainer.threads``), MKL's included. PyTorch's hook
    reads or writes them in each completion callback before that callback's first matrix product."""

    def __init__(self) -> None:
        super().__init__()
        self.threads = torch.get_num_threads()

    def _adopt(self) -> None:
        # (a thread's first call takes the process's count; a thread that took another one takes this one)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def __getitem__(self, key: int) -> torch.Tensor:
        self._adopt()
        return super().__getitem__(key)

    def __setitem__(self, key: int, value: torch.Tensor) -> None:
        self._adopt()
        super().__setitem__(key, value)


class BucketState:
    """PowerSGD's per-rank state (error feedback, warm-start P and Q) kept with the parameters it belongs to.

    ``prepare(bucket)`` runs before PyTorch's hook: if that bucket index holds other parameters than last time,
    the state of every bucket at rest (not yet handled in this backward pass, whose exchanges may still be
    running) is first split into per-parameter pieces, then this bucket's is assembled from them."""

    def __init__(self, psgd: PowerSGDState):
        self.psgd = psgd
        self.layout: dict[int, list[torch.Tensor]] = {}  # bucket index -> its parameters, in bucket order
        self.per_param: dict[int, dict[str, torch.Tensor]] = {}  # id(parameter) -> its error, p, q
        self.busy: set[int] = set()  # buckets handled in the current backward pass

    def prepare(self, bucket: dist.GradBucket) -> None:
        index, params = bucket.index(), bucket.parameters()
        known = self.layout.get(index)
        if known is None or len(known) != len(params) or any(a is not b for a, b in zip(known, params)):
            self.split_all(keep=self.busy)
            self.layout[index] = params
            self._assemble(index, params)
        self.busy.add(index)
        if bucket.is_last():  # DDP hands over its last bucket last; all are done before the next backward
            self.busy.clear()

    def split_all(self, keep: set[int] = frozenset()) -> None:
        """Move the state of every bucket (but those in ``keep``) into per-parameter pieces."""
        psgd = self.psgd
        for index in [i for i in self.layout if i not in keep]:
            params = self.layout.pop(index)
            error, p, q = (
                memory.pop(index, None) for memory in (psgd.error_dict, psgd.p_memory_dict, psgd.q_memory_dict)
            )
            pieces = [self.per_param.setdefault(id(param), {}) for param in params]
            if error is not None:
                for piece, part in zip(pieces, error.split([param.numel() for param in params])):
                    piece["error"] = part.clone()
            if p is not None and q is not None:
                p_at = q_at = 0
                for i, p_size, q_size in factor_order(
                    params, psgd.matrix_approximation_rank, psgd.min_compression_rate
                ):
                    pieces[i]["p"], pieces[i]["q"] = p[p_at : p_at + p_size].clone(), q[q_at : q_at + q_size].clone()
                    p_at, q_at = p_at + p_size, q_at + q_size

    def _assemble(self, index: int, params: list[torch.Tensor]) -> None:
        psgd, pieces = self.psgd, [self.per_param.get(id(p), {}) for p in params]
        if all("error" in piece for piece in pieces):
            psgd.error_dict[index] = torch.cat([piece["error"] for piece in pieces])
        order = factor_order(params, psgd.matrix_approximation_rank, psgd.min_compression_rate)
        compressed = [pieces[i] for i, _, _ in order]
        if compressed and all("p" in piece for piece in compressed):
            psgd.p_memory_dict[index] = torch.cat([piece["p"] for piece in compressed])
            psgd.q_memory_dict[index] = torch.cat([piece["q"] for piece in compressed])


class _PowerHookState(HookState):
    """The communicator, when this rank's last bucket was ready, and PyTorch's PowerSGD state."""

    def __init__(self, comm: Communicator, psgd: PowerSGDState, buckets: BucketState):
        super().__init__(comm)
        self.psgd, self.buckets = psgd, buckets


def counted_powersgd_hook(state: _PowerHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``powerSGD_hook``, counted by the Communicator (its allreduces, summed, as one record).

    A bucket's exchange is finished before the hook returns. PyTorch's hook issues the P and Q allreduces of a
    bucket from completion callbacks, on whichever thread completes the previous one; with several buckets in
    flight, one rank could then issue bucket 2's first allreduce before bucket 1's second while its peer does
    the reverse, a collective mismatch that gloo aborts on. Waiting here keeps
    every rank's collectives in the same order, at the cost of not overlapping one bucket's exchange with the
    rest of the backward pass."""
    start, clock, comm = time.perf_counter(), state.comm.clock, state.comm
    state.last_ready = began = clock.mark()
    psgd, buffer, index = state.psgd, bucket.buffer(), bucket.index()
    comm.mean_within_node(buffer)  # (node scope: the node's processes agree first, over the fast link)
    psgd.process_group, counted_share = comm.bucket_group(index)
    state.buckets.prepare(bucket)
    plain = psgd.iter < psgd.start_powerSGD_iter
    before = psgd.total_numel_after_compression
    future = comm.membership.relay(powerSGD_hook(psgd, bucket))
    future.wait()  # (PeerLost when a peer is lost elsewhere meanwhile)
    comm.share_bucket(buffer, index)
    if clock.on_device:  # (the wait ordered the current stream after the exchange: its end is a mark there)
        comm.time_span(began, clock.mark())
    numel = buffer.numel() if plain else psgd.total_numel_after_compression - before
    return counted(future, comm, numel * buffer.element_size() * counted_share, start)


class PowerSGD(AllReduce):
    """``sync=powersgd``: DDP with PyTorch's PowerSGD comm hook."""

    name = "powersgd"
    comm_hook = staticmethod(counted_powersgd_hook)

    def __init__(
        self,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 10,  # noqa: N803 - PyTorch's name
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        random_seed: int = 0,
        bucket_cap_mb: float = 25.0,
    ):
        super().__init__(bucket_cap_mb)
        self.options = {
            "matrix_approximation_rank": matrix_approximation_rank,
            "start_powerSGD_iter": start_powerSGD_iter,
            "min_compression_rate": min_compression_rate,
            "use_error_feedback": use_error_feedback,
            "warm_start": warm_start,
            "orthogonalization_epsilon": orthogonalization_epsilon,
            "random_seed": random_seed,
        }

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        super().validate(section, cfg, world_size)
        r = section["matrix_approximation_rank"]
        require(is_int(r) and r >= 1, "sync.matrix_approximation_rank", r, "an integer rank >= 1")
        s = section["start_powerSGD_iter"]
        # PyTorch's own rule: DDP rebuilds its buckets after the first step, which error feedback and warm start
        # cannot follow.
        stateful = section["use_error_feedback"] or section["warm_start"]
        require(
            is_int(s) and s >= (2 if stateful else 0),
            "sync.start_powerSGD_iter",
            s,
            "an integer >= 2 (>= 0 with use_error_feedback and warm_start both false)",
        )
        c = section["min_compression_rate"]
        require(is_number(c) and c > 0, "sync.min_compression_rate", c, "a number > 0")
        e = section["orthogonalization_epsilon"]
        require(is_number(e) and e >= 0, "sync.orthogonalization_epsilon", e, "a number >= 0")
        require(
            cfg["amp"]["_target_"] != "engine.amp.ApexAmp",
            "amp",
            "apex",
            "none or torch with sync=powersgd (apex.amp's patched optimizer conflicts with the comm hook)",
        )

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: SyncContext) -> None:
        self.psgd = PowerSGDState(process_group=ctx.comm.group, **self.options)
        # (its callbacks' matrix products with this thread's thread count, on any thread: the module's docstring)
        psgd = self.psgd
        psgd.error_dict, psgd.p_memory_dict, psgd.q_memory_dict = _ThreadsDict(), _ThreadsDict(), _ThreadsDict()
        self.buckets = BucketState(self.psgd)
        super().setup(model, optimizer, ctx)

    def on_membership_change(self, change: Change) -> SyncReport:
        self.psgd.process_group = self.ctx.comm.group
        return super().on_membership_change(change)

    def _wrap(self, model: nn.Module, replicas_agree: bool = False) -> nn.Module:
        ddp = super()._wrap(model, replicas_agree)
        # DDP lays its buckets out anew after its first step, in the order gradients became ready, and the matrix
        # products of PowerSGD round by where a tensor lies in memory: a process resumed from a checkpoint would
        # take its first step on another layout than the uninterrupted run took it. Fix the layout now, in
        # parameter order, for every DDP this algorithm builds (the hook finishes each bucket's exchange before it
        # returns, so which bucket becomes ready first buys no overlap).
        ddp.reducer._push_all_rebuilt_params()
        ddp.reducer._rebuild_buckets()
        return ddp

    def _hook_state(self) -> _PowerHookState:
        return _PowerHookState(self.ctx.comm, self.psgd, self.buckets)

    # ---- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, cached = self.psgd.rng.get_state()
        return {
            "iter": self.psgd.iter,
            "rng": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": pos,
                "has_gauss": has_gauss,
                "cached": cached,
            },
            "numel_before": self.psgd.total_numel_before_compression,
            "numel_after": self.psgd.total_numel_after_compression,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rng = state["rng"]
        self.psgd.rng.set_state(
            ("MT19937", rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"], rng["cached"])
        )
        self.psgd.iter = state["iter"]
        self.psgd.total_numel_before_compression = state["numel_before"]
        self.psgd.total_numel_after_compression = state["numel_after"]

    def local_state_dict(self) -> dict[str, Any]:
        """Error feedback and warm-start factors per parameter name (independent of DDP's buckets)."""
        self.buckets.split_all()
        return {
            name: self.buckets.per_param[id(p)]
            for name, p in self.model.named_parameters()
            if id(p) in self.buckets.per_param
        }

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        params = dict(self.model.named_parameters())
        self.buckets.split_all()
        self.buckets.per_param.update({id(params[name]): dict(pieces) for name, pieces in state.items()})
