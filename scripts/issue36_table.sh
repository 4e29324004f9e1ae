#!/usr/bin/env bash
# Issue 36's table for one release, next to the shipped weights' reports (docs/results.md, "The compact candidate
# against the shipped weights"): every row's command, each writing its report under reports/ with a prefix.
#
#   scripts/issue36_table.sh RELEASE PREFIX        # e.g. runs/recipe_compact/release recipe_compact
#   IWS_T36_SCALE=tiny scripts/issue36_table.sh RELEASE PREFIX OUTDIR   # the same commands at toy scale (tests)
#
# Rows: open loop on the 48 set4 episodes and on the README's 16 test episodes (paired with the shipped weights'
# rerun, reports/fidelity_stage2_rerun.json), 16 drives of 1,000 steps of each kind (replayed in gym-pusht too:
# stage 1's ceiling and the T's place), the 10-policy study on 32
# starts (after the trust calibration, issue 34), issue 33's whole-range study, the bench against the shipped weights (back to back), the contact
# starts (BASELINE=DIR names the weights the bench runs beside; default the shipped ones). A row whose report exists is skipped, so rerunning after an interruption continues. One thread per
# command; run it alone on 2 cores, or beside one other job, or as two lanes, one per core:
#   LANE=a scripts/issue36_table.sh R P & LANE=b scripts/issue36_table.sh R P   # b waits for a's trust calibration
set -euo pipefail
R=$1
P=$2
OUT=${3:-reports}
IWS=${IWS:-iws}
PYTHON=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} SDL_VIDEODRIVER=dummy
S=checkpoints/tpushing/policies/suite
if [ "${IWS_T36_SCALE:-full}" = tiny ]; then
  E48=2 E16=2 H=8 STEPS=20 DRIVES=2 E32=2 H32=4 EW=2 HW=4 BENCH="--steps 5 --batch-sizes 1 --batch-steps 2 --rollout-steps 4" CS=1 CAL="--calib-episodes 1 --calib-steps 10" ET=2 HT=6 FIT=""  # an untrained toy model loses every block: nothing to fit
else
  E48=48 E16=16 H=192 STEPS=1000 DRIVES=16 E32=32 H32=120 EW=16 HW=300 BENCH="--steps 300 --batch-sizes 1 8 --batch-steps 10 --rollout-steps 100" CS=16 CAL="" ET=16 HT=120 FIT="--fit --fit-episodes 16"
fi
mkdir -p "$OUT"
LANE=${LANE:-ab}
run() {  # REPORT COMMAND...: run COMMAND unless REPORT exists (or the row belongs to the other lane)
  local report=$1; shift
  if [ -f "$report" ]; then echo "skip $report"; return; fi
  echo "+ $*"; "$@"
}
lane() { [[ $LANE == *$1* ]]; }
lane a && run "$OUT/${P}_fidelity_48.json" $IWS eval fidelity --checkpoint "$R" --horizon $H --episodes $E48 --split set4 \
  --json "$OUT/${P}_fidelity_48.json"
lane a && run "$OUT/${P}_fidelity_16.json" $IWS eval fidelity --checkpoint "$R" --horizon $H --episodes $E16 \
  --json "$OUT/${P}_fidelity_16.json" --grid "$OUT/${P}_fidelity_16_grid.png"
if lane a && [ "${IWS_T36_SCALE:-full}" != tiny ]; then
  run "$OUT/${P}_vs_shipped_16.json" $IWS eval compare reports/fidelity_stage2_rerun.json "$OUT/${P}_fidelity_16.json" \
    --json "$OUT/${P}_vs_shipped_16.json"
fi
lane b && run "$OUT/${P}_stability_1000x16.json" $IWS eval stability --checkpoint "$R" --steps $STEPS --check-every 10 \
  --drives $DRIVES --actions random scripted hold --ground-truth $CAL --json "$OUT/${P}_stability_1000x16.json"
# the trust signal's calibration (issue 34) is written into the release first, so the studies below report
# their trusted-only figures with it
lane a && run "$OUT/${P}_trust.json" $IWS eval trust --checkpoint "$R" $FIT --episodes $ET --steps $HT \
  --plot "$OUT/${P}_trust.png" --json "$OUT/${P}_trust.json"
lane a && run "$OUT/${P}_correlate_32.json" $IWS eval correlate --checkpoint "$R" --episodes $E32 --horizon $H32 --workers 1 \
  --plot "$OUT/${P}_correlate_32.png" --json "$OUT/${P}_correlate_32.json"
lane b && run "$OUT/${P}_contact_starts.json" $PYTHON scripts/contact_starts.py "$R" "$OUT/${P}_contact_starts.json" $CS
if lane b; then while [ ! -f "$OUT/${P}_trust.json" ]; do sleep 10; done; fi  # the calibration the studies use
lane b && run "$OUT/${P}_correlate_whole_range.json" $IWS eval correlate --checkpoint "$R" --episodes $EW --horizon $HW --workers 1 \
  --add-policy vm_step5000=$S/vm_step5000.safetensors --add-policy vm_bc=$S/vm_bc.safetensors \
  --add-policy vm_round1=$S/vm_round1.safetensors --add-policy vm_markov_round2=$S/vm_markov_round2.safetensors \
  --add-policy visuomotor=iws_gym.policies:visuomotor \
  --add-policy expert=iws_gym.policies:ExpertPusher --plot "$OUT/${P}_correlate_whole_range.png" \
  --json "$OUT/${P}_correlate_whole_range.json"
if lane a && [ ! -f "$OUT/${P}_bench.json" ]; then  # back to back with the shipped weights, on the same machine
  $IWS bench --checkpoint "$R" $BENCH --json "$OUT/${P}_bench.json"
  $IWS bench --checkpoint "${BASELINE:-checkpoints/tpushing}" $BENCH --json "$OUT/${P}_bench_shipped.json"
fi
echo "issue 36 table of $R: done"
