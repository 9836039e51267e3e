#!/usr/bin/env bash
# Issue 23 on the GPU host, in one device call (repo root, .dev carried; see
# bench/h200.sh): the small handoff's hops and latency over a Ray round trip,
# frames as Ray calls and as NIXL notifications. With BEFORE=<dir> (a copy of
# an older checkout beside this one) the same runs of that code go first, so
# before and after share the machine and the run.
set -euo pipefail
source bench/_device.sh
nvidia-smi --query-gpu=name --format=csv,noheader || true; nproc
run() {  # run <checkout> <tag>
  local src=$1 tag=$2 t; t=$(tree_of "$src")
  for frames in ray nixl; do
    PYTHONPATH=$t:$site kvh bench --json --sections control --concurrency 1,8,32,64 --control-frames $frames \
      > "$out/hops_h200_${tag}_${frames}.json" || echo "$tag $frames failed: $?"
  done
}
[ -n "${BEFORE:-}" ] && run "$PWD/$BEFORE" before
run "$PWD" after
ls -la "$out"
