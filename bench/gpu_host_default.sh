#!/usr/bin/env bash
# The default path on the GPU host in one device call (repo root, .dev
# carried; see bench/h200.sh): issue 23's control section (small handoffs,
# one at a time and concurrent) and issue 20's fleet scale
# section (1x1, 2x2, 4x4 and four independent pairs, 16 clients per
# instance), both on host memory, with the default frame carrier (streams).
set -euo pipefail
source bench/_device.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true; nproc
kvh bench --json --sections control --concurrency 1,8,32 > "$out/default_control.json" 2>> "$out/log" || echo "control failed: $?"
kvh bench --json --sections scale --scale-sizes 1,2,4 --scale-repeats 5 --scale-clients 16 --sustain-s 5 --round-timeout-s 30 \
  > "$out/default_scale.json" 2>> "$out/log" || echo "scale failed: $?"
ls -la "$out"
