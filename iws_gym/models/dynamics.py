"""Stage 2: action-conditioned latent consistency dynamics with a rolling, slightly noised context.

Given a window of K past latents ctx = z_{t-K+1..t} and the actions that followed each, the model
denoises the next latent z_{t+1} in one to a few consistency steps. The window is a short video
(K context frames + 1 target slot) processed by blocks of

* a factorised 3D convolution: 3x3 spatial per frame, then a causal kernel-3 temporal convolution
  (time is really mixed, and no frame sees the future),
* FiLM from each slot's conditioning: the action that led into that frame, and its noise level
  (small for context frames, sigma for the target slot), plus a flag for padded slots,
* (at the input) maps of where each slot's action points on the latent grid (`action_maps`): FiLM is
  global, and without absolute positions the network cannot move the agent to an absolute target,
* spatial self-attention within each frame and causal temporal self-attention at each location.

Short history is explicit: a rollout may start from a single real frame. Missing context slots are
filled with the earliest frame, flagged as padding in their conditioning, and masked out of temporal
attention; training samples the history length uniformly in [1, K] so every case is trained.

What is denoised is the change z_{t+1} - z_t from the last context latent (normalised by its std over
the data), not z_{t+1} itself: most of a frame does not move, so a static scene costs nothing and the
network spends its capacity on what changes. With `transport` the base is not z_t itself but z_t moved by
a displacement field the network predicts from the window and the action (`FlowHead`, `flow_warp`):
content is carried cell by cell, and what is denoised is only the residual that moving cannot explain.
The flow is trained by how well the moved latent matches z_{t+1}; nothing in it knows what an object is.

Objective (`Stage2.loss`): the same family as stage 1 - improved consistency training between adjacent
noise levels with a stop-gradient target, a denoising regulariser at the same level and the
one-step jump from sigma_max (MSE) - with context-noise augmentation: context latents are noised at a
random level in [0, ctx_sigma_max] (given to the network), because at inference the context is the
model's own imperfect predictions; at inference the context is noised at `ctx_sigma` (fixed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from iws_gym.models import schedule
from iws_gym.models.layers import FourierEmbedding, ResBlock, group_norm
from iws_gym.models.sampler import consistency_sample, euler_sample


@dataclass
class DynamicsConfig:
    latent_ch: int = 8
    latent_size: int = 16
    context: int = 4               # K past latents in the window
    patch: int = 2                 # latent 16x16 -> 8x8 tokens per frame inside the network
    ch: int = 128
    blocks: int = 3
    heads: int = 4
    emb_dim: int = 128
    action_scale: float = 512.0    # actions are absolute targets in the 512 canvas -> [-1, 1]
    sigma_data: float = 0.5
    sigma_min: float = 0.002
    sigma_max: float = 80.0
    sigma_mid: float = 0.4         # second level of 2-step sampling
    ctx_sigma_max: float = 0.1     # context-noise augmentation range in training
    ctx_sigma: float = 0.02        # context noise at inference
    # "uniform": every context frame noised at one level in [0, ctx_sigma_max]; "per_frame" (Diffusion Forcing):
    # each frame but the last at its own level, half of them in that range and half log-uniform up to sigma_max,
    # so the network learns to restore, or to ignore, a degraded past (the last frame keeps the small range:
    # the change is denoised relative to it)
    ctx_noise: str = "uniform"
    z_mean: float = 0.0            # latent normalisation (from the stage-1 encoder over the data)
    z_std: float = 1.0
    dz_std: float = 1.0            # std of z_{t+1} - z_t over the data: the denoised quantity is this change
    hires_ch: int = 64             # width of the full-resolution refinement head (HiResHead); 0: none
    # the training objective and the sampler that goes with it: "consistency" (iCT + a denoising term + the
    # one-step jump by MSE; sampled by consistency jumps) or "denoise" (EDM denoising score matching alone,
    # sampled by `sample_steps` Euler steps of the probability-flow ODE: a sample, not a conditional mean)
    objective: str = "consistency"
    sample_steps: int = 1          # default sampler steps per prediction
    # the denoising objective's noise levels, log-normal (EDM's image defaults; DIAMOND's world model uses
    # p_mean -0.4 and starts its Euler sampler at sigma_max 5)
    p_mean: float = -1.2
    p_std: float = 1.2
    # transport: the base of the change is the last latent moved by a predicted flow (FlowHead); flow_weight
    # scales the flow's own loss (the moved latent against the next one)
    transport: bool = False
    flow_weight: float = 1.0
    # the flow's form: "dense" (a displacement per cell) or "rigid" (piecewise rigid: flow_slots soft masks,
    # each moved by its own rotation and translation, plus a still background; SE3-Nets' prior in 2D)
    flow: str = "dense"
    flow_slots: int = 4
    # a gate on the dense flow: flow = sigmoid(g) * displacement, with g predicted per cell (starting shut) and
    # flow_gate_weight * mean(sigmoid(g)) added to the loss, so the flow is near zero wherever nothing moves
    # (0: no gate)
    flow_gate_weight: float = 0.0
    # the agent track (see agent_landing): the fitted motion law of the agent, (c_pt, c_pt-1, c_at, c_at-1,
    # d_pt, d_at); empty: no track, the network sees actions only
    agent_motion: tuple = ()


class FactorisedConv3d(nn.Module):
    """A 3D convolution factorised as 3x3 spatial per frame, then causal kernel-3 temporal mixing:
    out[t] = W0 s[t-2] + W1 s[t-1] + W2 s[t] (s: the spatial output; missing past frames are zeros).

    It runs on two streams: the K context frames (B, K, C, H, W) and V variants of the target slot
    (B, V, C, H, W) that all follow the same context. Because nothing looks ahead, the context stream
    does not depend on the target, so it is computed once for every variant (the loss's noise levels,
    the sampler's steps)."""

    def __init__(self, ch: int):
        super().__init__()
        self.spatial = nn.Conv2d(ch, ch, 3, padding=1)
        self.temporal = nn.Conv2d(3 * ch, ch, 1)  # the three taps stacked on channels

    def _spatial(self, x):
        B, T = x.shape[:2]
        return self.spatial(x.flatten(0, 1)).unflatten(0, (B, T))

    def context(self, ctx):
        """The context stream (B, K, C, H, W) -> (its output, `prev`: the spatial outputs of the last two
        context frames (B, 2C, H, W), all a target variant needs of the context)."""
        s_c = self._spatial(ctx)                                       # (B, K, C, H, W)
        B, K = s_c.shape[:2]
        z = torch.zeros_like(s_c[:, :1])
        past = torch.cat([z, z, s_c], dim=1)                           # (B, K+2, C, H, W)
        taps_c = torch.cat([past[:, :K], past[:, 1 : K + 1], s_c], dim=2)  # (B, K, 3C, H, W)
        return self.temporal(taps_c.flatten(0, 1)).unflatten(0, (B, K)), past[:, K:K + 2].flatten(1, 2)

    def target(self, tgt, prev):
        """V target variants (B, V, C, H, W) after a context whose `prev` is given -> (B, V, C, H, W)."""
        s_t = self._spatial(tgt)
        B, V = s_t.shape[:2]
        taps_t = torch.cat([prev[:, None].expand(B, V, *prev.shape[1:]), s_t], dim=2)  # (B, V, 3C, H, W)
        return self.temporal(taps_t.flatten(0, 1)).unflatten(0, (B, V))

    def forward(self, ctx, tgt):
        out_c, prev = self.context(ctx)
        return out_c, self.target(tgt, prev)


class SpatialAttention(nn.Module):
    """Multi-head self-attention among the tokens of one frame, (N, L, C) -> (N, L, C).

    Written as two plain matmuls: at L = 64 tokens this trains ~2.5x faster on a CPU than the fused
    scaled_dot_product_attention kernels (measured, bf16 autocast)."""

    def __init__(self, ch: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(ch, 3 * ch)
        self.proj = nn.Linear(ch, ch)

    def forward(self, x):
        N, L, C = x.shape
        q, k, v = self.qkv(x).view(N, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # (N, h, L, d) each
        w = ((q @ k.transpose(-1, -2)) * (C // self.heads) ** -0.5).float().softmax(dim=-1).to(v.dtype)
        return self.proj((w @ v).transpose(1, 2).reshape(N, L, C))


class TemporalAttention(nn.Module):
    """Causal multi-head attention along a window of a few frames at each location.

    The sequences are tiny (K context frames, plus the target slot) and there are B*h*w*V of them, so
    scores are computed by broadcasting (N, Lq, 1, heads, d) * (N, 1, Lk, heads, d) rather than by
    batched matmuls or a flash kernel, which are several times slower at this shape on a CPU.
    Context slot i attends to slots j <= i that are real (and always to itself); a target variant attends
    to every real context slot and to itself."""

    def __init__(self, ch: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(ch, 3 * ch)
        self.proj = nn.Linear(ch, ch)

    def _split(self, x):  # (N, L, 3C) -> three (N, L, heads, d)
        N, L = x.shape[:2]
        return x.view(N, L, 3, self.heads, -1).unbind(2)

    @staticmethod
    def _attend(q, k, v, mask):
        """q (N, Lq, h, d); k, v (N, Lk, h, d); mask (N or 1, Lq, Lk) bool, True = blocked."""
        s = (q[:, :, None] * k[:, None]).sum(-1) * q.shape[-1] ** -0.5     # (N, Lq, Lk, h)
        w = s.float().masked_fill(mask[..., None], float("-inf")).softmax(dim=2).to(v.dtype)
        return (w[..., None] * v[:, None]).sum(2)                         # (N, Lq, h, d)

    def context(self, n_c, key_pad):
        """n_c (N, K, C) context, key_pad (N, K) True = padded slot -> (its output (N, K, C), the keys and
        values a target variant attends to)."""
        N, K, C = n_c.shape
        q_c, k_c, v_c = self._split(self.qkv(n_c))
        eye = torch.eye(K, dtype=torch.bool, device=n_c.device)
        causal = torch.ones(K, K, dtype=torch.bool, device=n_c.device).triu(1)
        a_c = self._attend(q_c, k_c, v_c, causal | (key_pad[:, None, :] & ~eye))
        return self.proj(a_c.reshape(N, K, C)), (k_c, v_c, key_pad)

    def target(self, n_t, kv):
        """n_t (N, V, C) target variants; kv from `context` -> (N, V, C). Each variant's keys: the K context
        slots + itself."""
        k_c, v_c, key_pad = kv
        N, V, C = n_t.shape
        K = k_c.shape[1]
        q_t, k_t, v_t = self._split(self.qkv(n_t))
        s_tc = (q_t[:, :, None] * k_c[:, None]).sum(-1)                   # (N, V, K, h)
        s_tt = (q_t * k_t).sum(-1)[:, :, None]                            # (N, V, 1, h)
        s = torch.cat([s_tc, s_tt], dim=2).float() * q_t.shape[-1] ** -0.5
        blocked = torch.cat([key_pad, key_pad.new_zeros(N, 1)], dim=1)   # (N, K+1)
        w = s.masked_fill(blocked[:, None, :, None], float("-inf")).softmax(dim=2).to(v_c.dtype)
        a_t = (w[:, :, :K, :, None] * v_c[:, None]).sum(2) + w[:, :, K, :, None] * v_t  # (N, V, h, d)
        return self.proj(a_t.reshape(N, V, C))

    def forward(self, n_c, n_t, key_pad):
        """n_c (N, K, C) context, n_t (N, V, C) target variants, key_pad (N, K) True = padded slot."""
        a_c, kv = self.context(n_c, key_pad)
        return a_c, self.target(n_t, kv)


class DynBlock(nn.Module):
    def __init__(self, ch: int, cond_dim: int, heads: int):
        super().__init__()
        self.norm1, self.conv1 = group_norm(ch), FactorisedConv3d(ch)
        self.norm2, self.conv2 = group_norm(ch), FactorisedConv3d(ch)
        self.film = nn.Linear(cond_dim, 2 * ch)
        nn.init.zeros_(self.conv2.temporal.weight)
        nn.init.zeros_(self.conv2.temporal.bias)
        self.norm_s, self.attn_s = group_norm(ch), SpatialAttention(ch, heads)
        self.norm_t, self.attn_t = group_norm(ch), TemporalAttention(ch, heads)

    @staticmethod
    def _norm(norm, x):  # per-pixel channel norm on (B, T, C, H, W)
        return norm(x.flatten(0, 1)).unflatten(0, x.shape[:2])

    def _film(self, h, cond):
        scale, shift = self.film(cond)[..., None, None].chunk(2, dim=2)  # (B, T, C, 1, 1) each
        return h * (1 + scale) + shift

    def _spatial_attn(self, x):
        B, T, C, H, W = x.shape
        s = self._norm(self.norm_s, x).permute(0, 1, 3, 4, 2).reshape(B * T, H * W, C)
        s = self.attn_s(s)
        return x + s.reshape(B, T, H, W, C).permute(0, 1, 4, 2, 3)

    def context(self, ctx, cond_c, pad):
        """The context stream: ctx (B, K, C, H, W), cond_c (B, K, D), pad (B, K) bool (True = padded slot,
        never attended to) -> (its output, the cache a target variant reads: nothing looks ahead, so the
        context stream is computed once for every variant and every sampler step)."""
        B, K, C, H, W = ctx.shape
        h_c, prev1 = self.conv1.context(F.silu(self._norm(self.norm1, ctx)))
        h_c = F.silu(self._film(self._norm(self.norm2, h_c), cond_c))
        d_c, prev2 = self.conv2.context(h_c)
        ctx = self._spatial_attn(ctx + d_c)
        # causal temporal attention at each location: the context attends to its (unpadded) past
        n_c = self._norm(self.norm_t, ctx).permute(0, 3, 4, 1, 2).reshape(B * H * W, K, C)
        key_pad = pad[:, None, :].expand(B, H * W, K).reshape(B * H * W, K)
        a_c, kv = self.attn_t.context(n_c, key_pad)
        return ctx + a_c.reshape(B, H, W, K, C).permute(0, 3, 4, 1, 2), (prev1, prev2, kv)

    def target(self, tgt, cond_t, cache):
        """V target variants tgt (B, V, C, H, W), cond_t (B, V, D), after the context of `cache`."""
        prev1, prev2, kv = cache
        B, V, C, H, W = tgt.shape
        h_t = self.conv1.target(F.silu(self._norm(self.norm1, tgt)), prev1)
        h_t = F.silu(self._film(self._norm(self.norm2, h_t), cond_t))
        tgt = self._spatial_attn(tgt + self.conv2.target(h_t, prev2))
        # ... each variant attends to the whole (unpadded) context and itself
        n_t = self._norm(self.norm_t, tgt).permute(0, 3, 4, 1, 2).reshape(B * H * W, V, C)
        return tgt + self.attn_t.target(n_t, kv).reshape(B, H, W, V, C).permute(0, 3, 4, 1, 2)

    def forward(self, ctx, tgt, cond_c, cond_t, pad):
        ctx, cache = self.context(ctx, cond_c, pad)
        return ctx, self.target(tgt, cond_t, cache)


ACTION_MAP_CH = 5
AGENT_MAP_CH = 3


def agent_landing(pos: torch.Tensor, actions: torch.Tensor, n_valid: torch.Tensor, coef) -> torch.Tensor:
    """Where the agent will be in the next frame, by its motion law: pos (B, K, 2) the agent's position
    in each context frame and actions (B, K, 2) the targets commanded there (canvas px; padded slots
    anything), n_valid (B,) -> (B, 2) canvas px.

    gym-pusht moves the agent by a PD controller toward the commanded target and the agent is not
    pushed back by what it touches, so its next position is linear in its last two positions and the
    last two targets: p_{t+1} = c0 p_t + c1 p_{t-1} + c2 a_t + c3 a_{t-1}; from a single frame (at rest)
    p_1 = d0 p_0 + d1 a_0. The six numbers are fitted to recorded episodes (`fit_agent_motion`).

    Evaluated as p_t plus weighted offsets from p_t, which is the same law wherever the fitted weights sum to
    one (they do, to 1e-6) and keeps an agent at rest exactly where it is: summed as fitted, the weights' excess
    moved a held agent by about 0.001 px a step, enough to flip the bf16 rounding of its position in the
    decoder and shift a still T by 0.4-1.2 px (docs/experiments.md, thirty-first session)."""
    c0, c1, c2, c3, d0, d1 = (float(v) for v in coef)
    p, a = pos.float(), actions.float()
    p0 = p[:, -1]
    two = p0 + c1 * (p[:, -2] - p0) + c2 * (a[:, -1] - p0) + c3 * (a[:, -2] - p0) if p.shape[1] > 1 else p0
    one = p0 + d1 * (a[:, -1] - p0)
    return torch.where((n_valid >= 2)[:, None], two, one)


def fit_agent_motion(agent_pos, actions) -> tuple[tuple, dict]:
    """Least-squares fit of agent_landing's six coefficients (shared by x and y) to episodes: lists of
    (T+1, 2) agent positions and (T, 2) actions. Returns (coef, stats) with the fit's residuals in
    canvas px (median and max over every transition)."""
    import numpy as np

    two_x, two_y, one_x, one_y = [], [], [], []
    for p, a in zip(agent_pos, actions):
        p, a = np.asarray(p, np.float64), np.asarray(a, np.float64)
        if len(a) >= 2:
            two_x.append(np.stack([p[1:-1], p[:-2], a[1:], a[:-1]], axis=-1).reshape(-1, 4))  # both axes as rows
            two_y.append(p[2:].reshape(-1))
        one_x.append(np.stack([p[0], a[0]], axis=-1))
        one_y.append(p[1])
    if not two_x:
        raise ValueError("fit_agent_motion needs at least one episode of 2 or more steps")
    X2, y2 = np.concatenate(two_x), np.concatenate(two_y)
    X1, y1 = np.concatenate(one_x), np.concatenate(one_y)
    w2, *_ = np.linalg.lstsq(X2, y2, rcond=None)
    w1, *_ = np.linalg.lstsq(X1, y1, rcond=None)
    r2 = np.linalg.norm((X2 @ w2 - y2).reshape(-1, 2), axis=1)
    r1 = np.linalg.norm((X1 @ w1 - y1).reshape(-1, 2), axis=1)
    r = np.concatenate([r2, r1])
    coef = tuple(round(float(v), 6) for v in (*w2, *w1))
    return coef, dict(transitions=int(len(r)), residual_px_median=float(np.median(r)), residual_px_max=float(r.max()))


def action_maps(actions_in: torch.Tensor, valid: torch.Tensor, size: int, blob: float = 0.1) -> torch.Tensor:
    """Where each slot's action points, as maps on the latent grid: (B, T, 2) normalised targets in
    [-1, 1] and valid (B, T) bool (False: no action led into the slot) -> (B, T, 5, size, size): the grid's own x and y, the offset from each cell
    to the target (dx, dy) and a Gaussian blob at the target. FiLM alone is global; these maps give the
    convolutions and attention the absolute positions they need to move the agent to a target."""
    B, T = actions_in.shape[:2]
    g = (torch.arange(size, device=actions_in.device, dtype=torch.float32) + 0.5) / size * 2 - 1
    gy, gx = torch.meshgrid(g, g, indexing="ij")                        # rows are y, columns are x
    a = actions_in.float()
    has = valid.float()[..., None, None]                                # (B, T, 1, 1)
    dx = (a[..., 0, None, None] - gx) * has                             # (B, T, size, size)
    dy = (a[..., 1, None, None] - gy) * has
    bl = torch.exp(-(dx**2 + dy**2) / (2 * blob**2)) * has
    return torch.stack([gx.expand(B, T, size, size), gy.expand(B, T, size, size), dx, dy, bl], dim=2)


def n_maps(cfg: "DynamicsConfig") -> int:
    """Input maps per slot: where the action points, and with an agent track where the agent is."""
    return ACTION_MAP_CH + (AGENT_MAP_CH if cfg.agent_motion else 0)


class HiResHead(nn.Module):
    """A refinement at the latent's own resolution (16x16 cells of 8 px). The trunk works on tokens of
    2x2 cells and reads out through one transposed convolution; this head sees, cell by cell, the last
    context latent and the noisy target (a skip path around the tokenisation), the target slot's action
    maps and the trunk's upsampled features, and adds a correction to the output. Its last convolution
    starts at zero, so adding it to a trained network does not change what it computes."""

    def __init__(self, cfg: "DynamicsConfig", blocks: int = 2):
        super().__init__()
        c = cfg.hires_ch
        self.inp = nn.Conv2d(2 * cfg.latent_ch + n_maps(cfg) + cfg.ch // 2, c, 3, padding=1)
        self.blocks = nn.ModuleList([ResBlock(c, cfg.emb_dim) for _ in range(blocks)])
        self.norm = group_norm(c)
        self.out = nn.Conv2d(c, cfg.latent_ch, 3, padding=1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x, cond):
        """x (N, 2*latent_ch + maps + ch/2, h, w) stacked inputs; cond (N, D) -> (N, latent_ch, h, w)."""
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h, cond)
        return self.out(F.silu(self.norm(h)))


def flow_warp(z: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
    """Move z (B, C, h, w) by a displacement field flow (B, 2, h, w) of (x, y) in cells: the output at cell q
    is z at q - flow(q) (bilinear; the border repeats). Zero flow returns z exactly."""
    B, _, H, W = z.shape
    gy = (torch.arange(H, device=z.device, dtype=torch.float32) + 0.5) / H * 2 - 1
    gx = (torch.arange(W, device=z.device, dtype=torch.float32) + 0.5) / W * 2 - 1
    qy, qx = torch.meshgrid(gy, gx, indexing="ij")
    f = flow.float()
    src = torch.stack([qx - f[:, 0] * (2 / W), qy - f[:, 1] * (2 / H)], dim=-1)   # (B, H, W, 2)
    return F.grid_sample(z.float(), src, mode="bilinear", padding_mode="border", align_corners=False)


class FlowHead(nn.Module):
    """Where the content of the last context latent goes next: a displacement field (B, 2, h, w) in cells at
    the latent's own resolution, from the last two context latents, the trunk's features of the last context
    frame (upsampled: they have seen the whole window through attention), the target slot's action maps and
    its action (FiLM). Its last convolution starts at zero: an untrained head moves nothing."""

    def __init__(self, cfg: "DynamicsConfig", blocks: int = 2):
        super().__init__()
        c = cfg.hires_ch or 64
        self.up = nn.ConvTranspose2d(cfg.ch, cfg.ch // 2, cfg.patch, stride=cfg.patch)
        self.inp = nn.Conv2d(2 * cfg.latent_ch + n_maps(cfg) + cfg.ch // 2, c, 3, padding=1)
        self.blocks = nn.ModuleList([ResBlock(c, cfg.emb_dim) for _ in range(blocks)])
        self.norm = group_norm(c)
        self.rigid = cfg.flow == "rigid"
        if cfg.flow not in ("dense", "rigid"):
            raise ValueError(f"DynamicsConfig.flow must be 'dense' or 'rigid', got {cfg.flow!r}")
        if self.rigid:  # masks over slots + background, and each slot's motion from its mask-pooled features
            self.masks = nn.Conv2d(c, cfg.flow_slots + 1, 3, padding=1)
            self.motion = nn.Sequential(nn.Linear(c, c), nn.SiLU(), nn.Linear(c, 3))  # angle, tx, ty (cells)
            self.out = self.motion[-1]
        else:
            self.gated = cfg.flow_gate_weight > 0
            self.out = nn.Conv2d(c, 3 if self.gated else 2, 3, padding=1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)
        if not self.rigid and self.gated:
            nn.init.constant_(self.out.bias[2:], -3.0)  # the gate starts nearly shut

    def forward(self, last, prev, maps_t, feats, cond):
        """last, prev (B, C, h, w) the last two context latents (prev zero if padded); maps_t (B, M, h, w);
        feats (B, ch, h/p, w/p) the trunk's last context frame; cond (B, D) -> flow (B, 2, h, w), float32, and
        with a gate its values (B, 1, h, w) (else None)."""
        dt = self.inp.weight.dtype
        u = F.silu(self.up(feats.to(dt)))
        h = self.inp(torch.cat([last.to(dt), prev.to(dt), maps_t.to(dt), u], dim=1))
        for blk in self.blocks:
            h = blk(h, cond)
        h = F.silu(self.norm(h))
        if self.rigid:
            return rigid_flow(self.masks(h).float().softmax(dim=1), h.float(), self.motion), None
        out = self.out(h).float()
        if not self.gated:
            return out, None
        gate = torch.sigmoid(out[:, 2:])
        return gate * out[:, :2], gate


def rigid_flow(masks: torch.Tensor, feats: torch.Tensor, motion: nn.Module) -> torch.Tensor:
    """A piecewise-rigid flow: masks (B, S+1, h, w) softmax over S slots and a still background (last), where
    each cell is at t+1; feats (B, c, h, w). Each slot's motion (angle, translation in cells) comes from its
    mask-pooled features; it turns about the slot's centroid. A cell's source is the mask-weighted mix of
    where each slot's motion says it came from -> flow (B, 2, h, w) = cell - source (see flow_warp)."""
    B, S1, H, W = masks.shape
    m = masks[:, :-1]                                                          # (B, S, h, w)
    area = m.sum((2, 3)).clamp_min(1e-3)                                      # (B, S)
    pooled = torch.einsum("bshw,bchw->bsc", m, feats) / area[..., None]      # (B, S, c)
    p = motion(pooled.to(next(motion.parameters()).dtype)).float()           # (B, S, 3)
    ang, t = p[..., 0], p[..., 1:]
    gy, gx = torch.meshgrid(torch.arange(H, device=m.device, dtype=torch.float32) + 0.5,
                            torch.arange(W, device=m.device, dtype=torch.float32) + 0.5, indexing="ij")
    q = torch.stack([gx, gy])                                                  # (2, h, w) cell centres
    c = torch.einsum("bshw,ihw->bsi", m, q) / area[..., None]               # (B, S, 2) centroids
    d = q[None, None] - (c + t)[..., None, None]                             # (B, S, 2, h, w) about the moved centroid
    cos, sin = ang.cos()[..., None, None], ang.sin()[..., None, None]
    src = torch.stack([cos * d[:, :, 0] + sin * d[:, :, 1], -sin * d[:, :, 0] + cos * d[:, :, 1]], 2) + c[..., None, None]
    src = (m[:, :, None] * src).sum(1) + masks[:, -1:] * q[None]              # (B, 2, h, w)
    return q[None] - src


class DynamicsNet(nn.Module):
    """The network: context window + V noisy target variants -> F for each variant. Knows nothing about
    noise schedules."""

    def __init__(self, cfg: DynamicsConfig):
        super().__init__()
        self.cfg = cfg
        # latent + maps of where the action points (see action_maps) and, with an agent track, of where
        # the agent is (its offset and blob maps) -> 8x8 tokens
        self.inp = nn.Conv2d(cfg.latent_ch + n_maps(cfg), cfg.ch, cfg.patch, stride=cfg.patch)
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
        self.hires = HiResHead(cfg) if cfg.hires_ch > 0 else None
        self.flow = FlowHead(cfg) if cfg.transport else None

    def _tokens(self, x, maps):  # (B, T, C, h, w) latents + (B, T, M, h, w) maps -> (B, T, ch, h/2, w/2)
        x = torch.cat([x.to(maps.dtype), maps], dim=2)
        return self.inp(x.flatten(0, 1).to(self.inp.weight.dtype)).unflatten(0, x.shape[:2])

    def context(self, ctx, ctx_c_noise, actions_in, act_valid, pad, agent_in=None) -> dict:
        """Everything about the window that does not depend on the target: ctx (B, K, C, h, w) preconditioned
        context; ctx_c_noise (B, K); actions_in (B, K+1, 2) normalised action leading into each slot (last:
        into the target); act_valid (B, K+1) bool; pad (B, K) bool; agent_in (B, K+1, 2) normalised agent
        position in each slot (last: where the track says it lands; needed with cfg.agent_motion).
        Returns the cache `target` reads, for any number of target variants and sampler steps."""
        B, K = ctx.shape[:2]
        dt = self.inp.weight.dtype
        ctx = ctx.masked_fill(pad[:, :, None, None, None], 0.0)  # padded slots carry no content
        a = self.action_emb(actions_in.to(dt))
        slot_c = self.slot_emb(pad.long())                         # 0 context, 1 padding
        cond_c = self.sigma_emb(ctx_c_noise.reshape(-1)).unflatten(0, (B, K)) + a[:, :K] + slot_c + self.pos_emb[:K]
        cond_c = F.silu(cond_c).to(dt)
        maps = action_maps(actions_in, act_valid, ctx.shape[-1])                   # (B, K+1, M, h, w)
        slot_real = torch.cat([~pad, pad.new_ones(B, 1)], dim=1)  # (B, K+1): padded slots get no track maps
        if self.cfg.agent_motion:  # + the agent's offset and blob maps
            maps = torch.cat([maps, action_maps(agent_in, slot_real, ctx.shape[-1])[:, :, 2:]], dim=2)
        h_c = self._tokens(ctx, maps[:, :K])
        blocks = []
        for blk in self.blocks:
            h_c, cache = blk.context(h_c, cond_c, pad)
            blocks.append(cache)
        out = dict(blocks=blocks, a_t=a[:, K:], maps_t=maps[:, K:], last=ctx[:, -1:])
        if self.flow is not None:  # where the last latent's content goes (Stage2.transport_base applies it)
            prev = ctx[:, -2] if K > 1 else torch.zeros_like(ctx[:, -1])
            out["flow"], out["flow_gate"] = self.flow(ctx[:, -1], prev, maps[:, K], h_c[:, -1], F.silu(a[:, K]).to(dt))
        return out

    def target(self, cache: dict, tgt, tgt_c_noise):
        """tgt (B, V, C, h, w) preconditioned noisy target variants with tgt_c_noise (B, V), after the window of
        `cache` (see `context`) -> F (B, V, C, h, w)."""
        B, V = tgt.shape[:2]
        K = self.cfg.context
        dt = self.inp.weight.dtype
        cond_t = self.sigma_emb(tgt_c_noise.reshape(-1)).unflatten(0, (B, V)) + cache["a_t"] \
            + self.slot_emb.weight[2] + self.pos_emb[K]
        cond_t = F.silu(cond_t).to(dt)
        maps_t = cache["maps_t"].expand(B, V, *cache["maps_t"].shape[2:])
        h_t = self._tokens(tgt, maps_t)
        for blk, c in zip(self.blocks, cache["blocks"]):
            h_t = blk.target(h_t, cond_t, c)
        h = h_t.flatten(0, 1)  # (B*V, ch, h/p, w/p): only the target slot is read out
        u = F.silu(self.up(F.silu(self.norm_out(h))))  # (B*V, ch/2, h, w)
        out = self.out(u)
        if self.hires is not None:  # full-resolution skip: last context latent, noisy target, action maps
            last = cache["last"].expand(B, V, *cache["last"].shape[2:])
            x = torch.cat([last.to(dt), tgt.to(dt), maps_t.to(dt)], dim=2)
            out = out + self.hires(torch.cat([x.flatten(0, 1), u.to(dt)], dim=1), cond_t.flatten(0, 1))
        return out.float().unflatten(0, (B, V))

    def forward(self, ctx, ctx_c_noise, actions_in, act_valid, pad, tgt, tgt_c_noise, agent_in=None):
        """The context and V noisy target variants in one call (see `context` and `target`) -> F (B, V, C, h, w)."""
        return self.target(self.context(ctx, ctx_c_noise, actions_in, act_valid, pad, agent_in), tgt, tgt_c_noise)


class Stage2(nn.Module):
    """Consistency parameterisation + loss around DynamicsNet. Latents in, latents out (unnormalised).

    total_steps / curriculum_offset: the training run's length and the steps trained before it (a
    fine-tune carries the discretisation curriculum on from where its release ended)."""

    def __init__(self, cfg: DynamicsConfig, total_steps: int = 20000, curriculum_offset: int = 0):
        super().__init__()
        self.cfg = cfg
        self.net = DynamicsNet(cfg)
        self.total_steps, self.curriculum_offset = total_steps, curriculum_offset

    def norm(self, z):
        return (z - self.cfg.z_mean) / self.cfg.z_std * self.cfg.sigma_data

    def unnorm(self, y):
        return y / self.cfg.sigma_data * self.cfg.z_std + self.cfg.z_mean

    def norm_delta(self, dz):
        return dz / self.cfg.dz_std * self.cfg.sigma_data

    def unnorm_delta(self, y):
        return y / self.cfg.sigma_data * self.cfg.dz_std

    def _check_agent(self, agent, actions):
        if not self.cfg.agent_motion:
            return None
        if agent is None or agent.shape != actions.shape:
            raise ValueError(f"this dynamics model tracks the agent: pass agent (B, K, 2), its position in each context "
                             f"frame (canvas px), beside actions {tuple(actions.shape)}; got "
                             f"{None if agent is None else tuple(agent.shape)}")
        return agent.float()

    def context(self, ctx, ctx_sigma, actions, n_valid, agent=None) -> dict:
        """The window's part of the network, computed once for any number of target variants or sampler steps:
        ctx (B, K, C, h, w) normalised context, already noised at ctx_sigma (B,) or per frame (B, K); actions (B, K, 2) raw actions
        (actions[:, i] taken at context frame i); n_valid (B,) how many of the K context slots are real (the
        earlier ones are padding); agent (B, K, 2) the agent's position in each context frame (canvas px), for
        a model with an agent track (cfg.agent_motion): the target slot then gets where agent_landing puts it."""
        c = self.cfg
        B, K = ctx.shape[:2]
        agent = self._check_agent(agent, actions)
        agent_in = None
        if agent is not None:
            agent_in = torch.cat([agent, self.landing(agent, actions, n_valid)[:, None]], dim=1) / c.action_scale * 2 - 1
        ctx_sigma = ctx_sigma.float()
        if ctx_sigma.ndim == 1:
            ctx_sigma = ctx_sigma[:, None].expand(B, K)
        ctx_in = ctx * schedule.c_in(ctx_sigma, c.sigma_data)[:, :, None, None, None]
        # the action leading into slot i is the action taken at slot i-1; nothing led into slot 0
        a = actions.float() / c.action_scale * 2 - 1
        actions_in = torch.cat([torch.zeros_like(a[:, :1]), a], dim=1)  # (B, K+1, 2)
        idx = torch.arange(K + 1, device=ctx.device)[None]
        act_valid = idx > (K - n_valid)[:, None]                         # (B, K+1): an action led into the slot
        actions_in = actions_in.masked_fill(~act_valid[..., None], 0.0)
        pad = idx[:, :K] < (K - n_valid)[:, None]
        ctx_noise = schedule.c_noise(ctx_sigma.clamp_min(c.sigma_min))
        return self.net.context(ctx_in, ctx_noise, actions_in, act_valid, pad, agent_in)

    def denoise(self, x_t, sigma, ctx=None, ctx_sigma=None, actions=None, n_valid=None, agent=None, cache=None):
        """Consistency function on normalised latents, for V target variants sharing one context.

        x_t (B, V, C, h, w) noisy targets at sigma (B, V); the window either as (ctx, ctx_sigma, actions,
        n_valid, agent) (see `context`) or as the `cache` that `context` returned for it.
        Returns x0_hat (B, V, C, h, w)."""
        c = self.cfg
        if cache is None:
            cache = self.context(ctx, ctx_sigma, actions, n_valid, agent)
        s = sigma.float()[..., None, None, None]
        c_skip = schedule.c_skip(s, c.sigma_data, c.sigma_min)
        c_out = schedule.c_out(s, c.sigma_data, c.sigma_min)
        F_x = self.net.target(cache, schedule.c_in(s, c.sigma_data) * x_t, schedule.c_noise(sigma.float()))
        return c_skip * x_t.float() + c_out * F_x

    def forward(self, batch, step: int):
        return self.loss(batch, step)

    def landing(self, agent, actions, n_valid):
        """Where the agent track puts the agent in the next frame (B, 2) canvas px, from its positions
        agent (B, K, 2) and the actions (B, K, 2) of the window; needs cfg.agent_motion."""
        if not self.cfg.agent_motion:
            raise ValueError("this dynamics model has no agent track (cfg.agent_motion is empty)")
        return agent_landing(agent, actions, n_valid, self.cfg.agent_motion)

    def loss(self, batch, step: int):
        if self.cfg.objective == "denoise":
            return self.denoise_loss(batch)
        if self.cfg.objective != "consistency":
            raise ValueError(f"DynamicsConfig.objective must be 'consistency' or 'denoise', got {self.cfg.objective!r}")
        return self.consistency_loss(batch, step)

    def _window(self, batch):
        """The raw target and last context latent, and the normalised context noised at random levels (see ctx_noise)."""
        c = self.cfg
        ctx, actions, target, n_valid, agent = batch
        last = ctx[:, -1].float()
        ctx = self.norm(ctx)
        B, K = ctx.shape[:2]
        if c.ctx_noise == "uniform":
            ctx_sigma = torch.rand(B, device=ctx.device).mul(c.ctx_sigma_max)[:, None].expand(B, K)
        elif c.ctx_noise == "per_frame":
            small = torch.rand(B, K, device=ctx.device) * c.ctx_sigma_max
            lo, hi = math.log(c.sigma_min), math.log(c.sigma_max)
            wide = torch.exp(lo + (hi - lo) * torch.rand(B, K, device=ctx.device))
            ctx_sigma = torch.where(torch.rand(B, K, device=ctx.device) < 0.5, small, wide)
            ctx_sigma[:, -1] = small[:, -1]
        else:
            raise ValueError(f"DynamicsConfig.ctx_noise must be 'uniform' or 'per_frame', got {c.ctx_noise!r}")
        ctx = ctx + ctx_sigma[:, :, None, None, None] * torch.randn_like(ctx)
        return target.float(), last, ctx, ctx_sigma, actions, n_valid, agent

    def transport_base(self, cache: dict, last: torch.Tensor) -> torch.Tensor:
        """What the change is added to: the last raw latent (B, C, h, w), moved by the predicted flow with
        cfg.transport (the refinement head then sees the moved latent in place of the last one)."""
        if not self.cfg.transport:
            return last.float()
        base = flow_warp(last, cache["flow"])
        c_in0 = schedule.c_in(torch.zeros((), device=base.device), self.cfg.sigma_data)
        cache["last"] = (self.norm(base) * c_in0).detach()[:, None]
        return base

    def _change(self, cache, target, last):
        """The normalised change to denoise, and with transport the flow's own loss (the moved latent against
        the target, in the change's units) and its logs."""
        base = self.transport_base(cache, last)
        if not self.cfg.transport:
            return self.norm_delta(target - base), 0.0, {}
        flow_mse = self.norm_delta(base - target).pow(2).mean()
        flow_reg = 1e-4 * cache["flow"].pow(2).mean()  # flat regions leave the flow free: keep it at rest there
        logs = {"flow_mse": flow_mse.item(), "flow_cells": cache["flow"].norm(dim=1).mean().item()}
        if self.cfg.flow_gate_weight > 0:  # the gate's sparsity prior: open only where something moves
            gate = cache["flow_gate"].mean()
            flow_reg = flow_reg + self.cfg.flow_gate_weight * gate
            logs["flow_gate"] = gate.item()
        return self.norm_delta(target - base.detach()), self.cfg.flow_weight * flow_mse + flow_reg, logs

    def denoise_loss(self, batch):
        """EDM's denoising objective (Karras et al. 2022): levels log-normal, each weighted so that the network's
        effective target has unit variance. Its optimum at every level is the posterior mean of the clean change
        given the noisy one, so integrating the probability-flow ODE from noise draws a sample."""
        c = self.cfg
        target, last, *window = self._window(batch)
        cache = self.context(*window)
        x, aux, logs = self._change(cache, target, last)
        sigma = (torch.randn(x.shape[0], device=x.device) * c.p_std + c.p_mean).exp()
        x_t = x + sigma[:, None, None, None] * torch.randn_like(x)
        out = self.denoise(x_t[:, None], sigma[:, None], cache=cache)[:, 0]
        w = (sigma**2 + c.sigma_data**2) / (sigma * c.sigma_data) ** 2
        mse = (out - x).pow(2).flatten(1).mean(1)
        loss = (w * mse).mean() / w.mean().detach() + aux
        return loss, {"loss": loss.item(), "dsm_mse": mse.mean().item(), **logs}

    def consistency_loss(self, batch, step: int):
        """batch: (ctx (B, K, C, h, w) raw latents, actions (B, K, 2), target (B, C, h, w), n_valid (B,),
        agent (B, K, 2) or None; see denoise).

        The three targets of the objective - x at sigma_{i+1} (online), at sigma_i (stop-gradient
        target) and at sigma_max (the one-step jump) - run as three variants over one context pass."""
        c = self.cfg
        target, last, *window = self._window(batch)
        cache = self.context(*window)
        x, aux, logs = self._change(cache, target, last)
        B = x.shape[0]
        # iCT's discretisation curriculum over the run
        n = schedule.ict_num_scales(step + self.curriculum_offset, self.total_steps)
        sigmas = schedule.karras_sigmas(n, c.sigma_min, c.sigma_max).to(x.device)
        idx = torch.multinomial(schedule.lognormal_index_probs(sigmas), B, replacement=True).to(x.device)
        s_lo, s_hi = sigmas[idx], sigmas[idx + 1]
        s_max = torch.full_like(s_hi, c.sigma_max)
        eps = torch.randn_like(x)
        x_t = torch.stack([x + s_hi[:, None, None, None] * eps, x + s_lo[:, None, None, None] * eps,
                           torch.randn_like(x) * c.sigma_max], dim=1)  # (B, 3, C, h, w)
        out = self.denoise(x_t, torch.stack([s_hi, s_lo, s_max], dim=1), cache=cache)
        x_hi, x_lo, x_one = out[:, 0], out[:, 1].detach(), out[:, 2]
        w = 1.0 / (s_hi - s_lo)
        huber_c = 0.00054 * (x[0].numel() ** 0.5)
        ct = (w * schedule.pseudo_huber(x_hi, x_lo, huber_c)).mean() / w.mean()
        dsm = (x_hi - x).pow(2).mean()
        one = (x_one - x).pow(2).mean()  # the one-step jump by MSE: its optimum is the conditional mean
        loss = 0.1 * ct + dsm + one + aux
        return loss, {"loss": loss.item(), "ct": ct.item(), "dsm_mse": dsm.item(), "one_step_mse": one.item(),
                      "num_scales": n, **logs}

    @torch.no_grad()
    def predict(self, ctx, actions, n_valid, agent=None, steps: int | None = None, generator=None, ctx_noise=None,
                sampler: str | None = None, ctx_sigma: float | None = None):
        """Next latent (B, C, h, w) from raw context latents (B, K, C, h, w), actions (B, K, 2) and, with an
        agent track, agent (B, K, 2) (see denoise).

        ctx_noise: optional (B, K, C, h, w) standard normal draws for the context noise (for determinism);
        ctx_sigma: its level (default: the config's). sampler: "consistency" (the default: `steps`
        consistency jumps) or "euler" (`steps` Euler steps of the probability-flow ODE over Karras levels
        from sigma_max; see sampler.py). None: the sampler of the model's objective, with cfg.sample_steps."""
        c = self.cfg
        sampler = sampler or ("euler" if c.objective == "denoise" else "consistency")
        steps = steps or c.sample_steps
        B = ctx.shape[0]
        level = c.ctx_sigma if ctx_sigma is None else ctx_sigma
        last = ctx[:, -1].float()
        ctx = self.norm(ctx)
        ctx_sigma_t = torch.full((B,), level, device=ctx.device)
        if ctx_noise is None:
            ctx_noise = torch.randn(ctx.shape, generator=generator, device=generator.device if generator else ctx.device).to(ctx.device)
        ctx = ctx + level * ctx_noise
        cache = self.context(ctx, ctx_sigma_t, actions, n_valid, agent)  # once, for every sampler step
        base = self.transport_base(cache, last)
        D = lambda x_t, s: self.denoise(x_t[:, None], s[:, None], cache=cache)[:, 0]  # noqa: E731
        shape = (B, c.latent_ch, c.latent_size, c.latent_size)
        if sampler == "consistency":
            sig = schedule.sampling_sigmas(steps, c.sigma_max, c.sigma_mid, c.sigma_min)
            y = consistency_sample(D, shape, sig, c.sigma_min, generator=generator, device=ctx.device)
        elif sampler == "euler":
            sig = schedule.karras_sigmas(steps, c.sigma_min, c.sigma_max).flip(0) if steps > 1 else torch.tensor([c.sigma_max])
            y = euler_sample(D, shape, sig, generator=generator, device=ctx.device)
        else:
            raise ValueError(f"sampler must be 'consistency' or 'euler', got {sampler!r}")
        return base + self.unnorm_delta(y)
