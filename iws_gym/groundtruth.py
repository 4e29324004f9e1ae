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
        env.agent.position = (float(a[0]), float(a[1]))
        env.block.angle = float(b[2])
        env.block.position = (float(b[0]), float(b[1]))
        for body in (env.agent, env.block):  # refresh the shapes' cached world vertices without stepping physics
            env.space.reindex_shapes_for_body(body)
        out.append(env._render())
    return np.stack(out)


def render_without_agent(block_pose: np.ndarray, frame_size: int = 128, env=None) -> np.ndarray:
    """The frames of an episode's block poses (T, 3) with the agent left out: (T, H, W, 3) uint8."""
    return render_states(np.tile(np.asarray(OFF_CANVAS), (len(block_pose), 1)), block_pose, frame_size, env)


OFF_CANVAS_BLOCK = (-1000.0, -1000.0, 0.0)  # a block pose far off the canvas: a frame rendered without the block


def corrupt_block(frames: np.ndarray, agent_pos: np.ndarray, block_pose: np.ndarray, rng, frame_size: int = 128,
                  env=None, keep=(0.3, 0.9), shift_px: float = 15.0, turn_rad: float = 0.2) -> np.ndarray:
    """An episode's frames (T, H, W, 3) uint8 with the T block drawn the way a dynamics model unsure of a
    push draws it: per frame, the real frame keeps a weight w ~ U(keep) and the rest goes, with equal
    odds, to the same state rendered without the block (a faded block) or with the block at a wrong
    pose (shifted N(0, shift_px) canvas px per axis, turned N(0, turn_rad): a ghost). Every part is an
    exact render with the agent at its real place, so the agent is unchanged. Returns (T, H, W, 3) uint8."""
    T = len(frames)
    if not (len(agent_pos) == len(block_pose) == T):
        raise ValueError(f"corrupt_block: {T} frames, {len(agent_pos)} agent positions, {len(block_pose)} block poses")
    w = rng.uniform(*keep, T)
    other = np.asarray(block_pose, dtype=np.float64) + np.c_[rng.normal(0, shift_px, (T, 2)), rng.normal(0, turn_rad, T)]
    other[rng.random(T) < 0.5] = OFF_CANVAS_BLOCK
    w = w[:, None, None, None]
    out = w * frames + (1 - w) * render_states(agent_pos, other, frame_size, env)
    return np.rint(out).clip(0, 255).astype(np.uint8)
