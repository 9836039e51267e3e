#!/usr/bin/env bash
# Issue 23 on the GPU host, in one device call (repo root, .dev carried; see
# bench/h200.sh): the small handoff's hops and latency over a Ray round trip,
# frames as Ray calls and as NIXL notifications. With BEFORE=<dir> (a copy of
# an older checkout beside this one) the same runs of that code go first, so
# before and after share the machine and the run.
set -euo pipefail
out=${OUT:-out}; mkdir -p "$out"
site=$(mktemp -d); for f in .dev/*.txz; do tar xJf "$f" -C "$site"; done
export NIXL_LOG_LEVEL=WARN
nvidia-smi --query-gpu=name --format=csv,noheader || true; nproc
run() {  # run <checkout> <tag>
  local src=$1 tag=$2 tree; tree=$(mktemp -d); mkdir -p "$tree/kvhandoff"
  ln -s "$src/pkg/__init__.py" "$tree/kvhandoff/__init__.py"
  for layer in protocol topology actors cli; do ln -s "$src/$layer" "$tree/kvhandoff/$layer"; done
  for frames in ray nixl; do
    PYTHONPATH=$tree:$site python -c "import importlib.util, sys; m = importlib.import_module('kvhandoff.cli' if importlib.util.find_spec('kvhandoff.cli') else 'kvhandoff.actors.cli'); sys.exit(m.main(sys.argv[1:]))" \
      bench --json --sections control --concurrency 1,8,32,64 --control-frames $frames \
      > "$out/hops_h200_${tag}_${frames}.json" || echo "$tag $frames failed: $?"
  done
}
[ -n "${BEFORE:-}" ] && run "$PWD/$BEFORE" before
run "$PWD" after
ls -la "$out"
