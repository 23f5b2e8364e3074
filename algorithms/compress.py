"""What DiLoCo's pseudo-gradients travel as: codecs from a byte a value down to a few bits per hundred values.

Each codec turns a 1-D fp32 tensor into one ``uint8`` payload whose size depends only on the tensor's length and
the codec's settings (so every rank's payload has the same shape, as an all-gather needs), and back. Every rank
decodes every payload with the same operations in the same order, so what the replicas compute from them is
bit-identical.

- **int8** (Streaming DiLoCo, arXiv 2501.18512): per block of ``block`` values one fp32 minimum and one fp32 scale,
  then a byte a value, ``round((v - min) / scale)`` with ``scale = (max - min) / 255``: within half a scale step.
- **fp4** (Streaming DiLoCo's 4-bit floats, E3M0: a sign and a 3-bit exponent, no mantissa): per block one fp32
  scale, the block's largest magnitude m; each value becomes ``± m · 2^-e`` for e in 0..6, or 0, whichever is
  nearest; two values a byte.
- **sparse** (SparseLoCo, arXiv 2508.15706): of each chunk of ``chunk`` values the ``k`` largest in magnitude,
  each as its index in the chunk (``ceil(log2(chunk))`` bits) and 2 bits: its sign and whether it is among the
  chunk's larger half of those k; per chunk two fp32 magnitudes, the mean magnitude of each half (the two levels
  that minimise the squared error for that split). The rest of the chunk is sent as 0. With an error-feedback
  buffer (:class:`ErrorFeedback`) what was not sent is sent later.

Bytes, for n values: int8 ``8 ceil(n / block) + n``; fp4 ``4 ceil(n / block) + ceil(n / 2)``; sparse, with
C = ceil(n / chunk) chunks, ``8 C + ceil(C k b / 8) + ceil(C k / 4)`` (b the index bits). At a density of 2 %
(k = 82 of 4,096: 12-bit indices) that is 151.5 bytes per 4,096 values, 0.92 % of fp32's 16,384.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CODECS = ("none", "fp16", "int8", "fp4", "sparse")
FP4_LEVELS = 7  # exponents 0..6: magnitudes m, m/2, ..., m/64; code 7 is 0


# ---- bits ------------------------------------------------------------------------------------------------------
def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below ``2 ** bits`` packed ``bits`` each, least significant first, into bytes."""
    shifts = torch.arange(bits, device=values.device)
    flat = ((values.reshape(-1, 1).long() >> shifts) & 1).reshape(-1)
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % 8)]).view(-1, 8)
    return (flat << torch.arange(8, device=values.device)).sum(dim=1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The inverse of :func:`pack_bits`: ``count`` integers (int64)."""
    flat = ((data.reshape(-1, 1).long() >> torch.arange(8, device=data.device)) & 1).reshape(-1)
    return (flat[: count * bits].view(count, bits) << torch.arange(bits, device=data.device)).sum(dim=1)


def _blocks(x: torch.Tensor, block: int, fill: torch.Tensor) -> torch.Tensor:
    pad = (-x.numel()) % block
    return torch.cat([x, fill.expand(pad)]).view(-1, block) if pad else x.view(-1, block)


def _floats(values: torch.Tensor) -> torch.Tensor:
    return values.contiguous().view(torch.uint8).view(-1)


# ---- int8 ------------------------------------------------------------------------------------------------------
def quantize_int8(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (1-D fp32) as int8 codes with a minimum and a scale per block (the module docstring)."""
    n = x.numel()
    blocks = _blocks(x, block, x[-1:])  # (the last block filled with its own last value, which widens no range)
    low, high = blocks.min(dim=1).values, blocks.max(dim=1).values
    scale = (high - low) / 255.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((blocks - low[:, None]) / safe[:, None]).round_().clamp_(0, 255).to(torch.uint8).view(-1)[:n]
    return torch.cat([_floats(torch.stack([low, scale], dim=1)), codes])


def dequantize_int8(packed: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The inverse of :func:`quantize_int8` for ``n`` values."""
    num_blocks = math.ceil(n / block)
    header = packed[: 8 * num_blocks].view(torch.float32).view(num_blocks, 2)
    codes = packed[8 * num_blocks : 8 * num_blocks + n].float()
    index = torch.arange(n, device=packed.device) // block
    return header[index, 0] + codes * header[index, 1]


# ---- fp4 (E3M0) ------------------------------------------------------------------------------------------------
def quantize_fp4(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (1-D fp32) as 4-bit codes, a sign and an exponent, with a scale per block (the module docstring)."""
    n = x.numel()
    blocks = _blocks(x, block, x.new_zeros(1))
    scale = blocks.abs().max(dim=1).values
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    r = blocks.abs() / safe[:, None]  # in [0, 1]
    # The nearest of 2^-e (e = 0..6) and 0: e = floor(-log2 r) brackets r in (2^-(e+1), 2^-e]; the upper level
    # wins from 0.75 x 2^-e up; below 2^-7, 0 is nearer than 2^-6.
    e = torch.floor(-torch.log2(r.clamp_min(2.0**-30))).clamp_(0, FP4_LEVELS - 1)
    e = torch.where(r >= 0.75 * torch.exp2(-e), e, e + 1)
    e = torch.where(r >= 2.0**-7, e.clamp_(max=FP4_LEVELS - 1), torch.full_like(e, FP4_LEVELS))
    codes = (e.long() | ((blocks < 0).long() << 3)).view(-1)[:n]
    return torch.cat([_floats(scale), pack_bits(codes, 4)])


def dequantize_fp4(packed: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The inverse of :func:`quantize_fp4` for ``n`` values."""
    num_blocks = math.ceil(n / block)
    scale = packed[: 4 * num_blocks].view(torch.float32)
    codes = unpack_bits(packed[4 * num_blocks :], 4, n)
    e = codes & 7
    magnitude = torch.where(e < FP4_LEVELS, torch.exp2(-e.float()), torch.zeros(1, device=packed.device))
    sign = 1.0 - 2.0 * (codes >> 3).float()
    return sign * magnitude * scale[torch.arange(n, device=packed.device) // block]


def fp4_bytes(n: int, block: int) -> int:
    return 4 * math.ceil(n / block) + math.ceil(n / 2)


# ---- sparse: top-k per chunk, 2 bits a value -------------------------------------------------------------------
@dataclass(frozen=True)
class TopK:
    """The sparse codec's shape: ``n`` values in chunks of ``chunk``, the ``k`` largest of each sent."""

    n: int
    chunk: int
    k: int

    @classmethod
    def of(cls, n: int, chunk: int, density: float) -> TopK:
        """``density`` of each chunk (at least one value); a tensor shorter than a chunk is one chunk."""
        chunk = max(1, min(chunk, n))
        return cls(n, chunk, max(1, min(chunk, round(density * chunk))))

    @property
    def chunks(self) -> int:
        return math.ceil(self.n / self.chunk)

    @property
    def index_bits(self) -> int:
        return max(1, math.ceil(math.log2(self.chunk)))

    @property
    def bytes(self) -> int:
        sent = self.chunks * self.k
        return 8 * self.chunks + math.ceil(sent * self.index_bits / 8) + math.ceil(sent / 4)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The payload of ``x`` (1-D fp32, ``n`` values): the module docstring's layout, scales first."""
        blocks = _blocks(x, self.chunk, x.new_zeros(1))
        top = blocks.abs().topk(self.k, dim=1, sorted=True)  # (largest first: the first half is the larger)
        upper = (self.k + 1) // 2
        high = top.values[:, :upper].mean(dim=1)
        low = top.values[:, upper:].mean(dim=1) if self.k > upper else high
        larger = torch.zeros(self.k, dtype=torch.long, device=x.device)
        larger[:upper] = 1
        negative = (blocks.gather(1, top.indices) < 0).long()
        codes = (negative << 1) | larger.expand_as(negative)
        scales = _floats(torch.stack([low, high], dim=1))
        return torch.cat([scales, pack_bits(top.indices, self.index_bits), pack_bits(codes, 2)])

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """The dense tensor a payload stands for (0 where nothing was sent)."""
        chunks, sent = self.chunks, self.chunks * self.k
        scales = payload[: 8 * chunks].view(torch.float32).view(chunks, 2)
        at = 8 * chunks
        width = math.ceil(sent * self.index_bits / 8)
        indices = unpack_bits(payload[at : at + width], self.index_bits, sent).view(chunks, self.k)
        codes = unpack_bits(payload[at + width :], 2, sent).view(chunks, self.k)
        values = scales.gather(1, codes & 1) * (1.0 - 2.0 * (codes >> 1).float())
        out = torch.zeros(chunks, self.chunk, dtype=torch.float32, device=payload.device)
        out.scatter_(1, indices, values)
        return out.view(-1)[: self.n]


class ErrorFeedback:
    """SparseLoCo's error-feedback buffer for one rank: ``e ← β e + Δ``, the payload of e's top-k is sent, and what
    it decodes to is taken out of e (``e ← e − sent``), so that what was not sent, or sent short by the 2-bit
    levels, is sent in a later round (decayed by β a round)."""

    def __init__(self, buffer: torch.Tensor, decay: float):
        self.buffer, self.decay = buffer, decay

    def send(self, lo: int, hi: int, delta: torch.Tensor, codec: TopK) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold ``delta`` into the buffer's ``[lo, hi)`` and take out what is sent: (payload, what it decodes to)."""
        e = self.buffer[lo:hi]
        e.mul_(self.decay).add_(delta)
        payload = codec.encode(e)
        sent = codec.decode(payload)  # (as every receiver decodes it)
        e.sub_(sent)
        return payload, sent
