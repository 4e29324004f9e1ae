import json

import numpy as np
import pytest

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
            "--ground-truth", "--checkpoint", tiny_checkpoint, "--device", "cpu", "--json", out,
            "--video", tmp_path / "p.mp4", "--video-episodes", 2)
    r = json.loads(out.read_text())
    assert r["learned"]["episodes"] == 2 and len(r["ground_truth"]["scores"]) == 2
    assert 0 <= r["gap"]["mean_abs"] <= 1 and r["ground_truth"]["seconds_per_episode"] > 0
    import cv2

    cap = cv2.VideoCapture(str(tmp_path / "p.mp4"))
    n, w, h = (int(cap.get(k)) for k in (cv2.CAP_PROP_FRAME_COUNT, cv2.CAP_PROP_FRAME_WIDTH, cv2.CAP_PROP_FRAME_HEIGHT))
    assert (n, w, h) == (4, 2 * 2 * 128, 2 * 2 * 128)  # reset + 3 steps; 2 episodes wide, gym-pusht above learned; x2
    assert r["video"]["episodes"] == 2 and not (tmp_path / "p.tmp.mp4").exists()


def test_episode_video_frames_tiles_ground_truth_above_learned():
    from iws_gym.evaluation.policy_eval import episode_video_frames

    learned = [np.full((2, 4, 4, 3), t, np.uint8) for t in range(3)]  # 3 steps of 2 episodes
    gt = [np.full((2, 4, 4, 3), 100 + e, np.uint8) for e in range(2)]  # episodes that ended after 1 step
    out = episode_video_frames(learned, gt)
    assert len(out) == 3 and out[0].shape == (8, 8, 3)
    assert (out[2][:4, :4] == 100).all() and (out[2][:4, 4:] == 101).all() and (out[2][4:] == 2).all()
    assert episode_video_frames(learned)[1].shape == (4, 8, 3)


def test_eval_policy_action_chunks_and_bad_spec(tiny_checkpoint, tmp_path):
    out = tmp_path / "c.json"
    run_iws("eval", "policy", "--policy", "tests.test_policy_eval:chunked_policy", "--episodes", 1, "--horizon", 4,
            "--ground-truth", "--checkpoint", tiny_checkpoint, "--device", "cpu", "--json", out)
    r = json.loads(out.read_text())
    assert r["learned"]["episodes"] == 1 and r["gap"]["stderr"] is None and r["gap"]["significant"] is False
    bad = run_iws("eval", "policy", "--policy", "no_such_module:x", "--episodes", 1, "--horizon", 2, check=False)
    assert bad.returncode == 2 and "cannot load policy" in bad.stderr


def test_start_states_are_identical_in_both_worlds():
    from iws_gym.tasks.pusht.groundtruth import make_env, render_state
    from iws_gym.evaluation.policy_eval import start_states
    from iws_gym.envs.registry import load_task

    st = start_states(load_task("tpushing"), 2, 0)
    env = make_env()
    for s in st:
        a, _ = env.reset(options={"reset_to_state": s})
        np.testing.assert_array_equal(a["pixels"], render_state(s))


def test_start_states_reproduce_gym_pushts_seeded_resets():
    """A recorded start, fed back through reset_to_state, is the seeded reset itself (gym-pusht turns the
    block about its centre of gravity after placing it, which a naive record of the pose gets wrong)."""
    from iws_gym.data.splits import SPLITS
    from iws_gym.evaluation.policy_eval import start_states
    from iws_gym.envs.registry import load_task
    from iws_gym.tasks.pusht.groundtruth import make_env

    task = load_task("tpushing")
    env = make_env()
    for i, s in enumerate(start_states(task, 5, 0)):
        seeded, _ = env.reset(seed=task.heldout_seed_base + SPLITS["test"] + i)
        pose = (*env.agent.position, *env.block.position, env.block.angle)
        restored, _ = env.reset(options={"reset_to_state": s})
        np.testing.assert_allclose((*env.agent.position, *env.block.position, env.block.angle), pose, atol=1e-6)
        np.testing.assert_array_equal(restored["pixels"], seeded["pixels"])


def test_ground_truth_frames_read_by_the_pixel_scorer_track_true_coverage():
    from iws_gym.policies.scripted import FramePusher
    from iws_gym.evaluation.policy_eval import run_ground_truth, start_states
    from iws_gym.envs.registry import load_task

    task = load_task("tpushing")
    st = start_states(task, 3, 0)
    px: list = []
    true, _ = run_ground_truth(task, lambda: FramePusher(), st, 8, 0, pixel_scores=px)
    assert len(px) == 3 and np.all(np.abs(np.array(px) - true) < 0.05)
    again, _ = run_ground_truth(task, lambda: FramePusher(), st, 8, 0)  # the extra reading changes nothing
    np.testing.assert_array_equal(again, true)


def test_rank_statistics():
    from iws_gym.evaluation.policy_eval import pearson, spearman

    x = np.array([0.1, 0.2, 0.5, 0.9])
    assert abs(pearson(x, 2 * x + 1) - 1) < 1e-12 and abs(spearman(x, x ** 3) - 1) < 1e-12
    assert abs(spearman(x, -x) + 1) < 1e-12
    assert np.isnan(pearson(x, np.ones(4)))


def test_paired_gap_uses_the_per_start_differences():
    from iws_gym.evaluation.policy_eval import paired_gap

    gt = np.array([0.0, 0.2, 0.5, 0.9, 0.3, 0.1])
    # a constant offset is significant however much the starts differ from each other
    g = paired_gap(gt + 0.05, gt)
    assert abs(g["mean"] - 0.05) < 1e-12 and g["stderr"] < 1e-12 and g["significant"]
    # one lucky episode: the mean gap is positive but within two standard errors
    g = paired_gap(gt + np.array([0.3, 0, 0, 0, 0, 0]), gt)
    assert abs(g["mean"] - 0.05) < 1e-12 and abs(g["stderr"] - 0.05) < 1e-12 and not g["significant"]
    with pytest.raises(ValueError, match="equal-length"):
        paired_gap(gt[:3], gt)
    g = paired_gap([0.5], [0.2])  # one episode: a gap, but nothing to judge it by
    assert abs(g["mean"] - 0.3) < 1e-12 and g["stderr"] is None and not g["significant"]


def test_suite_bootstrap_resamples_starts_for_all_policies_at_once():
    from iws_gym.evaluation.policy_eval import suite_bootstrap

    rng = np.random.default_rng(0)
    gt = rng.random((6, 12)) * np.linspace(0.1, 1.0, 6)[:, None]  # six policies of graded quality
    b = suite_bootstrap(gt + 0.02, gt, n=200)  # a world that adds 0.02 to every episode
    assert b["pearson_r"] == pytest.approx([1.0, 1.0, 1.0]) and b["share_spearman_ge_0_9"] == 1.0
    assert b["mean_abs_gap"] == pytest.approx([0.02] * 3) and b["share_mean_abs_gap_le_0_05"] == 1.0
    # per-episode noise in the learned world: the figures spread, and the same seed gives the same spread
    noisy = gt + rng.normal(0, 0.3, gt.shape)
    b1, b2 = suite_bootstrap(noisy, gt, n=200, seed=1), suite_bootstrap(noisy, gt, n=200, seed=1)
    assert b1 == b2 and b1["pearson_r"][0] < b1["pearson_r"][1] < b1["pearson_r"][2] <= 1.0
    assert 0.0 < b1["share_pearson_ge_0_95"] < 1.0 or b1["pearson_r"][2] < 0.95
    with pytest.raises(ValueError, match="policies, episodes"):
        suite_bootstrap(gt[:, :5], gt)


def test_split_half_measures_the_ground_truths_own_agreement():
    from iws_gym.evaluation.policy_eval import split_half

    rng = np.random.default_rng(0)
    gt = np.linspace(0.05, 0.5, 6)[:, None] + rng.normal(0, 0.05, (6, 16))  # graded policies, noisy episodes
    same = split_half(gt, gt, n=200)  # an evaluator that is the ground truth itself sits at the ceiling
    assert same["learned_vs_gt_spearman"] == same["gt_vs_gt_spearman"] and same["starts_per_half"] == 8
    assert 0.5 < same["gt_vs_gt_spearman"][1] <= 1.0
    flipped = split_half(gt[::-1], gt, n=200)  # one that ranks the suite backwards is far below it
    assert flipped["learned_vs_gt_spearman"][2] < 0 < flipped["gt_vs_gt_spearman"][0]
    # noise-free scores: every split agrees perfectly
    exact = split_half(np.repeat(np.linspace(0, 1, 5)[:, None], 4, 1), np.repeat(np.linspace(0, 1, 5)[:, None], 4, 1), n=20)
    assert exact["gt_vs_gt_spearman"] == pytest.approx([1.0] * 3)
    with pytest.raises(ValueError, match=">= 4 episodes"):
        split_half(gt[:, :3], gt[:, :3])


def test_reanalyse_recomputes_a_stored_report_and_names_what_is_missing(tmp_path):
    from iws_gym.evaluation.policy_eval import paired_gap, reanalyse, suite_figures

    rng = np.random.default_rng(1)
    per = {}
    for i, name in enumerate(["a", "b", "c", "d"]):
        gt = np.clip(0.1 * i + rng.normal(0, 0.05, 8), 0, 1)
        le = np.clip(gt + rng.normal(0, 0.03, 8), 0, 1)
        g = paired_gap(le, gt)
        per[name] = dict(learned=dict(mean_max_coverage=float(le.mean()), success_rate=i / 8),
                         ground_truth=dict(mean_max_coverage=float(gt.mean()), success_rate=i / 4),
                         gap=g["mean"], gap_stderr=g["stderr"], gap_significant=g["significant"],
                         seconds_per_episode_learned=1.0, seconds_per_episode_ground_truth=0.5,
                         scores_learned=le.tolist(), scores_ground_truth=gt.tolist(), scores_learned_pose=le.tolist())
    path = tmp_path / "corr.json"
    path.write_text(json.dumps(dict(per_policy=per, overall={"pearson_r": 0.0})))
    r = reanalyse(path)
    assert r["overall"] == suite_figures(per) and r["overall"]["pearson_r"] > 0.9
    assert r["overall"]["split_half"]["starts_per_half"] == 4 and r["reanalysed_from"] == str(path)
    out = tmp_path / "re.json"
    run_iws("eval", "correlate", "--from-json", path, "--json", out)
    assert json.loads(out.read_text())["overall"]["spearman_rho"] == pytest.approx(r["overall"]["spearman_rho"])
    del per["c"]["scores_ground_truth"]
    path.write_text(json.dumps(dict(per_policy=per)))
    proc = run_iws("eval", "correlate", "--from-json", path, check=False)
    assert proc.returncode == 2 and "per_policy.c.scores_ground_truth" in proc.stderr
    proc = run_iws("eval", "correlate", "--from-json", tmp_path / "none.json", check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_learned_run_keeps_the_frame_of_each_best_score(tiny_checkpoint):
    from iws_gym.policies.scripted import suite
    from iws_gym.evaluation.policy_eval import run_learned, start_states
    from iws_gym.tasks.pusht.scorer import TPushCoverageScorer
    from iws_gym.envs.registry import load_task

    task = load_task("tpushing")
    frames: list = []
    scores, _ = run_learned(task, suite()["random"], start_states(task, 3, 0), 4, 0, tiny_checkpoint, "cpu", best_frames=frames)
    assert len(frames) == 3 and frames[0].shape == (task.frame_size, task.frame_size, 3)
    # the env's scorer, re-run on the kept frames, gives back each episode's score
    np.testing.assert_allclose([TPushCoverageScorer().coverage(f) for f in frames], scores, atol=1e-6)


def test_learned_run_with_one_factory_per_start_routes_each_episode_to_its_policy(tiny_checkpoint):
    from iws_gym.evaluation.policy_eval import run_learned, start_states
    from iws_gym.envs.registry import load_task

    log = []

    def factory(name, target):
        class P:
            def reset(self, seed):
                log.append((name, "reset", seed))

            def __call__(self, obs):
                log.append((name, "act", None))
                return np.array(target, np.float32)
        return P

    task = load_task("tpushing")
    states = start_states(task, 2, 0)
    a, b = factory("a", [100, 100]), factory("b", [400, 400])
    with pytest.raises(ValueError, match="factories"):
        run_learned(task, [a], np.concatenate([states, states]), 3, 0, tiny_checkpoint, "cpu")
    scores, _ = run_learned(task, [a, a, b, b], np.concatenate([states, states]), 3, 7, tiny_checkpoint, "cpu", batch=3,
                            runner_seeds=[7, 8, 7, 8])
    assert scores.shape == (4,)
    for name in "ab":  # two episodes each (across the two vector envs of 3 and 1), reset with their own seeds
        assert sorted(s for n, k, s in log if n == name and k == "reset") == [7, 8]
        assert sum(1 for n, k, _ in log if n == name and k == "act") == 2 * 3


def test_suite_policies_act_in_the_ground_truth():
    from iws_gym.tasks.pusht.groundtruth import make_env
    from iws_gym.policies.scripted import suite

    s = suite()
    assert len(s) >= 8
    env = make_env(128)
    obs, _ = env.reset(seed=1_000_123)
    for name, factory in s.items():
        a = np.asarray(factory()(obs))
        assert a.shape == (2,) and np.all((a >= 0) & (a <= 512)), name


def test_shipped_bc_policies_load_by_name():
    from iws_gym.policies.bc import BCPolicy
    from iws_gym.evaluation.policy_eval import load_policy_factory
    from iws_gym.policies.scripted import suite

    factory = load_policy_factory("iws_gym.policies:bc_step4000")
    assert factory is suite()["bc_step4000"]  # the suite's member, not a copy
    assert isinstance(factory(), BCPolicy)


def test_correlate_command(tiny_checkpoint, tmp_path):
    out = tmp_path / "corr.json"
    run_iws("eval", "correlate", "--checkpoint", tiny_checkpoint, "--episodes", 2, "--horizon", 3,
            "--policies", "idle", "random", "bc_step300", "--plot", tmp_path / "corr.png", "--json", out)
    r = json.loads(out.read_text())
    assert set(r["per_policy"]) == {"idle", "random", "bc_step300"}
    for p in r["per_policy"].values():
        assert len(p["scores_learned"]) == 2 and len(p["scores_ground_truth"]) == 2
    assert {"pearson_r", "spearman_rho", "mean_bias", "mean_abs_gap", "pose_scorer_mean_abs_diff", "bootstrap_over_starts",
            "same_scorer"} <= set(r["overall"])
    for p in r["per_policy"].values():
        assert len(p["scores_learned_pose"]) == 2 and all(0 <= c <= 1 for c in p["scores_learned_pose"])
        # gym-pusht's frames read by the learned env's scorer: the gap splits into scorer + dynamics parts
        assert len(p["scores_ground_truth_pixels"]) == 2
        assert p["gap"] == pytest.approx(p["scorer_gap"] + p["dynamics_gap"])
        assert p["gap_stderr"] >= 0 and isinstance(p["gap_significant"], bool)
        t = p["trust"]  # each episode's lowest and mean trust, the selectors scripts/trust_tradeoff.py compares
        assert len(t["trust_mean"]) == 2 and all(lo <= m <= 1 for lo, m in zip(t["trust_min"], t["trust_mean"]))
    assert (tmp_path / "corr.png").stat().st_size > 0 and r["workers"] == 2
    # one process gives the same scores as the two worker processes (same starts, same seeds)
    one = tmp_path / "corr1.json"
    run_iws("eval", "correlate", "--checkpoint", tiny_checkpoint, "--episodes", 2, "--horizon", 3,
            "--policies", "idle", "random", "bc_step300", "--workers", 1, "--json", one, env={"OMP_NUM_THREADS": "1"})
    r1 = json.loads(one.read_text())
    assert r["reencode"] is True and r1["workers"] == 1
    assert list(r1["per_policy"]) == list(r["per_policy"])
    for name, p in r["per_policy"].items():
        np.testing.assert_allclose(r1["per_policy"][name]["scores_ground_truth"], p["scores_ground_truth"])
        np.testing.assert_allclose(r1["per_policy"][name]["scores_learned"], p["scores_learned"], atol=1e-6)
    proc = run_iws("eval", "correlate", "--policies", "nope", check=False)
    assert proc.returncode == 2 and "nope" in proc.stderr
    proc = run_iws("eval", "correlate", "--workers", 0, check=False)
    assert proc.returncode == 2 and "--workers" in proc.stderr


def test_probe_edits_and_command(tiny_checkpoint, tmp_path):
    from iws_gym.data.collect import heldout_episodes
    from iws_gym.evaluation.probe import EDITS, colour_share, edit_frame
    from iws_gym.envs.registry import load_task

    from iws_gym.tasks.pusht.pose import agent_position, estimate

    ep = next(heldout_episodes(load_task("tpushing"), 1, 1, first=42))
    frame = ep["frames"][0]
    for kind in EDITS:
        if kind == "agent_removed":
            continue
        edited, region, colour = edit_frame(frame, kind)
        assert edited.shape == frame.shape and edited.dtype == np.uint8 and region.any()
        assert colour_share(edited, region, colour) > 0.9 > colour_share(frame, region, colour)
    with pytest.raises(ValueError, match="block_pose"):
        edit_frame(frame, "agent_removed")
    edited, _, _ = edit_frame(frame, "agent_removed", block_pose=ep["block_pose"][0])
    assert agent_position(frame) is not None and agent_position(edited) is None  # the agent is gone ...
    assert np.abs(estimate(edited).block[:2] - estimate(frame).block[:2]).max() < 1.0  # ... the block stays
    out = tmp_path / "probe.json"
    run_iws("eval", "probe", "--checkpoint", tiny_checkpoint, "--steps", 2, "--episodes", 1, "--grid", tmp_path / "p.png", "--json", out)
    r = json.loads(out.read_text())
    assert set(r["edits"]) == set(EDITS) and (tmp_path / "p.png").stat().st_size > 0
    assert set(r["edits"]["agent_removed"]) == {"edit_kept", "block_px_vs_unedited", "agent_px_vs_unedited", "coverage"}


def test_mmrv_is_the_mean_worst_rank_violation():
    from iws_gym.evaluation.policy_eval import mmrv

    gt = [0.1, 0.5, 0.9]
    assert mmrv([0.0, 0.2, 0.4], gt) == 0.0                      # the same order, whatever the scale
    # policies 1 and 2 swapped: each of them is mis-ordered by 0.4, policy 0 by nothing
    assert abs(mmrv([0.1, 0.9, 0.5], gt) - (0 + 0.4 + 0.4) / 3) < 1e-12
    # everything reversed: 0.8, 0.4 (worst of 0.4 and 0.4), 0.8
    assert abs(mmrv([0.9, 0.5, 0.1], gt) - (0.8 + 0.4 + 0.8) / 3) < 1e-12
