import numpy as np
import pytest

from iws_gym.data.collect import heldout_episodes
from iws_gym.tasks.pusht.groundtruth import render_state, wrap_angle
from iws_gym.tasks.pusht.pose import estimate, pose_errors
from iws_gym.envs.registry import load_task


def test_pose_estimator_on_ground_truth_frames():
    errs = []
    for ep in heldout_episodes(load_task("tpushing"), 2, 40):
        for t in range(0, 41, 8):
            errs.append(pose_errors(estimate(ep["frames"][t]), ep["agent_pos"][t], ep["block_pose"][t], ep["coverage"][t]))
    med = {k: np.nanmedian([e[k] for e in errs]) for k in errs[0]}
    assert med["agent_px"] < 2 and med["block_px"] < 3 and med["block_rad"] < 0.05 and med["coverage"] < 0.03


def test_agent_touching_the_block_does_not_break_the_fit():
    # agent pressed against the bar's top edge (body frame y = 0 -> world y = 300 for angle 0)
    state = [256.0, 300.0 - 16.0, 256.0, 300.0, 0.0]
    frame = render_state(state)
    est = estimate(frame)
    assert np.linalg.norm(est.agent - state[:2]) < 3
    assert np.linalg.norm(est.block[:2] - np.array(state[2:4])) < 8
    assert abs(wrap_angle(est.block[2] - state[4])) < 0.1


def test_unmix_recovers_colour_fractions_against_each_background():
    """Pixels blended from known fractions of two colours over the backgrounds are read back exactly."""
    from iws_gym.tasks.pusht.pose import BACKGROUNDS, unmix
    from iws_gym.tasks.pusht.scorer import FILL_RGB, OUTLINE_RGB

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 0.5, (len(BACKGROUNDS), 2))  # fill, outline; together at most 1
    pix = np.stack([bg + a * (FILL_RGB - bg) + b * (OUTLINE_RGB - bg) for bg, (a, b) in zip(BACKGROUNDS, x)])
    np.testing.assert_allclose(unmix(pix[None].astype(np.float32), [FILL_RGB, OUTLINE_RGB])[0], x, atol=1e-3)
    white = np.full((1, 1, 3), 255.0, np.float32)
    assert unmix(white, [FILL_RGB])[0, 0, 0] == 0.0


def test_no_block_visible():
    frame = np.full((128, 128, 3), 255, np.uint8)
    est = estimate(frame)
    assert est.block is None and np.isnan(est.coverage) and est.agent is None


def test_rejects_bad_frame():
    with pytest.raises(ValueError, match="uint8"):
        estimate(np.zeros((128, 128, 3), np.float32))


def test_whole_t_check_passes_real_frames_and_fails_faded_doubled_or_missing_ts():
    """The object-permanence check (pose.is_whole_t): calibrated on real frames, every real frame passes;
    a T faded to half contrast, doubled by a copy at another pose, or gone does not."""
    from iws_gym.data.collect import heldout_episodes
    from iws_gym.envs.registry import load_task
    from iws_gym.tasks.pusht.groundtruth import OFF_CANVAS_BLOCK, render_states
    from iws_gym.tasks.pusht.pose import calibrate_whole_t, estimate, is_whole_t

    ep = next(heldout_episodes(load_task("tpushing"), 1, 30, "stability_check"))
    frames, ap, bp = ep["frames"], ep["agent_pos"], ep["block_pose"]
    thr = calibrate_whole_t(frames)
    assert all(is_whole_t(estimate(f), 128, thr) for f in frames)
    gone = render_states(ap[:3], np.array([OFF_CANVAS_BLOCK] * 3))
    faded = np.rint(0.5 * frames[:3] + 0.5 * gone).astype(np.uint8)
    other = render_states(ap[:3], bp[:3] + [40.0, 0.0, 0.6])
    doubled = np.minimum(frames[:3], other)  # both Ts drawn (the block is darker than the table)
    for bad in (gone, faded, doubled):
        assert not any(is_whole_t(estimate(f), 128, thr) for f in bad)
