"""Eval-time variants of a visuomotor policy release in gym-pusht (issue 33; a scratch tool kept at a git tag):
how many actions of a chunk to execute, ACT-style temporal ensembling, and one noise draw per episode.

    python scripts/policy_variants.py POLICY NAME '{"execute": 4}' EPISODES SEED   # -> /tmp/pol/NAME.json
    # variants: {"execute": k}, {"execute": k, "ensemble": m} (a chunk every k steps, overlapping chunks
    # averaged with weights exp(-m i), oldest first), {"execute": k, "fixed": true} (the same noise every call),
    # {"execute": 8, "bid": N} (N chunks sampled, the one closest to the previous chunk's unexecuted actions kept:
    # BID's backward coherence), {"execute": 8, "bid": N, "medoid": true} (the most central of N samples),
    # {"execute": 8, "temp": T} (the flow sampler's starting noise scaled by T), {"execute": 8, "seed_offset": S}
    # (the sampler seeded with S + the start's seed instead of the start's seed)
"""
import json, sys, time
from collections import deque
import numpy as np, torch
from iws_gym.policies.visuomotor import VisuomotorPolicy, prep_frames, frames_to_input, CANVAS
from iws_gym.evaluation.policy_eval import start_states, run_ground_truth, _summary
from iws_gym.envs.registry import load_task

class Variant(VisuomotorPolicy):
    def __init__(self, path, execute=8, ensemble=0.0, steps=None, fixed=False, bid=0, medoid=False, seed_offset=0):
        self.fixed, self.bid, self.medoid, self.seed_offset = fixed, bid, medoid, seed_offset
        super().__init__(path)
        self.cfg.execute = execute
        self.ens, self.steps = ensemble, steps
    def reset(self, seed=None):
        seed = None if seed is None else seed + getattr(self, "seed_offset", 0)
        super().reset(seed)
        self.seed0 = 0 if seed is None else int(seed)
        self.chunks = []  # (t0, chunk)
        self.prev_rest = None
        self.t = 0
    def __call__(self, obs):
        if self.fixed and (self.ens > 0 or not self.queue):  # the same noise draw at every call of the episode
            self.generator = torch.Generator().manual_seed(self.seed0)
        if self.bid > 0:
            return self.coherent(obs)
        if self.ens <= 0:
            return super().__call__(obs)
        frame = prep_frames(np.asarray(obs["pixels"]), self.cfg.size)
        agent = np.asarray(obs["agent_pos"], np.float32)
        if not self.frames:
            self.frames.extend([frame] * self.cfg.n_frames); self.agents.extend([agent] * self.cfg.n_obs)
        self.frames.append(frame); self.agents.append(agent)
        if self.t % self.cfg.execute == 0:
            x = frames_to_input(np.stack(self.frames)[None], self.cfg.crop)
            p = torch.from_numpy(np.stack(self.agents))[None]
            self.chunks.append((self.t, self.net.sample(x, p, self.generator, steps=self.steps)[0].cpu().numpy()))
        self.chunks = [(t0, c) for t0, c in self.chunks if self.t - t0 < len(c)]
        acts = np.stack([c[self.t - t0] for t0, c in self.chunks])  # oldest first
        w = np.exp(-self.ens * np.arange(len(acts)))
        a = (w[:, None] * acts).sum(0) / w.sum()
        self.t += 1
        return np.clip(a, 0, CANVAS).astype(np.float32)

def _coherent(self, obs):
    """BID-style backward coherence: sample `bid` chunks, keep the one whose first actions are closest to what
    the previous chunk planned for the same steps."""
    frame = prep_frames(np.asarray(obs["pixels"]), self.cfg.size)
    agent = np.asarray(obs["agent_pos"], np.float32)
    if not self.frames:
        self.frames.extend([frame] * self.cfg.n_frames); self.agents.extend([agent] * self.cfg.n_obs)
    self.frames.append(frame); self.agents.append(agent)
    if not self.queue:
        x = frames_to_input(np.stack(self.frames)[None], self.cfg.crop).expand(self.bid, -1, -1, -1, -1)
        p = torch.from_numpy(np.stack(self.agents))[None].expand(self.bid, -1, -1)
        chunks = self.net.sample(x, p, self.generator).cpu().numpy()  # (bid, chunk, 2)
        prev = getattr(self, "prev_rest", None)
        if getattr(self, "medoid", False):  # the most central sample: the dominant mode's typical push
            d = np.linalg.norm(chunks[:, None] - chunks[None], axis=-1).mean(-1)  # (bid, bid)
            k = int(np.argmin(d.sum(1)))
        elif prev is None:
            k = 0
        else:
            n = len(prev)
            k = int(np.argmin(np.linalg.norm(chunks[:, :n] - prev[None], axis=-1).mean(1)))
        c = chunks[k]
        self.prev_rest = c[self.cfg.execute:]
        self.queue.extend(c[: self.cfg.execute])
    return np.clip(self.queue.popleft(), 0, CANVAS).astype(np.float32)

Variant.coherent = _coherent

if __name__ == "__main__":
    path, name = sys.argv[1], sys.argv[2]
    kw = json.loads(sys.argv[3])
    temp = kw.pop("temp", None)
    if temp is not None:  # scale the flow sampler's starting noise (the module, not the package's factory of that name)
        V = sys.modules["iws_gym.policies.visuomotor"]
        def sample_chunk(head, cond, cfg, generator=None, steps=None):
            steps = steps or cfg.sample_steps
            x = temp * torch.randn(len(cond), cfg.chunk * 2, generator=generator).to(cond.device)
            for i in range(steps):
                t = torch.full((len(x),), i / steps, device=x.device)
                x = x + head(x, t, cond).float() / steps
            return V.from_unit(x.clamp(-1, 1)).view(-1, cfg.chunk, 2)
        V.sample_chunk = sample_chunk
        kw["temp"] = temp
    n = int(sys.argv[4]); seed = int(sys.argv[5])
    task = load_task("tpushing")
    states = start_states(task, n, seed)
    t = time.time()
    sc, _ = run_ground_truth(task, lambda: Variant(path, **{k: v for k, v in kw.items() if k != 'temp'}), states, 300, seed)
    out = dict(policy=path, variant=kw, episodes=n, seed=seed, ground_truth=dict(**_summary(sc), scores=sc.tolist()), wall_s=time.time()-t)
    import os; os.makedirs("/tmp/pol", exist_ok=True); json.dump(out, open(f"/tmp/pol/{name}.json", "w"), indent=1)
    print(name, kw, {k: v for k, v in out["ground_truth"].items() if k != "scores"}, round(out["wall_s"]))
