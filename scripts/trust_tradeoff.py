"""How much of a policy study's gap the trust signal removes at each share of episodes kept (issue 34's third
target: mean |gap| over trusted episodes at least 30% smaller than over all, with >= 70% kept).

    python scripts/trust_tradeoff.py REPORT.json [REPORT.json ...] --json OUT.json [--plot OUT.png]

REPORT is an `iws eval correlate` report (per policy: each episode's lowest trust and its scores in both
worlds). For every share kept, episodes are kept by three rules, each applied to all episodes of the study
at once (as the env's fixed threshold is):
- trust: the episodes whose lowest trust is highest (the signal the env reports);
- trust_mean: the episodes whose mean trust over their steps is highest (reports from after 2026-12-07 hold
  it): how long an episode was wrong rather than how wrong;
- oracle: the episodes whose own |learned - gym-pusht| score is smallest (what no signal can beat on the
  per-episode gap; it needs the ground truth);
- random: a random subset (mean over 200 draws), what keeping fewer episodes does by itself.
For each it reports the study's mean |gap| (per policy |mean learned - mean gym-pusht| over its kept episodes,
averaged over the policies that keep any) and the per-episode mean |gap|.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SHARES = np.round(np.arange(0.2, 1.0001, 0.05), 2)


def load(path):
    d = json.loads(Path(path).read_text())
    pol, tmin, tmean, le, gt = [], [], [], [], []
    for k, (name, p) in enumerate(d["per_policy"].items()):
        if "trust" not in p:
            raise SystemExit(f"{path}: policy {name!r} has no per-episode trust (rerun iws eval correlate)")
        n = len(p["scores_learned"])
        pol += [k] * n
        tmin += p["trust"]["trust_min"]
        tmean = tmean + p["trust"]["trust_mean"] if tmean is not None and "trust_mean" in p["trust"] else None
        le += p["scores_learned"]
        gt += p["scores_ground_truth"]
    tmean = None if tmean is None else np.array(tmean, float)  # older reports hold only the lowest trust
    return d, np.array(pol), np.array(tmin, float), tmean, np.array(le, float), np.array(gt, float)


def study_gap(pol, le, gt, keep):
    """Mean over the policies that keep any episode of |mean learned - mean gym-pusht| over the kept ones."""
    gaps = [abs(le[m].mean() - gt[m].mean()) for k in np.unique(pol) if (m := keep & (pol == k)).any()]
    return float(np.mean(gaps)), len(gaps)


def keep_top(score, share, rng=None):
    """Keep the `share` of episodes with the highest score (ties broken at random when rng is given)."""
    n = int(round(share * len(score)))
    jitter = rng.random(len(score)) * 1e-9 if rng is not None else 0.0
    keep = np.zeros(len(score), bool)
    keep[np.argsort(-(score + jitter), kind="stable")[:n]] = True
    return keep


def tradeoff(pol, tmin, le, gt, seed=0, tmean=None):
    rng = np.random.default_rng(seed)
    err = np.abs(le - gt)
    all_gap, _ = study_gap(pol, le, gt, np.ones(len(le), bool))
    rows = []
    for s in SHARES:
        row = dict(kept_share=float(s))
        rules = [("trust", tmin), ("oracle", -err)] + ([("trust_mean", tmean)] if tmean is not None else [])
        for name, score in rules:
            keep = keep_top(score, s, rng)
            g, n_pol = study_gap(pol, le, gt, keep)
            row[name] = dict(study_gap=g, reduction=1 - g / all_gap, policies=n_pol, episode_gap=float(err[keep].mean()),
                             lowest_trust_kept=float(tmin[keep].min()))
        draws = [study_gap(pol, le, gt, keep_top(rng.random(len(le)), s))[0] for _ in range(200)]
        row["random"] = dict(study_gap=float(np.mean(draws)), reduction=1 - float(np.mean(draws)) / all_gap)
        rows.append(row)
    return dict(study_gap_all=all_gap, episode_gap_all=float(err.mean()), episodes=len(le), rows=rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+")
    p.add_argument("--json", required=True)
    p.add_argument("--plot")
    a = p.parse_args(argv)
    out = {}
    for r in a.reports:
        d, pol, tmin, tmean, le, gt = load(r)
        t = tradeoff(pol, tmin, le, gt, tmean=tmean)
        t["checkpoint"] = d.get("checkpoint")
        at70 = next(row for row in t["rows"] if row["kept_share"] == 0.7)
        t["at_70pct_kept"] = {k: at70[k]["reduction"] for k in ("trust", "trust_mean", "oracle", "random") if k in at70}
        out[r] = t
        print(f"{r}: study |gap| over all {t['study_gap_all']:.3f}; with 70% kept, reduction by trust "
              f"{at70['trust']['reduction']:+.0%}, by the oracle {at70['oracle']['reduction']:+.0%}, "
              f"at random {at70['random']['reduction']:+.0%}")
    Path(a.json).write_text(json.dumps(out, indent=1))
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(out), figsize=(5 * len(out), 4), squeeze=False)
        for ax, (r, t) in zip(axes[0], out.items()):
            s = [row["kept_share"] for row in t["rows"]]
            for k, style in (("trust", "-o"), ("trust_mean", "-s"), ("oracle", "--"), ("random", ":")):
                if k not in t["rows"][0]:
                    continue
                ax.plot(s, [row[k]["study_gap"] for row in t["rows"]], style, label=k)
            ax.axhline(0.7 * t["study_gap_all"], color="grey", lw=0.8, label="30% below all")
            ax.axvline(0.7, color="grey", lw=0.8, ls="--")
            ax.set(xlabel="share of episodes kept", ylabel="study mean |gap|", title=Path(r).stem)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)


if __name__ == "__main__":
    main()
