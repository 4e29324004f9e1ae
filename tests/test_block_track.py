"""The block track: maps of the T at its pose, windows that carry the recorded poses, releases upgraded
to it without changing their function, and the env reading the pose from each decoded frame."""
import dataclasses
import shutil

import numpy as np
import pytest
import torch

from iws_gym.dynamics import DynamicsConfig, Stage2, block_maps
from iws_gym.groundtruth import T_AREA_CENTROID, rot
from iws_gym.world_model import WorldModel, frames_block_pose, update_block_track

from .conftest import run_iws
from .test_stage2 import _counting_latents

COEF = (0.7, -0.1, 0.3, 0.1, 0.7, 0.3)  # an agent motion law (any: the block track rides in its rows)


def test_block_maps_draw_the_T_where_its_pose_puts_it():
    pose = torch.tensor([[[200.0, 300.0, 0.0], [330.0, 150.0, 2.0]]])  # (B=1, T=2, 3)
    m = block_maps(pose, torch.tensor([[True, True]]), 64)               # (1, 2, 3, 64, 64), cells of 8 canvas px
    cov = m[0, :, 0]
    np.testing.assert_allclose(cov.sum((1, 2)).numpy(), 6300 / 64.0, rtol=0.03)  # the T's area, in cells
    g = (np.arange(64) + 0.5) * 8
    for t in range(2):
        w = cov[t].numpy()
        centroid = np.array([(w.sum(0) * g).sum(), (w.sum(1) * g).sum()]) / w.sum()
        want = pose[0, t, :2].numpy() + rot(float(pose[0, t, 2])) @ T_AREA_CENTROID
        np.testing.assert_allclose(centroid, want, atol=2.0)
    # the angle channels are the coverage times cos and sin of the angle
    np.testing.assert_allclose(m[0, 1, 1].numpy(), (cov[1] * np.cos(2.0)).numpy(), atol=1e-6)
    np.testing.assert_allclose(m[0, 1, 2].numpy(), (cov[1] * np.sin(2.0)).numpy(), atol=1e-6)
    # an invalid (padded) slot has no map
    assert block_maps(pose, torch.tensor([[True, False]]), 16)[0, 1].abs().max() == 0


def test_windows_carry_the_block_poses_of_their_frames():
    lat = _counting_latents()
    K = 3
    lat.agent = [np.zeros((len(z), 2), np.float32) for z in lat.latents]
    lat.block = [np.stack([np.arange(len(z)), 1000 + np.arange(len(z)), np.zeros(len(z))], 1).astype(np.float32)
                 for z in lat.latents]
    ctx, act, tgt, nv = lat.sample_rollout(np.random.default_rng(0), 64, K, 1)
    assert act.shape == (64, K + 1, 7)
    frame_of_ctx = ctx[:, :, 0, 0, 0]
    for b in range(64):
        real = slice(K - int(nv[b]), K)
        # the recorded pose of each slot's frame, jittered by a few px (as a fit on a predicted frame is)
        np.testing.assert_allclose(act[b, real, 4].numpy(), frame_of_ctx[b, real].numpy(), atol=10.0)
        np.testing.assert_allclose(act[b, real, 5].numpy(), 1000 + frame_of_ctx[b, real].numpy(), atol=10.0)
        assert (act[b, : K - int(nv[b])] == 0).all()
    jitter = act[:, :, 4] - torch.cat([frame_of_ctx, tgt[:, :1, 0, 0, 0]], 1)
    assert 1.0 < float(jitter[act[:, :, 1] != 0].std()) < 3.0
    lat.block_jitter = None  # held-out windows: the exact recorded poses
    ctx, act, tgt, nv = lat.sample_rollout(np.random.default_rng(0), 64, K, 1)
    real = act[:, :, 1] != 0
    np.testing.assert_array_equal(act[:, :, 4][real].numpy(), torch.cat([ctx[:, :, 0, 0, 0], tgt[:, :1, 0, 0, 0]], 1)[real].numpy())


def test_block_maps_added_to_a_release_keep_its_function():
    from iws_gym.stages import add_block_map_inputs

    for hires in (0, 8):
        torch.manual_seed(0)
        cfg0 = DynamicsConfig(ch=16, blocks=1, heads=2, emb_dim=16, context=2, hires_ch=hires, agent_motion=COEF)
        m0, m1 = Stage2(cfg0), Stage2(dataclasses.replace(cfg0, block_track=True))
        for p in m0.parameters():
            torch.nn.init.normal_(p, std=0.2)
        m1.load_state_dict(add_block_map_inputs(m0.state_dict(), m1.cfg))
        g = torch.Generator().manual_seed(0)
        ctx, act = torch.randn(3, 2, 8, 16, 16, generator=g) * 0.3, torch.rand(3, 2, 4, generator=g) * 512
        nv, noise = torch.tensor([1, 2, 2]), torch.randn(3, 2, 8, 16, 16, generator=g)
        pose = torch.cat([torch.rand(3, 2, 2, generator=g) * 512, torch.rand(3, 2, 1, generator=g) * 6 - 3], 2)

        def pred(m, a):
            return m.predict(ctx, a, nv, generator=torch.Generator().manual_seed(1), ctx_noise=noise)

        torch.testing.assert_close(pred(m1, torch.cat([act, pose], 2)), pred(m0, act))
        with pytest.raises(ValueError, match=r"tracks the agent and the block: actions must be \(B, K, 7\)"):
            pred(m1, act)
        with torch.no_grad():
            m1.net.inp.weight.normal_(std=0.2)  # trained input weights: now the block's pose matters
        moved = pose.clone()
        moved[..., :2] = 512 - moved[..., :2]
        assert (pred(m1, torch.cat([act, moved], 2)) - pred(m1, torch.cat([act, pose], 2))).abs().max() > 1e-3
    with pytest.raises(ValueError, match="needs the agent track"):
        Stage2(DynamicsConfig(ch=16, blocks=1, heads=2, emb_dim=16, context=2, block_track=True))


def test_the_track_holds_the_last_pose_where_a_frame_shows_no_block(tiny_dataset):
    from iws_gym.data import list_episodes, read_episode

    ep = read_episode(list_episodes(tiny_dataset)[0])
    blank = np.full((128, 128, 3), 255, np.uint8)
    track = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    out = update_block_track(track, np.stack([ep["frames"][5], blank]))
    np.testing.assert_allclose(out[0, :2].numpy(), ep["block_pose"][5, :2], atol=4.0)  # read from the frame
    np.testing.assert_array_equal(out[1].numpy(), [4.0, 5.0, 6.0])                     # held
    seq = update_block_track(track[:1], np.stack([blank, ep["frames"][3], blank]), hold=True)
    np.testing.assert_array_equal(seq[0].numpy(), [1.0, 2.0, 3.0])
    np.testing.assert_allclose(seq[2].numpy(), seq[1].numpy())


def test_block_track_release_trains_and_runs_in_the_envs(tiny_dataset, tiny_checkpoint, tmp_path):
    from iws_gym.checkpoint import load_release
    from iws_gym.data import list_episodes, read_episode
    from iws_gym.env import WorldSimEnv
    from iws_gym.vector_env import WorldSimVectorEnv

    proc = run_iws("train", "stage2", "--data", tiny_dataset, "--init", tiny_checkpoint, "--finetune", tiny_checkpoint,
                   "--block-track", "--out", tmp_path / "no", "--steps", 1, check=False)
    assert proc.returncode != 0 and "--block-track needs --agent-track" in proc.stderr
    out = tmp_path / "btrack"
    run_iws("train", "stage2", "--data", tiny_dataset, "--init", tiny_checkpoint, "--finetune", tiny_checkpoint,
            "--agent-track", "--block-track", "--corrupt-block", 0.5, "--out", out, "--steps", 2, "--batch", 4,
            "--lr", 1e-3, "--eval-every", 2, "--warmup", 1)
    cfg, _, meta = load_release(out / "stage2.safetensors", "stage2", DynamicsConfig)
    assert cfg.block_track and meta["block_track"]
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, ck)
    shutil.copy(out / "stage2.safetensors", ck)
    wm = WorldModel.from_pretrained(ck, device="cpu", stages=("stage1", "stage2"))
    assert wm.tracks_block
    ep = read_episode(list_episodes(tiny_dataset)[0])
    z0 = wm.encode(ep["frames"][:1])
    with pytest.raises(ValueError, match="needs block_pose"):
        wm.start(z0, ep["agent_pos"][:1])
    state = wm.start(z0, ep["agent_pos"][:1], ep["block_pose"][:1])
    frames = wm.step(state, torch.as_tensor(ep["actions"][:1]), generator=torch.Generator().manual_seed(0))
    assert state["acts"].shape == (1, cfg.context, 7)
    np.testing.assert_allclose(state["acts"][0, -1, 4:7].numpy(), ep["block_pose"][0], atol=1e-4)  # the pose it started at
    want = update_block_track(torch.as_tensor(ep["block_pose"][:1]), frames)                     # then the new frame's
    np.testing.assert_allclose(state["block"].numpy(), want.numpy())
    # a rollout and teacher-forced predictions read the poses from the real frames
    assert wm.rollout(ep["frames"][0], ep["actions"][:2]).shape == (3, 128, 128, 3)
    assert wm.predict_teacher_forced(ep["frames"][:4], ep["actions"][:3]).shape == (3, 128, 128, 3)
    with pytest.raises(ValueError, match="no T block found"):
        wm.rollout(np.full((128, 128, 3), 255, np.uint8), ep["actions"][:2], agent_pos=np.array([[256.0, 256.0]]))
    # the envs start the track at the reset frame's block
    start = [100.0, 400.0, 300.0, 300.0, 0.5]
    env = WorldSimEnv(world_model=wm)
    env.reset(seed=0, options={"reset_to_state": start})
    np.testing.assert_allclose(env._state["block"][0].numpy(), frames_block_pose(env._frame[None])[0])
    env.step(np.array([400.0, 100.0], np.float32))
    venv = WorldSimVectorEnv(num_envs=2, world_model=wm)
    venv.reset(seed=0, options={"reset_to_states": np.array([start, [300.0, 200.0, 250.0, 250.0, 0.0]])})
    np.testing.assert_allclose(venv._state["block"].numpy(), frames_block_pose(venv._frames))
    venv.step(np.array([[400.0, 100.0], [300.0, 200.0]], np.float32))
    # fine-tuning a block-track release needs the poses
    proc = run_iws("train", "stage2", "--data", tiny_dataset, "--init", tiny_checkpoint, "--finetune", out,
                   "--agent-track", "--out", tmp_path / "again", "--steps", 1, check=False)
    assert proc.returncode != 0 and "--block-track" in proc.stderr
