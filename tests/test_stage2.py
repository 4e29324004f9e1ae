import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from iws_gym.models.dynamics import DynamicsConfig, Stage2
from iws_gym.models.world_model import WorldModel

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
    run_iws("eval", "fidelity", "--checkpoint", ck, "--horizon", 3, "--episodes", 1, "--json", rep,
            "--dynamics-sampler", "euler", "--dynamics-steps", 3, "--ctx-sigma", 0.05)
    r = json.loads(rep.read_text())
    assert r["model_kind"] == "open_loop_rollout" and r["dynamics_sampler"] == "euler" and r["dynamics_steps"] == 3
    assert r["ctx_sigma"] == 0.05 and r["precision"] in ("bf16", "fp32")
    # the level reaches the dynamics: the network is given the context noised at that level, and the level
    # itself as conditioning (checked on its inputs: this barely trained tiny network hardly reacts to them)
    from iws_gym.models.world_model import load_predictor
    from iws_gym.models.world_model import RolloutSettings

    assert [load_predictor(ck, RolloutSettings(ctx_sigma=s))[1].ctx_sigma for s in (0.0, 0.1)] == [0.0, 0.1]
    s2 = WorldModel.from_pretrained(ck, device="cpu", stages=("stage1", "stage2"), dtype=torch.float32).stage2
    c = s2.cfg
    ctx = torch.randn(1, c.context, c.latent_ch, c.latent_size, c.latent_size, generator=torch.Generator().manual_seed(0))
    act, nv = torch.full((1, c.context, 2), 256.0), torch.tensor([c.context])
    seen, context = {}, s2.context

    def spy(ctx_in, ctx_sigma, *rest):  # records the context and level the network is given
        seen.setdefault(round(float(ctx_sigma[0]), 6), (ctx_in, ctx_sigma))
        return context(ctx_in, ctx_sigma, *rest)

    s2.context = spy
    for s in (0.0, 0.1):
        s2.predict(ctx, act, nv, generator=torch.Generator().manual_seed(1), ctx_sigma=s)
    (ctx0, lvl0), (ctx1, lvl1) = seen[0.0], seen[0.1]
    assert torch.allclose(ctx0, s2.norm(ctx)) and lvl0.tolist() == [0.0] and lvl1.tolist() == pytest.approx([0.1])
    assert 0.05 < (ctx1 - ctx0).std().item() < 0.2  # noise of std 0.1 on the normalised context
    # out of the trained range it is refused, naming the flag
    proc = run_iws("eval", "fidelity", "--checkpoint", ck, "--horizon", 2, "--episodes", 1, "--ctx-sigma", 0.5, check=False)
    assert proc.returncode == 2 and "ctx_sigma" in proc.stderr


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


def test_sampler_steps_reuse_the_context_stream_exactly():
    """predict computes the window's part once (Stage2.context) for every sampler step: the same numbers as
    running the whole network at each step."""
    from iws_gym.models import schedule
    from iws_gym.models.sampler import euler_sample

    m = _randomised(dataclasses.replace(TINY, objective="denoise", sample_steps=3))
    ctx, act = _inputs()
    nv = torch.tensor([3, 1])
    noise = torch.randn(ctx.shape, generator=torch.Generator().manual_seed(2))
    cached = m.predict(ctx, act, nv, generator=torch.Generator().manual_seed(0), ctx_noise=noise)
    c = m.cfg
    ctx_n = m.norm(ctx) + c.ctx_sigma * noise
    cs = torch.full((2,), c.ctx_sigma)
    D = lambda x_t, s: m.denoise(x_t[:, None], s[:, None], ctx_n, cs, act, nv)[:, 0]  # noqa: E731  whole network
    sig = schedule.karras_sigmas(3, c.sigma_min, c.sigma_max).flip(0)
    y = euler_sample(D, (2, c.latent_ch, c.latent_size, c.latent_size), sig, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(cached, ctx[:, -1] + m.unnorm_delta(y), rtol=1e-5, atol=1e-6)


def test_per_frame_context_noise_spans_the_range_and_spares_the_last_frame():
    """Diffusion-Forcing context noise: each frame but the last at its own level, half of them up to sigma_max;
    the last frame (the change is denoised relative to it) stays in [0, ctx_sigma_max]."""
    m = Stage2(dataclasses.replace(TINY, ctx_noise="per_frame", objective="denoise"))
    torch.manual_seed(0)
    B, K = 256, TINY.context
    batch = (torch.rand(B, K, 8, 16, 16), torch.rand(B, K, 2) * 512, torch.rand(B, 8, 16, 16), torch.full((B,), K), None)
    _, _, _, sig, *_ = m._window(batch)
    assert sig.shape == (B, K)
    assert (sig[:, -1] <= TINY.ctx_sigma_max).all() and (sig[:, :-1] > 1.0).float().mean() > 0.1
    assert (sig[:, 0] != sig[:, 1]).all()  # each frame its own level
    loss, logs = m.loss(batch, 0)
    assert torch.isfinite(loss)
    _, _, _, sig, *_ = Stage2(TINY)._window(batch)  # the default: one level for the window, in the small range
    assert (sig == sig[:, :1]).all() and (sig <= TINY.ctx_sigma_max).all()


def test_dynamics_run_on_a_near_pixel_latent():
    """A 4x32x32 latent (stage 1's `pixel` preset): the trunk still works on 8x8 tokens (patch 4), the
    refinement head at the latent's own 32x32, and the output has the latent's shape."""
    cfg = dataclasses.replace(TINY, latent_ch=4, latent_size=32, patch=4)
    m = _randomised(cfg)
    g = torch.Generator().manual_seed(0)
    ctx, act = torch.rand(2, 3, 4, 32, 32, generator=g) * 2 - 1, torch.rand(2, 3, 2, generator=g) * 512
    out = _predict(m, ctx, act, torch.tensor([3, 2]))
    assert out.shape == (2, 4, 32, 32) and torch.isfinite(out).all()
    assert m.net.inp.stride == (4, 4)


def test_flow_warp_moves_content_by_whole_cells_and_zero_flow_is_identity():
    from iws_gym.models.dynamics import flow_warp
    z = torch.zeros(1, 2, 8, 8)
    z[0, :, 3, 2] = 1.0
    assert torch.equal(flow_warp(z, torch.zeros(1, 2, 8, 8)), z)
    flow = torch.zeros(1, 2, 8, 8)
    flow[0, 0] = 2.0   # two cells to the right
    flow[0, 1] = -1.0  # one cell up
    moved = flow_warp(z, flow)
    assert moved[0, 0, 2, 4] == pytest.approx(1.0, abs=1e-5) and moved.sum().item() == pytest.approx(2.0, abs=1e-4)


@pytest.mark.parametrize("flow", ["dense", "rigid", "gated"])
def test_transport_starts_as_the_plain_design_and_its_flow_learns_a_shift(flow):
    """With transport, an untrained flow head moves nothing (the prediction is the plain design's); training it
    on windows whose next latent is the last one shifted by a cell teaches it that shift (a gated flow opens
    its gate there)."""
    gate = 0.01 if flow == "gated" else 0.0
    cfg = dataclasses.replace(TINY, transport=True, objective="denoise", latent_ch=4, latent_size=16, patch=2,
                              flow="dense" if flow == "gated" else flow, flow_gate_weight=gate)
    torch.manual_seed(0)
    m = Stage2(cfg)
    g = torch.Generator().manual_seed(0)
    B, K = 16, cfg.context

    def batch():
        blob = torch.zeros(B, 4, 16, 16)
        r, c = torch.randint(4, 12, (2, B), generator=g)
        for i in range(B):
            blob[i, :, r[i] - 1:r[i] + 2, c[i] - 1:c[i] + 2] = 1.0
        ctx = blob[:, None].expand(B, K, 4, 16, 16).clone()
        return ctx, torch.full((B, K, 2), 256.0), torch.roll(blob, 1, dims=-1), torch.full((B,), K), None

    ctx, act, tgt, nv, _ = batch()
    plain = Stage2(dataclasses.replace(cfg, transport=False))
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("net.flow.")})
    noise = torch.zeros_like(ctx)
    torch.testing.assert_close(m.predict(ctx, act, nv, ctx_noise=noise, generator=torch.Generator().manual_seed(0)),
                               plain.predict(ctx, act, nv, ctx_noise=noise, generator=torch.Generator().manual_seed(0)))
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    for _ in range(150):
        loss, logs = m.loss(batch(), 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert logs["flow_mse"] < 0.3 * m.norm_delta(tgt - ctx[:, -1]).pow(2).mean().item()
    cache = m.context(m.norm(ctx), torch.zeros(B), act, nv)
    on_blob = ctx[:, -1, 0] > 0.5
    assert cache["flow"][:, 0][on_blob].mean() > 0.5  # content moves right
    if flow == "gated":  # open on what moves, shut on the empty rest
        g = cache["flow_gate"][:, 0]
        empty = (ctx[:, -1, 0] < 0.5) & (tgt[:, 0] < 0.5)
        assert g[on_blob].mean() > 2 * g[empty].mean()


def test_rigid_flow_turns_a_slot_about_its_centroid():
    """One slot covering everything, turned by 90 degrees: each cell's source is its position turned back about
    the centre; with the background mask at 1 nothing moves."""
    from iws_gym.models.dynamics import rigid_flow

    H = 8
    motion = lambda f: torch.tensor([[[np.pi / 2, 0.0, 0.0]]]).expand(f.shape[0], f.shape[1], 3)  # noqa: E731
    motion.parameters = lambda: iter([torch.zeros(1)])
    masks = torch.zeros(1, 2, H, H)
    masks[:, 0] = 1.0
    flow = rigid_flow(masks, torch.zeros(1, 3, H, H), motion)
    q = torch.tensor([6.5, 4.5])   # a cell right of the centre (4, 4)...
    src = q - flow[0, :, 4, 6]      # ... came from below or above it, 2.5 cells away
    assert torch.allclose((src - 4.0).abs().sort().values, torch.tensor([0.5, 2.5]), atol=1e-5)
    masks = torch.zeros(1, 2, H, H)
    masks[:, 1] = 1.0
    assert rigid_flow(masks, torch.zeros(1, 3, H, H), motion).abs().max() < 1e-6


def _counting_latents(lengths=(30, 40)):
    """LatentEpisodes whose frame t is filled with the value t (and action t = (t, -t)), for alignment checks."""
    from iws_gym.data.latents import LatentEpisodes

    lat = object.__new__(LatentEpisodes)
    lat.latents = [torch.arange(n + 1, dtype=torch.float16)[:, None, None, None].expand(n + 1, 8, 16, 16).clone() for n in lengths]
    lat.actions = [np.stack([np.arange(n), -np.arange(n)], 1).astype(np.float32) for n in lengths]
    lat.erased = None
    lat.corrupted = None
    lat.agent = None
    return lat


class _PlusOne:
    """A stand-in dynamics model that predicts z_{t+1} = z_t + 1 and checks the actions it is given."""

    def predict(self, ctx, actions, n_valid, agent=None, steps=1, generator=None):
        last = ctx[:, -1, 0, 0, 0]
        assert torch.equal(actions[:, -1, 0], last.to(actions.dtype))  # the action taken at the last context frame
        return ctx[:, -1] + 1


def test_rollout_windows_line_up_with_their_targets():
    from iws_gym.training.stage2 import open_loop

    lat, K, R = _counting_latents(), 4, 5
    ctx, act, tgt, nv, ag = lat.sample_rollout(np.random.default_rng(0), 64, K, R)
    assert ctx.shape == (64, K, 8, 16, 16) and act.shape == (64, K + R, 2) and tgt.shape == (64, R + 1, 8, 16, 16)
    assert ag is None  # no agent positions loaded: no agent rows
    t = ctx[:, -1, 0, 0, 0]
    for r in range(R + 1):
        assert torch.equal(tgt[:, r, 0, 0, 0], t + 1 + r)
        preds = open_loop(_PlusOne(), ctx, act, nv, None, r + 1)  # _PlusOne checks each window's last action
        assert preds.shape[1] == r + 1 and torch.equal(preds[:, -1, 0, 0, 0], tgt[:, r, 0, 0, 0])
    assert (act[:, :K][torch.arange(K)[None].expand(64, K) < (K - nv)[:, None]] == 0).all()  # padded slots: no action


def test_focus_draws_the_listed_transitions():
    lat, K = _counting_latents(), 4
    lat.hard = np.array([[0, 7], [1, 33]])
    ctx, act, tgt, nv, ag = lat.sample_rollout(np.random.default_rng(0), 200, K, 0, focus=1.0)
    assert set(ctx[:, -1, 0, 0, 0].tolist()) == {7.0, 33.0}  # only the listed transitions t -> t+1
    assert torch.equal(tgt[:, 0, 0, 0, 0], ctx[:, -1, 0, 0, 0] + 1)
    ctx, *_ = lat.sample_rollout(np.random.default_rng(0), 200, K, 0, focus=0.5)
    hits = np.isin(ctx[:, -1, 0, 0, 0].numpy(), [7.0, 33.0]).mean()
    assert 0.35 < hits < 0.7  # about half from the list, the rest uniform
    ctx, act, tgt, nv, ag = lat.sample_rollout(np.random.default_rng(0), 50, K, 5, focus=1.0)  # t moved back so R fits
    assert tgt.shape[1] == 6 and (tgt[:, -1, 0, 0, 0] <= 40).all()


def test_drop_agent_swaps_the_last_context_frames_for_agentless_ones():
    lat, K = _counting_latents(), 4
    with pytest.raises(ValueError, match="agent-erased"):
        lat.sample_rollout(np.random.default_rng(0), 8, K, 0, drop_agent=0.5)
    lat.erased = [-(z + 1) for z in lat.latents]  # the agentless twin of frame t holds -(t + 1)
    ctx, act, tgt, nv, ag = lat.sample_rollout(np.random.default_rng(0), 400, K, 0, drop_agent=0.5)
    v = ctx[:, :, 0, 0, 0]
    dropped = v < 0
    assert 0.4 < dropped[:, -1].float().mean() < 0.6  # about half the windows lose the agent
    for i in range(len(v)):
        j = int(dropped[i].sum())
        assert j <= nv[i] and dropped[i, K - j :].all()  # only the last j valid slots, a contiguous run
        t = torch.where(v[i] < 0, -v[i] - 1, v[i])  # the frame index behind each slot
        n = int(nv[i])
        assert torch.equal(t[K - n :], t[-1] - torch.arange(n - 1, -1, -1, dtype=t.dtype))  # the same frames
        assert tgt[i, 0, 0, 0, 0] == t[-1] + 1  # the target is the real next frame (it keeps the agent)
    ctx, act, tgt, nv, ag = lat.sample(np.random.default_rng(1), 100, K, drop_all=True)
    v = ctx[:, :, 0, 0, 0]
    for i in range(len(v)):
        assert (v[i, K - nv[i] :] < 0).all() and (v[i, : K - nv[i]] >= 0).all()  # every valid slot, no padding


def test_corrupt_block_swaps_the_last_context_frames_and_excludes_drop_agent():
    lat, K = _counting_latents(), 4
    with pytest.raises(ValueError, match="block-corrupted"):
        lat.sample_rollout(np.random.default_rng(0), 8, K, 0, corrupt_block=0.5)
    lat.erased = [-(z + 1) for z in lat.latents]  # the agentless twin of frame t holds -(t + 1)
    lat.corrupted = [z + 1000 for z in lat.latents]  # the corrupted-block twin of frame t holds t + 1000
    with pytest.raises(ValueError, match="<= 1"):
        lat.sample_rollout(np.random.default_rng(0), 8, K, 0, drop_agent=0.6, corrupt_block=0.6)
    ctx, act, tgt, nv, ag = lat.sample_rollout(np.random.default_rng(0), 600, K, 0, drop_agent=0.3, corrupt_block=0.3)
    v = ctx[:, :, 0, 0, 0]
    dropped, corrupted = v < 0, v >= 1000
    assert 0.22 < dropped[:, -1].float().mean() < 0.38 and 0.22 < corrupted[:, -1].float().mean() < 0.38
    assert not (dropped.any(1) & corrupted.any(1)).any()  # one kind per window
    for i in range(len(v)):
        j = int(corrupted[i].sum())
        assert j <= nv[i] and corrupted[i, K - j :].all()  # the last j valid slots, a contiguous run
        t = torch.where(v[i] < 0, -v[i] - 1, torch.where(v[i] >= 1000, v[i] - 1000, v[i]))
        n = int(nv[i])
        assert torch.equal(t[K - n :], t[-1] - torch.arange(n - 1, -1, -1, dtype=t.dtype))  # the same frames
        assert tgt[i, 0, 0, 0, 0] == t[-1] + 1  # the target is the real next frame
    ctx, act, tgt, nv, ag = lat.sample(np.random.default_rng(1), 100, K, corrupt_all=True)
    v = ctx[:, :, 0, 0, 0]
    for i in range(len(v)):
        assert (v[i, K - nv[i] :] >= 1000).all() and (v[i, : K - nv[i]] < 1000).all()  # every valid slot, no padding


def test_block_moves_reads_the_recorded_block_poses(tiny_dataset):
    from iws_gym.data.episodes import list_episodes, read_episode
    from iws_gym.data.latents import moving_transitions, recorded

    paths = list_episodes(tiny_dataset)
    hard = moving_transitions(recorded(paths, "block_pose"))
    assert hard.ndim == 2 and hard.shape[1] == 2
    for e, t in hard:
        pose = read_episode(paths[e], keys=("block_pose",))["block_pose"]
        d = pose[t + 1] - pose[t]
        assert np.abs(d[:2]).sum() > 1.0 or abs(d[2]) > 0.01


@pytest.mark.slow
def test_finetune_starts_from_the_release_and_rolls_out(tiny_dataset, tiny_checkpoint, tmp_path):
    from iws_gym.models.checkpoint import load_release

    out = tmp_path / "ft"
    run_iws("train", "stage2", "--data", tiny_dataset, "--init", tiny_checkpoint, "--finetune", tiny_checkpoint,
            "--focus", 0.5, "--drop-agent", 0.5, "--corrupt-block", 0.25, "--out", out,
            "--steps", 3, "--batch", 4, "--lr", 0, "--eval-every", 2, "--warmup", 1)
    r = json.loads((out / "train_result.json").read_text())
    assert {"open_loop_mse_step16", "open_loop_mse_step16_copy_first", "open_loop_reencoded_mse_step16"} <= set(r["eval"])
    assert r["eval"]["open_loop_reencoded_mse_step16"] != r["eval"]["open_loop_mse_step16"]  # a different loop
    _, sd0, meta0 = load_release(tiny_checkpoint / "stage2.safetensors", "stage2", DynamicsConfig)
    cfg1, sd1, meta1 = load_release(out / "stage2.safetensors", "stage2", DynamicsConfig)
    assert cfg1.ch == 16  # the release's (tiny) config, not the default one
    assert meta1["step"] == meta0["step"] + 3 and meta1["finetune_steps"] == 3 and meta1["focus"] == 0.5
    assert meta1["drop_agent"] == 0.5 and meta1["corrupt_block"] == 0.25
    assert r["eval"]["latent_mse_copy_last_corrupt_block"] > 0  # held-out windows whose context has a corrupted block
    assert r["eval"]["latent_mse_copy_last_no_agent"] > 0  # held-out windows whose context lost the agent
    assert r["eval"]["latent_mse_copy_last_block_moving"] > 0  # held-out windows in which the block moves
    for k in sd0:  # lr 0: the weights are the release's
        torch.testing.assert_close(sd1[k].float(), sd0[k].float())
    # releasing the fine-tune keeps the chain: the base run's command, total steps and wall time
    dest = tmp_path / "ck"
    run_iws("release", "--run", tiny_checkpoint.parent / "stage2_run", "--stage", "stage2", "--dest", dest)
    base = json.loads((dest / "provenance.json").read_text())["stage2"]
    run_iws("release", "--run", out, "--stage", "stage2", "--dest", dest)
    p = json.loads((dest / "provenance.json").read_text())["stage2"]
    assert p["finetuned_from"]["command"] == base["command"] and "--finetune" in p["command"]
    assert p["steps"] == base["steps"] + 3 and p["finetune_steps"] == 3
    assert p["wall_s"] == pytest.approx(base["wall_s"] + p["finetune_wall_s"], abs=0.2)
    assert "fine-tuned from the release trained by" in (dest / "PROVENANCE.md").read_text()
    run_iws("release", "--run", out, "--stage", "stage2", "--dest", dest)  # released again (e.g. with reports)
    assert json.loads((dest / "provenance.json").read_text())["stage2"] == p
    # the run resumes from its last.pt; --finetune must still name the release it started from: `dest` now
    # holds this run's own export, whose step count would shift the consistency curriculum
    args = ["train", "stage2", "--data", tiny_dataset, "--init", tiny_checkpoint, "--focus", 0.5,
            "--out", out, "--steps", 5, "--batch", 4, "--lr", 0, "--eval-every", 100, "--warmup", 1]
    proc = run_iws(*args, "--finetune", dest, check=False)
    assert proc.returncode != 0 and "--finetune" in proc.stderr and "re-released" in proc.stderr
    run_iws(*args, "--finetune", tiny_checkpoint)
    # its final export released over the intermediate one: the chain is still the base run, counted once
    run_iws("release", "--run", out, "--stage", "stage2", "--dest", dest)
    p5 = json.loads((dest / "provenance.json").read_text())["stage2"]
    assert p5["finetuned_from"] == p["finetuned_from"] and p5["steps"] == base["steps"] + 5 and p5["finetune_steps"] == 5
    assert p5["wall_s"] == pytest.approx(base["wall_s"] + p5["finetune_wall_s"], abs=0.2)


def test_step_reencodes_the_observed_frame_into_the_context(tiny_checkpoint):
    wm = WorldModel.from_pretrained(tiny_checkpoint, device="cpu", stages=("stage1", "stage2"))
    frame = np.full((1, 128, 128, 3), 255, np.uint8)
    a = torch.tensor([[300.0, 200.0]])
    base = wm
    for reencode in (True, False):
        wm = base.with_settings(reencode=reencode, reencode_every=1)  # every step (the interval: the test below)
        state = wm.start(wm.encode(frame))
        ref = {k: v.clone() for k, v in state.items()}
        z = wm.advance(ref, a, generator=torch.Generator().manual_seed(0))
        frames = wm.step(state, a, generator=torch.Generator().manual_seed(0))
        assert frames.shape == (1, 128, 128, 3) and frames.dtype == np.uint8
        expect = wm.encode(frames).float() if reencode else z
        torch.testing.assert_close(state["ctx"][:, -1].float(), expect.float())
        torch.testing.assert_close(state["ctx"][:, :-1], ref["ctx"][:, :-1])  # the rest of the window slid as usual


def test_reencode_every_k_steps_keeps_the_raw_prediction_in_between(tiny_checkpoint):
    wm = WorldModel.from_pretrained(tiny_checkpoint, device="cpu", stages=("stage1", "stage2"))
    wm = wm.with_settings(reencode=True, reencode_every=3)
    frame = np.full((2, 128, 128, 3), 255, np.uint8)
    a = torch.tensor([[300.0, 200.0], [100.0, 400.0]])
    state = wm.start(wm.encode(frame))
    state["t"][1] = 1  # the second env is one step further along (as after a vector env's partial reset)
    for step in range(1, 7):
        ref = {k: v.clone() for k, v in state.items()}
        z = wm.advance(ref, a, generator=torch.Generator().manual_seed(step))
        frames = wm.step(state, a, generator=torch.Generator().manual_seed(step))
        enc = wm.encode(frames).float()
        for b, t in enumerate((step, step + 1)):
            expect = enc[b] if t % 3 == 0 else z[b].float()
            torch.testing.assert_close(state["ctx"][b, -1].float(), expect, msg=f"env {b} at its step {t}")
    assert state["t"].tolist() == [6, 7]
    with pytest.raises(ValueError, match="reencode_every must be an int >= 1"):
        wm.with_settings(reencode_every=0)  # refused, not read as "the default"
    from iws_gym.models.world_model import RolloutSettings

    with pytest.raises(ValueError, match="reencode_every must be an int >= 1"):
        RolloutSettings(reencode_every=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        wm.settings.reencode = False  # settings are passed in, never patched


def _release_and_grown(**grow):
    """A tiny 'release' m0 (with a non-zero read-out, as after training) and a copy m1 of it with the
    config changes in `grow` (new parameters freshly initialised), plus a fixed window and a predictor."""
    torch.manual_seed(0)
    cfg0 = DynamicsConfig(ch=16, blocks=1, heads=2, emb_dim=16, context=2, hires_ch=0)
    m0, m1 = Stage2(cfg0), Stage2(dataclasses.replace(cfg0, **grow))
    torch.nn.init.normal_(m0.net.out.weight, std=0.1)  # a trained (non-zero) read-out shows new parts' effect
    m1.load_state_dict({**m1.state_dict(), **m0.state_dict()})
    g = torch.Generator().manual_seed(0)
    ctx, act = torch.randn(3, 2, 8, 16, 16, generator=g) * 0.3, torch.rand(3, 2, 2, generator=g) * 512
    nv, noise = torch.tensor([1, 2, 2]), torch.randn(3, 2, 8, 16, 16, generator=g)

    def pred(m):
        return m.predict(ctx, act, nv, generator=torch.Generator().manual_seed(1), ctx_noise=noise)

    return m0, m1, (ctx, act, nv), pred


def test_hires_head_starts_as_a_no_op_and_learns_a_correction():
    m0, m1, (ctx, act, nv), pred = _release_and_grown(hires_ch=8)
    z0 = pred(m0)
    torch.testing.assert_close(pred(m1), z0)  # zero-initialised output: the release's function, exactly
    m1.total_steps = 100
    tgt = ctx[:, -1] + 0.2 * torch.randn(3, 8, 16, 16, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.Adam(m1.net.hires.parameters(), lr=1e-2)
    for step in range(3):
        loss, _ = m1.loss((ctx, act, tgt, nv, None), step)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert m1.net.hires.out.weight.abs().max().item() > 0  # gradients reach the head through its zero output
    assert (pred(m1) - z0).abs().max().item() > 1e-4


def test_cached_episode_latents_reuses_the_cache_only_for_the_same_episodes(tmp_path):
    from iws_gym.data.latents import cached_episode_latents

    cache, calls = tmp_path / "lat.pt", []

    def build(n=(3, 5)):
        calls.append(n)
        return [torch.full((k, 2), float(k)) for k in n]

    a = cached_episode_latents(cache, [3, 5], build)
    b = cached_episode_latents(cache, [3, 5], lambda: pytest.fail("the cache should have been used"))
    assert len(calls) == 1 and all(torch.equal(x, y) for x, y in zip(a, b))
    c = cached_episode_latents(cache, [3, 6], lambda: build((3, 6)))  # other episode lengths: rebuilt
    assert len(calls) == 2 and len(c[1]) == 6 and len(cached_episode_latents(cache, [3, 6], build)[1]) == 6


def test_agent_motion_law_fits_gym_pusht_exactly(tiny_dataset):
    """The agent track's premise: gym-pusht's agent is a PD-driven body that nothing pushes back, so its
    next position is linear in its last two positions and targets. Fitted on two recorded episodes, the
    law predicts the third's agent to a hundredth of a pixel, from rest too; a wrong law would not."""
    from iws_gym.data.episodes import list_episodes, read_episode
    from iws_gym.models.dynamics import agent_landing, fit_agent_motion

    eps = [read_episode(p, keys=("agent_pos", "actions")) for p in list_episodes(tiny_dataset)]
    coef, stats = fit_agent_motion([e["agent_pos"] for e in eps[:2]], [e["actions"] for e in eps[:2]])
    assert stats["residual_px_max"] < 0.01 and stats["transitions"] == sum(len(e["actions"]) for e in eps[:2])
    assert sum(coef[:4]) == pytest.approx(1.0, abs=1e-3) and sum(coef[4:]) == pytest.approx(1.0, abs=1e-3)
    p, a = torch.as_tensor(eps[2]["agent_pos"]), torch.as_tensor(eps[2]["actions"])
    T = len(a)
    pos = torch.stack([torch.cat([p[:1], p[: T - 1]]), p[:T]], dim=1)     # (T, 2 slots, 2): frames t-1, t
    acts = torch.stack([torch.cat([a[:1], a[: T - 1]]), a], dim=1)
    nv = torch.full((T,), 2)
    nv[0] = 1  # the first step starts from a single frame (at rest)
    err = (agent_landing(pos, acts, nv, coef) - p[1:]).norm(dim=1)
    assert err.max().item() < 0.01
    err_copy = (p[:T] - p[1:]).norm(dim=1)  # the agent does move: holding it still is far off
    assert err_copy.max().item() > 5
    with pytest.raises(ValueError, match="at least one episode"):
        fit_agent_motion([p[:2].numpy()], [a[:1].numpy()])



def test_agent_motion_law_holds_an_agent_at_rest_exactly():
    """An agent commanded to stay where it is stays there to the last bit, with the shipped law's weights (which
    sum to 1 + 1e-6): a drift of a thousandth of a pixel a step flips the bf16 rounding of the decoder's agent input
    and moves a still world's T."""
    from iws_gym.models.dynamics import agent_landing

    coef = (0.697776, -0.107374, 0.295672, 0.113927, 0.704328, 0.295672)
    p = torch.rand(64, 1, 2) * 512
    pos, acts = p.expand(64, 4, 2), p.expand(64, 4, 2)
    for nv in (1, 2, 4):
        assert torch.equal(agent_landing(pos, acts, torch.full((64,), nv), coef), p[:, 0])
    moving = agent_landing(pos, acts + 10.0, torch.full((64,), 2), coef)  # a target 10 px away does move it
    assert torch.allclose(moving - p[:, 0], torch.full((64, 2), 10.0 * (coef[2] + coef[3])), atol=1e-3)

def test_agent_track_follows_the_actions_and_windows_carry_it(tiny_dataset, tiny_checkpoint, tmp_path):
    """--agent-track: the motion law is fitted and stored in the config and provenance, the windows carry the
    recorded positions, and a rollout's track moves by the law from the start frame."""
    from iws_gym.models.checkpoint import load_release
    from iws_gym.data.episodes import list_episodes, read_episode

    out = tmp_path / "track"
    proc = run_iws("train", "stage2", "--data", tiny_dataset, "--init", tiny_checkpoint, "--finetune", tiny_checkpoint,
                   "--agent-track", "--out", out, "--steps", 2, check=False)
    assert proc.returncode == 2 and "drop --agent-track" in proc.stderr  # a release's inputs are what they are
    run_iws("train", "stage2", "--data", tiny_dataset, "--init", tiny_checkpoint, "--preset", "tiny",
            "--agent-track", "--drop-agent", 0.5, "--out", out, "--steps", 2, "--batch", 4, "--lr", 1e-3,
            "--eval-every", 2, "--warmup", 1)
    cfg, sd, meta = load_release(out / "stage2.safetensors", "stage2", DynamicsConfig)
    assert len(cfg.agent_motion) == 6 and meta["agent_motion"] == list(cfg.agent_motion)
    assert meta["agent_motion_fit"]["residual_px_max"] < 0.01
    assert meta["eval"]["hold_drift_mse_step16"] >= 0.0  # the still-world check runs with an agent track
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, ck)
    shutil.copy(out / "stage2.safetensors", ck)
    wm = WorldModel.from_pretrained(ck, device="cpu", stages=("stage1", "stage2"))
    assert wm.tracks_agent
    ep = read_episode(list_episodes(tiny_dataset)[0])
    frame = ep["frames"][:1]
    with pytest.raises(ValueError, match="needs agent_pos"):
        wm.start(wm.encode(frame))
    state = wm.start(wm.encode(frame), ep["agent_pos"][:1])
    for t in range(3):
        wm.step(state, torch.as_tensor(ep["actions"][t : t + 1]), generator=torch.Generator().manual_seed(0))
        # the track is the recorded agent, by the law alone (no frame is read)
        np.testing.assert_allclose(state["agent"][0].numpy(), ep["agent_pos"][t + 1], atol=0.05)
    assert state["acts"].shape == state["agent_hist"].shape == (1, cfg.context, 2)
    # a rollout starts the track from the agent_pos it is given (the robot's proprioception), never from pixels
    frames = wm.rollout(ep["frames"][0], ep["actions"][:2], agent_pos=ep["agent_pos"][0])
    assert frames.shape == (3, 128, 128, 3)
    with pytest.raises(ValueError, match="needs agent_pos"):
        wm.rollout(ep["frames"][0], ep["actions"][:2])
    # the envs start the track at the reset state's agent and report it where a frame lacks the agent
    from iws_gym.envs.env import WorldSimEnv
    from iws_gym.tasks.pusht.pose import agent_position
    from iws_gym.envs.vector_env import WorldSimVectorEnv

    start = [100.0, 400.0, 300.0, 300.0, 0.5]
    env = WorldSimEnv(world_model=wm)
    env.reset(seed=0, options={"reset_to_state": start})
    np.testing.assert_allclose(env._state["agent"][0].numpy(), start[:2])
    obs, *_ = env.step(np.array([400.0, 100.0], np.float32))
    law = np.array(start[:2]) * cfg.agent_motion[4] + np.array([400.0, 100.0]) * cfg.agent_motion[5]
    np.testing.assert_allclose(env._state["agent"][0].numpy(), law, atol=1e-3)
    expect = law if agent_position(obs["pixels"]) is None else np.clip(agent_position(obs["pixels"]), 0, 512)
    np.testing.assert_allclose(obs["agent_pos"], expect, atol=1e-3)
    venv = WorldSimVectorEnv(num_envs=2, world_model=wm)
    venv.reset(seed=0, options={"reset_to_states": np.array([start, [300.0, 200.0, 250.0, 250.0, 0.0]])})
    np.testing.assert_allclose(venv._state["agent"].numpy(), [start[:2], [300.0, 200.0]])
    venv.step(np.array([[400.0, 100.0], [300.0, 200.0]], np.float32))
    np.testing.assert_allclose(venv._state["agent"][0].numpy(), law, atol=1e-3)
    # fine-tuning a tracking release needs the positions
    proc = run_iws("train", "stage2", "--data", tiny_dataset, "--init", tiny_checkpoint, "--finetune", out,
                   "--out", tmp_path / "track2", "--steps", 1, check=False)
    assert proc.returncode != 0 and "--agent-track" in proc.stderr


def test_windows_carry_the_agent_positions_of_their_frames():
    lat = _counting_latents()
    K = 3
    lat.agent = [np.stack([np.arange(len(z)), 1000 + np.arange(len(z))], axis=1).astype(np.float32) for z in lat.latents]
    ctx, act, tgt, nv, ag = lat.sample_rollout(np.random.default_rng(0), 64, K, 2, drop_agent=0.0)
    assert act.shape == ag.shape == (64, K + 2, 2)
    frame_of_ctx = ctx[:, :, 0, 0, 0]  # _counting_latents: each latent holds its frame index
    for b in range(64):
        real = slice(K - int(nv[b]), K)
        np.testing.assert_array_equal(ag[b, real, 0].numpy(), frame_of_ctx[b, real].numpy())
        assert (ag[b, : K - int(nv[b])] == 0).all() and (act[b, : K - int(nv[b])] == 0).all()
        np.testing.assert_array_equal(ag[b, K:, 0].numpy(), tgt[b, :2, 0, 0, 0].numpy())  # frames after the window


def test_jump_focus_draws_the_fast_agent_transitions():
    from iws_gym.data.latents import agent_jumps

    lat = _counting_latents()
    # the agent jumps 40 px into frames 11 and 21 of episode 0 and never in episode 1
    p0 = np.zeros((31, 2), np.float32)
    p0[11:, 0] += 40
    p0[21:, 1] += 40
    lat.agent = [p0, np.zeros((41, 2), np.float32)]
    lat.jumps = agent_jumps(lat.agent)
    assert lat.jumps.tolist() == [[0, 10], [0, 20]]
    lat.hard = np.array([[1, 5]])
    ctx, act, tgt, nv, ag = lat.sample_rollout(np.random.default_rng(0), 400, 3, 0, focus=0.3, jump_focus=0.5)
    t = tgt[:, 0, 0, 0, 0]  # the target frame's index
    from_jumps = np.isin(t.numpy(), [11, 21]) & (ag[:, -1, 0].numpy() >= 0)
    assert 0.4 < from_jumps.mean() < 0.65  # ~50% from the jumps (+ the odd uniform draw)
    assert 0.2 < (t == 6).float().mean() < 0.4  # ~30% from the block-moving list
    with pytest.raises(ValueError, match="jump_focus"):
        lat.sample_rollout(np.random.default_rng(0), 8, 3, 0, focus=0.6, jump_focus=0.6)


def test_training_reencodes_as_the_env_does(tiny_checkpoint):
    """The training evaluation's re-encoded open loop puts the same latents into the context as WorldModel.step."""
    from iws_gym.training.stage2 import reencode_latents

    wm = WorldModel.from_pretrained(tiny_checkpoint, device="cpu", stages=("stage1", "stage2"), dtype=torch.float32)
    z = wm.encode(np.random.default_rng(0).integers(0, 256, (3, 128, 128, 3), dtype=np.uint8))
    z = z + 0.3 * torch.randn(z.shape, generator=torch.Generator().manual_seed(1))  # off the encoder's manifold
    want = wm.encode(wm.decode(z, steps=1, generator=torch.Generator().manual_seed(5)))
    with torch.no_grad():
        got = reencode_latents(wm.stage1, z, torch.Generator().manual_seed(5))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got - z).abs().max() > 1e-2  # the round trip is not the identity on these latents


