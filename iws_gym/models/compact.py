"""The compact world model (issue 36's second design): a frame is a handful of numbers z, and the dynamics
only moves them; drawing is left to a decoder that only ever learned to draw whole scenes.

    wm = WorldModel.from_pretrained("checkpoints/candidates/compact")   # dispatches here for a compact release
    state = wm.start_frames(frames, agent_pos)                          # (B, 128, 128, 3) uint8, (B, 2) canvas px
    frames = wm.step(state, actions)                                    # (B, 2) -> (B, 128, 128, 3) uint8

Stage 1: a CNN encoder (4x4 space-to-depth stem, residual blocks at 32, 16, 8 and 4 px, a linear head, tanh)
maps a frame to z (`z_dim` numbers); a broadcast decoder renders (z, the agent's position): a 32x32 grid of
coordinate features and the agent's offset, FiLM-modulated by z in residual 3x3 blocks, then two pixel-shuffle
upsamplings. The agent's position is the robot's own proprioception, as the agent track of the spatial design.

Stage 2: an MLP over the K context latents, the agent's position and the action at each slot and the motion
law's next agent position predicts the change of z; a learned gate, relu(g), multiplies it, so where nothing
acts z does not move at all (a world at rest stays exact). Optionally a latent denoiser (EDM preconditioning)
pulls each moved latent back towards the encodable scenes: one call at a small sigma, or the probability-flow
ODE from a larger one (`denoiser_steps`). Nothing in either stage names an
object: a task is its data, its z_dim and its agent's motion law.

The measurements that chose this design, and what limits it, are in docs/experiments.md ("a compact latent the
dynamics only has to move" and the sections after it).
"""
from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from iws_gym.models import trust
from iws_gym.models.checkpoint import load_release, load_state_checked, release_kind
from iws_gym.models.dynamics import agent_landing as _landing
from iws_gym.models.hardware import autocast, default_dtype, resolve_device
from iws_gym.models.sampler import euler_from
from iws_gym.models.schedule import geometric_sigmas

STAGE1_KIND, STAGE2_KIND = "compact_stage1", "compact_stage2"
CANVAS = 512.0  # positions and actions are canvas px; the networks see them divided by this


@dataclasses.dataclass(frozen=True)
class CompactStage1Config:
    frame_size: int = 128
    z_dim: int = 24
    enc_widths: tuple = (64, 96, 128, 128)  # at 32, 16, 8, 4 px (after the 4x4 space-to-depth stem)
    enc_hidden: int = 256
    dec_width: int = 96
    dec_blocks: int = 5
    dec_grid: int = 32                      # the decoder's grid; two 2x upsamplings to the frame


@dataclasses.dataclass(frozen=True)
class CompactStage2Config:
    z_dim: int = 24
    context: int = 4                        # K latents in the window
    width: int = 512
    blocks: int = 6
    gate: bool = True                       # relu(g) on the change: exactly zero where nothing acts
    agent_motion: tuple = ()                # the agent's motion law (dynamics.agent_landing), fitted on the data
    denoiser_blocks: int = 4                # 0: no latent denoiser
    denoiser_sigma: float = 0.05            # the noise level it starts from, in z's standard deviations
    denoiser_steps: int = 1                 # 1: one call at denoiser_sigma (the mean of the scenes near the
                                            # prediction); n > 1: the probability-flow ODE down to
                                            # denoiser_sigma_min in n calls (one scene near it; Denoiser.project)
    denoiser_sigma_min: float = 0.01

    def __post_init__(self):
        if isinstance(self.denoiser_steps, bool) or not isinstance(self.denoiser_steps, int) or self.denoiser_steps < 1:
            raise ValueError(f"denoiser_steps must be an int >= 1, got {self.denoiser_steps!r}")
        if self.denoiser_steps > 1 and not 0 < self.denoiser_sigma_min <= self.denoiser_sigma:
            raise ValueError(f"denoiser_sigma_min must be in (0, denoiser_sigma], got {self.denoiser_sigma_min!r} "
                             f"with denoiser_sigma {self.denoiser_sigma!r}")


def _gn(c):
    return nn.GroupNorm(8, c)


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n1, self.c1, self.n2, self.c2 = _gn(c), nn.Conv2d(c, c, 3, padding=1), _gn(c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.c2(F.silu(self.n2(self.c1(F.silu(self.n1(x))))))


class Encoder(nn.Module):
    """(B, 3, H, W) in [-1, 1] -> z (B, z_dim) in (-1, 1)."""

    def __init__(self, cfg: CompactStage1Config):
        super().__init__()
        w = cfg.enc_widths
        layers = [nn.Conv2d(48, w[0], 3, padding=1), ResBlock(w[0])]
        for a, b in zip(w, w[1:]):
            layers += [nn.Conv2d(a, b, 3, 2, 1), ResBlock(b)]
        side = cfg.frame_size // 4 // 2 ** (len(w) - 1)
        layers += [_gn(w[-1]), nn.SiLU(), nn.Flatten(), nn.Linear(w[-1] * side * side, cfg.enc_hidden), nn.SiLU(),
                   nn.Linear(cfg.enc_hidden, cfg.z_dim)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return torch.tanh(self.net(F.pixel_unshuffle(x, 4)))


class FiLMBlock(nn.Module):
    def __init__(self, c, cond):
        super().__init__()
        self.n, self.c, self.f = _gn(c), nn.Conv2d(c, c, 3, padding=1), nn.Linear(cond, 2 * c)

    def forward(self, x, e):
        g, b = self.f(e)[:, :, None, None].chunk(2, 1)
        return x + self.c(F.silu(self.n(x) * (1 + g) + b))


def coord_maps(B: int, n: int, agent: torch.Tensor) -> torch.Tensor:
    """(B, 21, n, n): the grid's x, y and Fourier features, and the agent's offset and blob (agent (B, 2) in [0, 1])."""
    t = (torch.arange(n, device=agent.device) + 0.5) / n
    y, x = torch.meshgrid(t, t, indexing="ij")
    base = [x, y] + [f(math.pi * k * v) for k in (1, 2, 4, 8) for v in (x, y) for f in (torch.sin, torch.cos)]
    base = torch.stack(base)[None].expand(B, -1, -1, -1)
    dx, dy = x[None] - agent[:, 0, None, None], y[None] - agent[:, 1, None, None]
    blob = torch.exp(-(dx ** 2 + dy ** 2) / (2 * 0.03 ** 2))
    return torch.cat([base, torch.stack([dx * 4, dy * 4, blob], 1)], 1)


class Decoder(nn.Module):
    """(z (B, z_dim), agent (B, 2) in [0, 1]) -> (B, 3, H, W) in about [-1, 1]."""

    def __init__(self, cfg: CompactStage1Config):
        super().__init__()
        c = cfg.dec_width
        self.grid = cfg.dec_grid
        self.emb = nn.Sequential(nn.Linear(cfg.z_dim + 2, 256), nn.SiLU(), nn.Linear(256, 256), nn.SiLU())
        self.inp = nn.Conv2d(21, c, 1)
        self.zin = nn.Linear(256, c)
        self.blocks = nn.ModuleList([FiLMBlock(c, 256) for _ in range(cfg.dec_blocks)])
        self.up1 = nn.Conv2d(c, 4 * 48, 3, padding=1)
        self.r1 = ResBlock(48)
        self.up2 = nn.Conv2d(48, 4 * 24, 3, padding=1)
        self.n2, self.out = _gn(24), nn.Conv2d(24, 3, 3, padding=1)

    def forward(self, z, agent):
        e = self.emb(torch.cat([z, agent], 1))
        h = self.inp(coord_maps(len(z), self.grid, agent).to(z.dtype)) + self.zin(e)[:, :, None, None]
        for b in self.blocks:
            h = b(h, e)
        h = self.r1(F.pixel_shuffle(self.up1(F.silu(h)), 2))
        h = F.pixel_shuffle(self.up2(F.silu(h)), 2)
        return self.out(F.silu(self.n2(h)))


class CompactStage1(nn.Module):
    def __init__(self, cfg: CompactStage1Config):
        super().__init__()
        if cfg.frame_size % (4 * 2 ** (len(cfg.enc_widths) - 1)) or cfg.frame_size != 4 * cfg.dec_grid:
            raise ValueError(f"frame_size {cfg.frame_size} must be 4 * dec_grid ({cfg.dec_grid}) and divisible by "
                             f"4 * 2^{len(cfg.enc_widths) - 1}")
        self.cfg = cfg
        self.encoder, self.decoder = Encoder(cfg), Decoder(cfg)


def agent_landing(p: torch.Tensor, a: torch.Tensor, n_valid: torch.Tensor, law) -> torch.Tensor:
    """dynamics.agent_landing on positions in [0, 1] (the law is linear: the same in any units)."""
    return _landing(p, a, n_valid, law)


def pad_first(x: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """Slots before the first valid one (the last n_valid of K are valid) repeat it, as in training."""
    K = x.shape[1]
    slot = torch.arange(K, device=x.device)[None].expand(len(x), K)
    src = torch.maximum(slot, (K - n_valid).clamp(min=0)[:, None])
    return torch.gather(x, 1, src[..., None].expand_as(x))


def _mlp_blocks(width, n):
    return nn.ModuleList([nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
                          for _ in range(n)])


class _ReopenableRelu(torch.autograd.Function):
    """relu(g), whose backward also passes a gradient that would open a closed gate (g <= 0 and the loss falls
    as g rises): a plain relu passes none there, so a gate closed everywhere early in training stays dead."""

    @staticmethod
    def forward(ctx, g):
        ctx.save_for_backward(g)
        return g.clamp(min=0)

    @staticmethod
    def backward(ctx, grad):
        (g,) = ctx.saved_tensors
        return torch.where(g > 0, grad, grad.clamp(max=0))


class Dynamics(nn.Module):
    """z_{t+1} = z_t + relu(g) * dz from the window: z (B, K, D) (padded slots repeat the first valid one),
    p (B, K, 2) the agent's position and a (B, K, 2) the action at each slot (in [0, 1]), n_valid (B,)."""

    def __init__(self, cfg: CompactStage2Config):
        super().__init__()
        D, K, W = cfg.z_dim, cfg.context, cfg.width
        self.cfg = cfg
        self.inp = nn.Linear(K * (D + 4 + 1) + 2, W)
        self.blocks = _mlp_blocks(W, cfg.blocks)
        self.out = nn.Sequential(nn.LayerNorm(W), nn.Linear(W, D))
        nn.init.zeros_(self.out[1].weight)
        nn.init.zeros_(self.out[1].bias)
        if cfg.gate:
            self.g = nn.Sequential(nn.LayerNorm(W), nn.Linear(W, 1))
            nn.init.zeros_(self.g[1].weight)
            nn.init.constant_(self.g[1].bias, 1.0)
        for name in ("z_mu", "z_sd", "dz_sd"):  # the training latents' statistics (set before training)
            self.register_buffer(name, torch.zeros(D) if name == "z_mu" else torch.ones(D))

    def forward(self, z, p, a, n_valid):
        """-> (z_{t+1} (B, D), the gate (B,): 0 where the world is held at rest; 1 without a gate)."""
        K = self.cfg.context
        mask = (torch.arange(K, device=z.device)[None] >= K - n_valid[:, None]).to(z.dtype)
        nxt = agent_landing(p, a, n_valid, self.cfg.agent_motion)
        zn = (z - self.z_mu) / self.z_sd
        x = torch.cat([(zn * mask[..., None]).flatten(1), (p * 4 - 2).flatten(1), (a * 4 - 2).flatten(1), mask,
                       nxt * 4 - 2], 1)
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        dz = self.out(h) * self.dz_sd
        if self.cfg.gate:  # the same relu either way; in training a closed gate can still be pulled open
            g = self.g(h).squeeze(1)
            gate = _ReopenableRelu.apply(g) if self.training and torch.is_grad_enabled() else F.relu(g)
        else:
            gate = torch.ones(len(z), device=z.device)
        return z[:, -1] + dz * gate[:, None], gate


class Denoiser(nn.Module):
    """D(z + sigma * z_sd * eps, p, sigma) ~ z for single latents (EDM preconditioning, sigma in units of z's
    standard deviation), given the agent's position p (B, 2) in [0, 1]."""

    def __init__(self, cfg: CompactStage2Config, width: int = 512):
        super().__init__()
        D = cfg.z_dim
        self.inp = nn.Linear(D + 3, width)
        self.blocks = _mlp_blocks(width, cfg.denoiser_blocks)
        self.out = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, D))
        self.register_buffer("z_mu", torch.zeros(D))
        self.register_buffer("z_sd", torch.ones(D))

    def forward(self, z, p, sigma):
        zn = (z - self.z_mu) / self.z_sd
        c_in, c_skip, c_out = (1 + sigma ** 2) ** -0.5, 1 / (1 + sigma ** 2), sigma * (1 + sigma ** 2) ** -0.5
        h = self.inp(torch.cat([zn * c_in[:, None], p * 4 - 2, sigma.log()[:, None] / 4], 1))
        for b in self.blocks:
            h = h + b(h)
        return (c_skip[:, None] * zn + c_out[:, None] * self.out(h)) * self.z_sd + self.z_mu

    def project(self, z, p, sigmas):
        """A moved latent back to one encodable scene near it: read as a sample at sigmas[0], integrated down
        `sigmas` by the probability-flow ODE (sampler.euler_from; one call for one level). A single call at a
        high sigma returns the mean of the scenes within it, a blend of poses; the ODE follows the density to one."""
        return euler_from(lambda x, s: self(x, p, s), z, sigmas)


class CompactStage2(nn.Module):
    def __init__(self, cfg: CompactStage2Config):
        super().__init__()
        if len(cfg.agent_motion) != 6:
            raise ValueError(f"agent_motion must be the 6 numbers of a fitted motion law, got {cfg.agent_motion!r}")
        self.cfg = cfg
        self.dynamics = Dynamics(cfg)
        self.denoiser = Denoiser(cfg) if cfg.denoiser_blocks else None
        # the levels Denoiser.project runs down each step (fixed by the config: computed once, not per step)
        self.denoiser_sigmas = [] if cfg.denoiser_sigma <= 0 else [float(cfg.denoiser_sigma)] if cfg.denoiser_steps == 1 \
            else [float(s) for s in geometric_sigmas(cfg.denoiser_steps, cfg.denoiser_sigma, cfg.denoiser_sigma_min)]

    def predict(self, z, p, a, n_valid):
        """The next latent, the gate (see Dynamics) and how far the denoiser moved it (B,), in z's standard
        deviations squared (0 without a denoiser, and at rest: the denoiser only touches latents that moved)."""
        z1, gate = self.dynamics(z, p, a, n_valid)
        moved = torch.zeros(len(z1), device=z1.device)
        if self.denoiser is not None and self.cfg.denoiser_sigma > 0:
            p1 = agent_landing(p, a, n_valid, self.cfg.agent_motion).clamp(0, 1)
            zd = self.denoiser.project(z1, p1, self.denoiser_sigmas)
            open_ = (gate > 0)[:, None]
            moved = torch.where(open_, (zd - z1) / self.denoiser.z_sd, 0.0).pow(2).mean(1)
            z1 = torch.where(open_, zd, z1)
        return z1, gate, moved


class CompactWorldModel:
    """WorldModel's interface (models/world_model.py) for the compact design: the envs, `iws eval` and the
    bench use it unchanged. State: ctx (B, K, D), agent_hist and acts (B, K, 2) in [0, 1], n_valid, t,
    agent (B, 2) canvas px, and the trust signal's fields."""

    tracks_agent = True

    def __init__(self, stage1: CompactStage1, device, path=None, meta=None, dtype=None, stage2=None, settings=None):
        from iws_gym.models.world_model import RolloutSettings

        self.device = device
        self.dtype = dtype or default_dtype(device)
        self.path, self.meta = path, meta or {}
        self.stage1 = stage1.to(device).eval().requires_grad_(False)
        self.stage2 = stage2.to(device).eval().requires_grad_(False) if stage2 is not None else None
        self.frame_size = stage1.cfg.frame_size
        self.settings = settings or RolloutSettings(reencode=False)
        self._check_settings(self.settings)
        self.trust_calibration = trust.TrustCalibration.load(path)

    @staticmethod
    def _check_settings(st):
        if st.decoder_steps != 1 or st.dynamics_steps not in (None, 1) or st.dynamics_sampler or st.ctx_sigma:
            raise ValueError("the compact world model is deterministic: decoder_steps, dynamics_steps, "
                             f"dynamics_sampler and ctx_sigma do not apply to it (got {st})")

    @classmethod
    def from_pretrained(cls, path, device="auto", stages=("stage1",), dtype=None, settings=None):
        from iws_gym.models.world_model import STAGE_FILES, release_settings

        path = Path(path)
        f1 = path / STAGE_FILES["stage1"]
        cfg1, sd1, meta1 = load_release(f1, STAGE1_KIND, CompactStage1Config)
        s1 = CompactStage1(cfg1)
        load_state_checked(s1, sd1, f1)
        metas, s2 = {"stage1": meta1}, None
        if "stage2" in stages:
            f2 = path / STAGE_FILES["stage2"]
            cfg2, sd2, metas["stage2"] = load_release(f2, STAGE2_KIND, CompactStage2Config)
            s2 = CompactStage2(cfg2)
            load_state_checked(s2, sd2, f2)
        if settings is None:  # the release's own rollout defaults (this design: no re-encoding)
            settings = release_settings(path)
        return cls(s1, resolve_device(device), path, metas, dtype=dtype, stage2=s2, settings=settings)

    def with_settings(self, **changes) -> "CompactWorldModel":
        wm = copy.copy(self)
        wm.settings = dataclasses.replace(self.settings, **changes)
        self._check_settings(wm.settings)
        return wm

    def compile(self) -> "CompactWorldModel":
        return self  # a step is a few small matmuls and one decoder pass: nothing to gain

    # ---- stage 1
    def _check_frames(self, frames):
        s = self.frame_size
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[1:] != (s, s, 3):
            raise ValueError(f"expected frames of shape (B, {s}, {s}, 3) dtype uint8 RGB, got shape "
                             f"{getattr(frames, 'shape', None)} dtype {getattr(frames, 'dtype', type(frames).__name__)}")

    def _agent(self, agent_pos, B) -> torch.Tensor:
        if isinstance(agent_pos, torch.Tensor):
            agent_pos = agent_pos.detach().cpu().numpy()
        q = torch.as_tensor(np.asarray(agent_pos, np.float32), device=self.device).reshape(-1, 2)
        if len(q) != B or not torch.isfinite(q).all():
            raise ValueError(f"agent_pos must be {B} finite (x, y) canvas positions, got {q.tolist()}")
        return q / CANVAS

    @torch.inference_mode()
    def encode(self, frames: np.ndarray) -> torch.Tensor:
        from iws_gym.models.frames import frames_to_tensor

        self._check_frames(frames)
        with autocast(self.device, self.dtype == torch.bfloat16):
            return self.stage1.encoder(frames_to_tensor(frames, self.device)).float()

    @torch.inference_mode()
    def _render(self, z: torch.Tensor, p: torch.Tensor) -> np.ndarray:
        """Frames of latents z (B, D) with the agent at p (B, 2) in [0, 1]."""
        from iws_gym.models.frames import tensor_to_frames

        with autocast(self.device, self.dtype == torch.bfloat16):
            return tensor_to_frames(self.stage1.decoder(z.float(), p.float()))

    def decode(self, z: torch.Tensor, agent_pos=None, **_) -> np.ndarray:
        """The frames of latents z (B, D) with the agent at agent_pos (B, 2) canvas px: the compact decoder draws it
        where the robot's proprioception says it is."""
        if agent_pos is None:
            raise ValueError("the compact decoder draws the agent where the robot says it is: pass agent_pos (B, 2)")
        return self._render(z, self._agent(agent_pos, len(z)))

    def decode_last(self, state: dict, generator=None) -> np.ndarray:
        """The frames of the newest latent in a rollout state, the agent where its track is."""
        return self._render(state["ctx"][:, -1], state["agent_hist"][:, -1])

    def reconstruct(self, frames: np.ndarray, agent_pos=None, batch: int = 64, **_) -> np.ndarray:
        """decode(encode(frames)) with the agent at agent_pos (N, 2) canvas px."""
        if agent_pos is None:
            raise ValueError("reconstruct needs the agent's positions agent_pos (N, 2) canvas px for the compact decoder")
        p = self._agent(agent_pos, len(frames))
        return np.concatenate([self._render(self.encode(frames[i : i + batch]), p[i : i + batch])
                               for i in range(0, len(frames), batch)])

    # ---- the rolling context, batched
    def start(self, z0: torch.Tensor, agent_pos=None) -> dict:
        if self.stage2 is None:
            raise ValueError(f"{self.path}: no stage2.safetensors, cannot roll out dynamics")
        if agent_pos is None:
            raise ValueError(f"{self.path}: this model tracks the agent; start() needs agent_pos (B, 2)")
        K, B = self.stage2.cfg.context, len(z0)
        p = self._agent(agent_pos, B)
        ones = torch.ones(B, device=self.device)
        return dict(ctx=z0.float()[:, None].repeat(1, K, 1), agent_hist=p[:, None].repeat(1, K, 1),
                    acts=torch.zeros(B, K, 2, device=self.device), n_valid=torch.ones(B, dtype=torch.long, device=self.device),
                    t=torch.zeros(B, dtype=torch.long, device=self.device), agent=p * CANVAS,
                    gate=ones.clone(), denoised=torch.zeros(B, device=self.device), trust_m=torch.zeros(B, device=self.device),
                    trust=ones.clone(), trust_min=ones.clone())

    def start_frames(self, frames: np.ndarray, agent_pos=None) -> dict:
        return self.start(self.encode(frames), agent_pos)

    @torch.inference_mode()
    def advance(self, state: dict, actions: torch.Tensor, generator=None) -> torch.Tensor:
        """Predict z_{t+1} for every env and slide the window; the agent moves by its motion law."""
        K, cfg = self.stage2.cfg.context, self.stage2.cfg
        a = torch.as_tensor(actions, dtype=torch.float32, device=self.device).reshape(-1, 2) / CANVAS
        nv = state["n_valid"]
        acts = pad_first(torch.cat([state["acts"][:, 1:], a[:, None]], 1), nv)
        z1, gate, state["denoised"] = self.stage2.predict(state["ctx"], state["agent_hist"], acts, nv)
        p1 = agent_landing(state["agent_hist"], acts, nv, cfg.agent_motion).clamp(0, 1)
        nv1 = (nv + 1).clamp(max=K)
        state["acts"] = acts
        state["ctx"] = pad_first(torch.cat([state["ctx"][:, 1:], z1[:, None]], 1), nv1)
        state["agent_hist"] = pad_first(torch.cat([state["agent_hist"][:, 1:], p1[:, None]], 1), nv1)
        state["n_valid"], state["t"], state["agent"], state["gate"] = nv1, state["t"] + 1, p1 * CANVAS, gate
        return z1

    @torch.inference_mode()
    def step(self, state: dict, actions: torch.Tensor, generator=None) -> np.ndarray:
        """One env step: predict, decode with the agent where its track is. With `settings.reencode`, every
        `reencode_every`-th step puts the frame's encoding back into the window where the gate is open (a world
        held at rest keeps its latent: the round trip would move it).

        `settings.trust`: with a denoiser, the signal is how far it had to move the prediction back towards the
        encodable scenes (free: it runs anyway); without one, the decode-encode cycle error (an extra encode)."""
        z = self.advance(state, actions)
        frames = self._render(z, state["agent_hist"][:, -1])
        st = self.settings
        due = (state["t"] % st.reencode_every == 0) & (state["gate"] > 0) if st.reencode else None
        free = self.stage2.denoiser is not None
        if st.trust and free:
            trust.update(state, state["denoised"], self.trust_calibration)
        if (st.trust and not free) or (due is not None and bool(due.any())):
            z_obs = self.encode(frames)
            if st.trust and not free:
                trust.update(state, trust.cycle_error(z, z_obs, self.stage2.dynamics.z_sd), self.trust_calibration)
            if due is not None and bool(due.any()):
                state["ctx"][:, -1] = torch.where(due[:, None], z_obs, state["ctx"][:, -1])
        return frames

    def rollout(self, first_frame: np.ndarray, actions: np.ndarray, seed: int = 0, agent_pos=None) -> np.ndarray:
        """Open loop from one real frame (H, W, 3) and its agent position (2,): (T, 2) actions -> (T+1, H, W, 3)."""
        if agent_pos is None:
            raise ValueError("rollout needs the agent's position in the first frame, agent_pos (2,)")
        state = self.start_frames(first_frame[None], np.reshape(agent_pos, (1, 2)))
        frames = [first_frame]
        for a in np.asarray(actions, dtype=np.float32):
            frames.append(self.step(state, torch.from_numpy(a)[None])[0])
        return np.stack(frames)


def is_compact_release(path) -> bool:
    from iws_gym.models.world_model import STAGE_FILES

    f = Path(path) / STAGE_FILES["stage1"]
    return f.is_file() and release_kind(f) == STAGE1_KIND
