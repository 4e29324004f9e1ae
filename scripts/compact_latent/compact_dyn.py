"""Ablation (issue 36): dynamics on the compact global latent: an MLP over K latents, agent positions and actions,
trained on unrolled open-loop windows. Usage:
  python scripts/compact_latent/compact_dyn.py encode RUN          # encode data/play_expert -> RUN/latents.npz
  python scripts/compact_latent/compact_dyn.py train RUN MINUTES H # train the dynamics with H-step unrolls
  python scripts/compact_latent/compact_dyn.py proj RUN MINUTES    # train a latent denoiser (RUN/proj.pt)
Options by environment:
  EXTRA=DIR,DIR (encode) more collections, appended after data/play_expert's episodes
  GATE=1 a learned gate on the change that can be exactly zero; STILL=F a share F of windows of a world at rest
  (still_windows), with STILL_L1=W (0.1) the gate's L1 on them; INIT=DYN.pt fine-tune from a checkpoint;
  LR (1e-3); CTXN (0.05) the context noise; TAG a suffix of the output name (dyn_hH{TAG}.pt);
  EXTRA_SHARE=f EXTRA_FROM=i: a share f of training windows from episodes i and later (the EXTRA ones)
"""
import os, sys, time, math, json, random
import numpy as np, torch, torch.nn as nn, torch.nn.functional as F
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from compact_ae import Enc, Dec, extra_paths
from iws_gym.data.episodes import read_episode, list_episodes
from iws_gym.models.dynamics import agent_landing

K = 4
# the agent's motion law, fit_agent_motion on data/play_expert as `iws train stage2 --agent-track` logs it
LAW = (0.697776, -0.107374, 0.295672, 0.113927, 0.704328, 0.295672)


def load_ae(run):
    ck = torch.load(Path(run) / "ae.pt")
    enc, dec = Enc(ck["D"]), Dec(ck["D"], parts=ck.get("parts", 0))
    enc.load_state_dict(ck["enc"]); dec.load_state_dict(ck["dec"])
    return enc.eval(), dec.eval(), ck["D"]


def landing(p, a, n_valid):
    """The agent's next position by gym-pusht's motion law (linear, so the same in [0, 1] units as in px)."""
    return agent_landing(p, a, n_valid, LAW)


class Dyn(nn.Module):
    def __init__(s, D, width=512, blocks=6, gate=False):
        super().__init__()
        s.D, s.gate = D, gate
        s.inp = nn.Linear(K * (D + 4 + 1) + 2, width)
        s.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width)) for _ in range(blocks)])
        s.out = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, D))
        nn.init.zeros_(s.out[1].weight); nn.init.zeros_(s.out[1].bias)
        if gate:  # a learned switch that can be exactly zero: where nothing acts, z does not change at all
            s.g = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 1))
            nn.init.zeros_(s.g[1].weight); nn.init.constant_(s.g[1].bias, 1.0)
        s.register_buffer("z_mu", torch.zeros(D)); s.register_buffer("z_sd", torch.ones(D)); s.register_buffer("dz_sd", torch.ones(D))

    def forward(s, z, p, a, n_valid):
        """z (B,K,D) context latents (padded slots repeat the first valid), p (B,K,2) agent positions, a (B,K,2) actions
        taken at each slot, n_valid (B,). Returns z_{t+1}."""
        B = z.shape[0]
        mask = (torch.arange(K, device=z.device)[None] >= K - n_valid[:, None]).float()  # valid slots are the last n
        zn = (z - s.z_mu) / s.z_sd
        nxt = landing(p, a, n_valid)
        x = torch.cat([(zn * mask[..., None]).flatten(1), (p * 4 - 2).flatten(1), (a * 4 - 2).flatten(1), mask, nxt * 4 - 2], 1)
        h = s.inp(x)
        for b in s.blocks:
            h = h + b(h)
        dz = s.out(h) * s.dz_sd
        if s.gate:
            s.open = F.relu(s.g(h)).squeeze(1)  # kept for the training loss on still windows
            dz = dz * s.open[:, None]
        return z[:, -1] + dz


class Proj(nn.Module):
    """A denoiser of single latents (EDM preconditioning, sigma in units of z's standard deviation), given the
    agent's position: P(z + sigma * eps, sigma) ~ z. Applied to each predicted latent at a small sigma it pulls a
    rollout that drifted off the set of encodable scenes back onto it, in latent space (no decode/encode)."""
    def __init__(s, D, width=512, blocks=4):
        super().__init__()
        s.inp = nn.Linear(D + 2 + 1, width)
        s.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width)) for _ in range(blocks)])
        s.out = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, D))
        s.register_buffer("z_mu", torch.zeros(D)); s.register_buffer("z_sd", torch.ones(D))

    def forward(s, z, p, sigma):
        """z (B,D) noisy latents, p (B,2) agent positions in [0,1], sigma (B,) -> denoised z."""
        zn = (z - s.z_mu) / s.z_sd
        c_in, c_skip, c_out = (1 + sigma ** 2) ** -0.5, 1 / (1 + sigma ** 2), sigma * (1 + sigma ** 2) ** -0.5
        h = s.inp(torch.cat([zn * c_in[:, None], p * 4 - 2, sigma.log()[:, None] / 4], 1))
        for b in s.blocks:
            h = h + b(h)
        return (c_skip[:, None] * zn + c_out[:, None] * s.out(h)) * s.z_sd + s.z_mu


def train_proj(run, minutes):
    W = Windows(run)
    D = W.z.shape[1]
    torch.manual_seed(0)
    model = Proj(D); model.z_mu.copy_(W.z_mu); model.z_sd.copy_(W.z_sd)
    tr = torch.from_numpy(np.flatnonzero(~np.isin(W.ep.numpy(), W.val)))
    va = torch.from_numpy(np.flatnonzero(np.isin(W.ep.numpy(), W.val)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    start, step, total = time.time(), 0, minutes * 60
    log = open(Path(run) / "proj_log.txt", "a")
    while time.time() - start < total:
        frac = (time.time() - start) / total
        for g in opt.param_groups: g["lr"] = 1e-3 * min(1, (step + 1) / 200) * (0.5 * (1 + math.cos(math.pi * frac)) * 0.95 + 0.05)
        rows = tr[torch.randint(len(tr), (512,))]
        z, p = W.z[rows], W.p[rows]
        sigma = torch.exp(torch.empty(512).uniform_(math.log(0.005), math.log(2.0)))
        den = model(z + sigma[:, None] * W.z_sd * torch.randn_like(z), p, sigma)
        loss = ((((den - z) / W.z_sd) ** 2).mean(1) * (1 + sigma ** 2) / sigma ** 2).mean()
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); step += 1
        if step % 500 == 0:
            with torch.no_grad():
                rows = va[torch.from_numpy(np.random.default_rng(0).choice(len(va), 4096))]
                z, p = W.z[rows], W.p[rows]
                parts = []
                for sg in (0.01, 0.05, 0.2):  # error left after denoising, in z standard deviations (input error: sg)
                    s_ = torch.full((len(z),), sg)
                    e = model(z + sg * W.z_sd * torch.randn(z.shape, generator=torch.Generator().manual_seed(1)), p, s_)
                    parts.append(f"@{sg} {(((e - z) / W.z_sd) ** 2).mean().sqrt():.4f}")
                ident = (((model(z, p, torch.full((len(z),), 0.05)) - z) / W.z_sd) ** 2).mean().sqrt()
            msg = f"step {step} loss {loss.item():.4f} val rms " + " ".join(parts) + f" clean-in@0.05 {ident:.4f} t {time.time()-start:.0f}"
            print(msg, flush=True); log.write(msg + "\n"); log.flush()
    torch.save(dict(model=model.state_dict(), D=D, step=step), Path(run) / "proj.pt")
    print("done", step)


def encode(run):
    enc, dec, D = load_ae(run)
    out = dict(z=[], p=[], a=[], ep=[])
    paths = list_episodes(Path("data/play_expert"))
    if os.environ.get("MAX_EPS"):
        paths = paths[:: len(paths) // int(os.environ["MAX_EPS"])]
    paths += extra_paths()
    from tqdm import tqdm
    with torch.no_grad():
        for i, path in enumerate(tqdm(paths, desc="encode")):
            e = read_episode(path, ["frames", "agent_pos", "actions"])
            zs = []
            for j in range(0, len(e["frames"]), 128):
                x = torch.from_numpy(e["frames"][j:j + 128]).permute(0, 3, 1, 2).float() / 127.5 - 1
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    zs.append(enc(x.contiguous(memory_format=torch.channels_last)).float())
            out["z"].append(torch.cat(zs).numpy()); out["p"].append(e["agent_pos"] / 512.0)
            out["a"].append(np.r_[e["actions"], e["actions"][-1:]] / 512.0); out["ep"].append(np.full(len(e["frames"]), i))
    np.savez(Path(run) / "latents.npz", **{k: np.concatenate(v).astype(np.float32 if k != "ep" else np.int32) for k, v in out.items()})


class Windows:
    def __init__(s, run, val_eps=40):
        d = np.load(Path(run) / "latents.npz")
        s.z, s.p, s.a, s.ep = (torch.from_numpy(d[k]) for k in ("z", "p", "a", "ep"))
        eps = s.ep.numpy()
        n_ep = eps.max() + 1
        rng = np.random.default_rng(0)
        s.val_ids = set(rng.choice(n_ep, val_eps, replace=False).tolist())
        start = np.r_[0, np.flatnonzero(np.diff(eps)) + 1]; end = np.r_[start[1:], len(eps)]
        s.spans = [(b, e) for b, e in zip(start, end)]
        s.train_eps = [i for i in range(n_ep) if i not in s.val_ids]
        s.val = sorted(s.val_ids)
        s.dz_sd = (s.z[1:] - s.z[:-1]).std(0)
        s.z_mu, s.z_sd = s.z.mean(0), s.z.std(0)

    def sample(s, B, H, eps):
        """Windows of K+H frames: indices (B, K+H) into the flat arrays; with a random history length 1..K
        (padded slots repeat the first valid)."""
        ids = np.random.choice(eps, B)
        if os.environ.get("EXTRA_SHARE"):  # EXTRA_SHARE=f EXTRA_FROM=i: a share f of windows from episodes >= i (encode's EXTRA)
            extra = [e for e in eps if e >= int(os.environ["EXTRA_FROM"])]
            pick = np.random.rand(B) < float(os.environ["EXTRA_SHARE"])
            ids[pick] = np.random.choice(extra, int(pick.sum()))
        rows = []
        n_valid = np.random.randint(1, K + 1, B)
        n_valid[np.random.rand(B) < 0.5] = K
        for i, nv in zip(ids, n_valid):
            b, e = s.spans[i]
            t0 = np.random.randint(b, e - H - nv + 1)  # first valid frame
            idx = np.r_[np.full(K - nv, t0), np.arange(t0, t0 + nv + H)]
            rows.append(idx)
        return torch.from_numpy(np.stack(rows)), torch.from_numpy(n_valid)


def still_windows(W, idx, frac):
    """Replace a share `frac` of the windows by a world at rest: one frame repeated, the agent commanded to stay
    where it is. This is what a recording of an idle robot looks like (in gym-pusht nothing moves then); play data
    has almost none of it (3% of steps with the agent slower than 0.5 px)."""
    still = torch.rand(idx.shape[0]) < frac
    idx = idx.clone()
    idx[still] = idx[still, -1:]
    return idx, still


def unroll(model, W, idx, nv, H, ctx_noise=0.0, still=None):
    """Open loop from the true context: returns predictions (B, H, D) and targets. Rows flagged `still` command
    the agent to hold its position (action = its position)."""
    z = W.z[idx[:, :K]].clone()
    if ctx_noise:
        z = z + ctx_noise * W.z_sd * torch.randn_like(z) * torch.rand(z.shape[0], 1, 1)
    preds, opens = [], []
    for h in range(H):
        sl = idx[:, h:h + K]
        nvh = torch.clamp(nv + h, max=K)
        a = W.a[sl]
        if still is not None:
            a = torch.where(still[:, None, None], W.p[sl], a)
        zn = model(z, W.p[sl], a, nvh)
        preds.append(zn)
        if model.gate:
            opens.append(model.open)
        z = torch.cat([z[:, 1:], zn[:, None]], 1)
        # padded slots: keep repeating the first valid latent (already the case since earlier slots hold it)
    model.opens = torch.stack(opens, 1) if opens else None  # (B, H) the gate at each step
    return torch.stack(preds, 1), W.z[idx[:, K:K + H]]


@torch.no_grad()
def hold_drift(model, W, n, steps):
    """Median distance (in z's standard deviations) that `steps` steps of a held agent move validation latents:
    0 in gym-pusht."""
    rows = torch.from_numpy(np.random.default_rng(1).choice(np.flatnonzero(np.isin(W.ep.numpy(), W.val)), n))
    z0, p = W.z[rows][:, None].repeat(1, K, 1), W.p[rows][:, None].repeat(1, K, 1)
    z, nv = z0.clone(), torch.full((n,), K)
    for _ in range(steps):
        z = torch.cat([z[:, 1:], model(z, p, p, nv)[:, None]], 1)
    return ((z[:, -1] - z0[:, -1]) / W.z_sd).norm(dim=1).median().item()


def train(run, minutes, H):
    W = Windows(run)
    D = W.z.shape[1]
    torch.manual_seed(0); np.random.seed(0)
    model = Dyn(D, gate=bool(int(os.environ.get("GATE", 0))))
    model.z_mu.copy_(W.z_mu); model.z_sd.copy_(W.z_sd); model.dz_sd.copy_(W.dz_sd)
    still_frac = float(os.environ.get("STILL", 0))  # share of windows of a world at rest (still_windows)
    still_l1 = float(os.environ.get("STILL_L1", 0.1))  # weight of the gate's L1 on still windows
    tag = os.environ.get("TAG", "")
    if os.environ.get("INIT"):  # fine-tune from a dynamics checkpoint (a gate, if new, starts open)
        model.load_state_dict(torch.load(os.environ["INIT"])["model"], strict=False)
        model.z_mu.copy_(W.z_mu); model.z_sd.copy_(W.z_sd); model.dz_sd.copy_(W.dz_sd)  # this run's latents' statistics
    lr0 = float(os.environ.get("LR", 1e-3))
    ctx_noise = float(os.environ.get("CTXN", 0.05))  # the context's noise: up to this many z standard deviations
    print("dyn params %.2fM" % (sum(p.numel() for p in model.parameters()) / 1e6), flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    start, step, B = time.time(), 0, 128
    log = open(Path(run) / f"dyn_h{H}{tag}_log.txt", "a")
    total = minutes * 60
    while time.time() - start < total:
        frac = (time.time() - start) / total
        lr = lr0 * min(1, (step + 1) / 200) * (0.5 * (1 + math.cos(math.pi * frac)) * 0.95 + 0.05)
        for g in opt.param_groups: g["lr"] = lr
        hh = H if H <= 2 else int(np.random.choice([2, H // 2, H]))
        idx, nv = W.sample(B, hh, W.train_eps)
        still = None
        if still_frac:
            idx, still = still_windows(W, idx, still_frac)
        pred, tgt = unroll(model, W, idx, nv, hh, ctx_noise=ctx_noise, still=still)
        loss = (((pred - tgt) / W.z_sd) ** 2).mean()
        if still is not None and still.any() and model.gate:  # at rest, z must not move at all, not just a little:
            loss = loss + still_l1 * model.opens[still].mean()  # an L1 pull on the gate, which can close exactly
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); step += 1
        if step % 200 == 0:
            with torch.no_grad():
                np.random.seed(step)
                idx, nv = W.sample(256, 32, W.val)
                nv[:] = K
                pred, tgt = unroll(model, W, idx, nv, 32)
                e = (((pred - tgt) / W.z_sd) ** 2).mean((0, 2))
                copy = (((W.z[idx[:, K - 1:K]] - tgt) / W.z_sd) ** 2).mean((0, 2))
            np.random.seed(None)
            hold = hold_drift(model, W, 64, 100)
            msg = f"step {step} loss {loss.item():.4f} val@1 {e[0]:.4f} @8 {e[7]:.4f} @32 {e[31]:.4f} (copy @1 {copy[0]:.4f} @32 {copy[31]:.4f}) hold100 {hold:.3f} t {time.time()-start:.0f}"
            print(msg, flush=True); log.write(msg + "\n"); log.flush()
    torch.save(dict(model=model.state_dict(), D=D, step=step, H=H, still=still_frac, gate=model.gate), Path(run) / f"dyn_h{H}{tag}.pt")
    print("done", step)


if __name__ == "__main__":
    if sys.argv[1] == "encode":
        encode(sys.argv[2])
    elif sys.argv[1] == "train":
        train(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "proj":
        train_proj(sys.argv[2], float(sys.argv[3]))
