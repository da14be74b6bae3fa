"""Deterministic global batches, each replica's slice of them, and its micro-batches.

Every rank computes the same global batch for step ``t`` without talking to the others:

- with ``dataset()``: sample order is a permutation of ``range(len(dataset))`` drawn from
  ``seed + epoch``; an epoch has ``len(dataset) // G`` steps and global batch ``t`` of an
  epoch is slice ``[t * G, (t + 1) * G)`` of that permutation. **Drop-last rule:** the
  ``len(dataset) % G`` samples at the end of an epoch's permutation are not used in that
  epoch; the next epoch draws a new permutation, so no sample is dropped for good.
- without it: ``sample_batch(G)`` under a per-step seed (the global RNG state is restored).

A replica takes samples ``[sample_offset, sample_offset + num_samples)`` of the global batch
and cuts them into ``microbatch_sizes(num_samples, micro_batch_size)``; each stage gets only
the graph inputs it reads, and the last stage also gets the targets.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.data import default_collate

from hplan.runtime.capture.loss_items import count_items, slice_samples
from hplan.runtime.capture.model_file import ModelFile
from hplan.runtime.contract.errors import ConfigError, ModelFileError, PlanMismatchError, one_line
from hplan.runtime.contract.plan import InputSpec

Binder = Callable[[Any], dict[str, Tensor]]
"""Turns ``inputs`` as the model file gives them into ``{forward parameter name: tensor}``."""

_STEP_SEED_STRIDE = 1_000_003
"""Per-step seed = seed * stride + step (a prime stride keeps seeds of nearby runs apart)."""


def steps_per_epoch(num_samples: int, global_batch_size: int) -> int:
    """Optimizer steps in one epoch under the drop-last rule.

    Raises:
        ConfigError: the dataset has fewer samples than one global batch.
    """
    if num_samples < global_batch_size:
        raise ConfigError(
            f"dataset() has {num_samples} samples, fewer than the global batch of "
            f"{global_batch_size}; add data or re-run `hplan solve` with a smaller batch"
        )
    return num_samples // global_batch_size


@functools.lru_cache(maxsize=2)
def epoch_permutation(seed: int, epoch: int, num_samples: int) -> Tensor:
    """The sample order of ``epoch``: a permutation of ``range(num_samples)``, int64, shape
    ``(num_samples,)``. Drawn once per epoch and kept (callers must not change it), as
    torch's ``DistributedSampler`` does: drawn every step, it costs CPU time that grows with
    the dataset."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator)


def global_batch_indices(seed: int, step: int, num_samples: int, global_batch_size: int) -> Tensor:
    """Dataset indices of global batch ``step``, shape ``(global_batch_size,)``.

    Raises:
        ConfigError: the dataset is smaller than one global batch.
    """
    per_epoch = steps_per_epoch(num_samples, global_batch_size)
    epoch, step_in_epoch = divmod(step, per_epoch)
    order = epoch_permutation(seed, epoch, num_samples)
    start = step_in_epoch * global_batch_size
    return order[start : start + global_batch_size].clone()


def replica_indices(
    seed: int, step: int, num_samples: int, global_batch_size: int, offset: int, count: int
) -> Tensor:
    """Dataset indices of one replica's share of global batch ``step``, shape ``(count,)``."""
    assert offset >= 0 and offset + count <= global_batch_size
    indices = global_batch_indices(seed, step, num_samples, global_batch_size)
    return indices[offset : offset + count]


def batch_digest(batch: Any) -> str:
    """A fingerprint of a raw batch (``BatchSource.global_batch``): its nesting, and every
    tensor's dtype, shape and bytes, in order (a leaf that is not a tensor by its ``repr``
    when it is a number, string, bool or None, else by its type's name alone).

    ``rehearse --verify`` compares the ranks' step-0 batch with the one process's by it: a
    model file whose ``dataset()`` reads files (the GPT example reads this repository's
    Markdown files) gives other samples once one of them is edited.
    """
    leaves, spec = tree_flatten(batch)
    digest = hashlib.sha256(str(spec).encode())
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            tensor = leaf.detach().cpu().contiguous()
            digest.update(f"tensor {tensor.dtype} {tuple(tensor.shape)}\n".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif leaf is None or isinstance(leaf, int | float | str | bool):
            digest.update(f"{type(leaf).__name__} {leaf!r}\n".encode())
        else:
            digest.update(f"{type(leaf).__qualname__}\n".encode())
    return digest.hexdigest()


def batch_tensors(batch: Any) -> list[Tensor]:
    """The tensors of a raw batch, in pytree order, detached, on the CPU (what a rank saves
    of it: other leaves may not load with ``torch.load(weights_only=True)``)."""
    leaves, _ = tree_flatten(batch)
    return [leaf.detach().cpu() for leaf in leaves if isinstance(leaf, Tensor)]


def with_batch_tensors(batch: Any, tensors: Sequence[Tensor]) -> Any:
    """``batch`` with its tensors replaced by ``tensors`` (as :func:`batch_tensors` gave
    them, in order), its nesting and other leaves kept.

    Raises:
        ValueError: ``tensors`` has another count of tensors than ``batch``.
    """
    leaves, spec = tree_flatten(batch)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
    if len(positions) != len(tensors):
        raise ValueError(f"the batch has {len(positions)} tensors, {len(tensors)} were given")
    for position, tensor in zip(positions, tensors, strict=True):
        leaves[position] = tensor
    return tree_unflatten(leaves, spec)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of one replica."""

    index: int
    num_samples: int
    inputs: dict[str, Tensor]
    """Graph inputs by ``forward`` parameter name, each with this micro-batch's samples."""
    targets: Any
    """What ``loss_fn`` receives as targets (same nesting as the model file returns)."""


@dataclass
class BatchSource:
    """Produces a replica's micro-batches for any step, identically on every rank."""

    model_file: ModelFile
    bind: Binder
    seed: int
    global_batch_size: int
    input_specs: Sequence[InputSpec] = ()
    _dataset: Any = None

    def __post_init__(self) -> None:
        if self.model_file.dataset is not None:
            self._dataset = _checked_dataset(self.model_file)
            steps_per_epoch(len(self._dataset), self.global_batch_size)

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps per epoch with ``dataset()``; None when training on ``sample_batch``."""
        if self._dataset is None:
            return None
        return steps_per_epoch(len(self._dataset), self.global_batch_size)

    def replica_batch(self, step: int, offset: int, num_samples: int) -> tuple[Any, Any]:
        """Raw ``(inputs, targets)`` of samples ``[offset, offset + num_samples)`` of step."""
        if self._dataset is not None:
            indices = replica_indices(
                self.seed,
                step,
                len(self._dataset),
                self.global_batch_size,
                offset,
                num_samples,
            )
            return default_collate([self._dataset[int(i)] for i in indices])
        inputs, targets = self.global_batch(step)
        return slice_samples(inputs, offset, offset + num_samples), slice_samples(
            targets, offset, offset + num_samples
        )

    def global_batch(self, step: int) -> tuple[Any, Any]:
        """Raw ``(inputs, targets)`` of the whole global batch of ``step``."""
        if self._dataset is not None:
            return self.replica_batch(step, 0, self.global_batch_size)
        with torch.random.fork_rng(devices=[]):
            # the CPU generator alone, the one fork_rng restores: torch.manual_seed also
            # queues a seed for every accelerator torch was built for, with a formatted
            # Python stack each time
            torch.random.default_generator.manual_seed(self.seed * _STEP_SEED_STRIDE + step)
            return self.model_file.sample_batch(self.global_batch_size)

    def loss_items(self, step: int, ranges: Sequence[tuple[int, int]]) -> int:
        """The target tokens (``loss_items.count_items``) of samples ``[start, stop)`` of
        step's global batch, summed over ``ranges``: what a token-mean loss's weights
        divide by. The last stages read the whole global batch for it (with ``dataset()``,
        every sample of it) once a step."""
        _, targets = self.global_batch(step)
        return sum(count_items(slice_samples(targets, start, stop)) for start, stop in ranges)

    def microbatches(
        self, step: int, offset: int, num_samples: int, micro_batch_sizes: Sequence[int]
    ) -> list[MicroBatch]:
        """The replica's micro-batches of ``step`` (sizes as given; they sum to its share)."""
        assert sum(micro_batch_sizes) == num_samples
        raw_inputs, targets = self.replica_batch(step, offset, num_samples)
        inputs = self.bind(raw_inputs)
        _check_batch_size(inputs, targets, num_samples, self._batch_dims())
        return split_microbatches(inputs, targets, micro_batch_sizes, self._batch_dims())

    def _batch_dims(self) -> dict[str, int | None]:
        return {spec.tensor.name: spec.tensor.batch_dim for spec in self.input_specs}


def _checked_dataset(model_file: ModelFile) -> Any:
    """``model_file.dataset()``, checked to be a sized, indexable collection of samples.

    Raises:
        ModelFileError: ``dataset()`` raised, or returned something without ``len`` and
            ``[]`` (a number, a generator).
    """
    assert model_file.dataset is not None
    where = f"dataset() in {str(model_file.path)!r}"
    try:
        data = model_file.dataset()
    except Exception as exc:
        raise ModelFileError(f"{where} raised {one_line(exc)}; fix model.py") from None
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise ModelFileError(
            f"{where} returned a {type(data).__name__}; return a sequence or a "
            "torch.utils.data.Dataset of (inputs, targets) samples (len and [] work on it)"
        )
    return data


def _check_batch_size(
    inputs: Mapping[str, Tensor], targets: Any, expected: int, batch_dims: Mapping[str, int | None]
) -> None:
    for name, tensor in inputs.items():
        dim = batch_dims.get(name, 0)
        if dim is None or not isinstance(tensor, Tensor):
            continue
        if tensor.shape[dim] != expected:
            raise ConfigError(
                f"input {name!r} has {tensor.shape[dim]} samples in dim {dim}, expected "
                f"{expected}; sample_batch(n)/dataset() must give n samples along dim 0"
            )


def split_microbatches(
    inputs: Mapping[str, Tensor],
    targets: Any,
    sizes: Sequence[int],
    batch_dims: Mapping[str, int | None],
) -> list[MicroBatch]:
    """Cut bound inputs and targets into consecutive micro-batches of ``sizes`` samples.

    Args:
        inputs: name -> tensor whose batch dimension (``batch_dims``, default 0) holds
            ``sum(sizes)`` samples; tensors with batch dimension None go whole to each.
        targets: nested tensors with samples in dim 0.
        sizes: samples per micro-batch, e.g. ``(3, 3, 2)``.
    """
    micro = []
    start = 0
    for index, size in enumerate(sizes):
        stop = start + size
        micro_inputs = {
            name: _slice_dim(tensor, batch_dims.get(name, 0), start, stop)
            for name, tensor in inputs.items()
        }
        micro.append(MicroBatch(index, size, micro_inputs, slice_samples(targets, start, stop)))
        start = stop
    return micro


def _slice_dim(tensor: Any, dim: int | None, start: int, stop: int) -> Any:
    if dim is None or not isinstance(tensor, Tensor):
        return tensor
    return tensor.narrow(dim, start, stop - start)


def stage_inputs(
    available: Mapping[str, Tensor], needed: Sequence[str], *, stage_label: str
) -> dict[str, Tensor]:
    """The graph inputs one stage reads, taken from a micro-batch's bound inputs.

    Raises:
        PlanMismatchError: an input the stage reads is not in the batch; names the input,
            the stage and what the batch does provide.
    """
    missing = [name for name in needed if name not in available]
    if missing:
        raise PlanMismatchError(
            f"{stage_label} reads graph input {missing[0]!r}, but the batch from "
            f"sample_batch()/dataset() provides only {sorted(available)}; make the model file "
            f"return {missing[0]!r} with its inputs, or re-run `hplan solve`"
        )
    return {name: available[name] for name in needed}
