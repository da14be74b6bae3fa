"""A deep MLP regressor: the smallest model that still has stages worth splitting.

HPLAN_MLP_LAYERS (8) hidden layers of width HPLAN_MLP_WIDTH (128).
"""

from __future__ import annotations

import os

import torch
from torch import nn

NUM_LAYERS = int(os.environ.get("HPLAN_MLP_LAYERS", "8"))
WIDTH = int(os.environ.get("HPLAN_MLP_WIDTH", "128"))
IN_FEATURES = 32


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, WIDTH)
        self.blocks = nn.Sequential(*(Block(WIDTH) for _ in range(NUM_LAYERS)))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


_TRUE_W = torch.Generator().manual_seed(1234)
_W = torch.randn(IN_FEATURES, 1, generator=_TRUE_W)


def build_model() -> nn.Module:
    return MLP()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch_size, IN_FEATURES)
    return x, torch.sin(x @ _W)


def loss_fn(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(pred, target)
