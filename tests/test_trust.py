import json
import shutil
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import iws_gym  # noqa: F401
from iws_gym.models import trust as T

from .conftest import run_iws


def test_trust_falls_with_the_signal_and_is_one_half_at_m_half():
    cal = T.TrustCalibration(m_half=0.02, slope=3.0)
    m = torch.tensor([0.0, 0.01, 0.02, 0.04, 1.0])
    t = cal.trust(m)
    assert t[0] == 1.0 and t[2] == pytest.approx(0.5) and (t.diff() < 0).all() and t[-1] < 1e-4
    with pytest.raises(ValueError, match="m_half > 0"):
        T.TrustCalibration(m_half=0.0)


def test_update_smooths_and_keeps_the_episode_minimum():
    cal = T.TrustCalibration(alpha=0.5, m_half=1.0, slope=2.0)
    st = dict(t=torch.tensor([1, 1]), trust_m=torch.zeros(2), trust=torch.ones(2), trust_min=torch.ones(2))
    T.update(st, torch.tensor([4.0, 0.0]), cal)          # first step: the signal itself
    assert st["trust_m"].tolist() == [4.0, 0.0]
    st["t"] += 1
    T.update(st, torch.tensor([0.0, 0.0]), cal)          # then an EMA; the minimum remembers the worst
    assert st["trust_m"].tolist() == [2.0, 0.0]
    assert st["trust"][0] > st["trust_min"][0] and st["trust_min"][1] == 1.0


def test_calibration_file_is_read_and_a_bad_one_is_named(tmp_path):
    assert T.TrustCalibration.load(tmp_path).source == "uncalibrated default"
    (tmp_path / T.TRUST_FILE).write_text(json.dumps(dict(alpha=0.2, m_half=0.05, slope=2.0, fitted_by="x")))
    cal = T.TrustCalibration.load(tmp_path)
    assert (cal.alpha, cal.m_half, cal.slope) == (0.2, 0.05, 2.0) and cal.source.endswith("trust.json")
    (tmp_path / T.TRUST_FILE).write_text(json.dumps(dict(alpha=0.2, m_half=-1, slope=2.0)))
    with pytest.raises(ValueError, match="m_half"):
        T.TrustCalibration.load(tmp_path)


def test_fit_logistic_and_auroc():
    from iws_gym.evaluation.trust import auroc, fit_logistic

    rng = np.random.default_rng(0)
    x = rng.normal(size=4000)
    y = (rng.random(4000) < 1 / (1 + np.exp(-(0.5 + 2.0 * x)))).astype(float)
    a, b = fit_logistic(x, y)
    assert a == pytest.approx(0.5, abs=0.15) and b == pytest.approx(2.0, abs=0.2)
    assert auroc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert auroc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4]) == 0.0
    assert auroc([0, 1], [0.5, 0.5]) == 0.5


def test_envs_report_trust_per_step_and_per_world(tiny_checkpoint):
    env = gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu")
    _, info = env.reset(seed=0)
    assert info["trust"] == 1.0 and info["trust_min"] == 1.0
    mins = []
    for _ in range(4):
        _, _, _, _, info = env.step(env.action_space.sample())
        assert 0.0 <= info["trust"] <= 1.0 and info["trust_min"] <= info["trust"] + 1e-7
        mins.append(info["trust_min"])
    assert mins == sorted(mins, reverse=True)
    venv = gym.make_vec("IWS-TPushing-v0", num_envs=3, checkpoint=tiny_checkpoint, device="cpu")
    venv.reset(seed=0)
    _, _, _, _, info = venv.step(np.full((3, 2), 256.0, np.float32))
    assert np.asarray(info["trust"]).shape == (3,) and np.all(np.asarray(info["trust_min"]) <= 1.0)
    off = gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu", trust=False, reencode_every=2)
    off.reset(seed=0)
    for _ in range(3):
        _, _, _, _, info = off.step(off.action_space.sample())
    assert info["trust"] == 1.0 and info["trust_min"] == 1.0


def test_untrusted_episodes_are_counted_and_can_be_stopped(tiny_checkpoint, tmp_path):
    """With a calibration under which nothing is trusted, every episode is untrusted; --stop-untrusted ends them
    at once and says so, never dropping them."""
    from iws_gym.envs.registry import load_task
    from iws_gym.evaluation.policy_eval import run_learned, start_states, trust_summary
    from iws_gym.policies.scripted import suite

    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, ck)
    (ck / T.TRUST_FILE).write_text(json.dumps(dict(alpha=1.0, m_half=1e-12, slope=8.0)))
    task = load_task("tpushing")
    states = start_states(task, 3, 0)
    tmin: list = []
    scores, _ = run_learned(task, suite()["random"], states, 6, 0, ck, "cpu", trust_min=tmin)
    assert len(tmin) == 3 and max(tmin) < T.TRUSTED
    s = trust_summary(tmin, scores, scores)
    assert s["trusted_share"] == 0.0 and s["learned_trusted"] is None and s["gap_trusted"] is None
    rec: list = []
    run_learned(task, suite()["random"], states, 6, 0, ck, "cpu", stop_untrusted=True, record=rec)
    assert len(rec) == 2  # the reset frame and the first step, which fell below the line
    tmin2, tmean2 = [], []
    run_learned(task, suite()["random"], states, 6, 0, tiny_checkpoint, "cpu", trust_min=tmin2, trust_mean=tmean2)  # uncalibrated
    assert all(0.0 <= t <= m <= 1.0 for t, m in zip(tmin2, tmean2)) and len(tmean2) == 3  # the mean is never below the minimum


def test_eval_trust_fits_writes_and_refuses_to_overwrite(tiny_checkpoint, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, ck)
    args = ("eval", "trust", "--checkpoint", ck, "--episodes", 2, "--fit-episodes", 3, "--steps", 6, "--behaviours",
            "random", "mix", "--device", "cpu")
    proc = run_iws(*args, "--fit", "--json", tmp_path / "t.json", "--plot", tmp_path / "t.png", check=False)
    if proc.returncode != 0:  # a tiny model may lose every block: the fit must then say why, and write nothing
        assert "same side of the 20 px line" in proc.stderr or "does not rise" in proc.stderr, proc.stderr
        assert not (ck / T.TRUST_FILE).exists()
        (ck / T.TRUST_FILE).write_text(json.dumps(dict(alpha=0.1, m_half=0.05, slope=2.0)))
    else:
        rep = json.loads((tmp_path / "t.json").read_text())
        assert rep["episodes"] == 4 and 0 <= rep["trusted_share"] <= 1 and (tmp_path / "t.png").stat().st_size > 0
        assert rep["calibration"]["source"].endswith("trust.json") and rep["fit"]["episodes"] == 6
    before = (ck / T.TRUST_FILE).read_text()
    proc = run_iws(*args, "--fit", check=False)
    assert proc.returncode == 2 and "--force" in proc.stderr
    assert (ck / T.TRUST_FILE).read_text() == before
    proc = run_iws(*args, "--fit", "--split", "validation", check=False)
    assert proc.returncode == 2 and "validation" in proc.stderr


def test_suite_trust_compares_trusted_episodes_with_all():
    from iws_gym.evaluation.policy_eval import suite_trust, trust_summary

    per = {}
    for name, (learned, gt, tmin) in dict(a=([0.5, 0.1, 0.4], [0.5, 0.5, 0.4], [0.9, 0.1, 0.8]),
                                          b=([0.2, 0.2], [0.2, 0.6], [1.0, 0.0])).items():
        per[name] = dict(scores_learned=learned, scores_ground_truth=gt, trust=trust_summary(tmin, learned, gt))
    t = suite_trust(per)
    assert t["kept_share"] == pytest.approx(3 / 5)
    assert t["episode_mean_abs_gap_trusted"] == 0.0 and t["episode_mean_abs_gap_untrusted"] == pytest.approx(0.4)
    assert t["mean_abs_gap_all"] == pytest.approx((abs(1.0 / 3 - 1.4 / 3) + 0.2) / 2)
    assert t["mean_abs_gap_trusted"] == 0.0 and t["reduction"] == 1.0


def test_report_states_the_ceiling_a_true_error_signal_would_reach():
    from iws_gym.evaluation.trust import _figures

    n = 8
    block = np.array([1, 2, 3, 30, 40, 50, 60, 70], float)
    gap = np.array([0.0, 0.01, 0.02, 0.03, 0.2, 0.1, 0.3, 0.4])  # a gap need not grow with the error
    e = dict(behaviour=np.array(["a"] * 4 + ["b"] * 4), max_block_px=block, gap=gap,
             trust_min=np.linspace(1, 0, n), step_trust=np.tile(np.linspace(1, 0, n)[:, None], 3),
             step_block_px=np.tile(block[:, None], 3), step_agent_px=np.zeros((n, 3)))
    r = _figures(e)
    assert r["spearman_trust_gap"] == pytest.approx(r["spearman_true_error_gap"])  # trust ranks as the error does
    assert -1 < r["spearman_true_error_gap"] < -0.5 and r["per_behaviour"]["a"]["spearman_true_error_gap"] < -0.9


def test_trust_tradeoff_keeps_episodes_by_each_rule(tmp_path):
    """scripts/trust_tradeoff.py: a study where trust ranks the broken episodes last removes the gap as the
    oracle does; one where trust is reversed keeps exactly the broken ones and makes the gap larger."""
    import importlib.util

    script = Path(__file__).resolve().parent.parent / "scripts/trust_tradeoff.py"
    spec = importlib.util.spec_from_file_location("trust_tradeoff", script)
    tt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tt)
    rng = np.random.default_rng(0)
    per = {}
    for k in range(4):
        gt = rng.uniform(0, 1, 20)
        broken = np.arange(20) < 6  # 30% of each policy's episodes score 0.5 too high in the learned world
        per[f"p{k}"] = dict(scores_ground_truth=gt.tolist(), scores_learned=(gt + 0.5 * broken).tolist(),
                            trust={"trust_min": np.where(broken, 0.1, 0.9).tolist(),
                                   "trust_mean": np.where(broken, 0.5, 0.95).tolist()})
    report = tmp_path / "study.json"
    report.write_text(json.dumps(dict(checkpoint="x", per_policy=per)))
    out = tmp_path / "out.json"
    tt.main([str(report), "--json", str(out)])
    at70 = json.loads(out.read_text())[str(report)]["at_70pct_kept"]
    assert at70["trust"] > 0.99 and at70["trust_mean"] > 0.99 and at70["oracle"] > 0.99 and abs(at70["random"]) < 0.3
    for p in per.values():
        p["trust"]["trust_min"] = (1 - np.array(p["trust"]["trust_min"])).tolist()
    report.write_text(json.dumps(dict(checkpoint="x", per_policy=per)))
    tt.main([str(report), "--json", str(out)])
    row = next(r for r in json.loads(out.read_text())[str(report)]["rows"] if r["kept_share"] == 0.3)
    assert row["trust"]["reduction"] < -1  # only the broken episodes kept: the gap is 0.5 instead of 0.15
    del per["p0"]["trust"]
    report.write_text(json.dumps(dict(checkpoint="x", per_policy=per)))
    with pytest.raises(SystemExit, match="no per-episode trust"):
        tt.main([str(report), "--json", str(out)])
