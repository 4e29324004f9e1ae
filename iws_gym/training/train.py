"""One training loop for every stage, chosen by name.

    # single process (bf16 autocast where the CPU/GPU has native bf16, else fp32; channels_last convs)
    iws train stage1 --data data/tpushing --out runs/stage1
    # several processes / GPUs: the same loop under DDP (gloo on CPU, NCCL on CUDA)
    torchrun --nproc_per_node=2 -m iws_gym.training.train stage1 --data data/tpushing --out runs/stage1

The loop, in order: learning rate -> periodic eval + checkpoint -> forward/backward -> clip -> step ->
EMA -> log. Interrupt it at any time; rerunning the same command resumes from `OUT/last.pt`.
Each stage provides: a model with `loss(batch, step) -> (loss, logs)`, a batch sampler, an evaluation
and an export to a released safetensors file.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from iws_gym.models.checkpoint import atomic_torch_save, config_to_dict
from iws_gym.training.common import HelpFormatter, add_dataclass_args, arg
from iws_gym.models.hardware import autocast, compute_dtype, dtype_name, resolve_device


@dataclass
class TrainArgs:
    """The loop's options, shared by every stage (each stage adds its own Options)."""

    data: str = arg("data/tpushing", "dataset directory written by `iws collect`")
    out: str = arg("runs/stage1", "run directory: last.pt (resume), TensorBoard logs, the exported weights")
    steps: int = arg(20000, "optimizer steps")
    batch: int = arg(32, "batch size per process")
    lr: float = arg(1e-3, "peak learning rate (linear warm-up, then cosine to 10%%)")
    warmup: int = arg(500, "warm-up steps")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    ema: float = arg(0.999, "rate of the evaluation EMA (not the consistency target)")
    clip: float = arg(1.0, "gradient-norm clip")
    eval_every: int = arg(1000, "steps between evaluations on validation episodes")
    ckpt_every: int = arg(500, "steps between checkpoints (last.pt)")
    log_every: int = arg(50, "steps between TensorBoard logs")
    seed: int = arg(0, "seed of the batch sampler and the initialisation")
    max_episodes: int | None = arg(None, "load only the first N episodes (quick runs)")
    max_minutes: float | None = arg(None, "stop after the first checkpoint past this much wall time (resume later)")
    time_schedule: bool = arg(False, "with --max-minutes: the learning rate decays over whichever of --steps and "
                                     "--max-minutes ends first, so a run cut by time still ends at its lowest rate "
                                     "(a fixed compute budget, as on a lent GPU)")
    deadline: float | None = arg(None, "with --time-schedule: end training by this Unix time; the budget becomes the "
                                       "smaller of --max-minutes and the time from the loop's start (after loading) to "
                                       "the deadline, so runs that load for different times still end together")
    device: str = arg("auto", "auto (CUDA if present, else CPU) | cpu | cuda | cuda:N")
    amp: bool = arg(True, "bf16 autocast where the hardware runs bf16 natively (AMX / AVX512-BF16 CPUs, CUDA); "
                          "fp32 elsewhere, where bf16 is emulated and slower")


def parse_args(stage_name: str, argv) -> tuple[TrainArgs, object]:
    """The loop's TrainArgs and the stage's Options from the command line (`iws train STAGE --help`)."""
    spec = STAGES[stage_name]
    p = argparse.ArgumentParser(prog="iws train-policy" if stage_name == "policy" else f"iws train {stage_name}", description=spec.__doc__,
                                formatter_class=HelpFormatter)
    add_dataclass_args(p.add_argument_group("training loop"), TrainArgs, spec.defaults)
    add_dataclass_args(p.add_argument_group(f"{stage_name}"), spec.Options, spec.Options())
    ns = vars(p.parse_args(argv))
    loop = {f.name for f in fields(TrainArgs)}
    return TrainArgs(**{k: v for k, v in ns.items() if k in loop}), spec.Options(**{k: v for k, v in ns.items() if k not in loop})


def update_ema(target: torch.nn.Module, source: torch.nn.Module, rate: float) -> None:
    with torch.no_grad():
        for t, s in zip(target.parameters(), source.parameters()):
            t.lerp_(s, 1 - rate)
        for t, s in zip(target.buffers(), source.buffers()):
            t.copy_(s)


def lr_at(step: int, a: TrainArgs, time_progress: float = 0.0) -> float:
    """Linear warm-up, then cosine to 10% over the steps (or over the time budget, `time_progress` in [0, 1],
    when that ends first)."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    progress = max((step - a.warmup) / max(1, a.steps - a.warmup), time_progress)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def run(stage_name: str, a: TrainArgs, o, argv=None) -> dict:
    """Train stage `stage_name` with loop options `a` and the stage's options `o`."""
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

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

    stage = STAGES[stage_name].load()(a, o, device)
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
        offset = getattr(model, "curriculum_offset", None) or None
        if state.get("curriculum_offset") is not None and state["curriculum_offset"] != offset:
            raise ValueError(f"{ckpt}: this run fine-tunes a release of {state['curriculum_offset']} steps, but --finetune "
                             f"{o.finetune} now holds one of {offset} steps (was it re-released from this run?); "
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
    args = {**asdict(a), **asdict(o)}

    def save():
        if not master:
            return
        atomic_torch_save(dict(stage=stage_name, model_config=config_to_dict(stage.config), args=args,
                               model=model.state_dict(), ema=ema.state_dict(), opt=opt.state_dict(),
                               curriculum_offset=getattr(model, "curriculum_offset", None) or None,
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
    if a.deadline is not None:  # what is left until the deadline, counted from now (loading is done)
        if not a.time_schedule:
            raise ValueError("--deadline needs --time-schedule (the budget the schedule runs over)")
        a.max_minutes = max(0.0, min(a.max_minutes or float("inf"), (wall_before + a.deadline - t0) / 60))
    bar = tqdm(total=a.steps, initial=step, desc=f"train {stage_name}", disable=not master, dynamic_ncols=True)
    metrics, logs = {}, {}
    stopped_early = budget_spent = False
    if a.time_schedule and a.max_minutes is None:
        raise ValueError("--time-schedule needs --max-minutes (the budget the schedule runs over)")

    def time_progress():
        if not a.time_schedule:
            return 0.0
        p = (wall_before + time.time() - t0) / 60 / a.max_minutes
        if ddp:  # every process must decay and stop at the same step: rank 0's clock decides
            t = torch.tensor([p], device=device)
            dist.broadcast(t, 0)
            p = float(t)
        return p

    while step < a.steps:
        progress = time_progress()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a, progress)
        if master and step > 0 and step % a.eval_every == 0:
            metrics = evaluate()
            bar.write(f"step {step}: " + json.dumps({k: round(v, 4) for k, v in metrics.items()}))
        if step > 0 and step % a.ckpt_every == 0:
            save()
            if a.max_minutes is not None and not a.time_schedule and (time.time() - t0) / 60 > a.max_minutes:
                stopped_early = True
                break
        if progress >= 1.0:  # the budget is spent and the rate at its floor: done
            budget_spent = True
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
            writer.add_scalar("train/lr", opt.param_groups[0]["lr"], step)
            bar.set_postfix({k: f"{v:.4g}" for k, v in list(logs.items())[:3]})
    bar.close()
    save()
    result = {}
    if master:
        metrics = evaluate()
        wall = wall_before + time.time() - t0
        result = dict(stage=stage_name, step=step, wall_s=round(wall, 1), eval=metrics, finished=not stopped_early,
                      **(dict(time_budget_spent=True) if budget_spent else {}),
                      command=" ".join(["iws", "train", stage_name, *map(str, argv or [])]),
                      args=args, world_size=world, device=str(device),
                      precision=dtype_name(compute_dtype(device, a.amp)))
        stage.export(ema, out, result)
        (out / "train_result.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        writer.close()
    if ddp:
        dist.barrier()
        dist.destroy_process_group()
    return result


class StageSpec:
    """A stage's name -> where its code lives, imported only when that stage runs."""

    def __init__(self, module: str, defaults: TrainArgs):
        self.module, self.defaults = module, defaults

    def load(self):
        return importlib.import_module(self.module).Stage

    @property
    def Options(self):  # noqa: N802
        return importlib.import_module(self.module).Options

    @property
    def __doc__(self):
        return importlib.import_module(self.module).__doc__


STAGES = {
    "stage1": StageSpec("iws_gym.training.stage1", TrainArgs(out="runs/stage1", steps=24000, batch=32, lr=1e-3)),
    "stage2": StageSpec("iws_gym.training.stage2", TrainArgs(out="runs/stage2", steps=6000, batch=32, lr=7e-4)),
    # the compact design (models/compact.py): stage 1, then the dynamics and denoiser on its latents
    "compact1": StageSpec("iws_gym.training.compact1", TrainArgs(out="runs/compact1", steps=24000, batch=32, lr=5e-4,
                                                                 warmup=300)),
    "compact2": StageSpec("iws_gym.training.compact2", TrainArgs(out="runs/compact2", steps=20000, batch=128, lr=1e-3,
                                                                 warmup=200, weight_decay=1e-4)),
    "policy": StageSpec("iws_gym.training.policy", TrainArgs(data="data/expert", out="runs/visuomotor", steps=12000,
                                                             batch=64, lr=1e-3, eval_every=2000, ckpt_every=500)),
}


def main(stage_name: str | None = None, argv=None):
    if stage_name is None:  # python -m iws_gym.training.train STAGE ...
        argv = sys.argv[1:] if argv is None else argv
        if not argv or argv[0] not in STAGES:
            raise SystemExit(f"usage: python -m iws_gym.training.train {{{','.join(STAGES)}}} [flags]")
        stage_name, argv = argv[0], argv[1:]
    if stage_name not in STAGES:
        raise ValueError(f"unknown stage {stage_name!r}; choose from {sorted(STAGES)}")
    a, o = parse_args(stage_name, argv or [])
    return run(stage_name, a, o, argv)


if __name__ == "__main__":
    main()
