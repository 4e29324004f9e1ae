"""The ground truth: gym-pusht's Push-T (pymunk physics, 10 Hz), plus the T geometry shared by the
pose estimator and the scorer.

Conventions (gym-pusht's): the canvas is 512x512 with y pointing down (image rows), actions are absolute
agent targets in [0, 512]^2, the block pose is (x, y, angle) of the body origin, and the goal pose is
fixed at (256, 256, pi/4). Frames are rendered at 512 and resized to 128 with cv2 INTER_LINEAR.
"""
from __future__ import annotations

import warnings

import numpy as np

from iws_gym.tasks.pusht.geometry import GOAL_POSE, T_BAR, T_STEM

SUCCESS_THRESHOLD = 0.95


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


def reset_state(env) -> np.ndarray:
    """The `reset_to_state` vector that puts a PushTEnv back exactly where `env` is now.

    gym-pusht's `_set_state` places the block's body at p (angle 0) and then turns it about its centre of
    gravity c, which stays put: the body ends at o = p + c - R(angle) c, not at p. Its own seeded reset goes
    through the same call, so the vector to record is p = o - c + R(angle) c for the body position o seen
    now (tests/test_policy_eval.py checks that a seeded reset is reproduced exactly)."""
    o, th = np.array(env.block.position), float(env.block.angle)
    c = np.array(env.block.center_of_gravity)
    rot = np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
    p = o - c + rot @ c
    return np.array([*env.agent.position, *p, th])


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


def corrupt_block(frames: np.ndarray, agent_pos: np.ndarray, block_pose: np.ndarray, rng, frame_size: int = 128,
                  env=None, keep=(0.3, 0.9), shift_px: float = 15.0, turn_rad: float = 0.2) -> np.ndarray:
    """An episode's frames (T, H, W, 3) uint8 with the T block drawn the way a dynamics model unsure of a
    push draws it. Per frame, with equal odds:
      fade:  the real frame keeps a weight w ~ U(keep), the rest goes to the frame without the block;
      ghost: likewise, the rest to the block at a wrong pose (shifted N(0, shift_px) canvas px per axis,
             turned N(0, turn_rad)).
    Every part is an exact render with the agent at its real place, so the agent is unchanged."""
    T = len(frames)
    if not (len(agent_pos) == len(block_pose) == T):
        raise ValueError(f"corrupt_block: {T} frames, {len(agent_pos)} agent positions, {len(block_pose)} block poses")
    agent_pos, block_pose = np.asarray(agent_pos, dtype=np.float64), np.asarray(block_pose, dtype=np.float64)
    w = rng.uniform(*keep, T)
    other = block_pose + np.c_[rng.normal(0, shift_px, (T, 2)), rng.normal(0, turn_rad, T)]
    fade = np.minimum((rng.random(T) * 2).astype(int), 1) == 0
    other[fade] = OFF_CANVAS_BLOCK
    wb = w[:, None, None, None]
    mixed = wb * frames + (1 - wb) * render_states(agent_pos, other, frame_size, env)
    return np.rint(mixed).clip(0, 255).astype(np.uint8)
