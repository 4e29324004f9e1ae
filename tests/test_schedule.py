import math

import pytest
import torch

from iws_gym.models import schedule


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


def test_euler_sample_follows_the_probability_flow_of_a_gaussian():
    """With the exact denoiser of data ~ N(mu, s^2), the ODE maps noise onto that distribution."""
    from iws_gym.models.sampler import euler_sample

    mu, s = 0.3, 0.5
    exact = lambda x, sigma: mu + s**2 / (s**2 + sigma[:, None] ** 2) * (x - mu)  # noqa: E731
    sig = schedule.karras_sigmas(64, 0.002, 80.0).flip(0)
    x = euler_sample(exact, (20000, 1), sig, generator=torch.Generator().manual_seed(0))
    assert abs(x.mean().item() - mu) < 0.02 and abs(x.std().item() - s) < 0.03
    point = euler_sample(lambda x, sigma: torch.full_like(x, mu), (4, 1), torch.tensor([80.0]))
    torch.testing.assert_close(point, torch.full((4, 1), mu))  # a point mass: one step lands on it


def test_predict_rejects_an_unknown_sampler():
    from iws_gym.models.dynamics import DynamicsConfig, Stage2

    m = Stage2(DynamicsConfig(ch=16, blocks=1, heads=2, emb_dim=16, context=2))
    with pytest.raises(ValueError, match="sampler"):
        m.predict(torch.zeros(1, 2, 8, 16, 16), torch.zeros(1, 2, 2), torch.tensor([1]), sampler="heun")
    for sampler in ("consistency", "euler"):
        assert m.predict(torch.zeros(1, 2, 8, 16, 16), torch.zeros(1, 2, 2), torch.tensor([1]), steps=3,
                         sampler=sampler).shape == (1, 8, 16, 16)
