"""The compact design's latent denoiser run as a sampler from a higher noise level down, instead of one
denoising call at sigma 0.05 (issue 36, thirty-third session). Any `iws` command runs with it:

    python scripts/compact_latent/denoiser_anneal.py --sigma-max 0.2 --n 8 [--mode ode|sde] -- \
        eval stability --checkpoint checkpoints/tpushing --steps 1000 --check-every 10 --drives 16 ...

One denoising call at sigma returns the posterior mean of the clean latent, an average over the poses within
sigma of the prediction: at a higher sigma it pulls harder towards the encodable scenes but draws their blend
(thirty-first session). Integrating the probability-flow ODE of the same denoiser from sigma_max down to
sigma_min (Euler steps on a geometric grid, EDM's d = (x - D(x, sigma)) / sigma, the last step a denoising call
at sigma_min) instead follows the density to one scene near the prediction. `--mode sde` first adds noise of
sigma_max (SDEdit: a draw instead of the nearest mode; the noise comes from torch's global generator, seeded
by --seed). `--trigger M` keeps the released call wherever it moves the prediction by at most M (mean square, in
z's standard deviations) and runs the ODE only where the prediction is far from the encodable scenes (a blend).
Only latents the gate let move are touched, so a world at rest stays exact. With --json, the report records the
settings and this command.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from iws_gym.models import compact


def sigmas(sigma_max: float, sigma_min: float, n: int) -> list[float]:
    """n levels from sigma_max to sigma_min, geometric."""
    if n == 1:
        return [sigma_max]
    r = math.log(sigma_min / sigma_max) / (n - 1)
    return [sigma_max * math.exp(r * i) for i in range(n)]


def anneal(den, z, p, levels, mode):
    s0 = levels[0]
    x = z + s0 * den.z_sd * torch.randn_like(z) if mode == "sde" else z
    for s, s_next in zip(levels[:-1], levels[1:]):
        d = (x - den(x, p, torch.full((len(x),), s, device=x.device))) / s
        x = x + (s_next - s) * d
    return den(x, p, torch.full((len(x),), levels[-1], device=x.device))


def install(sigma_max, sigma_min, n, mode, trigger=None):
    levels = sigmas(sigma_max, sigma_min, n)

    def predict(self, z, p, a, n_valid):
        z1, gate = self.dynamics(z, p, a, n_valid)
        p1 = compact.agent_landing(p, a, n_valid, self.cfg.agent_motion).clamp(0, 1)
        zd = anneal(self.denoiser, z1, p1, levels, mode)
        if trigger is not None:  # the released call where it moves the prediction less than `trigger`
            z_one = self.denoiser(z1, p1, torch.full((len(z1),), self.cfg.denoiser_sigma, device=z1.device))
            small = ((z_one - z1) / self.denoiser.z_sd).pow(2).mean(1, keepdim=True) <= trigger
            zd = torch.where(small, z_one, zd)
        open_ = (gate > 0)[:, None]
        moved = torch.where(open_, (zd - z1) / self.denoiser.z_sd, 0.0).pow(2).mean(1)
        return torch.where(open_, zd, z1), gate, moved

    compact.CompactStage2.predict = predict
    return levels


def main():
    argv = sys.argv[1:]
    if "--" not in argv:
        sys.exit("usage: denoiser_anneal.py [options] -- <iws command>")
    i = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sigma-max", type=float, required=True)
    ap.add_argument("--sigma-min", type=float, default=0.01)
    ap.add_argument("--n", type=int, default=8, help="denoiser calls per step")
    ap.add_argument("--mode", choices=("ode", "sde"), default="ode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trigger", type=float, default=None,
                    help="keep the released one call where it moves the prediction by at most this much (mean square, "
                    "z's sd units) and run the ODE only on the others (a blend is far from the encodable scenes)")
    a = ap.parse_args(argv[:i])
    if a.n < 1 or not 0 < a.sigma_min <= a.sigma_max:
        sys.exit(f"need --n >= 1 and 0 < --sigma-min <= --sigma-max, got {a.n}, {a.sigma_min}, {a.sigma_max}")
    torch.manual_seed(a.seed)
    levels = install(a.sigma_max, a.sigma_min, a.n, a.mode, a.trigger)
    print("denoiser levels", [round(s, 4) for s in levels], a.mode, flush=True)
    from iws_gym.cli import main as iws

    rest = argv[i + 1:]
    iws(rest)
    if "--json" in rest:  # the report records what ran
        stamp(rest[rest.index("--json") + 1], vars(a), levels)


def stamp(path, settings, levels):
    import json

    r = json.loads(open(path).read())
    r["denoiser_anneal"] = dict(settings, levels=[round(s, 5) for s in levels])
    r["command"] = "python " + " ".join(sys.argv)
    with open(path, "w") as f:
        json.dump(r, f, indent=1, default=float)


if __name__ == "__main__":
    main()
