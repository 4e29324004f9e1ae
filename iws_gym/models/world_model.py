"""The world model as users load it: the frozen stages bundled, with batched encode / decode / predict.

    wm = WorldModel.from_pretrained("checkpoints/tpushing", stages=("stage1", "stage2"))  # or a run directory
    z = wm.encode(frames_uint8)                             # (B, H, W, 3) uint8 -> (B, C, h, w)
    frames = wm.decode(z, steps=1)                          # -> (B, H, W, 3) uint8
    state = wm.start(z, agent_pos)                          # rolling context of B envs
    frames = wm.step(state, actions)                        # (B, 2) -> the next frames (B, H, W, 3) uint8
    wm4 = wm.with_settings(reencode_every=4)                # other RolloutSettings, the same weights

Device "auto" picks CUDA when present, else the CPU. The networks run in bf16 where the hardware computes
in it natively (CUDA, AMX / AVX512-BF16 CPUs) and in fp32 elsewhere (`hardware.default_dtype`; emulated
bf16 is several times slower than fp32), with channels_last; the consistency parameterisation stays fp32.
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import torch

from iws_gym.models.checkpoint import load_release, load_state_checked
from iws_gym.models.decoder import Stage1, Stage1Config, decode
from iws_gym.models.frames import frames_to_tensor, tensor_to_frames
from iws_gym.models.hardware import default_dtype, dtype_name, resolve_device
from iws_gym.models import trust


def check_reencode_every(k) -> int:
    """k as an int >= 1 (steps between re-encodings), or a ValueError that names it."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"reencode_every must be an int >= 1 (steps between re-encodings), got {k!r}")
    return int(k)


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """How a world model rolls out: fixed when it is built, passed in, never patched afterwards
    (`WorldModel.with_settings` makes a copy that shares the weights)."""

    decoder_steps: int = 1                # consistency steps of the decoder per frame
    dynamics_steps: int | None = None     # sampler steps of the dynamics per latent (None: the model's own)
    dynamics_sampler: str | None = None   # "consistency" | "euler" (probability-flow ODE); None: the model's own
    reencode: bool = True                 # put the decoded frame's encoding back into the context (see WorldModel.step)
    reencode_every: int = 1               # ... on every k-th step; the steps between keep the predicted latent.
                                          # 4 gives sharper rollouts but ranks policies less reliably (docs/results.md)
    ctx_sigma: float | None = None        # the context's noise level at inference (None: the release's config)
    trust: bool = True                    # the per-step trust signal (models/trust.py): free while every step
                                          # re-encodes; with reencode_every > 1 it costs an encode on the other steps

    def __post_init__(self):
        for name in ("decoder_steps", "dynamics_steps"):
            v = getattr(self, name)
            if v is None and name == "dynamics_steps":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.dynamics_sampler not in (None, "consistency", "euler"):
            raise ValueError(f"dynamics_sampler must be 'consistency' or 'euler', got {self.dynamics_sampler!r}")
        check_reencode_every(self.reencode_every)
        for name in ("reencode", "trust"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.ctx_sigma is not None and not self.ctx_sigma >= 0:
            raise ValueError(f"ctx_sigma must be >= 0, got {self.ctx_sigma!r}")



STAGE_FILES = {"stage1": "stage1.safetensors", "stage2": "stage2.safetensors"}


class WorldModel:
    def __init__(self, stage1: Stage1, device: torch.device, path: Path | None = None, meta: dict | None = None,
                 dtype: torch.dtype | None = None, stage2=None, settings: RolloutSettings = RolloutSettings()):
        dtype = dtype or default_dtype(device)  # bf16 where the hardware has it natively, else fp32
        self.device, self.path, self.meta, self.dtype = device, path, meta or {}, dtype
        self.stage1 = stage1.to(device).eval().requires_grad_(False).to(memory_format=torch.channels_last).to(dtype)
        self.stage2 = stage2.to(device).eval().requires_grad_(False).to(dtype) if stage2 is not None else None
        self.frame_size = stage1.cfg.encoder.frame_size
        if not isinstance(settings, RolloutSettings):
            raise ValueError(f"settings must be a RolloutSettings, got {type(settings).__name__}")
        self.settings = settings
        self.trust_calibration = trust.TrustCalibration.load(path)

    def with_settings(self, **changes) -> "WorldModel":
        """A copy with other rollout settings (dataclasses.replace of `settings`), sharing the weights."""
        wm = copy.copy(self)
        wm.settings = dataclasses.replace(self.settings, **changes)
        return wm

    def compile(self) -> "WorldModel":
        """torch.compile the dynamics network, where a step spends most of its time (many small ops at
        batch 1). The first step afterwards compiles (tens of seconds on a CPU; needs a C++ compiler
        there); the numbers are the eager model's up to bf16 rounding. Returns self."""
        if self.stage2 is not None and not hasattr(self.stage2.net, "_orig_mod"):
            self.stage2.net = torch.compile(self.stage2.net)
        return self

    @classmethod
    def from_pretrained(cls, path, device: str = "auto", stages=("stage1",), dtype: torch.dtype | None = None,
                        settings: RolloutSettings | None = None) -> "WorldModel":
        """Both stages from a release or run directory. A release of the compact design (models/compact.py)
        gives a CompactWorldModel, which has this class's interface. settings None: the release's defaults."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint directory {path} does not exist")
        from iws_gym.models.compact import CompactWorldModel, is_compact_release

        if is_compact_release(path):
            return CompactWorldModel.from_pretrained(path, device, stages, dtype, settings)
        settings = settings or release_settings(path)
        f1 = path / STAGE_FILES["stage1"]
        cfg, sd, meta = load_release(f1, "stage1", Stage1Config)
        model = Stage1(cfg)
        load_state_checked(model, sd, f1)
        metas, stage2 = {"stage1": meta}, None
        if "stage2" in stages:
            from iws_gym.models.dynamics import DynamicsConfig, Stage2

            f2 = path / STAGE_FILES["stage2"]
            cfg2, sd2, metas["stage2"] = load_release(f2, "stage2", DynamicsConfig)
            stage2 = Stage2(cfg2)
            load_state_checked(stage2, sd2, f2)
        return cls(model, resolve_device(device), path, metas, dtype=dtype, stage2=stage2, settings=settings)

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
        x = decode(self.stage1.decoder, z, steps or self.settings.decoder_steps, generator=generator)
        return tensor_to_frames(x)

    def decode_last(self, state: dict, generator: torch.Generator | None = None) -> np.ndarray:
        """The frames of the newest latent in a rollout state (what `step` would show), without re-encoding."""
        return self.decode(state["ctx"][:, -1], generator=generator)

    def reconstruct(self, frames: np.ndarray, steps: int | None = None, seed: int | None = None,
                    batch: int = 64, agent_pos=None) -> np.ndarray:
        """decode(encode(frames)); `agent_pos` is accepted for the compact design's interface and unused: this
        stage 1 draws the agent from its latent."""
        out = [self.decode(self.encode(frames[i : i + batch]), steps, seed) for i in range(0, len(frames), batch)]
        return np.concatenate(out)


    # ---- the rolling context, batched: what the envs step -------------------------------------------
    @property
    def tracks_agent(self) -> bool:
        """Whether the dynamics follow the agent with its motion law (dynamics.agent_landing)."""
        return self.stage2 is not None and bool(self.stage2.cfg.agent_motion)

    def start(self, z0: torch.Tensor, agent_pos=None) -> dict:
        """Rollout state for B envs from their first latents z0 (B, C, h, w): a context window of K
        slots holding z0 once (the earlier slots are padding) and no actions yet. A model that tracks the
        agent also needs its position in the first frames, agent_pos (B, 2) canvas px (the robot's own
        proprioception; the env reads it from the frame); the track then follows the actions."""
        if self.stage2 is None:
            raise ValueError(f"{self.path}: no stage2.safetensors, cannot roll out dynamics")
        K = self.stage2.cfg.context
        B = z0.shape[0]
        state = dict(ctx=z0[:, None].repeat(1, K, 1, 1, 1), acts=torch.zeros(B, K, 2, device=self.device),
                     n_valid=torch.ones(B, dtype=torch.long, device=self.device),
                     t=torch.zeros(B, dtype=torch.long, device=self.device),  # steps since start, per env
                     # the trust signal (models/trust.py): smoothed cycle error, trust now, its episode minimum
                     trust_m=torch.zeros(B, device=self.device), trust=torch.ones(B, device=self.device),
                     trust_min=torch.ones(B, device=self.device))
        if self.tracks_agent:
            if agent_pos is None:
                raise ValueError(f"{self.path}: this dynamics model tracks the agent; start() needs agent_pos (B, 2)")
            q = torch.as_tensor(np.asarray(agent_pos, np.float32), device=self.device).reshape(-1, 2)
            if len(q) != B or not torch.isfinite(q).all():
                raise ValueError(f"agent_pos must be {B} finite (x, y) canvas positions, got {q.tolist()}")
            state["agent"] = q                                          # (B, 2) where the agent is now
            state["agent_hist"] = torch.zeros(B, K, 2, device=self.device)  # where it was in each context frame
        return state

    def start_frames(self, frames: np.ndarray, agent_pos=None) -> dict:
        """`start` from the first frames themselves (B, H, W, 3) uint8."""
        return self.start(self.encode(frames), agent_pos)

    @torch.inference_mode()
    def advance(self, state: dict, actions: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """One env step for every env: predict z_{t+1} from the window and `actions` (B, 2), then slide the
        window forward (the oldest latent drops out, so the cost per step never grows). With an agent
        track, the window also holds the agent's position in each frame, and state["agent"] moves to where
        the motion law puts it. Returns z_{t+1}."""
        K, st = self.stage2.cfg.context, self.settings
        state["acts"] = torch.cat([state["acts"][:, 1:], actions.float().to(self.device)[:, None]], dim=1)
        agent = None
        if "agent" in state:
            state["agent_hist"] = agent = torch.cat([state["agent_hist"][:, 1:], state["agent"][:, None]], dim=1)
        z = self.stage2.predict(state["ctx"], state["acts"], state["n_valid"], agent, steps=st.dynamics_steps,
                                generator=generator, sampler=st.dynamics_sampler, ctx_sigma=st.ctx_sigma)
        if "agent" in state:
            state["agent"] = self.stage2.landing(agent, state["acts"], state["n_valid"]).clamp(0, 512)
        state["ctx"] = torch.cat([state["ctx"][:, 1:], z[:, None]], dim=1)
        state["n_valid"] = (state["n_valid"] + 1).clamp(max=K)
        state["t"] = state["t"] + 1
        return z

    @torch.inference_mode()
    def step(self, state: dict, actions: torch.Tensor, generator: torch.Generator | None = None) -> np.ndarray:
        """One env step: predict z_{t+1}, decode the frame the user sees, and (with `settings.reencode`,
        the default) on every `reencode_every`-th step of each env put that frame's encoding into the
        context in place of the raw prediction, so the window is regularly pulled back to latents of
        renderable frames, as at reset. Without it, small off-manifold errors of the prediction feed back
        into the next one and compound; every step, the decode-encode round trip blurs what the dynamics
        drew (docs/experiments.md, "Re-encoding interval"). With `settings.trust`, the round trip also gives
        each env's trust (state["trust"], state["trust_min"]; models/trust.py). Returns the frames (B, H, W, 3) uint8."""
        z = self.advance(state, actions, generator=generator)
        frames = self.decode(z, generator=generator)
        st = self.settings
        due = state["t"] % st.reencode_every == 0 if st.reencode else torch.zeros_like(state["t"], dtype=torch.bool)
        if st.trust or bool(due.any()):  # envs whose frame goes back this step, and the trust signal
            z_obs = self.encode(frames).to(state["ctx"].dtype)
            if st.trust:
                trust.update(state, trust.cycle_error(z, z_obs, self.stage2.cfg.z_std), self.trust_calibration)
            if bool(due.any()):
                z_last = torch.where(due[:, None, None, None], z_obs, state["ctx"][:, -1])
                state["ctx"] = torch.cat([state["ctx"][:, :-1], z_last[:, None]], dim=1)
        return frames

    @torch.inference_mode()
    def predict_teacher_forced(self, frames: np.ndarray, actions: np.ndarray, seed: int = 0, batch: int = 64,
                               agent_pos: np.ndarray | None = None) -> np.ndarray:
        """One-step predictions from real history: frames (T+1, H, W, 3) uint8, actions (T, 2) ->
        (T, H, W, 3), where prediction t+1 sees the real frames <= t (up to K of them) and actions <= t.
        A model that tracks the agent needs its positions agent_pos (T+1, 2)."""
        K, st = self.stage2.cfg.context, self.settings
        z = torch.cat([self.encode(frames[i : i + batch]) for i in range(0, len(frames), batch)]).float()
        a = torch.as_tensor(np.asarray(actions, np.float32), device=self.device)
        p = None
        if self.tracks_agent:
            if agent_pos is None:
                raise ValueError(f"{self.path}: this dynamics model tracks the agent; pass agent_pos (T+1, 2)")
            p = torch.as_tensor(np.asarray(agent_pos, np.float32)[: len(a)], device=self.device)
        T = len(a)
        gen = torch.Generator().manual_seed(seed)
        out = []
        for t0 in range(0, T, batch):
            ts = torch.arange(t0, min(T, t0 + batch), device=self.device)
            n_valid = (ts + 1).clamp(max=K)
            # window of K slots ending at t; slots before the episode start repeat the first frame (padding)
            idx = (ts[:, None] + torch.arange(-K + 1, 1, device=self.device)[None]).clamp(min=0)  # (b, K)
            padded = (torch.arange(K, device=self.device)[None] < (K - n_valid)[:, None])[..., None]
            acts = a[idx].masked_fill(padded, 0.0)
            agent = p[idx].masked_fill(padded, 0.0) if p is not None else None
            z1 = self.stage2.predict(z[idx], acts, n_valid, agent, steps=st.dynamics_steps, generator=gen,
                                     sampler=st.dynamics_sampler, ctx_sigma=st.ctx_sigma)
            out.append(self.decode(z1, generator=gen))
        return np.concatenate(out)

    def rollout(self, first_frame: np.ndarray, actions: np.ndarray, seed: int = 0, agent_pos=None) -> np.ndarray:
        """Open-loop rollout from one real frame: (H, W, 3) uint8 and (T, 2) actions -> (T+1, H, W, 3) uint8.
        agent_pos: the agent's position in the first frame (2,) or (1, 2), for a model that tracks it."""
        gen = torch.Generator().manual_seed(seed)
        state = self.start_frames(first_frame[None], None if agent_pos is None else np.reshape(agent_pos, (1, 2)))
        frames = [first_frame]
        for a in np.asarray(actions, dtype=np.float32):
            frames.append(self.step(state, torch.from_numpy(a)[None], generator=gen)[0])
        return np.stack(frames)


# what a release may set as its own rollout default (`iws release --set`): every setting but the trust switch
ROLLOUT_DEFAULT_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutSettings) if f.name != "trust")


def release_rollout(checkpoint) -> dict:
    """A release's own rollout defaults (RolloutSettings fields), from its metadata only (no weights are loaded):
    its design's (the compact design does not re-encode), then what its stage-2 metadata's `rollout` says
    (`iws release --set reencode_every=4` writes it)."""
    from iws_gym.models.checkpoint import release_metadata
    from iws_gym.models.compact import is_compact_release

    out = {"reencode": False} if is_compact_release(checkpoint) else {}
    f2 = Path(checkpoint) / STAGE_FILES["stage2"]
    if f2.is_file():
        out.update(release_metadata(f2).get("rollout") or {})
    return out


def release_settings(checkpoint, **changes) -> RolloutSettings:
    """The RolloutSettings a release runs with by default, with `changes` applied (a None value keeps the default).
    A bad value raises ValueError naming the field."""
    given = {k: v for k, v in changes.items() if v is not None}
    unknown = sorted(set(given) - {f.name for f in dataclasses.fields(RolloutSettings)})
    if unknown:
        raise ValueError(f"unknown rollout settings {unknown}")
    return RolloutSettings(**{**release_rollout(checkpoint), **given})


def load_predictor(checkpoint, settings: RolloutSettings = RolloutSettings()):
    """A fidelity predictor `(episode, horizon) -> frames (horizon+1, H, W, 3)` for a checkpoint directory.

    With only stage 1 present it is the autoencoder ceiling: every ground-truth frame encoded and
    decoded (teacher-forced, not a rollout); the report labels it so."""
    from iws_gym.models.compact import is_compact_release

    if is_compact_release(checkpoint):  # deterministic, no re-encoding by default: the release's own settings
        return _compact_predictor(checkpoint, settings)
    if WorldModel.has_stage(checkpoint, "stage2"):
        wm = WorldModel.from_pretrained(checkpoint, stages=("stage1", "stage2"), settings=settings)
        cfg = wm.stage2.cfg
        if settings.ctx_sigma is not None and settings.ctx_sigma > cfg.ctx_sigma_max:
            raise ValueError(f"ctx_sigma must be in [0, {cfg.ctx_sigma_max}] (the training range), got {settings.ctx_sigma}")

        def roll(ep, horizon):
            return wm.rollout(ep["frames"][0], ep["actions"][:horizon], seed=0,
                              agent_pos=ep["agent_pos"][:1] if "agent_pos" in ep else None)

        roll.precision = dtype_name(wm.dtype)
        roll.ctx_sigma = cfg.ctx_sigma if settings.ctx_sigma is None else settings.ctx_sigma
        roll.reencode_every = settings.reencode_every
        roll.dynamics_sampler = settings.dynamics_sampler or ("euler" if cfg.objective == "denoise" else "consistency")
        roll.dynamics_steps = settings.dynamics_steps or cfg.sample_steps
        return "open_loop_rollout", roll
    wm = WorldModel.from_pretrained(checkpoint, settings=settings)

    def autoencode(ep, horizon):
        return wm.reconstruct(ep["frames"][: horizon + 1], steps=settings.decoder_steps, seed=0)

    autoencode.precision = dtype_name(wm.dtype)
    return "stage1_autoencoder_ceiling", autoencode


def _compact_predictor(checkpoint, settings: RolloutSettings):
    """load_predictor for a compact release: its rollouts, or stage 1's round trip (it draws the agent where the
    episode's agent_pos puts it). Only the re-encoding settings apply; the others are the defaults."""
    stages = ("stage1", "stage2") if WorldModel.has_stage(checkpoint, "stage2") else ("stage1",)
    wm = WorldModel.from_pretrained(checkpoint, stages=stages)
    wm = wm.with_settings(reencode=settings.reencode, reencode_every=settings.reencode_every)
    if "stage2" in stages:
        def roll(ep, horizon):
            return wm.rollout(ep["frames"][0], ep["actions"][:horizon], agent_pos=ep["agent_pos"][0])

        roll.precision, roll.reencode_every = dtype_name(wm.dtype), settings.reencode_every
        roll.reencode, roll.dynamics_sampler, roll.dynamics_steps = settings.reencode, "deterministic", 1
        return "open_loop_rollout", roll

    def autoencode(ep, horizon):
        return wm.reconstruct(ep["frames"][: horizon + 1], agent_pos=ep["agent_pos"][: horizon + 1])

    autoencode.precision = dtype_name(wm.dtype)
    return "stage1_autoencoder_ceiling", autoencode
