"""`iws train recipe`: from nothing to released weights in one command, resumable after any interruption.

    iws train recipe --task tpushing --out runs/recipe                      # 2 CPU cores
    iws train recipe --task tpushing --out runs/recipe --scale gpu --workers 14 --budget-minutes 9   # one GPU
    iws train recipe --task tpushing --out runs/compact --design compact     # the compact design (models/compact.py)

Steps, in order: collect the dataset (OUT/data), train stage 1 (OUT/stage1), train stage 2 on it
(OUT/stage2), release both with their provenance (OUT/release, laid out like checkpoints/<task>; with the
design's inference settings, RELEASE_SETTINGS). The compact
design also collects the planning expert's pushes and uniform-random and jittery drives (OUT/data_expert,
OUT/data_random, OUT/data_jittery), on which with OUT/data stage 1 trains (OUT/compact1), and, once stage 1 is
done, 3.4 times as many episodes again (OUT/data_*_more) for stage 2 alone (OUT/compact2). A step
that is done is skipped; one that was interrupted resumes from its checkpoint when the same command runs
again. `--max-minutes` (per training stage) or `--budget-minutes` (the whole recipe, shared out between
the stages) stop a stage after a checkpoint: rerun the command to continue, or, with --budget-minutes,
the stage's weights so far are released as they are. OUT/recipe.json records the command, seeds, each
step's wall time and the commit.
"""
from __future__ import annotations

import json
import sys
import time
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path

from iws_gym.training.common import arg

SCALES = {  # model size and batch per stage; "gpu" is what one GPU affords in minutes and 2 cores never could
    "tiny": dict(stage1=dict(batch=4, preset="tiny", crop=64), stage2=dict(batch=4, preset="tiny")),
    "cpu": dict(stage1=dict(batch=32, preset="default", crop=64), stage2=dict(batch=32, preset="default")),
    "gpu": dict(stage1=dict(batch=128, preset="default", crop=0), stage2=dict(batch=128, preset="large")),
}
COMPACT_SCALES = {  # the compact design: stage-1 batch and preset; its stage 2 is small MLPs at batch 128 anywhere
    "tiny": dict(batch=4, preset="tiny", stage2_preset="tiny"),
    "cpu": dict(batch=32, preset="default", stage2_preset="default"),
    "gpu": dict(batch=256, preset="default", stage2_preset="default"),
}
# the compact design's extra collections: (folder, --mix, episodes per 1000 of --episodes, seed offset, stage 2
# only). Stage 1 holds its frames in RAM (about 10 GB for the first four collections at the default 400); stage 2
# trains on latents and also takes the "more" collections: more episodes, not more steps, lowered its held-out
# error (docs/experiments.md, sixteenth session), and more expert pushes placed the pushed T better (seventeenth). Seeds stay apart for --episodes below 15,000.
COMPACT_DATA = [("data_expert", "expert", 750, 200000, False), ("data_random", "random", 600, 300000, False),
                ("data_jittery", "jittery", 300, 310000, False), ("data_play_more", "play", 6500, 100000, True),
                ("data_random_more", "random", 1800, 400000, True), ("data_jittery_more", "jittery", 600, 500000, True),
                ("data_expert_more", "expert", 1750, 600000, True)]
DEFAULTS = {  # per design: steps and peak learning rate of each stage (compact stage 2: its candidates' dynamics
    # trained 43,000 steps over three runs, checkpoints/candidates/compact_v3/provenance.json)
    "spatial": dict(episodes=600, stage1_steps=24000, stage2_steps=6000, stage1_lr=1e-3, stage2_lr=7e-4),
    "compact": dict(episodes=400, stage1_steps=24000, stage2_steps=40000, stage1_lr=5e-4, stage2_lr=1e-3),
}

# per design, settings chosen after training that act only at inference, applied to the release as `iws release
# --set` would (recorded in its provenance's config_set): the compact latent denoiser integrated as an ODE from its
# sigma down to 0.01 in four calls (issue 36; docs/results.md, "The latent denoiser integrated as an ODE")
RELEASE_SETTINGS = {"compact": {"denoiser_steps": 4}}


@dataclass
class RecipeArgs:
    task: str = arg("tpushing", "task config name (iws_gym/envs/configs/<task>.toml)")
    out: str = arg("runs/recipe", "output folder: data/, stage1/, stage2/, release/, recipe.json")
    scale: str = arg("cpu", "model size and batch: tiny (tests) | cpu (2 cores) | gpu (one GPU)")
    design: str = arg("spatial", "spatial (models/encoder, decoder, dynamics; the one a pile of pucks needs) | "
                                  "compact (models/compact.py; the shipped T-pushing weights)")
    episodes: int | None = arg(None, "episodes of scripted play to collect (default: spatial 600, compact 400, plus "
                                     "0.75x, 0.6x and 0.3x as many expert, random and jittery episodes; compact: "
                                     "6.5x, 1.8x, 0.6x and 1.75x more play, random, jittery and expert ones for "
                                     "stage 2)")
    episode_steps: int | None = arg(None, "steps per episode (default: the task's)")
    seed: int = arg(0, "collection seed (episode i uses seed + i) and training seed")
    workers: int = arg(1, "collection processes (one per core)")
    stage1_steps: int | None = arg(None, "stage-1 optimizer steps (default: 24000)")
    stage2_steps: int | None = arg(None, "stage-2 optimizer steps (default: spatial 6000, compact 40000)")
    stage1_lr: float | None = arg(None, "stage-1 peak learning rate (default: spatial 1e-3, compact 5e-4)")
    stage2_lr: float | None = arg(None, "stage-2 peak learning rate (default: spatial 7e-4, compact 1e-3)")
    objective: str = arg("consistency", "stage-2 objective: consistency | denoise (see iws train stage2 --help)")
    eval_every: int = arg(1000, "steps between evaluations during training")
    device: str = arg("auto", "auto | cpu | cuda")
    max_minutes: float | None = arg(None, "stop each training stage after a checkpoint past this much wall time; "
                                           "rerun to continue")
    budget_minutes: float | None = arg(None, "wall-time budget of the whole recipe: stage 1 gets 40% of what is "
                                             "left after collection, stage 2 the rest; each stage's weights are "
                                             "released as they are when its share runs out")


# the spatial design's stage-2 options come from the task (STAGE2_OPTIONS of its module: T pushing's shipped
# recipe focuses on and re-renders windows by the T's pose; a pile has no such pose)


def _finished(run: Path, steps: int) -> bool:
    f = run / "train_result.json"
    if not f.is_file():
        return False
    r = json.loads(f.read_text())
    return bool(r.get("finished")) and r.get("step") == steps


def recipe(r: RecipeArgs, argv=None) -> dict:
    from iws_gym.data.collect import collect
    from iws_gym.envs.registry import load_task
    from iws_gym.models.checkpoint import git_commit
    from iws_gym.training.release import release
    from iws_gym.training.train import main as train_main

    if r.scale not in SCALES:
        raise ValueError(f"--scale must be one of {', '.join(SCALES)}, got {r.scale!r}")
    if r.design not in DEFAULTS:
        raise ValueError(f"--design must be one of {', '.join(DEFAULTS)}, got {r.design!r}")
    r = dataclasses.replace(r, **{k: v for k, v in DEFAULTS[r.design].items() if getattr(r, k) is None})
    if min(r.episodes, r.stage1_steps, r.stage2_steps, r.workers) < 1:
        raise ValueError("--episodes, --stage1-steps, --stage2-steps and --workers must be >= 1")
    task = load_task(r.task)
    out = Path(r.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = out / "recipe.json"
    log = json.loads(log_file.read_text()) if log_file.is_file() else {}
    if log.get("args") and {k: v for k, v in log["args"].items() if k not in ("max_minutes", "budget_minutes", "workers", "device")} != \
            {k: v for k, v in asdict(r).items() if k not in ("max_minutes", "budget_minutes", "workers", "device")}:
        raise ValueError(f"{log_file}: {out} holds a recipe run with other settings ({log['args']}); use a new --out")
    log.update(args=asdict(r), command=" ".join(["iws", "train", "recipe", *map(str, argv or [])]),
               commit=git_commit(), steps=log.get("steps", {}))
    t_start = time.time()

    def note(key, **kw):
        log["steps"][key] = {**log["steps"].get(key, {}), **kw}
        log_file.write_text(json.dumps(log, indent=2))

    # 1. data
    data = out / "data"
    meta_file = data / "dataset.json"
    if not (meta_file.is_file() and json.loads(meta_file.read_text()).get("episodes") == r.episodes):
        t0 = time.time()
        meta = collect(task, r.episodes, data, seed=r.seed, steps=r.episode_steps, resume=data.is_dir(), workers=r.workers)
        note("collect", wall_s=round(time.time() - t0, 1), seeds=meta["seeds"], episodes=r.episodes)
    stage1_extra, stage2_extra = [], []  # the compact stages' --extra-data
    compact_data = [c for c in COMPACT_DATA if c[1] in task.module.MIXES] if r.design == "compact" else []
    for folder, mix, per_1000, offset, stage2_only in compact_data:  # e.g. pile sweeping has no jittery pushes
        stage2_extra.append(str(out / folder))
        if not stage2_only:
            stage1_extra.append(str(out / folder))

    def collect_extra(stage: int):
        """The compact design's extra collections one stage needs: competent pushes, fast random drives and
        jittery pushes, scenes play rarely shows. Stage 2's own are collected only once stage 1 is done, so that
        a stage-1 run resumed on a fresh machine waits for its own data alone."""
        for folder, mix, per_1000, offset, stage2_only in compact_data:
            if stage2_only and stage == 1:
                continue
            n, d = max(1, r.episodes * per_1000 // 1000), out / folder
            f = d / "dataset.json"
            if not (f.is_file() and json.loads(f.read_text()).get("episodes") == n):
                t0 = time.time()
                meta = collect(task, n, d, seed=r.seed + offset, steps=r.episode_steps, resume=d.is_dir(), mix=mix,
                               workers=r.workers)
                note(f"collect_{folder.removeprefix('data_')}", wall_s=round(time.time() - t0, 1), seeds=meta["seeds"],
                     episodes=n)

    def minutes(share: float):
        if r.budget_minutes is None:
            return r.max_minutes
        left = r.budget_minutes - (time.time() - t_start) / 60
        return max(0.5, left * share)

    # 2. stage 1, 3. stage 2: the same loop as `iws train STAGE`, with the equivalent command recorded
    sc, csc = SCALES[r.scale], COMPACT_SCALES[r.scale]
    stages = [
        ("compact1", r.stage1_steps, ["--lr", r.stage1_lr, "--batch", csc["batch"], "--preset", csc["preset"],
                                      "--extra-data", ",".join(stage1_extra)], 0.6),
        ("compact2", r.stage2_steps, ["--lr", r.stage2_lr, "--preset", csc["stage2_preset"], "--init", out / "compact1",
                                      "--extra-data", ",".join(stage2_extra)], 1.0),
    ] if r.design == "compact" else [
        ("stage1", r.stage1_steps, ["--lr", r.stage1_lr, "--batch", sc["stage1"]["batch"], "--preset", sc["stage1"]["preset"],
                                    "--crop", sc["stage1"]["crop"]], 0.4),
        ("stage2", r.stage2_steps, ["--lr", r.stage2_lr, "--batch", sc["stage2"]["batch"], "--preset", sc["stage2"]["preset"],
                                    "--init", out / "stage1", "--objective", r.objective, *task.module.STAGE2_OPTIONS], 1.0),
    ]
    for i, (name, steps, flags, share) in enumerate(stages):
        run = out / name
        if _finished(run, steps):
            continue
        collect_extra(stage=i + 1)
        mins = minutes(share)
        argv_stage = ["--data", data, "--out", run, "--steps", steps, "--seed", r.seed, "--eval-every", r.eval_every,
                      "--device", r.device, *flags] + (["--max-minutes", mins] if mins is not None else [])
        result = train_main(name, [str(x) for x in argv_stage])  # its wall_s counts earlier sessions of the run
        note(name, wall_s=result.get("wall_s"), step=result.get("step"), finished=result.get("finished"),
             command=result.get("command"))
        if not result.get("finished") and r.budget_minutes is None:
            print(f"iws train recipe: {name} stopped at step {result.get('step')} (--max-minutes); "
                  f"run the same command again to continue", file=sys.stderr)
            return log
    # 4. release
    for name, run in zip(("stage1", "stage2"), [s[0] for s in stages]):
        release(out / run, name, out / "release", [])
    if r.design in RELEASE_SETTINGS:
        release(out / "release", "stage2", out / "release", [], settings=RELEASE_SETTINGS[r.design])
    note("release", path=str(out / "release"), wall_s_total=round(sum(s.get("wall_s", 0) for s in log["steps"].values()), 1))
    return log


def main(argv=None):
    import argparse

    from iws_gym.training.common import HelpFormatter, add_dataclass_args

    p = argparse.ArgumentParser(prog="iws train recipe", description=__doc__, formatter_class=HelpFormatter)
    add_dataclass_args(p, RecipeArgs, RecipeArgs())
    r = RecipeArgs(**vars(p.parse_args(argv)))
    return recipe(r, argv)
