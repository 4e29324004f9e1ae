"""The visuomotor policy (policies/visuomotor.py), trained by behaviour cloning on demonstrations, in
the same loop as the world model's stages (resume, EMA, TensorBoard, DDP). Every evaluation also
writes the EMA weights as a release, so checkpoints along training are policies of graded skill.

    iws collect --task tpushing --mix expert --episodes 500 --steps 300 --seed 200000 --out data/expert
    iws train-policy --data data/expert --out runs/visuomotor
    # a mix of datasets: the first N episodes of one (DIR:N), episodes I..J-1 of another (DIR:I-J)
    iws train-policy --data data/expert:50,data/generated:50-100 --out runs/mix
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from iws_gym.data.episodes import list_episodes, load_meta, read_episode
from iws_gym.envs.registry import load_task
from iws_gym.models.checkpoint import git_commit, save_release
from iws_gym.policies.visuomotor import VisuomotorConfig, VisuomotorNet, frames_to_input, prep_frames
from iws_gym.training.common import StageBase, arg


@dataclass
class Options:
    val_data: str | None = arg(None, "demonstrations never trained on, to measure the action error on (e.g. "
                                     "`iws collect --mix expert --episodes 10 --seed 300000 --out data/expert_val`)")
    preset: str = arg("default", "model: default | small (a narrower flow head) | tiny (tests)")
    sample_steps: int = arg(10, "Euler steps of the flow sampler stored in the config")
    pose_aux: float | None = arg(None, "weight of the auxiliary block-pose loss (training only; default: the config's, "
                                       "0, or the --init release's)")
    init: str | None = arg(None, "start from this policy release (its config and weights; --preset is ignored), e.g. "
                                 "to continue on demonstrations that add the expert's corrections")


PRESETS = {"default": {}, "small": dict(hidden=256),  # small: a head of 0.9 M parameters instead of 3.3 M
           "tiny": dict(ch=16, keypoints=8, hidden=64, head_blocks=1, sample_steps=2)}


def parse_data(spec: str) -> list[tuple[Path, slice]]:
    """"DIR[:N | :I-J][,...]" -> [(dir, which of its episodes)]: all, the first N, or episodes I..J-1."""
    out = []
    for part in spec.split(","):
        path, _, n = part.partition(":")
        if not path:
            raise ValueError(f"--data: empty directory in {spec!r}")
        lo, dash, hi = n.partition("-")
        if not n:
            out.append((Path(path), slice(None)))
        elif not dash and n.isdigit() and int(n) > 0:
            out.append((Path(path), slice(0, int(n))))
        elif dash and lo.isdigit() and hi.isdigit() and int(hi) > int(lo):
            out.append((Path(path), slice(int(lo), int(hi))))
        else:
            raise ValueError(f"--data: after DIR: a positive integer N or a range I-J (I < J), got {n!r} in {spec!r}")
    return out


class Stage(StageBase):
    name = "policy"

    def __init__(self, a, o, device):
        self.a, self.o, self.device = a, o, device
        self._step = 0  # the loop's step, kept by after_step (snapshots are named by it)
        sources = parse_data(a.data)
        self.meta = load_meta(sources[0][0])
        self.task = load_task(self.meta["task"])
        if o.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {o.preset!r}")
        self.config = cfg = VisuomotorConfig(**{"sample_steps": o.sample_steps, **PRESETS[o.preset]})
        init_sd = None
        if o.init:
            from iws_gym.models.checkpoint import load_release

            cfg, init_sd, _ = load_release(Path(o.init), "visuomotor", VisuomotorConfig)
        if o.pose_aux is not None:
            if o.pose_aux < 0:
                raise ValueError(f"--pose-aux must be >= 0, got {o.pose_aux}")
            cfg = dataclasses.replace(cfg, pose_aux=o.pose_aux)
        self.config = cfg
        self.model = VisuomotorNet(cfg)
        if init_sd is not None:  # a pose head added on top of a release starts fresh
            missing, unexpected = self.model.load_state_dict(init_sd, strict=False)
            if unexpected or any(not k.startswith("pose_head.") for k in missing):
                raise ValueError(f"--init {o.init}: weights do not fit (missing {missing}, unexpected {unexpected})")
        self.sources = []
        train, val = [], []
        for root, n in sources:
            meta = load_meta(root)
            if meta["task"] != self.task.name:
                raise ValueError(f"--data mixes tasks: {sources[0][0]} is {self.task.name!r}, {root} is {meta['task']!r}")
            paths = list_episodes(root)
            if n.stop is not None and n.stop > len(paths):
                raise ValueError(f"--data asks for episodes up to {n.stop} of {root}, which has {len(paths)}")
            paths = paths[n]
            if a.max_episodes:
                paths = paths[: a.max_episodes]
            train += paths
            self.sources.append(dict(data=str(root), episodes=len(paths), first=n.start or 0, seed=meta.get("seed"),
                                     generated=bool(meta.get("generated", False)), mix=meta.get("mix")))
        if o.val_data:
            if Path(o.val_data).resolve() in {Path(r).resolve() for r, _ in sources}:
                raise ValueError(f"--val-data {o.val_data} is also training data")
            val = list_episodes(Path(o.val_data))
        self.train = self._load(train)
        self.val = self._load(val) if val else None
        # the steps to imitate: all but those a learner took (`iws collect --mix intervention`)
        self.index = np.concatenate([np.stack([np.full(ep["imitate"].sum(), e), np.flatnonzero(ep["imitate"])], 1)
                                     for e, ep in enumerate(self.train)])

    def _load(self, paths):
        from tqdm import tqdm

        eps = []
        for p in tqdm(paths, desc="loading demonstrations", unit="ep"):
            ep = read_episode(p, keys=("frames", "actions", "agent_pos", "segments", "block_pose"))
            names = list(ep["attrs"].get("segment_names", []))
            learner = names.index("learner") if "learner" in names else None
            eps.append(dict(frames=prep_frames(ep["frames"], self.config.size), actions=ep["actions"],
                            agent_pos=ep["agent_pos"], block_pose=ep["block_pose"], imitate=ep["segments"] != learner if learner is not None
                            else np.ones(len(ep["actions"]), bool)))
        return eps

    def _windows(self, eps, pairs, rng=None):
        """Observation histories, agent positions and action chunks (padded with the last action)."""
        cfg = self.config
        F, P, A, B = [], [], [], []
        for e, t in pairs:
            ep = eps[e]
            F.append(ep["frames"][np.clip(np.arange(t - cfg.n_frames + 1, t + 1), 0, None)])
            P.append(ep["agent_pos"][np.clip(np.arange(t - cfg.n_obs + 1, t + 1), 0, None)])
            idx = np.clip(np.arange(t, t + cfg.chunk), None, len(ep["actions"]) - 1)
            A.append(ep["actions"][idx])
            B.append(ep["block_pose"][t])
        F = np.stack(F)
        offsets = None if rng is None else rng.integers(0, cfg.size - cfg.crop + 1, (len(F), 2))
        return dict(frames=frames_to_input(F, cfg.crop, offsets).to(self.device),
                    agent=torch.from_numpy(np.stack(P)).float().to(self.device),
                    actions=torch.from_numpy(np.stack(A)).float().to(self.device),
                    block_pose=torch.from_numpy(np.stack(B)).float().to(self.device))

    def sample_batch(self, rng, batch):
        return self._windows(self.train, self.index[rng.integers(0, len(self.index), batch)], rng)

    def evaluate(self, ema) -> dict:
        out = {}
        if self.val is not None:
            pairs = [(e, t) for e in range(len(self.val)) for t in range(0, len(self.val[e]["actions"]), 4)]
            b = self._windows(self.val, pairs)
            gen = torch.Generator().manual_seed(0)
            chunk = ema.sample(b["frames"], b["agent"], gen)[:, : self.config.execute]
            err = (chunk.float() - b["actions"][:, : self.config.execute]).norm(dim=-1)
            out["val_action_err_px_median"] = err.median().item()
            out["val_action_err_px_mean"] = err.mean().item()
            with torch.random.fork_rng():  # the same draws at every evaluation, training's RNG untouched
                torch.manual_seed(0)
                logs = ema.loss(b)[1]
            out["val_flow_mse"] = logs["flow_mse"]
            if "pose_mse" in logs:
                out["val_pose_mse"] = logs["pose_mse"]
        self._snapshot(ema, out)
        return out

    def _snapshot(self, ema, metrics):
        """The EMA weights at this step, as a release (checkpoints along training)."""
        step = self._step
        if step:
            save_release(Path(self.a.out) / f"visuomotor_step{step}.safetensors", ema.state_dict(), "visuomotor",
                         self.config, self._provenance(step, metrics))

    def after_step(self, model, step):
        self._step = step + 1  # the loop evaluates before step `step + 1`'s update

    def _provenance(self, step, metrics):
        return dict(data=self.sources, val_data=self.o.val_data, init=self.o.init, commit=git_commit(), step=step, eval=metrics, task=self.task.name,
                    command=f"iws train-policy --data {self.a.data} --out {self.a.out} --steps {self.a.steps}")

    def export(self, ema, out, result):
        extra = self._provenance(result["step"], result["eval"])
        extra.update(wall_s=result["wall_s"], command=result["command"].replace("iws train policy", "iws train-policy"))
        save_release(Path(out) / "visuomotor.safetensors", ema.state_dict(), "visuomotor", self.config, extra)
