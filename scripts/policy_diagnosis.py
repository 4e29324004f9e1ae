"""Why does the visuomotor policy not finish its pushes? Three measurements that separate seeing from acting
(issue 33; results in docs/experiments.md, "Imitating the planning expert").

1. `pose`: how well a small CNN reads the block's pose from a 96x96 frame (the visuomotor policy's input),
   trained by regression on the demonstrations' recorded poses, measured on validation demonstrations.
2. `train-state` + `eval`: the same chunked flow-matching head as the visuomotor policy, given the block's
   pose instead of pixels (at acting time the hand-written pose reader's, tasks/pusht/pose.py): the score of
   the imitation recipe if vision were perfect.
3. `dagger` (+ `train-state --labels`): a DAgger round for that head: the learner acts, and at each chunk
   start the planning expert, planning afresh from the true state, labels what it would do.

    python scripts/policy_diagnosis.py pose --steps 2000 --json reports/policy_diagnosis_pose.json
    python scripts/policy_diagnosis.py train-state --out runs/diag/state.pt
    python scripts/policy_diagnosis.py eval --head runs/diag/state.pt --json reports/policy_diagnosis_state.json
    python scripts/policy_diagnosis.py dagger --head runs/diag/state.pt --seed 230000 --out runs/diag/dagger_a.npz
    python scripts/policy_diagnosis.py train-state --labels runs/diag/dagger_a.npz,... --out runs/diag/state_dagger.pt

A scratch tool of an experiment, not part of the package: it reuses the package's pieces and writes JSON.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from iws_gym.data.episodes import list_episodes, read_episode
from iws_gym.policies.visuomotor import FlowHead, ResBlock, VisuomotorConfig, from_unit, prep_frames, to_unit

CHUNK, EXECUTE, N_OBS = 16, 8, 2
HEAD = VisuomotorConfig(hidden=256)  # the `small` preset's flow head


def state_cond(agent_hist: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """(B, N_OBS, 2) agent positions and (B, 3) block poses (px, rad) -> the head's condition (B, 2 N_OBS + 4)."""
    return torch.cat([to_unit(agent_hist).flatten(1), to_unit(block[:, :2]), torch.cos(block[:, 2:]), torch.sin(block[:, 2:])], 1)


def sample_chunk(head, cond, gen, temperature=1.0, steps=10):
    x = temperature * torch.randn(len(cond), CHUNK * 2, generator=gen)
    with torch.no_grad():
        for i in range(steps):
            x = x + head(x, torch.full((len(x),), i / steps), cond).float() / steps
    return from_unit(x.clamp(-1, 1)).view(-1, CHUNK, 2)


def load_demos(root):
    eps = [read_episode(p, keys=("actions", "agent_pos", "block_pose")) for p in list_episodes(Path(root))]
    lens = np.array([len(e["actions"]) for e in eps])
    ag = np.concatenate([e["agent_pos"][:n] for e, n in zip(eps, lens)]).astype(np.float32)
    bk = np.concatenate([e["block_pose"][:n] for e, n in zip(eps, lens)]).astype(np.float32)
    ac = np.concatenate([e["actions"] for e in eps]).astype(np.float32)
    ends = np.repeat(np.cumsum(lens), lens)
    return ag, bk, ac, ends, ends - np.repeat(lens, lens)


def train_state(a):
    torch.manual_seed(a.seed)
    ag, bk, ac, ends, starts = load_demos(a.data)
    labels = [np.load(f) for f in a.labels.split(",")] if a.labels else []
    if labels:
        XP, XB, XA = (np.concatenate([x[k] for x in labels]) for k in ("P", "B", "A"))
    print(f"{len(ac)} demonstration steps, {sum(len(x['A']) for x in labels)} DAgger labels", flush=True)

    def batch(rng, n):
        k = int(n * a.label_share) if labels else 0
        g = rng.integers(0, len(ac), n - k)
        P = ag[np.maximum(g[:, None] - np.arange(N_OBS - 1, -1, -1), starts[g][:, None])]
        A = ac[np.minimum(g[:, None] + np.arange(CHUNK), ends[g][:, None] - 1)]
        B = bk[g]
        if k:
            h = rng.integers(0, len(XA), k)
            P, B, A = np.concatenate([P, XP[h]]), np.concatenate([B, XB[h]]), np.concatenate([A, XA[h]])
        return state_cond(torch.from_numpy(P), torch.from_numpy(B)), to_unit(torch.from_numpy(A)).flatten(1)

    head = FlowHead(HEAD, 2 * N_OBS + 4)
    ema = copy.deepcopy(head)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 1e-3, total_steps=a.steps, pct_start=0.05)
    rng, t0 = np.random.default_rng(a.seed), time.time()
    for s in range(a.steps):
        c, x1 = batch(rng, a.batch)
        t, eps = torch.rand(len(x1)), torch.randn_like(x1)
        loss = F.mse_loss(head(t[:, None] * x1 + (1 - t[:, None]) * eps, t, c), x1 - eps)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), head.parameters()):
                pe.lerp_(p, 1 - 0.999)
        if s % 1000 == 0:
            print(f"step {s} flow mse {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(state_dict=ema.state_dict(), args={k: v for k, v in vars(a).items() if k != "func"}, wall_s=time.time() - t0), a.out)


def load_head(path):
    """-> (the head, the `train-state` arguments it was trained with)."""
    saved = torch.load(path)
    head = FlowHead(HEAD, 2 * N_OBS + 4)
    head.load_state_dict(saved["state_dict"])
    return head.eval(), saved["args"]


def act_chunk(head, agents, block, gen, temperature=1.0) -> np.ndarray:
    """The EXECUTE targets the head samples for one state: the last N_OBS agent positions, the block's pose."""
    c = state_cond(torch.tensor(np.stack(agents), dtype=torch.float32)[None], torch.tensor(block, dtype=torch.float32)[None])
    return sample_chunk(head, c, gen, temperature)[0, :EXECUTE].numpy()


class StatePolicy:
    """The head acting on gym-pusht's observations, the block's pose read from the frame (pose.py)."""

    def __init__(self, head, temperature):
        self.head, self.temperature = head, temperature

    def reset(self, seed):
        self.gen, self.agents, self.queue, self.block = torch.Generator().manual_seed(seed), deque(maxlen=N_OBS), deque(), None

    def __call__(self, obs):
        from iws_gym.policies.scripted import read_state

        agent, self.block = read_state(obs, self.block)
        if not self.agents:
            self.agents.extend([agent] * N_OBS)
        self.agents.append(agent)
        if not self.queue:
            if self.block is None:
                return agent.astype(np.float32)
            self.queue.extend(act_chunk(self.head, self.agents, self.block, self.gen, self.temperature))
        return self.queue.popleft().astype(np.float32)


def evaluate(a):
    from iws_gym.envs.registry import load_task
    from iws_gym.evaluation.policy_eval import _summary, run_ground_truth, start_states

    (head, head_args), task = load_head(a.head), load_task("tpushing")
    states = start_states(task, a.episodes, 0)
    scores, spe = run_ground_truth(task, lambda: StatePolicy(head, a.temperature), states, a.horizon, 0)
    out = dict(command="python scripts/policy_diagnosis.py eval " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
                                                                        if k not in ("cmd", "func")),
               head=a.head, head_args=head_args, temperature=a.temperature, horizon=a.horizon,
               max_coverage_quantiles={q: float(np.quantile(scores, q)) for q in (0.25, 0.5, 0.75, 0.9)},
               share_above={t: float((scores > t).mean()) for t in (0.8, 0.9, 0.95)},
               **_summary(scores), seconds_per_episode=spe, scores=scores.tolist())
    print(json.dumps({k: v for k, v in out.items() if k != "scores"}, indent=1))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))


def dagger(a):
    from iws_gym.tasks.pusht.expert import PlanningPusher
    from iws_gym.tasks.pusht.groundtruth import get_state, make_env

    (head, _), env = load_head(a.head), make_env(128)
    P, B, A, scores, t0 = [], [], [], [], time.time()
    for i in range(a.episodes):
        seed = a.seed + i
        env.reset(seed=seed)
        rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
        expert, agents, queue, best = PlanningPusher(rng=rng), deque(maxlen=N_OBS), [], 0.0
        for _ in range(a.horizon):
            s = get_state(env)
            if not agents:
                agents.extend([s[:2]] * N_OBS)
            agents.append(s[:2])
            if not queue:  # the expert labels this state with the start of a fresh plan
                expert.plan, expert.plan_vel = [], np.array(env.agent.velocity)
                label = [expert.act(s)] + list(expert.plan[:CHUNK - 1])
                label += [label[-1]] * (CHUNK - len(label))
                P.append(np.stack(agents))
                B.append(s[2:5])
                A.append(np.stack(label))
                if rng.random() < a.beta:  # now and then the expert's chunk is executed, to reach later states
                    queue = list(np.asarray(label[:EXECUTE]))
                else:
                    queue = list(act_chunk(head, agents, s[2:5], gen))
            _, _, term, _, info = env.step(np.asarray(queue.pop(0), np.float32))
            best = max(best, info["coverage"])
            if term:
                break
        scores.append(best)
        print(f"episode {i} seed {seed} max coverage {best:.3f} labels {len(A)} {time.time() - t0:.0f}s", flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        np.savez(a.out, P=np.array(P, np.float32), B=np.array(B, np.float32), A=np.array(A, np.float32), scores=np.array(scores))


def summarize(a):
    from iws_gym.evaluation.policy_eval import _summary

    d = np.load(a.labels)
    s = d["scores"]
    out = dict(command=f"python scripts/policy_diagnosis.py summarize --labels {a.labels} --json {a.json}", labels=int(len(d["A"])),
               **_summary(s), share_above_0_9=float((s > 0.9).mean()), scores=s.tolist())
    print(json.dumps({k: v for k, v in out.items() if k != "scores"}))
    Path(a.json).write_text(json.dumps(out, indent=1))


class PoseCNN(nn.Module):
    """96x96 frame -> the block's (x, y, cos, sin): a patch stem and residual blocks, read out by an MLP."""

    def __init__(self, c=32):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, c, 4, stride=4), ResBlock(c), ResBlock(c),
                                 nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), ResBlock(2 * c), ResBlock(2 * c),
                                 nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1), ResBlock(2 * c), nn.GroupNorm(8, 2 * c), nn.SiLU(),
                                 nn.Flatten(), nn.Linear(2 * c * 36, 256), nn.SiLU(), nn.Linear(256, 4))

    def forward(self, x):
        return self.net(x).float()


def pose(a):
    from iws_gym.models.hardware import default_dtype

    def load(root):
        eps = [read_episode(p, keys=("frames", "block_pose")) for p in list_episodes(Path(root))]
        return np.concatenate([prep_frames(e["frames"], 96) for e in eps]), np.concatenate([e["block_pose"] for e in eps]).astype(np.float32)

    def inp(f):
        return (torch.from_numpy(f).permute(0, 3, 1, 2).float() / 127.5 - 1).contiguous(memory_format=torch.channels_last)

    torch.manual_seed(a.seed)
    dtype = default_dtype("cpu")
    ftr, btr = load(a.data)
    fva, bva = load(a.val_data)
    net = PoseCNN().to(memory_format=torch.channels_last)
    ema = copy.deepcopy(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 1e-3, total_steps=a.steps, pct_start=0.05)

    def errors(m):
        xy, ang = [], []
        with torch.no_grad(), torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
            for i in range(0, len(fva), 256):
                p, b = m(inp(fva[i:i + 256])), torch.from_numpy(bva[i:i + 256])
                xy.append((from_unit(p[:, :2]) - b[:, :2]).norm(dim=1))
                ang.append((torch.remainder(torch.atan2(p[:, 3], p[:, 2]) - b[:, 2] + np.pi, 2 * np.pi) - np.pi).abs())
        xy, ang = torch.cat(xy), torch.cat(ang)
        return dict(px_median=xy.median().item(), px_p90=xy.quantile(0.9).item(), rad_median=ang.median().item(), rad_p90=ang.quantile(0.9).item())

    rng, t0, curve = np.random.default_rng(a.seed), time.time(), {}
    for s in range(1, a.steps + 1):
        g = rng.integers(0, len(ftr), a.batch)
        b = torch.from_numpy(btr[g])
        target = torch.cat([to_unit(b[:, :2]), torch.cos(b[:, 2:]), torch.sin(b[:, 2:])], 1)
        with torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
            loss = F.mse_loss(net(inp(ftr[g])), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), net.parameters()):
                pe.lerp_(p, 1 - 0.995)
        if s % 500 == 0 or s == a.steps:
            curve[s] = errors(ema)
            print(f"step {s} {time.time() - t0:.0f}s", curve[s], flush=True)
    out = dict(command=f"python scripts/policy_diagnosis.py pose --data {a.data} --val-data {a.val_data} --steps {a.steps} --batch {a.batch}",
               train_frames=len(ftr), val_frames=len(fva), frame_size=96, params=sum(p.numel() for p in net.parameters()),
               precision=str(dtype), wall_s=time.time() - t0, val_errors_by_step=curve)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train-state", help="the chunked flow head on (agent positions, block pose)")
    t.add_argument("--data", default="data/expert")
    t.add_argument("--labels", default="", help="DAgger label files (.npz from `dagger`), comma-separated")
    t.add_argument("--label-share", type=float, default=0.5, help="share of each batch drawn from the labels")
    t.add_argument("--steps", type=int, default=20000)
    t.add_argument("--batch", type=int, default=256)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", required=True)
    t.set_defaults(func=train_state)
    e = sub.add_parser("eval", help="the head in gym-pusht on the test starts, the block read from the frame")
    e.add_argument("--head", required=True)
    e.add_argument("--episodes", type=int, default=30)
    e.add_argument("--horizon", type=int, default=300)
    e.add_argument("--temperature", type=float, default=1.0, help="scale of the sampler's initial noise")
    e.add_argument("--json", required=True)
    e.set_defaults(func=evaluate)
    d = sub.add_parser("dagger", help="learner rollouts labelled by the planning expert (training seeds)")
    d.add_argument("--head", required=True)
    d.add_argument("--seed", type=int, default=230000)
    d.add_argument("--episodes", type=int, default=60)
    d.add_argument("--horizon", type=int, default=300)
    d.add_argument("--beta", type=float, default=0.3, help="probability that a chunk is the expert's, not the learner's")
    d.add_argument("--out", required=True)
    d.set_defaults(func=dagger)
    m = sub.add_parser("summarize", help="the scores of a DAgger round's episodes (learner and expert mixed) as JSON")
    m.add_argument("--labels", required=True)
    m.add_argument("--json", required=True)
    m.set_defaults(func=summarize)
    q = sub.add_parser("pose", help="a small CNN reading the block pose from 96x96 frames")
    q.add_argument("--data", default="data/expert")
    q.add_argument("--val-data", default="data/expert_val")
    q.add_argument("--steps", type=int, default=2000)
    q.add_argument("--batch", type=int, default=64)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--json", required=True)
    q.set_defaults(func=pose)
    a = p.parse_args()
    torch.set_num_threads(1)
    a.func(a)


if __name__ == "__main__":
    main()
