"""A small behaviour-cloning policy trained on ground-truth demonstrations: the learned member of the
policy suite (`iws eval correlate`), and an example of a policy trained from `iws collect` data.

Input: the frame (resized to 64x64) and agent_pos, as gym-pusht gives them. Output: the next absolute
agent target, predicted as an offset from agent_pos. Trained by MSE on the steps of the goal-directed
pushing segments (`push`, `push_near_goal`) of a dataset. Checkpoints at chosen steps give policies of
graded quality.

    iws train-bc --data data/tpushing --out runs/bc --steps 4000 --save-at 300 1000 4000
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from iws_gym.models.checkpoint import load_release, save_release
from iws_gym.data.episodes import list_episodes, read_episode
from iws_gym.models.hardware import autocast

BC_SEGMENTS = ("push", "push_near_goal")
OFFSET_SCALE = 64.0  # canvas px: typical |action - agent_pos| of the pusher


@dataclass
class BCConfig:
    size: int = 64     # input frame size
    ch: int = 32
    hidden: int = 256


class BCNet(nn.Module):
    def __init__(self, cfg: BCConfig):
        super().__init__()
        self.cfg = cfg
        c = cfg.ch
        self.convs = nn.Sequential(
            nn.Conv2d(3, c, 4, stride=4), nn.SiLU(),                         # 64 -> 16 (space-to-depth stem)
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.SiLU(),          # -> 8
            nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1), nn.SiLU())      # -> 4
        self.mlp = nn.Sequential(nn.Linear(2 * c * 16 + 2, cfg.hidden), nn.SiLU(), nn.Linear(cfg.hidden, cfg.hidden),
                                 nn.SiLU(), nn.Linear(cfg.hidden, 2))

    def forward(self, frames: torch.Tensor, agent: torch.Tensor) -> torch.Tensor:
        """frames (B, 3, s, s) in [-1, 1], agent (B, 2) in the 512 canvas -> offset / OFFSET_SCALE (B, 2)."""
        h = self.convs(frames).flatten(1)
        return self.mlp(torch.cat([h, agent / 256.0 - 1.0], dim=1))


def _prep(frames: np.ndarray, size: int) -> torch.Tensor:
    """(B, H, W, 3) uint8 -> (B, 3, size, size) float in [-1, 1]."""
    if frames.shape[1:3] != (size, size):
        frames = np.stack([cv2.resize(f, (size, size), interpolation=cv2.INTER_AREA) for f in frames])
    return torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def load_demos(root: Path, max_episodes: int | None, size: int):
    from tqdm import tqdm

    from iws_gym.data.collect import SEGMENT_NAMES

    keep = {SEGMENT_NAMES.index(s) for s in BC_SEGMENTS}
    X, P, Y = [], [], []
    for p in tqdm(list_episodes(Path(root))[:max_episodes], desc="loading demos", unit="ep"):
        ep = read_episode(p, keys=("frames", "actions", "agent_pos", "segments"))
        m = np.isin(ep["segments"], list(keep))
        if not m.any():
            continue
        idx = np.nonzero(m)[0]
        X.append(np.stack([cv2.resize(f, (size, size), interpolation=cv2.INTER_AREA) for f in ep["frames"][idx]]))
        P.append(ep["agent_pos"][idx].astype(np.float32))
        Y.append(ep["actions"][idx].astype(np.float32))
    if not X:
        raise ValueError(f"{root}: no steps from segments {BC_SEGMENTS} to clone")
    return np.concatenate(X), np.concatenate(P), np.concatenate(Y)


def train_bc(data: str, out: str, steps: int = 4000, batch: int = 128, lr: float = 1e-3, save_at=(300, 1000, 4000),
             max_episodes: int | None = 300, seed: int = 0) -> dict:
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    from iws_gym.models.checkpoint import git_commit

    if steps <= 0 or batch <= 0:
        raise ValueError(f"--steps and --batch must be > 0, got {steps} and {batch}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = BCConfig()
    X, P, Y = load_demos(Path(data), max_episodes, cfg.size)
    rng = np.random.default_rng(seed)
    hold = rng.random(len(X)) < 0.05
    torch.manual_seed(seed)
    net = BCNet(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr, weight_decay=1e-4)
    writer = SummaryWriter(str(out / "tb"))
    tr_idx, ho_idx = np.nonzero(~hold)[0], np.nonzero(hold)[0][:2048]
    xh, ph, yh = _prep(X[ho_idx], cfg.size), torch.from_numpy(P[ho_idx]), torch.from_numpy(Y[ho_idx])
    log, t0 = [], time.time()
    for step in tqdm(range(1, steps + 1), desc="train bc"):
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + np.cos(np.pi * step / steps))
        b = rng.choice(tr_idx, batch)
        x, p, y = _prep(X[b], cfg.size), torch.from_numpy(P[b]), torch.from_numpy(Y[b])
        with autocast("cpu"):
            pred = net(x, p)
        loss = F.mse_loss(pred.float(), (y - p) / OFFSET_SCALE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step in save_at:
            with torch.no_grad():
                err = ((net(xh, ph) * OFFSET_SCALE + ph - yh).norm(dim=1)).median().item()
            writer.add_scalar("loss", loss.item(), step)
            writer.add_scalar("heldout_action_err_px", err, step)
            log.append(dict(step=step, loss=loss.item(), heldout_action_err_px_median=err))
        if step in save_at:
            save_release(out / f"bc_step{step}.safetensors", net.state_dict(), "bc", cfg,
                         dict(step=step, data=str(data), commit=git_commit(), heldout_action_err_px_median=log[-1]["heldout_action_err_px_median"]))
    writer.close()
    result = dict(command=f"iws train-bc --data {data} --out {out} --steps {steps} --batch {batch} --save-at "
                  + " ".join(map(str, save_at)), demo_steps=int(len(X)), seed=seed, wall_s=round(time.time() - t0, 1), log=log)
    (out / "train_result.json").write_text(json.dumps(result, indent=1))
    return result


class BCPolicy:
    """A trained BC checkpoint as a policy `obs -> action` (gym-pusht's observation convention)."""

    def __init__(self, path):
        cfg, sd, self.meta = load_release(Path(path), "bc", BCConfig)
        self.net = BCNet(cfg)
        self.net.load_state_dict({k: v.float() for k, v in sd.items()})
        self.net.eval()
        self.cfg = cfg

    def reset(self, seed=None):
        pass

    @torch.inference_mode()
    def __call__(self, obs) -> np.ndarray:
        agent = np.asarray(obs["agent_pos"], np.float32)
        off = self.net(_prep(obs["pixels"][None], self.cfg.size), torch.from_numpy(agent)[None])[0].numpy()
        return np.clip(agent + off * OFFSET_SCALE, 0, 512).astype(np.float32)
