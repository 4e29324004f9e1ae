"""The visuomotor policy (policies/visuomotor.py), trained by behaviour cloning on demonstrations, in
the same loop as the world model's stages (resume, EMA, TensorBoard, DDP). Every evaluation also
writes the EMA weights as a release, so checkpoints along training are policies of graded skill.

    iws collect --task tpushing --mix expert --episodes 500 --steps 300 --seed 200000 --out data/expert
    iws train-policy --data data/expert --out runs/visuomotor
    # a mix of datasets: the first N episodes of one (DIR:N), episodes I..J-1 of another (DIR:I-J)
    iws train-policy --data data/expert:50,data/generated:50-100 --out runs/mix
    # the pose-bottleneck policy, with the planning expert's corrections (`iws dagger`) in half of each batch
    iws train-policy --data data/expert --preset pose --batch 1024 --labels runs/dagger/r1.npz --out runs/vm_pose
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
from iws_gym.policies.visuomotor import VisuomotorConfig, build_net, frames_to_input, prep_frames
from iws_gym.training.common import StageBase, arg


@dataclass
class Options:
    val_data: str | None = arg(None, "demonstrations never trained on, to measure the action error on (e.g. "
                                     "`iws collect --mix expert --episodes 10 --seed 300000 --out data/expert_val`)")
    preset: str = arg("default", "model: default | small (a narrower flow head) | tiny (tests) | pose (the pose "
                                 "bottleneck: a CNN reads the block pose, the head acts on it) | pose-tiny (tests)")
    sample_steps: int = arg(10, "Euler steps of the flow sampler stored in the config")
    pose_aux: float | None = arg(None, "weight of the auxiliary block-pose loss (training only; default: the config's, "
                                       "0, or the --init release's)")
    pose_noise: float | None = arg(None, "(pose presets) std of the noise on the recorded pose the head trains on, px "
                                         "(and px / 100 rad); default: the config's, 2, or the --init release's")
    init: str | None = arg(None, "start from this policy release (its config and weights; --preset is ignored), e.g. "
                                 "to continue on demonstrations that add the expert's corrections")
    labels: str | None = arg(None, "(pose presets) the expert's corrections on states a learner reached: label files of "
                                   "`iws dagger`, comma-separated")
    label_share: float = arg(0.5, "share of each batch drawn from --labels")
    reader_frames: int = arg(0, "(pose presets) this many frames of random states (the block anywhere inside the walls "
                                "at any angle, a third of them against a wall; the agent anywhere off it), rendered "
                                "by gym-pusht, make up half of "
                                "each reader batch: the reader then also sees the block where demonstrations rarely "
                                "take it, against the walls")


PRESETS = {"default": {}, "small": dict(hidden=256),  # small: a head of 0.9 M parameters instead of 3.3 M
           "tiny": dict(ch=16, keypoints=8, hidden=64, head_blocks=1, sample_steps=2),
           # the pose bottleneck (visuomotor.PoseBottleneckNet): a 0.9 M-parameter head behind a 0.9 M-parameter reader
           "pose": dict(bottleneck="pose", crop=96, hidden=256),
           "pose-tiny": dict(bottleneck="pose", crop=96, hidden=64, head_blocks=1, sample_steps=2, frame_batch=4, frame_every=2)}


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
        if o.pose_noise is not None:
            if o.pose_noise < 0:
                raise ValueError(f"--pose-noise must be >= 0, got {o.pose_noise}")
            cfg = dataclasses.replace(cfg, pose_noise=o.pose_noise)
        self.config = cfg
        self.pose = cfg.bottleneck == "pose"
        if o.labels and not self.pose:
            raise ValueError("--labels (state-only corrections) needs a pose-bottleneck policy (--preset pose)")
        if o.reader_frames < 0 or (o.reader_frames and not self.pose):
            raise ValueError(f"--reader-frames needs a pose-bottleneck policy (--preset pose) and a count >= 0, "
                             f"got {o.reader_frames} for bottleneck {cfg.bottleneck!r}")
        if not 0 <= o.label_share < 1:
            raise ValueError(f"--label-share must be in [0, 1), got {o.label_share}")
        self.model = build_net(cfg)
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
        self.labels = load_labels(o.labels, cfg) if o.labels else None
        self._calls = 0
        if self.pose:  # the steps' states as flat arrays: the head's batches are drawn without touching frames
            lens = np.array([len(ep["actions"]) for ep in self.train])
            start = np.concatenate([[0], np.cumsum(lens)[:-1]])
            self.flat = {k: np.concatenate([ep[k][:n] for ep, n in zip(self.train, lens)]).astype(np.float32)
                         for k in ("agent_pos", "block_pose", "actions")}
            self.flat_index = start[self.index[:, 0]] + self.index[:, 1]
            self.flat_start, self.flat_end = np.repeat(start, lens), np.repeat(start + lens, lens)
            known = np.isfinite(self.flat["block_pose"][self.flat_index]).all(1)  # generated data: the reader may miss the T
            if not known.any():
                raise ValueError(f"--data {a.data}: no step records the block's pose, which the pose preset trains on")
            self.index, self.flat_index = self.index[known], self.flat_index[known]
        self.synthetic = random_state_frames(o.reader_frames, self.task.frame_size, cfg.size, a.seed) \
            if o.reader_frames else None

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
        if not self.pose:
            return self._windows(self.train, self.index[rng.integers(0, len(self.index), batch)], rng)
        cfg = self.config
        k = int(batch * self.o.label_share) if self.labels is not None else 0
        g = self.flat_index[rng.integers(0, len(self.flat_index), batch - k)]
        P = self.flat["agent_pos"][np.maximum(g[:, None] - np.arange(cfg.n_obs - 1, -1, -1), self.flat_start[g][:, None])]
        A = self.flat["actions"][np.minimum(g[:, None] + np.arange(cfg.chunk), self.flat_end[g][:, None] - 1)]
        B = self.flat["block_pose"][g]
        if k:
            h = rng.integers(0, len(self.labels["A"]), k)
            P, B, A = (np.concatenate([x, self.labels[n][h]]) for x, n in ((P, "P"), (B, "B"), (A, "A")))
        out = dict(agent=torch.from_numpy(P), block_pose=torch.from_numpy(B), actions=torch.from_numpy(A))
        if self._calls % cfg.frame_every == 0:  # a batch for the pose reader
            n = cfg.frame_batch // 2 if self.synthetic is not None else cfg.frame_batch
            w = self._windows(self.train, self.index[rng.integers(0, len(self.index), n)])
            out.update(frames=w["frames"], frame_pose=w["block_pose"])
            if self.synthetic is not None:
                h = rng.integers(0, len(self.synthetic["frames"]), cfg.frame_batch - n)
                out["frames"] = torch.cat([out["frames"], frames_to_input(self.synthetic["frames"][h][:, None], cfg.crop)])
                out["frame_pose"] = torch.cat([out["frame_pose"], torch.from_numpy(self.synthetic["block_pose"][h])])
        self._calls += 1
        return {n: v.to(self.device) for n, v in out.items()}

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
                logs = ema.loss(dict(b, frame_pose=b["block_pose"]) if self.pose else b)[1]
            out["val_flow_mse"] = logs["flow_mse"]
            if "pose_mse" in logs:
                out["val_pose_mse"] = logs["pose_mse"]
            if self.pose:  # how well the reader sees the block
                read = ema.read_pose(b["frames"]).float()
                out["val_pose_err_px_median"] = (read[:, :2] - b["block_pose"][:, :2]).norm(dim=1).median().item()
                d = torch.remainder(read[:, 2] - b["block_pose"][:, 2] + np.pi, 2 * np.pi) - np.pi
                out["val_pose_err_rad_median"] = d.abs().median().item()
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
        return dict(data=self.sources, val_data=self.o.val_data, init=self.o.init, labels=self.o.labels,
                    reader_frames=self.o.reader_frames or None,
                    label_share=self.o.label_share if self.o.labels else None, commit=git_commit(), step=step, eval=metrics, task=self.task.name,
                    command=f"iws train-policy --data {self.a.data} --out {self.a.out} --steps {self.a.steps}")

    def export(self, ema, out, result):
        extra = self._provenance(result["step"], result["eval"])
        extra.update(wall_s=result["wall_s"], command=result["command"].replace("iws train policy", "iws train-policy"))
        save_release(Path(out) / "visuomotor.safetensors", ema.state_dict(), "visuomotor", self.config, extra)


def random_state_frames(n: int, frame_size: int, size: int, seed: int = 0, chunk: int = 1000) -> dict:
    """n gym-pusht frames of random states, prepared as the policy sees them: {"frames": (n, size, size, 3) uint8,
    "block_pose": (n, 3)}. The block lies anywhere inside the walls at any angle (demonstrations keep it near the
    middle), in a third of the frames pressed against a wall (within 10 px of it, where a learner's pushes can
    leave it); the agent lies anywhere it does not overlap the block."""
    from tqdm import tqdm

    from iws_gym.tasks.pusht.behaviours import scattered_state
    from iws_gym.tasks.pusht.groundtruth import make_env, render_states

    rng = np.random.default_rng([seed, 7])
    agents, poses = zip(*(scattered_state(rng) for _ in range(n)))
    poses, agents = np.array(poses, np.float32), np.array(agents)
    env, frames = make_env(frame_size), np.empty((n, size, size, 3), np.uint8)
    for i in tqdm(range(0, n, chunk), desc="rendering random states for the reader", unit="chunk"):
        frames[i:i + chunk] = prep_frames(render_states(agents[i:i + chunk], poses[i:i + chunk], frame_size, env), size)
    return dict(frames=frames, block_pose=poses)


def load_labels(spec: str, cfg: VisuomotorConfig) -> dict:
    """Label files of `iws dagger` (comma-separated) -> {"P": agent histories, "B": block poses, "A": chunks}."""
    parts = []
    for f in spec.split(","):
        if not Path(f).is_file():
            raise ValueError(f"--labels: no such file {f!r}")
        d = np.load(f)
        if not {"P", "B", "A"} <= set(d.files):
            raise ValueError(f"--labels: {f} is not a label file of `iws dagger` (needs arrays P, B, A; has {d.files})")
        if d["P"].shape[1:] != (cfg.n_obs, 2) or d["A"].shape[1:] != (cfg.chunk, 2):
            raise ValueError(f"--labels: {f} holds histories of {d['P'].shape[1]} and chunks of {d['A'].shape[1]} steps; "
                             f"this policy sees {cfg.n_obs} and predicts {cfg.chunk}")
        parts.append(d)
    return {k: np.concatenate([d[k] for d in parts]).astype(np.float32) for k in ("P", "B", "A")}
