import json

import numpy as np
import pytest

from iws_gym.data.episodes import read_episode, list_episodes

from .conftest import run_iws

pq = pytest.importorskip("pyarrow.parquet")


def test_export_lerobot_reads_back_with_pyarrow_and_a_video_decoder(tiny_dataset, tmp_path):
    import imageio.v2 as iio

    out = tmp_path / "lerobot"
    run_iws("export", "lerobot", "--data", tiny_dataset, "--out", out, "--max-episodes", 2)
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v2.1" and info["fps"] == 10 and info["total_episodes"] == 2
    for key in ("observation.image", "observation.state", "action", "episode_index", "frame_index", "timestamp",
                "next.reward", "next.done", "index", "task_index"):
        assert key in info["features"]
    episodes = [json.loads(line) for line in (out / "meta" / "episodes.jsonl").read_text().splitlines()]
    stats = json.loads((out / "meta" / "stats.json").read_text())
    assert stats["action"]["count"] == [info["total_frames"]] == [sum(e["length"] for e in episodes)]
    index = 0
    for i, path in enumerate(list_episodes(tiny_dataset)[:2]):
        ep = read_episode(path)
        T = len(ep["actions"])
        rows = pq.read_table(out / info["data_path"].format(episode_chunk=0, episode_index=i)).to_pydict()
        assert len(rows["action"]) == T == episodes[i]["length"]
        np.testing.assert_array_equal(np.array(rows["action"], np.float32), ep["actions"])
        np.testing.assert_array_equal(np.array(rows["observation.state"], np.float32), ep["agent_pos"][:T])
        assert rows["frame_index"] == list(range(T)) and set(rows["episode_index"]) == {i}
        assert rows["index"] == list(range(index, index + T))
        np.testing.assert_allclose(rows["timestamp"], np.arange(T) / 10, atol=1e-6)
        np.testing.assert_allclose(rows["next.reward"], np.clip(ep["coverage"][1:] / 0.95, 0, 1), atol=1e-6)
        assert rows["next.done"][-1] and not any(rows["next.done"][:-1]) or any(rows["next.success"])
        video = out / info["video_path"].format(episode_chunk=0, video_key="observation.image", episode_index=i)
        frames = np.stack([f for f in iio.get_reader(video).iter_data()])
        assert frames.shape == (T, *ep["frames"].shape[1:])
        mse = np.mean((frames.astype(np.float64) - ep["frames"][:T]) ** 2)
        assert 10 * np.log10(255**2 / mse) > 30  # h264 at crf 18: the frames, not just a file
        index += T
    source = json.loads((out / "meta" / "iws_source.json").read_text())
    assert source["exported_from"] == str(tiny_dataset) and source["generated"] is False


def test_export_lerobot_never_writes_into_a_used_directory(tiny_dataset, tmp_path):
    out = tmp_path / "used"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = run_iws("export", "lerobot", "--data", tiny_dataset, "--out", out, check=False)
    assert proc.returncode != 0 and "not empty" in proc.stderr
    assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 1


def test_generate_records_demonstrations_in_the_learned_world_marked_as_generated(tiny_checkpoint, tmp_path):
    from iws_gym.data.episodes import InMemoryEpisodes
    from iws_gym.tasks.pusht.groundtruth import make_env

    out = tmp_path / "gen"
    run_iws("generate", "--checkpoint", tiny_checkpoint, "--episodes", 3, "--steps", 4, "--num-envs", 2, "--seed", 5,
            "--out", out)
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["generated"] is True and meta["ground_truth"] is None and meta["seeds"] == [5, 7]
    assert len(meta["world_model"]["stage1_sha256"]) == 64 and meta["policy"] == "iws_gym.policies:FramePusher"
    eps = InMemoryEpisodes.load(out, progress=False)  # the project's loaders read it like any dataset
    assert len(eps.frames) == 3
    env = make_env(128)
    for i, path in enumerate(list_episodes(out)):
        ep = read_episode(path)
        assert ep["attrs"]["generated"] and int(ep["attrs"]["seed"]) == 5 + i
        assert 1 <= len(ep["actions"]) <= 4 and len(ep["frames"]) == len(ep["actions"]) + 1
        obs, _ = env.reset(seed=5 + i)  # each episode starts from gym-pusht's start of its seed
        np.testing.assert_array_equal(ep["frames"][0], obs["pixels"])
    # an interrupted generation (episode 1 and dataset.json missing) is completed by --resume, the same episode again
    before = read_episode(out / "ep_000001.h5")
    (out / "ep_000001.h5").unlink()
    (out / "dataset.json").unlink()
    run_iws("generate", "--checkpoint", tiny_checkpoint, "--episodes", 3, "--steps", 4, "--num-envs", 2, "--seed", 5,
            "--out", out, "--resume")
    again = read_episode(out / "ep_000001.h5")
    np.testing.assert_array_equal(again["frames"][0], before["frames"][0])
    np.testing.assert_array_equal(again["actions"][:1], before["actions"][:1])
    assert json.loads((out / "dataset.json").read_text())["episodes"] == 3
    wrong = run_iws("generate", "--checkpoint", tiny_checkpoint, "--episodes", 3, "--steps", 4, "--seed", 6,
                    "--out", out, "--resume", check=False)
    assert wrong.returncode != 0 and "cannot resume" in wrong.stderr
    lr = tmp_path / "lr"
    run_iws("export", "lerobot", "--data", out, "--out", lr)
    assert json.loads((lr / "meta" / "iws_source.json").read_text())["generated"] is True


def test_generate_refuses_a_bad_policy_before_writing(tiny_checkpoint, tmp_path):
    proc = run_iws("generate", "--checkpoint", tiny_checkpoint, "--episodes", 1, "--out", tmp_path / "g",
                   "--policy", "nowhere:nothing", check=False)
    assert proc.returncode != 0 and "cannot load policy" in proc.stderr and not (tmp_path / "g").exists()
