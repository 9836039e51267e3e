"""Staged TP2->TP1 handoffs in a loop on the bench's tp2 layout (every shard
piece `KIB` KiB), for profiling the ranks while the data phase runs and for
comparing slot sizes. Prints one JSON line: the data phase's best and p50
over the loop, and every rank's staging seconds and counters.

    python bench/staged_loop.py KIB MIB SECONDS CHUNK_MIB WINDOW MEMORY GPU_SHARE SLOT_MIB
    python bench/staged_loop.py 16 1024 20 64 4 VRAM 0.33 128   # one GPU, three ranks
    python bench/staged_loop.py 16 64 5 16 4 DRAM 0 0           # host memory
"""

import asyncio
import json
import sys
import time

from kvhandoff.actors import Deployment
from kvhandoff.cli._baselines import call_on, progressing, transfer_timings
from kvhandoff.cli._bench import _handoff
from kvhandoff.protocol import Role
from kvhandoff.topology import KVLayout, block_bytes


async def main(argv: list[str]) -> None:
    kib, mib, secs, chunk, window = (int(argv[0]), int(argv[1]), float(argv[2]), int(argv[3]), int(argv[4]))
    memory, share, slot = argv[5], float(argv[6]), int(argv[7])
    layout = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype="float16", tokens_per_block=kib)
    blocks = mib * (1 << 20) // block_bytes(layout, 1)
    dep = await Deployment.launch(
        ctx_tp=2, gen_tp=1, data_mode="staged", staging_window=window, layout=layout,
        pool_blocks=2 * blocks + 2, memory=memory, chunk_bytes=chunk << 20, staging_slot_bytes=slot << 20,
        round_timeout_s=30, synthetic=False, **({"gpus_per_rank": share} if share else {}),
    )
    try:
        ctx = await dep.ranks(Role.CTX)
        await progressing(dep, 3600.0)
        print("ready", flush=True)
        end = time.perf_counter() + secs
        phases: list[float] = []
        i = 0
        while time.perf_counter() < end or i < 3:
            rid = f"loop-{i}"
            i += 1
            r = await _handoff(dep, rid, blocks * kib, timeout=120.0)
            timings = await asyncio.gather(*(call_on(h, transfer_timings) for h in ctx))
            mine = [sec for per in timings for q, sec, _ in per if q == rid]
            if r.outcome == "completed" and mine:
                phases.append(max(mine))
        phases.sort()
        stats = await dep.stats()
        print(json.dumps({
            "n": len(phases), "best_ms": phases[0] * 1e3, "p50_ms": phases[len(phases) // 2] * 1e3,
            "gbps_best": mib * (1 << 20) / phases[0] / 1e9,
            "staging": [{"role": s["role"], **{k: s["staging"].get(k) for k in ("seconds", "counters")}} for s in stats["ranks"]],
        }))
    finally:
        await dep.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
