"""`iws eval probe`: WorldGym's generalisation probe - start the learned env from an edited real frame
and see what it does with the edit.

Edits of a held-out start frame (none of them ever appears in the training data):
* `goal_shifted`: the green goal T erased and redrawn 96 px to the right, rotated by 45 degrees;
* `block_recoloured`: the T block painted orange;
* `distractor`: a red 14x14 px square pasted in an empty corner of the table;
* `agent_removed`: the same start rendered without the agent (an exact render of its block pose), the
  state a rollout is in after it has faded the agent out: does the env put the agent back?
Each edited start and the unedited one are rolled out with the same actions (those of held-out
scripted play from the unedited start), and the report measures, at several steps:
* `edit_kept`: how much of the edit is still in the frame (share of goal-green pixels in the new goal
  region, orange share of the block's pixels, red share of the pasted square; median over episodes),
  1 = fully kept; for agent_removed, the share of episodes whose frame still has no agent;
* `block_px_vs_unedited`: how far the block (pose estimator) drifts from the unedited rollout's block,
  i.e. whether the edit changes the predicted physics (it should not), and `agent_px_vs_unedited` the
  same for the agent;
* the scorer's coverage on the edited frames.
A frame grid shows the rollouts side by side. The report describes; it does not judge.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from iws_gym.data.collect import collect_episode
from iws_gym.data.splits import split_offset
from iws_gym.tasks.pusht.groundtruth import GOAL_POSE, render_without_agent
from iws_gym.tasks.pusht.pose import agent_position, block_fraction, estimate, render_t
from iws_gym.tasks.pusht.scorer import TPushCoverageScorer
from iws_gym.envs.registry import TaskConfig

GREEN = np.array([144, 238, 144], np.float32)
WHITE = np.array([255, 255, 255], np.float32)
ORANGE = np.array([255, 140, 0], np.float32)
RED = np.array([220, 20, 20], np.float32)


def _mask(pose, size: int = 128) -> np.ndarray:
    ys, xs = np.mgrid[0:size, 0:size]
    return render_t(pose, ys.ravel().astype(float), xs.ravel().astype(float), scale=512.0 / size).reshape(size, size)


def _free(frame: np.ndarray) -> np.ndarray:
    """(H, W) weight of pixels that are table (not block, not agent)."""
    a, valid = block_fraction(frame)
    return np.clip(1 - a, 0, 1) * (valid > 0)


def edit_frame(frame: np.ndarray, kind: str, block_pose=None):
    """-> (edited frame, region mask (H, W) where the edit is measured, target colour).
    agent_removed needs the frame's true block pose (x, y, angle) and returns no region or colour."""
    if kind == "agent_removed":
        if block_pose is None:
            raise ValueError("the agent_removed edit needs the frame's block_pose (x, y, angle)")
        return render_without_agent(np.asarray(block_pose, np.float64)[None], frame.shape[0])[0], None, None
    f = frame.astype(np.float32)
    free = _free(frame)[..., None]
    if kind == "goal_shifted":
        old = _mask(GOAL_POSE)[..., None]
        new_pose = GOAL_POSE + np.array([96.0, 0.0, np.pi / 4])
        new = _mask(new_pose)[..., None]
        f = f + free * old * (WHITE - f)           # erase the goal where the table shows
        f = f + free * new * (GREEN - f)           # draw the shifted goal
        region = (new[..., 0] > 0.9) & (free[..., 0] > 0.9)
        return f.round().clip(0, 255).astype(np.uint8), region, GREEN
    if kind == "block_recoloured":
        a, _ = block_fraction(frame)
        a = np.clip(a, 0, 1)[..., None]
        f = f + a * (ORANGE - f)
        return f.round().clip(0, 255).astype(np.uint8), a[..., 0] > 0.9, ORANGE
    if kind == "distractor":
        # the emptiest 14x14 corner patch (away from block and agent)
        best = None
        for y, x in [(8, 8), (8, 106), (106, 8), (106, 106)]:
            s = free[y : y + 14, x : x + 14].mean()
            if best is None or s > best[0]:
                best = (s, y, x)
        _, y, x = best
        f[y : y + 14, x : x + 14] = RED
        region = np.zeros(frame.shape[:2], bool)
        region[y : y + 14, x : x + 14] = True
        return f.astype(np.uint8), region, RED
    raise ValueError(f"unknown edit {kind!r}; choose from {', '.join(EDITS)}")


def colour_share(frame: np.ndarray, region: np.ndarray, colour: np.ndarray, tol: float = 60.0) -> float:
    if not region.any():
        return float("nan")
    d = np.linalg.norm(frame.astype(np.float32)[region] - colour, axis=-1)
    return float((d < tol).mean())


EDITS = ("goal_shifted", "block_recoloured", "distractor", "agent_removed")


def probe(task: TaskConfig, checkpoint: str | None = None, steps: int = 60, episodes: int = 4, grid: Path | None = None,
          device: str = "auto") -> dict:
    from tqdm import tqdm

    from iws_gym.evaluation.fidelity import save_grid
    from iws_gym.models.world_model import WorldModel

    if steps <= 0 or episodes <= 0:
        raise ValueError(f"--steps and --episodes must be > 0, got {steps} and {episodes}")
    wm = WorldModel.from_pretrained(checkpoint or task.checkpoint_path, device=device, stages=("stage1", "stage2"))
    scorer = TPushCoverageScorer(frame_size=task.frame_size)
    at = sorted({s for s in (1, 10, 30, steps) if s <= steps})
    res = {k: dict(edit_kept={t: [] for t in [0] + at}, block_px_vs_unedited={t: [] for t in at},
                   agent_px_vs_unedited={t: [] for t in at}, coverage={t: [] for t in [0] + at}) for k in EDITS}
    base_cov = {t: [] for t in [0] + at}
    rows = []
    for e in tqdm(range(episodes), desc="probe"):
        ep = collect_episode(task, task.heldout_seed_base + split_offset("stability_check") + e, steps)
        frame0, acts = ep["frames"][0], ep["actions"][:steps]
        base = wm.rollout(frame0, acts, seed=e, agent_pos=ep["agent_pos"][:1])
        base_est = {t: estimate(base[t]) for t in at}
        for t in [0] + at:
            base_cov[t].append(scorer(base[t][None])[0].info["coverage"])
        if e == 0:
            rows.append(base[[0] + at])
        for kind in EDITS:
            edited, region, colour = edit_frame(frame0, kind, block_pose=ep["block_pose"][0])
            # a tracking model keeps the agent's true start even where the edit erased its picture
            roll = wm.rollout(edited, acts, seed=e, agent_pos=ep["agent_pos"][:1])
            r = res[kind]
            for t in [0] + at:
                if kind == "agent_removed":  # kept = the agent is still missing
                    r["edit_kept"][t].append(float(agent_position(roll[t]) is None))
                elif kind == "block_recoloured":  # the block moves: measure on its current pixels
                    est = estimate(base[t]) if t else None
                    reg = region if t == 0 else (_mask(est.block) > 0.9 if est.block is not None else region)
                    r["edit_kept"][t].append(colour_share(roll[t], reg, colour))
                else:
                    r["edit_kept"][t].append(colour_share(roll[t], region, colour))
                r["coverage"][t].append(scorer(roll[t][None])[0].info["coverage"])
                if t in base_est and t > 0:
                    be, ee = base_est[t], estimate(roll[t])
                    d = np.linalg.norm(be.block[:2] - ee.block[:2]) if be.block is not None and ee.block is not None else np.nan
                    r["block_px_vs_unedited"][t].append(float(d))
                    d = np.linalg.norm(be.agent - ee.agent) if be.agent is not None and ee.agent is not None else np.nan
                    r["agent_px_vs_unedited"][t].append(float(d))
            if e == 0:
                rows.append(roll[[0] + at])

    def med(d):
        return {str(t): (float(np.nanmedian(v)) if len(v) and not np.all(np.isnan(v)) else None) for t, v in d.items()}

    def mean(d):  # agent_removed's edit_kept is 0/1 per episode: its share, not its median
        return {str(t): float(np.mean(v)) if len(v) else None for t, v in d.items()}

    report = dict(task=task.name, checkpoint=str(wm.path), steps=steps, episodes=episodes, at_steps=at,
                  unedited_coverage=med(base_cov),
                  edits={k: {m: (mean(v) if (k, m) == ("agent_removed", "edit_kept") else med(v)) for m, v in r.items()}
                         for k, r in res.items()})
    if grid is not None:
        save_grid(rows, Path(grid), scale=2)
        report["grid"] = str(grid)
        report["grid_rows"] = ["unedited"] + list(EDITS)
        report["grid_columns"] = [0] + at
    return report
