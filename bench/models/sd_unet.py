"""Stable Diffusion 1.5's UNet (860M parameters), built from its config (random weights,
nothing downloaded).

Written for ``bench/slow_link_plans.py``. The config is SD 1.5's ``unet/config.json``
written out in code; the inputs are what its training step feeds: 64 x 64 latents of 4
channels, a timestep per sample and CLIP ViT-L/14's 77 x 768 text states; the loss is the
mean squared error of the predicted noise. Needs ``diffusers``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import UNet2DConditionModel
from torch import nn

LATENT_SIZE = 64
"""512 x 512 images in the VAE's latent space (a factor of 8)."""
TEXT_TOKENS = 77
TEXT_WIDTH = 768

SD15_UNET = {
    "sample_size": LATENT_SIZE,
    "in_channels": 4,
    "out_channels": 4,
    "center_input_sample": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "down_block_types": (
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    ),
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "up_block_types": (
        "UpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
    ),
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "downsample_padding": 1,
    "mid_block_scale_factor": 1,
    "act_fn": "silu",
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "cross_attention_dim": TEXT_WIDTH,
    "attention_head_dim": 8,
}
"""``runwayml/stable-diffusion-v1-5``'s ``unet/config.json``."""


def build_model() -> nn.Module:
    return UNet2DConditionModel(**SD15_UNET)


def sample_batch(batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    latents = torch.randn(batch_size, 4, LATENT_SIZE, LATENT_SIZE)
    timesteps = torch.randint(0, 1000, (batch_size,))
    text = torch.randn(batch_size, TEXT_TOKENS, TEXT_WIDTH)
    noise = torch.randn(batch_size, 4, LATENT_SIZE, LATENT_SIZE)
    inputs = {"sample": latents, "timestep": timesteps, "encoder_hidden_states": text}
    return inputs, noise


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    predicted = outputs.sample if hasattr(outputs, "sample") else outputs[0]
    return F.mse_loss(predicted.float(), targets.float())
