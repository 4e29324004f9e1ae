import json

from .conftest import run_iws


def test_bench_reports_every_section(tiny_checkpoint, tmp_path):
    out = tmp_path / "b.json"
    run_iws("bench", "--checkpoint", tiny_checkpoint, "--device", "cpu", "--steps", 5, "--batch-sizes", 1, 2,
            "--batch-steps", 2, "--rollout-steps", 40, "--json", out)
    r = json.loads(out.read_text())
    assert r["single_env"]["fps"] > 0 and set(r["batched_env_steps_per_s"]) == {"1", "2"}
    assert r["flops"]["per_step_gflop"] > 0 and r["flops"]["peak_matmul_tflops"] > 0
    assert r["gym_pusht_steps_per_s"] > 0 and r["long_rollout"]["steps"] == 40 and r["peak_rss_mb"] > 0
