"""Few-step consistency samplers: pure functions over a denoiser, never knowing which network it is.

`denoise(x_t, sigma) -> x0_hat` is any consistency function (see schedule.py). Multistep consistency
sampling (Song et al. 2023, Alg. 1): start from pure noise at sigmas[0], jump to x0, re-noise to the next
level, jump again. 1, 2 or 4 steps is the length of `sigmas`, not a code path.

`euler_sample` instead integrates the probability-flow ODE (Karras et al. 2022, Euler steps) with the same
denoiser read as an EDM denoiser (the objectives' denoising terms train it as one): a diagnostic of
what the network has learned as a distribution, not only as a one-step jump. `euler_from` runs the same ODE
from a given point instead of noise (the compact design's latent denoiser, models/compact.py).
"""
from __future__ import annotations

from typing import Callable

import torch


@torch.no_grad()
def consistency_sample(denoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], shape, sigmas: torch.Tensor,
                       sigma_min: float, generator: torch.Generator | None = None, device=None,
                       dtype=torch.float32) -> torch.Tensor:
    """Returns x0 of `shape` after len(sigmas) consistency jumps."""
    device = device or "cpu"
    gen_device = generator.device if generator is not None else device

    def noise():  # drawn on the generator's device so a CPU generator drives a CUDA model reproducibly
        return torch.randn(shape, generator=generator, device=gen_device).to(device=device, dtype=dtype)

    sigmas = [float(s) for s in sigmas]
    x_t = noise() * sigmas[0]
    for i, sigma in enumerate(sigmas):
        x0 = denoise(x_t, torch.full((shape[0],), sigma, device=device, dtype=dtype))
        if i + 1 < len(sigmas):
            x_t = x0 + noise() * (sigmas[i + 1] ** 2 - sigma_min**2) ** 0.5
    return x0


@torch.no_grad()
def euler_sample(denoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], shape, sigmas: torch.Tensor,
                 generator: torch.Generator | None = None, device=None, dtype=torch.float32) -> torch.Tensor:
    """Deterministic probability-flow ODE from noise at sigmas[0] down through `sigmas` (descending) to 0:
    x <- x0 + (sigma_next / sigma) (x - x0), one denoiser call per level."""
    device = device or "cpu"
    gen_device = generator.device if generator is not None else device
    x = torch.randn(shape, generator=generator, device=gen_device).to(device=device, dtype=dtype) * float(sigmas[0])
    return euler_from(denoise, x, sigmas)


def euler_from(denoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, sigmas) -> torch.Tensor:
    """The same ODE from a given x read as a sample at sigmas[0] (SDEdit without the added noise): it follows the
    density to one clean point near x, where one denoiser call at sigmas[0] returns the mean of those near x."""
    sigmas = [float(s) for s in sigmas] + [0.0]
    for sigma, nxt in zip(sigmas[:-1], sigmas[1:]):
        x0 = denoise(x, torch.full((x.shape[0],), sigma, device=x.device, dtype=x.dtype))
        x = x0 + (nxt / sigma) * (x - x0)
    return x
