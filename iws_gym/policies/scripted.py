"""Policies that act from what a policy may see: the frame and agent_pos (no hidden simulator state).

Each is a callable `policy(obs) -> action` with gym-pusht's observation convention
(obs = {"pixels": (H, W, 3) uint8, "agent_pos": (2,)}) and absolute actions in [0, 512]^2, so the same
policy runs unchanged in gym-pusht and in IWS-TPushing-v0. `reset(seed)` starts a new episode.
"""
from __future__ import annotations

import cv2
import numpy as np

from iws_gym.tasks.pusht.behaviours import Pusher
from iws_gym.tasks.pusht.pose import estimate


def read_state(obs, last_block=None):
    """(agent_pos, block pose) from a gym-pusht observation at any frame size: the block read from the frame
    (pose.py), or `last_block` where the reader finds none (None if it never has)."""
    frame, agent = obs["pixels"], np.asarray(obs["agent_pos"], dtype=np.float64)
    if frame.shape[:2] != (128, 128):
        frame = cv2.resize(frame, (128, 128), interpolation=cv2.INTER_AREA)
    block = estimate(frame).block
    return agent, (block if block is not None else last_block)


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
        agent, self.last_block = read_state(obs, self.last_block)
        if self.last_block is None:  # nothing to push: hold still
            return agent.astype(np.float32)
        return np.asarray(self.pusher.act(np.concatenate([agent, self.last_block])), dtype=np.float32)


class ExpertPusher:
    """The planning expert (tasks/pusht/expert.py) driven by the T pose read from the frame: it plans each push
    in its own copy of gym-pusht's physics, set to what it sees. The demonstrator of `iws generate` and of
    the policies trained by imitation."""

    def __init__(self, noise: float = 0.0, seed: int = 0, **expert):
        from iws_gym.tasks.pusht.expert import PlanningPusher

        self.noise, self.seed = noise, seed
        self.expert = PlanningPusher(noise=noise, **expert)
        self.reset(seed)

    def reset(self, seed: int | None = None):
        self.expert.reset(np.random.default_rng(self.seed if seed is None else seed))
        self.last_block = None

    def __call__(self, obs) -> np.ndarray:
        agent, self.last_block = read_state(obs, self.last_block)
        if self.last_block is None:
            return agent.astype(np.float32)
        return self.expert.act(np.concatenate([agent, self.last_block]))


class MarkovExpertPusher(ExpertPusher):
    """The planning expert that replans every 8 actions from what it sees (`iws collect --mix expert_markov`),
    driven by the T pose read from the frame: the demonstrator of `iws eval datagen --real` on such data."""

    def __init__(self, noise: float = 0.0, seed: int = 0):
        from iws_gym.tasks.pusht.expert import MARKOV

        super().__init__(noise, seed, **MARKOV)


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


class LazyPusher(FramePusher):
    """A degraded pusher: it acts every `every`-th step and otherwise holds where it is."""

    def __init__(self, every: int = 3, seed: int = 0):
        self.every = every
        super().__init__(noise=0.0, seed=seed)

    def reset(self, seed: int | None = None):
        super().reset(seed)
        self.t = 0

    def __call__(self, obs) -> np.ndarray:
        self.t += 1
        if self.t % self.every:
            return np.asarray(obs["agent_pos"], dtype=np.float32)
        return super().__call__(obs)


class JitteryPusher(FramePusher):
    """A degraded pusher: with probability `p` a step's action is a uniformly random target instead."""

    def __init__(self, p: float = 0.3, seed: int = 0):
        self.p = p
        super().__init__(noise=0.0, seed=seed)

    def __call__(self, obs) -> np.ndarray:
        a = super().__call__(obs)  # keep the pusher's internal plan advancing either way
        if self.rng.random() < self.p:
            return self.rng.uniform(0, 512, 2).astype(np.float32)
        return a


def bc_policy(step: int):
    """Factory of the shipped behaviour-cloning policy at a training step (checkpoints/tpushing/policies)."""
    from iws_gym.envs.registry import weights_path
    from iws_gym.policies.bc import BCPolicy

    def make():
        return BCPolicy(weights_path("checkpoints/tpushing/policies") / f"bc_step{step}.safetensors")
    make.is_factory = True
    return make


# the shipped behaviour-cloning policies by name, for `iws eval policy --policy iws_gym.policies:bc_step4000`
bc_step300, bc_step1000, bc_step4000 = bc_policy(300), bc_policy(1000), bc_policy(4000)


def suite() -> dict:
    """The policy suite of `iws eval correlate`, graded from doing nothing to the competent pusher.
    name -> factory (called once per episode)."""
    return {
        "idle": IdlePolicy,
        "random": RandomPolicy,
        "jittery_pusher_p0.6": lambda: JitteryPusher(p=0.6),
        "lazy_pusher_every4": lambda: LazyPusher(every=4),
        "noisy_pusher_1.5": lambda: FramePusher(noise=1.5),
        "jittery_pusher_p0.2": lambda: JitteryPusher(p=0.2),
        "pusher": lambda: FramePusher(noise=0.0),
        "bc_step300": bc_step300,
        "bc_step1000": bc_step1000,
        "bc_step4000": bc_step4000,
    }
