"""Evaluate the compact-latent ablation with the repository's own harnesses (fidelity, stability), by handing
them a world model with the WorldModel interface they use.
  python scripts/compact_latent/compact_eval.py fidelity RUN DYN.pt OUT.json [episodes] [horizon] [behaviour] [reencode 0/1]
  python scripts/compact_latent/compact_eval.py stability RUN DYN.pt OUT.json [steps] [reencode 0/1]"""
import sys, json
from pathlib import Path
import numpy as np, torch
sys.path.insert(0, str(Path(__file__).parent))
from compact_dyn import Dyn, load_ae, landing, K
from iws_gym.envs.registry import load_task


class CompactWM:
    def __init__(self, run, dyn, reencode=True):
        self.enc, self.dec, D = load_ae(run)
        ck = torch.load(dyn)
        self.dyn = Dyn(D); self.dyn.load_state_dict(ck["model"]); self.dyn.eval()
        self.reencode = reencode
        self.path, self.dtype = Path(dyn), torch.bfloat16

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
        p = torch.as_tensor(np.asarray(agent_pos, np.float32).reshape(-1, 2) / 512.0)
        return dict(z=[z], p=[p], a=[], ctx=z[:, None])

    def _slots(self, lst):
        lst = lst[-K:]
        return torch.stack([lst[0]] * (K - len(lst)) + lst, 1)

    @torch.no_grad()
    def advance(self, state, actions, generator=None):
        state["a"].append(torch.as_tensor(actions, dtype=torch.float32).reshape(-1, 2) / 512.0)
        n = min(len(state["z"]), K)
        nv = torch.full((state["z"][0].shape[0],), n)
        z, p, a = self._slots(state["z"]), self._slots(state["p"]), self._slots(state["a"][-n:])
        zn = self.dyn(z, p, a, nv)
        pn = landing(p, a, nv)
        state["z"] = (state["z"] + [zn])[-K:]; state["p"] = (state["p"] + [pn])[-K:]; state["a"] = state["a"][-K:]
        state["ctx"] = zn[:, None]
        self._last_p = pn
        return zn

    def step(self, state, actions, generator=None):
        zn = self.advance(state, actions)
        frame = self._dec(zn, self._last_p)
        if self.reencode:
            state["z"][-1] = self._enc(frame)
        return frame

    def decode(self, z, generator=None):
        return self._dec(z, self._last_p)

    def rollout(self, first, actions, agent_pos):
        state = self.start_frames(first[None], agent_pos)
        out = [first]
        for a in actions:
            out.append(self.step(state, a[None])[0])
        return np.stack(out)


if __name__ == "__main__":
    mode, run, dyn, out = sys.argv[1:5]
    task = load_task("tpushing")
    if mode == "fidelity":
        eps, hor, beh = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
        re = bool(int(sys.argv[8])) if len(sys.argv) > 8 else True
        wm = CompactWM(run, dyn, re)
        import iws_gym.models.world_model as W
        from iws_gym.evaluation import fidelity as Fm

        def roll(ep, horizon):
            return wm.rollout(ep["frames"][0], ep["actions"][:horizon], ep["agent_pos"][:1])
        W.load_predictor = lambda ck, settings: ("open_loop_rollout", roll)
        rep = Fm.fidelity(task, "compact", horizon=hor, episodes=eps, behaviour=beh, split="validation",
                          grid=Path(out).with_suffix(".png"))
    else:
        steps = int(sys.argv[5]); re = bool(int(sys.argv[6])) if len(sys.argv) > 6 else True
        wm = CompactWM(run, dyn, re)
        import iws_gym.models.world_model as W
        from iws_gym.evaluation import stability as S
        W.WorldModel.from_pretrained = classmethod(lambda cls, *a, **k: wm)
        rep = S.stability(task, "compact", steps=steps, reencode=re, kinds=("random", "scripted", "hold"), strip=Path(out).with_suffix(".png"))
    rep["ablation"] = dict(run=run, dyn=dyn, argv=sys.argv)
    Path(out).write_text(json.dumps(rep, indent=1, default=float))
    s = rep.get("summary", {}).get("model") or rep.get("rollouts")
    print(json.dumps({k: v for k, v in (s.items() if isinstance(s, dict) else [])
                      if not isinstance(v, list)}, indent=1, default=float)[:3000])
