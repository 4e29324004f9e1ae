"""One policy in gym-pusht on the same starts under several seeds of its sampler (issue 33).

A flow-sampled policy's score on 100 starts moves by up to 16 points with the sampler's seed alone
(docs/experiments.md, tenth session), so two policies are compared on the mean over a few seeds. The starts
are `iws eval policy --seed SEED`'s (8000: the validation starts; never tune on the test starts, seed 0);
offset k resets episode i's policy with seed SEED + k + i.

    python scripts/policy_sampler_seeds.py runs/vm/visuomotor.safetensors --offsets 0,1000,2000 --json reports/X.json
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from iws_gym.envs.registry import load_task
from iws_gym.evaluation.policy_eval import run_ground_truth, start_states
from iws_gym.policies import load_policy_factory


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("policy", help="a policy release (.safetensors) or MODULE:CALLABLE")
    p.add_argument("--offsets", default="0,1000,2000", help="comma-separated sampler seed offsets")
    p.add_argument("--episodes", type=int, default=100)
    p.add_argument("--horizon", type=int, default=300)
    p.add_argument("--seed", type=int, default=8000, help="the starts (8000: validation)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    task = load_task("tpushing")
    states = start_states(task, a.episodes, a.seed)
    factory = load_policy_factory(a.policy)
    offsets = [int(x) for x in a.offsets.split(",")]
    per = {}
    for o in offsets:
        s = np.asarray(run_ground_truth(task, factory, states, a.horizon, a.seed + o)[0])
        per[o] = dict(success_rate=float(task.module.success(s).mean()), mean_max_coverage=float(s.mean()), scores=s.round(4).tolist())
        print(f"offset {o}: success {per[o]['success_rate']:.2f}, mean max coverage {per[o]['mean_max_coverage']:.3f}", flush=True)
    succ = np.array([r["success_rate"] for r in per.values()])
    out = dict(policy=a.policy, episodes=a.episodes, horizon=a.horizon, seed=a.seed, offsets=offsets, per_offset=per,
               success_mean=float(succ.mean()), success_spread=[float(succ.min()), float(succ.max())],
               mean_max_coverage_mean=float(np.mean([r["mean_max_coverage"] for r in per.values()])),
               command=f"python scripts/policy_sampler_seeds.py {a.policy} --offsets {a.offsets} --episodes {a.episodes} "
                       f"--horizon {a.horizon} --seed {a.seed}" + (f" --json {a.json}" if a.json else ""))
    print(json.dumps({k: v for k, v in out.items() if k != "per_offset"}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
