"""`iws demo`: a scripted pusher that acts on the frame and agent_pos alone plays IWS-TPushing-v0 for a few
episodes, and the same pusher plays gym-pusht from the same start states. Prints both scores per episode
and writes a video: gym-pusht above, the learned env below.

What to expect, for the default 2 episodes x 80 steps: about a minute on 2 CPU cores (most of it loading
and the first steps). A good world model scores each episode close to gym-pusht's (max coverage within a
few hundredths) and keeps the grey T rigid in the video; a broken one loses, bends or fades the T, and then
scores far below gym-pusht on the episodes where the pusher really pushes.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np


def write_video(frames: list[np.ndarray], path: Path, fps: int = 10, scale: int = 3) -> None:
    import cv2

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    h, w = frames[0].shape[:2]
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    vw = cv2.VideoWriter(str(tmp), cv2.VideoWriter_fourcc(*"mp4v"), fps, (w * scale, h * scale))
    for f in frames:
        vw.write(cv2.resize(f, (w * scale, h * scale), interpolation=cv2.INTER_NEAREST)[:, :, ::-1])
    vw.release()
    tmp.replace(path)


def demo(checkpoint=None, episodes: int = 2, steps: int = 80, seed: int = 0, video: Path | None = None,
         device: str = "auto") -> dict:
    import gymnasium as gym
    from tqdm import tqdm

    import iws_gym  # noqa: F401
    from iws_gym.envs.registry import load_task
    from iws_gym.evaluation.policy_eval import run_ground_truth, start_states
    from iws_gym.policies.scripted import FramePusher

    if episodes <= 0 or steps <= 0:
        raise ValueError(f"--episodes and --steps must be > 0, got {episodes} and {steps}")
    task = load_task("tpushing")
    print(f"iws demo: {episodes} episodes x {steps} steps in the learned env and in gym-pusht; expect about "
          f"{max(1, round((20 + episodes * steps * 0.12) / 60))} min on 2 CPU cores", file=sys.stderr, flush=True)
    states = start_states(task, episodes, seed)
    truth_frames: list = []
    truth, _ = run_ground_truth(task, lambda: FramePusher(seed=seed), states, steps, seed, record=truth_frames,
                                record_episodes=episodes)
    env = gym.make("IWS-TPushing-v0", checkpoint=checkpoint, device=device, max_episode_steps=steps)
    results, frames, t0, n_steps = [], [], time.time(), 0
    for ep in tqdm(range(episodes), desc="demo episodes"):
        policy = FramePusher(seed=seed)
        policy.reset(seed + ep)
        obs, info = env.reset(seed=seed + ep, options={"reset_to_state": states[ep]})
        max_cov, done, ep_frames = info.get("coverage", 0.0), False, [obs["pixels"]]
        while not done:
            obs, r, term, trunc, info = env.step(policy(obs))
            n_steps += 1
            max_cov = max(max_cov, info.get("coverage", 0.0))
            ep_frames.append(obs["pixels"])
            done = term or trunc
        ep_frames += [ep_frames[-1]] * (steps + 1 - len(ep_frames))
        frames += [np.concatenate([t, f], axis=0) for t, f in zip(truth_frames[ep], ep_frames)]  # gym-pusht above
        results.append(dict(episode=ep, start_state=[round(float(v), 2) for v in states[ep]],
                            max_coverage=round(float(max_cov), 4), success=bool(max_cov > 0.95),
                            gym_pusht_max_coverage=round(float(truth[ep]), 4)))
    wall = time.time() - t0
    if video:
        write_video(frames, Path(video))
    env.close()
    learned = float(np.mean([r["max_coverage"] for r in results]))
    return dict(episodes=results, mean_max_coverage=learned, gym_pusht_mean_max_coverage=float(np.mean(truth)),
                gap=round(learned - float(np.mean(truth)), 4),
                how_to_read="max coverage of the goal T over each episode (success: > 0.95). A faithful world "
                            "scores each episode close to gym-pusht's; a much lower score with the T bent or gone in "
                            "the video (gym-pusht above, learned env below) is the world breaking.",
                success_rate=float(np.mean([r["success"] for r in results])), env_steps=n_steps,
                steps_per_s_including_policy=round(n_steps / wall, 2), video=str(video) if video else None)
