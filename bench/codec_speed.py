"""Speed of the quantized pseudo-gradient codec (``runtime/executor/outer/pseudo_gradient_codec.py``):
elements per second of one encode plus one decode of a large float32 tensor on the host, per
quantized wire format, on one CPU thread (what a rank's outer sync spends per element on
either side of the wire; the planner's cost model counts it).

    python bench/codec_speed.py [--elements 10000000] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hplan.runtime.contract.plan import PseudoGradientDtype
from hplan.runtime.executor.outer.pseudo_gradient_codec import decode, encode


def seconds(
    values: torch.Tensor, wire: PseudoGradientDtype, repeats: int, *, feedback: bool
) -> list[float]:
    """Wall seconds of ``repeats`` encode + decode round trips of ``values``; with
    ``feedback`` also the error feedback around them, as one island's exchange does it
    (``outer_exchange.QuantizedExchange``: value = 0.5 Δ + residual, residual ← value -
    decoded, and the decoded sum of two payloads)."""
    residual = torch.zeros_like(values)
    times = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        value = values * 0.5 + residual if feedback else values
        encoded = encode(value, wire)
        decoded = decode(encoded.payload, wire, values.numel())
        if feedback:
            residual.copy_(value - encoded.decoded)
            decoded += decoded
        times.append(time.perf_counter() - start_s)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    values = torch.randn(args.elements, generator=torch.Generator().manual_seed(0))
    print(f"{args.elements:,} float32 elements, {args.threads} thread(s), "
          f"median of {args.repeats} encode + decode round trips")  # fmt: skip
    for wire in (w for w in PseudoGradientDtype if w.quantized):
        for feedback, what in ((False, "encode + decode"), (True, "with error feedback")):
            seconds(values, wire, 1, feedback=feedback)  # warm-up
            median_s = statistics.median(seconds(values, wire, args.repeats, feedback=feedback))
            print(f"{wire.value:>5}: {median_s * 1e3:8.1f} ms  "
                  f"{args.elements / median_s:12.4g} elements/s ({what})")  # fmt: skip


if __name__ == "__main__":
    main()
