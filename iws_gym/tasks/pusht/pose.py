"""Read physical state from a 128x128 Push-T frame: agent position, T-block pose, goal coverage.

Used on ground-truth and model frames alike, so fidelity can be reported in physical units (px in the
512 canvas, rad) and so the learned env can score itself without hidden state.

* Agent: the blue disc (RoyalBlue) -> weighted centroid of "blueness".
* Block: each pixel's block fraction a in [0, 1], unmixing the slate-grey block colour against the
  white or light-green background it sits on; agent pixels are masked out (occlusion). The T pose is
  fitted to a by least squares against an anti-aliased T template rendered the way gym-pusht samples
  its 512 canvas down to 128 (cv2 INTER_LINEAR at 1/4 reads the 2x2 source pixels 4i+1..4i+2), first by
  a coarse angle sweep from the mask's centroid, then by pattern search on (x, y, angle).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from iws_gym.tasks.pusht.geometry import CANVAS, T_AREA, T_AREA_CENTROID, T_REACH, t_sdf_local
from iws_gym.tasks.pusht.groundtruth import coverage_of, rot, wrap_angle

BLOCK_RGB = np.array([131.0, 150.0, 169.0])  # between the block's fill (143,163,184) and its outline (119,136,153)
WHITE = np.array([255.0, 255.0, 255.0])
GOAL_RGB = np.array([144.0, 238.0, 144.0])   # LightGreen goal region
WALL_RGB = np.array([211.0, 211.0, 211.0])   # LightGray walls
# Backgrounds the block can be seen against: white, the goal, anti-aliased goal edges, and (for walls) grey.
BACKGROUNDS = [WHITE + b * (GOAL_RGB - WHITE) for b in (0.0, 0.25, 0.5, 0.75, 1.0)] + [WALL_RGB]
SCALE = 4.0                                   # 512 canvas px per frame px (at 128)
MIN_BLOCK_PIXELS = 30.0                       # below this the block counts as not visible


@dataclass
class FramePose:
    agent: np.ndarray | None      # (2,) in the 512 canvas, None if not visible
    block: np.ndarray | None      # (x, y, angle) of the body origin, None if not visible
    coverage: float               # nan if the block is not visible
    fit_residual: float           # mean squared template residual over the fit window (quality flag)
    block_area: float = float("nan")  # the block's pixels (frame px, fractional), whatever their shape
    block_map: tuple | None = field(default=None, repr=False, compare=False)  # (fraction, valid) behind the fit

    @property
    def t_iou(self) -> float:
        """IoU of the block's pixels with the rigid T at the fitted pose (the shape check; computed on demand,
        so the env's scorer does not pay for it): pixels at least half block against pixels at least half T;
        where the agent covers the block, neither counts."""
        if self.block is None or self.block_map is None:
            return float("nan")
        a, valid = self.block_map
        ys, xs = np.mgrid[: a.shape[0], : a.shape[1]].astype(np.float64)
        v = valid > 0.5
        t, m = (render_t(self.block, ys, xs, scale=CANVAS / a.shape[0]) > 0.5) & v, (a > 0.5) & v
        return float((t & m).sum() / max((t | m).sum(), 1))


def agent_position(frame: np.ndarray) -> np.ndarray | None:
    f = frame.astype(np.float32)
    blue = np.clip((f[..., 2] - 0.5 * (f[..., 0] + f[..., 1]) - 40.0) / 60.0, 0, 1)  # ~1 on the disc, 0 on grey/green/white
    w = blue.sum()
    if w < 3:
        return None
    ys, xs = np.mgrid[0 : frame.shape[0], 0 : frame.shape[1]]
    s = 512.0 / frame.shape[0]
    # pixel i samples the 512 canvas around s*i + s/2 (see module docstring)
    return np.array([(xs * blue).sum() / w * s + s / 2, (ys * blue).sum() / w * s + s / 2])


def unmix(frame: np.ndarray, colours) -> np.ndarray:
    """(H, W, k) fractions in [0, 1] of k colours in each pixel: least squares against the background of
    BACKGROUNDS that explains the pixel best (smallest residual)."""
    f = np.asarray(frame, np.float32)
    best_x, best_r = None, None
    for bg in BACKGROUNDS:
        d = np.stack([np.asarray(c, np.float32) - bg for c in colours], 1)  # (3, k)
        x = np.clip((f - bg) @ d @ np.linalg.inv(d.T @ d), 0, 1)
        r = np.linalg.norm(f - (bg + x @ d.T), axis=-1)
        if best_x is None:
            best_x, best_r = x, r
        else:
            take = r < best_r
            best_x, best_r = np.where(take[..., None], x, best_x), np.where(take, r, best_r)
    return best_x


def block_fraction(frame: np.ndarray):
    """(H, W) block fraction in [0, 1] and (H, W) validity weights (0 on and around the agent)."""
    f = frame.astype(np.float32)
    a = unmix(f, [BLOCK_RGB])[..., 0]
    a[a < 0.1] = 0.0  # residual colour noise, not block
    valid = ~agent_mask(f)
    return a * valid, valid.astype(np.float32)


def agent_mask(frame: np.ndarray) -> np.ndarray:
    """(H, W) bool: the blue agent and a one-pixel ring around it (its anti-aliased edge)."""
    f = np.asarray(frame, np.float32)
    blue = (f[..., 2] - 0.5 * (f[..., 0] + f[..., 1])) > 70  # the block itself is bluish (~30)
    return _dilate(blue, 1)


def _dilate(m: np.ndarray, r: int) -> np.ndarray:
    out = m.copy()
    for dy in range(-r, r + 1):
        for dx in range(-r, r + 1):
            out |= np.roll(np.roll(m, dy, 0), dx, 1)
    return out


def render_t(pose, ys: np.ndarray, xs: np.ndarray, scale: float = SCALE) -> np.ndarray:
    """Anti-aliased T coverage at frame pixels (ys, xs), as gym-pusht's resize samples it: the mean of two
    adjacent canvas pixels per axis, i.e. a box filter of width scale/2 -> a linear ramp across each edge."""
    dx, dy = xs * scale + scale / 2 - pose[0], ys * scale + scale / 2 - pose[1]  # canvas coords - body origin
    (r00, r01), (r10, r11) = rot(pose[2])
    lx, ly = dx * r00 + dy * r10, dx * r01 + dy * r11                            # world -> body frame
    sdf = t_sdf_local(lx, ly)
    return np.clip(0.5 - sdf / (scale / 2), 0.0, 1.0)


def fit_block(a: np.ndarray, valid: np.ndarray):
    """Least-squares T pose for a block-fraction map. Returns (pose, residual) or (None, nan)."""
    mass = a.sum()
    if mass < MIN_BLOCK_PIXELS:
        return None, float("nan")
    H, W = a.shape
    ys, xs = np.nonzero(a > 0.05)
    # Fit window: the mask's bounding box grown by the T's reach, so a wrong pose is penalised too.
    y0, y1 = max(0, ys.min() - 6), min(H, ys.max() + 7)
    x0, x1 = max(0, xs.min() - 6), min(W, xs.max() + 7)
    gy, gx = np.mgrid[y0:y1, x0:x1]
    gy, gx = gy.ravel().astype(np.float64), gx.ravel().astype(np.float64)
    target, w = a[y0:y1, x0:x1].ravel(), valid[y0:y1, x0:x1].ravel()
    cy = (np.arange(H)[:, None] * a).sum() / mass
    cx = (np.arange(W)[None, :] * a).sum() / mass
    centroid = np.array([cx * SCALE + SCALE / 2, cy * SCALE + SCALE / 2])

    def cost(p):
        return float((w * (render_t(p, gy, gx) - target) ** 2).sum())

    def from_centroid(th):  # body origin that puts the T's area centroid on the mask centroid
        return np.concatenate([centroid - rot(th) @ T_AREA_CENTROID, [th]])

    angles = np.linspace(-np.pi, np.pi, 48, endpoint=False)
    costs = [cost(from_centroid(th)) for th in angles]
    best = from_centroid(angles[int(np.argmin(costs))])
    best_c = min(costs)
    # Pattern search on (x, y, angle), halving the step when no move improves.
    step = np.array([6.0, 6.0, 0.08])
    for _ in range(60):
        improved = False
        for i in range(3):
            for sgn in (1.0, -1.0):
                cand = best.copy()
                cand[i] += sgn * step[i]
                c = cost(cand)
                if c < best_c:
                    best, best_c, improved = cand, c, True
        if not improved:
            step /= 2
            if step[0] < 0.1:
                break
    best[2] = float(wrap_angle(best[2]))
    return best, best_c / max(w.sum(), 1.0)


def estimate(frame: np.ndarray) -> FramePose:
    """All physical readings of one (H, W, 3) uint8 frame."""
    if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
        raise ValueError(f"expected an (H, W, 3) uint8 RGB frame, got shape {frame.shape} dtype {frame.dtype}")
    a, valid = block_fraction(frame)
    pose, res = fit_block(a, valid)
    cov = coverage_of(pose) if pose is not None else float("nan")
    return FramePose(agent_position(frame), pose, cov, res, float(np.clip(a, 0, 1).sum()), (a, valid))


def inside_share(pose, size: int) -> float:
    """Share of the T template at `pose` (canvas coords) that lies inside a size x size frame. The T reaches
    at most T_REACH canvas px from its body origin, so a border of that many frame px (plus the edge ramp)
    holds all of it."""
    scale = CANVAS / size
    b = int(np.ceil(T_REACH / scale)) + 2
    ys, xs = np.mgrid[-b : size + b, -b : size + b].astype(np.float64)
    t = render_t(pose, ys, xs, scale=scale)
    total = t.sum()
    return float(t[b:-b, b:-b].sum() / total) if total > 0 else float("nan")


WHOLE_AREA_TOL = 0.2  # a whole T's pixel area is within 20% of the true T's (of its part inside the frame)
WHOLE_IOU = 0.75      # ... its pixels overlap a rigid T at the fitted pose with IoU >= 0.75 (real frames: >= 0.81)
WHOLE_INSIDE = 0.9    # ... and that T is at least 90% inside the frame (a bar at the edge is not a T)


def t_area_px(frame_size: int) -> float:
    """The T's area in frame pixels at `frame_size` (gym-pusht renders the 512 canvas down)."""
    return T_AREA * (frame_size / CANVAS) ** 2


def calibrate_whole_t(frames: np.ndarray, widen: float = 0.25) -> float:
    """The fit-residual bound of a whole T, from real frames (N, H, W, 3): their largest residual, widened by
    `widen` of it. A predicted T that fits the rigid template worse than any real frame is not whole."""
    res = [estimate(f).fit_residual for f in frames]
    res = np.asarray([r for r in res if np.isfinite(r)])
    if not len(res):
        raise ValueError("calibrate_whole_t: no T found in any of the real frames")
    return float(res.max() * (1 + widen))


def is_whole_t(est: FramePose, frame_size: int, residual_max: float) -> bool:
    """Object permanence for the T: found by the pose reader, at least WHOLE_INSIDE inside the frame, its pixel
    area within WHOLE_AREA_TOL of a rigid T's at the fitted pose, overlapping that T with IoU >= WHOLE_IOU, and
    the rigid template fits it as well as it fits real frames (residual <= residual_max). A faded,
    bent, split or smeared T fails one of the three."""
    if est.block is None or not np.isfinite(est.fit_residual):
        return False
    return bool(abs(area_ratio(est, frame_size) - 1) <= WHOLE_AREA_TOL and est.fit_residual <= residual_max
                and est.t_iou >= WHOLE_IOU and inside_share(est.block, frame_size) >= WHOLE_INSIDE)


def area_ratio(est: FramePose, frame_size: int) -> float:
    """The block's pixel area over the area the rigid T at the fitted pose has inside the frame (NaN: no T)."""
    if est.block is None:
        return float("nan")
    return est.block_area / (t_area_px(frame_size) * max(inside_share(est.block, frame_size), 1e-6))


def pose_errors(est: FramePose, true_agent, true_block, true_coverage) -> dict:
    """Errors of an estimate against a true state (nan where the estimate is missing)."""
    nan = float("nan")
    return dict(
        agent_px=float(np.linalg.norm(est.agent - true_agent)) if est.agent is not None else nan,
        block_px=float(np.linalg.norm(est.block[:2] - true_block[:2])) if est.block is not None else nan,
        block_rad=float(abs(wrap_angle(est.block[2] - true_block[2]))) if est.block is not None else nan,
        coverage=float(abs(est.coverage - true_coverage)) if est.block is not None else nan,
    )


def compare(a: FramePose, b: FramePose) -> dict:
    """Errors of frame estimate `a` against frame estimate `b` (e.g. prediction vs ground truth)."""
    if b.block is None or b.agent is None:
        return dict(agent_px=float("nan"), block_px=float("nan"), block_rad=float("nan"), coverage=float("nan"))
    return pose_errors(a, b.agent, b.block, b.coverage)
