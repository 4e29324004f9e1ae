import json

import numpy as np

from .conftest import run_iws


def chunked_policy():
    """A factory returning a chunked policy (k=3 actions per call)."""
    class P:
        calls = 0

        def __call__(self, obs):
            P.calls += 1
            return np.tile(np.asarray(obs["agent_pos"], np.float32), (3, 1))
    return P()


chunked_policy.is_factory = True


def test_eval_policy_both_worlds(tiny_checkpoint, tmp_path):
    out = tmp_path / "p.json"
    run_iws("eval", "policy", "--policy", "iws_gym.policies:IdlePolicy", "--episodes", 2, "--horizon", 3,
            "--ground-truth", "--checkpoint", tiny_checkpoint, "--device", "cpu", "--json", out)
    r = json.loads(out.read_text())
    assert r["learned"]["episodes"] == 2 and len(r["ground_truth"]["scores"]) == 2
    assert 0 <= r["gap"]["mean_abs"] <= 1 and r["ground_truth"]["seconds_per_episode"] > 0


def test_eval_policy_action_chunks_and_bad_spec(tiny_checkpoint, tmp_path):
    out = tmp_path / "c.json"
    run_iws("eval", "policy", "--policy", "tests.test_policy_eval:chunked_policy", "--episodes", 1, "--horizon", 4,
            "--checkpoint", tiny_checkpoint, "--device", "cpu", "--json", out)
    assert json.loads(out.read_text())["learned"]["episodes"] == 1
    bad = run_iws("eval", "policy", "--policy", "no_such_module:x", "--episodes", 1, "--horizon", 2, check=False)
    assert bad.returncode == 2 and "cannot load policy" in bad.stderr


def test_start_states_are_identical_in_both_worlds():
    from iws_gym.groundtruth import make_env, render_state
    from iws_gym.policy_eval import start_states
    from iws_gym.tasks import load_task

    st = start_states(load_task("tpushing"), 2, 0)
    env = make_env()
    for s in st:
        a, _ = env.reset(options={"reset_to_state": s})
        np.testing.assert_array_equal(a["pixels"], render_state(s))
