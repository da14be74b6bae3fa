"""Pipeline shapes: which the solver considers, and the best split of the units over each.

A *pipeline shape* is an ordered list ``(c_0, ..., c_{S-1})`` of device groups
(``device_groups``; a class may repeat up to its size) with a micro-batch size; the
solver decides how many copies of each to run. The split of units over a shape's stages is
exact: a dynamic program over cut positions minimises the period (the slowest stage or
link per micro-batch) within every stage's memory; on tiny instances every split is
enumerated and every Pareto-optimal one kept, so the answer matches a brute-force search.

Which shapes (:func:`enumerate_shapes`): on small instances every ordering of every
multiset of classes; on larger ones each multiset in a few promising orders
(:func:`heuristic_orders`), for pipelines up to :data:`EXTRA_STAGES` longer than the
shortest that fits, until a time budget, and the answer is marked as a partial search.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hplan.planner.cost.evaluate import (
    link_time_s,
    max_microbatches,
)
from hplan.planner.cost.layout import StageLayout
from hplan.planner.cost.microbatch import pipeline_period_s
from hplan.planner.cost.problem import PlanningProblem, Policy
from hplan.planner.cost.recompute import recompute_order, selected_units
from hplan.planner.solve.device_groups import (
    DeviceGroup,
    distinct_orders,
    multisets,
    num_distinct_orders,
    pair_devices,
)
from hplan.runtime.contract.memory import in_flight_microbatches
from hplan.runtime.contract.plan import Schedule


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
    max_microbatches: int | None = None
    """The most micro-batches its stages hold in memory (GPipe keeps every one in flight,
    ``evaluate.max_microbatches``); None: any number (1F1B)."""

    @property
    def max_samples(self) -> int | None:
        """:attr:`max_microbatches` in samples."""
        if self.max_microbatches is None:
            return None
        return self.max_microbatches * self.micro_batch_size

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

    def __init__(self, problem: PlanningProblem, classes: Sequence[DeviceGroup]) -> None:
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
        # per TP degree of the problem's devices (one entry without TP): a card's bytes
        self._static_cum = {
            g: np.concatenate([zero, np.cumsum(p.static_bytes_at(g))]) for g in p.distinct_degrees
        }
        self._act_cum = {
            g: np.concatenate([zero, np.cumsum(p.activation_bytes_at(g))])
            for g in p.distinct_degrees
        }
        self._opt_cum = np.concatenate(
            [np.zeros((p.num_devices, 1)), np.cumsum(p.optimizer_time_s, axis=1)], axis=1
        )
        self._grad_cum = {
            g: np.concatenate([zero, np.cumsum(p.grad_bytes_at(g))]) for g in p.distinct_degrees
        }
        self._fwd_cum = np.concatenate(
            [
                np.zeros((p.num_devices, 1, len(p.micro_batch_sizes))),
                np.cumsum(p.fwd_time_s, axis=1),
            ],
            axis=1,
        )
        self._cut = np.concatenate([[0.0], p.cut_bytes_per_sample, [0.0]])
        self._cut_fixed = np.concatenate([[0.0], p.cut_fixed_array(), [0.0]])
        idx = np.arange(p.num_units + 1)
        self._nonempty = idx[:, None] < idx[None, :]
        self._strategies: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    # ------------------------------------------------------------------ stage costs
    def _compute(self, device: int, k: int) -> np.ndarray:
        """(U+1, U+1) matrix of forward+backward time of units [i, j)."""
        cum = self._time_cum[device, :, k]
        return cum[None, :] - cum[:, None]

    def _memory(self, device: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Units [i, j) on a card of ``device``: (U+1, U+1) static bytes + boundary buffers
        and activation bytes per micro-batch, and (U+1, 1) the received tensors without a
        batch dimension each micro-batch in flight holds (``evaluate.stage_memory_bytes``'s
        parts)."""
        degree = self.problem.degree(device)
        static_cum, act_cum = self._static_cum[degree], self._act_cum[degree]
        static = static_cum[None, :] - static_cum[:, None]
        per_microbatch = (act_cum[None, :] - act_cum[:, None]) * b
        cut = self._cut_bytes(b)
        return static + 2 * (cut[:, None] + cut[None, :]), per_microbatch, self._cut_fixed[:, None]

    def _cut_bytes(self, b: int) -> np.ndarray:
        """(U+1,) bytes of one micro-batch of ``b`` samples crossing a cut at position j
        (after unit j-1; 0 at both ends): batched tensors per sample, the others once."""
        return self._cut * b + self._cut_fixed

    def _memory_ok(
        self, device: int, b: int, in_flight: int, recompute: bool = False
    ) -> np.ndarray:
        """(U+1, U+1): whether units [i, j) fit ``device`` (``evaluate.stage_memory_bytes``)."""
        fixed, per_microbatch, received = self._memory(device, b)
        # Recomputing keeps each in-flight micro-batch's input and one's activations.
        acts = (
            per_microbatch + (self._cut * b)[:, None] * in_flight
            if recompute
            else per_microbatch * in_flight
        )
        need = fixed + acts + received * in_flight
        return (need <= self.problem.memory_capacity_bytes[device]) & self._nonempty

    def _selective(self, device: int, k: int, in_flight: int) -> tuple[np.ndarray, np.ndarray]:
        """Selective recomputation of units [i, j): (U+1, U+1) extra forward time of the
        fewest units, taken in ``recompute_order``, that make the stage fit (inf: none
        does, short of all of them), and how many of the order's units were looked at
        (``selected_units``'s ``count``; 0: none fits)."""
        p = self.problem
        b = p.micro_batch_sizes[k]
        fixed, per_microbatch, received = self._memory(device, b)
        activations = p.activation_bytes_on(device)
        capacity = p.memory_capacity_bytes[device]
        idx = np.arange(p.num_units + 1)
        kept = per_microbatch.copy()
        largest = np.zeros_like(kept)
        again = np.zeros_like(kept)
        chosen = np.zeros(kept.shape, dtype=int)
        extra = np.full(kept.shape, np.inf)
        counts = np.zeros(kept.shape, dtype=int)
        unit_input = self._cut_bytes(b)  # [u]: the boundary before unit u
        for t, u in enumerate(recompute_order(p, device, k)):
            inside = (idx[:, None] <= u) & (u < idx[None, :])
            # a stage's first unit keeps only the batched part: ``received`` holds the rest
            first = idx[:, None] == u
            saved = activations[u] * b - unit_input[u] + first * self._cut_fixed[u]
            kept -= inside * saved
            largest = np.maximum(largest, inside * activations[u] * b)
            again += inside * p.fwd_time_s[device, u, k]
            chosen += inside
            fits = fixed + (kept + received) * in_flight + largest <= capacity
            new = inside & fits & np.isinf(extra) & (chosen < idx[None, :] - idx[:, None])
            extra = np.where(new, again, extra)
            counts = np.where(new, t + 1, counts)
        return extra, counts

    def _strategy(
        self, device: int, k: int, in_flight: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per stage [i, j) under the problem's ``Policy``: (compute matrix with
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
        keep_ok = self._memory_ok(device, b, in_flight) & (policy is not Policy.ALWAYS)
        none = np.zeros(keep_ok.shape, dtype=int)
        if policy is Policy.NEVER:
            found = (np.where(keep_ok, compute, np.inf), np.zeros_like(keep_ok), none)
            self._strategies[key] = found
            return found
        extra, counts = (
            self._selective(device, k, in_flight)
            if policy is Policy.AUTO
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
            fwd = link_time_s(p, a, b_dev, p.cut_bytes(j - 1, b))
            bwd = link_time_s(p, b_dev, a, p.cut_grad_bytes(j - 1, b))
            out[j] = fwd + bwd
        return out

    def _stage_matrices(
        self, sequence: Sequence[int], k: int, num_microbatches: int | None
    ) -> list[_StageMatrices]:
        """Per stage position, its options with the micro-batches in flight the schedule
        gives ``num_microbatches`` (None: at most ``S - s`` under 1F1B)."""
        b = self.problem.micro_batch_sizes[k]
        devices = pair_devices(self.classes, sequence)
        num_stages = len(sequence)
        mats = []
        for s, dev in enumerate(devices):
            in_flight = in_flight_microbatches(
                self.problem.schedule, s, num_stages, num_microbatches
            )
            compute, recompute, counts = self._strategy(dev, k, in_flight)
            u = self.problem.num_units
            link = self._link_out(dev, devices[s + 1], b) if s + 1 < num_stages else np.zeros(u + 1)
            mats.append(_StageMatrices(compute, link, recompute, counts))
        return mats

    # ------------------------------------------------------------------ splitting
    def best_split(
        self, sequence: Sequence[int], k: int, num_microbatches: int | None = None
    ) -> PipelineShape | None:
        """The split minimising the period with ``num_microbatches`` (a level of
        :func:`microbatch_levels`) in flight; None if nothing fits."""
        mats = self._stage_matrices(sequence, k, num_microbatches)
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

    def all_splits(
        self, sequence: Sequence[int], k: int, num_microbatches: int | None = None
    ) -> list[PipelineShape]:
        """Every feasible split with ``num_microbatches`` in flight, reduced to its Pareto
        front (:func:`pareto`)."""
        mats = self._stage_matrices(sequence, k, num_microbatches)
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
        grad_cums = [self._grad_cum[self.problem.degree(d)] for d in devices]
        grads = tuple(
            float(grad_cums[s][bounds[s + 1]] - grad_cums[s][bounds[s]])
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
        b = self.problem.micro_batch_sizes[k]
        stages = [
            StageLayout(d, bounds[s], bounds[s + 1], recompute[s], selective[s])
            for s, d in enumerate(devices)
        ]
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
            max_microbatches=max_microbatches(self.problem, stages, b),
        )


def microbatch_levels(problem: PlanningProblem, k: int) -> tuple[int | None, ...]:
    """The micro-batches in flight a pipeline shape is split for at micro-batch candidate
    ``k``: under 1F1B one level, None (at most ``S - s`` whatever the count); under GPipe,
    where every micro-batch is in flight, 1, 2, 4, ... up to the global batch's count, so
    that a shape recomputing enough for many micro-batches is found beside one that keeps
    its activations for a few."""
    if problem.schedule is not Schedule.GPIPE:
        return (None,)
    most = -(-problem.global_batch_size // problem.micro_batch_sizes[k])
    levels = [1]
    while levels[-1] < most:
        levels.append(min(2 * levels[-1], most))
    return tuple(levels)


def pareto(shapes: Sequence[PipelineShape]) -> list[PipelineShape]:
    """Pipeline shapes not dominated in (period, fill, optimizer time) by one that holds at
    least as many micro-batches in memory (:attr:`PipelineShape.max_microbatches`)."""
    keep = []
    for t in shapes:
        dominated = any(
            o is not t
            and _holds_as_many(o, t)
            and o.period_s <= t.period_s
            and o.fill_s <= t.fill_s
            and o.optimizer_s <= t.optimizer_s
            and (o.period_s, o.fill_s, o.optimizer_s) != (t.period_s, t.fill_s, t.optimizer_s)
            for o in shapes
        )
        if not dominated:
            keep.append(t)
    unique = {(t.bounds, t.classes, t.k, t.recompute, t.recompute_units): t for t in keep}
    return list(unique.values())


def _holds_as_many(a: PipelineShape, b: PipelineShape) -> bool:
    if a.max_microbatches is None:
        return True
    return b.max_microbatches is not None and a.max_microbatches >= b.max_microbatches


# --------------------------------------------------------------------------- which shapes
EXTRA_STAGES = 3
"""Heuristic search: longest pipeline = shortest that fits + this."""


@dataclass(frozen=True)
class ShapeSet:
    """The costed shapes and how they were found."""

    shapes: list[PipelineShape]
    exhaustive: bool
    """Every order and every split was enumerated (no heuristic, no time cut)."""
    complete: bool
    """The heuristic enumeration finished before its time budget."""


def enumerate_shapes(
    problem: PlanningProblem,
    classes: Sequence[DeviceGroup],
    *,
    max_stages: int,
    exhaustive_limit: int,
    budget_deadline: float,
) -> ShapeSet:
    """Costed shapes worth considering (see the module docstring)."""
    partitioner = Partitioner(problem, classes)
    sizes = [c.size for c in classes]
    longest = min(max_stages, problem.num_units, problem.num_devices)
    if _exhaustive_count(problem, sizes, longest, exhaustive_limit) <= exhaustive_limit:
        found = [
            t
            for s in range(1, longest + 1)
            for ms in multisets(sizes, s)
            for order in distinct_orders(ms)
            for k in range(len(problem.micro_batch_sizes))
            for t in _all_levels(problem, partitioner, order, k)
        ]
        return ShapeSet(found, exhaustive=True, complete=True)
    return _heuristic(problem, partitioner, sizes, longest, budget_deadline)


def _all_levels(
    problem: PlanningProblem, partitioner: Partitioner, order: tuple[int, ...], k: int
) -> list[PipelineShape]:
    """Every split of ``order`` at candidate ``k``, at each micro-batches-in-flight level
    (``partition.microbatch_levels``: one under 1F1B), the levels' fronts merged."""
    levels = microbatch_levels(problem, k)
    if len(levels) == 1:
        return partitioner.all_splits(order, k, levels[0])
    return pareto([t for level in levels for t in partitioner.all_splits(order, k, level)])


def _exhaustive_count(
    problem: PlanningProblem, sizes: Sequence[int], longest: int, limit: int
) -> int:
    """(order, split, micro-batch size) triples, counted until ``limit`` is passed."""
    total = 0
    k = sum(len(microbatch_levels(problem, k)) for k in range(len(problem.micro_batch_sizes)))
    for s in range(1, longest + 1):
        splits = math.comb(problem.num_units - 1, s - 1)
        for ms in multisets(sizes, s):
            total += num_distinct_orders(ms) * splits * k
            if total > limit:
                return total
    return total


def _heuristic(
    problem: PlanningProblem,
    partitioner: Partitioner,
    sizes: Sequence[int],
    longest: int,
    budget_deadline: float,
) -> ShapeSet:
    found: list[PipelineShape] = []
    smallest_fit: int | None = None
    for s in range(1, longest + 1):
        if smallest_fit is not None and s > smallest_fit + EXTRA_STAGES:
            break
        for ms in multisets(sizes, s):
            if time.monotonic() > budget_deadline:
                return ShapeSet(found, exhaustive=False, complete=False)
            for k in range(len(problem.micro_batch_sizes)):
                orders = heuristic_orders(problem, partitioner.classes, ms)
                costed = [
                    t
                    for seq in orders
                    for level in microbatch_levels(problem, k)
                    if (t := partitioner.best_split(seq, k, level))
                ]
                if costed:
                    smallest_fit = s if smallest_fit is None else smallest_fit
                    found.extend(pareto(costed))
    return ShapeSet(found, exhaustive=False, complete=True)


def heuristic_orders(
    problem: PlanningProblem, classes: Sequence[DeviceGroup], ms: tuple[int, ...]
) -> list[tuple[int, ...]]:
    """Stage orders worth trying: most memory first (stage 0 holds the most activations),
    grouped by node (fewest slow hops; nodes by memory, then fastest node first and slowest
    node first), and fastest first; all orders of short pipelines. Ties go by node name
    and class index, so that the order of the cluster file decides as little as possible."""

    def memory(c: int) -> float:
        return float(problem.memory_capacity_bytes[classes[c].rep])

    def speed(c: int) -> float:
        return -float(problem.fwd_time_s[classes[c].rep].sum())

    def node(c: int) -> str:
        return problem.device_nodes[classes[c].rep]

    node_memory: dict[str, float] = {}
    node_time: dict[str, float] = {}
    for c in ms:
        node_memory[node(c)] = node_memory.get(node(c), 0.0) + memory(c)
        node_time[node(c)] = node_time.get(node(c), 0.0) - speed(c)
    orders = {
        tuple(sorted(ms, key=lambda c: (-memory(c), c))),
        tuple(sorted(ms, key=lambda c: (-node_memory[node(c)], node(c), -memory(c), c))),
        tuple(sorted(ms, key=lambda c: (node_time[node(c)], node(c), -speed(c), c))),
        tuple(sorted(ms, key=lambda c: (-node_time[node(c)], node(c), speed(c), c))),
        tuple(sorted(ms, key=lambda c: (-speed(c), -memory(c), c))),
    }
    if len(ms) <= 3:
        orders.update(distinct_orders(ms))
    return sorted(orders)
