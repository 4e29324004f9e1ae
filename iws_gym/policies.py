"""Policies that act from what a policy may see: the frame and agent_pos (no hidden simulator state).

Each is a callable `policy(obs) -> action` with gym-pusht's observation convention
(obs = {"pixels": (H, W, 3) uint8, "agent_pos": (2,)}) and absolute actions in [0, 512]^2, so the same
policy runs unchanged in gym-pusht and in IWS-TPushing-v0. `reset(seed)` starts a new episode.
"""
from __future__ import annotations

import cv2
import numpy as np

from .behaviours import Pusher
from .pose import estimate


class FramePusher:
    """The scripted goal-directed pusher driven by the T pose read from the frame (pose.py)."""

    def __init__(self, noise: float = 0.0, seed: int = 0):
        self.noise, self.seed = noise, seed
        self.reset(seed)

    def reset(self, seed: int | None = None):
        self.rng = np.random.default_rng(self.seed if seed is None else seed)
        self.pusher = Pusher(self.rng, noise=self.noise)
        self.last_block = None

    def __call__(self, obs) -> np.ndarray:
        frame, agent = obs["pixels"], np.asarray(obs["agent_pos"], dtype=np.float64)
        if frame.shape[:2] != (128, 128):
            frame = cv2.resize(frame, (128, 128), interpolation=cv2.INTER_AREA)
        est = estimate(frame)
        block = est.block if est.block is not None else self.last_block
        if block is None:  # nothing to push: hold still
            return agent.astype(np.float32)
        self.last_block = block
        return np.asarray(self.pusher.act(np.concatenate([agent, block])), dtype=np.float32)


class RandomPolicy:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self.reset(seed)

    def reset(self, seed: int | None = None):
        self.rng = np.random.default_rng(self.seed if seed is None else seed)

    def __call__(self, obs) -> np.ndarray:
        return self.rng.uniform(0, 512, 2).astype(np.float32)


class IdlePolicy:
    def reset(self, seed: int | None = None):
        pass

    def __call__(self, obs) -> np.ndarray:
        return np.asarray(obs["agent_pos"], dtype=np.float32)
