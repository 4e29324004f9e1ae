"""The ground truth of pile sweeping: a pile of small discs on a table, swept into a square goal region by
the same disc agent as gym-pusht's (pymunk, 10 Hz, absolute targets in [0, 512]^2, PD control).

Conventions are gym-pusht's, so that a Push-T policy's plumbing runs unchanged: a 512x512 canvas with y
pointing down (image rows), walls 5 px inside its edge, the agent a kinematic disc of radius 15 driven
towards the action by PD control (k_p 100, k_v 20) over ten 10 ms physics steps, no damping carried from
one step to the next (the table's friction: a piece moves only while something pushes it), frames drawn
with gym-pusht's renderer at 512 and resized with cv2. `coverage` is the share of pieces whose centre lies
inside the goal region; an episode succeeds, and terminates, at coverage >= 0.9.

State vector (`obs_type="state"`, `reset_to_state`): [agent x, agent y, piece 1 x, piece 1 y, ...].
"""
from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
from gymnasium import spaces

CANVAS = 512.0
AGENT_RADIUS = 15.0
PIECE_RADIUS = 10.0
N_PIECES = 40
GOAL_BOX = (160.0, 160.0, 352.0, 352.0)  # x0, y0, x1, y1: the goal region, a 192 px square in the middle
WALL_LO, WALL_HI = 5.0, 506.0            # gym-pusht's walls (segments of radius 2)
SUCCESS_THRESHOLD = 0.9
PIECE_COLOR = "DarkOrange"               # drawn with gym-pusht's renderer: a ring and a lighter inner disc


def inside_goal(xy) -> np.ndarray:
    """(..., 2) positions -> (...) bool: the centre lies inside the goal region."""
    xy = np.asarray(xy, dtype=np.float64)
    x0, y0, x1, y1 = GOAL_BOX
    return (xy[..., 0] >= x0) & (xy[..., 0] <= x1) & (xy[..., 1] >= y0) & (xy[..., 1] <= y1)


def coverage_of(pieces) -> float:
    """Share of pieces (N, 2) whose centre is inside the goal region."""
    pieces = np.asarray(pieces, dtype=np.float64).reshape(-1, 2)
    return float(inside_goal(pieces).mean()) if len(pieces) else 0.0


def sample_pile(rng: np.random.Generator, n: int = N_PIECES, agent=None) -> np.ndarray:
    """n non-overlapping piece centres (n, 2): one pile, centred outside the goal region; pieces keep clear
    of the walls and of the agent at `agent`."""
    lo, hi = 45.0, CANVAS - 45.0  # clear of the walls: a piece against a wall can only be slid along it
    x0, y0, x1, y1 = GOAL_BOX
    n_clumps = 1
    centres = []
    while len(centres) < n_clumps:
        c = rng.uniform(70, CANVAS - 70, 2)
        if not (x0 - 40 < c[0] < x1 + 40 and y0 - 40 < c[1] < y1 + 40):
            centres.append(c)
    spread = rng.uniform(30, 55)
    out = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 200 * n:  # a crowded clump: spread the rest wider
            spread *= 1.5
            tries = 0
        p = centres[len(out) % n_clumps] + rng.normal(0, spread, 2)
        if not (lo <= p[0] <= hi and lo <= p[1] <= hi):
            continue
        if out and np.min(np.linalg.norm(np.asarray(out) - p, axis=1)) < 2 * PIECE_RADIUS + 0.5:
            continue
        if agent is not None and np.linalg.norm(p - agent) < AGENT_RADIUS + PIECE_RADIUS + 2:
            continue
        out.append(p)
    return np.asarray(out)


class PileSweepEnv(gym.Env):
    """Pile sweeping in pymunk. `obs_type`: "pixels_agent_pos" (gym-pusht's dict of `pixels` and
    `agent_pos`), "pixels" or "state". `render_mode="rgb_array"` renders at 680x680 like gym-pusht."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, obs_type: str = "pixels_agent_pos", render_mode: str = "rgb_array", n_pieces: int = N_PIECES,
                 observation_width: int = 128, observation_height: int = 128, visualization_width: int = 680,
                 visualization_height: int = 680):
        super().__init__()
        if n_pieces < 1:
            raise ValueError(f"n_pieces must be >= 1, got {n_pieces}")
        self.obs_type, self.render_mode, self.n_pieces = obs_type, render_mode, n_pieces
        self.observation_width, self.observation_height = observation_width, observation_height
        self.visualization_width, self.visualization_height = visualization_width, visualization_height
        pixels = spaces.Box(0, 255, (observation_height, observation_width, 3), np.uint8)
        agent_pos = spaces.Box(np.zeros(2), np.full(2, CANVAS), dtype=np.float64)
        state = spaces.Box(np.zeros(2 + 2 * n_pieces), np.full(2 + 2 * n_pieces, CANVAS), dtype=np.float64)
        self.observation_space = {"pixels_agent_pos": spaces.Dict({"pixels": pixels, "agent_pos": agent_pos}),
                                  "pixels": pixels, "state": state}.get(obs_type)
        if self.observation_space is None:
            raise ValueError(f"unknown obs_type {obs_type!r}: pixels_agent_pos, pixels or state")
        self.action_space = spaces.Box(low=0, high=CANVAS, shape=(2,), dtype=np.float32)
        self.k_p, self.k_v, self.dt, self.control_hz = 100, 20, 0.01, self.metadata["render_fps"]
        self.success_threshold = SUCCESS_THRESHOLD
        self.space = None

    # physics -----------------------------------------------------------------------------------------------
    def _setup(self):
        import pymunk

        self.space = pymunk.Space()
        self.space.gravity = 0, 0
        self.space.damping = 0.0  # as gym-pusht: velocity is not carried over, so pieces stop when not pushed
        self.space.iterations = 30  # pieces squeezed between the agent and a wall overlap less (default 10)
        walls = [((WALL_LO, WALL_HI), (WALL_LO, WALL_LO)), ((WALL_LO, WALL_LO), (WALL_HI, WALL_LO)),
                 ((WALL_HI, WALL_LO), (WALL_HI, WALL_HI)), ((WALL_LO, WALL_HI), (WALL_HI, WALL_HI))]
        for a, b in walls:
            seg = pymunk.Segment(self.space.static_body, a, b, 2)
            seg.color = _color("LightGray")
            seg.friction = 0.5
            self.space.add(seg)
        self.agent = pymunk.Body(body_type=pymunk.Body.KINEMATIC)
        shape = pymunk.Circle(self.agent, AGENT_RADIUS)
        shape.color, shape.friction = _color("RoyalBlue"), 1.0
        self.space.add(self.agent, shape)
        self.pieces = []
        for _ in range(self.n_pieces):
            body = pymunk.Body(0.05, float("inf"))  # pucks that slide and do not spin, so friction holds a push
            s = pymunk.Circle(body, PIECE_RADIUS)
            s.color, s.friction, s.elasticity = _color(PIECE_COLOR), 1.0, 0.0
            self.space.add(body, s)
            self.pieces.append(body)

    def _set_state(self, state):
        state = np.asarray(state, dtype=np.float64).reshape(-1)
        if state.shape != (2 + 2 * self.n_pieces,) or not np.isfinite(state).all():
            raise ValueError(f"reset_to_state: expected {2 + 2 * self.n_pieces} finite numbers "
                             f"([agent x, y] + {self.n_pieces} piece x, y), got shape {state.shape}")
        self.agent.position = tuple(state[:2])
        self.agent.velocity = (0.0, 0.0)
        for body, p in zip(self.pieces, state[2:].reshape(-1, 2)):
            body.position, body.velocity, body.angle, body.angular_velocity = tuple(p), (0.0, 0.0), 0.0, 0.0
        self.space.reindex_shapes_for_body(self.agent)
        for body in self.pieces:
            self.space.reindex_shapes_for_body(body)

    def get_state(self) -> np.ndarray:
        return np.array([*self.agent.position, *(c for b in self.pieces for c in b.position)], dtype=np.float64)

    @property
    def piece_positions(self) -> np.ndarray:
        return np.array([tuple(b.position) for b in self.pieces], dtype=np.float64)

    def _coverage(self) -> float:
        return coverage_of(self.piece_positions)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self._setup()
        if options is not None and options.get("reset_to_state") is not None:
            state = np.asarray(options["reset_to_state"], dtype=np.float64)
        else:
            agent = self.np_random.integers(50, 450, 2).astype(np.float64)
            state = np.concatenate([agent, sample_pile(self.np_random, self.n_pieces, agent).reshape(-1)])
        self._set_state(state)
        self._last_action = None
        return self._obs(), self._info(False)

    def step(self, action):
        action = np.asarray(action, dtype=np.float64).reshape(-1)
        if action.shape != (2,) or not np.isfinite(action).all():
            raise ValueError(f"action must be 2 finite numbers (an absolute agent target in [0, 512]^2), got {action!r}")
        from pymunk import Vec2d

        self._last_action = action
        for _ in range(int(1 / (self.dt * self.control_hz))):
            acc = self.k_p * (Vec2d(*action) - self.agent.position) + self.k_v * (Vec2d(0, 0) - self.agent.velocity)
            self.agent.velocity += acc * self.dt
            self.space.step(self.dt)
        coverage = self._coverage()
        success = coverage >= self.success_threshold
        reward = float(np.clip(coverage / self.success_threshold, 0.0, 1.0))
        return self._obs(), reward, success, False, self._info(success)

    def _info(self, success: bool) -> dict:
        pieces = self.piece_positions
        return {"pos_agent": np.array(self.agent.position), "vel_agent": np.array(self.agent.velocity),
                "pieces": pieces, "coverage": coverage_of(pieces), "is_success": bool(success)}

    # rendering ---------------------------------------------------------------------------------------------
    def _draw(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import pygame
            from gym_pusht.envs.pymunk_override import DrawOptions
        screen = pygame.Surface((int(CANVAS), int(CANVAS)))
        screen.fill((255, 255, 255))
        x0, y0, x1, y1 = GOAL_BOX
        pygame.draw.rect(screen, pygame.Color("LightGreen"), pygame.Rect(x0, y0, x1 - x0, y1 - y0))
        self.space.debug_draw(DrawOptions(screen))
        return screen

    def _render_at(self, width: int, height: int) -> np.ndarray:
        import cv2
        import pygame

        img = np.transpose(np.array(pygame.surfarray.pixels3d(self._draw())), axes=(1, 0, 2))
        return cv2.resize(img, (width, height))

    def _obs(self):
        if self.obs_type == "state":
            return self.get_state()
        pixels = self._render_at(self.observation_width, self.observation_height)
        if self.obs_type == "pixels":
            return pixels
        return {"pixels": pixels, "agent_pos": np.array(self.agent.position, dtype=np.float64)}

    def render(self):
        return self._render_at(self.visualization_width, self.visualization_height)


def _color(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pygame
    return pygame.Color(name)


def make_env(frame_size: int = 128, n_pieces: int = N_PIECES) -> PileSweepEnv:
    """The ground truth returning pixels_agent_pos at `frame_size`, without a TimeLimit (as Push-T's make_env)."""
    return PileSweepEnv(obs_type="pixels_agent_pos", n_pieces=n_pieces, observation_width=frame_size,
                        observation_height=frame_size)


def render_state(state, frame_size: int = 128, env: PileSweepEnv | None = None) -> np.ndarray:
    """The frame (H, W, 3) uint8 of a state vector, drawn without stepping physics."""
    state = np.asarray(state, dtype=np.float64).reshape(-1)
    env = env or PileSweepEnv(obs_type="pixels", n_pieces=(len(state) - 2) // 2, observation_width=frame_size,
                              observation_height=frame_size)
    if env.space is None:
        env._setup()
    env._set_state(state)
    return env._render_at(frame_size, frame_size)
