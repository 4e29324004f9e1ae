"""How far to trust the learned world at each step: a signal computed from the world model alone.

The signal is the decode-encode cycle error of each prediction: the predicted latent z is decoded into the
frame the user sees and that frame encoded again, E(D(z)); a latent the decoder renders faithfully comes back
close to itself, while a latent off the manifold of real frames (a fading, bending or split object, a phantom
agent) does not. Re-encoding already does this round trip every step (WorldModel.step), so the signal costs a
subtraction. It is generic: nothing in it knows what the scene holds.

    s_t = mean(((E(D(z_t)) - z_t) / z_std)^2)        per env, the latents' own units
    m_t = (1 - alpha) m_{t-1} + alpha s_t             smoothed over steps (m_1 = s_1)
    trust_t = 1 / (1 + (m_t / m_half)^slope)          in [0, 1], higher is better; 0.5 at m_half
    trust_min_t = min over the episode so far         the episode's trust

`m_half` and `slope` are calibrated per release against the ground truth (`iws eval trust --fit`, written
to `trust.json` beside the weights); without that file the defaults below apply and the trust is
uncalibrated (`TrustCalibration.source`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

TRUST_FILE = "trust.json"
TRUSTED = 0.5  # an episode is trusted while its running minimum trust stays at or above this


@dataclass(frozen=True)
class TrustCalibration:
    alpha: float = 0.1      # EMA weight of a new step's cycle error
    m_half: float = 0.03    # the smoothed cycle error at which trust is 0.5
    slope: float = 4.0      # how sharply trust falls around m_half (in log signal)
    source: str = "uncalibrated default"

    def __post_init__(self):
        if not (0 < self.alpha <= 1 and self.m_half > 0 and self.slope > 0):
            raise ValueError(f"trust calibration needs 0 < alpha <= 1, m_half > 0, slope > 0; got {self}")

    @classmethod
    def load(cls, checkpoint) -> "TrustCalibration":
        """The calibration stored beside a release (`trust.json`), or the uncalibrated default."""
        p = Path(checkpoint) / TRUST_FILE if checkpoint is not None else None
        if p is None or not p.is_file():
            return cls()
        d = json.loads(p.read_text())
        try:
            return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d} | {"source": str(p)})
        except TypeError as e:
            raise ValueError(f"{p}: not a trust calibration ({e})") from None

    def trust(self, m: torch.Tensor) -> torch.Tensor:
        return 1.0 / (1.0 + (m.clamp_min(0) / self.m_half) ** self.slope)


def cycle_error(z: torch.Tensor, z_cycle: torch.Tensor, z_std: float) -> torch.Tensor:
    """Per-env cycle error (B,) of predictions z (B, C, h, w) against their decode-encode round trip."""
    return ((z_cycle.float() - z.float()) / z_std).pow(2).flatten(1).mean(1)


def update(state: dict, s: torch.Tensor, cal: TrustCalibration) -> None:
    """Fold one step's cycle errors s (B,) into the rollout state's smoothed signal, trust and minimum."""
    first = state["t"] <= 1
    state["trust_m"] = torch.where(first, s, (1 - cal.alpha) * state["trust_m"] + cal.alpha * s)
    state["trust"] = cal.trust(state["trust_m"])
    state["trust_min"] = torch.minimum(state["trust_min"], state["trust"])
