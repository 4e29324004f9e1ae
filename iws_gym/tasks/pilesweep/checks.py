"""Pile sweeping's frame checks for `iws eval stability` (evaluation/stability.py): the statistics a valid frame
keeps inside the envelope of real frames, and whether its pile is whole (the puck count read within 5%)."""
from __future__ import annotations

import numpy as np

from iws_gym.tasks.pilesweep.scorer import SHARP_MIN, PileCoverageScorer, ink_sharpness
from iws_gym.tasks.pusht.checks import agent_area, off_palette
from iws_gym.tasks.pusht.pose import agent_position  # the agent is gym-pusht's blue disc, drawn the same

# colours a pile frame is made of (RGB): background, goal, a puck's ring and its lighter centre, agent, walls
PALETTE = np.array([[255, 255, 255], [144, 238, 144], [255, 140, 0], [255, 168, 0], [65, 105, 225], [211, 211, 211]],
                   dtype=np.float32)
FOUND = ("agent_found",)
RANGED = ("agent_area", "pieces", "sharpness", "mean_r", "mean_g", "mean_b", "off_palette")
UPPER_ONLY = ("off_palette",)
WHOLE_TOL = 0.05
VALIDITY = ("agent detectable; agent area, puck count read from the ink, the ink's sharpness, mean colour and "
            "off-palette share inside the envelope of real frames (widened by 25% of its span)")

WHOLE_KEY, DRIFT_KEY, LOST_KEY = "pieces_whole", "coverage_drift", "coverage_lost_share"  # the names of its report entries


def frame_stats(frame: np.ndarray) -> dict:
    f = frame.astype(np.float32)
    coverage, pieces = PileCoverageScorer(frame.shape[0]).read(frame)
    return dict(agent_found=agent_position(frame) is not None, agent_area=agent_area(frame), pieces=pieces,
                sharpness=ink_sharpness(frame), coverage=coverage, mean_r=float(f[..., 0].mean()), mean_g=float(f[..., 1].mean()),
                mean_b=float(f[..., 2].mean()), off_palette=off_palette(frame, PALETTE))


def envelope_bounds(k: str, lo: float, hi: float, margin: float) -> list[float]:
    span = max(hi - lo, 1e-6)
    if k in UPPER_ONLY:
        return [0.0, hi + margin * span + 0.01]
    return [lo - margin * span, hi + margin * span]


def calibrate_whole(frames: np.ndarray) -> dict:
    """The whole-pile rule: the count read from real frames (their median is the true count) within WHOLE_TOL,
    and the ink drawn as pucks (sharpness >= SHARP_MIN)."""
    counts = [frame_stats(f)["pieces"] for f in frames]
    return dict(count=float(np.round(np.median(counts))), tol=WHOLE_TOL, sharp_min=SHARP_MIN)


def is_whole(frame: np.ndarray, whole: dict) -> bool:
    pieces = PileCoverageScorer(frame.shape[0]).read(frame)[1]  # only the count and the sharpness, not every statistic
    return bool(abs(pieces - whole["count"]) <= whole["tol"] * whole["count"] and ink_sharpness(frame) >= whole["sharp_min"])


def still_drift(frame: np.ndarray, first: np.ndarray) -> float:
    """How far the pile moved from the first frame: the in-region share's change (a share, not px)."""
    s = PileCoverageScorer(frame.shape[0])
    return abs(s.read(frame)[0] - s.read(first)[0])
