"""Precision choice: bf16 only where the hardware computes in it natively, fp32 elsewhere, overridable."""
import contextlib

import gymnasium as gym
import numpy as np
import pytest
import torch

import iws_gym  # noqa: F401
from iws_gym.models import hardware


@pytest.fixture
def cpu_flags(monkeypatch):
    """Pretend the CPU has the given native-bf16 flags."""
    def set_flags(flags):
        monkeypatch.setattr(hardware, "cpu_info", lambda: dict(model="test cpu", bf16_flags=list(flags)))
    monkeypatch.delenv("IWS_DTYPE", raising=False)
    return set_flags


@pytest.mark.parametrize("flags, expected", [([], torch.float32), (["avx512_bf16"], torch.bfloat16),
                                             (["amx_bf16", "avx512_bf16"], torch.bfloat16)])
def test_cpu_dtype_follows_native_bf16_flags(cpu_flags, flags, expected):
    cpu_flags(flags)
    assert hardware.native_bf16("cpu") == bool(flags)
    assert hardware.default_dtype("cpu") == expected
    ctx = hardware.autocast("cpu")
    assert isinstance(ctx, torch.autocast) == (expected == torch.bfloat16)
    assert isinstance(hardware.autocast("cpu", enabled=False), contextlib.nullcontext)


def test_env_variable_overrides_and_bad_value_is_named(cpu_flags, monkeypatch):
    cpu_flags([])
    monkeypatch.setenv("IWS_DTYPE", "bf16")
    assert hardware.default_dtype("cpu") == torch.bfloat16
    cpu_flags(["amx_bf16"])
    monkeypatch.setenv("IWS_DTYPE", "fp32")
    assert hardware.default_dtype("cpu") == torch.float32
    monkeypatch.setenv("IWS_DTYPE", "half")
    with pytest.raises(ValueError, match="IWS_DTYPE"):
        hardware.default_dtype("cpu")


def test_cpu_info_reads_this_machine():
    info = hardware.cpu_info()
    assert isinstance(info["model"], str) and set(info["bf16_flags"]) <= {"amx_bf16", "avx512_bf16", "bf16"}


def test_env_precision_option(tiny_checkpoint, cpu_flags):
    cpu_flags([])  # a CPU without native bf16: auto is fp32
    auto = gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu").unwrapped
    assert auto.wm.dtype == torch.float32
    assert next(auto.wm.stage2.parameters()).dtype == torch.float32
    forced = gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu", precision="bf16").unwrapped
    assert forced.wm.dtype == torch.bfloat16 and next(forced.wm.stage1.parameters()).dtype == torch.bfloat16
    # both run, and agree up to bf16 rounding
    frames = []
    for e in (auto, forced):
        e.reset(seed=3)
        obs, *_ = e.step(np.array([300.0, 200.0], np.float32))
        frames.append(obs["pixels"].astype(int))
    assert np.abs(frames[0] - frames[1]).mean() < 8
    with pytest.raises(ValueError, match="precision"):
        gym.make("IWS-TPushing-v0", checkpoint=tiny_checkpoint, device="cpu", precision="fp16")
