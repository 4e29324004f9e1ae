#!/usr/bin/env bash
# The visuomotor policy's recipe (issue 33; docs/training.md, "The pose bottleneck"): behaviour cloning of the
# planning expert with the pose-bottleneck policy, then five DAgger rounds, on 2 cores (one job per core).
#
#   scripts/train_visuomotor.sh [RUNS]          # RUNS defaults to runs; data/expert and data/expert_val must exist
#   IWS_VM_SCALE=tiny DATA=... VAL_DATA=... scripts/train_visuomotor.sh RUNS   # the same steps at toy scale (tests)
#   DATA=data/expert_markov VAL_DATA=data/expert_markov_val EXPERT=markov scripts/train_visuomotor.sh runs/markov
#       # the Markov expert's demonstrations (`iws collect --mix expert_markov`) and labels (`iws dagger --expert markov`)
#
# 1. 50,000 steps of 1,024 on the 500 demonstrations (runs/vm_pose). Meanwhile, on the other core, the expert
#    labels the states its snapshots at steps 5,000 and 20,000 reach (r0, r0b: 40 episodes each).
# 2. Round r = 1..5: the policy of the last round is continued for 25,000 steps on the demonstrations plus
#    every label so far (half of each batch), while on the other core (rounds 1-4) the expert labels what that
#    same policy reaches (r1 .. r4 on fresh training seeds), for the next round. Round 5 also shows the pose
#    reader 20,000 frames of random states, the block anywhere up to the walls (--reader-frames), and trains
#    the head on the recorded pose with less noise (--pose-noise 0.5 px instead of 2).
# Every step is skipped when its output exists, so rerunning after an interruption continues (a training run
# resumes from its last.pt). Each policy is measured on 30 validation starts (--seed 8000), never on test starts.
set -euo pipefail
R=${1:-runs}
IWS=${IWS:-iws}
DATA=${DATA:-data/expert}
VAL_DATA=${VAL_DATA:-data/expert_val}
EXPERT=${EXPERT:-planning}
if [ "${IWS_VM_SCALE:-full}" = tiny ]; then
  PRESET=pose-tiny BATCH=8 BC=4 D=2 EVERY=2 SNAP1=2 SNAP2=4 EPISODES=1 HORIZON=9 VAL=1 READER=8
else
  PRESET=pose BATCH=1024 BC=50000 D=25000 EVERY=5000 SNAP1=5000 SNAP2=20000 EPISODES=40 HORIZON=300 VAL=30 READER=20000
fi
export OMP_NUM_THREADS=1 SDL_VIDEODRIVER=dummy
mkdir -p "$R/dagger"

label() {  # POLICY SEED NAME: 40 DAgger episodes from training seeds SEED..SEED+39
  [ -f "$R/dagger/$3.json" ] || $IWS dagger --policy "$1" --episodes $EPISODES --horizon $HORIZON --seed "$2" \
    --expert $EXPERT --out "$R/dagger/$3.npz" --json "$R/dagger/$3.json" > "$R/dagger/$3.log" 2>&1
}
wait_for() { while [ ! -f "$1" ]; do kill -0 $$ 2>/dev/null || exit 1; sleep 2; done; }  # gives up if the script ended
val30() { [ -f "$1/val30.json" ] || $IWS eval policy --policy "$1/visuomotor.safetensors" --ground-truth-only \
  --episodes $VAL --horizon $HORIZON --seed 8000 --json "$1/val30.json" > "$1/val30.log" 2>&1; }

# 1. behaviour cloning, with the first labels collected from its snapshots on the other core
( wait_for "$R/vm_pose/visuomotor_step$SNAP1.safetensors"; label "$R/vm_pose/visuomotor_step$SNAP1.safetensors" 230000 r0
  wait_for "$R/vm_pose/visuomotor_step$SNAP2.safetensors"; label "$R/vm_pose/visuomotor_step$SNAP2.safetensors" 230050 r0b ) &
[ -f "$R/vm_pose/train_result.json" ] || $IWS train-policy --data "$DATA" --val-data "$VAL_DATA" --preset $PRESET \
  --batch $BATCH --steps $BC --eval-every $EVERY --ckpt-every 1000 --out "$R/vm_pose" > "$R/vm_pose.log" 2>&1
wait
labels="$R/dagger/r0.npz,$R/dagger/r0b.npz"
prev="$R/vm_pose"

# 2. DAgger rounds
for r in 1 2 3 4 5; do
  out="$R/vm_pose_d$r"
  val30 "$prev"
  [ $r = 5 ] || label "$prev/visuomotor.safetensors" $((230000 + 100 * r)) "r$r" &  # for the next round
  extra=(); [ $r = 5 ] && extra=(--reader-frames $READER --pose-noise 0.5)
  [ -f "$out/train_result.json" ] || $IWS train-policy --data "$DATA" --val-data "$VAL_DATA" \
    --init "$prev/visuomotor.safetensors" --labels "$labels" --batch $BATCH --steps $D --warmup 500 \
    --eval-every $EVERY --ckpt-every 1000 "${extra[@]}" --out "$out" > "$out.log" 2>&1
  wait
  [ $r = 5 ] || labels="$labels,$R/dagger/r$r.npz"
  prev="$out"
done
val30 "$prev"
echo "done: $prev/visuomotor.safetensors"
