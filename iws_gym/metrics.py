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


def _gaussian_1d(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    g = torch.exp(-((torch.arange(size, dtype=torch.float64) - size // 2) ** 2) / (2 * sigma**2))
    return g / g.sum()


def _blur(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Separable Gaussian filter, valid region: (N, 1, H, W) -> (N, 1, H-10, W-10)."""
    x = F.conv2d(x, g.view(1, 1, -1, 1))
    return F.conv2d(x, g.view(1, 1, 1, -1))


def ssim(a: np.ndarray, b: np.ndarray, chunk: int = 64) -> np.ndarray:
    """Per-frame SSIM in [-1, 1] (1 for identical frames)."""
    out = []
    g = _gaussian_1d()
    c1, c2 = 0.01**2, 0.03**2
    for i in range(0, len(a), chunk):  # chunks keep memory flat for long rollouts
        x, y = _to_float(a[i : i + chunk]), _to_float(b[i : i + chunk])
        N, C, H, W = x.shape
        x, y = x.reshape(N * C, 1, H, W), y.reshape(N * C, 1, H, W)
        mu_x, mu_y = _blur(x, g), _blur(y, g)
        sxx = _blur(x * x, g) - mu_x**2
        syy = _blur(y * y, g) - mu_y**2
        sxy = _blur(x * y, g) - mu_x * mu_y
        s = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x**2 + mu_y**2 + c1) * (sxx + syy + c2))
        out.append(s.reshape(N, C, -1).mean(dim=(1, 2)).numpy())
    return np.concatenate(out)


def latent_change_stats(last: torch.Tensor, pred: torch.Tensor, pred2: torch.Tensor, tgt: torch.Tensor) -> dict:
    """One-step dynamics diagnostics on latents of one shape: `last` the last context latent, `pred` and
    `pred2` two samples of the next latent (different noise seeds), `tgt` the true next latent.
    model_mse / copy_last_mse = unexplained share of the true change; predicted_change_ratio: energy of
    the predicted change over the true change's (< 1: the model under-predicts motion, the signature of
    a fade); sample_variance: per-element variance of the two samples (~0: the learned next-latent
    distribution has collapsed to one prediction, the conditional mean)."""
    if not (last.shape == pred.shape == pred2.shape == tgt.shape):
        raise ValueError(f"latent_change_stats: shapes differ: last {tuple(last.shape)}, pred {tuple(pred.shape)}, "
                         f"pred2 {tuple(pred2.shape)}, tgt {tuple(tgt.shape)}")
    last, pred, pred2, tgt = (t.float() for t in (last, pred, pred2, tgt))
    m, c = (pred - tgt).pow(2).mean().item(), (last - tgt).pow(2).mean().item()
    return dict(model_mse=m, copy_last_mse=c, unexplained=m / c,
                predicted_change_ratio=(pred - last).pow(2).mean().item() / c,
                sample_variance=(pred - pred2).pow(2).mean().item() / 2)
