"""Record tests/data/shipped_fp32_frames.npz from the shipped weights, after a release changes them: the frames
tests/test_install.py::test_shipped_weights_make_the_same_frames compares against (gym.make + reset(seed=3) + 8
seeded random-walk steps, in fp32).

    python scripts/record_shipped_frames.py
"""
from pathlib import Path

import gymnasium as gym
import numpy as np

import iws_gym  # noqa: F401

OUT = Path(__file__).resolve().parent.parent / "tests/data/shipped_fp32_frames.npz"
STEPS = 8

env = gym.make("IWS-TPushing-v0", precision="fp32")
obs, _ = env.reset(seed=3)
frames, rng, a = [obs["pixels"]], np.random.default_rng(0), obs["agent_pos"].astype(np.float32)
for _ in range(STEPS):
    a = np.clip(a + rng.normal(0, 25, 2), 0, 512).astype(np.float32)
    frames.append(env.step(a)[0]["pixels"])
np.savez_compressed(OUT, frames=np.stack(frames))
print(f"wrote {OUT}: {len(frames)} frames")
