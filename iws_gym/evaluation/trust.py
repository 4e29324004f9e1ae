"""`iws eval trust`: does the env's trust (models/trust.py) say when the learned world is wrong?

Held-out episodes of several behaviours (the training mix, the evaluation-only sweep, jittery pushes,
uniform-random targets) are replayed open loop in the learned world from their first real frame, under
their recorded actions, batched, exactly as the env steps (re-encoding and the trust signal included).
Against gym-pusht's own frames of the same episodes:

* per step: the trust against the block and agent position error read from the frames (pose.py);
* per episode: the lowest trust against "the block was ever more than 20 px off" (AUROC) and against the
  absolute gap between the episode's max coverage in the two worlds (Spearman).

`fit=True` first replays episodes of the validation split and fits the calibration there (a logistic
regression of "ever more than 20 px off" on the log of the episode's peak smoothed signal, which is what
sets its lowest trust), writes it beside the weights, and then reports on the requested split with it.
Test episodes never enter the fit. The policy-evaluation side (trusted episodes only) is in
`iws eval correlate` and `iws eval policy`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from iws_gym.data.collect import HELDOUT_BEHAVIOURS, PLAY_BEHAVIOURS, heldout_episodes
from iws_gym.envs.registry import TaskConfig
from iws_gym.models import trust as T
from iws_gym.models.world_model import WorldModel
from iws_gym.tasks.pusht import pose as P
from iws_gym.tasks.pusht.scorer import TPushCoverageScorer

LOST_PX = 20.0     # an episode is wrong if its block is ever this far from the truth
MISSING_PX = 200.0  # the error counted when the frame shows no block at all
SIGNAL_FLOOR = 1e-8  # the fit's floor for the peak signal (log of 0)


def auroc(positive, score) -> float:
    """Area under the ROC curve of `score` for the boolean labels `positive` (ties count half)."""
    from iws_gym.evaluation.policy_eval import _ranks

    y, s = np.asarray(positive, bool), np.asarray(score, float)
    n1, n0 = int(y.sum()), int((~y).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    r = _ranks(s) + 1
    return float((r[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def fit_logistic(x, y, ridge: float = 1e-3, iters: int = 100) -> tuple[float, float]:
    """P(y) = sigmoid(a + b x) by Newton's method (a small ridge keeps separable data finite) -> (a, b)."""
    X = np.stack([np.ones_like(x), x], 1).astype(np.float64)
    w = np.zeros(2)
    for _ in range(iters):
        p = 1 / (1 + np.exp(-X @ w))
        g = X.T @ (p - y) + ridge * w
        H = X.T @ (X * (p * (1 - p))[:, None]) + ridge * np.eye(2)
        step = np.linalg.solve(H, g)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return float(w[0]), float(w[1])


def replay(wm: WorldModel, eps: list[dict], scorer) -> dict:
    """Open-loop replay of episodes (batched) with per-step trust and pose errors -> arrays (B, T)."""
    B, H = len(eps), min(len(e["actions"]) for e in eps)
    st = wm.start_frames(np.stack([e["frames"][0] for e in eps]),
                         np.stack([e["agent_pos"][0] for e in eps]) if wm.tracks_agent else None)
    gen = torch.Generator().manual_seed(0)
    out = {k: np.zeros((B, H)) for k in ("signal", "trust", "block_px", "agent_px", "coverage", "true_coverage")}
    for t in range(H):
        frames = wm.step(st, torch.from_numpy(np.stack([e["actions"][t] for e in eps])).float(), generator=gen)
        out["signal"][:, t] = st["trust_m"].float().cpu().numpy()
        out["trust"][:, t] = st["trust"].float().cpu().numpy()
        for i, e in enumerate(eps):
            err = P.pose_errors(P.estimate(frames[i]), e["agent_pos"][t + 1], e["block_pose"][t + 1], 0.0)
            out["block_px"][i, t] = err["block_px"] if np.isfinite(err["block_px"]) else MISSING_PX
            out["agent_px"][i, t] = err["agent_px"] if np.isfinite(err["agent_px"]) else MISSING_PX
            out["coverage"][i, t] = scorer.coverage(frames[i])
            out["true_coverage"][i, t] = scorer.coverage(e["frames"][t + 1])
    return out


def _collect(task, wm, episodes, steps, split, behaviours, scorer) -> dict:
    from tqdm import tqdm

    runs = {}
    for b in tqdm(behaviours, desc=f"trust replay ({split})"):
        runs[b] = replay(wm, list(heldout_episodes(task, episodes, steps, split, behaviour=b)), scorer)
    return runs


def _episode_table(runs: dict) -> dict:
    cat = lambda k: np.concatenate([r[k] for r in runs.values()])  # noqa: E731
    return dict(behaviour=np.concatenate([[b] * len(r["trust"]) for b, r in runs.items()]),
                peak_signal=cat("signal").max(1), trust_min=cat("trust").min(1), max_block_px=cat("block_px").max(1),
                gap=np.abs(cat("coverage").max(1) - cat("true_coverage").max(1)),
                step_trust=cat("trust"), step_block_px=cat("block_px"), step_agent_px=cat("agent_px"))


def fit(runs: dict, alpha: float) -> T.TrustCalibration:
    e = _episode_table(runs)
    lost = (e["max_block_px"] > LOST_PX).astype(float)
    if lost.min() == lost.max():
        raise ValueError("trust fit: every fitting episode is on the same side of the 20 px line; use more episodes "
                         "or other behaviours")
    # a world that never moved (a gated model at rest) has a signal of exactly 0: floor it before the log
    a, b = fit_logistic(np.log(np.maximum(e["peak_signal"], SIGNAL_FLOOR)), lost)
    if b <= 0:
        raise ValueError(f"trust fit: the signal does not rise with the error on the fitting episodes (slope {b:.3g})")
    return T.TrustCalibration(alpha=alpha, m_half=float(np.exp(-a / b)), slope=float(b), source="iws eval trust --fit")


def _figures(e: dict) -> dict:
    from iws_gym.evaluation.policy_eval import spearman

    lost = e["max_block_px"] > LOST_PX
    ok = e["trust_min"] >= T.TRUSTED
    per_beh = {}
    for b in np.unique(e["behaviour"]):
        m = e["behaviour"] == b
        per_beh[str(b)] = dict(episodes=int(m.sum()), lost=int(lost[m].sum()), trusted=int(ok[m].sum()),
                               auroc_lost=auroc(lost[m], -e["trust_min"][m]),
                               spearman_trust_gap=spearman(e["trust_min"][m], e["gap"][m]),
                               spearman_true_error_gap=spearman(-e["max_block_px"][m], e["gap"][m]),
                               mean_trust_min=float(e["trust_min"][m].mean()))
    s_t, s_b = e["step_trust"].ravel(), e["step_block_px"].ravel()
    bins = [0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0001]
    by_bin = []
    for lo, hi in zip(bins[:-1], bins[1:]):
        m = (s_t >= lo) & (s_t < hi)
        by_bin.append(dict(trust=[lo, min(hi, 1.0)], steps=int(m.sum()),
                           block_px_median=float(np.median(s_b[m])) if m.any() else None,
                           share_over_20px=float((s_b[m] > LOST_PX).mean()) if m.any() else None))
    return dict(
        episodes=int(len(lost)), lost_episodes=int(lost.sum()),
        auroc_lost=auroc(lost, -e["trust_min"]),
        spearman_trust_gap=spearman(e["trust_min"], e["gap"]),
        # the same figure for a signal that knew each episode's true largest block error: how far any trust that
        # tracks the world's error can go towards the coverage-gap target on these episodes
        spearman_true_error_gap=spearman(-e["max_block_px"], e["gap"]),
        trusted_share=float(ok.mean()),
        lost_share_trusted=float(lost[ok].mean()) if ok.any() else None,
        lost_share_untrusted=float(lost[~ok].mean()) if (~ok).any() else None,
        mean_gap_trusted=float(e["gap"][ok].mean()) if ok.any() else None,
        mean_gap_untrusted=float(e["gap"][~ok].mean()) if (~ok).any() else None,
        step_spearman_trust_block_px=spearman(s_t, s_b),
        step_spearman_trust_agent_px=spearman(s_t, e["step_agent_px"].ravel()),
        steps_by_trust=by_bin, per_behaviour=per_beh)


def plot(e: dict, report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.4))
    for b in np.unique(e["behaviour"]):
        m = e["behaviour"] == b
        ax[0].scatter(e["trust_min"][m], np.minimum(e["max_block_px"][m], MISSING_PX), s=14, label=str(b))
    ax[0].axhline(LOST_PX, color="k", lw=0.8, ls="--")
    ax[0].axvline(T.TRUSTED, color="k", lw=0.8, ls=":")
    ax[0].set(xlabel="episode trust (lowest)", ylabel="largest block error (px; 200 = block gone)", yscale="log",
              title=f"AUROC {report['auroc_lost']:.2f} (block ever > 20 px)")
    ax[0].legend(fontsize=8)
    for b in np.unique(e["behaviour"]):
        m = e["behaviour"] == b
        ax[1].scatter(e["trust_min"][m], e["gap"][m], s=14, label=str(b))
    ax[1].set(xlabel="episode trust (lowest)", ylabel="|max coverage learned - gym-pusht|",
              title=f"Spearman {report['spearman_trust_gap']:.2f}")
    lost = e["max_block_px"] > LOST_PX
    th = np.sort(np.unique(np.concatenate([[0.0, 1.0001], e["trust_min"]])))
    tpr = [((e["trust_min"] < t) & lost).sum() / max(lost.sum(), 1) for t in th]
    fpr = [((e["trust_min"] < t) & ~lost).sum() / max((~lost).sum(), 1) for t in th]
    ax[2].plot(fpr, tpr)
    ax[2].plot([0, 1], [0, 1], color="k", lw=0.6, ls=":")
    ax[2].set(xlabel="false alarms (episodes kept whole flagged)", ylabel="lost episodes flagged", title="ROC")
    fig.suptitle(f"trust on {report['split']} episodes, {report['steps']} steps ({report['calibration']['source']})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def trust_report(task: TaskConfig, checkpoint=None, episodes: int = 16, steps: int = 120, split: str = "test",
                 behaviours=PLAY_BEHAVIOURS, fit_calibration: bool = False, fit_episodes: int = 16,
                 alpha: float = 0.1, force: bool = False, plot_path=None, device: str = "auto") -> dict:
    """See the module docstring. With fit_calibration, the calibration is written to CHECKPOINT/trust.json
    (refused if one is there, unless `force`)."""
    if episodes < 2 or steps < 1 or fit_episodes < 2:
        raise ValueError(f"--episodes and --fit-episodes must be >= 2 and --steps >= 1, got {episodes}, {fit_episodes}, {steps}")
    unknown = sorted(set(behaviours) - set(HELDOUT_BEHAVIOURS))
    if unknown:
        raise ValueError(f"unknown behaviours {unknown}; choose from {list(HELDOUT_BEHAVIOURS)}")
    if fit_calibration and split == "validation":
        raise ValueError("--fit fits on the validation split: report on another split (--split test)")
    ck = Path(checkpoint or task.checkpoint_path)
    out_file = ck / T.TRUST_FILE
    if fit_calibration and out_file.exists() and not force:
        raise FileExistsError(f"{out_file} exists: pass --force to replace that calibration")
    t0 = time.time()
    wm = WorldModel.from_pretrained(ck, device=device, stages=("stage1", "stage2"))
    scorer = TPushCoverageScorer(frame_size=task.frame_size)
    report = dict(task=task.name, checkpoint=str(ck), split=split, episodes_per_behaviour=episodes, steps=steps,
                  behaviours=list(behaviours), lost_px=LOST_PX, trusted_at=T.TRUSTED)
    if fit_calibration:
        wm.trust_calibration = T.TrustCalibration(alpha=alpha)  # the smoothed signal depends on alpha alone
        fit_runs = _collect(task, wm, fit_episodes, steps, "validation", behaviours, scorer)
        cal = fit(fit_runs, alpha)
        fe = _episode_table(fit_runs)
        report["fit"] = dict(split="validation", episodes_per_behaviour=fit_episodes,
                             lost_episodes=int((fe["max_block_px"] > LOST_PX).sum()), episodes=int(len(fe["trust_min"])),
                             auroc_lost=auroc(fe["max_block_px"] > LOST_PX, fe["peak_signal"]))
        out_file.write_text(json.dumps(dict(alpha=cal.alpha, m_half=cal.m_half, slope=cal.slope,
                                            fitted_by=f"iws eval trust --fit --fit-episodes {fit_episodes} --steps {steps}",
                                            fit=report["fit"]), indent=2) + "\n")
        wm.trust_calibration = T.TrustCalibration.load(ck)
    runs = _collect(task, wm, episodes, steps, split, behaviours, scorer)
    e = _episode_table(runs)
    cal = wm.trust_calibration
    report["calibration"] = dict(alpha=cal.alpha, m_half=cal.m_half, slope=cal.slope, source=cal.source)
    report.update(_figures(e))
    report["per_episode"] = dict(behaviour=e["behaviour"].tolist(), trust_min=e["trust_min"].tolist(),
                                 max_block_px=e["max_block_px"].tolist(), gap=e["gap"].tolist())
    report["wall_s"] = round(time.time() - t0, 1)
    if plot_path:
        plot(e, report, plot_path)
        report["plot"] = str(plot_path)
    return report
