"""ViT-B/16 (86M parameters) for ImageNet-1k classification, built from transformers'
``ViTConfig`` defaults (hidden 768, 12 layers, 12 heads, 224 x 224 images in 16 x 16
patches; random weights, nothing downloaded).

Written for ``bench/slow_link_plans.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import ViTConfig, ViTForImageClassification

NUM_CLASSES = 1000
IMAGE_SIZE = 224


def build_model() -> nn.Module:
    config = ViTConfig(
        image_size=IMAGE_SIZE,
        patch_size=16,
        num_labels=NUM_CLASSES,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return ViTForImageClassification(config)


def sample_batch(batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    images = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)
    return {"pixel_values": images}, torch.randint(0, NUM_CLASSES, (batch_size,))


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    return F.cross_entropy(logits, targets)
