"""Named held-out splits: every seed that evaluation uses, in one place.

Training collections use seeds below the task's `heldout_seed_base`; everything here starts at that
base plus an offset, so no split ever overlaps training data. A split is a range of consecutive seeds;
each command takes the first n of its split. Tune on `validation`, report on `test`.
"""
from __future__ import annotations

SPLITS = {
    "test": 0,                       # the fidelity reports' episodes, policy-evaluation starts, the env's start bank
    "scorer": 3000,                  # iws eval scorer
    "contact": 5000,                 # iws eval contact; the stability check's scripted drive
    "stability_calibration": 6000,   # real frames the stability envelope is calibrated on
    "stability_check": 7000,         # real frames its false-alarm rate is measured on; iws eval probe's starts
    "validation": 8000,              # choosing settings and designs; evaluation during training
    "set3": 16000,                   # further test sets of the reports (48 episodes each)
    "set4": 24000,
}
START_BANK = 1000  # reset() without options draws its start from the first START_BANK seeds of "test"


def split_offset(name: str) -> int:
    """The offset of split `name` from the held-out base; a ValueError naming the choices otherwise."""
    if name not in SPLITS:
        raise ValueError(f"unknown split {name!r}; choose from {', '.join(SPLITS)}")
    return SPLITS[name]
