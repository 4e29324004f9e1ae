"""Where a visuomotor policy loses its successes (issue 33; a scratch tool kept at the git tag exp-policy-finish).

    python scripts/policy_finish.py POLICY --json reports/policy_finish.json

1. traces: the policy in gym-pusht from the first 40 validation starts (--seed 8000), 300 steps; per episode the
   max coverage, the step it first passes 0.9, and the step it ends (success ends an episode).
2. reader: the policy's pose reader against the recorded block pose on data/expert_val, by the block's
   distance to the goal pose.
"""
import argparse, json
import numpy as np, torch
from iws_gym.data.episodes import list_episodes, read_episode
from iws_gym.envs.registry import load_task
from iws_gym.evaluation.policy_eval import start_states
from iws_gym.policies.visuomotor import VisuomotorPolicy, frames_to_input, prep_frames
from iws_gym.tasks.pusht.groundtruth import make_env

p = argparse.ArgumentParser()
p.add_argument("policy"); p.add_argument("--json", required=True); p.add_argument("--episodes", type=int, default=40)
p.add_argument("--val-data", default="data/expert_val")
a = p.parse_args()
task = load_task("tpushing")
env = make_env(task.frame_size)
traces = []
for i, st in enumerate(start_states(task, a.episodes, 8000)):
    obs, _ = env.reset(options={"reset_to_state": st})
    pol = VisuomotorPolicy(a.policy); pol.reset(8000 + i)
    cov = []
    for _ in range(300):
        obs, _, term, _, info = env.step(pol(obs)); cov.append(info["coverage"])
        if term:
            break
    cov = np.array(cov)
    first = int(np.argmax(cov > 0.9)) if (cov > 0.9).any() else None
    traces.append(dict(max=float(cov.max()), first_above_0_9=first, steps=len(cov), success=bool(cov.max() > 0.95)))
succ = [t["steps"] - t["first_above_0_9"] for t in traces if t["success"]]
near = [t["steps"] - t["first_above_0_9"] for t in traces if not t["success"] and t["max"] > 0.9]
pol = VisuomotorPolicy(a.policy)
E, D = [], []
for path in list_episodes(a.val_data):
    e = read_episode(path, keys=("frames", "block_pose"))
    x = frames_to_input(np.stack([prep_frames(f, pol.cfg.size) for f in e["frames"]])[:, None], pol.cfg.crop)
    est = pol.net.read_pose(x).numpy()
    n = min(len(est), len(e["block_pose"])); est, bp = est[:n], e["block_pose"][:n]
    E.append(np.c_[np.linalg.norm(est[:, :2] - bp[:, :2], axis=1), np.abs((est[:, 2] - bp[:, 2] + np.pi) % (2 * np.pi) - np.pi)])
    D.append(np.linalg.norm(bp[:, :2] - 256.0, axis=1))
E, D = np.concatenate(E), np.concatenate(D)
reader = {}
for lo, hi in ((0, 5), (5, 15), (15, 40), (40, 10_000)):
    m = (D >= lo) & (D < hi)
    reader[f"{lo}-{hi}px"] = dict(frames=int(m.sum()), px_median=float(np.median(E[m, 0])), rad_median=float(np.median(E[m, 1])))
out = dict(policy=a.policy, episodes=a.episodes, seed=8000, traces=traces,
           success_steps_from_0_9=dict(n=len(succ), min=min(succ, default=None), median=float(np.median(succ)) if succ else None,
                                       max=max(succ, default=None)),
           near_misses_steps_after_0_9=sorted(near), reader_by_goal_distance=reader)
json.dump(out, open(a.json, "w"), indent=1)
print(json.dumps({k: v for k, v in out.items() if k != "traces"}, indent=1))
