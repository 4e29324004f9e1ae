"""Ablation (issue 36), stage 1 of the compact latent: a CNN encoder to z (D numbers, tanh) and a broadcast
decoder that renders (z, the agent's position) back to a 128x128 frame (docs/experiments.md, "a compact
latent the dynamics only has to move"). Trains on 320 episodes of data/play_expert; resumes from RUN/ae.pt.

  python scripts/compact_latent/compact_ae.py RUN D MINUTES
  FREEZE_ENC=1 [CYCLE=W] python scripts/compact_latent/compact_ae.py RUN D MINUTES
      the decoder alone, the encoder frozen (the latents stay valid), cosine learning rate; CYCLE=W adds
      W * |enc(dec(z)) - z|^2 so that re-encoding a rendered frame returns its latent (also without FREEZE_ENC)
  PARTS=P: the decoder draws in P learned part frames (part_maps); NEW_DEC=1 (with FREEZE_ENC=1): a new decoder
  on RUN/ae.pt's encoder; without NEW_DEC, RUN/ae.pt's decoder gains part-frame inputs of zero weight
  N_EPS=K: train on K episodes instead of 320; LR=X: the learning rate (1e-3); EXTRA=DIR,DIR: all episodes of
  these collections as well
"""
import os, sys, time, math, json, random
import numpy as np, torch, torch.nn as nn, torch.nn.functional as F
from pathlib import Path
from iws_gym.data.episodes import read_episode, list_episodes


def gn(c): return nn.GroupNorm(8, c)

class Res(nn.Module):
    def __init__(s, c):
        super().__init__(); s.n1, s.c1, s.n2, s.c2 = gn(c), nn.Conv2d(c, c, 3, padding=1), gn(c), nn.Conv2d(c, c, 3, padding=1)
    def forward(s, x): return x + s.c2(F.silu(s.n2(s.c1(F.silu(s.n1(x))))))

class Enc(nn.Module):
    def __init__(s, D):
        super().__init__()
        s.net = nn.Sequential(nn.Conv2d(48, 64, 3, padding=1), Res(64),            # 32x32 (4x4 space-to-depth)
                              nn.Conv2d(64, 96, 3, 2, 1), Res(96),                    # 16
                              nn.Conv2d(96, 128, 3, 2, 1), Res(128),                  # 8
                              nn.Conv2d(128, 128, 3, 2, 1), Res(128),                 # 4
                              gn(128), nn.SiLU(), nn.Flatten(), nn.Linear(2048, 256), nn.SiLU(), nn.Linear(256, D))
    def forward(s, x):  # x (B,3,128,128) in [-1,1]
        return torch.tanh(s.net(F.pixel_unshuffle(x, 4)))

class FiLMConv(nn.Module):
    def __init__(s, c, cond):
        super().__init__(); s.n, s.c, s.f = gn(c), nn.Conv2d(c, c, 3, padding=1), nn.Linear(cond, 2 * c)
    def forward(s, x, e):
        g, b = s.f(e)[:, :, None, None].chunk(2, 1)
        return x + s.c(F.silu(s.n(x) * (1 + g) + b))

def coord_maps(B, n, agent, device):
    """(B, C, n, n): grid x, y, fourier features, and the agent's offset and blob (agent in [0,1])."""
    t = (torch.arange(n, device=device) + 0.5) / n
    y, x = torch.meshgrid(t, t, indexing="ij")
    base = [x, y] + [f(math.pi * k * v) for k in (1, 2, 4, 8) for v in (x, y) for f in (torch.sin, torch.cos)]
    base = torch.stack(base)[None].expand(B, -1, -1, -1)
    ax, ay = agent[:, 0, None, None], agent[:, 1, None, None]
    dx, dy = x[None] - ax, y[None] - ay
    blob = torch.exp(-(dx ** 2 + dy ** 2) / (2 * 0.03 ** 2))
    return torch.cat([base, torch.stack([dx * 4, dy * 4, blob], 1)], 1)

def part_maps(frames, n):
    """(B, P*18, n, n): the grid's coordinates in each of P learned part frames (B, P, 4: centre x, y, cos, sin),
    u = R^T (xy - t), scaled, with Fourier features. A shape drawn as a function of u moves and turns with its
    frame: a rigid object at any pose is the same drawing in its own coordinates."""
    t = (torch.arange(n, device=frames.device) + 0.5) / n
    y, x = torch.meshgrid(t, t, indexing="ij")
    dx, dy = x[None, None] - frames[..., 0, None, None], y[None, None] - frames[..., 1, None, None]
    c, s = frames[..., 2, None, None], frames[..., 3, None, None]
    u, v = (c * dx + s * dy) * 4, (-s * dx + c * dy) * 4  # part coordinates, about [-2, 2] over the frame
    feats = [u, v] + [f(math.pi * k * w / 2) for k in (1, 2, 4, 8) for w in (u, v) for f in (torch.sin, torch.cos)]
    return torch.stack(feats, 2).flatten(1, 2)


class Dec(nn.Module):
    def __init__(s, D, c=96, parts=0):
        super().__init__()
        s.parts = parts
        s.emb = nn.Sequential(nn.Linear(D + 2, 256), nn.SiLU(), nn.Linear(256, 256), nn.SiLU())
        s.inp = nn.Conv2d(2 + 16 + 3 + 18 * parts, c, 1)
        if parts:  # PARTS=P: P learned part frames (a pose-equivariant decoder; nothing in it names the object)
            s.frame = nn.Linear(256, 4 * parts)
        s.zin = nn.Linear(256, c)
        s.blocks = nn.ModuleList([FiLMConv(c, 256) for _ in range(5)])
        s.up1 = nn.Conv2d(c, 4 * 48, 3, padding=1); s.r1 = Res(48)
        s.up2 = nn.Conv2d(48, 4 * 24, 3, padding=1); s.n2 = gn(24); s.out = nn.Conv2d(24, 3, 3, padding=1)
    def forward(s, z, agent):
        B = z.shape[0]; e = s.emb(torch.cat([z, agent], 1))
        maps = coord_maps(B, 32, agent, z.device)
        if s.parts:
            f = s.frame(e).float().view(B, s.parts, 4)
            rot = F.normalize(f[..., 2:] + torch.tensor([1.0, 0.0], device=z.device), dim=-1)
            frames = torch.cat([0.5 + 0.75 * torch.tanh(f[..., :2]), rot], -1)
            maps = torch.cat([maps, part_maps(frames, 32)], 1)
        h = s.inp(maps) + s.zin(e)[:, :, None, None]
        for b in s.blocks: h = b(h, e)
        h = s.r1(F.pixel_shuffle(s.up1(F.silu(h)), 2))
        h = F.pixel_shuffle(s.up2(F.silu(h)), 2)
        return s.out(F.silu(s.n2(h)))

def add_part_inputs(old, new):
    """A trained decoder's weights for a PARTS decoder: the part-frame inputs start at zero weight, so the new
    decoder draws exactly what the old one drew and learns to use its part coordinates from there."""
    w = new["inp.weight"].clone().zero_(); w[:, : old["inp.weight"].shape[1]] = old["inp.weight"]
    return {**old, "inp.weight": w}


def extra_paths():
    """EXTRA=DIR,DIR: every episode of these collections too (e.g. `iws collect --mix random`)."""
    return [p for d in os.environ.get("EXTRA", "").split(",") if d for p in list_episodes(Path(d))]


def load_frames(n_eps, seed=0):
    paths = list_episodes(Path("data/play_expert")); random.Random(seed).shuffle(paths)
    fr, ag = [], []
    for p in paths[:n_eps] + extra_paths():
        e = read_episode(p, ["frames", "agent_pos"]); fr.append(e["frames"]); ag.append(e["agent_pos"])
    return np.concatenate(fr), np.concatenate(ag).astype(np.float32) / 512.0

if __name__ == "__main__":
    D = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    OUT = Path(sys.argv[1]); OUT.mkdir(parents=True, exist_ok=True)
    MINUTES = float(sys.argv[3]) if len(sys.argv) > 3 else 40
    torch.manual_seed(0)
    frames, agent = load_frames(int(os.environ.get("N_EPS", 320)))
    print("frames", frames.shape, flush=True)
    parts = int(os.environ.get("PARTS", 0))
    enc, dec = Enc(D), Dec(D, parts=parts)
    print("params enc %.2fM dec %.2fM" % (sum(p.numel() for p in enc.parameters()) / 1e6, sum(p.numel() for p in dec.parameters()) / 1e6), flush=True)
    freeze = bool(os.environ.get("FREEZE_ENC"))
    cycle = float(os.environ.get("CYCLE", 0))
    if freeze:
        enc.requires_grad_(False)
    params = list(dec.parameters()) if freeze else list(enc.parameters()) + list(dec.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    start, step, B = time.time(), 0, 32
    resume = OUT / "ae.pt"
    if resume.exists():
        ck = torch.load(resume); enc.load_state_dict(ck["enc"]); step = ck["step"]
        if os.environ.get("NEW_DEC") and not ck.get("new_dec"):  # a new decoder on a trained, frozen encoder
            print("decoder starts afresh"); step = 0
        elif parts and not ck.get("parts"):  # PARTS=P on a decoder without part frames: it starts as that decoder
            dec.load_state_dict(add_part_inputs(ck["dec"], dec.state_dict()), strict=False); print("part frames added")
        else:
            dec.load_state_dict(ck["dec"])
        if not freeze:
            try:
                opt.load_state_dict(ck["opt"])
            except ValueError:  # a checkpoint of a decoder-only run: the encoder's moments start afresh
                print("optimizer state not reused (a decoder-only checkpoint)")
    log = open(OUT / "ae_log.txt", "a")

    def save():
        torch.save(dict(enc=enc.state_dict(), dec=dec.state_dict(), opt=opt.state_dict(), step=step, D=D, parts=parts,
                        new_dec=bool(os.environ.get("NEW_DEC"))), resume)

    while time.time() - start < MINUTES * 60:
        idx = np.random.randint(0, len(frames), B)
        x = torch.from_numpy(frames[idx]).permute(0, 3, 1, 2).float() / 127.5 - 1
        a = torch.from_numpy(agent[idx])
        lr = float(os.environ.get("LR", 1e-3)) * min(1, (step + 1) / 300)
        if freeze:  # decoder polish: cosine from LR (5e-4) to 2e-5 over the run
            frac = (time.time() - start) / (MINUTES * 60)
            lr = 2e-5 + (float(os.environ.get("LR", 5e-4)) - 2e-5) * 0.5 * (1 + math.cos(math.pi * min(frac, 1)))
        for g in opt.param_groups: g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(not freeze):
            z = enc(x.contiguous(memory_format=torch.channels_last))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = z + 0.01 * torch.randn_like(z)  # a little latent noise: neighbouring codes decode alike
            y = dec(z.float(), a)
        err = (y.float() - x) ** 2
        fg = ((x - x.median()).abs().amax(1, keepdim=True) > 0.05).float()  # anything not background gets more weight
        loss = (err * (1 + 4 * fg)).mean()
        if cycle:  # the rendered frame must encode back to its latent: re-encoding then neither drifts nor moves the T
            with torch.autocast("cpu", dtype=torch.bfloat16):
                z2 = enc(y.clamp(-1, 1).contiguous(memory_format=torch.channels_last)).float()
            cyc = (z2 - z.detach().float()).pow(2).mean()
            loss = loss + cycle * cyc
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(params, 1.0); opt.step(); step += 1
        if step % 100 == 0:
            psnr = -10 * math.log10(((y.float().clamp(-1, 1) - x) ** 2).mean().item() / 4)
            msg = f"step {step} loss {loss.item():.5f} cyc {cyc.item() if cycle else 0:.5f} psnr {psnr:.2f} t {time.time()-start:.0f}s"
            print(msg, flush=True); log.write(msg + "\n"); log.flush()
        if step % 1000 == 0:
            save()
    save()
    print("done", step)
