"""Cost graph of a traced model: per-node and per-unit FLOPs, bytes and boundaries.

``build_model_graph`` traces the model, runs it node by node (a torch.fx Interpreter) at
two batch sizes and measures, per node: the output shapes and dtypes, FLOPs
(``torch.utils.flop_counter.FlopCounterMode``), bytes read and written, and bytes saved
for backward (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once).
Per-sample figures are the difference between the two runs divided by the difference of
the batch sizes, so parameters cancel out. It runs on the meta device when the model
allows it (no memory, no compute) and falls back to real CPU tensors.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import FlopCounterMode

from hplan.planner.units import assign_units, module_path
from hplan.runtime.errors import HplanError, ModelFileError
from hplan.runtime.model_file import ModelFile
from hplan.runtime.plan import InputSpec, TensorSpec, UnitSpec
from hplan.runtime.stage import crossing_values, node_units, replicable_nodes
from hplan.runtime.trace import TracedModel, bind_inputs, trace_model


@dataclass(frozen=True, slots=True)
class UnitCost:
    """What one partition unit costs, independent of the device.

    All per-sample figures are for one sample of the model's input (e.g. one sequence).
    """

    name: str
    fwd_flops_per_sample: float
    """Forward FLOPs per sample (backward is estimated by the cost model)."""
    param_bytes: int
    """Bytes of the parameters the unit uses (a tied parameter counts in every unit using it)."""
    trainable_param_bytes: int
    """Bytes of the unit's parameters with requires_grad (what gradients and optimizer hold)."""
    buffer_bytes: int
    activation_bytes_per_sample: float
    """Bytes saved for backward per sample (measured with saved-tensor hooks)."""
    io_bytes_per_sample: float
    """Bytes the unit's ops read and write per sample (memory-traffic estimate)."""
    num_ops: int
    """Graph nodes in the unit (a proxy for kernel-launch overhead)."""


@dataclass(frozen=True)
class ModelGraph:
    """The traced model, split into partition units, with costs and cut tensors."""

    traced: TracedModel
    units: tuple[UnitSpec, ...]
    unit_costs: tuple[UnitCost, ...]
    cuts: tuple[tuple[TensorSpec, ...], ...]
    """cuts[i]: tensors crossing a boundary placed between unit i and unit i+1."""
    inputs: tuple[InputSpec, ...]
    param_dtype: str
    """torch dtype name of most parameter bytes, e.g. ``float32``."""
    graph: nx.DiGraph
    """One node per fx node (attributes: op, unit, flops, output_bytes, module_path)."""
    notes: tuple[str, ...]
    """Human-readable notes (trace fallbacks, merged units)."""

    def cut_bytes_per_sample(self, cut_idx: int) -> float:
        """Bytes per sample crossing cut ``cut_idx`` (batched tensors only), forward."""
        return float(sum(_bytes_per_sample(t) for t in self.cuts[cut_idx]))

    def cut_grad_bytes_per_sample(self, cut_idx: int) -> float:
        """Bytes per sample of gradients sent back across cut ``cut_idx``."""
        return float(sum(_bytes_per_sample(t) for t in self.cuts[cut_idx] if t.requires_grad))


_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a torch dtype name (``float32`` -> 4)."""
    return _DTYPE_BYTES[dtype]


def _bytes_per_sample(spec: TensorSpec) -> float:
    numel = 1
    for dim in spec.shape:
        numel *= dim
    return float(numel * dtype_bytes(spec.dtype))


# ----------------------------------------------------------------------- the builder
def build_model_graph(
    model_file: ModelFile,
    *,
    batch_sizes: tuple[int, int] = (2, 3),
    leaf_modules: Sequence[str] = (),
    seed: int = 0,
) -> ModelGraph:
    """Trace a model file's model and measure what each node and unit costs.

    Args:
        model_file: the loaded model file; ``build_model`` runs after
            ``torch.manual_seed(seed)`` and ``sample_batch`` gives the example inputs.
        batch_sizes: the two batch sizes to measure at (distinct, >= 1).
        leaf_modules: module paths or class names to keep whole, besides the model
            file's ``LEAF_MODULES``.
        seed: RNG seed for building the model and the sample batches.

    Returns:
        The model graph: units, per-unit costs (per-sample figures for one sample),
        the tensors crossing every possible cut, the graph inputs and a networkx DiGraph
        (node attributes ``op``, ``unit``, ``flops``, ``output_bytes``, ``module_path``,
        per sample; edge attribute ``bytes``, per sample).

    Raises:
        ModelFileError: ``build_model``/``sample_batch`` raise or give unusable inputs.
        TraceError: the model cannot be traced or its graph cannot run.
        ValueError: ``batch_sizes`` are not two distinct positive integers.
    """
    small, large = _check_batch_sizes(batch_sizes)
    with torch.random.fork_rng(devices=[]):
        model = _build(model_file, seed)
        inputs = {b: _sample_inputs(model_file, model, b) for b in (small, large)}
    leaves = (*leaf_modules, *model_file.leaf_modules)
    traced = trace_model(model, inputs[small], leaf_modules=leaves)
    runs, measure_notes = _measure(model_file, traced, inputs, seed)
    costs = {
        name: _per_sample(name, runs[small][name], runs[large][name], small, large)
        for name in runs[small]
    }
    specs = {name: c.spec for name, c in costs.items() if c.spec is not None}
    units, unit_notes = assign_units(traced, set(specs))
    gm = traced.graph_module
    node_unit = node_units(gm, units)
    replicable = replicable_nodes(gm)
    cuts = tuple(
        tuple(specs[n] for n in crossing_values(gm, node_unit, i, replicable=replicable))
        for i in range(len(units) - 1)
    )
    return ModelGraph(
        traced=traced,
        units=units,
        unit_costs=_unit_costs(model, traced, units, node_unit, costs),
        cuts=cuts,
        inputs=_input_specs(traced, units, node_unit, costs, replicable),
        param_dtype=_param_dtype(model),
        graph=_nx_graph(traced, units, node_unit, costs),
        notes=(*traced.notes, *unit_notes, *measure_notes),
    )


def _check_batch_sizes(batch_sizes: tuple[int, int]) -> tuple[int, int]:
    small, large = sorted(batch_sizes)
    if small < 1 or small == large:
        raise ValueError(f"batch_sizes {batch_sizes} must be two distinct integers >= 1")
    return small, large


def _build(model_file: ModelFile, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    try:
        model = model_file.build_model()
    except HplanError:
        raise
    except Exception as exc:
        raise ModelFileError(
            f"build_model() in {str(model_file.path)!r} raised {_one_line(exc)}; fix model.py"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(
            f"build_model() returned a {type(model).__name__}; return a torch.nn.Module"
        )
    return model


def _sample_inputs(
    model_file: ModelFile, model: torch.nn.Module, batch_size: int
) -> dict[str, torch.Tensor]:
    try:
        batch = model_file.sample_batch(batch_size)
    except Exception as exc:
        raise ModelFileError(
            f"sample_batch({batch_size}) in {str(model_file.path)!r} raised "
            f"{_one_line(exc)}; fix model.py"
        ) from None
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ModelFileError(
            f"sample_batch({batch_size}) must return (inputs, targets), got "
            f"{type(batch).__name__}; fix model.py"
        )
    return bind_inputs(model, batch[0])


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


# ----------------------------------------------------------------------- measuring
@dataclass(frozen=True)
class _NodeRun:
    """What one node did at one batch size (bytes and FLOPs for the whole batch)."""

    tensor: tuple[tuple[int, ...], str, bool] | None
    """(shape, dtype, requires_grad) if the output is one tensor."""
    flops: float
    saved_bytes: int
    read_bytes: int
    written_bytes: int
    output_bytes: int


@dataclass(frozen=True)
class _NodeCost:
    """Per-sample figures of one node; ``spec`` if its output may cross a cut."""

    flops: float
    saved_bytes: float
    io_bytes: float
    output_bytes: float
    spec: TensorSpec | None


class _Meter(torch.fx.Interpreter):
    """Runs a graph node by node and records FLOPs, bytes and saved tensors per node."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.runs: dict[str, _NodeRun] = {}
        self._seen: set[StorageWeakRef] = set()
        self._keep: list[torch.Tensor] = []
        self._saved: list[torch.Tensor] = []
        self._counter = FlopCounterMode(display=False)

    def measure(self, args: Sequence[torch.Tensor]) -> dict[str, _NodeRun]:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        with self._counter, hooks, _warnings_ignored():
            self.run(*args, enable_io_processing=False)
        self._keep.clear()
        return self.runs

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._saved.append(tensor)
        return tensor

    def run_node(self, n: torch.fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        flops_before = self._counter.get_total_flops()
        self._saved = []
        result = super().run_node(n)
        inputs = _tensors((args, kwargs))
        outputs = _tensors(result)
        saved = 0
        for tensor in self._saved:
            key = StorageWeakRef(tensor.untyped_storage())
            if key not in self._seen:
                self._seen.add(key)
                self._keep.append(tensor)
                saved += tensor.untyped_storage().nbytes()
        moves = n.op not in ("placeholder", "get_attr")
        in_storages = {StorageWeakRef(t.untyped_storage()) for t in inputs}
        fresh = [t for t in outputs if StorageWeakRef(t.untyped_storage()) not in in_storages]
        self.runs[n.name] = _NodeRun(
            tensor=_tensor_info(result),
            flops=float(self._counter.get_total_flops() - flops_before),
            saved_bytes=saved,
            read_bytes=sum(_nbytes(t) for t in inputs) if moves else 0,
            written_bytes=sum(_nbytes(t) for t in fresh) if moves else 0,
            output_bytes=sum(_nbytes(t) for t in outputs),
        )
        return result


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def _warnings_ignored() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _tensor_info(value: Any) -> tuple[tuple[int, ...], str, bool] | None:
    if not isinstance(value, torch.Tensor):
        return None
    dtype = str(value.dtype).removeprefix("torch.")
    return tuple(value.shape), dtype, value.requires_grad and value.is_floating_point()


def _measure(
    model_file: ModelFile,
    traced: TracedModel,
    inputs: Mapping[int, Mapping[str, torch.Tensor]],
    seed: int,
) -> tuple[dict[int, dict[str, _NodeRun]], list[str]]:
    """Node runs at each batch size: on the meta device if possible, else on CPU."""
    try:
        return _measure_meta(model_file, traced, inputs, seed), []
    except Exception as exc:
        note = f"measured on CPU tensors: the meta device failed ({_one_line(exc)})"
    runs = {}
    gm = traced.graph_module
    saved = {name: b.detach().clone() for name, b in gm.named_buffers()}
    for batch_size, feed in inputs.items():
        args = [feed[name] for name in traced.input_names]
        try:
            runs[batch_size] = _Meter(gm).measure(args)
        except Exception as exc:
            raise ModelFileError(
                f"the traced graph fails at batch size {batch_size} ({_one_line(exc)}); check "
                "that dim 0 of every sample_batch input is the sample dimension"
            ) from None
        finally:
            with torch.no_grad():
                for name, buffer in gm.named_buffers():
                    buffer.copy_(saved[name])
    return runs, [note]


def _measure_meta(
    model_file: ModelFile,
    traced: TracedModel,
    inputs: Mapping[int, Mapping[str, torch.Tensor]],
    seed: int,
) -> dict[int, dict[str, _NodeRun]]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = model_file.build_model()
    metas = {b: {k: v.to("meta") for k, v in feed.items()} for b, feed in inputs.items()}
    first = metas[min(metas)]
    meta_traced = trace_model(model, first, leaf_modules=traced.leaf_modules, method=traced.method)
    if meta_traced.fingerprint() != traced.fingerprint():
        raise RuntimeError("the graph traced on the meta device differs")
    return {
        b: _Meter(meta_traced.graph_module).measure([feed[n] for n in traced.input_names])
        for b, feed in metas.items()
    }


def _per_sample(name: str, a: _NodeRun, b: _NodeRun, small: int, large: int) -> _NodeCost:
    def slope(x: float, y: float) -> float:
        return max((y - x) / (large - small), 0.0)

    return _NodeCost(
        flops=slope(a.flops, b.flops),
        saved_bytes=slope(a.saved_bytes, b.saved_bytes),
        io_bytes=slope(a.read_bytes + a.written_bytes, b.read_bytes + b.written_bytes),
        output_bytes=slope(a.output_bytes, b.output_bytes),
        spec=_tensor_spec(name, a, b, small, large),
    )


def _tensor_spec(name: str, a: _NodeRun, b: _NodeRun, small: int, large: int) -> TensorSpec | None:
    """The per-sample spec of a tensor output, or None when it is not batch-linear."""
    if a.tensor is None or b.tensor is None:
        return None
    (shape_a, dtype, grad_a), (shape_b, _, grad_b) = a.tensor, b.tensor
    if len(shape_a) != len(shape_b):
        return None
    changed = [i for i, (x, y) in enumerate(zip(shape_a, shape_b, strict=True)) if x != y]
    grad = grad_a and grad_b
    if not changed:
        return TensorSpec(name=name, shape=shape_a, dtype=dtype, batch_dim=None, requires_grad=grad)
    dim = changed[0]
    per_sample, rest = divmod(shape_a[dim], small)
    if len(changed) > 1 or rest or shape_b[dim] != per_sample * large:
        return None
    shape = (*shape_a[:dim], per_sample, *shape_a[dim + 1 :])
    return TensorSpec(name=name, shape=shape, dtype=dtype, batch_dim=dim, requires_grad=grad)


# ----------------------------------------------------------------------- assembling
def _unit_costs(
    model: torch.nn.Module,
    traced: TracedModel,
    units: Sequence[UnitSpec],
    node_unit: Mapping[str, int],
    costs: Mapping[str, _NodeCost],
) -> tuple[UnitCost, ...]:
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    held = _output_bytes_by_unit(traced.graph_module, node_unit, costs)
    ops = {n.name: n.op for n in traced.graph_module.graph.nodes}
    result = []
    for idx, unit in enumerate(units):
        nodes = [costs[n] for n in unit.nodes]
        calls = [n for n in unit.nodes if ops[n].startswith("call_")]
        result.append(
            UnitCost(
                name=unit.name,
                fwd_flops_per_sample=sum(c.flops for c in nodes),
                param_bytes=sum(_nbytes(params[p]) for p in unit.params),
                trainable_param_bytes=sum(
                    _nbytes(params[p]) for p in unit.params if params[p].requires_grad
                ),
                buffer_bytes=sum(_nbytes(buffers[b]) for b in unit.buffers),
                activation_bytes_per_sample=sum(c.saved_bytes for c in nodes) + held[idx],
                io_bytes_per_sample=sum(c.io_bytes for c in nodes),
                num_ops=len(calls),
            )
        )
    return tuple(result)


def _output_bytes_by_unit(
    gm: torch.fx.GraphModule, node_unit: Mapping[str, int], costs: Mapping[str, _NodeCost]
) -> list[float]:
    """Per-sample bytes of the graph outputs, charged to the unit that produces each.

    The outputs (e.g. the logits, batch x seq x vocab) stay alive until the loss and its
    backward have run, like saved activations.
    """
    held = [0.0] * (max(node_unit.values(), default=0) + 1)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in output.all_input_nodes:
        if node.name in node_unit:
            held[node_unit[node.name]] += costs[node.name].output_bytes
    return held


def _input_specs(
    traced: TracedModel,
    units: Sequence[UnitSpec],
    node_unit: Mapping[str, int],
    costs: Mapping[str, _NodeCost],
    replicable: frozenset[str],
) -> tuple[InputSpec, ...]:
    """Graph inputs with the units that read them (directly or via replicated nodes)."""
    gm = traced.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    readers: dict[str, set[int]] = {n.name: set() for n in placeholders}
    for node in gm.graph.nodes:
        if node.name not in node_unit:
            continue
        for placeholder in _placeholders_read(node, replicable):
            readers[placeholder].add(node_unit[node.name])
    specs = []
    for node, name in zip(placeholders, traced.input_names, strict=True):
        spec = costs[node.name].spec
        if spec is None or spec.batch_dim is None:
            raise ModelFileError(
                f"input {name!r} from sample_batch does not grow with the batch size; "
                "make dim 0 of every input the sample dimension"
            )
        tensor = TensorSpec(
            name=name, shape=spec.shape, dtype=spec.dtype, batch_dim=spec.batch_dim,
            requires_grad=False,
        )  # fmt: skip
        read_by = tuple(units[i].name for i in sorted(readers[node.name]))
        specs.append(InputSpec(tensor=tensor, read_by_units=read_by))
    return tuple(specs)


def _placeholders_read(node: torch.fx.Node, replicable: frozenset[str]) -> set[str]:
    """Placeholders a node reads directly or through replicable nodes."""
    found: set[str] = set()
    work = list(node.all_input_nodes)
    seen: set[torch.fx.Node] = set()
    while work:
        current = work.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            found.add(current.name)
        elif current.name in replicable:
            work.extend(current.all_input_nodes)
    return found


def _param_dtype(model: torch.nn.Module) -> str:
    """The dtype holding most parameter bytes (``float32`` for a model without any)."""
    totals: dict[str, int] = {}
    for param in model.parameters():
        dtype = str(param.dtype).removeprefix("torch.")
        totals[dtype] = totals.get(dtype, 0) + _nbytes(param)
    return max(totals, key=lambda d: totals[d]) if totals else "float32"


def _nx_graph(
    traced: TracedModel,
    units: Sequence[UnitSpec],
    node_unit: Mapping[str, int],
    costs: Mapping[str, _NodeCost],
) -> nx.DiGraph:
    """One node per fx node; per-sample FLOPs and bytes on nodes, bytes on edges."""
    graph = nx.DiGraph()
    for node in traced.graph_module.graph.nodes:
        cost = costs.get(node.name)
        unit = node_unit.get(node.name)
        graph.add_node(
            node.name,
            op=node.op,
            unit=units[unit].name if unit is not None else None,
            flops=cost.flops if cost else 0.0,
            output_bytes=cost.output_bytes if cost else 0.0,
            module_path=module_path(node, traced.module_classes),
        )
        for source in node.all_input_nodes:
            source_cost = costs.get(source.name)
            graph.add_edge(
                source.name, node.name, bytes=source_cost.output_bytes if source_cost else 0.0
            )
    return graph
