"""Stage 2: the latent consistency dynamics, trained on windows of latents of a frozen stage-1 release.

    iws train stage2 --data data/tpushing --init checkpoints/candidates/spatial --out runs/stage2 --agent-track \
        --focus 0.5 --jump-focus 0.3 --drop-agent 0.2 --corrupt-block 0.2
    # continue a release (its config, normalisation and weights):
    iws train stage2 ... --finetune checkpoints/candidates/spatial
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from iws_gym import metrics
from iws_gym.data.collect import heldout_episodes
from iws_gym.data.episodes import InMemoryEpisodes, read_episode
from iws_gym.data.latents import (LatentEpisodes, agent_erased_latents, agent_jumps, block_corrupted_latents, render_workers,
                                  latent_cache, moving_transitions)
from iws_gym.models.checkpoint import find_release, git_commit, load_release, load_stage, load_state_checked, save_release
from iws_gym.models.decoder import Stage1, Stage1Config, decode
from iws_gym.models.dynamics import DynamicsConfig, Stage2, fit_agent_motion
from iws_gym.training.common import StageBase, arg


@dataclass
class Options:
    init: str | None = arg(None, "the stage-1 release (file or directory) the dynamics build on (default: the "
                                 "task's shipped weights; T pushing's are of the compact design now, so name a "
                                 "spatial stage 1, e.g. checkpoints/candidates/spatial)")
    finetune: str | None = arg(None, "continue this stage-2 release: its config, normalisation and weights")
    preset: str = arg("default", "model size: default (1.8 M parameters in the trunk) | large (a GPU's: 2x wider, "
                                 "2x deeper) | tiny (tests)")
    agent_track: bool = arg(False, "condition on the agent track: its recorded position in each context frame and "
                                   "where its motion law, fitted to the episodes, puts it next (dynamics.agent_landing)")
    focus: float = arg(0.0, "share of windows whose target transition moves the block (contact)")
    jump_focus: float = arg(0.0, "share of windows whose target transition moves the agent more than 30 canvas px "
                                 "(needs --agent-track)")
    drop_agent: float = arg(0.0, "share of windows whose last context frames lose the agent (the target keeps it), "
                                 "so a rollout that faded it draws it again")
    corrupt_block: float = arg(0.0, "share of windows whose last context frames show a faded or ghosted block "
                                    "(the target: the real frame), so a fading block is redrawn rigid")
    objective: str | None = arg(None, "consistency | denoise (EDM denoising, sampled by Euler steps of the ODE); "
                                      "default: the release's with --finetune, else consistency")
    sample_steps: int | None = arg(None, "default sampler steps per prediction stored in the config "
                                         "(default: 1 for consistency, 4 for denoise)")
    ctx_noise: str | None = arg(None, "context-noise augmentation: uniform (one level in [0, 0.1] for the window) | "
                                      "per_frame (Diffusion Forcing: each frame but the last at its own level, up to "
                                      "sigma_max); default: the release's with --finetune, else uniform")
    p_mean: float | None = arg(None, "denoise: mean log noise level of training (default: the config's, EDM's -1.2; "
                                     "DIAMOND: -0.4)")
    transport: bool = arg(False, "carry content: the change is added to the last latent moved by a predicted flow "
                                 "(dynamics.FlowHead), so a pushed object is moved, not drawn anew")
    flow: str = arg("dense", "--transport: the flow's form, dense (a displacement per cell) | rigid (soft masks "
                             "of 4 pieces, each moved rigidly, and a still background)")
    flow_gate: float = arg(0.0, "--transport --flow dense: gate the flow per cell, with this weight on the gate's mean "
                                "(a sparsity prior: the flow is near zero wherever nothing moves); 0: no gate")
    sigma_max: float | None = arg(None, "the highest noise level: where sampling starts and the consistency jump "
                                        "comes from (default: the config's, 80; DIAMOND's Euler sampler: 5)")


PRESETS = {  # DynamicsConfig changes per --preset
    "default": {},
    "large": dict(ch=256, blocks=6, heads=8, emb_dim=256, hires_ch=128),
    "tiny": dict(ch=16, blocks=1, heads=2, emb_dim=16, context=2, hires_ch=8),
}


def check_share(name: str, v: float) -> None:
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {v}")


def reencode_latents(stage1, z: torch.Tensor, generator=None, decoder_steps: int = 1) -> torch.Tensor:
    """What the env puts into its context in place of a prediction z (B, C, h, w) (WorldModel.step): the
    stage-1 decoding of z, quantised to the uint8 frame the user sees, encoded again."""
    x = decode(stage1.decoder, z, decoder_steps, generator=generator)  # (B, 3, H, W) in [-1, 1]
    x = ((x.float().clamp(-1, 1) + 1) * 127.5).round() / 127.5 - 1  # as tensor_to_frames -> frames_to_tensor
    return stage1.encoder(x.contiguous(memory_format=torch.channels_last))


def open_loop(model, ctx, act, nv, agent, depth: int, steps: int | None = None, generator=None, reencode=None):
    """Roll `model` open loop for `depth` steps from real windows (LatentEpisodes.sample_rollout): returns
    the predictions (B, depth, C, h, w). The agent rows are the recorded positions (the robot's own
    proprioception). reencode: z -> z, applied to each prediction before it joins the window."""
    K = ctx.shape[1]
    preds = []
    for d in range(depth):
        z = model.predict(ctx, act[:, d : d + K], nv, None if agent is None else agent[:, d : d + K], steps=steps,
                          generator=generator).float()
        preds.append(z)
        z_ctx = z if reencode is None else reencode(z).float()
        ctx = torch.cat([ctx[:, 1:], z_ctx[:, None]], dim=1)
        nv = (nv + 1).clamp(max=K)
    return torch.stack(preds, 1)


class Stage(StageBase):
    name = "stage2"
    channels_last = False  # 5D activations (B, C, T, h, w)
    EVAL_DEPTH = 16

    def __init__(self, a, o, device):
        super().__init__(a, o, device)
        for name in ("focus", "jump_focus", "drop_agent", "corrupt_block"):
            check_share(name, getattr(o, name))
        if o.drop_agent + o.corrupt_block > 1:
            raise ValueError(f"--drop-agent + --corrupt-block must be <= 1, got {o.drop_agent} + {o.corrupt_block}")
        if o.focus + o.jump_focus > 1:
            raise ValueError(f"--focus + --jump-focus must be <= 1, got {o.focus} + {o.jump_focus}")
        if o.jump_focus > 0 and not o.agent_track:
            raise ValueError("--jump-focus reads the recorded agent positions: pass --agent-track")
        if o.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {o.preset!r}")
        self.stage1, _, self.stage1_file = load_stage(o.init or self.task.checkpoint_path, "stage1", Stage1Config,
                                                      Stage1, device)
        cfg1 = self.stage1.cfg
        self.data, poses = self._load_dataset(a.data, a.max_episodes, device)
        if o.focus > 0:
            self.data.hard = moving_transitions(poses)
        if o.jump_focus > 0:
            self.data.jumps = agent_jumps(self.data.agent)
        # the trunk works on 8x8 tokens whatever the latent's size; HiResHead refines at the latent's own
        cfg = DynamicsConfig(latent_ch=cfg1.encoder.latent_ch, latent_size=cfg1.encoder.latent_size,
                             patch=max(1, cfg1.encoder.latent_size // 8),
                             z_mean=self.data.z_mean, z_std=self.data.z_std, dz_std=self.data.dz_std)
        cfg = dataclasses.replace(cfg, **PRESETS[o.preset])
        init_sd, offset = None, 0
        if o.finetune:  # continue from a stage-2 release: its config (and normalisation) and weights
            f2 = find_release(o.finetune, "stage2")
            cfg, init_sd, init_meta = load_release(f2, "stage2", DynamicsConfig)
            offset = int(init_meta.get("step", 0))
            if bool(cfg.agent_motion) != o.agent_track:
                raise ValueError(f"--finetune {o.finetune} {'tracks' if cfg.agent_motion else 'does not track'} the agent: "
                                 f"{'pass' if cfg.agent_motion else 'drop'} --agent-track")
        self.agent_fit = None
        if o.agent_track and not cfg.agent_motion:  # fit the agent's motion law to the training episodes
            coef, self.agent_fit = fit_agent_motion(self.data.agent, self.data.actions)
            print(f"agent motion law {coef}: residual median {self.agent_fit['residual_px_median']:.2g} px, "
                  f"max {self.agent_fit['residual_px_max']:.2g} px over {self.agent_fit['transitions']} transitions")
            cfg = dataclasses.replace(cfg, agent_motion=coef)
        if o.objective is not None or o.sample_steps is not None:
            objective = o.objective or cfg.objective
            if objective not in ("consistency", "denoise"):
                raise ValueError(f"--objective must be 'consistency' or 'denoise', got {objective!r}")
            steps = o.sample_steps or (4 if objective == "denoise" else 1)
            if steps < 1:
                raise ValueError(f"--sample-steps must be >= 1, got {steps}")
            cfg = dataclasses.replace(cfg, objective=objective, sample_steps=steps)
        if o.ctx_noise is not None:
            if o.ctx_noise not in ("uniform", "per_frame"):
                raise ValueError(f"--ctx-noise must be 'uniform' or 'per_frame', got {o.ctx_noise!r}")
            cfg = dataclasses.replace(cfg, ctx_noise=o.ctx_noise)
        if o.p_mean is not None:
            cfg = dataclasses.replace(cfg, p_mean=o.p_mean)
        if o.sigma_max is not None:
            if not o.sigma_max > cfg.sigma_min:
                raise ValueError(f"--sigma-max must be above sigma_min {cfg.sigma_min}, got {o.sigma_max}")
            cfg = dataclasses.replace(cfg, sigma_max=o.sigma_max)
        if o.transport and not cfg.transport:
            if o.finetune:
                raise ValueError(f"--transport adds a flow head: train it from scratch, not as a fine-tune of {o.finetune}")
            if o.flow not in ("dense", "rigid"):
                raise ValueError(f"--flow must be 'dense' or 'rigid', got {o.flow!r}")
            if o.flow_gate < 0 or (o.flow_gate > 0 and o.flow != "dense"):
                raise ValueError(f"--flow-gate must be >= 0 and needs --flow dense, got {o.flow_gate} with --flow {o.flow}")
            cfg = dataclasses.replace(cfg, transport=True, flow=o.flow, flow_gate_weight=o.flow_gate)
        self.config = cfg
        # a fine-tune carries the discretisation curriculum on from where its release ended
        self.model = Stage2(cfg, total_steps=offset or a.steps, curriculum_offset=offset)
        if init_sd is not None:
            load_state_checked(self.model, init_sd, f2)
        self._eval_windows(device)

    def _load_dataset(self, data, max_episodes, device):
        """The dataset's latents (and, as the options need them, its agent-erased and block-corrupted
        latents), each cached in the dataset directory, and its recorded block poses."""
        a, o, cfg1 = self.a, self.o, self.stage1.cfg
        eps = InMemoryEpisodes.load(data, max_episodes)
        lat = LatentEpisodes(eps, self.stage1.encoder, device, amp=a.amp,
                             cache=latent_cache(data, self.stage1_file, len(eps.frames)))
        poses = []
        rigid = o.focus > 0 or o.drop_agent > 0 or o.corrupt_block > 0  # options that read (and re-render) the T's pose
        if rigid or o.agent_track:  # recorded states
            states = [read_episode(p, keys=("block_pose", "agent_pos") if rigid else ("agent_pos",)) for p in eps.paths]
            poses = [s["block_pose"] for s in states] if rigid else []
            if o.agent_track:  # the agent's position is proprioception (gym-pusht's agent_pos), not hidden state
                lat.agent = [s["agent_pos"] for s in states]
            if o.drop_agent > 0:
                cache = latent_cache(data, self.stage1_file, len(eps.frames), "noagent")
                lat.erased = agent_erased_latents(poses, self.stage1.encoder, device, a.amp, cache, cfg1.encoder.frame_size,
                                                  workers=render_workers())
            if o.corrupt_block > 0:
                cache = latent_cache(data, self.stage1_file, len(eps.frames), "corruptblock")
                lat.corrupted = block_corrupted_latents(eps.frames, [s["agent_pos"] for s in states], poses,
                                                        self.stage1.encoder, device, a.amp, cache, cfg1.encoder.frame_size,
                                                        workers=render_workers())
        return lat, poses

    def _eval_windows(self, device):
        """Fixed evaluation windows from validation episodes (encoded with the same frozen encoder)."""
        cfg, cfg1 = self.config, self.stage1.cfg
        held_eps = list(heldout_episodes(self.task, 4, 48, "validation"))
        held = InMemoryEpisodes([e["frames"] for e in held_eps], [e["actions"] for e in held_eps], [])
        self.held = LatentEpisodes(held, self.stage1.encoder, device, amp=self.a.amp)
        if cfg.agent_motion:
            self.held.agent = [e["agent_pos"] for e in held_eps]
        self.eval_batch = self.held.sample(np.random.default_rng(0), 64, cfg.context)
        # open-loop evaluation: rollouts from a single real frame, as the env runs them
        self.eval_rollout = self.held.sample_rollout(np.random.default_rng(1), 32, cfg.context, self.EVAL_DEPTH - 1)
        self._eval_hold(held_eps)
        self.eval_moving = self.eval_no_agent = self.eval_corrupt = None
        if "block_pose" not in held_eps[0]:  # a task without a rigid block (piles): no windows chosen by its pose
            self.held.hard = np.zeros((0, 2), np.int64)
            return
        # ... windows whose target transition moves the block (contact: where the error concentrates)
        self.held.hard = moving_transitions([e["block_pose"] for e in held_eps])
        ctx, act, tgt, nv, ag = self.held.sample_rollout(np.random.default_rng(2), 64, cfg.context, 0, focus=1.0)
        self.eval_moving = (ctx, act, tgt[:, 0], nv, ag) if len(self.held.hard) else None
        # ... windows whose whole context lost the agent (what --drop-agent trains): can it put it back?
        self.held.erased = agent_erased_latents([e["block_pose"] for e in held_eps], self.stage1.encoder, device,
                                                self.a.amp, frame_size=cfg1.encoder.frame_size)
        self.eval_no_agent = self.held.sample(np.random.default_rng(3), 64, cfg.context, drop_all=True)
        # ... windows whose whole context shows a faded or ghosted block (what --corrupt-block trains)
        self.held.corrupted = block_corrupted_latents(*[[e[k] for e in held_eps] for k in ("frames", "agent_pos", "block_pose")],
                                                      self.stage1.encoder, device, self.a.amp,
                                                      frame_size=cfg1.encoder.frame_size, seed=1)
        self.eval_corrupt = self.held.sample(np.random.default_rng(4), 64, cfg.context, corrupt_all=True)

    def _eval_hold(self, held_eps):
        cfg = self.config
        # a still world: each held-out episode's first frame (gym-pusht resets at rest), the agent told to hold
        # its position; nothing may move (with an agent track only: holding needs the agent's position)
        self.eval_hold = None
        if cfg.agent_motion:
            z0 = torch.stack([z[0] for z in self.held.latents]).float()                       # (N, C, h, w)
            p0 = torch.as_tensor(np.stack([e["agent_pos"][0] for e in held_eps]), dtype=torch.float32)
            K, D = cfg.context, self.EVAL_DEPTH
            hold = p0[:, None].expand(len(p0), K + D - 1, 2).contiguous()
            self.eval_hold = (z0[:, None].expand(len(z0), K, *z0.shape[1:]).contiguous(), hold,
                              torch.ones(len(z0), dtype=torch.long), hold.clone())

    def _to(self, windows):
        return tuple(None if t is None else t.to(self.device) for t in windows)

    def sample_batch(self, rng, batch):
        o = self.o
        ctx, act, tgt, nv, agent = self._to(self.data.sample_rollout(
            rng, batch, self.config.context, 0, focus=o.focus, drop_agent=o.drop_agent,
            corrupt_block=o.corrupt_block, jump_focus=o.jump_focus))
        return ctx, act, tgt[:, 0], nv, agent

    def evaluate(self, ema) -> dict:
        ctx, act, tgt, nv, ag = self._to(self.eval_batch)
        out = {}
        pred = ema.predict(ctx, act, nv, ag, generator=torch.Generator().manual_seed(0))  # the model's own sampler
        out["latent_mse"] = (pred - tgt).pow(2).mean().item()
        out["latent_mse_copy_last"] = (ctx[:, -1] - tgt).pow(2).mean().item()
        if self.eval_moving is not None:
            ctx, act, tgt, nv, ag = self._to(self.eval_moving)
            pred = ema.predict(ctx, act, nv, ag, generator=torch.Generator().manual_seed(0))
            pred2 = ema.predict(ctx, act, nv, ag, generator=torch.Generator().manual_seed(1))
            st = metrics.latent_change_stats(ctx[:, -1], pred, pred2, tgt)
            out["latent_mse_block_moving"] = st["model_mse"]
            out["latent_mse_copy_last_block_moving"] = st["copy_last_mse"]
            # < 1: one step under-predicts the change (averaging); ~0 variance: one step does not sample
            out["change_ratio_block_moving"] = st["predicted_change_ratio"]
            out["sample_variance_block_moving"] = st["sample_variance"]
        # contexts a rollout produces: the agent faded out / the block faded or ghosted
        for name, windows in (("no_agent", self.eval_no_agent), ("corrupt_block", self.eval_corrupt)):
            if windows is None:  # a task without a rigid block
                continue
            ctx, act, tgt, nv, ag = self._to(windows)
            pred = ema.predict(ctx, act, nv, ag, generator=torch.Generator().manual_seed(0))
            out[f"latent_mse_1step_{name}"] = (pred - tgt).pow(2).mean().item()
            out[f"latent_mse_copy_last_{name}"] = (ctx[:, -1] - tgt).pow(2).mean().item()
        ctx, act, tgt, nv, ag = self._to(self.eval_rollout)
        D = self.EVAL_DEPTH
        preds = open_loop(ema, ctx, act, nv, ag, D, generator=torch.Generator().manual_seed(0))
        out[f"open_loop_mse_step{D}"] = (preds[:, -1] - tgt[:, -1]).pow(2).mean().item()
        out[f"open_loop_mse_mean{D}"] = (preds - tgt).pow(2).mean().item()
        out[f"open_loop_mse_step{D}_copy_first"] = (ctx[:, -1] - tgt[:, -1]).pow(2).mean().item()
        # ... and as the env runs them: every prediction decoded and encoded again before it joins the window
        gen = torch.Generator().manual_seed(0)
        preds = open_loop(ema, ctx, act, nv, ag, D, generator=torch.Generator().manual_seed(0),
                          reencode=lambda z: reencode_latents(self.stage1, z, gen))
        out[f"open_loop_reencoded_mse_step{D}"] = (preds[:, -1] - tgt[:, -1]).pow(2).mean().item()
        out[f"open_loop_reencoded_mse_mean{D}"] = (preds - tgt).pow(2).mean().item()
        if self.eval_hold is not None:  # how far a still world drifts from its first latent in D steps
            ctx, act, nv, ag = self._to(self.eval_hold)
            preds = open_loop(ema, ctx, act, nv, ag, D, generator=torch.Generator().manual_seed(0))
            out[f"hold_drift_mse_step{D}"] = (preds[:, -1] - ctx[:, -1]).pow(2).mean().item()
        return out

    def export(self, ema, out, result):
        o = self.o
        extra = dict(data=str(self.a.data), data_seed=self.meta["seed"], data_episodes=len(self.data.latents),
                     stage1=self.stage1_file, commit=git_commit(), step=result["step"], eval=result["eval"],
                     task=self.task.name, focus=o.focus, jump_focus=o.jump_focus, drop_agent=o.drop_agent,
                     corrupt_block=o.corrupt_block, agent_motion=list(self.config.agent_motion) or None,
                     agent_motion_fit=self.agent_fit)
        if o.finetune:  # steps counts this run only; the curriculum offset is the steps before it
            extra.update(finetuned_from=str(o.finetune), step=result["step"] + self.model.curriculum_offset,
                         finetune_steps=result["step"])
        save_release(out / "stage2.safetensors", ema.state_dict(), "stage2", self.config, extra)
