"""Stage 2 of the compact design (models/compact.py): the dynamics over z, trained on open-loop unrolls, and
the latent denoiser, on the latents of a trained compact stage 1.

    iws train compact2 --data data/play_expert --extra-data data/random,data/jittery --init runs/compact1 \\
        --out runs/compact2

Every episode is encoded once by the stage-1 release (cached in OUT). Each training window starts from a real
context of 1..K latents and is unrolled open loop for 2, H/2 or H steps, the loss on every step (in units of
z's standard deviation). A share `--still` of the windows shows a world at rest (one frame repeated, the
agent commanded to stay), with an L1 pull on the gate there, so the gate learns to close exactly where nothing
acts. The pull ramps up over `--gate-warmup` steps, and a closed gate still gets the gradient that would open
it: without both, the gate closes everywhere before the change is learnt and never reopens. The denoiser
learns D(z + sigma eps) ~ z over sigma in [0.005, 2] on single latents beside it.
Runs in fp32 (small MLPs: bf16's rounding would bias a change that must be exactly zero at rest).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from iws_gym.data.collect import heldout_episodes
from iws_gym.data.episodes import list_episodes, read_episode
from iws_gym.models.checkpoint import (atomic_torch_save, find_release, git_commit, load_release, load_state_checked,
                                       save_release)
from iws_gym.models.compact import (CANVAS, STAGE1_KIND, STAGE2_KIND, CompactStage1, CompactStage1Config,
                                    CompactStage2, CompactStage2Config, pad_first)
from iws_gym.models.dynamics import fit_agent_motion
from iws_gym.models.frames import frames_to_tensor
from iws_gym.models.hardware import autocast
from iws_gym.training.common import StageBase, arg
from iws_gym.training.compact1 import COLLAPSED, data_dirs


@dataclass
class Options:
    init: str = arg("runs/compact1", "the compact stage-1 release (run directory or stage1.safetensors)")
    extra_data: str = arg("", "more datasets, comma-separated (as for compact1)")
    horizon: int = arg(16, "longest open-loop unroll H in training (windows unroll 2, H/2 or H steps)")
    still: float = arg(0.1, "share of windows showing a world at rest")
    still_l1: float = arg(0.1, "weight of the gate's L1 pull on those windows")
    gate_warmup: int = arg(2000, "steps over which that pull ramps up from 0: the change is learnt before the gate "
                                 "may close (a pull at full weight from step 0 closes it everywhere)")
    ctx_noise: float = arg(0.05, "noise on the real context, up to this many standard deviations of z")
    denoiser_weight: float = arg(1.0, "weight of the denoiser's loss (0 with --preset nodenoiser)")
    moving_share: float = arg(0.0, "share of windows placed where the scene (not only the agent) moves: z changes "
                                   "by more than 0.1 of its standard deviation in a predicted step")
    finetune: str | None = arg(None, "continue this compact stage-2 release (its config and normalisation; "
                                     "--preset is ignored); it must belong to the --init stage 1's latent")
    preset: str = arg("default", "model size: default | nodenoiser | tiny (tests)")


PRESETS = {"default": {}, "nodenoiser": dict(denoiser_blocks=0), "tiny": dict(width=32, blocks=1, denoiser_blocks=1)}


class Latents:
    """Every episode's latents z (N, D), agent positions p and actions a (N, 2) in [0, 1] (the last frame of an
    episode repeats its last action), flattened, with each episode's span."""

    def __init__(self, z, p, a, lengths):
        self.z, self.p, self.a = z, p, a
        ends = np.cumsum(lengths)
        self.spans = list(zip(ends - np.asarray(lengths), ends))

    @classmethod
    def encode(cls, episodes, encoder, device, amp=True):
        from tqdm import tqdm

        zs, ps, acts, lengths = [], [], [], []
        with torch.no_grad(), autocast(device, amp):
            for ep in tqdm(episodes, desc="encode", unit="ep"):
                zs.append(torch.cat([encoder(frames_to_tensor(ep["frames"][i : i + 128], device)).float().cpu()
                                     for i in range(0, len(ep["frames"]), 128)]))
                ps.append(torch.as_tensor(ep["agent_pos"], dtype=torch.float32) / CANVAS)
                a = np.concatenate([ep["actions"], ep["actions"][-1:]]).astype(np.float32)
                acts.append(torch.as_tensor(a) / CANVAS)
                lengths.append(len(ep["frames"]))
        return cls(torch.cat(zs), torch.cat(ps), torch.cat(acts), lengths)

    def to(self, device):
        self.z, self.p, self.a = self.z.to(device), self.p.to(device), self.a.to(device)
        return self

    def moving_frames(self, threshold: float = 0.1) -> np.ndarray:
        """Flat indices t whose next latent differs from z_t by more than `threshold` standard deviations of z
        (norm over z's dims): where something other than the agent moves."""
        z = self.z.cpu()
        dz = ((z[1:] - z[:-1]) / z.std(0).clamp_min(1e-8)).norm(dim=1).numpy()
        last = np.zeros(len(z) - 1, bool)
        last[[e - 1 for _, e in self.spans if e - 1 < len(last)]] = True  # no step across episodes
        return np.flatnonzero((dz > threshold) & ~last)

    def windows(self, rng, batch, K, H, still=0.0, moving=None, moving_share=0.0):
        """Index windows (B, K+H) into the flat arrays with 1..K valid context slots (half of them K; padded
        slots repeat the first valid one), n_valid (B,), and which rows show a world at rest (B,). A share
        `moving_share` of the windows is placed around a frame drawn from `moving` (see moving_frames), so that
        the motion falls in its predicted steps; the rest start anywhere."""
        eps = rng.integers(0, len(self.spans), batch)
        nv = rng.integers(1, K + 1, batch)
        nv[rng.random(batch) < 0.5] = K
        around = rng.random(batch) < moving_share if moving is not None and len(moving) else np.zeros(batch, bool)
        starts = np.array([b for b, _ in self.spans])
        rows = []
        for e, n, m in zip(eps, nv, around):
            if m:
                t = int(moving[rng.integers(len(moving))])
                e = int(np.searchsorted(starts, t, side="right") - 1)
            b, end = self.spans[e]
            hi = max(b + 1, end - H - n + 1)
            t0 = int(np.clip(t - n + 1 - rng.integers(0, H), b, hi - 1)) if m else rng.integers(b, hi)
            rows.append(np.r_[np.full(K - n, t0), np.arange(t0, t0 + n + H)].clip(max=end - 1))
        idx = torch.as_tensor(np.stack(rows))
        at_rest = torch.as_tensor(rng.random(batch) < still)
        idx[at_rest] = idx[at_rest, -1:]  # one frame repeated
        dev = self.z.device
        return idx.to(dev), torch.as_tensor(nv).to(dev), at_rest.to(dev)


def unroll(dyn, L: Latents, idx, nv, H, ctx_noise=0.0, at_rest=None):
    """Open loop from the real context: predictions and targets (B, H, D), and the gate at each step (B, H)."""
    K = dyn.cfg.context
    z = L.z[idx[:, :K]].clone()
    if ctx_noise:
        z = z + ctx_noise * dyn.z_sd * torch.randn_like(z) * torch.rand(len(z), 1, 1, device=z.device)
    preds, gates = [], []
    for h in range(H):
        sl = idx[:, h : h + K]
        a = L.a[sl] if at_rest is None else torch.where(at_rest[:, None, None], L.p[sl], L.a[sl])
        z1, g = dyn(z, L.p[sl], a, (nv + h).clamp(max=K))
        preds.append(z1)
        gates.append(g)
        z = pad_first(torch.cat([z[:, 1:], z1[:, None]], 1), (nv + h + 1).clamp(max=K))
    return torch.stack(preds, 1), L.z[idx[:, K : K + H]], torch.stack(gates, 1)


def normalise(model: CompactStage2, L: Latents):
    """Set the networks' latent statistics (z's mean and spread, the spread of one step's change) from L."""
    dz = torch.cat([L.z[b + 1 : e] - L.z[b : e - 1] for b, e in L.spans])
    for m in (model.dynamics, model.denoiser):
        if m is not None:
            m.z_mu.copy_(L.z.mean(0))
            m.z_sd.copy_(L.z.std(0))
    model.dynamics.dz_sd.copy_(dz.std(0))


def copy_error(dyn, L: Latents, idx, tgt):
    """The mean squared error per step (H,) of copying the last context latent: open_loop_error's baseline."""
    K = dyn.cfg.context
    return (((L.z[idx[:, K - 1 : K]] - tgt) / dyn.z_sd) ** 2).mean((0, 2))


def open_loop_error(dyn, L: Latents, rng, n: int, H: int):
    """Mean squared open-loop error per step (H,), in units of z's variance, over n windows with a full real
    context, and the windows' indices and targets."""
    K = dyn.cfg.context
    idx, nv, _ = L.windows(rng, n, K, H)
    nv[:] = K
    pred, tgt, _ = unroll(dyn, L, idx, nv, H)
    return (((pred - tgt) / dyn.z_sd) ** 2).mean((0, 2)), idx, tgt


class Trainable(CompactStage2):
    def __init__(self, cfg, o):
        super().__init__(cfg)
        self.o = o

    def forward(self, batch, step):
        idx, nv, at_rest, H, L = batch
        with torch.autocast(idx.device.type, enabled=False):
            pred, tgt, gate = unroll(self.dynamics, L, idx, nv, H, self.o.ctx_noise, at_rest)
            dyn = (((pred - tgt) / self.dynamics.z_sd) ** 2).mean()
            loss, logs = dyn, dict(dynamics=dyn.item())
            if self.cfg.gate and bool(at_rest.any()):
                rest = gate[at_rest].mean()
                loss = loss + self.o.still_l1 * min(1.0, step / max(1, self.o.gate_warmup)) * rest
                logs["gate_at_rest"] = rest.item()
            if self.denoiser is not None and self.o.denoiser_weight:
                rows = torch.randint(len(L.z), (512,), device=L.z.device)
                z, p = L.z[rows], L.p[rows]
                sigma = torch.exp(torch.empty(512, device=z.device).uniform_(math.log(0.005), math.log(2.0)))
                den = self.denoiser(z + sigma[:, None] * self.denoiser.z_sd * torch.randn_like(z), p, sigma)
                dl = ((((den - z) / self.denoiser.z_sd) ** 2).mean(1) * (1 + sigma ** 2) / sigma ** 2).mean()
                loss = loss + self.o.denoiser_weight * dl
                logs["denoiser"] = dl.item()
        return loss, logs


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


class Stage(StageBase):
    name = "compact2"
    channels_last = False  # MLPs

    def __init__(self, a, o, device):
        super().__init__(a, o, device)
        if o.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {o.preset!r}")
        if o.horizon < 2 or not 0 <= o.still < 1 or not 0 <= o.moving_share <= 1:
            raise ValueError(f"--horizon must be >= 2, --still in [0, 1) and --moving-share in [0, 1], got "
                             f"{o.horizon}, {o.still} and {o.moving_share}")
        self.s1_file = find_release(o.init, "stage1")
        cfg1, sd1, _ = load_release(self.s1_file, STAGE1_KIND, CompactStage1Config)
        s1 = CompactStage1(cfg1)
        load_state_checked(s1, sd1, self.s1_file)
        s1 = s1.to(device).eval().requires_grad_(False)
        self.dirs = data_dirs(a.data, o.extra_data)
        paths = [p for d in self.dirs for p in list_episodes(d)[: a.max_episodes]]
        if not paths:
            raise ValueError(f"no episodes in {', '.join(map(str, self.dirs))}")
        eps = [read_episode(p, ["agent_pos", "actions"]) for p in paths]
        law, self.law_fit = fit_agent_motion([e["agent_pos"] for e in eps], [e["actions"] for e in eps])
        cache = Path(a.out) / f"latents_{_sha(self.s1_file)}_{len(paths)}.pt"
        cached = cache.is_file()
        self.L = torch.load(cache, weights_only=False) if cached else Latents.encode(
            (read_episode(p, ["frames", "agent_pos", "actions"]) for p in paths), s1.encoder, device, a.amp)
        if (sd := self.L.z.std(0).mean().item()) < COLLAPSED:  # checked before a useless cache is written
            raise ValueError(f"{self.s1_file} encodes every frame to the same z (mean spread {sd:.1e}): a collapsed "
                             f"stage 1; train a new one")
        if not cached:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            atomic_torch_save(self.L, cache)
        val = list(heldout_episodes(self.task, 16, 48, "validation"))  # never trained on
        self.val = Latents.encode(val, s1.encoder, device, a.amp)
        self.moving = self.L.moving_frames() if o.moving_share else None
        self.L, self.val = self.L.to(device), self.val.to(device)
        if o.finetune:  # the release's weights, motion law and normalisation (the network was trained with them)
            f2 = find_release(o.finetune, "stage2")
            cfg, sd2, _ = load_release(f2, STAGE2_KIND, CompactStage2Config)
            if cfg.z_dim != s1.cfg.z_dim:
                raise ValueError(f"--finetune {f2} predicts z of {cfg.z_dim} dims, but the --init stage 1 "
                                 f"{self.s1_file} encodes {s1.cfg.z_dim}")
            self.config = cfg
            self.model = Trainable(cfg, o)
            load_state_checked(self.model, sd2, f2)
            return
        cfg = CompactStage2Config(z_dim=s1.cfg.z_dim, agent_motion=tuple(float(c) for c in law), **PRESETS[o.preset])
        self.config = cfg
        self.model = Trainable(cfg, o)
        normalise(self.model, self.L)

    def sample_batch(self, rng, batch):
        H = self.o.horizon
        hh = int(rng.choice([2, H // 2, H]))
        idx, nv, at_rest = self.L.windows(rng, batch, self.config.context, hh, self.o.still, self.moving,
                                          self.o.moving_share)
        return idx, nv, at_rest, hh, self.L

    def evaluate(self, ema) -> dict:
        """32-step open-loop latent error on held-out episodes, against copying the last context latent, and on
        training episodes (the gap between the two: how much of the fit generalises); how far a held agent moves
        z in 100 steps (0 in gym-pusht); the denoiser's error left at sigma 0.05."""
        rng = np.random.default_rng(0)
        K, dyn = self.config.context, ema.dynamics
        err, idx, tgt = open_loop_error(dyn, self.val, rng, 512, 32)
        copy = copy_error(dyn, self.val, idx, tgt)
        train_err = open_loop_error(dyn, self.L, rng, 512, 32)[0]
        rows = torch.as_tensor(rng.integers(0, len(self.val.z), 64), device=self.val.z.device)
        z = self.val.z[rows][:, None].repeat(1, K, 1)
        p = self.val.p[rows][:, None].repeat(1, K, 1)
        z0 = z[:, -1].clone()
        for _ in range(100):
            z = torch.cat([z[:, 1:], dyn(z, p, p, torch.full((64,), K, device=z.device))[0][:, None]], 1)
        out = dict(latent_err_1=err[0].item(), latent_err_32=err[31].item(), rel_to_copy_32=(err[31] / copy[31]).item(),
                   train_latent_err_32=train_err[31].item(),
                   hold_drift_100=((z[:, -1] - z0) / dyn.z_sd).norm(dim=1).median().item())
        if ema.denoiser is not None:
            zv, pv = self.val.z[:2048], self.val.p[:2048]
            eps = torch.randn(zv.shape, generator=torch.Generator().manual_seed(1)).to(zv.device)
            den = ema.denoiser(zv + 0.05 * ema.denoiser.z_sd * eps, pv, torch.full((len(zv),), 0.05, device=zv.device))
            out["denoiser_rms_0.05"] = (((den - zv) / ema.denoiser.z_sd) ** 2).mean().sqrt().item()
        return out

    def export(self, ema, out, result):
        extra = dict(data=[str(d) for d in self.dirs], data_seed=self.meta["seed"], data_episodes=len(self.L.spans),
                     stage1=dict(file=str(self.s1_file), sha256_16=_sha(self.s1_file)), agent_motion_fit=self.law_fit,
                     commit=git_commit(), step=result["step"], eval=result["eval"], task=self.task.name,
                     rollout=dict(reencode=False))
        if self.o.finetune:
            extra.update(finetuned_from=str(self.o.finetune))
        save_release(Path(out) / "stage2.safetensors", ema.state_dict(), STAGE2_KIND, self.config, extra,
                     dtype=torch.float32)

