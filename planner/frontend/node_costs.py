"""Measure what every node of a traced graph costs, per sample of the model's input.

:func:`measure_node_costs` runs the graph node by node (a torch.fx Interpreter) at two
batch sizes and records, per node: the output shapes and dtypes, FLOPs
(``torch.utils.flop_counter.FlopCounterMode``), bytes read and written, bytes saved for
backward (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once) and the
activation bytes of channels-first convolutions (:class:`ConvolutionCosts`). Attention is
costed as the fused CUDA kernels run it (``attention_costs.py``) and recurrent layers by
formula (``recurrent_costs.py``), whatever kernel runs here; grouped matmuls and expert
layers as ``moe.py`` says; ops that compute without a FLOP figure are named
(``uncosted_ops.py``).
Per-sample figures are the difference between the two runs over the difference of the batch
sizes, so parameters cancel out. It runs on the capture's fake tensors (no memory, no
compute).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from hplan.planner.frontend.attention_costs import FusedAttentionCosts
from hplan.planner.frontend.capture import CapturedModel, meta_copy, to_meta
from hplan.planner.frontend.moe import moe_flop_formulas
from hplan.planner.frontend.recurrent_costs import RecurrentCosts
from hplan.planner.frontend.uncosted_ops import UncostedOps
from hplan.runtime.contract.errors import ModelFileError, one_line
from hplan.runtime.contract.plan import TensorSpec


def measure_node_costs(captured: CapturedModel) -> tuple[dict[str, NodeCost], list[str]]:
    """Per-sample costs of every node of the captured graph, from runs at its two batch sizes.

    On the capture's fake tensors; for a capture on real tensors, on a meta copy of the
    graph when it runs there, else on the captured graph with its CPU tensors (its buffers
    restored after each run).

    Returns:
        ({node name: per-sample cost}, notes): a note says when the meta device failed
        and the graph ran on CPU tensors.

    Raises:
        ModelFileError: the traced graph fails on its fake tensors, or on CPU, at one of
            the batch sizes.
    """
    small, large = captured.batch_sizes
    runs, notes = _measure(captured)
    costs = {
        name: _per_sample(name, runs[small][name], runs[large][name], small, large)
        for name in runs[small]
    }
    return costs, notes


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (``numel * element_size``)."""
    return tensor.numel() * tensor.element_size()


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
    channels_first_conv_bytes: int = 0
    """Input plus output bytes of the node's channels-first convolutions."""
    conv_flops: float = 0.0
    """FLOPs of the node's convolutions (part of ``flops``)."""
    uncosted_ops: tuple[str, ...] = ()
    """Ops the node ran that compute but have no FLOP figure (``uncosted_ops.py``)."""


@dataclass(frozen=True)
class NodeCost:
    """Per-sample figures of one node; ``spec`` if its output may cross a cut."""

    flops: float
    saved_bytes: float
    io_bytes: float
    output_bytes: float
    spec: TensorSpec | None
    channels_first_conv_bytes: float = 0.0
    """Activation input plus output bytes of the node's convolutions whose input is
    channels-first (what cuDNN transposes around a tensor-core convolution)."""
    conv_flops: float = 0.0
    """FLOPs of the node's convolutions, part of ``flops`` (cuDNN runs them, on tensor
    cores or not: ``problem_builder.RooflineSource``)."""
    uncosted_ops: tuple[str, ...] = ()
    """Ops the node runs that compute but have no FLOP figure, so ``flops`` leaves them
    out (``uncosted_ops.py``)."""


_CONVOLUTIONS = (torch.ops.aten.convolution.default,)
_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


class ConvolutionCosts(TorchDispatchMode):
    """Adds up the FLOPs of every convolution (:attr:`flops`) and the activation input and
    output bytes of every 2-D or 3-D convolution that runs channels-first
    (:attr:`num_bytes`): cuDNN's tensor-core kernels compute in channels-last (NHWC) and
    transpose NCHW tensors in and out around them (NVIDIA, "Convolutional Layers User's
    Guide", Deep Learning Performance documentation, "Tensor Layouts In Memory: NCHW vs
    NHWC"), which the cost model charges where a convolution runs on tensor cores.

    On CUDA a convolution runs channels-last when its input or its weight is channels-last
    (``cudnn_conv_suggest_memory_format``); ``model.to(memory_format=torch.channels_last)``
    makes the weights so. Here the weight decides, then the input: fake and meta kernels do
    not keep every op's memory format (batch norm returns channels-first), so an input's
    strides cannot be trusted past the first layer. A weight whose strides fit both layouts
    (a 1x1 or depthwise kernel) follows the rest of the model: channels-last when any
    weight of it is.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.num_bytes = 0
        self.flops = 0
        self.channels_last_model = any(_strictly_channels_last(p) for p in module.parameters())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        if func not in _CONVOLUTIONS:
            return output
        activation, weight, transposed = args[0], args[1], bool(args[6])
        self.flops += conv_flop_count(
            list(activation.shape), list(weight.shape), list(output.shape), transposed
        )
        if activation.dim() in _CHANNELS_LAST and not self._runs_channels_last(activation, weight):
            self.num_bytes += tensor_nbytes(activation) + tensor_nbytes(output)
        return output

    def _runs_channels_last(self, activation: torch.Tensor, weight: torch.Tensor) -> bool:
        if _strictly_channels_last(weight) or _strictly_channels_last(activation):
            return True
        layout = _CHANNELS_LAST[weight.dim()]
        either = weight.is_contiguous() and weight.is_contiguous(memory_format=layout)
        return either and self.channels_last_model


def _strictly_channels_last(tensor: torch.Tensor) -> bool:
    """A 4-D or 5-D tensor laid out channels-last and not also channels-first."""
    layout = _CHANNELS_LAST.get(tensor.dim())
    return (
        layout is not None
        and tensor.is_contiguous(memory_format=layout)
        and not tensor.is_contiguous()
    )


class _Meter(torch.fx.Interpreter):
    """Runs a graph node by node and records FLOPs, bytes and saved tensors per node."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.runs: dict[str, _NodeRun] = {}
        self._seen: set[StorageWeakRef] = set()
        self._keep: list[torch.Tensor] = []
        self._saved: list[torch.Tensor] = []
        self._counter = FlopCounterMode(display=False, custom_mapping=moe_flop_formulas())
        self._attention = FusedAttentionCosts(self._counter, self._pack)
        self._recurrent = RecurrentCosts(self._counter, self._pack)
        self._convolutions = ConvolutionCosts(gm)
        self._uncosted = UncostedOps()

    def measure(self, args: Sequence[torch.Tensor]) -> dict[str, _NodeRun]:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        with (
            self._counter,
            self._convolutions,
            self._uncosted,
            hooks,
            self._attention,
            self._recurrent,
            _warnings_ignored(),
        ):
            self.run(*args, enable_io_processing=False)
        self._keep.clear()
        return self.runs

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._saved.append(tensor)
        return tensor

    def run_node(self, n: torch.fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        flops_before = self._flops()
        extra_before = self._extra_saved_bytes()
        self._uncosted.names = []
        convolutions_before = self._convolutions.num_bytes
        conv_flops_before = self._convolutions.flops
        self._saved = []
        result = super().run_node(n)
        inputs = _tensors((args, kwargs))
        outputs = _tensors(result)
        saved = self._extra_saved_bytes() - extra_before
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
            flops=float(self._flops() - flops_before),
            saved_bytes=saved,
            # A view (every output aliases an input) launches no kernel and moves nothing.
            read_bytes=sum(tensor_nbytes(t) for t in inputs) if moves and fresh else 0,
            written_bytes=sum(tensor_nbytes(t) for t in fresh) if moves else 0,
            output_bytes=sum(tensor_nbytes(t) for t in outputs),
            channels_first_conv_bytes=self._convolutions.num_bytes - convolutions_before,
            conv_flops=float(self._convolutions.flops - conv_flops_before),
            uncosted_ops=tuple(self._uncosted.names),
        )
        return result

    def _flops(self) -> int:
        adjustment = self._attention.flops_adjustment + self._recurrent.flops_adjustment
        return int(self._counter.get_total_flops()) + adjustment

    def _extra_saved_bytes(self) -> int:
        """Saved bytes charged by formula, not by tensors (fused kernels' own)."""
        return self._attention.extra_saved_bytes + self._recurrent.extra_saved_bytes


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def _warnings_ignored() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _tensor_info(value: Any) -> tuple[tuple[int, ...], str, bool] | None:
    if not isinstance(value, torch.Tensor):
        return None
    dtype = str(value.dtype).removeprefix("torch.")
    return tuple(value.shape), dtype, value.requires_grad and value.is_floating_point()


def _measure(captured: CapturedModel) -> tuple[dict[int, dict[str, _NodeRun]], list[str]]:
    """Node runs at each batch size: on fake tensors, else on meta if possible, else on CPU."""
    traced = captured.traced
    if captured.fake_mode is not None:
        return _measure_fake(captured), []
    try:
        return _measure_meta(captured), []
    except Exception as exc:
        note = (
            "costs measured with CPU tensors: the model does not run on the meta device "
            f"({_reason(exc)})"
        )
    runs = {}
    gm = traced.graph_module
    saved = {name: b.detach().clone() for name, b in gm.named_buffers()}
    for batch_size, feed in captured.inputs.items():
        args = [feed[name] for name in traced.input_names]
        try:
            runs[batch_size] = _Meter(gm).measure(args)
        except Exception as exc:
            raise ModelFileError(
                f"the traced graph fails at batch size {batch_size} ({one_line(exc)}); check "
                "that dim 0 of every sample_batch input is the sample dimension"
            ) from None
        finally:
            with torch.no_grad():
                for name, buffer in gm.named_buffers():
                    buffer.copy_(saved[name])
    return runs, [note]


def _reason(exc: BaseException) -> str:
    """An exception's first line; its class name only where the text needs it."""
    text = one_line(exc)
    return text.removeprefix("RuntimeError: ")


def _measure_fake(captured: CapturedModel) -> dict[int, dict[str, _NodeRun]]:
    """The captured graph run at both batch sizes on the capture's fake tensors."""
    traced, mode = captured.traced, captured.fake_mode
    assert mode is not None
    runs = {}
    for batch_size, feed in captured.inputs.items():
        try:
            with mode, captured.fake_runs():
                runs[batch_size] = _Meter(traced.graph_module).measure(
                    [feed[n] for n in traced.input_names]
                )
        except Exception as exc:
            raise ModelFileError(
                f"the traced graph fails on fake tensors at batch size {batch_size} "
                f"({one_line(exc)}); check that dim 0 of every sample_batch input is the "
                "sample dimension"
            ) from None
    return runs


def _measure_meta(captured: CapturedModel) -> dict[int, dict[str, _NodeRun]]:
    """The captured graph, copied onto the meta device, run at both batch sizes."""
    traced = captured.traced
    meta_gm = meta_copy(traced.graph_module)
    assert isinstance(meta_gm, torch.fx.GraphModule)
    return {
        b: _Meter(meta_gm).measure([to_meta(feed[n]) for n in traced.input_names])
        for b, feed in captured.inputs.items()
    }


def _per_sample(name: str, a: _NodeRun, b: _NodeRun, small: int, large: int) -> NodeCost:
    def slope(x: float, y: float) -> float:
        return max((y - x) / (large - small), 0.0)

    return NodeCost(
        flops=slope(a.flops, b.flops),
        saved_bytes=slope(a.saved_bytes, b.saved_bytes),
        io_bytes=slope(a.read_bytes + a.written_bytes, b.read_bytes + b.written_bytes),
        output_bytes=slope(a.output_bytes, b.output_bytes),
        spec=_tensor_spec(name, a, b, small, large),
        channels_first_conv_bytes=slope(a.channels_first_conv_bytes, b.channels_first_conv_bytes),
        conv_flops=slope(a.conv_flops, b.conv_flops),
        uncosted_ops=tuple(dict.fromkeys((*a.uncosted_ops, *b.uncosted_ops))),
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
