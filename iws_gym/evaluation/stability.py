"""`iws eval stability`: does a very long open-loop rollout keep producing valid frames?

The paper's model runs for over 10 minutes (9000 steps at 15 FPS). Here a rollout of N steps starts from
one real held-out frame (`drives` rollouts at once start from as many) and is driven by either
* `random`: a uniformly random agent target every step (what a random policy sends), or
* `scripted`: the actions of held-out scripted play (the training behaviour mix), episode after episode.

Every `check_every` steps the latent is decoded and the frame is checked. A frame is valid when
* the agent is detectable (pose.agent_position finds the blue disc) and its blue area is in range,
* the T block is detectable (pose.estimate fits a pose) with a template-fit residual in range,
* the block's visible area, the mean colour and the share of off-palette pixels are in range,
* the fitted T lies on the table: `block_inside`, the share of the fitted template's area inside the frame
  (a real block cannot leave the table, but a broken one - a bar against the wall - is fitted best by a T
  whose crossbar hangs off the frame, and the in-frame residual alone lets that pass),
where "in range" means inside the envelope of the same statistic over real ground-truth frames, widened
by a margin (`calibrate`). The real frames come from the same two drives in gym-pusht (held-out scripted
play and random targets, whole episodes: a pushed block covering the goal changes the mean colour, so
frames near the start alone make too narrow an envelope), and the checks are themselves checked: the
report's `false_alarm` is the share of a second, disjoint set of real frames that they reject. It also
gives the first step where any check fails (null if none), the fraction of failing checks per kind, and a
strip of frames across the rollout.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from iws_gym.data.collect import heldout_episodes
from iws_gym.tasks.pusht.pose import (WHOLE_AREA_TOL, WHOLE_INSIDE, WHOLE_IOU, block_fraction, calibrate_whole_t, estimate,
                                      inside_share, is_whole_t)
from iws_gym.envs.registry import TaskConfig

# colours a Push-T frame is made of (RGB): background, goal, block fill/outline, agent, walls
PALETTE = np.array([[255, 255, 255], [144, 238, 144], [143, 163, 184], [119, 136, 153], [65, 105, 225], [211, 211, 211]],
                   dtype=np.float32)


def frame_stats(frame: np.ndarray) -> dict:
    """Statistics of one (H, W, 3) uint8 frame that the validity checks use."""
    f = frame.astype(np.float32)
    blue = np.clip((f[..., 2] - 0.5 * (f[..., 0] + f[..., 1]) - 40.0) / 60.0, 0, 1)
    a, _ = block_fraction(frame)
    # distance of each pixel to the segment between any two palette colours (anti-aliased edges are mixes)
    d = np.full(f.shape[:2], np.inf, dtype=np.float32)
    for i in range(len(PALETTE)):
        for j in range(i, len(PALETTE)):
            p, q = PALETTE[i], PALETTE[j]
            v = q - p
            t = np.clip(((f - p) @ v) / max(float(v @ v), 1e-6), 0, 1) if i != j else np.zeros(f.shape[:2], np.float32)
            d = np.minimum(d, np.linalg.norm(f - (p + t[..., None] * v), axis=-1))
    est = estimate(frame)
    return dict(agent_found=est.agent is not None, block_found=est.block is not None,
                agent_area=float(blue.sum()), block_area=float(np.clip(a, 0, 1).sum()),
                fit_residual=float(est.fit_residual) if est.block is not None else float("nan"),
                block_inside=inside_share(est.block, frame.shape[0]) if est.block is not None else float("nan"),
                mean_r=float(f[..., 0].mean()), mean_g=float(f[..., 1].mean()), mean_b=float(f[..., 2].mean()),
                off_palette=float((d > 40).mean()))


RANGED = ("agent_area", "block_area", "fit_residual", "block_inside", "mean_r", "mean_g", "mean_b", "off_palette")


def calibrate(frames: np.ndarray, margin: float = 0.25) -> dict:
    """Envelope [lo, hi] of each ranged statistic over real frames, widened by `margin` of its span
    (one-sided quantities - residual, off-palette share - get an upper bound only)."""
    stats = [frame_stats(f) for f in frames]
    env = {}
    for k in RANGED:
        v = np.array([s[k] for s in stats], dtype=np.float64)
        v = v[np.isfinite(v)]
        lo, hi = float(v.min()), float(v.max())
        span = max(hi - lo, 1e-6)
        if k == "block_inside":  # a real T is never off the table; 2% slack for a fit a pixel off at the wall
            env[k] = [min(lo - margin * span, lo - 0.02), 1.0 + 1e-6]
        elif k in ("fit_residual", "off_palette"):
            env[k] = [0.0, hi + margin * span + (0.01 if k == "off_palette" else 0.0)]
        else:
            env[k] = [lo - margin * span, hi + margin * span]
    return env


def failures(stats: dict, envelope: dict) -> list[str]:
    out = [k for k in ("agent_found", "block_found") if not stats[k]]
    for k, (lo, hi) in envelope.items():
        v = stats[k]
        if not np.isfinite(v) or v < lo or v > hi:
            out.append(k)
    return out


def reference_frames(task: TaskConfig, episodes: int, steps: int, split: str, every: int = 5) -> np.ndarray:
    """Real frames of both drives, every `every`-th step: `episodes` of held-out scripted play and as many
    of random targets in gym-pusht, from the first seeds of held-out `split` (data.splits). (B, H, W, 3) uint8."""
    from iws_gym.data.splits import split_offset
    from iws_gym.tasks.pusht.groundtruth import make_env

    frames = [ep["frames"][every::every] for ep in heldout_episodes(task, episodes, steps, split)]
    env = make_env(task.frame_size)
    for i in range(episodes):
        seed = task.heldout_seed_base + split_offset(split) + i
        env.reset(seed=seed)
        for t, a in enumerate(drive_actions("random", task, steps, seed, [None], rngs=[np.random.default_rng(seed)])[0]):
            obs, *_ = env.step(a)
            if (t + 1) % every == 0:
                frames.append(obs["pixels"][None])
    env.close()
    return np.concatenate(frames)


def false_alarms(frames: np.ndarray, envelope: dict) -> dict:
    """How often the checks reject real frames (they should not)."""
    counts, n_bad = {}, 0
    for f in frames:
        bad = failures(frame_stats(f), envelope)
        n_bad += bool(bad)
        for k in bad:
            counts[k] = counts.get(k, 0) + 1
    return dict(frames=len(frames), invalid_fraction=n_bad / len(frames),
                failed_fraction={k: v / len(frames) for k, v in sorted(counts.items())})


ACTION_KINDS = ("random", "scripted", "hold")


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


def stability(task: TaskConfig, checkpoint: str | None = None, steps: int = 9000, check_every: int = 10,
              kinds=("random", "scripted"), seed: int = 0, strip: Path | None = None, device: str = "auto",
              reencode: bool = True, calib_episodes: int = 8, calib_steps: int = 200,
              reencode_every: int | None = None, drives: int = 1) -> dict:
    """`drives` rollouts of each kind at once, drive i from held-out start i (drive 0 is the one rollout of
    `drives=1`); the shares pool every drive's checks, `per_drive` lists each drive's own."""
    from tqdm import tqdm

    from iws_gym.models.hardware import dtype_name
    from iws_gym.models.world_model import RolloutSettings, WorldModel

    if steps <= 0 or check_every <= 0:
        raise ValueError(f"--steps and --check-every must be > 0, got {steps} and {check_every}")
    if drives <= 0:
        raise ValueError(f"--drives must be > 0, got {drives}")
    if calib_episodes <= 0 or calib_steps < 5:
        raise ValueError(f"--calib-episodes must be > 0 and --calib-steps >= 5, got {calib_episodes} and {calib_steps}")
    settings = RolloutSettings(reencode=reencode, **({} if reencode_every is None else dict(reencode_every=reencode_every)))
    wm = WorldModel.from_pretrained(checkpoint or task.checkpoint_path, device=device, stages=("stage1", "stage2"),
                                    settings=settings)
    # the first 50 steps of held-out scripted play: the first one is the rollouts' start, and every 5th frame of
    # them all is the envelope used before (episode starts only), whose false alarms the report compares
    starts = list(heldout_episodes(task, max(calib_episodes, drives), 50, "stability_calibration"))
    calib = reference_frames(task, calib_episodes, calib_steps, "stability_calibration")
    envelope = calibrate(calib)
    whole_residual = calibrate_whole_t(calib)  # object permanence: the T found, of its true area, rigid
    check = reference_frames(task, calib_episodes, calib_steps, "stability_check")
    report = dict(task=task.name, checkpoint=str(wm.path), steps=steps, check_every=check_every, seed=seed, drives=drives,
                  reencode=reencode,
                  reencode_every=settings.reencode_every if reencode else None, precision=dtype_name(wm.dtype),
                  validity="agent and block detectable; agent area, block area, T-fit residual, share of the fitted "
                           "T inside the frame, mean colour and off-palette share inside the envelope of real frames "
                           "(widened by 25% of its span)",
                  calibration=f"real gym-pusht frames, every 5th of {calib_episodes} held-out episodes of scripted play "
                              f"and {calib_episodes} of random targets, {calib_steps} steps each (split stability_calibration)",
                  envelope=envelope,
                  false_alarm=dict(false_alarms(check, envelope), source="the same from split stability_check"),
                  false_alarm_of_start_envelope=false_alarms(check, calibrate(np.concatenate(
                      [ep["frames"][::5] for ep in starts[:calib_episodes]]))),
                  t_whole=dict(residual_max=whole_residual, area_tol=WHOLE_AREA_TOL, iou_min=WHOLE_IOU, inside_min=WHOLE_INSIDE,
                               false_alarm=float(1 - np.mean([is_whole_t(estimate(f), f.shape[0], whole_residual)
                                                              for f in check]))),
                  rollouts={})
    strips = []
    first = np.stack([ep["frames"][0] for ep in starts[:drives]])
    first_est = [estimate(f) for f in first]
    first_area = [frame_stats(f)["agent_area"] for f in first]
    for kind in kinds:
        actions = torch.from_numpy(drive_actions(kind, task, steps, seed, [ep["agent_pos"][0] for ep in starts[:drives]]))
        # a still world: how far each drive's T and frame move from its start
        drift, frame_diff, agent_area = [[] for _ in first], [[] for _ in first], [[] for _ in first]
        gen = torch.Generator().manual_seed(seed)
        state = wm.start_frames(first, np.stack([ep["agent_pos"][0] for ep in starts[:drives]]))
        first_fail, fail_counts, shown, shown_at = None, {}, [first[0]], [0]
        n_seg = min(10, steps)  # invalid share per tenth of the rollout: does it break and stay broken?
        seg_bad, seg_n, seg_whole = [0] * n_seg, [0] * n_seg, [0] * n_seg
        per_drive = [dict(checks=0, invalid=0, whole=0, first_failure_step=None) for _ in first]
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
                for i, frame in enumerate(frames):
                    stats = frame_stats(frame)
                    bad = failures(stats, envelope)
                    est = estimate(frame)
                    whole = is_whole_t(est, frame.shape[0], whole_residual)
                    seg_bad[seg] += bool(bad)
                    seg_n[seg] += 1
                    seg_whole[seg] += whole
                    d = per_drive[i]
                    d["checks"] += 1
                    d["invalid"] += bool(bad)
                    d["whole"] += whole
                    if kind == "hold":
                        drift[i].append(float(np.linalg.norm(est.block[:2] - first_est[i].block[:2]))
                                        if est.block is not None and first_est[i].block is not None else np.nan)
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
            t_whole_share=sum(seg_whole) / n_checks,
            t_whole_share_by_tenth=[round(w / n, 3) if n else None for w, n in zip(seg_whole, seg_n)],
            per_drive=[dict(t_whole_share=d["whole"] / d["checks"], invalid_frame_fraction=d["invalid"] / d["checks"],
                            first_failure_step=d["first_failure_step"]) for d in per_drive],
            final_latent_abs_max=float(latent.abs().max()), wall_s=round(time.time() - t0, 1))
        if kind == "hold":  # the still world: T drift (canvas px), mean frame change (grey levels), agent area ratio
            d = np.asarray(drift)
            report["rollouts"][kind]["still_world"] = dict(
                block_drift_px_max=float(np.nanmax(d)) if np.isfinite(d).any() else None,
                block_drift_px_final=float(np.nanmax(d[:, -1])) if np.isfinite(d[:, -1]).any() else None,
                block_lost_share=float(np.isnan(d).mean()), frame_mean_abs_diff_max=float(np.max(frame_diff)),
                agent_area_ratio_max=float(np.max(agent_area)),
                note="the agent is commanded to stay where it starts: in gym-pusht nothing moves, so every figure "
                     "should stay at the start frame's (drift 0, diff ~0, ratio 1; a ratio near 2 is a second agent); "
                     "the largest over the drives")
        strips.append(np.stack(shown))
    report["stable"] = all(r["first_failure"] is None for r in report["rollouts"].values())
    if strip is not None:
        from iws_gym.evaluation.fidelity import save_grid

        save_grid(strips, Path(strip))
        report["strip"] = str(strip)
    return report
