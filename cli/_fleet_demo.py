"""`kvhandoff demo --ctx-instances N --gen-instances M`: the demo on a fleet.

The same workload as the one-pair demo (cli/_demo.py: log-uniform sizes,
`--cancel-rate` of them cancelled by a concurrent `cancel()` after a random
delay, so the cancels land in every phase), run through a `Fleet`
(actors/fleet.py): the built-in chooser pairs each request with a GEN
instance (most free blocks) and a CTX instance (round-robin). `--ctx-tp` and
`--gen-tp` take one TP or a comma list, cycled over the instances.

With `--chaos` and N, M >= 2 the run also goes through a membership storm,
each step triggered by the workload's progress (a share of the requests
finished), never by the clock:

- kill_rank: rank 0 of the last CTX instance is killed; its coordinator
  restarts it (new epoch), handoffs touching that instance may fail;
- kill_coordinator: the last GEN instance's coordinator is killed (its ranks
  die with it); the fleet fences it at once and takes it out;
- join: a replacement for it joins with the next incarnation and serves;
- drain: the first GEN instance drains (its handoffs finish) and leaves.

A fleet's data plane is direct, and it runs in the qualified scope: the
demo's `--data-mode`, `--unqualified` and `--placement` apply to one pair
only. With `--memory VRAM` the ranks share the cluster's GPUs (room is left
for the replacement instance).

`bystander_failed` counts handoffs that failed (or timed out) although
neither of their instances (by incarnation) was killed: it must be 0.
`faults` lists what happened, `pairs` the outcomes per pair of logical
names, `instances` every instance at the end. The invariants are the
demo's: S2 (no rank saw foreign bytes), S4 (every live rank's pool checks
itself), L1 (no handoff timed out), L2 (no block leaked on a live rank),
plus bystander_failed = 0.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import time
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.cli._console import Reporter

__all__ = ["run_fleet", "FleetReport", "tps"]

#: Shares of the requests finished at which each chaos step starts.
CHAOS_AT = (("kill_rank", 0.15), ("kill_coordinator", 0.35), ("join", 0.5), ("drain", 0.7))
#: After the workload, how long the live ranks may take to give back every block.
SETTLE_S = 30.0


def tps(values: list[int] | int, count: int) -> list[int]:
    """`--ctx-tp 2,1` over `count` instances: the list, cycled."""
    values = values if isinstance(values, list) else [values]
    return [values[i % len(values)] for i in range(count)]


@dataclass
class FleetReport:
    """What the fleet demo's JSON object and summary are made of."""

    args: dict[str, Any]
    results: list[Any]
    stats: dict[str, Any]
    faults: list[dict[str, Any]]
    faulted: set[str]
    durations: dict[str, float]
    violations: list[str] = field(default_factory=list)

    def outcomes(self) -> dict[str, int]:
        counts = collections.Counter(r.outcome for r in self.results)
        return {o: counts.get(o, 0) for o in ("completed", "cancelled", "rejected", "failed", "timeout")}

    def bystander_failed(self) -> int:
        return sum(
            1
            for r in self.results
            if r.outcome in ("failed", "timeout") and not ({r.ctx_instance, r.gen_instance} & self.faulted)
        )

    def ranks(self) -> list[dict[str, Any]]:
        return [s for s in self.stats.get("ranks", []) if "error" not in s]

    def leaked(self) -> int:
        return sum(int(s["pool"]) - int(s["free"]) - int(s["quarantined"]) for s in self.ranks())

    def quarantined(self) -> int:
        return sum(int(s["quarantined"]) for s in self.ranks())

    def check(self) -> None:
        """The invariants (module docstring); each broken one is a line."""
        for s in self.stats.get("ranks", []):
            if "error" in s:
                self.violations.append(f"S4: {s.get('instance')} rank {s.get('rank')} did not answer: {s['error'][:200]}")
            for v in s.get("violations", []):
                self.violations.append(f"S2: {s.get('instance')}: {v}")
        if self.outcomes()["timeout"]:
            self.violations.append(f"L1: {self.outcomes()['timeout']} handoffs timed out")
        if self.leaked():
            self.violations.append(f"L2: {self.leaked()} blocks leaked")
        if self.bystander_failed():
            self.violations.append(f"{self.bystander_failed()} handoffs failed between instances without a fault")
        for name, c in self.stats.get("coordinators", {}).items():
            if c.get("state") not in ("running", "draining"):
                self.violations.append(f"instance {name}'s coordinator is {c.get('state')}")

    def to_json(self) -> dict[str, Any]:
        outcomes = self.outcomes()
        pairs: dict[str, dict[str, int]] = {}
        for key, counts in self.stats.get("pairs", {}).items():
            pairs[key] = {o: int(counts.get(o, 0)) for o in ("completed", "cancelled", "failed")}
        return {
            "requests": len(self.results),
            **outcomes,
            "outcomes": outcomes,
            "bytes_verified": sum(r.bytes_verified for r in self.results),
            "leaked_blocks": self.leaked(),
            "quarantined_blocks": self.quarantined(),
            "invariant_violations": list(self.violations),
            "ok": not self.violations,
            "instances": [
                {k: i[k] for k in ("id", "role", "tp", "incarnation", "state")} for i in self.stats.get("instances", [])
            ],
            "pairs": pairs,
            "faults": self.faults,
            "bystander_failed": self.bystander_failed(),
            # Handoffs that ended "timeout": which pair, and what each rank said.
            "timeouts": [
                {
                    "request_id": r.request_id, "ctx_instance": r.ctx_instance, "gen_instance": r.gen_instance,
                    "ctx_outcomes": list(r.ctx_outcomes), "gen_outcomes": list(r.gen_outcomes),
                    "latency_s": r.latency_s,
                }
                for r in self.results
                if r.outcome == "timeout"
            ],
            # Parents still quarantined at the end: where, paired with whom,
            # and each edge's evidence (whose proof is missing).
            "quarantined_parents": [
                {"instance": s.get("instance"), "role": s.get("role"), "rank": s.get("rank"), "epoch": s.get("epoch"), **q}
                for s in self.ranks()
                for q in s.get("quarantine", [])
            ][:32],
            "control_frames": self.stats.get("control_frames"),
            "wall_s": self.durations.get("total_s", 0.0),
            "durations": dict(self.durations),
            "config": dict(self.args),
        }


async def run_fleet(args: argparse.Namespace, reporter: Reporter) -> FleetReport:
    """Launch the fleet, run the workload (and the storm), settle, report."""
    from kvhandoff.actors.fleet import Fleet, InstanceUnavailable
    from kvhandoff.cli._demo import DELAYED, plan_workload

    n, m = args.ctx_instances, args.gen_instances
    ctx_tps, gen_tps = tps(args.ctx_tp, n), tps(args.gen_tp, m)
    durations: dict[str, float] = {}
    t = time.perf_counter()
    from kvhandoff.cli._demo import _LaunchFailed

    gpus_per_rank = getattr(args, "gpus_per_rank", 0.0) or 1.0
    if args.memory == "VRAM" and not getattr(args, "gpus_per_rank", 0.0):
        import ray

        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus:  # every rank on a GPU: share them when there are fewer GPUs than ranks
            gpus_per_rank = min(1.0, int(100 * gpus / (sum(ctx_tps) + sum(gen_tps) + gen_tps[-1])) / 100)

    try:
        with reporter.step(f"launching a fleet: CTX tp={ctx_tps} x GEN tp={gen_tps} ({args.memory}, NIXL/UCX)", done="fleet ready"):
            fleet = await Fleet.launch(
                ctx=ctx_tps,
                gen=gen_tps,
                pool_blocks=args.pool_blocks,
                memory=args.memory,
                gpus_per_rank=gpus_per_rank,
                start_timeout_s=args.start_timeout,
                round_timeout_s=10.0,
                control_frames=getattr(args, "control_frames", "stream"),
                name=f"kvh-fleet-{random.getrandbits(24):06x}",
            )
    except Exception as exc:  # InvalidConfig, LaunchFailed: one line, no traceback
        raise _LaunchFailed(f"{type(exc).__name__}: {exc}") from exc
    durations["launch_s"] = time.perf_counter() - t
    plan = plan_workload(args.requests, args.cancel_rate, args.seed, exact_phases=False)
    results: list[Any] = []
    faults: list[dict[str, Any]] = []
    faulted: set[str] = set()
    finished = asyncio.Event()
    t0 = time.perf_counter()

    async def one(planned: Any) -> None:
        canceller = None
        try:
            if planned.cancel == DELAYED:
                async def cancel_later() -> None:
                    await asyncio.sleep(planned.cancel_delay_s)
                    await fleet.cancel(planned.request_id)
                canceller = asyncio.create_task(cancel_later())
            try:
                result = await fleet.handoff(planned.request_id, planned.num_tokens, timeout=60.0)
            except InstanceUnavailable:  # no instance of a role served at that moment
                from kvhandoff.actors.deployment import HandoffResult

                result = HandoffResult(request_id=planned.request_id, outcome="rejected")
            results.append(result)
        finally:
            if canceller is not None:
                canceller.cancel()
            finished.set()

    async def storm() -> None:
        victim_ctx = f"ctx{n - 1}"
        victim_gen, drained = f"gen{m - 1}", "gen0"
        for kind, share in CHAOS_AT:
            while len(results) < share * len(plan):
                finished.clear()
                await finished.wait()
            at = round(time.perf_counter() - t0, 3)
            if kind == "kill_rank":
                faulted.add(fleet._named(victim_ctx).id)
                import ray

                ray.kill((await fleet.instance_ranks(victim_ctx))[0], no_restart=True)
                faults.append({"kind": kind, "instance": victim_ctx, "at_s": at})
            elif kind == "kill_coordinator":
                import ray

                faulted.add(fleet._named(victim_gen).id)
                ray.kill(fleet.coordinator_of(victim_gen), no_restart=True)
                faults.append({"kind": kind, "instance": victim_gen, "at_s": at})
                while fleet._named(victim_gen).state != "dead":  # the watch sees it: a condition
                    await asyncio.sleep(0.02)
            elif kind == "join":
                await fleet.add_instance("gen", gen_tps[-1], name=victim_gen)
                faults.append({"kind": kind, "instance": victim_gen, "at_s": at})
            elif kind == "drain":
                faults.append({"kind": kind, "instance": drained, "at_s": at})
                await fleet.drain(drained, 120.0)

    chaos = bool(args.chaos) and n >= 2 and m >= 2
    try:
        reporter.start_requests(len(plan), f"{len(plan)} requests over {n} x {m} instances" + (", chaos" if chaos else ""))
        try:
            sem = asyncio.Semaphore(args.concurrency)

            async def bounded(p: Any) -> None:
                async with sem:
                    await one(p)
                reporter.request_done(results[-1].outcome if results else "?")

            storm_task = asyncio.create_task(storm()) if chaos else None
            await asyncio.gather(*(bounded(p) for p in plan))
            if storm_task is not None:
                await storm_task
        finally:
            reporter.end_requests()
        durations["workload_s"] = time.perf_counter() - t0
        t = time.perf_counter()
        with reporter.step("settling", done="settled"):
            deadline = time.monotonic() + SETTLE_S
            while True:
                stats = await fleet.stats()
                if all(s.get("leased") == 0 for s in stats["ranks"]) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
        durations["settle_s"] = time.perf_counter() - t
    finally:
        t = time.perf_counter()
        await fleet.shutdown()
        durations["shutdown_s"] = time.perf_counter() - t
    report = FleetReport(
        args={k: v for k, v in vars(args).items() if isinstance(v, int | float | str | bool) or v is None},
        results=results,
        stats=stats,
        faults=faults,
        faulted=faulted,
        durations=durations,
    )
    report.check()
    return report


def print_summary(report: FleetReport) -> None:
    """A short plain summary on stdout."""
    data = report.to_json()
    print(f"fleet: {len(data['instances'])} instances, {data['requests']} requests in {data['wall_s']:.1f}s")
    for i in data["instances"]:
        print(f"  {i['id']:<8} {i['role']} tp={i['tp']} incarnation {i['incarnation']}: {i['state']}")
    print("pairs:")
    for key, counts in sorted(data["pairs"].items()):
        print(f"  {key:<14} " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    for f in data["faults"]:
        print(f"fault: {f['kind']} {f['instance']} at {f['at_s']:.2f}s")
    print(
        "outcomes: " + ", ".join(f"{k} {v}" for k, v in data["outcomes"].items())
        + f"; bystander_failed {data['bystander_failed']}; leaked {data['leaked_blocks']}, quarantined {data['quarantined_blocks']}"
    )
    print("invariants: " + ("all hold" if data["ok"] else "; ".join(data["invariant_violations"])))
