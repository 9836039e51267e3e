#!/usr/bin/env bash
# The GPU-machine runs of docs/benchmarks.md, in one device call (repo root,
# with .dev carried: see the device notes on packing ray and nixl for it).
# Writes bench_*.json under $OUT (default: ./out).
set -euo pipefail
source bench/_device.sh
# The import package as a tree of symlinks (no pip install there).
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
gpus=$(nvidia-smi -L | wc -l)
share=1; [ "$gpus" -lt 2 ] && share=0.5   # one GPU: a CTX and a GEN rank share it
# 1. VRAM: the data plane at 256 MiB and 1 GiB (one GPU per rank where there are two).
kvh bench --json --memory VRAM --gpus-per-rank $share --sections data --sizes-mib 256,1024 \
  --chunk-mib 64 --repeats 5 > "$out/bench_h200_vram_data.json" || echo "vram data failed: $?"
# 2. Control plane and cancel on the host's cores (host memory).
kvh bench --json --sections control,cancel --sizes-mib 64 --concurrency 1,8,32,64 \
  > "$out/bench_h200_host_control.json" || echo "control failed: $?"
# 2b. The same with control frames on NIXL notifications.
kvh bench --json --sections control,cancel --sizes-mib 64 --concurrency 1,8,32,64 --control-frames nixl \
  > "$out/bench_h200_host_control_nixl.json" || echo "control nixl failed: $?"
# 3. Frames: one-way Ray calls vs NIXL notifications between two actors.
kvh bench --json --sections frames 2>/dev/null | tail -1 > "$out/bench_h200_host_frames.json" || echo "frames failed: $?"
ls -la "$out"
