import numpy as np
import pytest

from iws_gym.collect import heldout_episodes
from iws_gym.groundtruth import render_state, wrap_angle
from iws_gym.pose import estimate, pose_errors
from iws_gym.tasks import load_task


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


def test_no_block_visible():
    frame = np.full((128, 128, 3), 255, np.uint8)
    est = estimate(frame)
    assert est.block is None and np.isnan(est.coverage) and est.agent is None


def test_rejects_bad_frame():
    with pytest.raises(ValueError, match="uint8"):
        estimate(np.zeros((128, 128, 3), np.float32))
