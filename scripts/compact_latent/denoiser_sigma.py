"""The compact design's latent denoiser as an inference-time knob (issue 36): 1,000-step drives with the denoiser
applied at another sigma, everything else as released.

    python scripts/compact_latent/denoiser_sigma.py --sigma 0.1 --actions scripted --json OUT.json [--grid-drive 7 --grid OUT.png]

Runs `iws eval stability --steps 1000 --check-every 10 --drives 16 --no-reencode` on the release with its stage 2's
`denoiser_sigma` replaced, and optionally draws one drive's model frames every 40 steps (5 x 5).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import torch

from iws_gym.data.collect import heldout_episodes
from iws_gym.envs.registry import load_task
from iws_gym.evaluation.stability import START_STEPS, drive_actions, stability
from iws_gym.models import compact


def with_sigma(sigma):
    load = compact.CompactWorldModel.from_pretrained.__func__

    def patched(cls, *a, **k):
        wm = load(cls, *a, **k)
        if wm.stage2 is not None:
            wm.stage2.cfg = dataclasses.replace(wm.stage2.cfg, denoiser_sigma=sigma)
        return wm

    compact.CompactWorldModel.from_pretrained = classmethod(patched)


def grid(task, checkpoint, kind, drive, steps, path):
    import imageio.v2 as imageio

    starts = list(heldout_episodes(task, 16, START_STEPS, "stability_calibration"))
    acts = drive_actions(kind, task, steps, 0, [s["agent_pos"][0] for s in starts])[drive:drive + 1]
    wm = compact.CompactWorldModel.from_pretrained(checkpoint, device="cpu", stages=("stage1", "stage2"))
    state = wm.start_frames(starts[drive]["frames"][:1], starts[drive]["agent_pos"][:1])
    shown = []
    for t in range(steps):
        wm.advance(state, torch.from_numpy(acts[:, t]))
        if (t + 1) % (steps // 25) == 0:
            shown.append(wm.decode_last(state)[0])
    imageio.imwrite(path, np.concatenate([np.concatenate(shown[r * 5:(r + 1) * 5], 1) for r in range(5)], 0))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="checkpoints/tpushing")
    ap.add_argument("--sigma", type=float, required=True, help="the denoiser's sigma (released: 0.05)")
    ap.add_argument("--actions", default="scripted")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--drives", type=int, default=16)
    ap.add_argument("--json", required=True)
    ap.add_argument("--grid", help="PNG of one drive's model frames")
    ap.add_argument("--grid-drive", type=int, default=0)
    a = ap.parse_args()
    task = load_task("tpushing")
    with_sigma(a.sigma)
    r = stability(task, a.checkpoint, steps=a.steps, check_every=10, drives=a.drives, kinds=tuple(a.actions.split(",")),
                  reencode=False)
    r["denoiser_sigma"] = a.sigma
    with open(a.json, "w") as f:
        json.dump(r, f, indent=1, default=float)
    for k, v in r["rollouts"].items():
        print(k, "T whole", round(v["t_whole_share"], 4), "per drive", [round(x["t_whole_share"], 2) for x in v["per_drive"]])
    if a.grid:
        grid(task, a.checkpoint, a.actions.split(",")[0], a.grid_drive, a.steps, a.grid)


if __name__ == "__main__":
    main()
