"""The solver's output: which devices form which pipelines, and who holds which units.

Pure data with indices into a ``PlanningProblem``; ``hplan.planner.emit.plan_build`` turns it into a
``Plan``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hplan.runtime.contract.plan import MemoryStrategy, PseudoGradientDtype, SyncMode


@dataclass(frozen=True, slots=True)
class StageLayout:
    """One pipeline stage: a device and the contiguous units ``[unit_start, unit_stop)``."""

    device_idx: int
    unit_start: int
    unit_stop: int
    recompute: bool = False
    """The stage keeps only its inputs and runs its forward again in each backward
    (``MemoryStrategy.RECOMPUTE``): one extra forward per micro-batch, at most one
    micro-batch's activations alive."""
    recompute_units: tuple[int, ...] = ()
    """Selective recomputation (``MemoryStrategy.SELECTIVE``): the units (indices into the
    problem, ascending, some but not all of the stage's) that keep only their input and run
    their forward again in the backward; empty: none (or all, with ``recompute``)."""

    @property
    def memory_strategy(self) -> MemoryStrategy:
        if self.recompute:
            return MemoryStrategy.RECOMPUTE
        return MemoryStrategy.SELECTIVE if self.recompute_units else MemoryStrategy.KEEP

    @property
    def recomputed_units(self) -> tuple[int, ...]:
        """Every unit whose forward runs twice: all of them under ``recompute``."""
        if self.recompute:
            return tuple(range(self.unit_start, self.unit_stop))
        return self.recompute_units


@dataclass(frozen=True, slots=True)
class ReplicaLayout:
    """One data-parallel replica: a pipeline of stages and its share of the global batch."""

    stages: tuple[StageLayout, ...]
    micro_batch_size: int
    num_microbatches: int
    num_samples: int

    @property
    def num_stages(self) -> int:
        return len(self.stages)


def replica_layout(
    stages: tuple[StageLayout, ...], micro_batch_size: int, num_samples: int
) -> ReplicaLayout:
    """The replica running ``num_samples`` in micro-batches of ``micro_batch_size``, cut to
    one micro-batch of its share when the share is smaller (never a micro-batch larger
    than the share: that is what the runtime would run, ``contract.plan.microbatch_sizes``)."""
    b = min(micro_batch_size, num_samples)
    return ReplicaLayout(stages, b, -(-num_samples // b), num_samples)


def even_size(num_samples: int, num_microbatches: int) -> int:
    """Samples per micro-batch when ``num_samples`` are cut into ``num_microbatches``
    nearly equal ones: ``ceil(n / k)`` (the last micro-batch takes the rest, at most
    ``k - 1`` short). Raises ``ValueError`` for a count outside ``1..num_samples``."""
    if not 1 <= num_microbatches <= num_samples:
        raise ValueError(
            f"num_microbatches {num_microbatches} must be between 1 and num_samples {num_samples}"
        )
    return -(-num_samples // num_microbatches)


def is_even_cut(num_samples: int, micro_batch_size: int) -> bool:
    """Whether micro-batches of ``micro_batch_size`` cut ``num_samples`` evenly: the size is
    :func:`even_size` of the count it gives (1,365 at 455: yes; at 512: no, the last is 341)."""
    if not 1 <= micro_batch_size <= num_samples:
        return False
    return even_size(num_samples, -(-num_samples // micro_batch_size)) == micro_batch_size


@dataclass(frozen=True, slots=True)
class GroupSync:
    """How one holder set spanning islands syncs (``contract.plan.OuterSyncSpec`` without
    its ranks)."""

    mode: SyncMode
    local_steps: int = 1
    """H: inner optimizer steps per outer sync (1 for ``all_reduce``)."""
    wire_dtype: PseudoGradientDtype = PseudoGradientDtype.FLOAT32
    num_fragments: int = 1
    """F: fragments synced in turn (Streaming DiLoCo's staggered schedule)."""
    overlap_steps: int = 0
    """tau: inner steps a fragment's sync travels behind before it is applied
    (``local_sgd`` only, at most H - 1; 0: the islands wait for it)."""

    def verify(self, where: str) -> None:
        """Raise ValueError naming ``where`` when the fields contradict each other."""
        if self.local_steps < 1 or (self.mode is SyncMode.ALL_REDUCE and self.local_steps != 1):
            raise ValueError(f"{where}: {self.mode} with {self.local_steps} local steps")
        if not 1 <= self.num_fragments <= self.local_steps:
            raise ValueError(
                f"{where}: {self.num_fragments} fragments for {self.local_steps} local steps"
            )
        if self.overlap_steps and (
            self.mode is not SyncMode.LOCAL_SGD or self.overlap_steps >= self.local_steps
        ):
            raise ValueError(
                f"{where}: overlap {self.overlap_steps} under {self.mode} H={self.local_steps}"
            )


@dataclass(frozen=True, slots=True)
class IslandSync:
    """Islands of nodes and how the holder sets that span them sync (``SyncSpec``).

    Each holder set spanning two or more islands syncs by its own entry in ``groups``
    (keyed by its sorted device indices: its link decides), or by the defaults (``mode``,
    ``local_steps``, ...) when it has none. Under ``local_sgd`` and ``async`` the sets share
    each device's links (the cost is ``cost.sync_cost``'s).
    """

    islands: tuple[tuple[str, ...], ...]
    """Node names of each island, in cluster order; every node of the problem once."""
    mode: SyncMode
    local_steps: int = 1
    """H: inner optimizer steps per outer sync (1 for ``all_reduce``)."""
    wire_dtype: PseudoGradientDtype = PseudoGradientDtype.FLOAT32
    num_fragments: int = 1
    overlap_steps: int = 0
    groups: tuple[tuple[tuple[int, ...], GroupSync], ...] = ()
    """(sorted device indices of a spanning holder set, its sync), sorted by devices; a set
    not listed syncs by the defaults above (:meth:`of`)."""

    @property
    def local(self) -> bool:
        """Whether the spanning holder sets skip the every-step all-reduce."""
        return self.mode is not SyncMode.ALL_REDUCE

    @property
    def default(self) -> GroupSync:
        """The sync of a spanning holder set without its own entry."""
        return GroupSync(
            mode=self.mode,
            local_steps=self.local_steps,
            wire_dtype=self.wire_dtype,
            num_fragments=self.num_fragments,
            overlap_steps=self.overlap_steps,
        )

    def of(self, devices: tuple[int, ...]) -> GroupSync:
        """The sync of the spanning holder set of sorted ``devices``."""
        return dict(self.groups).get(devices, self.default)

    def with_groups(self, groups: dict[tuple[int, ...], GroupSync]) -> IslandSync:
        """This sync with ``groups`` as the per-set entries (sorted by devices)."""
        return replace(self, groups=tuple(sorted(groups.items())))


@dataclass(frozen=True, slots=True)
class Layout:
    """A whole layout: every replica. Devices not named in any stage stay idle."""

    replicas: tuple[ReplicaLayout, ...]
    sync: IslandSync | None = None
    """Islands and their sync; None: one island, every holder set all-reduces every step."""
    optimizer_shard_weights: tuple[float, ...] = ()
    """ZeRO stage 1 or 2: each device's relative share of the optimizer state (and under
    stage 2 of the summed gradients) of the units it shares, one weight per device of the
    problem (``cost.zero``); empty: no sharding."""
    zero_stage: int = 1
    """With ``optimizer_shard_weights``: 1 (optimizer state) or 2 (and the summed gradients,
    ``cost.zero.gradient_saving_bytes``); ignored without them."""
    optimizer_offload: tuple[bool, ...] = ()
    """Per device of the problem: whether it keeps its optimizer state in host memory and
    steps there (``cost.offload``); empty: none does."""

    @property
    def device_indices(self) -> tuple[int, ...]:
        return tuple(s.device_idx for r in self.replicas for s in r.stages)

    def verify(self) -> None:
        """Check the layout's own consistency; raise ValueError naming the first problem.

        At least one replica; every replica's stages hold contiguous, non-empty unit ranges
        from unit 0 to the same last unit; its micro-batches hold its samples; no device in
        two stages. (What needs the problem, memory and candidates, is
        ``solve.validate.layout_problems``'s.)
        """
        if not self.replicas:
            raise ValueError("a layout needs at least one replica")
        stops = {r.stages[-1].unit_stop if r.stages else 0 for r in self.replicas}
        if len(stops) != 1:
            raise ValueError(f"replicas end at different units {sorted(stops)}")
        for index, replica in enumerate(self.replicas):
            start = 0
            for stage in replica.stages:
                if stage.unit_start != start or stage.unit_stop <= stage.unit_start:
                    raise ValueError(f"replica {index}: stage units are not contiguous from 0")
                start = stage.unit_stop
            b, m = replica.micro_batch_size, replica.num_microbatches
            if not replica.stages or b < 1 or not (m - 1) * b < replica.num_samples <= m * b:
                raise ValueError(
                    f"replica {index}: {replica.num_samples} samples in {m} x {b} micro-batches"
                )
        if len(set(self.device_indices)) != len(self.device_indices):
            raise ValueError("a device holds two stages")
        if self.sync is not None:
            _verify_sync(self.sync)


def _verify_sync(sync: IslandSync) -> None:
    nodes = [n for island in sync.islands for n in island]
    if len(sync.islands) < 2 or not all(sync.islands) or len(set(nodes)) != len(nodes):
        raise ValueError(f"islands {sync.islands} must be two or more disjoint node sets")
    sync.default.verify("islands")
    for devices, group in sync.groups:
        group.verify(f"holder set {list(devices)}")
        if sync.local and group.mode is SyncMode.ALL_REDUCE:
            raise ValueError(f"holder set {list(devices)}: all_reduce under local sync")
