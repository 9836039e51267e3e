"""Benchmark: where one engine receive's time goes, hop by hop.

Not a test. Starts a local Ray cluster and an `EngineDeployment` of one CTX
and one GEN rank over the test suite's engine workers (tests/actors/
test_engine.py: paged CTX memory, split GEN memory, host DRAM), turns on the
per-handoff trace of both coordinators and their ranks, and runs
``--handoffs`` receives one at a time (a prefill and publish first, each).
For every receive it lists the trace's events in time order, from the
client's call, and prints the median time of each event over the receives
after ``--warmup``, then the median time the client's ``receive`` returned
(``receive_ms_p50``). Beside it, in the same run, a plain Ray actor call's
round trip between two idle actors (``ray_call_ms_p50``, 200 calls after
200 to warm up) and the
ratio of the two (``receive_over_ray_call``). ``--json`` prints the same as
one JSON object.

    python bench/engine_receive_trace.py [--handoffs 40] [--warmup 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import sys
import time
from typing import Any

import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvhandoff.actors._carrier import probe_carriers  # noqa: E402
from kvhandoff.protocol import Role  # noqa: E402
from tests.actors import test_engine as te  # noqa: E402


async def _ray_call_ms() -> float:
    """A plain Ray actor call's round trip between two idle actors on this
    node: the control-frame carrier's own probe (its notification round
    trips are not used here)."""
    ray_rtts, _notif = await probe_carriers(ray.get_runtime_context().get_node_id(), rounds=200)
    return statistics.median(ray_rtts) * 1e3


async def _trace(handoffs: int, warmup: int) -> dict[str, Any]:
    eng = await te._engine(1, 1, "paged", "split")
    steps: dict[tuple[int, str, str], list[float]] = collections.defaultdict(list)
    returned: list[float] = []
    try:
        gen_coord, ctx_coord = eng.dep._coords[Role.GEN], eng.dep._coords[Role.CTX]
        await gen_coord.set_trace.remote(1, eng.dep.plan.ctx.instance_id)
        await ctx_coord.set_trace.remote(1, eng.dep.plan.gen.instance_id)
        for i in range(handoffs):
            ticket, ctx_blocks = await eng.prefill_and_publish(f"r{i}", seed=i, tokens=16)
            gen_blocks = eng.take(Role.GEN, len(ctx_blocks))
            t0 = time.time_ns()
            result = await eng.dep.receive(ticket, gen_blocks)
            t1 = time.time_ns()
            assert result.outcome == "completed", result
            await eng.give_back(ticket, gen_blocks, ctx_blocks)
            events = [*await gen_coord.trace_events.remote(f"r{i}"), *await ctx_coord.trace_events.remote(f"r{i}")]
            events = sorted((e for e in events if e.t_ns >= t0), key=lambda e: e.t_ns)
            if i < warmup:
                continue
            for k, e in enumerate(events):
                where = e.actor.split("@")[0] + "@" + e.actor.split("-")[-1]
                steps[(k, where, e.what)].append((e.t_ns - t0) / 1e6)
            returned.append((t1 - t0) / 1e6)
    finally:
        await eng.close()
    counted = handoffs - warmup
    ping = await _ray_call_ms()
    receive = statistics.median(returned)
    return {
        "handoffs": counted,
        "receive_ms_p50": round(receive, 2),
        "ray_call_ms_p50": round(ping, 3),
        "receive_over_ray_call": round(receive / ping, 2),
        # Events seen in most receives, in the order they happened.
        "events": [
            {"at": k, "where": where, "what": what, "ms_p50": round(statistics.median(v), 2), "seen": len(v)}
            for (k, where, what), v in sorted(steps.items())
            if len(v) > counted // 2
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--handoffs", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ray.init(num_cpus=min(os.cpu_count() or 2, 16), include_dashboard=False, log_to_driver=False)
    try:
        out = asyncio.run(_trace(args.handoffs, args.warmup))
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for e in out["events"]:
        print(f"{e['ms_p50']:8.2f} ms  {e['where']:<12} {e['what']}")
    print(f"{out['receive_ms_p50']:8.2f} ms  client       receive returned")
    print(f"{out['ray_call_ms_p50']:8.3f} ms  a plain Ray call's round trip ({out['receive_over_ray_call']}x)")


if __name__ == "__main__":
    main()
