"""Scripted Push-T behaviours that generate the training data (`iws collect`).

They read the true simulator state (agent and block pose) because they stand in for a human
teleoperator; the models never see that state. Every behaviour is `act(state, rng) -> action`, where
state = [agent x, agent y, block x, block y, block angle] and action is the absolute agent target.
Targets move at most `max_speed` px per step, like a hand on a mouse (except `jumpy`, which is there so
the model has seen what a uniform-random policy does).

The mix (see `MIX`): each episode is a sequence of segments, each segment one behaviour, so episodes
contain transitions between pushing, playing, moving away and idling, as real play data does.
"""
from __future__ import annotations

import numpy as np

from iws_gym.tasks.pusht.geometry import AGENT_RADIUS, GOAL_POSE, T_COG, T_OUTLINE, t_sdf_local
from iws_gym.tasks.pusht.groundtruth import rot, wrap_angle

LO, HI = 20.0, 492.0  # keep targets off the walls (walls at 5 and 506)


def _perimeter_samples(n_per_edge: int = 4):
    """Points on the T outline in the body frame with outward normals: (N, 2), (N, 2)."""
    pts, nrm = [], []
    # Outline of the union, counter-clockwise in image coords; each edge with its outward normal.
    outline = T_OUTLINE
    for i in range(len(outline)):
        a, b = outline[i], outline[(i + 1) % len(outline)]
        d = (b - a) / np.linalg.norm(b - a)
        n = np.array([d[1], -d[0]])  # outward for this winding (checked: bar top edge has normal (0, -1))
        for t in (np.arange(n_per_edge) + 0.5) / n_per_edge:
            pts.append(a + t * (b - a))
            nrm.append(n)
    return np.array(pts), np.array(nrm)


PERIM_PTS, PERIM_NRM = _perimeter_samples()


def t_sdf(pts, pose):
    """Signed distance (px) from world points (N, 2) to the T at `pose` (negative inside)."""
    local = (pts - pose[:2]) @ rot(pose[2])  # world -> body frame (R^T applied on the right)

    return t_sdf_local(local[:, 0], local[:, 1])


def path_clear(a, b, pose, margin=AGENT_RADIUS + 6) -> bool:
    """Whether the agent can travel straight from a to b without touching the block at `pose`."""
    pts = a + np.linspace(0, 1, 12)[:, None] * (b - a)
    return bool(np.all(t_sdf(pts, pose) > margin))


def _step_towards(pos, target, max_speed):
    d = target - pos
    n = np.linalg.norm(d)
    return target if n <= max_speed else pos + d / n * max_speed


def _clip(a):
    return np.clip(a, LO, HI)


class Behaviour:
    name = "base"

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.target = None  # the current (smoothly moving) commanded target

    def _move(self, state, goal, max_speed):
        if self.target is None:
            self.target = state[:2].copy()
        self.target = _clip(_step_towards(self.target, _clip(goal), max_speed))
        return self.target.copy()

    def act(self, state):
        raise NotImplementedError


class Pusher(Behaviour):
    """Goal-directed pushing: pick the contact on the T outline whose push best reduces the pose error,
    go around the block to its pre-contact point, push through, re-plan. `noise` degrades it (partial
    and failed pushes); `goal` other than the real one gives purposeful pushes that end elsewhere."""

    name = "push"

    def __init__(self, rng, noise=0.0, goal=None, max_speed=None, push_len=None):
        super().__init__(rng)
        self.noise = noise
        self.goal = GOAL_POSE.copy() if goal is None else np.asarray(goal, float)
        self.max_speed = max_speed or rng.uniform(12, 30)
        self.push_len = push_len or int(rng.integers(4, 10))
        self.contact = None  # (local point, local normal)
        self.phase = "plan"
        self.push_steps = 0
        self.stalled = False

    def _plan(self, state):
        p, th = state[2:4], state[4]
        dpos = self.goal[:2] - p
        dth = float(wrap_angle(self.goal[2] - th))
        R = rot(th)
        cog = p + R @ T_COG
        pts = PERIM_PTS @ R.T + p
        nrm = PERIM_NRM @ R.T
        d = -nrm  # push directions
        # Translation progress and rotation progress of each candidate push.
        dist = np.linalg.norm(dpos)
        trans = d @ (dpos / (dist + 1e-6)) * min(1.0, dist / 40.0)
        r = pts - cog
        torque = (r[:, 0] * d[:, 1] - r[:, 1] * d[:, 0]) / 60.0
        rotn = np.sign(dth) * torque * min(1.0, abs(dth) / 0.25)
        noise = max(self.noise, 1.5 if self.stalled else 0.0)  # a stuck approach replans to another contact
        score = trans + 1.2 * rotn + noise * self.rng.normal(size=len(pts))
        pre = pts + nrm * (AGENT_RADIUS + 8)
        ok = np.all((pre > LO) & (pre < HI), axis=1)
        score[~ok] = -np.inf
        i = int(np.argmax(score))
        self.contact = (PERIM_PTS[i], PERIM_NRM[i])
        self.phase = "approach"
        self.orbit_dir, self.orbit_flips, self.approach_steps, self.stalled = 0.0, 0, 0, False

    @staticmethod
    def _clear(a, b, state):
        return path_clear(a, b, state[2:5])

    def _contact_world(self, state):
        R = rot(state[4])
        pl, nl = self.contact
        return state[2:4] + R @ pl, R @ nl

    def act(self, state):
        agent = state[:2]
        if self.phase == "plan" or self.contact is None:
            self._plan(state)
        c, n = self._contact_world(state)
        if self.phase == "approach":
            self.approach_steps += 1
            if self.approach_steps > 40:
                self.stalled = True
                self._plan(state)
                c, n = self._contact_world(state)
            pre = c + n * (AGENT_RADIUS + 10)
            far = c + n * 45
            cog = state[2:4] + rot(state[4]) @ T_COG
            if np.linalg.norm(pre - agent) < 10:
                self.phase, self.push_steps = "push", 0
            elif np.linalg.norm(far - agent) < 15 or self._clear(agent, far, state):
                goal = pre if np.linalg.norm(far - agent) < 25 else far
                return self._move(state, goal, self.max_speed)
            else:
                # Orbit the block at a safe radius towards the far pre-contact point.
                ra = np.arctan2(*(agent - cog)[::-1])
                rf = np.arctan2(*(far - cog)[::-1])
                if self.orbit_dir == 0:
                    self.orbit_dir = 1.0 if wrap_angle(rf - ra) > 0 else -1.0
                nxt = cog + 105 * np.array([np.cos(ra + self.orbit_dir * 0.7), np.sin(ra + self.orbit_dir * 0.7)])
                if np.any((nxt < LO) | (nxt > HI)):
                    self.orbit_flips += 1
                    if self.orbit_flips > 2:  # boxed in by the walls: replan to another contact
                        self.phase = "plan"
                    self.orbit_dir *= -1
                    nxt = cog + 105 * np.array([np.cos(ra + self.orbit_dir * 0.7), np.sin(ra + self.orbit_dir * 0.7)])
                return self._move(state, nxt, self.max_speed)
            if self.phase != "push":
                return self._move(state, pre, self.max_speed)
        # push: drive the target through the contact point along the inward normal
        self.push_steps += 1
        err = np.linalg.norm(self.goal[:2] - state[2:4]) / 40 + abs(float(wrap_angle(self.goal[2] - state[4]))) / 0.3
        if self.push_steps >= (self.push_len if err > 1 else 2):
            self.phase = "plan"
        goal = c - n * (25 + self.noise * self.rng.normal() * 10)
        return self._move(state, goal, self.max_speed * (0.8 if err > 1 else 0.4))


class Explore(Behaviour):
    """Play around and against the block: waypoints sampled near the block, some inside it (pokes)."""

    name = "explore"

    def __init__(self, rng):
        super().__init__(rng)
        self.wp = None
        self.max_speed = rng.uniform(8, 30)

    def act(self, state):
        if self.wp is None or np.linalg.norm(self.target - self.wp) < 5 or self.rng.random() < 0.03:
            cog = state[2:4] + rot(state[4]) @ T_COG
            self.wp = cog + self.rng.normal(size=2) * self.rng.uniform(30, 90)
        return self._move(state, self.wp, self.max_speed)


class FreeMotion(Behaviour):
    """Move around the workspace along random waypoints, preferring places away from the block."""

    name = "free"

    def __init__(self, rng):
        super().__init__(rng)
        self.wp = None
        self.max_speed = rng.uniform(10, 40)

    def act(self, state):
        if self.wp is None or np.linalg.norm(self.target - self.wp) < 5:
            cand = self.rng.uniform(LO, HI, size=(8, 2))
            far = np.linalg.norm(cand - state[2:4], axis=1)
            self.wp = cand[int(np.argmax(far + self.rng.uniform(0, 150, 8)))]
        return self._move(state, self.wp, self.max_speed)


class Idle(Behaviour):
    """Hold still, with the small tremor of a resting hand."""

    name = "idle"

    def act(self, state):
        if self.target is None:
            self.target = state[:2].copy()
        return _clip(self.target + self.rng.normal(size=2) * self.rng.choice([0.0, 1.0]))


class Jumpy(Behaviour):
    """Uniform-random targets over the whole box, held for 1-5 steps (what a random policy does)."""

    name = "jumpy"

    def __init__(self, rng):
        super().__init__(rng)
        self.hold = 0

    def act(self, state):
        if self.hold <= 0 or self.target is None:
            self.target = self.rng.uniform(0, 512, size=2)
            self.hold = int(self.rng.integers(1, 6))
        self.hold -= 1
        return self.target.copy()


class JitteryPush(Pusher):
    """Pushing in which each step's target is, with probability `p`, a uniformly random point of the box
    instead (the pusher's own plan keeps advancing). The default mix has fast, jumpy motion only away from
    pushes (`jumpy` segments); this covers the agent leaping off and back onto a block in mid-push, the
    motion of a degraded or exploring policy. Collected only on request (`iws collect --mix jittery`)."""

    name = "push_jittery"

    def __init__(self, rng, p=None):
        super().__init__(rng, noise=0.0)
        self.p = rng.uniform(0.1, 0.7) if p is None else p

    def act(self, state):
        a = super().act(state)
        return self.rng.uniform(0, 512, size=2) if self.rng.random() < self.p else a


# Episode-level mix: (name, probability, factory). Segments inside an episode are drawn from SEGMENT_MIX.
def _near_goal_pusher(rng):
    return Pusher(rng, noise=0.0, max_speed=rng.uniform(8, 15), push_len=int(rng.integers(3, 6)))


def _wrong_goal_pusher(rng):
    goal = np.array([rng.uniform(120, 392), rng.uniform(120, 392), rng.uniform(-np.pi, np.pi)])
    return Pusher(rng, noise=rng.uniform(0, 0.5), goal=goal)


SEGMENT_MIX = [
    ("push", 0.40, lambda rng: Pusher(rng, noise=0.0)),
    ("push_noisy", 0.15, lambda rng: Pusher(rng, noise=rng.uniform(0.3, 1.5))),
    ("push_other_goal", 0.08, _wrong_goal_pusher),
    ("explore", 0.15, Explore),
    ("free", 0.10, FreeMotion),
    ("idle", 0.05, Idle),
    ("jumpy", 0.07, Jumpy),
]


def sample_episode_plan(rng: np.random.Generator, steps: int):
    """An episode as [(segment name, behaviour, n_steps), ...] and whether to start near the goal.

    A quarter of episodes are long pushes (one segment) so some reach high coverage, 10% start near the
    goal (so the model sees near-success states and the transition to success), the rest mix segments."""
    names = [m[0] for m in SEGMENT_MIX]
    probs = np.array([m[1] for m in SEGMENT_MIX])
    probs /= probs.sum()
    u = rng.random()
    if u < 0.25:
        return [("push", Pusher(rng, noise=0.0), steps)], False
    if u < 0.35:
        return [("push_near_goal", _near_goal_pusher(rng), steps)], True
    plan, left = [], steps
    while left > 0:
        n = min(left, int(rng.integers(20, 100)))
        i = int(rng.choice(len(names), p=probs))
        plan.append((names[i], SEGMENT_MIX[i][2](rng), n))
        left -= n
    return plan, False


WALLS = (7.0, 504.0)  # the inner faces of gym-pusht's walls (segments at 5 and 506 px, radius 2), on both axes


def scattered_state(rng: np.random.Generator, wall_share: float = 1 / 3) -> tuple[np.ndarray, np.ndarray]:
    """A random valid state: (agent position (2,), block pose (3,)). The block lies anywhere inside the walls at
    any angle (play and demonstrations keep it near the middle), with probability `wall_share` pressed against a
    wall (its outermost corner 0-10 px from it); the agent lies anywhere it does not overlap the block."""
    from iws_gym.tasks.pusht.groundtruth import t_polygons

    lo, hi = WALLS
    while True:
        b = np.array([*rng.uniform(20, 492, 2), rng.uniform(-np.pi, np.pi)])
        if rng.random() < wall_share:  # against a wall: shift the block until its outermost corner is 0-10 px from it
            corners = np.concatenate(t_polygons(b))
            axis, side = rng.integers(2), rng.integers(2)
            gap = rng.uniform(0, 10)
            b[axis] += (lo + gap - corners[:, axis].min()) if side == 0 else (hi - gap - corners[:, axis].max())
        a = rng.uniform(15, 497, 2)
        corners = np.concatenate(t_polygons(b))
        if corners.min() >= lo and corners.max() <= hi and t_sdf(a[None], b)[0] >= AGENT_RADIUS:
            return a, b


def near_goal_state(rng: np.random.Generator) -> np.ndarray:
    """A start with the block near the goal pose and the agent somewhere clear of it."""
    block = GOAL_POSE + np.array([rng.normal(0, 25), rng.normal(0, 25), rng.normal(0, 0.35)])
    while True:
        agent = rng.uniform(60, 452, size=2)
        if np.linalg.norm(agent - block[:2]) > 130:
            return np.concatenate([agent, block])


class Sweep(Behaviour):
    """EVALUATION ONLY, never in the training mix: a lawnmower raster over the workspace at constant
    speed, sweeping through the block wherever it lies. Used to test generalisation beyond the data."""

    name = "sweep"

    def __init__(self, rng):
        super().__init__(rng)
        self.speed = rng.uniform(15, 25)
        lanes = np.linspace(60, 452, int(rng.integers(5, 9)))
        if rng.random() < 0.5:
            lanes = lanes[::-1]
        vertical = rng.random() < 0.5
        pts = []
        for i, c in enumerate(lanes):
            ends = (LO + 20, HI - 20) if i % 2 == 0 else (HI - 20, LO + 20)
            pts += [(c, e) if vertical else (e, c) for e in ends]
        self.waypoints = [np.array(p) for p in pts]
        self.i = 0

    def act(self, state):
        wp = self.waypoints[self.i % len(self.waypoints)]
        if self.target is not None and np.linalg.norm(self.target - wp) < 1:
            self.i += 1
        return self._move(state, wp, self.speed)


class RandomTargets(Behaviour):
    """A new uniform-random target over the whole box every step, which is what a uniform-random policy
    (and `iws eval stability`'s random drive) sends. Not in the default play mix; collected only on request
    (`iws collect --mix random`). The mix's `jumpy` segments hold a target for 1-5 steps; this one never
    does, so the agent is always at speed and runs into the block hard."""

    name = "random"

    def act(self, state):
        return self.rng.uniform(0, 512, size=2)
