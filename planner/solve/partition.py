"""Pipeline shapes: an ordered list of device classes, a micro-batch size, and the best
contiguous split of the partition units over them.

A *device class* is a set of interchangeable devices (``hplan.planner.solve.device_classes``). A
*pipeline shape* is an ordered list ``(c_0, ..., c_{S-1})`` of classes
(a class may repeat up to its size) with a micro-batch size; the solver decides how many
copies of each shape to run. For one shape the split of units over stages is
solved exactly here, by a dynamic program over cut positions that minimises the period
(the slowest stage or link per micro-batch) subject to every stage's memory (ties: the first
split found). On tiny instances every split is enumerated instead and all
(period, fill) Pareto-optimal splits are kept, so that the solver's answer matches a
brute-force search exactly.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hplan.planner.cost.evaluate import (
    in_flight_microbatches,
    link_time_s,
    unit_input_bytes_per_sample,
)
from hplan.planner.cost.microbatch import pipeline_period_s
from hplan.planner.cost.problem import PlanningProblem, RecomputePolicy
from hplan.planner.cost.recompute import recompute_order, selected_units
from hplan.planner.solve.device_classes import DeviceClass, pair_devices


@dataclass(frozen=True, slots=True)
class PipelineShape:
    """A costed pipeline shape; ``bounds[s]`` is the first unit of stage s (plus U at the end)."""

    classes: tuple[int, ...]
    k: int
    """Index of the micro-batch size among the problem's candidates."""
    micro_batch_size: int
    bounds: tuple[int, ...]
    period_s: float
    fill_s: float
    optimizer_s: float
    stage_grad_bytes: tuple[float, ...]
    stage_backward_s: tuple[float, ...]
    """Backward time of one micro-batch on each stage (the pass its all-reduce overlaps)."""
    recompute: tuple[bool, ...] = ()
    """Per stage: whether it recomputes its activations (empty: none does)."""
    recompute_units: tuple[tuple[int, ...], ...] = ()
    """Per stage: the units it recomputes selectively (empty: none; ``recompute`` covers
    whole stages)."""

    @property
    def num_stages(self) -> int:
        return len(self.classes)

    def time_s(self, num_microbatches: int, allreduce_s: float) -> float:
        """Step time of one copy running ``num_microbatches`` micro-batches."""
        return (num_microbatches - 1) * self.period_s + self.fill_s + self.optimizer_s + allreduce_s


@dataclass(frozen=True, slots=True)
class _StageMatrices:
    """One stage position's options over every unit range [i, j) (``Partitioner._strategy``)."""

    compute: np.ndarray
    """(U+1, U+1) forward + backward (+ recomputed forwards) per micro-batch; inf: no fit."""
    link: np.ndarray
    """(U+1,) outgoing link time of a cut placed at position j."""
    recompute: np.ndarray
    """(U+1, U+1) whole-stage recomputation."""
    counts: np.ndarray
    """(U+1, U+1) selective recomputation: ``selected_units``'s count (0: none)."""


class Partitioner:
    """Costs pipeline shapes for one problem (prefix sums cached per device and k)."""

    def __init__(self, problem: PlanningProblem, classes: Sequence[DeviceClass]) -> None:
        self.problem = problem
        self.classes = tuple(classes)
        p = problem
        zero = np.zeros(1)
        self._time_cum = np.concatenate(
            [
                np.zeros((p.num_devices, 1, len(p.micro_batch_sizes))),
                np.cumsum(p.fwd_time_s + p.bwd_time_s, axis=1),
            ],
            axis=1,
        )
        self._bwd_cum = np.concatenate(
            [
                np.zeros((p.num_devices, 1, len(p.micro_batch_sizes))),
                np.cumsum(p.bwd_time_s, axis=1),
            ],
            axis=1,
        )
        self._static_cum = np.concatenate([zero, np.cumsum(p.static_memory_bytes)])
        self._act_cum = np.concatenate([zero, np.cumsum(p.activation_bytes_per_sample)])
        self._opt_cum = np.concatenate(
            [np.zeros((p.num_devices, 1)), np.cumsum(p.optimizer_time_s, axis=1)], axis=1
        )
        self._grad_cum = np.concatenate([zero, np.cumsum(p.grad_bytes)])
        self._fwd_cum = np.concatenate(
            [
                np.zeros((p.num_devices, 1, len(p.micro_batch_sizes))),
                np.cumsum(p.fwd_time_s, axis=1),
            ],
            axis=1,
        )
        self._cut = np.concatenate([[0.0], p.cut_bytes_per_sample, [0.0]])
        self._unit_input = np.array([unit_input_bytes_per_sample(p, u) for u in range(p.num_units)])
        idx = np.arange(p.num_units + 1)
        self._nonempty = idx[:, None] < idx[None, :]
        self._strategies: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    # ------------------------------------------------------------------ stage costs
    def _compute(self, device: int, k: int) -> np.ndarray:
        """(U+1, U+1) matrix of forward+backward time of units [i, j)."""
        cum = self._time_cum[device, :, k]
        return cum[None, :] - cum[:, None]

    def _memory(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(U+1, U+1) matrices of units [i, j): static bytes + boundary buffers, and
        activation bytes per micro-batch (``evaluate.stage_memory_bytes``'s parts)."""
        static = self._static_cum[None, :] - self._static_cum[:, None]
        per_microbatch = (self._act_cum[None, :] - self._act_cum[:, None]) * b
        cut = self._cut
        return static + 2 * b * (cut[:, None] + cut[None, :]), per_microbatch

    def _memory_ok(
        self, device: int, b: int, in_flight: int, recompute: bool = False
    ) -> np.ndarray:
        """(U+1, U+1): whether units [i, j) fit ``device`` (``evaluate.stage_memory_bytes``)."""
        fixed, per_microbatch = self._memory(b)
        # Recomputing keeps each in-flight micro-batch's input and one's activations.
        acts = (
            per_microbatch + self._cut[:, None] * b * in_flight
            if recompute
            else per_microbatch * in_flight
        )
        return (fixed + acts <= self.problem.memory_capacity_bytes[device]) & self._nonempty

    def _selective(self, device: int, k: int, in_flight: int) -> tuple[np.ndarray, np.ndarray]:
        """Selective recomputation of units [i, j): (U+1, U+1) extra forward time of the
        fewest units, taken in ``recompute_order``, that make the stage fit (inf: none
        does, short of all of them), and how many of the order's units were looked at
        (``selected_units``'s ``count``; 0: none fits)."""
        p = self.problem
        b = p.micro_batch_sizes[k]
        fixed, per_microbatch = self._memory(b)
        capacity = p.memory_capacity_bytes[device]
        idx = np.arange(p.num_units + 1)
        kept = per_microbatch.copy()
        largest = np.zeros_like(kept)
        again = np.zeros_like(kept)
        chosen = np.zeros(kept.shape, dtype=int)
        extra = np.full(kept.shape, np.inf)
        counts = np.zeros(kept.shape, dtype=int)
        for t, u in enumerate(recompute_order(p, device, k)):
            inside = (idx[:, None] <= u) & (u < idx[None, :])
            kept -= inside * (p.activation_bytes_per_sample[u] - self._unit_input[u]) * b
            largest = np.maximum(largest, inside * p.activation_bytes_per_sample[u] * b)
            again += inside * p.fwd_time_s[device, u, k]
            chosen += inside
            fits = fixed + kept * in_flight + largest <= capacity
            new = inside & fits & np.isinf(extra) & (chosen < idx[None, :] - idx[:, None])
            extra = np.where(new, again, extra)
            counts = np.where(new, t + 1, counts)
        return extra, counts

    def _strategy(
        self, device: int, k: int, in_flight: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per stage [i, j) under the problem's ``RecomputePolicy``: (compute matrix with
        inf where nothing fits, whole-stage recompute flags, selective ``count``s, 0: none).
        ``auto`` keeps activations where they fit, else recomputes the fewest units (the
        cheapest per byte first) that make it fit, else recomputes the whole stage; each
        is costed as the forward it runs again, so the split weighs it."""
        key = (device, k, in_flight)
        if key in self._strategies:
            return self._strategies[key]
        b = self.problem.micro_batch_sizes[k]
        policy = self.problem.recompute
        compute = self._compute(device, k)
        keep_ok = self._memory_ok(device, b, in_flight) & (policy is not RecomputePolicy.ALWAYS)
        none = np.zeros(keep_ok.shape, dtype=int)
        if policy is RecomputePolicy.NEVER:
            found = (np.where(keep_ok, compute, np.inf), np.zeros_like(keep_ok), none)
            self._strategies[key] = found
            return found
        extra, counts = (
            self._selective(device, k, in_flight)
            if policy is RecomputePolicy.AUTO
            else (np.full(compute.shape, np.inf), none)
        )
        use_selective = ~keep_ok & np.isfinite(extra)
        recompute_ok = self._memory_ok(device, b, in_flight, recompute=True)
        cum = self._fwd_cum[device, :, k]
        again = cum[None, :] - cum[:, None]
        use_recompute = recompute_ok & ~keep_ok & ~use_selective
        cost = np.where(use_selective, compute + extra, compute + again)
        found = (
            np.where(keep_ok, compute, np.where(use_selective | use_recompute, cost, np.inf)),
            use_recompute,
            np.where(use_selective, counts, 0),
        )
        self._strategies[key] = found
        return found

    def _link_out(self, a: int, b_dev: int, b: int) -> np.ndarray:
        """(U+1,) link time per micro-batch of a cut placed at position j (after unit j-1)."""
        p = self.problem
        u = p.num_units
        out = np.full(u + 1, np.inf)
        for j in range(1, u):
            fwd = link_time_s(p, a, b_dev, p.cut_bytes_per_sample[j - 1] * b)
            bwd = link_time_s(p, b_dev, a, p.cut_grad_bytes_per_sample[j - 1] * b)
            out[j] = fwd + bwd
        return out

    def _stage_matrices(self, sequence: Sequence[int], k: int) -> list[_StageMatrices]:
        b = self.problem.micro_batch_sizes[k]
        devices = pair_devices(self.classes, sequence)
        num_stages = len(sequence)
        mats = []
        for s, dev in enumerate(devices):
            compute, recompute, counts = self._strategy(
                dev, k, in_flight_microbatches(s, num_stages)
            )
            u = self.problem.num_units
            link = self._link_out(dev, devices[s + 1], b) if s + 1 < num_stages else np.zeros(u + 1)
            mats.append(_StageMatrices(compute, link, recompute, counts))
        return mats

    # ------------------------------------------------------------------ splitting
    def best_split(self, sequence: Sequence[int], k: int) -> PipelineShape | None:
        """The split minimising the period; None if nothing fits."""
        mats = self._stage_matrices(sequence, k)
        u = self.problem.num_units
        best = np.full(u + 1, np.inf)
        best[0] = 0.0
        choices = []
        for s, m in enumerate(mats):
            compute, link = m.compute, m.link
            value = np.maximum(compute, link[None, :]) if s + 1 < len(mats) else compute
            cand = np.maximum(best[:, None], value)
            choices.append(np.argmin(cand, axis=0))
            best = cand.min(axis=0)
        if not np.isfinite(best[u]):
            return None
        bounds = [u]
        for choice in reversed(choices):
            bounds.append(int(choice[bounds[-1]]))
        return self._shape(sequence, k, tuple(reversed(bounds)), mats)

    def all_splits(self, sequence: Sequence[int], k: int) -> list[PipelineShape]:
        """Every feasible split, reduced to its (period, fill) Pareto front."""
        mats = self._stage_matrices(sequence, k)
        u = self.problem.num_units
        found = []
        for cuts in itertools.combinations(range(1, u), len(sequence) - 1):
            bounds = (0, *cuts, u)
            if all(
                np.isfinite(mats[s].compute[bounds[s], bounds[s + 1]]) for s in range(len(sequence))
            ):
                found.append(self._shape(sequence, k, bounds, mats))
        return pareto(found)

    def _shape(
        self,
        sequence: Sequence[int],
        k: int,
        bounds: tuple[int, ...],
        mats: list[_StageMatrices],
    ) -> PipelineShape:
        devices = pair_devices(self.classes, sequence)
        computes = [float(mats[s].compute[bounds[s], bounds[s + 1]]) for s in range(len(sequence))]
        links = [
            float(mats[s].link[bounds[s + 1]]) if s + 1 < len(sequence) else 0.0
            for s in range(len(sequence))
        ]
        optimizer = max(
            float(self._opt_cum[d, bounds[s + 1]] - self._opt_cum[d, bounds[s]])
            for s, d in enumerate(devices)
        )
        grads = tuple(
            float(self._grad_cum[bounds[s + 1]] - self._grad_cum[bounds[s]])
            for s in range(len(sequence))
        )
        recompute = tuple(
            bool(mats[s].recompute[bounds[s], bounds[s + 1]]) for s in range(len(sequence))
        )
        selective = tuple(
            selected_units(
                recompute_order(self.problem, d, k),
                bounds[s],
                bounds[s + 1],
                int(mats[s].counts[bounds[s], bounds[s + 1]]),
            )
            for s, d in enumerate(devices)
        )
        backward = tuple(
            float(self._bwd_cum[d, bounds[s + 1], k] - self._bwd_cum[d, bounds[s], k])
            for s, d in enumerate(devices)
        )
        return PipelineShape(
            classes=tuple(sequence),
            k=k,
            micro_batch_size=self.problem.micro_batch_sizes[k],
            bounds=bounds,
            period_s=pipeline_period_s(computes, links),
            fill_s=sum(computes) + sum(links),
            optimizer_s=optimizer,
            stage_grad_bytes=grads,
            stage_backward_s=backward,
            recompute=recompute,
            recompute_units=selective,
        )


def pareto(shapes: Sequence[PipelineShape]) -> list[PipelineShape]:
    """Pipeline shapes not dominated in (period, fill, optimizer time)."""
    keep = []
    for t in shapes:
        dominated = any(
            o is not t
            and o.period_s <= t.period_s
            and o.fill_s <= t.fill_s
            and o.optimizer_s <= t.optimizer_s
            and (o.period_s, o.fill_s, o.optimizer_s) != (t.period_s, t.fill_s, t.optimizer_s)
            for o in shapes
        )
        if not dominated:
            keep.append(t)
    unique = {(t.bounds, t.classes, t.k): t for t in keep}
    return list(unique.values())
