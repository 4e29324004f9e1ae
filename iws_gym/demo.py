"""`iws demo`: a scripted pusher (acting from frame + agent_pos only) drives IWS-TPushing-v0 for a few
episodes; prints the scores and writes a video of the rollouts."""
from __future__ import annotations

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


def demo(checkpoint=None, episodes: int = 3, steps: int = 100, seed: int = 0, video: Path | None = None,
         device: str = "auto") -> dict:
    import gymnasium as gym
    from tqdm import tqdm

    import iws_gym  # noqa: F401
    from .policies import FramePusher

    if episodes <= 0 or steps <= 0:
        raise ValueError(f"--episodes and --steps must be > 0, got {episodes} and {steps}")
    env = gym.make("IWS-TPushing-v0", checkpoint=checkpoint, device=device, max_episode_steps=steps)
    policy = FramePusher(seed=seed)
    results, frames, t0, n_steps = [], [], time.time(), 0
    for ep in tqdm(range(episodes), desc="demo episodes"):
        obs, info = env.reset(seed=seed + ep)
        policy.reset(seed + ep)
        max_cov, done = info.get("coverage", 0.0), False
        frames.append(obs["pixels"])
        while not done:
            obs, r, term, trunc, info = env.step(policy(obs))
            n_steps += 1
            max_cov = max(max_cov, info.get("coverage", 0.0))
            frames.append(obs["pixels"])
            done = term or trunc
        results.append(dict(episode=ep, seed=seed + ep, max_coverage=round(float(max_cov), 4), success=bool(max_cov > 0.95)))
    wall = time.time() - t0
    if video:
        write_video(frames, Path(video))
    env.close()
    return dict(episodes=results, mean_max_coverage=float(np.mean([r["max_coverage"] for r in results])),
                success_rate=float(np.mean([r["success"] for r in results])), env_steps=n_steps,
                steps_per_s_including_policy=round(n_steps / wall, 2), video=str(video) if video else None)
