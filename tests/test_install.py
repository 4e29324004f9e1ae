"""The package as users get it: a built wheel in a fresh environment, used from outside the repository;
and the shipped weights producing the frames recorded when they were promoted."""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_weights_make_the_same_frames():
    """gym.make + reset(seed=3) + 8 seeded random-walk steps on the shipped weights, in fp32, against the frames
    recorded when they became the default (tests/data/shipped_fp32_frames.npz, the recipe's weights). fp32
    kernels differ slightly between CPUs, so the bounds are a tenth of a grey level on average and a few pixels
    off by more than 8, not bit equality; the weights they replaced are 0.38 off on average, 0.9% of pixels by
    more than 8."""
    import gymnasium as gym

    import iws_gym  # noqa: F401

    want = np.load(ROOT / "tests/data/shipped_fp32_frames.npz")["frames"]
    env = gym.make("IWS-TPushing-v0", precision="fp32")
    obs, _ = env.reset(seed=3)
    frames, rng, a = [obs["pixels"]], np.random.default_rng(0), obs["agent_pos"].astype(np.float32)
    for _ in range(len(want) - 1):
        a = np.clip(a + rng.normal(0, 25, 2), 0, 512).astype(np.float32)
        frames.append(env.step(a)[0]["pixels"])
    diff = np.abs(np.stack(frames).astype(int) - want)
    assert diff[0].max() == 0  # the start frame is gym-pusht's render
    assert diff.mean() < 0.1, f"mean |diff| {diff.mean():.3f} grey levels"
    assert (diff > 8).mean() < 0.001, f"{(diff > 8).mean():.2%} of pixels off by more than 8 grey levels"


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_repository(tmp_path):
    """Build the wheel, install it (without its dependencies, which this environment already has) into a
    fresh virtual environment, and from another directory make the env and step it: task configs and the
    default weights must come from the installed package, not from the source tree."""
    import shutil

    src, dist = tmp_path / "src", tmp_path / "dist"  # a clean copy of what the wheel is built from (no stale build/)
    for name in ("iws_gym", "checkpoints"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(src)], check=True, capture_output=True, timeout=600)
    wheel = next(dist.glob("iws_gym-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies (torch, gymnasium, ...) from this environment; its editable iws_gym is not on that path
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=600)
    code = ("import gymnasium as gym, numpy as np, iws_gym; print(iws_gym.__file__); "
            "env = gym.make('IWS-TPushing-v0'); obs, _ = env.reset(seed=0); "
            "obs, r, *_ = env.step(np.array([256.0, 256.0], np.float32)); print(obs['pixels'].shape, float(r)); "
            "g = gym.make('iws_gym/PileSweepPymunk-v0'); g.reset(seed=0); print(len(g.step(np.array([99.0, 99.0]))[0]))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "IWS_CHECKPOINTS")}
    out = subprocess.run([str(py), "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(site), f"iws_gym imported from {lines[0]}, not the installed wheel in {site}"
    assert lines[1].startswith("(128, 128, 3)")
    assert lines[2] == "82"  # the second task's ground truth travels in the wheel too: agent + 40 pucks
    cli = subprocess.run([str(venv / "bin" / "iws"), "eval", "fidelity", "--help"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=env)
    assert cli.returncode == 0 and "--split" in cli.stdout
