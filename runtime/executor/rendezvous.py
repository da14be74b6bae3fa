"""Joining a plan's job: which rank this process is, whether this machine can run it, and
the rendezvous of all ranks, through torch's ``env://`` rendezvous.

Under torchrun (the launch scripts) the ranks meet in torchrun's own store, at
``MASTER_ADDR:MASTER_PORT`` (the plan's master host and port): no second port is opened.
torchrun numbers the ranks node by node in node-rank order, as the plan does, and
:func:`check_torchrun_rank` checks that the rank and local rank it gave this process are
the ones the plan runs here. Without torchrun (``--rank R``, a rehearsal's local ranks)
rank 0 hosts the store at the plan's master host and port (``MASTER_ADDR`` /
``MASTER_PORT`` or ``--master-port`` override them); the other ranks first wait, quietly,
for its port to accept connections: torch's store client logs a C++ stack trace for every
attempt that times out.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hplan.runtime.contract.errors import (
    ConfigError,
    EnvironmentProblemError,
    PeerFailureError,
    error_reason,
)
from hplan.runtime.contract.plan import CPU_KIND, Plan, RankPlan
from hplan.runtime.executor.machine import Binding, bind_interface, is_loopback, resolve

_CONNECT_TIMEOUT_S = 2.0
_CONNECT_RETRY_S = 0.2
_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""Set to ``True`` by torchrun for its workers: ``env://`` then uses torchrun's store."""


def under_torchrun() -> bool:
    """True when torchrun started this process (its workers rendezvous in its store)."""
    return os.environ.get(_AGENT_STORE_ENV, "").strip().lower() in ("1", "true")


def check_torchrun_rank(plan: Plan, rank: int) -> None:
    """Check that torchrun's ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` are the plan's.

    torchrun numbers the ranks node by node, in the order of ``--node-rank``, as the plan
    numbers them; a node started with another node's script or node rank, or another
    ``--nproc-per-node``, gets other numbers, and its ranks would exchange the wrong
    tensors with the wrong peers.

    Raises:
        ConfigError: naming the numbers torchrun gave and those the plan has.
    """
    rank_plan = plan.ranks[rank]
    given = {
        name: os.environ.get(name, "").strip() for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    }
    expected = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank_plan.local_rank),
        "WORLD_SIZE": str(plan.world_size),
    }
    wrong = [name for name in expected if given[name] != expected[name]]
    if not wrong:
        return
    said = ", ".join(f"{name}={given[name] or 'unset'}" for name in wrong)
    want = ", ".join(f"{name}={expected[name]}" for name in wrong)
    raise ConfigError(
        f"torchrun gave this process {said}, but the plan runs node {rank_plan.node!r} local "
        f"rank {rank_plan.local_rank} as {want}; start every node with its own launch script "
        "(launch/node-<node>.sh sets the node rank and process count the plan needs)"
    )


def join_process_group(
    *, backend: str, rank: int, world_size: int, host: str, port: int, timeout_s: float,
    job: str = "job", binding: Binding | None = None,
) -> None:  # fmt: skip
    """``dist.init_process_group`` through ``env://`` at ``host:port``.

    Under torchrun, its store (``MASTER_ADDR``/``MASTER_PORT``, which the caller passes);
    otherwise rank 0 hosts the store and the other ranks wait quietly for its port first.

    Args:
        binding: the interface this rank's backend was pointed at (named on failure).

    Raises:
        PeerFailureError: the other ranks did not join within ``timeout_s``; names ``job``,
            the address and port tried and the interface bound.
    """
    os.environ["MASTER_ADDR"] = host
    os.environ["MASTER_PORT"] = str(port)
    try:
        if rank != 0 and not under_torchrun():
            _wait_for_port(host, port, timeout_s)
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except (RuntimeError, TimeoutError, ValueError) as exc:
        raise PeerFailureError(
            join_failure(rank, world_size, job, host, port, binding, exc)
        ) from None


def join_failure(
    rank: int,
    world_size: int,
    job: str,
    host: str,
    port: int,
    binding: Binding | None,
    exc: BaseException,
) -> str:
    """The one line of a rank that could not join: what it tried, what it bound, why, and
    what to check (the address and interface too when either is a loopback one)."""
    bound = f", over {binding.describe()}" if binding is not None else ""
    resolved = resolve(host)
    at = host if resolved in (None, host) else f"{host} ({resolved})"
    hint = "check that every node started and that the port is reachable"
    if (resolved is not None and is_loopback(resolved)) or (
        binding is not None and binding.loopback
    ):
        hint += (
            "; a loopback address or interface reaches this machine only: on several "
            "machines give every node its network address (cluster.yaml `host:`) or its "
            "interface (`interface:`, or GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)"
        )
    return (
        f"rank {rank} could not join the {world_size}-rank {job}: it tried {at}:{port}{bound}: "
        f"{error_reason(exc)}; {hint}"
    )


def rendezvous_address(plan: Plan, *, host: str | None, port: int | None) -> tuple[str, int]:
    """Where the ranks meet: torchrun's store under torchrun; else ``host``/``port`` if given,
    else ``MASTER_ADDR``/``MASTER_PORT`` if set, else the plan's master host and port."""
    training = plan.training
    if under_torchrun():
        return os.environ.get("MASTER_ADDR", training.master_host), int(
            os.environ.get("MASTER_PORT", training.master_port)
        )
    env_port = os.environ.get("MASTER_PORT", "").strip()
    return (
        host or os.environ.get("MASTER_ADDR") or training.master_host,
        port if port is not None else int(env_port) if env_port.isdigit() else training.master_port,
    )


def join_job(plan: Plan, rank: int, *, host: str, port: int, backend: str) -> None:
    """Join the plan's process group at ``host:port`` (see :func:`join_process_group`).

    Points the backend at this node's network interface first (``machine.bind_interface``).
    Prints one line while waiting when there are peers; under torchrun, first checks the
    ranks it gave (:func:`check_torchrun_rank`).

    Raises:
        ConfigError: torchrun's ranks are not the plan's; the plan names an interface this
            machine lacks.
        PeerFailureError: the other ranks did not join within the plan's timeout.
    """
    if under_torchrun():
        check_torchrun_rank(plan, rank)
    binding = bind_interface(plan.node(plan.ranks[rank].node), backend)
    timeout_s = plan.training.process_group_timeout_s
    if plan.world_size > 1:
        peers = plan.world_size - 1
        via = f" via {binding.interface}" if binding.interface is not None else ""
        print(
            f"hplan: rank {rank} waiting for {peers} peer{'s' if peers > 1 else ''} at "
            f"{host}:{port}{via} (timeout {timeout_s:g} s)",
            file=sys.stderr,
            flush=True,
        )
    join_process_group(
        backend=backend, rank=rank, world_size=plan.world_size, host=host, port=port,
        timeout_s=timeout_s, binding=binding,
    )  # fmt: skip


def join_elastic(plan: Plan, rank: int, store: dist.Store, backend: str) -> tuple[str, int]:
    """Join the plan's process group in an elastic round's store (``elastic/start.py``), as
    ``rank`` of the plan (not torchrun's number); return the store's address.

    Raises:
        ConfigError: the plan names an interface this machine lacks.
        PeerFailureError: the other ranks did not join within the plan's timeout.
    """
    binding = bind_interface(plan.node(plan.ranks[rank].node), backend)
    timeout_s = plan.training.process_group_timeout_s
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore("hplan/pg/", store),
            rank=rank,
            world_size=plan.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except (RuntimeError, TimeoutError, ValueError) as exc:
        raise PeerFailureError(
            join_failure(rank, plan.world_size, "elastic round", host, port, binding, exc)
        ) from None
    return host, port


def barrier(rank: int, what: str) -> None:
    """A barrier of the whole job.

    Raises:
        PeerFailureError: a peer failed before it (names ``what``).
    """
    try:
        dist.barrier()
    except RuntimeError as exc:
        raise PeerFailureError(
            f"rank {rank}: a peer failed before the {what}: {error_reason(exc)}; check the other "
            "ranks' logs (one probably failed first)"
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
    if spec.kind == CPU_KIND:
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

    The launch scripts start one torchrun per node and every process finds itself by node
    name and local rank; under torchrun, :func:`check_torchrun_rank` then checks that
    torchrun's own ``RANK`` agrees.

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
