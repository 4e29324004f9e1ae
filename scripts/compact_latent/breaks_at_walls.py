"""Where the 1,000-step drives break (issue 36): is a broken T in the model's frames more often one that gym-pusht
holds against a wall?

    python scripts/compact_latent/breaks_at_walls.py --checkpoint checkpoints/tpushing --drives 48 --json OUT.json

The drives of `iws eval stability --steps 1000 --check-every 10 --drives N --actions scripted random` (same starts,
same actions, seed 0), rolled out in the model and in the ground truth. At every check: is the model's T whole (the
stability check's rule, calibrated as there), and is the true T within `--margin` px of a wall's inner face
(behaviours.WALLS). Reported per kind: the share of checks with the true T near a wall, among all checks and among
the broken ones, and the broken share near and away from walls.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from tqdm import tqdm

from iws_gym.data.collect import heldout_episodes, heldout_seed
from iws_gym.envs.registry import load_task
from iws_gym.evaluation.stability import START_STEPS, drive_actions, ground_truth_drives, reference_frames
from iws_gym.models.world_model import WorldModel
from iws_gym.tasks.pusht.behaviours import WALLS
from iws_gym.tasks.pusht.groundtruth import t_polygons


def near_wall(pose, margin: float) -> bool:
    v = np.concatenate(t_polygons(pose))
    return bool(v.min() < WALLS[0] + margin or v.max() > WALLS[1] - margin)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="checkpoints/tpushing")
    ap.add_argument("--drives", type=int, default=48)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--margin", type=float, default=10.0)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    task = load_task("tpushing")
    wm = WorldModel.from_pretrained(a.checkpoint, stages=("stage1", "stage2"))
    ck = task.module.checks()
    whole = ck.calibrate_whole(reference_frames(task, 8, 200, "stability_calibration"))
    starts = list(heldout_episodes(task, max(8, a.drives), START_STEPS, "stability_calibration"))[: a.drives]
    first = np.stack([ep["frames"][0] for ep in starts])
    agents = np.stack([ep["agent_pos"][0] for ep in starts])
    seeds = [heldout_seed(task, "stability_calibration", i) for i in range(a.drives)]
    check_at = list(range(10, a.steps + 1, 10))
    out = dict(command=" ".join(["python"] + sys.argv), margin_px=a.margin, drives=a.drives, kinds={})
    for kind in ("scripted", "random"):
        actions = drive_actions(kind, task, a.steps, 0, list(agents))
        state, gen = wm.start_frames(first, agents), torch.Generator().manual_seed(0)
        broken = []
        for t in tqdm(range(a.steps), desc=f"model ({kind})"):
            wm.advance(state, torch.from_numpy(actions[:, t]), generator=gen)
            if t + 1 in check_at:
                broken.append([not ck.is_whole(f, whole) for f in wm.decode_last(state)])
        broken = np.array(broken).T  # (drives, checks)
        _, truth = ground_truth_drives(task, seeds, first, actions, check_at)
        near = np.array([[near_wall(p, a.margin) for p in tr["block_pose"]] for tr in truth])
        per_drive = [dict(broken=float(b.mean()), near_wall=float(n.mean())) for b, n in zip(broken, near)]
        r = np.corrcoef([d["broken"] for d in per_drive], [d["near_wall"] for d in per_drive])[0, 1]
        out["kinds"][kind] = dict(
            checks=int(broken.size), broken_share=float(broken.mean()), near_wall_share=float(near.mean()),
            near_wall_share_of_broken=float(near[broken].mean()) if broken.any() else None,
            broken_share_near_wall=float(broken[near].mean()) if near.any() else None,
            broken_share_away_from_walls=float(broken[~near].mean()) if (~near).any() else None,
            per_drive_pearson_broken_vs_near_wall=None if np.isnan(r) else float(r), per_drive=per_drive)
        print(kind, {k: v for k, v in out["kinds"][kind].items() if k != "per_drive"})
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
