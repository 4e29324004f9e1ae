"""The world model as users load it: the frozen stages bundled, with batched encode / decode / predict.

    wm = WorldModel.from_pretrained("checkpoints/tpushing")   # or a run directory
    z = wm.encode(frames_uint8)                             # (B, H, W, 3) uint8 -> (B, C, h, w)
    frames = wm.decode(z, steps=1)                          # -> (B, H, W, 3) uint8

Device "auto" picks CUDA when present, else the CPU. The networks run in bf16 where the hardware computes
in it natively (CUDA, AMX / AVX512-BF16 CPUs) and in fp32 elsewhere (`hardware.default_dtype`; emulated
bf16 is several times slower than fp32), with channels_last; the consistency parameterisation stays fp32.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from .checkpoint import load_release, load_state_checked
from .decoder import Stage1, Stage1Config, decode
from .hardware import default_dtype, dtype_name, resolve_device
from .stages import frames_to_tensor, tensor_to_frames

# With re-encoding on, every REENCODE_EVERY-th step's decoded frame is encoded back into the context and
# the steps between keep the raw predicted latent (WorldModel.step). Every step is the default: 4 gives
# sharper rollouts but ranks policies less reliably (docs/model.md, "Re-encoding interval").
REENCODE_EVERY = 1


def check_reencode_every(k) -> int:
    """k as an int >= 1 (steps between re-encodings), or a ValueError that names it."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"reencode_every must be an int >= 1 (steps between re-encodings), got {k!r}")
    return int(k)


STAGE_FILES = {"stage1": "stage1.safetensors", "stage2": "stage2.safetensors", "stage3": "stage3.safetensors"}


class WorldModel:
    def __init__(self, stage1: Stage1, device: torch.device, path: Path | None = None, meta: dict | None = None,
                 dtype: torch.dtype | None = None, decoder_steps: int = 1, stage2=None, dynamics_steps: int = 1,
                 reencode: bool = True, reencode_every: int = REENCODE_EVERY):
        dtype = dtype or default_dtype(device)  # bf16 where the hardware has it natively, else fp32
        self.device, self.path, self.meta, self.dtype = device, path, meta or {}, dtype
        self.stage1 = stage1.to(device).eval().requires_grad_(False).to(memory_format=torch.channels_last).to(dtype)
        self.stage2 = stage2.to(device).eval().requires_grad_(False).to(dtype) if stage2 is not None else None
        self.dynamics_steps = dynamics_steps
        self.dynamics_sampler = "consistency"  # or "euler" (see Stage2.predict)
        self.frame_size = stage1.cfg.encoder.frame_size
        self.decoder_steps = decoder_steps
        self.reencode = reencode
        self.reencode_every = reencode_every  # with reencode: every k-th step's frame goes back (1: every step)

    def compile(self) -> "WorldModel":
        """torch.compile the dynamics network, where a step spends most of its time (many small ops at
        batch 1). The first step afterwards compiles (tens of seconds on a CPU; needs a C++ compiler
        there); the numbers are the eager model's up to bf16 rounding. Returns self."""
        if self.stage2 is not None and not hasattr(self.stage2.net, "_orig_mod"):
            self.stage2.net = torch.compile(self.stage2.net)
        return self

    @classmethod
    def from_pretrained(cls, path, device: str = "auto", stages=("stage1",), dtype: torch.dtype | None = None) -> "WorldModel":
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint directory {path} does not exist")
        f1 = path / STAGE_FILES["stage1"]
        cfg, sd, meta = load_release(f1, "stage1", Stage1Config)
        model = Stage1(cfg)
        load_state_checked(model, sd, f1)
        metas, stage2 = {"stage1": meta}, None
        if "stage2" in stages:
            from .dynamics import DynamicsConfig, Stage2

            f2 = path / STAGE_FILES["stage2"]
            cfg2, sd2, metas["stage2"] = load_release(f2, "stage2", DynamicsConfig)
            stage2 = Stage2(cfg2)
            load_state_checked(stage2, sd2, f2)
            f3 = path / STAGE_FILES["stage3"]
            if f3.is_file():  # stage 3: a decoder fine-tuned on predicted latents renders the rollouts
                from .decoder import Stage3, Stage3Config

                cfg3, sd3, metas["stage3"] = load_release(f3, "stage3", Stage3Config)
                s3 = Stage3(cfg3)
                load_state_checked(s3, sd3, f3)
                model.decoder = s3.decoder
        return cls(model, resolve_device(device), path, metas, dtype=dtype, stage2=stage2)

    @staticmethod
    def has_stage(path, stage: str) -> bool:
        return (Path(path) / STAGE_FILES[stage]).is_file()

    def _check_frames(self, frames: np.ndarray):
        s = self.frame_size
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[1:] != (s, s, 3):
            shape = getattr(frames, "shape", None)
            dtype = getattr(frames, "dtype", type(frames).__name__)
            raise ValueError(f"expected frames of shape (B, {s}, {s}, 3) dtype uint8 RGB, got shape {shape} dtype {dtype}")

    @torch.inference_mode()
    def encode(self, frames: np.ndarray) -> torch.Tensor:
        self._check_frames(frames)
        return self.stage1.encoder(frames_to_tensor(frames, self.device))

    @torch.inference_mode()
    def decode(self, z: torch.Tensor, steps: int | None = None, seed: int | None = None,
               generator: torch.Generator | None = None) -> np.ndarray:
        if generator is None and seed is not None:
            generator = torch.Generator().manual_seed(seed)
        x = decode(self.stage1.decoder, z, steps or self.decoder_steps, generator=generator)
        return tensor_to_frames(x)

    def reconstruct(self, frames: np.ndarray, steps: int | None = None, seed: int | None = None,
                    batch: int = 64) -> np.ndarray:
        out = [self.decode(self.encode(frames[i : i + batch]), steps, seed) for i in range(0, len(frames), batch)]
        return np.concatenate(out)


    # ---- the rolling context, batched: what the envs step -------------------------------------------
    @property
    def tracks_agent(self) -> bool:
        """Whether the dynamics follow the agent with its motion law (dynamics.agent_landing)."""
        return self.stage2 is not None and bool(self.stage2.cfg.agent_motion)

    @property
    def tracks_block(self) -> bool:
        """Whether the dynamics are given the T block's pose (dynamics.block_maps), read from each frame."""
        return self.stage2 is not None and bool(self.stage2.cfg.block_track)

    def start(self, z0: torch.Tensor, agent_pos=None, block_pose=None) -> dict:
        """Rollout state for B envs from their first latents z0 (B, C, h, w): a context window of K
        slots holding z0 once (the earlier slots are padding) and no actions yet. A model that tracks the
        agent also needs its position in the first frames, agent_pos (B, 2) canvas px (see
        pose.agent_position to read it from a frame); the track then follows the actions. A model that
        tracks the block needs its pose in the first frames, block_pose (B, 3) canvas px and rad
        (`frames_block_pose`); each step then reads it from the decoded frame (see `step`)."""
        if self.stage2 is None:
            raise ValueError(f"{self.path}: no stage2.safetensors, cannot roll out dynamics")
        K = self.stage2.cfg.context
        B = z0.shape[0]
        state = dict(ctx=z0[:, None].repeat(1, K, 1, 1, 1), acts=torch.zeros(B, K, 2, device=self.device),
                     n_valid=torch.ones(B, dtype=torch.long, device=self.device),
                     t=torch.zeros(B, dtype=torch.long, device=self.device))  # steps since start, per env
        tracks = [("agent", "agent_pos", 2, agent_pos, "(x, y) canvas positions")] if self.tracks_agent else []
        tracks += [("block", "block_pose", 3, block_pose, "(x, y, angle) poses")] if self.tracks_block else []
        for name, key, width, rows, what in tracks:  # each track starts from (B, width) rows
            if rows is None:
                raise ValueError(f"{self.path}: this dynamics model tracks the {name}; start() needs {key} (B, {width})")
            q = torch.as_tensor(np.asarray(rows, np.float32), device=self.device).reshape(-1, width)
            if len(q) != B or not torch.isfinite(q).all():
                raise ValueError(f"{key} must be {B} finite {what}, got {q.tolist()}")
            state[name] = q
        # each window row: the action, then each track's row for that frame
        state["acts"] = torch.zeros(B, K, 2 + sum(width for _, _, width, _, _ in tracks), device=self.device)
        return state

    def start_frames(self, frames: np.ndarray, agent_pos=None) -> dict:
        """`start` from the first frames themselves (B, H, W, 3) uint8: encoded, and with a block track the
        block's pose read from them (`frames_block_pose`)."""
        return self.start(self.encode(frames), agent_pos, frames_block_pose(frames) if self.tracks_block else None)

    @torch.inference_mode()
    def advance(self, state: dict, actions: torch.Tensor, generator: torch.Generator | None = None,
                steps: int | None = None) -> torch.Tensor:
        """One env step for every env: predict z_{t+1} from the window and `actions` (B, 2), then slide the
        window forward (the oldest latent drops out, so the cost per step never grows). With an agent
        track, each window row also holds the agent's position in that frame, and state["agent"] moves
        to where the motion law puts it. Returns z_{t+1}."""
        K = self.stage2.cfg.context
        row = actions.float().to(self.device)
        if "agent" in state:
            row = torch.cat([row, state["agent"]], dim=1)
        if "block" in state:
            row = torch.cat([row, state["block"]], dim=1)
        state["acts"] = torch.cat([state["acts"][:, 1:], row[:, None]], dim=1)
        z = self.stage2.predict(state["ctx"], state["acts"], state["n_valid"], steps=steps or self.dynamics_steps,
                                generator=generator, sampler=self.dynamics_sampler)
        if "agent" in state:
            state["agent"] = self.stage2.landing(state["acts"], state["n_valid"]).clamp(0, 512)
        state["ctx"] = torch.cat([state["ctx"][:, 1:], z[:, None]], dim=1)
        state["n_valid"] = (state["n_valid"] + 1).clamp(max=K)
        state["t"] = state["t"] + 1
        return z

    @torch.inference_mode()
    def step(self, state: dict, actions: torch.Tensor, generator: torch.Generator | None = None,
             steps: int | None = None) -> np.ndarray:
        """One env step: predict z_{t+1}, decode the frame the user sees, and (with `reencode`, the
        default) on every `reencode_every`-th step of each env put that frame's encoding into the context
        in place of the raw prediction, so the window is regularly pulled back to latents of renderable
        frames, as at reset. Without it, small off-manifold errors of the prediction feed back into the
        next one and compound; every step, the decode-encode round trip blurs what the dynamics drew
        (measured: docs/model.md, "Re-encoding interval"). Returns the frames (B, H, W, 3) uint8."""
        z = self.advance(state, actions, generator=generator, steps=steps)
        frames = self.decode(z, generator=generator)
        if "block" in state:  # the block track: the pose fitted to each new frame, held where none is found
            state["block"] = update_block_track(state["block"], frames)
        if self.reencode:
            due = state["t"] % check_reencode_every(self.reencode_every) == 0  # (B,) envs whose frame goes back this step
            if bool(due.any()):
                z_obs = self.encode(frames).to(state["ctx"].dtype)
                z_last = torch.where(due[:, None, None, None], z_obs, state["ctx"][:, -1])
                state["ctx"] = torch.cat([state["ctx"][:, :-1], z_last[:, None]], dim=1)
        return frames

    @torch.inference_mode()
    def predict_teacher_forced(self, frames: np.ndarray, actions: np.ndarray, seed: int = 0, batch: int = 64,
                               agent_pos: np.ndarray | None = None) -> np.ndarray:
        """One-step predictions from real history: frames (T+1, H, W, 3) uint8, actions (T, 2) ->
        (T, H, W, 3), where prediction t+1 sees the real frames <= t (up to K of them) and actions <= t.
        A model that tracks the agent reads its positions (T+1, 2) from `agent_pos`, or from the frames."""
        K = self.stage2.cfg.context
        z = torch.cat([self.encode(frames[i : i + batch]) for i in range(0, len(frames), batch)]).float()
        a = torch.as_tensor(np.asarray(actions, np.float32), device=self.device)
        if self.tracks_agent:
            p = frames_agent_pos(frames) if agent_pos is None else np.asarray(agent_pos, np.float32)
            a = torch.cat([a, torch.as_tensor(p[: len(a)], dtype=torch.float32, device=self.device)], dim=1)
        if self.tracks_block:  # read from the real frames, held where a frame does not show the block
            q = update_block_track(torch.as_tensor(frames_block_pose(frames[:1])), frames[: len(a)], hold=True)
            a = torch.cat([a, q.to(self.device)], dim=1)
        T = len(a)
        gen = torch.Generator().manual_seed(seed)
        out = []
        for t0 in range(0, T, batch):
            ts = torch.arange(t0, min(T, t0 + batch), device=self.device)
            n_valid = (ts + 1).clamp(max=K)
            # window of K slots ending at t; slots before the episode start repeat the first frame (padding)
            idx = (ts[:, None] + torch.arange(-K + 1, 1, device=self.device)[None]).clamp(min=0)  # (b, K)
            acts = a[idx].masked_fill((torch.arange(K, device=self.device)[None] < (K - n_valid)[:, None])[..., None], 0.0)
            z1 = self.stage2.predict(z[idx], acts, n_valid, steps=self.dynamics_steps, generator=gen,
                                     sampler=self.dynamics_sampler)
            out.append(self.decode(z1, generator=gen))
        return np.concatenate(out)

    def rollout(self, first_frame: np.ndarray, actions: np.ndarray, seed: int = 0, steps: int | None = None,
                agent_pos=None) -> np.ndarray:
        """Open-loop rollout from one real frame: (H, W, 3) uint8 and (T, 2) actions -> (T+1, H, W, 3) uint8.
        agent_pos: the agent's position in the first frame, for a model that tracks it (default: read
        from the frame)."""
        gen = torch.Generator().manual_seed(seed)
        if self.tracks_agent and agent_pos is None:
            agent_pos = frames_agent_pos(first_frame[None])
        state = self.start_frames(first_frame[None], agent_pos)
        frames = [first_frame]
        for a in np.asarray(actions, dtype=np.float32):
            frames.append(self.step(state, torch.from_numpy(a)[None], generator=gen, steps=steps)[0])
        return np.stack(frames)


def frames_agent_pos(frames: np.ndarray) -> np.ndarray:
    """The agent's position (canvas px) in each of (N, H, W, 3) real frames, read by pose.agent_position;
    raises ValueError when a frame does not show it (a track must start from where the agent is)."""
    from .pose import agent_position

    out = []
    for i, f in enumerate(frames):
        p = agent_position(f)
        if p is None:
            raise ValueError(f"frame {i}: no agent found; pass its position as agent_pos")
        out.append(p)
    return np.asarray(out, np.float32)


def _block_pose_or(frame: np.ndarray, fallback):
    """The T block's pose (x, y, angle; canvas px, rad) fitted to one frame by the pose estimator, or
    `fallback` where the frame does not show the block."""
    from .pose import block_fraction, fit_block

    q, _ = fit_block(*block_fraction(frame))
    return fallback if q is None else np.asarray(q, np.float32)


def frames_block_pose(frames: np.ndarray) -> np.ndarray:
    """The T block's pose in each of (N, H, W, 3) real frames; raises ValueError when a frame does not
    show it (a track must start from it)."""
    out = []
    for i, f in enumerate(frames):
        q = _block_pose_or(f, None)
        if q is None:
            raise ValueError(f"frame {i}: no T block found; pass its pose as block_pose")
        out.append(q)
    return np.asarray(out, np.float32)


def update_block_track(track: torch.Tensor, frames: np.ndarray, hold: bool = False) -> torch.Tensor:
    """The block track after new frames. track (B, 3) the last poses, frames (B, H, W, 3) uint8 ->
    (B, 3): each frame's fitted pose, or its row of `track` where the frame shows no block (a faded block
    is held where it was last seen). With hold=True the frames are one sequence (N, H, W, 3) starting
    from track (1, 3), and the result is (N, 3), each row the last pose seen up to that frame."""
    last = track.float().cpu().numpy()
    if hold:
        out, prev = [], last[0]
        for f in frames:
            prev = _block_pose_or(f, prev)
            out.append(prev)
    else:
        out = [_block_pose_or(f, prev) for f, prev in zip(frames, last)]
    return torch.as_tensor(np.stack(out), dtype=torch.float32).to(track.device)


def load_predictor(checkpoint, decoder_steps: int | None = None, dynamics_steps: int | None = None,
                   reencode: bool = True, dynamics_sampler: str = "consistency", ctx_sigma: float | None = None,
                   reencode_every: int | None = None):
    """A fidelity predictor `(episode, horizon) -> frames (horizon+1, H, W, 3)` for a checkpoint directory.

    With only stage 1 present it is the autoencoder ceiling: every ground-truth frame encoded and
    decoded (teacher-forced, not a rollout); the report labels it so."""
    if WorldModel.has_stage(checkpoint, "stage2"):
        wm = WorldModel.from_pretrained(checkpoint, stages=("stage1", "stage2"))
        wm.decoder_steps = decoder_steps or wm.decoder_steps
        wm.dynamics_steps = dynamics_steps or wm.dynamics_steps
        wm.reencode = reencode
        if reencode_every is not None:
            wm.reencode_every = check_reencode_every(reencode_every)
        wm.dynamics_sampler = dynamics_sampler
        if ctx_sigma is not None:  # the context's inference noise level (the release's config holds the default)
            if not 0.0 <= ctx_sigma <= wm.stage2.cfg.ctx_sigma_max:
                raise ValueError(f"--ctx-sigma must be in [0, {wm.stage2.cfg.ctx_sigma_max}] (the training range), got {ctx_sigma}")
            wm.stage2.cfg = dataclasses.replace(wm.stage2.cfg, ctx_sigma=ctx_sigma)

        def roll(ep, horizon):
            return wm.rollout(ep["frames"][0], ep["actions"][:horizon], seed=0,
                              agent_pos=ep["agent_pos"][:1] if "agent_pos" in ep else None)

        roll.precision, roll.ctx_sigma, roll.reencode_every = dtype_name(wm.dtype), wm.stage2.cfg.ctx_sigma, wm.reencode_every
        return "open_loop_rollout", roll
    wm = WorldModel.from_pretrained(checkpoint)

    def autoencode(ep, horizon):
        return wm.reconstruct(ep["frames"][: horizon + 1], steps=decoder_steps, seed=0)

    autoencode.precision = dtype_name(wm.dtype)
    return "stage1_autoencoder_ceiling", autoencode
