#!/usr/bin/env bash
# Issue 22 (h) on the GPU host (one H200, 16 cores), in one device call (repo
# root, .dev carried; see bench/h200.sh): the soak (`kvhandoff bench
# --sections soak`, host memory, the embedded default) runs ~50x more
# handoffs there than on the 2-core box, so its slope per handoff is that much
# less noisy; then Ray's own floor for an actor that makes calls
# (bench/ray_caller_floor.py), then NIXL's (bench/nixl_memory_floor.py).
# SOAK=0, FLOOR=0 or NIXL=0 skips a part; TRACE=1 adds --soak-trace (what
# each process's Python heap and object counts grew after the warm-up). Writes under $OUT.
set -uo pipefail
source bench/_device.sh
nproc
if [ "${SOAK:-1}" = 1 ]; then
  kvh bench --json --sections soak --soak-s ${SOAK_S:-400} --soak-warmup-s ${WARM_S:-150} \
    --soak-clients ${CLIENTS:-8} ${TRACE:+--soak-trace} > "$out/bench_soak.json" 2> "$out/bench_soak.err" || echo "soak failed: $?"
  tail -5 "$out/bench_soak.err"
fi
if [ "${FLOOR:-1}" = 1 ]; then
  python bench/ray_caller_floor.py ${CALLS:-2000000} ${FLOOR_S:-120} > "$out/ray_caller_floor.txt" 2>&1
  tail -2 "$out/ray_caller_floor.txt"
fi
if [ "${NIXL:-1}" = 1 ]; then
  python bench/nixl_memory_floor.py ${NIXL_S:-120} > "$out/nixl_memory_floor.txt" 2>&1
  tail -1 "$out/nixl_memory_floor.txt"
fi
ls -la "$out"
