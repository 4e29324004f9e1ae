"""Task configs: one short TOML file per task in iws_gym/envs/configs/ (package data): ground truth, action
space, frame size, scorer, shipped weights, and the task's module (its ground truth and behaviours). The
shipped weights are found by `weights_path`."""
from __future__ import annotations

import importlib
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # iws_gym/
CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def weights_path(rel: str) -> Path:
    """Where shipped weights `rel` (e.g. "checkpoints/tpushing") are: under $IWS_CHECKPOINTS when set, in an
    installed package under iws_gym/checkpoints/, in a source checkout under <repo>/checkpoints/. Raises
    FileNotFoundError naming every place looked in."""
    rel = Path(rel)
    sub = Path(*rel.parts[1:]) if rel.parts and rel.parts[0] == "checkpoints" else rel
    places = ([Path(os.environ["IWS_CHECKPOINTS"]) / sub] if os.environ.get("IWS_CHECKPOINTS") else []) + \
        [PACKAGE_DIR / "checkpoints" / sub, PACKAGE_DIR.parent / "checkpoints" / sub]
    for p in places:
        if p.exists():
            return p
    raise FileNotFoundError(f"shipped weights {rel} not found in {', '.join(map(str, places))}; set IWS_CHECKPOINTS to "
                            f"a directory holding {sub}, or pass checkpoint=DIR")


@dataclass(frozen=True)
class TaskConfig:
    name: str
    env_id: str
    ground_truth: str           # gymnasium id of the ground-truth simulator
    frame_size: int             # square RGB frames, uint8
    action_low: float
    action_high: float
    control_hz: int
    episode_steps: int          # steps per collected episode
    max_episode_steps: int      # TimeLimit of the learned env
    scorer: str                 # "module:Class" of the default success scorer
    checkpoint: str             # shipped weights, "checkpoints/<name>" (see weights_path)
    heldout_seed_base: int      # held-out seeds are >= this; training seeds < this
    task_module: str = "iws_gym.tasks.pusht.task"  # the task's module (the interface in iws_gym/tasks/__init__.py)

    @property
    def checkpoint_path(self) -> Path:
        return weights_path(self.checkpoint)

    @property
    def module(self):
        """The task's module: its ground truth, behaviours and what collection records (iws_gym/tasks/__init__.py)."""
        return importlib.import_module(self.task_module)

    def make_scorer(self):
        """The task's default success scorer, built for its frame size."""
        module, _, name = self.scorer.partition(":")
        return getattr(importlib.import_module(module), name)(frame_size=self.frame_size)


def available_tasks() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def load_task(name: str) -> TaskConfig:
    path = CONFIG_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"unknown task {name!r}; available tasks: {', '.join(available_tasks()) or 'none'} (configs in {CONFIG_DIR})")
    raw = tomllib.loads(path.read_text())
    names = {f.name for f in fields(TaskConfig)}
    missing, extra = names - raw.keys() - {"task_module"}, raw.keys() - names
    if missing or extra:
        raise ValueError(f"{path}: missing keys {sorted(missing)}, unknown keys {sorted(extra)}")
    return TaskConfig(**raw)
