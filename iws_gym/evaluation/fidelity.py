"""Measurements against the ground truth: pose-estimator validation, stage-1 reconstruction, and the
open-loop fidelity harness (`iws eval fidelity`) with its two baselines.

Fidelity protocol (the paper's): take a held-out episode's first frame and its action sequence, roll
the model open loop for `horizon` steps, and compare every predicted frame with the ground truth. Every
report carries two baselines so the numbers have a scale:

* copy_first_frame: predict the first frame forever (what a model that ignores actions scores);
* ground_truth_rerender: the true states re-rendered by gym-pusht's own renderer (the floor: PSNR is
  exact, and the physical errors are the pose estimator's own noise).
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np

from iws_gym import metrics
from iws_gym.data.collect import heldout_episodes
from iws_gym.tasks.pusht.groundtruth import wrap_angle
from iws_gym.tasks.pusht.pose import (WHOLE_AREA_TOL, WHOLE_INSIDE, WHOLE_IOU, area_ratio, estimate, inside_share,
                                      pose_errors)
from iws_gym.envs.registry import TaskConfig

POSE_KEYS = ("agent_px", "block_px", "block_rad", "coverage")


def _summ(v: np.ndarray) -> dict:
    v = np.asarray(v, dtype=np.float64)
    ok = v[~np.isnan(v)]
    if not len(ok):
        return dict(mean=None, median=None, p90=None, n=0, missing=int(len(v)))
    return dict(mean=float(ok.mean()), median=float(np.median(ok)), p90=float(np.percentile(ok, 90)),
                n=int(len(ok)), missing=int(len(v) - len(ok)))


def validate_pose_estimator(task: TaskConfig, episodes: int = 20, steps: int = 100, stride: int = 5) -> dict:
    """Pose estimator error on held-out ground-truth frames against the true simulator state."""
    from tqdm import tqdm

    rows, signed, t_est = [], [], 0.0
    for ep in tqdm(heldout_episodes(task, episodes, steps), total=episodes, desc="pose validation"):
        for t in range(0, steps + 1, stride):
            t0 = time.perf_counter()
            est = estimate(ep["frames"][t])
            t_est += time.perf_counter() - t0
            rows.append(pose_errors(est, ep["agent_pos"][t], ep["block_pose"][t], ep["coverage"][t]))
            if est.block is not None:
                signed.append(np.r_[est.block[:2] - ep["block_pose"][t][:2], wrap_angle(est.block[2] - ep["block_pose"][t][2])])
    signed = np.array(signed)
    report = {k: _summ([r[k] for r in rows]) for k in POSE_KEYS}
    report["block_bias"] = dict(x_px=float(signed[:, 0].mean()), y_px=float(signed[:, 1].mean()), rad=float(signed[:, 2].mean()))
    report["frames"] = len(rows)
    report["ms_per_frame"] = 1000 * t_est / max(len(rows), 1)
    report["targets"] = dict(block_px_median_lt=3.0, block_rad_median_lt=0.05,
                             met=bool(report["block_px"]["median"] < 3.0 and report["block_rad"]["median"] < 0.05))
    report["command"] = f"iws eval pose --task {task.name} --episodes {episodes} --steps {steps}"
    return report


def frame_metrics(pred: np.ndarray, ep: dict, task: TaskConfig | None = None) -> dict:
    """Per-step metrics (arrays of length T+1) of predicted frames against a ground-truth episode: the image
    metrics, and the task's readings of its objects against their true state (`task.module.readings`; T
    pushing's when task is None)."""
    gt = ep["frames"][: len(pred)]
    out = dict(mse=metrics.mse(pred, gt), psnr=metrics.psnr(pred, gt), ssim=metrics.ssim(pred, gt))
    readings = task.module.readings if task is not None else pusht_readings
    return {**out, **readings(pred, ep)}


def pusht_readings(pred: np.ndarray, ep: dict) -> dict:
    """T pushing's readings: the pose errors of POSE_KEYS (NaN where the reader finds nothing), and the T's fit
    residual and area ratio to the true T's, for `whole_t`."""
    out, cache, rows = {}, {}, []  # identical frames (the copy baseline) are estimated once
    for t, f in enumerate(pred):
        key = hash(f.tobytes())
        if key not in cache:
            cache[key] = estimate(f)
        rows.append(pose_errors(cache[key], ep["agent_pos"][t], ep["block_pose"][t], ep["coverage"][t]))
    for k in POSE_KEYS:
        out[k] = np.array([r[k] for r in rows])
    ests = [cache[hash(f.tobytes())] for f in pred]
    out["t_fit_residual"] = np.array([e.fit_residual if e.block is not None else np.nan for e in ests])
    out["t_area_ratio"] = np.array([area_ratio(e, pred.shape[1]) for e in ests])
    out["t_shape_ok"] = np.array([e.block is not None and e.t_iou >= WHOLE_IOU and
                                  inside_share(e.block, pred.shape[1]) >= WHOLE_INSIDE for e in ests])
    # a frame is judged only where the true T lies (nearly) inside it: gym-pusht's block can leave the frame
    out["t_judged"] = np.array([inside_share(ep["block_pose"][t], pred.shape[1]) >= 0.9 for t in range(len(pred))])
    return out


def whole_t(residual: np.ndarray, ratio: np.ndarray, shape_ok: np.ndarray, judged: np.ndarray, residual_max: float) -> np.ndarray:
    """pose.is_whole_t on stored readings (found, area within WHOLE_AREA_TOL, fit residual <= residual_max): 1 or
    0 per frame, NaN where the true T is not inside the frame (not judged)."""
    with np.errstate(invalid="ignore"):
        ok = ((np.abs(ratio - 1) <= WHOLE_AREA_TOL) & (residual <= residual_max) & shape_ok).astype(np.float64)
    return np.where(judged, ok, np.nan)


def by_decile(flags: np.ndarray) -> list[float]:
    """Share of 1s among (episodes, T) flags in each tenth of the horizon (steps 1..T; fewer parts when T < 10)."""
    parts = np.array_split(np.arange(flags.shape[1]), min(10, flags.shape[1]))
    return [float(np.nanmean(flags[:, p])) if np.isfinite(flags[:, p]).any() else None for p in parts]


def _copy_first(ep, horizon):
    return np.repeat(ep["frames"][:1], horizon + 1, axis=0)


def fidelity(task: TaskConfig, checkpoint: str | None, horizon: int = 192, episodes: int = 16,
             behaviour: str = "mix", settings=None, plot: Path | None = None, grid: Path | None = None,
             grid_episodes: int = 3, split: str = "test") -> dict:
    """The fidelity report: per-step and summary metrics for the model and both baselines.

    grid: a PNG of the first `grid_episodes` episodes, the true frames above the model's, at
    GRID_STEPS (those within the horizon) - what the numbers mean, to look at.
    settings: the model's RolloutSettings (None: the release's defaults). split: the named held-out split
    (data.splits): "test" for the reports, "validation" for choosing settings without touching it."""
    from tqdm import tqdm

    from iws_gym.data.splits import split_offset
    from iws_gym.models.world_model import RolloutSettings, release_settings

    settings = settings or (release_settings(checkpoint) if checkpoint else RolloutSettings())
    offset = split_offset(split)

    if horizon <= 0 or episodes <= 0:
        raise ValueError(f"--horizon and --episodes must be > 0, got {horizon} and {episodes}")
    if grid is not None and checkpoint is None:
        raise ValueError("--grid shows the model's rollouts: it needs --checkpoint")
    predictors = {"copy_first_frame": _copy_first,
                  "ground_truth_rerender": lambda ep, h: task.module.rerender(ep, h, task.frame_size)}
    model_kind = None
    if checkpoint is not None:
        from iws_gym.models.world_model import load_predictor

        model_kind, predict = load_predictor(checkpoint, settings)
        predictors["model"] = predict
    per = {name: {} for name in predictors}
    timings = {name: 0.0 for name in predictors}
    t_start = time.time()
    grid_steps = [t for t in GRID_STEPS if t <= horizon]
    grid_rows = []
    for i, ep in enumerate(tqdm(heldout_episodes(task, episodes, horizon, split, behaviour=behaviour),
                              total=episodes, desc="fidelity")):
        for name, fn in predictors.items():
            t0 = time.perf_counter()
            pred = fn(ep, horizon)
            timings[name] += time.perf_counter() - t0
            for k, v in frame_metrics(pred, ep, task).items():
                per[name].setdefault(k, []).append(v)
            if grid is not None and name == "model" and i < grid_episodes:
                grid_rows += [ep["frames"][grid_steps], pred[grid_steps]]
    report = dict(task=task.name, horizon=horizon, episodes=episodes, behaviour=behaviour,
                  checkpoint=str(checkpoint) if checkpoint else None, model_kind=model_kind,
                  decoder_steps=settings.decoder_steps,
                  dynamics_steps=getattr(predictors.get("model"), "dynamics_steps", settings.dynamics_steps),
                  dynamics_sampler=getattr(predictors.get("model"), "dynamics_sampler", settings.dynamics_sampler),
                  reencode=settings.reencode,
                  reencode_every=settings.reencode_every if settings.reencode else None, split=split,
                  precision=getattr(predictors.get("model"), "precision", None),
                  ctx_sigma=getattr(predictors.get("model"), "ctx_sigma", None),
                  heldout_seeds=[task.heldout_seed_base + offset, task.heldout_seed_base + offset + episodes - 1],

                  not_reported="LPIPS and FVD need pretrained network weights (AlexNet/VGG, I3D) that cannot be downloaded here",
                  per_step={}, summary={}, wall_s=None)
    pusht = "t_fit_residual" in per["ground_truth_rerender"]
    if pusht:  # object permanence: the fit-residual bound from the real frames (gym-pusht's renders of the true states)
        res = np.concatenate(per["ground_truth_rerender"]["t_fit_residual"])
        whole_residual = float(np.nanmax(res) * 1.25) if np.isfinite(res).any() else float("nan")
        report["t_whole"] = dict(residual_max=whole_residual, area_tol=WHOLE_AREA_TOL, iou_min=WHOLE_IOU, inside_min=WHOLE_INSIDE,
                                 rule="found by the pose reader, at least inside_min inside the frame, pixel area within "
                                      "area_tol of a rigid T's, IoU >= iou_min with it, rigid-T fit "
                                      "residual <= residual_max (the largest over the episodes' real frames, widened by 25%); "
                                      "judged only where the true T is at least 90% inside the frame")
    else:
        report["whole"] = task.module.WHOLE_RULE
    keys = task.module.READING_KEYS
    for name, d in per.items():
        if pusht:
            res, ratio, shape_ok, judged = (np.stack(d.pop(k)) for k in ("t_fit_residual", "t_area_ratio", "t_shape_ok", "t_judged"))
        arr = {k: np.stack(v) for k, v in d.items()}  # (episodes, T+1)
        if pusht:
            arr["t_whole"] = whole_t(res, ratio, shape_ok, judged, whole_residual)
        report["per_step"][name], s = summarise(arr, horizon, keys)
        s["seconds_per_episode"] = timings[name] / episodes
        report["summary"][name] = s
    gt = report["summary"]["ground_truth_rerender"]
    report["pose_estimator_error"] = {
        "note": "the task's reader (T pushing: the pose estimator) on exact re-renders of the true states vs those "
                "states: the floor of every physical metric",
        **{k: gt[k] for k in gt if k.endswith("_median") or "@" in k}}
    report["wall_s"] = round(time.time() - t_start, 1)
    if plot is not None:
        plot_per_step(report, plot)
    if grid is not None:
        save_grid(grid_rows, Path(grid), scale=1)
        report["grid"] = dict(path=str(grid), rows="per episode: true frames, then the model's", steps=grid_steps)
    return report


def summarise(arr: dict[str, np.ndarray], horizon: int, keys=POSE_KEYS) -> tuple[dict, dict]:
    """Per-step curves and the summary of one predictor's metrics, arr[k] (episodes, T+1) with NaN where
    the pose estimator found nothing. Frame metrics are means over steps 1..T, pose errors medians over
    the frames where the object was found; `{k}_found@t` says over how many episodes a median at step t
    was taken, `{k}_median_counting_lost@t` is the median over all episodes with a lost object counted as
    the worst error, and per_step `{k}_found` is the share of episodes that have it at each step."""
    with warnings.catch_warnings():  # steps where no episode has the object: NaN, by design
        warnings.simplefilter("ignore", RuntimeWarning)
        per_step = {k: np.nanmean(v, axis=0).tolist() if k in ("mse", "psnr", "ssim") or k.endswith("whole")
                    else np.nanmedian(v, axis=0).tolist() for k, v in arr.items()}
    s = {k: float(np.nanmean(arr[k][:, 1:])) for k in ("mse", "psnr", "ssim")}
    for wk in [k for k in arr if k.endswith("whole")]:  # object permanence (T pushing: t_whole; piles: pieces_whole):
        w = arr[wk]                                       # the share of whole-object frames, overall and per tenth
        s[f"{wk}_share"] = float(np.nanmean(w[:, 1:]))
        s[f"{wk}_share_by_decile"] = by_decile(w[:, 1:])
        s[f"{wk}_judged_frames"] = int(np.isfinite(w[:, 1:]).sum())
        for t in (32, 64, 192):
            if t <= horizon:
                s[f"{wk}_share@{t}"] = float(np.nanmean(w[:, t])) if np.isfinite(w[:, t]).any() else None
    # each episode's mean over steps 1..T, and how far the mean over episodes could move with other episodes
    for k in ("psnr", "ssim"):
        per_ep = np.nanmean(arr[k][:, 1:], axis=1)
        s[f"{k}_per_episode"] = per_ep.tolist()
        s[f"{k}_ci95"] = bootstrap_ci(per_ep)
    for k in keys:
        found = ~np.isnan(arr[k])
        per_step[f"{k}_found"] = found.mean(axis=0).tolist()
        s[f"{k}_median"] = float(np.nanmedian(arr[k][:, 1:])) if found[:, 1:].any() else float("nan")
        s[f"{k}_missing_frac"] = float(1 - found[:, 1:].mean())
        for t in (32, 64, 192):
            if t <= horizon:
                s[f"{k}_median@{t}"] = float(np.nanmedian(arr[k][:, t])) if found[:, t].any() else float("nan")
                s[f"{k}_found@{t}"] = int(found[:, t].sum())
                s[f"{k}@{t}_per_episode"] = [None if np.isnan(v) else float(v) for v in arr[k][:, t]]  # None: lost
                # stricter: an episode that lost the object counts as the worst error (None: over half lost)
                strict = float(np.median(np.where(found[:, t], arr[k][:, t], np.inf)))
                s[f"{k}_median_counting_lost@{t}"] = strict if np.isfinite(strict) else None
    return per_step, s


def bootstrap_ci(v, level: float = 0.95, resamples: int = 4000, seed: int = 0) -> list[float]:
    """Percentile bootstrap interval of the mean of `v` (one value per episode), resampling episodes.
    Seeded, so a report is reproducible; one episode gives the degenerate interval [v, v]."""
    v = np.asarray(v, dtype=np.float64)
    if v.ndim != 1 or not len(v) or np.isnan(v).any():
        raise ValueError(f"bootstrap_ci needs a non-empty 1D array without NaN, got shape {v.shape}")
    means = v[np.random.default_rng(seed).integers(0, len(v), (resamples, len(v)))].mean(axis=1)
    a = (1 - level) / 2
    return [float(np.quantile(means, a)), float(np.quantile(means, 1 - a))]


COMPARE_KEYS = ("psnr", "ssim")


def compare_fidelity(a: dict, b: dict, predictor: str = "model") -> dict:
    """Paired comparison of two fidelity reports on the same held-out episodes (`iws eval compare`):
    per-episode differences b - a of each frame metric, their mean with a bootstrap 95% interval, and the
    share of episodes where b is ahead. Pairing removes the episode-to-episode spread (one episode that
    keeps or loses its block), which dominates the interval of either mean alone."""
    for name, r in (("A", a), ("B", b)):
        if "summary" not in r or predictor not in r["summary"]:
            raise ValueError(f"report {name} has no summary for predictor {predictor!r} (is it an `iws eval fidelity` JSON?)")
        missing = [k for k in COMPARE_KEYS if f"{k}_per_episode" not in r["summary"][predictor]]
        if missing:
            raise ValueError(f"report {name} lacks per-episode values ({missing[0]}_per_episode): it predates them; rerun it")
    for key in ("task", "horizon", "behaviour", "heldout_seeds"):
        if a.get(key) != b.get(key):
            raise ValueError(f"the reports are not on the same episodes: {key} is {a.get(key)!r} in A and {b.get(key)!r} in B")
    out = dict(task=a["task"], horizon=a["horizon"], behaviour=a["behaviour"], heldout_seeds=a["heldout_seeds"],
               episodes=len(a["summary"][predictor]["psnr_per_episode"]), predictor=predictor,
               a=dict(checkpoint=a.get("checkpoint"), reencode_every=a.get("reencode_every")),
               b=dict(checkpoint=b.get("checkpoint"), reencode_every=b.get("reencode_every")), metrics={})
    sa, sb = a["summary"][predictor], b["summary"][predictor]
    for k in COMPARE_KEYS:
        va, vb = np.asarray(sa[f"{k}_per_episode"]), np.asarray(sb[f"{k}_per_episode"])
        d = vb - va
        out["metrics"][k] = dict(a=float(va.mean()), b=float(vb.mean()), diff_b_minus_a=float(d.mean()),
                                 diff_ci95=bootstrap_ci(d), b_ahead_share=float((d > 0).mean()),
                                 a_ci95=sa.get(f"{k}_ci95") or bootstrap_ci(va), b_ci95=sb.get(f"{k}_ci95") or bootstrap_ci(vb))
    for k in [k for k in sa if k.endswith("_per_episode") and "@" in k and k in sb]:  # pose errors at fixed steps
        va, vb = (np.array([np.inf if v is None else v for v in s[k]], float) for s in (sa, sb))  # lost: the worst
        closer, farther = int((vb < va).sum()), int((vb > va).sum())
        out["metrics"][k.removesuffix("_per_episode")] = dict(
            lower_is_better=True, a_median=_finite(np.median(va)), b_median=_finite(np.median(vb)),
            a_lost=int(np.isinf(va).sum()), b_lost=int(np.isinf(vb).sum()), b_closer=closer, b_farther=farther,
            sign_test_p=sign_test(closer, farther))
    return out


def _finite(v: float) -> float | None:
    return float(v) if np.isfinite(v) else None


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test (ties dropped): how often a fair coin splits at least this unevenly."""
    from math import comb

    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    return float(min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n))


GRID_STEPS = (0, 4, 8, 16, 32, 64, 128, 192)


def save_grid(rows: list[np.ndarray], path: Path, scale: int = 2) -> None:
    """Rows of (N, H, W, 3) uint8 frames -> one PNG."""
    import cv2

    img = np.concatenate([np.concatenate(list(r), axis=1) for r in rows], axis=0)
    img = cv2.resize(img, None, fx=scale, fy=scale, interpolation=cv2.INTER_NEAREST)
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), img[:, :, ::-1])


def plot_per_step(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["psnr", "ssim", "agent_px", "block_px", "block_rad", "coverage", "agent_px_found", "block_px_found"]
    fig, axes = plt.subplots(2, 4, figsize=(17, 7))
    for ax, k in zip(axes.ravel(), keys):
        for name, d in report["per_step"].items():
            if k in d:  # reports written before the found shares existed lack them
                ax.plot(d[k], label=name)
        ax.set_title(k.replace("_px_found", " found (share of episodes)") if k.endswith("_found")
                     else k + (" (mean)" if k in ("psnr", "ssim") else " error (median)"))
        ax.set_xlabel("step")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"open-loop fidelity, {report['episodes']} held-out episodes ({report['behaviour']})")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def reconstruction(task: TaskConfig, checkpoint: str | None, frames: int = 512, steps_list=(1, 2, 4),
                   sigma_mids=(), grid: Path | None = None) -> dict:
    """Stage-1 quality on held-out frames: PSNR/SSIM per decoder step count, the task's readings of the
    reconstruction against the true state (T pushing: also its pose against the pose read from the original),
    and encode+decode latency at batch 1."""
    import torch

    from iws_gym.models.world_model import WorldModel

    wm = WorldModel.from_pretrained(checkpoint or task.checkpoint_path, stages=("stage1",))
    n_eps = max(1, frames // 32)
    eps = list(heldout_episodes(task, n_eps, 64))
    # the frames, and the true state of each, as one episode-like dict for the task's readings
    truth = {k: np.concatenate([e[k][::2][:32] for e in eps])[:frames] for k in eps[0]
             if k != "plan" and len(eps[0][k]) == len(eps[0]["frames"])}
    x = truth["frames"]
    report = dict(task=task.name, checkpoint=str(wm.path), frames=len(x), device=str(wm.device), by_steps={})
    pusht = task.module.READING_KEYS == POSE_KEYS
    gt_est = [estimate(f) for f in x] if pusht else None
    agent = dict(agent_pos=truth["agent_pos"]) if getattr(wm, "tracks_agent", False) else {}  # the compact decoder draws the agent there
    rows = [x[:8]]
    for steps in steps_list:
        rec = wm.reconstruct(x, steps=steps, seed=0, **agent)
        rows.append(rec[:8])
        read = task.module.readings(rec, truth)  # against the true state
        report["by_steps"][steps] = dict(
            psnr=float(metrics.psnr(rec, x).mean()), ssim=float(metrics.ssim(rec, x).mean()),
            **{f"{k}_median_vs_truth": _summ(read[k])["median"] for k in task.module.READING_KEYS},
            **{f"{k}_share": float(np.nanmean(v)) for k, v in read.items() if k.endswith("whole")})
        if pusht:  # and against the pose read from the original frame (the reader's own error cancels)
            errs = [pose_errors(estimate(r), g.agent, g.block, g.coverage) if g.block is not None else None
                    for r, g in zip(rec, gt_est)]
            errs = [e for e in errs if e is not None]
            report["by_steps"][steps].update({f"{k}_median_vs_original": _summ([e[k] for e in errs])["median"] for k in POSE_KEYS})
        # latency at batch 1, one frame at a time as the env does it
        one = x[:1]
        for _ in range(5):
            wm.reconstruct(one, steps=steps, **{k: v[:1] for k, v in agent.items()})
        ts = []
        for i in range(50):
            t0 = time.perf_counter()
            j = i % len(x)
            wm.reconstruct(x[j : j + 1], steps=steps, **{k: v[j : j + 1] for k, v in agent.items()})
            ts.append(time.perf_counter() - t0)
        report["by_steps"][steps]["encode_decode_ms_p50"] = 1000 * float(np.median(ts))
        report["by_steps"][steps]["encode_decode_ms_p95"] = 1000 * float(np.percentile(ts, 95))
    if grid is not None:  # originals on top, then one row per step count; error maps x4 at the bottom
        err = np.abs(rows[1].astype(int) - rows[0].astype(int)).clip(0, 63).astype(np.uint8) * 4
        save_grid(rows + [err], Path(grid))
        report["grid"] = str(grid)
    # multistep sampling: quality of 2 steps as a function of the second noise level
    cfg = getattr(wm.stage1.decoder, "cfg", None)  # None: a one-shot decoder (the compact design) has no sigma_mid
    if sigma_mids and cfg is not None:
        default = wm.stage1.decoder.cfg.sigma_mid
        report["two_step_psnr_by_sigma_mid"] = {}
        for sm in sigma_mids:
            wm.stage1.decoder.cfg.sigma_mid = float(sm)
            report["two_step_psnr_by_sigma_mid"][str(sm)] = float(metrics.psnr(wm.reconstruct(x, steps=2, seed=0), x).mean())
        wm.stage1.decoder.cfg.sigma_mid = default
    report["sigma_mid"] = cfg.sigma_mid if cfg is not None else None
    report["torch_threads"] = torch.get_num_threads()
    report["command"] = (f"iws eval recon --task {task.name} --checkpoint {checkpoint} --frames {frames} --steps "
                         f"{' '.join(map(str, steps_list))}" + (f" --sigma-mid {' '.join(map(str, sigma_mids))}" if sigma_mids else ""))
    return report


def scorer_validation(task: TaskConfig, checkpoint: str | None, episodes: int = 8, steps: int = 100,
                      behaviour: str = "mix") -> dict:
    """How well the env's reward and agent_pos, both read from frames, match the ground truth's true state.

    Frames: (1) ground-truth renders, (2) model frames - one-step predictions from real history
    (teacher-forced: the model's error at one step, the rate at which a closed-loop episode is scored),
    and (3) open-loop rollouts of the whole episode (dynamics drift included). For each: |coverage read -
    true coverage| for both scorer methods, agreement of the success flag, and |agent_pos read - true|."""
    from tqdm import tqdm

    from iws_gym.envs.env import read_agent
    from iws_gym.models.world_model import WorldModel

    if episodes <= 0 or steps <= 0:
        raise ValueError(f"--episodes and --steps must be > 0, got {episodes} and {steps}")
    second = task.module.second_scorer()  # T pushing: the pose fit
    scorers = {"pixels": task.make_scorer(), **({"pose": second} if second is not None else {})}
    wm = None
    try:
        shipped = WorldModel.has_stage(task.checkpoint_path, "stage2")
    except FileNotFoundError:  # a task without shipped weights: the ground truth's frames only
        shipped = False
    if checkpoint is not None or shipped:
        wm = WorldModel.from_pretrained(checkpoint or task.checkpoint_path, stages=("stage1", "stage2"))
    # one-step predictions from real history need predict_teacher_forced, which the compact design does not have
    one_step = wm is not None and hasattr(wm, "predict_teacher_forced")
    sources = ["ground_truth"] + (["model_one_step"] if one_step else []) + (["model_open_loop"] if wm else [])
    rows = {s: dict(cov_true=[], agent_err=[], **{f"cov_{m}": [] for m in scorers}) for s in sources}
    t0 = time.time()
    for ep in tqdm(heldout_episodes(task, episodes, steps, "scorer", behaviour=behaviour), total=episodes, desc="scorer"):
        frames = {"ground_truth": ep["frames"][1:]}
        if wm:
            if one_step:
                frames["model_one_step"] = wm.predict_teacher_forced(ep["frames"], ep["actions"], agent_pos=ep["agent_pos"])
            frames["model_open_loop"] = wm.rollout(ep["frames"][0], ep["actions"], agent_pos=ep["agent_pos"][:1])[1:]
        for s, fr in frames.items():
            r = rows[s]
            r["cov_true"] += list(ep["coverage"][1:])
            for m, sc in scorers.items():
                r[f"cov_{m}"] += [x.info["coverage"] for x in sc(fr)]
            for f, true_agent in zip(fr, ep["agent_pos"][1:]):
                r["agent_err"].append(float(np.linalg.norm(read_agent(f, np.full(2, np.nan)) - true_agent)))
    report = dict(task=task.name, checkpoint=str(wm.path) if wm else None, episodes=episodes, steps=steps,
                  behaviour=behaviour, by_source={})
    for s, r in rows.items():
        true = np.array(r["cov_true"])
        out = dict(frames=len(true), agent_pos_error_px=_summ(r["agent_err"]))
        for m in scorers:
            c = np.array(r[f"cov_{m}"])
            out[f"coverage_abs_error_{m}"] = _summ(np.abs(c - true))
            out[f"coverage_bias_{m}"] = float((c - true).mean())
            out[f"success_agreement_{m}"] = float((task.module.success(c) == task.module.success(true)).mean())
        out["true_success_frames"] = int(task.module.success(true).sum())
        report["by_source"][s] = out
    report["wall_s"] = round(time.time() - t0, 1)
    return report


def contact_error(task: TaskConfig, checkpoint: str | None, data: str, train_episodes: int = 100,
                  heldout: int = 16, steps: int = 100, windows: int = 256, seed: int = 0,
                  dynamics_steps: int | None = None, dynamics_sampler: str | None = None) -> dict:
    """Where the dynamics' one-step error is: latent MSE of one-step predictions (by default 1 consistency step, from
    real history) on all windows and on windows whose target transition moves the T block (contact),
    against copying the last latent, on training episodes (the first `train_episodes` of `data`) and on
    held-out ones. The ratio model / copy is the share of the change the model leaves unexplained; a
    train-vs-held-out gap separates overfitting from underfitting. Also: the energy of the predicted change
    relative to the true change, and the variance between two samples (different seeds)."""
    import torch

    from iws_gym.data.episodes import InMemoryEpisodes
    from iws_gym.models.decoder import Stage1, Stage1Config
    from iws_gym.models.dynamics import DynamicsConfig, Stage2
    from iws_gym.models.hardware import autocast
    from iws_gym.data.latents import LatentEpisodes, latent_cache, moving_transitions, recorded
    from iws_gym.models.checkpoint import load_stage

    if min(train_episodes, heldout, steps, windows, dynamics_steps or 1) <= 0:
        raise ValueError("--train-episodes, --heldout, --steps, --windows and --dynamics-steps must be > 0")
    ck = Path(checkpoint or task.checkpoint_path)
    s1, _, s1_file = load_stage(ck, "stage1", Stage1Config, Stage1, "cpu")
    model, *_ = load_stage(ck, "stage2", DynamicsConfig, Stage2, "cpu")
    cfg = model.cfg
    dynamics_sampler = dynamics_sampler or ("euler" if cfg.objective == "denoise" else "consistency")
    dynamics_steps = dynamics_steps or cfg.sample_steps
    train = InMemoryEpisodes.load(Path(data), train_episodes)
    held_eps = list(heldout_episodes(task, heldout, steps, "contact"))
    held = InMemoryEpisodes([e["frames"] for e in held_eps], [e["actions"] for e in held_eps], [])
    sets = {"train": (train, moving_transitions(recorded(train.paths, "block_pose"))),
            "heldout": (held, moving_transitions([e["block_pose"] for e in held_eps]))}
    report = dict(task=task.name, checkpoint=str(ck), data=str(data), train_episodes=len(train.frames),
                  dynamics_sampler=dynamics_sampler, dynamics_steps=dynamics_steps,
                  heldout_episodes=heldout, steps=steps, windows=windows, by_set={})
    K = cfg.context
    for name, (eps, hard) in sets.items():
        # the training episodes' latents are cached in the (git-ignored) data dir, as in training
        cache = latent_cache(data, s1_file, len(eps.frames)) if name == "train" else None
        lat = LatentEpisodes(eps, s1.encoder, "cpu", cache=cache)
        lat.hard = hard
        if cfg.agent_motion:  # a tracking model reads the agent's recorded positions beside the actions
            lat.agent = recorded(eps.paths, "agent_pos") if name == "train" else [e["agent_pos"] for e in held_eps]
        out = dict(block_moving_share=round(len(hard) / sum(len(a) for a in eps.actions), 4))
        for kind, focus in (("all", 0.0), ("block_moving", 1.0)):
            ctx, act, tgt, nv, ag = lat.sample_rollout(np.random.default_rng(seed), windows, K, 0, focus=focus)
            with torch.inference_mode(), autocast("cpu"):
                pred, pred2 = (model.predict(ctx, act, nv, ag, steps=dynamics_steps, sampler=dynamics_sampler,
                                             generator=torch.Generator().manual_seed(s)).float() for s in (seed, seed + 1))
            out[kind] = metrics.latent_change_stats(ctx[:, -1], pred, pred2, tgt[:, 0])
        report["by_set"][name] = out
    return report
