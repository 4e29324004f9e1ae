
import os

import h5py
import numpy as np
import pytest
import torch

from iws_gym.data.collect import collect, collect_episode, heldout_episodes
from iws_gym.data.episodes import (DatasetError, InMemoryEpisodes, episode_path, list_episodes, load_meta, read_episode,
                          write_episode)
from iws_gym.envs.registry import load_task

from .conftest import run_iws

TASK = load_task("tpushing")


def test_dataset_layout(tiny_dataset):
    meta = load_meta(tiny_dataset)
    assert meta["episodes"] == 3 and meta["seed"] == 7 and meta["gym_pusht_version"] == "0.1.8"
    paths = list_episodes(tiny_dataset)
    assert [p.name for p in paths] == ["ep_000000.h5", "ep_000001.h5", "ep_000002.h5"]
    ep = read_episode(paths[0])
    assert ep["frames"].shape == (25, 128, 128, 3) and ep["frames"].dtype == np.uint8
    assert ep["actions"].shape == (24, 2) and ep["agent_pos"].shape == (25, 2)
    assert ep["block_pose"].shape == (25, 3) and ep["coverage"].shape == (25,)
    assert np.all((ep["actions"] >= 0) & (ep["actions"] <= 512))
    assert ep["attrs"]["seed"] == 7


def test_collection_is_deterministic(tiny_dataset):
    again = collect_episode(TASK, 7, steps=24)
    stored = read_episode(episode_path(tiny_dataset, 0))
    for k in ("frames", "actions", "agent_pos", "block_pose"):
        np.testing.assert_array_equal(again[k].astype(stored[k].dtype), stored[k])


def test_actions_drive_the_agent(tiny_dataset):
    """actions[t] is the target applied between frames[t] and frames[t+1]: the agent moves toward it."""
    ep = read_episode(episode_path(tiny_dataset, 1))
    before = np.linalg.norm(ep["actions"] - ep["agent_pos"][:-1], axis=1)
    after = np.linalg.norm(ep["actions"] - ep["agent_pos"][1:], axis=1)
    moving = before > 5
    assert np.mean(after[moving] < before[moving]) > 0.9


def test_heldout_seeds_are_disjoint_and_on_the_fly():
    ep = next(heldout_episodes(TASK, 1, 5))
    assert ep["frames"].shape[0] == 6
    with pytest.raises(ValueError, match="held-out"):
        collect(TASK, 2, "/tmp/never-written", seed=TASK.heldout_seed_base - 1, progress=False)


@pytest.mark.parametrize("args,msg", [
    (["--task", "nope", "--episodes", 1], "unknown task 'nope'"),
    (["--episodes", 0], "--episodes must be > 0"),
    (["--episodes", -3], "--episodes must be > 0"),
])
def test_collect_bad_input(tmp_path, args, msg):
    proc = run_iws("collect", *args, "--out", tmp_path / "x", check=False)
    assert proc.returncode == 2 and msg in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_collect_refuses_non_empty_dir_and_keeps_its_files(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    proc = run_iws("collect", "--episodes", 1, "--steps", 3, "--out", tmp_path, check=False)
    assert proc.returncode == 2 and "not empty" in proc.stderr
    assert (tmp_path / "keep.txt").read_text() == "precious" and not list(tmp_path.glob("ep_*"))


def test_collect_refuses_unwritable_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")  # a directory cannot be created below a file, even as root
    proc = run_iws("collect", "--episodes", 1, "--out", blocker / "sub", check=False)
    assert proc.returncode == 2 and "cannot be created or written" in proc.stderr
    assert blocker.read_text() == "x"


def test_interrupted_collection_resumes_without_touching_finished_episodes(tmp_path):
    out = tmp_path / "c"
    collect(TASK, 2, out, seed=3, steps=4, progress=False)
    first = episode_path(out, 0)
    stamp = first.stat().st_mtime_ns
    episode_path(out, 1).unlink()                               # episode 1 never finished ...
    (out / "ep_000001.h5.tmp").write_bytes(b"half-written")     # ... and left a partial temp file
    (out / "dataset.json").unlink()
    assert [p.name for p in list_episodes(out)] == ["ep_000000.h5"]  # readers ignore the temp file
    meta = collect(TASK, 2, out, seed=3, steps=4, resume=True, progress=False)
    assert first.stat().st_mtime_ns == stamp and meta["episodes"] == 2
    assert not list(out.glob("*.tmp")) and len(list_episodes(out)) == 2
    np.testing.assert_array_equal(read_episode(episode_path(out, 1))["frames"], collect_episode(TASK, 4, 4)["frames"])


def test_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "ep_000000.h5"
    ep = {k: v for k, v in collect_episode(TASK, 1, 3).items() if k != "plan"}
    write_episode(path, ep, {"seed": 1})
    before = path.read_bytes()
    bad = dict(ep, frames=ep["frames"][:2])  # wrong length: refused before anything is written
    with pytest.raises(ValueError, match="frames"):
        write_episode(path, bad, {"seed": 1})

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(h5py.Group, "create_dataset", boom)
    with pytest.raises(OSError):
        write_episode(path, ep, {"seed": 2})
    assert path.read_bytes() == before


def test_truncated_and_corrupt_files_are_named(tmp_path, tiny_dataset):
    data = episode_path(tiny_dataset, 0).read_bytes()
    trunc = tmp_path / "ep_000000.h5"
    trunc.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError, match="ep_000000.h5"):
        read_episode(trunc)
    junk = tmp_path / "ep_000001.h5"
    junk.write_bytes(b"not hdf5 at all")
    with pytest.raises(DatasetError, match="corrupt or truncated"):
        read_episode(junk)
    with pytest.raises(DatasetError, match="dataset.json"):
        load_meta(tmp_path)


def test_loader_windows_match_episodes(tiny_dataset):
    eps = InMemoryEpisodes.load(tiny_dataset, progress=False)
    rng = np.random.default_rng(0)
    fr, ac = eps.sample_windows(rng, 8, context=4)
    assert fr.shape == (8, 5, 128, 128, 3) and ac.shape == (8, 4, 2)
    # every window is a contiguous slice of one episode, frames and actions aligned
    for f, a in zip(fr, ac):
        hit = False
        for E, A in zip(eps.frames, eps.actions):
            for s in range(len(A) - 3):
                if np.array_equal(E[s], f[0]) and np.array_equal(A[s : s + 4], a) and np.array_equal(E[s : s + 5], f):
                    hit = True
        assert hit


def test_data_stats_command(tiny_dataset, tmp_path):
    run_iws("data-stats", "--data", tiny_dataset, "--json", tmp_path / "s.json", "--plot", tmp_path / "s.png", "--loader-batches", 3)
    import json

    s = json.loads((tmp_path / "s.json").read_text())
    assert s["episodes"] == 3 and abs(sum(s["behaviour_mix"].values()) - 1) < 1e-3
    assert 0 <= s["contact_step_fraction"] <= 1 and s["loader"]["frames_per_s"] > 0
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_reports_are_strict_json(tmp_path):
    """An undefined statistic (NaN, e.g. a correlation of constant scores) is written as null, not as the
    non-standard NaN token that strict JSON readers reject."""
    import json

    import numpy as np

    from iws_gym.data.episodes import write_json_atomic

    p = tmp_path / "r.json"
    write_json_atomic(p, {"r": float("nan"), "a": np.array([1.0, np.inf]), "n": np.float32(0.5), "k": [1, "x"]})
    text = p.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"r": None, "a": [1.0, None], "n": 0.5, "k": [1, "x"]}
    assert not (tmp_path / "r.json.tmp").exists()


def test_jittery_mix_records_pushes_with_random_jumps(tmp_path):
    from iws_gym.tasks.pusht.behaviours import JitteryPush
    from iws_gym.data.collect import SEGMENT_NAMES

    out = tmp_path / "jit"
    meta = collect(TASK, 2, out, seed=11, steps=30, progress=False, mix="jittery")
    assert meta["mix"] == "jittery" and load_meta(out)["mix"] == "jittery"
    ep = read_episode(episode_path(out, 0))
    assert set(ep["segments"].tolist()) == {SEGMENT_NAMES.index("push_jittery")}
    assert ep["attrs"]["plan"] == "push_jittery:30"
    # the default play mix keeps its indices (files store them), and the new name comes last
    assert SEGMENT_NAMES[:2] == ["push", "push_noisy"] and SEGMENT_NAMES[-5:] == ["push_jittery", "random", "expert", "learner", "expert_markov"]
    # deterministic, like every collection
    again = collect_episode(TASK, 11, 30, plan=[("push_jittery", JitteryPush(np.random.default_rng([11, 1])), 30)])
    np.testing.assert_array_equal(again["actions"], ep["actions"])
    # p = 1: every target is a random jump; p = 0: the smooth pusher (targets move at most max_speed a step)
    state = np.array([100.0, 100.0, 256.0, 256.0, 0.3])
    rng = np.random.default_rng(0)
    jumps = [np.linalg.norm(JitteryPush(rng, p=1.0).act(state) - state[:2]) for _ in range(50)]
    assert np.median(jumps) > 60
    push = JitteryPush(np.random.default_rng(1), p=0.0)
    acts = np.array([push.act(state) for _ in range(20)])
    assert np.all(np.linalg.norm(np.diff(acts, axis=0), axis=1) <= push.max_speed + 1e-6)


def test_random_mix_records_the_stability_drive_and_resumes_only_as_random(tmp_path):
    from iws_gym.data.collect import SEGMENT_NAMES, mix_of

    out = tmp_path / "rnd"
    meta = collect(TASK, 2, out, seed=21, steps=12, progress=False, mix="random")
    assert meta["mix"] == "random" and load_meta(out)["mix"] == "random"
    ep = read_episode(episode_path(out, 1))
    assert set(ep["segments"].tolist()) == {SEGMENT_NAMES.index("random")} and ep["attrs"]["plan"] == "random:12"
    a = ep["actions"]
    assert (np.linalg.norm(np.diff(a, axis=0), axis=1) > 1).all()  # a new target every step, never held
    # deterministic: episode_plan("random", seed) (also the held-out random drive's plan) regenerates it
    from iws_gym.data.collect import episode_plan

    again = collect_episode(TASK, 22, 12, plan=episode_plan("random", 22, 12))
    np.testing.assert_array_equal(again["actions"], a)
    assert [mix_of(p) for p in ("random:12", "push_jittery:30", "push:100;free:100", "")] == ["random", "jittery", "play", "play"]
    # resuming a random collection as play (or the reverse) is refused, naming the mix it was collected with
    episode_path(out, 1).unlink()
    with pytest.raises(ValueError, match="mix random"):
        collect(TASK, 2, out, seed=21, steps=12, resume=True, progress=False)
    collect(TASK, 2, out, seed=21, steps=12, resume=True, progress=False, mix="random")
    np.testing.assert_array_equal(read_episode(episode_path(out, 1))["actions"], a)


def test_collect_names_a_bad_mix(tmp_path):
    with pytest.raises(ValueError, match="mix must be one of"):
        collect(TASK, 1, tmp_path / "x", mix="chaos", progress=False)
    assert not (tmp_path / "x").exists()
    proc = run_iws("collect", "--episodes", 1, "--mix", "chaos", "--out", tmp_path / "y", check=False)
    assert proc.returncode == 2 and "--mix" in proc.stderr
    with pytest.raises(ValueError, match="behaviour must be one of"):
        next(heldout_episodes(TASK, 1, 5, behaviour="chaos"))


def test_heldout_expert_episodes_push_for_the_whole_horizon():
    # the planning expert's competent pushes (fidelity --behaviour expert): the episode runs past success
    ep = next(heldout_episodes(TASK, 1, 100, "validation", first=1, behaviour="expert"))
    assert len(ep["actions"]) == 100 and ep["plan"] == [("expert_heldout", 100)]
    assert ep["coverage"][:90].max() > 0.95 and ep["coverage"][0] < 0.3  # it succeeds before the end and goes on


def test_resume_refuses_another_seed_or_mix_and_keeps_the_episodes(tmp_path):
    out = tmp_path / "c"
    collect(TASK, 2, out, seed=3, steps=4, progress=False)
    episode_path(out, 1).unlink()
    (out / "dataset.json").unlink()
    stamp = episode_path(out, 0).stat().st_mtime_ns
    with pytest.raises(ValueError, match="seed 3 and mix play"):
        collect(TASK, 2, out, seed=4, steps=4, resume=True, progress=False)
    proc = run_iws("collect", "--episodes", 2, "--steps", 4, "--seed", 3, "--mix", "jittery", "--resume", "--out", out, check=False)
    assert proc.returncode == 2 and "cannot resume" in proc.stderr and "--mix jittery" in proc.stderr
    assert episode_path(out, 0).stat().st_mtime_ns == stamp and not episode_path(out, 1).exists()


def test_augmentation_renders_are_the_same_on_several_processes(tiny_dataset):
    from iws_gym.data.episodes import list_episodes, read_episode
    from iws_gym.data.latents import agent_erased_latents, block_corrupted_latents

    eps = [read_episode(p) for p in list_episodes(tiny_dataset)[:2]]
    enc = lambda x: x[:, :, ::8, ::8]  # noqa: E731 - a stand-in encoder: the frames, subsampled
    runs = [(agent_erased_latents([e["block_pose"] for e in eps], enc, "cpu", False, workers=w),
             block_corrupted_latents(*[[e[k] for e in eps] for k in ("frames", "agent_pos", "block_pose")], enc, "cpu",
                                     False, workers=w)) for w in (1, 2)]
    for one, two in zip(*runs):
        assert all(torch.equal(a, b) for a, b in zip(one, two)) and len(one) == 2


def test_atomic_saves_of_one_file_by_several_writers_leave_no_temporary_file(tmp_path):
    from iws_gym.models.checkpoint import _tmp_name, atomic_torch_save

    path = tmp_path / "latents.pt"
    assert _tmp_name(path) != path.with_name(path.name + ".tmp") and str(os.getpid()) in _tmp_name(path).name
    atomic_torch_save({"a": 1}, path)
    atomic_torch_save({"a": 2}, path)
    assert torch.load(path)["a"] == 2 and [p.name for p in tmp_path.iterdir()] == ["latents.pt"]


def test_merge_links_several_datasets_into_one(tiny_dataset, tmp_path):
    from iws_gym.data.episodes import DatasetError, InMemoryEpisodes, load_meta

    other = tmp_path / "random"
    collect(TASK, 2, other, seed=40, steps=10, progress=False, mix="random")
    out = tmp_path / "merged"
    run_iws("merge", "--data", tiny_dataset, other, "--out", out)
    meta = load_meta(out)
    assert meta["episodes"] == 5 and meta["mix"] == "merged" and meta["seed"] is None
    assert [(m["first_episode"], m["episodes"], m["mix"]) for m in meta["merged_from"]] == [(0, 3, "play"), (3, 2, "random")]
    eps = InMemoryEpisodes.load(out, progress=False)
    np.testing.assert_array_equal(eps.actions[3], read_episode(episode_path(other, 0))["actions"])  # in order, linked
    assert all(p.is_symlink() for p in out.glob("ep_*.h5"))
    # bad input names the problem and leaves what is there alone
    for args, dest, msg in (([tiny_dataset], tmp_path / "m2", "at least two"), ([tiny_dataset, tmp_path / "nope"], tmp_path / "m2", "nope"),
                            ([tiny_dataset, other], out, "not an empty directory")):
        proc = run_iws("merge", "--data", *args, "--out", dest, check=False)
        assert proc.returncode == 2 and msg in proc.stderr, proc.stderr
    assert load_meta(out)["episodes"] == 5 and not (tmp_path / "m2").exists()
    with pytest.raises(DatasetError, match="one of the sources"):
        from iws_gym.data.episodes import merge_datasets
        merge_datasets([tiny_dataset, other], other)
