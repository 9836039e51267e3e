#!/usr/bin/env bash
# The real-model example on the GPU machine (issue 10): prefill TP=2 -> decode
# TP=1 with VRAM pools, in one device call (repo root, .dev carried with ray,
# nixl and transformers: see docs/journal/2026-12-05-benchmarks-history.md "Engine example on H200").
set -euo pipefail
source bench/_device.sh
export HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python examples/disagg_generate.py --device cuda --json "$@" > "$out/engine_h200_cuda.json" 2> "$out/engine_h200_cuda.err" \
  || echo "cuda run exit $?"
tail -c 3000 "$out/engine_h200_cuda.json"; tail -n 20 "$out/engine_h200_cuda.err" | grep -v "^\s*$" | tail -n 12
python examples/disagg_generate.py --device cuda --dtype bfloat16 --json --prompts 32 > "$out/engine_h200_cuda_bf16.json" 2> "$out/engine_h200_cuda_bf16.err" \
  || echo "bf16 run exit $?"
tail -c 1500 "$out/engine_h200_cuda_bf16.json"
