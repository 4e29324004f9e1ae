"""Push-T's success scorer: coverage of the goal T read from predicted frames (the protocol: tasks/scoring.py).

    env = gym.make("IWS-TPushing-v0", scorer=TPushCoverageScorer(method="pose"))
"""
from __future__ import annotations

import numpy as np

from iws_gym.tasks.pusht.groundtruth import GOAL_POSE, SUCCESS_THRESHOLD
from iws_gym.tasks.scoring import ProbabilityScorer, Score  # noqa: F401  (the protocol; re-exported)
from iws_gym.tasks.pusht.pose import agent_mask, estimate, render_t, unmix

FILL_RGB = np.array([143.0, 163.0, 184.0])     # the block's fill, as gym-pusht draws it
OUTLINE_RGB = np.array([119.0, 136.0, 153.0])  # its outline: a band about one frame pixel wide across the polygon's edge
# coverage = the goal-weighted sum of FILL_W x fill fraction + OUTLINE_W x outline fraction per pixel: the outline
# lies half outside the true polygon, and anti-aliasing blends the fill into it. Least squares of gym-pusht's
# exact coverage on rendered frames (`fit_weights(calibration_frames(400, seed=1))`; a test refits on other frames)
FILL_W, OUTLINE_W = 1.06, 0.45


def block_parts(frame: np.ndarray) -> np.ndarray:
    """(H, W, 2) fill and outline fractions of each pixel: least-squares unmixing against the background
    (white, the goal, their blends, the walls) that explains the pixel best; 0 on and around the agent."""
    return unmix(frame, [FILL_RGB, OUTLINE_RGB]) * (~agent_mask(frame))[..., None]


def calibration_frames(n: int, seed: int, frame_size: int = 128):
    """n gym-pusht frames of the block near the goal (offsets of 2-100 px and up to ~1.7 rad; the agent drawn
    nearby) and their exact coverages: the range where success is decided, which scripted play rarely reaches."""
    from iws_gym.tasks.pusht.groundtruth import coverage_of, make_env, render_states

    env, rng, goal = make_env(frame_size), np.random.default_rng(seed), np.asarray(GOAL_POSE, float)
    frames, cov = [], []
    for _ in range(n):
        scale = rng.choice([2.0, 5.0, 10.0, 30.0, 100.0])
        pose = goal + np.array([rng.normal(0, scale), rng.normal(0, scale), rng.normal(0, scale / 60)])
        agent = pose[:2] + rng.normal(0, 80, 2)
        frames.append(render_states(agent[None], pose[None], frame_size, env)[0])
        cov.append(coverage_of(pose))
    return np.stack(frames), np.array(cov)


def fit_weights(frames: np.ndarray, coverage: np.ndarray, frame_size: int = 128) -> tuple[float, float]:
    """Least-squares FILL_W, OUTLINE_W of the pixel scorer on frames with known coverage."""
    s = TPushCoverageScorer(frame_size=frame_size)
    parts = np.array([s.parts(f) for f in frames])
    w = np.linalg.lstsq(parts, coverage, rcond=None)[0]
    return float(w[0]), float(w[1])


def goal_mask(frame_size: int = 128) -> np.ndarray:
    """(H, W) anti-aliased coverage of the goal T at frame resolution."""
    ys, xs = np.mgrid[0:frame_size, 0:frame_size]
    return render_t(GOAL_POSE, ys.ravel().astype(float), xs.ravel().astype(float), scale=512.0 / frame_size).reshape(frame_size, frame_size)


class TPushCoverageScorer:
    """Push-T's reward from pixels: coverage of the goal T by the block, as gym-pusht defines it
    (reward = clip(coverage / 0.95, 0, 1), success = coverage > 0.95).

    method="pixels" (default, ~1 ms): the block's fill and outline fractions of each goal pixel, weighted
    (FILL_W, OUTLINE_W) and averaged over the goal.
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
        fill, outline = self.parts(frame)
        return float(np.clip(FILL_W * fill + OUTLINE_W * outline, 0.0, 1.0))

    def parts(self, frame: np.ndarray) -> np.ndarray:
        """The goal-weighted fill and outline fractions (2,), each a share of the goal's area."""
        x = block_parts(frame[self.box])  # per-pixel unmixing: the crop changes nothing (but a 1-px agent-mask edge)
        return (x * self.goal[self.box][..., None]).sum((0, 1)) / self.goal_area

    def __call__(self, frames: np.ndarray) -> list[Score]:
        out = []
        for f in frames:
            c = self.coverage(f)
            out.append(Score(float(np.clip(c / SUCCESS_THRESHOLD, 0, 1)), bool(c > SUCCESS_THRESHOLD), {"coverage": c}))
        return out
