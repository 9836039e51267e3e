#!/usr/bin/env bash
# The fleet chaos demo on the GPU host with each control-frame carrier, and
# the scale section with Ray-call frames (repo root, .dev carried; see
# bench/h200.sh). Writes JSON under $OUT.
set -uo pipefail
source bench/_device.sh
[ "${SCALE:-1}" = 1 ] && timeout 230 "${kvh_cmd[@]}" \
  bench --json --sections scale --scale-sizes 1,2,4 --scale-repeats 5 --scale-clients 16 --sustain-s 5 --round-timeout-s 30 \
  --control-frames ray > "$out/bench_scale_ray.json" 2> "$out/bench_scale_ray.err"
for run in ${RUNS:-nixl.1 nixl.2 ray.1}; do
  timeout 110 "${kvh_cmd[@]}" \
    demo --json --chaos --ctx-instances 2 --gen-instances 2 --ctx-tp 2,1 --gen-tp 1,2 --requests 300 \
    --control-frames "${run%.*}" --seed "${run#*.}" > "$out/demo_chaos_$run.json" 2> "$out/demo_chaos_$run.err"
  echo "$run rc=$?"
done
ls -la "$out"
