import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
ROOT = Path(__file__).resolve().parent.parent


def run_iws(*args, check=True, env=None):
    """Run the real `iws` CLI in a subprocess (as users do)."""
    proc = subprocess.run([sys.executable, "-m", "iws_gym.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"iws {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "tiny"
    run_iws("collect", "--episodes", 3, "--steps", 24, "--out", out, "--seed", 7)
    return out


@pytest.fixture(scope="session")
def tiny_stage1(tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "stage1"
    run_iws("train", "stage1", "--data", tiny_dataset, "--out", out, "--steps", 12, "--batch", 4, "--preset", "tiny",
            "--crop", 64, "--eval-every", 100, "--ckpt-every", 6, "--log-every", 2, "--warmup", 2)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_dataset, tiny_stage1, tmp_path_factory):
    """A complete (stage 1 + stage 2) tiny checkpoint directory, as `checkpoints/tpushing` is laid out."""
    import shutil

    s2 = tmp_path_factory.mktemp("runs") / "stage2"
    run_iws("train", "stage2", "--data", tiny_dataset, "--init", tiny_stage1, "--out", s2, "--steps", 4, "--batch", 4,
            "--preset", "tiny", "--eval-every", 100, "--ckpt-every", 100, "--warmup", 1)
    ck = tmp_path_factory.mktemp("ck") / "tpushing"
    ck.mkdir()
    shutil.copy(tiny_stage1 / "stage1.safetensors", ck)
    shutil.copy(s2 / "stage2.safetensors", ck)
    (ck.parent / "stage2_run").symlink_to(s2)  # the run it was trained by (for release tests)
    return ck
