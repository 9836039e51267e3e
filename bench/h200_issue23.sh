#!/usr/bin/env bash
# Issue 23's GPU-host targets in one device call (repo root, .dev carried; see
# bench/h200.sh): the control overhead of a 256 MiB handoff over a Ray round
# trip and cancel -> release, in VRAM (one GPU: a CTX and a GEN rank share it),
# then the small handoff, sustained rate, hops, big requests, the 256 MiB
# overhead and cancel on host memory with frames on NIXL notifications.
set -euo pipefail
source bench/_device.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true; nproc
kvh bench --json --memory VRAM --gpus-per-rank 0.5 --sections data,cancel --sizes-mib 256 \
  --chunk-mib 64 --repeats 7 --cancels 20 > "$out/issue23_h200x1_vram_data_cancel.json" || echo "vram failed: $?"
kvh bench --json --sections data,control,cancel --sizes-mib 256 --chunk-mib 64 --repeats 7 --cancels 20 \
  --concurrency 1,8,32,64 --control-frames nixl > "$out/issue23_h200x1_host_all_nixl.json" || echo "host failed: $?"
ls -la "$out"
