"""Episode storage and training windows. The one place the dataset format is defined.

A dataset is a directory:

    DIR/
      dataset.json           task, seed range, collection settings, iws-gym commit (written last)
      ep_000000.h5           one HDF5 file per episode, written to a temp name then renamed (atomic)
      ...

Each episode file holds T steps and T+1 observations:

    frames       (T+1, H, W, 3) uint8   RGB, chunks of 16 frames, lzf-compressed
    actions      (T, 2)      float32    absolute agent target in the 512 canvas; actions[t] leads frames[t] -> frames[t+1]
    agent_pos    (T+1, 2)    float32    agent position in the 512 canvas
    coverage     (T+1,)      float32    true task score (goal coverage): for evaluation only
    segments     (T,)        int8       index into attrs["segment_names"]: which behaviour produced the step
    attrs: seed, task, steps, segment_names, format_version
and the task's true state, for evaluation only (models never read it; each task package names its arrays):
    block_pose   (T+1, 3)    float32    T pushing: the block's (x, y, angle)
    n_contacts   (T,)        int16      T pushing: contact points per step (gym-pusht's info["n_contacts"])
    pieces       (T+1, N, 2) float32    pile sweeping: every piece's centre

An interrupted collection leaves finished episodes intact and at most a `*.h5.tmp` file, which readers
ignore and the next collection into the same directory may delete.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

FORMAT_VERSION = 1
COMMON = ("frames", "actions", "agent_pos", "coverage", "segments")  # every episode has these
ARRAYS = {  # name: (dtype, trailing shape or None where it varies, length offset relative to T)
    "frames": (np.uint8, None, 1),
    "actions": (np.float32, (2,), 0),
    "agent_pos": (np.float32, (2,), 1),
    "coverage": (np.float32, (), 1),
    "segments": (np.int8, (), 0),
    "block_pose": (np.float32, (3,), 1),
    "n_contacts": (np.int16, (), 0),
    "pieces": (np.float32, None, 1),
}


class DatasetError(ValueError):
    """A dataset or episode file is missing, corrupt, truncated or malformed."""


def episode_path(root: Path, index: int) -> Path:
    return Path(root) / f"ep_{index:06d}.h5"


def write_episode(path: Path, ep: dict, attrs: dict) -> None:
    """Write one episode atomically: to `path.tmp`, flushed and fsynced, then renamed over `path`. Writes
    the arrays of ARRAYS that `ep` holds; those of COMMON are required."""
    path = Path(path)
    missing = [k for k in COMMON if k not in ep]
    if missing:
        raise ValueError(f"episode lacks the arrays {missing}")
    T = len(ep["actions"])
    names = [k for k in ARRAYS if k in ep]
    for name in names:
        arr = np.asarray(ep[name])
        if len(arr) != T + ARRAYS[name][2]:
            raise ValueError(f"episode array {name!r} has length {len(arr)}, expected {T + ARRAYS[name][2]}")
    tmp = path.with_name(path.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        for name in names:
            arr = np.asarray(ep[name], dtype=ARRAYS[name][0])
            if name == "frames":
                f.create_dataset(name, data=arr, chunks=(min(16, len(arr)),) + arr.shape[1:], compression="lzf")
            else:
                f.create_dataset(name, data=arr)
        for k, v in {**attrs, "steps": T, "format_version": FORMAT_VERSION}.items():
            f.attrs[k] = v
        f.flush()
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_episode(path: Path, keys=None) -> dict:
    """Read an episode file fully into memory, validating it (all the arrays it holds when `keys` is None).
    Raises DatasetError naming the file."""
    path = Path(path)
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format_version") != FORMAT_VERSION:
                raise DatasetError(f"{path}: format_version {f.attrs.get('format_version')!r}, expected {FORMAT_VERSION}")
            keys = [k for k in ARRAYS if k in f] if keys is None else list(keys)
            absent = [k for k in keys if k not in f]
            if absent:
                raise DatasetError(f"{path}: no array {', '.join(map(repr, absent))} in this {f.attrs.get('task', '?')} episode "
                                   f"(it holds {', '.join(f.keys())})")
            T = int(f.attrs["steps"])
            out = {k: f[k][()] for k in keys}
            out["attrs"] = dict(f.attrs)
    except DatasetError:
        raise
    except (OSError, KeyError) as e:
        raise DatasetError(f"{path}: corrupt or truncated episode file ({e})") from None
    for k in keys:
        dtype, shape, off = ARRAYS[k]
        if len(out[k]) != T + off:
            raise DatasetError(f"{path}: {k!r} has {len(out[k])} rows, expected {T + off}")
    if "frames" in out and (out["frames"].ndim != 4 or out["frames"].shape[-1] != 3):
        raise DatasetError(f"{path}: frames have shape {out['frames'].shape}, expected (T+1, H, W, 3)")
    return out


def list_episodes(root: Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"dataset directory {root} does not exist")
    return sorted(root.glob("ep_*.h5"))


def merge_datasets(sources, out: Path) -> dict:
    """One dataset made of several (e.g. scripted play and expert demonstrations): OUT holds relative
    symbolic links ep_000000.h5 ... to every source's episodes in order, and a dataset.json that names
    each source with its seeds and mix. Sources must be of one task and frame size. Nothing is copied,
    and OUT is refused unless it is new or empty. Returns the written metadata."""
    out = Path(out)
    sources = [Path(s) for s in sources]
    if len(sources) < 2:
        raise DatasetError(f"--data needs at least two datasets to merge, got {len(sources)}")
    if any(out.resolve() == s.resolve() for s in sources):
        raise DatasetError(f"output {out} is one of the sources")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DatasetError(f"output {out} exists and is not an empty directory")
    metas, paths = [load_meta(s) for s in sources], [list_episodes(s) for s in sources]
    for s, m, ps in zip(sources, metas, paths):
        if not ps:
            raise DatasetError(f"no episodes (ep_*.h5) in {s}")
        for k in ("task", "frame_size"):
            if m.get(k) != metas[0].get(k):
                raise DatasetError(f"datasets differ in {k}: {sources[0]} has {metas[0].get(k)!r}, {s} has {m.get(k)!r}")
    out.mkdir(parents=True, exist_ok=True)
    merged, i = [], 0
    for s, m, ps in zip(sources, metas, paths):
        merged.append(dict(data=str(s), first_episode=i, episodes=len(ps),
                           **{k: m[k] for k in ("seed", "seeds", "mix", "steps", "generated") if k in m}))
        for src in ps:
            os.symlink(os.path.relpath(src.resolve(), out.resolve()), out / f"ep_{i:06d}.h5")
            i += 1
    meta = dict(task=metas[0]["task"], episodes=i, frame_size=metas[0].get("frame_size"), seed=None, mix="merged",
                merged_from=merged, **{k: metas[0][k] for k in ("ground_truth", "gym_pusht_version") if k in metas[0]})
    write_json_atomic(out / "dataset.json", meta)
    return meta


def load_meta(root: Path) -> dict:
    p = Path(root) / "dataset.json"
    if not p.is_file():
        raise DatasetError(f"{p} is missing: not a finished iws dataset (run `iws collect`)")
    return json.loads(p.read_text())


def write_json_atomic(path: Path, obj) -> None:
    """Strict JSON (NaN / inf, e.g. an undefined correlation, become null), written atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_finite(obj), indent=2, default=_json_default, allow_nan=False))
    os.replace(tmp, path)


def _finite(o):
    if isinstance(o, (float, np.floating)):
        return float(o) if np.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    if isinstance(o, np.ndarray):
        return _finite(o.tolist())
    return o


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o))


# ----------------------------------------------------------------------------------------------- loader

@dataclass
class InMemoryEpisodes:
    """Episodes of a dataset held in RAM (uint8 frames): 600 x 201 frames of 128x128 is ~5.9 GB."""

    frames: list[np.ndarray]      # each (T+1, H, W, 3) uint8
    actions: list[np.ndarray]     # each (T, 2) float32
    paths: list[Path]

    @classmethod
    def load(cls, root: Path, max_episodes: int | None = None, progress: bool = True) -> "InMemoryEpisodes":
        from tqdm import tqdm

        paths = list_episodes(root)[:max_episodes]
        if not paths:
            raise DatasetError(f"no episodes (ep_*.h5) in {root}")
        frames, actions = [], []
        for p in tqdm(paths, desc=f"loading {root}", disable=not progress, unit="ep"):
            ep = read_episode(p, keys=("frames", "actions"))
            frames.append(ep["frames"])
            actions.append(ep["actions"])
        return cls(frames, actions, paths)

    @property
    def num_frames(self) -> int:
        return sum(len(f) for f in self.frames)

    def sample_frames(self, rng: np.random.Generator, batch: int) -> np.ndarray:
        """Random single frames: (B, H, W, 3) uint8."""
        ei = rng.integers(0, len(self.frames), batch)
        return np.stack([self.frames[e][rng.integers(0, len(self.frames[e]))] for e in ei])

    def sample_windows(self, rng: np.random.Generator, batch: int, context: int):
        """Random training windows: `context` frames, the actions that follow each, and the next frame.

        Returns frames (B, context+1, H, W, 3) uint8 and actions (B, context, 2) float32, where
        actions[:, i] takes frames[:, i] to frames[:, i+1]; the last frame is the prediction target.
        """
        ei = rng.integers(0, len(self.frames), batch)
        fr, ac = [], []
        for e in ei:
            T = len(self.actions[e])
            s = rng.integers(0, T - context + 1)
            fr.append(self.frames[e][s : s + context + 1])
            ac.append(self.actions[e][s : s + context])
        return np.stack(fr), np.stack(ac)
