"""Release an ablation run of the compact latent as the package's compact world model (iws_gym/models/compact.py):
  python scripts/compact_latent/release.py RUN DYN.pt [PROJ.pt|-] OUT
writes OUT/stage1.safetensors and OUT/stage2.safetensors (kinds compact_stage1 / compact_stage2) with the configs in
their metadata, so `gym.make("IWS-TPushing-v0", checkpoint=OUT)` and every `iws eval` run on it. Stage 2 is stored in
fp32 (its MLP is evaluated in fp32), stage 1 in bf16 (evaluated under bf16 autocast where the CPU has it)."""
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from compact_dyn import LAW  # noqa: E402

from iws_gym.models.checkpoint import git_commit, save_release  # noqa: E402
from iws_gym.models.compact import (STAGE1_KIND, STAGE2_KIND, CompactStage1, CompactStage1Config,  # noqa: E402
                                    CompactStage2, CompactStage2Config)


def main(run, dyn, proj, out):
    out = Path(out)
    ae = torch.load(Path(run) / "ae.pt")
    if ae.get("parts"):
        raise SystemExit(f"{run}: a part-frame decoder (PARTS) has no release format")
    cfg1 = CompactStage1Config(z_dim=ae["D"])
    s1 = CompactStage1(cfg1)
    s1.encoder.load_state_dict(ae["enc"])
    s1.decoder.load_state_dict(ae["dec"])
    dk = torch.load(dyn)
    pk = torch.load(proj) if proj != "-" else None
    cfg2 = CompactStage2Config(z_dim=ae["D"], gate=bool(dk.get("gate")), agent_motion=tuple(LAW),
                               denoiser_blocks=4 if pk else 0)
    s2 = CompactStage2(cfg2)
    s2.dynamics.load_state_dict(dk["model"])
    if pk:
        s2.denoiser.load_state_dict(pk["model"])
    prov = dict(source=dict(stage1=f"{run}/ae.pt (step {ae['step']})", dynamics=f"{dyn} (step {dk['step']})",
                            denoiser=f"{proj} (step {pk['step']})" if pk else None),
                command=" ".join(["python", *sys.argv]), commit=git_commit())
    save_release(out / "stage1.safetensors", s1.state_dict(), STAGE1_KIND, cfg1, extra=dict(provenance=prov))
    save_release(out / "stage2.safetensors", s2.state_dict(), STAGE2_KIND, cfg2, dtype=torch.float32,
                 extra=dict(provenance=prov, rollout=dict(reencode=False)))
    lineage = ["reports/ablation_compact_train.json", "reports/ablation_compact_gate_train.json",
               "reports/ablation_compact_rj_train.json", "reports/ablation_compact_pol_train.json"]
    full = dict(stage1=dict(file="stage1.safetensors", kind=STAGE1_KIND, steps=ae["step"], config=dataclasses.asdict(cfg1)),
                stage2=dict(file="stage2.safetensors", kind=STAGE2_KIND, dynamics_steps=dk["step"],
                            denoiser_steps=pk["step"] if pk else None, config=dataclasses.asdict(cfg2)),
                released_at_commit=prov["commit"], command=prov["command"], source=prov["source"],
                lineage=[f for f in lineage if Path(f).is_file()],
                note="trained by the ablation scripts in scripts/compact_latent over several sessions (the lineage files "
                     "hold every command and log); `iws train recipe --design compact` is the one-command path "
                     "for new weights of this design")
    (out / "provenance.json").write_text(json.dumps(full, indent=1))
    print(json.dumps(full, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 5:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
