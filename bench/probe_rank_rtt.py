"""How much of a Ray hop is ours: round trips to a bare async actor and to a
real rank actor (idle, and while handoffs run), from the driver and from
inside an async actor, interleaved in one run. Prints one JSON line.

    python bench/probe_rank_rtt.py [N]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

import ray

from kvhandoff.actors.deployment import Deployment
from kvhandoff.protocol import Role


@ray.remote(num_cpus=0)
class Bare:
    async def ping(self) -> int:
        return 0


async def round_trips(target, n: int) -> list[float]:
    """`n` sequential `target.ping` round trips, in seconds each."""

    async def one() -> float:
        start = time.perf_counter()
        await target.ping.remote()
        return time.perf_counter() - start

    return [await one() for _ in range(n)]


@ray.remote(num_cpus=0)
class Caller:
    async def rtts(self, target, n: int) -> list[float]:
        return await round_trips(target, n)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[max(0, int(q * len(xs)) - 1)] * 1e6


async def main(n: int) -> dict:
    dep = await Deployment.launch(ctx_tp=1, gen_tp=1)
    try:
        (rank,) = await dep.ranks(Role.CTX)
        bare, caller = Bare.remote(), Caller.remote()
        await bare.ping.remote()
        await caller.rtts.remote(bare, 10)
        samples: dict[str, list[float]] = {k: [] for k in ("driver->bare", "driver->rank", "actor->bare", "actor->rank")}
        for _ in range(n // 100):
            for name, target in (("bare", bare), ("rank", rank)):
                samples[f"driver->{name}"] += await round_trips(target, 50)
                samples[f"actor->{name}"] += await caller.rtts.remote(target, 50)
        # The rank while small handoffs run back to back.
        busy: list[float] = []
        stop = False

        async def load() -> int:
            k = 0
            while not stop:
                await dep.handoff(f"probe-{k}", 64, timeout=30.0)
                k += 1
            return k

        task = asyncio.ensure_future(load())
        await asyncio.sleep(0.5)
        busy = await caller.rtts.remote(rank, n // 2)
        stop = True
        handoffs = await task
        samples["actor->rank, handoffs running"] = busy
        return {
            "n": n,
            "handoffs_during_busy": handoffs,
            "p50_us": {k: round(pct(v, 0.5)) for k, v in samples.items()},
            "p99_us": {k: round(pct(v, 0.99)) for k, v in samples.items()},
            "mean_us": {k: round(statistics.mean(v) * 1e6) for k, v in samples.items()},
        }
    finally:
        await dep.shutdown()


if __name__ == "__main__":
    ray.init(include_dashboard=False, log_to_driver=False)
    print(json.dumps(asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000))))
