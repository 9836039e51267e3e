"""`kvhandoff bench --sections scale`: aggregate handoff rate of a fleet.

Setups. For each size N in `--scale-sizes` (default 1,2,4) one fleet of N
CTX and N GEN instances (tp=1 each), driven by N front ends (each a Ray
actor: its own process, as front ends are) of `--scale-clients` concurrent
clients each: the clients grow in proportion to the instances. A front end
submits straight to the GEN coordinators (`submit`, as `Fleet.handoff`
sends it), so no single driver process serializes the run. Client k sends
its small handoffs round-robin over every pair (ctx i, gen j), starting at
pair k, so traffic covers all N x N pairs evenly. For the largest size, the
same fleet again with front end j sending only to pair (ctx j, gen j)
(`own_pairs`): what the fleet costs when its traffic does not spread over
pairs. Beside them, N_max independent one-pair `Deployment`s (their own
directory, coordinators and ranks; the same Ray cluster), driven like the
largest fleet: N_max front ends, client k round-robin over every
deployment from deployment k. So the clients spread over N_max GEN
coordinators in both, as a router in front of either would: what differs is
only that a fleet's instances pair with every peer instance. A fleet must
not cost what independent pairs would not.

Interleaved windows. Every setup is launched first and stays up (an idle
setup costs the host a few hundredths of a core), and each runs uncounted
for min(2 s, half a window) once. Then `--scale-repeats` repeats (default 3)
each give every setup one window of `--sustain-s` seconds, in an order
rotated by the repeat, so no setup always runs first or after the same one.
A window's rate is its completed handoffs per second of wall time (the last
in-flight ones included); a setup's figure is the median of its windows. A
ratio is taken window against window within each repeat (a slow minute of
the host hits both) and its figure is the median over the repeats; each
repeat's ratio is kept beside it (`ratios`).

Ratios (targets): rate(2x2) / rate(1x1) >= 1.8, rate(4x4) / rate(1x1) >=
2.8, rate(4x4 fleet) / rate(4 independent pairs) >= 1.0, on the GPU host
(16 cores); a 2-core box reports them, bound by its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
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
        try:
            await asyncio.gather(*(loop(k) for k in range(loops)))
        finally:
            submitter.close()
        return {
            "seconds": time.perf_counter() - began,
            "latencies": latencies,
            "outcomes": dict(outcomes),
            "cpu_s": time.process_time() - cpu0,
            "submits": submitter.counters | {"channel_sends": submitter.channel_counters["channel_sends"]},
        }


async def _front_ends(
    ends: list[Any], targets: list[list[tuple[str, str]]], tokens: int, loops: int, seconds: float, tag: str,
    failures: collections.Counter[str],
) -> dict[str, Any]:
    """Front end j of `ends` drives `targets[j]`, all at once: one window's
    rate, its latencies (`_latencies`, dropped from the output) and the CPU
    it cost."""
    busy0 = _host_busy_s()
    parts = await asyncio.gather(
        *(e.drive.remote(t, tokens, loops, j * loops, seconds, f"{tag}-{j}") for j, (e, t) in enumerate(zip(ends, targets)))
    )
    busy1 = _host_busy_s()
    latencies = sorted(x for p in parts for x in p["latencies"])
    for p in parts:
        for outcome, n in p["outcomes"].items():
            if outcome != "completed":
                failures[outcome] += n
    elapsed = max(p["seconds"] for p in parts)
    return {
        "completed": len(latencies),
        "seconds": elapsed,
        "handoffs_per_s": len(latencies) / elapsed if elapsed > 0 else 0.0,
        "_latencies": latencies,
        "_front_end_cpu_s": sum(p["cpu_s"] for p in parts),
        "_host_busy_s": busy1 - busy0 if busy0 is not None and busy1 is not None else None,
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


@dataclass
class _Setup:
    """One thing the section measures: a fleet with its traffic over every
    pair, the largest fleet with each front end on its own pair, or the
    independent pairs; `routes[j]` is front end j's targets."""

    key: str
    instances: int
    pairs: int
    routes: list[list[tuple[str, str]]]
    stats: Callable[[], Awaitable[list[dict[str, Any]]]]
    windows: list[dict[str, Any]] = field(default_factory=list)
    work: collections.Counter[str] = field(default_factory=collections.Counter)
    last_stats: list[dict[str, Any]] = field(default_factory=list)

    async def measure(self, ends: list[Any], tokens: int, per: int, seconds: float, tag: str, failures: collections.Counter[str]) -> None:
        before = await _work(await self.stats())
        window = await _front_ends(ends, self.routes, tokens, per, seconds, tag, failures)
        self.last_stats = await self.stats()
        after = await _work(self.last_stats)
        self.work.update({k: after[k] - before[k] for k in after})
        self.windows.append(window)

    def summary(self) -> dict[str, Any]:
        """Every window together: the median window rate (the figure), each
        window's rate in run order, and the work and CPU per handoff over all."""
        ws = self.windows
        rates = [w["handoffs_per_s"] for w in ws]
        done = sum(w["completed"] for w in ws)
        seconds = sum(w["seconds"] for w in ws)
        latencies = sorted(x for w in ws for x in w["_latencies"])
        cpu: dict[str, Any] = {"front_ends_us": round(1e6 * sum(w["_front_end_cpu_s"] for w in ws) / done, 1) if done else None}
        busy = [w["_host_busy_s"] for w in ws]
        if done and None not in busy:
            # Every process of the host (Ray's own and idle setups' too), while the front ends ran.
            cpu["host_us"] = round(1e6 * sum(busy) / done, 1)
            cpu["host_busy_cores"] = round(sum(busy) / seconds, 2) if seconds > 0 else None
        submits: collections.Counter[str] = collections.Counter()
        for w in ws:
            submits.update(w["submits"])
        return {
            "instances": self.instances,
            "pairs": self.pairs,
            "front_ends": len(self.routes),
            "clients": 0,  # set by the caller: front ends x clients each
            "handoffs_per_s": statistics.median(rates) if rates else 0.0,
            "rates": [round(r, 1) for r in rates],
            "completed": done,
            "seconds": seconds,
            "latency_p50_s": latencies[len(latencies) // 2] if latencies else None,
            "cpu_per_handoff": cpu,
            "per_handoff": _per_handoff(collections.Counter(), self.work, done),
            "round_ms_p50": _round_ms(self.last_stats),
            "submits": dict(submits),
        }


def _ratio(top: _Setup, bottom: _Setup) -> dict[str, Any]:
    """top / bottom, window by window within each repeat (both measured
    within one repeat of the run: a slow minute of the host hits both), and
    the median of those: the figure a target compares."""
    per = [t["handoffs_per_s"] / b["handoffs_per_s"] for t, b in zip(top.windows, bottom.windows) if b["handoffs_per_s"]]
    return {"median": statistics.median(per) if per else None, "per_repeat": [round(x, 3) for x in per]}


async def scale(args: argparse.Namespace, reporter: Reporter, rid: Callable[[str], str]) -> dict[str, Any]:
    """The `scale` section (module docstring)."""
    import ray

    from kvhandoff.actors.deployment import Deployment
    from kvhandoff.actors.fleet import Fleet

    raw = args.scale_sizes
    # Each size once, in the order given (a repeated size adds nothing: every
    # size is measured in every repeat).
    sizes = list(dict.fromkeys(int(s) for s in (raw if isinstance(raw, list) else str(raw).split(",")) if str(s).strip()))
    repeats = getattr(args, "scale_repeats", 3)
    per = args.scale_clients
    tokens = SCALE_LAYOUT.tokens_per_block  # one block
    k = max(sizes)
    pool = max(64, 4 * per * k)  # every client's blocks in flight fit on every instance
    failures: collections.Counter[str] = collections.Counter()
    # Before its first window each setup runs uncounted for a while: the first
    # handoffs of a fresh fleet pay for cold Ray workers and paths.
    warm_s = min(2.0, args.sustain_s / 2)
    # synthetic=False: time the protocol, not the test pattern.
    common = dict(layout=SCALE_LAYOUT, pool_blocks=pool, synthetic=False, **launch_options(args))
    direct = not _in_rounds(args)  # the same admission for fleets and independent pairs: like for like
    fleets: list[Any] = []
    deps: list[Any] = []
    ends: list[Any] = []
    setups: list[_Setup] = []
    carrier: dict[str, Any] | None = None
    try:
        for n in sizes:
            with reporter.step(f"launching a {n}x{n} fleet (tp=1)", done=f"{n}x{n} fleet ready"):
                fleet = await Fleet.launch(ctx=n, gen=n, admit_at_open=direct, **common)
            fleets.append(fleet)
            if fleet.carrier is not None:
                carrier = fleet.carrier.as_dict()  # the node's answer: the same for every launch of the run
            pairs = [(f"ctx{i}", f"gen{j}") for i in range(n) for j in range(n)]
            # Warm every pair once (negotiated at launch; agents load on first use).
            await asyncio.gather(*(fleet.handoff(rid("scale-warm"), tokens, ctx=c, gen=g) for c, g in pairs))
            ids = {i["id"]: i["instance_id"] for i in fleet.instances()}
            coord = {name: f"{fleet.name}.coord.{ids[name]}" for name in ids}

            async def stats(fleet: Any = fleet) -> list[dict[str, Any]]:
                return [await fleet.stats()]

            # Every pair, as (GEN coordinator, CTX instance id); front end j
            # starts at its own offset, so traffic covers the pairs evenly.
            routes = [(coord[g], ids[c]) for c, g in pairs]
            setups.append(_Setup(f"{n}x{n}", n, len(pairs), [routes] * n, stats))
            if n > 1 and n == k:
                # The same fleet with front end j on pair (ctx j, gen j) only:
                # what it costs when its traffic does not spread over pairs.
                own = [[(coord[f"gen{j}"], ids[f"ctx{j}"])] for j in range(n)]
                setups.append(_Setup("own", n, n, own, stats))
        if k > 1:
            with reporter.step(f"launching {k} independent one-pair deployments", done="deployments ready"):
                deps = list(await asyncio.gather(
                    *(Deployment.launch(ctx_tp=1, gen_tp=1, admit_at_open=direct, **common) for _ in range(k))
                ))
            await asyncio.gather(*(d.handoff(rid("indep-warm"), tokens) for d in deps))

            async def indep_stats() -> list[dict[str, Any]]:
                return list(await asyncio.gather(*(d.stats() for d in deps)))

            # Every front end over every deployment, from its own offset: the
            # clients spread as the fleet's do (module docstring).
            setups.append(_Setup("independent", k, k, [[(f"{d.name}.coord.gen", "") for d in deps]] * k, indep_stats))
        # The front ends, each its own process (as front ends are), shared by every setup.
        ends = [ray.remote(num_cpus=0)(_FrontEnd).remote() for _ in range(k)]
        with reporter.step(f"warming {len(setups)} setups for {warm_s:g}s each", done="warm"):
            for s in setups:
                await _front_ends(ends, s.routes, tokens, per, warm_s, rid("scale-warm"), collections.Counter())
        for r in range(repeats):
            # Rotated each repeat: no setup always runs first, or after the same one.
            order = setups[r % len(setups):] + setups[: r % len(setups)]
            with reporter.step(
                f"repeat {r + 1}/{repeats}: {len(order)} setups x {args.sustain_s:g}s, {per} clients per front end",
                done=f"repeat {r + 1} measured",
            ):
                for s in order:
                    await s.measure(ends, tokens, per, args.sustain_s, rid(f"scale-{s.key}"), failures)
    finally:
        for e in ends:
            ray.kill(e)
        await asyncio.gather(*(x.shutdown() for x in fleets + deps), return_exceptions=True)
    by_key = {s.key: s for s in setups}
    summary = {s.key: s.summary() | {"clients": per * len(s.routes)} for s in setups}
    one = by_key.get("1x1")
    out: dict[str, Any] = {
        "clients_per_instance": per,
        "seconds": args.sustain_s,
        "repeats": repeats,
        "control_frames": carrier,
        "admit_at_open": direct,
        "rows": [],
        "ratios": {},
    }
    for s in setups:
        if s.key in ("own", "independent"):
            continue
        row = summary[s.key]
        row["over_1x1"] = _ratio(s, one)["median"] if one is not None else None
        if one is not None and s is not one:
            out["ratios"][f"{s.key}/1x1"] = _ratio(s, one)
        out["rows"].append(row)
    largest = by_key.get(f"{k}x{k}")
    if "independent" in by_key and largest is not None:
        indep = by_key["independent"]
        out["independent"] = {"deployments": k, "routing": "every front end over every deployment", **summary["independent"]}
        ratio = _ratio(largest, indep)
        out["ratios"][f"{k}x{k}/independent"] = ratio
        out["largest_over_independent"] = ratio["median"]
        if "own" in by_key:
            out["own_pairs"] = summary["own"] | {"over_independent": _ratio(by_key["own"], indep)["median"]}
    out["failures"] = dict(failures)
    return out


def scale_table(scale_out: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """The `scale` section as table rows: one per fleet size, then the
    fleet on its own pairs and the independent pairs. The rate is the median
    window; the range beside it is the slowest and the fastest window."""
    headers = ["setup", "clients", "handoffs/s", "windows", "x 1x1", "p50 ms", "host CPU ms / handoff", "busy cores"]
    rows: list[list[Any]] = []

    def row(setup: str, r: dict[str, Any], over_1x1: str = "-") -> list[Any]:
        p50 = r.get("latency_p50_s")
        cpu = r.get("cpu_per_handoff") or {}
        us, cores = cpu.get("host_us"), cpu.get("host_busy_cores")
        rates = r.get("rates") or []
        spread = f"{min(rates):.0f}-{max(rates):.0f}" if len(rates) > 1 else "-"
        return [
            setup, r["clients"], f"{r['handoffs_per_s']:.0f}", spread, over_1x1, f"{p50 * 1e3:.1f}" if p50 else "-",
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
    """The issue's fleet targets from one `scale` result: each the median
    over the repeats of the ratio window against window (`_ratio`)."""
    for row in scale_out.get("rows", []):
        n = row["instances"]
        bound = {2: 1.8, 4: 2.8}.get(n)
        if bound is not None and row.get("over_1x1") is not None:
            add(f"fleet {n}x{n} / 1x1 aggregate handoffs/s", row["over_1x1"], ">=", bound, cpu_note)
    ratio = scale_out.get("largest_over_independent")
    if ratio is not None:
        n = scale_out["independent"]["deployments"]
        add(f"fleet {n}x{n} / {n} independent pairs, handoffs/s", ratio, ">=", 1.0, cpu_note)


def _in_rounds(args: Any) -> bool:
    """Does the scale section admit in rounds (`--admit-in-rounds` or
    `--scale-admit-in-rounds`)?"""
    return bool(getattr(args, "admit_in_rounds", False) or getattr(args, "scale_admit_in_rounds", False))
