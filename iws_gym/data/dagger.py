"""DAgger labels: the planning expert's corrections on the states a learner reaches (Ross et al. 2011).

A pose-bottleneck visuomotor policy acts in gym-pusht from training seeds. At every chunk start the
planning expert plans afresh from the true state, and the first `chunk` targets of that plan label the
state (the agent's last positions, the block's true pose). With probability `beta` the expert's chunk is
executed instead of the learner's, so that episodes also reach the later states of a push. The labels
are state-only: `iws train-policy --preset pose --labels FILE` trains the policy's action head on them.

    iws dagger --policy runs/vm_pose/visuomotor.safetensors --episodes 50 --seed 230000 --out runs/dagger/r1.npz
"""
from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import numpy as np


def collect_labels(policy_path: str, episodes: int, seed: int, out: str, horizon: int = 300, beta: float = 0.3,
                   task_name: str = "tpushing", expert: str = "planning") -> dict:
    """Run the learner from seeds seed .. seed + episodes - 1, label each chunk start, write `out` (.npz)
    after every episode (an interrupted run keeps what it labelled). Returns a summary."""
    import torch
    from tqdm import tqdm

    from iws_gym.envs.registry import load_task
    from iws_gym.policies.visuomotor import VisuomotorPolicy
    from iws_gym.tasks.pusht.expert import MARKOV, PlanningPusher
    from iws_gym.tasks.pusht.groundtruth import get_state, make_env

    task = load_task(task_name)
    if seed < 0 or seed + episodes > task.heldout_seed_base:
        raise ValueError(f"--seed: DAgger runs on training seeds, below the held-out base {task.heldout_seed_base}; "
                         f"got {seed} .. {seed + episodes - 1}")
    if expert not in ("planning", "markov"):
        raise ValueError(f"--expert must be planning or markov, got {expert!r}")
    reach = MARKOV["reach"] if expert == "markov" else 0.0  # every chunk start is a fresh plan either way
    if not 0 <= beta <= 1:
        raise ValueError(f"--beta must be in [0, 1], got {beta}")
    policy = VisuomotorPolicy(policy_path)
    cfg = policy.cfg
    if cfg.bottleneck != "pose":
        raise ValueError(f"--policy {policy_path}: DAgger labels are states, for a pose-bottleneck policy (--preset pose); "
                         f"this one has bottleneck {cfg.bottleneck!r}")
    torch.set_grad_enabled(False)
    env = make_env(task.frame_size)
    P, B, A, scores, expert_share = [], [], [], [], []
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    meta = dict(policy=str(policy_path), seed=seed, episodes=episodes, horizon=horizon, beta=beta, task=task.name,
                expert=expert, command=f"iws dagger --policy {policy_path} --episodes {episodes} --seed {seed} "
                                       f"--horizon {horizon} --beta {beta} --expert {expert} --out {out}")
    for i in (bar := tqdm(range(episodes), desc="dagger", unit="ep")):
        obs, _ = env.reset(seed=seed + i)
        rng = np.random.default_rng(seed + i)
        teacher = PlanningPusher(rng=rng, reach=reach)
        policy.reset(seed + i)
        agents: deque = deque(maxlen=cfg.n_obs)
        best, chunks, expert_chunks = 0.0, 0, 0
        for _ in range(horizon):
            agent = np.asarray(obs["agent_pos"], np.float32)
            agents.extend([agent] * (cfg.n_obs if not agents else 1))
            if not policy.queue:  # a chunk start: the expert labels this state with the start of a fresh plan
                s = get_state(env)
                teacher.plan, teacher.plan_vel = [], np.array(env.agent.velocity)
                label = [teacher.act(s)] + list(teacher.plan[: cfg.chunk - 1])
                label += [label[-1]] * (cfg.chunk - len(label))
                P.append(np.stack(agents))
                B.append(s[2:5])
                A.append(np.stack(label))
                chunks += 1
                if rng.random() < beta:  # now and then the expert's chunk is executed, to reach later states
                    policy.queue.extend(np.asarray(label[: cfg.execute], np.float32))
                    expert_chunks += 1
            obs, _, term, _, info = env.step(policy(obs))
            best = max(best, float(info["coverage"]))
            if term:
                break
        scores.append(best)
        expert_share.append(expert_chunks / max(chunks, 1))
        bar.set_postfix(labels=len(A), max_cov=f"{best:.2f}")
        np.savez(out, P=np.array(P, np.float32), B=np.array(B, np.float32), A=np.array(A, np.float32),
                 scores=np.array(scores), meta=json.dumps(meta))
    s = np.array(scores)
    return dict(meta, labels=len(A), mean_max_coverage=float(s.mean()), success_rate=float((s > 0.95).mean()),
                expert_chunk_share=float(np.mean(expert_share)))
