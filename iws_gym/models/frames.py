"""Frames between numpy (what envs and datasets hold) and torch (what the networks take)."""
from __future__ import annotations

import numpy as np
import torch


def frames_to_tensor(frames: np.ndarray, device) -> torch.Tensor:
    """(..., H, W, 3) uint8 -> (..., 3, H, W) float in [-1, 1]."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).to(device)
    x = x.movedim(-1, -3).float().div_(127.5).sub_(1.0)
    return x.contiguous(memory_format=torch.channels_last) if x.ndim == 4 else x


def tensor_to_frames(x: torch.Tensor) -> np.ndarray:
    """(..., 3, H, W) in [-1, 1] -> (..., H, W, 3) uint8."""
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).movedim(-3, -1).cpu().numpy()
