"""`iws eval stability`: does a very long open-loop rollout keep producing valid frames?

The paper's model runs for over 10 minutes (9000 steps at 15 FPS). Here a rollout of N steps starts from
one real held-out frame (`drives` rollouts at once start from as many) and is driven by either
* `random`: a uniformly random agent target every step (what a random policy sends),
* `scripted`: the actions of held-out scripted play (the training behaviour mix), episode after episode, or
* `hold`: the agent told to stay where it is (a still world: nothing may move).

Every `check_every` steps the latent is decoded and the frame is checked by the task's checks (its checks.py).
A frame is valid when its objects are detectable and each of its statistics lies inside the envelope of the same
statistic over real ground-truth frames, widened by a margin (`calibrate`). For T pushing:
* the agent is detectable (pose.agent_position finds the blue disc) and its blue area is in range,
* the T block is detectable (pose.estimate fits a pose) with a template-fit residual in range,
* the block's visible area, the mean colour and the share of off-palette pixels are in range,
* the fitted T lies on the table: `block_inside`, the share of the fitted template's area inside the frame
  (a real block cannot leave the table, but a broken one - a bar against the wall - is fitted best by a T
  whose crossbar hangs off the frame, and the in-frame residual alone lets that pass);
for pile sweeping the agent, the puck count read from the frame, the mean colour and the off-palette share.
The real frames come from the same two drives in the ground truth (held-out scripted play and random targets,
whole episodes: a pushed block covering the goal changes the mean colour, so frames near the start alone make
too narrow an envelope), and the checks are themselves checked: the report's `false_alarm` is the share of a
second, disjoint set of real frames that they reject. It also gives the first step where any check fails (null
if none), the fraction of failing checks per kind, the share of frames whose object is whole (T: `t_whole`;
piles: `pieces_whole`) and a strip of frames across the rollout.

With `ground_truth=True` the random and scripted drives are also run in the ground truth, from the same starts
under the same actions (`ground_truth_drives`), and each kind's report gains `ground_truth`: the share of real
frames whose object is whole (the check's own false alarm on these drives), the same share for stage 1's round
trip of those real frames (decode(encode(real)): the ceiling no dynamics can beat, since the rollout's frames are
decoded latents), and the task's readings of the model's frames against the true state (T: block and agent
pose error, per tenth of the drive), which say where the model's object is, not only whether it is whole.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from iws_gym.data.collect import heldout_episodes, heldout_seed, reset_episode
from iws_gym.envs.registry import TaskConfig
from iws_gym.tasks.pusht import checks as PUSHT  # the default checks of the helpers below (T pushing's)
from iws_gym.tasks.pusht.pose import inside_share  # noqa: F401  (re-exported for the tests)


def frame_stats(frame: np.ndarray, checks=PUSHT) -> dict:
    """Statistics of one (H, W, 3) uint8 frame that the validity checks use (the task's checks.py)."""
    return checks.frame_stats(frame)


def calibrate(frames: np.ndarray, margin: float = 0.25, checks=PUSHT) -> dict:
    """Envelope [lo, hi] of each ranged statistic over real frames, widened by `margin` of its span
    (one-sided quantities get an upper bound only; see the task's checks.envelope_bounds)."""
    stats = [checks.frame_stats(f) for f in frames]
    env = {}
    for k in checks.RANGED:
        v = np.array([s[k] for s in stats], dtype=np.float64)
        v = v[np.isfinite(v)]
        env[k] = checks.envelope_bounds(k, float(v.min()), float(v.max()), margin)
    return env


def failures(stats: dict, envelope: dict, checks=PUSHT) -> list[str]:
    out = [k for k in checks.FOUND if not stats[k]]
    for k, (lo, hi) in envelope.items():
        v = stats[k]
        if not np.isfinite(v) or v < lo or v > hi:
            out.append(k)
    return out


def reference_frames(task: TaskConfig, episodes: int, steps: int, split: str, every: int = 5) -> np.ndarray:
    """Real frames of both drives, every `every`-th step: `episodes` of held-out scripted play and as many
    of random targets in the ground truth, from the first seeds of held-out `split` (data.splits). (B, H, W, 3) uint8."""
    frames = [ep["frames"][every::every] for ep in heldout_episodes(task, episodes, steps, split)]
    env = task.module.make_env(task.frame_size)
    for i in range(episodes):
        seed = heldout_seed(task, split, i)
        env.reset(seed=seed)
        for t, a in enumerate(drive_actions("random", task, steps, seed, [None], rngs=[np.random.default_rng(seed)])[0]):
            obs, *_ = env.step(a)
            if (t + 1) % every == 0:
                frames.append(obs["pixels"][None])
    env.close()
    return np.concatenate(frames)


def false_alarms(frames: np.ndarray, envelope: dict, checks=PUSHT) -> dict:
    """How often the checks reject real frames (they should not)."""
    counts, n_bad = {}, 0
    for f in frames:
        bad = failures(checks.frame_stats(f), envelope, checks)
        n_bad += bool(bad)
        for k in bad:
            counts[k] = counts.get(k, 0) + 1
    return dict(frames=len(frames), invalid_fraction=n_bad / len(frames),
                failed_fraction={k: v / len(frames) for k, v in sorted(counts.items())})


ACTION_KINDS = ("random", "scripted", "hold")
START_STEPS = 50  # the held-out episodes (split stability_calibration) whose first frames start the drives


def drive_actions(kind: str, task: TaskConfig, steps: int, seed: int, start_agents, rngs=None) -> np.ndarray:
    """The actions of len(start_agents) drives of one kind -> (drives, steps, 2): random targets from the
    generator of drive i (seed for drive 0, (seed, i) after it), held-out scripted play (drive i plays its own
    held-out episodes, one after another), or holding each drive's start position."""
    d = len(start_agents)
    if kind == "hold":
        return np.stack([np.tile(np.asarray(p, np.float32).reshape(1, 2), (steps, 1)) for p in start_agents])
    if kind == "random":
        rngs = rngs or [np.random.default_rng(seed if i == 0 else (seed, i)) for i in range(d)]
        return np.stack([r.uniform(task.action_low, task.action_high, (steps, 2)).astype(np.float32) for r in rngs])
    if kind == "scripted":
        n = -(-steps // task.episode_steps)
        acts = [ep["actions"] for ep in heldout_episodes(task, n * d, task.episode_steps, "contact", progress=True)]
        return np.stack([np.concatenate(acts[n * i:n * (i + 1)])[:steps] for i in range(d)]).astype(np.float32)
    raise ValueError(f"action kind must be one of {', '.join(ACTION_KINDS)}, got {kind!r}")


def ground_truth_drives(task: TaskConfig, seeds, first: np.ndarray, actions: np.ndarray, check_at,
                        start_steps: int = START_STEPS) -> tuple:
    """The drives in the ground truth: drive i reset where the held-out episode of seed seeds[i] (of
    `start_steps` steps, the training mix) starts (it must show the model's start frame first[i]) and stepped with
    actions[i] (steps, 2). Returns the real frames at the steps `check_at`
    (drives, checks, H, W, 3) and each drive's true state there: {"agent_pos": ..., and the task's `observe`
    arrays}, each (checks, ...), what the task's `readings` compare frames against."""
    from tqdm import tqdm

    gt = task.module
    env = gt.make_env(task.frame_size)
    at = set(int(t) for t in check_at)
    frames, truth = [], []
    for i in tqdm(range(len(seeds)), desc="ground-truth drives"):
        obs, info, _ = reset_episode(task, env, int(seeds[i]), start_steps, gt.heldout_plan("mix", int(seeds[i]), start_steps))
        if not np.array_equal(obs["pixels"], first[i]):
            raise RuntimeError(f"the ground truth reset from seed {seeds[i]} does not show drive {i}'s start frame")
        fr, rec = [], {"agent_pos": []}
        for t in range(actions.shape[1]):
            obs, _, _, _, info = env.step(np.asarray(actions[i, t]))
            if t + 1 in at:
                fr.append(obs["pixels"])
                rec["agent_pos"].append(obs["agent_pos"])
                for k, v in gt.observe(env, info).items():
                    rec.setdefault(k, []).append(v)
        frames.append(np.stack(fr))
        truth.append({k: np.asarray(v) for k, v in rec.items()})
    env.close()
    return np.stack(frames), truth


def ground_truth_figures(task: TaskConfig, wm, ck, whole: dict, model: np.ndarray, real: np.ndarray, truth: list,
                         seg: np.ndarray, n_seg: int) -> dict:
    """One kind's `ground_truth` figures from the model's frames and the real ones at the same checks, both
    (drives, checks, H, W, 3), with each check's part of the drive seg (checks,) in [0, n_seg): see the module
    docstring."""
    D = len(model)
    real_flat = real.reshape(-1, *real.shape[2:])
    agent = np.concatenate([t["agent_pos"] for t in truth])
    recon = wm.reconstruct(real_flat, agent_pos=agent)
    reads = [task.module.readings(model[i], truth[i]) for i in range(D)]
    C = real.shape[1]
    reads_s1 = [task.module.readings(recon[i * C:(i + 1) * C], truth[i]) for i in range(D)]
    keys = [k for k in task.module.READING_KEYS if k in reads[0]]

    def med(v):
        v = v[np.isfinite(v)]
        return float(np.median(v)) if len(v) else None

    out = dict(real_whole_share=float(np.mean([ck.is_whole(f, whole) for f in real_flat])),
               stage1_whole_share=float(np.mean([ck.is_whole(f, whole) for f in recon])),
               note="real: the ground truth's frames at the same checks; stage 1: decode(encode(real frame)), the "
                    "ceiling of any dynamics on this stage 1; readings: the model's frames against the true state "
                    "(median over drives and checks where the reader finds the object; missing: where it does not); "
                    "stage1_*: the same readings of the round trip")
    for k in keys:
        v = np.stack([r[k] for r in reads]).astype(np.float64)  # (drives, checks)
        out[f"{k}_median"] = med(v)
        out[f"{k}_median_by_tenth"] = [med(v[:, seg == j]) for j in range(n_seg)]
        out[f"{k}_missing"] = float(np.isnan(v).mean())
        out[f"stage1_{k}_median"] = med(np.stack([r[k] for r in reads_s1]).astype(np.float64))
    return out


def stability(task: TaskConfig, checkpoint: str | None = None, steps: int = 9000, check_every: int = 10,
              kinds=("random", "scripted"), seed: int = 0, strip: Path | None = None, device: str = "auto",
              reencode: bool | None = None, calib_episodes: int = 8, calib_steps: int = 200,
              reencode_every: int | None = None, drives: int = 1, ground_truth: bool = False) -> dict:
    """`drives` rollouts of each kind at once, drive i from held-out start i (drive 0 is the one rollout of
    `drives=1`); the shares pool every drive's checks, `per_drive` lists each drive's own. `ground_truth`: the
    random and scripted drives are also run in the ground truth (module docstring)."""
    from tqdm import tqdm

    from iws_gym.models.hardware import dtype_name
    from iws_gym.models.world_model import WorldModel, release_settings

    if steps <= 0 or check_every <= 0:
        raise ValueError(f"--steps and --check-every must be > 0, got {steps} and {check_every}")
    if drives <= 0:
        raise ValueError(f"--drives must be > 0, got {drives}")
    if calib_episodes <= 0 or calib_steps < 5:
        raise ValueError(f"--calib-episodes must be > 0 and --calib-steps >= 5, got {calib_episodes} and {calib_steps}")
    settings = release_settings(checkpoint or task.checkpoint_path, reencode=reencode, reencode_every=reencode_every)
    wm = WorldModel.from_pretrained(checkpoint or task.checkpoint_path, device=device, stages=("stage1", "stage2"),
                                    settings=settings)
    # the first 50 steps of held-out scripted play: the first one is the rollouts' start, and every 5th frame of
    # them all is the envelope used before (episode starts only), whose false alarms the report compares
    ck = task.module.checks()
    starts = list(heldout_episodes(task, max(calib_episodes, drives), START_STEPS, "stability_calibration"))
    calib = reference_frames(task, calib_episodes, calib_steps, "stability_calibration")
    envelope = calibrate(calib, checks=ck)
    whole = ck.calibrate_whole(calib)  # object permanence (T: found, of its true area, rigid; piles: the count kept)
    check = reference_frames(task, calib_episodes, calib_steps, "stability_check")
    report = dict(task=task.name, checkpoint=str(wm.path), steps=steps, check_every=check_every, seed=seed, drives=drives,
                  reencode=settings.reencode,
                  reencode_every=settings.reencode_every if settings.reencode else None, precision=dtype_name(wm.dtype),
                  validity=ck.VALIDITY,
                  calibration=f"real ground-truth frames, every 5th of {calib_episodes} held-out episodes of scripted play "
                              f"and {calib_episodes} of random targets, {calib_steps} steps each (split stability_calibration)",
                  envelope=envelope,
                  false_alarm=dict(false_alarms(check, envelope, ck), source="the same from split stability_check"),
                  false_alarm_of_start_envelope=false_alarms(check, calibrate(np.concatenate(
                      [ep["frames"][::5] for ep in starts[:calib_episodes]]), checks=ck), ck),
                  **{ck.WHOLE_KEY: dict(**whole, false_alarm=float(1 - np.mean([ck.is_whole(f, whole) for f in check])))},
                  rollouts={})
    strips = []
    first = np.stack([ep["frames"][0] for ep in starts[:drives]])
    first_area = [ck.frame_stats(f)["agent_area"] for f in first]
    for kind in kinds:
        actions = torch.from_numpy(drive_actions(kind, task, steps, seed, [ep["agent_pos"][0] for ep in starts[:drives]]))
        # a still world: how far each drive's T and frame move from its start
        drift, frame_diff, agent_area = [[] for _ in first], [[] for _ in first], [[] for _ in first]
        own_drift = [[] for _ in first]  # from the model's own drawing of the start: its dynamics alone
        gen = torch.Generator().manual_seed(seed)
        state = wm.start_frames(first, np.stack([ep["agent_pos"][0] for ep in starts[:drives]]))
        own_first = wm.decode_last(state, generator=torch.Generator().manual_seed(seed)) if kind == "hold" else None
        first_fail, fail_counts, shown, shown_at = None, {}, [first[0]], [0]
        n_seg = min(10, steps)  # invalid share per tenth of the rollout: does it break and stay broken?
        seg_bad, seg_n, seg_whole = [0] * n_seg, [0] * n_seg, [0] * n_seg
        per_drive = [dict(checks=0, invalid=0, whole=0, first_failure_step=None) for _ in first]
        gt_kind = ground_truth and kind != "hold"  # held still, the truth is the start frame (still_world)
        model_frames = []  # the checked frames, kept for the ground-truth comparison
        t0 = time.time()
        for t in tqdm(range(steps), desc=f"stability ({kind}, {drives} drive{'s' * (drives > 1)})"):
            # every step is decoded when the context is re-encoded from frames; otherwise only checked ones
            if settings.reencode:
                frames = wm.step(state, actions[:, t], generator=gen)
            else:
                wm.advance(state, actions[:, t], generator=gen)
            if (t + 1) % check_every == 0 or t + 1 == steps:
                if not settings.reencode:
                    frames = wm.decode_last(state, generator=gen)
                seg = min(t * n_seg // steps, n_seg - 1)
                if gt_kind:
                    model_frames.append(np.asarray(frames))
                for i, frame in enumerate(frames):
                    stats = ck.frame_stats(frame)
                    bad = failures(stats, envelope, ck)
                    is_whole = ck.is_whole(frame, whole)
                    seg_bad[seg] += bool(bad)
                    seg_n[seg] += 1
                    seg_whole[seg] += is_whole
                    d = per_drive[i]
                    d["checks"] += 1
                    d["invalid"] += bool(bad)
                    d["whole"] += is_whole
                    if kind == "hold":
                        drift[i].append(ck.still_drift(frame, first[i]))
                        own_drift[i].append(ck.still_drift(frame, own_first[i]))
                        frame_diff[i].append(float(np.abs(frame.astype(np.float32) - first[i]).mean()))
                        agent_area[i].append(stats["agent_area"] / max(first_area[i], 1e-6))
                    for k in bad:
                        fail_counts[k] = fail_counts.get(k, 0) + 1
                    if bad and d["first_failure_step"] is None:
                        d["first_failure_step"] = t + 1
                    if bad and first_fail is None:
                        first_fail = dict(step=t + 1, failed=bad, drive=i)
                if len(shown) < 10 and (t + 1) * 9 >= len(shown) * steps:  # the first check past each ninth
                    shown.append(frames[0])
                    shown_at.append(t + 1)
        latent = state["ctx"][:, -1].float()
        n_checks = sum(seg_n)
        report["rollouts"][kind] = dict(
            first_failure=first_fail, checks=n_checks,
            failed_fraction={k: v / n_checks for k, v in sorted(fail_counts.items())},
            invalid_frame_fraction=sum(seg_bad) / n_checks, strip_steps=shown_at,
            invalid_fraction_by_tenth=[round(b / n, 3) if n else None for b, n in zip(seg_bad, seg_n)],
            **{f"{ck.WHOLE_KEY}_share": sum(seg_whole) / n_checks,
               f"{ck.WHOLE_KEY}_share_by_tenth": [round(w / n, 3) if n else None for w, n in zip(seg_whole, seg_n)]},
            per_drive=[{f"{ck.WHOLE_KEY}_share": d["whole"] / d["checks"], "invalid_frame_fraction": d["invalid"] / d["checks"],
                        "first_failure_step": d["first_failure_step"]} for d in per_drive],
            final_latent_abs_max=float(latent.abs().max()), wall_s=round(time.time() - t0, 1))
        if gt_kind:
            check_at = [t + 1 for t in range(steps) if (t + 1) % check_every == 0 or t + 1 == steps]
            seeds = [heldout_seed(task, "stability_calibration", i) for i in range(drives)]
            real, truth = ground_truth_drives(task, seeds, first, actions.numpy(), check_at)
            report["rollouts"][kind]["ground_truth"] = ground_truth_figures(
                task, wm, ck, whole, np.stack(model_frames, 1), real, truth,
                np.minimum((np.asarray(check_at) - 1) * n_seg // steps, n_seg - 1), n_seg)
        if kind == "hold":  # the still world: object drift (T: canvas px), mean frame change (grey levels), agent area ratio
            d, od = np.asarray(drift), np.asarray(own_drift)
            report["rollouts"][kind]["still_world"] = {
                f"{ck.DRIFT_KEY}_max": float(np.nanmax(d)) if np.isfinite(d).any() else None,
                f"{ck.DRIFT_KEY}_final": float(np.nanmax(d[:, -1])) if np.isfinite(d[:, -1]).any() else None,
                f"{ck.DRIFT_KEY}_own_max": float(np.nanmax(od)) if np.isfinite(od).any() else None,
                ck.LOST_KEY: float(np.isnan(d).mean()), "frame_mean_abs_diff_max": float(np.max(frame_diff)),
                "agent_area_ratio_max": float(np.max(agent_area)),
                "note": "the agent is commanded to stay where it starts: in the ground truth nothing moves, so every "
                        "figure should stay at the start frame's (drift 0, diff ~0, ratio 1; a ratio near 2 is a second "
                        "agent); the largest over the drives; *_own_max: drift from the model's own drawing of the "
                        "start frame, without stage 1's round-trip offset, so the dynamics' drift alone"}
        strips.append(np.stack(shown))
    report["stable"] = all(r["first_failure"] is None for r in report["rollouts"].values())
    if strip is not None:
        from iws_gym.evaluation.fidelity import save_grid

        save_grid(strips, Path(strip))
        report["strip"] = str(strip)
    return report
