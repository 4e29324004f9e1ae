"""Noise schedules and the consistency parameterisation: small pure functions shared by every stage.

Notation (Karras et al. 2022; Song et al. 2023): x_t = x0 + sigma * eps, data scaled to sigma_data.
A consistency function f(x_t, sigma) = c_skip(sigma) x_t + c_out(sigma) F(c_in(sigma) x_t, c_noise(sigma))
satisfies the boundary condition f(x, sigma_min) = x because c_skip(sigma_min) = 1 and c_out(sigma_min) = 0.
"""
from __future__ import annotations

import math

import torch


def karras_sigmas(n: int, sigma_min: float, sigma_max: float, rho: float = 7.0) -> torch.Tensor:
    """n noise levels from sigma_min up to sigma_max (ascending), spaced as in EDM."""
    ramp = torch.linspace(0, 1, n, dtype=torch.float64)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return ((lo + ramp * (hi - lo)) ** rho).float()


def ict_num_scales(step: int, total_steps: int, s0: int = 10, s1: int = 1280) -> int:
    """Improved consistency training's discretisation curriculum: N doubles in stages from s0 to s1."""
    k_prime = math.floor(total_steps / (math.log2(s1 / s0) + 1))
    return min(s0 * 2 ** math.floor(step / max(k_prime, 1)), s1) + 1


def lognormal_index_probs(sigmas: torch.Tensor, p_mean: float = -1.1, p_std: float = 2.0) -> torch.Tensor:
    """iCT's lognormal proposal over adjacent pairs (sigma_i, sigma_{i+1}); returns len(sigmas)-1 probabilities."""
    log = torch.log(sigmas.double())
    cdf = 0.5 * (1 + torch.erf((log - p_mean) / (p_std * math.sqrt(2))))
    p = (cdf[1:] - cdf[:-1]).clamp_min(1e-12)
    return (p / p.sum()).float()


def c_skip(sigma, sigma_data: float, sigma_min: float):
    return sigma_data**2 / ((sigma - sigma_min) ** 2 + sigma_data**2)


def c_out(sigma, sigma_data: float, sigma_min: float):
    return (sigma - sigma_min) * sigma_data / (sigma**2 + sigma_data**2).sqrt()


def c_in(sigma, sigma_data: float):
    return 1 / (sigma**2 + sigma_data**2).sqrt()


def c_noise(sigma):
    return 0.25 * torch.log(sigma.clamp_min(1e-8))


def pseudo_huber(a: torch.Tensor, b: torch.Tensor, c: float) -> torch.Tensor:
    """Per-sample pseudo-Huber distance sqrt(||a-b||^2 / d + c^2) - c (iCT), mean over non-batch dims."""
    d = (a - b).float().pow(2).flatten(1).mean(1)
    return (d + c**2).sqrt() - c


def sampling_sigmas(steps: int, sigma_max: float, sigma_mid: float, sigma_min: float) -> torch.Tensor:
    """Few-step sampling levels: sigma_max first, then geometric down to sigma_mid; ends at sigma_min implicitly.

    1 step: [sigma_max]; 2 steps: [sigma_max, sigma_mid]; 4: [sigma_max, ..., sigma_mid]."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if steps == 1:
        return torch.tensor([sigma_max])
    rest = torch.logspace(math.log10(sigma_mid * 4 ** (steps - 2)), math.log10(sigma_mid), steps - 1)
    rest = rest.clamp(max=sigma_max * 0.5)
    return torch.cat([torch.tensor([sigma_max]), rest])


def geometric_sigmas(n: int, sigma_max: float, sigma_min: float) -> torch.Tensor:
    """n levels from sigma_max down to sigma_min, evenly spaced in log sigma; 1: [sigma_max]."""
    if n < 1 or not 0 < sigma_min <= sigma_max:
        raise ValueError(f"need n >= 1 and 0 < sigma_min <= sigma_max, got {n}, {sigma_min}, {sigma_max}")
    if n == 1:
        return torch.tensor([float(sigma_max)])
    return torch.logspace(math.log10(sigma_max), math.log10(sigma_min), n)
