"""Per-unit model profile: forward, backward and optimizer time and memory of each unit.

Each partition unit of the model's cost graph runs alone as a one-unit pipeline stage
(``hplan.runtime.capture.stage.build_stage``, exactly what a rank of that unit would run), on its
real inputs: the model runs once per micro-batch size as a chain of one-unit stages, so
every unit receives the boundary tensors its predecessor sends (hidden states, int
position ids, masks ...). Per (unit, micro-batch size):

- forward and backward seconds (warm-up, then repeated timing; median and spread), in
  ``rounds`` sweeps over all sizes (alternately ascending and descending) whose medians
  are combined by their median: a machine whose speed drifts during the profile (clocks,
  neighbours; on this project's 2-core VM one sweep measured micro-batches 1-4 25-40%
  faster than the next minutes ran) then skews no size by more than one round. The
  last unit's forward includes the model file's ``loss_fn`` and its backward starts from
  the loss, as the runtime's last stage does; other units' backward starts from random
  gradients of what they send;
- the optimizer step of the unit's parameters (the model file's ``make_optimizer``, else
  AdamW), timed once per unit and recorded at every size;
- activation and peak bytes (``unit_memory.py``).

Identical repeated units (the same stage graph, the same module classes, configuration and
parameter shapes, the same input shapes and dtypes) are timed once and share the result.
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
from hplan.runtime.capture.model_file import ModelFile, checked_loss
from hplan.runtime.capture.stage import StageModule, build_stage
from hplan.runtime.capture.trace import bind_inputs, target_name
from hplan.runtime.contract.errors import ModelFileError, one_line

OnStep = Callable[[str, bool, int], None]
"""Progress callback, once per (unit, micro-batch size): the unit's name, whether it was
timed (False: it reuses an identical unit's timings), and the number of steps in all."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitProfileOptions:
    """How to profile units."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    num_warmup: int = 2
    min_samples: int = 5
    """Timed runs per (unit, size), at least."""
    max_samples: int = 30
    min_time_s: float = 0.05
    """Keep timing until this many seconds of forward + backward were timed (or
    ``max_samples``)."""
    optimizer: bool = True
    seed: int = 0
    rounds: int = 3
    """Sweeps over all micro-batch sizes; each (unit, size) median is the median of its
    rounds' medians, its optimizer time likewise (memory is measured in the first round)."""

    def __post_init__(self) -> None:
        if not self.micro_batch_sizes or min(self.micro_batch_sizes) < 1:
            raise ValueError(f"micro_batch_sizes {self.micro_batch_sizes} must be integers >= 1")
        if self.min_samples < 1 or self.max_samples < self.min_samples or self.num_warmup < 0:
            raise ValueError("need num_warmup >= 0 and 1 <= min_samples <= max_samples")
        if self.rounds < 1:
            raise ValueError(f"rounds {self.rounds} must be >= 1")


@dataclass(frozen=True, slots=True)
class UnitProfile:
    """What :func:`profile_units` measured."""

    timings: tuple[UnitTiming, ...]
    """One per (unit, micro-batch size), in unit order, then size order."""
    shared_with: dict[str, str]
    """Unit -> the identical earlier unit whose timings it reuses (absent: timed itself)."""


@dataclass
class _Unit:
    """One unit as a one-unit stage, with which received tensors need a gradient."""

    stage: StageModule
    grad_names: frozenset[str]
    signature: str


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
            to ``device`` and its parameters are changed by the optimizer timing.
        device_key: the profile device key the timings are recorded under.

    Returns:
        The timings, and which units reused an identical unit's timings.

    Raises:
        ModelFileError: ``sample_batch`` or ``loss_fn`` fail.
    """
    options = options or UnitProfileOptions()
    sizes = sorted(set(options.micro_batch_sizes))
    total = options.rounds * len(sizes) * len(graph.units)
    notify = on_step or (lambda _unit, _timed, _total: None)
    graph.traced_module().graph_module.to(device)
    units = _unit_stages(graph)
    profiler = _Profiler(model_file, device, device_key, options)
    rounds: dict[tuple[str, int], list[UnitTiming]] = {}
    with one_cpu_thread(device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        for round_idx in range(options.rounds):
            profiler.start_round()
            for size in sizes if round_idx % 2 == 0 else reversed(sizes):
                for timing in profiler.profile_size(
                    graph, units, size, lambda unit, timed: notify(unit, timed, total)
                ):
                    rounds.setdefault((timing.unit, size), []).append(timing)
    order = {u.name: i for i, u in enumerate(graph.units)}
    merged = [_merged(found) for found in rounds.values()]
    ordered = tuple(sorted(merged, key=lambda t: (order[t.unit], t.micro_batch_size)))
    return UnitProfile(ordered, dict(profiler.shared_with))


def _merged(rounds: Sequence[UnitTiming]) -> UnitTiming:
    """One (unit, size)'s rounds as one timing: the median of each statistic and of the
    optimizer time over the rounds, the samples summed; memory from the first round."""

    def combined(stats: Sequence[Stat]) -> Stat:
        return Stat(
            median=statistics.median(s.median for s in stats),
            p10=statistics.median(s.p10 for s in stats),
            p90=statistics.median(s.p90 for s in stats),
            num_samples=sum(s.num_samples for s in stats),
        )

    optimizer = [r.optimizer_s for r in rounds if r.optimizer_s is not None]
    return replace(
        rounds[0],
        forward_s=combined([r.forward_s for r in rounds]),
        backward_s=combined([r.backward_s for r in rounds]),
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
        self.watch = Stopwatch(device)
        self.binder = _signature_module(model_file)
        self.shared: dict[str, UnitTiming] = {}
        """This round's timings by unit key (identical units share them)."""
        self.first_round: dict[str, UnitTiming] = {}
        """The first round's timings by unit key: their memory serves the later rounds."""
        self.optimizer_s: dict[str, float] = {}
        self.shared_with: dict[str, str] = {}

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
        inputs, targets = _sample(self.model_file, size)
        feed = {k: v.to(self.device) for k, v in bind_inputs(self.binder, inputs).items()}
        targets = _to_device(targets, self.device)
        boundary: dict[str, Tensor] = {}
        timings = []
        for unit, spec in zip(units, graph.units, strict=True):
            received = {n: _leaf(boundary[n], n in unit.grad_names) for n in unit.stage.recv_names}
            key = f"{unit.signature}|{_shapes(feed, unit.stage.input_names, received)}"
            run = _UnitRun(self.model_file, unit.stage, feed, received, targets)
            timed = key not in self.shared
            if timed:
                timing, outputs = self._measure(run, spec.name, unit.signature, size, key)
                self.shared[key] = timing
            else:
                timing = replace(self.shared[key], unit=spec.name)
                self.shared_with.setdefault(spec.name, self.shared[key].unit)
                outputs = run.forward_no_grad()
            timings.append(timing)
            boundary = {n: outputs[n].detach() for n in unit.stage.send_names}
            notify(spec.name, timed)
        return timings

    def _measure(
        self, run: _UnitRun, unit: str, signature: str, size: int, key: str
    ) -> tuple[UnitTiming, dict[str, Any]]:
        options = self.options
        for _ in range(options.num_warmup):
            run.backward(run.forward())
        forward_s: list[float] = []
        backward_s: list[float] = []
        while len(forward_s) < options.min_samples or (
            sum(forward_s) + sum(backward_s) < options.min_time_s
            and len(forward_s) < options.max_samples
        ):
            run.clear_grads()
            fwd, bwd = self._sample(run)
            forward_s.append(fwd)
            backward_s.append(bwd)
        run.clear_grads()
        if options.optimizer and signature not in self.optimizer_s:
            self.optimizer_s[signature] = self._optimizer_s(run)
        earlier = self.first_round.get(key)
        if earlier is not None:
            timing = replace(
                earlier,
                unit=unit,
                forward_s=Stat.of(forward_s),
                backward_s=Stat.of(backward_s),
                optimizer_s=self.optimizer_s.get(signature),
            )
            return timing, run.forward_no_grad()
        memory = measure_unit_memory(
            run.forward, run.backward, device=self.device, resident=run.resident()
        )
        timing = UnitTiming(
            device=self.device_key,
            unit=unit,
            micro_batch_size=size,
            forward_s=Stat.of(forward_s),
            backward_s=Stat.of(backward_s),
            optimizer_s=self.optimizer_s.get(signature),
            activation_bytes=memory.activation_bytes,
            peak_bytes=memory.peak_bytes,
        )
        return timing, run.forward_no_grad()

    def _sample(self, run: _UnitRun) -> tuple[float, float]:
        """Seconds of one forward and of its backward."""
        holder: list[Any] = []
        fwd_s, bwd_s = self.watch.laps(
            [lambda: holder.append(run.forward()), lambda: run.backward(holder[0])]
        )
        return fwd_s, bwd_s

    def _optimizer_s(self, run: _UnitRun) -> float:
        """Median seconds of one optimizer step over the unit's trainable parameters."""
        params = [p for p in run.stage.parameters() if p.requires_grad]
        if not params:
            return 0.0
        run.backward(run.forward())
        optimizer = self.model_file.optimizer(params)
        optimizer.step()  # creates the state
        samples = [self.watch.laps([optimizer.step])[0] for _ in range(self.options.min_samples)]
        optimizer.zero_grad(set_to_none=True)
        return statistics.median(samples)


class _UnitRun:
    """Forward and backward of one unit on fixed inputs (the runtime's stage semantics)."""

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
