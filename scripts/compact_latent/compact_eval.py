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
reencode: 0 never, 1 every step, open every step where the dynamics' gate is open (a gated model's world at
rest keeps its latent: the round trip would move it)."""
import sys, json
from pathlib import Path
import numpy as np, torch
sys.path.insert(0, str(Path(__file__).parent))
from compact_dyn import Dyn, load_ae, landing, K
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
            lambda cls, *a, settings=None, **k: wm.with_settings(reencode=settings.reencode, reencode_every=settings.reencode_every))

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
    else:
        steps = int(sys.argv[5])
        re, only_open = reencode_arg(sys.argv[6] if len(sys.argv) > 6 else "1")
        wm = CompactWM(run, dyn, re, only_open=only_open)
        import iws_gym.models.world_model as W
        from iws_gym.evaluation import stability as S
        W.WorldModel.from_pretrained = classmethod(lambda cls, *a, **k: wm)
        rep = S.stability(task, "compact", steps=steps, reencode=re, kinds=("random", "scripted", "hold"), strip=Path(out).with_suffix(".png"))
    rep["ablation"] = dict(run=run, dyn=dyn, argv=sys.argv)
    Path(out).write_text(json.dumps(rep, indent=1, default=float))
    if mode in ("fidelity", "stability"):  # the other modes printed their summary above
        s = rep["summary"]["model"] if mode == "fidelity" else rep["rollouts"]
        print(json.dumps({k: v for k, v in s.items() if not isinstance(v, list)}, indent=1, default=float)[:3000])
