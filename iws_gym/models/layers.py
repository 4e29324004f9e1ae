"""Shared building blocks: residual conv blocks with FiLM, noise embedding, spatial and causal temporal attention."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class ChannelNorm(nn.Module):
    """LayerNorm over channels at each pixel. Unlike GroupNorm it has no spatial statistics, so a model
    trained on crops behaves the same on full frames (and it is cheap in channels_last)."""

    def __init__(self, ch: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(ch)), nn.Parameter(torch.zeros(ch)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x.permute(0, 2, 3, 1), x.shape[1:2], self.weight, self.bias, self.eps)  # (B, H, W, C)
        return h.permute(0, 3, 1, 2)


def group_norm(ch: int) -> nn.Module:
    return ChannelNorm(ch)


class FourierEmbedding(nn.Module):
    """Scalar (e.g. c_noise(sigma)) -> (B, dim) with fixed random Fourier features and an MLP."""

    def __init__(self, dim: int, scale: float = 16.0):
        super().__init__()
        self.register_buffer("freqs", torch.randn(dim // 2) * scale)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = 2 * math.pi * x[:, None].float() * self.freqs[None].float()
        return self.mlp(torch.cat([f.cos(), f.sin()], dim=1).to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    """GroupNorm-SiLU-Conv x2 with a residual; optional FiLM (scale, shift) from a conditioning vector."""

    def __init__(self, ch: int, cond_dim: int = 0, out_ch: int | None = None):
        super().__init__()
        out_ch = out_ch or ch
        self.norm1, self.conv1 = group_norm(ch), nn.Conv2d(ch, out_ch, 3, padding=1)
        self.norm2, self.conv2 = group_norm(out_ch), nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.film = nn.Linear(cond_dim, 2 * out_ch) if cond_dim else None
        self.skip = nn.Conv2d(ch, out_ch, 1) if out_ch != ch else nn.Identity()
        nn.init.zeros_(self.conv2.weight)
        nn.init.zeros_(self.conv2.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.norm2(h)
        if self.film is not None:
            scale, shift = self.film(cond)[:, :, None, None].chunk(2, dim=1)
            h = h * (1 + scale) + shift
        return self.skip(x) + self.conv2(F.silu(h))
