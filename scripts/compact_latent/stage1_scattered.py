"""Ablation (issue 36, twenty-fourth session; lost): does a compact stage 1 fine-tuned on frames of random valid
states (the T anywhere, a third of them against a wall; `behaviours.scattered_state`) draw a whole T in more
round trips of real frames? Its round trips at rare poses draw Y- and L-shaped blends.

    python scripts/compact_latent/stage1_scattered.py eval checkpoints/candidates/compact/stage1.safetensors runs/s1/base.json
    python scripts/compact_latent/stage1_scattered.py eval runs/recipe_compact/compact1/last.pt runs/s1/recipe.json  # mid-training
    python scripts/compact_latent/stage1_scattered.py train checkpoints/candidates/compact/stage1.safetensors runs/s1/dec50 \
        --steps 400 --share 0.5 --lr 3e-5 --ema 0.998 --data DATA --max-episodes 150 --eval-every 400
    python scripts/compact_latent/stage1_scattered.py report OUT.json runs/s1/base.json runs/s1/dec50 ...
    python scripts/compact_latent/stage1_scattered.py grid checkpoints/candidates/compact/stage1.safetensors OUT.png
    python scripts/compact_latent/stage1_scattered.py zopt checkpoints/candidates/compact/stage1.safetensors OUT.json --n 48
    python scripts/compact_latent/stage1_scattered.py codes checkpoints/candidates/compact/stage1.safetensors OUT.json
    python scripts/compact_latent/stage1_scattered.py injectivity checkpoints/candidates/compact/stage1.safetensors OUT.json

`zopt` (twenty-fifth session) asks whose fault a blend is: for the first --n random states whose round trip is not
whole (and 16 whose round trip is, as a control), z is optimised by Adam (lr 0.02) on the frame's MSE through the
frozen decoder, starting from the encoder's code; the report gives the whole share and PSNR after 10, 30, 100
and 300 steps and where the optimised codes lie against the encoder's codes of all 800 states.

`codes` and `injectivity` (twenty-sixth session) ask whether blended round trips are the frames whose code sits at
tanh's edge, or whose code moves little when the T moves; `train --cosine F` decays the rate to F * --lr and
`--cycle 0` drops the cycle term, to tell the constant rate and the term apart from the random states.

Evaluation sets, all held out: 8 episodes of scripted play and 8 of random targets (600 steps, every 5th frame,
split stability_check) and 800 random valid states; the whole-T rule calibrated as `iws eval stability` does.
`whole_given_real`: the share of round trips whole among frames whose real frame passes the rule. Training:
`--share` of each batch random states (20,000 rendered, seed 0), the rest frames of `--data` (the recipe's play
collection), frame loss as `iws train compact1`; the encoder frozen unless `--train-encoder`; EMA weights evaluated
(`--ema 0`: the raw weights).
"""
import argparse, json, sys, time
from pathlib import Path

import numpy as np
import torch

from iws_gym.envs.registry import load_task
from iws_gym.data.collect import heldout_episodes
from iws_gym.models.checkpoint import load_release, save_release
from iws_gym.models.compact import CANVAS, STAGE1_KIND, CompactStage1Config
from iws_gym.models.frames import frames_to_tensor, tensor_to_frames
from iws_gym.evaluation.stability import reference_frames
from iws_gym.training.common import psnr

task = load_task("tpushing")
ck = task.module.checks()


def random_states(n, seed):
    from iws_gym.tasks.pusht.behaviours import scattered_state
    from iws_gym.tasks.pusht.groundtruth import make_env, render_states

    rng = np.random.default_rng([seed, 11])
    agents, poses = zip(*(scattered_state(rng) for _ in range(n)))
    agents = np.array(agents, np.float32)
    env = make_env(128)
    frames = np.concatenate([render_states(agents[i:i + 500], np.array(poses[i:i + 500]), 128, env) for i in range(0, n, 500)])
    return frames, agents


def eval_sets():
    cache = Path("runs/stage1_scattered_eval.npz")
    if cache.is_file():
        d = np.load(cache)
        return {k: (d[k + "_f"], d[k + "_a"]) for k in ("scripted", "random", "states")}, d["calib"]
    sets = {}
    for name, beh in (("scripted", "mix"), ("random", "random")):
        eps = list(heldout_episodes(task, 8, 600, "stability_check", behaviour=beh))
        sets[name] = (np.concatenate([e["frames"][5::5] for e in eps]), np.concatenate([e["agent_pos"][5::5] for e in eps]).astype(np.float32))
    sets["states"] = random_states(800, seed=12345)
    calib = reference_frames(task, 8, 200, "stability_calibration")
    np.savez(cache, calib=calib, **{k + "_f": v[0] for k, v in sets.items()}, **{k + "_a": v[1] for k, v in sets.items()})
    return sets, calib


@torch.no_grad()
def round_trip(m, f, a):
    out = []
    for i in range(0, len(f), 64):
        x = frames_to_tensor(f[i:i + 64], "cpu")
        with torch.autocast("cpu", torch.bfloat16):
            y = m.decoder(m.encoder(x), torch.as_tensor(a[i:i + 64] / CANVAS))
        out.append(y.float().clamp(-1, 1))
    y = torch.cat(out)
    x = frames_to_tensor(f, "cpu")
    p = psnr(y, x).mean().item()
    return tensor_to_frames(y), p


@torch.no_grad()
def encode(m, f):
    """The encoder's codes (N, z_dim) of uint8 frames, 64 at a time."""
    return torch.cat([m.encoder(frames_to_tensor(f[i:i + 64], "cpu")).float() for i in range(0, len(f), 64)])


def whole_mask(frames, whole):
    return np.array([ck.is_whole(g, whole) for g in frames])


def evaluate(m, sets, whole):
    m.eval()
    res = {}
    for k, (f, a) in sets.items():
        img, p = round_trip(m, f, a)
        w = whole_mask(img, whole)
        rw = whole_mask(f, whole)
        res[k] = dict(whole=float(w.mean()), psnr=round(p, 2), real_whole=float(rw.mean()),
                      whole_given_real=float(w[rw].mean()))
    m.train()
    return res


def optimise_codes(m, states, whole, n, lr=0.02, steps=300, checks=(10, 30, 100, 300)):
    f, a = states
    img, _ = round_trip(m, f, a)
    rw = whole_mask(f, whole)
    w = whole_mask(img, whole)
    for p in m.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        z_all = encode(m, f)
    out = dict(states=len(f), round_trip_whole_given_real=float(w[rw].mean()), lr=lr,
               encoder_codes=dict(abs_max=float(z_all.abs().max()), sd=float(z_all.std(0).mean())))
    for name, idx in (("failures", np.flatnonzero(rw & ~w)[:n]), ("control", np.flatnonzero(rw & w)[:16])):
        x, ag = frames_to_tensor(f[idx], "cpu"), torch.as_tensor(a[idx] / CANVAS)
        z0 = z_all[idx]
        z = z0.clone().requires_grad_(True)
        opt = torch.optim.Adam([z], lr)
        curve = []
        for step in range(1, steps + 1):
            with torch.autocast("cpu", torch.bfloat16):
                y = m.decoder(z, ag)
            loss = ((y.float() - x) ** 2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            if step in checks:
                with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
                    y = m.decoder(z, ag).float().clamp(-1, 1)
                im = tensor_to_frames(y)
                curve.append(dict(steps=step, whole=float(whole_mask(im, whole).mean()),
                                  psnr=round(psnr(y, x).mean().item(), 2)))
                print(name, curve[-1], flush=True)
        zd = z.detach()
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            p0 = psnr(m.decoder(z0, ag).float().clamp(-1, 1), x).mean().item()
        out[name] = dict(n=len(idx), psnr_encoder_code=round(p0, 2), curve=curve,
                         moved=float((zd - z0).norm(dim=1).mean()), to_nearest_encoder_code=float(torch.cdist(zd, z_all).min(1).values.mean()),
                         share_outside_tanh_range=float((zd.abs() > 1).float().mean()), abs_max=float(zd.abs().max()))
    return out


@torch.no_grad()
def code_saturation(m, sets, whole, edge=0.95):
    """Are blended round trips the ones whose code sits at tanh's edge? Per set: the share of z's coordinates with
    |z| > edge, and the whole share of the round trips, split by whether any coordinate is beyond the edge."""
    out = dict(edge=edge)
    for k, (f, a) in sets.items():
        z = encode(m, f)
        img, _ = round_trip(m, f, a)
        rw = whole_mask(f, whole)
        w = whole_mask(img, whole)[rw]
        sat = (z.abs() > edge).numpy()[rw]
        any_sat = sat.any(1)
        out[k] = dict(frames=int(rw.sum()), coords_beyond_edge=float(sat.mean()), frames_with_one=float(any_sat.mean()),
                      whole_with_one=float(w[any_sat].mean()) if any_sat.any() else None,
                      whole_without=float(w[~any_sat].mean()) if (~any_sat).any() else None,
                      abs_z_mean_whole=float(np.abs(z.numpy()[rw][w]).mean()),
                      abs_z_mean_blended=float(np.abs(z.numpy()[rw][~w]).mean()) if (~w).any() else None)
    return out


@torch.no_grad()
def injectivity(m, sets, whole, k=5):
    """Does the encoder give different poses of the random states different codes? For each of the 800 states,
    its k nearest neighbours by code: how far their T lies from its T (the mean distance between corresponding
    corners of the two Ts, frame px), for states whose round trip is whole and for those it blends; and how far
    its code moves per frame px of corner motion when its T alone moves 2 px along x or y or turns 0.05 rad."""
    from iws_gym.tasks.pusht.behaviours import scattered_state
    from iws_gym.tasks.pusht.groundtruth import make_env, render_states, t_polygons

    f, a = sets["states"]
    rng = np.random.default_rng([12345, 11])  # the poses random_states(800, seed=12345) drew
    poses = np.array([scattered_state(rng)[1] for _ in range(len(f))])
    corners = np.stack([np.concatenate(t_polygons(b)) for b in poses]) / 4  # (N, C, 2) in 128-px frame units
    z = encode(m, f)
    img, _ = round_trip(m, f, a)
    w = whole_mask(img, whole)
    dz = torch.cdist(z, z).numpy()
    np.fill_diagonal(dz, np.inf)
    nn_ = np.argsort(dz, 1)[:, :k]
    pose_d = np.linalg.norm(corners[:, None] - corners[nn_], axis=-1).mean(-1)  # (N, k)
    far = (pose_d > 10).mean(1)  # share of the k code-neighbours whose T lies > 10 px away
    # sensitivity: how far the code moves when the T moves 2 frame px along x, along y, or turns 0.05 rad
    env = make_env(128)
    sens = []
    for d in ((8.0, 0, 0), (0, 8.0, 0), (0, 0, 0.05)):
        q = poses + np.array(d)
        fq = np.concatenate([render_states(a[i:i + 500], q[i:i + 500], 128, env) for i in range(0, len(f), 500)])
        zq = encode(m, fq)
        cq = np.stack([np.concatenate(t_polygons(b)) for b in q]) / 4
        sens.append((zq - z).norm(dim=1).numpy() / np.linalg.norm(cq - corners, axis=-1).mean(-1))
    sens = np.stack(sens, 1)  # (N, 3): code distance per frame px of corner motion
    out = dict(k=k, states=len(f), whole=float(w.mean()))
    for name, sel in (("whole", w), ("blended", ~w)):
        out[name] = dict(n=int(sel.sum()), code_dist_nn1_median=float(np.median(dz[sel].min(1))),
                         pose_px_of_code_nn1_median=float(np.median(pose_d[sel, 0])),
                         pose_px_of_code_nn_mean_median=float(np.median(pose_d[sel].mean(1))),
                         share_of_code_nn_beyond_10px=float(far[sel].mean()),
                         code_per_px_x_y_angle_median=[round(float(v), 4) for v in np.median(sens[sel], 0)])
    return out


def load(path, train_encoder=False, cycle=0.5):
    """The release (or a training checkpoint's EMA weights: a .pt file) as compact1's Trainable, whose forward is
    `iws train compact1`'s loss: with the encoder frozen from step 0 (the cycle term on), or never frozen
    (`train_encoder`: the term off)."""
    from iws_gym.training.compact1 import Options, Trainable

    if str(path).endswith(".pt"):  # a training checkpoint (`iws train compact1`'s last.pt): its EMA weights
        state = torch.load(path, map_location="cpu", weights_only=False)
        cfg, sd = CompactStage1Config(**state["model_config"]), state["ema"]
    else:
        cfg, sd, _ = load_release(Path(path), STAGE1_KIND, CompactStage1Config)
    m = Trainable(cfg, Options(freeze_encoder_at=1.0 if train_encoder else 0.0, cycle=cycle), 10 ** 9)
    m.load_state_dict(sd)
    return cfg, m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["eval", "train", "report", "grid", "zopt", "codes", "injectivity"]); ap.add_argument("stage1"); ap.add_argument("out")
    ap.add_argument("runs", nargs="*")
    ap.add_argument("--steps", type=int, default=3000); ap.add_argument("--share", type=float, default=0.5)
    ap.add_argument("--data", default=""); ap.add_argument("--n-states", type=int, default=20000)
    ap.add_argument("--lr", type=float, default=1e-4); ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--train-encoder", action="store_true"); ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--encoder-only", action="store_true", help="train the encoder alone against the frozen decoder")
    ap.add_argument("--n", type=int, default=48, help="zopt: failures to optimise")
    ap.add_argument("--cycle", type=float, default=0.5, help="weight of compact1's cycle term (frozen encoder only)")
    ap.add_argument("--cosine", type=float, default=None,
                    help="decay the rate by a cosine to this share of --lr over --steps (default: constant)")
    ap.add_argument("--max-episodes", type=int, default=60); ap.add_argument("--eval-every", type=int, default=500)
    a = ap.parse_args()
    if a.mode == "report":  # stage1 is the output file here, out the base evaluation, the rest run folders
        base = json.loads(Path(a.out).read_text())
        runs = {Path(r).name: json.loads((Path(r) / "log.json").read_text()) for r in a.runs}
        rep = dict(command="python " + " ".join(sys.argv), base=dict(stage1="checkpoints/candidates/compact/stage1.safetensors", **base),
                   runs={k: dict(args=v["args"], evals=v["evals"]) for k, v in runs.items()})
        Path(a.stage1).write_text(json.dumps(rep, indent=1)); print(json.dumps(rep)[:2000]); return
    sets, calib = eval_sets()
    whole = ck.calibrate_whole(calib)
    cfg, m = load(a.stage1, a.train_encoder or a.encoder_only, a.cycle)
    if a.mode == "grid":  # real | round trip | difference, for random states whose round trip fails the rule
        from PIL import Image

        f, ag = sets["states"][0][:240], sets["states"][1][:240]
        img, _ = round_trip(m.eval(), f, ag)
        bad = [i for i in range(len(f)) if not ck.is_whole(img[i], whole)][:8]
        rows = [np.concatenate([f[i], img[i], np.abs(f[i].astype(int) - img[i].astype(int)).astype(np.uint8)], 1) for i in bad]
        Image.fromarray(np.concatenate([np.concatenate(rows[j:j + 2], 1) for j in range(0, len(rows) - 1, 2)])).save(a.out)
        print(f"{len(bad)} shown; {a.out}"); return
    measure = dict(zopt=lambda: optimise_codes(m.eval(), sets["states"], whole, a.n),
                   injectivity=lambda: injectivity(m.eval(), sets, whole),
                   codes=lambda: code_saturation(m.eval(), sets, whole), eval=lambda: evaluate(m, sets, whole))
    if a.mode in measure:
        r = dict(stage1=a.stage1, command="python " + " ".join(sys.argv), **measure[a.mode]())
        if a.mode == "eval" and a.stage1.endswith(".pt"):
            r["step"] = torch.load(a.stage1, map_location="cpu", weights_only=False)["step"]
        print(json.dumps(r)); Path(a.out).write_text(json.dumps(r, indent=1)); return
    from iws_gym.training.compact1 import FramesWithAgent
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    data = FramesWithAgent([Path(d) for d in a.data.split(",") if d], a.max_episodes) if a.share < 1 else None
    sf, sa = random_states(a.n_states, seed=0) if a.share > 0 else (None, None)
    if not (a.train_encoder or a.encoder_only):
        for p in m.encoder.parameters():
            p.requires_grad_(False)
    if a.encoder_only:
        for p in m.decoder.parameters():
            p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], a.lr)
    import copy
    ema = copy.deepcopy(m)
    rng = np.random.default_rng(0)
    log = dict(args=vars(a), evals=[])
    t0 = time.time()
    for step in range(1, a.steps + 1):
        ns = int(round(a.batch * a.share))
        fs, ps = [], []
        if ns:
            i = rng.integers(0, len(sf), ns); fs.append(sf[i]); ps.append(sa[i] / CANVAS)
        if a.batch - ns:
            f, p = data.sample(rng, a.batch - ns); fs.append(f); ps.append(p)
        x = frames_to_tensor(np.concatenate(fs), "cpu"); p = torch.as_tensor(np.concatenate(ps), dtype=torch.float32)
        if a.cosine is not None:
            for g in opt.param_groups:
                g["lr"] = a.lr * (a.cosine + (1 - a.cosine) * 0.5 * (1 + np.cos(np.pi * (step - 1) / a.steps)))
        with torch.autocast("cpu", torch.bfloat16):  # compact1's loss: frozen encoder -> cycle term on, else off
            loss, logs = m((x, p), step)
        opt.zero_grad(); loss.backward(); opt.step()
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), m.parameters()):
                pe.lerp_(pm, 1 - a.ema)
        if step % 50 == 0:
            print(f"step {step} {logs} {(time.time()-t0)/step:.2f}s/step", flush=True)
        if step % a.eval_every == 0 or step == a.steps:
            log["evals"].append(dict(step=step, **evaluate(ema, sets, whole))); print(log["evals"][-1], flush=True)
            save_release(out / "stage1.safetensors", ema.state_dict(), STAGE1_KIND, cfg,
                         dict(finetuned_from=a.stage1, step=step, command=" ".join(sys.argv)))
            (out / "log.json").write_text(json.dumps(log, indent=1))


if __name__ == "__main__":
    main()
