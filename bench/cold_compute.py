"""Why a rehearsal of a cpu plan runs slower than its profile: compute after a sleep.

A rehearsal stretches each rank's compute by sleeping after it (``hplan rehearse``: a
forward lasts D x its CPU time), so between two forwards a rank sleeps. ``hplan profile``
times units back to back. This bench times the same forward + backward of the GPT example
(one thread, thread CPU time, the median of ``--repeats``) right after another call and
after a sleep of 1x and 3x a call's duration (a rehearsal at dilation 4 sleeps 3x),
interleaved in one run, and prints the ratios. On the 2-core VM this project is built on
(2026-11-29, three runs): 1.03-1.07x after 1x, 1.24-1.28x after 3x (caches and the
idle vCPU go cold) - most of the 1.35x that ``hplan calibrate`` learned from a rehearsal
at dilation 4 of a plan profiled back to back. A single factor measured this way did not
hold inside a rehearsal (forwards ran colder than backwards, and the other ranks evict the
caches too), so from the second step each rank stretches the warm CPU time of its own
stage, measured back to back after the first step (``runtime/rehearsal/warm_compute.py``).

    python bench/cold_compute.py [--batch 8] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import GPT, console, table

from hplan.runtime.capture.model_file import load_model_file
from hplan.runtime.capture.trace import bind_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_file = load_model_file(Path(GPT))
    torch.manual_seed(0)
    model = model_file.build_model()
    inputs, targets = model_file.sample_batch(args.batch)
    bound = bind_inputs(model, inputs)

    def step() -> None:
        model_file.loss_fn(model(**bound), targets).backward()

    for _ in range(3):
        step()
    factors = (0.0, 1.0, 3.0)
    cpu_s: dict[float, list[float]] = {f: [] for f in factors}
    last_wall_s = 0.0
    for _ in range(args.repeats):
        for factor in factors:
            step()  # the call before: back to back with the timed one, or followed by a sleep
            time.sleep(factor * last_wall_s)
            start_cpu, start_wall = time.thread_time(), time.perf_counter()
            step()
            cpu_s[factor].append(time.thread_time() - start_cpu)
            last_wall_s = time.perf_counter() - start_wall
    hot_s = statistics.median(cpu_s[0.0])
    out = table(
        f"GPT example forward + backward, batch {args.batch}, one thread: CPU time per call",
        ["after the previous call", "median CPU ms", "vs back to back"],
    )
    for factor in factors:
        median_s = statistics.median(cpu_s[factor])
        label = "back to back" if factor == 0 else f"sleep {factor:g}x its duration"
        out.add_row(label, f"{median_s * 1e3:.2f}", f"{median_s / hot_s:.2f}x")
    console.print(out)


if __name__ == "__main__":
    main()
