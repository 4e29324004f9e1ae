"""Stage 1, part 1: CNN encoder from a 128x128 RGB frame to a compact 2D latent z.

A patchify (space-to-depth, 4x4 stride 4) stem turns the frame into a 32x32 grid of 4x4 patches, so no
convolution runs at full resolution; z is bounded by tanh so later stages see a fixed scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from iws_gym.models.layers import ResBlock, group_norm


@dataclass
class EncoderConfig:
    frame_size: int = 128
    patch: int = 4                 # space-to-depth factor of the stem: 128 -> 32
    ch: tuple = (64, 128)          # widths at 32x32 and (if latent_size == 16) at 16x16
    blocks: tuple = (1, 2)         # residual blocks per level
    latent_ch: int = 8
    latent_size: int = 16          # 16 or 32
    # "patch": a learned 4x4 stride-4 patch embedding and a 3x3 output convolution (each cell codes the pattern in
    # its patch, orientation included); "pool": the frame's mean colour per cell mixed by 1x1 convolutions only,
    # so a cell holds no orientation and moving cells moves what they show (needs latent_size == frame/patch)
    stem: str = "patch"


class Encoder(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        c0, c1 = cfg.ch
        if cfg.stem not in ("patch", "pool"):
            raise ValueError(f"EncoderConfig.stem must be 'patch' or 'pool', got {cfg.stem!r}")
        if cfg.stem == "pool" and (cfg.latent_size != cfg.frame_size // cfg.patch or any(cfg.blocks)):
            raise ValueError("the 'pool' stem keeps cells free of orientation: latent_size must be frame_size / patch "
                             "and blocks (0, 0)")
        self.stem = (nn.Sequential(nn.AvgPool2d(cfg.patch), nn.Conv2d(3, c0, 1)) if cfg.stem == "pool"
                     else nn.Conv2d(3, c0, cfg.patch, stride=cfg.patch))  # space-to-depth + linear map in one op
        self.level0 = nn.ModuleList([ResBlock(c0) for _ in range(cfg.blocks[0])])
        grid = cfg.frame_size // cfg.patch
        if cfg.latent_size == grid // 2:
            self.down = nn.Conv2d(c0, c1, 4, stride=2, padding=1)
            self.level1 = nn.ModuleList([ResBlock(c1) for _ in range(cfg.blocks[1])])
            c_out = c1
        elif cfg.latent_size == grid:
            self.down, self.level1, c_out = None, nn.ModuleList(), c0
        else:
            raise ValueError(f"latent_size must be {grid} or {grid // 2}, got {cfg.latent_size}")
        self.norm_out = group_norm(c_out)
        self.out = nn.Conv2d(c_out, cfg.latent_ch, 1 if cfg.stem == "pool" else 3, padding=0 if cfg.stem == "pool" else 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 3, H, W) in [-1, 1] -> z: (B, latent_ch, latent_size, latent_size) in (-1, 1)."""
        h = self.stem(x.to(self.out.weight.dtype))  # (B, 3, 128, 128) -> (B, c0, 32, 32): each 4x4 patch embedded
        for blk in self.level0:
            h = blk(h)
        if self.down is not None:
            h = self.down(h)  # (B, c1, 16, 16)
            for blk in self.level1:
                h = blk(h)
        return torch.tanh(self.out(torch.nn.functional.silu(self.norm_out(h)))).float()
