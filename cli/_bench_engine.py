"""`kvhandoff bench --sections engine`: what a hosted endpoint costs the engine's Python.

An engine hosts its rank endpoint in its own worker process (`EndpointHost`):
the endpoint runs on the "kvhandoff" concurrency group's event loop, in its
own thread, while the engine's work (a forward pass, a scheduler step) runs
on another thread of the same process. Both need the GIL. This section
measures how much of the engine's pure-Python throughput the endpoint takes.

Two workers of the same class run the same CPU-bound Python loop (a
scheduler-like mix of dict, list and integer work, no C extension releasing
the GIL) on a worker thread for `--engine-spin-s` seconds, *at the same
time*, and report their iterations per second:

* **none**: a worker that never builds an endpoint (the baseline);
* **idle**: a worker hosting a GEN endpoint of a live deployment, no traffic;
* **load**: the same worker while the driver runs handoffs into it back to
  back (the endpoint applies admissions, opens, receives TERMINALs, reports).

Running the pair side by side makes each ratio (idle / none, load / none)
compare two loops that shared the same seconds of the machine: a slow spell
of a shared box, or the deployment's other processes, fall on both alike,
and what is left is what the endpoint costs inside its own process (the GIL
its thread holds, the core it takes). The result is the median ratio over
`--repeats` (at least 9) pairs, idle and load alternating. Targets: idle >=
0.98 x none (the issue's "<= 2 % slowdown when idle"); load is reported, not
bounded. Beside the loops, a quiet window measures the CPU time an idle
endpoint's process takes beyond a plain worker's: a bound on what the
engine's loop can lose to it (<= 2 % of a core), steady where the loop
ratio of a busy 2-core box is not.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

from kvhandoff.actors.endpoint import EnginePlan, ctx_endpoint, gen_endpoint
from kvhandoff.actors.engine import EngineDeployment
from kvhandoff.actors.rank import EndpointHost, endpoint_actor
from kvhandoff.cli._console import Reporter
from kvhandoff.protocol import Role
from kvhandoff.topology import KVLayout, heads_per_rank

__all__ = ["engine_cost", "engine_targets"]

#: A small model's paged KV (per-layer [blocks, 2, tokens, heads, dim]).
ENGINE_LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_block=16)
ENGINE_BLOCKS = 64
#: Tokens per handoff under load: 4 blocks.
LOAD_TOKENS = 64


def _spin(seconds: float) -> float:
    """Scheduler-like pure Python for `seconds`: iterations per second."""
    table: dict[int, list[int]] = {}
    n = 0
    deadline = time.perf_counter() + seconds
    while True:
        for _ in range(256):
            key = n & 1023
            row = table.setdefault(key, [])
            row.append(n)
            if len(row) > 8:
                del row[:4]
            n += 1
        if time.perf_counter() >= deadline:
            break
    return n / seconds


@endpoint_actor(num_cpus=0)
class _Worker(EndpointHost):
    """An engine worker: its own KV tensors, an endpoint only if asked."""

    def __init__(self, plan: EnginePlan | None, role: str, rank: int) -> None:
        if plan is None:
            return  # the baseline: no endpoint in this process
        spec = plan.spec(Role(role))
        heads = heads_per_rank(plan.layout, spec.tp)
        lay = plan.layout
        shape = (ENGINE_BLOCKS, 2, lay.tokens_per_block, heads, lay.head_dim)
        self.kv = [torch.zeros(shape, dtype=torch.float16) for _ in range(lay.num_layers)]
        make = ctx_endpoint if Role(role) is Role.CTX else gen_endpoint
        self.kvhandoff = make(plan, rank, self.kv)

    async def cpu_s(self) -> float:
        """This process's CPU time so far (every thread: the endpoint's, Ray's)."""
        return time.process_time()

    async def spin(self, seconds: float) -> float:
        """The engine's work on its own thread (as docs/design.md asks of an engine)."""
        out: list[float] = []
        thread = threading.Thread(target=lambda: out.append(_spin(seconds)))
        thread.start()
        while thread.is_alive():
            await asyncio.sleep(0.05)
        return out[0]


async def engine_cost(args: argparse.Namespace, reporter: Reporter, rid: Callable[[str], str]) -> dict[str, Any]:
    dep = await EngineDeployment.create(ctx_tp=1, gen_tp=1, layout=ENGINE_LAYOUT, ctx_memory="paged", gen_memory="paged")
    ctx = _Worker.remote(dep.plan, "ctx", 0)
    gen = _Worker.remote(dep.plan, "gen", 0)
    plain = _Worker.remote(None, "gen", 0)
    rates: dict[str, list[float]] = {"none_beside_idle": [], "idle": [], "none_beside_load": [], "load": []}
    handoffs = 0
    failures: dict[str, int] = {}
    try:
        await dep.attach([ctx], [gen])
        blocks = list(range(LOAD_TOKENS // ENGINE_LAYOUT.tokens_per_block))

        async def traffic(stop: asyncio.Event) -> None:
            nonlocal handoffs
            while not stop.is_set():
                request = rid("engine")
                ticket = await dep.publish(request, LOAD_TOKENS, blocks)
                result = await dep.receive(ticket.encode(), blocks, timeout=60)
                await dep.returned(ticket, Role.CTX, timeout=60)
                if result.outcome == "completed":
                    handoffs += 1
                else:
                    failures[result.outcome] = failures.get(result.outcome, 0) + 1

        async def pair() -> tuple[float, float]:
            """(none, endpoint) iterations/s, spun side by side."""
            none, hosted = await asyncio.gather(
                plain.spin.remote(args.engine_spin_s), gen.spin.remote(args.engine_spin_s)
            )
            return float(none), float(hosted)

        async def run(variant: str) -> tuple[float, float]:
            if variant == "idle":
                return await pair()
            stop = asyncio.Event()
            load = asyncio.ensure_future(traffic(stop))
            try:
                return await pair()
            finally:
                stop.set()
                await load

        for variant in ("idle", "load"):  # warm-up: imports, maps, connections
            await run(variant)
        # What an idle endpoint takes at all: its process's CPU time over a
        # quiet window, beside the same worker without one. The engine's
        # loop cannot lose more than that (GIL or core) to it.
        before = await asyncio.gather(plain.cpu_s.remote(), gen.cpu_s.remote())
        window = time.perf_counter()
        await asyncio.sleep(5 * args.engine_spin_s)
        after = await asyncio.gather(plain.cpu_s.remote(), gen.cpu_s.remote())
        window = time.perf_counter() - window
        idle_cpu = {"none": (after[0] - before[0]) / window, "idle": (after[1] - before[1]) / window}
        for rep in range(max(args.repeats, 9)):
            for variant in ("idle", "load") if rep % 2 else ("load", "idle"):
                none, hosted = await run(variant)
                rates[f"none_beside_{variant}"].append(none)
                rates[variant].append(hosted)
        reporter.line(f"engine: {handoffs} handoffs under load")
    finally:
        await dep.shutdown()
        for w in (ctx, gen, plain):
            ray.kill(w)
    median = {k: statistics.median(v) for k, v in rates.items()}
    idle = [i / n for i, n in zip(rates["idle"], rates["none_beside_idle"])]
    load = [x / n for x, n in zip(rates["load"], rates["none_beside_load"])]
    return {
        "spin_s": args.engine_spin_s,
        "iterations_per_s": rates,
        "median": median,
        "idle_over_none_per_repeat": idle,
        "load_over_none_per_repeat": load,
        "idle_over_none": statistics.median(idle),
        "idle_cpu_share": idle_cpu,
        "idle_endpoint_cpu_share": idle_cpu["idle"] - idle_cpu["none"],
        "load_over_none": statistics.median(load),
        "handoffs_under_load": handoffs,
        "failures": failures,
    }


def engine_targets(out: dict[str, Any], add: Callable[..., None]) -> None:
    add("engine Python loop with an idle endpoint / without one (median)", out["idle_over_none"], ">=", 0.98)
    if "idle_endpoint_cpu_share" in out:
        add("an idle endpoint's CPU time beyond a plain worker's / wall time", out["idle_endpoint_cpu_share"], "<=", 0.02,
            "a bound on the slowdown: the engine's loop cannot lose more to it")
    add("engine Python loop under handoff load / without an endpoint (median)", out["load_over_none"], ">=", 0.0,
        "reported, not bounded (the issue asks for it reported)")
