import shutil

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import iws_gym  # noqa: F401  (registers IWS-TPushing-v0)
from iws_gym.tasks.pusht.scorer import TPushCoverageScorer
from iws_gym.tasks.scoring import ProbabilityScorer


@pytest.fixture
def env(tiny_checkpoint):
    e = gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu")
    yield e
    e.close()


def test_check_env_passes(tiny_checkpoint):
    e = gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu")
    check_env(e.unwrapped, skip_render_check=True)


def test_spaces_and_step_contract(env):
    assert env.action_space == gym.spaces.Box(0, 512, (2,), np.float32)
    obs, info = env.reset(seed=0)
    assert obs["pixels"].shape == (128, 128, 3) and obs["pixels"].dtype == np.uint8
    assert obs["agent_pos"].shape == (2,) and obs["agent_pos"].dtype == np.float64
    assert "coverage" in info and info["is_success"] is False
    obs, r, term, trunc, info = env.step(np.array([100.0, 200.0], np.float32))
    assert 0 <= r <= 1 and isinstance(term, bool) and trunc is False and {"coverage", "is_success"} <= set(info)
    assert env.spec.max_episode_steps == 300 and env.metadata["render_fps"] == 10


def test_same_seed_same_observations(env):
    acts = np.random.default_rng(0).uniform(0, 512, (4, 2)).astype(np.float32)

    def run():
        o, _ = env.reset(seed=123)
        out = [o["pixels"]]
        for a in acts:
            out.append(env.step(a)[0]["pixels"])
        return np.stack(out)
    np.testing.assert_array_equal(run(), run())


@pytest.mark.parametrize("bad,msg", [
    (np.zeros(3), "shape"), (np.array([np.nan, 1.0]), "finite"), (np.array([np.inf, 1.0]), "finite"),
    ("left", "numeric|shape"), (np.zeros((1, 2)), "shape"),
])
def test_bad_actions_raise_and_env_stays_usable(env, bad, msg):
    env.reset(seed=0)
    with pytest.raises(ValueError, match=msg):
        env.step(bad)
    env.step(np.array([256.0, 256.0]))  # still fine


def test_out_of_range_actions_are_clipped(env):
    env.reset(seed=0)
    from iws_gym.envs.env import check_action

    np.testing.assert_array_equal(check_action([-50, 900]), np.array([0, 512], np.float32))
    env.step(np.array([-50.0, 900.0]))


def test_reset_options(env):
    frame = np.full((96, 96, 3), 255, np.uint8)
    obs, _ = env.reset(options={"initial_frame": frame, "agent_pos": [10.0, 20.0], "unknown": 1})
    assert obs["pixels"].shape == (128, 128, 3) and np.allclose(obs["agent_pos"], [10, 20])
    obs, _ = env.reset(options={"reset_to_state": [100, 100, 300, 300, 0.5]})
    assert np.allclose(obs["agent_pos"], [100, 100])
    with pytest.raises(ValueError, match="uint8"):
        env.reset(options={"initial_frame": np.zeros((64, 64, 3), np.float32)})
    with pytest.raises(ValueError, match="reset_to_state"):
        env.reset(options={"reset_to_state": [1, 2, 3]})
    env.reset(seed=1)  # still usable


def test_pixels_obs_type_and_resize(tiny_checkpoint):
    e = gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu", obs_type="pixels",
                 observation_width=96, observation_height=96, render_mode="rgb_array")
    obs, _ = e.reset(seed=0)
    assert obs.shape == (96, 96, 3) and e.render().shape == (128, 128, 3)


def test_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        gym.make("IWS-TPushing-v0", checkpoint=tmp_path / "nope", device="cpu")


def test_custom_scorer_protocol(tiny_checkpoint):
    calls = []

    def prob(frames):
        calls.append(frames.shape)
        return np.full(len(frames), 0.9)
    e = gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu", scorer=ProbabilityScorer(prob, 0.5))
    e.reset(seed=0)
    _, r, term, _, info = e.step(np.array([1.0, 2.0]))
    assert r == pytest.approx(0.9) and term is True and info["success_prob"] == pytest.approx(0.9)
    assert calls[-1] == (1, 128, 128, 3)


def test_pixel_coverage_scorer_on_ground_truth():
    from iws_gym.data.collect import heldout_episodes
    from iws_gym.envs.registry import load_task

    s = TPushCoverageScorer()
    errs = []
    for ep in heldout_episodes(load_task("tpushing"), 2, 30):
        errs += [abs(s.coverage(f) - c) for f, c in zip(ep["frames"], ep["coverage"])]
    assert np.median(errs) < 0.03


def test_pixel_coverage_scorer_reads_the_top_of_the_range():
    # scripted play rarely nears the goal; here the block lies on it or near it, where success is decided
    from iws_gym.tasks.pusht import scorer as S
    from iws_gym.tasks.pusht.groundtruth import GOAL_POSE, render_states

    frames, cov = S.calibration_frames(200, seed=5)
    s = TPushCoverageScorer()
    err = np.array([s.coverage(f) for f in frames]) - cov
    top = cov > 0.9
    assert top.sum() >= 10 and abs(err[top].mean()) < 0.03 and np.median(np.abs(err)) < 0.02
    assert ((np.array([s.coverage(f) for f in frames]) > 0.95) == (cov > 0.95)).mean() >= 0.9
    on_goal = render_states(np.array([[100.0, 100.0]]), np.array([GOAL_POSE], float))[0]
    assert s.coverage(on_goal) > 0.95 and s([on_goal])[0].is_success  # a block on the goal is a success
    fill_w, outline_w = S.fit_weights(*S.calibration_frames(200, seed=3))  # the constants are what a refit finds
    assert fill_w == pytest.approx(S.FILL_W, abs=0.05) and outline_w == pytest.approx(S.OUTLINE_W, abs=0.08)


def test_demo_command(tiny_checkpoint, tmp_path):
    import json

    from .conftest import run_iws

    out = tmp_path / "demo.json"
    run_iws("demo", "--checkpoint", tiny_checkpoint, "--episodes", 2, "--steps", 3, "--video", tmp_path / "d.mp4",
            "--device", "cpu", "--json", out)
    r = json.loads(out.read_text())
    assert len(r["episodes"]) == 2 and r["env_steps"] <= 6 and (tmp_path / "d.mp4").stat().st_size > 0
    # the same pusher from the same starts in gym-pusht: what a faithful world would score
    assert all(0 <= e["gym_pusht_max_coverage"] <= 1 for e in r["episodes"])
    assert r["gap"] == round(r["mean_max_coverage"] - r["gym_pusht_mean_max_coverage"], 4)


def test_frame_pusher_runs_in_the_ground_truth_unchanged():
    from iws_gym.tasks.pusht.groundtruth import make_env
    from iws_gym.policies.scripted import FramePusher

    env, pol = make_env(128), FramePusher()
    obs, info = env.reset(seed=3)
    start = info["block_pose"].copy()
    for _ in range(60):
        obs, r, term, trunc, info = env.step(pol(obs))
    assert np.linalg.norm(info["block_pose"][:2] - start[:2]) > 1 or info["coverage"] > 0  # it reached and moved the block


def test_action_chunk_equals_single_steps(env):
    acts = np.random.default_rng(1).uniform(0, 512, (5, 2)).astype(np.float32)
    env.reset(seed=5)
    singles = [env.step(a) for a in acts]
    env.reset(seed=5)
    obs, rewards, term, trunc, info = env.unwrapped.step_chunk(acts)
    assert info["chunk_steps"] == 5 and rewards.shape == (5,)
    np.testing.assert_array_equal(obs["pixels"], singles[-1][0]["pixels"])
    np.testing.assert_allclose(rewards, [s[1] for s in singles])
    with pytest.raises(ValueError, match="chunk"):
        env.unwrapped.step_chunk(np.zeros(2))
    with pytest.raises(ValueError, match="row 1"):
        env.unwrapped.step_chunk(np.array([[1.0, 2.0], [np.nan, 0.0]]))
    env.step(acts[0])  # still usable


def test_standard_wrappers(tiny_checkpoint, tmp_path):
    from gymnasium.wrappers import RecordEpisodeStatistics, RecordVideo

    e = gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu", render_mode="rgb_array",
                 max_episode_steps=4)
    e = RecordEpisodeStatistics(RecordVideo(e, str(tmp_path / "videos"), episode_trigger=lambda i: True,
                                            disable_logger=True))
    e.reset(seed=0)
    trunc = term = False
    n = 0
    while not (trunc or term):
        _, _, term, trunc, info = e.step(e.action_space.sample())
        n += 1
    assert n == 4 and trunc  # TimeLimit from max_episode_steps
    assert info["episode"]["l"] == 4 and "r" in info["episode"]
    e.close()
    assert list((tmp_path / "videos").glob("*.mp4"))


def test_make_with_module_prefix_without_import(tiny_checkpoint):
    import subprocess
    import sys

    code = ("import gymnasium as gym; "
            f"e = gym.make('iws_gym:IWS-TPushing-v0', checkpoint={str(tiny_checkpoint)!r}, device='cpu'); "
            "print(e.spec.max_episode_steps, e.action_space.shape, sorted(e.observation_space.spaces))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.split()[0] == "300" and "agent_pos" in out and "pixels" in out


def test_reencode_is_an_env_option(tiny_checkpoint):
    import gymnasium as gym

    env = gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu", reencode=False)
    assert env.unwrapped.wm.settings.reencode is False
    env.reset(seed=0)
    obs, *_ = env.step(np.array([256.0, 256.0], np.float32))
    assert obs["pixels"].shape == (128, 128, 3)
    assert gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu").unwrapped.wm.settings.reencode is True
    from iws_gym.models.world_model import RolloutSettings

    default = gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu").unwrapped.wm.settings
    assert default == RolloutSettings() and default.reencode_every == 1
    vec = gym.make_vec("IWS-TPushing-v0", num_envs=2, checkpoint=tiny_checkpoint, device="cpu", reencode_every=3)
    assert vec.wm.settings.reencode_every == 3
    vec.reset(seed=0)
    vec.step(np.full((2, 2), 256.0, np.float32))
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="reencode_every"):
            gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu", reencode_every=bad)


def test_a_release_carries_its_rollout_defaults(tiny_checkpoint, tmp_path):
    """`iws release --set reencode_every=K` on a spatial release: the env, the world model and the evaluations
    run with K unless told otherwise; the weights are unchanged; a bad value is named and nothing is written."""
    import json

    import torch

    from iws_gym.envs.registry import load_task
    from iws_gym.evaluation.stability import stability
    from iws_gym.models.world_model import WorldModel, release_settings
    from iws_gym.training.release import release

    rel = tmp_path / "rel"
    shutil.copytree(tiny_checkpoint, rel)
    release(tiny_checkpoint.parent / "stage2_run", "stage2", rel, [])
    release(rel, "stage2", rel, [], settings={"reencode_every": 3})
    prov = json.loads((rel / "provenance.json").read_text())["stage2"]
    assert prov["rollout"] == {"reencode_every": 3}
    assert prov["config_set"][-1]["changes"] == {"rollout.reencode_every": [1, 3]}
    assert release_settings(rel).reencode_every == 3 and release_settings(tiny_checkpoint).reencode_every == 1
    assert release_settings(rel, reencode_every=2).reencode_every == 2
    assert WorldModel.from_pretrained(rel, device="cpu", stages=("stage1", "stage2")).settings.reencode_every == 3
    assert gym.make("IWS-TPushing-v0", checkpoint=rel, device="cpu").unwrapped.wm.settings.reencode_every == 3
    assert gym.make("IWS-TPushing-v0", checkpoint=rel, device="cpu", reencode_every=1).unwrapped.wm.settings.reencode_every == 1
    r = stability(load_task("tpushing"), str(rel), steps=4, check_every=2, kinds=("hold",), device="cpu",
                  calib_episodes=1, calib_steps=5)
    assert r["reencode_every"] == 3
    a = WorldModel.from_pretrained(tiny_checkpoint, device="cpu", stages=("stage1", "stage2"))
    b = WorldModel.from_pretrained(rel, device="cpu", stages=("stage1", "stage2"))
    assert all(torch.equal(p, q) for p, q in zip(a.stage2.state_dict().values(), b.stage2.state_dict().values()))
    before = (rel / "stage2.safetensors").read_bytes()
    for bad, named in (({"reencode_every": 0}, "reencode_every"), ({"reencode": "maybe"}, "reencode"),
                       ({"width": 8}, "width")):
        with pytest.raises(ValueError, match=named):
            release(rel, "stage2", rel, [], settings=bad)
    assert (rel / "stage2.safetensors").read_bytes() == before


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="torch.compile on a CPU needs a C++ compiler")
@pytest.mark.slow
def test_compiled_env_matches_the_eager_one(tiny_checkpoint):
    """gym.make(..., compile=True) compiles the dynamics network; the agent position and the frames it
    produces agree with the eager env's up to bf16 rounding (a pixel or two of the frame)."""
    eager = gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu").unwrapped
    fast = gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu", compile=True).unwrapped
    assert hasattr(fast.wm.stage2.net, "_orig_mod") and not hasattr(eager.wm.stage2.net, "_orig_mod")
    o1, _ = eager.reset(seed=3)
    o2, _ = fast.reset(seed=3)
    actions = np.random.default_rng(0).uniform(0, 512, (4, 2)).astype(np.float32)
    for a in actions:
        o1, *_ = eager.step(a)
        o2, *_ = fast.step(a)
        diff = np.abs(o1["pixels"].astype(int) - o2["pixels"].astype(int))
        assert np.mean(diff > 8) < 0.01
