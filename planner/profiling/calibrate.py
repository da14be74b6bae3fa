"""Calibration: compare measured runs with the plan's prediction and correct the profile.

``hplan calibrate PLAN RUNS_DIR`` reads the per-rank metrics of runs of a plan (rehearsed or
real; a rehearsal's emulated seconds divided by its recorded time scale, the warm-up step left
out, a rank's figure the median over steps) and the plan's report. It prints per-rank
predicted and measured compute, rest of the step and memory; takes each device kind's median
measured/predicted compute ratio (the kind correction); gives a ``DeviceFactor`` to a
straggler (``STRAGGLER_THRESHOLD`` off its kind's reference) and to a device measurably off its
kind (``SPEED_THRESHOLD``; devices timed alike that measured within ``POOL_THRESHOLD`` count
as one speed); writes a corrected profile (timings scaled per kind and per phase, optimizer
times, device factors); and fits the gradient all-reduce per node (``comm_calibration``).
A CPU rank under a binding quota is read by its CPU time over the quota
(``StepMetrics.sustained_s``), as the profile measures it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hplan.planner.profiling.comm_calibration import (
    GroupFit,
    calibrated_node_collectives,
    collective_fits,
)
from hplan.planner.profiling.profile_file import (
    DeviceFactor,
    MeasurementSource,
    NodeCollective,
    Profile,
    Stat,
    UnitTiming,
)
from hplan.runtime.contract.elastic import SegmentRecord, read_segments
from hplan.runtime.contract.errors import ConfigError, HplanError
from hplan.runtime.contract.memory_use import RankMemoryUse, memory_use
from hplan.runtime.contract.metrics_file import EmulationRecord, StepMetrics, read_rank_metrics
from hplan.runtime.contract.plan import Plan

STRAGGLER_THRESHOLD = 0.15
"""A device whose compute ratio differs from its kind's reference by more than this is a
straggler (issue 3: "differs from other devices of its type by more than 15%")."""
SPEED_THRESHOLD = 0.02
"""A device that is no straggler but whose compute ratio differs from its kind's correction
by more than this gets its own factor too (a *speed factor*), so that the next solve
shares the batch by its measured speed. A difference left uncorrected stays in the next
plan as an imbalance; one corrected that was noise puts the noise there instead. So the
threshold bounds the bias, not the noise: chosen below a difference that left a node the
bottleneck of every run of the next plan."""
CLASS_THRESHOLD = 0.05
"""Devices of one sibling group (``sibling_group``) whose predicted compute a sample differs by
at most this belong to one *speed class*: the plan timed them alike (two nodes profiled alike,
or the same card twice), so a measured difference between them is the run's, not the
profile's."""
POOL_THRESHOLD = 0.06
"""The members of a speed class whose measured compute a sample lies within this of each other
(largest over smallest) are read as one speed, the class's median, so that one run's noise
does not reach the next plan as unequal shares; chosen at the spread of one rank's
sustained compute over runs of the same plan. A real difference below the threshold is
split between the members: each is then off by less than it (half of it for two)."""


@dataclass(frozen=True, slots=True)
class Run:
    """The metrics of one run of a plan, in the run's own seconds."""

    path: Path
    time_scale: float
    """Seconds of the run per second of the plan's hardware (1 for a real run)."""
    records: tuple[StepMetrics, ...]


@dataclass(frozen=True, slots=True)
class RankError:
    """Predicted and measured times of one rank, in seconds of the plan's hardware."""

    rank: int
    device: str
    kind: str
    predicted_compute_s: float
    measured_compute_s: float
    predicted_rest_s: float
    """Step - compute - optimizer: communication, waiting and bubbles."""
    measured_rest_s: float
    predicted_step_s: float
    measured_step_s: float
    predicted_optimizer_s: float = 0.0
    measured_optimizer_s: float = 0.0
    predicted_forward_s: float = 0.0
    """The forward part of ``predicted_compute_s``."""
    measured_forward_s: float = 0.0
    """The forward part of ``measured_compute_s`` (0: the runs did not record it)."""
    samples: int = 0
    """Samples of the global batch the rank computed a step (its plan's ``num_samples``)."""

    @property
    def compute_ratio(self) -> float:
        """Measured / predicted compute (1.4: this rank computes 40% slower than predicted)."""
        return ratio(self.measured_compute_s, self.predicted_compute_s)


@dataclass(frozen=True, slots=True)
class Calibration:
    """What ``hplan calibrate`` found and the profile it made."""

    errors: tuple[RankError, ...]
    kind_corrections: dict[str, float]
    """Device kind -> median measured/predicted compute ratio of its non-straggler devices."""
    optimizer_corrections: dict[str, float]
    """Device kind -> the same for the optimizer step (applied to the profile's timings)."""
    phase_corrections: dict[str, tuple[float, float]]
    """Device kind -> (forward, backward) median measured/predicted ratios, for kinds whose
    runs recorded forward times; these replace the kind correction on unit timings."""
    device_ratios: dict[str, float]
    """Cluster device name -> its median measured/predicted compute ratio."""
    factors: tuple[DeviceFactor, ...]
    """Stragglers found by this calibration (their factor relative to their kind)."""
    profile: Profile
    """The corrected profile."""
    memory: tuple[RankMemoryUse, ...] = ()
    """Every rank's predicted and measured memory (of every plan, in order)."""
    collectives: tuple[GroupFit, ...] = ()
    """Each fitted sync group's all-reduce (of every plan, in order)."""
    speed_factors: tuple[DeviceFactor, ...] = ()
    """Devices within the straggler threshold but more than ``SPEED_THRESHOLD`` off their
    kind's correction: their factor relative to it (in the profile with the stragglers')."""
    pooled: tuple[SpeedClass, ...] = ()
    """Speed classes whose members were read as one speed (``POOL_THRESHOLD``)."""


@dataclass(frozen=True, slots=True)
class SpeedClass:
    """Devices the plan timed alike, with their measured compute a sample (``POOL_THRESHOLD``)."""

    devices: tuple[str, ...]
    measured_per_sample_s: tuple[float, ...]
    """Each device's median measured compute a sample, seconds, in ``devices``' order."""
    pooled_per_sample_s: float
    """Their median: what each of them is read as (seconds a sample)."""

    @property
    def spread(self) -> float:
        """Largest over smallest measured compute a sample, minus 1 (0.04: 4% apart)."""
        return max(self.measured_per_sample_s) / min(self.measured_per_sample_s) - 1.0


# ------------------------------------------------------------------------------ math
def ratio(measured: float, predicted: float) -> float:
    """``measured / predicted``; NaN when nothing was predicted."""
    return measured / predicted if predicted > 0 else float("nan")


def kind_reference(ratios: Sequence[float]) -> float:
    """The ratio a kind's devices are compared against: their lower median.

    With two devices the faster one is the reference, so the slow one is the straggler.
    """
    return statistics.median_low(sorted(ratios))


def sibling_group(plan: Plan, device: str) -> str:
    """The devices ``device`` is compared with: its kind, with the cluster's declared peak
    FLOP/s and memory bandwidth (a ``cpu`` declared at 0.2 TFLOP/s is not a sibling of a
    catalog ``cpu``: their predictions and emulations differ by design)."""
    spec = plan.device(device)
    return (
        f"{spec.kind} ({spec.peak_flops:.4g} FLOP/s, {spec.memory_bandwidth_bytes_per_s:.4g} B/s)"
    )


CALIBRATE_PLAN = "give the plan that ran as `hplan calibrate`'s PLAN argument"
"""How :func:`check_runs_of_plan` tells ``hplan calibrate``'s user to give another plan."""


def check_runs_of_plan(plan: Plan, runs: Sequence[Run], give_plan: str = CALIBRATE_PLAN) -> None:
    """Refuse runs whose recorded ``plan.json`` (rehearsals write one) places ranks otherwise,
    or whose metrics (every run's) put a rank in another replica or stage, or give it
    another number of samples, than ``plan`` does (the samples only where the plan's shares
    stay fixed: the runtime moves those of one-stage replicas, ``Plan.fixed_shares_reason``).

    Args:
        give_plan: the fix's first half, naming how the command takes the plan (its
            option or argument).

    Raises:
        ConfigError: a run folder holds the plan of another layout.
    """
    ranks = {rp.rank: rp for rp in plan.ranks}
    moving = plan.fixed_shares_reason() is None  # its runs may move samples
    for run in runs:
        for record in run.records:
            rp = ranks.get(record.rank)
            if rp is None:
                continue  # a rank the plan lacks: the callers name it
            samples = rp.num_samples if moving else record.samples
            if (record.replica, record.stage, samples) != (
                rp.replica,
                rp.stage,
                rp.num_samples,
            ):
                raise ConfigError(
                    f"{run.path} is a run of another plan: its rank {record.rank} ran replica "
                    f"{record.replica} stage {record.stage} with {record.samples} samples, the "
                    "plan gives it "
                    f"replica {rp.replica} stage {rp.stage} with {rp.num_samples}; "
                    f"{give_plan}, or the runs of this plan"
                )
        recorded = run.path / "plan.json"
        if not recorded.is_file():
            continue
        ran = Plan.load(recorded)
        if ran.ranks != plan.ranks:
            raise ConfigError(
                f"{run.path} is a run of another plan (its plan.json places ranks otherwise); "
                f"{give_plan}, or the runs of this plan"
            )


def find_stragglers(
    device_ratios: Mapping[str, float],
    device_kinds: Mapping[str, str],
    threshold: float = STRAGGLER_THRESHOLD,
) -> dict[str, float]:
    """Devices whose ratio differs from their kind's reference by more than ``threshold``.

    Args:
        device_ratios: device name -> measured/predicted compute ratio.
        device_kinds: device name -> device kind.
        threshold: relative difference (0.15 = 15%).

    Returns:
        Straggler device name -> its ratio divided by its kind's reference (1.4: 40%
        slower than its siblings; below 1 for a device faster than them). A kind with
        one measured device has no stragglers.
    """
    by_kind: dict[str, list[str]] = {}
    for name in sorted(device_ratios):
        by_kind.setdefault(device_kinds[name], []).append(name)
    stragglers = {}
    for names in by_kind.values():
        if len(names) < 2:
            continue
        reference = kind_reference([device_ratios[n] for n in names])
        for name in names:
            relative = device_ratios[name] / reference
            if abs(relative - 1.0) > threshold:
                stragglers[name] = relative
    return stragglers


def kind_corrections(
    device_ratios: Mapping[str, float],
    device_kinds: Mapping[str, str],
    stragglers: Mapping[str, float],
) -> dict[str, float]:
    """Per kind, the median ratio of its devices that are not stragglers."""
    by_kind: dict[str, list[float]] = {}
    for name, value in device_ratios.items():
        if name not in stragglers:
            by_kind.setdefault(device_kinds[name], []).append(value)
    return {kind: statistics.median(values) for kind, values in sorted(by_kind.items())}


def straggler_reason(
    device: str,
    kind: str,
    relative: float,
    reference: float,
    *,
    compared_with: str = "the other {kind} devices",
    threshold: str = f"threshold {STRAGGLER_THRESHOLD * 100:.0f}%",
) -> str:
    """One line naming the numbers behind a device's factor (a straggler's by default;
    ``compared_with`` and ``threshold`` name another rule's reference and threshold)."""
    direction = "slower" if relative > 1 else "faster"
    return (
        f"{device} computed {relative * reference:.2f}x its predicted time, "
        f"{compared_with.format(kind=kind)} {reference:.2f}x: {abs(relative - 1) * 100:.0f}% "
        f"{direction} ({threshold})"
    )


# ------------------------------------------------------------------------------ runs
def load_runs(runs_dir: Path) -> tuple[Run, ...]:
    """The runs in ``runs_dir``: the folder itself, or each subfolder, with ``rank-*.jsonl``.

    Raises:
        ConfigError: no metrics anywhere, or an unreadable emulation record.
    """
    if runs_dir.exists() and not runs_dir.is_dir():
        raise ConfigError(
            f"runs folder {str(runs_dir)!r} is a file; give the folder a run's --metrics-dir "
            "wrote (it holds rank-*.jsonl)"
        )
    if not runs_dir.is_dir():
        raise ConfigError(f"runs folder {str(runs_dir)!r} does not exist; give a --metrics-dir")
    folders = [runs_dir] if any(runs_dir.glob("rank-*.jsonl")) else sorted(runs_dir.iterdir())
    runs = tuple(_load_run(f) for f in folders if f.is_dir() and any(f.glob("rank-*.jsonl")))
    if not runs:
        raise ConfigError(
            f"no rank-*.jsonl metrics in {str(runs_dir)!r} or its subfolders; run "
            "`hplan rehearse PLAN --metrics-dir DIR` (or `hplan run --metrics-dir`) first"
        )
    return runs


def load_runs_of_plan(plan: Plan, runs_dir: Path) -> tuple[Run, ...]:
    """:func:`load_runs`; of an elastic run's metrics folder (``segment-<NNN>/``), the
    segments that ran ``plan`` (its digest, as their ``segment.json`` or plan copy gives it).

    Raises:
        ConfigError: as :func:`load_runs`; no segment that ran ``plan`` measured a step
            (naming a segment's plan to give instead).
    """
    segments = read_segments(runs_dir) if runs_dir.is_dir() else []
    if not segments:
        return load_runs(runs_dir)
    digest = plan.digest()
    ran = [folder for folder, record in segments if _ran_plan(folder, record, digest)]
    runs = tuple(
        run
        for folder in ran
        if any(folder.glob("rank-*.jsonl"))
        for run in load_runs(folder)
        if run.records
    )
    if not runs:
        measured = [f for f, _ in segments if any(p.stat().st_size for p in f.glob("rank-*.jsonl"))]
        instead = (measured or [segments[-1][0]])[-1] / "plan.json"
        why = (
            f"its {len(ran)} segment(s) that ran this plan measured no step"
            if ran
            else f"none of its {len(segments)} segments ran this plan"
        )
        raise ConfigError(
            f"{str(runs_dir)!r} is an elastic run's metrics, and {why}; give the plan of the "
            f"segment to calibrate, e.g. `hplan calibrate {instead} {runs_dir}`"
        )
    return runs


def _ran_plan(folder: Path, record: SegmentRecord, digest: str) -> bool:
    """Whether the segment in ``folder`` ran the plan of ``digest``."""
    if record.plan_digest == digest:
        return True
    copy = folder / "plan.json"
    try:
        return copy.is_file() and Plan.load(copy).digest() == digest
    except HplanError:
        return False


def _load_run(folder: Path) -> Run:
    records = [r for path in sorted(folder.glob("rank-*.jsonl")) for r in read_rank_metrics(path)]
    return Run(folder, recorded_time_scale(folder), tuple(records))


def recorded_time_scale(folder: Path) -> float:
    """The time scale a rehearsal recorded in ``folder/emulation.json`` (1.0 without one).

    Raises:
        ConfigError: the file is not an emulation record.
    """
    record = EmulationRecord.load(folder)
    return 1.0 if record is None else record.time_scale


def _timed(records: Sequence[StepMetrics]) -> list[StepMetrics]:
    """One rank's records of one run without the first step (warm-up), if it has more."""
    ordered = sorted(records, key=lambda r: r.step)
    return ordered[1:] or ordered


def rank_errors(plan: Plan, runs: Sequence[Run]) -> tuple[RankError, ...]:
    """Predicted vs measured times of every rank of ``plan`` (see the module docstring).

    Raises:
        ConfigError: a run has ranks the plan lacks, or misses one of the plan's ranks.
    """
    predicted = {r.rank: r for r in plan.report.ranks}
    step_s = plan.report.predicted_step_time_s
    errors = []
    for rank_plan in plan.ranks:
        samples: dict[str, list[float]] = {
            "compute": [], "rest": [], "step": [], "opt": [], "forward": []
        }  # fmt: skip
        for run in runs:
            mine = [r for r in run.records if r.rank == rank_plan.rank]
            if not mine:
                raise ConfigError(
                    f"{run.path} has no metrics of rank {rank_plan.rank}; is it a run of "
                    "this plan? (each run folder must hold every rank's rank-<r>.jsonl)"
                )
            for r in _timed(mine):
                # a run that moved samples (``rebalance.py``): its compute at the plan's
                # share, read as linear in the samples
                share = rank_plan.num_samples / r.samples if r.samples > 0 else 1.0
                compute_s = r.sustained_s(r.compute_time_s, r.compute_cpu_time_s) * share
                samples["compute"].append(compute_s / run.time_scale)
                rest_s = r.step_time_s - r.compute_time_s - r.optimizer_time_s
                samples["rest"].append(rest_s / run.time_scale)
                samples["step"].append(r.step_time_s / run.time_scale)
                opt_s = r.sustained_s(r.optimizer_time_s, r.optimizer_cpu_time_s)
                samples["opt"].append(opt_s / run.time_scale)
                forward_s = r.forward_time_s * (
                    compute_s / r.compute_time_s if r.compute_time_s > 0 else share
                )
                samples["forward"].append(forward_s / run.time_scale)
        compute_s = optimizer_s = forward_share = 0.0
        report = predicted.get(rank_plan.rank)
        if report is not None:
            compute_s, optimizer_s = report.busy_time_s, report.optimizer_time_s
            phases_s = report.forward_time_s + report.backward_time_s
            forward_share = report.forward_time_s / phases_s if phases_s > 0 else 0.0
        recorded = all(f > 0 for f in samples["forward"])
        errors.append(
            RankError(
                rank=rank_plan.rank,
                device=rank_plan.device,
                kind=rank_plan.device_kind,
                predicted_compute_s=compute_s,
                measured_compute_s=statistics.median(samples["compute"]),
                predicted_rest_s=max(0.0, step_s - compute_s - optimizer_s),
                measured_rest_s=statistics.median(samples["rest"]),
                predicted_step_s=step_s,
                measured_step_s=statistics.median(samples["step"]),
                predicted_optimizer_s=optimizer_s,
                measured_optimizer_s=statistics.median(samples["opt"]),
                predicted_forward_s=compute_s * forward_share,
                measured_forward_s=statistics.median(samples["forward"]) if recorded else 0.0,
                samples=rank_plan.num_samples,
            )
        )
    _check_ranks(plan, runs)
    return tuple(errors)


def _check_ranks(plan: Plan, runs: Sequence[Run]) -> None:
    for run in runs:
        extra = sorted({r.rank for r in run.records} - {r.rank for r in plan.ranks})
        if extra:
            raise ConfigError(
                f"{run.path} has metrics of rank {extra[0]}, which plan {plan.cluster.name!r} "
                "lacks; calibrate each run against the plan it ran"
            )


# ------------------------------------------------------------------------------ profile
def device_ratios(errors: Sequence[RankError]) -> dict[str, float]:
    """Device name -> median compute ratio over every rank (of every plan) it ran."""
    by_device: dict[str, list[float]] = {}
    for e in errors:
        if e.predicted_compute_s > 0:
            by_device.setdefault(e.device, []).append(e.compute_ratio)
    return {name: statistics.median(values) for name, values in sorted(by_device.items())}


def _kind_of_key(key: str) -> str:
    return key.split("@")[0].split("#")[0]


def _scaled_stat(stat: Stat, factor: float) -> Stat:
    return replace(stat, median=stat.median * factor, p10=stat.p10 * factor, p90=stat.p90 * factor)


def optimizer_corrections(
    errors: Sequence[RankError], stragglers: Mapping[str, float]
) -> dict[str, float]:
    """Per kind, the median measured/predicted optimizer step of its non-straggler ranks."""
    by_kind: dict[str, list[float]] = {}
    for e in errors:
        if e.device not in stragglers and e.predicted_optimizer_s > 0:
            by_kind.setdefault(e.kind, []).append(e.measured_optimizer_s / e.predicted_optimizer_s)
    return {kind: statistics.median(values) for kind, values in sorted(by_kind.items())}


def phase_corrections(
    errors: Sequence[RankError], stragglers: Mapping[str, float]
) -> dict[str, tuple[float, float]]:
    """Per kind, the median measured/predicted forward and backward ratios of its
    non-straggler ranks; only kinds all of whose ranks recorded their forward time."""
    by_kind: dict[str, list[RankError]] = {}
    for e in errors:
        if e.device not in stragglers and e.predicted_compute_s > 0:
            by_kind.setdefault(e.kind, []).append(e)
    out = {}
    for kind, rows in sorted(by_kind.items()):
        usable = all(
            e.measured_forward_s > 0 and 0 < e.predicted_forward_s < e.predicted_compute_s
            for e in rows
        )
        if usable:
            forward = statistics.median(e.measured_forward_s / e.predicted_forward_s for e in rows)
            backward = statistics.median(
                (e.measured_compute_s - e.measured_forward_s)
                / (e.predicted_compute_s - e.predicted_forward_s)
                for e in rows
            )
            out[kind] = (forward, backward)
    return out


def _scaled_timing(
    timing: UnitTiming, factors: tuple[float, float], optimizer_factor: float
) -> UnitTiming:
    optimizer_s = timing.optimizer_s
    return replace(
        timing,
        forward_s=_scaled_stat(timing.forward_s, factors[0]),
        backward_s=_scaled_stat(timing.backward_s, factors[1]),
        optimizer_s=None if optimizer_s is None else optimizer_s * optimizer_factor,
        source=MeasurementSource.CALIBRATED,
    )


def corrected_profile(
    base: Profile,
    corrections: Mapping[str, float],
    stragglers: Sequence[DeviceFactor],
    cluster_devices: Mapping[str, str],
    optimizer: Mapping[str, float] | None = None,
    phases: Mapping[str, tuple[float, float]] | None = None,
) -> Profile:
    """``base`` with unit times of each kind scaled and straggler factors applied.

    Args:
        base: the profile the plan was solved with (an empty ``Profile()`` for the roofline).
        corrections: kind -> measured/predicted compute ratio.
        optimizer: kind -> measured/predicted optimizer ratio, applied to the optimizer
            times of unit timings (a kind without timings keeps the roofline's).
        phases: kind -> (forward, backward) ratios that replace ``corrections`` on the
            forward and backward times of that kind's unit timings.
        stragglers: this calibration's device factors (relative to their kind).
        cluster_devices: every cluster device name -> its kind (kinds without unit timings
            put their correction on each of these devices).

    Returns:
        The corrected profile; device factors of ``base`` are multiplied, not replaced.
    """
    timed_kinds = {_kind_of_key(t.device) for t in base.unit_timings}
    optimizer = optimizer or {}
    phases = phases or {}
    timings = tuple(
        _scaled_timing(
            t,
            phases.get(kind, (corrections[kind], corrections[kind])),
            optimizer.get(kind, 1.0),
        )
        if (kind := _kind_of_key(t.device)) in corrections
        else t
        for t in base.unit_timings
    )
    factors = {f.device: f for f in base.device_factors}
    for name, kind in sorted(cluster_devices.items()):
        if kind in corrections and kind not in timed_kinds:
            factors[name] = _times(
                factors.get(name),
                DeviceFactor(
                    device=name,
                    kind=kind,
                    time_factor=corrections[kind],
                    reason=f"{kind} compute measured {corrections[kind]:.2f}x the prediction "
                    "(median of its devices; no unit timings of the kind to correct)",
                ),
            )
    for factor in stragglers:
        factors[factor.device] = _times(factors.get(factor.device), factor)
    note = "calibrated: " + ", ".join(f"{k} x {v:.3f}" for k, v in sorted(corrections.items()))
    return replace(
        base,
        unit_timings=timings,
        device_factors=tuple(factors[k] for k in sorted(factors)),
        notes=tuple(dict.fromkeys((*base.notes, note))),
    )


def _times(old: DeviceFactor | None, new: DeviceFactor) -> DeviceFactor:
    if old is None or old.kind != new.kind:
        return new
    return replace(
        new, time_factor=old.time_factor * new.time_factor, reason=f"{old.reason}; {new.reason}"
    )


def calibrate(
    observations: Sequence[tuple[Plan, Sequence[Run]]],
    base: Profile | None = None,
    threshold: float = STRAGGLER_THRESHOLD,
) -> Calibration:
    """Compare runs with their plans' predictions and correct ``base``.

    Args:
        observations: (plan, its runs) pairs; several plans on the same cluster pool their
            devices' ratios.
        base: the profile the plans were solved with (None: the roofline, no profile).
        threshold: the straggler threshold (relative).

    Raises:
        ConfigError: see :func:`rank_errors`.
    """
    errors: list[RankError] = []
    memory: list[RankMemoryUse] = []
    siblings: dict[str, str] = {}
    fits: list[GroupFit] = []
    collectives: dict[str, NodeCollective] = {}
    for plan, runs in observations:
        check_runs_of_plan(plan, runs)
        errors.extend(plan_errors := rank_errors(plan, runs))
        fits.extend(plan_fits := collective_fits(plan, measured_exposed_all_reduce_s(runs)))
        collectives = merged_collectives(collectives, calibrated_node_collectives(plan, plan_fits))
        memory.extend(memory_use(plan, [r for run in runs for r in run.records]))
        siblings.update({e.device: sibling_group(plan, e.device) for e in plan_errors})
    kinds = {e.device: e.kind for e in errors}
    ratios = device_ratios(errors)
    relative = find_stragglers(ratios, siblings, threshold)
    pooled = pooled_classes(errors, siblings, relative)
    read = pooled_ratios(errors, pooled) | {n: v for n, v in ratios.items() if not _in(n, pooled)}
    corrections = kind_corrections(read, kinds, relative)
    stragglers = tuple(
        DeviceFactor(
            device=name,
            kind=kinds[name],
            time_factor=value,
            reason=straggler_reason(name, kinds[name], value, ratios[name] / value),
        )
        for name, value in sorted(relative.items())
    )
    speeds = tuple(
        replace(f, reason=f"{f.reason}; {_pooled_reason(f.device, pooled)}")
        if _in(f.device, pooled)
        else f
        for f in speed_factors(read, kinds, corrections, relative)
    )
    cluster = {d.name: d.kind for plan, _ in observations for d in plan.cluster.devices}
    optimizer = optimizer_corrections(errors, relative)
    phases = phase_corrections(errors, relative)
    profile = corrected_profile(
        base or Profile(), corrections, (*stragglers, *speeds), cluster, optimizer, phases
    )
    kept = {c.node: c for c in profile.node_collectives} | collectives
    profile = replace(profile, node_collectives=tuple(kept[k] for k in sorted(kept)))
    return Calibration(
        tuple(errors),
        corrections,
        optimizer,
        phases,
        ratios,
        stragglers,
        profile,
        tuple(memory),
        tuple(fits),
        speeds,
        pooled,
    )


def _in(device: str, classes: Sequence[SpeedClass]) -> bool:
    return any(device in c.devices for c in classes)


def _pooled_reason(device: str, classes: Sequence[SpeedClass]) -> str:
    (speed_class,) = [c for c in classes if device in c.devices]
    return (
        f"read at the median of its speed class {', '.join(speed_class.devices)} "
        f"(measured {speed_class.spread * 100:.1f}% apart a sample, pool threshold "
        f"{POOL_THRESHOLD * 100:.0f}%)"
    )


def _per_sample_s(errors: Sequence[RankError], measured: bool) -> dict[str, float]:
    """Device -> median compute a sample (measured or predicted) over its ranks, seconds."""
    by_device: dict[str, list[float]] = {}
    for e in errors:
        if e.samples > 0 and e.predicted_compute_s > 0:
            value = e.measured_compute_s if measured else e.predicted_compute_s
            by_device.setdefault(e.device, []).append(value / e.samples)
    return {name: statistics.median(values) for name, values in sorted(by_device.items())}


def pooled_classes(
    errors: Sequence[RankError],
    siblings: Mapping[str, str],
    stragglers: Mapping[str, float],
    class_threshold: float = CLASS_THRESHOLD,
    pool_threshold: float = POOL_THRESHOLD,
) -> tuple[SpeedClass, ...]:
    """The speed classes whose members measured within ``pool_threshold`` of each other.

    A class is a run of devices of one sibling group, in order of predicted compute a sample,
    each within ``class_threshold`` of the run's first; stragglers belong to none. Classes
    of one device, and classes whose members measured further apart, are left out (their
    devices keep their own ratios).

    Args:
        errors: every rank's predicted and measured times (:func:`rank_errors`).
        siblings: device name -> its sibling group (:func:`sibling_group`).
        stragglers: devices :func:`find_stragglers` flagged.
    """
    predicted = _per_sample_s(errors, measured=False)
    measured = _per_sample_s(errors, measured=True)
    by_group: dict[str, list[str]] = {}
    for name in sorted(predicted, key=lambda n: (predicted[n], n)):
        if name not in stragglers and not math.isnan(measured[name]):
            by_group.setdefault(siblings[name], []).append(name)
    classes: list[list[str]] = []
    for names in by_group.values():
        current: list[str] = []
        for name in names:
            if current and predicted[name] > predicted[current[0]] * (1 + class_threshold):
                classes.append(current)
                current = []
            current.append(name)
        classes.append(current)
    out = []
    for members in classes:
        values = tuple(measured[n] for n in members)
        if len(members) > 1 and max(values) <= min(values) * (1 + pool_threshold):
            out.append(SpeedClass(tuple(members), values, statistics.median(values)))
    return tuple(out)


def pooled_ratios(errors: Sequence[RankError], classes: Sequence[SpeedClass]) -> dict[str, float]:
    """Each pooled device's ratio read at its class's speed: the class's median measured
    compute a sample over the device's predicted compute a sample (so that the corrected
    profile times every member alike)."""
    predicted = _per_sample_s(errors, measured=False)
    return {n: c.pooled_per_sample_s / predicted[n] for c in classes for n in c.devices}


def speed_factors(
    device_ratios: Mapping[str, float],
    device_kinds: Mapping[str, str],
    corrections: Mapping[str, float],
    stragglers: Mapping[str, float],
    threshold: float = SPEED_THRESHOLD,
) -> tuple[DeviceFactor, ...]:
    """A factor for each device that is no straggler and whose ratio differs from its kind's
    correction by more than ``threshold``: its ratio over the correction, so that the
    corrected profile times it as measured (``SPEED_THRESHOLD``)."""
    factors = []
    for name, value in sorted(device_ratios.items()):
        kind = device_kinds[name]
        if name in stragglers or kind not in corrections or math.isnan(value):
            continue
        relative = value / corrections[kind]
        if abs(relative - 1.0) > threshold:
            reason = straggler_reason(
                name,
                kind,
                relative,
                corrections[kind],
                compared_with="its kind {kind}",
                threshold=f"speed threshold {threshold * 100:.0f}%",
            )
            factors.append(
                DeviceFactor(device=name, kind=kind, time_factor=relative, reason=reason)
            )
    return tuple(factors)


def measured_exposed_all_reduce_s(runs: Sequence[Run]) -> dict[int, dict[int, float]]:
    """Rank -> step key -> exposed all-reduce in seconds of the plan's hardware, warm-up
    steps left out (``_timed``); run ``i``'s step ``s`` is key ``i * 2**32 + s``."""
    out: dict[int, dict[int, float]] = {}
    for i, run in enumerate(runs):
        for rank in sorted({r.rank for r in run.records}):
            for r in _timed([x for x in run.records if x.rank == rank]):
                out.setdefault(rank, {})[i * 2**32 + r.step] = r.allreduce_time_s / run.time_scale
    return out


def merged_collectives(
    old: Mapping[str, NodeCollective], new: Mapping[str, NodeCollective]
) -> dict[str, NodeCollective]:
    """Per node, the smaller latency of two plans' fits (``comm_calibration``: a node in a
    fast ring cannot be what slows a slow one)."""
    out = dict(old)
    for node, c in new.items():
        if node not in out or c.latency_per_step_s < out[node].latency_per_step_s:
            out[node] = c
    return out


def check_profile_out(out_dir: Path) -> None:
    """Fail before calibrating when the corrected profile could not go to ``out_dir``.

    Raises:
        ConfigError: ``out_dir`` is a file or holds other profiles (``hplan solve --profile``
            would merge them over the correction).
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"-o {str(out_dir)!r} is a file; give a directory")
    path = out_dir / "calibrated.json"
    others = sorted(p.name for p in out_dir.glob("*.json") if p != path) if out_dir.exists() else []
    if others:
        raise ConfigError(
            f"-o {str(out_dir)!r} already holds {others[0]}; write the corrected profile to a "
            "new directory (it contains the input profile's measurements too)"
        )


def single_step_runs(runs: Sequence[Run]) -> list[Path]:
    """Runs in which some rank has one step only: its warm-up step is all there is."""
    return [
        run.path
        for run in runs
        if any(
            sum(1 for r in run.records if r.rank == rank) < 2
            for rank in {r.rank for r in run.records}
        )
    ]


def write_profile(profile: Profile, out_dir: Path) -> Path:
    """Write ``out_dir/calibrated.json`` (the whole corrected profile) and return its path.

    Raises:
        ConfigError: ``out_dir`` is a file or holds other profiles (``hplan solve --profile``
            would merge them over the correction).
    """
    check_profile_out(out_dir)
    path = out_dir / "calibrated.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json(), encoding="utf-8")
    return path
