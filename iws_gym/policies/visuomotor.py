"""A visuomotor policy in the style of Diffusion Policy: from the current frame (96x96) and the last two
agent positions, sample a chunk of the next 16 absolute agent targets and execute the first 8.

The chunk is drawn by a flow-matching head (rectified flow: x_t = t a + (1 - t) eps, the head predicts
a - eps; `sample_steps` Euler steps from t = 0 to 1), so where the demonstrator could push from two sides
the policy commits to one instead of averaging them. The image encoder is a small residual CNN read out
by spatial soft-argmax keypoints (as Diffusion Policy's ResNet); frames are randomly cropped in training
and centre-cropped when acting.

    iws train-policy --data data/expert --out runs/visuomotor      # iws_gym/training/policy.py
    iws eval policy --policy iws_gym.policies:visuomotor --ground-truth-only --episodes 100 --horizon 300

`VisuomotorPolicy(path)` acts on gym-pusht's observations at any frame size; `visuomotor` is the zero-
argument factory of the shipped weights (checkpoints/tpushing/policies/visuomotor.safetensors).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

CANVAS = 512.0


@dataclass
class VisuomotorConfig:
    size: int = 96          # frames are resized to size x size
    crop: int = 88          # random crops of this size in training, the centre crop when acting
    n_obs: int = 2          # agent positions the policy sees: the current one and those before
    n_frames: int = 1       # frames it sees, the last of them (the agent positions carry the motion)
    chunk: int = 16         # actions predicted at once
    execute: int = 8        # actions of a chunk executed before the next prediction
    ch: int = 48            # encoder width at 1/4 resolution (twice that at 1/8)
    keypoints: int = 32     # spatial soft-argmax keypoints per frame
    hidden: int = 512       # width of the flow head
    head_blocks: int = 3
    sample_steps: int = 10  # Euler steps of the flow sampler
    noise_draws: int = 4    # flow-matching draws per observation in training (the head is cheap)
    pose_aux: float = 0.0   # weight of an auxiliary loss: the block's pose read from the frame's features (training
                            # only, where the demonstrations record it; the policy acts on pixels and agent_pos alone)
    bottleneck: str = "features"  # what the head sees of the frame: "features" (keypoints and pooled features, trained
                                  # end to end) or "pose" (a CNN's reading of the block's pose; see PoseBottleneckNet)
    pose_noise: float = 2.0  # (pose) std of the noise on the recorded pose the head trains on: px, and px / 100 rad
    frame_every: int = 16    # (pose) the pose reader trains on every N-th batch (the head is cheap, the reader is not)
    frame_batch: int = 64    # (pose) frames per reader batch


def to_unit(pos: torch.Tensor) -> torch.Tensor:
    return pos / (CANVAS / 2) - 1.0


def from_unit(x: torch.Tensor) -> torch.Tensor:
    return (x + 1.0) * (CANVAS / 2)


class ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.body = nn.Sequential(nn.GroupNorm(8, c), nn.SiLU(), nn.Conv2d(c, c, 3, padding=1),
                                  nn.GroupNorm(8, c), nn.SiLU(), nn.Conv2d(c, c, 3, padding=1))

    def forward(self, x):
        return x + self.body(x)


class SpatialSoftArgmax(nn.Module):
    """(B, C, H, W) -> (B, 2K): the expected (x, y) in [-1, 1] of K softmax maps (Levine et al. 2016)."""

    def __init__(self, c: int, k: int):
        super().__init__()
        self.proj = nn.Conv2d(c, k, 1)

    def forward(self, h):
        B, _, H, W = h.shape
        att = self.proj(h).float().flatten(2).softmax(-1)  # (B, K, HW)
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, H, device=h.device), torch.linspace(-1, 1, W, device=h.device),
                                indexing="ij")
        grid = torch.stack([xs.flatten(), ys.flatten()], -1)  # (HW, 2)
        return (att @ grid).flatten(1)


class Encoder(nn.Module):
    """A frame (B, 3, crop, crop) in [-1, 1] -> features (B, 2K + 2c)."""

    def __init__(self, cfg: VisuomotorConfig):
        super().__init__()
        c = cfg.ch
        self.net = nn.Sequential(
            nn.Conv2d(3, c, 4, stride=4),                     # 88 -> 22: a patch stem
            ResBlock(c), ResBlock(c),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1),      # -> 11
            ResBlock(2 * c), ResBlock(2 * c),
            nn.GroupNorm(8, 2 * c), nn.SiLU())
        self.keypoints = SpatialSoftArgmax(2 * c, cfg.keypoints)
        self.out_dim = 2 * cfg.keypoints + 2 * c

    def forward(self, x):
        h = self.net(x)
        return torch.cat([self.keypoints(h), h.float().mean((2, 3))], 1)


class FlowHead(nn.Module):
    """Velocity of the chunk's flow: (x_t (B, chunk*2), t (B,), cond (B, D)) -> (B, chunk*2)."""

    def __init__(self, cfg: VisuomotorConfig, cond_dim: int):
        super().__init__()
        d, h = cfg.chunk * 2, cfg.hidden
        self.register_buffer("freqs", torch.exp(torch.linspace(0, math.log(1000), 32)), persistent=False)
        self.inp = nn.Linear(d + 64 + cond_dim, h)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(h), nn.Linear(h, 2 * h), nn.SiLU(), nn.Linear(2 * h, h))
                                    for _ in range(cfg.head_blocks))
        self.out = nn.Sequential(nn.LayerNorm(h), nn.Linear(h, d))

    def forward(self, x_t, t, cond):
        emb = t[:, None] * self.freqs
        h = self.inp(torch.cat([x_t, emb.sin(), emb.cos(), cond], 1))
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


def pose_features(pose: torch.Tensor) -> torch.Tensor:
    """(B, 3) block poses (canvas px, rad) -> (B, 4): x, y in [-1, 1], cos, sin (what PoseReader predicts)."""
    return torch.cat([to_unit(pose[:, :2]), torch.cos(pose[:, 2:]), torch.sin(pose[:, 2:])], 1)


def sample_chunk(head: FlowHead, cond: torch.Tensor, cfg: VisuomotorConfig, generator=None, steps: int | None = None):
    """A chunk (B, chunk, 2) of absolute targets in canvas px: Euler steps of the head's flow from noise."""
    steps = steps or cfg.sample_steps
    x = torch.randn(len(cond), cfg.chunk * 2, generator=generator).to(cond.device)
    for i in range(steps):
        t = torch.full((len(x),), i / steps, device=x.device)
        x = x + head(x, t, cond).float() / steps
    return from_unit(x.clamp(-1, 1)).view(-1, cfg.chunk, 2)


class VisuomotorNet(nn.Module):
    def __init__(self, cfg: VisuomotorConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.cond_dim = cfg.n_frames * self.encoder.out_dim + cfg.n_obs * 2
        self.head = FlowHead(cfg, self.cond_dim)
        if cfg.pose_aux > 0:  # (x, y, cos, sin) of the block, from the current frame's features
            self.pose_head = nn.Sequential(nn.Linear(self.encoder.out_dim, 256), nn.SiLU(), nn.Linear(256, 4))

    def condition(self, frames: torch.Tensor, agent: torch.Tensor, features: bool = False):
        """frames (B, n_frames, 3, crop, crop) in [-1, 1], agent (B, n_obs, 2) canvas px -> (B, cond_dim)
        (and with `features`, the current frame's encoder features)."""
        f = self.encoder(frames.flatten(0, 1)).float().view(len(frames), frames.shape[1], -1)
        cond = torch.cat([f.flatten(1), to_unit(agent).flatten(1)], 1)
        return (cond, f[:, -1]) if features else cond

    def loss(self, batch: dict, step: int = 0):
        """Flow matching on the action chunk, `noise_draws` draws of (t, eps) per observation (plus the
        pose loss where `pose_aux` > 0 and the batch has the block's pose)."""
        cond, feats = self.condition(batch["frames"], batch["agent"], features=True)
        a = to_unit(batch["actions"]).flatten(1)                       # (B, chunk*2)
        k = self.cfg.noise_draws
        cond, a = cond.repeat_interleave(k, 0), a.repeat_interleave(k, 0)
        t = torch.rand(len(a), device=a.device)
        eps = torch.randn_like(a)
        x_t = t[:, None] * a + (1 - t[:, None]) * eps
        v = self.head(x_t, t, cond).float()
        loss = F.mse_loss(v, a - eps)
        logs = {"flow_mse": loss.item()}
        if self.cfg.pose_aux > 0 and "block_pose" in batch:
            pose = batch["block_pose"]
            target = pose_features(pose)
            ok = torch.isfinite(target).all(1)  # generated data: the pose reader may have found no T
            if ok.any():
                pose_mse = F.mse_loss(self.pose_head(feats[ok]).float(), target[ok])
                loss = loss + self.cfg.pose_aux * pose_mse
                logs["pose_mse"] = pose_mse.item()
        return loss, logs

    forward = loss

    @torch.no_grad()
    def sample(self, frames, agent, generator: torch.Generator | None = None, steps: int | None = None):
        """A chunk (B, chunk, 2) of absolute targets in canvas px, by Euler steps of the learned flow."""
        return sample_chunk(self.head, self.condition(frames, agent), self.cfg, generator, steps)


class PoseReader(nn.Module):
    """A whole frame (B, 3, S, S) in [-1, 1], S = 96 -> the block's pose (B, 4): x, y in [-1, 1], cos, sin."""

    def __init__(self, c: int = 32):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, c, 4, stride=4), ResBlock(c), ResBlock(c),                          # 96 -> 24
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), ResBlock(2 * c), ResBlock(2 * c),    # -> 12
            nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1), ResBlock(2 * c), nn.GroupNorm(8, 2 * c), nn.SiLU(),  # -> 6
            nn.AdaptiveAvgPool2d(6), nn.Flatten(), nn.Linear(2 * c * 36, 256), nn.SiLU(), nn.Linear(256, 4))

    def forward(self, x):
        return self.net(x).float()


class PoseBottleneckNet(nn.Module):
    """The head sees the block only through its pose, read from the frame by a small CNN (PoseReader).

    Seeing and acting are trained apart in one loop: the reader regresses the demonstrations' recorded
    poses (every `frame_every`-th batch, `frame_batch` frames), and the head learns the action chunks
    conditioned on the recorded pose plus noise (`pose_noise`, as large as the reader's errors), so it can
    train for many cheap steps and also learn from state-only corrections (DAgger labels). Acting, it
    runs on the pixels and agent_pos alone. Why this split: docs/experiments.md, "Visuomotor policy
    (issue 33)": the pose reads to 1.4 px from 96x96 frames, and the action head needs ~10^5 steps."""

    def __init__(self, cfg: VisuomotorConfig):
        super().__init__()
        if cfg.crop != cfg.size or cfg.n_frames != 1:
            raise ValueError(f"the pose bottleneck reads one whole frame (crop == size, n_frames == 1), got crop "
                             f"{cfg.crop}, size {cfg.size}, n_frames {cfg.n_frames}")
        self.cfg = cfg
        self.reader = PoseReader()
        self.cond_dim = 4 + cfg.n_obs * 2
        self.head = FlowHead(cfg, self.cond_dim)

    def state_condition(self, pose4: torch.Tensor, agent: torch.Tensor) -> torch.Tensor:
        return torch.cat([pose4.float(), to_unit(agent).flatten(1)], 1)

    def condition(self, frames: torch.Tensor, agent: torch.Tensor) -> torch.Tensor:
        return self.state_condition(self.reader(frames[:, -1]), agent)

    def loss(self, batch: dict, step: int = 0):
        """Flow matching of the chunk given (agent positions, noised recorded pose); plus, where the batch
        holds frames, the reader's pose regression."""
        pose = batch["block_pose"]
        noise = torch.randn_like(pose) * self.cfg.pose_noise * torch.tensor([1.0, 1.0, 0.01], device=pose.device)
        cond = self.state_condition(pose_features(pose + noise), batch["agent"])
        a = to_unit(batch["actions"]).flatten(1)
        t = torch.rand(len(a), device=a.device)
        eps = torch.randn_like(a)
        flow = F.mse_loss(self.head(t[:, None] * a + (1 - t[:, None]) * eps, t, cond).float(), a - eps)
        logs = {"flow_mse": flow.item()}
        loss = flow
        if "frames" in batch:
            pose_mse = F.mse_loss(self.reader(batch["frames"][:, -1]), pose_features(batch["frame_pose"]))
            loss = loss + pose_mse
            logs["pose_mse"] = pose_mse.item()
        return loss, logs

    forward = loss

    @torch.no_grad()
    def read_pose(self, frames: torch.Tensor) -> torch.Tensor:
        """(B, n, 3, S, S) -> (B, 3): the block's pose (canvas px, rad) read from the last frame."""
        p = self.reader(frames[:, -1])
        return torch.cat([from_unit(p[:, :2]), torch.atan2(p[:, 3], p[:, 2])[:, None]], 1)

    @torch.no_grad()
    def sample(self, frames, agent, generator: torch.Generator | None = None, steps: int | None = None, pose=None):
        """A chunk (B, chunk, 2) of absolute targets in canvas px; `pose` (B, 3) replaces the reader's."""
        cond = self.condition(frames, agent) if pose is None else self.state_condition(pose_features(pose), agent)
        return sample_chunk(self.head, cond, self.cfg, generator, steps)


def build_net(cfg: VisuomotorConfig) -> nn.Module:
    if cfg.bottleneck not in ("features", "pose"):
        raise ValueError(f"bottleneck must be 'features' or 'pose', got {cfg.bottleneck!r}")
    return PoseBottleneckNet(cfg) if cfg.bottleneck == "pose" else VisuomotorNet(cfg)


def prep_frames(frames: np.ndarray, size: int) -> np.ndarray:
    """(..., H, W, 3) uint8 -> (..., size, size, 3) uint8 (INTER_AREA), unchanged if already that size."""
    if frames.shape[-3:-1] == (size, size):
        return frames
    flat = frames.reshape(-1, *frames.shape[-3:])
    out = np.stack([cv2.resize(f, (size, size), interpolation=cv2.INTER_AREA) for f in flat])
    return out.reshape(*frames.shape[:-3], size, size, 3)


def frames_to_input(frames: np.ndarray, crop: int, offsets=None) -> torch.Tensor:
    """(B, n, S, S, 3) uint8 -> (B, n, 3, crop, crop) in [-1, 1]; crop at `offsets` (B, 2) or the centre."""
    B, n, S = frames.shape[:3]
    if offsets is None:
        o = (S - crop) // 2
        frames = frames[:, :, o:o + crop, o:o + crop]
    else:
        frames = np.stack([f[:, oy:oy + crop, ox:ox + crop] for f, (oy, ox) in zip(frames, offsets)])
    return torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0


class VisuomotorPolicy:
    """Trained weights as a policy `obs -> action` on gym-pusht's observations (`pixels` at any size,
    `agent_pos`). Keeps the last `n_obs` observations and a queue of the chunk's actions."""

    def __init__(self, path, device: str = "cpu"):
        from iws_gym.models.checkpoint import load_release

        cfg, sd, self.meta = load_release(Path(path), "visuomotor", VisuomotorConfig)
        self.cfg, self.device = cfg, torch.device(device)
        self.net = build_net(cfg)
        self.net.load_state_dict(sd)
        self.net.eval().to(self.device)
        self.reset(0)

    def reset(self, seed=None):
        self.frames, self.agents = deque(maxlen=self.cfg.n_frames), deque(maxlen=self.cfg.n_obs)
        self.queue: deque = deque()
        self.generator = torch.Generator().manual_seed(0 if seed is None else int(seed))

    def __call__(self, obs) -> np.ndarray:
        frame = prep_frames(np.asarray(obs["pixels"]), self.cfg.size)
        agent = np.asarray(obs["agent_pos"], np.float32)
        if not self.frames:  # the first step: the history is the first observation repeated
            self.frames.extend([frame] * self.cfg.n_frames)
            self.agents.extend([agent] * self.cfg.n_obs)
        self.frames.append(frame)
        self.agents.append(agent)
        if not self.queue:
            x = frames_to_input(np.stack(self.frames)[None], self.cfg.crop).to(self.device)
            p = torch.from_numpy(np.stack(self.agents))[None].to(self.device)
            chunk = self.net.sample(x, p, self.generator)[0].cpu().numpy()
            self.queue.extend(chunk[: self.cfg.execute])
        return np.clip(self.queue.popleft(), 0, CANVAS).astype(np.float32)


def visuomotor():
    """The shipped visuomotor policy (`iws eval policy --policy iws_gym.policies:visuomotor`)."""
    from iws_gym.envs.registry import weights_path

    return VisuomotorPolicy(weights_path("checkpoints/tpushing/policies") / "visuomotor.safetensors")


visuomotor.is_factory = True
