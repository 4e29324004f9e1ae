"""Datasets in latent space: every frame encoded once by a frozen stage-1 encoder, and the windows stage 2
trains on.

A window is what the dynamics see at one step: K context latents (the earliest slots repeat the first
frame when the history is shorter, and are flagged as padding), the action taken at each, the agent's
position in each context frame (for a model with an agent track), and the latent that follows.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from iws_gym.models.frames import frames_to_tensor
from iws_gym.models.hardware import autocast


def encode_frames(frames: np.ndarray, encoder, device, amp: bool = True, batch: int = 256) -> torch.Tensor:
    """(T, H, W, 3) uint8 -> (T, C, h, w) fp16 latents on the CPU."""
    zs = []
    for i in range(0, len(frames), batch):
        with torch.inference_mode(), autocast(device, amp):
            zs.append(encoder(frames_to_tensor(frames[i : i + batch], device)).float().half().cpu())
    return torch.cat(zs)


def latent_cache(data, stage1_file, n_episodes: int, kind: str = "") -> Path:
    """Where a dataset's latents under one stage-1 release are cached (in the git-ignored data dir)."""
    h = hashlib.sha256(Path(stage1_file).read_bytes()).hexdigest()[:12]
    return Path(data) / f"latents{'_' + kind if kind else ''}_{h}_{n_episodes}.pt"


def cached_episode_latents(cache: Path | None, lengths, build) -> list[torch.Tensor]:
    """Per-episode latents from `cache` when it holds episodes of exactly these lengths, else `build()`
    (then saved to `cache`, atomically)."""
    from iws_gym.models.checkpoint import atomic_torch_save

    if cache is not None and cache.is_file():
        c = torch.load(cache, map_location="cpu", weights_only=True)
        if len(c) == len(lengths) and all(len(z) == n for z, n in zip(c, lengths)):
            return c
    out = build()
    if cache is not None:
        atomic_torch_save(out, cache)
    return out


class LatentEpisodes:
    """Every frame of a dataset encoded once by the frozen stage-1 encoder, kept in RAM as fp16."""

    def __init__(self, episodes, encoder, device, batch: int = 256, amp: bool = True, cache: Path | None = None):
        """episodes: a data.episodes.InMemoryEpisodes; cache: a file for the encoded latents (reused when it
        holds as many episodes)."""
        from tqdm import tqdm

        from iws_gym.models.checkpoint import atomic_torch_save

        self.latents, self.actions = [], episodes.actions
        self.erased = None     # the same frames without the agent, for drop_agent (agent_erased_latents)
        self.corrupted = None  # the same frames with a corrupted block, for corrupt_block (block_corrupted_latents)
        self.agent = None      # per-episode agent positions (T+1, 2); when set, windows carry them
        self.hard = np.zeros((0, 2), dtype=np.int64)   # (episode, t) transitions `focus` draws from
        self.jumps = np.zeros((0, 2), dtype=np.int64)  # (episode, t) transitions `jump_focus` draws from
        if cache is not None and cache.is_file():  # encoded before by the same stage-1 weights
            c = torch.load(cache, map_location="cpu", weights_only=True)
            if len(c["latents"]) == len(episodes.frames):
                self.latents, self.z_mean, self.z_std = c["latents"], c["z_mean"], c["z_std"]
                self.dz_std = self._dz_std()
                return
        for fr in tqdm(episodes.frames, desc="encoding latents", unit="ep"):
            self.latents.append(encode_frames(fr, encoder, device, amp, batch))
        allz = torch.cat(self.latents[: min(len(self.latents), 100)]).float()
        self.z_mean, self.z_std = float(allz.mean()), float(allz.std())
        self.dz_std = self._dz_std()
        if cache is not None:
            atomic_torch_save(dict(latents=self.latents, z_mean=self.z_mean, z_std=self.z_std), cache)

    def _dz_std(self) -> float:
        """Std of the one-step latent change z_{t+1} - z_t over (up to) the first 100 episodes."""
        return float(torch.cat([z[1:].float() - z[:-1].float() for z in self.latents[:100]]).std())

    def sample(self, rng, batch: int, K: int, drop_all: bool = False, corrupt_all: bool = False):
        """Windows with a uniformly random history length in [1, K]; missing slots repeat the earliest frame.
        Returns ctx (B, K, C, h, w), actions (B, K, 2), the next latent (B, C, h, w), n_valid (B,) and agent
        (B, K, 2) or None. drop_all / corrupt_all: every context frame without the agent / with a corrupted
        block (see sample_rollout)."""
        ctx, act, tgt, nv, agent = self.sample_rollout(rng, batch, K, 0, drop_all=drop_all, corrupt_all=corrupt_all)
        return ctx, act, tgt[:, 0], nv, agent

    def sample_rollout(self, rng, batch: int, K: int, R: int, focus: float = 0.0, drop_agent: float = 0.0,
                       drop_all: bool = False, corrupt_block: float = 0.0, corrupt_all: bool = False,
                       jump_focus: float = 0.0):
        """Windows for R + 1 steps of open loop: a real context ending at frame t (history length uniform in
        [1, K]), the K + R actions from its first slot on, and the R + 1 latents that follow it. Returns
        ctx (B, K, C, h, w), actions (B, K + R, 2), targets (B, R + 1, C, h, w), n_valid (B,), and agent
        (B, K + R, 2) - the agent's recorded position in each slot's frame (canvas px; zero in padded
        slots) - or None when `self.agent` is not set.

        focus: the probability that a window is drawn from the transitions in `self.hard` (e.g. from
        `moving_transitions`: the block moves) instead of uniformly; jump_focus: likewise from `self.jumps`
        (`agent_jumps`: the agent moves fast), drawn first.

        drop_agent: the probability that a window's last j context frames (j uniform in 1..n_valid) are
        the same frames rendered without the agent (`self.erased`); the target keeps it, so a rollout that
        faded the agent learns to draw it again. corrupt_block: likewise with a faded or ghosted block
        (`self.corrupted`); the target is the real frame with its rigid T. drop_all / corrupt_all: every
        window, j = n_valid. A window gets at most one of the two."""
        if drop_all:
            drop_agent = 1.0
        if corrupt_all:
            drop_agent, corrupt_block = 0.0, 1.0
        if drop_agent > 0 and self.erased is None:
            raise ValueError("drop_agent > 0 needs the agent-erased latents (LatentEpisodes.erased)")
        if corrupt_block > 0 and self.corrupted is None:
            raise ValueError("corrupt_block > 0 needs the block-corrupted latents (LatentEpisodes.corrupted)")
        if drop_agent + corrupt_block > 1:
            raise ValueError(f"drop_agent + corrupt_block must be <= 1, got {drop_agent} + {corrupt_block}")
        if jump_focus + focus > 1:
            raise ValueError(f"focus + jump_focus must be <= 1, got {focus} + {jump_focus}")
        use_jumps, use_hard = jump_focus > 0 and len(self.jumps) > 0, focus > 0 and len(self.hard) > 0
        f = self._flat()
        n_act = f["n_act"]
        # which transition each window ends at: uniform, or from the jump / hard pools
        e = rng.integers(0, len(self.latents), batch)
        t = (rng.random(batch) * (n_act[e] - R)).astype(np.int64)  # frames t+1 .. t+R+1 exist
        if use_jumps or use_hard:
            u = rng.random(batch)
            for use, pool, m in ((use_jumps, "jumps", u < jump_focus), (use_hard, "hard", (u >= jump_focus) & (u < jump_focus + focus))):
                if use and m.any():
                    pool = getattr(self, pool)
                    pick = pool[rng.integers(0, len(pool), int(m.sum()))]
                    e[m] = pick[:, 0]
                    t[m] = np.minimum(pick[:, 1], n_act[pick[:, 0]] - R - 1)
        n_valid = np.minimum(rng.integers(1, K + 1, batch), t + 1)
        idx = np.maximum(t[:, None] + np.arange(1 - K, 1)[None], (t - n_valid + 1)[:, None])  # (B, K) frame index
        frame = f["z_off"][e][:, None] + idx                                                # into the flat latents
        ctx = f["z"][torch.from_numpy(frame)]
        if drop_agent > 0 or corrupt_block > 0:  # the last j context frames from an altered rendering
            u = rng.random(batch)
            j = n_valid if (drop_all or corrupt_all) else rng.integers(1, n_valid + 1)
            late = np.arange(K)[None] >= (K - j)[:, None]                                   # (B, K)
            for key, m in (("erased", u < drop_agent), ("corrupted", (u >= drop_agent) & (u < drop_agent + corrupt_block))):
                sel = torch.from_numpy(m[:, None] & late)
                if sel.any():
                    ctx[sel] = f[key][torch.from_numpy(frame)[sel]]
        pad = torch.from_numpy(np.arange(K + R)[None] < (K - n_valid)[:, None])            # (B, K + R) padded slots
        steps = np.concatenate([idx, t[:, None] + 1 + np.arange(R)[None]], axis=1)          # (B, K + R)
        act = f["a"][torch.from_numpy(f["a_off"][e][:, None] + steps)]
        act[pad] = 0.0
        agent = None
        if self.agent is not None:  # the agent's position in each slot's frame (also where it was erased)
            agent = f["agent"][torch.from_numpy(f["z_off"][e][:, None] + steps)]
            agent[pad] = 0.0
        tgt = f["z"][torch.from_numpy(f["z_off"][e][:, None] + t[:, None] + 1 + np.arange(R + 1)[None])]
        return ctx.float(), act, tgt.float(), torch.from_numpy(n_valid), agent

    def _flat(self) -> dict:
        """The episodes concatenated once (latents, actions, agent positions, altered latents) with each
        episode's offset, so a batch of windows is a few gathers; the per-episode lists become views into
        them (no copy kept). Rebuilt when one of the lists is replaced."""
        names = ("latents", "actions", "agent", "erased", "corrupted")
        cached = getattr(self, "_flat_cache", None)
        if cached is not None and all(getattr(self, n) is o for n, o in zip(names, cached[0])):
            return cached[1]
        n_z = np.array([len(z) for z in self.latents])
        n_act = np.array([len(a) for a in self.actions])
        f = dict(n_act=n_act, z_off=np.concatenate([[0], np.cumsum(n_z)[:-1]]).astype(np.int64),
                 a_off=np.concatenate([[0], np.cumsum(n_act)[:-1]]).astype(np.int64))
        f["z"] = torch.cat(list(self.latents))
        self.latents = list(f["z"].split(n_z.tolist()))
        f["a"] = torch.from_numpy(np.concatenate(self.actions).astype(np.float32))
        if self.agent is not None:
            if any(len(p) != n for p, n in zip(self.agent, n_z)):
                raise ValueError("agent positions must have one row per frame of each episode")
            f["agent"] = torch.from_numpy(np.concatenate(self.agent).astype(np.float32))
        for key in ("erased", "corrupted"):
            alt = getattr(self, key)
            if alt is not None:
                f[key] = torch.cat(list(alt))
                setattr(self, key, list(f[key].split(n_z.tolist())))
        self._flat_cache = (tuple(getattr(self, n) for n in names), f)
        return f


_ENVS: dict = {}  # one gym-pusht renderer per frame size and process


def _env(frame_size: int):
    from iws_gym.tasks.pusht.groundtruth import make_env

    if frame_size not in _ENVS:
        _ENVS[frame_size] = make_env(frame_size)
    return _ENVS[frame_size]


def _erased_frames(block_pose, frame_size):
    from iws_gym.tasks.pusht.groundtruth import render_without_agent

    return render_without_agent(block_pose, frame_size, _env(frame_size))


def _corrupted_frames(frames, agent_pos, block_pose, seed, e, frame_size):
    from iws_gym.tasks.pusht.groundtruth import corrupt_block

    return corrupt_block(frames, agent_pos, block_pose, np.random.default_rng([seed, e]), frame_size, _env(frame_size))


def _call(job):
    fn, args = job
    return fn(*args)


def render_workers() -> int:
    """Processes that render augmentation frames: every core (rendering is one-threaded Python)."""
    return max(1, min(os.cpu_count() or 1, 32))


def _rendered(fn, jobs: list, desc: str, workers: int):
    """fn(*job) for each job, in order, on `workers` processes when > 1 (gym-pusht renders about 2 ms per
    frame on one core: a 600-episode dataset is minutes on one process, seconds on many)."""
    from tqdm import tqdm

    if workers <= 1:
        yield from (fn(*j) for j in tqdm(jobs, desc=desc, unit="ep"))
        return
    import multiprocessing as mp

    # fork, as `iws collect`, unless the parent holds CUDA, which a forked child must not inherit
    ctx = mp.get_context("spawn" if torch.cuda.is_initialized() else "fork")
    with ctx.Pool(min(workers, len(jobs))) as pool:
        yield from tqdm(pool.imap(_call, [(fn, j) for j in jobs]), total=len(jobs), desc=desc, unit="ep")


def agent_erased_latents(block_poses, encoder, device, amp: bool = True, cache: Path | None = None,
                         frame_size: int = 128, workers: int = 1) -> list[torch.Tensor]:
    """Per episode, the latents of its frames re-rendered without the agent (exact renders of the
    recorded block poses: identical to the real frames away from the agent), for `drop_agent`.
    Rendered on `workers` processes; cached like the latents."""

    def build():
        return [encode_frames(f, encoder, device, amp)
                for f in _rendered(_erased_frames, [(p, frame_size) for p in block_poses], "latents without the agent",
                                   workers)]

    return cached_episode_latents(cache, [len(p) for p in block_poses], build)


def block_corrupted_latents(frames, agent_pos, block_poses, encoder, device, amp: bool = True,
                            cache: Path | None = None, frame_size: int = 128, seed: int = 0,
                            workers: int = 1) -> list[torch.Tensor]:
    """Per episode, the latents of its frames with the block faded or ghosted (`groundtruth.corrupt_block`,
    exact re-renders, seeded by (seed, episode)), for `corrupt_block`. Rendered on `workers` processes;
    cached like the latents."""

    def build():
        jobs = [(fr, ap, bp, seed, e, frame_size) for e, (fr, ap, bp) in enumerate(zip(frames, agent_pos, block_poses))]
        return [encode_frames(f, encoder, device, amp)
                for f in _rendered(_corrupted_frames, jobs, "latents with a corrupted block", workers)]

    return cached_episode_latents(cache, [len(f) for f in frames], build)


def moving_transitions(block_poses, min_canvas_px: float = 1.0, min_rad: float = 0.01) -> np.ndarray:
    """Transitions (episode, t) in which the T block moves (frame t -> t+1), from each episode's block
    poses (T+1, 3): (N, 2) int. About a fifth of the training mix; the one-step error concentrates there."""
    out = []
    for e, pose in enumerate(block_poses):
        d = np.diff(pose, axis=0)
        moved = (np.abs(d[:, :2]).sum(1) > min_canvas_px) | (np.abs(d[:, 2]) > min_rad)
        out.extend((e, int(t)) for t in np.flatnonzero(moved))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def agent_jumps(agent_pos, min_canvas_px: float = 30.0) -> np.ndarray:
    """Transitions (episode, t) in which the agent moves more than `min_canvas_px` from frame t to t+1,
    from each episode's agent positions (T+1, 2): (N, 2) int. Fast, jumpy motion: rare in the play mix,
    where the agent vanishes from the predicted frame most."""
    out = []
    for e, p in enumerate(agent_pos):
        step = np.linalg.norm(np.diff(np.asarray(p, np.float64), axis=0), axis=1)
        out.extend((e, int(t)) for t in np.flatnonzero(step > min_canvas_px))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def recorded(paths, key: str) -> list[np.ndarray]:
    """One recorded array (e.g. "agent_pos" (T+1, 2) or "block_pose" (T+1, 3)) of each episode file."""
    from iws_gym.data.episodes import read_episode

    return [read_episode(p, keys=(key,))[key] for p in paths]
