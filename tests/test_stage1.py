import dataclasses
import math
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from iws_gym.models.checkpoint import load_release, save_release
from iws_gym.models.decoder import ConsistencyDecoder, DecoderConfig, Stage1Config, decode
from iws_gym.models.world_model import WorldModel

from .conftest import ROOT, run_iws


def test_training_writes_release_with_config(tiny_stage1):
    result = json.loads((tiny_stage1 / "train_result.json").read_text())
    assert result["step"] == 12 and "psnr_1step" in result["eval"]
    from iws_gym.models.hardware import default_dtype, dtype_name
    assert result["precision"] == dtype_name(default_dtype("cpu"))  # what the loop trained in, by the hardware rule
    cfg, sd, meta = load_release(tiny_stage1 / "stage1.safetensors", "stage1", Stage1Config)
    assert cfg.decoder.ch == 16 and meta["data_seed"] == 7 and meta["step"] == 12 and "commit" in meta
    assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())
    assert list((tiny_stage1 / "tb").iterdir()), "TensorBoard logs missing"


def test_world_model_roundtrip_and_steps(tiny_stage1, tiny_dataset):
    from iws_gym.data.episodes import episode_path, read_episode

    wm = WorldModel.from_pretrained(tiny_stage1, device="cpu")
    frames = read_episode(episode_path(tiny_dataset, 0))["frames"][:3]
    z = wm.encode(frames)
    assert z.shape == (3, 8, 16, 16) and torch.all(z.abs() <= 1)
    for steps in (1, 2, 4):
        out = wm.decode(z, steps=steps, seed=0)
        assert out.shape == frames.shape and out.dtype == np.uint8
    np.testing.assert_array_equal(wm.decode(z, steps=2, seed=1), wm.decode(z, steps=2, seed=1))


@pytest.mark.parametrize("bad,msg", [
    (np.zeros((1, 64, 64, 3), np.uint8), r"\(B, 128, 128, 3\)"),
    (np.zeros((1, 128, 128, 3), np.float32), "uint8"),
    (np.zeros((1, 128, 128, 4), np.uint8), "RGB"),
    (np.zeros((128, 128, 3), np.uint8), "shape"),
])
def test_encode_rejects_bad_frames(tiny_stage1, bad, msg):
    wm = WorldModel.from_pretrained(tiny_stage1, device="cpu")
    with pytest.raises(ValueError, match=msg):
        wm.encode(bad)


def test_truncated_or_mismatched_checkpoint_is_named(tiny_stage1, tmp_path):
    data = (tiny_stage1 / "stage1.safetensors").read_bytes()
    (tmp_path / "stage1.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="stage1.safetensors.*(truncated|corrupt)"):
        WorldModel.from_pretrained(tmp_path)
    # weights of another architecture under the right name
    other = ConsistencyDecoder(DecoderConfig(ch=16, z_ch=32, z_blocks=1, trunk_blocks=1, emb_dim=32))
    save_release(tmp_path / "stage1.safetensors", other.state_dict(), "stage1", Stage1Config())
    with pytest.raises(ValueError, match="do not match"):
        WorldModel.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        WorldModel.from_pretrained(tmp_path / "nope")


def test_sampler_counts_denoiser_calls():
    calls = []
    dec = ConsistencyDecoder(DecoderConfig(ch=16, z_ch=16, z_blocks=1, trunk_blocks=1, emb_dim=16)).eval()
    orig = dec.forward
    dec.forward = lambda *a: calls.append(1) or orig(*a)
    z = torch.zeros(2, 8, 16, 16)
    for steps in (1, 2, 4):
        calls.clear()
        x = decode(dec, z, steps, generator=torch.Generator().manual_seed(0))
        assert len(calls) == steps and x.shape == (2, 3, 128, 128) and x.abs().max() <= 1


@pytest.mark.slow
def test_resume_after_interruption(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    args = ["train", "stage1", "--data", tiny_dataset, "--out", out, "--steps", 8, "--batch", 2, "--preset", "tiny",
            "--crop", 32, "--eval-every", 100, "--ckpt-every", 4, "--warmup", 1]
    run_iws(*args, "--max-minutes", 0)  # stops at the first checkpoint, like a killed run
    first = json.loads((out / "train_result.json").read_text())
    assert first["step"] == 4 and first["finished"] is False
    proc = run_iws(*args)
    assert "resumed" in proc.stderr and json.loads((out / "train_result.json").read_text())["step"] == 8
    # a different model config must not silently resume into the same directory
    bad = run_iws("train", "stage1", "--data", tiny_dataset, "--out", out, "--steps", 8, "--batch", 2, check=False)
    assert bad.returncode == 2 and "another run" in bad.stderr


def test_torchrun_ddp_two_cpu_processes(tiny_dataset, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533", "-m", "iws_gym.training.train",
           "stage1", "--data", str(tiny_dataset), "--out", str(out), "--steps", 4, "--batch", 2, "--preset", "tiny",
           "--crop", 32, "--eval-every", 100, "--ckpt-every", 100, "--warmup", 1]
    proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "train_result.json").read_text())["step"] == 4
    assert (out / "stage1.safetensors").is_file()


def test_recon_command_reports_quality_and_latency(tiny_stage1, tmp_path):
    out = tmp_path / "recon.json"
    run_iws("eval", "recon", "--checkpoint", tiny_stage1, "--frames", 8, "--steps", 1, 2, "--json", out,
            "--grid", tmp_path / "g.png", "--sigma-mid", 0.1, 0.4)
    r = json.loads(out.read_text())
    assert set(r["by_steps"]) == {"1", "2"} and r["frames"] == 8
    for s in r["by_steps"].values():
        assert s["encode_decode_ms_p50"] > 0 and 0 < s["psnr"] <= 100 and "block_px_median_vs_original" in s
    assert set(r["two_step_psnr_by_sigma_mid"]) == {"0.1", "0.4"} and (tmp_path / "g.png").stat().st_size > 1000


def test_release_writes_weights_and_provenance(tiny_stage1, tmp_path):
    dest = tmp_path / "ck"
    run_iws("release", "--run", tiny_stage1, "--stage", "stage1", "--dest", dest)
    prov = json.loads((dest / "provenance.json").read_text())["stage1"]
    assert prov["command"].startswith("iws train stage1 --data") and prov["data_seed"] == 7 and prov["steps"] == 12
    assert (dest / "stage1.safetensors").is_file() and "## stage1" in (dest / "PROVENANCE.md").read_text()
    WorldModel.from_pretrained(dest, device="cpu")


def test_release_promotes_a_candidate_with_its_provenance(tiny_stage1, tmp_path):
    cand, dest = tmp_path / "cand", tmp_path / "ck"
    run_iws("release", "--run", tiny_stage1, "--stage", "stage1", "--dest", cand)
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"summary": {"psnr": 30.0}}))
    run_iws("release", "--run", cand, "--stage", "stage1", "--dest", dest, "--report", report)
    old, new = (json.loads((d / "provenance.json").read_text())["stage1"] for d in (cand, dest))
    assert (dest / "stage1.safetensors").read_bytes() == (cand / "stage1.safetensors").read_bytes()
    assert new["command"] == old["command"] and new["steps"] == old["steps"] and new["promoted_from"] == str(cand)
    assert new["reports"] == {str(report): {"psnr": 30.0}} and "promoted from" in (dest / "PROVENANCE.md").read_text()
    r = run_iws("release", "--run", cand, "--stage", "stage1", "--dest", dest, "--report", tmp_path / "no.json",
                check=False)
    assert r.returncode == 2 and "no.json" in r.stderr
    assert json.loads((dest / "provenance.json").read_text())["stage1"] == new  # nothing written on error
    run_iws("release", "--run", dest, "--stage", "stage1", "--dest", dest)  # in place: same weights, chain kept
    again = json.loads((dest / "provenance.json").read_text())["stage1"]
    assert again["promoted_from"] == str(cand) and again["reports"] == new["reports"]
    assert (dest / "stage1.safetensors").read_bytes() == (cand / "stage1.safetensors").read_bytes()


def test_part_warp_moves_the_part_rigidly_at_every_resolution():
    from iws_gym.models.decoder import random_part_warps, warp

    # a disc of radius 0.5 about (0, 0) shifted right by 0.25 (an eighth of the width), not rotated
    params = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.25, 0.0]])
    for size in (16, 32, 128):
        x = torch.zeros(1, 1, size, size)
        x[0, 0, size // 2, size // 2] = 1.0          # a dot inside the part
        x[0, 0, 1, 1] = 2.0                          # and one outside it
        y = warp(x, params)
        assert y[0, 0, size // 2, size // 2 + size // 8] == 1.0 and y[0, 0, 1, 1] == 2.0
        assert y.sum() == x.sum()
    # a rotation by angle a about the centre: a dot at offset (d, 0) lands at d (cos a, sin a)
    params = torch.tensor([[0.0, 0.0, 0.9, 0.3, 0.0, 0.0]])
    x = torch.zeros(1, 1, 128, 128)
    x[0, 0, 64 - 1 : 64 + 1, 64 + 32 - 1 : 64 + 32 + 1] = 1.0   # about offset (0.5, 0) in [-1, 1] units
    y = warp(x, params)[0, 0]
    ys, xs = torch.nonzero(y > 0.1, as_tuple=True)
    cy, cx = (ys.float() + 0.5).mean() / 64 - 1, (xs.float() + 0.5).mean() / 64 - 1
    assert abs(cx - 0.5 * math.cos(0.3)) < 0.02 and abs(cy - 0.5 * math.sin(0.3)) < 0.02
    p = random_part_warps(64, generator=torch.Generator().manual_seed(0))
    assert p.shape == (64, 6) and (p[:, 2] >= 0.2).all() and (p[:, 3].abs() <= 0.3).all()


def test_warp_share_trains_frames_and_latents_moved_together(monkeypatch):
    """With warp_share, the first share of the batch is decoded from its latent moved by a part warp, against
    the frame moved by the same warp; the rest is left as it was."""
    from iws_gym.models import decoder as D

    torch.manual_seed(0)
    cfg = D.Stage1Config(warp_share=0.5, z_noise=0.0)
    cfg.encoder = dataclasses.replace(cfg.encoder, ch=(16, 32), blocks=(1, 1))
    cfg.decoder = dataclasses.replace(cfg.decoder, z_ch=32, z_blocks=1, ch=16, z_blocks32=1, trunk_blocks=1, emb_dim=32)
    m = D.Stage1(cfg)
    params = torch.tensor([[0.1, -0.2, 0.5, 0.2, 0.1, 0.05], [0.0, 0.0, 0.6, -0.1, -0.1, 0.0]])
    monkeypatch.setattr(D, "random_part_warps", lambda n, device="cpu", generator=None: params[:n])
    seen = {}
    monkeypatch.setattr(D, "decoder_loss", lambda dec, x, z, *a: seen.update(x=x, z=z) or (x.sum(), {}))
    x = torch.rand(4, 3, 64, 64) * 2 - 1
    m.loss(x, 0)
    z = m.encoder(x)
    torch.testing.assert_close(seen["x"][:2], D.warp(x[:2], params))
    torch.testing.assert_close(seen["z"][:2], D.warp(z[:2], params))
    torch.testing.assert_close(seen["x"][2:], x[2:])
    torch.testing.assert_close(seen["z"][2:], z[2:])
    assert not torch.allclose(seen["x"][:2], x[:2])


def test_export_release_writes_a_running_stage_and_keeps_existing_files(tiny_stage1, tmp_path):
    from iws_gym.models.decoder import Stage1

    out = tmp_path / "mid"
    rep = json.loads(run_iws("export", "release", "--run", tiny_stage1, "--out", out).stdout)
    assert rep["stage"] == "stage1" and rep["run_step"] == 12
    cfg, sd, meta = load_release(out / "stage1.safetensors", "stage1", Stage1Config)
    assert meta["exported_mid_run"] is True
    Stage1(cfg).load_state_dict({k: v.float() for k, v in sd.items()})  # a complete, loadable stage
    proc = run_iws("export", "release", "--run", tiny_stage1, "--out", out, check=False)
    assert proc.returncode != 0 and "exists" in proc.stderr


def test_time_schedule_decays_over_the_budget_and_ends_at_its_floor(tiny_dataset, tmp_path):
    from iws_gym.training.train import TrainArgs, lr_at

    a = TrainArgs(lr=1.0, warmup=2, steps=1000, max_minutes=1.0, time_schedule=True)
    assert lr_at(0, a) == 0.5 and lr_at(500, a, 0.0) > 0.5  # warm-up, then the step schedule ...
    assert abs(lr_at(10, a, 1.0) - 0.1) < 1e-9 and lr_at(10, a, 0.5) < lr_at(10, a, 0.1)  # ... or the clock's, earlier
    args = ["train", "stage1", "--data", tiny_dataset, "--out", tmp_path / "run", "--steps", 100000, "--batch", 2,
            "--preset", "tiny", "--crop", 32, "--eval-every", 100000, "--ckpt-every", 100000, "--warmup", 1]
    bad = run_iws(*args, "--time-schedule", check=False)
    assert bad.returncode == 2 and "--time-schedule needs --max-minutes" in bad.stderr
    run_iws(*args, "--time-schedule", "--max-minutes", 0.05)  # 3 s of training: done, at the floor, released
    r = json.loads((tmp_path / "run" / "train_result.json").read_text())
    assert r["finished"] and r["time_budget_spent"] and 0 < r["step"] < 100000
    assert (tmp_path / "run" / "stage1.safetensors").is_file()
    # --deadline: the budget ends at a moment, counted from the end of loading (runs that load unevenly end together)
    import time

    bad = run_iws(*args[:5], tmp_path / "run2", *args[6:], "--deadline", time.time() + 30, check=False)
    assert bad.returncode == 2 and "--deadline needs --time-schedule" in bad.stderr
    run_iws(*args[:5], tmp_path / "run3", *args[6:], "--time-schedule", "--max-minutes", 60, "--deadline", time.time() + 30)
    r = json.loads((tmp_path / "run3" / "train_result.json").read_text())
    assert r["finished"] and r["time_budget_spent"] and r["wall_s"] < 60
