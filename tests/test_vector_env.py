import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import iws_gym  # noqa: F401
from iws_gym.tasks.scoring import ProbabilityScorer


def make(ck, n=3, **kw):
    return gym.make_vec("IWS-TPushing-v0", num_envs=n, checkpoint=ck, device="cpu", **kw)


def test_make_vec_is_native_and_batched(tiny_checkpoint):
    from iws_gym.envs.vector_env import WorldSimVectorEnv

    envs = make(tiny_checkpoint)
    assert isinstance(envs.unwrapped, WorldSimVectorEnv) and envs.num_envs == 3
    obs, info = envs.reset(seed=0)
    assert obs["pixels"].shape == (3, 128, 128, 3) and obs["agent_pos"].shape == (3, 2)
    calls = []
    orig = envs.unwrapped.wm.advance
    envs.unwrapped.wm.advance = lambda *a, **k: calls.append(1) or orig(*a, **k)
    obs, r, term, trunc, info = envs.step(envs.action_space.sample())
    assert len(calls) == 1 and r.shape == (3,) and term.dtype == bool and info["coverage"].shape == (3,)
    assert envs.single_action_space == gym.spaces.Box(0, 512, (2,), np.float32)
    assert envs.get_attr("max_episode_steps") == (300, 300, 300)
    with pytest.raises(ValueError, match=r"\(3, 2\)"):
        envs.step(np.zeros((2, 2)))
    envs.step(np.zeros((3, 2)))  # still usable


def test_same_seed_same_observations(tiny_checkpoint):
    a = np.random.default_rng(1).uniform(0, 512, (3, 2, 2)).astype(np.float32)

    def run():
        envs = make(tiny_checkpoint, n=2)
        out = [envs.reset(seed=5)[0]["pixels"]]
        out += [envs.step(x)[0]["pixels"] for x in a]
        return np.stack(out)
    np.testing.assert_array_equal(run(), run())


def _always_success(frames):
    return np.ones(len(frames))


def test_next_step_autoreset(tiny_checkpoint):
    envs = make(tiny_checkpoint, n=2, scorer=ProbabilityScorer(_always_success))
    envs.reset(seed=0)
    _, r, term, _, _ = envs.step(np.full((2, 2), 100.0))
    assert term.all()
    obs, r, term, trunc, info = envs.step(np.full((2, 2), 100.0))  # the reset step
    assert (r == 0).all() and not term.any() and not trunc.any()


def test_same_step_autoreset_with_final_obs(tiny_checkpoint):
    envs = make(tiny_checkpoint, n=2, scorer=ProbabilityScorer(_always_success), autoreset_mode=AutoresetMode.SAME_STEP)
    assert envs.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
    envs.reset(seed=0)
    obs, r, term, trunc, info = envs.step(np.full((2, 2), 100.0))
    assert term.all() and info["_final_obs"].all() and info["final_obs"][0]["pixels"].shape == (128, 128, 3)
    assert info["final_info"]["is_success"].all()


def test_truncation_by_time_limit(tiny_checkpoint):
    envs = make(tiny_checkpoint, n=2, max_episode_steps=2, scorer=ProbabilityScorer(lambda f: np.zeros(len(f))))
    envs.reset(seed=0)
    assert not envs.step(np.zeros((2, 2)))[3].any()
    assert envs.step(np.zeros((2, 2)))[3].all()
