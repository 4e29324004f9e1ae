#!/usr/bin/env bash
# The whole recipe as one prepared run on a GPU machine (for example one GPU and 16 cores, about 10 minutes
# of compute): collect on all cores, train stage 1 and stage 2 on the GPU at the "gpu" scale (a batch and a
# stage-2 model that 2 CPU cores could never afford), release the weights and measure them, all under OUT.
#
#   scripts/gpu_recipe.sh OUT                       # on the GPU machine (the device tool's $OUT)
#   IWS_RECIPE_SCALE=tiny scripts/gpu_recipe.sh OUT # the same script at toy scale on a CPU (tests run this)
#   IWS_RECIPE_DESIGN=compact scripts/gpu_recipe.sh OUT   # the compact design (models/compact.py)
#
# Nothing here needs a GPU: on a CPU it runs the same steps, only slower. Rerunning it resumes.
set -euo pipefail
OUT=${1:?usage: scripts/gpu_recipe.sh OUT}
SCALE=${IWS_RECIPE_SCALE:-gpu}
BUDGET=${IWS_RECIPE_BUDGET_MINUTES:-8}
DESIGN=${IWS_RECIPE_DESIGN:-spatial}
mkdir -p "$OUT"
if [ "$SCALE" = tiny ]; then
  SIZE=(--episodes 3 --episode-steps 24 --stage1-steps 6 --stage2-steps 4 --eval-every 100)
  EVAL=(--horizon 4 --episodes 1)
else
  SIZE=(--stage1-steps 24000 --stage2-steps 20000 --eval-every 2000)
  EVAL=(--horizon 64 --episodes 16)
fi
python - <<'PY' > "$OUT/machine.json"
import json, os, platform, torch
print(json.dumps(dict(torch=torch.__version__, cuda=torch.cuda.is_available(),
                      gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                      cores=os.cpu_count(), machine=platform.machine())))
PY
iws train recipe --task tpushing --out "$OUT/recipe" --design "$DESIGN" --scale "$SCALE" --workers "$(nproc)" \
  --budget-minutes "$BUDGET" "${SIZE[@]}" 2>&1 | tail -n 40 > "$OUT/recipe.log"
iws eval fidelity --checkpoint "$OUT/recipe/release" --split validation "${EVAL[@]}" \
  --json "$OUT/fidelity_validation.json" --grid "$OUT/fidelity_validation_grid.png" > /dev/null
echo "done: $OUT/recipe/release (weights + provenance), $OUT/recipe/recipe.json, $OUT/fidelity_validation.json"
