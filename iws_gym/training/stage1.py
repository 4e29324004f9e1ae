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
from iws_gym.models.checkpoint import find_release, git_commit, load_release, load_state_checked, save_release
from iws_gym.models.decoder import Stage1, Stage1Config, decode
from iws_gym.models.frames import frames_to_tensor
from iws_gym.training.common import StageBase, arg, psnr


@dataclass
class Options:
    crop: int = arg(64, "train on random crops of this size, aligned to the latent grid (0: full frames); the model "
                        "is fully convolutional with per-pixel norms, so crops train it ~(H/crop)^2 times cheaper")
    finetune: str | None = arg(None, "continue this stage-1 release: its config and weights (--preset is ignored)")
    warp_share: float | None = arg(None, "share of each batch trained for transport: a random part of the frame moved "
                                         "rigidly, its latent moved by the same warp must decode to the moved frame "
                                         "(default: the release's with --finetune, else 0)")
    preset: str = arg("default", "model: default (a deep encoder to 8x16x16) | pixel (a two-layer encoder to a near-pixel "
                                 "4x32x32 latent, the capacity in the decoder) | pool (the same size, each cell the "
                                 "mean colour of its 4x4 patch mixed by 1x1 convolutions) | tiny (tests)")


PRESETS = {  # (EncoderConfig, DecoderConfig) changes per --preset
    "default": ({}, {}),
    # moving an object is moving cells: a 4x4 patch stem and one 3x3 convolution (the Interactive World
    # Simulator's encoder is this small); the decoder reads the latent at 32x32 directly
    "pixel": (dict(latent_size=32, latent_ch=4, ch=(16, 16), blocks=(0, 0)),
              dict(latent_size=32, latent_ch=4, z_ch=64, z_blocks=2)),
    # ... and cells that hold no orientation: each is the mean colour of its 4x4 patch, mixed by 1x1 convolutions
    "pool": (dict(latent_size=32, latent_ch=4, ch=(16, 16), blocks=(0, 0), stem="pool"),
             dict(latent_size=32, latent_ch=4, z_ch=64, z_blocks=2)),
    "tiny": (dict(ch=(16, 32), blocks=(1, 1)), dict(z_ch=32, z_blocks=1, ch=16, z_blocks32=1, trunk_blocks=1, emb_dim=32)),
}


class Stage(StageBase):
    name = "stage1"

    def __init__(self, a, o, device):
        super().__init__(a, o, device)
        if o.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {o.preset!r}")
        self.episodes = InMemoryEpisodes.load(a.data, a.max_episodes)
        cfg = Stage1Config(total_steps=a.steps)
        enc, dec = PRESETS[o.preset]
        cfg.encoder = dataclasses.replace(cfg.encoder, **enc)
        cfg.decoder = dataclasses.replace(cfg.decoder, **dec)
        init_sd, offset = None, 0
        if o.finetune:  # continue a release: its config and weights, the curriculum where it ended
            f1 = find_release(o.finetune, "stage1")
            cfg, init_sd, meta = load_release(f1, "stage1", Stage1Config)
            offset = int(meta.get("step", 0))
        if o.warp_share is not None:
            if not 0.0 <= o.warp_share <= 1.0:
                raise ValueError(f"--warp-share must be in [0, 1], got {o.warp_share}")
            cfg = dataclasses.replace(cfg, warp_share=o.warp_share)
        self.config = cfg
        self.model = Stage1(cfg, curriculum_offset=offset)
        if init_sd is not None:
            load_state_checked(self.model, init_sd, f1)
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
                     commit=git_commit(), step=result["step"] + self.model.curriculum_offset, eval=result["eval"],
                     task=self.task.name)
        if self.o.finetune:
            extra.update(finetuned_from=str(self.o.finetune), finetune_steps=result["step"])
        save_release(out / "stage1.safetensors", ema.state_dict(), "stage1", self.config, extra)
