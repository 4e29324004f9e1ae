"""Can a policy that replans every chunk imitate the planning expert? The expert's own answer (issue 33).

A chunked policy plans afresh every 8 steps from what it sees; so do the DAgger labels (`iws dagger`). This
runs the planning expert on the true state in three forms, from the same validation starts:

- committed: as it demonstrates (`iws collect --mix expert`): plan a push, execute all of it, plan again;
- replan8: plan afresh every 8 steps (what a DAgger label asks of the learner);
- markov: the same, with the direct approach (`reach`: from beside the contact, straight to it instead of
  backing off to the orbit first), `iws collect --mix expert_markov`.

    python scripts/expert_replanning.py --episodes 50 --json reports/expert_replanning.json
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from tqdm import tqdm

from iws_gym.envs.registry import load_task
from iws_gym.evaluation.policy_eval import start_states
from iws_gym.tasks.pusht.expert import MARKOV, PlanningPusher
from iws_gym.tasks.pusht.groundtruth import get_state, make_env

FORMS = {"committed": dict(), "replan8": dict(replan_every=MARKOV["replan_every"]), "markov": MARKOV}


def run(form: dict, states: np.ndarray, horizon: int, seed: int) -> dict:
    env = make_env(96)
    scores, steps = [], []
    t0 = time.time()
    for i, st in enumerate(tqdm(states, desc=str(form or "committed"), unit="ep")):
        env.reset(options={"reset_to_state": st})
        expert = PlanningPusher(rng=np.random.default_rng(seed + i), **form)
        best, t = 0.0, 0
        for t in range(1, horizon + 1):
            _, _, done, _, info = env.step(expert.act(get_state(env)))
            best = max(best, float(info["coverage"]))
            if done:
                break
        scores.append(best)
        steps.append(t)
    s = np.array(scores)
    ok = s > 0.95
    return dict(form=form, success_rate=float(ok.mean()), success_stderr=float(ok.std() / np.sqrt(len(s))),
                mean_max_coverage=float(s.mean()), median_steps_to_success=float(np.median(np.array(steps)[ok])) if ok.any() else None,
                scores=s.round(4).tolist(), seconds_per_episode=(time.time() - t0) / len(s))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--horizon", type=int, default=300)
    p.add_argument("--seed", type=int, default=8000, help="starts: the held-out validation starts from this seed")
    p.add_argument("--forms", default=",".join(FORMS), help="comma-separated: " + ", ".join(FORMS))
    p.add_argument("--json", default=None)
    a = p.parse_args()
    states = start_states(load_task("tpushing"), a.episodes, a.seed)
    out = dict(episodes=a.episodes, horizon=a.horizon, seed=a.seed, command="python scripts/expert_replanning.py "
               f"--episodes {a.episodes} --horizon {a.horizon} --seed {a.seed} --forms {a.forms}" +
               (f" --json {a.json}" if a.json else ""))
    for name in a.forms.split(","):
        if name not in FORMS:
            raise SystemExit(f"--forms: unknown form {name!r}; choose from {', '.join(FORMS)}")
        out[name] = run(FORMS[name], states, a.horizon, a.seed)
        print(name, {k: v for k, v in out[name].items() if k != "scores"}, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
