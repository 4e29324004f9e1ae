"""`iws collect`: record scripted play in a task's ground-truth simulator (gym-pusht for T pushing) as episode
files. What is task-specific (the env, its behaviours, what each step records) comes from the task's module
(`TaskConfig.module`, e.g. tasks/pusht/task.py).

Episode i of a collection with seed S uses seed S + i for both gym-pusht's reset and the behaviour
RNG, so any episode can be regenerated alone and collections are deterministic. Held-out episodes use
seeds >= the task's `heldout_seed_base` and are generated in memory when evaluating (`heldout_episodes`).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from iws_gym.data.splits import split_offset
from iws_gym.data.episodes import episode_path, write_episode, write_json_atomic
from iws_gym.envs.registry import TaskConfig
from iws_gym.models.checkpoint import git_commit
from iws_gym.tasks.pusht.task import HELDOUT_BEHAVIOURS, LEARNER_STEPS, PLAY_BEHAVIOURS, SEGMENT_NAMES  # noqa: F401  (T pushing's)


class Learner:
    """A policy acting on the ground truth's observations, as a segment of a collected episode (`--mix intervention`)."""

    reads_obs = True

    def __init__(self, policy, seed: int):
        self.policy = policy
        if hasattr(policy, "reset"):
            policy.reset(seed)

    def act_obs(self, obs) -> np.ndarray:
        return np.asarray(self.policy(obs), dtype=np.float32).reshape(-1, 2)[0]


def check_mix(mix: str, policy: str | None = None, task: TaskConfig | None = None) -> None:
    mixes = _module(task).MIXES
    if mix not in mixes:
        raise ValueError(f"mix must be one of {mixes}" + (f" for {task.name}" if task else "") + f", got {mix!r}")
    if (mix == "intervention") != (policy is not None):
        raise ValueError("--mix intervention needs --policy (the learner), and only it takes one")


def episode_plan(mix: str, seed: int, steps: int, policy=None, task: TaskConfig | None = None):
    """An explicit plan for `collect_episode` (None: sample the default play mix from the episode's rng).
    `policy`: the learner of `--mix intervention` (a policy object). `task`: T pushing when None."""
    check_mix(mix, None if policy is None else "policy", task)
    gt = _module(task)
    return gt.mix_plan(mix, seed, steps, Learner(policy, seed) if policy is not None else None)


def mix_of(plan: str, task: TaskConfig | None = None) -> str:
    """The `--mix` an episode was collected with, from its stored plan attribute ("name:steps;...")."""
    return _module(task).mix_of(plan)


def _module(task: TaskConfig | None):
    if task is None:
        from iws_gym.tasks.pusht import task as pusht

        return pusht
    return task.module


def reset_episode(task: TaskConfig, env, seed: int, steps: int, plan=None):
    """Reset `env` where `collect_episode(task, seed, steps, plan=plan)` starts (the play mix may choose the
    start): returns the first observation, info and the plan."""
    options = None
    if plan is None:
        plan, options = task.module.play_plan(np.random.default_rng(seed), steps)
    obs, info = env.reset(seed=seed, options=options)
    return obs, info, plan


def collect_episode(task: TaskConfig, seed: int, steps: int | None = None, env=None, plan=None) -> dict:
    """One episode of scripted play from seed `seed`. Returns the arrays of `data.episodes.ARRAYS` that the
    task records, plus 'plan'. `plan` ([(name, behaviour, n_steps), ...]) overrides the sampled play mix."""
    gt = task.module
    steps = steps or task.episode_steps
    env = env or gt.make_env(task.frame_size)
    obs, info, plan = reset_episode(task, env, seed, steps, plan)
    rec = {"frames": [obs["pixels"]], "agent_pos": [obs["agent_pos"]]}
    for k, v in gt.observe(env, info).items():
        rec[k] = [v]
    per_step = {"actions": [], "segments": []}
    stopped = False
    for k, (name, behaviour, n) in enumerate(plan):
        for _ in range(n):
            if getattr(behaviour, "reads_obs", False):
                a = behaviour.act_obs(obs)
            else:
                a = np.asarray(behaviour.act(gt.get_state(env)), dtype=np.float32)
            obs, _, _, _, info = env.step(a)
            rec["frames"].append(obs["pixels"])
            rec["agent_pos"].append(obs["agent_pos"])
            for key, v in gt.observe(env, info).items():
                rec[key].append(v)
            per_step["actions"].append(a)
            per_step["segments"].append(gt.SEGMENT_NAMES.index(name) if name in gt.SEGMENT_NAMES else -1)
            for key, v in gt.step_record(info).items():
                per_step.setdefault(key, []).append(v)
            stopped = name in ("expert", "expert_markov") and info["is_success"]  # a demonstration ends at success
            if stopped:
                break
        if stopped:  # the plan as executed: the segments before, and this one cut short
            done = sum(m for _, _, m in plan[:k])
            plan = plan[:k] + [(name, behaviour, len(per_step["actions"]) - done)]
            break
    return dict({key: np.asarray(v) for key, v in {**rec, **per_step}.items()}, plan=[(name, n) for name, _, n in plan])


def heldout_seed(task: TaskConfig, split: str, i: int) -> int:
    """The seed of the i-th held-out episode of a named split (data.splits)."""
    return task.heldout_seed_base + split_offset(split) + i


def heldout_episodes(task: TaskConfig, n: int, steps: int, split: str = "test", first: int = 0, progress: bool = False,
                     behaviour: str = "mix"):
    """Held-out ground-truth episodes n of a named split (data.splits), from its `first`-th seed on,
    generated on the fly from seeds disjoint from any training seed.

    behaviour (T pushing's; other tasks name theirs in HELDOUT_BEHAVIOURS): "mix": the training behaviour mix;
    "unseen": the evaluation-only Sweep policy; "jittery": whole-episode jittery pushes (`iws collect --mix
    jittery`); "random": a uniform-random target every step (as `iws eval stability` drives the model);
    "expert": the planning expert's competent pushes, for the whole horizon (it does not stop at success)."""
    from tqdm import tqdm

    gt = task.module
    if behaviour not in gt.HELDOUT_BEHAVIOURS:
        raise ValueError(f"behaviour must be one of {gt.HELDOUT_BEHAVIOURS}, got {behaviour!r}")
    env = gt.make_env(task.frame_size)
    for i in tqdm(range(n), desc=f"held-out episodes ({behaviour})", disable=not progress):
        seed = heldout_seed(task, split, first + i)
        yield collect_episode(task, seed, steps, env, plan=gt.heldout_plan(behaviour, seed, steps))


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


_ENV = {}  # one ground-truth env per process, task and frame size (collection workers reuse theirs)


def _collect_one(job) -> int:
    """Record episode i of a collection (seed + i) into its file."""
    task, seed, i, steps, mix, out, policy = job
    env = _ENV.get((task.name, task.frame_size))
    if env is None:
        env = _ENV[(task.name, task.frame_size)] = task.module.make_env(task.frame_size)
    learner = None
    if policy is not None:  # one learner per process, reset for each episode
        if policy not in _ENV:
            from iws_gym.policies import load_policy_factory

            _ENV[policy] = load_policy_factory(policy)()
        learner = _ENV[policy]
    ep = collect_episode(task, seed + i, steps, env, plan=episode_plan(mix, seed + i, steps, learner, task))
    attrs = dict(seed=seed + i, task=task.name, segment_names=task.module.SEGMENT_NAMES, **({"learner": policy} if policy else {}),
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
    check_mix(mix, policy, task)  # before anything is written
    if policy is not None:
        from iws_gym.policies import load_policy_factory

        load_policy_factory(policy)  # a bad --policy fails here
    out = Path(out)
    done = check_out_dir(out, resume)
    if done:  # resuming: the finished episodes must be this very collection's (same seeds, same mix)
        from iws_gym.data.episodes import read_episode

        i = min(done)
        attrs = read_episode(episode_path(out, i), keys=())["attrs"]
        was = mix_of(str(attrs.get("plan", "")), task)
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
    else:  # episodes are independent files: any number of processes, each with its own ground truth
        import multiprocessing as mp

        with mp.get_context("fork").Pool(workers) as pool:
            for _ in tqdm(pool.imap_unordered(_collect_one, jobs), **bar):
                pass
    wall = time.time() - t0
    meta = dict(task=task.name, episodes=episodes, steps=steps, seed=seed, mix=mix, seeds=[seed, seed + episodes - 1],
                **({"learner": policy} if policy else {}),
                frame_size=task.frame_size, ground_truth=task.ground_truth, **task.module.versions(),
                commit=git_commit(), wall_s=round(wall, 1),
                episodes_per_min=round(len(todo) / max(wall, 1e-9) * 60, 1) if todo else None)
    write_json_atomic(out / "dataset.json", meta)
    return meta
