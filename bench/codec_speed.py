"""Speed of the quantized pseudo-gradient codec (``runtime/executor/pseudo_gradient_codec.py``):
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
from hplan.runtime.executor.pseudo_gradient_codec import decode, encode


def seconds(values: torch.Tensor, wire: PseudoGradientDtype, repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` encode + decode round trips of ``values``."""
    times = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        encoded = encode(values, wire)
        decode(encoded.payload, wire, values.numel())
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
        seconds(values, wire, 1)  # warm-up
        median_s = statistics.median(seconds(values, wire, args.repeats))
        print(f"{wire.value:>5}: {median_s * 1e3:8.1f} ms  {args.elements / median_s:12.4g} "
              "elements/s (encode + decode)")  # fmt: skip


if __name__ == "__main__":
    main()
