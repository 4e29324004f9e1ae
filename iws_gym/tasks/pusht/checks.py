"""T pushing's frame checks for `iws eval stability` (evaluation/stability.py): the statistics a valid frame keeps
inside the envelope of real gym-pusht frames, whether its T is whole, and how far a still world's T drifts."""
from __future__ import annotations

import numpy as np

from iws_gym.tasks.pusht.pose import (WHOLE_AREA_TOL, WHOLE_INSIDE, WHOLE_IOU, block_fraction, calibrate_whole_t, estimate,
                                      inside_share, is_whole_t)

# colours a Push-T frame is made of (RGB): background, goal, block fill/outline, agent, walls
PALETTE = np.array([[255, 255, 255], [144, 238, 144], [143, 163, 184], [119, 136, 153], [65, 105, 225], [211, 211, 211]],
                   dtype=np.float32)
FOUND = ("agent_found", "block_found")  # must be true
RANGED = ("agent_area", "block_area", "fit_residual", "block_inside", "mean_r", "mean_g", "mean_b", "off_palette")
UPPER_ONLY = ("fit_residual", "off_palette")  # one-sided: only an upper bound
VALIDITY = ("agent and block detectable; agent area, block area, T-fit residual, share of the fitted T inside the "
            "frame, mean colour and off-palette share inside the envelope of real frames (widened by 25% of its span)")

WHOLE_KEY, DRIFT_KEY, LOST_KEY = "t_whole", "block_drift_px", "block_lost_share"  # the names of its report entries


def off_palette(frame: np.ndarray, palette: np.ndarray) -> float:
    """Share of pixels farther than 40 grey levels from the segment between any two palette colours (anti-aliased
    edges are mixes of two)."""
    f = frame.astype(np.float32)
    d = np.full(f.shape[:2], np.inf, dtype=np.float32)
    for i in range(len(palette)):
        for j in range(i, len(palette)):
            p, q = palette[i], palette[j]
            v = q - p
            t = np.clip(((f - p) @ v) / max(float(v @ v), 1e-6), 0, 1) if i != j else np.zeros(f.shape[:2], np.float32)
            d = np.minimum(d, np.linalg.norm(f - (p + t[..., None] * v), axis=-1))
    return float((d > 40).mean())


def agent_area(frame: np.ndarray) -> float:
    f = frame.astype(np.float32)
    return float(np.clip((f[..., 2] - 0.5 * (f[..., 0] + f[..., 1]) - 40.0) / 60.0, 0, 1).sum())


def frame_stats(frame: np.ndarray) -> dict:
    """Statistics of one (H, W, 3) uint8 frame that the validity checks use."""
    f = frame.astype(np.float32)
    a, _ = block_fraction(frame)
    est = estimate(frame)
    return dict(agent_found=est.agent is not None, block_found=est.block is not None,
                agent_area=agent_area(frame), block_area=float(np.clip(a, 0, 1).sum()),
                fit_residual=float(est.fit_residual) if est.block is not None else float("nan"),
                block_inside=inside_share(est.block, frame.shape[0]) if est.block is not None else float("nan"),
                mean_r=float(f[..., 0].mean()), mean_g=float(f[..., 1].mean()), mean_b=float(f[..., 2].mean()),
                off_palette=off_palette(frame, PALETTE))


def envelope_bounds(k: str, lo: float, hi: float, margin: float) -> list[float]:
    """[lo, hi] of statistic k over real frames, widened by `margin` of its span."""
    span = max(hi - lo, 1e-6)
    if k == "block_inside":  # a real T is never off the table; 2% slack for a fit a pixel off at the wall
        return [min(lo - margin * span, lo - 0.02), 1.0 + 1e-6]
    if k in UPPER_ONLY:
        return [0.0, hi + margin * span + (0.01 if k == "off_palette" else 0.0)]
    return [lo - margin * span, hi + margin * span]


def calibrate_whole(frames: np.ndarray) -> dict:
    """The whole-T rule's parameters from real frames (the fit-residual bound)."""
    return dict(residual_max=calibrate_whole_t(frames), area_tol=WHOLE_AREA_TOL, iou_min=WHOLE_IOU, inside_min=WHOLE_INSIDE)


def is_whole(frame: np.ndarray, whole: dict) -> bool:
    return is_whole_t(estimate(frame), frame.shape[0], whole["residual_max"])


def still_drift(frame: np.ndarray, first: np.ndarray) -> float:
    """How far (canvas px) the T sits from where it was in the first frame; NaN where either has none."""
    a, b = estimate(frame).block, estimate(first).block
    return float(np.linalg.norm(a[:2] - b[:2])) if a is not None and b is not None else float("nan")
