"""Optimizer-state offload: the model file's optimizer stepped in host memory.

A rank whose plan says ``optimizer_offload`` (the idea of ZeRO-Offload, Ren et al., USENIX
ATC 2021, with ``torch.optim`` on the CPU in place of its fused CPU Adam) keeps in host
memory a copy of each trainable parameter of its stage, a gradient buffer for it and the
optimizer state (pinned on CUDA, so that the copies are DMA transfers); the device keeps the
rest, as without offload. The gradient sync, unscaling and clipping act on the device's
gradients as always; :meth:`OffloadedOptimizer.step` then steps on the host. The optimizer
is the same code on the same numbers, so a CPU rank that offloads trains bit for bit as one
that does not. Checkpoints keep their format (:class:`HostState`), so a job resumes across
plain and offloading plans. Not combined with ZeRO or local sync (``Plan.verify`` refuses
both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


class HostState(MutableMapping[Tensor, Any]):
    """The host optimizer's state, keyed by the device's parameters (what checkpoints,
    the loss scaler and ``_initialise_optimizer`` look up) instead of the host copies."""

    def __init__(
        self, inner: MutableMapping[Tensor, Any], pairs: Sequence[tuple[Tensor, Tensor]]
    ) -> None:
        """``pairs``: (device parameter, host parameter) of every parameter."""
        self._inner = inner
        self._host_of = {id(p): h for p, h in pairs}
        self._device = {id(h): p for p, h in pairs}

    def _host(self, param: Tensor) -> Tensor:
        host = self._host_of.get(id(param))
        if host is None:
            raise KeyError(param)
        return host

    def __getitem__(self, param: Tensor) -> Any:
        return self._inner[self._host(param)]

    def __setitem__(self, param: Tensor, value: Any) -> None:
        self._inner[self._host(param)] = value

    def __delitem__(self, param: Tensor) -> None:
        del self._inner[self._host(param)]

    def __iter__(self) -> Iterator[Tensor]:
        return iter([self._device[id(h)] for h in list(self._inner) if id(h) in self._device])

    def __len__(self) -> int:
        return sum(1 for h in self._inner if id(h) in self._device)


class OffloadedOptimizer(torch.optim.Optimizer):
    """The model file's optimizer stepping host copies of the device's parameters.

    The host parameters are the masters between steps: whatever writes the device's
    parameters outside the step (a checkpoint being loaded) must say so
    (:meth:`parameters_changed`), and the next step first copies them to the host.

    Its param groups are the model file's optimizer's, over the device's parameters: what
    a loss scaler unscales, clipping reads, an LR scheduler changes and ``zero_grad``
    clears. ``state_dict`` is not supported (checkpoints save the state by name).
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        params_by_group: Sequence[Sequence[nn.Parameter]],
        hosts: Sequence[tuple[nn.Parameter, nn.Parameter, Tensor]],
        device: torch.device,
    ) -> None:
        groups = [
            {**_hyperparameters(g), "params": list(p)}
            for g, p in zip(inner.param_groups, params_by_group, strict=True)
        ]
        super().__init__(groups, inner.defaults)
        self.inner = inner
        self.hosts = tuple(hosts)
        """(device parameter, host parameter, host gradient buffer) of every parameter."""
        self.device = device
        pairs = [(p, h) for p, h, _ in self.hosts]
        self.state = HostState(inner.state, pairs)  # type: ignore[assignment]  # keyed as torch's
        self._host_stale = False

    def parameters_changed(self) -> None:
        """The device's parameters were written outside the step (a checkpoint loaded):
        the next step copies them to the host first."""
        self._host_stale = True

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # no closure form
        """Gradients to the host, the model file's optimizer there, parameters back.

        Each gradient is copied into its host buffer (a parameter without a gradient gives
        its host parameter none, so the optimizer skips it as it would on the device); the
        model file's optimizer, built as ``make_optimizer`` builds it over the host
        parameters, steps on the CPU; the updated host parameters are copied back into the
        device's parameters.

        Raises:
            ValueError: a ``closure`` is given (the step is taken once, on given gradients).
        """
        if closure is not None:
            raise ValueError("an offloaded optimizer steps on the synced gradients, no closure")
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update(_hyperparameters(outer))
        with torch.no_grad():
            if self._host_stale:
                for param, host, _ in self.hosts:
                    host.copy_(param, non_blocking=True)
                self._host_stale = False
            for param, host, buffer in self.hosts:
                if param.grad is None:
                    host.grad = None
                    continue
                buffer.copy_(param.grad, non_blocking=True)
                host.grad = buffer
            _wait(self.device)
            self.inner.step()
            for param, host, _ in self.hosts:
                param.copy_(host, non_blocking=True)
            _wait(self.device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for _, host, _ in self.hosts:
            host.grad = None

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("an offloaded optimizer's state is saved by name")


def _wait(device: torch.device) -> None:
    """Wait for the copies queued on ``device``'s stream (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_copy(tensor: Tensor, pin: bool) -> Tensor:
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    out.copy_(tensor.detach())
    return out


def offload_optimizer(
    optimizer: torch.optim.Optimizer,
    make_optimizer: Callable[[Sequence[nn.Parameter]], Any],
    device: torch.device,
) -> OffloadedOptimizer:
    """``optimizer`` (the model file's, over the stage's trainable parameters, not yet
    stepped) moved to host memory: its param groups now hold host copies of the
    parameters (pinned when ``device`` is CUDA), and an :class:`OffloadedOptimizer`
    around it steps them.

    Args:
        make_optimizer: the model file's ``optimizer(params)``: builds the host parameters'
            initial state for an optimizer that creates it at construction (Adagrad).
    """
    pin = device.type == "cuda"
    outer = [list(g["params"]) for g in optimizer.param_groups]
    hosts = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            host = nn.Parameter(_host_copy(param, pin))
            buffer = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=pin)
            hosts.append((param, host, buffer))
    host_of = {id(p): h for p, h, _ in hosts}
    eager = bool(optimizer.state)
    optimizer.state.clear()
    for group in optimizer.param_groups:
        group["params"] = [host_of[id(p)] for p in group["params"]]
    if eager:  # the host parameters' initial state, as this optimizer makes it for them
        probe = make_optimizer([h for _, h, _ in hosts])
        for _, host, _ in hosts:
            optimizer.state[host] = probe.state[host]
    return OffloadedOptimizer(optimizer, outer, hosts, device)
