"""The visuomotor policy (policies/visuomotor.py) and `iws train-policy` (training/policy.py)."""
import json

import numpy as np
import pytest

from .conftest import run_iws


@pytest.fixture(scope="module")
def val_dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "val"
    run_iws("collect", "--episodes", 1, "--steps", 24, "--out", out, "--seed", 900)
    return out


@pytest.fixture(scope="module")
def policy_run(tiny_dataset, val_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "policy"
    common = ("--data", f"{tiny_dataset}:2", "--val-data", val_dataset, "--out", out, "--preset", "tiny", "--batch", 8,
              "--eval-every", 4, "--ckpt-every", 4, "--warmup", 2)
    run_iws("train-policy", *common, "--steps", 4)
    resumed = run_iws("train-policy", *common, "--steps", 8)  # an interrupted run continues from last.pt
    return out, resumed



def _fit(net, batch, steps: int = 300, lr: float = 3e-3) -> dict:
    """Adam on one fixed batch; returns the last step's logs."""
    import torch

    opt = torch.optim.Adam(net.parameters(), lr)
    for _ in range(steps):
        loss, logs = net.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return logs

def test_train_policy_resumes_and_writes_releases_along_training(policy_run, tiny_dataset, val_dataset):
    from iws_gym.models.checkpoint import load_release
    from iws_gym.policies.visuomotor import VisuomotorConfig

    out, resumed = policy_run
    assert "resumed" in resumed.stderr and "at step 4" in resumed.stderr
    assert (out / "visuomotor_step4.safetensors").is_file() and (out / "visuomotor_step8.safetensors").is_file()
    cfg, _, meta = load_release(out / "visuomotor.safetensors", "visuomotor", VisuomotorConfig)
    assert meta["step"] == 8 and meta["command"].startswith("iws train-policy")
    assert meta["data"] == [dict(data=str(tiny_dataset), episodes=2, first=0, seed=7, generated=False, mix="play")]
    assert meta["val_data"] == str(val_dataset)
    result = json.loads((out / "train_result.json").read_text())
    assert np.isfinite(result["eval"]["val_action_err_px_median"])


def test_policy_acts_on_any_frame_size_and_executes_chunks(policy_run):
    """Actions are valid targets; a chunk is sampled once per `execute` steps; reset clears the queue."""
    from iws_gym.policies import load_policy_factory

    out, _ = policy_run
    policy = load_policy_factory(str(out / "visuomotor.safetensors"))()
    calls = []
    sample = policy.net.sample
    policy.net.sample = lambda *a, **k: calls.append(1) or sample(*a, **k)
    rng = np.random.default_rng(0)
    for size in (96, 128, 64):
        policy.reset(seed=1)
        for t in range(policy.cfg.execute + 1):
            obs = {"pixels": rng.integers(0, 255, (size, size, 3), dtype=np.uint8), "agent_pos": np.array([100.0, 300.0])}
            a = policy(obs)
            assert a.shape == (2,) and a.dtype == np.float32 and np.all((a >= 0) & (a <= 512))
    assert len(calls) == 3 * 2  # per episode: at step 0 and again at step `execute`


def test_policy_learns_the_demonstrations():
    """Fitting one batch of demonstrations drives the sampled chunk toward the demonstrated actions."""
    import torch

    from iws_gym.policies.visuomotor import VisuomotorConfig, VisuomotorNet

    torch.manual_seed(0)
    cfg = VisuomotorConfig(ch=16, keypoints=8, hidden=64, head_blocks=1, sample_steps=4, size=32, crop=32)
    net = VisuomotorNet(cfg)
    g = torch.Generator().manual_seed(0)
    frames = torch.rand(8, 1, 3, 32, 32, generator=g) * 2 - 1
    agent = torch.rand(8, 2, 2, generator=g) * 512
    actions = agent[:, -1:, :] + torch.linspace(0, 60, cfg.chunk)[None, :, None]  # a straight push from the agent
    batch = dict(frames=frames, agent=agent, actions=actions)

    def err():
        return (net.sample(frames, agent, torch.Generator().manual_seed(1)) - actions).norm(dim=-1).mean().item()

    before = err()
    _fit(net, batch)
    assert err() < 0.25 * before


def test_bad_data_and_policy_specs_are_named(tiny_dataset, tiny_stage1, tmp_path):
    from iws_gym.policies import load_policy_factory
    from iws_gym.training.policy import parse_data

    assert [s for _, s in parse_data("a:3,b,c:2-5")] == [slice(0, 3), slice(None), slice(2, 5)]
    for bad in ("a:x", "a:0", "a:5-2", "a:-3"):
        with pytest.raises(ValueError, match="positive integer N or a range"):
            parse_data(bad)
    with pytest.raises(ValueError, match="not a policy"):
        load_policy_factory(str(tiny_stage1 / "stage1.safetensors"))
    bad = run_iws("train-policy", "--data", f"{tiny_dataset}:50", "--out", tmp_path / "p", "--steps", 1, check=False)
    assert bad.returncode != 0 and "asks for episodes up to 50" in bad.stderr
    same = run_iws("train-policy", "--data", tiny_dataset, "--val-data", tiny_dataset, "--out", tmp_path / "q",
                   "--steps", 1, check=False)
    assert same.returncode != 0 and "also training data" in same.stderr


def test_datagen_trains_one_policy_per_share_and_scores_them_in_gym_pusht(tiny_checkpoint, tiny_dataset, tmp_path):
    """The data-generation experiment end to end at toy scale; rerunning it reuses every finished step."""
    from iws_gym.evaluation.datagen import mix_spec

    assert mix_spec("r", "g", 10, 0.5) == "r:0-5,g:5-10" and mix_spec("r", "g", 10, 1.0) == "g:0-10"
    real = tmp_path / "real"
    run_iws("collect", "--mix", "expert", "--episodes", 2, "--steps", 6, "--seed", 40, "--out", real)
    args = ("eval", "datagen", "--real", real, "--out", tmp_path / "dg", "--episodes", 2, "--train-steps", 2,
            "--eval-episodes", 2, "--horizon", 3, "--preset", "tiny", "--batch", 3, "--checkpoint", tiny_checkpoint,
            "--grid", tmp_path / "grid.png", "--json", tmp_path / "dg.json")
    run_iws(*args)
    r = json.loads((tmp_path / "dg.json").read_text())
    assert list(r["policies"]) == ["generated_0pct", "generated_50pct", "generated_100pct"]
    assert r["policies"]["generated_50pct"]["data"].count(":") == 2 and r["policies"]["generated_0pct"]["episodes"] == 2
    assert r["generated"]["world_model"]["checkpoint"] == str(tiny_checkpoint) and (tmp_path / "grid.png").is_file()
    assert r["generated"]["policy"] == "iws_gym.policies:ExpertPusher"  # the real demonstrations' demonstrator
    assert isinstance(r["target"]["met"], bool) and len(r["generated_over_real"]["mean_max_coverage_interval"]) == 3
    trained = json.loads((tmp_path / "dg" / "2ep" / "generated_100pct" / "train_result.json").read_text())
    assert r["batch"] == 3 and trained["args"]["batch"] == 3
    stamp = (tmp_path / "dg" / "2ep" / "generated_50pct" / "visuomotor.safetensors").stat().st_mtime
    again = run_iws(*args)
    assert "train policy" not in again.stderr  # nothing retrained
    assert (tmp_path / "dg" / "2ep" / "generated_50pct" / "visuomotor.safetensors").stat().st_mtime == stamp
    other = list(args)
    other[other.index("--train-steps") + 1] = 3  # other settings never reuse policies trained with these
    proc = run_iws(*other, check=False)
    assert proc.returncode != 0 and "use another --out" in proc.stderr
    other = list(args)
    other[other.index("--real") + 1] = tiny_dataset  # play episodes have no demonstrator to generate with
    other[other.index("--out") + 1] = tmp_path / "dg_play"
    proc = run_iws(*other, check=False)
    assert proc.returncode != 0 and "needs a demonstrator's" in proc.stderr and not (tmp_path / "dg_play").exists()


def test_datagen_successful_only_trains_on_generated_successes_and_says_when_there_are_too_few(tiny_checkpoint, tmp_path):
    """--successful-only: a world where no episode succeeds is refused with the count, after generating up to
    --max-generated; once enough generated episodes succeed, the generated part links only those, in seed order."""
    from iws_gym.data.episodes import episode_path, read_episode, write_episode
    from iws_gym.evaluation.datagen import successful_subset

    real = tmp_path / "real"
    run_iws("collect", "--mix", "expert", "--episodes", 2, "--steps", 6, "--seed", 40, "--out", real)
    args = ["eval", "datagen", "--real", real, "--out", tmp_path / "dg", "--episodes", 2, "--train-steps", 2,
            "--eval-episodes", 2, "--horizon", 3, "--preset", "tiny", "--batch", 3, "--checkpoint", tiny_checkpoint,
            "--successful-only", "--max-generated", 5, "--json", tmp_path / "dg.json"]
    proc = run_iws(*args, check=False)  # an untrained world never reaches the goal
    assert proc.returncode != 0 and "only 0 of 5 generated episodes end in the learned world's success" in proc.stderr
    gen = tmp_path / "dg" / "generated"
    assert json.loads((gen / "dataset.json").read_text())["episodes"] == 5  # kept for a rerun
    for i in (1, 3, 4):  # make three of them successes, as a world that reaches the goal would
        ep = read_episode(episode_path(gen, i))
        ep["coverage"][-1] = 1.0
        write_episode(episode_path(gen, i), ep, ep.pop("attrs"))
    with pytest.raises(ValueError, match="3 of its 5 episodes end in success, 4 are needed"):
        successful_subset(gen, tmp_path / "sub", 4)
    run_iws(*args)
    r = json.loads((tmp_path / "dg.json").read_text())
    sub = json.loads((tmp_path / "dg" / "generated_successful" / "dataset.json").read_text())
    assert r["successful_only"] and r["generated"]["kept"] == 2 and r["generated"]["episodes"] == 5
    assert sub["source_indices"] == [1, 3] and sub["seeds"] == [41, 43] and sub["success_rate_of_source"] == 0.6
    linked = read_episode(episode_path(tmp_path / "dg" / "generated_successful", 1))
    assert linked["attrs"]["seed"] == 43 and linked["coverage"][-1] == 1.0
    assert r["policies"]["generated_100pct"]["data"] == f"{tmp_path / 'dg' / 'generated_successful'}:0-2"
    assert (tmp_path / "dg" / "2ep_successful" / "generated_100pct" / "visuomotor.safetensors").is_file()
    assert (tmp_path / "dg" / "2ep" / "generated_0pct" / "visuomotor.safetensors").is_file()  # shared with the plain run
    proc = run_iws(*args[:-4], "--max-generated", 1, check=False)
    assert proc.returncode != 0 and "--max-generated must be >= --episodes (2), got 1" in proc.stderr


def test_the_markov_demonstrator_reads_the_frame_and_replans_every_chunk():
    from iws_gym.evaluation.datagen import DEMONSTRATORS
    from iws_gym.policies import MarkovExpertPusher, load_policy_factory
    from iws_gym.tasks.pusht.expert import MARKOV

    policy = load_policy_factory(DEMONSTRATORS["expert_markov"])()
    assert isinstance(policy, MarkovExpertPusher)
    assert policy.expert.replan_every == MARKOV["replan_every"] and policy.expert.reach == MARKOV["reach"]
    from iws_gym.tasks.pusht.groundtruth import make_env

    obs, _ = make_env().reset(seed=5)
    policy.reset(5)
    actions = [policy(obs) for _ in range(3)]
    assert all(a.shape == (2,) and np.all((a >= 0) & (a <= 512)) for a in actions)


def test_intervention_episodes_hand_over_to_the_expert_and_only_its_steps_are_imitated(policy_run, tmp_path):
    """`iws collect --mix intervention`: the learner acts first, then the expert; training skips the learner's steps."""
    from types import SimpleNamespace

    from iws_gym.data.collect import LEARNER_STEPS, SEGMENT_NAMES
    from iws_gym.data.episodes import list_episodes, read_episode
    from iws_gym.training.policy import Stage, Options

    out, _ = policy_run
    data = tmp_path / "iv"
    run_iws("collect", "--mix", "intervention", "--policy", out / "visuomotor.safetensors", "--episodes", 2,
            "--steps", 220, "--seed", 60, "--out", data)
    learner, expert = SEGMENT_NAMES.index("learner"), SEGMENT_NAMES.index("expert")
    imitated = 0
    for p in list_episodes(data):
        ep = read_episode(p)
        seg = ep["segments"]
        n = int((seg == learner).sum())
        assert LEARNER_STEPS[0] <= n < LEARNER_STEPS[1] and np.all(seg[:n] == learner) and np.all(seg[n:] == expert)
        assert ep["attrs"]["plan"].startswith(f"learner:{n}") and ep["attrs"]["learner"] == str(out / "visuomotor.safetensors")
        imitated += len(seg) - n
    a = SimpleNamespace(data=str(data), max_episodes=None)
    stage = Stage(a, Options(preset="tiny"), "cpu")
    assert len(stage.index) == imitated
    assert all(stage.train[e]["imitate"][t] for e, t in stage.index)
    bad = run_iws("collect", "--mix", "intervention", "--episodes", 1, "--out", tmp_path / "x", check=False)
    assert bad.returncode == 2 and "needs --policy" in bad.stderr


def test_the_shipped_policy_is_a_zero_argument_factory():
    import iws_gym.policies as policies

    policy = policies.load_policy_factory("iws_gym.policies:visuomotor")()
    assert policy.meta["command"].startswith("iws train-policy") and policy.meta["data"][0]["seed"] == 200000
    policy.reset(seed=0)
    a = policy({"pixels": np.full((96, 96, 3), 255, np.uint8), "agent_pos": np.array([256.0, 256.0])})
    assert a.shape == (2,) and np.all((a >= 0) & (a <= 512))


def test_pose_bottleneck_policy_trains_on_expert_corrections(tiny_dataset, val_dataset, tmp_path):
    """The pose preset: the reader and the head train in one loop; `iws dagger` labels the learner's chunk starts
    with the expert's plan (state-only labels), and the head trains on them; the policy acts on pixels alone."""
    from iws_gym.policies import load_policy_factory

    common = ("--data", tiny_dataset, "--val-data", val_dataset, "--preset", "pose-tiny", "--batch", 8, "--eval-every", 2,
              "--ckpt-every", 2, "--warmup", 1, "--steps", 2)
    run_iws("train-policy", *common, "--out", tmp_path / "p")
    result = json.loads((tmp_path / "p" / "train_result.json").read_text())
    assert {"val_pose_err_px_median", "val_pose_err_rad_median", "val_action_err_px_median"} <= set(result["eval"])
    labels = tmp_path / "r1.npz"
    run_iws("dagger", "--policy", tmp_path / "p" / "visuomotor.safetensors", "--episodes", 1, "--horizon", 9,
            "--seed", 50, "--beta", 1.0, "--expert", "markov", "--out", labels, "--json", tmp_path / "r1.json")
    d = np.load(labels)
    assert json.loads(str(d["meta"]))["expert"] == "markov"
    assert d["A"].shape == (2, 16, 2) and d["P"].shape == (2, 2, 2) and d["B"].shape == (2, 3)  # chunk starts 0 and 8
    assert np.isfinite(d["A"]).all() and (d["A"] >= 0).all() and (d["A"] <= 512).all()
    assert json.loads((tmp_path / "r1.json").read_text())["expert_chunk_share"] == 1.0  # beta 1: every chunk the expert's
    run_iws("train-policy", *common, "--out", tmp_path / "q", "--labels", labels, "--init",
            tmp_path / "p" / "visuomotor.safetensors", "--pose-noise", 0.5, "--reader-frames", 8)
    policy = load_policy_factory(str(tmp_path / "q" / "visuomotor.safetensors"))()
    assert policy.meta["labels"] == str(labels) and policy.cfg.bottleneck == "pose"
    assert policy.meta["reader_frames"] == 8
    assert policy.cfg.pose_noise == 0.5  # over the --init release's 2.0
    for size in (96, 128):
        policy.reset(seed=0)
        a = policy({"pixels": np.full((size, size, 3), 255, np.uint8), "agent_pos": np.array([256.0, 256.0])})
        assert a.shape == (2,) and np.all((a >= 0) & (a <= 512))
    bad = run_iws("train-policy", "--data", tiny_dataset, "--out", tmp_path / "x", "--preset", "tiny", "--steps", 1,
                  "--labels", labels, check=False)
    assert bad.returncode != 0 and "needs a pose-bottleneck policy" in bad.stderr
    bad = run_iws("train-policy", *common, "--out", tmp_path / "z", "--pose-noise", -1, check=False)
    assert bad.returncode != 0 and "--pose-noise must be >= 0" in bad.stderr
    bad = run_iws("train-policy", "--data", tiny_dataset, "--out", tmp_path / "x", "--preset", "tiny", "--steps", 1,
                  "--reader-frames", 4, check=False)
    assert bad.returncode != 0 and "--reader-frames needs a pose-bottleneck policy" in bad.stderr
    bad = run_iws("dagger", "--policy", tmp_path / "p" / "visuomotor.safetensors", "--seed", 999_999, "--episodes", 2,
                  "--out", tmp_path / "y.npz", check=False)
    assert bad.returncode != 0 and "below the held-out base" in bad.stderr


def test_random_state_frames_show_the_block_where_they_say_anywhere_inside_the_walls():
    """The reader's extra frames: valid states (the whole T inside the walls, the agent off it) spread over the
    canvas, including the strips near the walls that demonstrations rarely reach; each frame is gym-pusht's
    render of its recorded pose (the block's pixels sit where the pose puts them)."""
    from iws_gym.tasks.pusht.behaviours import t_sdf
    from iws_gym.tasks.pusht.groundtruth import t_polygons
    from iws_gym.tasks.pusht.pose import BLOCK_RGB
    from iws_gym.training.policy import random_state_frames

    d = random_state_frames(200, 128, 96, seed=3, chunk=64)
    assert d["frames"].shape == (200, 96, 96, 3) and d["frames"].dtype == np.uint8 and d["block_pose"].shape == (200, 3)
    corners = np.stack([np.concatenate(t_polygons(b)) for b in d["block_pose"]])
    margin = np.minimum(corners.min(1), 512 - corners.max(1)).min(1)  # the block's closest approach to the canvas edge
    assert margin.min() >= 7  # inside the walls
    assert 0.2 < (margin < 17).mean() < 0.6  # pressed against a wall in about a third of the frames
    assert np.ptp(d["block_pose"][:, 2]) > 5.5  # all angles
    for i in range(5):  # the block's grey pixels lie on the T at the recorded pose
        grey = np.argwhere(np.abs(d["frames"][i] - BLOCK_RGB).max(-1) < 25)
        pts = (grey[:, ::-1] + 0.5) * 512 / 96
        assert len(pts) > 20 and np.median(t_sdf(pts, d["block_pose"][i].astype(float))) < 3
    again = random_state_frames(200, 128, 96, seed=3)
    assert np.array_equal(again["block_pose"], d["block_pose"]) and np.array_equal(again["frames"], d["frames"])


def test_pose_bottleneck_head_learns_the_chunk_from_the_pose():
    """Fitting one batch: the head, given the recorded pose, samples chunks near the demonstrated ones, and the
    reader's pose regression falls."""
    import torch

    from iws_gym.policies.visuomotor import VisuomotorConfig, build_net

    torch.manual_seed(0)
    cfg = VisuomotorConfig(bottleneck="pose", crop=96, hidden=64, head_blocks=1, sample_steps=4, pose_noise=0.0)
    net = build_net(cfg)
    g = torch.Generator().manual_seed(0)
    agent = torch.rand(8, 2, 2, generator=g) * 512
    pose = torch.cat([torch.rand(8, 2, generator=g) * 300 + 100, torch.rand(8, 1, generator=g) * 6 - 3], 1)
    actions = pose[:, None, :2] + torch.linspace(0, 60, cfg.chunk)[None, :, None]  # pushes that start at the block
    frames = torch.rand(8, 1, 3, 96, 96, generator=g) * 2 - 1
    batch = dict(agent=agent, block_pose=pose, actions=actions, frames=frames, frame_pose=pose)

    def err():
        chunk = net.sample(frames, agent, torch.Generator().manual_seed(1), pose=pose)
        return (chunk - actions).norm(dim=-1).mean().item()

    before, pose_before = err(), net.loss(batch)[1]["pose_mse"]
    logs = _fit(net, batch)
    assert err() < 0.35 * before and logs["pose_mse"] < 0.5 * pose_before
    with pytest.raises(ValueError, match="reads one whole frame"):
        build_net(VisuomotorConfig(bottleneck="pose"))  # crop 88 < size 96


@pytest.mark.slow
def test_visuomotor_recipe_script_runs_at_toy_scale(tiny_dataset, val_dataset, tmp_path):
    """scripts/train_visuomotor.sh: behaviour cloning, labels from two of its snapshots, five DAgger rounds (the
    last with random-state frames for the reader), each policy measured on validation starts; a rerun finds
    everything done."""
    import os
    import subprocess

    from .conftest import ROOT

    env = {**os.environ, "IWS_VM_SCALE": "tiny", "DATA": str(tiny_dataset), "VAL_DATA": str(val_dataset),
           "IWS": f"{os.sys.executable} -m iws_gym.cli"}
    run = lambda: subprocess.run(["bash", str(ROOT / "scripts" / "train_visuomotor.sh"), str(tmp_path)], env=env, cwd=ROOT,
                                 capture_output=True, text=True, timeout=900)
    proc = run()
    assert proc.returncode == 0, proc.stderr
    for r in ("r0", "r0b", "r1", "r2", "r3", "r4"):
        assert np.load(tmp_path / "dagger" / f"{r}.npz")["A"].shape[1:] == (16, 2)
    from iws_gym.models.checkpoint import load_release
    from iws_gym.policies.visuomotor import VisuomotorConfig

    cfg5, _, meta = load_release(tmp_path / "vm_pose_d5" / "visuomotor.safetensors", "visuomotor", VisuomotorConfig)
    assert meta["labels"].split(",") == [str(tmp_path / "dagger" / f"{r}.npz") for r in ("r0", "r0b", "r1", "r2", "r3", "r4")]
    assert meta["init"] == str(tmp_path / "vm_pose_d4" / "visuomotor.safetensors")
    assert meta["reader_frames"] == 8 and cfg5.pose_noise == 0.5
    _, _, meta4 = load_release(tmp_path / "vm_pose_d4" / "visuomotor.safetensors", "visuomotor", VisuomotorConfig)
    assert meta4["reader_frames"] is None  # only the last round adds the random-state frames
    assert json.loads((tmp_path / "vm_pose_d5" / "val30.json").read_text())["ground_truth"]["episodes"] == 1
    again = run()
    assert again.returncode == 0 and "done" in again.stdout and not list(tmp_path.glob("vm_pose_d6*"))
    assert not (tmp_path / "dagger" / "r5.npz").exists()  # the last round collects nothing

