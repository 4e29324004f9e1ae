"""Stage 1 of the compact design (models/compact.py): the encoder to z and the broadcast decoder, trained
together, then the decoder alone on the frozen encoder (its latents stay valid for stage 2).

    iws train compact1 --data data/play_expert --extra-data data/random,data/jittery --out runs/compact1

Loss: MSE on the frame with `--fg-weight` more weight on pixels that differ from the background, z jittered by
`--z-noise` (neighbouring codes decode alike), and `--cycle` * |E(D(z)) - z|^2 so that re-encoding a rendered
frame returns its latent, once the encoder is frozen: from `--freeze-encoder-at` of the steps on, only the decoder
trains. Evaluation reports `z_sd`, the spread of z over validation frames; training stops with an error if it falls
to nothing (a collapsed encoder draws every frame alike, and stage 2 would learn nothing from it).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from iws_gym.data.collect import heldout_episodes
from iws_gym.data.episodes import DatasetError, list_episodes, read_episode
from iws_gym.models.checkpoint import find_release, git_commit, load_release, load_state_checked, save_release
from iws_gym.models.compact import CANVAS, STAGE1_KIND, CompactStage1, CompactStage1Config
from iws_gym.models.frames import frames_to_tensor
from iws_gym.training.common import StageBase, arg, psnr


@dataclass
class Options:
    z_dim: int = arg(24, "numbers per frame (the latent z)")
    extra_data: str = arg("", "more datasets to train on, comma-separated (e.g. `iws collect --mix random` and "
                              "`--mix jittery` collections: the decoder must draw the scenes fast drives make)")
    freeze_encoder_at: float = arg(0.75, "share of the steps after which only the decoder trains")
    cycle: float = arg(0.5, "weight of |E(D(z)) - z|^2, on the frozen encoder")
    fg_weight: float = arg(4.0, "extra loss weight on pixels that differ from the background")
    z_noise: float = arg(0.01, "noise added to z before decoding, in training")
    finetune: str | None = arg(None, "continue this compact stage-1 release (its config; --z-dim is ignored)")
    preset: str = arg("default", "model size: default | tiny (tests)")


COLLAPSED = 1e-4  # the spread of z (its std over frames, averaged over dims) below which the encoder has collapsed
PRESETS = {"default": {}, "tiny": dict(enc_widths=(8, 8, 16, 16), enc_hidden=32, dec_width=16, dec_blocks=1)}


def data_dirs(data, extra: str) -> list[Path]:
    return [Path(data)] + [Path(d) for d in extra.split(",") if d.strip()]


class FramesWithAgent:
    """Every episode's frames (uint8) and agent positions of several datasets, in RAM."""

    def __init__(self, dirs, max_episodes=None):
        from tqdm import tqdm

        self.frames, self.agent = [], []
        for d in dirs:
            paths = list_episodes(d)[:max_episodes]
            if not paths:
                raise DatasetError(f"no episodes (ep_*.h5) in {d}")
            for p in tqdm(paths, desc=f"loading {d}", unit="ep"):
                ep = read_episode(p, ["frames", "agent_pos"])
                self.frames.append(ep["frames"])
                self.agent.append(ep["agent_pos"].astype(np.float32) / CANVAS)

    def sample(self, rng, batch):
        ei = rng.integers(0, len(self.frames), batch)
        ti = [rng.integers(0, len(self.frames[e])) for e in ei]
        return (np.stack([self.frames[e][t] for e, t in zip(ei, ti)]),
                np.stack([self.agent[e][t] for e, t in zip(ei, ti)]))


class Trainable(CompactStage1):
    def __init__(self, cfg, o, total_steps):
        super().__init__(cfg)
        self.o, self.freeze_step = o, int(o.freeze_encoder_at * total_steps)

    def forward(self, batch, step):
        x, p = batch
        frozen = step >= self.freeze_step
        # frozen: the encoder runs on detached weights, so it gets no gradient (the optimizer skips it) while the
        # cycle term still reaches the decoder through the rendered frame
        enc = self.encoder if not frozen else lambda v: torch.func.functional_call(
            self.encoder, {k: t.detach() for k, t in self.encoder.named_parameters()}, (v,))
        z = enc(x)
        y = self.decoder(z + self.o.z_noise * torch.randn_like(z), p)
        err = (y.float() - x.float()) ** 2
        fg = ((x - x.median()).abs().amax(1, keepdim=True) > 0.05).float()  # not the background
        rec = (err * (1 + self.o.fg_weight * fg)).mean()
        logs = dict(rec=rec.item(), frozen_encoder=float(frozen))
        loss = rec
        if self.o.cycle and frozen:  # only on the frozen encoder: while it trains, E(D(z)) = z is met by a
            # constant z (the encoder collapsed to tanh's +-1 in the first 1,000 steps of the first full run)
            cyc = (enc(y.clamp(-1, 1)).float() - z.detach().float()).pow(2).mean()
            loss = loss + self.o.cycle * cyc
            logs["cycle"] = cyc.item()
        return loss, logs


class Stage(StageBase):
    name = "compact1"

    def __init__(self, a, o, device):
        super().__init__(a, o, device)
        if o.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {o.preset!r}")
        if not 0.0 <= o.freeze_encoder_at <= 1.0:
            raise ValueError(f"--freeze-encoder-at must be in [0, 1], got {o.freeze_encoder_at}")
        cfg, init_sd = CompactStage1Config(z_dim=o.z_dim, **PRESETS[o.preset]), None
        if o.finetune:
            f1 = find_release(o.finetune, "stage1")
            cfg, init_sd, _ = load_release(f1, STAGE1_KIND, CompactStage1Config)
        self.config = cfg
        self.model = Trainable(cfg, o, a.steps)
        if init_sd is not None:
            load_state_checked(self.model, init_sd, f1)
        self.dirs = data_dirs(a.data, o.extra_data)
        self.data = FramesWithAgent(self.dirs, a.max_episodes)
        eps = list(heldout_episodes(self.task, 4, 64, "validation"))  # never trained on
        self.eval_x = frames_to_tensor(np.concatenate([e["frames"][::4] for e in eps]), device)
        self.eval_p = torch.as_tensor(np.concatenate([e["agent_pos"][::4] for e in eps]) / CANVAS,
                                      dtype=torch.float32, device=device)

    def sample_batch(self, rng, batch):
        f, p = self.data.sample(rng, batch)
        return frames_to_tensor(f, self.device), torch.as_tensor(p, device=self.device)

    def evaluate(self, ema) -> dict:
        z = ema.encoder(self.eval_x)
        z_sd = z.float().std(0).mean().item()
        if z_sd < COLLAPSED:
            raise RuntimeError(f"stage 1 collapsed: the encoder maps every validation frame to the same z (mean "
                               f"spread {z_sd:.1e}); lower --lr or check the data, and start a new --out")
        y = ema.decoder(z, self.eval_p)
        return dict(psnr=psnr(y, self.eval_x).mean().item(), z_sd=z_sd,
                    cycle=(ema.encoder(y.clamp(-1, 1)).float() - z.float()).pow(2).mean().item())

    def export(self, ema, out, result):
        extra = dict(data=[str(d) for d in self.dirs], data_seed=self.meta["seed"],
                     data_episodes=len(self.data.frames), commit=git_commit(), step=result["step"],
                     eval=result["eval"], task=self.task.name)
        if self.o.finetune:
            extra.update(finetuned_from=str(self.o.finetune))
        save_release(Path(out) / "stage1.safetensors", ema.state_dict(), STAGE1_KIND, self.config, extra)
