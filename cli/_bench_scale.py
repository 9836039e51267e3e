"""`kvhandoff bench --sections scale`: aggregate handoff rate of a fleet.

For each size N in `--scale-sizes` (default 1,2,4,1) one fleet of N CTX
and N GEN instances (tp=1 each) runs small handoffs for `--sustain-s`
seconds from N front ends (each a Ray actor: its own process, as front
ends are) of `--scale-clients` concurrent clients each: the clients grow in
proportion to the instances. A front end submits straight to the GEN
coordinators (`submit`, the one call `Fleet.handoff` makes per handoff),
so no single driver process serializes the whole run. The same clients first run uncounted for min(2 s, half the
window), so no size pays for a cold start the others do not. Client k sends
its handoffs round-robin over every pair (ctx i, gen j), starting at pair k,
so traffic covers all N x N pairs evenly. The rate is completed handoffs per
second of wall time (the last in-flight ones included).

For the largest size, the same fleet again with front end j sending only
to pair (ctx j, gen j) (`own_pairs`): what the fleet costs when its
traffic does not spread over pairs, against the independent pairs.

In the same run, beside them: N_max independent one-pair `Deployment`s at
once (their own directory, coordinators and ranks; the same Ray cluster),
driven like the largest fleet: N_max front ends of `--scale-clients`
clients, client k sending round-robin over every deployment from
deployment k. So the clients spread their calls over N_max GEN
coordinators in both, as a router in front of either would: what differs
is only that a fleet's instances pair with every peer instance. A fleet
must not cost what independent pairs would not. (`own_pairs` above is the
other like-for-like view: each front end on one pair in both.)

Ratios (targets): rate(2x2) / rate(1x1) >= 1.8, rate(4x4) / rate(1x1) >=
2.8, rate(4x4 fleet) / rate(4 independent pairs) >= 1.0, on the GPU host
(16 cores); a 2-core box reports them, bound by its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import time
from collections.abc import Callable
from typing import Any

from kvhandoff.cli._console import Reporter
from kvhandoff.cli._flags import launch_options
from kvhandoff.topology import KVLayout

__all__ = ["scale", "scale_targets"]

#: Small requests: one 16 KiB block per rank (the control plane's load, not the link's).
SCALE_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=128, dtype="float16", tokens_per_block=16)


class _FrontEnd:
    """A front end in its own process (a Ray actor, no CPU reserved): `loops`
    concurrent loops, each submitting small handoffs straight to the GEN
    coordinators of `targets` ((coordinator actor name, CTX instance id),
    round-robin from its own start) for `seconds`. The submissions go as
    `Fleet.handoff` sends them (a `Submitter`: those made in one turn of the
    loop to one coordinator in one call), without one driver process
    serializing every client of the run."""

    async def drive(
        self, targets: list[tuple[str, str]], tokens: int, loops: int, start: int, seconds: float, tag: str
    ) -> dict[str, Any]:
        import ray

        from kvhandoff.actors._submit import SubmitRequest, Submitter
        from kvhandoff.protocol import ParentKey

        coords = {name: ray.get_actor(name) for name, _ in targets}
        submitter = Submitter()
        cpu0 = time.process_time()
        deadline = time.perf_counter() + seconds
        latencies: list[float] = []
        outcomes: collections.Counter[str] = collections.Counter()

        async def loop(k: int) -> None:
            i = 0
            while time.perf_counter() < deadline:
                name, ctx = targets[(start + k + i) % len(targets)]
                parent = ParentKey(request_id=f"{tag}-{k}-{i}", ctx_attempt=1, gen_attempt=1)
                t = time.perf_counter()
                try:
                    outcome = await submitter.submit(coords[name], SubmitRequest(parent, tokens, True, (), ctx))
                except Exception as exc:
                    outcome = f"error: {type(exc).__name__}"
                outcomes[outcome] += 1
                if outcome == "completed":
                    latencies.append(time.perf_counter() - t)
                i += 1

        began = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in range(loops)))
        return {
            "seconds": time.perf_counter() - began,
            "latencies": latencies,
            "outcomes": dict(outcomes),
            "cpu_s": time.process_time() - cpu0,
            "submits": submitter.counters,
        }


async def _front_ends(
    targets: list[list[tuple[str, str]]], tokens: int, loops: int, seconds: float, tag: str, failures: collections.Counter[str]
) -> dict[str, Any]:
    """One front-end actor per entry of `targets`, all at once; the rate."""
    import ray

    actor = ray.remote(num_cpus=0)(_FrontEnd)
    ends = [actor.remote() for _ in targets]
    busy0 = _host_busy_s()
    try:
        parts = await asyncio.gather(
            *(e.drive.remote(t, tokens, loops, j * loops, seconds, f"{tag}-{j}") for j, (e, t) in enumerate(zip(ends, targets)))
        )
    finally:
        busy1 = _host_busy_s()
        for e in ends:
            ray.kill(e)
    latencies = sorted(x for p in parts for x in p["latencies"])
    done = len(latencies)
    elapsed = max(p["seconds"] for p in parts)
    cpu: dict[str, Any] = {"front_ends_us": round(1e6 * sum(p["cpu_s"] for p in parts) / done, 1) if done else None}
    if busy0 is not None and busy1 is not None and done:
        # Every process of the host (Ray's own too), while the front ends ran.
        cpu["host_us"] = round(1e6 * (busy1 - busy0) / done, 1)
        cpu["host_busy_cores"] = round((busy1 - busy0) / elapsed, 2) if elapsed > 0 else None
    for p in parts:
        for outcome, n in p["outcomes"].items():
            if outcome != "completed":
                failures[outcome] += n
    return {
        "front_ends": len(targets),
        "clients": loops * len(targets),
        "completed": done,
        "seconds": elapsed,
        "handoffs_per_s": done / elapsed if elapsed > 0 else 0.0,
        "latency_p50_s": latencies[len(latencies) // 2] if latencies else None,
        "cpu_per_handoff": cpu,
        # Submissions per Ray call: calls of one, batches, and requests in all.
        "submits": {k: sum(p["submits"][k] for p in parts) for k in parts[0]["submits"]},
    }


def _host_busy_s() -> float | None:
    """CPU seconds the host's cores spent busy since boot (/proc/stat: all
    but idle and iowait); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / ticks


#: The rank counters `_work` sums: Ray calls carrying frames, frames, reports
#: to the coordinator (and those held for `report_gap_s`), stream writes and
#: frames read, completion reports that waited for other news.
_RANK_WORK = (
    "frame_calls", "frames_sent", "reports_sent", "reports_paced", "stream_writes", "frames_stream_in",
    "completion_reports_lazy",
)


async def _work(stats: list[dict[str, Any]]) -> collections.Counter[str]:
    """What the coordinators and ranks did so far, summed: rounds, Ray calls
    by kind, frames and reports (the work a handoff costs, machine-free)."""
    total: collections.Counter[str] = collections.Counter()
    for st in stats:
        for name, c in st.get("coordinators", {}).items():
            if isinstance(c, dict):
                total["rounds"] += int(c.get("rounds", 0))
                role = name.rstrip("0123456789")[-3:]  # "ctx0" -> "ctx"
                total.update({f"coord_{k}": int(v) for k, v in c.get("calls", {}).items()})
                total.update({f"coord_{role}_{k}": int(v) for k, v in c.get("calls", {}).items()})
                # CPU microseconds, by process kind and role.
                total[f"cpu_us_coord_{role}"] += int(1e6 * c.get("cpu_s", 0.0))
        for r in st.get("ranks", []):
            counters = r.get("counters", {}) if isinstance(r, dict) else {}
            role = r.get("role", "") if isinstance(r, dict) else ""
            # Summed, and by role: what a GEN and a CTX rank each did.
            for key in _RANK_WORK:
                total[f"rank_{key}"] += int(counters.get(key, 0))
                total[f"rank_{key}_{role}"] += int(counters.get(key, 0))
            if isinstance(r, dict) and "cpu_s" in r:
                total[f"cpu_us_rank_{role}"] += int(1e6 * r["cpu_s"])
    return total


def _round_ms(stats: list[dict[str, Any]]) -> dict[str, float]:
    """Each role's median round duration (ms), over its coordinators' medians
    of their latest rounds: a GEN round that pairs its batch with several CTX
    instances waits for the slowest one's answer."""
    by_role: dict[str, list[float]] = {}
    for st in stats:
        for name, c in st.get("coordinators", {}).items():
            if isinstance(c, dict) and c.get("round_s_p50") is not None:
                by_role.setdefault(name.rstrip("0123456789")[-3:], []).append(c["round_s_p50"] * 1e3)
    return {role: round(sorted(v)[len(v) // 2], 2) for role, v in sorted(by_role.items())}


def _per_handoff(before: collections.Counter[str], after: collections.Counter[str], n: int) -> dict[str, float]:
    return {k: round((after[k] - before[k]) / n, 3) for k in sorted(after) if n and after[k] != before[k]}


async def scale(args: argparse.Namespace, reporter: Reporter, rid: Callable[[str], str]) -> dict[str, Any]:
    """The `scale` section (module docstring)."""
    from kvhandoff.actors.deployment import Deployment
    from kvhandoff.actors.fleet import Fleet

    raw = args.scale_sizes
    # In the order given, repeats allowed ("1,2,4,1": the first size again
    # last, to see whether the order of the run favours one size).
    sizes = [int(s) for s in (raw if isinstance(raw, list) else str(raw).split(",")) if str(s).strip()]
    per = args.scale_clients
    tokens = SCALE_LAYOUT.tokens_per_block  # one block
    pool = max(64, 4 * per * max(sizes))  # every client's blocks in flight fit on every instance
    failures: collections.Counter[str] = collections.Counter()
    # Before each measurement the same clients run uncounted for a while:
    # the first handoffs of a fresh fleet pay for cold Ray workers and paths.
    warm_s = min(2.0, args.sustain_s / 2)
    # synthetic=False: time the protocol, not the test pattern.
    common = dict(layout=SCALE_LAYOUT, pool_blocks=pool, synthetic=False, **launch_options(args))
    rows = []
    own_pairs: dict[str, Any] = {}
    carrier: dict[str, Any] | None = None
    for n in sizes:
        with reporter.step(f"launching a {n}x{n} fleet (tp=1)", done=f"{n}x{n} fleet ready"):
            fleet = await Fleet.launch(ctx=n, gen=n, admit_at_open=not _in_rounds(args), **common)
        if fleet.carrier is not None:
            carrier = fleet.carrier.as_dict()  # the node's answer: the same for every launch of the run
        try:
            pairs = [(f"ctx{i}", f"gen{j}") for i in range(n) for j in range(n)]
            # Warm every pair once (negotiated at launch; agents load on first use).
            await asyncio.gather(*(fleet.handoff(rid("scale-warm"), tokens, ctx=c, gen=g) for c, g in pairs))

            # Every pair, as (GEN coordinator, CTX instance id); front end j
            # starts at its own offset, so traffic covers the pairs evenly.
            ids = {i["id"]: i["instance_id"] for i in fleet.instances()}
            routes = [(f"{fleet.name}.coord.{ids[g]}", ids[c]) for c, g in pairs]
            with reporter.step(f"{n}x{n}: {n} front ends x {per} clients for {args.sustain_s:g}s", done=f"{n}x{n} measured"):
                await _front_ends([routes] * n, tokens, per, warm_s, rid("scale-warm"), collections.Counter())
                before = await _work([await fleet.stats()])
                row = await _front_ends([routes] * n, tokens, per, args.sustain_s, rid("scale"), failures)
                after_stats = await fleet.stats()
                row["per_handoff"] = _per_handoff(before, await _work([after_stats]), row["completed"])
                row["round_ms_p50"] = _round_ms([after_stats])
            if n > 1 and n == max(sizes):
                # The same fleet with front end j on pair (ctx j, gen j) only:
                # what it costs when its traffic does not spread over pairs.
                own = [[(f"{fleet.name}.coord.{ids[f'gen{j}']}", ids[f"ctx{j}"])] for j in range(n)]
                with reporter.step(f"{n}x{n}: each front end on its own pair", done=f"{n}x{n} own pairs measured"):
                    await _front_ends(own, tokens, per, warm_s, rid("scale-warm"), collections.Counter())
                    before = await _work([await fleet.stats()])
                    own_row = await _front_ends(own, tokens, per, args.sustain_s, rid("scale-own"), failures)
                    after_stats = await fleet.stats()
                    own_row["per_handoff"] = _per_handoff(before, await _work([after_stats]), own_row["completed"])
                    own_row["round_ms_p50"] = _round_ms([after_stats])
                own_pairs = {"instances": n, "pairs": n, **own_row}
        finally:
            await fleet.shutdown()
        rows.append({"instances": n, "pairs": len(pairs), **row})
    independent: dict[str, Any] = {}
    k = max(sizes)
    if k > 1:
        with reporter.step(f"launching {k} independent one-pair deployments", done="deployments ready"):
            # The same admission as the fleets' (at the OPEN unless told otherwise): like for like.
            direct = not _in_rounds(args)
            deps = await asyncio.gather(
                *(Deployment.launch(ctx_tp=1, gen_tp=1, admit_at_open=direct, **common) for _ in range(k))
            )
        try:
            await asyncio.gather(*(d.handoff(rid("indep-warm"), tokens) for d in deps))

            # Every front end over every deployment, from its own offset: the
            # clients spread as the fleet's do (module docstring).
            routes = [[(f"{d.name}.coord.gen", "") for d in deps]] * k
            with reporter.step(f"{k} independent pairs: {k} front ends x {per} clients", done="independent pairs measured"):
                await _front_ends(routes, tokens, per, warm_s, rid("indep-warm"), collections.Counter())
                before = await _work(list(await asyncio.gather(*(d.stats() for d in deps))))
                independent = {
                    "deployments": k,
                    "routing": "every front end over every deployment",
                    **await _front_ends(routes, tokens, per, args.sustain_s, rid("indep"), failures),
                }
                after_stats = list(await asyncio.gather(*(d.stats() for d in deps)))
                independent["per_handoff"] = _per_handoff(before, await _work(after_stats), independent["completed"])
                independent["round_ms_p50"] = _round_ms(after_stats)
        finally:
            await asyncio.gather(*(d.shutdown() for d in deps), return_exceptions=True)
    # The best 1x1 of the run: a ratio to a slow 1x1 would flatter the fleet.
    base = max((r["handoffs_per_s"] for r in rows if r["instances"] == 1), default=None)
    for row in rows:
        row["over_1x1"] = row["handoffs_per_s"] / base if base else None
    out: dict[str, Any] = {
        "clients_per_instance": per,
        "seconds": args.sustain_s,
        "control_frames": carrier,
        "admit_at_open": not _in_rounds(args),
        "rows": rows,
    }
    if independent:
        out["independent"] = independent
        largest = max((r for r in rows if r["instances"] == k), key=lambda r: r["handoffs_per_s"])
        out["largest_over_independent"] = (
            largest["handoffs_per_s"] / independent["handoffs_per_s"] if independent["handoffs_per_s"] else None
        )
        if own_pairs:
            own_pairs["over_independent"] = (
                own_pairs["handoffs_per_s"] / independent["handoffs_per_s"] if independent["handoffs_per_s"] else None
            )
    if own_pairs:
        out["own_pairs"] = own_pairs
    out["failures"] = dict(failures)
    return out


def scale_table(scale_out: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """The `scale` section as table rows: one per fleet size, then the independent pairs."""
    headers = ["setup", "clients", "handoffs/s", "x 1x1", "p50 ms", "host CPU ms / handoff", "busy cores"]
    rows: list[list[Any]] = []

    def row(setup: str, r: dict[str, Any], over_1x1: str = "-") -> list[Any]:
        p50 = r.get("latency_p50_s")
        cpu = r.get("cpu_per_handoff") or {}
        us, cores = cpu.get("host_us"), cpu.get("host_busy_cores")
        return [
            setup, r["clients"], f"{r['handoffs_per_s']:.0f}", over_1x1, f"{p50 * 1e3:.1f}" if p50 else "-",
            f"{us / 1e3:.2f}" if us is not None else "-", f"{cores:.1f}" if cores is not None else "-",
        ]

    for r in scale_out.get("rows", []):
        over = f"{r['over_1x1']:.2f}" if r.get("over_1x1") else "-"
        rows.append(row(f"fleet {r['instances']}x{r['instances']}", r, over))
    own = scale_out.get("own_pairs")
    if own:
        rows.append(row(f"fleet {own['instances']}x{own['instances']}, own pairs", own))
    ind = scale_out.get("independent")
    if ind:
        rows.append(row(f"{ind['deployments']} independent pairs", ind))
    return headers, rows


def scale_targets(scale_out: dict[str, Any], cpu_note: str, add: Callable[..., None]) -> None:
    """The issue's fleet targets from one `scale` result."""
    best: dict[int, float] = {}
    for row in scale_out.get("rows", []):
        if row.get("over_1x1") is not None:
            best[row["instances"]] = max(best.get(row["instances"], 0.0), row["over_1x1"])
    for n, bound in ((2, 1.8), (4, 2.8)):
        if n in best:
            add(f"fleet {n}x{n} / 1x1 aggregate handoffs/s", best[n], ">=", bound, cpu_note)
    ratio = scale_out.get("largest_over_independent")
    if ratio is not None:
        n = scale_out["independent"]["deployments"]
        add(f"fleet {n}x{n} / {n} independent pairs, handoffs/s", ratio, ">=", 1.0, cpu_note)


def _in_rounds(args: Any) -> bool:
    """Does the scale section admit in rounds (`--admit-in-rounds` or
    `--scale-admit-in-rounds`)?"""
    return bool(getattr(args, "admit_in_rounds", False) or getattr(args, "scale_admit_in_rounds", False))
