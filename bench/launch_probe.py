"""GPU probe: the host-side cost of launching one staged gather / scatter
(index_select into a slot, index_copy_ out of it) in one process, alone or
with N copies of itself running on the same GPU. Prints one JSON line per
process. Usage: python bench/launch_probe.py [procs]"""

import json
import multiprocessing as mp
import sys
import time

import torch


def one(i: int, q) -> None:
    dev = "cuda:0"
    mem = torch.zeros(512 << 20, dtype=torch.uint8, device=dev)
    slot = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    unit = 16 << 10
    rows = (64 << 20) // unit
    src = mem.view(torch.complex128).view(-1, unit // 16)
    out = slot.view(torch.complex128).view(-1, unit // 16)
    idx = torch.randperm(src.shape[0], device=dev)[:rows].contiguous()
    res = {}
    for name, fn in (
        ("index_select_out", lambda: torch.index_select(src, 0, idx, out=out)),
        ("index_copy_", lambda: src.index_copy_(0, idx, out)),
        ("event_record", lambda: torch.cuda.Event().record()),
    ):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        calls = []
        t_all = time.perf_counter()
        for _ in range(50):
            t0 = time.perf_counter()
            fn()
            calls.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        gpu = (time.perf_counter() - t_all) / 50
        calls.sort()
        res[name] = {"call_us_p50": 1e6 * calls[25], "call_us_p90": 1e6 * calls[45], "per_op_us_incl_gpu": 1e6 * gpu}
    q.put({"proc": i, **res})


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=one, args=(i, q)) for i in range(n)]
    for p in ps:
        p.start()
    for _ in ps:
        print(json.dumps({"procs": n, **q.get()}))
    for p in ps:
        p.join()
