"""The block-quantized wire formats of pseudo-gradients (``int8``, ``int4``), on host float32.

A quantized outer sync (``PseudoGradientDtype``, ``outer_sync.py``) sends each island's
weighted pseudo-gradient plus its residual as one payload of bytes: the float32 scales of
its blocks of ``WIRE_BLOCK_ELEMENTS`` elements, then the signed integers (``int8``: one
byte each; ``int4``: two's-complement nibbles, element 2j in the low half of byte j, the
high half of a last odd byte zero). :func:`encode` returns the payload with the values it
decodes to, so that the caller's residual (values - decoded) is exactly what the rounding
lost and :func:`decode` of the payload gives those same values bit for bit. Vectorised torch
on the host: no Python loop over blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hplan.runtime.contract.plan import (
    WIRE_BLOCK_ELEMENTS,
    PseudoGradientDtype,
    wire_payload_bytes,
)

__all__ = ["Encoded", "decode", "encode"]

_SCALE_BYTES = 4
"""Bytes of one block's float32 scale."""


@dataclass(frozen=True)
class Encoded:
    """One quantized pseudo-gradient."""

    payload: Tensor
    """``(wire_payload_bytes(wire, n),)`` uint8: the scales, then the integers."""
    decoded: Tensor
    """``(n,)`` float32: what :func:`decode` of :attr:`payload` gives."""


def _blocks(values: Tensor) -> Tensor:
    """``(n,)`` -> ``(num_blocks, WIRE_BLOCK_ELEMENTS)``: a view when the blocks are whole,
    else a copy whose last block is padded with zeros."""
    if values.numel() % WIRE_BLOCK_ELEMENTS == 0:
        return values.view(-1, WIRE_BLOCK_ELEMENTS)
    num_blocks = -(-values.numel() // WIRE_BLOCK_ELEMENTS)
    padded = values.new_zeros(num_blocks * WIRE_BLOCK_ELEMENTS)
    padded[: values.numel()] = values
    return padded.view(num_blocks, WIRE_BLOCK_ELEMENTS)


def _check(wire: PseudoGradientDtype) -> None:
    if not wire.quantized:
        raise ValueError(f"wire format {wire.value} is not a quantized one (int8, int4)")


def encode(values: Tensor, wire: PseudoGradientDtype) -> Encoded:
    """Quantize ``values`` in blocks: scale = the block's largest magnitude / the format's
    largest integer (``PseudoGradientDtype.largest_integer``), integer = round(value /
    scale) to nearest (ties to even), 0 in a block of zeros.

    Args:
        values: ``(n,)`` float32 on the host, finite.
        wire: ``int8`` or ``int4``.

    Returns:
        The payload and its decoded values; ``|values - decoded| <= scale / 2`` per element.

    Raises:
        ValueError: ``wire`` is a float format.
    """
    _check(wire)
    num = values.numel()
    blocks = _blocks(values.reshape(-1).to(torch.float32))
    largest = wire.largest_integer
    scales = blocks.abs().amax(dim=1).div_(largest)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    rounded = (blocks / safe[:, None]).round_().clamp_(-largest, largest)
    integers = rounded.to(torch.int8).reshape(-1)[:num]
    payload = torch.cat([scales.view(torch.uint8), _pack(integers, wire)])
    assert payload.numel() == wire_payload_bytes(wire, num)
    return Encoded(payload, _dequantize(integers, scales))


def decode(payload: Tensor, wire: PseudoGradientDtype, num_elements: int) -> Tensor:
    """The ``(num_elements,)`` float32 values of a payload of :func:`encode` (host uint8).

    Raises:
        ValueError: ``wire`` is a float format, or the payload's size is not
            ``wire_payload_bytes(wire, num_elements)``.
    """
    _check(wire)
    if payload.numel() != wire_payload_bytes(wire, num_elements):
        raise ValueError(
            f"a {wire.value} payload of {num_elements} elements has "
            f"{wire_payload_bytes(wire, num_elements)} bytes, got {payload.numel()}"
        )
    num_blocks = -(-num_elements // WIRE_BLOCK_ELEMENTS)
    scales = payload[: _SCALE_BYTES * num_blocks].clone().view(torch.float32)
    integers = _unpack(payload[_SCALE_BYTES * num_blocks :], wire, num_elements)
    return _dequantize(integers, scales)


def _dequantize(integers: Tensor, scales: Tensor) -> Tensor:
    """``(n,)`` int8 integers times their block's scale, float32."""
    wide = _blocks(integers.to(torch.float32))
    return wide.mul_(scales[:, None]).reshape(-1)[: integers.numel()]


def _pack(integers: Tensor, wire: PseudoGradientDtype) -> Tensor:
    """``(n,)`` int8 integers -> their bytes (``int4``: two per byte, low nibble first)."""
    if wire is PseudoGradientDtype.INT8:
        return integers.view(torch.uint8)
    nibbles = integers.view(torch.uint8) & 0x0F
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
    pairs = nibbles.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack(data: Tensor, wire: PseudoGradientDtype, num_elements: int) -> Tensor:
    """The inverse of :func:`_pack`: ``(num_elements,)`` int8."""
    if wire is PseudoGradientDtype.INT8:
        return data.clone().view(torch.int8)
    low = (data << 4).view(torch.int8) >> 4  # arithmetic shifts: the sign extended
    high = data.view(torch.int8) >> 4
    return torch.stack([low, high], dim=1).reshape(-1)[:num_elements]
