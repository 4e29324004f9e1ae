"""T pushing, as the task-generic layers see it (the interface is documented in iws_gym/tasks/__init__.py).

Collection plans (`iws collect --mix`): the default play mix, whole-episode jittery pushes, whole episodes of a
uniform-random target every step (the stability check's random drive), expert demonstrations (the planning
expert on the true state; an episode ends at success, as Push-T's demonstrations do), or interventions (a
learner policy acts for a random 10-199 steps, then the expert takes over and shows how to recover from
where the learner went: DAgger's data with the expert's corrections as whole pushes).
"""
from __future__ import annotations

import numpy as np

from iws_gym.tasks.pusht.behaviours import SEGMENT_MIX, JitteryPush, RandomTargets, Sweep, near_goal_state, sample_episode_plan
from iws_gym.tasks.pusht.groundtruth import get_state, make_env, render_state, reset_state  # noqa: F401  (the interface)

SEGMENT_NAMES = [m[0] for m in SEGMENT_MIX] + ["push_near_goal", "push_jittery", "random", "expert", "learner",
                                             "expert_markov"]  # append only: files store indices
STATE_SIZE, STATE_DOC = 5, "[agent x, y, block x, y, angle]"  # get_state's vector, as gym-pusht's reset_to_state
# the spatial stage 2's options in `iws train recipe` (docs/training.md): agent track, windows where the block moves
# or the agent jumps, the agent erased and the block corrupted in re-renders of the T's pose
STAGE2_OPTIONS = ["--agent-track", "--focus", "0.5", "--jump-focus", "0.3", "--drop-agent", "0.2",
                  "--corrupt-block", "0.2"]
MIXES = ("play", "jittery", "random", "expert", "intervention", "expert_markov")
PLAY_BEHAVIOURS = ("mix", "unseen", "jittery", "random")  # scripted play and its variants (the trust calibration's)
HELDOUT_BEHAVIOURS = PLAY_BEHAVIOURS + ("expert",)
LEARNER_STEPS = (10, 200)  # the learner's part of an intervention episode, drawn uniformly from [lo, hi)


def observe(env, info) -> dict:
    """The true state recorded with each observation (for evaluation only)."""
    return {"block_pose": info["block_pose"],
            "coverage": float(info["coverage"]) if "coverage" in info else float(env._get_coverage())}


def step_record(info) -> dict:
    """What is recorded with each step besides the action."""
    return {"n_contacts": info["n_contacts"]}


def play_plan(rng: np.random.Generator, steps: int):
    """The default play mix: (plan, reset options); a tenth of the episodes start near the goal."""
    plan, near_goal = sample_episode_plan(rng, steps)
    return plan, ({"reset_to_state": near_goal_state(rng)} if near_goal else None)


def mix_plan(mix: str, seed: int, steps: int, learner=None):
    """The plan of one episode of `iws collect --mix MIX` (None: the play mix, sampled by `play_plan`)."""
    if mix == "play":
        return None
    if mix == "intervention":
        from iws_gym.tasks.pusht.expert import PlanningPusher

        n = min(steps, int(np.random.default_rng([seed, 4]).integers(*LEARNER_STEPS)))
        return [("learner", learner, n), ("expert", PlanningPusher(np.random.default_rng([seed, 3])), steps - n)]
    if mix == "random":
        return [("random", RandomTargets(np.random.default_rng([seed, 2])), steps)]
    if mix == "expert":
        from iws_gym.tasks.pusht.expert import PlanningPusher

        return [("expert", PlanningPusher(np.random.default_rng([seed, 3])), steps)]
    if mix == "expert_markov":
        from iws_gym.tasks.pusht.expert import MARKOV, PlanningPusher

        return [("expert_markov", PlanningPusher(np.random.default_rng([seed, 3]), **MARKOV), steps)]
    return [("push_jittery", JitteryPush(np.random.default_rng([seed, 1])), steps)]


def mix_of(plan: str) -> str:
    """The `--mix` an episode was collected with, from its stored plan attribute ("name:steps;...")."""
    for mix, prefix in (("jittery", "push_jittery:"), ("random", "random:"), ("expert", "expert:"),
                        ("expert_markov", "expert_markov:"),
                        ("intervention", "learner:")):
        if plan.startswith(prefix):
            return mix
    return "play"


def heldout_plan(behaviour: str, seed: int, steps: int):
    """The plan of a held-out episode of `behaviour` (None: the play mix). "unseen": the evaluation-only Sweep
    raster; "expert": the planning expert for the whole horizon, under another name than the
    demonstrations' "expert", so it does not stop at success."""
    if behaviour == "mix":
        return None
    if behaviour in ("jittery", "random"):
        return mix_plan(behaviour, seed, steps)
    if behaviour == "expert":
        from iws_gym.tasks.pusht.expert import PlanningPusher

        return [("expert_heldout", PlanningPusher(np.random.default_rng([seed, 3])), steps)]
    return [("sweep", Sweep(np.random.default_rng(seed)), steps)]


READING_KEYS = ("agent_px", "block_px", "block_rad", "coverage")  # what fidelity reads from frames: errors in px, rad, coverage


def readings(pred: np.ndarray, ep: dict) -> dict:
    """Per-step readings of predicted frames against an episode's true state (evaluation/fidelity.py)."""
    from iws_gym.evaluation.fidelity import pusht_readings

    return pusht_readings(pred, ep)


def rerender(ep: dict, horizon: int, frame_size: int) -> np.ndarray:
    """An episode's true states over `horizon` steps drawn again by gym-pusht's renderer: fidelity's floor."""
    from iws_gym.tasks.pusht.groundtruth import render_states

    return render_states(ep["agent_pos"][: horizon + 1], ep["block_pose"][: horizon + 1], frame_size)


def success(coverage) -> np.ndarray:
    """Success per coverage value, as gym-pusht decides it (coverage > 0.95)."""
    from iws_gym.tasks.pusht.groundtruth import SUCCESS_THRESHOLD

    return np.asarray(coverage) > SUCCESS_THRESHOLD


SCORE_DOC = "max coverage over the episode (Push-T); success = max coverage > 0.95"


def second_scorer():
    """A second reader of the score from frames (the pose fit), to tell a scorer's error from the dynamics'."""
    from iws_gym.tasks.pusht.scorer import TPushCoverageScorer

    return TPushCoverageScorer(method="pose")


def checks():
    """The frame checks of `iws eval stability` (validity envelope, whole object, still-world drift)."""
    from iws_gym.tasks.pusht import checks as c

    return c


def versions() -> dict:
    """Versions of the ground truth, recorded with each collection."""
    return {"gym_pusht_version": _version("gym-pusht")}


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "unknown"
