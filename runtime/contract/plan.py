"""The plan: the only contract between the planner and the runtime.

A ``Plan`` says *what to run* (which rank runs which partition units of which replica, with
which micro-batch size, which tensors cross each stage boundary, how gradients are
synchronised) and, apart from that, *why* (the ``report``: predicted times and memory,
solver status, efficiency). The executor reads only the "what" (``tests/test_architecture.py``
checks it); a rehearsal reads the report to replay the planner's predictions.

All types are frozen dataclasses with JSON-native fields and ``StrEnum``s; ``to_json`` is
deterministic (same plan, same bytes) and ``from_json(to_json(p)) == p``. Value ranges are
pydantic field constraints (``Index``, ``Count``, ``Port``, ...), so they are in the JSON
Schema too. Loading rejects unknown keys, wrong types and values out of range in one line
naming the field, then checks the plan's consistency (:func:`Plan.verify`). No torch: a
plan can be read and shown anywhere.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import field
from enum import IntEnum, StrEnum
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import Field, Strict, TypeAdapter, ValidationError

from hplan.runtime.contract.errors import PlanFileError
from hplan.runtime.contract.versioned_file import record

SCHEMA_VERSION: Final = 2

# Value ranges, declared once: pydantic enforces them when a plan loads and when it is
# verified, and they are part of plan.schema.json.
Index = Annotated[int, Strict(), Field(ge=0)]
"""A rank, stage, replica or position: a JSON integer >= 0 (``"3"`` and ``3.0`` are refused:
pydantic's lax mode would read them as 3)."""
Count = Annotated[int, Strict(), Field(ge=1)]
"""A number of things that must be at least one (samples, micro-batches); a JSON integer."""
ByteCount = Annotated[int, Strict(), Field(ge=0)]
Port = Annotated[int, Strict(), Field(ge=1, le=65534)]
MAX_LOCAL_STEPS = 1_000_000
"""The most inner steps per outer sync a plan may carry (DiLoCo uses 500)."""
LocalSteps = Annotated[int, Strict(), Field(ge=1, le=MAX_LOCAL_STEPS)]
"""H: inner optimizer steps per outer sync, a JSON integer in 1 .. MAX_LOCAL_STEPS."""
"""A TCP port; 65535 is kept free (the runtime once used ``port + 1``)."""
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A finite number > 0 (a bandwidth, a peak, a timeout)."""
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A finite number >= 0 (a time, a latency, a speed ratio)."""
Flag = Annotated[bool, Strict()]
"""JSON ``true`` or ``false`` only: ``"yes"``, ``1`` or ``"false"`` are refused at load
(pydantic's lax mode would read ``"yes"`` as true)."""

CPU_KIND: Final = "cpu"
"""``DeviceSpec.kind`` of a host CPU (the device catalog's key for it): its rank runs on the
CPU with gloo, and its memory is the host's."""

DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "complex64": 8, "complex128": 16, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip
"""Bytes per element of each torch dtype name a plan may carry (``float32`` -> 4); a plain
table, so that a plan can be sized without torch."""


class Schedule(StrEnum):
    """Pipeline schedule of micro-batches within one replica."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"


class TraceMethod(StrEnum):
    """How the model was turned into a graph (the runtime re-traces the same way)."""

    SYMBOLIC = "fx_symbolic_trace"
    EXPORT = "torch_export"
    MODULES = "module_boundaries"


class LossConvention(StrEnum):
    """What ``loss_fn`` averages over, so that the micro-batches' losses sum to the global
    batch's (checked at solve time, ``runtime/capture/loss_items.py``).

    - ``sample_mean``: a mean over the samples it is given; each micro-batch's loss is
      weighted by its samples over the global batch's.
    - ``token_mean``: a mean over the target elements that are not ``-100`` (padded labels,
      ``cross_entropy``'s ``ignore_index``); each micro-batch's loss is weighted by its
      such elements over the global batch's (transformers' ``num_items_in_batch``).
    """

    SAMPLE_MEAN = "sample_mean"
    TOKEN_MEAN = "token_mean"


class MemoryStrategy(StrEnum):
    """What a rank does with activations between forward and backward.

    - ``keep_activations``: every in-flight micro-batch keeps what autograd saves.
    - ``selective``: the units named in ``RankPlan.recompute_units`` (some of the stage's)
      each keep only their input per micro-batch in flight and run their forward again in
      the backward (``torch.utils.checkpoint`` per unit); the other units keep their
      activations (Korthikanti et al., "Reducing Activation Recomputation in Large
      Transformer Models", MLSys 2023, chose the ops; hplan chooses whole partition units,
      the cheapest to recompute per byte saved first).
    - ``recompute``: the stage's forward keeps only its inputs; the backward of each
      micro-batch first runs the forward again (one extra forward per micro-batch), so at
      most one micro-batch's activations are alive at a time (Chen et al., "Training Deep
      Nets with Sublinear Memory Cost", 2016; Megatron-LM's full recomputation).
    """

    KEEP = "keep_activations"
    SELECTIVE = "selective"
    RECOMPUTE = "recompute"


class ZeroStage(IntEnum):
    """How the optimizer state of parameters held by several ranks is kept.

    - ``0``: every rank keeps the optimizer state of every parameter it holds.
    - ``1``: each holder set's optimizer state is split among its ranks
      (Rajbhandari et al., "ZeRO", SC 2020, stage 1 "P_os"), in shards whose sizes follow
      each rank's ``optimizer_shard_weight`` (``holders.optimizer_shards``; shards may be
      uneven, and a rank of weight 0 keeps none). After the gradients are summed each rank
      steps its shard, and the updated shards are all-gathered.
    - ``2``: stage 1, and the summed gradients are sharded the same way (ZeRO stage 2
      "P_os+g"): each slice of a gradient is reduced to the rank that keeps its optimizer
      state only, the other ranks drop it, and no rank holds a whole summed gradient of a
      shared parameter. Gradients still accumulate whole over the step's micro-batches
      (``executor/memory/zero.py`` says why), so what it saves is the summed copy
      (``contract.memory``).
    """

    NONE = 0
    OPTIMIZER_STATE = 1
    GRADIENTS = 2


class Precision(StrEnum):
    """How a rank computes: the number format of its matmuls and saved activations.

    Parameters, gradients and optimizer state stay in the model's parameter dtype in every
    mode (for an fp32 model: fp32 master weights, as in Micikevicius et al., "Mixed
    Precision Training", ICLR 2018).

    - ``fp32``: PyTorch's defaults: float32 matmuls, convolutions in TF32 where the GPU has
      it (``torch.backends.cudnn.allow_tf32`` is True by default).
    - ``tf32``: float32 matmuls also in TF32 (``torch.backends.cuda.matmul.allow_tf32``).
    - ``bf16``: ``torch.autocast`` to bfloat16.
    - ``fp16``: ``torch.autocast`` to float16 with dynamic loss scaling, the skip of a step
      with a non-finite gradient agreed by every rank.
    """

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def autocast_dtype(self) -> str | None:
        """torch dtype name ``torch.autocast`` runs in, None without autocast."""
        return {Precision.BF16: "bfloat16", Precision.FP16: "float16"}.get(self)


def wire_spec(spec: TensorSpec, sender: Precision) -> TensorSpec:
    """The spec of ``spec`` as it travels from a rank computing in ``sender`` precision.

    Under autocast (bf16, fp16) float32 boundary tensors travel, and their gradients
    return, in the autocast dtype: the bytes the cost model counts (half of float32), and
    what the receiver's autocast ops would cast them to anyway (a receiver without
    autocast casts them back to float32). Other tensors (integer ids, masks, a half
    precision model's tensors) and every tensor of an fp32/tf32 rank travel as traced.
    """
    half = sender.autocast_dtype
    if half is None or spec.dtype != "float32":
        return spec
    return TensorSpec(
        name=spec.name,
        shape=spec.shape,
        dtype=half,
        batch_dim=spec.batch_dim,
        requires_grad=spec.requires_grad,
    )


class SyncMode(StrEnum):
    """How the holders of some parameters keep them in step across islands
    (:class:`SyncSpec`).

    - ``all_reduce``: their gradients are summed every step (inside an island always so).
    - ``local_sgd`` (DiLoCo; Douillard et al., 2023): each island takes ``local_steps``
      inner optimizer steps on its own; then the pseudo-gradients (global parameters minus
      the island's) are averaged weighted by the samples each island processed, and an
      outer optimizer (Nesterov SGD; the model file's ``OUTER_LR``, default 0.7, and
      ``OUTER_MOMENTUM``, default 0.9) applies them to the global parameters, which every
      island then continues from.
    - ``async``: as ``local_sgd``, but the average of round k travels while round k + 1
      computes and is applied at the end of round k + 1 (staleness: one round), each
      island keeping its own change of round k + 1 on top of the new global parameters.
    """

    ALL_REDUCE = "all_reduce"
    LOCAL_SGD = "local_sgd"
    ASYNC = "async"


class PseudoGradientDtype(StrEnum):
    """The wire format pseudo-gradients cross the slow links in (averaged in float32 after).

    - ``float32``, ``bfloat16``: one SUM all-reduce over the holder set in that dtype.
    - ``int8``, ``int4``: quantized with error feedback. Each island's lowest holder adds
      its residual to its weighted pseudo-gradient, cuts the result into blocks of
      :data:`WIRE_BLOCK_ELEMENTS` elements and sends each block as signed integers
      (``int8``: -127..127; ``int4``: -7..7, two per byte) over one float32 scale, the
      block's largest magnitude / the largest integer, rounding to nearest; the residual
      becomes what the rounding lost (error feedback: Seide et al., "1-bit SGD", 2014;
      Karimireddy et al., "EF-SGD", 2019). The islands' lowest holders all-gather the
      payloads, each decodes them and sums them in float32 in island order, and sends the
      sum to its island's other holders. Every holder of an island computes the same
      residual. Streaming DiLoCo (Douillard et al., 2025) sends 4-bit values; INTELLECT-1
      int8.
    """

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def quantized(self) -> bool:
        """Whether this format is a block-quantized integer one (``int8``, ``int4``)."""
        return self in (PseudoGradientDtype.INT8, PseudoGradientDtype.INT4)

    @property
    def largest_integer(self) -> int:
        """The largest magnitude a quantized element takes (127, 7); 0 for float formats."""
        return {PseudoGradientDtype.INT8: 127, PseudoGradientDtype.INT4: 7}.get(self, 0)


WIRE_BLOCK_ELEMENTS: Final = 64
"""Elements per block of a quantized wire format, each block with one float32 scale."""


def wire_payload_bytes(wire: PseudoGradientDtype, num_elements: int) -> int:
    """Bytes one island's pseudo-gradient of ``num_elements`` elements takes on the wire in
    ``wire``: 4 or 2 per element for the float formats; for ``int8`` one byte per element,
    for ``int4`` one per two (rounded up), plus 4 bytes of scale per started block of
    :data:`WIRE_BLOCK_ELEMENTS`."""
    if not wire.quantized:
        return num_elements * DTYPE_BYTES[wire.value]
    blocks = -(-num_elements // WIRE_BLOCK_ELEMENTS)
    data = num_elements if wire is PseudoGradientDtype.INT8 else -(-num_elements // 2)
    return data + 4 * blocks


def wire_bytes_per_element(wire: PseudoGradientDtype) -> float:
    """Bytes per element of ``wire`` for a large tensor (:func:`wire_payload_bytes` / n):
    4, 2, 1.0625, 0.5625."""
    return wire_payload_bytes(wire, WIRE_BLOCK_ELEMENTS * 1024) / (WIRE_BLOCK_ELEMENTS * 1024)


TP_DEGREES: Final = (1, 2, 4, 8)
"""The tensor-parallel degrees a stage may have (``RankPlan.tp_degree``)."""


class TpStyle(StrEnum):
    """How one module of the model's tensor-parallel plan is split across a stage's TP
    group (``torch.distributed.tensor.parallel``; Megatron-LM's column/row pair, Shoeybi
    et al., 2019). The names are Hugging Face's ``base_model_tp_plan`` values.

    - ``colwise``: an ``nn.Linear``'s weight split by output features (dim 0) and its
      bias with it; the input is replicated, the output stays split by features.
    - ``rowwise``: the weight split by input features (dim 1), the bias replicated; the
      input arrives split by features, the outputs are summed (one all-reduce).
    - ``colwise_rep``: ``colwise`` whose output is gathered whole (an LM head).
    - ``rowwise_rep``: ``rowwise`` whose input arrives whole and is split locally.

    An ``nn.Embedding`` in either style is split by its features (weight dim 1) and its
    output gathered whole: each member holds 1/d of its bytes, as a split by vocabulary
    would (whose masked partial sums DTensor did not carry between micro-batches).
    """

    COLWISE = "colwise"
    ROWWISE = "rowwise"
    COLWISE_REP = "colwise_rep"
    ROWWISE_REP = "rowwise_rep"


@record
class TpRule:
    """One entry of a model's tensor-parallel plan."""

    pattern: str
    """A module path of ``named_modules()``; ``*`` stands for one path component
    (``layers.*.self_attn.q_proj``), as in Hugging Face's ``base_model_tp_plan``."""
    style: TpStyle

    def matches(self, module_path: str) -> bool:
        """Whether ``module_path`` (``layers.3.self_attn.q_proj``) is one this rule names."""
        want, have = self.pattern.split("."), module_path.split(".")
        if len(want) != len(have):
            return False
        return all(w in ("*", h) for w, h in zip(want, have, strict=True))

    def splits(self, param_name: str) -> bool:
        """Whether this rule splits parameter ``param_name`` of a module it matches: the
        weight always, the bias under the column styles (a row-split module's bias is
        added once, whole)."""
        module_path, _, leaf = param_name.rpartition(".")
        if not self.matches(module_path):
            return False
        return leaf == "weight" or (
            leaf == "bias" and self.style in (TpStyle.COLWISE, TpStyle.COLWISE_REP)
        )


class Backend(StrEnum):
    """torch.distributed backend for point-to-point and collectives."""

    GLOO = "gloo"
    NCCL = "nccl"


class SolverStatus(StrEnum):
    """What the planner can say about the layout it returned."""

    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    HEURISTIC = "heuristic"


@record
class TensorSpec:
    """A tensor that crosses a stage boundary or enters the graph as an input."""

    name: str
    """Name of the fx node that produces it (graph inputs: the placeholder name)."""
    shape: tuple[ByteCount, ...]
    """Shape for a micro-batch of one sample; see ``batch_dim``."""
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``float32``, ``int64``, ``bool``."""
    batch_dim: Index | None
    """Dimension whose size is ``shape[batch_dim] * micro_batch_size``; None: not batched."""
    requires_grad: Flag
    """True when a gradient flows back across the boundary (float tensors only)."""

    def shape_for(self, micro_batch_size: int) -> tuple[int, ...]:
        """Concrete shape of this tensor for a micro-batch of ``micro_batch_size`` samples."""
        if self.batch_dim is None:
            return self.shape
        dims = list(self.shape)
        dims[self.batch_dim] *= micro_batch_size
        return tuple(dims)

    def num_bytes(self, micro_batch_size: int) -> int:
        """Bytes of this tensor for a micro-batch of ``micro_batch_size`` samples.

        The element count of ``shape_for(micro_batch_size)`` times ``DTYPE_BYTES[dtype]``.

        Raises:
            PlanFileError: ``dtype`` is not a key of ``DTYPE_BYTES``.
        """
        if self.dtype not in DTYPE_BYTES:
            raise PlanFileError(
                f"boundary tensor {self.name!r} has unknown dtype {self.dtype!r}; "
                f"expected one of {', '.join(sorted(DTYPE_BYTES))}"
            )
        return math.prod(self.shape_for(micro_batch_size)) * DTYPE_BYTES[self.dtype]


@record
class InputSpec:
    """A graph input (a ``forward`` argument that the model file feeds)."""

    tensor: TensorSpec
    read_by_units: tuple[str, ...]
    """Partition units whose nodes read this input (the runtime delivers it to them)."""


@record
class UnitSpec:
    """A partition unit: the smallest piece a stage boundary may fall between."""

    name: str
    nodes: tuple[str, ...]
    """Names of the fx graph nodes (not placeholders, not output) that belong to the unit."""
    params: tuple[str, ...]
    """Canonical names (``named_parameters()``) of the parameters the unit uses."""
    buffers: tuple[str, ...]
    """Canonical names of the buffers the unit reads (each stage holds its own copy)."""


@record
class CutSpec:
    """The tensors that cross a stage boundary placed after unit ``after_unit``."""

    after_unit: str
    tensors: tuple[TensorSpec, ...]


@record
class ParameterSpec:
    """One trainable parameter of the model, for sizing memory without torch."""

    name: str
    """Canonical name (``named_parameters()``)."""
    num_elements: ByteCount
    element_bytes: Count


@record
class UnitMemorySpec:
    """What one partition unit adds to a stage's memory besides its parameters."""

    unit: str
    activation_bytes_per_sample: NonNegative
    """Bytes autograd saves for the backward per sample (at the precision the plan was
    costed in)."""
    frozen_bytes: ByteCount
    """Buffers and parameters without ``requires_grad`` (no gradient, no optimizer state)."""
    input_bytes_per_sample: NonNegative = 0.0
    """Bytes per sample of the boundary before this unit (what the previous unit's cut
    carries; 0 for the first unit): what a recomputed unit keeps per micro-batch in flight
    (``MemoryStrategy.SELECTIVE``)."""
    tp_split_activation_bytes_per_sample: NonNegative = 0.0
    """Of ``activation_bytes_per_sample``: what the model's TP plan splits (a rank of a TP
    group of degree d keeps 1/d of it; ``UnitTensorParallel``)."""


@record
class MemoryModelSpec:
    """The sizes the memory check reads (``contract.memory``): the plan's own prediction,
    re-checked wherever a plan is loaded, under its schedule and memory strategies."""

    optimizer_state_bytes_per_param_byte: NonNegative
    """Optimizer state per trainable parameter byte: 2.0 for Adam/AdamW, 0 for SGD."""
    parameters: tuple[ParameterSpec, ...]
    """Every trainable parameter, in ``holders.parameter_order``; a unit's parameters not
    listed are frozen (counted in its ``frozen_bytes``)."""
    units: tuple[UnitMemorySpec, ...]
    """One per unit, in unit order."""


@record
class ModelSpec:
    """Which model the plan is for, and how to rebuild its graph."""

    path: str
    """model.py path; ``hplan solve`` writes it relative to the folder of plan.json, and a
    relative path is read relative to that folder. ``--model`` overrides it."""
    sha256: str
    """Digest of model.py at solve time; a different file only warns."""
    trace_method: TraceMethod
    leaf_modules: tuple[str, ...]
    """Module paths traced as single nodes (kept whole)."""
    graph_fingerprint: str
    """Digest of the traced graph's node names and ops; the runtime checks it."""
    inputs: tuple[InputSpec, ...]
    """Graph inputs fed by ``sample_batch``/``dataset``, in forward-signature order."""
    param_dtype: str
    loss_convention: LossConvention = LossConvention.SAMPLE_MEAN
    """What ``loss_fn`` averages over: how the runtime weights each micro-batch's loss."""
    tp_plan: tuple[TpRule, ...] = ()
    """The model's tensor-parallel plan, in the order it was declared: ``TP_PLAN`` in
    model.py, else the Hugging Face model's ``config.base_model_tp_plan`` (its paths under
    the base model, prefixed as ``named_modules()`` names them) and its own ``_tp_plan``;
    empty: the model has none, and no stage may have ``tp_degree`` > 1."""


@record
class DeviceSpec:
    """One accelerator (or CPU) in the cluster."""

    name: str
    """Unique device name, ``<node>/<local_index>``."""
    node: str
    local_index: Index
    """GPU index on the node in PCI bus order (CPU devices: a process index)."""
    kind: str
    """Device catalog key, e.g. ``rtx4090``, ``a100-80gb``, ``cpu``."""
    memory_bytes: ByteCount
    peak_flops: Positive
    """Peak FLOP/s for the model's dtype (used for emulation and reports)."""
    memory_bandwidth_bytes_per_s: Positive
    consumer_card: Flag
    """GeForce-class card: peer-to-peer over PCIe is unreliable, NCCL P2P is disabled."""


@record
class CollectiveSpec:
    """A node's all-reduce among its devices as measured (``hplan bandwidth``), as a ring.

    An all-reduce of ``n`` ranks on the node takes at least
    ``2 (n - 1) * latency_per_step_s + 2 (n - 1) / n * bytes / bus_bandwidth_bytes_per_s``
    (``link_model.ring_all_reduce_time_s``), whatever its point-to-point links allow: a
    collective library adds its own per-step cost.
    """

    latency_per_step_s: NonNegative
    """The measured all-reduce's latency over its ``2 (K - 1)`` ring steps (K ranks)."""
    bus_bandwidth_bytes_per_s: Positive
    """Its bus bandwidth (nccl-tests' convention: algorithm bandwidth x 2 (K - 1) / K)."""


@record
class NodeSpec:
    """One machine: its name, its address, its devices (by name)."""

    name: str
    host: str
    devices: tuple[str, ...]
    collective: CollectiveSpec | None = None
    """Its measured all-reduce, when a bandwidth file measured one."""
    interface: str | None = None
    """The network interface the ranks of this node talk over (cluster.yaml's
    ``interface``: ``eth1``, ``ib0``); None: the interface that holds ``host`` here."""
    host_memory_bytes: ByteCount | None = None
    """The node's host (CPU) memory, what optimizer-state offload may fill
    (``RankPlan.optimizer_offload``); None: not declared, ``contract.memory`` assumes
    ``HOST_MEMORY_PER_DEVICE_MEMORY`` x the memory of its devices."""


@record
class LinkSpec:
    """Alpha-beta model of the link between two devices (symmetric)."""

    a: str
    b: str
    bandwidth_bytes_per_s: Positive
    latency_s: NonNegative


@record
class ClusterSpec:
    """The hardware the plan was made for."""

    name: str
    nodes: tuple[NodeSpec, ...]
    devices: tuple[DeviceSpec, ...]
    links: tuple[LinkSpec, ...]
    """One entry per unordered pair of distinct devices."""


@record
class IslandSpec:
    """Nodes joined by fast links: inside an island every holder set sums its gradients
    every step."""

    name: str
    nodes: tuple[str, ...]
    """Node names (``NodeSpec.name``), in cluster order."""


@record
class OuterSyncSpec:
    """How one holder set that spans two or more islands keeps its parameters in step."""

    ranks: tuple[Index, ...]
    """The sorted ranks holding the same parameters (``holders.holder_sets``)."""
    mode: SyncMode
    local_steps: LocalSteps = 1
    """H: inner optimizer steps per outer sync (1 for ``all_reduce``)."""
    num_fragments: Count = 1
    """The group's parameters are cut into this many fragments of about equal bytes, in
    model order (``holders.outer_fragments``); fragment f syncs at the steps s with
    ``(s + 1 + f * local_steps // num_fragments) % local_steps == 0`` (Streaming DiLoCo's
    staggered schedule), so at most one fragment travels at a time."""
    wire_dtype: PseudoGradientDtype = PseudoGradientDtype.FLOAT32
    overlap_steps: Index = 0
    """``local_sgd`` only: the inner steps a fragment's outer sync travels behind before its
    average is applied, at most H - 1 (0: the islands wait for it). A sync launched after
    step s is applied after step ``s + overlap_steps``: G ← outer(G, average), and each
    island's parameters become G plus the change the island made since the launch (it keeps
    its own in-flight steps; the next pseudo-gradient is G - L, so no step is lost or
    counted twice). ``async`` applies at the fragment's next point (:attr:`delay_steps` =
    H) and takes 0 here."""

    @property
    def delay_steps(self) -> int:
        """Inner steps between a fragment's sync launch and the application of its average:
        ``overlap_steps`` under ``local_sgd`` (the staleness bound), H under ``async``, 0
        under ``all_reduce``."""
        if self.mode is SyncMode.ASYNC:
            return self.local_steps
        return self.overlap_steps if self.mode is SyncMode.LOCAL_SGD else 0


@record
class SyncSpec:
    """Islands and how each holder set spanning islands syncs. Holder sets inside one
    island, and spanning ones not listed in ``groups``, sum their gradients every step."""

    islands: tuple[IslandSpec, ...]
    """Every node of the cluster in exactly one island."""
    groups: tuple[OuterSyncSpec, ...] = ()
    """At most one entry per spanning holder set, sorted by ranks."""

    @property
    def local(self) -> bool:
        """Whether some group does not sum its gradients every step: then every replica lies
        inside one island and the islands' losses are weighted by the island's samples."""
        return any(g.mode is not SyncMode.ALL_REDUCE for g in self.groups)


@record
class RankPlan:
    """What one process runs."""

    rank: Index
    node: str
    local_rank: Index
    device: str
    """Device name (see ``DeviceSpec.name``)."""
    device_kind: str
    replica: Index
    stage: Index
    units: tuple[str, ...]
    micro_batch_size: Count
    num_microbatches: Count
    num_samples: Count
    """Samples this replica processes per optimizer step (its batch share)."""
    memory_strategy: MemoryStrategy = MemoryStrategy.KEEP
    recompute_units: tuple[str, ...] = ()
    """Under ``memory_strategy`` ``selective``: the units of ``units`` (one or more, not all,
    in stage order) that are recomputed; empty under the other strategies."""
    precision: Precision = Precision.FP32
    optimizer_shard_weight: NonNegative = 1.0
    """Under ``training.zero_stage`` 1 or 2: this rank's relative share of the optimizer
    state (and under stage 2 of the summed gradients) of every holder set it belongs to
    (shards proportional to the members' weights; see ``holders.optimizer_shards``).
    Ignored under stage 0."""
    tp_degree: Count = 1
    """Tensor-parallel degree of this rank's stage: the stage of this replica runs on
    ``tp_degree`` ranks (its TP group: same node, same device kind, same units and
    micro-batches, consecutive ranks in ``tp_rank`` order), each holding its share of every
    module of ``ModelSpec.tp_plan`` (the ``tp_rank``-th piece). One of ``TP_DEGREES``."""
    tp_rank: Index = 0
    """This rank's position in its TP group, 0 .. ``tp_degree`` - 1. The ``tp_rank`` 0
    rank is the stage's lead: ``Plan.replica_ranks`` lists the leads."""
    optimizer_offload: Flag = False
    """This rank keeps its optimizer state and an fp32 master copy of its trainable
    parameters in host memory (pinned on CUDA) and steps the model file's optimizer there:
    after the backward and the gradient sync its gradients go to the host, the updated
    parameters come back (``executor/memory/offload.py``). Not combined with ZeRO (stage 1
    or 2) or local sync."""


@record
class TrainingSpec:
    """How the runtime trains."""

    schedule: Schedule = Schedule.ONE_F_ONE_B
    backend: Backend = Backend.GLOO
    sync: SyncSpec | None = None
    """Islands and cross-island sync modes; None: one island, every holder set all-reduces
    its gradients every step."""
    zero_stage: ZeroStage = ZeroStage.NONE
    """Sharding of the optimizer state (stage 1), and of the summed gradients too (stage 2),
    among the ranks holding the same parameters."""
    seed: Annotated[int, Strict()] = 0
    process_group_timeout_s: Positive = 300.0
    master_host: str = "127.0.0.1"
    master_port: Port = 29500
    steps: Count | None = None
    """Optimizer steps a run trains (``hplan solve --steps``); ``--steps`` at run time
    overrides it. None: see ``epochs``."""
    epochs: Count | None = None
    """Passes over the model file's ``dataset()`` a run trains (``hplan solve --epochs``):
    ``epochs`` x its steps per epoch (``len(dataset()) // global_batch_size``). None with
    ``steps`` None: the run must be given ``--steps``."""
    min_microbatch_samples: Count = 1
    """The fewest samples any micro-batch may hold, here and when a run moves samples between
    replicas (``executor/control/rebalance.py``): 2 for a model that normalises by the
    batch's statistics in training (BatchNorm: one sample has no variance), else 1."""


@record
class RankReport:
    """Predictions for one rank (ignored by the runtime)."""

    rank: Index
    stage_time_per_microbatch_s: NonNegative
    """Forward + backward + boundary transfers of one full micro-batch on this rank."""
    busy_time_s: NonNegative
    """Predicted compute time of one optimizer step."""
    memory_bytes: ByteCount
    """Predicted peak memory: parameters, gradients, optimizer state, activations in flight,
    workspace (the sum of the five ``*_memory_bytes`` below when they are given)."""
    memory_capacity_bytes: ByteCount
    """What the plan may fill on the rank's device (``memory.usable_memory_bytes``)."""
    relative_speed: NonNegative = 1.0
    """This rank's device speed on this model relative to the plan's fastest device
    (standalone samples/s ratio, 1.0 = fastest); rehearsal stretches CPU compute by its
    inverse."""
    forward_time_s: NonNegative = 0.0
    """Predicted forward compute of one full micro-batch on this rank (0: not predicted)."""
    backward_time_s: NonNegative = 0.0
    """Predicted backward compute of one full micro-batch on this rank."""
    last_forward_time_s: NonNegative = 0.0
    """Predicted forward compute of the rank's last micro-batch where it is smaller than
    the others (``microbatch_sizes``); 0: it is not, or nothing predicted it (a full one's
    time stands for it)."""
    last_backward_time_s: NonNegative = 0.0
    """Predicted backward compute of that smaller last micro-batch (0 as above)."""
    optimizer_time_s: NonNegative = 0.0
    """Predicted optimizer step of this rank's parameters."""
    parameter_memory_bytes: ByteCount = 0
    """Parameters and buffers this rank holds (0 in all five: no breakdown recorded)."""
    gradient_memory_bytes: ByteCount = 0
    optimizer_state_memory_bytes: ByteCount = 0
    """This rank's optimizer state: its shard under ZeRO stage 1."""
    activation_memory_bytes: ByteCount = 0
    """Activations of the micro-batches in flight at once under the schedule and the
    rank's memory strategy."""
    workspace_memory_bytes: ByteCount = 0
    """Boundary send/receive buffers and autocast's half-precision weight copy."""
    memory_strategy_time_s: NonNegative = 0.0
    """What the rank's memory strategy adds to a step: recomputed forwards, under ZeRO
    the all-gather of the updated shards, under offload the transfers and the host's
    optimizer step less the device's own optimizer step."""
    host_memory_bytes: ByteCount = 0
    """Host memory this rank's optimizer offload holds (0: it does not offload, or it runs
    on a ``cpu`` device, where the host is its device)."""
    cost_source: str = "roofline"
    """Where this rank's forward/backward times came from: ``roofline``, ``measured``,
    ``measured (interpolated)``, ``roofline x 0.42 (scaled by measured devices)``,
    ``calibrated`` ... (distinct sources of its units joined by ``; ``)."""


@record
class BaselineReport:
    """Predicted throughput of what other tools would do on the same cluster."""

    name: str
    samples_per_s: NonNegative | None
    """None when the baseline does not fit in memory."""
    note: str


@record
class IdleDeviceReport:
    """A device of the cluster that no rank uses, and why (from the cost model)."""

    device: str
    """The device's name, ``<node>/<index>``."""
    kind: str
    reason: str
    """One line: the memory check it fails, or what the best layout with it costs."""


@record
class GradSyncReport:
    """Gradients that one holder set of ranks sums every step (one all-reduce bucket)."""

    ranks: tuple[Index, ...]
    """Sorted ranks whose units use the parameters."""
    num_bytes: ByteCount
    """Bytes all-reduced per step: the gradients in the wire dtype (float32 or wider)."""


@record
class SyncChoiceReport:
    """Why one cross-island holder set syncs the way the plan says (the planner's choice)."""

    ranks: tuple[Index, ...]
    mode: SyncMode
    local_steps: LocalSteps
    all_reduce_time_s: NonNegative
    """What summing the group's gradients every step would expose per step."""
    outer_sync_time_s: NonNegative
    """One outer sync of the group's pseudo-gradients over its slowest link (0 for
    ``all_reduce``)."""
    exposed_time_per_step_s: NonNegative
    """What the chosen mode adds to an average step."""
    reason: str
    """One line: why this mode and this H."""
    num_fragments: Count = 1
    overlap_steps: Index = 0
    wire_dtype: PseudoGradientDtype = PseudoGradientDtype.FLOAT32
    """The group's fragments, overlap and wire format (its ``OuterSyncSpec``'s)."""


@record
class Report:
    """Why this plan: predictions and solver facts. The runtime ignores it."""

    predicted_step_time_s: NonNegative
    predicted_samples_per_s: NonNegative
    physical_bound_samples_per_s: NonNegative
    """Samples/s no layout exceeds under the planning model: every device computing the
    whole step at its fastest per-sample unit times, no bubble, sync or optimizer, and
    at most the global batch per step, with each micro-batch's fixed cost, its trip through
    every unit and a stage's wait for the stages before it (``hplan.planner.solve.bound``;
    0 when not computed)."""
    efficiency: NonNegative
    """predicted_samples_per_s / physical_bound_samples_per_s."""
    bottleneck_rank: Index
    ranks: tuple[RankReport, ...]
    solver_status: SolverStatus
    optimality_gap: NonNegative | None
    """Relative gap between the returned step time and the best lower bound; None if unknown."""
    solver_backend: str
    cost_source: str
    reference_time_per_sample_s: NonNegative
    """Forward + backward time per sample of the whole model on the plan's fastest device, at
    ``reference_micro_batch_size``. Rehearsal times the same work on its CPU to convert
    predictions into emulated time."""
    reference_micro_batch_size: Count = 1
    """The plan's largest micro-batch size (where the reference time is taken)."""
    baselines: tuple[BaselineReport, ...] = ()
    notes: tuple[str, ...] = ()
    simulated_step_time_s: NonNegative | None = None
    """Step time of the event-driven simulation of this plan (``hplan simulate``); None:
    not simulated."""
    grad_sync: tuple[GradSyncReport, ...] | None = None
    """The gradient all-reduce groups of the plan, sorted by ranks; None: not recorded."""
    idle_devices: tuple[IdleDeviceReport, ...] = ()
    """Every device of the cluster no rank uses, in cluster order, with the reason."""
    sync_choices: tuple[SyncChoiceReport, ...] = ()
    """One per cross-island holder set of ``training.sync``, sorted by ranks."""

    def verify(self) -> None:
        """Every figure of the report and of its ranks and baselines is in its declared
        range (``NonNegative``, ``Index`` ...; what ``plan.schema.json`` says).

        Raises:
            PlanFileError: naming the first figure that is not.
        """
        _check_ranges(self, _report_adapter(), prefix=("report",))


@record
class Plan:
    """A complete, runnable training plan. See the module docstring."""

    schema_version: Literal[2] = SCHEMA_VERSION
    """Version of this format; a reader rejects other versions (see ``from_json``)."""
    model: ModelSpec
    global_batch_size: Count
    units: tuple[UnitSpec, ...]
    cuts: tuple[CutSpec, ...]
    """Only the cuts some replica uses, in unit order."""
    cluster: ClusterSpec
    training: TrainingSpec = field(default_factory=TrainingSpec)
    """Defaults only for plans built in code: :meth:`from_json` refuses a file without it."""
    ranks: tuple[RankPlan, ...]
    report: Report
    memory: MemoryModelSpec | None = None
    """Sizes for the memory check at load (``contract.memory.check_fits``). ``hplan solve``
    always writes them and :meth:`from_json` refuses a file without them (a plan whose
    memory cannot be re-checked is not run); None only while the planner builds a plan."""

    # ----------------------------------------------------------------- derived views
    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def num_replicas(self) -> int:
        return 1 + max(r.replica for r in self.ranks)

    @property
    def loss_scaling(self) -> bool:
        """Whether the job scales its loss: some rank computes in fp16. One loss scale is
        then shared by every rank (gradients cross stages and replicas at that scale)."""
        return any(r.precision is Precision.FP16 for r in self.ranks)

    def replica_ranks(self, replica: int) -> tuple[RankPlan, ...]:
        """The stage leads of one replica (``tp_rank`` 0: every rank without tensor
        parallelism), in stage order."""
        return tuple(
            sorted(
                (r for r in self.ranks if r.replica == replica and r.tp_rank == 0),
                key=_stage_key,
            )
        )

    def tp_group(self, rank: int) -> tuple[RankPlan, ...]:
        """The ranks of ``rank``'s stage of its replica (its TP group), in ``tp_rank``
        order; ``(plans.ranks[rank],)`` without tensor parallelism."""
        me = self.ranks[rank]
        return tuple(
            sorted(
                (r for r in self.ranks if r.replica == me.replica and r.stage == me.stage),
                key=lambda r: r.tp_rank,
            )
        )

    @property
    def tensor_parallel(self) -> bool:
        """Whether some stage runs on a TP group of two or more ranks."""
        return any(r.tp_degree > 1 for r in self.ranks)

    def cut_after(self, unit: str) -> CutSpec:
        """The boundary after ``unit``; raises ``PlanFileError`` if the plan lacks it."""
        for cut in self.cuts:
            if cut.after_unit == unit:
                return cut
        raise PlanFileError(f"plan has no cut after unit {unit!r}; re-run `hplan solve`")

    def unit(self, name: str) -> UnitSpec:
        for unit in self.units:
            if unit.name == name:
                return unit
        raise PlanFileError(f"plan has no unit {name!r}; re-run `hplan solve`")

    def device(self, name: str) -> DeviceSpec:
        for device in self.cluster.devices:
            if device.name == name:
                return device
        raise PlanFileError(f"plan has no device {name!r}; re-run `hplan solve`")

    def node(self, name: str) -> NodeSpec:
        for node in self.cluster.nodes:
            if node.name == name:
                return node
        raise PlanFileError(f"plan has no node {name!r}; re-run `hplan solve`")

    def fixed_shares_reason(self) -> str | None:
        """Why a run of this plan keeps its batch shares throughout (None: its replicas may
        move samples between steps as their measured speeds ask, ``executor/control/rebalance.py``:
        two or more replicas of one stage each that sum their gradients every step)."""
        if self.num_replicas < 2:
            return "one replica"
        if any(len(self.replica_ranks(r)) > 1 for r in range(self.num_replicas)):
            return "a replica is a pipeline"
        if self.training.sync is not None and self.training.sync.local:
            return "islands train on their own"
        return None

    def sample_offset(self, replica: int) -> int:
        """Index of this replica's first sample within the global batch."""
        firsts = [self.replica_ranks(r)[0] for r in range(replica)]
        return sum(r.num_samples for r in firsts)

    def link(self, a: str, b: str) -> LinkSpec:
        for link in self.cluster.links:
            if {link.a, link.b} == {a, b}:
                return link
        raise PlanFileError(f"plan has no link between {a!r} and {b!r}; re-run `hplan solve`")

    def ring_channel(self, devices: Sequence[str]) -> tuple[float, float]:
        """(bandwidth in bytes/s, latency per step in s) of a ring all-reduce over
        ``devices``: the slowest link among them, and no faster than the measured
        all-reduce of any of their nodes (``NodeSpec.collective``).

        Raises:
            PlanFileError: fewer than two devices, or a pair without a link.
        """
        if len(devices) < 2:
            raise PlanFileError(f"a ring needs two devices or more, got {list(devices)}")
        links = [self.link(a, b) for i, a in enumerate(devices) for b in devices[i + 1 :]]
        node_of = {d.name: d.node for d in self.cluster.devices}
        nodes = {n.name: n for n in self.cluster.nodes}
        measured = [c for c in (nodes[node_of[d]].collective for d in devices) if c is not None]
        return (
            min([link.bandwidth_bytes_per_s for link in links]
                + [c.bus_bandwidth_bytes_per_s for c in measured]),
            max([link.latency_s for link in links] + [c.latency_per_step_s for c in measured]),
        )  # fmt: skip

    def digest(self) -> str:
        """sha256 hex of what the plan runs: every field but the ``report`` (predictions do
        not change what a rank does). Ranks of one job must have the same digest."""
        return _sha256_json(self._runnable())

    def section_digests(self) -> dict[str, str]:
        """{top-level field: sha256 hex of it} of :meth:`digest`'s fields, to say which
        parts of two plans differ (``"cuts"``, ``"ranks"`` ...)."""
        return {key: _sha256_json(value) for key, value in self._runnable().items()}

    def _runnable(self) -> dict[str, Any]:
        data: dict[str, Any] = _adapter().dump_python(self, mode="json")
        data.pop("report", None)
        return data

    # ----------------------------------------------------------------- (de)serialisation
    def to_json(self) -> str:
        """Deterministic JSON text (2-space indent, field order as declared, newline at end)."""
        data = _adapter().dump_python(self, mode="json")
        return json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n"

    @staticmethod
    def load(path: str | Path) -> Plan:
        """Read and validate ``plan.json``.

        Raises:
            PlanFileError: unreadable file, or see :meth:`from_json`.
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise PlanFileError(
                f"cannot read plan {str(path)!r} ({exc.strerror}); check the path"
            ) from None
        try:
            return Plan.from_json(text)
        except PlanFileError as exc:
            raise PlanFileError(f"{path}: {exc}") from None

    @staticmethod
    def from_json(text: str) -> Plan:
        """Parse and validate plan JSON.

        Raises:
            PlanFileError: not JSON, wrong schema version, unknown keys, wrong types, no
                ``memory`` section, or an inconsistent plan (see :meth:`verify`). The message
                names the field.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFileError(f"plan is not valid JSON ({exc}); re-run `hplan solve`") from None
        if not isinstance(data, dict):
            raise PlanFileError("plan JSON must be an object; re-run `hplan solve`")
        if "ranks" not in data or "cluster" not in data:
            raise PlanFileError(
                "this is not a plan (no 'ranks' or 'cluster'; a profile or another hplan "
                "file?); give the plan.json `hplan solve` wrote"
            )
        version = data.get("schema_version")
        if isinstance(version, float) and version == SCHEMA_VERSION:
            raise PlanFileError(
                f"plan schema_version is {version!r}; write the integer {SCHEMA_VERSION} or "
                "re-run `hplan solve`"
            )
        if isinstance(version, str) and version.strip() == str(SCHEMA_VERSION):
            raise PlanFileError(
                f"plan schema_version is the string {version!r}; write the number "
                f"{SCHEMA_VERSION} (no quotes) or re-run `hplan solve`"
            )
        if version != SCHEMA_VERSION:
            raise PlanFileError(
                f"plan schema_version is {version!r}, this hplan reads {SCHEMA_VERSION}; "
                "re-run `hplan solve` with this version"
            )
        if "training" not in data:  # its defaults (all_reduce, gloo) would run another job
            raise PlanFileError(
                "plan has no 'training' section (schedule, backend, sync), so it cannot be run "
                "as solved; re-run `hplan solve` to write a complete plan.json"
            )
        try:
            plan = _adapter().validate_python(data)
        except ValidationError as exc:
            raise PlanFileError(_validation_message(exc, data, ())) from None
        _verify_plan(plan)
        if plan.memory is None:
            raise PlanFileError(
                "plan has no 'memory' section (the sizes its memory is checked with), so it "
                "cannot be checked against its devices; re-run `hplan solve` to write a "
                "complete plan.json"
            )
        return plan

    @staticmethod
    def json_schema() -> dict[str, Any]:
        """The JSON Schema of plan.json (draft 2020-12), generated from these types."""
        return _adapter().json_schema()

    # ----------------------------------------------------------------- consistency
    def verify(self) -> None:
        """Check internal consistency; raise ``PlanFileError`` naming the first problem.

        Checks: every value in its declared range (the field constraints, as on load: a
        process-group timeout > 0 s, a master port in 1..65534, finite figures >= 0 ...);
        ranks numbered 0..n-1; every rank's device and node exist; each replica's stages
        are 0..k-1 and hold contiguous, in-order runs of units that cover every unit exactly
        once; every replica-internal cut exists in ``cuts``; micro-batch fields agree within
        a replica; no micro-batch holds fewer than ``training.min_microbatch_samples``;
        batch shares sum to ``global_batch_size``; the training length is given as steps or
        as epochs, not both.
        """
        _check_ranges(self, _adapter(), prefix=())
        _verify_plan(self)


def _stage_key(rank: RankPlan) -> int:
    return rank.stage


def _sha256_json(value: object) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@cache
def _adapter() -> TypeAdapter[Plan]:
    return TypeAdapter(Plan)


def _fail(msg: str) -> None:
    raise PlanFileError(f"invalid plan: {msg}")


_RANGE_ERRORS = frozenset(
    ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number")
)
_RULES = {
    "greater_than": "> {gt}",
    "greater_than_equal": ">= {ge}",
    "less_than": "< {lt}",
    "less_than_equal": "<= {le}",
    "finite_number": "a finite number",
}
Loc = tuple[int | str, ...]


@cache
def _report_adapter() -> TypeAdapter[Report]:
    return TypeAdapter(Report)


def _check_ranges(value: Any, adapter: TypeAdapter[Any], *, prefix: Loc) -> None:
    """Validate an instance again (``revalidate_instances``: every field constraint).

    Raises:
        PlanFileError: naming the first value out of its range.
    """
    try:
        adapter.validate_python(value)
    except ValidationError as exc:
        raise PlanFileError(_validation_message(exc, adapter.dump_python(value), prefix)) from None


def _validation_message(exc: ValidationError, data: Any, prefix: Loc) -> str:
    """One line for pydantic's first error on plan ``data`` (at ``prefix`` in a plan)."""
    first = exc.errors()[0]
    loc: Loc = (*prefix, *first["loc"])
    if first["type"] == "bool_type":
        where = ".".join(str(p) for p in loc)
        return (
            f"plan field {where!r} is {first['input']!r}; it must be true or false (a JSON "
            "boolean, not a string or number): fix that value or re-run `hplan solve`"
        )
    if first["type"] == "int_type":
        where = ".".join(str(p) for p in loc)
        return (
            f"plan field {where!r} is {first['input']!r}; it must be a JSON integer (no "
            "quotes, no decimal point): fix that value or re-run `hplan solve`"
        )
    if first["type"] not in _RANGE_ERRORS:
        where = ".".join(str(p) for p in loc)
        return f"plan field {where!r}: {first['msg']}; re-run `hplan solve`"
    ctx = first.get("ctx", {})
    rule = _RULES[first["type"]].format(**ctx)
    inner = data
    for key in first["loc"][:-1]:
        inner = inner[key]
    return "invalid plan: " + _range_message(loc, first["input"], rule, inner, data)


def _range_message(loc: Loc, value: Any, rule: str, owner: Any, root: Any) -> str:
    """What is out of range, in the words of the record it belongs to (``owner``: the
    record's values; ``root``: the whole plan's, or the report's)."""
    field = loc[-1]
    if loc[:2] == ("cluster", "links"):
        return (
            f"link {owner['a']}-{owner['b']} has bandwidth {owner['bandwidth_bytes_per_s']} "
            f"B/s and latency {owner['latency_s']} s; bandwidth must be finite and > 0, "
            "latency finite and >= 0"
        )
    if loc[:2] == ("cluster", "devices") and field != "memory_bytes":
        return (
            f"device {owner['name']} has peak {owner['peak_flops']} FLOP/s and memory "
            f"bandwidth {owner['memory_bandwidth_bytes_per_s']} B/s; both must be finite and > 0"
        )
    if loc[:2] == ("cluster", "nodes") and "collective" in loc:
        return (
            f"node {root['cluster']['nodes'][loc[2]]['name']}'s collective has bus bandwidth "
            f"{owner['bus_bandwidth_bytes_per_s']:.4g} B/s and latency "
            f"{owner['latency_per_step_s']:.4g} s per step; bandwidth must be finite and > 0, "
            "latency finite and >= 0 (re-run `hplan solve`, or remove the collective)"
        )
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if loc == ("training", "process_group_timeout_s"):
        return f"{where} is {value}; it must be a number of seconds > 0"
    if loc == ("training", "master_port"):
        return f"{where} is {value}; it must be in 1..65534"
    return f"{where} is {value}; it must be {rule}"


def _verify_plan(plan: Plan) -> None:
    """The structural checks of :meth:`Plan.verify` (the ranges are the types')."""
    if [r.rank for r in plan.ranks] != list(range(len(plan.ranks))):
        _fail("ranks must be listed in order 0..n-1")
    if not plan.ranks:
        _fail("plan has no ranks")
    if plan.training.steps is not None and plan.training.epochs is not None:
        _fail("training gives both steps and epochs; keep one")
    device_names = {d.name for d in plan.cluster.devices}
    node_names = {n.name for n in plan.cluster.nodes}
    used_devices = [r.device for r in plan.ranks]
    if len(set(used_devices)) != len(used_devices):
        _fail("two ranks share one device")
    for rank in plan.ranks:
        if rank.device not in device_names:
            _fail(f"rank {rank.rank} uses unknown device {rank.device!r}")
        if rank.node not in node_names:
            _fail(f"rank {rank.rank} is on unknown node {rank.node!r}")
    _verify_tp(plan)
    unit_order = [u.name for u in plan.units]
    if len(set(unit_order)) != len(unit_order):
        _fail("unit names repeat")
    cut_units = {c.after_unit for c in plan.cuts}
    total = 0
    for replica in range(plan.num_replicas):
        ranks = plan.replica_ranks(replica)
        if not ranks:
            _fail(f"replica {replica} has no ranks")
        _verify_replica(replica, ranks, unit_order, cut_units)
        total += ranks[0].num_samples
    if total != plan.global_batch_size:
        _fail(f"batch shares sum to {total}, global_batch_size is {plan.global_batch_size}")
    _verify_floor(plan)
    if plan.training.sync is not None:
        _verify_sync(plan, plan.training.sync)
    if plan.training.zero_stage is not ZeroStage.NONE:
        _verify_zero(plan)
    if any(r.optimizer_offload for r in plan.ranks):
        _verify_offload(plan)
    if plan.memory is not None:
        _verify_memory(plan, plan.memory)


_TP_SAME: Final = (
    "node", "device_kind", "units", "micro_batch_size", "num_microbatches", "num_samples",
    "memory_strategy", "recompute_units", "precision", "tp_degree",
)  # fmt: skip
"""What every rank of one TP group shares."""


def _verify_tp(plan: Plan) -> None:
    """TP groups: ``tp_degree`` ranks per (replica, stage), consecutive, alike; a TP plan
    in the model; the holders of a unit all of one degree."""
    groups: dict[tuple[int, int], list[RankPlan]] = {}
    for rank in plan.ranks:
        if rank.tp_degree not in TP_DEGREES:
            _fail(f"rank {rank.rank} has tp_degree {rank.tp_degree}; use one of {TP_DEGREES}")
        if rank.tp_rank >= rank.tp_degree:
            _fail(f"rank {rank.rank} has tp_rank {rank.tp_rank} >= tp_degree {rank.tp_degree}")
        groups.setdefault((rank.replica, rank.stage), []).append(rank)
    for (replica, stage), members in groups.items():
        lead = members[0]
        where = f"replica {replica} stage {stage}"
        if sorted(r.tp_rank for r in members) != list(range(lead.tp_degree)):
            _fail(
                f"{where} has tp_ranks {[r.tp_rank for r in members]}; its TP group of "
                f"degree {lead.tp_degree} needs tp_ranks 0..{lead.tp_degree - 1} once each"
            )
        if [r.tp_rank for r in members] != sorted(r.tp_rank for r in members) or [
            r.rank for r in members
        ] != list(range(lead.rank, lead.rank + len(members))):
            _fail(f"{where}: the ranks of a TP group must be consecutive, in tp_rank order")
        for rank in members[1:]:
            for name in _TP_SAME:
                if getattr(rank, name) != getattr(lead, name):
                    _fail(
                        f"{where}: rank {rank.rank} has another {name} than rank "
                        f"{lead.rank}; the ranks of a TP group differ only in device"
                    )
    if plan.tensor_parallel and not plan.model.tp_plan:
        _fail(
            "a stage has tp_degree > 1 but the model has no tensor-parallel plan "
            "(model.tp_plan); re-run `hplan solve` with --tensor-parallel never"
        )
    degree_of: dict[str, int] = {}
    for rank in plan.ranks:
        for unit in rank.units:
            if degree_of.setdefault(unit, rank.tp_degree) != rank.tp_degree:
                _fail(
                    f"unit {unit!r} is held by stages of tp_degree {degree_of[unit]} and "
                    f"{rank.tp_degree}; every holder of a unit has one degree"
                )


def _verify_floor(plan: Plan) -> None:
    floor = plan.training.min_microbatch_samples
    for replica in range(plan.num_replicas):
        first = plan.replica_ranks(replica)[0]
        smallest = min(microbatch_sizes(first.num_samples, first.micro_batch_size))
        if smallest < floor:
            _fail(
                f"replica {replica} has a micro-batch of {smallest} sample(s), fewer than "
                f"training.min_microbatch_samples {floor}; re-run `hplan solve`"
            )


def _verify_offload(plan: Plan) -> None:
    if plan.training.zero_stage is not ZeroStage.NONE:
        _fail(
            f"optimizer_offload with zero_stage {int(plan.training.zero_stage)} is not "
            "supported; use zero_stage 0 or set optimizer_offload false on every rank"
        )
    if plan.training.sync is not None and plan.training.sync.local:
        _fail(
            "optimizer_offload with local_sgd or async groups is not supported; set "
            "optimizer_offload false on every rank or sync every step (all_reduce)"
        )


def _verify_zero(plan: Plan) -> None:
    if plan.training.sync is not None and plan.training.sync.local:
        _fail(
            f"zero_stage {int(plan.training.zero_stage)} with local_sgd or async groups is "
            "not supported; use zero_stage 0"
        )
    for ranks in sorted(_holder_sets(plan)):
        if sum(plan.ranks[r].optimizer_shard_weight for r in ranks) <= 0:
            _fail(
                f"holder set {list(ranks)} has optimizer_shard_weight 0 on every rank; "
                "give one of them a weight > 0"
            )


def _verify_memory(plan: Plan, memory: MemoryModelSpec) -> None:
    if [u.unit for u in memory.units] != [u.name for u in plan.units]:
        _fail("memory.units must list every unit once, in unit order")
    names = {p.name for p in memory.parameters}
    if len(names) != len(memory.parameters):
        _fail("memory.parameters names repeat")
    unknown = sorted(names - {p for u in plan.units for p in u.params})
    if unknown:
        _fail(f"memory.parameters names {unknown[0]!r}, which no unit uses")


def _verify_sync(plan: Plan, sync: SyncSpec) -> None:
    names = [i.name for i in sync.islands]
    if len(set(names)) != len(names):
        _fail(f"island names repeat: {names}")
    placed = [n for i in sync.islands for n in i.nodes]
    nodes = [n.name for n in plan.cluster.nodes]
    if any(not i.nodes for i in sync.islands):
        _fail("an island has no nodes")
    if sorted(placed) != sorted(nodes):
        _fail(f"islands must hold every node of the cluster once: {placed} vs {nodes}")
    island = {n: i.name for i in sync.islands for n in i.nodes}
    spanning = {s for s in _holder_sets(plan) if len({island[plan.ranks[r].node] for r in s}) > 1}
    seen: set[tuple[int, ...]] = set()
    for group in sync.groups:
        if group.ranks not in spanning:
            _fail(
                f"sync group {list(group.ranks)} is not a holder set spanning two or more "
                "islands; re-run `hplan solve`"
            )
        if group.ranks in seen:
            _fail(f"sync group {list(group.ranks)} is listed twice")
        seen.add(group.ranks)
        if group.mode is SyncMode.ALL_REDUCE and group.local_steps != 1:
            _fail(f"sync group {list(group.ranks)} all-reduces every step: local_steps must be 1")
        if group.overlap_steps and (
            group.mode is not SyncMode.LOCAL_SGD or group.overlap_steps >= group.local_steps
        ):
            _fail(
                f"sync group {list(group.ranks)} has overlap_steps {group.overlap_steps} under "
                f"{group.mode.value} H={group.local_steps}; only local_sgd overlaps, by at most "
                "H - 1 steps (async applies one round late by itself)"
            )
        if (
            group.wire_dtype is not PseudoGradientDtype.FLOAT32
            and group.mode is SyncMode.ALL_REDUCE
        ):
            _fail(
                f"sync group {list(group.ranks)} all-reduces every step: its wire_dtype must be "
                "float32 (wire formats are for pseudo-gradients)"
            )
        if group.num_fragments > group.local_steps and group.mode is not SyncMode.ALL_REDUCE:
            _fail(
                f"sync group {list(group.ranks)} has {group.num_fragments} fragments for "
                f"{group.local_steps} local steps; at most one fragment per step"
            )
    if [g.ranks for g in sync.groups] != sorted(g.ranks for g in sync.groups):
        _fail("sync groups must be sorted by ranks")
    if sync.local:
        for replica in range(plan.num_replicas):
            where = {island[r.node] for r in plan.replica_ranks(replica)}
            if len(where) > 1:
                _fail(
                    f"replica {replica} spans islands {sorted(where)}; with local_sgd or async "
                    "every replica must lie inside one island"
                )


def _verify_replica(
    replica: int, ranks: tuple[RankPlan, ...], unit_order: list[str], cut_units: set[str]
) -> None:
    if [r.stage for r in ranks] != list(range(len(ranks))):
        _fail(f"replica {replica} stages must be 0..{len(ranks) - 1}")
    held = [u for r in ranks for u in r.units]
    if held != unit_order:
        _fail(f"replica {replica} must hold every unit once, in order and contiguously")
    if any(not r.units for r in ranks):
        _fail(f"replica {replica} has an empty stage")
    first = ranks[0]
    for rank in ranks:
        for name in ("micro_batch_size", "num_microbatches", "num_samples"):
            if getattr(rank, name) != getattr(first, name):
                _fail(
                    f"replica {replica}: rank {rank.rank} has {name} {getattr(rank, name)}, "
                    f"rank {first.rank} (stage 0) {getattr(first, name)}; every stage of a "
                    "replica runs the same micro-batches"
                )
    if not (first.num_microbatches - 1) * first.micro_batch_size < first.num_samples:
        _fail(f"replica {replica} has an empty micro-batch")
    if first.num_samples > first.micro_batch_size * first.num_microbatches:
        _fail(f"replica {replica} cannot fit its samples in its micro-batches")
    for rank in ranks[:-1]:
        if rank.units[-1] not in cut_units:
            _fail(f"cut after unit {rank.units[-1]!r} (replica {replica}) is missing")
    for rank in ranks:
        _verify_recompute_units(rank)


def _verify_recompute_units(rank: RankPlan) -> None:
    """``recompute_units``: some (not all) of the rank's units, in order, under
    ``selective`` only."""
    chosen = rank.recompute_units
    if rank.memory_strategy is not MemoryStrategy.SELECTIVE:
        if chosen:
            _fail(
                f"rank {rank.rank} lists recompute_units under memory_strategy "
                f"{rank.memory_strategy.value}; set memory_strategy selective or empty the list"
            )
        return
    if not chosen or len(chosen) >= len(rank.units):
        _fail(
            f"rank {rank.rank} is selective with {len(chosen)} of its {len(rank.units)} units "
            "recomputed; name some but not all of its units (none: keep_activations, all: "
            "recompute)"
        )
    order = [u for u in rank.units if u in set(chosen)]
    if list(chosen) != order or len(set(chosen)) != len(chosen):
        _fail(
            f"rank {rank.rank} recompute_units {list(chosen)} must be its own units, once "
            f"each, in stage order ({', '.join(rank.units)})"
        )


def _holder_sets(plan: Plan) -> set[tuple[int, ...]]:
    """The distinct sorted rank sets of two or more ranks that hold a parameter at one TP
    position (what ``holders.holder_sets`` orders; computed here, since ``holders`` imports this module)."""
    units = {u.name: u for u in plan.units}
    found: dict[tuple[str, int], set[int]] = {}
    for rank in plan.ranks:
        for unit in rank.units:
            for name in units[unit].params:
                found.setdefault((name, rank.tp_rank), set()).add(rank.rank)
    return {tuple(sorted(ranks)) for ranks in found.values() if len(ranks) > 1}


def microbatch_sizes(num_samples: int, micro_batch_size: int) -> tuple[int, ...]:
    """Sizes of a replica's micro-batches: full ones, then one smaller remainder if any.

    Example: 8 samples at micro-batch size 3 -> (3, 3, 2).
    """
    full, rest = divmod(num_samples, micro_batch_size)
    return (micro_batch_size,) * full + ((rest,) if rest else ())
