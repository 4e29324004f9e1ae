"""The long-rollout validity checks: real frames pass, broken frames fail, and the command reports."""
import json

import numpy as np

from .conftest import run_iws
from iws_gym.collect import heldout_episodes
from iws_gym.stability import calibrate, failures, frame_stats
from iws_gym.tasks import load_task


def _real_frames():
    ep = next(heldout_episodes(load_task("tpushing"), 1, 30, offset=777))
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


def test_stability_command(tiny_checkpoint, tmp_path):
    out = tmp_path / "stab.json"
    run_iws("eval", "stability", "--checkpoint", tiny_checkpoint, "--steps", 12, "--check-every", 6,
            "--strip", tmp_path / "strip.png", "--json", out)
    r = json.loads(out.read_text())
    assert set(r["rollouts"]) == {"random", "scripted"} and r["precision"] in ("bf16", "fp32")
    for roll in r["rollouts"].values():
        assert roll["checks"] == 2
        # an untrained tiny model makes garbage: the checks must notice
        assert roll["first_failure"] is not None and roll["first_failure"]["step"] == 6
    assert r["stable"] is False
    assert (tmp_path / "strip.png").stat().st_size > 0
    proc = run_iws("eval", "stability", "--checkpoint", tiny_checkpoint, "--steps", 0, check=False)
    assert proc.returncode == 2 and "--steps" in proc.stderr
