import json
import subprocess
import sys

import numpy as np

from iws_gym.data.episodes import read_episode

from .conftest import ROOT


def test_play_headless_records_an_episode(tiny_checkpoint, tmp_path):
    events = tmp_path / "events.txt"
    # start recording, hold right for 4 frames, then down for 3, stop (saves); record again and discard; quit
    events.write_text("1 r\n1 right\n5 right\n5 down\n8 down\n9 r\n10 r\n12 x\n13 quit\n")
    out = tmp_path / "demos"
    proc = subprocess.run([sys.executable, "examples/play.py", "--checkpoint", str(tiny_checkpoint), "--out", str(out),
                           "--events", str(events), "--fps", "1000"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={"SDL_VIDEODRIVER": "dummy", "SDL_AUDIODRIVER": "dummy", "PATH": "/usr/bin:/bin",
                                            "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(summary["saved"]) == 1 and summary["frames"] == 13
    ep = read_episode(summary["saved"][0])
    T = len(ep["actions"])
    assert T == 8 and ep["frames"].shape == (T + 1, 128, 128, 3)
    a = ep["actions"]
    assert np.all(np.diff(a[:4, 0]) > 0) and np.all(np.diff(a[4:7, 1]) > 0)  # moved right, then down
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["episodes"] == 1 and meta["generated"] is True and len(meta["world_model"]["stage2_sha256"]) == 64
    assert len(list(out.glob("ep_*.h5"))) == 1  # the discarded recording was not written
