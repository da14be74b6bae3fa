"""Per-unit model profile: forward, backward and optimizer time and memory of each unit.

Each partition unit runs alone as a one-unit pipeline stage
(``hplan.runtime.capture.stage.build_stage``, exactly what a rank of that unit would run) on
its real inputs: the model runs as a chain of one-unit stages, so every unit receives the
boundary tensors its predecessor sends. Per (unit, micro-batch size) it records forward and
backward seconds, the optimizer step of the unit's parameters (the model file's
``make_optimizer``, else AdamW) and activation and peak bytes (``unit_memory.py``). The last
unit's forward includes ``loss_fn``, as the runtime's last stage does. Times are sustained
speeds (``windows.py``), swept ``rounds`` times in alternating order and reduced to the
median, so a machine whose speed drifts during the profile skews no size by more than one
round; then scaled to the whole model's (``UnitProfileOptions.whole_model``). Identical
repeated units (same stage graph, modules, shapes and dtypes) are timed once.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from hplan.planner.frontend.cost_graph import ModelGraph
from hplan.planner.profiling.microbench import Stopwatch, one_cpu_thread
from hplan.planner.profiling.profile_file import Stat, UnitTiming
from hplan.planner.profiling.unit_memory import measure_unit_memory
from hplan.planner.profiling.windows import (
    DEFAULT_MAX_MICRO_BATCH_SIZE,
    DEFAULT_TIME_BUDGET_S,
    DEFAULT_WINDOW_S,
)
from hplan.runtime.capture.model_file import ModelFile, checked_loss
from hplan.runtime.capture.stage import StageModule, build_stage
from hplan.runtime.capture.trace import bind_inputs, target_name
from hplan.runtime.contract.cpus import usable_cpus
from hplan.runtime.contract.errors import ConfigError, ModelFileError, one_line
from hplan.runtime.contract.quantities import MS_PER_S

OnStep = Callable[[str, bool, int | None], None]
"""Progress callback, once per (unit, micro-batch size): the unit's name, whether it was
timed (False: it reuses an identical unit's timings), and the number of steps in all (None
while the first sweep is still choosing the sizes)."""


class _OutOfMemory(Exception):
    """A micro-batch size does not fit in the profiled device's memory (internal: the first
    sweep stops there; elsewhere it becomes a ``ConfigError``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitProfileOptions:
    """How to profile units."""

    micro_batch_sizes: tuple[int, ...] | None = None
    """Sizes to time; None: the first sweep chooses them, powers of two from 1 up to the first
    whose forward + backward of the whole model takes ``time_budget_s`` (beyond it a
    micro-batch's fixed overhead is lost in its per-sample time, and the cost model extends
    the line), the first that runs out of memory (left out), or ``max_micro_batch_size``."""
    max_micro_batch_size: int = DEFAULT_MAX_MICRO_BATCH_SIZE
    """Largest size the first sweep may choose (it also takes this size when it is no power
    of two)."""
    time_budget_s: float = DEFAULT_TIME_BUDGET_S
    """The first sweep stops after the size whose forward + backward of the whole model
    takes this long (it times sizes 1 and 2 at least)."""
    num_warmup: int = 2
    """Untimed forward + backward runs per unit and size before its window."""
    window_s: float = DEFAULT_WINDOW_S
    """Wall seconds each window lasts at least (one window per size and round)."""
    optimizer: bool = True
    seed: int = 0
    rounds: int = 3
    """Sweeps over all micro-batch sizes; each (unit, size) number is the median of its
    rounds' windows, its optimizer time likewise (memory is measured in the first round)."""
    whole_model: bool = True
    """Also time the whole model at each size and round (every forward in order, then every
    backward in reverse, as one micro-batch of a step runs them) and scale that size's unit
    times to sum to it. A unit timed alone runs its backward right after its own forward, on
    its own weights and activations again and again; in a step every other unit runs in
    between, and the units alone can make small micro-batches look cheaper than they train.
    The factors differ by size and are not all above 1. Skipped for a one-unit model and at a
    size where it runs out of memory."""

    def __post_init__(self) -> None:
        sizes = self.micro_batch_sizes
        if sizes is not None and (not sizes or min(sizes) < 1):
            raise ValueError(f"micro_batch_sizes {sizes} must be integers >= 1")
        if self.max_micro_batch_size < 1:
            raise ValueError(f"max_micro_batch_size {self.max_micro_batch_size} must be >= 1")
        if self.num_warmup < 0 or self.window_s < 0 or self.time_budget_s <= 0:
            raise ValueError("need num_warmup >= 0, window_s >= 0 and time_budget_s > 0")
        if self.rounds < 1:
            raise ValueError(f"rounds {self.rounds} must be >= 1")


@dataclass(frozen=True, slots=True)
class UnitProfile:
    """What :func:`profile_units` measured."""

    timings: tuple[UnitTiming, ...]
    """One per (unit, micro-batch size), in unit order, then size order."""
    shared_with: dict[str, str]
    """Unit -> the identical earlier unit whose timings it reuses (absent: timed itself)."""
    micro_batch_sizes: tuple[int, ...] = ()
    """The sizes timed, ascending (the first sweep's choice unless they were given)."""
    notes: tuple[str, ...] = ()
    """Why the first sweep stopped at its largest size."""


@dataclass
class _Unit:
    """One unit as a one-unit stage, with which received tensors need a gradient."""

    stage: StageModule
    grad_names: frozenset[str]
    signature: str


@dataclass
class _Link:
    """One unit of the chain at one micro-batch size."""

    name: str
    signature: str
    key: str
    """Signature and input shapes: units with the same key share their timings."""
    run: _UnitRun | None
    """The unit on its inputs (None: it shares an earlier unit's timings)."""
    step_run: _UnitRun
    """The unit on its inputs, timed or not (the whole-model window runs every unit)."""


class _Steps:
    """Forwards progress to an ``OnStep`` with the number of steps in all, once known."""

    def __init__(self, on_step: OnStep | None, total: int | None) -> None:
        self.on_step = on_step
        self.total = total

    def __call__(self, unit: str, timed: bool) -> None:
        if self.on_step is not None:
            self.on_step(unit, timed, self.total)


def profile_units(
    model_file: ModelFile,
    graph: ModelGraph,
    device: torch.device,
    device_key: str,
    options: UnitProfileOptions | None = None,
    on_step: OnStep | None = None,
) -> UnitProfile:
    """Measure every unit of ``graph`` on ``device`` at each micro-batch size.

    Args:
        model_file: supplies ``sample_batch``, ``loss_fn`` and ``make_optimizer``.
        graph: the model's cost graph (``build_model_graph``); its traced module is moved
            to ``device`` (its parameters are restored after each optimizer timing).
        device_key: the profile device key the timings are recorded under.

    Returns:
        The timings, which units reused an identical unit's timings, and the sizes timed.

    Raises:
        ModelFileError: ``sample_batch`` or ``loss_fn`` fail.
        ConfigError: a given size, or size 1, runs out of the device's memory.
    """
    options = options or UnitProfileOptions()
    fixed = options.micro_batch_sizes
    steps = _Steps(on_step, options.rounds * len(set(fixed)) * len(graph.units) if fixed else None)
    graph.traced_module().graph_module.to(device)
    units = _unit_stages(graph)
    profiler = _Profiler(model_file, device, device_key, options)
    with one_cpu_thread(device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        try:
            sizes, found, notes = _sweeps(profiler, graph, units, steps)
        except _OutOfMemory as exc:
            raise ConfigError(str(exc)) from None
    rounds: dict[tuple[str, int], list[UnitTiming]] = {}
    for timing in found:
        rounds.setdefault((timing.unit, timing.micro_batch_size), []).append(timing)
    order = {u.name: i for i, u in enumerate(graph.units)}
    merged = [_merged(group) for group in rounds.values()]
    ordered = tuple(sorted(merged, key=lambda t: (order[t.unit], t.micro_batch_size)))
    notes = (*notes, *whole_model_notes(profiler.whole_model_factors))
    return UnitProfile(ordered, dict(profiler.shared_with), sizes, notes)


def whole_model_notes(factors: Mapping[int, Sequence[tuple[float, float]]]) -> tuple[str, ...]:
    """One line on how the whole model's windows scaled the units' times, per size: the
    median over rounds of forward and backward factors (x1.10: the whole model took 10%
    longer than its units timed alone); a second line naming sizes where it ran out of
    memory (their units' times stand as timed)."""
    scaled = {size: rounds for size, rounds in sorted(factors.items()) if rounds}
    skipped = [size for size, rounds in sorted(factors.items()) if not rounds]
    notes = []
    if scaled:
        parts = ", ".join(
            f"{size}: forward x{statistics.median(f for f, _ in rounds):.2f}, "
            f"backward x{statistics.median(b for _, b in rounds):.2f}"
            for size, rounds in scaled.items()
        )
        notes.append(
            "unit times scaled to the whole model's forward + backward at each micro-batch "
            f"size (each unit had run alone, its backward right after its forward): {parts}"
        )
    if skipped:
        notes.append(
            "the whole model ran out of memory at micro-batch sizes "
            f"{', '.join(map(str, skipped))}: their unit times stand as timed alone"
        )
    return tuple(notes)


def _sweeps(
    profiler: _Profiler, graph: ModelGraph, units: Sequence[_Unit], steps: _Steps
) -> tuple[tuple[int, ...], list[UnitTiming], tuple[str, ...]]:
    """Every round's timings: the first sweep's (which may choose the sizes), then the
    others over its sizes, alternately descending and ascending."""
    sizes, found, notes = _first_sweep(profiler, graph, units, steps)
    steps.total = profiler.options.rounds * len(sizes) * len(units)
    for round_idx in range(1, profiler.options.rounds):
        profiler.start_round()
        for size in sizes if round_idx % 2 == 0 else reversed(sizes):
            found += profiler.profile_size(graph, units, size, steps)
    return sizes, found, notes


def first_sweep_sizes(max_micro_batch_size: int) -> list[int]:
    """Sizes the first sweep may try, ascending: powers of two below the maximum, then the
    maximum (``24 -> [1, 2, 4, 8, 16, 24]``)."""
    sizes = [2**i for i in range(max_micro_batch_size.bit_length()) if 2**i < max_micro_batch_size]
    return [*sizes, max_micro_batch_size]


def _first_sweep(
    profiler: _Profiler, graph: ModelGraph, units: Sequence[_Unit], steps: _Steps
) -> tuple[tuple[int, ...], list[UnitTiming], tuple[str, ...]]:
    """The first round: the given sizes, or sizes chosen as it goes
    (``UnitProfileOptions.micro_batch_sizes``)."""
    options = profiler.options
    profiler.start_round()
    if options.micro_batch_sizes is not None:
        sizes = tuple(sorted(set(options.micro_batch_sizes)))
        found = [t for size in sizes for t in profiler.profile_size(graph, units, size, steps)]
        return sizes, found, ()
    swept: list[int] = []
    found = []
    note = f"micro-batch sizes up to {options.max_micro_batch_size} (the largest allowed)"
    for size in first_sweep_sizes(options.max_micro_batch_size):
        try:
            timings = profiler.profile_size(graph, units, size, steps)
        except _OutOfMemory:
            if not swept:
                raise
            note = (
                f"micro-batch size {size} ran out of memory on {profiler.device}; sizes up to "
                f"{swept[-1]} timed"
            )
            break
        swept.append(size)
        found += timings
        total_s = sum(t.forward_s.median + t.backward_s.median for t in timings)
        if total_s >= options.time_budget_s and size >= 2:
            note = (
                f"micro-batch sizes up to {size}: forward + backward of the whole model took "
                f"{total_s * MS_PER_S:.0f} ms there (the sweep stops past "
                f"{options.time_budget_s * MS_PER_S:.0f} ms; larger sizes follow the line)"
            )
            break
    return tuple(swept), found, (note,)


def _merged(rounds: Sequence[UnitTiming]) -> UnitTiming:
    """One (unit, size)'s rounds as one timing: each round's window a sample of the
    forward and backward ``Stat``, the median optimizer time; memory from the first round."""
    optimizer = [r.optimizer_s for r in rounds if r.optimizer_s is not None]
    return replace(
        rounds[0],
        forward_s=Stat.of([r.forward_s.median for r in rounds]),
        backward_s=Stat.of([r.backward_s.median for r in rounds]),
        optimizer_s=statistics.median(optimizer) if optimizer else None,
    )


def _unit_stages(graph: ModelGraph) -> list[_Unit]:
    traced = graph.traced_module()
    num_units = len(graph.units)
    result = []
    for idx, unit in enumerate(graph.units):
        recv = [t.name for t in graph.cuts[idx - 1]] if idx > 0 else []
        send = [t.name for t in graph.cuts[idx]] if idx < num_units - 1 else []
        stage = build_stage(traced, graph.units, [unit.name], recv=recv, send=send)
        grads = {t.name for t in graph.cuts[idx - 1] if t.requires_grad} if idx > 0 else set()
        result.append(_Unit(stage, frozenset(grads), structure_signature(stage)))
    return result


class _Profiler:
    """Times units at one micro-batch size after another; shares identical units."""

    def __init__(
        self,
        model_file: ModelFile,
        device: torch.device,
        device_key: str,
        options: UnitProfileOptions,
    ) -> None:
        self.model_file = model_file
        self.device = device
        self.device_key = device_key
        self.options = options
        self.watch = Stopwatch(device, quota_cores=usable_cpus().quota_cores)
        self.binder = _signature_module(model_file)
        self.shared: dict[str, UnitTiming] = {}
        """This round's timings by unit key (identical units share them)."""
        self.first_round: dict[str, UnitTiming] = {}
        """The first round's timings by unit key: their memory serves the later rounds."""
        self.optimizer_s: dict[str, float] = {}
        self.shared_with: dict[str, str] = {}
        self.whole_model_factors: dict[int, list[tuple[float, float]]] = {}
        """Size -> each round's (forward, backward) factor from the whole model's window
        (an empty list: it ran out of memory there)."""

    def start_round(self) -> None:
        """Time every unit again (memory and optimizer are kept from the first round)."""
        if not self.first_round:
            self.first_round = self.shared
        self.shared = {}
        self.optimizer_s = {}

    def profile_size(
        self,
        graph: ModelGraph,
        units: Sequence[_Unit],
        size: int,
        notify: Callable[[str, bool], None],
    ) -> list[UnitTiming]:
        """Every unit's timing at ``size``; the units not yet timed this round in one window.

        Raises:
            _OutOfMemory: ``size`` runs out of the device's memory.
        """
        try:
            chain = self._chain(graph, units, size)
            self._time([link for link in chain if link.run is not None], size)
        except RuntimeError as exc:
            if not _out_of_memory(exc):
                raise
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise _OutOfMemory(
                f"micro-batch size {size} runs out of memory on {self.device}; profile smaller "
                "--micro-batch-sizes"
            ) from None
        timings = []
        for link in chain:
            timing = self.shared[link.key]
            if timing.unit != link.name:
                self.shared_with.setdefault(link.name, timing.unit)
                timing = replace(timing, unit=link.name)
            timings.append(timing)
            notify(link.name, link.run is not None)
        if self.options.whole_model and len(chain) > 1:
            timings = self._scaled_to_whole_model(chain, timings, size)
        return timings

    def _scaled_to_whole_model(
        self, chain: Sequence[_Link], timings: list[UnitTiming], size: int
    ) -> list[UnitTiming]:
        """``timings`` (this round's, one per link) with forward and backward times scaled
        to sum to the whole model's at ``size`` (module docstring); as they were when the
        whole model runs out of memory there."""
        whole = self._time_whole_model([link.step_run for link in chain])
        if whole is None:
            self.whole_model_factors.setdefault(size, [])
            return timings
        units_forward_s = sum(t.forward_s.median for t in timings)
        units_backward_s = sum(t.backward_s.median for t in timings)
        if units_forward_s <= 0 or units_backward_s <= 0:
            return timings
        forward_factor, backward_factor = whole[0] / units_forward_s, whole[1] / units_backward_s
        self.whole_model_factors.setdefault(size, []).append((forward_factor, backward_factor))
        return [
            replace(
                t,
                forward_s=Stat.of([t.forward_s.median * forward_factor]),
                backward_s=Stat.of([t.backward_s.median * backward_factor]),
            )
            for t in timings
        ]

    def _time_whole_model(self, runs: Sequence[_UnitRun]) -> tuple[float, float] | None:
        """Mean seconds of every unit's forward in order and of every backward in reverse,
        after warm-up, in one window; None when it runs out of the device's memory."""
        held: list[dict[str, Any]] = []

        def forward() -> None:
            for run in runs:
                run.clear_input_grads()
                held.append(run.forward())

        def backward() -> None:
            for run in reversed(runs):
                run.backward(held.pop())

        try:
            for _ in range(self.options.num_warmup):
                forward()
                backward()
            forward_s, backward_s = self.watch.window([forward, backward], self.options.window_s)
        except RuntimeError as exc:
            if not _out_of_memory(exc):
                raise
            held.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return None
        finally:
            for run in runs:
                run.clear_grads()
        return forward_s, backward_s

    def _chain(self, graph: ModelGraph, units: Sequence[_Unit], size: int) -> list[_Link]:
        """The units at ``size``, each on what its predecessor sends; runs for the units
        whose key is new this round."""
        inputs, targets = _sample(self.model_file, size)
        feed = {k: v.to(self.device) for k, v in bind_inputs(self.binder, inputs).items()}
        targets = _to_device(targets, self.device)
        boundary: dict[str, Tensor] = {}
        seen = set(self.shared)
        chain = []
        for unit, spec in zip(units, graph.units, strict=True):
            received = {n: _leaf(boundary[n], n in unit.grad_names) for n in unit.stage.recv_names}
            key = f"{unit.signature}|{_shapes(feed, unit.stage.input_names, received)}"
            run = _UnitRun(self.model_file, unit.stage, feed, received, targets)
            chain.append(_Link(spec.name, unit.signature, key, None if key in seen else run, run))
            seen.add(key)
            outputs = run.forward_no_grad()
            boundary = {n: outputs[n].detach() for n in unit.stage.send_names}
        return chain

    def _time(self, links: Sequence[_Link], size: int) -> None:
        """Warm up, then one window over every link's forward and backward; the optimizer
        steps not yet timed this round; memory in the first round."""
        runs = [link.run for link in links if link.run is not None]
        for run in runs:
            for _ in range(self.options.num_warmup):
                run.backward(run.forward())
            run.clear_grads()
        calls = [call for run in runs for call in _laps(run)]
        means_s = self.watch.window(calls, self.options.window_s) if calls else []
        for run in runs:
            run.clear_grads()
        if self.options.optimizer:
            self._time_optimizers(links)
        for idx, link in enumerate(links):
            self.shared[link.key] = self._timing(link, size, means_s[2 * idx], means_s[2 * idx + 1])

    def _timing(self, link: _Link, size: int, forward_s: float, backward_s: float) -> UnitTiming:
        run = link.run
        assert run is not None
        earlier = self.first_round.get(link.key)
        if earlier is not None:
            return replace(
                earlier,
                unit=link.name,
                forward_s=Stat.of([forward_s]),
                backward_s=Stat.of([backward_s]),
                optimizer_s=self.optimizer_s.get(link.signature),
            )
        memory = measure_unit_memory(
            run.forward, run.backward, device=self.device, resident=run.resident()
        )
        return UnitTiming(
            device=self.device_key,
            unit=link.name,
            micro_batch_size=size,
            forward_s=Stat.of([forward_s]),
            backward_s=Stat.of([backward_s]),
            optimizer_s=self.optimizer_s.get(link.signature),
            activation_bytes=memory.activation_bytes,
            peak_bytes=memory.peak_bytes,
        )

    def _time_optimizers(self, links: Sequence[_Link]) -> None:
        """One window over the optimizer step of every signature not yet timed this round
        (each over its unit's trainable parameters; 0 s without any).

        The parameters are restored afterwards: a window takes hundreds of steps on one
        gradient, which would drive them far enough (attention logits to inf) to slow every
        later forward and backward of the profile."""
        todo: dict[str, _UnitRun] = {}
        for link in links:
            if link.run is not None and link.signature not in self.optimizer_s:
                todo.setdefault(link.signature, link.run)
        optimizers = {}
        saved: list[tuple[Tensor, Tensor]] = []
        for signature, run in todo.items():
            params = [p for p in run.stage.parameters() if p.requires_grad]
            if not params:
                self.optimizer_s[signature] = 0.0
                continue
            saved += [(p, p.detach().to("cpu", copy=True)) for p in params]
            run.backward(run.forward())
            optimizer = self.model_file.optimizer(params)
            optimizer.step()  # creates the state
            optimizers[signature] = optimizer
        steps = [optimizer.step for optimizer in optimizers.values()]
        means_s = self.watch.window(steps, self.options.window_s) if steps else []
        for (signature, optimizer), mean_s in zip(optimizers.items(), means_s, strict=True):
            self.optimizer_s[signature] = mean_s
            optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for param, value in saved:
                param.copy_(value)
        for run in todo.values():
            run.clear_grads()


def _laps(run: _UnitRun) -> list[Callable[[], object]]:
    """The forward and the backward of ``run`` as two calls of one window's iteration (a unit's
    sample is the mean of its laps in the window)."""
    holder: list[dict[str, Any]] = []

    def forward() -> None:
        run.clear_input_grads()
        holder.append(run.forward())

    def backward() -> None:
        run.backward(holder.pop())

    return [forward, backward]


def _out_of_memory(exc: RuntimeError) -> bool:
    """A CUDA out-of-memory error, or the CPU allocator's."""
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


class _UnitRun:
    """Forward and backward of one unit on fixed inputs (the runtime's stage semantics): the
    last stage's backward starts from the loss, another's from fixed random gradients of what
    it sends; parameter gradients accumulate over a window, as over a step's micro-batches."""

    def __init__(
        self,
        model_file: ModelFile,
        stage: StageModule,
        feed: Mapping[str, Tensor],
        received: Mapping[str, Tensor],
        targets: Any,
    ) -> None:
        self.model_file = model_file
        self.stage = stage
        self.feed = feed
        self.received = received
        self.targets = targets
        self._grads: dict[str, Tensor] | None = None

    def forward(self) -> dict[str, Any]:
        outputs = self.stage(self.feed, self.received)
        if self.stage.is_last:
            outputs = {"loss": checked_loss(self.model_file, outputs["output"], self.targets)}
        return outputs

    def forward_no_grad(self) -> dict[str, Any]:
        with torch.no_grad():
            return self.stage(self.feed, self.received)

    def backward(self, outputs: Mapping[str, Any]) -> None:
        if self.stage.is_last:
            loss = outputs["loss"]
            if loss.requires_grad:
                loss.backward()
            return
        if self._grads is None:
            self._grads = {
                name: torch.randn_like(value)
                for name, value in outputs.items()
                if isinstance(value, Tensor) and value.requires_grad
            }
        pairs = [(outputs[name], grad) for name, grad in self._grads.items()]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def clear_grads(self) -> None:
        for tensor in (*self.stage.parameters(), *self.received.values()):
            tensor.grad = None

    def clear_input_grads(self) -> None:
        """Drop the received tensors' gradients (a stage receives them anew per micro-batch;
        parameter gradients accumulate)."""
        for tensor in self.received.values():
            tensor.grad = None

    def resident(self) -> list[Tensor]:
        return [
            *self.stage.parameters(),
            *self.stage.buffers(),
            *self.feed.values(),
            *self.received.values(),
        ]


def _sample(model_file: ModelFile, size: int) -> tuple[Any, Any]:
    try:
        inputs, targets = model_file.sample_batch(size)
    except Exception as exc:
        raise ModelFileError(
            f"sample_batch({size}) in {str(model_file.path)!r} raised {one_line(exc)}; fix "
            "model.py or profile other --micro-batch-sizes"
        ) from None
    return inputs, targets


def _leaf(tensor: Tensor, requires_grad: bool) -> Tensor:
    leaf = tensor.detach()
    return leaf.requires_grad_(requires_grad and leaf.is_floating_point())


def _to_device(value: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map(
        lambda x: x.to(device) if isinstance(x, Tensor) else x, value
    )


def _shapes(
    feed: Mapping[str, Tensor], names: Sequence[str], received: Mapping[str, Tensor]
) -> str:
    """Shapes, dtypes and grad flags of a unit's inputs, positionally (names differ per unit)."""
    values = [feed[n] for n in names] + list(received.values())
    return ";".join(f"{tuple(t.shape)}:{t.dtype}:{t.requires_grad}" for t in values)


def _signature_module(model_file: ModelFile) -> nn.Module:
    """A model instance whose ``forward`` signature names ``sample_batch``'s inputs.

    Built on the meta device when the model allows it (no memory), else on the CPU.
    """
    try:
        with torch.device("meta"):
            return model_file.build_model()
    except Exception:
        return model_file.build_model()


def structure_signature(stage: StageModule) -> str:
    """A digest of what a one-unit stage computes, independent of its names.

    Covers every node's op, its target (a module as its class, its configuration and its
    parameter/buffer shapes; a function by qualified name; an attribute by shape and dtype),
    and its arguments (earlier nodes by position, constants by value).
    """
    gm = stage.graph_module
    position: dict[torch.fx.Node, int] = {}
    parts = [f"last={stage.is_last}"]
    for idx, node in enumerate(gm.graph.nodes):
        position[node] = idx
        args = torch.fx.map_arg((node.args, node.kwargs), lambda n: f"%{position[n]}")
        parts.append(f"{node.op}|{_target_text(gm, node)}|{args!r}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _target_text(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        tensors = [
            f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}"
            for name, t in (*module.named_parameters(), *module.named_buffers())
        ]
        settings = {
            k: v
            for k, v in vars(module).items()
            if not k.startswith("_") and isinstance(v, int | float | bool | str | tuple | None)
        }
        return f"{type(module).__qualname__}|{module!r}|{tensors}|{sorted(settings.items())}"
    if node.op == "get_attr":
        value = _attr(gm, str(node.target))
        if isinstance(value, Tensor):
            return f"tensor:{tuple(value.shape)}:{value.dtype}:{value.requires_grad}"
        return type(value).__qualname__
    if node.op in ("placeholder", "output"):
        return node.op
    return target_name(node.target)


def _attr(gm: torch.fx.GraphModule, path: str) -> Any:
    value: Any = gm
    for part in path.split("."):
        value = getattr(value, part)
    return value
