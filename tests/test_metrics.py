import numpy as np
import pytest
import torch

from iws_gym import metrics


def frames(seed=0, n=2):
    return np.random.default_rng(seed).integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)


def test_identical_frames():
    a = frames()
    assert np.allclose(metrics.mse(a, a), 0)
    assert np.all(metrics.psnr(a, a) == 100.0)
    assert np.allclose(metrics.ssim(a, a), 1.0)


def test_psnr_known_value():
    a = np.zeros((1, 16, 16, 3), np.uint8)
    b = np.full_like(a, 51)  # error 0.2 on the [0, 1] scale -> MSE 0.04 -> 13.98 dB
    assert metrics.psnr(a, b)[0] == pytest.approx(10 * np.log10(1 / 0.04), abs=1e-6)


def test_ssim_drops_with_noise_and_is_symmetric():
    a = frames(1)
    noisy = np.clip(a.astype(int) + np.random.default_rng(2).integers(-40, 40, a.shape), 0, 255).astype(np.uint8)
    s = metrics.ssim(a, noisy)
    assert np.all(s < 0.99) and np.allclose(s, metrics.ssim(noisy, a))


def test_rejects_bad_frames():
    with pytest.raises(ValueError, match="uint8"):
        metrics.psnr(np.zeros((1, 8, 8, 3), np.float32), np.zeros((1, 8, 8, 3), np.float32))


def test_latent_change_stats_mean_prediction_and_samples():
    last, tgt = torch.zeros(4, 2, 3, 3), torch.ones(4, 2, 3, 3)
    half = torch.full_like(tgt, 0.5)
    s = metrics.latent_change_stats(last, half, half, tgt)  # the conditional mean of "stay" or "move by 2"
    assert s["unexplained"] == pytest.approx(0.25) and s["predicted_change_ratio"] == pytest.approx(0.25)
    assert s["sample_variance"] == 0.0
    s = metrics.latent_change_stats(last, tgt, tgt + 0.2, tgt)  # right change, two different draws
    assert s["unexplained"] == 0.0 and s["predicted_change_ratio"] == pytest.approx(1.0)
    assert s["sample_variance"] == pytest.approx(0.02)
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.latent_change_stats(last, half[:2], half, tgt)
