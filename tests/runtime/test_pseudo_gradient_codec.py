"""The quantized wire formats of pseudo-gradients (``pseudo_gradient_codec.py``) and the
error feedback of their exchange (``outer_exchange.QuantizedExchange``), in one process."""

from __future__ import annotations

import pytest
import torch

from hplan.runtime.contract.plan import (
    WIRE_BLOCK_ELEMENTS,
    PseudoGradientDtype,
    wire_payload_bytes,
)
from hplan.runtime.executor.outer.outer_exchange import (
    QuantizedExchange,
    broadcast_floor_bytes,
    gather_floor_bytes,
)
from hplan.runtime.executor.outer.pseudo_gradient_codec import decode, encode

QUANTIZED = [w for w in PseudoGradientDtype if w.quantized]
SIZES = [1, 2, 63, 64, 65, 129, 1000]
"""Element counts: one, an odd and even number, a block and either side of it."""


def _values(num: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(num)
    values = torch.randn(num, generator=generator) * torch.logspace(-3, 1, num)
    if num > WIRE_BLOCK_ELEMENTS:  # a block of zeros
        values[:WIRE_BLOCK_ELEMENTS] = 0.0
    return values


def _scales(values: torch.Tensor, wire: PseudoGradientDtype) -> torch.Tensor:
    """Each element's block scale, by hand."""
    blocks = [values[i : i + WIRE_BLOCK_ELEMENTS] for i in range(0, values.numel(), 64)]
    return torch.cat([b.abs().max().expand(b.numel()) / wire.largest_integer for b in blocks])


@pytest.mark.parametrize("wire", QUANTIZED)
@pytest.mark.parametrize("num", SIZES)
def test_a_round_trip_loses_at_most_half_a_scale_per_element(
    wire: PseudoGradientDtype, num: int
) -> None:
    values = _values(num)
    encoded = encode(values, wire)
    assert encoded.payload.dtype == torch.uint8
    assert encoded.payload.numel() == wire_payload_bytes(wire, num)
    decoded = decode(encoded.payload, wire, num)
    assert torch.equal(decoded, encoded.decoded)  # the sender's residual is the receiver's loss
    lost = (values - decoded).abs()
    assert torch.all(lost <= _scales(values, wire) / 2 * (1 + 1e-6))
    largest = values.abs().max()
    assert decoded.abs().max() == pytest.approx(float(largest), rel=1e-6)  # the absmax travels
    if num > WIRE_BLOCK_ELEMENTS:
        assert torch.all(decoded[:WIRE_BLOCK_ELEMENTS] == 0)


def test_int4_packs_two_twos_complement_nibbles_per_byte_low_first() -> None:
    # one block whose scale is 1 (largest magnitude 7): the integers are the values
    values = torch.tensor([7.0, -7.0, 1.0, -1.0, 0.0, 3.0, -7.0])
    encoded = encode(values, PseudoGradientDtype.INT4)
    scale, data = encoded.payload[:4].view(torch.float32), encoded.payload[4:].tolist()
    assert scale.item() == 1.0
    assert data == [0x97, 0xF1, 0x30, 0x09]  # (7, -7), (1, -1), (0, 3), (-7, zero pad)
    int8 = encode(values, PseudoGradientDtype.INT8).payload
    assert int8[4:].view(torch.int8).tolist() == [127, -127, 18, -18, 0, 54, -127]


def test_the_codec_refuses_a_float_format_and_a_payload_of_another_size() -> None:
    with pytest.raises(ValueError, match="bfloat16 is not a quantized one"):
        encode(torch.ones(3), PseudoGradientDtype.BFLOAT16)
    payload = encode(torch.ones(65), PseudoGradientDtype.INT4).payload
    with pytest.raises(ValueError, match="int4 payload of 64 elements has 36 bytes, got 41"):
        decode(payload, PseudoGradientDtype.INT4, 64)


def test_the_residual_carries_exactly_what_the_rounding_lost_into_the_next_launch() -> None:
    # an island's holder other than its lead: quantizes and keeps the residual, sends nothing
    wire = PseudoGradientDtype.INT4
    exchange = QuantizedExchange(
        wire=wire, weight=0.25, lead_rank=0, leads=None, num_leads=2, island_group=None,
        gather_floor_s=0.0, broadcast_floor_s=0.0, residual=torch.zeros(100),
    )  # fmt: skip
    deltas = _values(100)
    exchange.launch(deltas, torch.device("cpu"))
    first = deltas * 0.25
    lost = first - encode(first, wire).decoded
    assert torch.equal(exchange.residual, lost) and lost.abs().max() > 0
    exchange.launch(deltas, torch.device("cpu"))
    second = deltas * 0.25 + lost  # what the rounding lost is sent the next time
    assert torch.equal(exchange.residual, second - encode(second, wire).decoded)
    # over two rounds the decoded sum misses only the last residual
    sent = encode(first, wire).decoded + encode(second, wire).decoded
    torch.testing.assert_close(sent + exchange.residual, 2 * first, rtol=0, atol=1e-6)


def test_the_floor_bytes_of_a_gather_and_a_broadcast_match_a_ring() -> None:
    # k payloads of P bytes: each member receives (k - 1) P, as an all-reduce of k P / 2
    assert gather_floor_bytes(2, 1000) == 1000
    assert gather_floor_bytes(3, 1001) == 1502
    # a broadcast of B bytes carries B over each link: 2 (m - 1) / m * x = B
    assert broadcast_floor_bytes(2, 400) == 400
    assert broadcast_floor_bytes(4, 300) == 200
    assert broadcast_floor_bytes(1, 300) == 0
