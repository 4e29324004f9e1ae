#!/usr/bin/env bash
# The stage-2 design study (issue 36) as one prepared run on a GPU machine (one GPU, 16 cores, ~9 minutes):
# collect the play dataset on all cores, train the pool-latent stage 1, then train several stage-2 designs
# *at once* on the same GPU from that stage 1, each for the same wall-time budget (the learning rate decays
# over the budget: --time-schedule), release each and measure it on held-out validation episodes.
#
#   scripts/gpu_study.sh OUT                          # on the GPU machine (the device tool's $OUT)
#   IWS_STUDY_SCALE=tiny scripts/gpu_study.sh OUT     # the same steps at toy scale on a CPU (tests run this)
#   IWS_STUDY_VARIANTS="consistency_df consistency_df_large" IWS_STUDY_BATCH=1024 IWS_STUDY_EVAL=0 ...
#                                                     # fewer designs, a larger batch, evaluations left to you
#
# Work happens in $IWS_STUDY_WORK (default /tmp/iws_study); rerunning resumes (a finished step is skipped).
# OUT receives what comes back, each file as soon as it exists (so a run cut short still returns what it
# finished): study.log (the machine, each step's time), stage1.safetensors, s2_NAME.safetensors per variant,
# reports.tar.gz (train results, fidelity and stability JSONs, grids, logs, TensorBoard). Nothing here
# needs a GPU.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_study.sh OUT}
SCALE=${IWS_STUDY_SCALE:-gpu}
WORK=${IWS_STUDY_WORK:-/tmp/iws_study}
IWS=${IWS:-iws}
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)

if [ "$SCALE" = tiny ]; then
  COLLECT=(--episodes 3 --steps 24); MIN1=0.15; MIN2=0.15; B1=4; B2=4; P1=tiny; P2=tiny; EVAL_TIMEOUT=120
  FID=(--horizon 4 --episodes 1); STAB=(--steps 20 --check-every 10 --calib-episodes 1 --calib-steps 20)
  DN="--objective denoise --sample-steps 2"
  VARIANTS=("consistency|--objective consistency" "consistency_df|--objective consistency --ctx-noise per_frame"
            "transport_gated_df|$DN --ctx-noise per_frame --transport --flow-gate 0.02")
else
  COLLECT=(--episodes 600); MIN1=${IWS_STUDY_STAGE1_MINUTES:-2.0}; MIN2=${IWS_STUDY_STAGE2_MINUTES:-3.5}
  B1=128; B2=${IWS_STUDY_BATCH:-256}; P1=pool; P2=default; EVAL_TIMEOUT=${IWS_STUDY_EVAL_SECONDS:-100}
  FID=(--horizon 64 --episodes 16); STAB=(--steps 1000 --check-every 10)
  DN="--objective denoise --sample-steps 4 --p-mean -0.4 --sigma-max 5"
  VARIANTS=(
    "consistency|--objective consistency"
    "consistency_df|--objective consistency --ctx-noise per_frame"
    "consistency_df_large|--objective consistency --ctx-noise per_frame --preset large"
    "denoise|$DN"
    "denoise_df|$DN --ctx-noise per_frame"
    "transport_gated_df|$DN --ctx-noise per_frame --transport --flow-gate 0.02"
  )
fi
# IWS_STUDY_VARIANTS="a b": only these of the table above (default: all but the large one)
WANT=${IWS_STUDY_VARIANTS:-consistency consistency_df denoise denoise_df transport_gated_df}
[ "$SCALE" = tiny ] && WANT=${IWS_STUDY_VARIANTS:-consistency consistency_df transport_gated_df}
CHOSEN=()
for v in "${VARIANTS[@]}"; do
  [[ " $WANT " == *" ${v%%|*} "* ]] && CHOSEN+=("$v")
done
[ ${#CHOSEN[@]} -gt 0 ] || { echo "IWS_STUDY_VARIANTS names none of: ${VARIANTS[*]%%|*}"; exit 2; }
VARIANTS=("${CHOSEN[@]}")
# IWS_STUDY_EVAL=0: no evaluations here (run them elsewhere); the whole budget trains
[ "${IWS_STUDY_EVAL:-1}" = 0 ] && EVAL_TIMEOUT=0
# the shipped recipe's data options (docs/training.md; `iws train recipe` holds them), common to every variant
read -ra COMMON <<< "$(python3 -c 'from iws_gym.tasks.pusht.task import STAGE2_OPTIONS; print(*STAGE2_OPTIONS)')"
WORKERS=$(nproc)
export OMP_NUM_THREADS=2 PYTHONUNBUFFERED=1

python3 - <<'PY' > "$OUT/study.log"
import json, os, platform, torch
print(json.dumps(dict(torch=torch.__version__, cuda=torch.cuda.is_available(),
                      gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                      cores=os.cpu_count(), machine=platform.machine())))
PY
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/study.log"; }

# 1. data: scripted play, on every core
if [ ! -f "$WORK/data/dataset.json" ]; then
  stamp collect
  $IWS collect --task tpushing --out "$WORK/data" --workers "$WORKERS" "${COLLECT[@]}" \
    $( [ -d "$WORK/data" ] && echo --resume ) > "$WORK/collect.log" 2>&1 || { stamp "collect failed"; tail -5 "$WORK/collect.log"; exit 1; }
fi

# 2. stage 1: the pool latent (cells that hold no orientation; docs/experiments.md), or a given release
if [ -n "${IWS_STUDY_STAGE1:-}" ] && [ ! -f "$WORK/stage1/train_result.json" ]; then
  stamp "stage1: $IWS_STUDY_STAGE1"
  mkdir -p "$WORK/stage1" && cp "$IWS_STUDY_STAGE1/stage1.safetensors" "$WORK/stage1/" &&
    echo "{\"given\": \"$IWS_STUDY_STAGE1\"}" > "$WORK/stage1/train_result.json"
fi
if [ ! -f "$WORK/stage1/train_result.json" ]; then
  stamp stage1
  $IWS train stage1 --data "$WORK/data" --out "$WORK/stage1" --preset "$P1" --crop 0 --batch "$B1" \
    --steps 100000 --max-minutes "$MIN1" --time-schedule --eval-every 1000 --ckpt-every 500 \
    > "$WORK/stage1.log" 2>&1 || { stamp "stage1 failed"; tail -20 "$WORK/stage1.log"; exit 1; }
  cp "$WORK/stage1/stage1.safetensors" "$OUT/"
fi

# 3. stage 2: every variant at once, the same budget each; with IWS_STUDY_DEADLINE (seconds since the
# script began) every training ends by the same moment (--deadline: its budget counts from the end of its
# loading, which the cache builds make uneven), leaving time for the evaluations and packing
DEADLINE=()
if [ -n "${IWS_STUDY_DEADLINE:-}" ]; then
  DEADLINE=(--deadline $(( T0 + IWS_STUDY_DEADLINE - EVAL_TIMEOUT - 30 )))
fi
stamp "stage2 x ${#VARIANTS[@]}, ${MIN2} min each ${DEADLINE[*]:+(ending by the deadline)}"
for v in "${VARIANTS[@]}"; do
  name=${v%%|*}; flags=${v#*|}
  [ -f "$WORK/s2_$name/train_result.json" ] && continue
  # shellcheck disable=SC2086
  ( timeout "$(python3 -c "print(int($MIN2 * 60 + 150))")" \
      $IWS train stage2 --data "$WORK/data" --init "$WORK/stage1" --out "$WORK/s2_$name" --preset "$P2" \
      --batch "$B2" --steps 100000 --max-minutes "$MIN2" --time-schedule "${DEADLINE[@]}" --eval-every 2000 \
      --ckpt-every 500 "${COMMON[@]}" $flags > "$WORK/s2_$name.log" 2>&1 \
    && cp "$WORK/s2_$name/stage2.safetensors" "$OUT/s2_$name.safetensors" && stamp "$name trained" ) &
  if [ "$name" = "${VARIANTS[0]%%|*}" ]; then  # the first builds the latent caches (every core renders) ...
    for _ in $(seq 240); do
      [ -n "$(ls "$WORK"/data/latents_corruptblock_* 2>/dev/null)" ] && break
      kill -0 $! 2>/dev/null || break; sleep 1
    done
    stamp "latent caches built"
  fi  # ... which the others then load
done
wait
stamp "stage2 done"

# 4. release each (stage 1 beside it) and measure it on held-out validation episodes, all at once
for v in "${VARIANTS[@]}"; do
  [ "$EVAL_TIMEOUT" = 0 ] && break
  name=${v%%|*}; rel="$WORK/release/$name"
  [ -f "$WORK/s2_$name/stage2.safetensors" ] || { stamp "$name: no weights"; continue; }
  mkdir -p "$rel"; cp "$WORK/stage1/stage1.safetensors" "$WORK/s2_$name/stage2.safetensors" "$rel/"
  cp "$WORK/s2_$name/train_result.json" "$rel/stage2_train_result.json"
  cp "$WORK/stage1/train_result.json" "$rel/stage1_train_result.json"
  ( timeout "$EVAL_TIMEOUT" $IWS eval fidelity --checkpoint "$rel" --split validation "${FID[@]}" \
      --json "$rel/fidelity_val_h64.json" --grid "$rel/fidelity_val_grid.png" > "$rel/fidelity.log" 2>&1 ) &
  ( timeout "$EVAL_TIMEOUT" $IWS eval stability --checkpoint "$rel" "${STAB[@]}" --actions scripted random hold \
      --json "$rel/stability_1000.json" --strip "$rel/stability_1000.png" > "$rel/stability.log" 2>&1 ) &
done
wait
stamp "evaluations done"

# 5. everything else in one file
cd "$WORK"
tar czf "$OUT/reports.tar.gz" --exclude='*.safetensors' --exclude='last.pt' collect.log stage1.log s2_*.log \
  release stage1/train_result.json stage1/tb s2_*/train_result.json s2_*/tb 2>/dev/null
stamp "packed: $(ls "$OUT" | tr '\n' ' ')"
