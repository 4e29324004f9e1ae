"""Checkpoints: configs as dataclasses travelling with the weights.

* Released weights: `<name>.safetensors` (bf16 by default) whose metadata holds the JSON config, the
  kind of model, the data seed and the git commit, so `load_release(path)` needs nothing else.
* Training state: `last.pt` (model, EMA, optimizer, step, RNG) for resuming; written atomically.
"""
from __future__ import annotations

import dataclasses
import json
import os
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


def atomic_torch_save(obj, path: Path) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


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

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def _read_safetensors(path: Path) -> tuple[dict, dict]:
    """-> (metadata strings, tensors as stored). Errors name the file."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable safetensors file, truncated or corrupt ({e})") from None


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


def average_releases(paths: list, out: Path, weights: list | None = None) -> dict:
    """Weight average ("model soup") of releases of one kind and config, e.g. fine-tunes of one release.

    Floating tensors are averaged in fp32 (`weights`: one per file, default uniform) and stored in the
    first file's dtype; other tensors and the metadata are the first file's, with the sources under
    `averaged_from`. Errors name the file and the key that does not match. Returns a summary."""
    paths = [Path(p) for p in paths]
    if len(paths) < 2:
        raise ValueError(f"averaging needs at least two files, got {len(paths)}")
    weights = [1.0 / len(paths)] * len(paths) if weights is None else [float(w) for w in weights]
    if len(weights) != len(paths) or any(w < 0 for w in weights) or abs(sum(weights) - 1) > 1e-6:
        raise ValueError(f"weights must be one non-negative number per file summing to 1, got {weights}")
    metas, sds = zip(*(_read_safetensors(p) for p in paths))
    for p, m, sd in zip(paths[1:], metas[1:], sds[1:]):
        for key in ("kind", "config"):
            if m.get(key) != metas[0].get(key):
                raise ValueError(f"{p}: metadata {key!r} differs from {paths[0]}'s; only releases of one model can be averaged")
        if set(sd) != set(sds[0]):
            raise ValueError(f"{p}: tensor names differ from {paths[0]}'s: {sorted(set(sd) ^ set(sds[0]))[:5]}")
        bad = [k for k in sd if sd[k].shape != sds[0][k].shape]
        if bad:
            raise ValueError(f"{p}: tensor {bad[0]!r} has shape {tuple(sd[bad[0]].shape)}, {paths[0]} {tuple(sds[0][bad[0]].shape)}")
    avg = {}
    for k, v0 in sds[0].items():
        if v0.is_floating_point():
            xs = torch.stack([sd[k].float() for sd in sds])  # (n_files, *shape)
            if len(set(weights)) == 1:
                mean = xs.mean(0)
            else:
                mean = (xs * torch.tensor(weights).view(-1, *[1] * v0.dim())).sum(0)
            avg[k] = mean.to(v0.dtype).contiguous()
        else:
            avg[k] = v0
    meta = dict(metas[0])
    meta["averaged_from"] = json.dumps([dict(file=str(p), weight=w) for p, w in zip(paths, weights)])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_safetensors(out, avg, meta)
    return dict(out=str(out), kind=meta.get("kind"), averaged_from=json.loads(meta["averaged_from"]), tensors=len(avg))


def load_state_checked(module: torch.nn.Module, sd: dict, path) -> None:
    own = module.state_dict()
    bad_shape = [k for k, v in own.items() if k in sd and sd[k].shape != v.shape]
    missing, unexpected = [k for k in own if k not in sd], [k for k in sd if k not in own]
    if not (missing or unexpected or bad_shape):
        module.load_state_dict(sd)
    if missing or unexpected or bad_shape:
        raise ValueError(f"{path}: weights do not match the code's model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, wrong shape {bad_shape[:5]}")
