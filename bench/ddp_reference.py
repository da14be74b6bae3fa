"""torch DDP on an hplan model file: the reference that hplan's runtime is measured against.

Run under torchrun, one process per rank (``bench/real_cluster.py`` starts it in each
network namespace)::

    torchrun ... bench/ddp_reference.py MODEL --batch-sizes 64,32,32 --steps 30 --out T.json

Rank ``r`` trains on ``batch_sizes[r]`` samples per step: equal sizes are plain DDP; unequal
ones are the hand split of a user who knows the nodes' speeds. Each rank's mean loss is
weighted by ``batch_sizes[r] * world / global_batch`` so that DDP's gradient average is the
gradient of the global batch's mean loss, as in hplan. Data: the model file's ``dataset()``
in hplan's order (``runtime/executor/data.py``: the global batch of step ``t`` under
``--seed``, each rank its own slice of it in rank order, default-collated), so that DDP and
hplan with the same seed and split see the same samples; without one, ``sample_batch``.
The optimizer is the model file's (default AdamW, lr 1e-3), as hplan's.
Rank 0 writes ``{"end_unix_time_s": [...], "losses": [...], "forward_backward_optimizer_s":
[...]}``: the wall-clock end of every step (after ``optimizer.step()``), its loss and its
three parts (the backward includes DDP's all-reduce) and ``"cpu_s"``, the process's CPU
seconds per step (``time.process_time``, data loading included) and
``"forward_backward_optimizer_cpu_s"``, those of the three parts; with ``HPLAN_DDP_PARTS=1`` every rank
writes its own ``OUT.rank<r>.json`` too.

``--solo`` (no torchrun, one process per node, all nodes at once): each process trains the
model alone on ``--batch-sizes``' one size, without a process group, and writes its own
step ends: what each node computes while the others compute too, the speeds a user would
split DDP's batch by.
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
from hplan.runtime.executor.data import global_batch_indices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--batch-sizes", required=True, help="per-rank samples, comma separated")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--solo", action="store_true", help="train alone, no process group")
    args = parser.parse_args()
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    if args.solo:
        rank, world = 0, 1
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        rank, world = dist.get_rank(), dist.get_world_size()
    assert len(sizes) == world, f"{len(sizes)} batch sizes for {world} ranks"
    global_batch = sum(sizes)
    model_file = load_model_file(args.model)
    torch.manual_seed(args.seed)
    model = model_file.build_model()
    if not args.solo:
        model = DistributedDataParallel(model)
    optimizer = model_file.optimizer(list(model.parameters()))
    dataset = model_file.dataset() if model_file.dataset is not None else None
    weight = sizes[rank] * world / global_batch
    first = sum(sizes[:rank])
    ends, losses, parts, cpu_s, cpu_parts = [], [], [], [], []
    last_cpu_s = time.process_time()
    for step in range(args.steps):
        if dataset is not None:
            order = global_batch_indices(args.seed, step, len(dataset), global_batch)
            mine = order[first : first + sizes[rank]]
            inputs, targets = default_collate([dataset[int(i)] for i in mine])
        else:
            inputs, targets = model_file.sample_batch(sizes[rank])
        start_s, start_cpu_s = time.time(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        loss = model_file.loss_fn(model(inputs), targets)
        forward_s, forward_cpu_s = time.time(), time.process_time()
        (loss * weight).backward()
        backward_s, backward_cpu_s = time.time(), time.process_time()
        optimizer.step()
        ends.append(time.time())
        parts.append((forward_s - start_s, backward_s - forward_s, ends[-1] - backward_s))
        cpu_parts.append(
            (
                forward_cpu_s - start_cpu_s,
                backward_cpu_s - forward_cpu_s,
                time.process_time() - backward_cpu_s,
            )
        )
        losses.append(float(loss.detach()))
        cpu_s.append(time.process_time() - last_cpu_s)
        last_cpu_s += cpu_s[-1]
    record = {
        "end_unix_time_s": ends,
        "losses": losses,
        "forward_backward_optimizer_s": parts,
        "cpu_s": cpu_s,
        "forward_backward_optimizer_cpu_s": cpu_parts,
    }
    if rank == 0:
        args.out.write_text(json.dumps(record))
    if os.environ.get("HPLAN_DDP_PARTS"):  # every rank: where its step went
        args.out.with_suffix(f".rank{rank}.json").write_text(json.dumps(record))
    if not args.solo:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    main()
