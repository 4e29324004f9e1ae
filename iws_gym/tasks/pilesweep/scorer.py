"""Pile sweeping's success scorer: the share of pieces inside the goal region, read from a frame.

A piece is drawn orange (red minus blue 255 on its ring and on its lighter centre) on a background whose red
minus blue is 0 (white, the goal's light green) or negative (the blue agent). Red minus blue is linear in the
colour, so the cv2 resize that blends a piece into its background keeps its sum: each piece adds the same
"mass" to the frame wherever it sits (within a few percent, from pygame's whole-pixel circles). The piece
count is the frame's mass over one piece's (PIECE_MASS, calibrated on rendered frames), and coverage is the
share of the mass inside the goal region. The protocol is tasks/scoring.py's.
"""
from __future__ import annotations

import numpy as np

from iws_gym.tasks.pilesweep.groundtruth import CANVAS, GOAL_BOX, SUCCESS_THRESHOLD
from iws_gym.tasks.scoring import Score

# one piece's red-minus-blue sum in a 128x128 frame: the mean over 400 single pieces at random places
# (`calibrate_piece_mass(400, seed=1)`; a test re-measures it on other places)
PIECE_MASS_128 = 4916.3
# Ink is conserved by blur too, so the count alone cannot tell drawn pucks from an orange smear. A pixel wholly
# inside a puck has the full 255; on real frames 80-95% of the ink lies in pixels of >= SHARP_INK, on the same
# frames blurred by one pixel (Gaussian sigma 1) under 50% (tests/test_pilesweep.py checks both). Whole pucks:
# a share >= SHARP_MIN.
SHARP_INK, SHARP_MIN = 200.0, 0.75


def piece_mass(frame: np.ndarray) -> np.ndarray:
    """(H, W) red minus blue, clipped at 0: the pieces' ink in each pixel."""
    f = np.asarray(frame, dtype=np.float32)
    return np.clip(f[..., 0] - f[..., 2], 0.0, None)


def ink_sharpness(frame: np.ndarray) -> float:
    """The share of the frame's ink in pixels of at least SHARP_INK (1.0 where there is no ink)."""
    m = piece_mass(frame)
    total = float(m.sum())
    return float(m[m >= SHARP_INK].sum() / total) if total > 0 else 1.0


def goal_mask(frame_size: int = 128) -> np.ndarray:
    """(H, W) share of each pixel inside the goal region."""
    s = frame_size / CANVAS
    edges = np.arange(frame_size + 1, dtype=np.float64)

    def overlap(lo, hi):  # per pixel column/row: the covered share of [i, i + 1]
        return np.clip(np.minimum(edges[1:], hi * s) - np.maximum(edges[:-1], lo * s), 0.0, 1.0)

    x0, y0, x1, y1 = GOAL_BOX
    return np.outer(overlap(y0, y1), overlap(x0, x1))


def calibrate_piece_mass(n: int, seed: int, frame_size: int = 128) -> float:
    """The mean mass of one piece drawn alone at n random places (on the table and on the goal)."""
    from iws_gym.tasks.pilesweep.groundtruth import N_PIECES, PileSweepEnv, render_state

    env = PileSweepEnv(obs_type="pixels", observation_width=frame_size, observation_height=frame_size)
    rng, masses = np.random.default_rng(seed), []
    away = [-100.0, -100.0] * (N_PIECES - 1)
    for _ in range(n):
        p = rng.uniform(30, CANVAS - 30, 2)
        masses.append(piece_mass(render_state([CANVAS - 20, CANVAS - 20, *p, *away], frame_size, env)).sum())
    return float(np.mean(masses))


class PileCoverageScorer:
    """coverage = share of the pieces' mass inside the goal region; reward = clip(coverage / 0.9, 0, 1),
    success = coverage >= 0.9, as the ground truth defines them on piece centres. info also carries
    `pieces`, the piece count read from the frame."""

    def __init__(self, frame_size: int = 128):
        self.frame_size = frame_size
        self.goal = goal_mask(frame_size)
        self.unit = PIECE_MASS_128 * (frame_size / 128.0) ** 2

    def read(self, frame: np.ndarray) -> tuple[float, float]:
        """(coverage, piece count) of one frame; coverage 0 where no piece is seen."""
        if frame.shape[:2] != (self.frame_size, self.frame_size):
            raise ValueError(f"PileCoverageScorer: frame of shape {frame.shape}, built for {self.frame_size}x{self.frame_size}")
        m = piece_mass(frame)
        total = float(m.sum())
        return (float((m * self.goal).sum() / total) if total > 0 else 0.0), total / self.unit

    def coverage(self, frame: np.ndarray) -> float:
        return self.read(frame)[0]

    def __call__(self, frames: np.ndarray) -> list[Score]:
        out = []
        for f in frames:
            c, n = self.read(f)
            out.append(Score(float(np.clip(c / SUCCESS_THRESHOLD, 0, 1)), bool(c >= SUCCESS_THRESHOLD),
                             {"coverage": c, "pieces": n}))
        return out
