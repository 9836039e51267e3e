#!/usr/bin/env bash
# The fleet chaos demo with NIXL-notification frames on the GPU host, keeping
# every Ray worker's log lines about the handoffs that ended "timeout"
# (repo root, .dev carried; see bench/h200.sh). Writes under $OUT.
set -uo pipefail
source bench/_device.sh
for seed in ${SEEDS:-1 0}; do
  rm -rf /tmp/ray/session_*
  timeout 110 "${kvh_cmd[@]}" \
    demo --json --chaos --ctx-instances 2 --gen-instances 2 --ctx-tp 2,1 --gen-tp 1,2 --requests 300 \
    --control-frames ${FRAMES:-nixl} --seed "$seed" > "$out/demo_$seed.json" 2> "$out/demo_$seed.err"
  echo "seed $seed rc=$?"
  ids=$(python -c "import json,sys; d=json.load(open('$out/demo_$seed.json')); print('|'.join(t['request_id'] for t in d.get('timeouts', [])) or 'NONE')" 2>/dev/null || echo NONE)
  echo "timeouts: $ids"
  logs=$(ls -d /tmp/ray/session_*/logs 2>/dev/null | head -1)
  [ -n "$logs" ] && grep -H -E "WARNING|ERROR|Error|Traceback|$ids" "$logs"/worker-*.err "$logs"/worker-*.out 2>/dev/null | grep -v "Token authentication" | tail -400 > "$out/logs_$seed.txt"
  [ -n "$logs" ] && for f in "$logs"/worker-*.out; do n=$(head -c 4000 "$f" | grep -o -m1 "ray::[A-Za-z_]*" ); echo "$f $n"; done > "$out/workers_$seed.txt"
done
ls -la "$out"
