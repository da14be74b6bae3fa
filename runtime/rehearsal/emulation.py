"""How a rehearsal makes this machine look like the plan's hardware: the executor's two
seams (``executor/seams.py``), implemented.

:class:`EmulatedClock` stretches every forward, backward and optimizer step (cpu plans: a
multiple of its CPU time; GPU plans: at least ``time_scale`` times the planner's prediction,
see :class:`ComputeEmulation`). :class:`EmulatedLinks` delays each transfer to its alpha-beta
time on a queued link (``contract/link_model.LinkQueue``) and each gradient bucket's all-reduce
to its ring time once every holder has launched it. The emulation reads the plan's report
(replaying the planner's model is what a rehearsal of a GPU plan does); the executor never does.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from torch import Tensor

from hplan.runtime.contract.link_model import LinkQueue, group_ring_time_s
from hplan.runtime.contract.metrics_file import EmulationRecord
from hplan.runtime.contract.plan import Backend, Plan, microbatch_sizes
from hplan.runtime.executor.rendezvous import barrier
from hplan.runtime.executor.seams import ComputeClock, ComputeSpan, LinkDelay, Phase, Seams
from hplan.runtime.executor.worker import boundaries
from hplan.runtime.rehearsal.warm_compute import ROUNDS, Sample, WarmTimer, WarmTimes

if TYPE_CHECKING:
    from pathlib import Path

    from hplan.runtime.executor.data import MicroBatch
    from hplan.runtime.executor.pipeline import StepRunner


@dataclass(frozen=True)
class Emulation:
    """How a rehearsal slows this machine down to look like the plan's hardware."""

    dilation: float
    """Global time-dilation factor (>= 1) so that all ranks' CPU demand fits the cores."""
    time_scale: float
    """Emulated seconds per second of plan hardware: links, all-reduce and, for GPU plans,
    compute (see ComputeEmulation)."""
    slowdown: Mapping[str, float] = field(default_factory=dict)
    """Straggler emulation: cluster device name -> factor its compute is slowed by
    (1.4 = 40% slower than the plan says), in both compute modes."""


def recorded_emulation(emulation: Emulation, metrics_dir: Path | None) -> Emulation:
    """``emulation`` with the slowdowns a rehearsal recorded in ``<metrics_dir>/emulation.json``
    (``contract/metrics_file.py``; unchanged without one).

    Raises:
        ConfigError: the file is not an emulation record.
    """
    record = EmulationRecord.load(metrics_dir)
    return emulation if record is None else replace(emulation, slowdown=dict(record.slowdown))


# --------------------------------------------------------------------------- speeds
def modelled_emulation(plan: Plan) -> bool:
    """True for GPU plans whose report predicts every rank's compute (see ComputeEmulation)."""
    ranks = plan.report.ranks
    return (
        plan.training.backend is Backend.NCCL
        and len(ranks) == len(plan.ranks)
        and all(r.forward_time_s > 0 and r.backward_time_s > 0 for r in ranks)
    )


def rank_speeds(plan: Plan) -> list[float]:
    """Speed of each rank's device on this model relative to the fastest (rank order).

    Plans whose compute is stretched (cpu devices, see ComputeEmulation): the ratio of the
    devices' declared peak FLOP/s, i.e. the hardware the cluster file describes. Not the
    report's ``relative_speed``: that is a standalone throughput, lower for a device whose
    memory only fits small micro-batches, and it includes calibrated factors (a straggler
    is emulated with ``slowdown``, not by replaying the planner's estimate of it).
    Modelled plans: the report's per-rank ``relative_speed`` when every rank has one;
    otherwise the peak FLOP/s ratio.
    """
    by_rank = {r.rank: r.relative_speed for r in plan.report.ranks}
    if (
        modelled_emulation(plan)
        and len(by_rank) == len(plan.ranks)
        and all(v > 0 for v in by_rank.values())
    ):
        return [by_rank[r.rank] / max(by_rank.values()) for r in plan.ranks]
    peaks = [plan.device(r.device).peak_flops for r in plan.ranks]
    return [peak / max(peaks) for peak in peaks]


def device_stretch(plan: Plan, rank: int) -> float:
    """How many times slower than the fastest device this rank's device runs (>= 1)."""
    return 1.0 / rank_speeds(plan)[rank]


# --------------------------------------------------------------------------- compute
@dataclass(frozen=True)
class ComputeEmulation:
    """How long a rank's compute blocks last under emulation.

    Two modes. *Stretch* (plans for cpu devices, gloo): in the first step each forward,
    backward and optimizer step lasts ``stretch`` x its measured CPU time; after it, the
    rank times its own stage back to back (``warm_compute.py``) and each block lasts
    ``stretch`` x that warm time of its phase and micro-batch size (a block after the
    emulation's sleeps runs colder than on a dedicated core). The emulated device is a
    CPU, so its real compute is the right model. *Modelled* (GPU plans, NCCL): each
    forward, backward and optimizer step lasts at least ``time_scale`` x the planner's
    prediction for this rank (``RankReport.forward_time_s`` ...; a smaller last micro-batch
    its own, ``RankReport.last_forward_time_s``, where the report has it). A CPU cannot show a GPU's
    behaviour (launch overhead amortised by larger micro-batches, tensor-core peaks), so
    the plan's hardware model is replayed and the runtime's schedule, transfers and
    synchronisation are measured on top of it.
    """

    stretch: float = 1.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    last_samples: int = 0
    """Modelled mode: the size of the rank's last micro-batch when it is smaller than the
    others and the report predicts it (0: none), which lasts at least the two below."""
    last_forward_s: float = 0.0
    last_backward_s: float = 0.0
    measure_warm: bool = False
    """Stretched mode: time the stage back to back after the first step."""
    warm: WarmTimes | None = None
    """Stretched mode, after the first step: the stage's warm CPU times."""


def compute_emulation(plan: Plan, rank: int, emulation: Emulation | None) -> ComputeEmulation:
    """This rank's compute emulation (none when not rehearsing)."""
    if emulation is None:
        return ComputeEmulation()
    slowdown = emulation.slowdown.get(plan.ranks[rank].device, 1.0)
    if not modelled_emulation(plan):
        stretch = emulation.dilation * device_stretch(plan, rank) * slowdown
        return ComputeEmulation(stretch=stretch, measure_warm=True)
    report = next(r for r in plan.report.ranks if r.rank == rank)
    scale = emulation.time_scale * slowdown
    rank_plan = plan.ranks[rank]
    last = microbatch_sizes(rank_plan.num_samples, rank_plan.micro_batch_size)[-1]
    smaller = last < rank_plan.micro_batch_size and report.last_forward_time_s > 0
    return ComputeEmulation(
        forward_s=scale * report.forward_time_s,
        backward_s=scale * report.backward_time_s,
        optimizer_s=scale * report.optimizer_time_s,
        last_samples=last if smaller else 0,
        last_forward_s=scale * report.last_forward_time_s if smaller else 0.0,
        last_backward_s=scale * report.last_backward_time_s if smaller else 0.0,
    )


class EmulatedClock(ComputeClock):
    """The compute clock of a rehearsal rank (``seams.ComputeClock``; see the module
    docstring).

    A block lasts at least ``floor_s`` (modelled emulation) and at least ``stretch`` x its
    *CPU time* (``time.thread_time``: torch runs on the calling thread with one intra-op
    thread), so that time lost to other processes on the machine is not stretched as well.
    """

    def __init__(self, compute: ComputeEmulation, rank: int, world_size: int) -> None:
        self.compute = compute
        self.rank = rank
        self.world_size = world_size
        self._spans: list[ComputeSpan] = []
        self._worked_s: list[float] = []
        """When the real work of each span in ``_spans`` ended (before the stretch)."""
        self._samples: dict[int, Sample] = {}
        """Stretched emulation, until timed: one micro-batch of each size (warm_compute)."""

    def forward(
        self,
        label: str,
        mb: MicroBatch,
        inputs: Mapping[str, Tensor],
        received: Mapping[str, Tensor],
    ) -> contextlib.AbstractContextManager[None]:
        self._keep_sample(mb, inputs, received)
        return super().forward(label, mb, inputs, received)

    def backward(
        self, label: str, mb: MicroBatch, grads: Mapping[str, Tensor]
    ) -> contextlib.AbstractContextManager[None]:
        sample = self._samples.get(mb.num_samples)
        if sample is not None and sample.microbatch is mb:
            sample.grads = {name: g.detach().clone() for name, g in grads.items()}
        return super().backward(label, mb, grads)

    def take_spans(self) -> list[ComputeSpan]:
        spans, self._spans, self._worked_s = self._spans, [], []
        return spans

    def timeline_s(self, monotonic_s: float) -> float:
        """A moment inside a block's real work, mapped onto the stretched block: 30% into
        the work is 30% into the block (a gradient bucket launched from a backward hook
        then starts where the emulated backward pass would have produced it)."""
        for span, worked_s in zip(reversed(self._spans), reversed(self._worked_s), strict=True):
            if span.start_s <= monotonic_s <= worked_s:
                fraction = (monotonic_s - span.start_s) / max(worked_s - span.start_s, 1e-12)
                return span.start_s + fraction * span.duration_s
        return monotonic_s

    def after_step(self, step: int, runner: StepRunner, *, more_steps: bool) -> None:
        """After the first step of a stretched emulation: time the stage warm, the ranks
        taking turns (every rank calls this; barriers between the turns); the ranks of a
        TP group take their lead's turn together (their stage's forward is collective)."""
        compute = self.compute
        if not compute.measure_warm or compute.warm is not None or not more_steps:
            return
        samples, self._samples = self._samples, {}
        timer = WarmTimer(
            runner.parts.stage,
            samples,
            lambda stage, sample, received: runner.replay_forward(
                stage, sample.microbatch, sample.inputs, received
            ),
            runner.backward_pairs,
            runner.parts.model_file.optimizer,
            recompute=runner.recompute,
            device=runner.parts.device,
        )
        barrier(self.rank, "warm compute timing")  # every rank idle before the first turn
        lead = runner.parts.plan.tp_group(self.rank)[0].rank  # a TP group times together
        for _ in range(ROUNDS):
            for turn in range(self.world_size):
                if turn == lead:
                    timer.time_round()
                barrier(self.rank, "warm compute timing")
        warm = timer.result()
        self.compute = replace(compute, warm=warm)
        print(f"rank {self.rank}: {warm.describe()}", file=sys.stderr, flush=True)

    def _keep_sample(
        self, mb: MicroBatch, inputs: Mapping[str, Tensor], received: Mapping[str, Tensor]
    ) -> None:
        """Keep the first micro-batch of each size while the warm compute is to be timed."""
        compute = self.compute
        if not compute.measure_warm or compute.warm is not None or mb.num_samples in self._samples:
            return
        kept = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in received.items()}
        self._samples[mb.num_samples] = Sample(dict(inputs), kept, mb)

    def _floor_and_stretch(self, phase: Phase, num_samples: int) -> tuple[float, float]:
        """(least seconds, CPU-time factor) of a block: the stage's warm time when timed."""
        compute, warm = self.compute, self.compute.warm
        last = num_samples == compute.last_samples
        floors = {
            Phase.FORWARD: compute.last_forward_s if last else compute.forward_s,
            Phase.BACKWARD: compute.last_backward_s if last else compute.backward_s,
            Phase.OPTIMIZER: compute.optimizer_s,
        }
        if warm is None:
            return floors[phase], compute.stretch
        if phase is Phase.OPTIMIZER:
            return compute.stretch * warm.optimizer_s, 0.0
        table = warm.forward_s if phase is Phase.FORWARD else warm.backward_s
        if num_samples in table:
            return compute.stretch * table[num_samples], 0.0
        return floors[phase], compute.stretch

    @contextlib.contextmanager
    def _block(self, phase: Phase, label: str, num_samples: int) -> Iterator[None]:
        floor_s, stretch = self._floor_and_stretch(phase, num_samples)
        start_s = time.monotonic()
        start_cpu_s = time.thread_time()
        failed = True
        try:
            yield
            failed = False
        finally:
            worked_s = time.monotonic()
            if not failed:
                cpu_s = time.thread_time() - start_cpu_s
                _sleep_until(start_s + max(floor_s, stretch * cpu_s))
            self._spans.append(ComputeSpan(phase, label, start_s, time.monotonic()))
            self._worked_s.append(worked_s)


def _sleep_until(deadline_s: float) -> None:
    remaining_s = deadline_s - time.monotonic()
    if remaining_s > 0:
        time.sleep(remaining_s)


# --------------------------------------------------------------------------- links
@dataclass
class EmulatedLink:
    """Alpha-beta model of one direction of a link, in emulated (scaled) seconds.

    ``ready_at = max(now, busy_until) + scale * bytes / bandwidth + scale * latency``:
    transfers on one link queue behind each other (``link_model.LinkQueue``).
    """

    latency_s: float
    bandwidth_bytes_per_s: float
    time_scale: float
    """Emulated seconds per real second of the plan's hardware."""
    queue: LinkQueue = field(default_factory=LinkQueue)

    def ready_time_s(self, now_s: float, nbytes: int) -> float:
        """Monotonic time at which ``nbytes`` sent at ``now_s`` may be used by the receiver."""
        sent = self.queue.send(
            now_s,
            nbytes,
            self.bandwidth_bytes_per_s / self.time_scale,
            self.latency_s * self.time_scale,
        )
        return sent.arrival_s


def _no_floor(ranks: Sequence[int], num_bytes: int) -> float:
    return 0.0


@dataclass
class EmulatedLinks(LinkDelay):
    """The link delay of a rehearsal rank (``seams.LinkDelay``): one :class:`EmulatedLink`
    per peer it sends to, and a floor under every all-reduce."""

    links: Mapping[int, EmulatedLink]
    """Peer rank -> the link this rank sends to it on."""
    floor_s: Callable[[Sequence[int], int], float] = _no_floor
    """(ranks, bytes) -> least seconds of their all-reduce."""

    def delays(self, peer_rank: int) -> bool:
        return peer_rank in self.links

    def ready_time_s(self, peer_rank: int, now_s: float, num_bytes: int) -> float:
        return self.links[peer_rank].ready_time_s(now_s, num_bytes)

    def hold_until(self, ready_s: float) -> None:
        _sleep_until(ready_s)

    def all_reduce_floor_s(self, ranks: Sequence[int], num_bytes: int) -> float:
        return self.floor_s(ranks, num_bytes)


def emulated_links(plan: Plan, rank: int, emulation: Emulation) -> EmulatedLinks:
    """The links of ``rank``'s stage to its neighbours, and its all-reduces, at the plan's
    speeds scaled by ``emulation.time_scale``."""
    rank_plan = plan.ranks[rank]
    links = {}
    for side in boundaries(plan, rank_plan):
        if side is None:
            continue
        for peer in (side.peer_rank, *side.destinations):  # TP groups: several peers
            spec = plan.link(rank_plan.device, plan.ranks[peer].device)
            links[peer] = EmulatedLink(
                spec.latency_s, spec.bandwidth_bytes_per_s, emulation.time_scale
            )
    scale = emulation.time_scale

    def floor_s(ranks: Sequence[int], num_bytes: int) -> float:
        return scale * group_ring_time_s(plan, ranks, num_bytes)

    return EmulatedLinks(links, floor_s)


def rehearsal_seams(plan: Plan, rank: int, emulation: Emulation) -> Seams:
    """The emulated clock and links of one rehearsal rank."""
    clock = EmulatedClock(compute_emulation(plan, rank, emulation), rank, plan.world_size)
    return Seams(clock=clock, links=emulated_links(plan, rank, emulation))
