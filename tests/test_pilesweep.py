"""Pile sweeping's ground truth (issue 35): physics, determinism, the state round trip, the pixel scorer
against the true state, and the scripted sweeper."""
import gymnasium as gym
import numpy as np
import pytest

from iws_gym.tasks.pilesweep.behaviours import SEGMENT_MIX, Sweeper, sample_episode_plan
from iws_gym.tasks.pilesweep.groundtruth import (GOAL_BOX, N_PIECES, PIECE_RADIUS, PileSweepEnv, coverage_of, inside_goal,
                                                 make_env, render_state, sample_pile)
from iws_gym.tasks.pilesweep.scorer import PIECE_MASS_128, PileCoverageScorer, calibrate_piece_mass, goal_mask


def _drive(env, seed, steps, behaviour=None):
    obs, info = env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    b = behaviour or Sweeper(rng, noise=5.0)
    out = [(obs, info)]
    for _ in range(steps):
        obs, r, term, trunc, info = env.step(b.act(env.get_state()))
        out.append((obs, info))
    return out


def test_env_checker_and_spaces():
    from gymnasium.utils.env_checker import check_env

    for obs_type in ("pixels_agent_pos", "pixels", "state"):
        env = PileSweepEnv(obs_type=obs_type)
        check_env(env, skip_render_check=True)
    env = make_env()
    obs, info = env.reset(seed=0)
    assert obs["pixels"].shape == (128, 128, 3) and obs["pixels"].dtype == np.uint8
    assert obs["agent_pos"].shape == (2,) and len(info["pieces"]) == N_PIECES
    assert env.render().shape == (680, 680, 3)


def test_registered_ground_truth():
    import iws_gym  # noqa: F401  (registers the ids)

    env = gym.make("iws_gym/PileSweepPymunk-v0")
    assert env.spec.max_episode_steps == 400
    obs, _ = env.reset(seed=1)
    assert obs.shape == (2 + 2 * N_PIECES,)


def test_pieces_are_conserved_and_stay_on_the_table():
    env, closest = make_env(), []
    for seed in range(3):
        for _, info in _drive(env, seed, 60, Sweeper(np.random.default_rng(seed), noise=40.0)):
            p = info["pieces"]
            assert len(p) == N_PIECES and np.isfinite(p).all()
            assert (p > 5).all() and (p < 507).all()  # inside the walls
            closest.append((np.linalg.norm(p[:, None] - p[None], axis=-1) + np.eye(len(p)) * 1e3).min())
    # they push each other and never pass through; squeezed hard between the agent and a wall, they overlap
    # a little for a step (pymunk's soft contacts)
    assert min(closest) > PIECE_RADIUS and np.percentile(closest, 5) > 2 * PIECE_RADIUS - 3


def test_deterministic_under_a_seed_and_reset_to_state():
    env_a, env_b = make_env(), make_env()
    a, b = _drive(env_a, 5, 30), _drive(env_b, 5, 30)
    for (oa, ia), (ob, ib) in zip(a, b):
        np.testing.assert_array_equal(oa["pixels"], ob["pixels"])
        np.testing.assert_array_equal(ia["pieces"], ib["pieces"])
    # reset_to_state puts an env exactly at a state (positions; velocities start at rest, as gym-pusht's), and
    # two envs reset to the same state go on identically
    state = env_a.get_state()
    for env in (env_a, env_b):
        obs, _ = env.reset(options={"reset_to_state": state})
        np.testing.assert_array_equal(env.get_state(), state)
        np.testing.assert_array_equal(obs["pixels"], render_state(state))
    rng = np.random.default_rng(0)
    for _ in range(10):
        act = rng.uniform(0, 512, 2)
        env_a.step(act)
        env_b.step(act)
    np.testing.assert_array_equal(env_a.get_state(), env_b.get_state())


def test_bad_input_is_named():
    env = make_env()
    env.reset(seed=0)
    with pytest.raises(ValueError, match="reset_to_state"):
        env.reset(options={"reset_to_state": np.zeros(5)})
    with pytest.raises(ValueError, match="action"):
        env.step(np.array([np.nan, 3.0]))
    with pytest.raises(ValueError, match="obs_type"):
        PileSweepEnv(obs_type="voxels")


def test_coverage_and_success():
    x0, y0, x1, y1 = GOAL_BOX
    inside = np.array([[x0 + 20, y0 + 20]] * 4 + [[20.0, 20.0]])
    assert coverage_of(inside) == pytest.approx(0.8)
    assert inside_goal([[x0 - 1, y0 + 5], [x1, y1]]).tolist() == [False, True]
    env = make_env(n_pieces=4)
    state = np.array([40.0, 40.0, x0 + 30, y0 + 30, x0 + 70, y0 + 30, x0 + 30, y0 + 70, x0 + 70, y0 + 70])
    env.reset(options={"reset_to_state": state})
    _, reward, terminated, _, info = env.step(np.array([40.0, 40.0]))
    assert info["coverage"] == 1.0 and info["is_success"] and terminated and reward == 1.0


def test_random_starts_are_piles_outside_the_goal():
    rng = np.random.default_rng(0)
    covs = []
    for _ in range(20):
        p = sample_pile(rng, N_PIECES, agent=np.array([256.0, 256.0]))
        d = np.linalg.norm(p[:, None] - p[None], axis=-1) + np.eye(len(p)) * 1e3
        assert d.min() >= 2 * PIECE_RADIUS and (p >= 45).all() and (p <= 512 - 45).all()
        covs.append(coverage_of(p))
    assert np.mean(covs) < 0.25


def test_pixel_scorer_reads_the_true_state():
    """Coverage and piece count read from gym frames against the true state, over sweeping episodes."""
    env, scorer = make_env(), PileCoverageScorer()
    errs, counts = [], []
    for seed in range(3):
        for obs, info in _drive(env, 100 + seed, 80)[::4]:
            s = scorer([obs["pixels"]])[0]
            errs.append(s.info["coverage"] - info["coverage"])
            counts.append(s.info["pieces"])
    assert np.median(np.abs(errs)) < 0.02 and np.max(np.abs(errs)) < 0.06
    assert np.all(np.abs(np.array(counts) - N_PIECES) <= 0.05 * N_PIECES)
    # the piece's mass constant, re-measured at other places
    assert calibrate_piece_mass(60, seed=7) == pytest.approx(PIECE_MASS_128, rel=0.02)
    assert goal_mask(128).sum() == pytest.approx(48 * 48)
    with pytest.raises(ValueError, match="frame of shape"):
        scorer.read(np.zeros((96, 96, 3), np.uint8))


def test_sweeper_sweeps_and_play_mixes():
    env = make_env()
    final = []
    for seed in range(3):
        final.append(max(i["coverage"] for _, i in _drive(env, 200 + seed, 150, Sweeper(np.random.default_rng(seed)))))
    assert np.mean(final) > 0.5  # from under 0.25 at the start
    rng = np.random.default_rng(1)
    names = set()
    for _ in range(30):
        plan = sample_episode_plan(rng, 200)
        assert sum(n for _, _, n in plan) == 200
        names |= {name for name, _, _ in plan}
    assert names == {m[0] for m in SEGMENT_MIX}


def test_collect_pile_sweeping_through_the_cli(tmp_path):
    """`iws collect --task pilesweeping`: the same command and format as T pushing, with the pieces recorded."""
    from iws_gym.data.episodes import DatasetError, list_episodes, read_episode
    from tests.conftest import run_iws

    out = tmp_path / "ps"
    run_iws("collect", "--task", "pilesweeping", "--episodes", 2, "--steps", 12, "--out", out, "--seed", 3)
    eps = list_episodes(out)
    assert len(eps) == 2
    ep = read_episode(eps[1])
    assert ep["frames"].shape == (13, 128, 128, 3) and ep["pieces"].shape == (13, N_PIECES, 2)
    assert ep["attrs"]["task"] == "pilesweeping" and ep["attrs"]["seed"] == 4
    np.testing.assert_allclose(ep["coverage"], [coverage_of(p) for p in ep["pieces"]], atol=1e-6)
    with pytest.raises(DatasetError, match="no array 'block_pose'"):
        read_episode(eps[0], keys=("frames", "block_pose"))
    bad = run_iws("collect", "--task", "pilesweeping", "--episodes", 1, "--mix", "jittery", "--out", tmp_path / "j", check=False)
    assert bad.returncode != 0 and "for pilesweeping" in bad.stderr and not (tmp_path / "j").exists()


@pytest.fixture(scope="module")
def tiny_pile_release(tmp_path_factory):
    """The one recipe, unchanged, on pile sweeping at toy scale: collection, both compact stages, the release."""
    from tests.conftest import run_iws

    out = tmp_path_factory.mktemp("pile") / "recipe"
    run_iws("train", "recipe", "--task", "pilesweeping", "--out", out, "--design", "compact", "--scale", "tiny",
            "--episodes", 3, "--episode-steps", 16, "--stage1-steps", 4, "--stage2-steps", 4, "--eval-every", 4)
    return out / "release"


def test_learned_pile_sweeping_env(tiny_pile_release):
    """gym.make("IWS-PileSweeping-v0") and its vector env run a release the recipe made with no model change;
    reset_to_state takes the pile's state vector and names it when wrong."""
    import json

    from gymnasium.utils.env_checker import check_env

    import iws_gym  # noqa: F401

    recipe = json.loads((tiny_pile_release.parent / "recipe.json").read_text())
    assert "collect_jittery" not in recipe["steps"] and recipe["steps"]["compact2"]["finished"]
    env = gym.make("IWS-PileSweeping-v0", checkpoint=tiny_pile_release, device="cpu")
    assert env.spec.max_episode_steps == 400
    check_env(env.unwrapped, skip_render_check=True)
    gt = make_env()
    gt.reset(seed=9)
    state = gt.get_state()
    obs, _ = env.reset(options={"reset_to_state": state})
    np.testing.assert_allclose(obs["agent_pos"], state[:2])
    obs, reward, terminated, truncated, info = env.step(np.array([100.0, 100.0]))
    assert 0.0 <= info["coverage"] <= 1.0 and "pieces" in info and reward == pytest.approx(min(1.0, info["coverage"] / 0.9))
    with pytest.raises(ValueError, match=f"must be {2 + 2 * N_PIECES} finite numbers"):
        env.reset(options={"reset_to_state": np.zeros(5)})
    vec = gym.make_vec("IWS-PileSweeping-v0", num_envs=2, vectorization_mode="vector_entry_point",
                       checkpoint=tiny_pile_release, device="cpu")
    vec.reset(seed=1)
    obs, reward, *_ = vec.step(np.array([[100.0, 100.0], [300.0, 300.0]]))
    assert obs["pixels"].shape == (2, 128, 128, 3) and reward.shape == (2,)


def test_shipped_pile_weights_make_the_env():
    """The shipped weights (checkpoints/pilesweeping): gym.make("IWS-PileSweeping-v0") with no checkpoint given
    passes the env checker, starts from the ground truth's own render of a held-out pile, and a step draws a
    frame whose piece count is read near the pile's (a pushed puck may fade later: docs/results.md). The release
    re-encodes every 4th step by default (its rollout metadata)."""
    from gymnasium.utils.env_checker import check_env

    import iws_gym  # noqa: F401

    env = gym.make("IWS-PileSweeping-v0", device="cpu")
    assert env.unwrapped.wm.settings.reencode and env.unwrapped.wm.settings.reencode_every == 4
    check_env(env.unwrapped, skip_render_check=True)
    gt = make_env()
    gt.reset(seed=1_000_001)  # a held-out pile
    state = gt.get_state()
    obs, _ = env.reset(options={"reset_to_state": state})
    assert np.array_equal(obs["pixels"], render_state(state))
    obs, reward, terminated, truncated, info = env.step(obs["agent_pos"])
    assert obs["pixels"].shape == (128, 128, 3) and abs(info["pieces"] - N_PIECES) <= 0.05 * N_PIECES


def test_fidelity_reads_the_pile(tiny_pile_release, tmp_path):
    """`iws eval fidelity --task pilesweeping`: the piece count and in-region share read from each frame against
    the truth; on real frames drawn again the count is whole and the share error small."""
    import json

    from tests.conftest import run_iws

    out = tmp_path / "fid.json"
    run_iws("eval", "fidelity", "--task", "pilesweeping", "--checkpoint", tiny_pile_release, "--horizon", 8,
            "--episodes", 2, "--json", out)
    r = json.loads(out.read_text())
    floor, model = r["summary"]["ground_truth_rerender"], r["summary"]["model"]
    assert floor["pieces_whole_share"] == 1.0 and floor["pieces_err_median"] < 0.02 and floor["coverage_median"] < 0.02
    for k in ("pieces_err_median", "coverage_median", "pieces_whole_share", "pieces_whole_share_by_decile", "psnr_ci95"):
        assert k in model
    assert r["whole"]["tol"] == 0.05 and "block_px_median" not in model
    # stage 1 alone (iws eval recon): the same readings of reconstructions against the truth
    out = tmp_path / "recon.json"
    run_iws("eval", "recon", "--task", "pilesweeping", "--checkpoint", tiny_pile_release, "--frames", 32, "--steps", 1,
            "--json", out)
    by = json.loads(out.read_text())["by_steps"]["1"]
    assert {"psnr", "pieces_err_median_vs_truth", "coverage_median_vs_truth", "pieces_whole_share"} <= set(by)


def test_policy_suite_is_graded_and_correlate_runs(tiny_pile_release, tmp_path):
    """The pile suite's policies see only frames and agent_pos; in the ground truth the sweeper beats doing
    nothing; `iws eval correlate --task pilesweeping` runs the whole suite in both worlds."""
    import json

    from iws_gym.envs.registry import load_task
    from iws_gym.evaluation.policy_eval import run_ground_truth, start_states
    from iws_gym.policies.sweepers import pile_points, suite
    from tests.conftest import run_iws

    task = load_task("pilesweeping")
    states = start_states(task, 2, seed=0)
    assert states.shape == (2, 2 + 2 * N_PIECES)
    from iws_gym.evaluation.policy_eval import _summary

    assert _summary(np.array([0.9, 0.5]), task)["success_rate"] == 0.5  # the pile's success: a share >= 0.9
    idle, _ = run_ground_truth(task, suite()["idle"], states, 80, seed=0)
    sweep, _ = run_ground_truth(task, suite()["sweeper"], states, 80, seed=0)
    assert sweep.mean() > idle.mean() + 0.1
    # the sweeper's eyes: every orange pixel of a frame, in canvas coordinates, near some true piece
    env = make_env()
    obs, info = env.reset(seed=4)
    pts = pile_points(obs["pixels"])
    assert len(pts) > 5 * N_PIECES
    assert np.linalg.norm(pts[:, None] - info["pieces"][None], axis=-1).min(axis=1).max() < PIECE_RADIUS + 4
    out = tmp_path / "corr.json"
    run_iws("eval", "correlate", "--task", "pilesweeping", "--checkpoint", tiny_pile_release, "--episodes", 2,
            "--horizon", 4, "--workers", 1, "--json", out)
    r = json.loads(out.read_text())
    assert list(r["per_policy"]) == list(suite()) and r["env_id"] == "IWS-PileSweeping-v0"


def test_stability_checks_the_pile(tiny_pile_release, tmp_path):
    """`iws eval stability --task pilesweeping`: the pile's own checks (agent, puck count, colours) calibrated on
    real frames, which they accept; the whole-pile share and the still world's drift reported."""
    import json

    from iws_gym.evaluation.stability import calibrate, failures
    from iws_gym.tasks.pilesweep import checks
    from tests.conftest import run_iws

    env = make_env()
    frames = [o["pixels"] for o, _ in _drive(env, 31, 40)]
    envelope = calibrate(np.stack(frames[::2]), checks=checks)
    assert all(not failures(checks.frame_stats(f), envelope, checks) for f in frames[1::2])
    whole = checks.calibrate_whole(np.stack(frames))
    assert whole["count"] == N_PIECES and all(checks.is_whole(f, whole) for f in frames)
    from iws_gym.tasks.pilesweep.scorer import piece_mass

    broken = frames[0].copy()
    ys, xs = np.nonzero(piece_mass(broken) > 0)
    keep = xs < np.median(xs)  # the pucks of one half of the pile erased
    broken[ys[~keep], xs[~keep]] = 255
    assert not checks.is_whole(broken, whole)
    out = tmp_path / "stab.json"
    run_iws("eval", "stability", "--task", "pilesweeping", "--checkpoint", tiny_pile_release, "--steps", 10,
            "--check-every", 5, "--actions", "random", "hold", "--calib-episodes", 1, "--calib-steps", 10,
            "--ground-truth", "--json", out)
    r = json.loads(out.read_text())
    assert r["pieces_whole"]["count"] == N_PIECES and "pieces_whole_share" in r["rollouts"]["random"]
    g = r["rollouts"]["random"]["ground_truth"]  # the drive replayed in the pile's ground truth
    assert g["real_whole_share"] == 1.0 and {"pieces_err_median", "coverage_median_by_tenth"} <= set(g)
    assert "coverage_drift_max" in r["rollouts"]["hold"]["still_world"]


def test_a_smeared_pile_is_not_whole():
    """Blur keeps the ink, so the count alone passes a smear; the sharpness of the ink does not."""
    import cv2

    from iws_gym.tasks.pilesweep import checks
    from iws_gym.tasks.pilesweep.scorer import SHARP_MIN, ink_sharpness
    from iws_gym.tasks.pilesweep.task import readings

    env = make_env()
    frames, pieces, cover = [], [], []
    for seed in range(3):
        for obs, info in _drive(env, 50 + seed, 60)[::10]:
            frames.append(obs["pixels"])
            pieces.append(info["pieces"])
            cover.append(info["coverage"])
    frames = np.stack(frames)
    blurred = np.stack([cv2.GaussianBlur(f, (0, 0), 1.0) for f in frames])
    sharp, smear = [ink_sharpness(f) for f in frames], [ink_sharpness(f) for f in blurred]
    assert 0.8 <= min(sharp) and max(sharp) <= 0.95 and max(smear) < 0.5 < SHARP_MIN
    ep = {"pieces": np.stack(pieces), "coverage": np.array(cover)}
    assert readings(frames, ep)["pieces_whole"].all() and not readings(blurred, ep)["pieces_whole"].any()
    assert np.abs(readings(blurred, ep)["pieces_err"]).max() < 0.05  # the count alone would have passed them
    whole = checks.calibrate_whole(frames)
    assert all(checks.is_whole(f, whole) for f in frames) and not any(checks.is_whole(f, whole) for f in blurred)


def test_spatial_recipe_runs_on_piles(tmp_path):
    """The spatial design's recipe takes its stage-2 options from the task: no window chosen or re-rendered by a
    T's pose, which a pile has not."""
    import json

    from tests.conftest import run_iws

    out = tmp_path / "spatial"
    run_iws("train", "recipe", "--task", "pilesweeping", "--out", out, "--scale", "tiny", "--episodes", 3,
            "--episode-steps", 16, "--stage1-steps", 4, "--stage2-steps", 4, "--eval-every", 2)
    cmd = json.loads((out / "recipe.json").read_text())["steps"]["stage2"]["command"]
    assert "--agent-track" in cmd and "--focus" not in cmd and "--corrupt-block" not in cmd
    assert (out / "release" / "stage2.safetensors").is_file()
