"""How often a dataset shows the T moving against a wall (issue 36: the 1,000-step drives break where a pushed T
meets a wall or a corner).

    python scripts/compact_latent/wall_share.py DATA [DATA ...] [--episodes 120] [--margin 10] --json OUT.json

Per dataset, over its first `--episodes` episodes: the share of frames whose T has a vertex within `--margin` px of
a wall's inner face (breaks_at_walls.near_wall), the share of transitions where the T moves (> 0.5 px or
0.01 rad), and the share of those that happen against a wall.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from iws_gym.data.episodes import list_episodes, read_episode

sys.path.insert(0, str(Path(__file__).parent))
from breaks_at_walls import near_wall  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="+")
    ap.add_argument("--episodes", type=int, default=120)
    ap.add_argument("--margin", type=float, default=10.0)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    out = dict(command=" ".join(["python"] + sys.argv), margin_px=a.margin, datasets={})
    for d in a.data:
        near, moving = [], []
        for p in list_episodes(d)[: a.episodes]:
            b = read_episode(p, ["block_pose"])["block_pose"]
            near.append(np.array([near_wall(q, a.margin) for q in b]))
            step = np.diff(b, axis=0)
            moving.append((np.linalg.norm(step[:, :2], axis=1) > 0.5) | (np.abs(step[:, 2]) > 0.01))
        n, m = np.concatenate([x[:-1] for x in near]), np.concatenate(moving)
        out["datasets"][d] = dict(episodes=len(near), frames_near_wall=float(np.concatenate(near).mean()),
                                  moving_transitions=float(m.mean()), moving_near_wall_of_moving=float((m & n).sum() / max(m.sum(), 1)))
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
