#!/usr/bin/env bash
# The control-frame carrier on the GPU host (one H200, 16 cores), in one
# device call (repo root, .dev carried; see bench/h200.sh). Writes under $OUT:
#  1. tests/actors/test_carrier.py there (the probe between two real NIXL
#     agents on a many-core host);
#  2. the issue 20 scale section with --control-frames $FRAMES (default auto:
#     measured at launch; the JSON's scale.control_frames says what it took);
#  3. DEMO=1: the fleet chaos demo on the default carrier.
set -uo pipefail
source bench/_device.sh
frames=${FRAMES:-auto}
nproc
[ "${TESTS:-1}" = 1 ] && python -m pytest -q -p no:cacheprovider tests/actors/test_carrier.py > "$out/pytest_carrier.txt" 2>&1; tail -3 "$out/pytest_carrier.txt" 2>/dev/null
[ "${SCALE:-1}" = 1 ] && kvh bench --json --sections scale --scale-sizes ${SIZES:-1,2,4} --scale-repeats ${REPEATS:-5} --scale-clients ${CLIENTS:-16} \
  --sustain-s ${SUSTAIN:-5} --round-timeout-s 30 --control-frames "$frames" > "$out/bench_scale_$frames.json" 2> "$out/bench_scale_$frames.err" || echo "scale bench failed: $?"
[ "${DEMO:-1}" = 1 ] && kvh demo --json --chaos --ctx-instances 2 --gen-instances 2 --ctx-tp 2,1 --gen-tp 1,2 \
  --requests ${REQ:-300} > "$out/demo_fleet_chaos.json" 2> "$out/demo_fleet_chaos.err" || echo "demo failed: $?"
ls -la "$out"
