"""An expert Push-T demonstrator: it plans each push in its own copy of the physics.

The scripted `Pusher` (behaviours.py) picks a contact by a hand-made score and pushes open loop; read from
frames it succeeds in 31% of 300-step episodes, this expert in 89% (docs/results.md). `PlanningPusher` instead tries every push
it can make - a contact point on the T's outline, a direction within 0.5 rad of the inward normal, a length -
in a private pymunk world set to the current state (the same physics as gym-pusht: PD agent at 10 Hz, 100 Hz
physics, a block with no momentum), and executes the one that leaves the block closest to the goal pose.
Each push starts with an approach that orbits the block, so the approach is simulated too. It reads the true
state, as a teleoperator sees the scene; `iws_gym.policies:ExpertPusher` reads it from the frame instead
(pose.py), so the same expert can act on learned frames.
"""
from __future__ import annotations

import warnings

import numpy as np

from iws_gym.tasks.pusht.behaviours import LO, HI, _perimeter_samples, _step_towards, path_clear
from iws_gym.tasks.pusht.geometry import AGENT_RADIUS, GOAL_POSE, T_COG
from iws_gym.tasks.pusht.groundtruth import rot, wrap_angle


def pose_error(block, goal=GOAL_POSE, px_per_rad: float = 60.0) -> float:
    """Distance of a block pose (x, y, angle) from the goal: px plus px_per_rad per radian of turn."""
    return float(np.hypot(*(np.asarray(block[:2]) - goal[:2])) + px_per_rad * abs(float(wrap_angle(goal[2] - block[2]))))


class _Physics:
    """A private gym-pusht world for trying actions: set a state, step actions, read the block."""

    def __init__(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from gym_pusht.envs.pusht import PushTEnv
        from pymunk.vec2d import Vec2d
        self.Vec2d = Vec2d
        self.env = PushTEnv(obs_type="state")
        self.env.reset(seed=0)
        self.substeps = int(1 / (self.env.dt * self.env.control_hz))

    def set(self, agent, agent_vel, block):
        e = self.env
        e.agent.position, e.agent.velocity = (float(agent[0]), float(agent[1])), (float(agent_vel[0]), float(agent_vel[1]))
        e.block.angle = float(block[2])
        e.block.position = (float(block[0]), float(block[1]))
        e.block.velocity, e.block.angular_velocity = (0.0, 0.0), 0.0

    def get(self):
        e = self.env
        return (np.array(e.agent.position), np.array(e.agent.velocity),
                np.array([e.block.position.x, e.block.position.y, e.block.angle]))

    def step(self, action):
        e, a = self.env, self.Vec2d(float(action[0]), float(action[1]))
        for _ in range(self.substeps):  # gym-pusht's PD control and physics step
            e.agent.velocity += (e.k_p * (a - e.agent.position) + e.k_v * (self.Vec2d(0, 0) - e.agent.velocity)) * e.dt
            e.space.step(e.dt)


MARKOV = dict(reach=40.0, replan_every=8)  # the expert that replans every chunk a policy executes (`--mix expert_markov`)


class PlanningPusher:
    """act(state) -> action, state = [agent x, agent y, block x, block y, block angle] (behaviours.py's
    convention). Plans a push (approach + push, up to a few dozen steps), executes it, plans again.

    speed: px per step of the approach; push_speed: px per step while pushing; lengths: push lengths (px);
    turns: push directions off the inward normal (rad); the fine_* values replace them within fine_within
    (pose_error) of the goal; settle: steps the target holds still after the approach and after a push, so that
    the PD agent, which lags its target, arrives; noise: the std (px) of a perturbation added to every
    action, for demonstrations of varied quality.

    reach: a pre-contact point within this many px, with a clear way to it, is approached straight (0: always
    the orbiting approach, which first backs off from a block the agent touches); replan_every: plan afresh
    every N actions instead of at the end of each plan (0), the agent's velocity estimated from its last two
    positions. With both (`MARKOV`), what it does next depends on the state alone, not on a plan made earlier:
    the teacher a policy that replans every chunk can imitate (docs/experiments.md)."""

    def __init__(self, rng=None, speed: float = 30.0, push_speed: float = 8.0, lengths=(8, 20, 40, 70),
                 turns=(-0.5, 0.0, 0.5), fine_within: float = 30.0, fine_lengths=(3, 6, 12, 24),
                 fine_turns=(-0.7, -0.35, 0.0, 0.35, 0.7), settle: int = 2, noise: float = 0.0, goal=None,
                 reach: float = 0.0, replan_every: int = 0):
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.speed, self.push_speed, self.lengths, self.turns = speed, push_speed, tuple(lengths), tuple(turns)
        self.fine_within, self.fine_lengths, self.fine_turns = fine_within, tuple(fine_lengths), tuple(fine_turns)
        self.coarse_pts, self.fine_pts = _perimeter_samples(4), _perimeter_samples(8)
        self.settle = settle
        self.noise = noise
        self.goal = GOAL_POSE.copy() if goal is None else np.asarray(goal, float)
        if reach < 0 or replan_every < 0:
            raise ValueError(f"reach and replan_every must be >= 0, got {reach}, {replan_every}")
        self.reach, self.replan_every = float(reach), int(replan_every)
        self.sim = _Physics()
        self.reset()

    def reset(self, rng=None):
        if rng is not None:
            self.rng = rng
        self.plan: list[np.ndarray] = []
        self.plan_vel = np.zeros(2)  # the agent's velocity at the end of the plan, as the private world saw it
        self.steps, self.last_agent = 0, None

    # -- the candidates ------------------------------------------------------------------------------------
    def _approach(self, agent, block, c, n):
        """Targets from the agent to the pre-contact point c + n * (radius + 4), orbiting the block at a safe
        radius when the straight way is blocked. None if the walls box the way in."""
        cog = block[:2] + rot(block[2]) @ T_COG
        far, pre = c + n * 45, c + n * (AGENT_RADIUS + 4)
        if np.any((pre < LO) | (pre > HI)):
            return None
        out, pos = [], agent.astype(float)
        legs = [(pre, self.speed / 2)]
        # beside the contact already (e.g. after a push from it), with a clear way: straight there; else orbit first
        if not (self.reach and np.linalg.norm(pre - pos) <= self.reach and path_clear(pos, pre, block, AGENT_RADIUS - 2)):
            for _ in range(30):
                if path_clear(pos, far, block):
                    break
                ra, rf = np.arctan2(*(pos - cog)[::-1]), np.arctan2(*(far - cog)[::-1])
                step = float(np.clip(wrap_angle(rf - ra), -0.6, 0.6))
                r = max(105.0, np.linalg.norm(pos - cog))
                nxt = cog + r * np.array([np.cos(ra + step), np.sin(ra + step)])
                if r > 106:  # first back off to the orbit radius
                    nxt = cog + 105.0 * (pos - cog) / np.linalg.norm(pos - cog)
                pos = _step_towards(pos, np.clip(nxt, LO, HI), self.speed)
                out.append(pos)
            else:
                return None
            legs.insert(0, (far, self.speed))
        for goal, speed in legs:
            while np.linalg.norm(goal - pos) > 1e-6:
                pos = _step_towards(pos, goal, speed)
                out.append(pos)
        return out + [pre] * self.settle  # the PD agent lags its target: let it arrive before pushing

    def _candidates(self, agent, block, fine: bool):
        """(approach targets, [push targets, ...]) per contact point; near the goal (fine), shorter and slower
        pushes from twice as many contacts and in more directions."""
        R = rot(block[2])
        pts, nrm = self.fine_pts if fine else self.coarse_pts
        pts, nrm = pts @ R.T + block[:2], nrm @ R.T
        turns, lengths = (self.fine_turns, self.fine_lengths) if fine else (self.turns, self.lengths)
        speed = self.push_speed / 2 if fine else self.push_speed
        for c, n in zip(pts, nrm):
            app = self._approach(agent, block, c, n)
            if app is None:
                continue
            pushes = []
            for turn in turns:
                d = rot(turn) @ -n
                for L in lengths:
                    k = max(1, int(np.ceil(L / speed)))
                    start = app[-1]
                    push = [np.clip(start + d * L * (i + 1) / k, 0, 512) for i in range(k)]
                    pushes.append(push + push[-1:] * self.settle)
            yield app, pushes

    def _search(self, agent, agent_vel, block, fine: bool):
        """Every candidate push tried in the private world: [(cost, index, targets, (agent, velocity, block)
        after it)], cost = the block's pose_error after it plus a small price per step; fine: the candidates
        near the goal."""
        out = []
        for app, pushes in self._candidates(agent, block, fine):
            self.sim.set(agent, agent_vel, block)
            for a in app:
                self.sim.step(a)
            snap = self.sim.get()
            for push in pushes:
                self.sim.set(*snap)
                for a in push:
                    self.sim.step(a)
                end = self.sim.get()
                out.append((pose_error(end[2], self.goal) + 0.02 * (len(app) + len(push)), len(out), app + push, end))
        return sorted(out, key=lambda t: t[:2])

    def _replan(self, agent, agent_vel, block):
        """The best push, if it brings the block closer; else (a dead end) one of the ten least bad
        pushes, at random, to leave it."""
        now = pose_error(block, self.goal)
        tried = self._search(agent, agent_vel, block, now < self.fine_within)
        if not tried:
            return []
        _, _, plan, end = tried[0]
        if tried[0][0] >= now - 0.1:  # a dead end: one of the ten least bad pushes, at random
            _, _, plan, end = tried[int(self.rng.integers(min(10, len(tried))))]
        self.plan_vel = end[1]
        return list(plan)

    def act(self, state) -> np.ndarray:
        state = np.asarray(state, dtype=np.float64)
        agent, block = state[:2], state[2:5]
        if self.replan_every and self.steps % self.replan_every == 0:
            self.plan = []
            if self.last_agent is not None:  # gym-pusht acts at 10 Hz: px per step x 10 = px/s
                self.plan_vel = (agent - self.last_agent) * 10.0
        self.steps += 1
        self.last_agent = agent.copy()
        if not self.plan:
            self.plan = self._replan(agent, self.plan_vel, block)
            if not self.plan:
                return agent.astype(np.float32)
        a = self.plan.pop(0)
        if self.noise:
            a = a + self.rng.normal(0, self.noise, 2)
        return np.clip(a, 0, 512).astype(np.float32)

