"""The simulator's input and output types (``engine.simulate`` states the rules it applies).

``SimSpec`` is small and neutral on purpose: ``spec.py`` builds it from a plan or a solver
layout, and an importer of external measurements can build it by hand. All times are in
seconds, sizes in bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from hplan.runtime.contract.link_model import BUCKET_CAP_BYTES
from hplan.runtime.contract.plan import TP_DEGREES, Schedule, SyncMode


# --------------------------------------------------------------------------- input
@dataclass(frozen=True, slots=True)
class SimChannel:
    """One direction of a link (alpha-beta)."""

    bandwidth_bytes_per_s: float
    """May be ``math.inf`` (transfers take only the latency)."""
    latency_s: float
    key: str = ""
    """Channels with the same non-empty key share one FIFO queue (e.g. a node's uplink);
    ``""``: this link direction has a queue of its own."""


@dataclass(frozen=True, slots=True)
class SimStage:
    """One pipeline stage: the rank that runs it and its compute times."""

    rank: int
    device: str
    """A label (device kind or name) for tables and traces."""
    forward_s: tuple[float, ...]
    """Forward time of each micro-batch of the replica, in order."""
    backward_s: tuple[float, ...]
    """Backward time of each micro-batch (recomputation included where it applies)."""
    optimizer_s: float
    tp_degree: int = 1
    """Size of the TP group that runs the stage (``RankPlan.tp_degree``); its members run
    in lockstep, so the stage lead stands for all of them."""
    tp_forward_s: tuple[float, ...] = ()
    """Seconds of the TP group's collectives in each micro-batch's forward, run after
    ``forward_s`` (``link_model.tp_layer_all_reduce_time_s`` per layer); ``()``: none, or
    already inside ``forward_s``."""
    tp_backward_s: tuple[float, ...] = ()
    """The same for each backward."""


@dataclass(frozen=True, slots=True)
class SimLink:
    """The boundary between stage s and s+1 of one replica."""

    forward: SimChannel
    """Carries activations from stage s to s+1."""
    backward: SimChannel
    """Carries gradients from stage s+1 back to s."""
    forward_bytes: tuple[float, ...]
    """Activation bytes of each micro-batch (0: nothing is sent, nothing is waited for)."""
    backward_bytes: tuple[float, ...]
    """Gradient bytes of each micro-batch (0: nothing is sent, nothing is waited for)."""


@dataclass(frozen=True, slots=True)
class SimReplica:
    """One data-parallel replica: a pipeline of stages and its micro-batches."""

    stages: tuple[SimStage, ...]
    links: tuple[SimLink, ...]
    """``links[s]`` joins stage s and s+1 (one fewer than stages)."""
    microbatch_sizes: tuple[int, ...]
    """Samples in each micro-batch (e.g. ``(3, 3, 2)``)."""


@dataclass(frozen=True, slots=True)
class SimSyncGroup:
    """Gradients that a set of ranks sums every step (one all-reduce)."""

    ranks: tuple[int, ...]
    """Sorted ranks of the group."""
    num_bytes: float
    bandwidth_bytes_per_s: float
    """The group's slowest link."""
    latency_s: float
    """The group's largest link latency."""


@dataclass(frozen=True, slots=True)
class SimOuterSync:
    """Pseudo-gradients that a holder set spanning islands averages once per round of
    ``local_steps`` inner steps (one ring all-reduce)."""

    ranks: tuple[int, ...]
    """Sorted ranks of the holder set."""
    num_bytes: float
    """Bytes of one outer sync, in the wire dtype."""
    bandwidth_bytes_per_s: float
    latency_s: float
    mode: SyncMode = SyncMode.LOCAL_SGD
    """``local_sgd`` or ``async``."""
    local_steps: int = 1
    """H: inner steps per outer sync."""
    num_fragments: int = 1
    """F: fragments synced in turn."""
    overlap_steps: int = 0
    """tau: inner steps a fragment's sync travels behind (0: the islands wait for it)."""
    transfer_s: float | None = None
    """Seconds T of one outer sync (``sync_cost.outer_transfer_time_s``); None: a ring
    all-reduce of ``num_bytes`` over the channel."""
    codec_s: float = 0.0
    """Of ``transfer_s``, the host's encode and decode (``sync_cost.outer_codec_time_s``):
    exposed even when the sync overlaps."""
    largest_share: float = 0.0
    """The set's largest indivisible piece (a parameter, or a unit) as a share of its bytes:
    its fragment is no smaller (``sync_cost.fragment_shares``); 0: fragments cut evenly."""


@dataclass(frozen=True, slots=True)
class SimSpec:
    """Everything the simulator needs about one training step."""

    replicas: tuple[SimReplica, ...]
    sync_groups: tuple[SimSyncGroup, ...] = ()
    schedule: Schedule = Schedule.ONE_F_ONE_B
    notes: tuple[str, ...] = ()
    """Caveats of the builder (e.g. a plan without gradient sizes), passed to the result."""
    bucket_cap_bytes: float | None = BUCKET_CAP_BYTES
    """Most bytes per gradient bucket of a runtime that sums gradients in buckets launched
    during the last backward pass (hplan's, torch DDP's); None: every group is summed in one
    blocking all-reduce after the schedule (e.g. DeepSpeed's pipeline engine)."""
    blocking_p2p: bool = False
    """False (hplan's runtime): a send is posted and the rank goes on (``isend``). True
    (runtimes with blocking ``send``/``recv``, e.g. DeepSpeed's pipeline engine): a transfer
    costs both ends its wire time; the sender is blocked until its message has left the wire,
    and a receive takes at least the wire time from when it is posted."""
    outer_syncs: tuple[SimOuterSync, ...] = ()
    """Holder sets spanning islands under local sync (``sync_groups`` then hold only what
    sums every step, inside the islands)."""

    def verify(self) -> None:
        """Check the spec's shapes and values.

        Raises:
            ValueError: naming the replica, stage or group and the bad field.
        """
        _verify_spec(self)


# --------------------------------------------------------------------------- output
class EventKind(StrEnum):
    """What a span of the timeline is."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    TRANSFER = "transfer"
    """A point-to-point message on the wire (``rank`` is the sender, ``peer`` the receiver)."""
    ALLREDUCE = "all-reduce"
    TP_COLLECTIVE = "tp all-reduce"
    """A TP group's collectives of one forward or backward pass (``SimStage.tp_forward_s``)."""
    OUTER_SYNC = "outer sync"
    """What the outer syncs leave exposed per inner step (local SGD, async): the ranks
    wait for it."""
    OUTER_SYNC_HIDDEN = "outer sync behind compute"
    """Outer sync traffic per inner step that travels beside the compute (overlapped local
    SGD, async): on the timeline, not waited for, not counted in a rank's time."""
    WAIT = "wait"
    """A rank blocked in a receive, or until its sends are complete."""


COMPUTE_KINDS = frozenset({EventKind.FORWARD, EventKind.BACKWARD, EventKind.OPTIMIZER})


@dataclass(frozen=True, slots=True)
class SimEvent:
    """One span of the simulated timeline (seconds from the step's start)."""

    kind: EventKind
    rank: int
    replica: int
    stage: int
    start_s: float
    end_s: float
    label: str
    """``s1.F.mb3``, ``F.mb3 s0->s1``, ``wait F.mb3 from s0``, ``all-reduce ranks 0,2`` ..."""
    microbatch: int | None = None
    peer: int | None = None
    """The receiving rank of a transfer."""
    cause: int | None = None
    """Index (in ``SimulationResult.events``) of the event whose end fixed this start."""


@dataclass(frozen=True, slots=True)
class RankTimes:
    """How one rank spent the step; ``compute_s + communication_s + idle_s`` = step time."""

    rank: int
    replica: int
    stage: int
    device: str
    compute_s: float
    communication_s: float
    idle_s: float
    end_s: float
    """When this rank finished its optimizer step."""


@dataclass(frozen=True)
class SimulationResult:
    """The simulated step."""

    step_time_s: float
    samples_per_s: float
    ranks: tuple[RankTimes, ...]
    """In rank order."""
    bubble_fraction: float
    """Idle share of all ranks' time: sum of idle / (ranks x step time)."""
    bottleneck_rank: int
    """The rank with the most compute time on the critical path."""
    critical_path: tuple[SimEvent, ...]
    """From the step's start to its end."""
    events: tuple[SimEvent, ...]
    notes: tuple[str, ...] = ()


# --------------------------------------------------------------------------- validation
def _verify_spec(spec: SimSpec) -> None:
    if not spec.replicas:
        raise ValueError("SimSpec has no replicas")
    seen: set[int] = set()
    for r_idx, replica in enumerate(spec.replicas):
        _verify_replica(r_idx, replica, seen)
    if len({g.ranks for g in spec.sync_groups}) != len(spec.sync_groups):
        raise ValueError("sync groups must have distinct rank sets (one group per holder set)")
    if spec.bucket_cap_bytes is not None and not spec.bucket_cap_bytes > 0:
        raise ValueError(f"bucket_cap_bytes must be > 0 or None, got {spec.bucket_cap_bytes}")
    groups: list[SimSyncGroup | SimOuterSync] = [*spec.sync_groups, *spec.outer_syncs]
    for group in groups:
        if list(group.ranks) != sorted(set(group.ranks)) or not set(group.ranks) <= seen:
            raise ValueError(f"sync group {group.ranks}: ranks must be sorted, unique and known")
        if not (group.bandwidth_bytes_per_s > 0 and group.latency_s >= 0 and group.num_bytes >= 0):
            raise ValueError(f"sync group {group.ranks}: bandwidth > 0, latency and bytes >= 0")
    for outer in spec.outer_syncs:
        if outer.local_steps < 1 or outer.mode is SyncMode.ALL_REDUCE:
            raise ValueError(
                f"outer sync {outer.ranks}: needs local_sgd or async and H >= 1, got "
                f"{outer.mode} H={outer.local_steps}"
            )


def _tp_times(stage: SimStage) -> tuple[float, ...]:
    return (*stage.tp_forward_s, *stage.tp_backward_s)


def _verify_tp(where: str, stage: SimStage, num_mb: int) -> None:
    if stage.tp_degree not in TP_DEGREES:
        raise ValueError(f"{where}: tp_degree {stage.tp_degree} is not one of {TP_DEGREES}")
    for name, times in (
        ("tp_forward_s", stage.tp_forward_s),
        ("tp_backward_s", stage.tp_backward_s),
    ):
        if times and len(times) != num_mb:
            raise ValueError(f"{where}: {name} needs one time per micro-batch or none")
        if any(times) and stage.tp_degree < 2:
            raise ValueError(f"{where}: {name} given for a stage of tp_degree 1")


def _verify_replica(r_idx: int, replica: SimReplica, seen: set[int]) -> None:
    num_mb = len(replica.microbatch_sizes)
    if not replica.stages or num_mb < 1 or min(replica.microbatch_sizes) < 1:
        raise ValueError(f"replica {r_idx}: needs stages and micro-batches of >= 1 sample")
    if len(replica.links) != len(replica.stages) - 1:
        raise ValueError(f"replica {r_idx}: {len(replica.links)} links for {len(replica.stages)}")
    for s_idx, stage in enumerate(replica.stages):
        where = f"replica {r_idx} stage {s_idx}"
        if stage.rank in seen:
            raise ValueError(f"{where}: rank {stage.rank} appears twice")
        seen.add(stage.rank)
        times = (*stage.forward_s, *stage.backward_s, stage.optimizer_s)
        if len(stage.forward_s) != num_mb or len(stage.backward_s) != num_mb:
            raise ValueError(f"{where}: needs one forward and backward time per micro-batch")
        if not all(math.isfinite(t) and t >= 0 for t in (*times, *_tp_times(stage))):
            raise ValueError(f"{where}: times must be finite and >= 0")
        _verify_tp(where, stage, num_mb)
    for l_idx, link in enumerate(replica.links):
        where = f"replica {r_idx} link {l_idx}"
        if len(link.forward_bytes) != num_mb or len(link.backward_bytes) != num_mb:
            raise ValueError(f"{where}: needs forward and backward bytes per micro-batch")
        for channel in (link.forward, link.backward):
            if not (channel.bandwidth_bytes_per_s > 0 and channel.latency_s >= 0):
                raise ValueError(f"{where}: bandwidth must be > 0 and latency >= 0")
