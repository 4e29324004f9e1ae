"""WorldSimEnv: a learned world (T pushing, or any task of iws_gym/tasks) as a Gymnasium environment.

## Description
A learned simulator of a task's ground truth (`IWS-TPushing-v0`: gym-pusht's Push-T; `IWS-PileSweeping-v0`:
tasks/pilesweep's pymunk piles). `reset()` encodes a real initial frame into the latent
space of the world model; `step(action)` denoises the next latent with the latent consistency
dynamics (rolling, slightly noised context of K latents) and decodes a 128x128 RGB frame with the
consistency decoder. Reward and success are read from the predicted frame by a pluggable scorer.

## Action space
`Box(0, 512, (2,), float32)`: the absolute agent target in the 512x512 canvas, at 10 Hz (gym-pusht's
convention). Out-of-range actions are clipped to the box; wrong shapes, NaN or inf raise ValueError.

## Observation space
- `obs_type="pixels_agent_pos"` (default): `Dict(pixels=Box(0, 255, (H, W, 3), uint8),
  agent_pos=Box(0, 512, (2,), float64))`; agent_pos is read from the frame (where it shows the agent).
- `obs_type="pixels"`: the frame alone.
`observation_width/height` resize the returned frame (LeRobot's Push-T policies take 96x96).

## Rewards
`reward = clip(coverage / 0.95, 0, 1)` with coverage read from the frame by the scorer (the task's default
scorer; pile sweeping: the share of pucks in the goal, over 0.9).

## Starting state
A real frame: by default drawn (seeded) from held-out ground-truth starts (gym-pusht resets with seeds
in the held-out range, never seen in training); `options["initial_frame"]` (H x W x 3 uint8 RGB) with
optional `options["agent_pos"]`; or `options["reset_to_state"]` (the task's state vector: T pushing
[agent x, y, block x, y, angle], pile sweeping [agent x, y, puck 1 x, y, ...]), rendered by the ground truth's
own renderer so one policy can start identically in both worlds.

## Action chunks
`env.unwrapped.step_chunk(actions (k, 2))` runs k steps in one call (identical to k `step` calls).

## Trust
`info["trust"]` (this step) and `info["trust_min"]` (the episode so far): 1 = the world model's frame
survives its own decode-encode round trip, 0 = it does not (a fading or split object, a phantom agent).
Calibrated per release against gym-pusht (`iws eval trust`); an episode whose `trust_min` falls below
0.5 is untrusted.

## Episode end
`terminated = is_success` as the scorer decides it (T pushing: coverage > 0.95); truncation by TimeLimit (via
gym.make: 300 steps for T pushing, 400 for pile sweeping).

## Arguments
`obs_type`, `render_mode` ("rgb_array" | "human"), `observation_width`, `observation_height`,
`checkpoint` (None: the shipped weights), `device` ("auto": CUDA if present, else CPU), `precision`
("auto": bf16 where the device computes in bf16 natively - CUDA, AMX / AVX512-BF16 CPUs - else fp32;
"bf16" | "fp32" to force one; see hardware.py),
`scorer` (see scorer.py), `decoder_steps`, `dynamics_steps`, `task`, `reencode` (default True: each
decoded observation is encoded back into the context window; see WorldModel.step), `reencode_every`
(default None: the world model's, every step; K: every K-th step's observation goes
back, the steps between keep the predicted latent), `compile` (default
False: torch.compile the dynamics network for faster steps after a one-off compile; see
WorldModel.compile), `trust` (default True: `info["trust"]`, how far to trust this step, in [0, 1], and
`info["trust_min"]`, its minimum over the episode; see models/trust.py and docs/evaluation.md; False
reports 1.0 and skips the extra encode that re-encoding every K-th step would otherwise need).

## Version history
- v0: first release.
"""
from __future__ import annotations

import cv2
import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

from iws_gym.models.hardware import DTYPES
from iws_gym.tasks.pusht.pose import agent_position
from iws_gym.data.splits import SPLITS, START_BANK
from iws_gym.envs.registry import load_task



def check_action(action, low: float = 0.0, high: float = 512.0) -> np.ndarray:
    """Validate one action (2,) and clip it to the box. Raises ValueError naming the problem."""
    try:
        a = np.asarray(action, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"action must be a numeric array of shape (2,), got {type(action).__name__}") from None
    if a.dtype.kind not in "fiu" or a.shape != (2,):
        raise ValueError(f"action must have shape (2,) (absolute agent target x, y in [0, 512]), got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"action must be finite, got {a.tolist()}")
    return np.clip(a, low, high).astype(np.float32)


def check_frame(frame, size: int) -> np.ndarray:
    """An RGB uint8 (H, W, 3) frame resized to size x size."""
    f = np.asarray(frame)
    if f.ndim != 3 or f.shape[2] != 3 or f.dtype != np.uint8:
        raise ValueError(f"initial_frame must be an (H, W, 3) uint8 RGB array, got shape {f.shape} dtype {f.dtype}")
    if f.shape[:2] != (size, size):
        f = cv2.resize(f, (size, size), interpolation=cv2.INTER_AREA)
    return np.ascontiguousarray(f)


def setup_world(env, obs_type, observation_width, observation_height, checkpoint, device, scorer, task,
                world_model, decoder_steps, dynamics_steps, reencode=None, compile=False, precision="auto",
                reencode_every=None, trust=None):
    """What the single and the vector env share: task, world model, scorer, single-env spaces. The
    rollout options change the release's RolloutSettings (None: keep its default)."""
    from iws_gym.models.world_model import WorldModel

    if obs_type not in ("pixels_agent_pos", "pixels"):
        raise ValueError(f"obs_type must be 'pixels_agent_pos' or 'pixels', got {obs_type!r}")
    if precision not in ("auto", *DTYPES):
        raise ValueError(f"precision must be 'auto', 'bf16' or 'fp32', got {precision!r}")
    env.task = load_task(task)
    given = dict(decoder_steps=decoder_steps, dynamics_steps=dynamics_steps,
                 reencode=None if reencode is None else bool(reencode), reencode_every=reencode_every,
                 trust=None if trust is None else bool(trust))
    changes = {k: v for k, v in given.items() if v is not None}
    if world_model is not None:
        env.wm = world_model.with_settings(**changes) if changes else world_model
    else:
        env.wm = WorldModel.from_pretrained(checkpoint or env.task.checkpoint_path, device=device,
                                            stages=("stage1", "stage2"), dtype=DTYPES.get(precision))
        env.wm = env.wm.with_settings(**changes) if changes else env.wm  # the release's defaults, then the user's
    if compile:
        env.wm.compile()
    env.obs_type, env.size = obs_type, env.task.frame_size
    env.obs_hw = (observation_height, observation_width)
    env.scorer = scorer or env.task.make_scorer()
    action_space = spaces.Box(env.task.action_low, env.task.action_high, (2,), np.float32)
    pixels = spaces.Box(0, 255, (observation_height, observation_width, 3), np.uint8)
    obs_space = pixels if obs_type == "pixels" else spaces.Dict(
        {"pixels": pixels, "agent_pos": spaces.Box(0, 512, (2,), np.float64)})
    return action_space, obs_space


def read_agent(frame, fallback) -> np.ndarray:
    """agent_pos as the frame shows it (the learned world has no other source)."""
    p = agent_position(frame)
    return np.clip(p, 0, 512) if p is not None else np.asarray(fallback, np.float64)


def track_or(state: dict, i: int, fallback) -> np.ndarray:
    """Where the world model's agent track has env i's agent (a tracking model), else `fallback`: the
    agent_pos reported when the frame does not show the agent."""
    return state["agent"][i].cpu().numpy().astype(np.float64) if "agent" in state else fallback


def trust_info(state: dict) -> list[dict]:
    """Each env's trust in this step (in [0, 1], higher is better) and its minimum over the episode so far (see
    models/trust.py; 1.0 at reset, and throughout when the env was made with trust=False), read once per step."""
    return [{"trust": t, "trust_min": m} for t, m in zip(state["trust"].tolist(), state["trust_min"].tolist())]


def start_frame(options: dict, size: int, gt_env, np_random, task) -> tuple[np.ndarray, np.ndarray]:
    """The real frame an episode starts from, and its agent position (see the class docstring)."""
    if options.get("initial_frame") is not None:
        frame = check_frame(options["initial_frame"], size)
        agent = options.get("agent_pos")
        return frame, (np.asarray(agent, np.float64) if agent is not None else read_agent(frame, np.full(2, 256.0)))
    if options.get("reset_to_state") is not None:
        state = np.asarray(options["reset_to_state"], dtype=np.float64)
        gt = task.module
        if state.shape != (gt.STATE_SIZE,) or not np.all(np.isfinite(state)):
            raise ValueError(f"reset_to_state must be {gt.STATE_SIZE} finite numbers {gt.STATE_DOC}, got {state.tolist()}")
        return task.module.render_state(state, size, gt_env), state[:2].copy()
    obs, _ = gt_env.reset(seed=task.heldout_seed_base + SPLITS["test"] + int(np_random.integers(START_BANK)))
    return obs["pixels"], np.asarray(obs["agent_pos"], np.float64)


def resize_obs(frames: np.ndarray, hw) -> np.ndarray:
    """(..., H, W, 3) frames resized to hw (INTER_AREA), or returned as they are."""
    if tuple(frames.shape[-3:-1]) == tuple(hw):
        return frames.copy()
    if frames.ndim == 3:
        return cv2.resize(frames, hw[::-1], interpolation=cv2.INTER_AREA)
    return np.stack([cv2.resize(f, hw[::-1], interpolation=cv2.INTER_AREA) for f in frames])


class WorldSimEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array", "human"], "render_fps": 10}

    def __init__(self, obs_type: str = "pixels_agent_pos", render_mode: str | None = None,
                 observation_width: int = 128, observation_height: int = 128, checkpoint=None,
                 device: str = "auto", scorer=None, decoder_steps: int | None = None,
                 dynamics_steps: int | None = None, task: str = "tpushing", world_model=None,
                 reencode: bool | None = None, compile: bool = False, precision: str = "auto",
                 reencode_every: int | None = None, trust: bool | None = None):
        if render_mode not in (None, "rgb_array", "human"):
            raise ValueError(f"render_mode must be None, 'rgb_array' or 'human', got {render_mode!r}")
        self.render_mode = render_mode
        self.action_space, self.observation_space = setup_world(
            self, obs_type, observation_width, observation_height, checkpoint, device, scorer, task, world_model,
            decoder_steps, dynamics_steps, reencode, compile, precision, reencode_every, trust)
        self._state, self._frame, self._agent = None, None, None
        self._gen = torch.Generator()
        self._window = self._clock = None
        self._gt_env = None

    # ---- helpers
    def _obs(self):
        f = resize_obs(self._frame, self.obs_hw)
        return f if self.obs_type == "pixels" else {"pixels": f, "agent_pos": self._agent.astype(np.float64)}

    def _ground_truth_env(self):
        if self._gt_env is None:
            self._gt_env = self.task.module.make_env(self.size)
        return self._gt_env

    # ---- Gymnasium API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        self._gen.manual_seed(int(self.np_random.integers(2**31 - 1)))
        frame, agent = start_frame(options, self.size, self._ground_truth_env(), self.np_random, self.task)
        self._frame, self._agent = frame, agent
        self._state = self.wm.start_frames(frame[None], agent[None] if self.wm.tracks_agent else None)
        score = self.scorer(frame[None])[0]
        info = {"is_success": False, **score.info, **trust_info(self._state)[0]}
        if self.render_mode == "human":
            self.render()
        return self._obs(), info

    def step(self, action):
        if self._state is None:
            raise RuntimeError("call reset() before step()")
        a = check_action(action, self.task.action_low, self.task.action_high)
        self._frame = self.wm.step(self._state, torch.from_numpy(a)[None], generator=self._gen)[0]
        self._agent = read_agent(self._frame, track_or(self._state, 0, self._agent))
        score = self.scorer(self._frame[None])[0]
        info = {"is_success": score.is_success, **score.info, **trust_info(self._state)[0]}
        if self.render_mode == "human":
            self.render()
        return self._obs(), score.reward, score.is_success, False, info

    def step_chunk(self, actions):
        """Execute an action chunk (k, 2) in one call, for chunked policies (Diffusion Policy, ACT).

        Exactly k calls of `step` (the same result as stepping one by one), stopping early if the
        episode terminates. Returns (obs after the last executed step, rewards (n,), terminated,
        truncated, info of the last step with `chunk_steps` = n executed). It lives on the unwrapped
        env: a TimeLimit wrapper counts only `step` calls, so use `env.unwrapped.step_chunk` with your
        own step budget, or step one by one under the wrapper."""
        a = np.asarray(actions)
        if a.ndim != 2 or a.shape[1] != 2 or len(a) == 0:
            raise ValueError(f"an action chunk must have shape (k, 2) with k >= 1, got shape {a.shape}")
        for i, ai in enumerate(a):  # validate the whole chunk before anything runs
            try:
                check_action(ai, self.task.action_low, self.task.action_high)
            except ValueError as e:
                raise ValueError(f"action chunk row {i}: {e}") from None
        rewards = []
        for ai in a:
            obs, r, term, trunc, info = self.step(ai)
            rewards.append(r)
            if term or trunc:
                break
        return obs, np.array(rewards, dtype=np.float64), term, trunc, {**info, "chunk_steps": len(rewards)}

    def render(self):
        if self._frame is None:
            return None
        if self.render_mode == "rgb_array":
            return self._frame.copy()
        if self.render_mode == "human":
            import pygame

            if self._window is None:
                pygame.init()
                self._window = pygame.display.set_mode((512, 512))
                pygame.display.set_caption("iws-gym: IWS-TPushing-v0")
                self._clock = pygame.time.Clock()
            big = cv2.resize(self._frame, (512, 512), interpolation=cv2.INTER_NEAREST)
            self._window.blit(pygame.surfarray.make_surface(big.swapaxes(0, 1)), (0, 0))
            pygame.event.pump()
            pygame.display.flip()
            self._clock.tick(self.metadata["render_fps"])
        return None

    def close(self):
        if self._window is not None:
            import pygame

            pygame.display.quit()
            pygame.quit()
            self._window = None
