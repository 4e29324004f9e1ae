"""The compact world model (models/compact.py): release format, the WorldModel interface the envs use, a world
at rest, and clear errors."""
import json

import gymnasium as gym
import numpy as np
import pytest
import torch

from iws_gym.models.checkpoint import save_release
from iws_gym.models.compact import (STAGE1_KIND, STAGE2_KIND, CompactStage1, CompactStage1Config, CompactStage2,
                                    CompactStage2Config, CompactWorldModel, pad_first)
from iws_gym.models.world_model import WorldModel, load_predictor

LAW = (0.7, -0.1, 0.3, 0.1, 0.7, 0.3)
TINY1 = CompactStage1Config(z_dim=8, enc_widths=(8, 8, 16, 16), enc_hidden=32, dec_width=16, dec_blocks=1)
TINY2 = CompactStage2Config(z_dim=8, width=32, blocks=1, agent_motion=LAW, denoiser_blocks=1)


def _release(path, gate_bias=1.0, seed=0):
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    s1, s2 = CompactStage1(TINY1), CompactStage2(TINY2)
    for p in s2.dynamics.out.parameters():  # zero-initialised: a trained model moves z
        torch.nn.init.normal_(p, std=0.1)
    torch.nn.init.constant_(s2.dynamics.g[1].bias, gate_bias)
    save_release(path / "stage1.safetensors", s1.state_dict(), STAGE1_KIND, TINY1)
    save_release(path / "stage2.safetensors", s2.state_dict(), STAGE2_KIND, TINY2, dtype=torch.float32,
                 extra=dict(rollout=dict(reencode=False)))
    return path


@pytest.fixture
def compact(tmp_path):
    return _release(tmp_path)


def _frames(n, seed=0):
    return np.random.default_rng(seed).integers(0, 255, (n, 128, 128, 3), dtype=np.uint8)


def test_release_loads_as_compact_world_model(compact):
    wm = WorldModel.from_pretrained(compact, device="cpu", stages=("stage1", "stage2"))
    assert isinstance(wm, CompactWorldModel) and wm.tracks_agent and wm.settings.reencode is False
    z = wm.encode(_frames(3))
    assert z.shape == (3, 8) and bool((z.abs() < 1).all())
    out = wm.rollout(_frames(1)[0], np.full((5, 2), 300.0, np.float32), agent_pos=np.array([100.0, 200.0]))
    assert out.shape == (6, 128, 128, 3) and out.dtype == np.uint8


def test_agent_follows_the_motion_law(compact):
    wm = WorldModel.from_pretrained(compact, device="cpu", stages=("stage1", "stage2"))
    state = wm.start_frames(_frames(2), np.array([[100.0, 100.0], [400.0, 50.0]]))
    wm.step(state, torch.tensor([[300.0, 100.0], [400.0, 50.0]]))
    # one frame of history: p1 = d0 p0 + d1 a0
    np.testing.assert_allclose(state["agent"].numpy(), [[0.7 * 100 + 0.3 * 300, 100.0], [400.0, 50.0]], rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_closed_gate_keeps_a_world_at_rest_exact(tmp_path, dtype):
    """An agent told to stay, with weights of the motion law that sum to 1 + 1e-6 like the shipped ones: the latent,
    the agent and every pixel of the frames stay exactly as they were (in bf16 a 0.001 px drift of the agent flipped
    the rounding of the decoder's input and moved a still T)."""
    import dataclasses

    wm = WorldModel.from_pretrained(_release(tmp_path, gate_bias=-1.0), device="cpu", stages=("stage1", "stage2"),
                                    dtype=dtype)
    wm.stage2.cfg = dataclasses.replace(wm.stage2.cfg, agent_motion=(0.697776, -0.107374, 0.295672, 0.113927,
                                                                     0.704328, 0.295672))
    start = np.array([[213.7, 391.3]])
    state = wm.start_frames(_frames(1), start)
    z0, first = state["ctx"][:, -1].clone(), wm.decode_last(state)
    for _ in range(5):
        frame = wm.step(state, torch.tensor(start, dtype=torch.float32))
    assert torch.equal(state["ctx"][:, -1], z0) and float(state["gate"][0]) == 0.0
    assert np.array_equal(state["agent"].numpy(), start.astype(np.float32)) and np.array_equal(frame, first)


def test_open_gate_moves_the_world(compact):
    wm = WorldModel.from_pretrained(compact, device="cpu", stages=("stage1", "stage2"))
    state = wm.start_frames(_frames(1), np.array([[200.0, 200.0]]))
    z0 = state["ctx"][:, -1].clone()
    wm.step(state, torch.tensor([[250.0, 200.0]]))
    assert not torch.equal(state["ctx"][:, -1], z0)


def test_pad_first_repeats_the_first_valid_slot():
    x = torch.arange(8.0).view(2, 4, 1)
    out = pad_first(x, torch.tensor([1, 3]))
    assert out[0, :, 0].tolist() == [3, 3, 3, 3] and out[1, :, 0].tolist() == [5, 5, 6, 7]


def test_clear_errors(compact):
    wm = WorldModel.from_pretrained(compact, device="cpu", stages=("stage1", "stage2"))
    with pytest.raises(ValueError, match="agent_pos"):
        wm.start_frames(_frames(1))
    with pytest.raises(ValueError, match="deterministic"):
        wm.with_settings(decoder_steps=2)
    with pytest.raises(ValueError, match="agent_pos must be 2"):
        wm.start_frames(_frames(2), np.array([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="motion law"):
        CompactStage2(CompactStage2Config(agent_motion=()))


def test_env_and_vector_env_run_on_a_compact_release(compact):
    from gymnasium.utils.env_checker import check_env

    env = gym.make("IWS-TPushing-v0", checkpoint=str(compact), device="cpu")
    check_env(env.unwrapped, skip_render_check=True)
    env.reset(seed=0)
    obs, r, term, trunc, info = env.step(env.action_space.sample())
    assert env.observation_space.contains(obs) and 0.0 <= info["trust"] <= 1.0
    venv = gym.make_vec("IWS-TPushing-v0", num_envs=3, vectorization_mode="vector_entry_point", checkpoint=str(compact),
                        device="cpu", reencode=True)
    venv.reset(seed=1)
    obs, r, *_ = venv.step(venv.action_space.sample())
    assert obs["pixels"].shape[0] == 3 and r.shape == (3,)


def test_fidelity_predictor_of_a_compact_release(compact):
    kind, roll = load_predictor(compact)
    ep = dict(frames=_frames(4), actions=np.full((3, 2), 256.0, np.float32), agent_pos=np.full((4, 2), 256.0))
    assert kind == "open_loop_rollout" and roll(ep, 3).shape == (4, 128, 128, 3)


def test_train_both_stages_release_and_step(tiny_dataset, tmp_path):
    """`iws train compact1` and `compact2` at toy scale, released like the shipped weights, then stepped as an env;
    rerunning a finished stage resumes from its checkpoint instead of starting over."""
    from .conftest import run_iws

    c1, c2, rel = tmp_path / "c1", tmp_path / "c2", tmp_path / "release"
    run_iws("train", "compact1", "--data", tiny_dataset, "--out", c1, "--steps", 6, "--batch", 4, "--preset", "tiny",
            "--eval-every", 3, "--ckpt-every", 3, "--warmup", 1, "--freeze-encoder-at", 0.5)
    run_iws("train", "compact2", "--data", tiny_dataset, "--init", c1, "--out", c2, "--steps", 4, "--batch", 8,
            "--preset", "tiny", "--horizon", 4, "--eval-every", 2, "--ckpt-every", 2, "--warmup", 1)
    r2 = json.loads((c2 / "train_result.json").read_text())
    assert r2["step"] == 4 and "denoiser_rms_0.05" in r2["eval"]
    assert np.isfinite(r2["eval"]["latent_err_32"]) and np.isfinite(r2["eval"]["train_latent_err_32"])
    run_iws("train", "compact2", "--data", tiny_dataset, "--init", c1, "--out", c2, "--steps", 6, "--batch", 8,
            "--preset", "tiny", "--horizon", 4, "--eval-every", 2, "--ckpt-every", 2, "--warmup", 1)
    assert json.loads((c2 / "train_result.json").read_text())["step"] == 6
    for run, stage in ((c1, "stage1"), (c2, "stage2")):
        run_iws("release", "--run", run, "--stage", stage, "--dest", rel)
    wm = WorldModel.from_pretrained(rel, device="cpu", stages=("stage1", "stage2"))
    assert isinstance(wm, CompactWorldModel) and len(wm.stage2.cfg.agent_motion) == 6
    env = gym.make("IWS-TPushing-v0", checkpoint=str(rel), device="cpu")
    env.reset(seed=0)
    obs, *_ = env.step(env.action_space.sample())
    assert env.observation_space.contains(obs)
    # --finetune continues the released stage 2: its weights and normalisation, not a fresh network
    from safetensors.torch import load_file

    c2b = tmp_path / "c2b"
    run_iws("train", "compact2", "--data", tiny_dataset, "--init", c1, "--out", c2b, "--finetune", rel, "--steps", 1,
            "--batch", 8, "--horizon", 4, "--eval-every", 1, "--warmup", 1, "--lr", 1e-12)
    before, after = load_file(rel / "stage2.safetensors"), load_file(c2b / "stage2.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.allclose(before[k].float(), after[k].float(), atol=1e-6) for k in before)
    assert json.loads((c2b / "train_result.json").read_text())["step"] == 1


def test_compact2_needs_a_compact_stage1(tiny_dataset, tiny_stage1, tmp_path):
    from .conftest import run_iws

    with pytest.raises(Exception, match="compact_stage1"):
        run_iws("train", "compact2", "--data", tiny_dataset, "--init", tiny_stage1, "--out", tmp_path / "c2",
                "--steps", 2, "--preset", "tiny")


def test_the_cycle_term_never_trains_the_encoder():
    """|E(D(z)) - z|^2 is met by a constant z: while the encoder trains it is left out (the first full-size run's
    encoder collapsed to tanh's +-1 with it), and on the frozen encoder it reaches the decoder alone."""
    from types import SimpleNamespace

    from iws_gym.training.compact1 import Trainable

    o = SimpleNamespace(freeze_encoder_at=0.5, z_noise=0.01, fg_weight=4.0, cycle=0.5)
    model = Trainable(TINY1, o, total_steps=10)
    batch = (torch.rand(2, 3, 128, 128) * 2 - 1, torch.rand(2, 2))
    _, logs = model(batch, step=0)
    assert "cycle" not in logs
    loss, logs = model(batch, step=5)
    loss.backward()
    assert "cycle" in logs and all(p.grad is None for p in model.encoder.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.decoder.parameters())


def test_a_collapsed_stage1_is_refused_with_a_clear_error(tiny_dataset, tmp_path):
    """An encoder that maps every frame to the same z: its own training stops, and stage 2 refuses it."""
    from .conftest import run_iws
    from iws_gym.training.compact1 import Stage, Options
    from iws_gym.training.train import STAGES, TrainArgs

    s1 = CompactStage1(TINY1)
    torch.nn.init.zeros_(s1.encoder.net[-1].weight)
    torch.nn.init.constant_(s1.encoder.net[-1].bias, 9.0)  # tanh(9) = 1 for every frame
    save_release(tmp_path / "c1" / "stage1.safetensors", s1.state_dict(), STAGE1_KIND, TINY1)
    proc = run_iws("train", "compact2", "--data", tiny_dataset, "--init", tmp_path / "c1", "--out", tmp_path / "c2",
                   "--steps", 2, "--preset", "tiny", check=False)
    assert proc.returncode != 0 and "collapsed stage 1" in proc.stderr
    a = TrainArgs(**{**vars(STAGES["compact1"].defaults), "data": str(tiny_dataset), "out": str(tmp_path / "c1b")})
    stage = Stage(a, Options(preset="tiny", z_dim=TINY1.z_dim), "cpu")
    stage.model.encoder.load_state_dict(s1.encoder.state_dict())
    with pytest.raises(RuntimeError, match="stage 1 collapsed"):
        stage.evaluate(stage.model)


def test_eval_commands_use_the_release_default_of_no_reencoding(compact, tmp_path):
    from .conftest import run_iws

    run_iws("eval", "stability", "--checkpoint", compact, "--steps", 4, "--check-every", 2, "--actions", "hold",
            "--calib-episodes", 1, "--calib-steps", 5, "--json", tmp_path / "s.json")
    r = json.loads((tmp_path / "s.json").read_text())
    assert r["reencode"] is False and r["rollouts"]["hold"]["checks"] == 2
    run_iws("eval", "stability", "--checkpoint", compact, "--steps", 4, "--check-every", 2, "--actions", "hold",
            "--calib-episodes", 1, "--calib-steps", 5, "--reencode", "--json", tmp_path / "s2.json")
    assert json.loads((tmp_path / "s2.json").read_text())["reencode"] is True
    # the ground-truth replay: stage 1's round trip draws the agent where the real frames have it
    run_iws("eval", "stability", "--checkpoint", compact, "--steps", 4, "--check-every", 2, "--actions", "random",
            "--calib-episodes", 1, "--calib-steps", 5, "--ground-truth", "--json", tmp_path / "s3.json")
    g = json.loads((tmp_path / "s3.json").read_text())["rollouts"]["random"]["ground_truth"]
    assert g["real_whole_share"] == 1.0 and 0 <= g["stage1_whole_share"] <= 1 and "block_px_median" in g


def test_trust_is_the_denoisers_correction_and_free(compact, tmp_path):
    wm = WorldModel.from_pretrained(compact, device="cpu", stages=("stage1", "stage2"))
    assert wm.settings.trust
    state = wm.start_frames(_frames(1), np.array([[200.0, 200.0]]))
    calls = []
    enc = wm.stage1.encoder.forward
    wm.stage1.encoder.forward = lambda x: calls.append(1) or enc(x)
    wm.step(state, torch.tensor([[300.0, 250.0]]))
    assert not calls and float(state["denoised"][0]) > 0 and 0 < float(state["trust"][0]) <= 1
    rest = WorldModel.from_pretrained(_release(tmp_path / "rest", gate_bias=-1.0), device="cpu", stages=("stage1", "stage2"))
    state = rest.start_frames(_frames(1), np.array([[200.0, 200.0]]))
    rest.step(state, torch.tensor([[200.0, 200.0]]))
    assert float(state["denoised"][0]) == 0.0 and float(state["trust"][0]) == 1.0


def test_moving_windows_predict_the_motion():
    """--moving-share 1 places every window so that a step where the scene moves is among its predicted steps,
    never across two episodes; the default draws windows anywhere."""
    from iws_gym.training.compact2 import Latents

    lengths = [40, 30, 50]
    z = torch.zeros(sum(lengths), 3)
    z[70 + 20 :, 0] = 5.0  # the third episode's scene moves once, between its frames 19 and 20
    z[:, 1] = torch.arange(len(z)) / 100  # another dim drifts slowly everywhere (0.03 of its sd a step)
    z[:, 2] = 1.0  # and one never changes
    L = Latents(z, torch.zeros(len(z), 2), torch.zeros(len(z), 2), lengths)
    moving = L.moving_frames()
    assert moving.tolist() == [89]
    rng = np.random.default_rng(0)
    K, H = 4, 8
    idx, nv, _ = L.windows(rng, 256, K, H, moving=moving, moving_share=1.0)
    targets = idx[:, K:]
    assert bool((targets == 90).any(1).all()) and bool((idx >= 70).all())
    idx, _, _ = L.windows(rng, 256, K, H)
    assert not bool((idx[:, K:] == 90).any(1).all())


def test_finetune_refuses_a_stage2_of_another_latent(tiny_dataset, compact, tmp_path):
    from dataclasses import replace

    from .conftest import run_iws

    other = tmp_path / "other"
    other.mkdir()
    cfg = replace(TINY2, z_dim=6)
    save_release(other / "stage2.safetensors", CompactStage2(cfg).state_dict(), STAGE2_KIND, cfg, dtype=torch.float32)
    with pytest.raises(Exception, match="predicts z of 6 dims"):
        run_iws("train", "compact2", "--data", tiny_dataset, "--init", compact, "--finetune", other,
                "--out", tmp_path / "c2", "--steps", 1)


def _pushed_latents(n_eps=40, T=60, D=8):
    """Latents whose change follows the agent: z moves by a fixed map of the agent's step, a world at rest
    otherwise."""
    from iws_gym.training.compact2 import Latents

    g = torch.Generator().manual_seed(0)
    M = torch.randn(2, D, generator=g)
    zs, ps, acts = [], [], []
    for _ in range(n_eps):
        p, z = torch.rand(2, generator=g), 0.3 * torch.randn(D, generator=g)
        for t in range(T):
            a = torch.rand(2, generator=g) if t % 10 == 0 else a
            zs.append(z), ps.append(p), acts.append(a)
            p2 = p + 0.5 * (a - p)
            z, p = z + (p2 - p) @ M, p2
    return Latents(torch.stack(zs), torch.stack(ps), torch.stack(acts), [T] * n_eps)


def _train_dynamics(L, steps, **options):
    from iws_gym.training.compact2 import Options, Trainable, copy_error, normalise, open_loop_error

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    cfg = CompactStage2Config(z_dim=L.z.shape[1], width=64, blocks=2, agent_motion=(1, 0, 0, 0, 0, 0), denoiser_blocks=0)
    m = Trainable(cfg, Options(**options))
    normalise(m, L)
    opt = torch.optim.AdamW(m.parameters(), 1e-3)
    for step in range(steps):
        H = int(rng.choice([2, 8, 16]))
        idx, nv, at_rest = L.windows(rng, 64, cfg.context, H, m.o.still)
        loss, logs = m((idx, nv, at_rest, H, L), step)
        opt.zero_grad(), loss.backward(), opt.step()
    m.eval()
    with torch.no_grad():
        err, idx, tgt = open_loop_error(m.dynamics, L, np.random.default_rng(1), 256, 8)
        copy = copy_error(m.dynamics, L, idx, tgt)
    return m, (err[-1] / copy[-1]).item()


def test_the_gate_pull_waits_for_its_warm_up():
    """At step 0 the gate's L1 pull on windows at rest weighs nothing; it reaches --still-l1 after --gate-warmup."""
    L = _pushed_latents(n_eps=4)
    from iws_gym.training.compact2 import Options, Trainable

    m = Trainable(CompactStage2Config(z_dim=8, width=32, blocks=1, agent_motion=LAW, denoiser_blocks=0),
                  Options(still_l1=1.0, gate_warmup=100, ctx_noise=0.0))
    idx, nv, at_rest = L.windows(np.random.default_rng(0), 32, 4, 2, still=0.5)
    losses = [m((idx, nv, at_rest, 2, L), step)[0].item() for step in (0, 50, 100, 500)]
    gate = m((idx, nv, at_rest, 2, L), 0)[1]["gate_at_rest"]  # the gate starts open (1) everywhere
    assert gate == pytest.approx(1.0) and losses[1] - losses[0] == pytest.approx(0.5 * gate, rel=1e-4)
    assert losses[2] - losses[0] == pytest.approx(gate, rel=1e-4) and losses[3] == pytest.approx(losses[2])


def test_a_gate_pulled_shut_from_the_start_reopens_and_learns_the_motion(monkeypatch):
    """A strong L1 pull with no warm-up closes the gate everywhere before the change is learnt; with a plain
    relu it never reopens and the dynamics stay a copy of the last latent (rel_to_copy 1.0, as in the recipe's
    first stage-2 run). The gradient that opens a closed gate lets it learn the motion anyway."""
    import iws_gym.models.compact as compact

    class PlainRelu(torch.autograd.Function):  # the gate before the fix
        forward = staticmethod(lambda ctx, g: (ctx.save_for_backward(g), g.clamp(min=0))[1])
        backward = staticmethod(lambda ctx, grad: grad * (ctx.saved_tensors[0] > 0))

    monkeypatch.setattr(compact, "_ReopenableRelu", PlainRelu)
    assert _train_dynamics(_pushed_latents(), 300, still_l1=1.0, gate_warmup=1)[1] == pytest.approx(1.0, abs=1e-3)
    monkeypatch.undo()
    m, rel = _train_dynamics(_pushed_latents(), 300, still_l1=1.0, gate_warmup=1)
    assert rel < 0.5
    L = _pushed_latents(n_eps=8)
    idx, nv, _ = L.windows(np.random.default_rng(2), 256, 4, 1)
    with torch.no_grad():
        _, gate = m.dynamics(L.z[idx[:, :4]], L.p[idx[:, :4]], L.a[idx[:, :4]], torch.full((256,), 4))
    assert float((gate > 0).float().mean()) > 0.2


def test_denoiser_ode_lands_on_one_scene_where_one_call_blends():
    """Two encodable scenes at -1 and +1 (the exact denoiser of that mixture): from a prediction between them one
    call at a high sigma returns their blend, near 0; the probability-flow ODE (denoiser_steps > 1) lands on one."""
    from iws_gym.models.sampler import euler_from
    from iws_gym.models.schedule import geometric_sigmas

    def mixture(x, s):  # E[x0 | x] for x0 = +-1 with equal weight, x = x0 + s eps
        s = s[:, None]
        return torch.tanh(x / s ** 2)

    x = torch.tensor([[0.3], [-0.2]])
    one = mixture(x, torch.full((2,), 2.0))
    ode = euler_from(mixture, x, geometric_sigmas(12, 2.0, 0.01))
    assert float(one.abs().max()) < 0.1
    torch.testing.assert_close(ode, torch.tensor([[1.0], [-1.0]]), atol=1e-3, rtol=0)
    assert torch.equal(euler_from(mixture, x, geometric_sigmas(1, 0.5, 0.5)), mixture(x, torch.full((2,), 0.5)))


def test_denoiser_steps_set_at_release(compact, tmp_path):
    """`iws release --set` changes an inference field of a release's config and nothing else; one step is the one
    call the weights were released with; a bad field or value is named and nothing is written."""
    from .conftest import run_iws

    entry = dict(file="stage2.safetensors", size_mb=0.1, command="iws train compact2", data="d", data_seed=0,
                 data_episodes=1, steps=1, wall_s=1.0, device="cpu", trained_at_commit="x", released_at_commit="x",
                 train_eval={}, reports={})
    (compact / "provenance.json").write_text(json.dumps({"stage2": entry}))
    dest = tmp_path / "ode"
    dest.mkdir()
    (dest / "stage1.safetensors").write_bytes((compact / "stage1.safetensors").read_bytes())
    run_iws("release", "--run", compact, "--stage", "stage2", "--dest", dest, "--set", "denoiser_steps=6",
            "--set", "denoiser_sigma=0.4")
    a, b = (WorldModel.from_pretrained(d, device="cpu", stages=("stage1", "stage2")) for d in (compact, dest))
    assert (a.stage2.cfg.denoiser_steps, b.stage2.cfg.denoiser_steps, b.stage2.cfg.denoiser_sigma) == (1, 6, 0.4)
    assert all(torch.equal(p, q) for p, q in zip(a.stage2.state_dict().values(), b.stage2.state_dict().values()))
    prov = json.loads((dest / "provenance.json").read_text())["stage2"]
    assert prov["config_set"][0]["changes"] == {"denoiser_steps": [1, 6], "denoiser_sigma": [0.05, 0.4]}
    assert "denoiser_steps` 1 -> 6" in (dest / "PROVENANCE.md").read_text()
    frames = _frames(1)
    acts = np.array([[260.0, 200.0]] * 3, np.float32)
    ra, rb = (m.rollout(frames[0], acts, agent_pos=np.array([200.0, 200.0])) for m in (a, b))
    assert not np.array_equal(ra, rb)
    before = (dest / "stage2.safetensors").read_bytes()
    for bad, named in (("denoiser_step=3", "denoiser_step"), ("denoiser_steps=0", "denoiser_steps"), ("width=64", "width"),
                       ("denoiser_sigma_min=0.9", "denoiser_sigma_min")):
        r = run_iws("release", "--run", dest, "--stage", "stage2", "--dest", dest, "--set", bad, check=False)
        assert r.returncode == 2 and named in r.stderr
    assert (dest / "stage2.safetensors").read_bytes() == before
