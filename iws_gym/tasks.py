"""Task configs: one short TOML file per task under `envs/` (ground truth, action space, frame size, scorer...)."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ENVS_DIR = REPO_ROOT / "envs"


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
    checkpoint: str             # shipped weights, relative to the repo root
    heldout_seed_base: int      # held-out seeds are >= this; training seeds < this

    @property
    def checkpoint_path(self) -> Path:
        return REPO_ROOT / self.checkpoint


def available_tasks() -> list[str]:
    return sorted(p.stem for p in ENVS_DIR.glob("*.toml"))


def load_task(name: str) -> TaskConfig:
    path = ENVS_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"unknown task {name!r}; available tasks: {', '.join(available_tasks()) or 'none'} (configs in {ENVS_DIR})")
    raw = tomllib.loads(path.read_text())
    names = {f.name for f in fields(TaskConfig)}
    missing, extra = names - raw.keys(), raw.keys() - names
    if missing or extra:
        raise ValueError(f"{path}: missing keys {sorted(missing)}, unknown keys {sorted(extra)}")
    return TaskConfig(**raw)
