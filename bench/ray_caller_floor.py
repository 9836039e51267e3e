"""Ray's own floor for the soak: does an async actor that makes calls grow?

Two empty async actors: a caller awaits `ping` on a callee, 4 calls at a
time, with a `ParentKey` argument (as the coordinators and ranks do). Every
10 s both processes' settled resident bytes are sampled (after
`gc.collect()` and `malloc_trim(0)`, as `kvhandoff bench --sections soak`
does), and the least-squares slope over the last two thirds of the samples is
printed in bytes per call, as JSON on the last line.

    python bench/ray_caller_floor.py [calls] [seconds]   # default 200,000, 120 s
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import ray

from kvhandoff.cli._bench_soak import settled_resident, slope


@ray.remote(num_cpus=0)
class Callee:
    async def ping(self, x: Any) -> Any:
        return x


@ray.remote(num_cpus=0)
class Caller:
    def __init__(self, callee: Any) -> None:
        self.callee = callee
        self.calls = 0

    async def loop(self, n: int, fanout: int, seconds: float) -> int:
        from kvhandoff.protocol import ParentKey

        async def one(i: int) -> None:
            await self.callee.ping.remote(ParentKey(request_id=f"r{i}", ctx_attempt=0, gen_attempt=0))

        end = time.monotonic() + seconds
        for i in range(0, n, fanout):
            if time.monotonic() > end:
                break
            await asyncio.gather(*(one(i + k) for k in range(fanout)))
            self.calls += fanout
        return self.calls

    def rss(self) -> tuple[int, int | None]:
        return self.calls, settled_resident()


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    ray.init(num_cpus=2, include_dashboard=False)
    callee = Callee.remote()  # type: ignore[attr-defined]
    caller = Caller.remote(callee)  # type: ignore[attr-defined]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 120.0
    done_ref = caller.loop.remote(total, 4, seconds)
    samples: list[tuple[int, int, int]] = []
    start = time.time()
    while True:
        done, _ = ray.wait([done_ref], timeout=10)
        calls, rss = ray.get(caller.rss.remote())
        callee_rss = ray.get(callee.__ray_call__.remote(settled_resident))
        samples.append((calls, rss, callee_rss))
        print(round(time.time() - start), calls, rss, callee_rss, flush=True)
        if done:
            break
    tail = samples[len(samples) // 3 :]
    print(
        json.dumps(
            {
                "calls": samples[-1][0],
                "seconds": round(time.time() - start, 1),
                "caller_bytes_per_call": slope([c for c, _, _ in tail], [r for _, r, _ in tail]),
                "callee_bytes_per_call": slope([c for c, _, _ in tail], [r for _, _, r in tail]),
            }
        )
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
