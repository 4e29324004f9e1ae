"""Eval-time variants of a visuomotor policy release in gym-pusht (issue 33; a scratch tool kept at a git tag):
how many actions of a chunk to execute, ACT-style temporal ensembling, and one noise draw per episode.

    python scripts/policy_variants.py POLICY NAME '{"execute": 4}' EPISODES SEED   # -> /tmp/pol/NAME.json
    # variants: {"execute": k}, {"execute": k, "ensemble": m} (a chunk every k steps, overlapping chunks
    # averaged with weights exp(-m i), oldest first), {"execute": k, "fixed": true} (the same noise every call)
"""
import json, sys, time
from collections import deque
import numpy as np, torch
from iws_gym.policies.visuomotor import VisuomotorPolicy, prep_frames, frames_to_input, CANVAS
from iws_gym.evaluation.policy_eval import start_states, run_ground_truth, _summary
from iws_gym.envs.registry import load_task

class Variant(VisuomotorPolicy):
    def __init__(self, path, execute=8, ensemble=0.0, steps=None, fixed=False):
        self.fixed = fixed
        super().__init__(path)
        self.cfg.execute = execute
        self.ens, self.steps = ensemble, steps
    def reset(self, seed=None):
        super().reset(seed)
        self.seed0 = 0 if seed is None else int(seed)
        self.chunks = []  # (t0, chunk)
        self.t = 0
    def __call__(self, obs):
        if self.fixed and (self.ens > 0 or not self.queue):  # the same noise draw at every call of the episode
            self.generator = torch.Generator().manual_seed(self.seed0)
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

if __name__ == "__main__":
    path, name = sys.argv[1], sys.argv[2]
    kw = json.loads(sys.argv[3])
    n = int(sys.argv[4]); seed = int(sys.argv[5])
    task = load_task("tpushing")
    states = start_states(task, n, seed)
    t = time.time()
    sc, _ = run_ground_truth(task, lambda: Variant(path, **kw), states, 300, seed)
    out = dict(policy=path, variant=kw, episodes=n, seed=seed, ground_truth=dict(**_summary(sc), scores=sc.tolist()), wall_s=time.time()-t)
    import os; os.makedirs("/tmp/pol", exist_ok=True); json.dump(out, open(f"/tmp/pol/{name}.json", "w"), indent=1)
    print(name, kw, {k: v for k, v in out["ground_truth"].items() if k != "scores"}, round(out["wall_s"]))
