"""Two `iws eval stability` reports of the same drives (same --seed and --drives), paired drive by drive: for each
kind, the mean difference of the T-whole share (B - A) with a bootstrap 95% interval over drives, and how many
drives B keeps whole more / less often than A.

    python scripts/compact_latent/paired_drives.py A.json B.json --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from iws_gym.evaluation.fidelity import bootstrap_ci


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--json", required=True)
    o = ap.parse_args(argv)
    A, B = (json.load(open(p)) for p in (o.a, o.b))
    if (A["seed"], A["drives"], A["steps"]) != (B["seed"], B["drives"], B["steps"]):
        raise ValueError(f"not the same drives: seed/drives/steps {A['seed'], A['drives'], A['steps']} against "
                         f"{B['seed'], B['drives'], B['steps']}")
    out = dict(command=" ".join(["python"] + sys.argv), a=o.a, b=o.b, drives=A["drives"], kinds={})
    for k in sorted(set(A["rollouts"]) & set(B["rollouts"])):
        x, y = (np.array([d["t_whole_share"] for d in r["rollouts"][k]["per_drive"]]) for r in (A, B))
        d = y - x
        out["kinds"][k] = dict(a=float(x.mean()), b=float(y.mean()), diff_b_minus_a=float(d.mean()),
                               diff_ci95=bootstrap_ci(d),
                               b_more_whole=int((d > 0).sum()), b_less_whole=int((d < 0).sum()), tied=int((d == 0).sum()))
    with open(o.json, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["kinds"], indent=1))
    return out


if __name__ == "__main__":
    main()
