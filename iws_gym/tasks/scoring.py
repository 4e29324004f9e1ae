"""Success scorers: reward and success read from predicted frames (a learned world has no hidden state).

Protocol: a scorer is any callable `scorer(frames) -> list[Score]` taking a batch of (N, H, W, 3) uint8
RGB frames (the raw model frames, before any observation resize). The env calls it once per step with one
frame per env, so a scorer may batch its work (a VLM or a learned reward model). Each Score carries
`reward`, `is_success` and a dict `info` merged into the step info. Each task's default scorer lives in its
task package (`tasks/pusht/scorer.py`, `tasks/pilesweep/scorer.py`) and is named in its config.

    env = gym.make("IWS-TPushing-v0", scorer=ProbabilityScorer(my_success_prob_fn, threshold=0.5))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass
class Score:
    reward: float
    is_success: bool
    info: dict = field(default_factory=dict)


class ProbabilityScorer:
    """Adapter for VLM-style or learned-reward scorers: wraps any `fn(frames) -> success probabilities`
    (for example a call into your own vision-language model); nothing is downloaded here.
    reward = probability; success = probability > threshold."""

    def __init__(self, fn: Callable[[np.ndarray], np.ndarray], threshold: float = 0.5):
        self.fn, self.threshold = fn, threshold

    def __call__(self, frames: np.ndarray) -> list[Score]:
        p = np.asarray(self.fn(frames), dtype=np.float64).reshape(-1)
        if len(p) != len(frames):
            raise ValueError(f"scorer function returned {len(p)} probabilities for {len(frames)} frames")
        return [Score(float(x), bool(x > self.threshold), {"success_prob": float(x)}) for x in p]
