"""Issue 36's diversity check for a compact release that draws its change (`noise_dim` > 0): two draws of the same
open-loop rollout (the same start and actions, noise seeds 0 and 1) must differ where the future is uncertain,
and each must draw a whole T.

    python scripts/compact_latent/sample_spread.py RELEASE --episodes 16 --horizon 192 --json OUT.json

Per step: the block's distance between the two draws (the spread), each draw's distance from the truth (the
error), and the share of whole Ts among the draws (pose.is_whole_t, its fit bound calibrated on the episodes'
real frames as `iws eval fidelity` does). A draw that follows the truth's distribution has a spread about equal
to its error (both are distances between two draws of the same distribution); a deterministic step has a spread
of 0. Episodes: the first of the held-out split set4 (`iws eval fidelity --split set4`).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from tqdm import tqdm

from iws_gym.data.collect import heldout_episodes
from iws_gym.data.splits import split_offset
from iws_gym.envs.registry import load_task
from iws_gym.models.world_model import WorldModel
from iws_gym.tasks.pusht.pose import calibrate_whole_t, estimate, inside_share, is_whole_t


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("release")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--horizon", type=int, default=192)
    ap.add_argument("--split", default="set4")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    task = load_task("tpushing")
    wm = WorldModel.from_pretrained(a.release, stages=("stage1", "stage2"))
    eps = list(heldout_episodes(task, a.episodes, a.horizon, a.split))
    residual_max = calibrate_whole_t(np.concatenate([e["frames"] for e in eps]))
    T, S = a.horizon + 1, 2
    spread, err, whole = (np.full((len(eps), T), np.nan) for _ in range(3))
    err2, whole2 = np.full((len(eps), T), np.nan), np.full((len(eps), T), np.nan)
    for i, ep in enumerate(tqdm(eps, desc="two draws per episode")):
        draws = [wm.rollout(ep["frames"][0], ep["actions"][: a.horizon], seed=s, agent_pos=ep["agent_pos"][0])
                 for s in range(S)]
        for t in range(T):
            e = [estimate(d[t]) for d in draws]
            true = ep["block_pose"][t][:2]
            if e[0].block is not None and e[1].block is not None:
                spread[i, t] = np.linalg.norm(e[0].block[:2] - e[1].block[:2])
            for k, (er, wh) in enumerate(((err, whole), (err2, whole2))):
                er[i, t] = np.linalg.norm(e[k].block[:2] - true) if e[k].block is not None else np.nan
                if inside_share(ep["block_pose"][t], task.frame_size) >= 0.9:  # judged as in `iws eval fidelity`
                    wh[i, t] = is_whole_t(e[k], task.frame_size, residual_max)
    at = [t for t in (8, 16, 32, 64, 128, 192) if t < T]
    med = lambda v, t: float(np.nanmedian(v[:, t])) if np.isfinite(v[:, t]).any() else None
    errs = np.concatenate([err, err2])
    res = dict(release=a.release, episodes=len(eps), horizon=a.horizon, split=a.split,
               command=" ".join(["python"] + sys.argv), noise_dim=wm.stage2.cfg.noise_dim,
               spread_block_px_median={t: med(spread, t) for t in at},
               error_block_px_median={t: med(errs, t) for t in at},
               spread_over_error={t: (med(spread, t) / med(errs, t)) if med(errs, t) else None for t in at},
               t_whole_share_all_draws=float(np.nanmean(np.concatenate([whole, whole2])[:, 1:])),
               whole_residual_max=residual_max,
               per_episode_spread_block_px=[[None if np.isnan(v) else round(float(v), 2) for v in r] for r in spread])
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if not k.startswith("per_")}, indent=1))
    return res


if __name__ == "__main__":
    main()
