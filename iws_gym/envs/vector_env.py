"""WorldSimVectorEnv: N learned T-pushing worlds stepped by one batched model call per step.

    envs = gym.make_vec("IWS-TPushing-v0", num_envs=32)                      # NEXT_STEP autoreset
    envs = gym.make_vec("IWS-TPushing-v0", num_envs=32, autoreset_mode="SameStep")   # LeRobot's loop

Every step puts the N actions into the rolling context, runs one dynamics forward and one decoder
forward for all N envs, scores the N frames, and resets finished envs in place (their slice of the
context is replaced by a fresh encoded start), following Gymnasium's autoreset semantics:
NEXT_STEP (the step after an episode ends returns the reset observation, reward 0) or SAME_STEP (the
reset observation is returned at once; the last observation and info go to info["final_obs"] /
info["final_info"]).
"""
from __future__ import annotations

import numpy as np
import torch
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from iws_gym.envs.env import check_action, read_agent, resize_obs, setup_world, start_frame, track_or, trust_info


class WorldSimVectorEnv(VectorEnv):
    metadata = {"render_modes": ["rgb_array"], "render_fps": 10, "autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(self, num_envs: int = 1, obs_type: str = "pixels_agent_pos", render_mode: str | None = None,
                 observation_width: int = 128, observation_height: int = 128, checkpoint=None, device: str = "auto",
                 scorer=None, task: str = "tpushing", max_episode_steps: int | None = 300,
                 autoreset_mode=AutoresetMode.NEXT_STEP, world_model=None, decoder_steps=None, dynamics_steps=None,
                 reencode=None, compile=False, precision="auto", reencode_every=None, trust=None):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"the vector env renders 'rgb_array' only, got {render_mode!r}")
        self.single_action_space, self.single_observation_space = setup_world(
            self, obs_type, observation_width, observation_height, checkpoint, device, scorer, task, world_model,
            decoder_steps, dynamics_steps, reencode, compile, precision, reencode_every, trust)
        self.num_envs, self.render_mode = num_envs, render_mode
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.metadata = {**self.metadata, "autoreset_mode": self.autoreset_mode}
        self.max_episode_steps = max_episode_steps
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self._gt = self.task.module.make_env(self.size)
        self._gen = torch.Generator()
        self._state = None
        self._frames = np.zeros((num_envs, self.size, self.size, 3), np.uint8)
        self._agents = np.zeros((num_envs, 2))
        self._elapsed = np.zeros(num_envs, dtype=np.int64)
        self._needs_reset = np.zeros(num_envs, dtype=bool)

    # ---- helpers
    def _reset_envs(self, idx, options_list):
        """Reset envs `idx` in place: new start frames, encoded in one batch, spliced into the context."""
        starts = [start_frame(o or {}, self.size, self._gt, self.np_random, self.task) for o in options_list]
        frames = np.stack([f for f, _ in starts])
        fresh = self.wm.start_frames(frames, np.stack([a for _, a in starts]) if self.wm.tracks_agent else None)
        if self._state is None:
            self._state = fresh
        else:
            t = torch.as_tensor(idx, device=self.wm.device)
            with torch.inference_mode():
                for k in self._state:
                    self._state[k][t] = fresh[k]
        for j, (f, a) in zip(idx, starts):
            self._frames[j], self._agents[j] = f, a if a is not None else np.full(2, 256.0)
        self._elapsed[idx] = 0
        self._needs_reset[idx] = False

    def _obs(self):
        f = resize_obs(self._frames, self.obs_hw)
        return f if self.obs_type == "pixels" else {"pixels": f, "agent_pos": self._agents.copy()}

    def _single_obs(self, obs, i):
        return obs[i] if self.obs_type == "pixels" else {k: v[i] for k, v in obs.items()}

    # ---- VectorEnv API
    def reset(self, *, seed=None, options: dict | None = None):
        super().reset(seed=seed if isinstance(seed, (int, type(None))) else int(seed[0]))
        self._gen.manual_seed(int(self.np_random.integers(2**31 - 1)))
        options = options or {}
        mask = options.get("reset_mask")
        idx = np.arange(self.num_envs) if mask is None or self._state is None else np.flatnonzero(mask)
        # per-env starts: options["reset_to_states"] (N, 5) or options["initial_frames"] (N, H, W, 3);
        # any other option applies to every env being reset
        shared = {k: v for k, v in options.items() if k not in ("reset_mask", "reset_to_states", "initial_frames")}
        per_env = [dict(shared) for _ in idx]
        for plural, single in (("reset_to_states", "reset_to_state"), ("initial_frames", "initial_frame")):
            if options.get(plural) is not None:
                vals = options[plural]
                if len(vals) != self.num_envs:
                    raise ValueError(f"options[{plural!r}] needs one entry per env ({self.num_envs}), got {len(vals)}")
                for d, i in zip(per_env, idx):
                    d[single] = vals[i]
        self._reset_envs(idx, per_env)
        scores = self.scorer(self._frames)
        infos, trust = {}, trust_info(self._state)
        for i in range(self.num_envs):
            infos = self._add_info(infos, {"is_success": False, **scores[i].info, **trust[i]}, i)
        return self._obs(), infos

    def step(self, actions):
        if self._state is None:
            raise RuntimeError("call reset() before step()")
        a = np.asarray(actions)
        if a.shape != (self.num_envs, 2):
            raise ValueError(f"actions must have shape ({self.num_envs}, 2) (one absolute agent target per env), got {a.shape}")
        a = np.stack([check_action(x, self.task.action_low, self.task.action_high) for x in a])
        # NEXT_STEP: envs that finished on the previous step are reset now and their action is ignored
        resetting = np.flatnonzero(self._needs_reset) if self.autoreset_mode == AutoresetMode.NEXT_STEP else np.array([], int)
        stepping = np.setdiff1d(np.arange(self.num_envs), resetting)
        frames = self.wm.step(self._state, torch.from_numpy(a), generator=self._gen)  # one batched forward for all
        self._frames[stepping] = frames[stepping]  # the resetting envs' slices are overwritten below
        for i in stepping:
            self._agents[i] = read_agent(self._frames[i], track_or(self._state, i, self._agents[i]))
        self._elapsed[stepping] += 1
        if len(resetting):
            self._reset_envs(resetting, [{}] * len(resetting))
        scores = self.scorer(self._frames)
        rewards = np.array([s.reward for s in scores], dtype=np.float64)
        terminated = np.array([s.is_success for s in scores], dtype=bool)
        truncated = (self._elapsed >= self.max_episode_steps) if self.max_episode_steps else np.zeros(self.num_envs, bool)
        rewards[resetting], terminated[resetting], truncated[resetting] = 0.0, False, False
        truncated &= ~terminated
        infos, trust = {}, trust_info(self._state)
        for i in range(self.num_envs):
            infos = self._add_info(infos, {"is_success": bool(terminated[i]), **scores[i].info, **trust[i]}, i)
        done = np.flatnonzero(terminated | truncated)
        obs = self._obs()
        if self.autoreset_mode == AutoresetMode.NEXT_STEP:
            self._needs_reset[done] = True
        elif self.autoreset_mode == AutoresetMode.SAME_STEP and len(done):
            for i in done:
                infos = self._add_info(infos, {"final_obs": self._single_obs(obs, i),
                                               "final_info": {"is_success": bool(terminated[i]), **scores[i].info}}, i)
            self._reset_envs(done, [{}] * len(done))
            obs = self._obs()
        return obs, rewards, terminated, truncated, infos

    def render(self):
        return self._frames.copy() if self.render_mode == "rgb_array" else None

    def call(self, name, *args, **kwargs):
        attr = getattr(self, name)
        out = attr(*args, **kwargs) if callable(attr) else attr
        return tuple(out for _ in range(self.num_envs))

    def get_attr(self, name):
        return self.call(name)

    def set_attr(self, name, values):
        values = values if isinstance(values, (list, tuple)) else [values] * self.num_envs
        if len(set(map(id, values))) > 1 and len(values) == self.num_envs and len({repr(v) for v in values}) > 1:
            raise ValueError(f"the batched env shares one {name!r} across its {self.num_envs} envs; got different values")
        setattr(self, name, values[0])
