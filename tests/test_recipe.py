"""One command from nothing to released weights (iws train recipe), and the GPU script at toy scale."""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from .conftest import ROOT, run_iws

TINY = ["--scale", "tiny", "--episodes", 3, "--episode-steps", 24, "--stage1-steps", 6, "--stage2-steps", 4,
        "--eval-every", 100, "--workers", 2]


def test_recipe_runs_collection_both_stages_and_release_and_resumes(tmp_path):
    out = tmp_path / "recipe"
    run_iws("train", "recipe", "--out", out, *TINY)
    log = json.loads((out / "recipe.json").read_text())
    assert set(log["steps"]) == {"collect", "stage1", "stage2", "release"} and log["command"].startswith("iws train recipe")
    prov = json.loads((out / "release" / "provenance.json").read_text())
    assert prov["stage2"]["command"] == log["steps"]["stage2"]["command"]  # the stage's exact command, reproducible alone
    assert "--agent-track" in prov["stage2"]["command"] and prov["stage1"]["data_seed"] == 0
    from iws_gym.models.world_model import WorldModel

    wm = WorldModel.from_pretrained(out / "release", device="cpu", stages=("stage1", "stage2"))
    assert wm.rollout(np.full((128, 128, 3), 255, np.uint8), np.zeros((2, 2)), agent_pos=[256.0, 256.0]).shape[0] == 3
    # interrupted after stage 1: the rerun skips what is done and finishes the rest
    before = (out / "stage1" / "stage1.safetensors").read_bytes()
    for f in ("stage2/train_result.json", "stage2/stage2.safetensors", "release/stage2.safetensors"):
        (out / f).unlink()
    run_iws("train", "recipe", "--out", out, *TINY)
    assert (out / "stage1" / "stage1.safetensors").read_bytes() == before and (out / "release" / "stage2.safetensors").is_file()
    # the same folder with other settings is refused, and nothing in it is touched
    proc = run_iws("train", "recipe", "--out", out, *TINY[:-2], "--workers", 1, "--seed", 5, check=False)
    assert proc.returncode == 2 and "other settings" in proc.stderr
    assert (out / "stage1" / "stage1.safetensors").read_bytes() == before


def test_compact_recipe_collects_four_kinds_of_data_and_releases_a_compact_model(tmp_path):
    out = tmp_path / "compact"
    run_iws("train", "recipe", "--out", out, "--design", "compact", *TINY[:-2])
    log = json.loads((out / "recipe.json").read_text())
    assert {"collect", "collect_expert", "collect_random", "collect_jittery", "compact1", "compact2"} <= set(log["steps"])
    assert log["steps"]["collect_random"]["seeds"][0] == 300000 and "--extra-data" in log["steps"]["compact2"]["command"]
    # stage 2 also learns from the "more" collections (latents are small); stage 1 holds frames in RAM and does not
    assert log["steps"]["collect_play_more"]["episodes"] == 19 and log["steps"]["collect_random_more"]["seeds"][0] == 400000
    assert "data_play_more" in log["steps"]["compact2"]["command"] and "data_play_more" not in log["steps"]["compact1"]["command"]
    assert log["steps"]["collect_expert_more"]["seeds"][0] == 600000 and "data_expert_more" in log["steps"]["compact2"]["command"]
    order = list(log["steps"])  # stage 2's own collections wait for stage 1: a resumed stage 1 needs only its data
    assert order.index("collect_jittery") < order.index("compact1") < order.index("collect_play_more")
    from iws_gym.models.compact import CompactWorldModel
    from iws_gym.models.world_model import WorldModel

    prov = json.loads((out / "release" / "provenance.json").read_text())["stage2"]  # the release's inference settings
    assert prov["config"]["denoiser_steps"] == 4 and prov["config_set"][0]["changes"] == {"denoiser_steps": [1, 4]}
    wm = WorldModel.from_pretrained(out / "release", device="cpu", stages=("stage1", "stage2"))
    assert isinstance(wm, CompactWorldModel) and wm.stage2.cfg.denoiser_steps == 4
    assert wm.rollout(np.full((128, 128, 3), 255, np.uint8), np.zeros((2, 2)), agent_pos=[256.0, 256.0]).shape[0] == 3
    proc = run_iws("train", "recipe", "--out", tmp_path / "bad", "--design", "pixels", *TINY, check=False)
    assert proc.returncode != 0 and "--design must be one of" in proc.stderr


def test_collection_workers_record_the_same_episodes(tmp_path):
    from iws_gym.data.episodes import read_episode

    for w in (1, 2):
        run_iws("collect", "--episodes", 3, "--steps", 8, "--out", tmp_path / f"w{w}", "--seed", 11, "--workers", w)
    for i in range(3):
        a, b = (read_episode(tmp_path / f"w{w}" / f"ep_{i:06d}.h5") for w in (1, 2))
        assert np.array_equal(a["frames"], b["frames"]) and np.array_equal(a["actions"], b["actions"])


@pytest.mark.slow
@pytest.mark.parametrize("design", ["spatial", "compact"])
def test_gpu_script_runs_at_toy_scale_on_a_cpu(tmp_path, design):
    env = {**os.environ, "IWS_RECIPE_SCALE": "tiny", "OMP_NUM_THREADS": "1", "IWS_RECIPE_DESIGN": design}
    subprocess.run(["bash", str(ROOT / "scripts" / "gpu_recipe.sh"), str(tmp_path)], check=True, env=env, cwd=ROOT,
                   capture_output=True, timeout=600)
    assert (tmp_path / "recipe" / "release" / "stage2.safetensors").is_file()
    r = json.loads((tmp_path / "fidelity_validation.json").read_text())
    assert r["split"] == "validation" and "t_whole_share" in r["summary"]["model"]
    assert json.loads(Path(tmp_path / "machine.json").read_text())["cores"] >= 1


@pytest.mark.slow
def test_gpu_study_script_runs_at_toy_scale_on_a_cpu(tmp_path):
    env = {**os.environ, "IWS_STUDY_SCALE": "tiny", "IWS_STUDY_WORK": str(tmp_path / "work"), "OMP_NUM_THREADS": "1",
           "IWS_STUDY_DEADLINE": "3000",  # every training ends by one moment (--deadline), far off at toy scale
           "IWS": f"{os.sys.executable} -m iws_gym.cli"}
    subprocess.run(["bash", str(ROOT / "scripts" / "gpu_study.sh"), str(tmp_path / "out")], check=True, env=env,
                   cwd=ROOT, capture_output=True, timeout=900)
    out = tmp_path / "out"
    names = ("consistency", "consistency_df", "transport_gated_df")
    assert all((out / f"s2_{n}.safetensors").is_file() for n in names) and (out / "stage1.safetensors").is_file()
    log = (out / "study.log").read_text()
    assert json.loads(log.splitlines()[0])["cores"] >= 1 and "evaluations done" in log
    for n in names:  # each variant trained to its time budget and was measured
        r = json.loads((tmp_path / "work" / "release" / n / "fidelity_val_h64.json").read_text())
        assert "t_whole_share" in r["summary"]["model"]
        assert json.loads((tmp_path / "work" / f"s2_{n}" / "train_result.json").read_text())["time_budget_spent"]


@pytest.mark.slow
def test_issue36_table_script_runs_at_toy_scale(tmp_path):
    """scripts/issue36_table.sh: every row's command on a compact release, each report written once (a rerun
    skips what exists)."""
    rel = tmp_path / "compact"
    run_iws("train", "recipe", "--out", rel, "--design", "compact", *TINY[:-2])
    env = {**os.environ, "IWS_T36_SCALE": "tiny", "IWS": f"{os.sys.executable} -m iws_gym.cli", "PYTHON": os.sys.executable}
    out = tmp_path / "reports"
    cmd = ["bash", str(ROOT / "scripts/issue36_table.sh"), str(rel / "release"), "t", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    names = {"fidelity_48", "fidelity_16", "stability_1000x16", "trust", "correlate_32", "correlate_whole_range", "bench",
             "bench_shipped", "contact_starts"}
    assert {f"t_{n}.json" for n in names} <= {p.name for p in out.iterdir()}
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("skip ") == 7
    lane_b = subprocess.run(cmd, cwd=ROOT, env={**env, "LANE": "b"}, capture_output=True, text=True, timeout=300)
    assert lane_b.returncode == 0 and lane_b.stdout.count("skip ") == 3  # its own rows only: the other lane's stay out
