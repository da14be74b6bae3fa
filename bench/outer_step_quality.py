"""The outer step of local SGD against synchronous training, in one process, per sample.

Issue 38: on the namespace cluster every local row of ``bench/slow_links.py`` ended 19-24%
above the synchronous loss at N samples with DiLoCo's outer optimizer (Nesterov SGD, lr
0.7, momentum 0.9: the runtime's default, ``capture/model_file.py``). This runs the same
model and data in one process, without links or timing, to tell the algorithm from the
runtime: I islands of ``--per-island`` samples each take an inner step (the model file's
optimizer) per step, and every H steps their parameters' mean change is applied to the
global parameters by ``SGD(lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=momentum > 0)``,
which every island continues from (DiLoCo; Douillard et al., 2023). The synchronous row
takes one step on the islands' samples together. Every row sees the same samples in the
same order (a shuffle of the model file's ``dataset()`` per seed). Printed: the mean
training loss of the last ``--window`` steps per row and its ratio to the synchronous
row's, per seed, and the median over seeds.

    python bench/outer_step_quality.py [--steps 1280] [--seeds 0,1,2]
        [--rows sync,24:0.7:0.9,24:1:0,100:0.7:0.9,100:1:0]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
from collections.abc import Iterator

import torch
from common import GPT, gpt_env

from hplan.runtime.capture.model_file import ModelFile, load_model_file

Batch = tuple[torch.Tensor, torch.Tensor]


def samples(model_file: ModelFile, seed: int) -> Iterator[Batch]:
    """The model file's dataset, shuffled by ``seed``, epoch after epoch."""
    data = model_file.dataset()
    generator = torch.Generator().manual_seed(seed)
    while True:
        for idx in torch.randperm(len(data), generator=generator).tolist():
            yield data[idx]


def take(source: Iterator[Batch], count: int) -> Batch:
    inputs, targets = zip(*(next(source) for _ in range(count)), strict=True)
    return torch.stack(inputs), torch.stack(targets)


def train(
    model_file: ModelFile, row: str, *, seed: int, steps: int, islands: int, per: int, window: int
) -> float:
    """The mean loss of the last ``window`` steps of ``row`` (``sync`` or ``H:LR:MOMENTUM``)."""
    torch.manual_seed(seed)
    base = model_file.build_model()
    source = samples(model_file, 1000 + seed)
    losses: list[float] = []
    if row == "sync":
        optimizer = model_file.make_optimizer(base.parameters())
        for _ in range(steps):
            inputs, targets = take(source, islands * per)
            loss = model_file.loss_fn(base(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return statistics.fmean(losses[-window:])
    h, lr, momentum = (float(v) for v in row.split(":"))
    models = [copy.deepcopy(base) for _ in range(islands)]
    optimizers = [model_file.make_optimizer(m.parameters()) for m in models]
    global_ = [p.detach().clone() for p in base.parameters()]
    outer = torch.optim.SGD(global_, lr=lr, momentum=momentum, nesterov=momentum > 0)
    for step in range(steps):
        step_losses = []
        for model, optimizer in zip(models, optimizers, strict=True):
            inputs, targets = take(source, per)
            loss = model_file.loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step_losses.append(loss.item())
        losses.append(statistics.fmean(step_losses))
        if (step + 1) % int(h) == 0:
            with torch.no_grad():
                params = [list(m.parameters()) for m in models]
                for k, g in enumerate(global_):
                    g.grad = sum(g - p[k] for p in params) / islands
                outer.step()
                outer.zero_grad()
                for p in params:
                    for local, g in zip(p, global_, strict=True):
                        local.copy_(g)
    return statistics.fmean(losses[-window:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1280, help="steps (N / global batch)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rows", default="sync,24:0.7:0.9,24:1:0,100:0.7:0.9,100:1:0")
    parser.add_argument("--islands", type=int, default=3)
    parser.add_argument("--per-island", type=int, default=8, help="samples per island and step")
    parser.add_argument("--window", type=int, default=16, help="last steps averaged")
    args = parser.parse_args()
    os.environ.update(gpt_env(layers=4, width=128, heads=4, seq=32))  # bench/slow_links.py's
    torch.set_num_threads(1)
    model_file = load_model_file(GPT)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = args.rows.split(",")
    if "sync" not in rows:
        rows.insert(0, "sync")
    print(
        f"GPT example (slow_links.py's size), {args.islands} islands x {args.per_island} "
        f"samples, {args.steps} steps = {args.steps * args.islands * args.per_island:,} "
        f"samples; loss = mean of the last {args.window} steps"
    )
    results = {
        row: [
            train(
                model_file,
                row,
                seed=seed,
                steps=args.steps,
                islands=args.islands,
                per=args.per_island,
                window=args.window,
            )
            for seed in seeds
        ]
        for row in rows
    }
    for row, values in results.items():
        ratios = [v / s for v, s in zip(values, results["sync"], strict=True)]
        what = (
            "synchronous"
            if row == "sync"
            else "H={} outer lr={} momentum={}".format(*row.split(":"))
        )
        print(
            f"{what:36} loss {' '.join(f'{v:.4f}' for v in values)}  "
            f"vs sync: median {statistics.median(ratios) - 1:+.1%} "
            f"({min(ratios) - 1:+.1%} .. {max(ratios) - 1:+.1%})"
        )


if __name__ == "__main__":
    main()
