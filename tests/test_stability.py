"""The long-rollout validity checks: real frames pass, broken frames fail, and the command reports."""
import json

import numpy as np
import pytest

from .conftest import run_iws
from iws_gym.data.collect import heldout_episodes
from iws_gym.tasks.pusht.pose import render_t
from iws_gym.evaluation.stability import calibrate, failures, false_alarms, frame_stats, inside_share, reference_frames
from iws_gym.envs.registry import load_task


def _real_frames():
    ep = next(heldout_episodes(load_task("tpushing"), 1, 30, first=777))
    return ep["frames"]


def test_real_frames_pass_and_broken_frames_fail():
    frames = _real_frames()
    env = calibrate(frames[::3])
    assert failures(frame_stats(frames[1]), env) == []
    grey = np.full_like(frames[0], 128)
    assert {"agent_found", "block_area"} <= set(failures(frame_stats(grey), env))  # all block-coloured
    noise = np.random.default_rng(0).integers(0, 256, frames[0].shape, dtype=np.uint8)
    assert "off_palette" in failures(frame_stats(noise), env)
    no_agent = frames[1].copy()
    blue = (no_agent[..., 2].astype(int) - no_agent[..., :2].mean(-1)) > 40
    no_agent[blue] = 255
    assert "agent_found" in failures(frame_stats(no_agent), env)


def _t_frame(pose):
    """A white 128x128 frame with a block-coloured T at `pose` (canvas coords), clipped by the frame."""
    ys, xs = np.mgrid[0:128, 0:128].astype(np.float64)
    a = render_t(np.asarray(pose, dtype=np.float64), ys, xs)[..., None]
    return (255 * (1 - a) + np.array([143, 163, 184]) * a).round().astype(np.uint8)


def test_a_t_hanging_off_the_table_fails():
    """A broken block against the wall is fitted by a T partly outside the frame; a real one never is."""
    assert abs(inside_share(np.array([256.0, 256.0, 0.3]), 128) - 1.0) < 1e-9
    half = inside_share(np.array([480.0, 256.0, -np.pi / 2]), 128)  # the stem beyond the right edge
    assert 0.2 < half < 0.9
    inside, off = frame_stats(_t_frame([256, 256, 0.3])), frame_stats(_t_frame([480, 256, -np.pi / 2]))
    assert inside["block_inside"] > 0.99 and off["block_inside"] < 0.95
    env = calibrate(_real_frames()[::3])
    assert env["block_inside"][0] > 0.9  # real frames: the whole T is on the table
    assert "block_inside" not in failures(inside, env) and "block_inside" in failures(off, env)


@pytest.mark.slow
def test_envelope_from_whole_episodes_accepts_real_pushes():
    """An envelope from the first frames of episodes rejects real frames where the block covers the goal
    (it did: 24% of held-out scripted frames, by mean colour); one from whole episodes of both drives
    accepts a disjoint set of them."""
    task = load_task("tpushing")
    env = calibrate(reference_frames(task, 3, 120, "stability_calibration", every=6))
    check = reference_frames(task, 3, 120, "stability_check", every=6)
    assert check.shape == (120, 128, 128, 3)
    wide = false_alarms(check, env)["invalid_fraction"]
    starts = np.concatenate([ep["frames"][::5] for ep in heldout_episodes(task, 3, 50, "stability_calibration")])
    narrow = false_alarms(check, calibrate(starts))["invalid_fraction"]
    assert wide <= 0.05 and narrow >= 0.05 and narrow > wide


def test_stability_command(tiny_checkpoint, tmp_path):
    out = tmp_path / "stab.json"
    run_iws("eval", "stability", "--checkpoint", tiny_checkpoint, "--steps", 12, "--check-every", 6,
            "--calib-episodes", 2, "--calib-steps", 20, "--strip", tmp_path / "strip.png", "--json", out,
            "--actions", "random", "scripted", "hold")
    r = json.loads(out.read_text())
    # the checks are checked: real frames of a disjoint set (2 drives x 2 episodes x 4 frames) pass
    assert r["false_alarm"]["frames"] == 16 and r["false_alarm"]["invalid_fraction"] <= 0.25
    assert r["false_alarm_of_start_envelope"]["frames"] == 16
    assert set(r["rollouts"]) == {"random", "scripted", "hold"} and r["precision"] in ("bf16", "fp32")
    # object permanence: real frames pass, the untrained model's T is never whole
    assert r["t_whole"]["false_alarm"] == 0.0 and r["rollouts"]["random"]["t_whole_share"] == 0.0
    still = r["rollouts"]["hold"]["still_world"]  # the agent told to stay put: how far does the world move?
    assert 0 <= still["block_lost_share"] <= 1 and still["frame_mean_abs_diff_max"] > 1
    assert "block_drift_px_own_max" in still  # the dynamics' drift alone, from the model's own start frame
    for roll in r["rollouts"].values():
        assert roll["checks"] == 2
        # an untrained tiny model makes garbage: the checks must notice
        assert roll["first_failure"] is not None and roll["first_failure"]["step"] == 6
        assert roll["strip_steps"] == [0, 6, 12]  # the first check past each ninth of the rollout
        assert len(roll["invalid_fraction_by_tenth"]) == 10 and roll["invalid_fraction_by_tenth"][4] == 1.0
        assert len(roll["t_whole_share_by_tenth"]) == 10
    assert r["stable"] is False
    assert (tmp_path / "strip.png").stat().st_size > 0
    proc = run_iws("eval", "stability", "--checkpoint", tiny_checkpoint, "--steps", 0, check=False)
    assert proc.returncode == 2 and "--steps" in proc.stderr
    proc = run_iws("eval", "stability", "--checkpoint", tiny_checkpoint, "--calib-episodes", 0, check=False)
    assert proc.returncode == 2 and "--calib-episodes" in proc.stderr


def test_stability_drives_are_stepped_together_and_reported_each(tiny_checkpoint, tmp_path):
    out = tmp_path / "stab.json"
    run_iws("eval", "stability", "--checkpoint", tiny_checkpoint, "--steps", 6, "--check-every", 3, "--drives", 3,
            "--calib-episodes", 2, "--calib-steps", 20, "--json", out, "--actions", "random", "hold")
    r = json.loads(out.read_text())
    assert r["drives"] == 3
    for roll in r["rollouts"].values():
        assert roll["checks"] == 6 and len(roll["per_drive"]) == 3  # 2 checks x 3 drives, pooled
        assert roll["t_whole_share"] == pytest.approx(np.mean([d["t_whole_share"] for d in roll["per_drive"]]))
        assert all(d["first_failure_step"] == 3 for d in roll["per_drive"])  # an untrained model fails at once
    proc = run_iws("eval", "stability", "--checkpoint", tiny_checkpoint, "--drives", 0, check=False)
    assert proc.returncode == 2 and "--drives" in proc.stderr


def test_ground_truth_replays_the_drives_and_measures_the_ceiling(tiny_checkpoint, tmp_path):
    """--ground-truth: the same drives in gym-pusht; real frames are whole, an untrained stage 1's round trip of
    them is not (the ceiling is measured, not assumed), and the model's frames are read against the truth."""
    out = tmp_path / "stab.json"
    run_iws("eval", "stability", "--checkpoint", tiny_checkpoint, "--steps", 6, "--check-every", 3, "--drives", 2,
            "--calib-episodes", 2, "--calib-steps", 20, "--json", out, "--actions", "random", "scripted", "hold",
            "--ground-truth")
    r = json.loads(out.read_text())
    assert "ground_truth" not in r["rollouts"]["hold"]  # held still, the truth is the start frame
    for kind in ("random", "scripted"):
        g = r["rollouts"][kind]["ground_truth"]
        assert g["real_whole_share"] == 1.0 and g["stage1_whole_share"] == 0.0
        assert len(g["block_px_median_by_tenth"]) == 6 and 0 <= g["block_px_missing"] <= 1  # a part per step here
        assert g["agent_px_median"] is None or g["agent_px_median"] >= 0
        assert "stage1_block_px_median" in g  # where stage 1's own round trip puts the T


def test_ground_truth_drives_start_where_the_model_does():
    from iws_gym.data.splits import split_offset
    from iws_gym.evaluation.stability import drive_actions, ground_truth_drives

    task = load_task("tpushing")
    eps = list(heldout_episodes(task, 3, 50, "stability_calibration"))  # the third one's start is chosen by the mix
    seeds = task.heldout_seed_base + split_offset("stability_calibration") + np.arange(3)
    acts = drive_actions("scripted", task, 4, 0, [ep["agent_pos"][0] for ep in eps])
    real, truth = ground_truth_drives(task, seeds, np.stack([ep["frames"][0] for ep in eps]), acts, [2, 4])
    assert real.shape == (3, 2, 128, 128, 3) and truth[0]["block_pose"].shape == (2, 3)
    with pytest.raises(RuntimeError, match="start frame"):
        ground_truth_drives(task, seeds[1:], eps[0]["frames"][:1], acts, [2])


def test_drives_get_their_own_actions():
    from iws_gym.evaluation.stability import drive_actions

    task = load_task("tpushing")
    a = drive_actions("random", task, 5, 0, [None, None])
    b = drive_actions("random", task, 5, 0, [None])
    assert a.shape == (2, 5, 2) and np.array_equal(a[0], b[0]) and not np.array_equal(a[0], a[1])
    h = drive_actions("hold", task, 4, 0, [(10, 20), (30, 40)])
    assert h.shape == (2, 4, 2) and (h[1] == [30, 40]).all()
