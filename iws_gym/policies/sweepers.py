"""Pile-sweeping policies (tasks/pilesweep) that act from what a policy may see: the frame and agent_pos (gym-pusht's observation
convention, any frame size), so each runs unchanged in the ground truth and in IWS-PileSweeping-v0.

`FrameSweeper` is the scripted sweeper (behaviours.Sweeper) driven by the pile read from the frame: every pixel
of orange ink is a point the sweeper may push, so it needs no count of the pieces. `suite()` is the graded suite
of `iws eval correlate --task pilesweeping`, from doing nothing to the competent sweeper.
"""
from __future__ import annotations

import numpy as np

from iws_gym.policies.scripted import IdlePolicy, RandomPolicy
from iws_gym.tasks.pilesweep.behaviours import Sweeper, Wander
from iws_gym.tasks.pilesweep.groundtruth import CANVAS
from iws_gym.tasks.pilesweep.scorer import piece_mass

INK_MIN = 60.0  # red minus blue above which a pixel is taken for part of a piece


def pile_points(frame: np.ndarray) -> np.ndarray:
    """(M, 2) canvas coordinates of the pixels that show pieces (pixel centres)."""
    ys, xs = np.nonzero(piece_mass(frame) > INK_MIN)
    scale = CANVAS / frame.shape[1]
    return np.stack([(xs + 0.5) * scale, (ys + 0.5) * scale], axis=1)


class FrameSweeper:
    """The scripted sweeper on the pile read from the frame. `noise`: Gaussian noise on each action (px);
    `every`: act every `every`-th step and hold in between; `p`: with probability p a step's action is a
    uniformly random target instead."""

    def __init__(self, noise: float = 0.0, every: int = 1, p: float = 0.0, seed: int = 0):
        self.noise, self.every, self.p, self.seed = noise, every, p, seed
        self.reset(seed)

    def reset(self, seed: int | None = None):
        self.rng = np.random.default_rng(self.seed if seed is None else seed)
        self.sweeper, self.t = Sweeper(self.rng, noise=self.noise), 0

    def __call__(self, obs) -> np.ndarray:
        agent = np.asarray(obs["agent_pos"], dtype=np.float64)
        self.t += 1
        if self.t % self.every:
            return agent.astype(np.float32)
        pts = pile_points(obs["pixels"])
        a = self.sweeper.act(np.concatenate([agent, pts.reshape(-1)])) if len(pts) else agent
        if self.p and self.rng.random() < self.p:
            return self.rng.uniform(0, CANVAS, 2).astype(np.float32)
        return np.asarray(a, dtype=np.float32)


class WanderPolicy:
    """Random waypoints at moderate speed, blind to the pile (it moves pieces only by chance)."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.reset(seed)

    def reset(self, seed: int | None = None):
        self.wander = Wander(np.random.default_rng(self.seed if seed is None else seed))

    def __call__(self, obs) -> np.ndarray:
        return np.asarray(self.wander.act(np.asarray(obs["agent_pos"], dtype=np.float64)), dtype=np.float32)


def suite() -> dict:
    """name -> factory (called once per episode): the graded suite of pile-sweeping policies."""
    return {
        "idle": IdlePolicy,
        "random": RandomPolicy,
        "wander": WanderPolicy,
        "jittery_sweeper_p0.6": lambda: FrameSweeper(p=0.6),
        "lazy_sweeper_every4": lambda: FrameSweeper(every=4),
        "jittery_sweeper_p0.2": lambda: FrameSweeper(p=0.2),
        "noisy_sweeper_15": lambda: FrameSweeper(noise=15.0),
        "sweeper": FrameSweeper,
    }
