"""Block error over the first 32 steps from held-out starts where gym-pusht puts the agent inside or against
the block (about 9% of its resets): pymunk pushes the two apart in the first steps, and the block jumps.

    python scripts/contact_starts.py CHECKPOINT OUT.json [N] [SPLIT]

Takes the first N (default 16) starts of SPLIT (default validation) whose agent circle (radius 15) overlaps
the block, plays the training behaviour mix from each for 32 steps in gym-pusht, rolls the model out open
loop under the same actions, and writes each episode's block error per step (None: no T found) with the
median at steps 4, 8, 16 and 32, and what copying the first frame would score at step 32 (how far the block
really went).
"""
import json
import sys

import numpy as np

from iws_gym.data.collect import collect_episode
from iws_gym.data.splits import split_offset
from iws_gym.envs.registry import load_task
from iws_gym.evaluation.fidelity import _copy_first, frame_metrics
from iws_gym.models.world_model import RolloutSettings, load_predictor
from iws_gym.tasks.pusht.groundtruth import make_env

AGENT_RADIUS, H = 15.0, 32


def contact_seeds(task, n: int, split: str, search: int = 4000) -> list[int]:
    env = make_env(task.frame_size)
    base, seeds = task.heldout_seed_base + split_offset(split), []
    for i in range(search):
        env.reset(seed=base + i)
        u = env.unwrapped
        if min(s.point_query(u.agent.position).distance for s in u.block.shapes) < AGENT_RADIUS:
            seeds.append(base + i)
            if len(seeds) == n:
                return seeds
    raise ValueError(f"only {len(seeds)} of the first {search} {split} starts have the agent against the block")


def main(checkpoint: str, out: str, n: int = 16, split: str = "validation") -> dict:
    task = load_task("tpushing")
    seeds = contact_seeds(task, n, split)
    _, predict = load_predictor(checkpoint, RolloutSettings())
    env = make_env(task.frame_size)
    per, copy = [], []
    for s in seeds:
        ep = collect_episode(task, s, H, env)
        per.append([None if np.isnan(v) else float(v) for v in frame_metrics(predict(ep, H), ep)["block_px"]])
        copy.append(float(frame_metrics(_copy_first(ep, H), ep)["block_px"][H]))
    B = np.array([[np.inf if v is None else v for v in p] for p in per])
    res = dict(checkpoint=checkpoint, split=split, seeds=seeds, command=" ".join(["python"] + sys.argv),
               median_block_px={t: float(np.median(B[:, t])) for t in (4, 8, 16, 32)},
               copy_first_frame_block_px_at_32=copy, per_episode_block_px=per)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["median_block_px"]))
    return res


if __name__ == "__main__":
    a = sys.argv[1:]
    if len(a) < 2:
        raise SystemExit(__doc__)
    main(a[0], a[1], int(a[2]) if len(a) > 2 else 16, a[3] if len(a) > 3 else "validation")
