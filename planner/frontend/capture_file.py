"""The capture file: one model's cost graph and trains-check verdict, written once
(``hplan capture``) and read by every ``hplan solve --capture`` of that model, whatever the
cluster.

It holds what the passes after ``trains_check`` read (the :class:`ModelGraph`'s plain
fields and its networkx graph's node and edge data, the trains check's verdict, the
optimizer's state bytes per parameter byte), the model file's sha256 and the capture
settings. The traced module is not written: a solve needs only its facts, and
``hplan profile``, which runs it, captures the model itself. :func:`load_capture` refuses a
file of another schema, a damaged one, or one made from another model file or settings. A
solve from the file does not import the model file: its sha256 stands for it, so settings
the model file reads from elsewhere (environment variables, other files) are not covered;
re-run ``hplan capture`` when they change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Final, Literal

import networkx as nx
from pydantic import TypeAdapter

from hplan.planner.frontend.capture import DEFAULT_BATCH_SIZES
from hplan.planner.frontend.cost_graph import ModelGraph, ParamSize, UnitCost
from hplan.planner.frontend.tp_costs import UnitTensorParallel
from hplan.planner.frontend.trains_check import TrainsVerdict
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.plan import (
    ByteCount,
    Count,
    InputSpec,
    LossConvention,
    NonNegative,
    TensorSpec,
    TpRule,
    TraceMethod,
    UnitSpec,
)
from hplan.runtime.contract.versioned_file import parse_versioned, record

__all__ = [
    "CAPTURE_SCHEMA_VERSION",
    "CaptureFile",
    "CaptureSettings",
    "capture_record",
    "load_capture",
    "sha256_of_file",
]

CAPTURE_SCHEMA_VERSION: Final = 4
"""2: convolutions' FLOPs and channels-first bytes (``conv_flops``,
``channels_first_conv_bytes``) added; 3: ``batch_statistics`` (BatchNorm in train mode);
4: the tensor-parallel plan (``tp_plan``, ``tp_max_degree``, ``tp_refusal``,
``tp_split_cuts``, each unit's ``tp``)."""


@record
class CaptureSettings:
    """How the model was captured: a solve must ask for the same."""

    seed: int
    """``--seed``: the RNG seed ``build_model`` and ``sample_batch`` ran under."""
    leaf_modules: tuple[str, ...]
    """``--leaf-module`` options, in the order given (the model file's own
    ``LEAF_MODULES`` are covered by its sha256)."""
    batch_sizes: tuple[int, int]
    """The two batch sizes every node was measured at, smaller first."""


@record
class UnitTpRecord:
    """A ``tp_costs.UnitTensorParallel``, field for field."""

    split_param_bytes: ByteCount
    split_flops_per_sample: NonNegative
    split_activation_bytes_per_sample: NonNegative
    fwd_allreduce_bytes_per_sample: NonNegative
    bwd_allreduce_bytes_per_sample: NonNegative
    num_allreduces: ByteCount
    """A count >= 0."""


@record
class UnitCostRecord:
    """A ``cost_graph.UnitCost``, field for field (per-sample figures for one sample)."""

    name: str
    fwd_flops_per_sample: NonNegative
    param_bytes: ByteCount
    trainable_param_bytes: ByteCount
    buffer_bytes: ByteCount
    activation_bytes_per_sample: NonNegative
    io_bytes_per_sample: NonNegative
    num_ops: ByteCount
    """A count >= 0 (``ByteCount`` is the contract's integer >= 0)."""
    memory_bound_io_bytes_per_sample: NonNegative
    channels_first_conv_io_bytes_per_sample: NonNegative
    conv_flops_per_sample: NonNegative
    tp: UnitTpRecord | None
    """What the model's TP plan splits in the unit; None: nothing."""

    def unit_cost(self) -> UnitCost:
        """The ``UnitCost`` this record holds."""
        fields = _fields_of(self)
        tp = fields.pop("tp")
        return UnitCost(**fields, tp=None if tp is None else UnitTensorParallel(**_fields_of(tp)))

    @classmethod
    def of(cls, cost: UnitCost) -> UnitCostRecord:
        """The record of a ``UnitCost``."""
        fields = _fields_of(cost)
        tp = fields.pop("tp")
        return cls(**fields, tp=None if tp is None else UnitTpRecord(**_fields_of(tp)))


@record
class NodeRecord:
    """One cost-graph node: its structure and per-sample costs (``ModelGraph.graph``)."""

    name: str
    op: str
    target: str
    module_path: str
    replicable: bool
    params: tuple[str, ...]
    buffers: tuple[str, ...]
    flops: float
    output_bytes: float
    saved_bytes: float
    io_bytes: float
    channels_first_conv_bytes: float
    conv_flops: float
    tensor: TensorSpec | None
    unit: str | None


@record
class EdgeRecord:
    """One cost-graph edge, from an input of a node to the node."""

    source: str
    target: str
    bytes: float
    """Bytes per sample of the source's output."""


@record
class TiedRecord:
    """Units sharing trainable parameters, and those parameters' bytes counted once."""

    unit_indices: tuple[int, ...]
    bytes: int


@record
class ParamRecord:
    """One trainable parameter (canonical name) and its size."""

    name: str
    numel: int
    element_bytes: int


@record
class TrainsRecord:
    """The trains check's verdict (``trains_check.TrainsVerdict``)."""

    device: str
    notes: tuple[str, ...]
    loss_convention: LossConvention = LossConvention.SAMPLE_MEAN


@record
class CaptureFile:
    """The whole capture file (see the module docstring)."""

    schema_version: Literal[4] = CAPTURE_SCHEMA_VERSION
    model_path: str
    """The model file as ``hplan capture`` was given it (for messages only)."""
    model_sha256: str
    """sha256 hex of the model file's bytes."""
    settings: CaptureSettings
    trace_method: TraceMethod
    leaf_modules: tuple[str, ...]
    """Module paths the trace kept whole (given + found automatically)."""
    graph_fingerprint: str
    param_dtype: str
    units: tuple[UnitSpec, ...]
    unit_costs: tuple[UnitCostRecord, ...]
    cuts: tuple[tuple[TensorSpec, ...], ...]
    inputs: tuple[InputSpec, ...]
    notes: tuple[str, ...]
    trainable_params: tuple[ParamRecord, ...]
    tied_trainable_bytes: tuple[TiedRecord, ...]
    nodes: tuple[NodeRecord, ...]
    """In graph order."""
    edges: tuple[EdgeRecord, ...]
    """By target node in graph order, each node's inputs in their order (so a rebuilt
    graph lists predecessors and successors as the measured one did)."""
    trains: TrainsRecord
    optimizer_state_bytes_per_param_byte: float
    """Bytes of optimizer state per byte of parameter, for the model file's optimizer."""
    batch_statistics: tuple[str, ...]
    """``ModelGraph.batch_statistics``: layers that normalise by the batch in training."""
    tp_plan: tuple[TpRule, ...]
    """``ModelGraph.tp_plan``: the model's tensor-parallel plan; empty: none."""
    tp_max_degree: Count
    """``ModelGraph.tp_max_degree``."""
    tp_refusal: str | None
    """``ModelGraph.tp_refusal``: why tensor parallelism is not offered; None: it is."""
    tp_split_cuts: tuple[int, ...]
    """``ModelGraph.tp_split_cuts``: the cuts that values the TP plan splits cross."""

    def to_json(self) -> str:
        """Deterministic JSON text (1-space indent, field order as declared, newline at end)."""
        data = _adapter().dump_python(self, mode="json")
        return json.dumps(data, indent=1, ensure_ascii=False, allow_nan=False) + "\n"

    def model_graph(self) -> ModelGraph:
        """The :class:`ModelGraph` this file holds (``traced`` None).

        Raises:
            ValueError: an edge names a node the file does not list.
        """
        graph: nx.DiGraph = nx.DiGraph()
        for node in self.nodes:
            data = _fields_of(node)
            graph.add_node(data.pop("name"), **data)
        for edge in self.edges:
            for end in (edge.source, edge.target):
                if end not in graph:
                    raise ValueError(f"edge {edge.source!r} -> {edge.target!r} names no node")
            graph.add_edge(edge.source, edge.target, bytes=edge.bytes)
        return ModelGraph(
            units=self.units,
            unit_costs=tuple(c.unit_cost() for c in self.unit_costs),
            cuts=self.cuts,
            inputs=self.inputs,
            param_dtype=self.param_dtype,
            graph=graph,
            notes=self.notes,
            trace_method=self.trace_method,
            leaf_modules=self.leaf_modules,
            graph_fingerprint=self.graph_fingerprint,
            trainable_param_sizes={
                p.name: ParamSize(p.numel, p.element_bytes) for p in self.trainable_params
            },
            tied_trainable_bytes={t.unit_indices: t.bytes for t in self.tied_trainable_bytes},
            batch_statistics=self.batch_statistics,
            tp_plan=self.tp_plan,
            tp_max_degree=self.tp_max_degree,
            tp_refusal=self.tp_refusal,
            tp_split_cuts=self.tp_split_cuts,
        )

    def trains_verdict(self) -> TrainsVerdict:
        """The trains check's verdict this file holds."""
        return TrainsVerdict(
            device=self.trains.device,
            notes=self.trains.notes,
            loss_convention=self.trains.loss_convention,
        )


@cache
def _adapter() -> TypeAdapter[CaptureFile]:
    return TypeAdapter(CaptureFile)


def _fields_of(value: Any) -> dict[str, Any]:
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}


def sha256_of_file(path: Path) -> str:
    """sha256 hex of a file's bytes (what ``load_model_file`` records as ``sha256``)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def capture_record(
    graph: ModelGraph,
    trains: TrainsVerdict,
    *,
    optimizer_state_bytes_per_param_byte: float,
    model_path: Path,
    model_sha256: str,
    seed: int,
    leaf_modules: Sequence[str],
    batch_sizes: tuple[int, int] = DEFAULT_BATCH_SIZES,
) -> CaptureFile:
    """The capture file of a measured graph and its trains verdict.

    Args:
        model_sha256: the model file's sha256 hex (``ModelFile.sha256``).
        seed, leaf_modules, batch_sizes: the settings the graph was captured with.

    Raises:
        ValueError: a graph node lacks a cost attribute (not a cost graph).
    """
    nodes = tuple(NodeRecord(name=name, **data) for name, data in graph.graph.nodes(data=True))
    edges = tuple(
        EdgeRecord(source=source, target=name, bytes=graph.graph.edges[source, name]["bytes"])
        for name in graph.graph.nodes
        for source in graph.graph.predecessors(name)
    )
    return CaptureFile(
        model_path=model_path.as_posix(),
        model_sha256=model_sha256,
        settings=CaptureSettings(
            seed=seed,
            leaf_modules=tuple(leaf_modules),
            batch_sizes=tuple(sorted(batch_sizes)),  # type: ignore[arg-type]
        ),
        trace_method=graph.trace_method,
        leaf_modules=graph.leaf_modules,
        graph_fingerprint=graph.graph_fingerprint,
        param_dtype=graph.param_dtype,
        units=graph.units,
        unit_costs=tuple(UnitCostRecord.of(c) for c in graph.unit_costs),
        cuts=graph.cuts,
        inputs=graph.inputs,
        notes=graph.notes,
        trainable_params=tuple(
            ParamRecord(name=name, numel=size.numel, element_bytes=size.element_bytes)
            for name, size in graph.trainable_param_sizes.items()
        ),
        tied_trainable_bytes=tuple(
            TiedRecord(unit_indices=idxs, bytes=num_bytes)
            for idxs, num_bytes in graph.tied_trainable_bytes.items()
        ),
        nodes=nodes,
        edges=edges,
        trains=TrainsRecord(
            device=trains.device, notes=trains.notes, loss_convention=trains.loss_convention
        ),
        optimizer_state_bytes_per_param_byte=optimizer_state_bytes_per_param_byte,
        batch_statistics=graph.batch_statistics,
        tp_plan=graph.tp_plan,
        tp_max_degree=graph.tp_max_degree,
        tp_refusal=graph.tp_refusal,
        tp_split_cuts=graph.tp_split_cuts,
    )


@dataclass(frozen=True)
class StoredCapture:
    """A capture read from a capture file: the model's cost graph, trains verdict and
    optimizer state factor as the file holds them (the model file is not imported)."""

    source: Path
    """The capture file it came from."""
    model_sha256: str
    """sha256 hex of the model file (checked against the file on disk)."""
    graph: ModelGraph
    trains: TrainsVerdict
    optimizer_state_bytes_per_param_byte: float

    def verify(self) -> None:
        """The graph's and the verdict's invariants (``ModelGraph.verify``)."""
        self.graph.verify()
        self.trains.verify()
        factor = self.optimizer_state_bytes_per_param_byte
        if not (math.isfinite(factor) and factor >= 0):
            raise ValueError(f"optimizer state factor {factor!r} is not finite and >= 0")


def _looks_like_a_plan(text: str) -> bool:
    try:
        data = json.loads(text)
    except ValueError:
        return False
    return isinstance(data, dict) and "ranks" in data and "cluster" in data


def _which_change(recorded: str, model_path: Path) -> str:
    """``edited since`` for the same file name, else ``another model file``."""
    return "edited since" if Path(recorded).name == model_path.name else "another model file"


def _shown(value: object) -> str:
    """A setting as a person writes it: ``none`` for an empty list, ``a, b`` for a list."""
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) or "none"
    return str(value)


def load_capture(
    path: Path,
    *,
    model_path: Path,
    seed: int,
    leaf_modules: Sequence[str],
    batch_sizes: tuple[int, int] = DEFAULT_BATCH_SIZES,
) -> StoredCapture:
    """Read ``path`` and check it was captured from ``model_path`` (its sha256) with these
    settings. The model file is read, not imported.

    Raises:
        ConfigError: unreadable, not JSON, another schema version, unknown keys, wrong
            types or an inconsistent graph; or made from a model file of another sha256, or
            with another seed, ``--leaf-module`` list or batch sizes. One line, naming the
            file and what differs, saying to re-run ``hplan capture``.
    """
    target = path if path.suffix == ".json" else Path("capture.json")  # never a cluster file
    rerun = f"re-run `hplan capture {model_path} -o {target}`"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"cannot read capture file {str(path)!r} ({reason}); {rerun}") from None
    if _looks_like_a_plan(text):
        raise ConfigError(
            f"{str(path)!r} is a plan (plan.json), not a capture file; make one with "
            f"`hplan capture {model_path} -o capture.json`"
        )
    stored = parse_versioned(
        text,
        _adapter(),
        what="capture file",
        source=str(path),
        version=CAPTURE_SCHEMA_VERSION,
        fix=rerun,
    )
    sha256 = sha256_of_file(model_path)
    if stored.model_sha256 != sha256:
        raise ConfigError(
            f"capture file {str(path)!r} was made from model file {stored.model_path} with "
            f"sha256 {stored.model_sha256[:12]}, but {model_path} has sha256 {sha256[:12]} "
            f"({_which_change(stored.model_path, model_path)}); {rerun}"
        )
    settings = stored.settings
    wanted = CaptureSettings(
        seed=seed,
        leaf_modules=tuple(leaf_modules),
        batch_sizes=tuple(sorted(batch_sizes)),  # type: ignore[arg-type]
    )
    for name, found, want in (
        ("--seed", settings.seed, wanted.seed),
        ("--leaf-module list", list(settings.leaf_modules), list(wanted.leaf_modules)),
        ("batch sizes measured at", list(settings.batch_sizes), list(wanted.batch_sizes)),
    ):
        if found != want:
            flags = _flags(wanted)
            raise ConfigError(
                f"capture file {str(path)!r} was made with {name} {_shown(found)}, this solve "
                f"asks for {_shown(want)}; re-run `hplan capture {model_path} -o {target}{flags}`"
            )
    try:
        capture = StoredCapture(
            source=path,
            model_sha256=sha256,
            graph=stored.model_graph(),
            trains=stored.trains_verdict(),
            optimizer_state_bytes_per_param_byte=stored.optimizer_state_bytes_per_param_byte,
        )
        capture.verify()
    except ValueError as exc:
        raise ConfigError(f"capture file {str(path)!r} is inconsistent ({exc}); {rerun}") from None
    return capture


def _flags(settings: CaptureSettings) -> str:
    leaves = "".join(f" --leaf-module {leaf}" for leaf in settings.leaf_modules)
    return f" --seed {settings.seed}{leaves}"
