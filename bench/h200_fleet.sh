#!/usr/bin/env bash
# Issue 20 on the GPU host (one H200, 16 cores), in one device call (repo
# root, with .dev/ray.txz and .dev/rest.txz carried: see bench/h200.sh).
# Writes JSON under $OUT.
#  1. The scale section: NxN fleets of tp=1 instances (1, 2, 4) and 4
#     independent one-pair deployments, small handoffs, clients in
#     proportion to the instances (host memory: the control plane's rate).
#     FRAMES=nixl: control frames over NIXL notifications (both sides).
#  2. The fleet chaos demo: 2x2 with mixed TP, a rank and a coordinator
#     killed, a replacement joining, an instance draining.
set -euo pipefail
source bench/_device.sh
nproc; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
[ "${SCALE:-1}" = 1 ] && kvh bench --json --sections scale --scale-sizes ${SIZES:-1,2,4} --scale-repeats ${REPEATS:-5} --scale-clients ${CLIENTS:-16} \
  --sustain-s ${SUSTAIN:-5} --round-timeout-s 30 --control-frames ${FRAMES:-stream} > "$out/bench_scale.json" 2> "$out/bench_scale.err" || echo "scale bench failed: $?"
tail -3 "$out/bench_scale.err" 2>/dev/null || true
[ "${DEMO:-1}" = 1 ] && kvh demo --json --chaos --ctx-instances 2 --gen-instances 2 --ctx-tp 2,1 --gen-tp 1,2 \
  --requests ${REQ:-300} > "$out/demo_fleet_chaos.json" 2> "$out/demo_fleet_chaos.err" || echo "demo failed: $?"
tail -3 "$out/demo_fleet_chaos.err" 2>/dev/null || true
ls -la "$out"
