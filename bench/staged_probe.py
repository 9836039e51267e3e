"""GPU micro-probe of one staged chunk's host-side costs (issue 11): the
index map, the gather kernel, its sync, on the default stream and on a side
stream. Prints one JSON line. Run on the GPU machine (bench/h200_staged.sh)."""

import json
import time

import torch

from kvhandoff.actors._dataplane import KVMemory, edge_pieces, plan_chunks
from kvhandoff.actors._staged import StagingArena, gather, scatter, stage_map, stage_unit
from kvhandoff.topology import KVLayout, memory_pieces, shard_map


def main() -> None:
    out = {}
    for kib in (4, 16, 64):
        layout = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype="float16", tokens_per_block=kib)
        sm = shard_map(layout, 2, 1)
        nb = (1 << 30) // (8 * kib * 1024)
        ctx = KVMemory.allocate("blocked", layout, 2, nb, "cuda:0")
        gen = KVMemory.allocate("blocked", layout, 1, nb, "cuda:0")
        chunk = 64 << 20
        pieces = edge_pieces(memory_pieces(sm, (0, 0), "blocked", "blocked"), chunk)
        plans = plan_chunks(pieces, [(b, b) for b in range(nb)], chunk)
        arena = StagingArena(2, chunk, "cuda:0")
        cu, gu = stage_unit(pieces, 0, ctx.strides), stage_unit(pieces, 1, gen.strides)
        side = torch.cuda.Stream()
        row = {"chunks": len(plans), "rows_per_chunk": len(plans[0].local)}
        for name, stream in (("default", None), ("side", side)):
            t_map = t_gather = t_scatter = 0.0
            for rep in range(3):
                torch.cuda.synchronize()
                for plan in plans:
                    t0 = time.perf_counter()
                    m = stage_map(pieces, plan.local, 0, ctx, cu, "cuda:0")
                    g = stage_map(pieces, plan.remote, 1, gen, gu, "cuda:0")
                    t1 = time.perf_counter()
                    with torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream()):
                        gather(ctx, arena.slot(0), m)
                    (stream or torch.cuda.current_stream()).synchronize()
                    t2 = time.perf_counter()
                    with torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream()):
                        scatter(gen, arena.slot(0), g)
                    (stream or torch.cuda.current_stream()).synchronize()
                    t3 = time.perf_counter()
                    if rep:
                        t_map += t1 - t0
                        t_gather += t2 - t1
                        t_scatter += t3 - t2
            n = 2 * len(plans)
            row[name] = {"map_us": 1e6 * t_map / n, "gather_us": 1e6 * t_gather / n, "scatter_us": 1e6 * t_scatter / n,
                         "gather_gbps": n * plans[0].nbytes / t_gather / 1e9}
        out[kib] = row
    print(json.dumps(out))


if __name__ == "__main__":
    main()
