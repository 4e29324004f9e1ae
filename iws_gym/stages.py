"""What each training stage plugs into the one loop in train.py: model, batches, evaluation, export."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .checkpoint import save_release
from .collect import git_commit, heldout_episodes
from .data import InMemoryEpisodes, load_meta
from .tasks import load_task


def frames_to_tensor(frames: np.ndarray, device) -> torch.Tensor:
    """(..., H, W, 3) uint8 -> (..., 3, H, W) float in [-1, 1]."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).to(device)
    x = x.movedim(-1, -3).float().div_(127.5).sub_(1.0)
    return x.contiguous(memory_format=torch.channels_last) if x.ndim == 4 else x


def tensor_to_frames(x: torch.Tensor) -> np.ndarray:
    """(..., 3, H, W) in [-1, 1] -> (..., H, W, 3) uint8."""
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).movedim(-3, -1).cpu().numpy()


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample PSNR (dB) of frames in [-1, 1] measured on the [0, 1] scale."""
    mse = ((a.float() - b.float()) / 2).pow(2).flatten(1).mean(1).clamp_min(1e-10)
    return -10 * torch.log10(mse)


class Stage1Stage:
    name = "stage1"

    def __init__(self, a, device):
        from .decoder import Stage1, Stage1Config

        self.a, self.device = a, device
        self.meta = load_meta(a.data)
        self.task = load_task(self.meta["task"])
        self.episodes = InMemoryEpisodes.load(a.data, a.max_episodes)
        cfg = Stage1Config(total_steps=a.steps)
        if a.preset == "tiny":
            cfg.encoder = dataclasses.replace(cfg.encoder, ch=(16, 32), blocks=(1, 1))
            cfg.decoder = dataclasses.replace(cfg.decoder, z_ch=32, z_blocks=1, ch=16, trunk_blocks=1, emb_dim=32)
        self.config = cfg
        self.model = Stage1(cfg)
        # A fixed held-out evaluation batch: frames from held-out seeds, never in training.
        eps = list(heldout_episodes(self.task, 4, 64))
        self.eval_frames = frames_to_tensor(np.concatenate([e["frames"][::4] for e in eps]), device)

    def sample_batch(self, rng, batch):
        frames = self.episodes.sample_frames(rng, batch)  # (B, H, W, 3)
        c = self.a.crop
        if c:  # the model is fully convolutional with per-pixel norms: crops train it ~(H/c)^2 times cheaper
            H = frames.shape[1]
            align = H // self.config.encoder.latent_size  # crop on the latent grid
            oy, ox = (rng.integers(0, (H - c) // align + 1, size=2) * align)
            frames = frames[:, oy : oy + c, ox : ox + c]
        return frames_to_tensor(frames, self.device)

    def after_step(self, model, step):
        pass

    def evaluate(self, ema) -> dict:
        from .decoder import decode

        x = self.eval_frames
        z = ema.encoder(x)
        out = {}
        for steps in (1, 2):
            gen = torch.Generator().manual_seed(0)
            out[f"psnr_{steps}step"] = psnr(decode(ema.decoder, z, steps, generator=gen), x).mean().item()
        return out

    def export(self, ema, out, result):
        extra = dict(data=str(self.a.data), data_seed=self.meta["seed"], data_episodes=len(self.episodes.paths),
                     commit=git_commit(), step=result["step"], eval=result["eval"], task=self.task.name)
        save_release(out / "stage1.safetensors", ema.state_dict(), "stage1", self.config, extra)


STAGES = {"stage1": Stage1Stage}


def default_args(stage: str):
    from .train import TrainArgs

    if stage == "stage1":
        return TrainArgs(out="runs/stage1", steps=40000, batch=32, lr=1e-3, crop=64)
    raise ValueError(f"unknown stage {stage!r}; choose from {sorted(STAGES)}")
