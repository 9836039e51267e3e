#!/usr/bin/env bash
# A/B on the GPU host, back to back in one device call: the same benches on
# an older tree (carried as .ab_base/kvhandoff, e.g. the commit before an
# issue) and on this one. Ratios are compared run against run on one machine.
# Usage (repo root, .dev and .ab_base carried): [ROUNDS=2] bash bench/h200_ab.sh
# (2 rounds write 7 files: the device returns at most 8.)
# CONTROL_ONLY=1: the control and cancel sections only, ROUNDS times.
# SCALE=1: the fleet's scale section instead (one run ~2 min per tree and
# round), with THIRD_TREE (another carried tree) as a third arm if given,
# HEAD_FLAGS / BASE_FLAGS added to that arm only, and BASE_TREE=head to run
# both arms on this tree (e.g. BASE_FLAGS=--scale-admit-in-rounds: the fleet
# with and without admission at the OPEN).
set -euo pipefail
source bench/_device.sh
base_tree=${BASE_TREE:-$PWD/.ab_base}
head_tree=${HEAD_TREE:-$tree}  # another carried tree in place of this one
if [ "${BASE_TREE:-}" = head ]; then base_tree=$head_tree; fi
run() {  # run TREE NAME ARGS...: one bench with TREE's kvhandoff first on the path
  local tree=$1 name=$2; shift 2
  (cd "$(mktemp -d)" && PYTHONPATH=$tree:$site kvh bench --json "$@") > "$out/$name.json" 2>> "$out/ab.log" \
    || echo "$name failed: $?"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
if [ -n "${VRAM_ONLY:-}" ]; then  # the VRAM data plane only, alternating, ROUNDS times
  for round in $(seq 1 "${ROUNDS:-2}"); do
    run "$base_tree" "ab_base_vram_$round" --memory VRAM --gpus-per-rank 0.5 --sections data --sizes-mib 256 --chunk-mib 64 --repeats 7
    run "$head_tree" "ab_head_vram_$round" --memory VRAM --gpus-per-rank 0.5 --sections data --sizes-mib 256 --chunk-mib 64 --repeats 7
  done
  ls -la "$out"; exit 0
fi
if [ -n "${SCALE:-}" ]; then  # the fleet's scale section, alternating, ROUNDS times
  scale=(--sections scale --scale-sizes 1,2,4 --scale-repeats ${REPEATS:-5} --scale-clients 16 --sustain-s 5 --round-timeout-s 30 --control-frames ${FRAMES:-stream})
  for round in $(seq 1 "${ROUNDS:-1}"); do
    # shellcheck disable=SC2086
    run "$base_tree" "ab_base_scale_$round" "${scale[@]}" ${BASE_FLAGS:-}
    # shellcheck disable=SC2086
    run "$head_tree" "ab_head_scale_$round" "${scale[@]}" ${HEAD_FLAGS:-}
    if [ -n "${THIRD_TREE:-}" ]; then run "$THIRD_TREE" "ab_third_scale_$round" "${scale[@]}"; fi
  done
  ls -la "$out"; exit 0
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  run "$base_tree" "ab_base_control_$round" --sections control,cancel --sizes-mib 64 --concurrency 1,8,32
  run "$head_tree" "ab_head_control_$round" --sections control,cancel --sizes-mib 64 --concurrency 1,8,32
done
if [ -n "${CONTROL_ONLY:-}" ]; then ls -la "$out"; exit 0; fi
run "$base_tree" ab_base_vram --memory VRAM --gpus-per-rank 0.5 --sections data --sizes-mib 256,1024 --chunk-mib 64 --repeats 5
run "$head_tree" ab_head_vram --memory VRAM --gpus-per-rank 0.5 --sections data --sizes-mib 256,1024 --chunk-mib 64 --repeats 5
ls -la "$out"
