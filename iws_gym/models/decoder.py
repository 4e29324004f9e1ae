"""Stage 1, part 2: the consistency decoder D(x_t, sigma, z) -> x0_hat, and its training loss.

The decoder is a consistency model conditioned on the latent z: from a frame noised to sigma it jumps
to the clean frame in one step, and multistep sampling (sampler.py) refines in 2-4. It has two parts:

* a z-branch (latent -> 32x32 feature map) that depends only on z, so it runs once per frame however
  many denoising steps follow, and
* a light denoising trunk on the space-to-depth noisy frame, FiLM-modulated by the noise level.

Objective (`Stage1.loss`): consistency training in the improved-CT form (Song & Dhariwal 2023): adjacent
noise levels (sigma_i < sigma_{i+1}) on the same noise draw, the target D(x + sigma_i eps) computed with
stop-gradient weights (iCT showed an EMA target is unnecessary and slows convergence; we keep a separate
EMA copy only for evaluation), pseudo-Huber distance, lognormal level sampling and the doubling
discretisation curriculum. As in CTM, a denoising (DSM) term D(x + sigma eps) -> x regularises it: with a
strong conditioning z it makes the one-step jump exact early in training, which matters with a 2-hour CPU
budget; the consistency term ties the levels together so 2- and 4-step sampling stays on the trajectory.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from iws_gym.models import schedule
from iws_gym.models.encoder import Encoder, EncoderConfig
from iws_gym.models.layers import FourierEmbedding, ResBlock, group_norm
from iws_gym.models.sampler import consistency_sample


@dataclass
class DecoderConfig:
    frame_size: int = 128
    patch: int = 4
    latent_ch: int = 8
    latent_size: int = 16
    z_ch: int = 128                # width of the z-branch at the latent resolution
    z_blocks: int = 2
    ch: int = 64                   # width of the 32x32 feature map and the trunk
    z_blocks32: int = 2            # z-branch blocks at 32x32 (run once per frame)
    trunk_blocks: int = 2
    emb_dim: int = 128
    sigma_data: float = 0.5
    sigma_min: float = 0.002
    sigma_max: float = 80.0
    sigma_mid: float = 0.4         # second level of 2-step sampling (chosen by `iws eval recon`)


class ConsistencyDecoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        grid = cfg.frame_size // cfg.patch
        self.z_in = nn.Conv2d(cfg.latent_ch, cfg.z_ch, 3, padding=1)
        self.z_blocks = nn.ModuleList([ResBlock(cfg.z_ch) for _ in range(cfg.z_blocks)])
        self.z_up = cfg.latent_size != grid
        self.z_out = nn.Conv2d(cfg.z_ch, cfg.ch * (4 if self.z_up else 1), 3, padding=1)
        self.z_blocks32 = nn.ModuleList([ResBlock(cfg.ch) for _ in range(cfg.z_blocks32)])
        # The z-branch renders a full frame estimate by itself (a clean path, no noise in it); the trunk
        # adds a zero-initialised, noise-level-aware correction from x_t on top.
        self.z_norm = group_norm(cfg.ch)
        self.z_head = nn.ConvTranspose2d(cfg.ch, 3, cfg.patch, stride=cfg.patch)
        self.emb = FourierEmbedding(cfg.emb_dim)
        # Per-channel gate on the noisy-frame path from the noise level: at sigma_max x_t is pure noise and
        # must not swamp the z features it is added to; at small sigma it carries the detail.
        self.x_gate = nn.Linear(cfg.emb_dim, cfg.ch)
        self.x_in = nn.Conv2d(3, cfg.ch, cfg.patch, stride=cfg.patch)  # 4x4 patches of the noisy frame
        self.trunk = nn.ModuleList([ResBlock(cfg.ch, cond_dim=cfg.emb_dim) for _ in range(cfg.trunk_blocks)])
        self.norm_out = group_norm(cfg.ch)
        self.out = nn.ConvTranspose2d(cfg.ch, 3, cfg.patch, stride=cfg.patch)  # back to 4x4 pixel patches
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def z_features(self, z: torch.Tensor):
        """z (B, C, 16, 16) -> features (B, ch, 32, 32) and the z-only frame estimate (B, 3, 128, 128);
        computed once per frame, however many denoising steps follow."""
        h = self.z_in(z.to(self.z_in.weight.dtype))
        for blk in self.z_blocks:
            h = blk(h)
        h = self.z_out(F.silu(h))
        h = F.pixel_shuffle(h, 2) if self.z_up else h  # (B, 4*ch, 16, 16) -> (B, ch, 32, 32)
        for blk in self.z_blocks32:
            h = blk(h)
        return h, self.z_head(F.silu(self.z_norm(h)))

    def forward(self, x_t: torch.Tensor, sigma: torch.Tensor, zf: tuple) -> torch.Tensor:
        """Consistency function: x_t (B, 3, H, W), sigma (B,), zf = z_features(z) -> x0_hat (B, 3, H, W)."""
        zfeat, z_frame = zf
        c = self.cfg
        s = sigma.to(torch.float32)[:, None, None, None]
        c_skip = schedule.c_skip(s, c.sigma_data, c.sigma_min)
        c_out = schedule.c_out(s, c.sigma_data, c.sigma_min)
        c_in = schedule.c_in(s, c.sigma_data)
        dt = self.x_in.weight.dtype  # the network may run in bf16; the parameterisation stays in fp32
        emb = self.emb(schedule.c_noise(sigma.to(torch.float32))).to(dt)
        gate = torch.sigmoid(self.x_gate(emb))[:, :, None, None]
        h = zfeat.to(dt) + gate * self.x_in((c_in * x_t).to(dt))  # (B, 3, 128, 128) -> (B, ch, 32, 32)
        for blk in self.trunk:
            h = blk(h, emb)
        F_x = z_frame + self.out(F.silu(self.norm_out(h)))  # (B, ch, 32, 32) -> (B, 3, 128, 128)
        return c_skip * x_t.float() + c_out * F_x.float()


def decoder_sigmas(cfg: DecoderConfig, steps: int) -> torch.Tensor:
    return schedule.sampling_sigmas(steps, cfg.sigma_max, cfg.sigma_mid, cfg.sigma_min)


@torch.no_grad()
def decode(decoder: ConsistencyDecoder, z: torch.Tensor, steps: int = 1, generator=None) -> torch.Tensor:
    """z -> frames (B, 3, H, W) in [-1, 1] with `steps` consistency jumps."""
    zfeat = decoder.z_features(z)
    c = decoder.cfg
    shape = (z.shape[0], 3, c.frame_size, c.frame_size)
    x0 = consistency_sample(lambda x_t, sigma: decoder(x_t, sigma, zfeat), shape, decoder_sigmas(c, steps),
                            c.sigma_min, generator=generator, device=z.device)
    return x0.clamp(-1, 1)


@dataclass
class Stage1Config:
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    dsm_weight: float = 1.0        # CTM-style denoising regulariser
    ct_weight: float = 0.1         # 1.0 stalled the one-step path at ~18.5 dB for 600 steps; 0.1 tracked a plain AE
    z_noise: float = 0.05          # latent noise in training: the decoder must tolerate imperfect predicted latents
    total_steps: int = 20000       # for the iCT discretisation curriculum
    # share of each batch trained for transport (`random_part_warps`): a part of the frame moved rigidly, the
    # latent moved by the same warp must decode to the moved frame, so moving cells moves what they show
    warp_share: float = 0.0


class Stage1(nn.Module):
    """Encoder + consistency decoder trained together; `loss(batch) -> (loss, logs)`."""

    def __init__(self, cfg: Stage1Config, curriculum_offset: int = 0):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg.encoder)
        self.decoder = ConsistencyDecoder(cfg.decoder)
        self.curriculum_offset = curriculum_offset  # a fine-tune carries the discretisation curriculum on

    def forward(self, x: torch.Tensor, step: int):  # DDP hooks run on forward(); the loss is the forward
        return self.loss(x, step)

    def loss(self, x: torch.Tensor, step: int):
        """x: (B, 3, H, W) frames in [-1, 1]."""
        c = self.cfg
        z = self.encoder(x)
        n = int(round(c.warp_share * x.shape[0]))
        if n:  # the first n frames and their latents moved by the same random part warps
            grid = random_part_warps(n, device=x.device)
            x = torch.cat([warp(x[:n].float(), grid).to(x.dtype), x[n:]])
            z = torch.cat([warp(z[:n], grid), z[n:]])
        z = z + c.z_noise * torch.randn_like(z)
        return decoder_loss(self.decoder, x, z, step + self.curriculum_offset, c.total_steps, c.ct_weight, c.dsm_weight)


def random_part_warps(n: int, device="cpu", generator=None) -> torch.Tensor:
    """n random warps that move one part of a frame rigidly and leave the rest: a disc (centre anywhere,
    radius 0.2-0.7 of the half-width) rotated by up to 0.3 rad and shifted by up to 0.15 of the half-width.
    (n, 6): centre x, y, radius, angle, shift x, y, in the frame's [-1, 1] coordinates; `warp` applies them
    at any resolution, so a frame and its latent move by exactly the same motion."""
    u = torch.rand(n, 6, generator=generator).to(device)
    return torch.stack([u[:, 0] * 1.6 - 0.8, u[:, 1] * 1.6 - 0.8, 0.2 + 0.5 * u[:, 2], (u[:, 3] * 2 - 1) * 0.3,
                        (u[:, 4] * 2 - 1) * 0.15, (u[:, 5] * 2 - 1) * 0.15], dim=1)


def warp(x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Move x (n, C, H, W) by the part warps `params` (n, 6) of `random_part_warps` (bilinear resampling)."""
    H, W = x.shape[-2:]
    gy = (torch.arange(H, device=x.device) + 0.5) / H * 2 - 1
    gx = (torch.arange(W, device=x.device) + 0.5) / W * 2 - 1
    qy, qx = torch.meshgrid(gy, gx, indexing="ij")
    q = torch.stack([qx, qy], -1)[None]                                   # (1, H, W, 2) output points
    p = params.to(x.device, torch.float32)[:, None, None]                 # (n, 1, 1, 6)
    centre, radius, angle, shift = p[..., 0:2], p[..., 2], p[..., 3], p[..., 4:6]
    d = q - (centre + shift)                                              # about the moved centre
    inside = (d.norm(dim=-1) < radius)[..., None]
    cos, sin = angle.cos(), angle.sin()                                   # rotate back by -angle
    src = torch.stack([cos * d[..., 0] + sin * d[..., 1], -sin * d[..., 0] + cos * d[..., 1]], -1) + centre
    grid = torch.where(inside, src, q.expand_as(src))
    return F.grid_sample(x, grid.to(x.dtype), mode="bilinear", padding_mode="border", align_corners=False)


def decoder_loss(decoder: ConsistencyDecoder, x: torch.Tensor, z: torch.Tensor, step: int, total_steps: int,
                 ct_weight: float, dsm_weight: float):
    """The consistency decoder's objective for frames x (B, 3, H, W) in [-1, 1] given latents z (see the
    module docstring)."""
    dc = decoder.cfg
    B = x.shape[0]
    zfeat = decoder.z_features(z)
    n = schedule.ict_num_scales(step, total_steps)
    sigmas = schedule.karras_sigmas(n, dc.sigma_min, dc.sigma_max).to(x.device)
    idx = torch.multinomial(schedule.lognormal_index_probs(sigmas), B, replacement=True).to(x.device)
    s_lo, s_hi = sigmas[idx], sigmas[idx + 1]
    eps = torch.randn_like(x)
    x_hi = decoder(x + s_hi[:, None, None, None] * eps, s_hi, zfeat)
    with torch.no_grad():  # stop-gradient target one level lower on the same trajectory
        x_lo = decoder(x + s_lo[:, None, None, None] * eps, s_lo, tuple(t.detach() for t in zfeat))
    w = 1.0 / (s_hi - s_lo)
    huber_c = 0.00054 * (x[0].numel() ** 0.5)
    ct = (w * schedule.pseudo_huber(x_hi, x_lo, huber_c)).mean() / w.mean()
    dsm = (x_hi - x).float().pow(2).mean()
    # The one-step jump from pure noise is what `decode(steps=1)` runs: train it directly every batch.
    s_max = torch.full((B,), dc.sigma_max, device=x.device)
    x_one = decoder(torch.randn_like(x) * dc.sigma_max, s_max, zfeat)
    one = (x_one - x).float().pow(2).mean()
    loss = ct_weight * ct + dsm_weight * (dsm + one)
    return loss, {"loss": loss.item(), "ct": ct.item(), "dsm_mse": dsm.item(), "one_step_mse": one.item(), "num_scales": n}
