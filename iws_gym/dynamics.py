"""Stage 2: action-conditioned latent consistency dynamics with a rolling, slightly noised context.

Given a window of K past latents ctx = z_{t-K+1..t} and the actions that followed each, the model
denoises the next latent z_{t+1} in one to a few consistency steps. The window is a short video
(K context frames + 1 target slot) processed by blocks of

* a factorised 3D convolution: 3x3 spatial per frame, then a causal kernel-3 temporal convolution
  (time is really mixed, and no frame sees the future),
* FiLM from each slot's conditioning: the action that led into that frame, and its noise level
  (small for context frames, sigma for the target slot), plus a flag for padded slots,
* spatial self-attention within each frame and causal temporal self-attention at each location.

Short history is explicit: a rollout may start from a single real frame. Missing context slots are
filled with the earliest frame, flagged as padding in their conditioning, and masked out of temporal
attention; training samples the history length uniformly in [1, K] so every case is trained.

Objective (`Stage2.loss`): the same family as stage 1 - improved consistency training between adjacent
noise levels with a stop-gradient target, a denoising regulariser at the same level and the
one-step jump from sigma_max - with context-noise augmentation: context latents are noised at a
random level in [0, ctx_sigma_max] (given to the network), because at inference the context is the
model's own imperfect predictions; at inference the context is noised at `ctx_sigma` (fixed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import schedule
from .layers import FourierEmbedding, group_norm
from .sampler import consistency_sample


@dataclass
class DynamicsConfig:
    latent_ch: int = 8
    latent_size: int = 16
    context: int = 4               # K past latents in the window
    patch: int = 2                 # latent 16x16 -> 8x8 tokens per frame inside the network
    ch: int = 160
    blocks: int = 4
    heads: int = 4
    emb_dim: int = 128
    action_scale: float = 512.0    # actions are absolute targets in the 512 canvas -> [-1, 1]
    sigma_data: float = 0.5
    sigma_min: float = 0.002
    sigma_max: float = 80.0
    sigma_mid: float = 0.4         # second level of 2-step sampling
    ctx_sigma_max: float = 0.1     # context-noise augmentation range in training
    ctx_sigma: float = 0.02        # context noise at inference
    z_mean: float = 0.0            # latent normalisation (from the stage-1 encoder over the data)
    z_std: float = 1.0


class FactorisedConv3d(nn.Module):
    """(B, C, T, H, W): 3x3 spatial conv per frame, then a causal temporal conv (kernel 3, left-padded)."""

    def __init__(self, ch: int):
        super().__init__()
        self.spatial = nn.Conv3d(ch, ch, (1, 3, 3), padding=(0, 1, 1))
        self.temporal = nn.Conv3d(ch, ch, (3, 1, 1))

    def forward(self, x):
        x = self.spatial(x)
        return self.temporal(F.pad(x, (0, 0, 0, 0, 2, 0)))  # pad 2 frames in the past only


class DynBlock(nn.Module):
    def __init__(self, ch: int, cond_dim: int, heads: int):
        super().__init__()
        self.norm1, self.conv1 = group_norm(ch), FactorisedConv3d(ch)
        self.norm2, self.conv2 = group_norm(ch), FactorisedConv3d(ch)
        self.film = nn.Linear(cond_dim, 2 * ch)
        nn.init.zeros_(self.conv2.temporal.weight)
        nn.init.zeros_(self.conv2.temporal.bias)
        self.norm_s, self.attn_s = group_norm(ch), nn.MultiheadAttention(ch, heads, batch_first=True)
        self.norm_t, self.attn_t = group_norm(ch), nn.MultiheadAttention(ch, heads, batch_first=True)

    @staticmethod
    def _norm(norm, x):  # per-pixel channel norm on (B, C, T, H, W)
        B, C, T, H, W = x.shape
        return norm(x.transpose(1, 2).reshape(B * T, C, H, W)).reshape(B, T, C, H, W).transpose(1, 2)

    def forward(self, x, cond, t_mask, pad):
        """x (B, C, T, H, W); cond (B, T, cond_dim); t_mask (T, T) bool, True = may not attend;
        pad (B, T) bool, True = padded slot (never attended to)."""
        B, C, T, H, W = x.shape
        h = self.conv1(F.silu(self._norm(self.norm1, x)))
        scale, shift = self.film(cond).transpose(1, 2)[..., None, None].chunk(2, dim=1)  # (B, C, T, 1, 1) each
        h = self._norm(self.norm2, h) * (1 + scale) + shift
        x = x + self.conv2(F.silu(h))
        # spatial attention within each frame: tokens = H*W
        s = self._norm(self.norm_s, x).permute(0, 2, 3, 4, 1).reshape(B * T, H * W, C)
        s = self.attn_s(s, s, s, need_weights=False)[0]
        x = x + s.reshape(B, T, H, W, C).permute(0, 4, 1, 2, 3)
        # causal temporal attention at each location: tokens = T
        t = self._norm(self.norm_t, x).permute(0, 3, 4, 2, 1).reshape(B * H * W, T, C)
        key_pad = pad[:, None, :].expand(B, H * W, T).reshape(B * H * W, T)
        t = self.attn_t(t, t, t, attn_mask=t_mask, key_padding_mask=key_pad, need_weights=False)[0]
        return x + t.reshape(B, H, W, T, C).permute(0, 4, 3, 1, 2)


class DynamicsNet(nn.Module):
    """The network: noisy window -> F for the target slot. Knows nothing about noise schedules."""

    def __init__(self, cfg: DynamicsConfig):
        super().__init__()
        self.cfg = cfg
        self.inp = nn.Conv2d(cfg.latent_ch, cfg.ch, cfg.patch, stride=cfg.patch)  # 16x16 -> 8x8 tokens
        self.sigma_emb = FourierEmbedding(cfg.emb_dim)
        self.action_emb = nn.Sequential(nn.Linear(2, cfg.emb_dim), nn.SiLU(), nn.Linear(cfg.emb_dim, cfg.emb_dim))
        self.slot_emb = nn.Embedding(3, cfg.emb_dim)  # 0 = context, 1 = padded context, 2 = target
        self.pos_emb = nn.Parameter(torch.zeros(cfg.context + 1, cfg.emb_dim))
        self.blocks = nn.ModuleList([DynBlock(cfg.ch, cfg.emb_dim, cfg.heads) for _ in range(cfg.blocks)])
        self.norm_out = group_norm(cfg.ch)
        self.up = nn.ConvTranspose2d(cfg.ch, cfg.ch // 2, cfg.patch, stride=cfg.patch)  # back to 16x16
        self.out = nn.Conv2d(cfg.ch // 2, cfg.latent_ch, 3, padding=1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, window, actions_in, c_noise, slot):
        """window (B, T, C, h, w) preconditioned inputs; actions_in (B, T, 2) normalised action leading
        into each slot; c_noise (B, T); slot (B, T) long (1 = padding). Returns F for the last slot (B, C, h, w)."""
        B, T, C, H, W = window.shape
        pad = slot == 1
        window = window.masked_fill(pad[:, :, None, None, None], 0.0)  # padded slots carry no content
        dt = self.inp.weight.dtype
        cond = self.sigma_emb(c_noise.reshape(-1)).reshape(B, T, -1) + self.action_emb(actions_in.to(dt)) \
            + self.slot_emb(slot) + self.pos_emb[:T]
        cond = F.silu(cond).to(dt)
        h = self.inp(window.reshape(B * T, C, H, W).to(dt))  # (B*T, ch, h/2, w/2)
        h = h.reshape(B, T, *h.shape[1:]).transpose(1, 2)    # (B, ch, T, h/2, w/2)
        causal = torch.ones(T, T, dtype=torch.bool, device=window.device).triu(1)
        for blk in self.blocks:
            h = blk(h, cond, causal, pad)
        last = h[:, :, -1]  # (B, ch, h/2, w/2): only the target slot is read out
        return self.out(F.silu(self.up(F.silu(self.norm_out(last))))).float()


class Stage2(nn.Module):
    """Consistency parameterisation + loss around DynamicsNet. Latents in, latents out (unnormalised)."""

    def __init__(self, cfg: DynamicsConfig):
        super().__init__()
        self.cfg = cfg
        self.net = DynamicsNet(cfg)

    def norm(self, z):
        return (z - self.cfg.z_mean) / self.cfg.z_std * self.cfg.sigma_data

    def unnorm(self, y):
        return y / self.cfg.sigma_data * self.cfg.z_std + self.cfg.z_mean

    def denoise(self, x_t, sigma, ctx, ctx_sigma, actions, n_valid):
        """Consistency function on normalised latents.

        x_t (B, C, h, w) noisy target; sigma (B,); ctx (B, K, C, h, w) normalised context (already noised
        at ctx_sigma (B,)); actions (B, K, 2) raw actions, actions[:, i] taken at context frame i;
        n_valid (B,) how many of the K context slots are real (the rest, at the start, are padding)."""
        c = self.cfg
        B, K = ctx.shape[:2]
        s = sigma.float()[:, None, None, None]
        c_skip = schedule.c_skip(s, c.sigma_data, c.sigma_min)
        c_out = schedule.c_out(s, c.sigma_data, c.sigma_min)
        ctx_scale = schedule.c_in(ctx_sigma.float(), c.sigma_data)[:, None, None, None, None]
        window = torch.cat([ctx * ctx_scale, (schedule.c_in(s, c.sigma_data) * x_t)[:, None]], dim=1)  # (B, K+1, C, h, w)
        # the action leading into slot i is the action taken at slot i-1; slot 0 has none (zeros)
        a = actions.float() / c.action_scale * 2 - 1
        actions_in = torch.cat([torch.zeros_like(a[:, :1]), a], dim=1)  # (B, K+1, 2)
        idx = torch.arange(K + 1, device=ctx.device)[None]
        padded = idx < (K - n_valid)[:, None]
        slot = torch.where(padded, 1, 0)
        slot[:, -1] = 2
        no_action = idx <= (K - n_valid)[:, None]  # padded slots and the first real one: nothing led into them
        actions_in = actions_in.masked_fill(no_action[..., None], 0.0)
        c_noise = torch.cat([schedule.c_noise(ctx_sigma.float().clamp_min(c.sigma_min))[:, None].expand(B, K),
                             schedule.c_noise(sigma.float())[:, None]], dim=1)
        F_x = self.net(window, actions_in, c_noise, slot)
        return c_skip * x_t.float() + c_out * F_x

    def forward(self, batch, step: int):
        return self.loss(batch, step)

    def loss(self, batch, step: int):
        """batch: (ctx (B, K, C, h, w) raw latents, actions (B, K, 2), target (B, C, h, w), n_valid (B,))."""
        c = self.cfg
        ctx, actions, target, n_valid = batch
        B = target.shape[0]
        ctx, x = self.norm(ctx), self.norm(target)
        ctx_sigma = torch.rand(B, device=x.device) * c.ctx_sigma_max
        ctx = ctx + ctx_sigma[:, None, None, None, None] * torch.randn_like(ctx)
        n = schedule.ict_num_scales(step, getattr(self, "total_steps", 20000))
        sigmas = schedule.karras_sigmas(n, c.sigma_min, c.sigma_max).to(x.device)
        idx = torch.multinomial(schedule.lognormal_index_probs(sigmas), B, replacement=True).to(x.device)
        s_lo, s_hi = sigmas[idx], sigmas[idx + 1]
        eps = torch.randn_like(x)
        x_hi = self.denoise(x + s_hi[:, None, None, None] * eps, s_hi, ctx, ctx_sigma, actions, n_valid)
        with torch.no_grad():
            x_lo = self.denoise(x + s_lo[:, None, None, None] * eps, s_lo, ctx, ctx_sigma, actions, n_valid)
        w = 1.0 / (s_hi - s_lo)
        huber_c = 0.00054 * (x[0].numel() ** 0.5)
        ct = (w * schedule.pseudo_huber(x_hi, x_lo, huber_c)).mean() / w.mean()
        dsm = (x_hi - x).pow(2).mean()
        s_max = torch.full((B,), c.sigma_max, device=x.device)
        x_one = self.denoise(torch.randn_like(x) * c.sigma_max, s_max, ctx, ctx_sigma, actions, n_valid)
        one = (x_one - x).pow(2).mean()
        loss = 0.1 * ct + dsm + one
        return loss, {"loss": loss.item(), "ct": ct.item(), "dsm_mse": dsm.item(), "one_step_mse": one.item(), "num_scales": n}

    @torch.no_grad()
    def predict(self, ctx, actions, n_valid, steps: int = 1, generator=None, ctx_noise=None):
        """Next latent (B, C, h, w) from raw context latents (B, K, C, h, w) and actions (B, K, 2).

        ctx_noise: optional (B, K, C, h, w) standard normal draws for the context noise (for determinism)."""
        c = self.cfg
        B = ctx.shape[0]
        ctx = self.norm(ctx)
        ctx_sigma = torch.full((B,), c.ctx_sigma, device=ctx.device)
        if ctx_noise is None:
            ctx_noise = torch.randn(ctx.shape, generator=generator, device=generator.device if generator else ctx.device).to(ctx.device)
        ctx = ctx + c.ctx_sigma * ctx_noise
        sig = schedule.sampling_sigmas(steps, c.sigma_max, c.sigma_mid, c.sigma_min)
        y = consistency_sample(lambda x_t, s: self.denoise(x_t, s, ctx, ctx_sigma, actions, n_valid),
                               (B, c.latent_ch, c.latent_size, c.latent_size), sig, c.sigma_min,
                               generator=generator, device=ctx.device)
        return self.unnorm(y)
