"""Checkpoints: configs as dataclasses travelling with the weights.

* Released weights: `<name>.safetensors` (bf16 by default) whose metadata holds the JSON config, the
  kind of model, the data seed and the git commit, so `load_release(path)` needs nothing else.
* Training state: `last.pt` (model, EMA, optimizer, step, RNG) for resuming; written atomically.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import typing
from pathlib import Path

import torch


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(cls, d: dict, where: str = "config"):
    """Rebuild a (nested) dataclass from a dict; unknown or missing fields are errors naming them."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a mapping for {cls.__name__}, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"{where}: fields {sorted(unknown)} are not in {cls.__name__} (checkpoint from another code version?)")
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue  # newer field with a default: old checkpoints stay loadable
        v, t = d[f.name], hints[f.name]
        if dataclasses.is_dataclass(t):
            v = config_from_dict(t, v, f"{where}.{f.name}")
        elif t is tuple or typing.get_origin(t) is tuple:
            v = tuple(v)
        kw[f.name] = v
    return cls(**kw)


def _tmp_name(path: Path) -> Path:
    """A temporary name beside `path` that no other process writing the same file uses (runs that share a
    dataset build its latent cache at once: each writes its own file, and the last rename wins)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def atomic_torch_save(obj, path: Path) -> None:
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_release(path: Path, state_dict: dict, kind: str, config, extra: dict | None = None,
                 dtype=torch.bfloat16) -> None:
    """Write weights (floating tensors cast to `dtype`) with the config in the safetensors metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
               for k, v in state_dict.items()}
    meta = {"kind": kind, "config": json.dumps(config_to_dict(config))}
    meta.update({k: json.dumps(v) for k, v in (extra or {}).items()})
    _write_safetensors(path, tensors, meta)


def _write_safetensors(path: Path, tensors: dict, meta: dict) -> None:
    """Atomic write: a temporary file renamed over `path`, so a crash never leaves half a checkpoint."""
    from safetensors.torch import save_file

    tmp = _tmp_name(path)
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_safetensors(path: Path, tensors: bool = True) -> tuple[dict, dict]:
    """-> (metadata strings, tensors as stored; none with tensors=False: the header alone is read). Errors name
    the file."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()} if tensors else {}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable safetensors file, truncated or corrupt ({e})") from None


def release_metadata(path: Path) -> dict:
    """A release file's metadata (its kind, and the JSON entries decoded) without loading its weights."""
    meta = _read_safetensors(Path(path), tensors=False)[0]
    return {k: v if k == "kind" else json.loads(v) for k, v in meta.items()}


def release_kind(path: Path) -> str | None:
    """The kind of model a release file holds ("stage1", "visuomotor", ...). Errors name the file."""
    return _read_safetensors(Path(path), tensors=False)[0].get("kind")


def load_release(path: Path, kind: str, config_cls):
    """-> (config, state_dict (float32), metadata). Errors name the file and what is wrong."""
    path = Path(path)
    meta, sd = _read_safetensors(path)
    if meta.get("kind") != kind:
        raise ValueError(f"{path}: holds a {meta.get('kind')!r} model, expected {kind!r}")
    if "config" not in meta:
        raise ValueError(f"{path}: no 'config' in the metadata")
    cfg = config_from_dict(config_cls, json.loads(meta["config"]), where=f"{path} config")
    sd = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
    return cfg, sd, {k: json.loads(v) for k, v in meta.items() if k not in ("kind", "config")}


def load_state_checked(module: torch.nn.Module, sd: dict, path) -> None:
    own = module.state_dict()
    bad_shape = [k for k, v in own.items() if k in sd and sd[k].shape != v.shape]
    missing, unexpected = [k for k in own if k not in sd], [k for k in sd if k not in own]
    if not (missing or unexpected or bad_shape):
        module.load_state_dict(sd)
    if missing or unexpected or bad_shape:
        raise ValueError(f"{path}: weights do not match the code's model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, wrong shape {bad_shape[:5]}")


def find_release(path, name: str) -> Path:
    """A stage release file: `path` itself, or `path/<name>.safetensors` for a run or checkpoint directory."""
    p = Path(path)
    return p / f"{name}.safetensors" if p.is_dir() else p


def load_stage(path, name, config_cls, model_cls, device):
    """A frozen released stage from a file or directory -> (model, metadata, file)."""
    f = find_release(path, name)
    cfg, sd, meta = load_release(f, name, config_cls)
    model = model_cls(cfg)
    load_state_checked(model, sd, f)
    return model.to(device).eval().requires_grad_(False), meta, str(f)


def git_commit() -> str:
    """The source checkout's commit (with "-dirty" for uncommitted changes), for provenance; "unknown"
    outside a git checkout (an installed wheel)."""
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, timeout=5)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
