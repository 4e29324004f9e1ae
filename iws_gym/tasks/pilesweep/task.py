"""Pile sweeping, as the task-generic layers see it (the interface is documented in iws_gym/tasks/__init__.py).

Collection plans (`iws collect --task pilesweeping --mix`): the default play mix (behaviours.py), whole
episodes of a uniform-random target every step, and demonstrations of the scripted sweeper (ending at
success).
"""
from __future__ import annotations

import numpy as np

from iws_gym.tasks.pilesweep.behaviours import SEGMENT_NAMES, RandomTargets, Sweeper, Wander, sample_episode_plan  # noqa: F401
from iws_gym.tasks.pilesweep.groundtruth import N_PIECES, make_env, render_state  # noqa: F401  (the interface)

STATE_SIZE, STATE_DOC = 2 + 2 * N_PIECES, f"[agent x, y, piece 1 x, y, ..., piece {N_PIECES} x, y]"

# the spatial stage 2's options in `iws train recipe`: the agent track and windows where the agent jumps (the
# block-pose options of T pushing have no object to read)
STAGE2_OPTIONS = ["--agent-track", "--jump-focus", "0.3"]
MIXES = ("play", "random", "expert")
PLAY_BEHAVIOURS = ("mix", "unseen", "random")
HELDOUT_BEHAVIOURS = PLAY_BEHAVIOURS + ("expert",)


def get_state(env) -> np.ndarray:
    """[agent x, agent y, piece 1 x, y, ...] of an unwrapped PileSweepEnv."""
    return env.get_state()


def reset_state(env) -> np.ndarray:
    """The `reset_to_state` vector that puts an env back where `env` is now."""
    return env.get_state()


def observe(env, info) -> dict:
    return {"pieces": info["pieces"], "coverage": float(info["coverage"])}


def step_record(info) -> dict:
    return {}


def play_plan(rng: np.random.Generator, steps: int):
    return sample_episode_plan(rng, steps), None


def mix_plan(mix: str, seed: int, steps: int, learner=None):
    if mix == "play":
        return None
    if mix == "random":
        return [("random", RandomTargets(np.random.default_rng([seed, 2])), steps)]
    return [("expert", Sweeper(np.random.default_rng([seed, 3])), steps)]


def mix_of(plan: str) -> str:
    for mix, prefix in (("random", "random:"), ("expert", "expert:")):
        if plan.startswith(prefix):
            return mix
    return "play"


def heldout_plan(behaviour: str, seed: int, steps: int):
    """"unseen": wandering at random moderate speeds for the whole episode (play mixes it with sweeping);
    "expert": the sweeper for the whole horizon (under another name: no stop at success)."""
    if behaviour == "mix":
        return None
    if behaviour == "random":
        return mix_plan("random", seed, steps)
    if behaviour == "expert":
        return [("expert_heldout", Sweeper(np.random.default_rng([seed, 3])), steps)]
    return [("wander", Wander(np.random.default_rng(seed)), steps)]


READING_KEYS = ("pieces_err", "coverage", "ink_sharpness")  # per frame: |pieces read - true count| / count,
# |coverage read - true|, and the share of the ink drawn as whole pucks (scorer.ink_sharpness)
WHOLE_TOL = 0.05  # a frame keeps the pile whole when the piece count read from it is within 5% of the truth (issue 35)
WHOLE_RULE = dict(tol=WHOLE_TOL, rule="the piece count read from the frame (PileCoverageScorer: its orange ink over one "
                                      "piece's) within tol of the true count")


def readings(pred: np.ndarray, ep: dict) -> dict:
    """Per-step readings of predicted frames against an episode's true pieces (evaluation/fidelity.py), and
    `pieces_whole`: 1 where the count read is within WHOLE_TOL of the truth."""
    from iws_gym.tasks.pilesweep.scorer import SHARP_MIN, PileCoverageScorer, ink_sharpness

    scorer = PileCoverageScorer(frame_size=pred.shape[1])
    read = np.array([scorer.read(f) for f in pred])  # (T+1, 2): coverage, count
    sharp = np.array([ink_sharpness(f) for f in pred])
    n = ep["pieces"].shape[1]
    err = np.abs(read[:, 1] - n) / n
    return {"pieces_err": err, "coverage": np.abs(read[:, 0] - ep["coverage"][: len(pred)]), "ink_sharpness": sharp,
            "pieces_whole": ((err <= WHOLE_TOL) & (sharp >= SHARP_MIN)).astype(np.float64)}


def rerender(ep: dict, horizon: int, frame_size: int) -> np.ndarray:
    """An episode's true states drawn again without stepping physics: fidelity's floor."""
    from iws_gym.tasks.pilesweep.groundtruth import PileSweepEnv

    n = ep["pieces"].shape[1]
    env = PileSweepEnv(obs_type="pixels", n_pieces=n, observation_width=frame_size, observation_height=frame_size)
    states = np.concatenate([ep["agent_pos"][: horizon + 1], ep["pieces"][: horizon + 1].reshape(-1, 2 * n)], axis=1)
    return np.stack([render_state(s, frame_size, env) for s in states])


def success(coverage) -> np.ndarray:
    """Success per coverage value (a share of pieces >= 0.9)."""
    from iws_gym.tasks.pilesweep.groundtruth import SUCCESS_THRESHOLD

    return np.asarray(coverage) >= SUCCESS_THRESHOLD


SCORE_DOC = "max share of the pieces inside the goal region over the episode; success = share >= 0.9"


def second_scorer():
    return None


def checks():
    """The frame checks of `iws eval stability` (validity envelope, whole object, still-world drift)."""
    from iws_gym.tasks.pilesweep import checks as c

    return c


def versions() -> dict:
    from importlib.metadata import version

    return {"pymunk_version": version("pymunk")}
