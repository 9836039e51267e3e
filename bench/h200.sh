#!/usr/bin/env bash
# The GPU-machine runs of docs/benchmarks.md, in one device call (repo root,
# with .dev carried: see the device notes on packing ray and nixl for it).
# Writes bench_*.json under $OUT (default: ./out).
set -euo pipefail
out=${OUT:-out}; mkdir -p "$out"
site=$(mktemp -d); for f in .dev/*.txz; do tar xJf "$f" -C "$site"; done
# The import package as a tree of symlinks (no pip install there).
tree=$(mktemp -d); mkdir -p "$tree/kvhandoff"
ln -s "$PWD/pkg/__init__.py" "$tree/kvhandoff/__init__.py"
for layer in protocol topology actors; do ln -s "$PWD/$layer" "$tree/kvhandoff/$layer"; done
export PYTHONPATH=$tree:$site:$PWD NIXL_LOG_LEVEL=WARN
kvh() { python -c "import sys; from kvhandoff.actors.cli import main; sys.exit(main(sys.argv[1:]))" "$@"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
# 1. VRAM, a CTX and a GEN rank sharing the one GPU: data plane at 256 MiB and 1 GiB.
kvh bench --json --memory VRAM --gpus-per-rank 0.5 --sections data --sizes-mib 256,1024 \
  --chunk-mib 64 --repeats 5 > "$out/bench_h200_vram_data.json" || echo "vram data failed: $?"
# 2. Control plane and cancel on the 16-core host (host memory).
kvh bench --json --sections control,cancel --sizes-mib 64 --concurrency 1,8,32,64 \
  > "$out/bench_h200_host_control.json" || echo "control failed: $?"
ls -la "$out"
