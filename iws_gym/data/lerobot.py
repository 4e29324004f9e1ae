"""Export an iws dataset in LeRobot's dataset layout (LeRobotDataset v2.1, one file per episode), the
layout LeRobot's Push-T tools read:

    OUT/
      meta/info.json             schema (features, fps, path templates), counts, codebase_version "v2.1"
      meta/episodes.jsonl        one line per episode: index, task, length
      meta/tasks.jsonl           the task's text
      meta/episodes_stats.jsonl  per-episode min / max / mean / std / count of every numeric feature and the image
      meta/stats.json            the same over the whole dataset
      meta/iws_source.json       where the data came from: the iws dataset's own metadata (for generated data:
                                 the world model release and seeds that made it), never mistaken for ground truth
      data/chunk-000/episode_000000.parquet
      videos/chunk-000/observation.image/episode_000000.mp4

Each row is one step t of an episode: observation.image (frame t, in the video), observation.state (the
agent's position, gym-pusht's `agent_pos`), action (the commanded target, 512 canvas px), next.reward
(gym-pusht's reward after the step: coverage / 0.95 clipped to 1), next.done (last step or success),
next.success, timestamp (t / fps), frame_index t, episode_index, index (over the dataset), task_index.
Written with pyarrow and ffmpeg (imageio): LeRobot itself needs a newer Python than iws-gym supports.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from iws_gym.data.episodes import DatasetError, list_episodes, load_meta, read_episode, write_json_atomic

CODEBASE_VERSION = "v2.1"
CHUNKS_SIZE = 1000
DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
IMAGE_KEY = "observation.image"
TASKS = {"tpushing": "Push the T-shaped block onto the T-shaped target."}
SUCCESS = 0.95  # gym-pusht's success threshold on goal coverage


def _features(size: int, fps: int) -> dict:
    vec = lambda names: dict(dtype="float32", shape=[len(names)], names={"motors": names})  # noqa: E731
    one = lambda dtype: dict(dtype=dtype, shape=[1], names=None)  # noqa: E731
    return {
        IMAGE_KEY: dict(dtype="video", shape=[size, size, 3], names=["height", "width", "channel"],
                        info={"video.fps": float(fps), "video.height": size, "video.width": size, "video.channels": 3,
                              "video.codec": "h264", "video.pix_fmt": "yuv420p", "video.is_depth_map": False,
                              "has_audio": False}),
        "observation.state": vec(["x", "y"]),
        "action": vec(["x", "y"]),
        "episode_index": one("int64"), "frame_index": one("int64"), "timestamp": one("float32"),
        "next.reward": one("float32"), "next.done": one("bool"), "next.success": one("bool"),
        "index": one("int64"), "task_index": one("int64"),
    }


def _stats(x: np.ndarray) -> dict:
    """LeRobot's per-feature statistics over rows (axis 0); images per channel, scaled to [0, 1]."""
    x = np.asarray(x, np.float64)
    axes = (0,) if x.ndim <= 2 else (0, 1, 2)  # images (T, H, W, 3): per channel, kept as (3, 1, 1)
    keep = x.ndim > 2
    s = dict(min=x.min(axis=axes), max=x.max(axis=axes), mean=x.mean(axis=axes), std=x.std(axis=axes))
    if keep:
        s = {k: v[:, None, None] for k, v in s.items()}
    out = {k: np.atleast_1d(v).tolist() for k, v in s.items()}
    out["count"] = [int(x.shape[0])]
    return out


def _merge(stats: list[dict], counts: list[int]) -> dict:
    """Dataset statistics from per-episode ones (pooled mean and variance)."""
    w = np.asarray(counts, np.float64)
    mean = [np.asarray(s["mean"]) for s in stats]
    var = [np.asarray(s["std"]) ** 2 for s in stats]
    m = sum(wi * mi for wi, mi in zip(w, mean)) / w.sum()
    v = sum(wi * (vi + (mi - m) ** 2) for wi, vi, mi in zip(w, var, mean)) / w.sum()
    return dict(min=np.minimum.reduce([np.asarray(s["min"]) for s in stats]).tolist(),
                max=np.maximum.reduce([np.asarray(s["max"]) for s in stats]).tolist(),
                mean=m.tolist(), std=np.sqrt(v).tolist(), count=[int(w.sum())])


def _write_video(path: Path, frames: np.ndarray, fps: int) -> None:
    import imageio.v2 as iio

    path.parent.mkdir(parents=True, exist_ok=True)
    with iio.get_writer(path, fps=fps, codec="libx264", pixelformat="yuv420p", macro_block_size=1,
                        ffmpeg_log_level="error", output_params=["-g", "2", "-crf", "18"]) as w:
        for f in frames:
            w.append_data(f)


def export_lerobot(data: Path, out: Path, fps: int = 10, max_episodes: int | None = None,
                   progress: bool = True) -> dict:
    """Write the iws dataset `data` to `out` in the LeRobotDataset v2.1 layout; returns a summary."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("the LeRobot export writes parquet with pyarrow: pip install 'iws-gym[lerobot]'") from e
    from tqdm import tqdm

    data, out = Path(data), Path(out)
    meta = load_meta(data)
    paths = list_episodes(data)[:max_episodes]
    if not paths:
        raise DatasetError(f"no episodes (ep_*.h5) in {data}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: pick a new --out (nothing was written)")
    task_text = TASKS.get(meta.get("task"), str(meta.get("task")))
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)  # an earlier interrupted export of ours
    (tmp / "meta").mkdir(parents=True)
    episodes, ep_stats, index, size = [], [], 0, None
    for ep_i, p in enumerate(tqdm(paths, desc=f"export {data} -> LeRobot", disable=not progress, unit="ep")):
        ep = read_episode(p, keys=("frames", "actions", "agent_pos", "coverage"))
        T = len(ep["actions"])
        frames = ep["frames"][:T]
        size = frames.shape[1]
        cov_next = np.asarray(ep["coverage"][1 : T + 1], np.float64)
        success = cov_next > SUCCESS
        done = success.copy()
        done[-1] = True
        cols = {
            "observation.state": np.asarray(ep["agent_pos"][:T], np.float32),
            "action": np.asarray(ep["actions"], np.float32),
            "episode_index": np.full(T, ep_i, np.int64), "frame_index": np.arange(T, dtype=np.int64),
            "timestamp": (np.arange(T) / fps).astype(np.float32),
            "next.reward": np.clip(cov_next / SUCCESS, 0, 1).astype(np.float32),
            "next.done": done, "next.success": success,
            "index": np.arange(index, index + T, dtype=np.int64), "task_index": np.zeros(T, np.int64),
        }
        table = pa.table({k: (pa.array(list(v), type=pa.list_(pa.float32(), 2)) if v.ndim == 2 else pa.array(v))
                          for k, v in cols.items()})
        chunk = ep_i // CHUNKS_SIZE
        f = tmp / DATA_PATH.format(episode_chunk=chunk, episode_index=ep_i)
        f.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, f)
        _write_video(tmp / VIDEO_PATH.format(episode_chunk=chunk, video_key=IMAGE_KEY, episode_index=ep_i), frames, fps)
        st = {k: _stats(v[:, None] if v.ndim == 1 else v) for k, v in cols.items()}
        st[IMAGE_KEY] = _stats(frames[::max(1, T // 50)] / 255.0)  # sampled frames, as LeRobot does
        st[IMAGE_KEY]["count"] = [T]
        ep_stats.append(st)
        episodes.append(dict(episode_index=ep_i, tasks=[task_text], length=T))
        index += T
    n = len(episodes)
    with open(tmp / "meta" / "episodes.jsonl", "w") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in episodes)
    with open(tmp / "meta" / "episodes_stats.jsonl", "w") as fh:
        fh.writelines(json.dumps(dict(episode_index=i, stats=s)) + "\n" for i, s in enumerate(ep_stats))
    (tmp / "meta" / "tasks.jsonl").write_text(json.dumps(dict(task_index=0, task=task_text)) + "\n")
    counts = [e["length"] for e in episodes]
    write_json_atomic(tmp / "meta" / "stats.json", {k: _merge([s[k] for s in ep_stats], counts) for k in ep_stats[0]})
    info = dict(codebase_version=CODEBASE_VERSION, robot_type=None, total_episodes=n, total_frames=index,
                total_tasks=1, total_videos=n, total_chunks=(n - 1) // CHUNKS_SIZE + 1, chunks_size=CHUNKS_SIZE,
                fps=fps, splits={"train": f"0:{n}"}, data_path=DATA_PATH, video_path=VIDEO_PATH,
                features=_features(size, fps))
    write_json_atomic(tmp / "meta" / "info.json", info)
    write_json_atomic(tmp / "meta" / "iws_source.json", {**meta, "generated": bool(meta.get("generated")), "exported_from": str(data)})
    if out.exists():
        out.rmdir()  # empty (checked above)
    tmp.rename(out)
    return dict(out=str(out), episodes=n, frames=index, fps=fps, codebase_version=CODEBASE_VERSION,
                generated=bool(meta.get("generated")), source=str(data))
