"""Joining a plan's job: which rank this process is, whether this machine can run it, and
the rendezvous of all ranks.

The ranks rendezvous through a TCP store that rank 0 hosts at ``<master_host>:<port>``
(the caller passes ``master_port + 1``: torchrun's own rendezvous store listens on
``master_port``). The store is made here rather than by ``init_method="tcp://..."``:
under torchrun that would look for torchrun's agent store instead
(``TORCHELASTIC_USE_AGENT_STORE``) and every rank would wait for a server that never
starts. Ranks other than 0 first wait, quietly, for the store's port to accept
connections: torch's store client logs a C++ stack trace for every attempt that times out.
"""

from __future__ import annotations

import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hplan.runtime.contract.errors import ConfigError, EnvironmentProblemError, PeerFailureError
from hplan.runtime.contract.plan import Plan, RankPlan
from hplan.runtime.executor.comm import error_reason

_CONNECT_TIMEOUT_S = 2.0
_CONNECT_RETRY_S = 0.2


def join_job(plan: Plan, rank: int, *, host: str, port: int, backend: str) -> None:
    """Join the plan's process group through the TCP store at ``host:port``.

    Rank 0 hosts the store, the others connect to it, everyone within the plan's
    ``process_group_timeout_s``. Prints one line while waiting when there are peers.

    Raises:
        PeerFailureError: the other ranks did not join within the timeout.
    """
    timeout_s = plan.training.process_group_timeout_s
    if plan.world_size > 1:
        peers = plan.world_size - 1
        print(
            f"hplan: rank {rank} waiting for {peers} peer{'s' if peers > 1 else ''} at "
            f"{host}:{port} (timeout {timeout_s:g} s)",
            file=sys.stderr,
            flush=True,
        )
    timeout = timedelta(seconds=timeout_s)
    try:
        if rank != 0:
            _wait_for_port(host, port, timeout_s)
        store = dist.TCPStore(
            host, port, plan.world_size, is_master=rank == 0, timeout=timeout,
            wait_for_workers=False,
        )  # fmt: skip
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=plan.world_size, timeout=timeout
        )
    except (RuntimeError, TimeoutError) as exc:
        raise PeerFailureError(
            f"rank {rank} could not join the {plan.world_size}-rank job at {host}:{port}: "
            f"{error_reason(exc)}; check that every node started and that the port is reachable"
        ) from None


def _wait_for_port(host: str, port: int, timeout_s: float) -> None:
    """Wait until ``host:port`` accepts a TCP connection (rank 0's store is up).

    Raises:
        TimeoutError: nothing accepted a connection within ``timeout_s``.
    """
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S):
                return
        except OSError as exc:
            if time.monotonic() >= deadline_s:
                raise TimeoutError(
                    f"nothing answered at {host}:{port} within {timeout_s:g} s ({exc})"
                ) from None
        time.sleep(_CONNECT_RETRY_S)


def check_machine(plan: Plan, rank: int, *, backend: str, device: str | None) -> None:
    """Check, before joining the job, that this machine can run ``rank`` of the plan.

    Args:
        backend: the backend the rank will use (``nccl`` or ``gloo``).
        device: a device that overrides the plan's (rehearsal: ``cpu``), or None.

    Raises:
        EnvironmentProblemError: the plan needs NCCL or a GPU that this machine lacks.
    """
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise EnvironmentProblemError(
            f"the plan runs on NCCL (GPUs), but torch here has "
            f"{'no CUDA device' if not torch.cuda.is_available() else 'no NCCL'}; run it on "
            "the plan's GPU nodes, or run `hplan rehearse` to try it on CPU"
        )
    rank_device(plan, plan.ranks[rank], device)


def rank_device(plan: Plan, rank_plan: RankPlan, override: str | None) -> torch.device:
    """``cuda:<local_index>`` for GPU kinds, ``cpu`` for kind ``cpu`` (or ``override``).

    Raises:
        EnvironmentProblemError: the plan wants a GPU that this machine does not have.
    """
    if override is not None:
        return torch.device(override)
    spec = plan.device(rank_plan.device)
    if spec.kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available() or spec.local_index >= torch.cuda.device_count():
        raise EnvironmentProblemError(
            f"rank {rank_plan.rank} needs GPU {spec.local_index} ({spec.kind}) on node "
            f"{rank_plan.node}, but torch sees {torch.cuda.device_count()} GPUs; check "
            "CUDA_VISIBLE_DEVICES or run `hplan rehearse` to run on CPU"
        )
    torch.cuda.set_device(spec.local_index)
    return torch.device("cuda", spec.local_index)


def resolve_rank(plan: Plan, *, rank: int | None, node: str | None, local_rank: str | None) -> int:
    """The plan rank of this process: ``rank`` if given, else (``node``, ``LOCAL_RANK``).

    torchrun's own ``RANK`` ordering is never used: the launch scripts start one torchrun
    per node and every process finds itself by node name and local rank.

    Raises:
        ConfigError: no way to tell the rank, or no rank of the plan matches.
    """
    if rank is not None:
        if not 0 <= rank < plan.world_size:
            raise ConfigError(f"--rank {rank} is outside the plan's ranks 0..{plan.world_size - 1}")
        return rank
    if node is None:
        raise ConfigError(
            "pass --node NAME or set HPLAN_NODE=NAME (with LOCAL_RANK set, as torchrun does), "
            "or pass --rank R"
        )
    on_node = [r for r in plan.ranks if r.node == node]
    if not on_node:
        names = sorted({r.node for r in plan.ranks})
        raise ConfigError(f"--node {node!r} runs no rank of this plan; nodes with ranks: {names}")
    if local_rank is None and len(on_node) == 1:
        return on_node[0].rank
    if local_rank is None or not local_rank.strip().isdigit():
        raise ConfigError(
            f"node {node!r} runs {len(on_node)} ranks; set LOCAL_RANK (torchrun does) "
            f"to 0..{len(on_node) - 1}, got {local_rank!r}"
        )
    for rank_plan in on_node:
        if rank_plan.local_rank == int(local_rank):
            return rank_plan.rank
    raise ConfigError(
        f"LOCAL_RANK={local_rank} but node {node!r} runs local ranks 0..{len(on_node) - 1}; "
        f"start torchrun with --nproc-per-node {len(on_node)}"
    )
