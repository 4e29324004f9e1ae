"""What every stage shares: its options, device, the dataset's metadata and task, and loading a frozen
released stage."""
from __future__ import annotations

import torch

from iws_gym.data.episodes import load_meta
from iws_gym.envs.registry import load_task


class StageBase:
    """A stage plugs into the loop in train.py: `model` (with `loss(batch, step) -> (loss, logs)`),
    `config` (the model config embedded in the release), `sample_batch(rng, batch)`, `evaluate(ema)`
    (on validation episodes) and `export(ema, out, result)`."""

    channels_last = True

    def __init__(self, a, o, device):
        self.a, self.o, self.device = a, o, device
        self.meta = load_meta(a.data)
        self.task = load_task(self.meta["task"])

    def after_step(self, model, step):
        pass


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample PSNR (dB) of frames in [-1, 1] measured on the [0, 1] scale."""
    mse = ((a.float() - b.float()) / 2).pow(2).flatten(1).mean(1).clamp_min(1e-10)
    return -10 * torch.log10(mse)
