"""What each training stage plugs into the one loop in train.py: model, batches, evaluation, export."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from . import metrics
from .checkpoint import save_release
from .collect import git_commit, heldout_episodes
from .data import InMemoryEpisodes, load_meta
from .hardware import autocast
from .tasks import load_task


def frames_to_tensor(frames: np.ndarray, device) -> torch.Tensor:
    """(..., H, W, 3) uint8 -> (..., 3, H, W) float in [-1, 1]."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).to(device)
    x = x.movedim(-1, -3).float().div_(127.5).sub_(1.0)
    return x.contiguous(memory_format=torch.channels_last) if x.ndim == 4 else x


def tensor_to_frames(x: torch.Tensor) -> np.ndarray:
    """(..., 3, H, W) in [-1, 1] -> (..., H, W, 3) uint8."""
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).movedim(-3, -1).cpu().numpy()


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample PSNR (dB) of frames in [-1, 1] measured on the [0, 1] scale."""
    mse = ((a.float() - b.float()) / 2).pow(2).flatten(1).mean(1).clamp_min(1e-10)
    return -10 * torch.log10(mse)


class StageBase:
    """What every stage shares: its args, device, the dataset's metadata and task."""

    channels_last = True

    def __init__(self, a, device):
        self.a, self.device = a, device
        self.meta = load_meta(a.data)
        self.task = load_task(self.meta["task"])

    def after_step(self, model, step):
        pass


class Stage1Stage(StageBase):
    name = "stage1"

    def __init__(self, a, device):
        from .decoder import Stage1, Stage1Config

        super().__init__(a, device)
        self.episodes = InMemoryEpisodes.load(a.data, a.max_episodes)
        cfg = Stage1Config(total_steps=a.steps)
        if a.preset == "tiny":
            cfg.encoder = dataclasses.replace(cfg.encoder, ch=(16, 32), blocks=(1, 1))
            cfg.decoder = dataclasses.replace(cfg.decoder, z_ch=32, z_blocks=1, ch=16, z_blocks32=1, trunk_blocks=1, emb_dim=32)
        self.config = cfg
        self.model = Stage1(cfg)
        # A fixed held-out evaluation batch: frames from held-out seeds, never in training.
        eps = list(heldout_episodes(self.task, 4, 64))
        self.eval_frames = frames_to_tensor(np.concatenate([e["frames"][::4] for e in eps]), device)

    def sample_batch(self, rng, batch):
        frames = self.episodes.sample_frames(rng, batch)  # (B, H, W, 3)
        c = self.a.crop
        if c:  # the model is fully convolutional with per-pixel norms: crops train it ~(H/c)^2 times cheaper
            H = frames.shape[1]
            align = H // self.config.encoder.latent_size  # crop on the latent grid
            oy, ox = (rng.integers(0, (H - c) // align + 1, size=2) * align)
            frames = frames[:, oy : oy + c, ox : ox + c]
        return frames_to_tensor(frames, self.device)

    def evaluate(self, ema) -> dict:
        from .decoder import decode

        x = self.eval_frames
        z = ema.encoder(x)
        out = {}
        for steps in (1, 2):
            gen = torch.Generator().manual_seed(0)
            out[f"psnr_{steps}step"] = psnr(decode(ema.decoder, z, steps, generator=gen), x).mean().item()
        return out

    def export(self, ema, out, result):
        extra = dict(data=str(self.a.data), data_seed=self.meta["seed"], data_episodes=len(self.episodes.paths),
                     commit=git_commit(), step=result["step"], eval=result["eval"], task=self.task.name)
        save_release(out / "stage1.safetensors", ema.state_dict(), "stage1", self.config, extra)


def find_release(path, name: str):
    """A stage release file: `path` itself, or `path/<name>.safetensors` for a run or checkpoint directory."""
    from pathlib import Path

    p = Path(path)
    return p / f"{name}.safetensors" if p.is_dir() else p


BLOCK_POSE_JITTER = np.array([2.0, 2.0, 0.03], np.float32)  # canvas px, px, rad: the block track's training noise


class LatentEpisodes:
    """Every frame of a dataset encoded once by the frozen stage-1 encoder, kept in RAM as fp16."""

    def __init__(self, episodes: InMemoryEpisodes, encoder, device, batch: int = 256, amp: bool = True,
                 cache: Path | None = None):
        from tqdm import tqdm

        self.latents, self.actions = [], episodes.actions
        self.erased = None  # the same frames without the agent, for drop_agent (agent_erased_latents)
        self.corrupted = None  # the same frames with a corrupted block, for corrupt_block (block_corrupted_latents)
        self.agent = None  # per-episode agent positions (T+1, 2); when set, windows carry them (see sample_rollout)
        self.block = None  # per-episode block poses (T+1, 3); when set (with agent), windows carry them too
        self.block_jitter = BLOCK_POSE_JITTER  # their noise (std of x, y, angle); None: exact (held-out windows)
        self.hard = np.zeros((0, 2), dtype=np.int64)  # (episode, t) transitions `focus` draws from (see below)
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
            from .checkpoint import atomic_torch_save

            atomic_torch_save(dict(latents=self.latents, z_mean=self.z_mean, z_std=self.z_std), cache)

    def extend(self, other: "LatentEpisodes") -> None:
        """Append another dataset's episodes (and their erased / corrupted latents, where this one has
        them); the normalisation stays this dataset's."""
        self.latents, self.actions = list(self.latents) + list(other.latents), list(self.actions) + list(other.actions)
        if self.erased is not None:
            self.erased = list(self.erased) + list(other.erased)
        if self.corrupted is not None:
            self.corrupted = list(self.corrupted) + list(other.corrupted)
        if self.agent is not None:
            self.agent = list(self.agent) + list(other.agent)
        if self.block is not None:
            self.block = list(self.block) + list(other.block)

    def _dz_std(self) -> float:
        """Std of the one-step latent change z_{t+1} - z_t over (up to) the first 100 episodes."""
        return float(torch.cat([z[1:].float() - z[:-1].float() for z in self.latents[:100]]).std())

    def sample(self, rng, batch: int, K: int, drop_all: bool = False, corrupt_all: bool = False):
        """Windows with a uniformly random history length in [1, K]; missing slots repeat the earliest frame.
        Returns ctx (B, K, C, h, w), actions (B, K, 2), the next frame (B, C, h, w), n_valid (B,).
        drop_all / corrupt_all: every context frame without the agent / with a corrupted block (see
        sample_rollout's drop_agent and corrupt_block)."""
        ctx, act, tgt, nv = self.sample_rollout(rng, batch, K, 0, drop_all=drop_all, corrupt_all=corrupt_all)
        return ctx, act, tgt[:, 0], nv

    def sample_rollout(self, rng, batch: int, K: int, R: int, focus: float = 0.0, drop_agent: float = 0.0,
                       drop_all: bool = False, corrupt_block: float = 0.0, corrupt_all: bool = False,
                       jump_focus: float = 0.0):
        """Windows for training on the model's own predictions: a real context ending at frame t (history
        length uniform in [1, K], as in `sample`), the K + R actions from its first slot on, and the R + 1
        frames that follow it. Returns ctx (B, K, C, h, w), actions (B, K + R, 2), targets (B, R + 1, C, h, w),
        n_valid (B,): after r open-loop steps the window is (real ctx + r predictions)[-K:], its actions
        actions[:, r : r + K], and its target targets[:, r].

        focus: the probability that a window is drawn from the transitions listed in `self.hard`
        (episode, t) - set by the caller, e.g. from `block_moves` - instead of uniformly. jump_focus: likewise
        from `self.jumps` (e.g. `agent_jumps`: the agent moves fast), drawn first.

        drop_agent: the probability that a window's last j context frames (j uniform in 1..n_valid) are
        replaced by the same frames rendered without the agent (`self.erased`, see `agent_erased_latents`);
        the target keeps it. drop_all: every window, j = n_valid (the whole history). At inference a
        rollout that has faded the agent out of its recent frames otherwise never draws it again; this
        teaches the network to put it back where the actions say.

        corrupt_block: likewise, the probability that the last j context frames are replaced by the same
        frames with a faded, ghosted or bent block (`self.corrupted`, see `block_corrupted_latents`); the target
        is the real next frame with its rigid, full-contrast T. corrupt_all: every window, j = n_valid.
        A window gets at most one of the two (drawn with one uniform: drop_agent first). The fade of a
        pushed block is the one-step average of the places it might go, fed back step after step; this
        teaches the network to redraw a faint or doubled T as the rigid block it stands for.

        With `self.agent` set (an agent-track model), actions are (B, K + R, 4): each row also holds the
        agent's recorded position in that slot's frame (canvas px; zero in padded slots), also where
        the agent was erased from the frame."""
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
        ctx, act, tgt, nv = [], [], [], []
        for e in rng.integers(0, len(self.latents), batch):
            u = rng.random() if use_jumps or use_hard else 1.0
            pool = self.jumps if use_jumps and u < jump_focus else self.hard if use_hard and u < jump_focus + focus else None
            if pool is not None:
                e, t = (int(v) for v in pool[rng.integers(0, len(pool))])
                t = min(t, len(self.actions[e]) - R - 1)
            else:
                t = int(rng.integers(0, len(self.actions[e]) - R))  # frames t+1 .. t+R+1 exist
            Z, A = self.latents[e], self.actions[e]
            n_valid = min(int(rng.integers(1, K + 1)), t + 1)
            idx = np.clip(np.arange(t - K + 1, t + 1), t - n_valid + 1, None)
            c = Z[idx]
            if drop_agent > 0 or corrupt_block > 0:
                u = rng.random()
                alt = self.erased if u < drop_agent else self.corrupted if u < drop_agent + corrupt_block else None
                if alt is not None:
                    j = n_valid if (drop_all or corrupt_all) else int(rng.integers(1, n_valid + 1))
                    c = torch.cat([c[: K - j], alt[e][idx[K - j :]]])
            ctx.append(c)
            a = np.concatenate([A[idx], A[t + 1 : t + R + 1]]).astype(np.float32)
            if self.agent is not None:  # the agent's position in each slot's frame, beside the action taken there
                P = self.agent[e]
                a = np.concatenate([a, np.concatenate([P[idx], P[t + 1 : t + R + 1]])], axis=1).astype(np.float32)
                if self.block is not None:  # ... and the block's pose, jittered as a fit on a predicted frame is
                    Q = np.concatenate([self.block[e][idx], self.block[e][t + 1 : t + R + 1]]).astype(np.float32)
                    if self.block_jitter is not None:
                        Q = Q + rng.normal(0.0, 1.0, Q.shape).astype(np.float32) * self.block_jitter
                    a = np.concatenate([a, Q], axis=1)
            a[: K - n_valid] = 0.0
            act.append(a)
            tgt.append(Z[t + 1 : t + R + 2])
            nv.append(n_valid)
        return torch.stack(ctx).float(), torch.from_numpy(np.stack(act)), torch.stack(tgt).float(), torch.tensor(nv)


def reencode_latents(stage1, z: torch.Tensor, generator=None, decoder_steps: int = 1) -> torch.Tensor:
    """What the env puts into its context in place of a prediction z (B, C, h, w) (WorldModel.step): the
    stage-1 decoding of z, quantised to the uint8 frame the user sees, encoded again. On tensors, so
    training (--rollout-reencode) can run it batched without leaving the device."""
    from .decoder import decode

    x = decode(stage1.decoder, z, decoder_steps, generator=generator)  # (B, 3, H, W) in [-1, 1]
    x = ((x.float().clamp(-1, 1) + 1) * 127.5).round() / 127.5 - 1  # as tensor_to_frames -> frames_to_tensor
    return stage1.encoder(x.contiguous(memory_format=torch.channels_last))


def encode_frames(frames: np.ndarray, encoder, device, amp: bool = True, batch: int = 256) -> torch.Tensor:
    """(T, H, W, 3) uint8 -> (T, C, h, w) fp16 latents on the CPU."""
    zs = []
    for i in range(0, len(frames), batch):
        with torch.inference_mode(), autocast(device, amp):
            zs.append(encoder(frames_to_tensor(frames[i : i + batch], device)).float().half().cpu())
    return torch.cat(zs)


def cached_episode_latents(cache: Path | None, lengths, build) -> list[torch.Tensor]:
    """Per-episode latents from `cache` when it holds episodes of exactly these lengths, else `build()`
    (then saved to `cache`, atomically)."""
    if cache is not None and cache.is_file():
        c = torch.load(cache, map_location="cpu", weights_only=True)
        if len(c) == len(lengths) and all(len(z) == n for z, n in zip(c, lengths)):
            return c
    out = build()
    if cache is not None:
        from .checkpoint import atomic_torch_save

        atomic_torch_save(out, cache)
    return out


def agent_erased_latents(block_poses, encoder, device, amp: bool = True, cache: Path | None = None,
                         frame_size: int = 128) -> list[torch.Tensor]:
    """Per episode, the latents of its frames re-rendered without the agent (exact renders of the
    recorded block poses: identical to the real frames away from the agent), for `drop_agent`.
    About 2 ms per frame to render; cached like the latents."""
    from tqdm import tqdm

    from .groundtruth import make_env, render_without_agent

    def build():
        env = make_env(frame_size)
        return [encode_frames(render_without_agent(p, frame_size, env), encoder, device, amp)
                for p in tqdm(block_poses, desc="latents without the agent", unit="ep")]

    return cached_episode_latents(cache, [len(p) for p in block_poses], build)


def block_corrupted_latents(frames, agent_pos, block_poses, encoder, device, amp: bool = True,
                            cache: Path | None = None, frame_size: int = 128, seed: int = 0,
                            kinds: tuple[str, ...] = ("fade", "ghost")) -> list[torch.Tensor]:
    """Per episode, the latents of its frames with the block faded, ghosted or bent
    (`groundtruth.corrupt_block` with `kinds`, exact re-renders, seeded by (seed, episode)), for
    `corrupt_block`. Cached like the latents."""
    from tqdm import tqdm

    from .groundtruth import corrupt_block, make_env

    def build():
        env = make_env(frame_size)
        return [encode_frames(corrupt_block(fr, ap, bp, np.random.default_rng([seed, e]), frame_size, env, kinds=kinds),
                              encoder, device, amp)
                for e, (fr, ap, bp) in enumerate(tqdm(list(zip(frames, agent_pos, block_poses)),
                                                      desc="latents with a corrupted block", unit="ep"))]

    return cached_episode_latents(cache, [len(f) for f in frames], build)


def comma_list(spec: str) -> list[str]:
    """A comma-separated flag value as its non-empty, stripped items: "a, b," -> ["a", "b"]."""
    return [x.strip() for x in (spec or "").split(",") if x.strip()]


def corrupt_kinds(spec: str) -> tuple[str, ...]:
    """--corrupt-kinds "fade,ghost,bend" -> ("fade", "ghost", "bend"), checked against groundtruth.CORRUPT_KINDS."""
    from .groundtruth import check_corrupt_kinds

    return check_corrupt_kinds(comma_list(spec), "--corrupt-kinds")


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
    common in jittery play, where the agent vanishes from the predicted frame most."""
    out = []
    for e, p in enumerate(agent_pos):
        step = np.linalg.norm(np.diff(np.asarray(p, np.float64), axis=0), axis=1)
        out.extend((e, int(t)) for t in np.flatnonzero(step > min_canvas_px))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def recorded_agent_pos(paths) -> list[np.ndarray]:
    """The recorded agent positions (T+1, 2) of the episodes stored at `paths` (for an agent track)."""
    from .data import read_episode

    return [read_episode(p, keys=("agent_pos",))["agent_pos"] for p in paths]


def block_moves(paths) -> np.ndarray:
    """`moving_transitions` of the episodes stored at `paths` (their recorded block poses)."""
    from .data import read_episode

    return moving_transitions([read_episode(p, keys=("block_pose",))["block_pose"] for p in paths])


def latent_cache(data, stage1_file, n_episodes: int, kind: str = "") -> Path:
    """Where a dataset's latents under one stage-1 release are cached (in the git-ignored data dir)."""
    import hashlib

    h = hashlib.sha256(Path(stage1_file).read_bytes()).hexdigest()[:12]
    return Path(data) / f"latents{'_' + kind if kind else ''}_{h}_{n_episodes}.pt"


class Stage2Stage(StageBase):
    """Latent dynamics on top of a frozen stage-1 release (`--init`)."""

    name = "stage2"
    channels_last = False  # 5D activations (B, C, T, h, w)

    def __init__(self, a, device):
        from .decoder import Stage1, Stage1Config
        from .dynamics import DynamicsConfig, Stage2

        super().__init__(a, device)
        self.stage1, self.stage1_meta, self.stage1_file = load_stage(a.init or self.task.checkpoint_path, "stage1",
                                                                     Stage1Config, Stage1, device)
        cfg1 = self.stage1.cfg
        if not 0.0 <= a.focus <= 1.0:
            raise ValueError(f"--focus must be in [0, 1], got {a.focus}")
        if not 0.0 <= a.drop_agent <= 1.0:
            raise ValueError(f"--drop-agent must be in [0, 1], got {a.drop_agent}")
        if not 0.0 <= a.corrupt_block <= 1.0 or a.drop_agent + a.corrupt_block > 1:
            raise ValueError(f"--corrupt-block must be in [0, 1] and --drop-agent + --corrupt-block <= 1, "
                             f"got {a.corrupt_block} and {a.drop_agent}")
        kinds = corrupt_kinds(a.corrupt_kinds)
        # --data and then each --extra-data directory, every one with its own latent caches
        self.extra_meta = []
        for d in comma_list(a.extra_data):  # --extra-data "data/a,data/b"
            m = load_meta(d)
            if m["task"] != self.meta["task"]:
                raise ValueError(f"--extra-data {d} holds task {m['task']!r}, --data holds {self.meta['task']!r}")
            self.extra_meta.append(dict(data=d, seed=m.get("seed"), episodes=m.get("episodes"), mix=m.get("mix", "play")))
        parts = [self._load_dataset(d, a.max_episodes if i == 0 else None, kinds, device)
                 for i, d in enumerate([a.data] + [m["data"] for m in self.extra_meta])]
        self.data, poses = parts[0]
        for lat, p in parts[1:]:  # normalisation stays the first dataset's (a fine-tune keeps the release's anyway)
            self.data.extend(lat)
            poses = poses + p
        if a.focus > 0:
            self.data.hard = moving_transitions(poses)
        if not 0.0 <= a.jump_focus <= 1.0 or a.focus + a.jump_focus > 1:
            raise ValueError(f"--jump-focus must be in [0, 1] and --focus + --jump-focus <= 1, got {a.jump_focus} and {a.focus}")
        if a.jump_focus > 0:
            if self.data.agent is None:
                raise ValueError("--jump-focus reads the recorded agent positions: pass --agent-track")
            self.data.jumps = agent_jumps(self.data.agent)
        cfg = DynamicsConfig(latent_ch=cfg1.encoder.latent_ch, latent_size=cfg1.encoder.latent_size,
                             z_mean=self.data.z_mean, z_std=self.data.z_std, dz_std=self.data.dz_std)
        if a.preset == "tiny":
            cfg = dataclasses.replace(cfg, ch=16, blocks=1, heads=2, emb_dim=16, context=2)
        if a.finetune:  # continue from a stage-2 release: its config (and normalisation) and weights
            from .checkpoint import load_release, load_state_checked

            f2 = find_release(a.finetune, "stage2")
            cfg, init_sd, init_meta = load_release(f2, "stage2", DynamicsConfig)
        if a.grow_blocks < 0 or (a.grow_blocks and not a.finetune):
            raise ValueError(f"--grow-blocks must be >= 0 and needs --finetune (it grows a release), got {a.grow_blocks}")
        if a.hires_ch < 0 or (a.hires_ch and cfg.hires_ch and a.hires_ch != cfg.hires_ch):
            raise ValueError(f"--hires-ch must be >= 0 and cannot change the width of a release's head "
                             f"({cfg.hires_ch}), got {a.hires_ch}")
        base_blocks, base_hires, base_track = cfg.blocks, cfg.hires_ch, bool(cfg.agent_motion)
        cfg = dataclasses.replace(cfg, blocks=cfg.blocks + a.grow_blocks, hires_ch=a.hires_ch or cfg.hires_ch)
        self.agent_fit = None
        if a.agent_track and not cfg.agent_motion:  # fit the agent's motion law to the training episodes
            from .dynamics import fit_agent_motion

            coef, self.agent_fit = fit_agent_motion(self.data.agent, self.data.actions)
            print(f"agent motion law {coef}: residual median {self.agent_fit['residual_px_median']:.2g} px, "
                  f"max {self.agent_fit['residual_px_max']:.2g} px over {self.agent_fit['transitions']} transitions")
            cfg = dataclasses.replace(cfg, agent_motion=coef)
        if cfg.agent_motion and self.data.agent is None:
            raise ValueError(f"--finetune {a.finetune} tracks the agent: pass --agent-track (it reads the recorded agent positions)")
        base_block = cfg.block_track
        if a.block_track:
            if not cfg.agent_motion:
                raise ValueError("--block-track needs --agent-track (the block's pose rides in the agent track's rows)")
            cfg = dataclasses.replace(cfg, block_track=True)
        if cfg.block_track and self.data.block is None:
            raise ValueError(f"--finetune {a.finetune} tracks the block: pass --block-track (it reads the recorded block poses)")
        self.config = cfg
        self.model = Stage2(cfg)
        self.model.total_steps = a.steps
        if a.rollout < 0 or (a.rollout_reencode and a.rollout == 0):
            raise ValueError(f"--rollout must be >= 0 and --rollout-reencode needs --rollout R > 0, got {a.rollout}")
        self.reencode_gen = torch.Generator().manual_seed(a.seed)  # the decoder's noise in --rollout-reencode contexts
        if a.change_weight < 0:
            raise ValueError(f"--change-weight must be >= 0, got {a.change_weight}")
        self.model.change_weight = a.change_weight
        if a.one_step_loss not in ("mse", "energy"):
            raise ValueError(f"--one-step-loss must be 'mse' or 'energy', got {a.one_step_loss!r}")
        self.model.one_step_loss = a.one_step_loss
        if a.finetune:
            if a.grow_blocks:  # the release's weights + identity blocks after its own
                self.model.net.identity_blocks(base_blocks)
            # parameters the release lacks: grown blocks, and a new refinement head (its output starts at 0)
            new = {k: v for k, v in self.model.state_dict().items()
                   if (k.startswith("net.blocks.") and int(k.split(".")[2]) >= base_blocks)
                   or (k.startswith("net.hires.") and not base_hires)}
            init_sd = {**init_sd, **new}
            if cfg.agent_motion and not base_track:  # new agent-map input channels, starting at zero
                init_sd = add_agent_map_inputs(init_sd, cfg)
            if cfg.block_track and not base_block:  # new block-map input channels, starting at zero
                init_sd = add_block_map_inputs(init_sd, cfg)
            load_state_checked(self.model, init_sd, f2)
            self.model.curriculum_offset = self.model.total_steps = int(init_meta.get("step", 0))
        # held-out windows for evaluation (encoded with the same frozen encoder)
        held_eps = list(heldout_episodes(self.task, 4, 48))
        held = InMemoryEpisodes([e["frames"] for e in held_eps], [e["actions"] for e in held_eps], [])
        self.held = LatentEpisodes(held, self.stage1.encoder, device, amp=a.amp)
        if cfg.agent_motion:
            self.held.agent = [e["agent_pos"] for e in held_eps]
        if cfg.block_track:  # exact poses, so the held-out windows are the same ones with or without a track
            self.held.block, self.held.block_jitter = [e["block_pose"] for e in held_eps], None
        self.eval_batch = self.held.sample(np.random.default_rng(0), 64, cfg.context)
        # ... and windows whose target transition moves the block (contact: where the error concentrates)
        self.held.hard = moving_transitions([e["block_pose"] for e in held_eps])
        ctx, act, tgt, nv = self.held.sample_rollout(np.random.default_rng(2), 64, cfg.context, 0, focus=1.0)
        self.eval_moving = (ctx, act, tgt[:, 0], nv) if len(self.held.hard) else None
        # ... and windows whose whole context lost the agent (what --drop-agent trains): can it put it back?
        self.held.erased = agent_erased_latents([e["block_pose"] for e in held_eps], self.stage1.encoder, device,
                                                a.amp, frame_size=cfg1.encoder.frame_size)
        self.eval_no_agent = self.held.sample(np.random.default_rng(3), 64, cfg.context, drop_all=True)
        # ... and windows whose whole context shows a corrupted block (what --corrupt-block trains)
        held_states = [[e[k] for e in held_eps] for k in ("frames", "agent_pos", "block_pose")]

        def corrupted_windows(kinds, sample_seed):
            self.held.corrupted = block_corrupted_latents(*held_states, self.stage1.encoder, device, a.amp,
                                                          frame_size=cfg1.encoder.frame_size, seed=1, kinds=kinds)
            return self.held.sample(np.random.default_rng(sample_seed), 64, cfg.context, corrupt_all=True)

        self.eval_corrupt = corrupted_windows(("fade", "ghost"), 4)  # a faded or ghosted T
        self.eval_bend = corrupted_windows(("bend",), 5)  # a bent T (bar and stem apart; --corrupt-kinds ...,bend)
        # open-loop evaluation: rollouts from a single real frame, as the env runs them
        self.eval_rollout = self.held.sample_rollout(np.random.default_rng(1), 32, cfg.context, self.EVAL_DEPTH - 1)

    def _load_dataset(self, data, max_episodes, kinds, device):
        """One dataset directory's latents (and, as the options need them, its agent-erased and
        block-corrupted latents), each cached in that directory, and its recorded block poses."""
        a, cfg1 = self.a, self.stage1.cfg
        eps = InMemoryEpisodes.load(data, max_episodes)
        lat = LatentEpisodes(eps, self.stage1.encoder, device, amp=a.amp,
                             cache=latent_cache(data, self.stage1_file, len(eps.frames)))
        poses = []
        if a.focus > 0 or a.drop_agent > 0 or a.corrupt_block > 0 or a.agent_track or a.block_track:  # recorded states
            from .data import read_episode

            states = [read_episode(p, keys=("block_pose", "agent_pos")) for p in eps.paths]
            poses = [s["block_pose"] for s in states]
            if a.agent_track:  # the agent's position is an observation (gym-pusht's agent_pos), not hidden state
                lat.agent = [s["agent_pos"] for s in states]
            if a.block_track:  # the T's pose: in the env it is read from each frame (pose.estimate)
                lat.block = poses
            if a.drop_agent > 0:
                cache = latent_cache(data, self.stage1_file, len(eps.frames), "noagent")
                lat.erased = agent_erased_latents(poses, self.stage1.encoder, device, a.amp, cache,
                                                  cfg1.encoder.frame_size)
            if a.corrupt_block > 0:
                # the original two kinds keep their cache name
                name = "corruptblock" + ("" if kinds == ("fade", "ghost") else "-" + "-".join(kinds))
                cache = latent_cache(data, self.stage1_file, len(eps.frames), name)
                lat.corrupted = block_corrupted_latents(eps.frames, [s["agent_pos"] for s in states], poses,
                                                        self.stage1.encoder, device, a.amp, cache,
                                                        cfg1.encoder.frame_size, kinds=kinds)
        return lat, poses

    EVAL_DEPTH = 16

    @staticmethod
    def open_loop(model, ctx, act, nv, depth: int, steps: int = 1, generator=None, reencode=None):
        """Roll `model` open loop for `depth` steps from real windows (see LatentEpisodes.sample_rollout):
        returns the last window, its actions and n_valid, and the predictions (B, depth, C, h, w).
        reencode: z -> z, applied to each prediction before it joins the window (see `reencoder`)."""
        K = ctx.shape[1]
        preds = []
        for d in range(depth):
            z = model.predict(ctx, act[:, d : d + K], nv, steps=steps, generator=generator).float()
            preds.append(z)
            z_ctx = z if reencode is None else reencode(z).float()
            ctx = torch.cat([ctx[:, 1:], z_ctx[:, None]], dim=1)
            nv = (nv + 1).clamp(max=K)
        preds = torch.stack(preds, 1) if preds else ctx.new_zeros(ctx.shape[0], 0, *ctx.shape[2:])
        return ctx, act[:, depth : depth + K], nv, preds

    def reencoder(self, z: torch.Tensor) -> torch.Tensor:
        return reencode_latents(self.stage1, z, self.reencode_gen)

    def sample_batch(self, rng, batch):
        """Teacher-forced windows; with --rollout R, half the batches instead have a context whose last r
        frames (r uniform in 1..R) are the current model's own open-loop predictions (no gradient through
        them; with --rollout-reencode each one decoded and encoded again, as the env does) and the real
        frame after them as target, so it learns to correct its own errors rather than compound them
        (context noise alone only imitates those errors)."""
        K, R = self.config.context, self.a.rollout
        if R <= 0 or rng.random() < 0.5:
            ctx, act, tgt, nv = self.data.sample_rollout(rng, batch, K, 0, focus=self.a.focus, drop_agent=self.a.drop_agent,
                                                         corrupt_block=self.a.corrupt_block, jump_focus=self.a.jump_focus)
            return ctx.to(self.device), act.to(self.device), tgt[:, 0].to(self.device), nv.to(self.device)
        r = int(rng.integers(1, R + 1))
        ctx, act, tgt, nv = (t.to(self.device) for t in self.data.sample_rollout(rng, batch, K, r, focus=self.a.focus,
                                                                                 jump_focus=self.a.jump_focus))
        with torch.no_grad(), autocast(self.device, self.a.amp):
            ctx, act, nv, _ = self.open_loop(self.model, ctx, act, nv, r,
                                             reencode=self.reencoder if self.a.rollout_reencode else None)
        return ctx.float(), act, tgt[:, r], nv

    def evaluate(self, ema) -> dict:
        ctx, act, tgt, nv = (t.to(self.device) for t in self.eval_batch)
        out = {}
        for steps in (1, 2):
            pred = ema.predict(ctx, act, nv, steps=steps, generator=torch.Generator().manual_seed(0))
            out[f"latent_mse_{steps}step"] = (pred - tgt).pow(2).mean().item()
        out["latent_mse_copy_last"] = (ctx[:, -1] - tgt).pow(2).mean().item()
        if self.eval_moving is not None:
            ctx, act, tgt, nv = (t.to(self.device) for t in self.eval_moving)
            pred = ema.predict(ctx, act, nv, steps=1, generator=torch.Generator().manual_seed(0))
            pred2 = ema.predict(ctx, act, nv, steps=1, generator=torch.Generator().manual_seed(1))
            st = metrics.latent_change_stats(ctx[:, -1], pred, pred2, tgt)
            out["latent_mse_1step_block_moving"] = st["model_mse"]
            out["latent_mse_copy_last_block_moving"] = st["copy_last_mse"]
            # < 1: one step under-predicts the change (averaging); ~0 variance: one step does not sample
            out["change_ratio_block_moving"] = st["predicted_change_ratio"]
            out["sample_variance_block_moving"] = st["sample_variance"]
        # contexts a rollout produces: the agent faded out / the block faded, ghosted or bent (what the augmentations train)
        for name, windows in (("no_agent", self.eval_no_agent), ("corrupt_block", self.eval_corrupt),
                              ("bent_block", self.eval_bend)):
            ctx, act, tgt, nv = (t.to(self.device) for t in windows)
            pred = ema.predict(ctx, act, nv, steps=1, generator=torch.Generator().manual_seed(0))
            out[f"latent_mse_1step_{name}"] = (pred - tgt).pow(2).mean().item()
            out[f"latent_mse_copy_last_{name}"] = (ctx[:, -1] - tgt).pow(2).mean().item()
        ctx, act, tgt, nv = (t.to(self.device) for t in self.eval_rollout)
        D = self.EVAL_DEPTH
        *_, preds = self.open_loop(ema, ctx, act, nv, D, generator=torch.Generator().manual_seed(0))
        out[f"open_loop_mse_step{D}"] = (preds[:, -1] - tgt[:, -1]).pow(2).mean().item()
        out[f"open_loop_mse_mean{D}"] = (preds - tgt).pow(2).mean().item()
        out[f"open_loop_mse_step{D}_copy_first"] = (ctx[:, -1] - tgt[:, -1]).pow(2).mean().item()
        # ... and as the env runs them: every prediction decoded and encoded again before it joins the window
        gen = torch.Generator().manual_seed(0)
        *_, preds = self.open_loop(ema, ctx, act, nv, D, generator=torch.Generator().manual_seed(0),
                                   reencode=lambda z: reencode_latents(self.stage1, z, gen))
        out[f"open_loop_reencoded_mse_step{D}"] = (preds[:, -1] - tgt[:, -1]).pow(2).mean().item()
        out[f"open_loop_reencoded_mse_mean{D}"] = (preds - tgt).pow(2).mean().item()
        return out

    def export(self, ema, out, result):
        extra = dict(data=str(self.a.data), data_seed=self.meta["seed"], data_episodes=len(self.data.latents),
                     stage1=self.stage1_file, commit=git_commit(), step=result["step"], eval=result["eval"],
                     task=self.task.name, rollout=self.a.rollout, rollout_reencode=self.a.rollout_reencode, focus=self.a.focus, change_weight=self.a.change_weight,
                     grow_blocks=self.a.grow_blocks, hires_ch=self.config.hires_ch, drop_agent=self.a.drop_agent,
                     corrupt_block=self.a.corrupt_block, corrupt_kinds=self.a.corrupt_kinds if self.a.corrupt_block else None,
                     one_step_loss=self.a.one_step_loss, extra_data=self.extra_meta or None,
                     agent_motion=list(self.config.agent_motion) or None, agent_motion_fit=self.agent_fit,
                     jump_focus=self.a.jump_focus, block_track=self.config.block_track)
        if self.a.finetune:  # steps counts this run only; the curriculum offset is the steps before it
            extra.update(finetuned_from=str(self.a.finetune), step=result["step"] + self.model.curriculum_offset,
                         finetune_steps=result["step"])
        save_release(out / "stage2.safetensors", ema.state_dict(), "stage2", self.config, extra)


def zero_map_inputs(sd: dict, cfg, after: int, n: int) -> dict:
    """A state dict with n zero-weight input channels inserted after the first `after` input maps of the
    trunk's input and of the full-resolution head's input (when it has one). Zero weights keep the
    release's function exactly, so new maps can be added to a trained release."""
    sd = dict(sd)
    for key, at in (("net.inp.weight", cfg.latent_ch + after), ("net.hires.inp.weight", 2 * cfg.latent_ch + after)):
        if key in sd:
            w = sd[key]
            sd[key] = torch.cat([w[:, :at], w.new_zeros(w.shape[0], n, *w.shape[2:]), w[:, at:]], dim=1)
    return sd


def add_agent_map_inputs(sd: dict, cfg) -> dict:
    """A release without an agent track, with zero weights for the agent maps `cfg` adds (after the
    action maps)."""
    from .dynamics import ACTION_MAP_CH, AGENT_MAP_CH

    return zero_map_inputs(sd, cfg, ACTION_MAP_CH, AGENT_MAP_CH)


def add_block_map_inputs(sd: dict, cfg) -> dict:
    """A release without a block track, with zero weights for the block maps `cfg` adds (after the action
    and agent maps)."""
    from .dynamics import ACTION_MAP_CH, AGENT_MAP_CH, BLOCK_MAP_CH

    return zero_map_inputs(sd, cfg, ACTION_MAP_CH + AGENT_MAP_CH, BLOCK_MAP_CH)


def load_stage(path, name, kind_cls, model_cls, device):
    """A frozen released stage from a file or directory."""
    from .checkpoint import load_release, load_state_checked

    f = find_release(path, name)
    cfg, sd, meta = load_release(f, name, kind_cls)
    model = model_cls(cfg)
    load_state_checked(model, sd, f)
    return model.to(device).eval().requires_grad_(False), meta, str(f)


class Stage3Stage(StageBase):
    """Decoder fine-tuning on predicted latents (`--init`: a directory with stage1 and stage2 releases)."""

    name = "stage3"

    def __init__(self, a, device):
        from .decoder import Stage1, Stage1Config, Stage3, Stage3Config
        from .dynamics import DynamicsConfig, Stage2

        super().__init__(a, device)
        init = a.init or self.task.checkpoint_path
        self.stage1, _, self.f1 = load_stage(init, "stage1", Stage1Config, Stage1, device)
        self.stage2, _, self.f2 = load_stage(init, "stage2", DynamicsConfig, Stage2, device)
        self.episodes = InMemoryEpisodes.load(a.data, a.max_episodes)
        self.data = LatentEpisodes(self.episodes, self.stage1.encoder, device, amp=a.amp,
                                   cache=latent_cache(a.data, self.f1, len(self.episodes.frames)))
        if self.stage2.cfg.agent_motion:  # a tracking stage 2 needs the agent's recorded positions
            self.data.agent = recorded_agent_pos(self.episodes.paths)
        self.config = Stage3Config(decoder=self.stage1.cfg.decoder, total_steps=a.steps)
        self.model = Stage3(self.config)
        self.model.decoder.load_state_dict(self.stage1.decoder.state_dict())
        held = list(heldout_episodes(self.task, 4, 48))
        self.held_frames = [e["frames"] for e in held]
        self.held = LatentEpisodes(InMemoryEpisodes(self.held_frames, [e["actions"] for e in held], []),
                                   self.stage1.encoder, device, amp=a.amp)
        if self.stage2.cfg.agent_motion:
            self.held.agent = [e["agent_pos"] for e in held]
        self.eval_batch = self._batch(np.random.default_rng(0), 32, self.held, self.held_frames)

    def _batch(self, rng, batch, lat: "LatentEpisodes", frames):
        """Frames x_{t+1} and latents predicted for them by `depth` open-loop dynamics steps."""
        K, R = self.stage2.cfg.context, self.config.rollout_depth
        depth = int(rng.integers(1, R + 1))
        ctx, act, nv, tgt = [], [], [], []
        track = lat.agent is not None  # a tracking stage 2: each row also holds the agent's position
        for e in rng.integers(0, len(lat.latents), batch):
            Z, A = lat.latents[e], lat.actions[e]
            t0 = int(rng.integers(0, len(A) - depth + 1))   # last real context frame
            n_valid = min(K, t0 + 1)
            idx = np.clip(np.arange(t0 - K + 1, t0 + 1), t0 - n_valid + 1, None)
            ctx.append(Z[idx])
            a = np.zeros((K + depth - 1, 4 if track else 2), np.float32)
            a[: K, :2] = A[idx]
            a[K:, :2] = A[t0 + 1 : t0 + depth]
            if track:
                P = lat.agent[e]
                a[: K, 2:] = P[idx]
                a[K:, 2:] = P[t0 + 1 : t0 + depth]
            a[: K - n_valid] = 0.0
            act.append(a)
            nv.append(n_valid)
            tgt.append(frames[e][t0 + depth])
        ctx = torch.stack(ctx).float().to(self.device)
        act = torch.from_numpy(np.stack(act)).to(self.device)
        nv = torch.tensor(nv, device=self.device)
        with torch.no_grad(), autocast(self.device, self.a.amp):
            *_, preds = Stage2Stage.open_loop(self.stage2, ctx, act, nv, depth)  # the frozen dynamics, open loop
        return frames_to_tensor(np.stack(tgt), self.device), preds[:, -1]

    def sample_batch(self, rng, batch):
        return self._batch(rng, batch, self.data, self.episodes.frames)

    def evaluate(self, ema) -> dict:
        from .decoder import decode

        x, z = self.eval_batch
        out = {}
        for name, dec in (("stage3", ema.decoder), ("stage1", self.stage1.decoder)):
            pred = decode(dec, z, 1, generator=torch.Generator().manual_seed(0))
            out[f"psnr_predicted_latents_{name}_decoder"] = psnr(pred, x).mean().item()
        return out

    def export(self, ema, out, result):
        extra = dict(data=str(self.a.data), data_seed=self.meta["seed"], data_episodes=len(self.data.latents),
                     stage1=self.f1, stage2=self.f2, commit=git_commit(), step=result["step"], eval=result["eval"],
                     task=self.task.name)
        save_release(out / "stage3.safetensors", ema.state_dict(), "stage3", self.config, extra)


STAGES = {"stage1": Stage1Stage, "stage2": Stage2Stage, "stage3": Stage3Stage}


def default_args(stage: str):
    from .train import TrainArgs

    if stage == "stage1":
        return TrainArgs(out="runs/stage1", steps=24000, batch=32, lr=1e-3, crop=64)
    if stage == "stage2":
        return TrainArgs(out="runs/stage2", steps=6000, batch=32, lr=7e-4)
    if stage == "stage3":
        return TrainArgs(out="runs/stage3", steps=5000, batch=16, lr=2e-4, warmup=100)
    raise ValueError(f"unknown stage {stage!r}; choose from {sorted(STAGES)}")
