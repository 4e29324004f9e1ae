"""One training loop for every stage, chosen by name.

    # single process (bf16 autocast where the CPU/GPU has native bf16, else fp32; channels_last convs)
    iws train stage1 --data data/tpushing --out runs/stage1
    # several processes / GPUs: the same loop under DDP (gloo on CPU, NCCL on CUDA)
    torchrun --nproc_per_node=2 -m iws_gym.train stage1 --data data/tpushing --out runs/stage1

The loop, in order: learning rate -> periodic eval + checkpoint -> forward/backward -> clip -> step ->
EMA -> log. Interrupt it at any time; rerunning the same command resumes from `OUT/last.pt`.
Each stage provides: a model with `loss(batch, step) -> (loss, logs)`, a batch sampler, an evaluation
and an export to a released safetensors file.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .checkpoint import atomic_torch_save, config_to_dict
from .hardware import autocast, compute_dtype, dtype_name, resolve_device


@dataclass
class TrainArgs:
    data: str = "data/tpushing"       # dataset directory written by `iws collect`
    extra_data: str = ""              # stage 2: more dataset directories whose episodes join --data's for training,
                                      #   comma-separated (e.g. an `iws collect --mix jittery` collection)
    out: str = "runs/stage1"          # run directory: last.pt, TensorBoard logs, exported weights
    steps: int = 20000                # optimizer steps
    batch: int = 32                   # per process
    lr: float = 1e-3
    warmup: int = 500
    weight_decay: float = 0.0
    ema: float = 0.999                # evaluation EMA (not the consistency target)
    clip: float = 1.0
    eval_every: int = 1000
    ckpt_every: int = 500
    log_every: int = 50
    seed: int = 0
    max_episodes: int | None = None   # load only the first N episodes (quick runs)
    max_minutes: float | None = None  # stop (after a checkpoint) once this much wall time is spent
    device: str = "auto"
    amp: bool = True                  # bf16 autocast where the hardware runs bf16 natively (AMX / AVX512-BF16
                                      #   CPUs, CUDA); fp32 elsewhere, where bf16 is emulated and slower (hardware.py)
    crop: int = 0                     # stage 1: train on random aligned crops of this size (0: full frames)
    preset: str = "default"           # model size preset of the stage: default | tiny (tests)
    init: str | None = None           # stage 2/3: path of the stage-1 (and stage-2) release they build on
    finetune: str | None = None       # stage 2: start from the weights (and config) of this stage-2 release
    rollout: int = 0                  # stage 2: contexts partly made of the model's own open-loop predictions,
                                      #   up to this many steps deep (0: teacher forcing only); see Stage2Stage
    focus: float = 0.0                # stage 2: fraction of windows whose target transition moves the block
                                      #   (contact), on top of uniform sampling; see block_moves
    change_weight: float = 0.0        # stage 2: extra loss weight on latent cells that change (see Stage2.loss)
    grow_blocks: int = 0              # stage 2 with --finetune: append this many identity-initialised blocks
                                      #   (more capacity without losing what the release learned)
    one_step_loss: str = "mse"        # stage 2: the one-step jump's loss: mse (conditional mean) | energy
                                      #   (energy score of two draws: one step samples; see dynamics.energy_score)
    drop_agent: float = 0.0           # stage 2: share of windows whose last context frames lose the agent (target
                                      #   keeps it), so a rollout that faded it draws it again; see sample_rollout
    corrupt_block: float = 0.0        # stage 2: share of windows whose last context frames show a faded or ghosted
                                      #   block (target: the real frame), so a fading block is redrawn rigid
    corrupt_kinds: str = "fade,ghost"  # stage 2: the corruptions --corrupt-block draws from, comma-separated, equal
                                      #   odds: fade, ghost, bend (bar and stem at different poses); see corrupt_block
    hires_ch: int = 0                 # stage 2: add a full-resolution refinement head of this width (HiResHead);
                                      #   with --finetune it starts at zero, so the release's function is kept
    jump_focus: float = 0.0           # stage 2: fraction of windows whose target transition moves the agent more
                                      #   than 30 canvas px (needs --agent-track); see agent_jumps
    rollout_reencode: bool = False    # stage 2 with --rollout: each predicted latent of those contexts is decoded to
                                      #   a uint8 frame and encoded back, as the env does (reencode_every=1), so the
                                      #   network sees the errors of the loop it runs in, not of raw latents
    agent_track: bool = False         # stage 2: condition on the agent track (its position in each context frame
                                      #   and where its fitted motion law puts it next; dynamics.agent_landing); with
                                      #   --finetune of a release without one, the new inputs start at zero
    block_track: bool = False         # stage 2 (needs --agent-track): condition on the T block's recorded pose in
                                      #   each context frame (dynamics.block_maps, jittered by 2 px / 0.03 rad as
                                      #   a fit on a predicted frame is); the env reads it from each decoded frame


def parse_args(argv, defaults: TrainArgs) -> TrainArgs:
    p = argparse.ArgumentParser(prog="iws train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, f in TrainArgs.__dataclass_fields__.items():
        d = getattr(defaults, name)
        if isinstance(d, bool):
            p.add_argument(f"--{name.replace('_', '-')}", default=d, action=argparse.BooleanOptionalAction)
        else:
            typ = {int: int, float: float}.get(type(d), str)
            if name in ("max_episodes",):
                typ = int
            if name in ("max_minutes",):
                typ = float
            p.add_argument(f"--{name.replace('_', '-')}", type=typ, default=d)
    return TrainArgs(**vars(p.parse_args(argv)))


def update_ema(target: torch.nn.Module, source: torch.nn.Module, rate: float) -> None:
    with torch.no_grad():
        for t, s in zip(target.parameters(), source.parameters()):
            t.lerp_(s, 1 - rate)
        for t, s in zip(target.buffers(), source.buffers()):
            t.copy_(s)


def lr_at(step: int, a: TrainArgs) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    progress = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def run(stage_name: str, a: TrainArgs, argv=None) -> dict:
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    from .stages import STAGES

    # ---- DDP, inline (torchrun sets RANK / WORLD_SIZE / LOCAL_RANK)
    ddp = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = resolve_device(a.device)
    if ddp:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        if device.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    else:
        rank, world = 0, 1
    master = rank == 0
    torch.manual_seed(a.seed + rank)
    rng = np.random.default_rng(a.seed + 1000 * rank)
    out = Path(a.out)
    if master:
        out.mkdir(parents=True, exist_ok=True)

    stage = STAGES[stage_name](a, device)
    model = stage.model.to(device)
    if stage.channels_last:  # 2D conv nets: channels_last is what makes AMX / tensor-core convs fast
        model = model.to(memory_format=torch.channels_last)
    ema = copy.deepcopy(model).requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=a.weight_decay, betas=(0.9, 0.99))
    step, wall_before = 0, 0.0
    ckpt = out / "last.pt"
    if ckpt.is_file():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        if state["stage"] != stage_name or state["model_config"] != config_to_dict(stage.config):
            raise ValueError(f"{ckpt}: belongs to another run (stage {state['stage']!r} or a different model config); use a new --out")
        offset = getattr(model, "curriculum_offset", None)
        if state.get("curriculum_offset") is not None and state["curriculum_offset"] != offset:
            raise ValueError(f"{ckpt}: this run fine-tunes a release of {state['curriculum_offset']} steps, but --finetune "
                             f"{a.finetune} now holds one of {offset} steps (was it re-released from this run?); "
                             "resume with --finetune pointing at the release the run started from")
        model.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["opt"])
        step, wall_before = state["step"], state.get("wall_s", 0.0)
        rng = np.random.default_rng([a.seed + 1000 * rank, step])
        if master:
            print(f"resumed {ckpt} at step {step}", file=sys.stderr)
    net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    amp = autocast(device, a.amp)  # bf16 only where the hardware has it natively (hardware.py), else fp32
    writer = SummaryWriter(str(out / "tb")) if master else None

    def save():
        if not master:
            return
        atomic_torch_save(dict(stage=stage_name, model_config=config_to_dict(stage.config), args=vars(a),
                               model=model.state_dict(), ema=ema.state_dict(), opt=opt.state_dict(),
                               curriculum_offset=getattr(model, "curriculum_offset", None),
                               step=step, wall_s=wall_before + time.time() - t0), ckpt)

    def evaluate():
        ema.eval()
        with torch.no_grad(), amp:
            metrics = stage.evaluate(ema)
        ema.train()
        for k, v in metrics.items():
            writer.add_scalar(f"eval/{k}", v, step)
        return metrics

    t0 = time.time()
    bar = tqdm(total=a.steps, initial=step, desc=f"train {stage_name}", disable=not master, dynamic_ncols=True)
    metrics, logs = {}, {}
    stopped_early = False
    while step < a.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        if master and step > 0 and step % a.eval_every == 0:
            metrics = evaluate()
            bar.write(f"step {step}: " + json.dumps({k: round(v, 4) for k, v in metrics.items()}))
        if step > 0 and step % a.ckpt_every == 0:
            save()
            if a.max_minutes is not None and (time.time() - t0) / 60 > a.max_minutes:
                stopped_early = True
                break
        batch = stage.sample_batch(rng, a.batch)
        with amp:
            loss, logs = net(batch, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, a.clip)
        opt.step()
        update_ema(ema, model, min(a.ema, (1 + step) / (10 + step)))  # EMA warm-up: early evals mean something
        stage.after_step(model, step)
        step += 1
        bar.update(1)
        if master and step % a.log_every == 0:
            for k, v in logs.items():
                writer.add_scalar(f"train/{k}", v, step)
            writer.add_scalar("train/grad_norm", float(gnorm), step)
            writer.add_scalar("train/lr", lr_at(step, a), step)
            bar.set_postfix({k: f"{v:.4g}" for k, v in list(logs.items())[:3]})
    bar.close()
    save()
    result = {}
    if master:
        metrics = evaluate()
        wall = wall_before + time.time() - t0
        result = dict(stage=stage_name, step=step, wall_s=round(wall, 1), eval=metrics, finished=not stopped_early,
                      command=" ".join(["iws", "train", stage_name, *map(str, argv or [])]),
                      args=vars(a), world_size=world, device=str(device),
                      precision=dtype_name(compute_dtype(device, a.amp)))
        stage.export(ema, out, result)
        (out / "train_result.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        writer.close()
    if ddp:
        dist.barrier()
        dist.destroy_process_group()
    return result


def main(stage_name: str | None = None, argv=None):
    from .stages import STAGES, default_args

    if stage_name is None:  # python -m iws_gym.train STAGE ...
        argv = sys.argv[1:] if argv is None else argv
        if not argv or argv[0] not in STAGES:
            raise SystemExit(f"usage: python -m iws_gym.train {{{','.join(STAGES)}}} [flags]")
        stage_name, argv = argv[0], argv[1:]
    a = parse_args(argv or [], default_args(stage_name))
    return run(stage_name, a, argv)


if __name__ == "__main__":
    main()
