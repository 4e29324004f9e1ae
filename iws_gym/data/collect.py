"""`iws collect`: record scripted play in the ground-truth simulator (gym-pusht) as episode files.

Episode i of a collection with seed S uses seed S + i for both gym-pusht's reset and the behaviour
RNG, so any episode can be regenerated alone and collections are deterministic. Held-out episodes use
seeds >= the task's `heldout_seed_base` and are generated in memory when evaluating (`heldout_episodes`).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from iws_gym.tasks.pusht.behaviours import SEGMENT_MIX, JitteryPush, RandomTargets, Sweep, near_goal_state, sample_episode_plan
from iws_gym.data.splits import split_offset
from iws_gym.data.episodes import episode_path, write_episode, write_json_atomic
from iws_gym.tasks.pusht.groundtruth import get_state, make_env
from iws_gym.envs.registry import TaskConfig
from iws_gym.models.checkpoint import git_commit

SEGMENT_NAMES = [m[0] for m in SEGMENT_MIX] + ["push_near_goal", "push_jittery", "random", "expert", "learner"]  # append only: files store indices
# `iws collect --mix`: the default play mix, whole-episode jittery pushes, whole episodes of a uniform-random
# target every step (the stability check's random drive, `behaviours.RandomTargets`), or expert demonstrations
# (`expert.PlanningPusher` on the true state; an episode ends at success, as Push-T's demonstrations do), or
# interventions (a learner policy acts for a random 10-199 steps, then the expert takes over and shows how
# to recover from where the learner went: DAgger's data with the expert's corrections as whole pushes)
MIXES = ("play", "jittery", "random", "expert", "intervention")
LEARNER_STEPS = (10, 200)  # the learner's part of an intervention episode, drawn uniformly from [lo, hi)


class Learner:
    """A policy acting on gym-pusht's observations, as a segment of a collected episode (`--mix intervention`)."""

    reads_obs = True

    def __init__(self, policy, seed: int):
        self.policy = policy
        if hasattr(policy, "reset"):
            policy.reset(seed)

    def act_obs(self, obs) -> np.ndarray:
        return np.asarray(self.policy(obs), dtype=np.float32).reshape(-1, 2)[0]


def check_mix(mix: str, policy: str | None = None) -> None:
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")
    if (mix == "intervention") != (policy is not None):
        raise ValueError("--mix intervention needs --policy (the learner), and only it takes one")


def episode_plan(mix: str, seed: int, steps: int, policy=None):
    """An explicit plan for `collect_episode` (None: sample the default play mix from the episode's rng).
    `policy`: the learner of `--mix intervention` (a policy object)."""
    check_mix(mix, None if policy is None else "policy")
    if mix == "play":
        return None
    if mix == "intervention":
        from iws_gym.tasks.pusht.expert import PlanningPusher

        n = min(steps, int(np.random.default_rng([seed, 4]).integers(*LEARNER_STEPS)))
        return [("learner", Learner(policy, seed), n), ("expert", PlanningPusher(np.random.default_rng([seed, 3])), steps - n)]
    if mix == "random":
        return [("random", RandomTargets(np.random.default_rng([seed, 2])), steps)]
    if mix == "expert":
        from iws_gym.tasks.pusht.expert import PlanningPusher

        return [("expert", PlanningPusher(np.random.default_rng([seed, 3])), steps)]
    return [("push_jittery", JitteryPush(np.random.default_rng([seed, 1])), steps)]


def mix_of(plan: str) -> str:
    """The `--mix` an episode was collected with, from its stored plan attribute ("name:steps;...")."""
    for mix, prefix in (("jittery", "push_jittery:"), ("random", "random:"), ("expert", "expert:"),
                        ("intervention", "learner:")):
        if plan.startswith(prefix):
            return mix
    return "play"


def collect_episode(task: TaskConfig, seed: int, steps: int | None = None, env=None, plan=None) -> dict:
    """One episode of scripted play from seed `seed`. Returns the arrays of `data.ARRAYS` plus 'plan'.

    `plan` ([(name, behaviour, n_steps), ...]) overrides the sampled behaviour mix."""
    steps = steps or task.episode_steps
    env = env or make_env(task.frame_size)
    rng = np.random.default_rng(seed)
    if plan is None:
        plan, near_goal = sample_episode_plan(rng, steps)
    else:
        near_goal = False
    options = {"reset_to_state": near_goal_state(rng)} if near_goal else None
    obs, info = env.reset(seed=seed, options=options)
    frames, agent_pos, block_pose, coverage = [obs["pixels"]], [obs["agent_pos"]], [info["block_pose"]], [0.0]
    actions, contacts, segments = [], [], []
    coverage[0] = float(env._get_coverage())
    stopped = False
    for k, (name, behaviour, n) in enumerate(plan):
        for _ in range(n):
            if getattr(behaviour, "reads_obs", False):
                a = behaviour.act_obs(obs)
            else:
                a = np.asarray(behaviour.act(get_state(env)), dtype=np.float32)
            obs, _, _, _, info = env.step(a)
            actions.append(a)
            frames.append(obs["pixels"])
            agent_pos.append(obs["agent_pos"])
            block_pose.append(info["block_pose"])
            coverage.append(info["coverage"])
            contacts.append(info["n_contacts"])
            segments.append(SEGMENT_NAMES.index(name) if name in SEGMENT_NAMES else -1)
            stopped = name == "expert" and info["is_success"]  # a demonstration ends at success
            if stopped:
                break
        if stopped:  # the plan as executed: the segments before, and this one cut short
            done = sum(m for _, _, m in plan[:k])
            plan = plan[:k] + [(name, behaviour, len(actions) - done)]
            break
    return dict(
        frames=np.stack(frames), actions=np.stack(actions), agent_pos=np.stack(agent_pos),
        block_pose=np.stack(block_pose), coverage=np.array(coverage), n_contacts=np.array(contacts),
        segments=np.array(segments), plan=[(name, n) for name, _, n in plan],
    )


PLAY_BEHAVIOURS = ("mix", "unseen", "jittery", "random")  # scripted play and its variants (the trust calibration's)
HELDOUT_BEHAVIOURS = PLAY_BEHAVIOURS + ("expert",)


def heldout_episodes(task: TaskConfig, n: int, steps: int, split: str = "test", first: int = 0, progress: bool = False,
                     behaviour: str = "mix"):
    """Held-out ground-truth episodes n of a named split (data.splits), from its `first`-th seed on,
    generated on the fly from seeds disjoint from any training seed.

    behaviour="mix": the training behaviour mix; "unseen": the evaluation-only Sweep policy; "jittery":
    whole-episode jittery pushes (`iws collect --mix jittery`); "random": a uniform-random target every step
    (the evaluation-only RandomTargets, as `iws eval stability` drives the model); "expert": the planning
    expert's competent pushes (PlanningPusher), for the whole horizon (it does not stop at success)."""
    from tqdm import tqdm

    if behaviour not in HELDOUT_BEHAVIOURS:
        raise ValueError(f"behaviour must be one of {HELDOUT_BEHAVIOURS}, got {behaviour!r}")
    base = split_offset(split) + first
    env = make_env(task.frame_size)
    for i in tqdm(range(n), desc=f"held-out episodes ({behaviour})", disable=not progress):
        seed = task.heldout_seed_base + base + i
        if behaviour == "mix":
            yield collect_episode(task, seed, steps, env)
        elif behaviour == "jittery":
            yield collect_episode(task, seed, steps, env, plan=episode_plan("jittery", seed, steps))
        elif behaviour == "random":
            yield collect_episode(task, seed, steps, env, plan=episode_plan("random", seed, steps))
        elif behaviour == "expert":  # under another name than the demonstrations' "expert": no stop at success
            from iws_gym.tasks.pusht.expert import PlanningPusher

            yield collect_episode(task, seed, steps, env, plan=[("expert_heldout", PlanningPusher(np.random.default_rng([seed, 3])), steps)])
        else:
            yield collect_episode(task, seed, steps, env, plan=[("sweep", Sweep(np.random.default_rng(seed)), steps)])


def check_out_dir(out: Path, resume: bool) -> set[int]:
    """Make sure `out` can take a new collection. Returns the indices already there when resuming."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory")
    existing = sorted(out.glob("ep_*.h5")) if out.is_dir() else []
    if out.is_dir() and any(out.iterdir()) and not resume:
        raise ValueError(f"output directory {out} is not empty; use a new directory, or --resume to complete an interrupted collection")
    probe = out / ".write_test"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"output directory {out} cannot be created or written ({e.strerror})") from None
    for tmp in out.glob("*.h5.tmp"):  # half-written leftovers of an interrupted run
        tmp.unlink()
    return {int(p.stem.split("_")[1]) for p in existing}


_ENV = {}  # one gym-pusht per process and frame size (collection workers reuse theirs)


def _collect_one(job) -> int:
    """Record episode i of a collection (seed + i) into its file."""
    task, seed, i, steps, mix, out, policy = job
    env = _ENV.get(task.frame_size)
    if env is None:
        env = _ENV[task.frame_size] = make_env(task.frame_size)
    learner = None
    if policy is not None:  # one learner per process, reset for each episode
        if policy not in _ENV:
            from iws_gym.policies import load_policy_factory

            _ENV[policy] = load_policy_factory(policy)()
        learner = _ENV[policy]
    ep = collect_episode(task, seed + i, steps, env, plan=episode_plan(mix, seed + i, steps, learner))
    attrs = dict(seed=seed + i, task=task.name, segment_names=SEGMENT_NAMES, **({"learner": policy} if policy else {}),
                 plan=";".join(f"{n}:{k}" for n, k in ep.pop("plan")))
    write_episode(episode_path(out, i), ep, attrs)
    return i


def collect(task: TaskConfig, episodes: int, out: Path, seed: int = 0, steps: int | None = None,
            resume: bool = False, progress: bool = True, mix: str = "play", workers: int = 1,
            policy: str | None = None) -> dict:
    """Record `episodes` episodes of scripted play (episode i: seed + i) into `out`, with `workers` processes."""
    from tqdm import tqdm

    if episodes <= 0:
        raise ValueError(f"--episodes must be > 0, got {episodes}")
    steps = steps or task.episode_steps
    if steps <= 0:
        raise ValueError(f"--steps must be > 0, got {steps}")
    if seed < 0 or seed + episodes > task.heldout_seed_base:
        raise ValueError(f"seeds {seed}..{seed + episodes - 1} overlap the held-out range (>= {task.heldout_seed_base}) or are negative")
    check_mix(mix, policy)  # before anything is written
    if policy is not None:
        from iws_gym.policies import load_policy_factory

        load_policy_factory(policy)  # a bad --policy fails here
    out = Path(out)
    done = check_out_dir(out, resume)
    if done:  # resuming: the finished episodes must be this very collection's (same seeds, same mix)
        from iws_gym.data.episodes import read_episode

        i = min(done)
        attrs = read_episode(episode_path(out, i), keys=())["attrs"]
        was = mix_of(str(attrs.get("plan", "")))
        if int(attrs.get("seed", -1)) != seed + i or was != mix:
            raise ValueError(f"cannot resume {out} with --seed {seed} --mix {mix}: its episode {i} was collected with "
                             f"seed {attrs.get('seed')} and mix {was} (expected seed {seed + i})")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    t0 = time.time()
    todo = [i for i in range(episodes) if i not in done]
    jobs = [(task, seed, i, steps, mix, out, policy) for i in todo]
    bar = dict(total=len(todo), desc=f"collect {task.name}", unit="ep", disable=not progress)
    if workers == 1:
        for job in tqdm(jobs, **bar):
            _collect_one(job)
    else:  # episodes are independent files: any number of processes, each with its own gym-pusht
        import multiprocessing as mp

        with mp.get_context("fork").Pool(workers) as pool:
            for _ in tqdm(pool.imap_unordered(_collect_one, jobs), **bar):
                pass
    wall = time.time() - t0
    meta = dict(task=task.name, episodes=episodes, steps=steps, seed=seed, mix=mix, seeds=[seed, seed + episodes - 1],
                **({"learner": policy} if policy else {}),
                frame_size=task.frame_size, ground_truth=task.ground_truth, gym_pusht_version=_version("gym-pusht"),
                commit=git_commit(), wall_s=round(wall, 1),
                episodes_per_min=round(len(todo) / max(wall, 1e-9) * 60, 1) if todo else None)
    write_json_atomic(out / "dataset.json", meta)
    return meta


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "unknown"
