import json

import numpy as np
import pytest

from iws_gym.data.collect import heldout_episodes
from iws_gym.evaluation.fidelity import frame_metrics
from iws_gym.tasks.pusht.groundtruth import render_states
from iws_gym.envs.registry import load_task

from .conftest import run_iws


def test_rerender_reproduces_ground_truth():
    ep = next(heldout_episodes(load_task("tpushing"), 1, 6))
    m = frame_metrics(render_states(ep["agent_pos"], ep["block_pose"], 128), ep)
    assert np.all(m["psnr"] > 40) and np.all(m["ssim"] > 0.99)


def test_render_without_agent_changes_only_the_agent():
    from iws_gym.tasks.pusht.groundtruth import render_without_agent
    from iws_gym.tasks.pusht.pose import agent_position

    ep = next(heldout_episodes(load_task("tpushing"), 1, 6))
    frames = render_without_agent(ep["block_pose"], 128)
    assert all(agent_position(f) is None for f in frames) and all(agent_position(f) is not None for f in ep["frames"])
    changed = np.abs(frames.astype(int) - ep["frames"]).sum(-1) > 0  # (T, H, W)
    yy, xx = np.mgrid[:128, :128] * 4 + 2  # pixel centres in the 512 canvas
    d2 = (xx[None] - ep["agent_pos"][:, 0, None, None]) ** 2 + (yy[None] - ep["agent_pos"][:, 1, None, None]) ** 2
    assert changed.any() and not (changed & (d2 > 23**2)).any()  # nothing changes beyond the agent's disc


def test_corrupt_block_fades_or_ghosts_the_block_and_keeps_the_agent():
    from iws_gym.tasks.pusht.groundtruth import corrupt_block
    from iws_gym.tasks.pusht.pose import agent_position, block_fraction

    ep = next(heldout_episodes(load_task("tpushing"), 1, 12))
    fr, ap, bp = ep["frames"], ep["agent_pos"], ep["block_pose"]
    assert np.array_equal(corrupt_block(fr, ap, bp, np.random.default_rng(0), keep=(1.0, 1.0)), fr)  # w = 1: unchanged
    out = corrupt_block(fr, ap, bp, np.random.default_rng(0))
    assert out.shape == fr.shape and out.dtype == np.uint8
    drops = []
    for f, g in zip(fr, out):
        np.testing.assert_allclose(agent_position(g), agent_position(f), atol=1.0)  # the agent is where it was
        assert not np.array_equal(f, g)
        a_f, a_g = block_fraction(f)[0], block_fraction(g)[0]
        solid = a_f > 0.8  # the real block's pixels
        drops.append(a_f[solid].mean() - a_g[solid].mean())
    assert min(drops) >= 0 and np.mean(drops) > 0.1  # the real block loses contrast (faded, or partly a ghost)
    again = corrupt_block(fr, ap, bp, np.random.default_rng(0))
    assert np.array_equal(out, again)  # seeded: the training cache is reproducible
    with pytest.raises(ValueError, match="block poses"):
        corrupt_block(fr, ap, bp[:-1], np.random.default_rng(0))


def test_fidelity_report_with_baselines_and_model(tiny_stage1, tmp_path):
    out = tmp_path / "fid.json"
    run_iws("eval", "fidelity", "--checkpoint", tiny_stage1, "--horizon", 4, "--episodes", 1, "--json", out,
            "--plot", tmp_path / "fid.png", "--grid", tmp_path / "grid.png")
    r = json.loads(out.read_text())
    # the frame grid: per episode a row of true frames above a row of predicted ones, at steps 0 and 4
    import cv2

    img = cv2.imread(str(tmp_path / "grid.png"))
    assert r["grid"]["steps"] == [0, 4] and img.shape == (2 * 128, 2 * 128, 3)
    ep = next(iter(heldout_episodes(load_task("tpushing"), 1, 4)))
    assert np.array_equal(img[:128, :128, ::-1], ep["frames"][0]) and np.array_equal(img[:128, 128:, ::-1], ep["frames"][4])
    assert img[128:].std() > 0  # the model's row is a picture, not a blank
    assert set(r["summary"]) == {"copy_first_frame", "ground_truth_rerender", "model"}
    assert r["model_kind"] == "stage1_autoencoder_ceiling" and "LPIPS" in r["not_reported"]
    for name, s in r["summary"].items():
        assert {"psnr", "ssim", "mse", "agent_px_median", "block_px_median", "block_rad_median", "coverage_median"} <= set(s)
        assert len(r["per_step"][name]["psnr"]) == 5
    # the floor must beat the copy baseline on every frame metric
    gt, copy = r["summary"]["ground_truth_rerender"], r["summary"]["copy_first_frame"]
    assert gt["psnr"] > copy["psnr"] and gt["ssim"] >= copy["ssim"]
    assert (tmp_path / "fid.png").stat().st_size > 1000


def test_fidelity_unseen_behaviour_baselines_only(tmp_path):
    out = tmp_path / "f.json"
    run_iws("eval", "fidelity", "--horizon", 3, "--episodes", 1, "--behaviour", "unseen", "--json", out)
    r = json.loads(out.read_text())
    assert r["behaviour"] == "unseen" and "model" not in r["summary"]


def test_random_behaviour_sends_a_new_uniform_target_every_step():
    from iws_gym.data.collect import heldout_episodes
    from iws_gym.envs.registry import load_task

    task = load_task("tpushing")
    ep, again = (next(heldout_episodes(task, 1, 30, behaviour="random")) for _ in range(2))
    a = ep["actions"]
    assert a.shape == (30, 2) and (a >= 0).all() and (a <= 512).all()
    assert (np.linalg.norm(np.diff(a, axis=0), axis=1) > 1).all()  # never held, unlike the mix's jumpy segments
    assert a[:, 0].std() > 100 and a[:, 1].std() > 100  # spread over the whole box
    np.testing.assert_array_equal(a, again["actions"])  # held-out seeds: the same episode every time
    np.testing.assert_array_equal(ep["frames"], again["frames"])
    from iws_gym.tasks.pusht.behaviours import SEGMENT_MIX
    from iws_gym.data.collect import SEGMENT_NAMES

    # its own segment name (collected only on request, `iws collect --mix random`), never in the play mix
    assert ep["plan"] == [("random", 30)] and (ep["segments"] == SEGMENT_NAMES.index("random")).all()
    assert "random" not in [m[0] for m in SEGMENT_MIX]


def test_fidelity_bad_input(tmp_path):
    proc = run_iws("eval", "fidelity", "--horizon", 0, "--episodes", 1, check=False)
    assert proc.returncode == 2 and "--horizon" in proc.stderr
    proc = run_iws("eval", "fidelity", "--checkpoint", tmp_path / "missing", "--horizon", 2, "--episodes", 1, check=False)
    assert proc.returncode == 2 and "missing" in proc.stderr
    proc = run_iws("eval", "fidelity", "--horizon", 2, "--episodes", 1, "--grid", tmp_path / "g.png", check=False)
    assert proc.returncode == 2 and "--grid" in proc.stderr and not (tmp_path / "g.png").exists()


def test_pose_command(tmp_path):
    out = tmp_path / "pose.json"
    run_iws("eval", "pose", "--episodes", 1, "--steps", 10, "--json", out)
    r = json.loads(out.read_text())
    assert r["frames"] == 3 and r["block_px"]["median"] < 5 and "block_bias" in r


def test_scorer_validation_command(tiny_checkpoint, tmp_path):
    out = tmp_path / "scorer.json"
    run_iws("eval", "scorer", "--checkpoint", tiny_checkpoint, "--episodes", 1, "--steps", 6, "--json", out)
    r = json.loads(out.read_text())
    assert set(r["by_source"]) == {"ground_truth", "model_one_step", "model_open_loop"}
    gt = r["by_source"]["ground_truth"]
    assert gt["frames"] == 6
    # on real frames both readings are close to the true state
    assert gt["coverage_abs_error_pixels"]["median"] < 0.05 and gt["agent_pos_error_px"]["median"] < 3
    proc = run_iws("eval", "scorer", "--episodes", 0, check=False)
    assert proc.returncode == 2 and "--episodes" in proc.stderr


def test_contact_error_command(tiny_checkpoint, tiny_dataset, tmp_path):
    out = tmp_path / "contact.json"
    run_iws("eval", "contact", "--checkpoint", tiny_checkpoint, "--data", tiny_dataset, "--train-episodes", 2,
            "--heldout", 2, "--steps", 30, "--windows", 8, "--json", out)
    r = json.loads(out.read_text())
    assert set(r["by_set"]) == {"train", "heldout"}
    for s in r["by_set"].values():
        assert 0 < s["block_moving_share"] < 1
        for kind in ("all", "block_moving"):
            k = s[kind]
            assert k["copy_last_mse"] > 0 and abs(k["unexplained"] - k["model_mse"] / k["copy_last_mse"]) < 1e-9
            assert k["predicted_change_ratio"] > 0 and k["sample_variance"] >= 0
    proc = run_iws("eval", "contact", "--windows", 0, check=False)
    assert proc.returncode == 2 and "--windows" in proc.stderr
    out2 = tmp_path / "contact_euler.json"
    run_iws("eval", "contact", "--checkpoint", tiny_checkpoint, "--data", tiny_dataset, "--train-episodes", 2,
            "--heldout", 2, "--steps", 30, "--windows", 8, "--dynamics-sampler", "euler", "--dynamics-steps", 3, "--json", out2)
    r2 = json.loads(out2.read_text())
    assert (r2["dynamics_sampler"], r2["dynamics_steps"]) == ("euler", 3) and r["dynamics_sampler"] == "consistency"
    # the same windows and targets, another sampler: the copy baseline is identical, the predictions are not
    assert r2["by_set"]["train"]["all"]["copy_last_mse"] == r["by_set"]["train"]["all"]["copy_last_mse"]
    assert r2["by_set"]["train"]["all"]["model_mse"] != r["by_set"]["train"]["all"]["model_mse"]


def test_fidelity_summary_counts_where_the_object_was_found():
    from iws_gym.evaluation.fidelity import summarise

    T, nan = 64, np.nan
    arr = {k: np.ones((4, T + 1)) for k in ("mse", "psnr", "ssim", "agent_px", "block_rad", "coverage")}
    block = np.tile(np.arange(T + 1, dtype=float), (4, 1))  # error grows by 1 px a step
    block[1:, 32:] = nan                                       # 3 of 4 episodes lose the block at step 32
    arr["block_px"] = block
    per_step, s = summarise(arr, T)
    assert s["block_px_found@32"] == 1 and s["block_px_found@64"] == 1 and s["agent_px_found@32"] == 4
    assert s["block_px_median@32"] == 32.0  # the one episode that still has it
    assert s["block_px@32_per_episode"] == [32.0, None, None, None]  # which episodes lost it
    assert s["block_px_median_counting_lost@32"] is None and s["agent_px_median_counting_lost@32"] == 1.0
    arr["block_px"][1, 32] = 5.0  # 2 of 4 found at step 32: the median counting the lost ones is inf
    assert summarise(arr, T)[1]["block_px_median_counting_lost@32"] is None
    arr["block_px"][2, 32] = 7.0  # 3 of 4 found (5, 7, 32) and one lost: median of (5, 7, 32, inf) = 19.5
    assert summarise(arr, T)[1]["block_px_median_counting_lost@32"] == 19.5
    assert s["block_px_missing_frac"] == pytest.approx(3 * 33 / (4 * T))
    assert per_step["block_px_found"][31] == 1.0 and per_step["block_px_found"][32] == 0.25
    assert "block_px_median@192" not in s  # beyond the horizon
    arr["block_px"][:] = nan
    _, s = summarise(arr, T)
    assert np.isnan(s["block_px_median"]) and s["block_px_found@32"] == 0 and s["block_px_missing_frac"] == 1.0


def test_fidelity_summary_has_per_episode_values_and_a_bootstrap_interval():
    from iws_gym.evaluation.fidelity import bootstrap_ci, summarise

    T = 8
    arr = {k: np.ones((4, T + 1)) for k in ("mse", "psnr", "ssim", "agent_px", "block_px", "block_rad", "coverage")}
    arr["psnr"] = np.array([[99.0] + [p] * T for p in (20.0, 24.0, 28.0, 32.0)])  # step 0 is not a prediction
    _, s = summarise(arr, T)
    assert s["psnr_per_episode"] == [20.0, 24.0, 28.0, 32.0] and s["psnr"] == 26.0
    lo, hi = s["psnr_ci95"]
    assert 20.0 <= lo < 26.0 < hi <= 32.0
    assert bootstrap_ci([20.0, 24.0, 28.0, 32.0]) == s["psnr_ci95"]  # seeded: reproducible
    assert bootstrap_ci([27.5]) == [27.5, 27.5]
    narrow = bootstrap_ci(np.full(16, 26.0) + np.linspace(-0.1, 0.1, 16))
    assert narrow[1] - narrow[0] < hi - lo  # less spread between episodes, a tighter interval
    with pytest.raises(ValueError, match="NaN"):
        bootstrap_ci([1.0, np.nan])


def _fake_report(psnr, seeds=(1000000, 1000003)):
    s = dict(psnr_per_episode=list(psnr), ssim_per_episode=[0.9] * len(psnr))
    return dict(task="tpushing", horizon=192, behaviour="mix", heldout_seeds=list(seeds), checkpoint="x",
                summary=dict(model=s))


def test_compare_pairs_episodes():
    from iws_gym.evaluation.fidelity import compare_fidelity

    a = _fake_report([20.0, 30.0, 25.0, 35.0])  # a wide spread between episodes ...
    b = _fake_report([20.5, 30.5, 25.5, 35.0])  # ... and b a little ahead on three of them
    m = compare_fidelity(a, b)["metrics"]["psnr"]
    assert m["diff_b_minus_a"] == pytest.approx(0.375) and m["b_ahead_share"] == 0.75
    lo, hi = m["diff_ci95"]
    assert 0 <= lo <= 0.375 <= hi <= 0.5  # paired: the interval of the difference is far tighter ...
    assert m["b_ci95"][1] - m["b_ci95"][0] > 5  # ... than either mean's
    assert compare_fidelity(b, a)["metrics"]["psnr"]["diff_b_minus_a"] == pytest.approx(-0.375)
    a["summary"]["model"]["block_px@32_per_episode"] = [2.0, 9.0, None, 4.0]  # None: the block was lost
    b["summary"]["model"]["block_px@32_per_episode"] = [1.0, 3.0, 5.0, 4.0]
    m = compare_fidelity(a, b)["metrics"]["block_px@32"]
    assert (m["b_closer"], m["b_farther"], m["a_lost"], m["b_lost"]) == (3, 0, 1, 0) and m["lower_is_better"]
    assert m["a_median"] == 6.5 and m["b_median"] == 3.5 and m["sign_test_p"] == 0.25  # 3 of 3: 2 / 2**3
    with pytest.raises(ValueError, match="heldout_seeds"):
        compare_fidelity(a, _fake_report([1.0] * 4, seeds=(1008000, 1008003)))
    old = _fake_report([1.0] * 4)
    del old["summary"]["model"]["psnr_per_episode"]
    with pytest.raises(ValueError, match="per-episode"):
        compare_fidelity(old, a)
    with pytest.raises(ValueError, match="predictor 'model'"):
        compare_fidelity(dict(summary={}), a)


@pytest.mark.slow
def test_compare_command(tmp_path):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "cmp.json"
    run_iws("eval", "fidelity", "--horizon", 3, "--episodes", 2, "--json", a)
    run_iws("eval", "fidelity", "--horizon", 3, "--episodes", 2, "--split", "validation", "--json", b)
    run_iws("eval", "compare", a, a, "--predictor", "copy_first_frame", "--json", out)
    r = json.loads(out.read_text())
    m = r["metrics"]["psnr"]
    assert r["episodes"] == 2 and m["diff_b_minus_a"] == 0.0 and m["diff_ci95"] == [0.0, 0.0] and m["a"] > 15
    proc = run_iws("eval", "compare", a, b, "--predictor", "copy_first_frame", check=False)
    assert proc.returncode == 2 and "heldout_seeds" in proc.stderr
    proc = run_iws("eval", "compare", a, a, check=False)  # baselines only: no model in these reports
    assert proc.returncode == 2 and "'model'" in proc.stderr
    proc = run_iws("eval", "compare", a, tmp_path / "nope.json", check=False)
    assert proc.returncode == 2 and "nope.json" in proc.stderr


def test_motion_grid_is_the_identity_at_rest_and_moves_the_t_with_its_pose():
    from iws_gym.evaluation.transport import motion_grid

    block, agent = np.array([256.0, 256.0, 0.3]), np.array([100.0, 400.0])
    g, uncovered = motion_grid(32, block, block, agent, agent)
    centres = (np.arange(32) + 0.5) / 32 * 2 - 1
    np.testing.assert_allclose(g[..., 0].numpy(), np.broadcast_to(centres, (32, 32)), atol=1e-6)
    assert not uncovered.any()
    # the T moved one cell (16 canvas px) to the right: its cells at t+1 read one cell to the left
    moved = block + np.array([16.0, 0.0, 0.0])
    g, uncovered = motion_grid(32, block, moved, agent, agent)
    shift = (g[..., 0].numpy() - np.broadcast_to(centres, (32, 32))) * 32 / 2  # in cells
    assert np.isclose(shift, -1.0, atol=1e-5).sum() > 20 and np.isin(np.round(shift, 5), [0.0, -1.0]).all()
    assert uncovered.any()  # the strip the T left behind


def test_transport_command_reports_latent_and_pixel_transport(tiny_stage1, tmp_path):
    out = tmp_path / "transport.json"
    run_iws("eval", "transport", "--checkpoint", tiny_stage1, "--episodes", 1, "--steps", 10, "--check-every", 5,
            "--json", out, "--grid", tmp_path / "t.png")
    rep = json.loads(out.read_text())
    assert rep["latent_shape"] == [8, 16, 16] and (tmp_path / "t.png").is_file()
    assert rep["pixels"]["checks"] == rep["latent"]["checks"] == 2
    assert rep["pixels"]["whole"] == 1.0  # ten steps of true motion on the frame's own pixels keep the T whole
    assert 0.0 <= rep["latent"]["whole"] <= 1.0
