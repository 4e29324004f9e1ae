"""Evaluate the compact-latent ablation with the repository's own harnesses (fidelity, stability), by handing
them a world model with the WorldModel interface they use.
  python scripts/compact_latent/compact_eval.py fidelity RUN DYN.pt OUT.json [episodes] [horizon] [behaviour] [reencode 0/1/open]
  python scripts/compact_latent/compact_eval.py stability RUN DYN.pt OUT.json [steps] [reencode 0/1/open]
  python scripts/compact_latent/compact_eval.py recon RUN - OUT.json [episodes] [frames]
      stage 1 alone: the T's pose error of decode(encode(frame)) over the first frames of held-out expert
      episodes (split validation), where the T lies at the start poses the data has least of
  python scripts/compact_latent/compact_eval.py correlate RUN DYN.pt OUT.json GT_REPORT.json [reencode 0/1/open]
      `iws eval correlate` with this model as the learned env: the same suite, added policies, starts, seeds
      and horizon as GT_REPORT (a report of that command); its gym-pusht side is read from GT_REPORT instead of
      being run again (the same starts and seeds give the same ground truth).
  python scripts/compact_latent/compact_eval.py whole RUN DYN.pt OUT.json N STEPS [reencode] [split]
      N drives of each kind (uniform-random targets every step; scripted play) from N held-out starts (split
      validation unless given, seeds from +500), run in gym-pusht and in the model with the same actions: the
      share of checks (every 10 steps) where the T is whole (stability's check) and the T's pose error against
      gym-pusht's, by tenth of the drive. Many drives instead of stability's one per kind.
  python scripts/compact_latent/compact_eval.py recondrive RUN - OUT.json [N] [STEPS]
      stage 1 alone on the whole mode's drives (N of each kind, every 10th frame): is decode(encode(frame))
      a whole T (the real frames all are; and which part of the check fails: area, fit residual, IoU), and the
      T's pose error
STAB_SEED=n: stability's drive seed (0; other seeds for tuning, 0 for the reported figure).
PROJ=RUN/proj.pt (compact_dyn.py proj) with PROJ_SIGMA=s (0.05): each predicted latent denoised at sigma s.
reencode: 0 never, 1 every step, open every step where the dynamics' gate is open (a gated model's world at
rest keeps its latent: the round trip would move it)."""
import os, sys, json
from pathlib import Path
import numpy as np, torch
sys.path.insert(0, str(Path(__file__).parent))
from compact_dyn import Dyn, Proj, load_ae, landing, K
from iws_gym.envs.registry import load_task


def pad_first(x, n_valid):
    """Slots before the first valid one (the last n_valid of K are valid) repeat it, as in training."""
    K = x.shape[1]
    first = (K - n_valid).clamp(min=0)
    slot = torch.arange(K)[None].expand(len(x), K)
    src = torch.maximum(slot, first[:, None])
    return torch.gather(x, 1, src[..., None].expand_as(x))


class CompactWM:
    """The compact latent behind WorldModel's interface: a batched state of tensors (what the envs splice on
    reset), start_frames / advance / step / decode, and the agent track in state["agent"]."""
    tracks_agent = True
    device = torch.device("cpu")

    def __init__(self, run, dyn, reencode=True, reencode_every=1, only_open=False):
        self.enc, self.dec, D = load_ae(run)
        if dyn is not None:  # None: stage 1 alone
            ck = torch.load(dyn)
            self.dyn = Dyn(D, gate=ck.get("gate", False)); self.dyn.load_state_dict(ck["model"]); self.dyn.eval()
        self.reencode, self.reencode_every, self.only_open = reencode, reencode_every, only_open
        self.proj = None
        if os.environ.get("PROJ"):  # PROJ=RUN/proj.pt [PROJ_SIGMA=s]: each predicted latent denoised at sigma s
            ck = torch.load(os.environ["PROJ"])
            self.proj = Proj(ck["D"]); self.proj.load_state_dict(ck["model"]); self.proj.eval()
            self.proj_sigma = float(os.environ.get("PROJ_SIGMA", 0.05))
        self.path, self.dtype = Path(dyn or run), torch.bfloat16

    def with_settings(self, **changes):
        import copy
        wm = copy.copy(self)
        wm.reencode = changes.get("reencode", self.reencode)
        wm.reencode_every = changes.get("reencode_every", self.reencode_every)
        return wm

    def compile(self):
        return self

    @torch.no_grad()
    def _enc(self, frames):
        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float() / 127.5 - 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.enc(x.contiguous(memory_format=torch.channels_last)).float()

    @torch.no_grad()
    def _dec(self, z, p):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.dec(z, p).float()
        return ((y.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()

    def start_frames(self, frames, agent_pos):
        z = self._enc(frames)
        B = len(z)
        p = torch.as_tensor(np.asarray(agent_pos, np.float32).reshape(-1, 2) / 512.0)
        return dict(ctx=z[:, None].repeat(1, K, 1), agent_hist=p[:, None].repeat(1, K, 1), acts=torch.zeros(B, K, 2),
                    n_valid=torch.ones(B, dtype=torch.long), t=torch.zeros(B, dtype=torch.long), agent=p * 512,
                    trust=torch.ones(B), trust_min=torch.ones(B))

    @torch.no_grad()
    def advance(self, state, actions, generator=None):
        a = torch.as_tensor(actions, dtype=torch.float32).reshape(-1, 2) / 512.0
        nv = state["n_valid"]
        acts = pad_first(torch.cat([state["acts"][:, 1:], a[:, None]], 1), nv)
        zn = self.dyn(state["ctx"], state["agent_hist"], acts, nv)
        pn = landing(state["agent_hist"], acts, nv).clamp(0, 1)
        if self.proj is not None:  # only where the dynamics moved z (a closed gate keeps a world at rest exact)
            moved = self.dyn.open > 0 if self.dyn.gate else torch.ones(len(zn), dtype=torch.bool)
            zp = self.proj(zn, pn, torch.full((len(zn),), self.proj_sigma))
            zn = torch.where(moved[:, None], zp, zn)
        nv2 = (nv + 1).clamp(max=K)
        state["acts"] = acts
        state["ctx"] = pad_first(torch.cat([state["ctx"][:, 1:], zn[:, None]], 1), nv2)
        state["agent_hist"] = pad_first(torch.cat([state["agent_hist"][:, 1:], pn[:, None]], 1), nv2)
        state["n_valid"], state["t"], state["agent"] = nv2, state["t"] + 1, pn * 512
        self._last_p = pn
        return zn

    def step(self, state, actions, generator=None):
        zn = self.advance(state, actions)
        frame = self._dec(zn, state["agent_hist"][:, -1])
        if self.reencode:
            due = state["t"] % self.reencode_every == 0
            if self.only_open:  # where the dynamics changed nothing (its gate closed), the latent is kept as it is
                due &= self.dyn.open > 0
            if bool(due.any()):
                state["ctx"][:, -1] = torch.where(due[:, None], self._enc(frame), state["ctx"][:, -1])
        return frame

    def decode(self, z, generator=None):
        """The frame of latents z, with the agent where the last advance() put it."""
        return self._dec(z, self._last_p)

    def rollout(self, first, actions, agent_pos):
        state = self.start_frames(first[None], agent_pos)
        out = [first]
        for a in actions:
            out.append(self.step(state, a[None])[0])
        return np.stack(out)


def drives(task, kind, n, steps, split="validation", env=None):
    """The `whole` and `recondrive` modes' drives: n episodes of `kind` (uniform-random targets, or scripted play)
    recorded in gym-pusht from the held-out seeds of `split` + 500 on. Returns (first seed, episodes)."""
    from iws_gym.data.collect import collect_episode, episode_plan
    from iws_gym.data.splits import split_offset
    seed0 = task.heldout_seed_base + split_offset(split) + 500
    return seed0, [collect_episode(task, seed0 + i, steps, env,
                                   plan=episode_plan("random", seed0 + i, steps) if kind == "random" else None)
                   for i in range(n)]


def whole_residual(task):
    """The fit-residual bound of a whole T, calibrated on real frames as `iws eval stability` does."""
    from iws_gym.evaluation.stability import reference_frames
    from iws_gym.tasks.pusht.pose import calibrate_whole_t
    return calibrate_whole_t(reference_frames(task, 8, 200, "stability_calibration"))


def reencode_arg(v):
    if v not in ("0", "1", "open"):
        raise SystemExit(f"reencode must be 0, 1 or open, got {v!r}")
    return v != "0", v == "open"


if __name__ == "__main__":
    mode, run, dyn, out = sys.argv[1:5]
    task = load_task("tpushing")
    if mode == "fidelity":
        eps, hor, beh = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
        re, only_open = reencode_arg(sys.argv[8] if len(sys.argv) > 8 else "1")
        wm = CompactWM(run, dyn, re, only_open=only_open)
        import iws_gym.models.world_model as W
        from iws_gym.evaluation import fidelity as Fm

        def roll(ep, horizon):
            return wm.rollout(ep["frames"][0], ep["actions"][:horizon], ep["agent_pos"][:1])
        W.load_predictor = lambda ck, settings: ("open_loop_rollout", roll)
        rep = Fm.fidelity(task, "compact", horizon=hor, episodes=eps, behaviour=beh, split="validation",
                          grid=Path(out).with_suffix(".png"))
    elif mode == "recon":
        from iws_gym.data.collect import heldout_episodes
        from iws_gym.evaluation.fidelity import frame_metrics
        n_eps, n_fr = (int(sys.argv[5]) if len(sys.argv) > 5 else 32), (int(sys.argv[6]) if len(sys.argv) > 6 else 10)
        wm = CompactWM(run, None)
        px, rad, real = [], [], []
        for ep in heldout_episodes(task, n_eps, n_fr, "validation", behaviour="expert"):
            sub = {k: (v[:n_fr] if isinstance(v, np.ndarray) else v) for k, v in ep.items()}
            y = wm._dec(wm._enc(sub["frames"]), torch.from_numpy(sub["agent_pos"].astype(np.float32) / 512))
            m, m0 = frame_metrics(y, sub), frame_metrics(sub["frames"], sub)
            px.append(m["block_px"]); rad.append(m["block_rad"]); real.append(m0["block_px"])
        px, rad, real = (np.concatenate(v) for v in (px, rad, real))
        q = lambda v: dict(median=float(np.nanmedian(v)), mean=float(np.nanmean(v)), p90=float(np.nanquantile(v, 0.9)))
        rep = dict(run=run, ae_step=int(torch.load(Path(run) / "ae.pt")["step"]), episodes=n_eps, frames_per_episode=n_fr,
                   split="validation", behaviour="expert", block_px=q(px), block_rad=q(rad),
                   real_frames_block_px=q(real), note="the pose reader's own error on the real frames is real_frames_block_px")
        print(json.dumps(rep, indent=1))
    elif mode == "correlate":
        gt = json.loads(Path(sys.argv[5]).read_text())
        re, only_open = reencode_arg(sys.argv[6] if len(sys.argv) > 6 else "1")
        wm = CompactWM(run, dyn, re, only_open=only_open)
        import iws_gym.models.world_model as W
        from iws_gym.evaluation import policy_eval as P
        W.WorldModel.from_pretrained = classmethod(
            lambda cls, *a, settings=None, **k: wm if settings is None else
            wm.with_settings(reencode=settings.reencode, reencode_every=settings.reencode_every))

        def stored_gt(task_name, name, states, horizon, seed, spec=None, threads=None):
            p = gt["per_policy"][name]
            return (np.array(p["scores_ground_truth"]), p["seconds_per_episode_ground_truth"],
                    np.array(p["scores_ground_truth_pixels"]), None)
        P._suite_run_ground_truth = stored_gt
        rep = P.correlate(task, episodes=gt["episodes"], horizon=gt["horizon"], seed=gt["seed"], device="cpu",
                          workers=1, reencode=re, reencode_every=1, extra=gt["added_policies"],
                          plot=Path(out).with_suffix(".png"))
        rep["ground_truth_from"] = sys.argv[5]
        s = rep["overall"]
        print(json.dumps({k: s[k] for k in ("pearson_r", "spearman_rho", "mean_abs_gap", "mmrv", "mean_bias")}, indent=1))
        print({n: (round(p["ground_truth"]["mean_max_coverage"], 3), round(p["learned"]["mean_max_coverage"], 3))
               for n, p in rep["per_policy"].items()})
    elif mode == "recondrive":
        from iws_gym.evaluation.fidelity import save_grid
        from iws_gym.tasks.pusht.pose import (WHOLE_AREA_TOL, WHOLE_IOU, area_ratio, estimate, is_whole_t,
                                              pose_errors)
        n, steps = (int(sys.argv[5]) if len(sys.argv) > 5 else 8), (int(sys.argv[6]) if len(sys.argv) > 6 else 300)
        residual_max = whole_residual(task)
        wm = CompactWM(run, None)
        rep = dict(run=run, ae_step=int(torch.load(Path(run) / "ae.pt")["step"]), drives=n, steps=steps, kinds={})
        for kind in ("random", "scripted"):
            rep["seeds_from"], eps = drives(task, kind, n, steps)
            whole, real, px, ratio, res_ok, iou_ok = [], [], [], [], [], []
            for i, e in enumerate(eps):
                f = e["frames"][10::10]
                y = wm._dec(wm._enc(f), torch.from_numpy(e["agent_pos"][10::10].astype(np.float32) / 512))
                if i == 0:  # the first drive: real frames above their reconstructions, every 30 steps
                    save_grid([f[::3][:10], y[::3][:10]], Path(out).with_name(Path(out).stem + f"_{kind}.png"))
                for j in range(len(f)):
                    est, t = estimate(y[j]), 10 + 10 * j
                    whole.append(is_whole_t(est, f.shape[1], residual_max))
                    ratio.append(area_ratio(est, f.shape[1]))  # which part of the check fails
                    res_ok.append(est.block is not None and est.fit_residual <= residual_max)
                    iou_ok.append(est.block is not None and est.t_iou >= WHOLE_IOU)
                    real.append(is_whole_t(estimate(f[j]), f.shape[1], residual_max))
                    px.append(pose_errors(est, e["agent_pos"][t], e["block_pose"][t], e["coverage"][t])["block_px"])
            rep["kinds"][kind] = dict(t_whole_share=float(np.mean(whole)), real_t_whole_share=float(np.mean(real)),
                                      block_px_median=float(np.nanmedian(px)), block_px_p90=float(np.nanquantile(px, 0.9)),
                                      area_ok=float(np.mean(np.abs(np.asarray(ratio) - 1) <= WHOLE_AREA_TOL)),
                                      area_ratio_median=float(np.nanmedian(ratio)), residual_ok=float(np.mean(res_ok)),
                                      iou_ok=float(np.mean(iou_ok)))
        print(json.dumps(rep["kinds"]))
    elif mode == "whole":
        from tqdm import tqdm
        from iws_gym.evaluation.fidelity import save_grid
        from iws_gym.tasks.pusht.groundtruth import make_env
        from iws_gym.tasks.pusht.pose import estimate, is_whole_t, pose_errors
        n, steps = int(sys.argv[5]), int(sys.argv[6])
        if steps < 50:
            raise SystemExit(f"whole: STEPS must be >= 50 (the pose error at step 50 is reported), got {steps}")
        re, only_open = reencode_arg(sys.argv[7] if len(sys.argv) > 7 else "0")
        split = sys.argv[8] if len(sys.argv) > 8 else "validation"
        wm = CompactWM(run, dyn, re, only_open=only_open)
        residual_max = whole_residual(task)
        env = make_env(task.frame_size)
        rep = dict(drives=n, steps=steps, split=split, residual_max=residual_max, kinds={})
        for kind in ("random", "scripted"):
            rep["seeds_from"], eps = drives(task, kind, n, steps, split, env)
            state = wm.start_frames(np.stack([e["frames"][0] for e in eps]), np.stack([e["agent_pos"][0] for e in eps]))
            checks = list(range(10, steps + 1, 10))
            whole, px, rad = np.zeros((n, len(checks))), np.full((n, len(checks)), np.nan), np.full((n, len(checks)), np.nan)
            shown = [np.stack([e["frames"][0] for e in eps[:4]])]
            for t in tqdm(range(steps), desc=f"model ({kind})"):
                a = np.stack([e["actions"][t] for e in eps])
                if re:
                    frames = wm.step(state, a)
                else:
                    zn = wm.advance(state, a)
                if (t + 1) % 10 == 0:
                    c = (t + 1) // 10 - 1
                    if not re:
                        frames = wm.decode(zn)
                    for b in range(n):
                        est = estimate(frames[b])
                        whole[b, c] = is_whole_t(est, frames.shape[1], residual_max)
                        e = pose_errors(est, eps[b]["agent_pos"][t + 1], eps[b]["block_pose"][t + 1], eps[b]["coverage"][t + 1])
                        px[b, c], rad[b, c] = e["block_px"], e["block_rad"]
                    if (t + 1) % max(10, steps // 8 // 10 * 10) == 0:
                        shown.append(frames[:4]); shown.append(np.stack([e["frames"][t + 1] for e in eps[:4]]))
            tenth = lambda v, f: [float(f(v[:, i * len(checks) // 10:(i + 1) * len(checks) // 10])) for i in range(10)]
            rep["kinds"][kind] = dict(t_whole_share=float(whole.mean()), t_whole_by_tenth=tenth(whole, np.mean),
                                      block_px_median=float(np.nanmedian(px)), block_px_median_by_tenth=tenth(px, np.nanmedian),
                                      block_rad_median=float(np.nanmedian(rad)), block_px_at_50=float(np.nanmedian(px[:, 4])),
                                      drives_whole_throughout=int((whole.min(1) == 1).sum()))
            save_grid([np.stack([f[j] for f in shown]) for j in range(min(4, n))], Path(out).with_name(Path(out).stem + f"_{kind}.png"))
            print(kind, json.dumps({k: v for k, v in rep["kinds"][kind].items() if not isinstance(v, list)}), flush=True)
    else:
        steps = int(sys.argv[5])
        re, only_open = reencode_arg(sys.argv[6] if len(sys.argv) > 6 else "1")
        wm = CompactWM(run, dyn, re, only_open=only_open)
        import iws_gym.models.world_model as W
        from iws_gym.evaluation import stability as S
        W.WorldModel.from_pretrained = classmethod(lambda cls, *a, **k: wm)
        rep = S.stability(task, "compact", steps=steps, reencode=re, kinds=("random", "scripted", "hold"),
                          strip=Path(out).with_suffix(".png"), seed=int(os.environ.get("STAB_SEED", 0)))
    rep["ablation"] = dict(run=run, dyn=dyn, argv=sys.argv)
    Path(out).write_text(json.dumps(rep, indent=1, default=float))
    if mode in ("fidelity", "stability"):  # the other modes printed their summary above
        s = rep["summary"]["model"] if mode == "fidelity" else rep["rollouts"]
        print(json.dumps({k: v for k, v in s.items() if not isinstance(v, list)}, indent=1, default=float)[:3000])
