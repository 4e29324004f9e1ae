import math

import pytest
import torch

from iws_gym import schedule


def test_boundary_condition_at_sigma_min():
    s = torch.tensor([0.002])
    assert schedule.c_skip(s, 0.5, 0.002).item() == pytest.approx(1.0)
    assert schedule.c_out(s, 0.5, 0.002).item() == pytest.approx(0.0)


def test_large_sigma_is_pure_prediction():
    s = torch.tensor([80.0])
    assert schedule.c_skip(s, 0.5, 0.002).item() < 1e-4
    assert schedule.c_out(s, 0.5, 0.002).item() == pytest.approx(0.5, rel=1e-3)
    assert schedule.c_in(s, 0.5).item() == pytest.approx(1 / math.sqrt(80**2 + 0.25))


def test_karras_sigmas_endpoints_and_order():
    s = schedule.karras_sigmas(11, 0.002, 80.0)
    assert s[0].item() == pytest.approx(0.002, rel=1e-4) and s[-1].item() == pytest.approx(80.0, rel=1e-4)
    assert torch.all(s[1:] > s[:-1])


def test_ict_curriculum_doubles_and_caps():
    n = [schedule.ict_num_scales(k, 1000) for k in range(0, 1000, 50)]
    assert n[0] == 11 and all(b >= a for a, b in zip(n, n[1:])) and max(n) <= 1281


def test_lognormal_probs_normalised():
    p = schedule.lognormal_index_probs(schedule.karras_sigmas(41, 0.002, 80.0))
    assert len(p) == 40 and p.sum().item() == pytest.approx(1.0, abs=1e-5) and torch.all(p > 0)


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_sampling_sigmas(steps):
    s = schedule.sampling_sigmas(steps, 80.0, 0.4, 0.002)
    assert len(s) == steps and s[0].item() == 80.0 and torch.all(s[1:] < s[:-1])


def test_sampling_sigmas_rejects_zero_steps():
    with pytest.raises(ValueError, match="steps"):
        schedule.sampling_sigmas(0, 80.0, 0.4, 0.002)
