"""Where a pose-bottleneck policy fails: its pose reader or its action head (issue 33).

Runs the policy in gym-pusht from the validation starts (seed 8000; never the test starts) twice: acting on
the pose its reader reads from the frame, and acting on the block's true pose. At every chunk start it
records the reader's error, split by where the block is (its centre within 100 px of a wall or not).
With --takeover K it also replays each failed episode (reader mode) for K steps and hands the true state
to the Markov planning expert for 300 more: does the expert rescue the states the learner reached?

    python scripts/policy_pose_oracle.py runs/markov/vm_pose_d3/visuomotor.safetensors --episodes 30 \\
        --takeover 150 --json reports/visuomotor_pose_oracle_d3.json
"""
from __future__ import annotations

import argparse
import json
from collections import deque

import numpy as np
import torch

from iws_gym.envs.registry import load_task
from iws_gym.evaluation.policy_eval import start_states
from iws_gym.policies.visuomotor import CANVAS, VisuomotorPolicy, frames_to_input, prep_frames
from iws_gym.tasks.pusht.expert import MARKOV, PlanningPusher
from iws_gym.tasks.pusht.groundtruth import get_state, make_env, wrap_angle

NEAR_WALL = 100.0  # px between the block's centre and the nearest wall


def run(env, policy, state, seed, horizon, true_pose: bool, errors: list | None = None, steps: int | None = None):
    """One episode from `state`; returns its max coverage. Reader errors at chunk starts go to `errors`."""
    obs, info = env.reset(options={"reset_to_state": state})
    policy.reset(seed)
    cfg, queue, agents = policy.cfg, deque(), deque(maxlen=policy.cfg.n_obs)
    best = float(info.get("coverage", 0.0))
    for _ in range(horizon if steps is None else steps):
        agent = np.asarray(obs["agent_pos"], np.float32)
        agents.extend([agent] * (cfg.n_obs if not agents else 1))
        if not queue:
            x = frames_to_input(prep_frames(np.asarray(obs["pixels"]), cfg.size)[None, None], cfg.crop)
            s = get_state(env)
            true = torch.from_numpy(s[None, 2:5].astype(np.float32))
            if errors is not None:
                read = policy.net.read_pose(x)[0].numpy()
                wall = min(s[2], s[3], 512 - s[2], 512 - s[3])
                errors.append([np.hypot(*(read[:2] - s[2:4])), abs(float(wrap_angle(read[2] - s[4]))), wall])
            p = torch.from_numpy(np.stack(agents))[None]
            chunk = policy.net.sample(x, p, policy.generator, pose=true if true_pose else None)[0].numpy()
            queue.extend(chunk[: cfg.execute])
        obs, _, term, _, info = env.step(np.clip(queue.popleft(), 0, CANVAS).astype(np.float32))
        best = max(best, float(info["coverage"]))
        if term:
            break
    return best


def error_summary(e: np.ndarray) -> dict:
    if not len(e):
        return {}
    return dict(chunk_starts=len(e), px_median=float(np.median(e[:, 0])), px_p90=float(np.percentile(e[:, 0], 90)),
                rad_median=float(np.median(e[:, 1])), rad_p90=float(np.percentile(e[:, 1], 90)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("policy", help="a pose-bottleneck policy release (.safetensors)")
    p.add_argument("--episodes", type=int, default=30)
    p.add_argument("--horizon", type=int, default=300)
    p.add_argument("--seed", type=int, default=8000, help="the starts (8000: validation)")
    p.add_argument("--takeover", type=int, default=0, help="replay failures for K steps, then the expert acts (0: off)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_grad_enabled(False)
    task = load_task("tpushing")
    policy = VisuomotorPolicy(a.policy)
    if policy.cfg.bottleneck != "pose":
        raise SystemExit(f"{a.policy}: not a pose-bottleneck policy (bottleneck {policy.cfg.bottleneck!r})")
    env, states = make_env(task.frame_size), start_states(task, a.episodes, a.seed)
    out = dict(policy=a.policy, episodes=a.episodes, horizon=a.horizon, seed=a.seed, near_wall_px=NEAR_WALL)
    for mode in ("reader", "true_pose"):
        errors: list = []
        scores = np.array([run(env, policy, st, a.seed + i, a.horizon, mode == "true_pose", errors)
                           for i, st in enumerate(states)])
        e = np.array(errors)
        near = e[:, 2] < NEAR_WALL
        out[mode] = dict(success_rate=float(task.module.success(scores).mean()), mean_max_coverage=float(scores.mean()),
                         scores=scores.round(4).tolist(), near_wall_share=float(near.mean()),
                         reader_error_near_wall=error_summary(e[near]), reader_error_elsewhere=error_summary(e[~near]))
        print(f"{mode}: success {out[mode]['success_rate']:.2f}, mean max coverage {out[mode]['mean_max_coverage']:.3f}, "
              f"reader px median/p90 near a wall {out[mode]['reader_error_near_wall'].get('px_median', float('nan')):.1f}/"
              f"{out[mode]['reader_error_near_wall'].get('px_p90', float('nan')):.1f}, elsewhere "
              f"{out[mode]['reader_error_elsewhere']['px_median']:.1f}/{out[mode]['reader_error_elsewhere']['px_p90']:.1f}",
              flush=True)
    if a.takeover:
        rescued = []
        for i in np.flatnonzero(~task.module.success(np.array(out["reader"]["scores"]))):
            before = run(env, policy, states[i], a.seed + i, a.horizon, False, steps=a.takeover)
            expert, best = PlanningPusher(rng=np.random.default_rng(int(i)), **MARKOV), before
            for _ in range(300):
                _, _, term, _, info = env.step(expert.act(get_state(env)))
                best = max(best, float(info["coverage"]))
                if term:
                    break
            rescued.append(dict(start=int(i), learner_max_coverage=round(before, 4), after_expert=round(best, 4)))
        out["takeover"] = dict(at_step=a.takeover, expert_steps=300, episodes=rescued,
                               rescued_share=float(task.module.success(np.array([r["after_expert"] for r in rescued])).mean()) if rescued else None)
        print(f"takeover at step {a.takeover}: the expert rescues {out['takeover']['rescued_share']} of the failures")
    out["command"] = (f"python scripts/policy_pose_oracle.py {a.policy} --episodes {a.episodes} --horizon {a.horizon} "
                      f"--seed {a.seed} --takeover {a.takeover}" + (f" --json {a.json}" if a.json else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
