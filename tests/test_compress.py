"""The pseudo-gradients' codecs (algorithms/compress.py) against hand computations: top-k per chunk with 2-bit
values, dense 4-bit floats, the error-feedback buffer, the bit packing, and the payload sizes the bytes count."""

from __future__ import annotations

import pytest
import torch

from algorithms.compress import (
    ErrorFeedback,
    TopK,
    dequantize_fp4,
    fp4_bytes,
    pack_bits,
    quantize_fp4,
    unpack_bits,
)


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 7, 12, 16])
def test_bits_round_trip_in_the_bytes_they_need(bits):
    g = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 2**bits, (1001,), generator=g)
    packed = pack_bits(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-1001 * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, 1001), values)


def test_top_k_of_each_chunk_with_two_levels_by_hand():
    # Chunks of 4, 2 of each: chunk 0 keeps -2.0 (index 1) and 1.0 (index 3), its larger half -2.0 (level 2.0)
    # and its smaller 1.0 (level 1.0); chunk 1 keeps 3.0 (index 0) and -0.25 (index 2).
    codec = TopK.of(8, chunk=4, density=0.5)
    assert (codec.chunk, codec.k, codec.chunks, codec.index_bits) == (4, 2, 2, 2)
    payload = codec.encode(_t([0.5, -2.0, 0.1, 1.0, 3.0, 0.0, -0.25, 0.125]))
    assert payload.numel() == codec.bytes == 8 * 2 + 1 + 1  # (4 indices x 2 bits, 4 codes x 2 bits)
    assert codec.decode(payload).tolist() == [0.0, -2.0, 0.0, 1.0, 3.0, 0.0, -0.25, 0.0]
    # 3 of each: the larger half is 2 values, sent at their mean magnitude, the smaller at its own.
    codec = TopK.of(8, chunk=4, density=0.75)
    decoded = codec.decode(codec.encode(_t([0.5, -2.0, 0.1, 1.0, 3.0, 0.0, -0.25, 0.125])))
    assert decoded.tolist() == [0.5, -1.5, 0.0, 1.5, 1.625, 0.0, -1.625, 0.125]  # (3, 0.25 | 0.125)


def test_a_last_chunk_shorter_than_the_rest_is_filled_and_cut():
    codec = TopK.of(6, chunk=4, density=0.25)
    assert (codec.chunks, codec.k) == (2, 1)
    assert codec.decode(codec.encode(_t([0.0, 0.0, 4.0, -1.0, 0.5, -0.75]))).tolist() == [0, 0, 4.0, 0, 0, -0.75]


def test_sparse_payload_at_two_percent_is_under_one_percent_of_fp32():
    codec = TopK.of(4096 * 100, chunk=4096, density=0.02)
    assert (codec.k, codec.index_bits, codec.bytes) == (82, 12, 100 * 8 + 12_300 + 2_050)
    g = torch.Generator().manual_seed(0)
    assert codec.encode(torch.randn(codec.n, generator=g)).numel() == codec.bytes
    assert codec.bytes / (4 * codec.n) < 0.0093  # (151.5 bytes per 4,096 values)


def test_error_feedback_sends_what_it_holds_and_keeps_the_rest_by_hand():
    codec = TopK.of(4, chunk=4, density=0.25)  # one value a round
    ef = ErrorFeedback(torch.zeros(4), decay=0.5)
    payload, sent = ef.send(0, 4, _t([1.0, -3.0, 2.0, 0.0]), codec)
    assert sent.tolist() == [0.0, -3.0, 0.0, 0.0] and codec.decode(payload).tolist() == sent.tolist()
    assert ef.buffer.tolist() == [1.0, 0.0, 2.0, 0.0]
    # Next round: e = 0.5 e + delta = [0.5 + 0.25, 0.0, 1.0 - 0.5, 1.0]: 1.0 goes, the rest stays.
    _, sent = ef.send(0, 4, _t([0.25, 0.0, -0.5, 1.0]), codec)
    assert sent.tolist() == [0.0, 0.0, 0.0, 1.0] and ef.buffer.tolist() == [0.75, 0.0, 0.5, 0.0]


def test_error_feedback_works_on_its_fragment_of_the_buffer():
    codec = TopK.of(2, chunk=2, density=0.5)
    ef = ErrorFeedback(torch.zeros(5), decay=0.95)
    ef.send(2, 4, _t([-1.0, 0.5]), codec)
    assert ef.buffer.tolist() == [0.0, 0.0, 0.0, 0.5, 0.0]


def test_fp4_levels_by_hand():
    # Block of 4, scale 1: 1.0 and -0.5 are levels; 0.3 is below 0.375 (the midpoint of 0.25 and 0.5): 0.25;
    # 0.001 is below 2^-7 (the midpoint of 0 and 2^-6): 0. The second block's scale is 8: 6.1 / 8 = 0.7625 is
    # above 0.75, so 1; 0.2 / 8 = 0.025 is above 0.0234 (the midpoint of 2^-5 and 2^-6), so 2^-5 x 8 = 0.25.
    x = _t([1.0, -0.5, 0.3, 0.001, 8.0, 6.1, -0.2, 0.0])
    packed = quantize_fp4(x, 4)
    assert packed.numel() == fp4_bytes(8, 4) == 2 * 4 + 4
    assert dequantize_fp4(packed, 8, 4).tolist() == [1.0, -0.5, 0.25, 0.0, 8.0, 8.0, -0.25, 0.0]


def test_fp4_error_is_at_most_a_third_of_a_value_or_half_the_smallest_level():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40 * 256, generator=g) * torch.exp(torch.randn(40 * 256, generator=g) * 2)
    decoded = dequantize_fp4(quantize_fp4(x, 256), x.numel(), 256)
    scale = x.abs().view(40, 256).amax(dim=1).repeat_interleave(256)
    bound = torch.maximum(x.abs() / 3, scale * 2.0**-7) * (1 + 1e-6)
    assert bool(((decoded - x).abs() <= bound).all())
    assert bool((torch.sign(decoded) * torch.sign(x) >= 0).all())  # (never the wrong sign)
