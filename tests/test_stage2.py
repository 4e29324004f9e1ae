import json
import shutil

import numpy as np
import torch

from iws_gym.dynamics import DynamicsConfig, Stage2
from iws_gym.world_model import WorldModel

from .conftest import run_iws

TINY = DynamicsConfig(ch=16, blocks=1, heads=2, emb_dim=16, context=3)


def _inputs(B=2, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.rand(B, K, 8, 16, 16, generator=g) * 2 - 1
    act = torch.rand(B, K, 2, generator=g) * 512
    return ctx, act


def _predict(m, ctx, act, nv):
    noise = torch.zeros_like(ctx)
    return m.predict(ctx, act, nv, steps=1, generator=torch.Generator().manual_seed(0), ctx_noise=noise)


def _randomised(cfg=TINY):
    torch.manual_seed(0)
    m = Stage2(cfg).eval()
    for p in m.parameters():  # zero-initialised output layers would hide every dependency
        torch.nn.init.normal_(p, std=0.2)
    return m


def test_padded_slots_do_not_matter():
    m = _randomised()
    ctx, act = _inputs()
    nv = torch.tensor([1, 2])
    other = ctx.clone()
    other[0, :2] = torch.rand_like(other[0, :2])   # sample 0: two padded slots
    other[1, :1] = torch.rand_like(other[1, :1])   # sample 1: one padded slot
    a2 = act.clone()
    a2[0, :2] = 7.0
    torch.testing.assert_close(_predict(m, ctx, act, nv), _predict(m, other, a2, nv))


def test_time_is_mixed_and_actions_matter():
    m = _randomised()
    ctx, act = _inputs()
    nv = torch.tensor([3, 3])
    base = _predict(m, ctx, act, nv)
    earlier = ctx.clone()
    earlier[:, 0] += 0.5
    assert (base - _predict(m, earlier, act, nv)).abs().max() > 1e-4
    moved = act.clone()
    moved[:, -1] += 100
    assert (base - _predict(m, ctx, moved, nv)).abs().max() > 1e-4


def test_sampling_steps_and_shapes():
    m = Stage2(TINY).eval()
    ctx, act = _inputs()
    for steps in (1, 2, 4):
        out = m.predict(ctx, act, torch.tensor([3, 1]), steps=steps)
        assert out.shape == (2, 8, 16, 16) and torch.isfinite(out).all()


def test_train_stage2_and_roll_out(tiny_dataset, tiny_stage1, tmp_path):
    out = tmp_path / "s2"
    run_iws("train", "stage2", "--data", tiny_dataset, "--init", tiny_stage1, "--out", out, "--steps", 6, "--batch", 4,
            "--preset", "tiny", "--eval-every", 100, "--ckpt-every", 3, "--warmup", 1)
    assert json.loads((out / "train_result.json").read_text())["step"] == 6
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copy(tiny_stage1 / "stage1.safetensors", ck)
    shutil.copy(out / "stage2.safetensors", ck)
    wm = WorldModel.from_pretrained(ck, device="cpu", stages=("stage1", "stage2"))
    frames = np.zeros((128, 128, 3), np.uint8) + 255
    actions = np.random.default_rng(0).uniform(0, 512, (5, 2))
    roll = wm.rollout(frames, actions, seed=3)
    assert roll.shape == (6, 128, 128, 3) and roll.dtype == np.uint8
    np.testing.assert_array_equal(roll, wm.rollout(frames, actions, seed=3))  # same seed, same frames
    rep = tmp_path / "fid.json"
    run_iws("eval", "fidelity", "--checkpoint", ck, "--horizon", 3, "--episodes", 1, "--json", rep)
    assert json.loads(rep.read_text())["model_kind"] == "open_loop_rollout"


def test_stage2_needs_a_stage1(tiny_dataset, tmp_path):
    proc = run_iws("train", "stage2", "--data", tiny_dataset, "--init", tmp_path / "nothing", "--out", tmp_path / "o",
                   "--steps", 2, "--preset", "tiny", check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_target_variants_share_the_context_exactly():
    """Running 3 noisy targets over one context pass equals running each alone (the context is causal)."""
    m = _randomised()
    ctx, act = _inputs()
    nv = torch.tensor([3, 2])
    g = torch.Generator().manual_seed(1)
    x_t = torch.randn(2, 3, 8, 16, 16, generator=g)
    sig = torch.tensor([[0.5, 2.0, 80.0], [0.1, 1.0, 10.0]])
    cs = torch.tensor([0.01, 0.05])
    joint = m.denoise(x_t, sig, ctx, cs, act, nv)
    for v in range(3):
        alone = m.denoise(x_t[:, v : v + 1], sig[:, v : v + 1], ctx, cs, act, nv)
        torch.testing.assert_close(joint[:, v : v + 1], alone, rtol=1e-4, atol=1e-5)


def test_stage3_fine_tunes_the_decoder_on_predicted_latents(tiny_dataset, tiny_checkpoint, tmp_path):
    out = tmp_path / "s3"
    run_iws("train", "stage3", "--data", tiny_dataset, "--init", tiny_checkpoint, "--out", out, "--steps", 4,
            "--batch", 2, "--eval-every", 100, "--ckpt-every", 100, "--warmup", 1)
    r = json.loads((out / "train_result.json").read_text())
    assert {"psnr_predicted_latents_stage3_decoder", "psnr_predicted_latents_stage1_decoder"} <= set(r["eval"])
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, ck)
    shutil.copy(out / "stage3.safetensors", ck)
    wm = WorldModel.from_pretrained(ck, device="cpu", stages=("stage1", "stage2"))
    assert "stage3" in wm.meta and wm.rollout(np.full((128, 128, 3), 255, np.uint8), np.zeros((2, 2))).shape[0] == 3
