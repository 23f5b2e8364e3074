"""sync=diloco with quantize=sparse (SparseLoCo): every round on every rank against the rule computed by
hand in float64 from what was logged (the error-feedback fold, the top-k of each chunk and its two levels, what is
taken out of the buffer, the average and the outer step), and the replicas bit-identical after every round. (The
bytes counted: test_diloco.py; resume, alone and inside relaxed sync, and a join: test_contract.py.)"""

from __future__ import annotations

import math

import torch
from _rounding import EPS
from conftest import FAST, train_each

from algorithms.compress import TopK, unpack_bits

F64 = torch.float64
SPARSE = ["sync=diloco", "sync.inner_steps=4", "sync.fragments=2", "sync.delay=1", "sync.quantize=sparse"]
SPARSE += ["sync.density=0.05", "sync.chunk=512", "sync.ef_decay=0.9"]
COMMON = [*FAST, "trainer.nproc=2", "optimizer=momentum", "trainer.max_steps=12", "trainer.checkpoint_every=0"]


def _load(path):
    return torch.load(path, weights_only=False)


def _by_hand(folded: torch.Tensor, payload: torch.Tensor, codec: TopK) -> torch.Tensor:
    """What ``payload`` must decode to, in float64, from the fp32 fold it was made of: in each chunk the payload
    names k distinct values none smaller in magnitude than any left out, and marks as larger the (k + 1) // 2 of
    them none smaller than the rest (which of equal magnitudes is free: this job's fp32 pseudo-gradients tie);
    each is sent with its sign at the mean magnitude of its half."""
    chunks, k, upper = codec.chunks, codec.k, (codec.k + 1) // 2
    at, width = 8 * chunks, -(-chunks * k * codec.index_bits // 8)
    indices = unpack_bits(payload[at : at + width], codec.index_bits, chunks * k).view(chunks, k).tolist()
    larger = (unpack_bits(payload[at + width :], 2, chunks * k) & 1).view(chunks, k).tolist()
    padded = torch.cat([folded.double(), torch.zeros((-folded.numel()) % codec.chunk, dtype=F64)])
    out = torch.zeros(padded.numel(), dtype=F64)
    for c in range(chunks):
        values = padded[c * codec.chunk : (c + 1) * codec.chunk]
        chosen = indices[c]
        assert len(set(chosen)) == k
        left = [abs(float(v)) for i, v in enumerate(values) if i not in set(chosen)]
        high = [abs(float(values[i])) for i, h in zip(chosen, larger[c]) if h]
        low = [abs(float(values[i])) for i, h in zip(chosen, larger[c]) if not h]
        assert len(high) == upper and min(high) >= max(low or [0.0]) and min(low or high) >= max(left or [0.0])
        levels = (sum(low) / len(low) if low else sum(high) / upper, sum(high) / upper)
        for i, h in zip(chosen, larger[c]):
            out[c * codec.chunk + i] = math.copysign(levels[h], float(values[i]))
    return out[: folded.numel()]


def test_every_sparse_round_follows_the_rule_by_hand_and_replicas_stay_bit_identical(tmp_path):
    """2 ranks, H=4 in 2 fragments (a round every 2 steps, applied a step later), 5 % of each chunk of 512, β 0.9,
    outer Nesterov (lr 0.7, momentum 0.9): 6 rounds. Per round and rank: the buffer's fold β e + Δ (float64 against
    the fp32 fold, within its rounding); the payload decodes to a top-k of the fold with its two levels (by hand, in
    float64: ``_by_hand``); the buffer keeps the fold minus what was sent; the new
    global fragment is the outer step on the two ranks' decoded average; every rank's global fragment and its own
    fragment after the round are the same bits."""
    from _sparse import logging_sparse_rounds

    train_each(tmp_path, {"sparse": [*COMMON, *SPARSE]}, logging_sparse_rounds)
    logs = [_load(tmp_path / "sparse" / f"sparse_rank{r}.pt") for r in range(2)]
    assert [len(log["sends"]) for log in logs] == [6, 6] and [len(log["applies"]) for log in logs] == [6, 6]
    for index in range(6):
        sent = []
        for log in logs:
            s = log["sends"][index]
            n = s["delta"].numel()
            codec = TopK.of(n, 512, 0.05)
            folded = s["before"] * 0.9 + s["delta"]  # (the fp32 fold, as the buffer computes it)
            exact = 0.9 * s["before"].double() + s["delta"].double()
            assert float((folded.double() - exact).abs().max()) <= 2 * EPS * float(exact.abs().max()), index
            hand = _by_hand(folded, s["payload"], codec)
            assert float((s["sent"].double() - hand).abs().max()) <= 4 * EPS * float(hand.abs().max()), index
            assert torch.equal(codec.decode(s["payload"]), s["sent"])  # (what every receiver decodes)
            assert torch.equal(s["after"], folded - s["sent"]), index  # what was not sent stays
            assert int((s["sent"] != 0).sum()) <= codec.k * codec.chunks
            sent.append(hand)
        applies = [log["applies"][index] for log in logs]
        for other in applies[1:]:  # (bit-identical replicas: the same global fragment, the same own fragment)
            assert all(torch.equal(other[k], applies[0][k]) for k in ("old", "momentum", "new", "momentum_after"))
            assert torch.equal(other["local"], applies[0]["local"]), index
        a = applies[0]
        assert torch.equal(a["local"], a["new"])  # (alpha 0: the rank takes the global fragment)
        average = (sent[0] + sent[1]) / 2
        momentum = 0.9 * a["momentum"].double() + average
        theta = a["old"].double() - 0.7 * (average + 0.9 * momentum)
        bound = 64 * EPS * max(float(a["old"].abs().max()), float(momentum.abs().max()))
        assert float((a["new"].double() - theta).abs().max()) <= bound, index
        assert float((a["momentum_after"].double() - momentum).abs().max()) <= bound, index
