"""`iws eval policy`: Monte-Carlo evaluation of any policy in the learned env, batched across episodes,
optionally side by side with the ground truth (gym-pusht) from identical initial states.

A policy is given as MODULE:CALLABLE. CALLABLE is either a policy object/function `obs -> action` or a
class / factory that builds one (called with no arguments, once per episode). An action is (2,) or an
action chunk (k, 2) (Diffusion Policy, ACT), executed step by step before the policy is asked again.
If the policy has `reset(seed)`, it is called at every episode start.

An episode's score is its max coverage (the task's: T pushing's goal coverage, the share of pucks in the goal for
piles); success as the task decides it (T pushing: max coverage > 0.95; piles: >= 0.9).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from iws_gym.data.splits import SPLITS
from iws_gym.models.trust import TRUSTED
from iws_gym.policies import load_policy_factory, task_suite  # noqa: F401 (part of this module's API)
from iws_gym.envs.registry import TaskConfig


class _Runner:
    """One episode's policy with its pending action chunk."""

    def __init__(self, factory, seed: int):
        self.policy = factory()
        if hasattr(self.policy, "reset"):
            self.policy.reset(seed)
        self.queue: list[np.ndarray] = []

    def act(self, obs) -> np.ndarray:
        if not self.queue:
            a = np.asarray(self.policy(obs), dtype=np.float32)
            if a.shape == (2,):
                self.queue = [a]
            elif a.ndim == 2 and a.shape[1] == 2 and len(a) > 0:
                self.queue = list(a)
            else:
                raise ValueError(f"policy returned an action of shape {a.shape}; expected (2,) or a chunk (k, 2)")
        return self.queue.pop(0)


def start_states(task: TaskConfig, episodes: int, seed: int) -> np.ndarray:
    """Initial states of held-out ground-truth resets (seeded; T pushing: [agent x, y, block x, y, angle]), as
    vectors that `reset_to_state` turns back into exactly those starts (see pusht.groundtruth.reset_state)."""
    env = task.module.make_env(task.frame_size)
    out = []
    for i in range(episodes):
        env.reset(seed=task.heldout_seed_base + SPLITS["test"] + seed + i)
        out.append(task.module.reset_state(env))
    return np.array(out)


LEARNED_BATCH = 32  # episodes per vector env in run_learned
SUITE_BATCH = 128  # episodes (of all policies together) per vector env in the correlation study's learned side


def _precision(device: str) -> str:
    """The number format the learned env's networks run in on `device` (see hardware.default_dtype)."""
    from iws_gym.models.hardware import default_dtype, dtype_name

    return dtype_name(default_dtype(device))


def run_learned(task, factory, states, horizon, seed, checkpoint=None, device="auto", batch=LEARNED_BATCH, reencode=None,
                best_frames: list | None = None, record: list | None = None, reencode_every: int | None = None,
                trust_min: list | None = None, stop_untrusted: bool = False, runner_seeds=None, env_seed: int | None = None,
                trust_mean: list | None = None):
    """Scores (max coverage) of one policy in the learned env from each initial state, and seconds per
    episode. `factory` may also be a list, one factory per state: several policies then share each vector
    env (the world model steps them in one batch); `runner_seeds` (one per state, default seed + index)
    are what each episode's policy is reset with; `env_seed` (default `seed`) + the batch's first index
    seeds each vector env. If `best_frames` is a list, the observed frame at each episode's best coverage is appended
    to it (so the score can be re-read by another scorer). If `record` is a list, the observations of
    the first batch's episodes are appended to it, one (n, H, W, 3) array per step (an episode that has
    ended repeats its last frame). If `trust_min` is a list, each episode's lowest trust (models/trust.py)
    is appended to it, and to `trust_mean` its mean trust over the steps it ran (how long it was wrong, where
    the minimum says only how wrong); with `stop_untrusted` an episode ends as soon as it falls below
    trust.TRUSTED (its score is the max coverage so far, and it counts as untrusted)."""
    import gymnasium as gym

    import iws_gym  # noqa: F401

    n = len(states)
    factories = factory if isinstance(factory, (list, tuple)) else [factory] * n
    runner_seeds = np.arange(seed, seed + n) if runner_seeds is None else np.asarray(runner_seeds)
    if len(factories) != n or len(runner_seeds) != n:
        raise ValueError(f"{len(factories)} factories and {len(runner_seeds)} runner seeds for {n} start states")
    scores = np.zeros(n)
    t0 = time.time()
    for b0 in range(0, n, batch):
        idx = np.arange(b0, min(n, b0 + batch))
        envs = gym.make_vec(task.env_id, num_envs=len(idx), checkpoint=checkpoint, device=device,
                            max_episode_steps=horizon + 1, reencode=reencode,
                            reencode_every=reencode_every)
        obs, info = envs.reset(seed=(seed if env_seed is None else env_seed) + b0, options={"reset_to_states": states[idx]})
        runners = [_Runner(factories[i], int(runner_seeds[i])) for i in idx]
        best = np.array(info["coverage"], dtype=float)
        tmin = np.array(info["trust_min"], dtype=float)
        tsum, steps = np.zeros(len(idx)), np.zeros(len(idx))
        keep = best_frames is not None
        at_best = obs["pixels"].copy() if keep else None
        rec = record is not None and b0 == 0
        if rec:
            record.append(obs["pixels"].copy())
        done = np.zeros(len(idx), bool)
        for _ in range(horizon):
            acts = np.stack([r.act({k: v[j] for k, v in obs.items()}) if not done[j] else np.zeros(2, np.float32)
                             for j, r in enumerate(runners)])
            obs, rew, term, trunc, info = envs.step(acts)
            better = ~done & (np.asarray(info["coverage"]) > best)
            if keep:
                at_best[better] = obs["pixels"][better]
            if rec:
                record.append(np.where(done[:, None, None, None], record[-1], obs["pixels"]))
            best = np.where(better, info["coverage"], best)
            tmin = np.where(done, tmin, np.minimum(tmin, info["trust_min"]))
            tsum, steps = tsum + np.where(done, 0.0, info["trust"]), steps + ~done
            done |= term
            if stop_untrusted:
                done |= tmin < TRUSTED
            if done.all():
                break
        scores[idx] = best
        if trust_min is not None:
            trust_min.extend(tmin.tolist())
        if trust_mean is not None:
            trust_mean.extend((tsum / np.maximum(steps, 1)).tolist())
        if keep:
            best_frames.extend(at_best)
        envs.close()
    return scores, (time.time() - t0) / n


def run_ground_truth(task, factory, states, horizon, seed, record: list | None = None, record_episodes: int = 0,
                     pixel_scores: list | None = None):
    """Scores of one policy in gym-pusht from each initial state (its true coverage), and seconds per
    episode. If `record` is a list, it receives the observed frames of the first `record_episodes`
    episodes, one (T+1, H, W, 3) array per episode (an episode that ended early repeats its last frame).
    If `pixel_scores` is a list, it receives each episode's score as the learned env reads it: the max
    coverage of gym-pusht's own frames by the default pixel scorer (so a gap can be split into the
    scorer's part and the dynamics' part)."""
    env = task.module.make_env(task.frame_size)
    scorer = task.make_scorer() if pixel_scores is not None else None
    scores = np.zeros(len(states))
    t0 = time.time()
    for i, st in enumerate(states):
        obs, info = env.reset(options={"reset_to_state": st})
        runner = _Runner(factory, seed + i)
        best = float(task.module.observe(env, info)["coverage"])
        best_px = scorer.coverage(obs["pixels"]) if scorer else None
        frames = [obs["pixels"]] if record is not None and i < record_episodes else None
        for _ in range(horizon):
            obs, r, term, trunc, info = env.step(runner.act(obs))
            best = max(best, info["coverage"])
            if scorer:
                best_px = max(best_px, scorer.coverage(obs["pixels"]))
            if frames is not None:
                frames.append(obs["pixels"])
            if term:
                break
        if frames is not None:
            record.append(np.stack(frames + [frames[-1]] * (horizon + 1 - len(frames))))
        scores[i] = best
        if scorer:
            pixel_scores.append(float(best_px))
    return scores, (time.time() - t0) / len(states)


def episode_video_frames(learned: list, ground_truth: list | None = None) -> list[np.ndarray]:
    """Video frames that tile episodes side by side, the ground truth (if given) above the learned env:
    `learned` is a list of (n, H, W, 3) arrays, one per step; `ground_truth` a list of n (T+1, H, W, 3)
    arrays, one per episode."""
    out = []
    for t, row in enumerate(learned):
        tile = np.concatenate(list(row), axis=1)  # (H, n*W, 3)
        if ground_truth is not None:
            gt = np.concatenate([ep[min(t, len(ep) - 1)] for ep in ground_truth], axis=1)
            tile = np.concatenate([gt, tile], axis=0)
        out.append(tile)
    return out


def _summary(scores: np.ndarray, task: TaskConfig | None = None) -> dict:
    """Mean score and success rate (as the task decides success; T pushing's max coverage > 0.95 when None)."""
    n = len(scores)
    succ = (task.module.success(scores) if task is not None else scores > 0.95).astype(float)
    return dict(mean_max_coverage=float(scores.mean()), stderr=float(scores.std(ddof=1) / np.sqrt(n)) if n > 1 else None,
                success_rate=float(succ.mean()), success_stderr=float(succ.std(ddof=1) / np.sqrt(n)) if n > 1 else None,
                episodes=n)


def trust_summary(tmin, learned, gt=None, task: TaskConfig | None = None, tmean=None) -> dict:
    """Per policy: the share of trusted episodes (lowest trust >= trust.TRUSTED) and the scores over them
    (and, with ground-truth scores, the gap over all episodes and over the trusted ones); each episode's mean
    trust is kept beside its lowest when given (scripts/trust_tradeoff.py compares the two as selectors)."""
    tmin, learned = np.asarray(tmin, float), np.asarray(learned, float)
    ok = tmin >= TRUSTED
    out = dict(threshold=TRUSTED, trusted_share=float(ok.mean()), trusted_episodes=int(ok.sum()),
               trust_min=tmin.tolist(), learned_trusted=_summary(learned[ok], task) if ok.any() else None)
    if tmean is not None:
        out["trust_mean"] = np.asarray(tmean, float).tolist()
    if gt is not None:
        gt = np.asarray(gt, float)
        out.update(gap_all=float(learned.mean() - gt.mean()),
                   gap_trusted=float(learned[ok].mean() - gt[ok].mean()) if ok.any() else None,
                   ground_truth_trusted=_summary(gt[ok], task) if ok.any() else None)
    return out


def evaluate_policy(task: TaskConfig, policy: str, episodes: int, horizon: int, seed: int = 0, ground_truth: bool = False,
                    checkpoint=None, device: str = "auto", video=None, video_episodes: int = 4,
                    stop_untrusted: bool = False, learned: bool = True) -> dict:
    """With `learned` False only gym-pusht is run (a demonstrator's or a policy's real-world score). With
    `video`, the first `video_episodes` episodes are written side by side as an mp4 (with --ground-truth,
    gym-pusht's frames above the learned env's, from the same starts). With `stop_untrusted`, a learned
    episode ends when its trust falls below trust.TRUSTED (see run_learned)."""
    if episodes <= 0 or horizon <= 0:
        raise ValueError(f"--episodes and --horizon must be > 0, got {episodes} and {horizon}")
    if video is not None and video_episodes <= 0:
        raise ValueError(f"--video-episodes must be > 0, got {video_episodes}")
    factory = load_policy_factory(policy)
    states = start_states(task, episodes, seed)
    report = dict(policy=policy, episodes=episodes, horizon=horizon, seed=seed,
                  start_seeds=[task.heldout_seed_base + seed, task.heldout_seed_base + seed + episodes - 1])
    k = min(video_episodes, episodes, LEARNED_BATCH if learned else episodes)  # run_learned records its first batch
    rec_l = [] if video is not None and learned else None
    if learned:
        tmin, tmean = [], []
        scores, t_l = run_learned(task, factory, states, horizon, seed, checkpoint, device, record=rec_l, trust_min=tmin,
                                  trust_mean=tmean, stop_untrusted=stop_untrusted)
        report.update(precision=_precision(device), stop_untrusted=stop_untrusted,
                      learned=dict(**_summary(scores, task), seconds_per_episode=t_l, scores=scores.tolist()))
    gt = None
    rec_g = [] if video is not None and (ground_truth or not learned) else None
    if ground_truth or not learned:
        gt, t_g = run_ground_truth(task, factory, states, horizon, seed, record=rec_g, record_episodes=k)
        report["ground_truth"] = dict(**_summary(gt, task), seconds_per_episode=t_g, scores=gt.tolist())
    if learned:
        if gt is not None:
            report["gap"] = dict(**paired_gap(scores, gt), mean_abs=float(np.abs(scores - gt).mean()))
        report["trust"] = trust_summary(tmin, scores, gt, task, tmean)
    if video is not None:
        from iws_gym.evaluation.demo import write_video

        if learned:
            frames = episode_video_frames([f[:k] for f in rec_l], rec_g)
            layout = "gym-pusht above the learned env" if ground_truth else "learned env"
        else:  # gym-pusht's episodes, one per tile
            frames, layout = episode_video_frames([np.stack([ep[t] for ep in rec_g]) for t in range(horizon + 1)]), "gym-pusht"
        write_video(frames, video, scale=2)
        report["video"] = dict(path=str(video), episodes=k, layout=layout)
    return report


def paired_gap(learned, gt) -> dict:
    """Mean learned - ground-truth score over episodes that share their initial state, with the standard
    error of that mean from the per-episode differences (pairing removes the spread between starts), and
    whether the gap is more than two standard errors from zero."""
    learned, gt = np.asarray(learned, float), np.asarray(gt, float)
    if learned.shape != gt.shape or gt.ndim != 1 or len(gt) < 1:
        raise ValueError(f"paired_gap needs two equal-length, non-empty 1D score arrays, got {learned.shape} and {gt.shape}")
    d = learned - gt
    if len(d) < 2:  # one episode: no spread to judge the gap by
        return dict(mean=float(d.mean()), stderr=None, significant=False)
    se = float(d.std(ddof=1) / np.sqrt(len(d)))
    return dict(mean=float(d.mean()), stderr=se, significant=bool(abs(d.mean()) > 2 * se))


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (for Spearman's rho)."""
    order = np.argsort(x, kind="mergesort")
    r = np.empty(len(x))
    r[order] = np.arange(len(x), dtype=float)
    for v in np.unique(x):
        m = x == v
        r[m] = r[m].mean()
    return r


def pearson(x, y) -> float:
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 2 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def spearman(x, y) -> float:
    return pearson(_ranks(np.asarray(x, float)), _ranks(np.asarray(y, float)))


def mmrv(learned, gt) -> float:
    """Mean maximum rank violation (SIMPLER, Li et al. 2024): for each policy, the largest ground-truth score
    difference to any policy the learned scores order the other way, averaged over policies (0: the
    learned world orders every pair as the real one does)."""
    L, G = np.asarray(learned, float), np.asarray(gt, float)
    wrong = (L[:, None] < L[None, :]) != (G[:, None] < G[None, :])
    return float(np.mean(np.max(np.where(wrong, np.abs(G[:, None] - G[None, :]), 0.0), axis=1))) if len(G) else float("nan")


def suite_bootstrap(learned: np.ndarray, gt: np.ndarray, n: int = 2000, seed: int = 0) -> dict:
    """How much the suite-level figures depend on which starts were drawn: learned and gt are (P, E)
    scores of P policies from the same E starts; resample the starts with replacement (one draw for all
    policies and both worlds, which keeps the pairing) and recompute Pearson r, Spearman rho and the
    mean |gap| and MMRV of the policy means. Returns each figure's 5th / 50th / 95th percentile and the share of
    resamples in which the issue's target holds."""
    learned, gt = np.asarray(learned, float), np.asarray(gt, float)
    if learned.shape != gt.shape or gt.ndim != 2 or gt.shape[1] < 2:
        raise ValueError(f"suite_bootstrap needs two equal (policies, episodes) score arrays with >= 2 episodes, "
                         f"got {learned.shape} and {gt.shape}")
    rng = np.random.default_rng(seed)
    out = {"pearson_r": [], "spearman_rho": [], "mean_abs_gap": [], "mmrv": []}
    for _ in range(n):
        idx = rng.integers(0, gt.shape[1], gt.shape[1])
        L, G = learned[:, idx].mean(1), gt[:, idx].mean(1)
        out["pearson_r"].append(pearson(L, G))
        out["spearman_rho"].append(spearman(L, G))
        out["mean_abs_gap"].append(float(np.abs(L - G).mean()))
        out["mmrv"].append(mmrv(L, G))
    res = {k: [float(q) for q in np.nanpercentile(v, [5, 50, 95])] for k, v in out.items()}
    res.update(resamples=n, seed=seed,
               share_pearson_ge_0_95=float(np.mean(np.asarray(out["pearson_r"]) >= 0.95)),
               share_spearman_ge_0_9=float(np.mean(np.asarray(out["spearman_rho"]) >= 0.9)),
               share_mean_abs_gap_le_0_05=float(np.mean(np.asarray(out["mean_abs_gap"]) <= 0.05)),
               share_mmrv_le_0_03=float(np.mean(np.asarray(out["mmrv"]) <= 0.03)))
    return res


def suite_figures(per: dict) -> dict:
    """The suite-level figures of `correlate` from its per-policy results (which hold every episode's
    scores), so a stored report can be re-analysed without rerunning (`reanalyse`)."""
    L = np.array([p["learned"]["mean_max_coverage"] for p in per.values()])
    G = np.array([p["ground_truth"]["mean_max_coverage"] for p in per.values()])
    all_l = np.concatenate([p["scores_learned"] for p in per.values()])
    all_g = np.concatenate([p["scores_ground_truth"] for p in per.values()])
    all_p = np.concatenate([p["scores_learned_pose"] for p in per.values()])
    overall = dict(policies=len(per), pearson_r=pearson(L, G), spearman_rho=spearman(L, G),
                   mean_bias=float((L - G).mean()), mean_abs_gap=float(np.abs(L - G).mean()), mmrv=mmrv(L, G),
                   episode_level_pearson_r=pearson(all_l, all_g),
                   success_rate_pearson_r=pearson([p["learned"]["success_rate"] for p in per.values()],
                                                  [p["ground_truth"]["success_rate"] for p in per.values()]),
                   optimistic_policies=[k for k, p in per.items() if p["gap"] > 0.1],
                   significantly_optimistic=[k for k, p in per.items() if p["gap_significant"] and p["gap"] > 0],
                   significantly_pessimistic=[k for k, p in per.items() if p["gap_significant"] and p["gap"] < 0],
                   # the learned score re-read by the pose-fit scorer at each episode's best frame
                   pose_scorer_mean_abs_diff=float(np.mean(np.abs(all_l - all_p))),
                   pearson_r_pose_scorer=pearson([np.mean(p["scores_learned_pose"]) for p in per.values()], G),
                   seconds_per_episode_learned=float(np.mean([p["seconds_per_episode_learned"] for p in per.values()])),
                   seconds_per_episode_ground_truth=float(np.mean([p["seconds_per_episode_ground_truth"] for p in per.values()])))
    overall["targets"] = dict(pearson_ge_0_95=overall["pearson_r"] >= 0.95, spearman_ge_0_9=overall["spearman_rho"] >= 0.9,
                              mean_abs_gap_le_0_05=overall["mean_abs_gap"] <= 0.05, mmrv_le_0_03=overall["mmrv"] <= 0.03)
    if all("scores_ground_truth_pixels" in p for p in per.values()):  # both worlds read by the same scorer
        Gpx = np.array([np.mean(p["scores_ground_truth_pixels"]) for p in per.values()])
        overall["same_scorer"] = dict(
            pearson_r=pearson(L, Gpx), spearman_rho=spearman(L, Gpx), mean_bias=float((L - Gpx).mean()),
            mean_abs_gap=float(np.abs(L - Gpx).mean()), scorer_mean_bias=float((Gpx - G).mean()),
            significantly_optimistic=[k for k, p in per.items() if p["dynamics_gap_significant"] and p["dynamics_gap"] > 0],
            significantly_pessimistic=[k for k, p in per.items() if p["dynamics_gap_significant"] and p["dynamics_gap"] < 0])
    scores = ([p["scores_learned"] for p in per.values()], [p["scores_ground_truth"] for p in per.values()])
    if len(all_g) >= 2 * len(per):  # the same figures over resampled starts: how firmly each target is met or missed
        overall["bootstrap_over_starts"] = suite_bootstrap(*scores)
    if len(all_g) >= 4 * len(per):  # how well the ground truth ranks the suite against itself (the ceiling)
        overall["split_half"] = split_half(*scores)
    return overall


def split_half(learned: np.ndarray, gt: np.ndarray, n: int = 2000, seed: int = 0) -> dict:
    """The ranking's noise ceiling. learned and gt are (P, E) scores of P policies from the same E starts.
    Split the starts at random into halves A and B and compare policy means over E/2 starts each:
    gt(A) vs gt(B) is how well the ground truth agrees with itself on independent starts (no evaluator
    can be expected to beat it at this sample size), learned(A) vs gt(B) is the learned env on the same
    footing. Returns the median and 5th / 95th percentiles of Spearman rho and Pearson r over n splits."""
    learned, gt = np.asarray(learned, float), np.asarray(gt, float)
    if learned.shape != gt.shape or gt.ndim != 2 or gt.shape[1] < 4:
        raise ValueError(f"split_half needs two equal (policies, episodes) score arrays with >= 4 episodes, "
                         f"got {learned.shape} and {gt.shape}")
    rng = np.random.default_rng(seed)
    h = gt.shape[1] // 2
    out = {k: [] for k in ("gt_vs_gt_spearman", "learned_vs_gt_spearman", "gt_vs_gt_pearson", "learned_vs_gt_pearson")}
    for _ in range(n):
        idx = rng.permutation(gt.shape[1])
        a, b = idx[:h], idx[h : 2 * h]
        ga, gb, la = gt[:, a].mean(1), gt[:, b].mean(1), learned[:, a].mean(1)
        out["gt_vs_gt_spearman"].append(spearman(ga, gb))
        out["learned_vs_gt_spearman"].append(spearman(la, gb))
        out["gt_vs_gt_pearson"].append(pearson(ga, gb))
        out["learned_vs_gt_pearson"].append(pearson(la, gb))
    res = {k: [float(q) for q in np.nanpercentile(v, [5, 50, 95])] for k, v in out.items()}
    res.update(starts_per_half=h, splits=n, seed=seed)
    return res


def reanalyse(path) -> dict:
    """A stored `correlate` report with its suite-level figures recomputed by this version's code from
    the per-episode scores it holds (`iws eval correlate --from-json REPORT`); nothing is rerun."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
        per = report["per_policy"]
        lengths = set()
        for name, p in per.items():
            for k in ("scores_learned", "scores_ground_truth", "scores_learned_pose"):
                if not isinstance(p.get(k), list):
                    raise KeyError(f"per_policy.{name}.{k}")
                lengths.add(len(p[k]))
        if len(lengths) != 1:
            raise KeyError("per_policy (no policies, or score lists of different lengths)")
    except FileNotFoundError:
        raise ValueError(f"correlate report {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a JSON correlate report ({e})") from None
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a correlate report with per-episode scores: missing or bad {e}") from None
    report["overall"] = suite_figures(per)
    if all("trust" in p for p in per.values()):
        report["overall"]["trust"] = suite_trust(per)
    report["reanalysed_from"] = str(path)
    return report


def _suite_run_ground_truth(task_name: str, name: str, states, horizon: int, seed: int, spec: str | None = None,
                            threads: int | None = None):
    """One policy of the suite in gym-pusht (top level, so worker processes can run it). Returns (scores,
    seconds per episode, the same episodes' frames read by the learned env's pixel scorer, None)."""
    import torch

    from iws_gym.envs.registry import load_task

    if threads:
        torch.set_num_threads(threads)
    task = load_task(task_name)
    factory = load_policy_factory(spec) if spec else task_suite(task.name)[name]
    pixels: list = []
    return (*run_ground_truth(task, factory, states, horizon, seed, pixel_scores=pixels), np.array(pixels), None)


def _suite_run_learned(task_name: str, names: list, specs: dict, states, horizon: int, seed: int, checkpoint, device: str,
                       reencode: bool | None = None, reencode_every: int | None = None, stop_untrusted: bool = False,
                       threads: int | None = None, first: int = 0, batch: int = SUITE_BATCH):
    """A group of the suite's policies in the learned world at once: their episodes share vector envs
    of `batch` worlds, so the world model steps them together (each episode keeps its policy, start state and
    seeds). `first`: the index of this group's first episode in the whole suite (its vector envs are seeded
    as if the suite ran as one list). Returns name -> (scores, seconds per episode, the best frames read by
    the pose-fit scorer, each episode's lowest and mean trust)."""
    import torch

    from iws_gym.envs.registry import load_task

    if threads:
        torch.set_num_threads(threads)
    task = load_task(task_name)
    built = task_suite(task.name)
    factories = {n: load_policy_factory(specs[n]) if specs.get(n) else built[n] for n in names}
    n_ep = len(states)
    all_states = np.concatenate([states] * len(names))
    frames, tmin, tmean = [], [], []
    scores, sec = run_learned(task, [factories[n] for n in names for _ in range(n_ep)], all_states, horizon, seed, checkpoint,
                              device, batch=batch, reencode=reencode, best_frames=frames, reencode_every=reencode_every,
                              trust_min=tmin, trust_mean=tmean, stop_untrusted=stop_untrusted, runner_seeds=np.tile(np.arange(seed, seed + n_ep), len(names)),
                              env_seed=seed + first)
    # the same best frames read by a second scorer (T pushing: the pose fit): if it agrees, a gap is the dynamics',
    # not the pixel scorer's; a task without one repeats the pixel scores
    second = task.module.second_scorer()
    pose = np.array([second.coverage(f) for f in frames]) if second is not None else scores.copy()
    tmin, tmean = np.array(tmin), np.array(tmean)
    return {n: (scores[k * n_ep:(k + 1) * n_ep], sec, pose[k * n_ep:(k + 1) * n_ep], tmin[k * n_ep:(k + 1) * n_ep],
                tmean[k * n_ep:(k + 1) * n_ep]) for k, n in enumerate(names)}


def suite_trust(per: dict) -> dict:
    """The study over trusted episodes only: per policy the mean score over its trusted episodes in both
    worlds, and across policies the mean |gap| over all episodes against over trusted ones, and the share kept."""
    all_gaps, trusted_gaps, ep_gaps, ep_ok = [], [], [], []
    for p in per.values():
        t = p["trust"]
        all_gaps.append(abs(t["gap_all"]))
        if t["gap_trusted"] is not None:
            trusted_gaps.append(abs(t["gap_trusted"]))
        ep_gaps.append(np.abs(np.asarray(p["scores_learned"]) - np.asarray(p["scores_ground_truth"])))
        ep_ok.append(np.asarray(t["trust_min"]) >= TRUSTED)
    m_all = float(np.mean(all_gaps))
    m_tr = float(np.mean(trusted_gaps)) if trusted_gaps else None
    ep_gaps, ep_ok = np.concatenate(ep_gaps), np.concatenate(ep_ok)
    e_all = float(ep_gaps.mean())
    e_tr = float(ep_gaps[ep_ok].mean()) if ep_ok.any() else None
    return dict(threshold=TRUSTED, kept_share=float(ep_ok.mean()), policies_with_trusted_episodes=len(trusted_gaps),
                # the study's figure: per policy |mean learned - mean gym-pusht| over its (trusted) episodes
                mean_abs_gap_all=m_all, mean_abs_gap_trusted=m_tr,
                reduction=(1 - m_tr / m_all) if m_tr is not None and m_all > 0 else None,
                # per episode |learned - gym-pusht|, over all episodes and over the trusted ones
                episode_mean_abs_gap_all=e_all, episode_mean_abs_gap_trusted=e_tr,
                episode_mean_abs_gap_untrusted=float(ep_gaps[~ep_ok].mean()) if (~ep_ok).any() else None,
                episode_reduction=(1 - e_tr / e_all) if e_tr is not None and e_all > 0 else None)


def correlate(task: TaskConfig, episodes: int = 16, horizon: int = 100, seed: int = 0, checkpoint=None,
              device: str = "auto", names=None, plot=None, workers: int = 1, reencode: bool | None = None,
              reencode_every: int | None = None, stop_untrusted: bool = False, extra: dict | None = None) -> dict:
    """Run the policy suite in the learned env and in gym-pusht from the same initial states; report how
    well the learned env's scores track the ground truth (per policy and overall).

    The learned world runs the policies in groups whose episodes fill one vector env of up to SUITE_BATCH
    worlds, so the world model steps a group in one batch (the per-episode seconds are the group's, shared).
    workers > 1 runs those groups and the per-policy gym-pusht jobs in separate processes (one torch
    thread each), the learned groups and the frame-reading pushers first because they are the slowest.
    Every job sees the same starts and seeds either way. `extra` adds policies to the suite, name -> spec
    (MODULE:CALLABLE or a policy's .safetensors, see load_policy_factory)."""
    from tqdm import tqdm

    from iws_gym.models.world_model import release_settings

    if episodes <= 1 or horizon <= 0:
        raise ValueError(f"--episodes must be > 1 and --horizon > 0, got {episodes} and {horizon}")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    rollout = release_settings(checkpoint or task.checkpoint_path, reencode=reencode, reencode_every=reencode_every)
    reencode, reencode_every = rollout.reencode, rollout.reencode_every  # given, else the release's defaults
    policies = task_suite(task.name)
    unknown = sorted(set(names or []) - set(policies))
    if unknown:
        raise ValueError(f"unknown policies {unknown}; the suite has {sorted(policies)}")
    if names:
        policies = {k: v for k, v in policies.items() if k in names}
    extra = dict(extra or {})
    clash = sorted(set(extra) & set(policies))
    if clash:
        raise ValueError(f"added policies {clash} already have those names in the suite")
    for name, spec in extra.items():
        load_policy_factory(spec)  # a bad spec fails here, before any job runs
    policies.update(extra)
    states = start_states(task, episodes, seed)
    t0 = time.time()
    args = (states, horizon, seed, str(checkpoint) if checkpoint else None, device, reencode, reencode_every, stop_untrusted)
    # the learned world: groups of policies whose episodes fill one vector env each (the same groups
    # whatever the workers, so the same batches and scores); gym-pusht: one job per policy
    names = list(policies)
    g = max(1, SUITE_BATCH // episodes)
    groups = [(names[i:i + g], i * episodes) for i in range(0, len(names), g)]
    gt_names = sorted(names, key=lambda n: "pusher" not in n and "sweeper" not in n)  # the frame readers first: the slowest
    if workers == 1:
        res = {}
        for group, first in tqdm(groups, desc="policy suite in the learned world"):
            res.update({(n, "learned"): r for n, r in _suite_run_learned(task.name, group, extra, *args, None, first).items()})
        res.update({(n, "ground_truth"): _suite_run_ground_truth(task.name, n, states, horizon, seed, extra.get(n))
                    for n in tqdm(gt_names, desc="policy suite in gym-pusht")})
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            learned = [pool.submit(_suite_run_learned, task.name, group, extra, *args, 1, first)  # first: the longest
                       for group, first in groups]
            futs = {pool.submit(_suite_run_ground_truth, task.name, n, states, horizon, seed, extra.get(n), 1): (n, "ground_truth")
                    for n in gt_names}
            res = {futs[f]: f.result() for f in tqdm(as_completed(futs), total=len(futs), desc="policy suite in gym-pusht")}
            for f in tqdm(learned, desc="policy suite in the learned world"):
                res.update({(n, "learned"): r for n, r in f.result().items()})
    per = {}
    for name in policies:  # the suite's order, whatever finished first
        (learned, t_l, pose, tmin, tmean), (gt, t_g, gt_px, _) = res[(name, "learned")], res[(name, "ground_truth")]
        pg = paired_gap(learned, gt)
        sg, dg = paired_gap(gt_px, gt), paired_gap(learned, gt_px)
        per[name] = dict(learned=_summary(learned, task), ground_truth=_summary(gt, task), gap=pg["mean"], gap_stderr=pg["stderr"],
                         gap_significant=pg["significant"], episode_pearson=pearson(learned, gt), seconds_per_episode_learned=t_l,
                         seconds_per_episode_ground_truth=t_g, scores_learned=learned.tolist(), scores_ground_truth=gt.tolist(),
                         scores_learned_pose=pose.tolist(), scores_ground_truth_pixels=gt_px.tolist(),
                         # gap = scorer part (gym-pusht's frames read by the pixel scorer - true coverage)
                         #     + dynamics part (learned - gym-pusht's frames read by the same scorer)
                         scorer_gap=sg["mean"], scorer_gap_stderr=sg["stderr"],
                         dynamics_gap=dg["mean"], dynamics_gap_stderr=dg["stderr"], dynamics_gap_significant=dg["significant"],
                         trust=trust_summary(tmin, learned, gt, task, tmean))
    overall = suite_figures(per)
    overall["trust"] = suite_trust(per)
    report = dict(task=task.name, episodes=episodes, horizon=horizon, seed=seed, workers=workers, reencode=reencode,
                  stop_untrusted=stop_untrusted, added_policies=extra,
                  reencode_every=reencode_every if reencode else None, precision=_precision(device),
                  checkpoint=str(checkpoint or task.checkpoint_path),
                  score=task.module.SCORE_DOC, ground_truth=task.ground_truth, env_id=task.env_id,
                  start_seeds=[task.heldout_seed_base + seed, task.heldout_seed_base + seed + episodes - 1],
                  overall=overall, per_policy=per, wall_s=round(time.time() - t0, 1))
    if plot:
        plot_correlation(report, plot)
        report["plot"] = str(plot)
    return report


def plot_correlation(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    for name, p in report["per_policy"].items():
        g, l = p["ground_truth"], p["learned"]
        ax.errorbar(g["mean_max_coverage"], l["mean_max_coverage"], xerr=g["stderr"], yerr=l["stderr"], fmt="o",
                    capsize=3, label=name)
    ax.plot([0, 1], [0, 1], "k--", lw=0.8)
    o = report["overall"]
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel=f"{report.get('ground_truth', 'gym-pusht')} (ground truth): mean max coverage",
           ylabel=f"{report.get('env_id', 'IWS-TPushing-v0')} (learned): mean max coverage",
           title=f"r = {o['pearson_r']:.3f}, rho = {o['spearman_rho']:.3f}, mean |gap| = {o['mean_abs_gap']:.3f}")
    ax.legend(fontsize=7, loc="upper left")  # a legend, not labels at the points: scores often cluster
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
