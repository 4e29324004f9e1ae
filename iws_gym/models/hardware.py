"""Which device and number format the networks run in, chosen from what the hardware does natively.

bf16 is fast only where the hardware computes in it: CUDA GPUs of compute capability >= 8, and CPUs
with AMX or AVX512-BF16 (recent Intel Xeons, AMD Zen 4 and later). Elsewhere - AVX2-only CPUs, which
is most laptops and many cloud machines - PyTorch emulates bf16 and every convolution runs several
times *slower* than in fp32 (measured by `iws bench` on an AVX2 AMD EPYC: 2.9 env steps/s in bf16
against 13.0 in fp32; docs/results.md, "Speed"). So the default is bf16 where it is native and fp32 everywhere
else; `IWS_DTYPE=bf16|fp32` overrides it for a process. Reports name the precision they ran in.

    device = resolve_device("auto")        # CUDA when present, else the CPU
    dtype = default_dtype(device)          # torch.bfloat16 or torch.float32
    with autocast(device):                 # bf16 autocast where native, a no-op elsewhere
        ...
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # x86 /proc/cpuinfo flags; aarch64 lists "bf16"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@functools.lru_cache(maxsize=None)
def cpu_info() -> dict:
    """CPU model name and its native-bf16 flags, read from /proc/cpuinfo (Linux; empty elsewhere)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip().lower()
                if key == "model name":
                    model = val.strip()
                elif key in ("flags", "features"):
                    flags |= set(val.split())
    except OSError:
        pass
    native = sorted(f for f in flags if f in BF16_CPU_FLAGS or (f == "bf16" and platform.machine() == "aarch64"))
    return dict(model=model, bf16_flags=native)


def native_bf16(device: str | torch.device = "auto") -> bool:
    """Whether `device` computes in bf16 natively (so bf16 is faster than fp32 there)."""
    device = resolve_device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return bool(cpu_info()["bf16_flags"])
    return False


def default_dtype(device: str | torch.device = "auto") -> torch.dtype:
    """bf16 where the device has it natively, else fp32; the IWS_DTYPE environment variable overrides."""
    name = os.environ.get("IWS_DTYPE", "").strip().lower()
    if name:
        if name not in DTYPES:
            raise ValueError(f"IWS_DTYPE must be one of {sorted(DTYPES)}, got {name!r}")
        return DTYPES[name]
    return torch.bfloat16 if native_bf16(device) else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype))


def compute_dtype(device: str | torch.device, amp: bool = True) -> torch.dtype:
    """What mixed precision (`amp`) computes in on `device`: default_dtype(device), or fp32 without amp."""
    return default_dtype(device) if amp else torch.float32


def autocast(device: str | torch.device, enabled: bool = True):
    """bf16 autocast when compute_dtype(device, enabled) is bf16; otherwise a no-op context."""
    device = resolve_device(device)
    if compute_dtype(device, enabled) == torch.bfloat16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
