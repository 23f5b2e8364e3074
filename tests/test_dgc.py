"""sync=dgc: dense equivalence, lossless error feedback, Fleet's warm-up, overflow agreement, exact bytes."""

from __future__ import annotations

import copy
import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from types import SimpleNamespace

import pytest
import timm
import torch
from _rounding import EPS, assert_one_update_apart
from conftest import load_model_state, plain_cfg, records, train, train_each
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from algorithms.base import SyncContext
from algorithms.dgc import DGC, keep_count, pack, select, sparsity_at, top_magnitudes, unpack
from distributed.clock import Clock
from distributed.membership import Membership
from engine.optim import build_optimizer

FAST = ["model=test_resnet", "data=digits", "logger=none", "trainer.progress=false", "trainer.nproc=2"]
FLEET_EXAMPLE = [0.75, 0.9375, 0.984375, 0.996, 0.999]


def test_warmup_schedule_matches_fleet_example():
    at = [sparsity_at(step, 0, 100, FLEET_EXAMPLE) for step in range(130)]
    assert at[0:20] == [0.75] * 20
    assert at[20:40] == [0.9375] * 20
    assert at[40:60] == [0.984375] * 20
    assert at[60:80] == [0.996] * 20
    assert at[80:130] == [0.999] * 50
    assert sparsity_at(4, 5, 10, [0.999]) is None  # before rampup_begin_step: dense
    assert sparsity_at(5, 5, 1, [0.999]) == 0.999  # fine-tuning setting: compress from the begin step


def _dgc_on(model: torch.nn.Module, **kw) -> DGC:
    dgc = DGC(**kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    dgc.setup(model, opt, SyncContext(comm=None, membership=Membership(0, 2), device=torch.device("cpu")))
    return dgc


@pytest.mark.parametrize("sparsity", [0.999, 0.99, 0.9])
def test_sent_plus_residual_equals_accumulated_velocity(sparsity):
    torch.manual_seed(0)
    dgc = _dgc_on(timm.create_model("test_resnet", num_classes=10), sparsity=[sparsity])
    assert dgc.compressed  # test_resnet has tensors above min_compress_numel
    for _ in range(3):  # several steps: the residual carries over
        dgc.u.mul_(0.9).add_(torch.randn_like(dgc.u))
        dgc.v.add_(dgc.u)
        before = dgc.v.clone()
        u_before = dgc.u.clone()
        indices, values, k_total, sent = dgc._compress(sparsity)
        sent = int(sent)
        sent_dense = torch.zeros_like(before).index_add_(0, indices.long(), values)
        torch.testing.assert_close(sent_dense + dgc.v, before, rtol=0, atol=0)  # nothing lost
        sizes = [dgc.offsets[j + 1] - dgc.offsets[j] for j in range(len(dgc.compressed))]
        assert k_total == sum(keep_count(n, sparsity) for n in sizes) == indices.numel()
        assert sent <= k_total and sent >= 0.9 * k_total
        chosen = sent_dense != 0
        assert torch.all(dgc.u[chosen] == 0)  # momentum factor masking
        assert torch.equal(dgc.u[~chosen], u_before[~chosen])


def test_a_failed_exchange_puts_back_what_was_selected():
    """A step redone after a lost peer must not lose what the failed attempt took out of the residuals."""
    torch.manual_seed(0)
    dgc = _dgc_on(timm.create_model("test_resnet", num_classes=10), sparsity=[0.99])
    dgc.u.copy_(torch.randn_like(dgc.u))
    dgc.v.copy_(torch.randn_like(dgc.v))
    u, v = dgc.u.clone(), dgc.v.clone()
    dgc._compress(0.99)
    assert not torch.equal(dgc.v, v) and not torch.equal(dgc.u, u)  # selected entries were cleared
    dgc._restore_selected()
    assert torch.equal(dgc.v, v) and torch.equal(dgc.u, u)
    dgc._compress(0.99)
    dgc._commit({})  # the exchange succeeded: nothing is put back any more
    dgc._restore_selected()
    assert not torch.equal(dgc.v, v)
    dgc.v.copy_(v)
    dgc._accumulated = 7
    dgc._compress(0.99)
    dgc._settle(7)  # the exchange failed and step 7 is redone: what was selected goes back first
    assert torch.equal(dgc.v, v)


def test_select_takes_the_largest_magnitudes():
    torch.manual_seed(0)
    v = torch.randn(100_000)
    chosen, sent = select(v, 0.999, 0.01)
    assert chosen.numel() == sent.numel() == 100
    assert set(chosen.tolist()) == set(v.abs().topk(100).indices.tolist())
    assert sent.all()  # the sampled threshold let all of them through


@pytest.mark.parametrize("n", [1, 127, 128, 129, 4096, 100_003])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.1, 0.5, 1.0])
def test_top_magnitudes_are_the_exact_top_k(n, fraction):
    """Whatever the block size (up to 64, or none), the tail of n % block entries included."""
    v = torch.randn(n, generator=torch.Generator().manual_seed(n))
    v[-1] = -v.abs().max() - 1.0  # the largest magnitude is negative and sits in the tail
    k = max(1, min(n, round(n * fraction)))
    indices, magnitudes = top_magnitudes(v, k)
    assert indices.unique().numel() == k and torch.equal(v[indices].abs(), magnitudes)
    assert torch.equal(magnitudes.sort().values, v.abs().topk(k).values.sort().values)


def _sampled_rule(v: torch.Tensor, sparsity: float, sample_ratio: float, generator: torch.Generator) -> torch.Tensor:
    """The paper's selection from one tensor, step by step: a threshold from a random sample that about 1.5 k
    entries reach (3 k when fewer than k reach it), then the exact top-k among the candidates above it."""
    n, k = v.numel(), keep_count(v.numel(), sparsity)
    if k >= n:
        return torch.arange(n)
    m = min(n, max(math.ceil(n * sample_ratio), math.ceil(16 / (1.5 * (1.0 - sparsity)))))
    sample = v[torch.randint(n, (m,), generator=generator)].abs()
    ranked = sample.topk(min(m, max(1, math.ceil(3.0 * m * (1.0 - sparsity)))), sorted=True).values
    for factor in (1.5, 3.0):
        position = min(ranked.numel(), max(1, math.ceil(factor * m * (1.0 - sparsity))))
        candidates = (v.abs() >= ranked[position - 1]).nonzero().view(-1)
        if candidates.numel() >= k:
            break
    return candidates[v[candidates].abs().topk(min(k, candidates.numel())).indices]


@pytest.mark.parametrize("sparsity", [0.999, 0.99, 0.9, 0.75, 0.0])
def test_what_is_sent_is_the_sampled_rule_exactly(sparsity):
    """DGC sends of each tensor what the sampled rule selects from it, with the same draws of the same generator,
    and takes exactly that out of the residual and the momentum. In the largest tensor the entries the sample will
    draw are made the largest, so that its threshold is too high, fewer than k entries reach it and the rest of its
    k is padding (0.0 at the tensor's first index)."""
    torch.manual_seed(0)
    dgc = _dgc_on(timm.create_model("test_resnet", num_classes=10), sparsity=[sparsity], min_compress_numel=1024)
    dgc.u.copy_(torch.randn_like(dgc.u))
    dgc.v.copy_(torch.randn_like(dgc.v) * torch.randn_like(dgc.v).exp())  # heavy tails, as gradients have
    sizes = [dgc.offsets[j + 1] - dgc.offsets[j] for j in range(len(dgc.compressed))]
    largest = max(range(len(sizes)), key=sizes.__getitem__)
    draws = torch.Generator().set_state(dgc.generator.get_state())
    for j, n in enumerate(sizes[: largest + 1]):
        if keep_count(n, sparsity) < n:
            m = min(n, max(math.ceil(n * dgc.sample_ratio), math.ceil(16 / (1.5 * (1.0 - sparsity)))))
            drawn = torch.randint(n, (m,), generator=draws)
            if j == largest:
                dgc.v[dgc.offsets[j] + drawn] = 100.0 + torch.rand(m)
    v, u, state = dgc.v.clone(), dgc.u.clone(), dgc.generator.get_state()

    indices, values, k_total, sent = dgc._compress(sparsity)
    rule = torch.Generator().set_state(state)
    chosen = [
        _sampled_rule(v[lo:hi], sparsity, dgc.sample_ratio, rule) + lo for lo, hi in zip(dgc.offsets, dgc.offsets[1:])
    ]
    assert torch.equal(dgc.generator.get_state(), rule.get_state())  # the same draws
    chosen = torch.cat(chosen)
    expected_v, expected_u = v.clone(), u.clone()
    expected_v[chosen] = 0.0
    expected_u[chosen] = 0.0
    assert torch.equal(dgc.v, expected_v) and torch.equal(dgc.u, expected_u)
    sent_dense = torch.zeros_like(v).index_add_(0, indices.long(), values)
    assert torch.equal(sent_dense, v - expected_v)  # what was sent: exactly what left the residual
    assert k_total == indices.numel() == sum(keep_count(n, sparsity) for n in sizes)
    assert int(sent) == chosen.numel() == (values != 0).sum()
    if sparsity:
        assert chosen.numel() < k_total  # the largest tensor fell short: its padding is 0.0 at its first index
        padding = values == 0
        assert (indices[padding] == dgc.offsets[largest]).all()


class _HostReads(TorchDispatchMode):
    """Counts the reads of tensor data back to the host, each of which makes the host wait for a GPU: a value
    (``.item()``, ``float()``, ``int()``, ``bool()``), an output whose size depends on the data (``nonzero``, a mask
    as an index, ``masked_select``, ``unique``) and ``.tolist()`` (which does not dispatch: counted by a patch)."""

    ops = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "equal"}

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        super().__init__()
        self.count = 0
        tolist = torch.Tensor.tolist

        def counted(tensor, *args, **kwargs):
            self.count += 1
            return tolist(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "tolist", counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masks = func.name() in ("aten::index.Tensor", "aten::index_put_", "aten::index_put") and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        )
        self.count += masks or func._opname in self.ops
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("options", [{}, {"clip_norm": 1.0, "fp16_values": True, "momentum_masking": False}])
def test_a_step_reads_back_from_the_device_the_same_few_times_for_any_number_of_tensors(monkeypatch, options):
    """On a GPU every read back is a wait for the device: one compressed step reads the overflow flag and, once its
    exchange is queued, the number of entries sent (and the norm, when clipping), with 5 tensors as with 50."""
    reads = []
    for layers in (5, 50):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(128, 128) for _ in range(layers)))  # weights compressed, biases dense
        dgc = _dgc_on(model, sparsity=[0.999], **options)
        assert len(dgc.compressed) == len(dgc.small) == layers
        dgc.ctx.comm = SimpleNamespace(
            size=2, all_reduce=lambda t: t, all_gather=lambda t: [t, t.clone()], clock=Clock()
        )
        for step in range(2):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            with _HostReads(monkeypatch) as counted:
                assert dgc.after_backward(step, True).metrics["density"] > 0
            monkeypatch.undo()
        reads.append(counted.count)
    assert reads[0] == reads[1] <= 2 + ("clip_norm" in options), reads


def test_dgc_takes_over_momentum_and_weight_decay():
    model = timm.create_model("test_resnet", num_classes=10)
    dgc = _dgc_on(model)
    assert dgc.momentum == 0.9
    assert all(g["momentum"] == 0 and g["weight_decay"] == 0 for g in dgc.optimizer.param_groups)


def test_sparsity_zero_equals_allreduce_momentum_sgd(tmp_path):
    """Everything sent, no momentum masking (which would clear the momentum of every sent entry): DGC is
    exactly momentum SGD with weight decay on averaged gradients. Compared after one step, the only one whose
    difference is rounding alone (see _rounding.py); the steps after it are the next test's, on fixed gradients."""
    common = [*FAST, "optimizer=momentum", "trainer.max_steps=1", "data.batch_size=16", "trainer.checkpoint_every=0"]
    dgc = [*common, "sync=dgc", "sync.sparsity=[0.0]", "sync.momentum_masking=false"]
    train_each(tmp_path, {"dgc": dgc, "ar": [*common, "sync=allreduce"]})
    assert_one_update_apart(load_model_state(tmp_path / "dgc"), load_model_state(tmp_path / "ar"), skip=("running",))


class _ThreadWorld:
    """The collectives DGC calls (``all_reduce``, ``all_gather``) for ranks that are threads of this process: each
    rank puts a copy of its tensor on the table, all meet, each takes the list (or its sum, in rank order)."""

    def __init__(self, size: int, fail: tuple[int, int] | None = None):
        self.size, self.table, self.meet = size, [None] * size, threading.Barrier(size, timeout=60)
        self.fail, self.gathers = fail, [0] * size  # (rank, its n-th allgather): fails there after the others read

    def comm(self, rank: int) -> SimpleNamespace:
        return SimpleNamespace(
            size=self.size,
            all_gather=partial(self._gather, rank),
            all_reduce=partial(self._all_reduce, rank),
            clock=Clock(),
        )

    def _gather(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.table[rank] = tensor.clone()
        self.meet.wait()
        got = list(self.table)
        self.meet.wait()  # everyone has read the table before anyone puts the next collective's on it
        self.gathers[rank] += 1
        if self.fail == (rank, self.gathers[rank]):
            raise ConnectionError("the peer's half of the exchange never came")  # (the others got this rank's)
        return got

    def _all_reduce(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        got = self._gather(rank, tensor)
        total = got[0].clone()
        for t in got[1:]:
            total += t
        return tensor.copy_(total)

    def run(self, fn) -> list:
        """``fn(rank)`` on every rank, each in a thread; their results in rank order."""

        def guarded(rank):
            try:
                return fn(rank)
            except BaseException:
                self.meet.abort()  # the others stop waiting for this one
                raise

        with ThreadPoolExecutor(self.size) as pool:
            return [f.result() for f in [pool.submit(guarded, r) for r in range(self.size)]]


def test_sparsity_zero_is_momentum_sgd_on_averaged_gradients_step_after_step():
    """The same, over several steps, against float64: two ranks (threads of this process, one DGC each, on the
    optimizer the trainer builds, bias and norm exempt from weight decay) are handed fixed random gradients, not
    gradients of their parameters, so that no step amplifies the rounding of the one before. The update DGC hands
    the optimizer at every step, and the parameters it leads to, are momentum SGD with weight decay on the averaged
    gradients, computed in float64 from the same gradients, within a bound of float32 rounding derived below."""
    n, steps, lr = 2, 6, 0.1
    torch.manual_seed(0)
    base = timm.create_model("test_resnet", num_classes=10)
    shapes = [p.shape for p in base.parameters()]
    g = torch.Generator().manual_seed(1)
    grads = torch.randn(steps, n, sum(s.numel() for s in shapes), generator=g)  # flat, as model.parameters()
    world, optimizer_cfg = _ThreadWorld(n), plain_cfg("optimizer=momentum")["optimizer"]

    def flat(tensors) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in tensors])

    def rank(r: int):
        model = copy.deepcopy(base)
        opt = build_optimizer(model, optimizer_cfg, lr=lr)
        decay = {id(p): group["weight_decay"] for group in opt.param_groups for p in group["params"]}
        decay = flat(torch.full(p.shape, decay[id(p)], dtype=torch.float64) for p in model.parameters())
        dgc = DGC(sparsity=[0.0], momentum_masking=False, min_compress_numel=1024)
        dgc.setup(model, opt, SyncContext(comm=world.comm(r), membership=Membership(r, n), device=torch.device("cpu")))
        assert dgc.compressed and dgc.small  # both paths: the sparse allgather and the dense allreduce
        updates = []
        for t in range(steps):
            for p, grad in zip(model.parameters(), grads[t, r].split([s.numel() for s in shapes])):
                p.grad = grad.view(p.shape).clone()
            assert dgc.after_backward(t, True).grads_finite
            updates.append(flat(p.grad for p in model.parameters()))
            opt.step()
        return updates, flat(model.parameters()), decay, dgc.momentum

    (updates, params, decay, m), (updates_1, params_1, _, _) = world.run(rank)
    assert all(torch.equal(a, b) for a, b in zip(updates + [params], updates_1 + [params_1]))  # the same everywhere
    assert m == 0.9 and sorted(decay.unique().tolist()) == [0.0, 1e-4]  # bias and norm exempt

    # Bounds, per entry: `size` of what DGC computes (the ranks' mean of the momentum of |g| + wd |theta|), `err` of
    # its float32 update and `off` of its parameter. Every float32 operation rounds within EPS of its result (on any
    # CPU), and each result here is at most `size`: a step adds the weight decay (2 roundings) and accumulates
    # u = m u + g (2) on each rank, adds the ranks' u (1; the dense tensors: their gradients, before the momentum)
    # and halves (exact): 5, counted as 8. The earlier error decays with m; the weight decay reads the parameter,
    # `off` of the reference's. The optimizer's step rounds the update and the parameter (2).
    theta = flat(base.parameters()).double()
    buf, size, err, off = (torch.zeros_like(theta) for _ in range(4))
    for t in range(steps):
        g64 = grads[t].double()
        buf = m * buf + g64.mean(0) + decay * theta
        size = m * size + g64.abs().mean(0) + decay * theta.abs()
        err = m * err + 8 * EPS * size + decay * off
        _assert_within(updates[t], buf, err, f"the update of step {t}")
        theta = theta - lr * buf
        off = off + lr * err + 2 * EPS * (theta.abs() + lr * size)
    _assert_within(params, theta, off, f"the parameters after {steps} steps")


def _three_ranks_with_a_heal(fail_step: int | None, steps: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three ranks (threads) run DGC past its warm-up on fixed random gradients. At ``fail_step`` rank 0's allgather
    fails after the others received its share: they finish the step, and rank 0 is healed from rank 1 as the
    trainer heals a rank left a collective behind (the peer's parameters, optimizer and sync ``state_dict``), then
    all go on. Returns each rank's parameters and residuals at the end."""
    n = 3
    torch.manual_seed(0)
    base = timm.create_model("test_resnet", num_classes=10)
    grads = torch.randn(steps, n, sum(p.numel() for p in base.parameters()), generator=torch.Generator().manual_seed(1))
    world, stepped, front = _ThreadWorld(n, None if fail_step is None else (0, fail_step + 1)), threading.Barrier(n), {}
    optimizer_cfg = plain_cfg("optimizer=momentum")["optimizer"]

    def rank(r: int):
        model = copy.deepcopy(base)
        opt = build_optimizer(model, optimizer_cfg, lr=0.1)
        dgc = DGC(sparsity=[0.99], rampup_begin_step=1, min_compress_numel=1024)
        dgc.setup(model, opt, SyncContext(comm=world.comm(r), membership=Membership(r, n), device=torch.device("cpu")))
        assert dgc.compressed and dgc.small  # both paths: the sparse allgather and the dense allreduce
        for t in range(steps):
            for p, grad in zip(model.parameters(), grads[t, r].split([p.numel() for p in model.parameters()])):
                p.grad = grad.view(p.shape).clone()
            try:
                dgc.after_backward(t, True)
                opt.step()
                healed = False
            except ConnectionError:
                healed = True
            if r == 1:
                front["state"] = copy.deepcopy((model.state_dict(), opt.state_dict(), dgc.state_dict()))
            stepped.wait()
            if healed:
                model_state, opt_state, sync_state = front["state"]
                model.load_state_dict(model_state)
                opt.load_state_dict(opt_state)
                dgc.load_state_dict(sync_state)
            stepped.wait()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), dgc.v.clone()

    return world.run(rank)


def test_a_rank_healed_in_the_sparse_exchange_goes_on_exactly_as_without_the_failure():
    """The front applied the healed rank's share of that step, so the rank must neither send it again (it stays
    out of the residuals) nor keep the dense momentum of the step before (it takes the front's): the run then
    goes on bit for bit as if nothing had failed, every replica identical."""
    reference = _three_ranks_with_a_heal(None)
    healed = _three_ranks_with_a_heal(2)
    assert all(torch.equal(params, reference[0][0]) for params, _ in reference + healed)  # one replica everywhere
    for r in range(3):
        assert torch.equal(healed[r][1], reference[r][1]), f"rank {r}'s residuals"


def _assert_within(x: torch.Tensor, reference: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    off = (x.double() - reference).abs()
    worse = int((off > bound).sum())
    assert not worse, f"{what}: {worse} of {off.numel()} entries beyond the bound, up to {off.max():.3g}"


@pytest.mark.parametrize("count", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pack_and_unpack_round_trip(count, dtype):
    indices = torch.arange(7, 7 + count, dtype=torch.int32)
    values = torch.linspace(-1, 1, count).to(dtype)
    buffer = pack(indices, values)
    assert buffer.dtype == torch.uint8 and buffer.numel() == count * (4 + values.element_size())
    got_indices, got_values = unpack(buffer, count, dtype)
    assert torch.equal(got_indices, indices) and torch.equal(got_values, values)


def test_bytes_sent_match_the_sparse_exchange(tmp_path):
    common = [*FAST, "sync=dgc", "trainer.max_steps=3", "sync.min_compress_numel=16384"]
    runs = train_each(
        tmp_path, {"fp32": [*common, "sync.fp16_values=false"], "fp16": [*common, "sync.fp16_values=true"]}
    )
    model = timm.create_model("test_resnet", num_classes=10)
    sizes = [p.numel() for p in model.parameters()]
    big = [n for n in sizes if n >= 16384]
    small = sum(n for n in sizes if n < 16384)
    k = sum(keep_count(n, 0.999) for n in big)
    n_ranks = 2
    dense = 2 * (n_ranks - 1) / n_ranks * 4 * sum(sizes)
    for name, metrics in runs.items():  # fp32 or fp16 values; int32 indices
        value_bytes = 2 if name == "fp16" else 4
        expected = 2 * (n_ranks - 1) / n_ranks * 4 * (small + 1) + (n_ranks - 1) * (4 + value_bytes) * k
        for r in records(metrics, "train"):
            assert r["bytes_sent"] == pytest.approx(expected)
            assert r["compression"] == pytest.approx(dense / expected)
            assert r["sparsity"] == 0.999


def test_overflow_on_one_rank_skips_the_step_everywhere(tmp_path):
    from _workers import dgc_with_overflow

    train(
        tmp_path, *FAST, "sync=dgc", "amp=torch", "amp.scaler=true", "trainer.max_steps=6",
        "trainer.timeout_s=120", entrypoint=dgc_with_overflow,
    )  # fmt: skip
    seen = [json.loads((tmp_path / f"overflow_rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["local_finite"] for s in seen] == [True, False]
    assert [s["agreed_finite"] for s in seen] == [False, False]  # both ranks skipped
    assert all(s["residuals_untouched"] for s in seen)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records(metrics, "train")}
    assert steps[3].get("skipped") is True and not any(steps[s].get("skipped") for s in (0, 1, 2, 4, 5))
    assert steps[4]["loss_scale"] == steps[2]["loss_scale"] / 2
    assert records(metrics, "summary")[0]["replica_spread"] == 0.0


@pytest.mark.full  # make test: tests/test_contract.py (dgc alone and inside relaxed, in one launch)
def test_resume_restores_each_ranks_residuals(tmp_path):
    common = [*FAST, "sync=dgc", "sync.sparsity=[0.99]", "data.batch_size=64", "trainer.epochs=2"]
    train(tmp_path / "full", *common)
    train(tmp_path / "split", *common, "trainer.max_epochs_per_run=1")
    assert (tmp_path / "split" / "checkpoints" / "sync_rank1.pt").exists()
    train(tmp_path / "split", *common, "trainer.resume=auto")
    a, b = load_model_state(tmp_path / "full"), load_model_state(tmp_path / "split")
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)
