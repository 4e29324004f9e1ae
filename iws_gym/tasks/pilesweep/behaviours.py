"""Scripted behaviours of pile sweeping, acting on the true state [agent x, y, piece 1 x, y, ...] and
returning absolute agent targets (the ground truth's action).

`Sweeper` is the competent demonstrator: it takes the outside piece farthest from the goal, goes (around
the goal region) to the point behind it, and pushes it in one straight stroke towards the goal's centre until
it would be well inside, taking along whatever lies in the stroke's way; then the next piece. `sample_episode_plan` is the play mix collections
record: whole sweeps, and episodes of sweeping, wandering, fast random moves and rests mixed.
"""
from __future__ import annotations

import numpy as np

from iws_gym.tasks.pilesweep.groundtruth import AGENT_RADIUS, CANVAS, GOAL_BOX, PIECE_RADIUS

GOAL_CENTRE = np.array([(GOAL_BOX[0] + GOAL_BOX[2]) / 2, (GOAL_BOX[1] + GOAL_BOX[3]) / 2])
CONTACT = AGENT_RADIUS + PIECE_RADIUS
REACH = (5.0 + 2 + AGENT_RADIUS + 1, CANVAS - 6 - 2 - AGENT_RADIUS - 1)  # where the agent's centre can be


def _split(state):
    state = np.asarray(state, dtype=np.float64).reshape(-1)
    return state[:2], state[2:].reshape(-1, 2)


def _clip(a):
    return np.clip(a, 0.0, CANVAS)


def _step_towards(pos, target, max_speed):
    d = target - pos
    n = np.linalg.norm(d)
    return target if n <= max_speed else pos + d * (max_speed / n)


class Behaviour:
    name = "behaviour"

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def act(self, state) -> np.ndarray:
        raise NotImplementedError


def deep_inside(pieces, margin: float) -> np.ndarray:
    """(N,) bool: the piece's centre is inside the goal region by at least `margin` px."""
    x0, y0, x1, y1 = GOAL_BOX
    return ((pieces[:, 0] >= x0 + margin) & (pieces[:, 0] <= x1 - margin) &
            (pieces[:, 1] >= y0 + margin) & (pieces[:, 1] <= y1 - margin))


class Sweeper(Behaviour):
    """Push outside pieces into the goal one target piece at a time (others in the way come along).
    `speed`: the most the target moves per step while pushing (px); `noise`: Gaussian noise on each action."""

    name = "sweep"

    def __init__(self, rng, speed: float | None = None, noise: float = 0.0, margin: float = 30.0):
        super().__init__(rng)
        self.speed = float(rng.uniform(20, 32)) if speed is None else speed
        self.noise, self.margin = noise, margin
        self.phase, self.start, self.end, self.wait, self.piece, self.skip = None, None, None, 0, None, set()

    def _pick(self, pieces) -> int | None:
        """The outside piece farthest from the goal; pieces against a wall (which can only slide along it)
        come last."""
        out = np.nonzero(~deep_inside(pieces, self.margin * 0.5))[0]
        out = np.array([i for i in out if i not in self.skip] or out, dtype=int)
        if len(out) == 0:
            return None
        d = np.linalg.norm(pieces[out] - GOAL_CENTRE, axis=1)
        walled = (np.minimum(pieces[out], CANVAS - pieces[out]).min(axis=1) < 12 + PIECE_RADIUS + 2 * AGENT_RADIUS)
        return int(out[np.lexsort((-d, walled))[0]])

    def _stroke(self, p):
        """The stroke that pushes a piece at p into the goal: start behind it (on the line from the goal's
        centre through it, or against a wall the nearest reachable point), end with it `margin` inside."""
        d = np.linalg.norm(GOAL_CENTRE - p)
        start = np.clip(p - (GOAL_CENTRE - p) / max(d, 1e-6) * (CONTACT + 10), REACH[0], REACH[1])
        u = (p - start) / max(np.linalg.norm(p - start), 1e-6)
        # how far along u until the piece is `margin` inside the goal (or as deep as the line goes)
        ts = np.linspace(0, 2 * CANVAS, 400)
        deep = deep_inside(p + ts[:, None] * u, self.margin)
        t_end = ts[np.argmax(deep)] if deep.any() else float(np.clip(d, 0, 300))
        return start, p + u * (t_end - CONTACT + 6)

    def act(self, state):
        agent, pieces = _split(state)
        if self.phase == "push" and np.linalg.norm(agent - self.end) < 8:  # back out the way it came
            self.phase = "retreat"
        if self.phase == "retreat":
            if np.linalg.norm(agent - self.start) < 8:
                self.phase = None
            else:
                a = _step_towards(agent, self.start, 40.0)
        if self.phase is None:
            i = self._pick(pieces)
            if i is None:  # everything is in: rest
                return agent
            self.piece = i
            self.start, self.end = self._stroke(pieces[i])
            self.phase, self.wait = "approach", 0
        if self.phase == "approach":
            self.wait += 1
            if np.linalg.norm(agent - self.start) < 6:
                self.phase = "push"
            elif self.wait > 30:  # stuck (against a wall): try the next piece
                self.phase, self.skip = None, self.skip | {self.piece}
                return agent
            else:
                a = _step_towards(agent, _around_pile(agent, self.start), 60.0)
        if self.phase == "push":
            a = _step_towards(agent, self.end, self.speed)
        if self.noise:
            a = a + self.rng.normal(0, self.noise, 2)
        return _clip(a)


def _around_pile(agent, target, step: float = 70.0):
    """The next waypoint from `agent` to the start of a stroke, `target`, going around the goal's centre on the
    circle through `target`: the sweeper takes the piece farthest from the goal first, so no piece lies
    farther out than its stroke's start, and the circle passes clear of the pile."""
    rt = np.linalg.norm(target - GOAL_CENTRE)
    th_a = np.arctan2(*(agent - GOAL_CENTRE)[::-1])
    dth = (np.arctan2(*(target - GOAL_CENTRE)[::-1]) - th_a + np.pi) % (2 * np.pi) - np.pi
    if abs(dth) * rt < 30:
        return target
    th = th_a + np.sign(dth) * min(abs(dth), step / max(rt, 1.0))
    return np.clip(GOAL_CENTRE + rt * np.array([np.cos(th), np.sin(th)]), REACH[0], REACH[1])


class Wander(Behaviour):
    """Moves to random waypoints at a random moderate speed, through or past the pile."""

    name = "wander"

    def __init__(self, rng):
        super().__init__(rng)
        self.speed, self.goal = rng.uniform(8, 30), None

    def act(self, state):
        agent, _ = _split(state)
        if self.goal is None or np.linalg.norm(self.goal - agent) < 5:
            self.goal = self.rng.uniform(20, CANVAS - 20, 2)
        return _step_towards(agent, self.goal, self.speed)


class Jumpy(Behaviour):
    """A new random target every 1-5 steps: fast moves that hit pieces hard."""

    name = "jumpy"

    def __init__(self, rng):
        super().__init__(rng)
        self.left, self.goal = 0, None

    def act(self, state):
        if self.left <= 0:
            self.goal, self.left = self.rng.uniform(0, CANVAS, 2), int(self.rng.integers(1, 6))
        self.left -= 1
        return self.goal


class Rest(Behaviour):
    """Holds the agent where it is: nothing moves."""

    name = "rest"

    def act(self, state):
        return _split(state)[0]


class RandomTargets(Behaviour):
    """A uniform-random target every step (what a uniform-random policy sends)."""

    name = "random"

    def act(self, state):
        return self.rng.uniform(0, CANVAS, size=2)


SEGMENT_MIX = [  # (name, weight, factory) of the segments play mixes
    ("sweep", 0.45, lambda rng: Sweeper(rng)),
    ("sweep_noisy", 0.15, lambda rng: Sweeper(rng, noise=8.0)),
    ("wander", 0.2, Wander),
    ("jumpy", 0.1, Jumpy),
    ("rest", 0.1, Rest),
]
SEGMENT_NAMES = [m[0] for m in SEGMENT_MIX] + ["random", "expert"]  # append only: episode files store indices


def sample_episode_plan(rng: np.random.Generator, steps: int):
    """An episode of play as [(segment name, behaviour, n_steps), ...]: a third are one whole sweep, so that
    some reach success, the rest mix segments of 20-100 steps."""
    if rng.random() < 1 / 3:
        return [("sweep", Sweeper(rng), steps)]
    names, probs = [m[0] for m in SEGMENT_MIX], np.array([m[1] for m in SEGMENT_MIX])
    plan, left = [], steps
    while left > 0:
        n = min(left, int(rng.integers(20, 100)))
        i = int(rng.choice(len(names), p=probs / probs.sum()))
        plan.append((names[i], SEGMENT_MIX[i][2](rng), n))
        left -= n
    return plan
