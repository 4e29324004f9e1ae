"""Success scorers: reward and success read from predicted frames (a learned world has no hidden state).

Protocol: a scorer is any callable `scorer(frames) -> list[Score]` taking a batch of (N, H, W, 3) uint8
RGB frames (the raw 128x128 model frames, before any observation resize). The env calls it once per
step with one frame per env, so a scorer may batch its work (a VLM or a learned reward model). Each
Score carries `reward`, `is_success` and a dict `info` merged into the step info.

    env = gym.make("IWS-TPushing-v0", scorer=TPushCoverageScorer(method="pose"))
    env = gym.make("IWS-TPushing-v0", scorer=ProbabilityScorer(my_success_prob_fn, threshold=0.5))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from iws_gym.tasks.pusht.groundtruth import GOAL_POSE, SUCCESS_THRESHOLD
from iws_gym.tasks.pusht.pose import block_fraction, estimate, render_t


@dataclass
class Score:
    reward: float
    is_success: bool
    info: dict = field(default_factory=dict)


def goal_mask(frame_size: int = 128) -> np.ndarray:
    """(H, W) anti-aliased coverage of the goal T at frame resolution."""
    ys, xs = np.mgrid[0:frame_size, 0:frame_size]
    return render_t(GOAL_POSE, ys.ravel().astype(float), xs.ravel().astype(float), scale=512.0 / frame_size).reshape(frame_size, frame_size)


class TPushCoverageScorer:
    """Push-T's reward from pixels: coverage of the goal T by the block, as gym-pusht defines it
    (reward = clip(coverage / 0.95, 0, 1), success = coverage > 0.95).

    method="pixels" (default, ~1 ms): block fraction of each goal pixel, averaged over the goal.
    method="pose": fit the T pose (pose.py) and intersect polygons exactly (~50 ms per frame)."""

    def __init__(self, method: str = "pixels", frame_size: int = 128):
        if method not in ("pixels", "pose"):
            raise ValueError(f"method must be 'pixels' or 'pose', got {method!r}")
        self.method = method
        self.goal = goal_mask(frame_size)
        self.goal_area = self.goal.sum()
        rows, cols = np.nonzero(self.goal.any(axis=1))[0], np.nonzero(self.goal.any(axis=0))[0]
        self.box = (slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1))  # only the goal's pixels matter

    def coverage(self, frame: np.ndarray) -> float:
        if self.method == "pose":
            c = estimate(frame).coverage
            return 0.0 if np.isnan(c) else float(c)
        a, _ = block_fraction(frame[self.box])  # per-pixel unmixing: the crop changes nothing (but a 1-px agent-mask edge)
        return float(np.clip((np.clip(a, 0, 1) * self.goal[self.box]).sum() / self.goal_area, 0.0, 1.0))

    def __call__(self, frames: np.ndarray) -> list[Score]:
        out = []
        for f in frames:
            c = self.coverage(f)
            out.append(Score(float(np.clip(c / SUCCESS_THRESHOLD, 0, 1)), bool(c > SUCCESS_THRESHOLD), {"coverage": c}))
        return out


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
