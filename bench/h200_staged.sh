#!/usr/bin/env bash
# Issue 11 on the GPU machine, in one device call (repo root, with .dev/ray.txz
# and .dev/rest.txz carried: see bench/h200.sh). Writes JSON under $OUT.
#  1. The paged section, CTX TP=2 -> GEN TP=1 per piece size, VRAM: raw
#     direct, direct and staged handoffs, one contiguous raw WRITE, a copy.
#  2. The chaos demo with the staged mode forced (0 leaked slots).
set -euo pipefail
source bench/_device.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
gpus=$(nvidia-smi -L | wc -l)
share=0.5; [ "$gpus" -lt 2 ] && share=0.33   # 3 ranks: two share a GPU, or all three one
[ "${BENCH:-1}" = 1 ] && kvh bench --json --memory VRAM --gpus-per-rank $share --sections paged --paged-layouts tp2 \
  --paged-kib ${KIBS:-4,16,64,256,1024} --paged-mib ${MIB:-1024} --chunk-mib ${CHUNK:-64} --staging-window ${WINDOW:-4} ${SLOT:+--staging-slot-mib $SLOT} --repeats 5 --round-timeout-s 30 \
  > "$out/bench_staged_vram.json" 2> "$out/bench_staged_vram.err" || echo "staged bench failed: $?"
tail -3 "$out/bench_staged_vram.err" 2>/dev/null || true
[ "${DEMO:-1}" = 1 ] && kvh demo --json --chaos --data-mode staged --memory VRAM --requests ${REQ:-200} \
  > "$out/demo_staged_chaos_vram.json" 2> "$out/demo_staged_chaos_vram.err" || echo "demo failed: $?"
tail -3 "$out/demo_staged_chaos_vram.err" 2>/dev/null || true
[ "${PROBE:-0}" = 1 ] && python bench/staged_probe.py > "$out/staged_probe.json" 2>&1 || true
ls -la "$out"
