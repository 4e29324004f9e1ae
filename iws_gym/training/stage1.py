"""Stage 1: the encoder (frame -> compact 2D latent) and the consistency decoder, trained together on
frames of the dataset.

    iws train stage1 --data data/tpushing --out runs/stage1
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from iws_gym.data.collect import heldout_episodes
from iws_gym.data.episodes import InMemoryEpisodes
from iws_gym.models.checkpoint import git_commit, save_release
from iws_gym.models.decoder import Stage1, Stage1Config, decode
from iws_gym.models.frames import frames_to_tensor
from iws_gym.training.common import StageBase, arg, psnr


@dataclass
class Options:
    crop: int = arg(64, "train on random crops of this size, aligned to the latent grid (0: full frames); the model "
                        "is fully convolutional with per-pixel norms, so crops train it ~(H/crop)^2 times cheaper")
    preset: str = arg("default", "model size: default | tiny (tests)")


class Stage(StageBase):
    name = "stage1"

    def __init__(self, a, o, device):
        super().__init__(a, o, device)
        if o.preset not in ("default", "tiny"):
            raise ValueError(f"--preset must be 'default' or 'tiny', got {o.preset!r}")
        self.episodes = InMemoryEpisodes.load(a.data, a.max_episodes)
        cfg = Stage1Config(total_steps=a.steps)
        if o.preset == "tiny":
            cfg.encoder = dataclasses.replace(cfg.encoder, ch=(16, 32), blocks=(1, 1))
            cfg.decoder = dataclasses.replace(cfg.decoder, z_ch=32, z_blocks=1, ch=16, z_blocks32=1, trunk_blocks=1, emb_dim=32)
        self.config = cfg
        self.model = Stage1(cfg)
        # a fixed evaluation batch: frames of validation episodes, never in training
        eps = list(heldout_episodes(self.task, 4, 64, "validation"))
        self.eval_frames = frames_to_tensor(np.concatenate([e["frames"][::4] for e in eps]), device)

    def sample_batch(self, rng, batch):
        frames = self.episodes.sample_frames(rng, batch)  # (B, H, W, 3)
        c = self.o.crop
        if c:
            H = frames.shape[1]
            align = H // self.config.encoder.latent_size  # crop on the latent grid
            oy, ox = (rng.integers(0, (H - c) // align + 1, size=2) * align)
            frames = frames[:, oy : oy + c, ox : ox + c]
        return frames_to_tensor(frames, self.device)

    def evaluate(self, ema) -> dict:
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
