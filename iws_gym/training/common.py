"""What every stage shares: its options, device, the dataset's metadata and task, and loading a frozen
released stage."""
from __future__ import annotations

import argparse
from dataclasses import field, fields

import torch

from iws_gym.data.episodes import load_meta
from iws_gym.envs.registry import load_task


class StageBase:
    """A stage plugs into the loop in train.py: `model` (with `loss(batch, step) -> (loss, logs)`),
    `config` (the model config embedded in the release), `sample_batch(rng, batch)`, `evaluate(ema)`
    (on validation episodes) and `export(ema, out, result)`."""

    channels_last = True

    def __init__(self, a, o, device):
        self.a, self.o, self.device = a, o, device
        self.meta = load_meta(a.data)
        self.task = load_task(self.meta["task"])

    def after_step(self, model, step):
        pass


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample PSNR (dB) of frames in [-1, 1] measured on the [0, 1] scale."""
    mse = ((a.float() - b.float()) / 2).pow(2).flatten(1).mean(1).clamp_min(1e-10)
    return -10 * torch.log10(mse)


def arg(default, help: str):
    """A dataclass field whose help text becomes the flag's `--help`."""
    return field(default=default, metadata={"help": help})


def add_dataclass_args(p: argparse.ArgumentParser, cls, defaults) -> None:
    """One flag per field of dataclass `cls`, its help from the field's metadata and its default from `defaults`."""
    for f in fields(cls):
        d = getattr(defaults, f.name)
        flag, help = f"--{f.name.replace('_', '-')}", f.metadata.get("help", "")
        if isinstance(d, bool):
            p.add_argument(flag, default=d, action=argparse.BooleanOptionalAction, help=help)
        else:
            typ = {"int | None": int, "float | None": float, "str | None": str}.get(str(f.type)) or \
                {int: int, float: float}.get(type(d), str)
            p.add_argument(flag, type=typ, default=d, help=help)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every flag's help; the stage's docstring (with its example commands) as written."""
