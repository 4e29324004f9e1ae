"""`iws bench`: how fast the learned env runs on this device, and how close to the hardware limit.

Measures in one run: single-env step latency (p50/p95, FPS; reset separately), native vector-env
throughput at several batch sizes, gym-pusht's own physics+render throughput at 128x128 (and the
ratio), FLOPs per step (counted with torch's FlopCounterMode) against a measured matmul peak in the
precision the networks run in (bf16 where the hardware has it natively, else fp32: hardware.py), and
peak RSS plus RSS / latency drift over a long rollout. The report names the CPU model and its
native-bf16 flags, so numbers from different machines are not confused.
"""
from __future__ import annotations

import platform
import resource
import time

import numpy as np
import torch


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_matmul_tflops(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 2048, reps: int = 10) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def flops_per_step(env) -> float:
    """Mean FLOPs of an env step over one re-encoding period (the encoder runs every reencode_every-th step)."""
    from torch.utils.flop_counter import FlopCounterMode

    st = env.wm.settings
    n = st.reencode_every if st.reencode else 1
    with FlopCounterMode(display=False) as fc:
        for _ in range(n):
            env.step(env.action_space.sample())
    return float(fc.get_total_flops()) / n


def gym_pusht_throughput(steps: int) -> float:
    from iws_gym.tasks.pusht.groundtruth import make_env

    env = make_env(128)
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    for _ in range(steps):
        env.step(rng.uniform(0, 512, 2))
    return steps / (time.perf_counter() - t)


def bench(checkpoint=None, device: str = "auto", steps: int = 200, batch_sizes=(1, 8, 32, 64),
          rollout_steps: int = 9000, batch_steps: int = 20, compile: bool = False, precision: str = "auto",
          reencode_every: int | None = None, trust: bool = True) -> dict:
    """trust: compute the per-step trust signal (the env's default; models/trust.py). compile: torch.compile
    the dynamics (WorldModel.compile). FLOPs are counted on the eager model first; the compile itself happens
    in the warm-up steps and is reported as compile_s."""
    import gymnasium as gym
    from tqdm import tqdm

    import iws_gym  # noqa: F401

    from iws_gym.models.hardware import cpu_info, dtype_name

    env = gym.make("IWS-TPushing-v0", checkpoint=checkpoint, device=device, max_episode_steps=10**9,
                   precision=precision, reencode_every=reencode_every, trust=trust).unwrapped
    dev = env.wm.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    env.reset(seed=0)
    reset_ms = 1000 * (time.perf_counter() - t)
    flops = flops_per_step(env)  # eager: FlopCounterMode does not see inside compiled graphs
    compile_s = None
    if compile:
        env.wm.compile()
        t = time.perf_counter()
        env.step(rng.uniform(0, 512, 2))
        compile_s = time.perf_counter() - t
    for _ in range(10):
        env.step(rng.uniform(0, 512, 2))
    lat = []
    for _ in tqdm(range(steps), desc="single-env steps"):
        a = rng.uniform(0, 512, 2)
        sync()
        t = time.perf_counter()
        env.step(a)
        sync()
        lat.append(time.perf_counter() - t)
    lat = np.array(lat) * 1000
    cpu = cpu_info()
    report = dict(device=str(dev), torch=torch.__version__, cpu=platform.processor() or platform.machine(),
                  cpu_model=cpu["model"], cpu_bf16_flags=cpu["bf16_flags"], precision=dtype_name(env.wm.dtype),
                  threads=torch.get_num_threads(), checkpoint=str(env.wm.path),
                  decoder_steps=env.wm.settings.decoder_steps, dynamics_steps=env.wm.settings.dynamics_steps,
                  compile=compile, compile_s=compile_s, reencode=env.wm.settings.reencode, trust=env.wm.settings.trust,
                  reencode_every=env.wm.settings.reencode_every if env.wm.settings.reencode else None,
                  single_env=dict(step_ms_p50=float(np.median(lat)), step_ms_p95=float(np.percentile(lat, 95)),
                                  step_ms_mean=float(lat.mean()),
                                  fps=float(1000 / np.median(lat)),
                                  fps_from_mean=float(1000 / lat.mean()),  # counts a periodic re-encoding pass
                                  reset_ms=reset_ms))
    peak = peak_matmul_tflops(dev, env.wm.dtype)
    report["flops"] = dict(per_step_gflop=flops / 1e9, peak_matmul_tflops=peak, peak_dtype=dtype_name(env.wm.dtype),
                           achieved_tflops_at_batch1=flops / (np.median(lat) / 1000) / 1e12)
    report["flops"]["fraction_of_peak_at_batch1"] = report["flops"]["achieved_tflops_at_batch1"] / peak
    batched = {}
    for n in batch_sizes:
        # the single env's world model (compiled once, if asked) serves every batch size
        envs = gym.make_vec("IWS-TPushing-v0", num_envs=n, world_model=env.wm)
        envs.reset(seed=0)
        acts = rng.uniform(0, 512, (batch_steps + 2, n, 2)).astype(np.float32)
        envs.step(acts[0])
        sync()
        t = time.perf_counter()
        for a in acts[1:-1]:
            envs.step(a)
        sync()
        batched[n] = n * batch_steps / (time.perf_counter() - t)
        envs.close()
    report["batched_env_steps_per_s"] = batched
    gt = gym_pusht_throughput(max(200, steps))
    report["gym_pusht_steps_per_s"] = gt
    report["batched_best_over_gym_pusht"] = max(batched.values()) / gt
    # long rollout: RSS and latency drift
    rss, lat_win = [], []
    env.reset(seed=1)
    t_last = time.perf_counter()
    for i in tqdm(range(rollout_steps), desc="long rollout"):
        env.step(rng.uniform(0, 512, 2))
        if (i + 1) % max(1, rollout_steps // 20) == 0:
            now = time.perf_counter()
            rss.append(_rss_mb())
            lat_win.append(1000 * (now - t_last) / max(1, rollout_steps // 20))
            t_last = now
    report["long_rollout"] = dict(steps=rollout_steps, rss_mb_first=rss[0] if rss else None, rss_mb_last=rss[-1] if rss else None,
                                  rss_growth_mb=(rss[-1] - rss[0]) if rss else None,
                                  step_ms_first_window=lat_win[0] if lat_win else None,
                                  step_ms_last_window=lat_win[-1] if lat_win else None)
    report["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report["targets"] = dict(single_env_fps_ge_30=report["single_env"]["fps"] >= 30,
                             batched_ge_gym_pusht=report["batched_best_over_gym_pusht"] >= 1.0,
                             no_rss_growth=(report["long_rollout"]["rss_growth_mb"] or 0) < 50)
    return report
