"""`iws eval transport`: is a stage-1 latent one in which moving an object is moving cells?

A dynamics model can only carry a pushed object along as one piece if its latent lets it. This check
takes the dynamics out of the question: it moves each latent by the object's *true* motion and asks
whether the decoded object is still whole.

From the first frame of a held-out episode, the latent z is warped step after step (open loop, no
network) by the true motion of that step, on the latent grid, by bilinear resampling:
* cells the T covers at t+1 (their centre within `margin` cells of its outline: a cell holds what lies
  around its centre, and at 16x16 a cell is wider than the T's bar) are read from where its rigid motion
  says they were at t;
* cells of the agent's disc at t+1 (the same margin) from where the agent was;
* cells the T or the agent uncovered are filled from the encoding of the empty table (what was behind
  an object is not in z_t; the fill is an oracle, the same for every latent);
* all other cells stay.
With `once`, each check instead warps the first latent by the whole motion since the start, in one
resampling: equivariance without the blur that repeated bilinear resampling adds.
The frame is decoded (one decoder step) every `check_every` steps and checked by the whole-T test of
`iws eval stability` (pose.is_whole_t, residual bound calibrated on the real frames) and for the
block's position error. The same warps applied to the frame's own pixels (128x128) are the reference:
what transport does to an object when the representation is the image itself.

Task-specific on purpose (it reads the true block and agent poses): it measures a property of the
latent, not of a model that uses it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from iws_gym.data.collect import heldout_episodes
from iws_gym.envs.registry import TaskConfig
from iws_gym.models.checkpoint import load_stage
from iws_gym.models.decoder import Stage1, Stage1Config, decode
from iws_gym.models.frames import frames_to_tensor, tensor_to_frames
from iws_gym.tasks.pusht import pose as P
from iws_gym.tasks.pusht.geometry import CANVAS, t_sdf_local
from iws_gym.tasks.pusht.groundtruth import render_states, rot

AGENT_RADIUS = 15.0  # canvas px (gym-pusht's agent disc)


def _body(q_x, q_y, pose):
    """World (canvas) points -> the T's body frame at `pose`."""
    (r00, r01), (r10, r11) = rot(pose[2])
    dx, dy = q_x - pose[0], q_y - pose[1]
    return dx * r00 + dy * r10, dx * r01 + dy * r11


def motion_grid(size: int, block0, block1, agent0, agent1, margin: float = 0.75):
    """The backward sampling grid of one step's true motion on a size x size grid: (size, size, 2) in
    grid_sample's [-1, 1] coordinates, and the (size, size) bool mask of cells the objects uncovered. A cell
    moves with an object when its centre is within `margin` cells of the object's outline (a cell holds
    what lies around its centre: at 16x16 a cell is wider than the T's bar)."""
    c = (np.arange(size) + 0.5) * CANVAS / size
    margin = margin * CANVAS / size  # cells -> canvas px
    qy, qx = np.meshgrid(c, c, indexing="ij")
    src_x, src_y = qx.copy(), qy.copy()
    lx, ly = _body(qx, qy, block1)
    in1 = t_sdf_local(lx, ly) < margin
    R0 = rot(block0[2])
    src_x[in1] = (R0[0, 0] * lx + R0[0, 1] * ly + block0[0])[in1]
    src_y[in1] = (R0[1, 0] * lx + R0[1, 1] * ly + block0[1])[in1]
    in0 = t_sdf_local(*_body(qx, qy, block0)) < margin
    ag1 = np.hypot(qx - agent1[0], qy - agent1[1]) < AGENT_RADIUS + margin
    ag0 = np.hypot(qx - agent0[0], qy - agent0[1]) < AGENT_RADIUS + margin
    src_x[ag1] = qx[ag1] - (agent1[0] - agent0[0])
    src_y[ag1] = qy[ag1] - (agent1[1] - agent0[1])
    uncovered = (in0 | ag0) & ~(in1 | ag1)
    grid = np.stack([src_x / CANVAS * 2 - 1, src_y / CANVAS * 2 - 1], -1)
    return torch.tensor(grid, dtype=torch.float32), torch.tensor(uncovered)


def _warp(x, grid, uncovered, fill):
    x = F.grid_sample(x, grid[None], mode="bilinear", padding_mode="border", align_corners=False)
    return torch.where(uncovered[None, None], fill, x)


@torch.no_grad()
def transport(task: TaskConfig, checkpoint=None, episodes: int = 8, steps: int = 100, check_every: int = 10,
              split: str = "validation", margin: float = 0.75, grid: Path | None = None, seed: int = 0,
              once: bool = False) -> dict:
    if steps < 1 or check_every < 1 or episodes < 1:
        raise ValueError(f"--episodes, --steps and --check-every must be >= 1, got {episodes}, {steps}, {check_every}")
    s1, meta, f1 = load_stage(checkpoint or task.checkpoint_path, "stage1", Stage1Config, Stage1, "cpu")
    size = task.frame_size
    eps = list(heldout_episodes(task, episodes, steps, split, progress=True))
    residual_max = P.calibrate_whole_t(np.concatenate([e["frames"][::check_every] for e in eps]))
    table = render_states(np.array([[-400.0, -400.0]]), np.array([[-400.0, -400.0, 0.0]]), size)[0]
    x_fill = frames_to_tensor(table[None], "cpu").float()
    z_fill = s1.encoder(x_fill).float()
    rows = {"latent": [], "pixels": []}
    strips = []
    for i, e in enumerate(eps):
        bp, ap = e["block_pose"], e["agent_pos"]
        z0 = z = s1.encoder(frames_to_tensor(e["frames"][:1], "cpu")).float()
        x0 = x = frames_to_tensor(e["frames"][:1], "cpu").float()
        strip = []
        for t in range(steps):
            s = 0 if once else t  # once: the first frame moved by the whole motion since; else the last one by one step
            g, u = motion_grid(z.shape[-1], bp[s], bp[t + 1], ap[s], ap[t + 1], margin)
            z = _warp(z0 if once else z, g, u, z_fill)
            g, u = motion_grid(size, bp[s], bp[t + 1], ap[s], ap[t + 1], margin)
            x = _warp(x0 if once else x, g, u, x_fill)
            if (t + 1) % check_every:
                continue
            dec = tensor_to_frames(decode(s1.decoder, z, 1, generator=torch.Generator().manual_seed(seed)))[0]
            pix = tensor_to_frames(x)[0]
            if i == 0:
                strip.append((e["frames"][t + 1], pix, dec))
            if P.inside_share(bp[t + 1], size) < P.WHOLE_INSIDE:  # judged only where the true T is in the frame
                continue
            for name, frame in (("latent", dec), ("pixels", pix)):
                est = P.estimate(frame)
                err = float(np.hypot(*(est.block[:2] - bp[t + 1][:2]))) if est.block is not None else float("nan")
                rows[name].append(dict(episode=i, step=t + 1, whole=P.is_whole_t(est, size, residual_max), block_px=err))
        strips.append(strip)
    out = dict(task=task.name, checkpoint=str(checkpoint or task.checkpoint_path), stage1=f1,
               latent_shape=list(z.shape[1:]), split=split, episodes=episodes, steps=steps, check_every=check_every,
               margin_cells=margin, residual_max=residual_max,
               warps="once: the first frame by the whole motion since" if once else "step after step")
    for name, r in rows.items():
        whole = np.array([v["whole"] for v in r], bool)
        err = np.array([v["block_px"] for v in r])
        by = {}
        for s in sorted({v["step"] for v in r}):
            sel = np.array([v["step"] == s for v in r])
            by[str(s)] = dict(whole=float(whole[sel].mean()), block_px_median=float(np.nanmedian(err[sel])))
        out[name] = dict(checks=len(r), whole=float(whole.mean()) if len(r) else float("nan"),
                         block_px_median=float(np.nanmedian(err)) if len(r) else float("nan"), by_step=by)
    if grid is not None and strips and strips[0]:
        import imageio.v2 as iio

        img = np.concatenate([np.concatenate([s[k] for s in strips[0]], axis=1) for k in range(3)], axis=0)
        grid.parent.mkdir(parents=True, exist_ok=True)
        iio.imwrite(grid, img)
        out["grid"] = str(grid) + " (rows: truth, pixels warped, latent warped and decoded; every check)"
    return out
