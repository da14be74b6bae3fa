"""torch DDP on an hplan model file: the reference that hplan's runtime is measured against.

Run under torchrun, one process per rank (``bench/real_cluster.py`` starts it in each
network namespace)::

    torchrun ... bench/ddp_reference.py MODEL --batch-sizes 64,32,32 --steps 30 --out T.json

Rank ``r`` trains on ``batch_sizes[r]`` samples per step: equal sizes are plain DDP; unequal
ones are the hand split of a user who knows the nodes' speeds. Each rank's mean loss is
weighted by ``batch_sizes[r] * world / global_batch`` so that DDP's gradient average is the
gradient of the global batch's mean loss, as in hplan. Data: the model file's ``dataset()``
(consecutive items, each rank its own slice of the global batch, default-collated) or, without
one, ``sample_batch``. The optimizer is the model file's (default AdamW, lr 1e-3), as hplan's.
Rank 0 writes ``{"end_unix_time_s": [...], "losses": [...]}``: the wall-clock end of every
step (after ``optimizer.step()``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import default_collate

from hplan.runtime.capture.model_file import load_model_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--batch-sizes", required=True, help="per-rank samples, comma separated")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert len(sizes) == world, f"{len(sizes)} batch sizes for {world} ranks"
    global_batch = sum(sizes)
    model_file = load_model_file(args.model)
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(model_file.build_model())
    optimizer = model_file.optimizer(list(model.parameters()))
    dataset = model_file.dataset() if model_file.dataset is not None else None
    weight = sizes[rank] * world / global_batch
    first = sum(sizes[:rank])
    ends, losses = [], []
    for step in range(args.steps):
        if dataset is not None:
            start = (step * global_batch + first) % max(1, len(dataset) - sizes[rank])
            inputs, targets = default_collate([dataset[start + i] for i in range(sizes[rank])])
        else:
            inputs, targets = model_file.sample_batch(sizes[rank])
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        loss = model_file.loss_fn(model(inputs), targets)
        t1 = time.time()
        (loss * weight).backward()
        t2 = time.time()
        optimizer.step()
        ends.append(time.time())
        if os.environ.get("DDP_DEBUG"):
            print(
                f"rank {rank} step {step} fwd {t1 - t0:.3f} bwd {t2 - t1:.3f} opt {ends[-1] - t2:.3f}",
                flush=True,
            )
        losses.append(float(loss))
    if rank == 0:
        args.out.write_text(json.dumps({"end_unix_time_s": ends, "losses": losses}))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    main()
