"""`iws generate`: demonstrations recorded inside the learned world, in the project's dataset format.

    iws generate --task tpushing --episodes 100 --out data/generated --seed 0

A policy (default: the scripted demonstrator `iws_gym.policies:FramePusher`, which reads the T's pose
from the frame, so it sees only what any policy sees) acts in the batched learned env
(`WorldSimVectorEnv`) from gym-pusht's start frames of seeds seed..seed+N-1. Each episode is recorded as
`iws collect` records ground truth (data/episodes.py): the learned frames, the actions, the agent
position the env reports. What only a simulator knows is not there: block_pose is the pose reader's
estimate from the learned frame (NaN where it finds no T), coverage the env scorer's, n_contacts -1. An
episode ends at the learned env's success (coverage > 0.95) or after --steps.

dataset.json says `generated: true` and names the world model (its directory, the sha256 of each
stage's weights and their provenance), the policy and the seeds, so generated data can never be mistaken
for ground truth (`iws export lerobot` carries it to meta/iws_source.json).
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np

from iws_gym.data.collect import check_out_dir
from iws_gym.data.episodes import episode_path, write_episode, write_json_atomic
from iws_gym.envs.registry import TaskConfig
from iws_gym.models.checkpoint import find_release, git_commit

DEFAULT_POLICY = "iws_gym.policies:FramePusher"


def world_model_identity(checkpoint) -> dict:
    """Which world model made the data: its directory, each stage's weights (sha256) and their provenance."""
    out = dict(checkpoint=str(checkpoint))
    for stage in ("stage1", "stage2"):
        f = find_release(checkpoint, stage)
        out[f"{stage}_sha256"] = hashlib.sha256(Path(f).read_bytes()).hexdigest()
    prov = Path(checkpoint) / "provenance.json"
    if prov.is_file():
        p = json.loads(prov.read_text())
        out["provenance"] = {s: {k: p[s].get(k) for k in ("command", "steps", "trained_at_commit", "released_at_commit")}
                             for s in ("stage1", "stage2") if isinstance(p.get(s), dict)}
    return out


def generate(task: TaskConfig, out: Path, episodes: int, steps: int | None = None, seed: int = 0,
             policy: str = DEFAULT_POLICY, checkpoint=None, num_envs: int = 8, device: str = "auto",
             progress: bool = True, resume: bool = False) -> dict:
    """Record `episodes` episodes of `policy` in the learned world (episode i starts from seed + i's
    frame). With `resume`, the episodes already in `out` (of this very seed and policy) are kept."""
    from tqdm import tqdm

    from iws_gym.envs.vector_env import WorldSimVectorEnv
    from iws_gym.policies import load_policy_factory
    from iws_gym.tasks.pusht.groundtruth import make_env
    from iws_gym.tasks.pusht.pose import estimate

    steps = steps or task.episode_steps
    if episodes < 1 or steps < 1 or num_envs < 1:
        raise ValueError(f"--episodes, --steps and --num-envs must be >= 1, got {episodes}, {steps}, {num_envs}")
    if seed < 0 or seed + episodes > task.heldout_seed_base:
        raise ValueError(f"start seeds {seed}..{seed + episodes - 1} overlap the held-out range (>= "
                         f"{task.heldout_seed_base}) or are negative")
    factory = load_policy_factory(policy)  # a bad --policy fails before anything is written
    out = Path(out)
    done = check_out_dir(out, resume)
    if done:
        from iws_gym.data.episodes import read_episode

        i = min(done)
        attrs = read_episode(episode_path(out, i), keys=())["attrs"]
        if int(attrs.get("seed", -1)) != seed + i or attrs.get("policy") != policy:
            raise ValueError(f"cannot resume {out} with --seed {seed} --policy {policy}: its episode {i} was generated "
                             f"with seed {attrs.get('seed')} and policy {attrs.get('policy')}")
    todo = [i for i in range(episodes) if i not in done]
    checkpoint = Path(checkpoint) if checkpoint else task.checkpoint_path
    ident = world_model_identity(checkpoint)
    n = max(1, min(num_envs, len(todo)))
    env = WorldSimVectorEnv(num_envs=n, checkpoint=checkpoint, device=device, task=task.name, max_episode_steps=None)
    gt = make_env(task.frame_size)
    t0 = time.time()
    bar = tqdm(total=len(todo), desc=f"generate {task.name} in the learned world", unit="ep", disable=not progress)
    for b0 in range(0, len(todo), n):
        ids = todo[b0 : b0 + n]
        starts = [gt.reset(seed=seed + i)[0]["pixels"] for i in ids]
        starts += [starts[-1]] * (n - len(ids))  # the last batch: spare envs replay a start, unrecorded
        obs, info = env.reset(seed=seed + ids[0], options={"initial_frames": np.stack(starts)})
        policies = [factory() for _ in range(n)]
        for k, p in enumerate(policies):
            if hasattr(p, "reset"):
                p.reset(seed + (ids[k] if k < len(ids) else ids[-1]))
        rec = [dict(frames=[obs["pixels"][k]], agent_pos=[obs["agent_pos"][k]], actions=[],
                    coverage=[float(info["coverage"][k])]) for k in range(n)]
        live = np.zeros(n, bool)
        live[: len(ids)] = True
        for _ in range(steps):
            actions = np.stack([np.asarray(p({"pixels": obs["pixels"][k], "agent_pos": obs["agent_pos"][k]}),
                                           np.float32).reshape(-1, 2)[0] if live[k] else obs["agent_pos"][k]
                                for k, p in enumerate(policies)]).astype(np.float32)
            obs, _, terminated, _, info = env.step(actions)
            for k in np.flatnonzero(live):
                r = rec[k]
                r["actions"].append(actions[k])
                r["frames"].append(obs["pixels"][k])
                r["agent_pos"].append(obs["agent_pos"][k])
                r["coverage"].append(float(info["coverage"][k]))
            live &= ~terminated
            if not live.any():
                break
        for k, i in enumerate(ids):
            r = rec[k]
            T = len(r["actions"])
            poses = [estimate(f).block for f in r["frames"]]
            ep = dict(frames=np.stack(r["frames"]), actions=np.stack(r["actions"]),
                      agent_pos=np.stack(r["agent_pos"]).astype(np.float32),
                      block_pose=np.stack([p if p is not None else np.full(3, np.nan) for p in poses]).astype(np.float32),
                      coverage=np.asarray(r["coverage"], np.float32), n_contacts=np.full(T, -1, np.int16),
                      segments=np.zeros(T, np.int8))
            write_episode(episode_path(out, i), ep, dict(seed=seed + i, task=task.name, steps=T, segment_names=["generated"],
                                                         plan=f"generated:{T}", generated=True, policy=policy))
            bar.update(1)
    bar.close()
    wall = time.time() - t0
    from iws_gym.data.episodes import read_episode

    cov = [read_episode(episode_path(out, i), keys=("coverage",))["coverage"] for i in range(episodes)]
    lengths, successes = [len(c) - 1 for c in cov], [bool(c[-1] > 0.95) for c in cov]
    meta = dict(task=task.name, episodes=episodes, steps=steps, seed=seed, seeds=[seed, seed + episodes - 1],
                frame_size=task.frame_size, generated=True, world_model=ident, policy=policy, num_envs=n,
                ground_truth=None, source="iws generate (learned world)", commit=git_commit(), wall_s=round(wall, 1),
                mean_length=float(np.mean(lengths)), success_rate_in_learned_world=float(np.mean(successes)),
                block_pose="estimated from the learned frames by the pose reader (NaN: no T found)",
                coverage="the learned env's scorer")
    write_json_atomic(out / "dataset.json", meta)
    return meta
