"""The ground truth: gym-pusht's Push-T (pymunk physics, 10 Hz), plus the T geometry shared by the
pose estimator and the scorer.

Conventions (gym-pusht's): the canvas is 512x512 with y pointing down (image rows), actions are absolute
agent targets in [0, 512]^2, the block pose is (x, y, angle) of the body origin, and the goal pose is
fixed at (256, 256, pi/4). Frames are rendered at 512 and resized to 128 with cv2 INTER_LINEAR.
"""
from __future__ import annotations

import warnings

import numpy as np

GOAL_POSE = np.array([256.0, 256.0, np.pi / 4])
AGENT_RADIUS = 15.0
SUCCESS_THRESHOLD = 0.95
CANVAS = 512.0

# The T in its body frame (gym-pusht's add_tee with scale 30, length 4): a bar on top, a stem below.
T_BAR = np.array([[-60.0, 30.0], [60.0, 30.0], [60.0, 0.0], [-60.0, 0.0]])
T_STEM = np.array([[-15.0, 30.0], [-15.0, 120.0], [15.0, 120.0], [15.0, 30.0]])
T_COG = np.array([0.0, 45.0])  # gym-pusht sets the centre of gravity to the mean of the two part centroids
# Area centroid of the T (bar 120x30 centred at y=15, stem 30x90 centred at y=75): what a pixel mask's mean measures.
T_AREA_CENTROID = np.array([0.0, (3600 * 15.0 + 2700 * 75.0) / 6300.0])


def rot(theta: float) -> np.ndarray:
    c, s = np.cos(theta), np.sin(theta)
    return np.array([[c, -s], [s, c]])


def t_polygons(pose) -> list[np.ndarray]:
    """World-frame vertices (4, 2) of the bar and the stem for a block pose (x, y, angle)."""
    x, y, th = pose
    R = rot(th)
    return [v @ R.T + np.array([x, y]) for v in (T_BAR, T_STEM)]


def coverage_of(pose) -> float:
    """Fraction of the goal T covered by a T at `pose`, exactly as gym-pusht computes it (shapely)."""
    import shapely.geometry as sg

    block = sg.MultiPolygon([sg.Polygon(p) for p in t_polygons(pose)])
    goal = sg.MultiPolygon([sg.Polygon(p) for p in t_polygons(GOAL_POSE)])
    return float(goal.intersection(block).area / goal.area)


def wrap_angle(a):
    return (np.asarray(a) + np.pi) % (2 * np.pi) - np.pi


def make_env(frame_size: int = 128):
    """gym-pusht's PushT-v0 returning pixels_agent_pos at `frame_size`, without the TimeLimit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import gym_pusht.envs  # noqa: F401  (imports pygame quietly)
        from gym_pusht.envs.pusht import PushTEnv
    return PushTEnv(obs_type="pixels_agent_pos", observation_width=frame_size, observation_height=frame_size)


def get_state(env) -> np.ndarray:
    """[agent x, agent y, block x, block y, block angle] of an unwrapped PushTEnv (angle wrapped to [-pi, pi))."""
    a, b = env.agent.position, env.block.position
    return np.array([a.x, a.y, b.x, b.y, float(wrap_angle(env.block.angle))])


def render_state(state, frame_size: int = 128, env=None) -> np.ndarray:
    """Render [agent x, y, block x, y, angle] with gym-pusht's own renderer. Returns (H, W, 3) uint8."""
    env = env or make_env(frame_size)
    obs, _ = env.reset(options={"reset_to_state": np.asarray(state, dtype=np.float64)})
    return obs["pixels"]


OFF_CANVAS = (-1000.0, -1000.0)  # an agent position far off the canvas: a frame rendered without the agent


def render_states(agent_pos: np.ndarray, block_pose: np.ndarray, frame_size: int = 128, env=None) -> np.ndarray:
    """Render true states exactly (angle set before position, unlike reset_to_state's legacy order):
    agent_pos (T, 2), block_pose (T, 3) -> (T, H, W, 3) uint8. An agent at OFF_CANVAS is not drawn."""
    env = env or make_env(frame_size)
    env.reset(seed=0)
    out = []
    for a, b in zip(agent_pos, block_pose):
        _place(env, a, b)
        out.append(env._render())
    return np.stack(out)


def _place(env, agent_pos, block_pose) -> None:
    """Move the agent and the block of a reset PushTEnv without stepping physics."""
    env.agent.position = (float(agent_pos[0]), float(agent_pos[1]))
    env.block.angle = float(block_pose[2])
    env.block.position = (float(block_pose[0]), float(block_pose[1]))
    for body in (env.agent, env.block):  # refresh the shapes' cached world vertices
        env.space.reindex_shapes_for_body(body)


def render_without_agent(block_pose: np.ndarray, frame_size: int = 128, env=None) -> np.ndarray:
    """The frames of an episode's block poses (T, 3) with the agent left out: (T, H, W, 3) uint8."""
    return render_states(np.tile(np.asarray(OFF_CANVAS), (len(block_pose), 1)), block_pose, frame_size, env)


OFF_CANVAS_BLOCK = (-1000.0, -1000.0, 0.0)  # a block pose far off the canvas: a frame rendered without the block


CORRUPT_KINDS = ("fade", "ghost", "bend")


def check_corrupt_kinds(kinds, what: str = "corrupt_block: kinds") -> tuple[str, ...]:
    """`kinds` as a tuple if it names distinct entries of CORRUPT_KINDS; else a ValueError naming `what`."""
    kinds = tuple(kinds)
    if not kinds or set(kinds) - set(CORRUPT_KINDS) or len(set(kinds)) != len(kinds):
        raise ValueError(f"{what} must be distinct names from {', '.join(CORRUPT_KINDS)}, got {kinds}")
    return kinds


def corrupt_block(frames: np.ndarray, agent_pos: np.ndarray, block_pose: np.ndarray, rng, frame_size: int = 128,
                  env=None, keep=(0.3, 0.9), shift_px: float = 15.0, turn_rad: float = 0.2,
                  kinds: tuple[str, ...] = ("fade", "ghost"), part_alpha=(0.4, 1.0)) -> np.ndarray:
    """An episode's frames (T, H, W, 3) uint8 with the T block drawn the way a dynamics model unsure of a
    push draws it. Per frame one of `kinds`, with equal odds:
      fade:  the real frame keeps a weight w ~ U(keep), the rest goes to the frame without the block;
      ghost: likewise, the rest to the block at a wrong pose (shifted N(0, shift_px) canvas px per axis,
             turned N(0, turn_rad));
      bend:  no real frame; the bar and the stem at slightly different poses (`bend_poses`), each with its
             own contrast ~ U(part_alpha) (`render_bent`): the split, thinning T a long push produces.
    Every part is an exact render with the agent at its real place, so the agent is unchanged.
    Returns (T, H, W, 3) uint8."""
    T = len(frames)
    if not (len(agent_pos) == len(block_pose) == T):
        raise ValueError(f"corrupt_block: {T} frames, {len(agent_pos)} agent positions, {len(block_pose)} block poses")
    kinds = check_corrupt_kinds(kinds)
    agent_pos, block_pose = np.asarray(agent_pos, dtype=np.float64), np.asarray(block_pose, dtype=np.float64)
    w = rng.uniform(*keep, T)
    other = block_pose + np.c_[rng.normal(0, shift_px, (T, 2)), rng.normal(0, turn_rad, T)]
    kind = np.asarray(kinds)[np.minimum((rng.random(T) * len(kinds)).astype(int), len(kinds) - 1)]
    other[kind == "fade"] = OFF_CANVAS_BLOCK
    out = np.empty(np.shape(frames), np.uint8)
    blend = kind != "bend"
    if blend.any():
        wb = w[blend][:, None, None, None]
        mixed = wb * frames[blend] + (1 - wb) * render_states(agent_pos[blend], other[blend], frame_size, env)
        out[blend] = np.rint(mixed).clip(0, 255).astype(np.uint8)
    if (~blend).any():
        bar, stem = bend_poses(block_pose[~blend], rng)
        alpha = rng.uniform(*part_alpha, (2, int((~blend).sum())))
        out[~blend] = render_bent(agent_pos[~blend], bar, stem, alpha[0], alpha[1], frame_size, env)
    return out


T_JOINT = np.array([0.0, 30.0])  # where the stem meets the bar, in the body frame


def bend_poses(block_pose: np.ndarray, rng, bend_rad: float = 0.35, bar_shift_px: float = 4.0,
               bar_turn_rad: float = 0.08, stem_shift_px: float = 6.0) -> tuple[np.ndarray, np.ndarray]:
    """A split T for block poses (T, 3): the bar near the real pose (N(0, bar_shift_px) per axis,
    N(0, bar_turn_rad)), the stem turned about the joint with the bar by N(0, bend_rad) and shifted
    N(0, stem_shift_px). Returns the poses (T, 3) the bar and the stem are each drawn at."""
    pose = np.asarray(block_pose, dtype=np.float64)
    T = len(pose)
    bar = pose + np.c_[rng.normal(0, bar_shift_px, (T, 2)), rng.normal(0, bar_turn_rad, T)]
    th = bar[:, 2] + rng.normal(0, bend_rad, T)
    joint = bar[:, :2] + np.einsum("tij,j->ti", np.stack([rot(a) for a in bar[:, 2]]), T_JOINT)
    stem_xy = joint - np.einsum("tij,j->ti", np.stack([rot(a) for a in th]), T_JOINT) + rng.normal(0, stem_shift_px, (T, 2))
    return bar, np.c_[stem_xy, th]


def render_bent(agent_pos: np.ndarray, bar_pose: np.ndarray, stem_pose: np.ndarray, bar_alpha: np.ndarray,
                stem_alpha: np.ndarray, frame_size: int = 128, env=None) -> np.ndarray:
    """Frames (T, H, W, 3) uint8 of a T whose bar and stem sit at different poses, each drawn with its own
    contrast alpha in [0, 1] (0: not drawn). gym-pusht draws the bar and the stem as two shapes of one
    body and cannot split them, so each part is cut out of an exact 512 px render of the whole block at
    that part's pose (a polygon mask, grown by 3 px to take the outline) and laid over the 512 px render
    without the block, then resized the way gym-pusht resizes (cv2, bilinear)."""
    import cv2
    import pygame

    env = env or make_env(frame_size)
    env.reset(seed=0)
    out = []
    for a, pb, ps, ab, ast in zip(agent_pos, bar_pose, stem_pose, bar_alpha, stem_alpha):
        screens = []
        for b in (OFF_CANVAS_BLOCK, pb, ps):
            _place(env, a, b)
            screens.append(np.transpose(np.array(pygame.surfarray.pixels3d(env._draw())), (1, 0, 2)))
        s0, s_bar, s_stem = screens
        polys = [t_polygons(pb)[0], t_polygons(ps)[1]]
        # only the box around both parts changes: composite there
        lo = np.clip(np.floor(np.concatenate(polys).min(0)) - 6, 0, CANVAS).astype(int)
        hi = np.clip(np.ceil(np.concatenate(polys).max(0)) + 7, 0, CANVAS).astype(int)
        box = (slice(lo[1], hi[1]), slice(lo[0], hi[0]))
        m_bar, m_stem = (_polygon_mask(q - lo, hi - lo) for q in polys)
        m_stem = m_stem * (1 - m_bar)  # where the parts overlap, the bar is drawn
        c0 = s0[box].astype(np.float32)
        crop = c0 + (ab * m_bar)[..., None] * (s_bar[box] - c0) + (ast * m_stem)[..., None] * (s_stem[box] - c0)
        img = s0.copy()
        img[box] = np.rint(crop).clip(0, 255).astype(np.uint8)
        out.append(cv2.resize(img, (frame_size, frame_size)))
    return np.stack(out)


def _polygon_mask(poly: np.ndarray, size, grow_px: int = 3) -> np.ndarray:
    """A float mask (h, w) of `poly` (pixel x, y) on a (w, h) = size canvas, grown by grow_px."""
    import cv2

    m = np.zeros((int(size[1]), int(size[0])), np.uint8)
    cv2.fillPoly(m, [np.rint(poly).astype(np.int32)], 1)
    return cv2.dilate(m, np.ones((2 * grow_px + 1,) * 2, np.uint8)).astype(np.float32)
