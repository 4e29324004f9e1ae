"""`iws eval datagen`: can demonstrations generated in the learned world replace real ones?

    iws eval datagen --real data/expert --episodes 100 --out runs/datagen --json reports/datagen.json

1. Generate: the demonstrator of the real demonstrations, reading the T from the frame (`ExpertPusher` for
   `--mix expert`, `MarkovExpertPusher` for `--mix expert_markov`), acts in the learned world from the start
   frames of the real demonstrations' seeds (`iws generate`).
2. Train: the same policy recipe (`iws train-policy`, fixed steps) on N episodes of which 0%, 50% and
   100% are generated and the rest real. The mixes share starts as little as they can: the generated part
   takes the last episodes' seeds, the real part the first. With `--successful-only` the generated part
   holds only episodes that end in the learned world's success (as a user who generates demonstrations
   would keep them): more starts are generated, from the seeds after the real ones, until there are N such
   episodes, linked in seed order into OUT/generated_successful.
3. Evaluate: each policy in gym-pusht (the real world), the same held-out starts, 300 steps.

Every step is resumable (generation keeps finished episodes, training resumes from its last.pt,
evaluations are kept as JSON in OUT), so rerunning the command after an interruption continues.
The report gives each policy's success and mean max coverage with standard errors, and the generated-
only policy's ratio to the real-only one, with a bootstrap interval over starts; a frame grid shows real
and generated demonstrations from the same starts side by side.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from iws_gym.data.episodes import list_episodes, load_meta, write_json_atomic
from iws_gym.envs.registry import TaskConfig

DEMONSTRATORS = {"expert": "iws_gym.policies:ExpertPusher", "expert_markov": "iws_gym.policies:MarkovExpertPusher"}


def mix_spec(real: Path, generated: Path, n: int, share: float) -> str:
    """The --data of a policy trained on n episodes, `share` of them generated: the real part from the
    first seeds, the generated part from the last (so the two parts start from different states)."""
    k = int(round(share * n))
    parts = []
    if n - k:
        parts.append(f"{real}:0-{n - k}")
    if k:
        parts.append(f"{generated}:{n - k}-{n}")
    return ",".join(parts)


def successes(gen: Path, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per generated episode 0..n-1: did it end in the learned env's success (its scorer's coverage > 0.95),
    and its length in steps."""
    from iws_gym.data.episodes import episode_path, read_episode

    cov = [read_episode(episode_path(gen, i), keys=("coverage",))["coverage"] for i in range(n)]
    return np.array([c[-1] > 0.95 for c in cov]), np.array([len(c) - 1 for c in cov])


def successful_subset(gen: Path, out: Path, n: int) -> dict:
    """OUT: relative links ep_000000.h5 ... to the first n episodes of `gen` (in seed order) that end in the
    learned world's success, and a dataset.json that says so and lists their indices in `gen`."""
    import os

    meta = load_meta(gen)
    won, lengths = successes(gen, meta["episodes"])
    ok = np.flatnonzero(won)
    if len(ok) < n:
        raise ValueError(f"{gen}: {len(ok)} of its {meta['episodes']} episodes end in success, {n} are needed")
    keep = [int(i) for i in ok[:n]]
    sub = dict(meta, episodes=n, successful_only=True, source=str(gen), source_indices=keep,
               seeds=[meta["seed"] + keep[0], meta["seed"] + keep[-1]],
               success_rate_in_learned_world=1.0, success_rate_of_source=float(len(ok) / meta["episodes"]),
               mean_length=float(lengths[keep].mean()))
    if (out / "dataset.json").is_file() and load_meta(out).get("source_indices") == keep:
        return load_meta(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dataset.json").unlink(missing_ok=True)  # written last: an interrupted relinking is redone
    for f in out.glob("ep_*.h5"):
        f.unlink()
    for j, i in enumerate(keep):
        src = gen / f"ep_{i:06d}.h5"
        os.symlink(os.path.relpath(src.resolve(), out.resolve()), out / f"ep_{j:06d}.h5")
    write_json_atomic(out / "dataset.json", sub)
    return sub


def ratio_interval(gen: np.ndarray, real: np.ndarray, n: int = 2000, seed: int = 0) -> list[float | None]:
    """5th / 50th / 95th percentile of mean(gen) / mean(real) over starts resampled together (None where
    the real policy scores 0 in every resample)."""
    rng = np.random.default_rng(seed)
    r = []
    for _ in range(n):
        idx = rng.integers(0, len(gen), len(gen))
        m = real[idx].mean()
        r.append(gen[idx].mean() / m if m > 0 else np.nan)
    if np.all(np.isnan(r)):
        return [None, None, None]
    return [float(q) for q in np.nanpercentile(r, [5, 50, 95])]


def datagen(task: TaskConfig, real: Path, out: Path, episodes: int = 100, shares=(0.0, 0.5, 1.0),
            train_steps: int = 12000, eval_episodes: int = 100, horizon: int = 300, checkpoint=None,
            device: str = "auto", grid: Path | None = None, preset: str = "default", batch: int = 64,
            successful_only: bool = False, max_generated: int | None = None) -> dict:
    from iws_gym.data.generate import generate
    from iws_gym.evaluation.policy_eval import evaluate_policy
    from iws_gym.training.train import STAGES, TrainArgs, run

    real, out = Path(real), Path(out)
    if episodes < 2 or train_steps < 1 or eval_episodes < 2 or horizon < 1 or batch < 1:
        raise ValueError(f"--episodes and --eval-episodes must be >= 2, --train-steps, --horizon and --batch >= 1; got "
                         f"{episodes}, {eval_episodes}, {train_steps}, {horizon}, {batch}")
    if any(not 0.0 <= s <= 1.0 for s in shares) or 0.0 not in shares or 1.0 not in shares:
        raise ValueError(f"--shares must lie in [0, 1] and include 0 and 1, got {list(shares)}")
    if max_generated is not None and max_generated < episodes:
        raise ValueError(f"--max-generated must be >= --episodes ({episodes}), got {max_generated}")
    meta = load_meta(real)
    if meta.get("generated"):
        raise ValueError(f"--real {real} is a generated dataset; the comparison needs real demonstrations")
    if meta.get("mix") not in DEMONSTRATORS:
        raise ValueError(f"--real {real} holds {meta.get('mix')!r} episodes; the comparison needs a demonstrator's "
                         f"(`iws collect --mix {' or --mix '.join(DEMONSTRATORS)}`)")
    generator = DEMONSTRATORS[meta["mix"]]
    have = len(list_episodes(real))
    if have < episodes:
        raise ValueError(f"--real {real} has {have} episodes, --episodes asks for {episodes}")
    out.mkdir(parents=True, exist_ok=True)

    # 1. the generated twin of the real demonstrations: same start seeds, the same demonstrator, the learned world
    gen, world = out / "generated", Path(checkpoint) if checkpoint else task.checkpoint_path
    if (gen / "dataset.json").is_file() and Path(load_meta(gen)["world_model"]["checkpoint"]) != world:
        raise ValueError(f"{gen} was generated by {load_meta(gen)['world_model']['checkpoint']}, not {world}; "
                         f"use another --out")

    def grow(n):  # generated episodes 0..n-1 (new, interrupted or grown)
        if not (gen / "dataset.json").is_file() or load_meta(gen)["episodes"] < n:
            generate(task, gen, n, steps=int(meta.get("steps") or 300), seed=int(meta["seed"]), policy=generator,
                     checkpoint=world, device=device, resume=gen.exists())

    grow(episodes)
    gen_meta, train_gen = load_meta(gen), gen
    if successful_only:  # more starts until `episodes` generated episodes end in success (at most max_generated)
        cap = max_generated or 3 * episodes
        n = max(episodes, gen_meta["episodes"])
        while (k := int(successes(gen, n)[0].sum())) < episodes:
            if n >= cap:
                raise ValueError(f"only {k} of {n} generated episodes end in the learned world's success; "
                                 f"--successful-only needs {episodes} (raise --max-generated, now {cap})")
            n = min(cap, n + int(np.ceil((episodes - k) / max(k / n, 1 / 3) * 1.1)))
            grow(n)
        gen_meta = load_meta(gen)
        train_gen = out / "generated_successful"
        kept = successful_subset(gen, train_gen, episodes)

    # 2. one policy per share, the same recipe; 3. each evaluated in gym-pusht
    policies = {}
    for share in shares:
        name = f"generated_{int(round(100 * share))}pct"
        # a larger --episodes later trains its own policies; the all-real one is the same with --successful-only
        run_dir = out / (f"{episodes}ep_successful" if successful_only and share > 0 else f"{episodes}ep") / name
        data = mix_spec(real, train_gen, episodes, share)
        done = run_dir / "train_result.json"
        if done.is_file():
            was = json.loads(done.read_text())["args"]
            now = dict(data=data, steps=train_steps, batch=batch, preset=preset)
            if any(was.get(k) != v for k, v in now.items()):
                raise ValueError(f"{run_dir} was trained with {({k: was.get(k) for k in now})}, not {now}; use another --out")
        if not (run_dir / "visuomotor.safetensors").is_file():
            a = TrainArgs(**{**vars(STAGES["policy"].defaults), "data": data, "out": str(run_dir), "steps": train_steps,
                             "batch": batch, "eval_every": max(1, train_steps // 4), "device": device})
            o = STAGES["policy"].Options(preset=preset)
            run("policy", a, o, ["--data", data, "--out", str(run_dir), "--steps", train_steps, "--preset", preset,
                                 "--batch", batch])
        ev_path = run_dir / f"eval_gym_pusht_{eval_episodes}x{horizon}.json"
        if not ev_path.is_file():
            ev = evaluate_policy(task, str(run_dir / "visuomotor.safetensors"), eval_episodes, horizon, learned=False)
            write_json_atomic(ev_path, ev)
        ev = json.loads(ev_path.read_text())
        policies[name] = dict(share_generated=share, data=data, weights=str(run_dir / "visuomotor.safetensors"),
                              **{k: v for k, v in ev["ground_truth"].items() if k != "scores"},
                              scores=ev["ground_truth"]["scores"])
    real_p, gen_p = policies["generated_0pct"], policies["generated_100pct"]
    g, r = np.asarray(gen_p["scores"]), np.asarray(real_p["scores"])
    ratios = dict(mean_max_coverage=gen_p["mean_max_coverage"] / max(real_p["mean_max_coverage"], 1e-9),
                  mean_max_coverage_interval=ratio_interval(g, r),
                  success=gen_p["success_rate"] / real_p["success_rate"] if real_p["success_rate"] > 0 else None,
                  success_interval=ratio_interval((g > 0.95).astype(float), (r > 0.95).astype(float)))
    report = dict(task=task.name, real=str(real), real_seeds=meta.get("seeds"), episodes=episodes, train_steps=train_steps,
                  preset=preset, batch=batch,
                  eval_episodes=eval_episodes, horizon=horizon, successful_only=successful_only,
                  generated=dict(data=str(gen), trained_on=str(train_gen), policy=generator, episodes=gen_meta["episodes"],
                  world_model=gen_meta.get("world_model"), success_rate_in_learned_world=gen_meta.get(
                      "success_rate_in_learned_world"), mean_length=gen_meta.get("mean_length"),
                  **(dict(kept=kept["episodes"], kept_mean_length=kept["mean_length"]) if successful_only else {})),
                  policies=policies, generated_over_real=ratios,
                  target=dict(rule="the 100%-generated policy reaches >= 95% of the real-data twin's success and mean max coverage",
                              met=bool(ratios["mean_max_coverage"] >= 0.95 and (ratios["success"] or 0) >= 0.95)))
    if grid is not None:
        frame_grid(real, gen, grid, episodes=range(min(4, episodes)))
        report["grid"] = str(grid)
    return report


def frame_grid(real: Path, gen: Path, path: Path, episodes=(0, 1, 2, 3), every: int = 20, cols: int = 8) -> None:
    """Rows: a real demonstration above its generated twin (same start), frames every `every` steps."""
    import cv2

    from iws_gym.data.episodes import episode_path, read_episode

    rows = []
    for i in episodes:
        pair = [read_episode(episode_path(d, i), keys=("frames",))["frames"] for d in (real, gen)]
        for frames in pair:
            idx = [min(t, len(frames) - 1) for t in range(0, cols * every, every)]
            rows.append(np.concatenate([frames[t] for t in idx], axis=1))
        rows.append(np.full((6, rows[-1].shape[1], 3), 255, np.uint8))
    img = np.concatenate(rows[:-1], axis=0)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
