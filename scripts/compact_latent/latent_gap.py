"""How well a compact stage 2 generalises: open-loop latent error at steps 1, 8 and 32 on training episodes
against held-out validation episodes (16 x 48 steps, compact2's own evaluation set), same window protocol.

  python scripts/compact_latent/latent_gap.py CACHE.pt OUT.json STAGE2.safetensors [STAGE2 ...]
  UNSEEN=data/play_more:200,data/random_more:100 python scripts/compact_latent/latent_gap.py ...

UNSEEN adds a third set: the first N episodes of each named collection, collected like the training data (same
generator, other seeds) but never trained on. Its error says whether the validation gap is memorisation (unseen
episodes as hard as validation ones) or a harder validation distribution (unseen as easy as training ones).

CACHE.pt: the training latents a compact2 run cached in its folder (`latents_<stage-1 sha>_<n>.pt`); every
stage 2 must belong to the stage 1 of the first release's folder. Errors are in units of z's variance, averaged
over 4 x 256 windows (mean and standard error over the 4 draws)."""
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from iws_gym.data.collect import heldout_episodes
from iws_gym.data.episodes import list_episodes, read_episode
from iws_gym.envs.registry import load_task
from iws_gym.models.checkpoint import load_release, load_state_checked
from iws_gym.models.compact import (STAGE1_KIND, STAGE2_KIND, CompactStage1, CompactStage1Config, CompactStage2,
                                    CompactStage2Config)
from iws_gym.training.compact2 import Latents, open_loop_error


def errors(dyn, L, H=32, draws=4, n=256):
    out = []
    for seed in range(draws):
        with torch.no_grad():
            e = open_loop_error(dyn, L, np.random.default_rng(seed), n, H)[0]
        out.append([e[0].item(), e[7].item(), e[H - 1].item()])
    m, se = np.mean(out, 0), np.std(out, 0) / np.sqrt(draws)
    return {f"@{h}": [round(float(a), 5), round(float(b), 5)] for h, a, b in zip((1, 8, H), m, se)}


def main():
    cache, out, files = sys.argv[1], sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    train = torch.load(cache, weights_only=False)
    s1_file = Path(files[0]).parent / "stage1.safetensors"
    cfg1, sd1, _ = load_release(s1_file, STAGE1_KIND, CompactStage1Config)
    s1 = CompactStage1(cfg1)
    load_state_checked(s1, sd1, s1_file)
    val = Latents.encode(list(heldout_episodes(load_task("tpushing"), 16, 48, "validation")), s1.eval().encoder,
                         "cpu", True)
    sets = dict(train=train, validation=val)
    unseen = os.environ.get("UNSEEN", "")
    if unseen:
        paths = [p for item in unseen.split(",") for d, n in [item.rsplit(":", 1)] for p in list_episodes(d)[: int(n)]]
        sets["unseen"] = Latents.encode((read_episode(p, ["frames", "agent_pos", "actions"]) for p in paths),
                                        s1.encoder, "cpu", True)
    rep = dict(command=(f"UNSEEN={unseen} " if unseen else "") + "python scripts/compact_latent/latent_gap.py "
               + " ".join(sys.argv[1:]), stage1=str(s1_file), train_episodes=len(train.spans), results={})
    for f in files:
        cfg, sd, _ = load_release(f, STAGE2_KIND, CompactStage2Config)
        m = CompactStage2(cfg)
        load_state_checked(m, sd, f)
        m.eval()
        rep["results"][f] = {k: errors(m.dynamics, L) for k, L in sets.items()}
        print(f, json.dumps(rep["results"][f]))
    Path(out).write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
