"""`iws data-stats`: what a collected dataset contains (behaviour mix, coverage, contact, workspace
occupancy) and how fast the loader serves training windows."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from iws_gym.data.episodes import InMemoryEpisodes, list_episodes, load_meta, read_episode

GRID = 16  # workspace occupancy cells per axis (32 px in the 512 canvas)


def dataset_stats(root: Path, plot: Path | None = None, loader_batches: int = 50, context: int = 4) -> dict:
    from tqdm import tqdm

    meta = load_meta(root)
    paths = list_episodes(root)
    keys = ("agent_pos", "block_pose", "coverage", "n_contacts", "segments")
    max_cov, all_cov, contact, seg_counts = [], [], [], {}
    agent_occ, block_occ = np.zeros((GRID, GRID)), np.zeros((GRID, GRID))
    angles, seg_names = [], None
    for p in tqdm(paths, desc="scanning episodes", unit="ep"):
        ep = read_episode(p, keys)
        seg_names = list(ep["attrs"]["segment_names"])
        max_cov.append(float(ep["coverage"].max()))
        all_cov.append(ep["coverage"])
        contact.append(ep["n_contacts"] > 0)
        for s, n in zip(*np.unique(ep["segments"], return_counts=True)):
            seg_counts[seg_names[s]] = seg_counts.get(seg_names[s], 0) + int(n)
        ai = np.clip((ep["agent_pos"] / 512 * GRID).astype(int), 0, GRID - 1)
        bi = np.clip((ep["block_pose"][:, :2] / 512 * GRID).astype(int), 0, GRID - 1)
        np.add.at(agent_occ, (ai[:, 1], ai[:, 0]), 1)
        np.add.at(block_occ, (bi[:, 1], bi[:, 0]), 1)
        angles.append(ep["block_pose"][:, 2])
    max_cov, all_cov = np.array(max_cov), np.concatenate(all_cov)
    contact, angles = np.concatenate(contact), np.concatenate(angles)
    total = sum(seg_counts.values())
    inner = slice(1, GRID - 1)  # cells reachable by the agent centre (walls at 5 and 506)
    edges = np.array([0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.95, 1.0001])
    stats = dict(
        dataset=str(root), episodes=len(paths), steps=int(len(contact)), frames=int(len(all_cov)),
        collection=dict(seed=meta["seed"], wall_s=meta.get("wall_s"), episodes_per_min=meta.get("episodes_per_min")),
        behaviour_mix={k: round(v / total, 4) for k, v in sorted(seg_counts.items(), key=lambda kv: -kv[1])},
        max_coverage_per_episode=dict(
            histogram={f"{lo:.2f}-{min(hi, 1):.2f}": int(((max_cov >= lo) & (max_cov < hi)).sum()) for lo, hi in zip(edges[:-1], edges[1:])},
            mean=float(max_cov.mean()), success_rate=float((max_cov > 0.95).mean()),
            frac_above_0_5=float((max_cov > 0.5).mean()), frac_below_0_1=float((max_cov < 0.1).mean())),
        contact_step_fraction=float(contact.mean()),
        workspace=dict(agent_cells_visited=float((agent_occ[inner, inner] > 0).mean()),
                       block_cells_visited=float((block_occ[inner, inner] > 0).mean()),
                       grid=f"{GRID - 2}x{GRID - 2} cells of 32 px (inner workspace)"),
        block_angle_bins_visited=float((np.histogram(angles % (2 * np.pi), bins=36, range=(0, 2 * np.pi))[0] > 0).mean()),
    )
    if loader_batches > 0:
        stats["loader"] = loader_throughput(root, loader_batches, context)
    if plot is not None:
        _plot(stats, max_cov, agent_occ, block_occ, angles, plot)
    return stats


def loader_throughput(root: Path, batches: int, context: int, batch: int = 32, max_episodes: int = 200) -> dict:
    """Time the in-memory loader: episode load rate, and window sampling rate (frames/s, uint8 + float tensors)."""
    from iws_gym.models.frames import frames_to_tensor

    t0 = time.perf_counter()
    eps = InMemoryEpisodes.load(root, max_episodes=max_episodes, progress=False)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for _ in range(batches):
        fr, ac = eps.sample_windows(rng, batch, context)
        frames_to_tensor(fr.reshape(-1, *fr.shape[2:]), "cpu")
    dt = time.perf_counter() - t0
    return dict(episodes_loaded=len(eps.frames), load_episodes_per_s=len(eps.frames) / load_s,
                window_batch=batch, context=context,
                windows_per_s=batches * batch / dt, frames_per_s=batches * batch * (context + 1) / dt)


def _plot(stats, max_cov, agent_occ, block_occ, angles, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(17, 4))
    ax[0].hist(max_cov, bins=20, range=(0, 1), color="tab:green")
    ax[0].set_title("max coverage per episode")
    ax[0].axvline(0.95, color="k", ls="--", lw=1)
    ax[1].imshow(np.log1p(agent_occ), cmap="viridis")
    ax[1].set_title("agent occupancy (log)")
    ax[2].imshow(np.log1p(block_occ), cmap="viridis")
    ax[2].set_title("block occupancy (log)")
    mix = stats["behaviour_mix"]
    ax[3].barh(list(mix), list(mix.values()))
    ax[3].set_title("behaviour mix (fraction of steps)")
    for a in ax[1:3]:
        a.set_xticks([])
        a.set_yticks([])
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
