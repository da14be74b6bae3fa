"""One replica of a torchft data-parallel job: ``bench/elastic.py``'s reference row.

Run by a Python that has torchft (installed apart from hplan's environment: this file
imports no hplan), one process per replica group, each in its own namespace, with torchft's
lighthouse on the first node. It trains the model file's model on ``--batch`` samples of its
own per step (``sample_batch``), gradients averaged over the replicas in the step's quorum
(one ``Manager.allreduce`` of the flattened gradients, over gloo: torchft 0.2.0's
``DistributedDataParallel`` fails under torch 2.13, its comm hook's future has no ``_fut``),
and appends one JSON line per step to
``--out``: the step's end (Unix s), torchft's step counter, the replicas that took part, the
loss. A replica that starts late heals from a live one (torchft's checkpoint transport).

    python bench/torchft_worker.py MODEL --replica 0 --host IP --lighthouse http://IP:PORT
        --steps N --batch B --out FILE
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import TCPStore
from torchft import Manager, Optimizer, ProcessGroupGloo

TIMEOUT_S = 10.0
"""torchft's collective and commit timeout: how long a step waits for a lost replica."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--host", required=True, help="this replica's address")
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--store-port", type=int, default=29741)
    parser.add_argument("--manager-port", type=int, default=29742)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    # The namespaces share this machine's hostname; torchft gives peers its checkpoint server
    # as http://<hostname>:port, which would name the machine's own address: a node's
    # hostname names its own address, as on a cluster of machines.
    socket.gethostname = lambda: args.host  # type: ignore[assignment]
    spec = importlib.util.spec_from_file_location("hplan_model", args.model)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.build_model()
    inner = (
        module.make_optimizer(model.parameters())
        if hasattr(module, "make_optimizer")
        else torch.optim.AdamW(model.parameters())
    )

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, object]) -> None:
        model.load_state_dict(state["model"])  # type: ignore[arg-type]
        inner.load_state_dict(state["optim"])  # type: ignore[arg-type]

    _store = TCPStore(args.host, args.store_port, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=TIMEOUT_S)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        rank=0,
        world_size=1,
        store_addr=args.host,
        store_port=args.store_port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"replica-{args.replica}",
        port=args.manager_port,
        hostname=args.host,
    )
    optimizer = Optimizer(manager, inner)
    torch.manual_seed(1000 + args.replica)
    with args.out.open("a", encoding="utf-8") as out:
        while manager.current_step() < args.steps:
            inputs, targets = module.sample_batch(args.batch)
            optimizer.zero_grad()
            loss = module.loss_fn(model(inputs), targets)
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            manager.allreduce(flat).wait()
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
            optimizer.step()
            line = {
                "end_unix_s": time.time(),
                "step": manager.current_step(),
                "participants": manager.num_participants(),
                "loss": float(loss.item()),
            }
            out.write(json.dumps(line) + "\n")
            out.flush()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
