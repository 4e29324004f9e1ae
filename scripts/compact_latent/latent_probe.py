"""How two compact stage 1s' latents carry the T's pose (issue 36: is one latent easier for a dynamics to move?).

    python scripts/compact_latent/latent_probe.py RELEASE [RELEASE ...] --json OUT.json

For each release, on held-out frames (generated on the fly, never trained on):
- sensitivity: decode(z + eps * sd(z) * noise) against decode(z), the T's pose read from both frames (px, rad),
  for eps in 0.02-0.2 z standard deviations: how far a dynamics error of a given size (in the units stage 2's
  losses use) moves the drawn T;
- probe: ridge regression from z (linear, and with its pairwise products) to the T's true (x, y, 60 cos, 60 sin),
  fitted on validation frames of the training mix and read on test frames of expert pushes: how simply the pose
  can be read from z.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from iws_gym.data.collect import heldout_episodes
from iws_gym.envs.registry import load_task
from iws_gym.models.compact import CompactWorldModel
from iws_gym.tasks.pusht.pose import estimate

EPS = (0.02, 0.05, 0.1, 0.2)


def frames_of(task, split, n, steps, every, behaviour):
    f, a, b = [], [], []
    for ep in heldout_episodes(task, n, steps, split, behaviour=behaviour):
        f.append(ep["frames"][::every]), a.append(ep["agent_pos"][::every]), b.append(ep["block_pose"][::every])
    return np.concatenate(f), np.concatenate(a), np.concatenate(b)


def angle_diff(x, y):
    return abs((x - y + np.pi) % (2 * np.pi) - np.pi)


def sensitivity(wm, frames, agents, seed=0):
    z = wm.encode(frames)
    sd = z.std(0)
    base = [estimate(f).block for f in wm.decode(z, agents)]
    out, g = {}, torch.Generator().manual_seed(seed)
    for eps in EPS:
        moved = [estimate(f).block for f in wm.decode(z + eps * sd * torch.randn(z.shape, generator=g), agents)]
        pairs = [(m, b) for m, b in zip(moved, base) if m is not None and b is not None]
        out[str(eps)] = dict(px_median=float(np.median([np.hypot(*(m[:2] - b[:2])) for m, b in pairs])),
                             rad_median=float(np.median([angle_diff(m[2], b[2]) for m, b in pairs])), frames=len(pairs))
    return out


def probe(wm, train, test):
    def target(b):
        return np.stack([b[:, 0], b[:, 1], 60 * np.cos(b[:, 2]), 60 * np.sin(b[:, 2])], 1)

    def feats(z, quadratic):
        if not quadratic:
            return np.c_[z, np.ones(len(z))]
        iu = np.triu_indices(z.shape[1])
        return np.c_[z, (z[:, :, None] * z[:, None])[:, iu[0], iu[1]], np.ones(len(z))]

    ztr, zte = wm.encode(train[0]).numpy(), wm.encode(test[0]).numpy()
    out = {}
    for name, quad in (("linear", False), ("quadratic", True)):
        x = feats(ztr, quad)
        w = np.linalg.solve(x.T @ x + 1e-3 * np.eye(x.shape[1]), x.T @ target(train[2]))
        pred, true = feats(zte, quad) @ w, target(test[2])
        out[name] = dict(xy_px_median=float(np.median(np.hypot(*(pred[:, :2] - true[:, :2]).T))))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("releases", nargs="+")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    task = load_task("tpushing")
    sens = frames_of(task, "validation", 8, 96, 8, "expert")
    train = frames_of(task, "validation", 24, 120, 4, "mix")
    test = frames_of(task, "test", 12, 120, 4, "expert")
    report = dict(frames=dict(sensitivity=len(sens[0]), probe_fit=len(train[0]), probe_test=len(test[0])), releases={})
    for r in a.releases:
        wm = CompactWorldModel.from_pretrained(r, device="cpu")
        report["releases"][r] = dict(sensitivity=sensitivity(wm, sens[0], sens[1]), probe=probe(wm, train, test))
        print(r, json.dumps(report["releases"][r]))
    with open(a.json, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
