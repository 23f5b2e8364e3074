"""sync=diloco: with outer lr 1 and no momentum it is local SGD; every fragment syncs once per outer step; the
int8 pseudo-gradients round-trip within half a quantization step and are what is counted. (Resume of every
DiLoCo variant, alone and inside relaxed sync: test_contract.py.)"""

from __future__ import annotations

import json
import math

import pytest
import timm
import torch
from _contract import case_dir
from _rounding import EPS, each_config_checking_averages
from conftest import FAST, records, train_each

from algorithms.compress import TopK, dequantize_int8, fp4_bytes, quantize_int8
from algorithms.diloco import fragment_due
from algorithms.replicas import segment_ranges
from engine.metrics import read_metrics

FAST = [*FAST, "trainer.nproc=2"]
_MODEL = timm.create_model("test_resnet", num_classes=10)
_PARAMS = sum(p.numel() for p in _MODEL.parameters())


@pytest.mark.parametrize("n,block", [(1, 4), (1000, 64), (4097, 1024), (300, 300)])
def test_int8_round_trip_is_within_half_a_step_of_each_block(n, block):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)  # blocks of very different ranges
    packed = quantize_int8(x, block)
    assert packed.dtype == torch.uint8 and packed.numel() == 8 * math.ceil(n / block) + n  # fp32 min, scale; 1 B
    y = dequantize_int8(packed, n, block)
    for lo in range(0, n, block):
        part = x[lo : lo + block]
        half_step = (part.max() - part.min()) / 255 / 2
        # Beyond the half step, float32 rounding (within EPS of each result, on any CPU): of the range, the scale,
        # x - min, the quotient, code x scale and min + it, all at most twice the block's largest magnitude: < 16.
        assert (y[lo : lo + block] - part).abs().max() <= half_step + 16 * EPS * part.abs().max()
    constant = torch.full((10,), 3.25)
    assert torch.equal(dequantize_int8(quantize_int8(constant, 4), 10, 4), constant)  # zero range: exact


@pytest.mark.parametrize("inner_steps,fragments", [(8, 1), (8, 4), (12, 3), (16, 16)])
def test_every_fragment_syncs_once_per_outer_step_and_fragments_cover_the_model(inner_steps, fragments):
    model = timm.create_model("test_resnet", num_classes=10)
    ranges = segment_ranges(model, fragments)
    total = sum(p.numel() for p in model.parameters())
    bounds = [(lo, hi) for _, lo, hi in ranges]
    assert bounds[0][0] == 0 and bounds[-1][1] == total and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    for outer in range(3):
        window = range(outer * inner_steps, (outer + 1) * inner_steps)
        synced = [fragment_due(step, inner_steps, fragments) for step in window]
        assert sorted(f for f in synced if f is not None) == list(range(fragments))
        gaps = [i for i, f in enumerate(synced) if f is not None]
        assert all(b - a == inner_steps // fragments for a, b in zip(gaps, gaps[1:]))  # staggered evenly


def test_outer_lr_1_without_momentum_is_local_sgd(tmp_path):
    """theta - 1 x mean(theta - theta_m) is mean(theta_m): every H steps, each replica becomes the replicas' average
    (BN statistics too), and in between the inner steps are left alone: local SGD with period H. Checked at each of
    two outer steps against the float64 average of that step's replicas, up to the rounding of the outer step alone
    (the pseudo-gradients, their sum and the step round once each: at most 5 EPS of the largest magnitude averaged;
    see _rounding.py), not against a local SGD run after training has amplified it. The second outer step would see
    a momentum that outer_momentum=0 left on."""
    common = [*FAST, "optimizer=momentum", "trainer.max_steps=8", "data.batch_size=16", "trainer.checkpoint_every=0"]
    outer_is_average = ["sync.outer_lr=1.0", "sync.outer_momentum=0.0", "sync.nesterov=false"]
    runs = {"diloco": [*common, "sync=diloco", "sync.inner_steps=4", *outer_is_average]}
    train_each(tmp_path, runs, entrypoint=each_config_checking_averages)
    for rank in (0, 1):
        log = json.loads((tmp_path / "diloco" / f"averages_rank{rank}.json").read_text())
        assert [e["step"] for e in log] == list(range(8))
        outer = [e for e in log if (e["step"] + 1) % 4 == 0]
        assert all(e["moved"] and e["replicas_differed"] for e in outer), outer
        assert all(e["error_eps"] <= 8 for e in outer), outer  # at most 5 (2.1 measured)
        assert not any(e["moved"] for e in log if (e["step"] + 1) % 4), log  # the inner steps are the optimizer's


def test_streaming_bytes_are_the_int8_fragments(contract_runs):
    """The contract test's streaming run (H=4 in 2 fragments, delay 1, int8): a fragment every 2 steps, sent as
    one byte per value plus one fp32 minimum and scale per 1024 values, by allgather (2 ranks: each sends its
    own); BN statistics averaged once per outer step."""
    case = (None, "diloco", ["inner_steps=4", "fragments=2", "delay=1", "quantize=int8"])
    metrics = read_metrics(str(case_dir(contract_runs, case) / "full" / "metrics.jsonl"))
    sent = _assert_fragments_sent(metrics, 6, lambda n: 8 * math.ceil(n / 1024) + n)
    assert sent < 6 * 4 * _PARAMS / 8  # vs allreduce every step


@pytest.mark.parametrize("quantize", ["sparse", "fp4"])
def test_fp4_and_sparse_bytes_are_their_payloads(tmp_path, quantize):
    """The same schedule with 4-bit floats (a fp32 scale per 1024 values, two values a byte) and with SparseLoCo's
    top 2 % of each chunk of 512 (two fp32 levels per chunk, 9-bit indices, 2-bit values)."""
    common = [*FAST, "optimizer=momentum", "trainer.max_steps=8", "trainer.checkpoint_every=0", "sync=diloco"]
    settings = ["sync.inner_steps=4", "sync.fragments=2", "sync.delay=1", f"sync.quantize={quantize}", "sync.chunk=512"]
    metrics = train_each(tmp_path, {quantize: [*common, *settings]})[quantize]
    payload = (lambda n: TopK.of(n, 512, 0.02).bytes) if quantize == "sparse" else (lambda n: fp4_bytes(n, 1024))
    sent = _assert_fragments_sent(metrics, 8, payload)
    assert sent < 4 * _PARAMS / (30 if quantize == "sparse" else 3)  # (a fragment a round, of 2)


def _assert_fragments_sent(metrics: list[dict], steps: int, payload) -> float:
    """Every step's bytes are its fragment's ``payload(numel)`` (gathered by 2 ranks: each sends its own once) and,
    once per outer step, the BN statistics (a ring allreduce of 2 sends them once); returns the fragments' bytes."""
    fragments = [hi - lo for _, lo, hi in segment_ranges(_MODEL, 2)]
    buffers = sum(b.numel() * 4 for b in _MODEL.buffers() if b.is_floating_point())
    train = records(metrics, "train")
    assert len(train) == steps
    for r in train:
        fragment = fragment_due(r["step"], 4, 2)
        expected = 0 if fragment is None else payload(fragments[fragment])
        expected += buffers if (r["step"] + 1) % 4 == 0 else 0
        assert r["bytes_sent"] == expected, r["step"]
    return sum(r["bytes_sent"] - (buffers if (r["step"] + 1) % 4 == 0 else 0) for r in train)


def test_right_after_a_whole_outer_step_the_replicas_agree_without_another_exchange():
    """After an outer step that sets the whole model (one fragment, no delay), every replica is the global model:
    ``before_eval()`` exchanges nothing until the next inner step, and ``agreement_at`` names the outer steps' step
    counts. With fragments, no step has every replica the same, and any step is as good as another."""
    from _counting import set_up, step

    from algorithms.diloco import DiLoCo

    diloco = DiLoCo(inner_steps=4)
    comm = set_up(diloco)
    for index in range(4):
        step(diloco, index)
    assert comm.calls == ["all_reduce_async", "average_buffers"]
    diloco.before_eval()
    assert len(comm.calls) == 2
    step(diloco, 4)
    diloco.before_eval()
    assert comm.calls[2:] == ["all_reduce_coalesced"]
    assert [diloco.agreement_at(n) for n in (5, 8, 9)] == [8, 8, 12]
    streaming = DiLoCo(inner_steps=4, fragments=2)
    set_up(streaming)
    assert streaming.agreement_at(5) == 5
    own_statistics = DiLoCo(inner_steps=4, average_buffers=False)  # (each replica keeps its BN statistics)
    comm = set_up(own_statistics)
    for index in range(4):
        step(own_statistics, index)
    own_statistics.before_eval()
    assert comm.calls == ["all_reduce_async", "average_buffers"]  # the statistics alone


def test_right_after_a_whole_outer_step_the_state_holds_the_outer_parameters_once():
    """They are the model's parameters then: the state (a checkpoint's, a joining process's) leaves them out, and
    loading it after the model's own state gives them back; after an inner step it holds them."""
    from _counting import set_up, step

    from algorithms.diloco import DiLoCo

    diloco = DiLoCo(inner_steps=2, outer_lr=0.5, outer_momentum=0.9)
    set_up(diloco)
    for index in range(2):
        step(diloco, index)
    state = diloco.state_dict()
    assert state["global_params"] is None and torch.equal(diloco.flat_parameters(), diloco.global_params)
    outer, momentum = diloco.global_params.clone(), diloco.momentum.clone()
    fresh = DiLoCo(inner_steps=2, outer_lr=0.5, outer_momentum=0.9)
    set_up(fresh, diloco.model)  # (the model already holds the state's parameters)
    fresh.global_params.zero_()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.global_params, outer) and torch.equal(fresh.momentum, momentum)
    with torch.no_grad():
        diloco.model[0].weight.add_(1.0)  # an inner step
    step(diloco, 2)
    assert torch.equal(diloco.state_dict()["global_params"], outer)
