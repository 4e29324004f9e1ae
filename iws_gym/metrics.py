"""Frame metrics on uint8 RGB frames, computed on the [0, 1] scale: MSE, PSNR, SSIM.

SSIM follows Wang et al. (2004): 11x11 Gaussian window (sigma 1.5), K1 = 0.01, K2 = 0.03, computed per
channel with valid (unpadded) windows and averaged. LPIPS and FVD need pretrained networks (AlexNet/VGG,
I3D) whose weights cannot be downloaded here, so they are not reported.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def _to_float(frames: np.ndarray) -> torch.Tensor:
    """(N, H, W, 3) uint8 -> (N, 3, H, W) float64 in [0, 1]."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected (N, H, W, 3) uint8 frames, got shape {frames.shape} dtype {frames.dtype}")
    return torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).double() / 255.0


def mse(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return ((_to_float(a) - _to_float(b)) ** 2).flatten(1).mean(1).numpy()


def psnr(a: np.ndarray, b: np.ndarray, max_db: float = 100.0) -> np.ndarray:
    """Per-frame PSNR in dB, capped at `max_db` for identical frames."""
    m = mse(a, b)
    with np.errstate(divide="ignore"):
        return np.minimum(-10 * np.log10(np.maximum(m, 0)), max_db)


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    g = torch.exp(-((torch.arange(size, dtype=torch.float64) - size // 2) ** 2) / (2 * sigma**2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]  # (1, 1, size, size)


def ssim(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-frame SSIM in [-1, 1] (1 for identical frames)."""
    x, y = _to_float(a), _to_float(b)
    N, C, H, W = x.shape
    w = _gaussian_window().to(x)
    x, y = x.reshape(N * C, 1, H, W), y.reshape(N * C, 1, H, W)
    mu_x, mu_y = F.conv2d(x, w), F.conv2d(y, w)
    sxx = F.conv2d(x * x, w) - mu_x**2
    syy = F.conv2d(y * y, w) - mu_y**2
    sxy = F.conv2d(x * y, w) - mu_x * mu_y
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x**2 + mu_y**2 + c1) * (sxx + syy + c2))
    return s.reshape(N, C, -1).mean(dim=(1, 2)).numpy()
