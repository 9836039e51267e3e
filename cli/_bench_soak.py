"""`kvhandoff bench --sections soak`: does a long-running deployment stay flat?

Theory of operation
-------------------
A serving deployment runs for days; whatever a rank or coordinator remembers
per handoff must be bounded by what is still needed, or it grows until the
process is killed. This section runs `--soak-clients` clients doing small
handoffs back to back for `--soak-s` seconds, a fraction `--soak-cancel` of
them cancelled after a random delay (so cancel paths run too), and samples the
resident memory of every rank and coordinator (their `stats()["memory"]`) and
of this driver about 40 times, each after a garbage collection and
`malloc_trim` (so a sample is what the process retains, not the allocator's
slack).

Memory is allowed to rise while the bounded memories fill: the first
`--soak-warmup-s` seconds (at least `RETAIN_S`, the age bound of what a rank
or coordinator remembers about finished requests) and at least
`CLOSED_SESSION_MEMORY` handoffs (the largest of the protocol's small
count-bounded memories of closed sessions, parents and leases, which fill by
traffic, not by time), and until every bounded memory of every rank and
coordinator that holds anything has begun to forget (by age or by bytes:
it is at its steady state; an observable condition, not a guess of how long
filling takes on this machine). After that, the growth is the least-squares slope of resident bytes against
handoffs done, per process, in bytes per handoff; the target is the largest of
them (docs/design.md "What a rank remembers"). A slope is robust to the
allocator's steps: one sample's jump moves it little.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import gc
import random
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

from kvhandoff.actors._metrics import resident_bytes
from kvhandoff.actors.deployment import Deployment
from kvhandoff.cli._console import Reporter
from kvhandoff.protocol import CLOSED_SESSION_MEMORY, RETAIN_S, Role
from kvhandoff.topology import KVLayout

__all__ = ["settled_resident", "soak", "slope"]

#: One layer's 4-token page of 8 heads x 128 dims (16 KiB per block): small handoffs.
SOAK_LAYOUT = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, dtype="float16", tokens_per_block=4)
#: Samples over the whole run (the slope needs enough after the warm-up).
_SAMPLES = 40


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of ys against xs (NaN for fewer than 3 points
    or no spread in xs)."""
    n = len(xs)
    if n < 3:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return float("nan")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def settled_resident(_: Any = None) -> int | None:
    """Resident bytes once garbage is collected and the allocator has handed
    its free pages back (glibc `malloc_trim`): what the process retains, not
    its allocator's slack, which otherwise jitters by megabytes between
    samples. Run in each actor through `__ray_call__` (a bench tool, no hook
    in the actors), and by the floor probes (bench/*_floor.py)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return resident_bytes()


# --soak-trace: a diagnosis of what a process keeps, run in each process
# through `__ray_call__` (the state lives in this module of that process).
_TRACE_FRAMES = 6
_trace_base: dict[str, Any] = {}


def _trace_start(_: Any = None) -> bool:
    """Start tracing Python allocations in this process."""
    if not tracemalloc.is_tracing():
        tracemalloc.start(_TRACE_FRAMES)
    return True


def _census() -> collections.Counter[str]:
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def _trace_sample(_: Any = None) -> dict[str, int]:
    """Python bytes traced now, and what the tracing itself costs."""
    if not tracemalloc.is_tracing():
        return {}
    return {"traced": tracemalloc.get_traced_memory()[0], "overhead": tracemalloc.get_tracemalloc_memory()}


def _trace_mark(_: Any = None) -> bool:
    """Remember this moment (the end of the warm-up) to diff against later."""
    gc.collect()
    _trace_base["snapshot"] = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None
    _trace_base["census"] = _census()
    return True


_TRACE_TOP = 25


def _trace_diff(_: Any = None) -> dict[str, Any]:
    """What grew since `_trace_mark`: allocation sites (by line, and by the
    traceback of the largest), and object counts by type."""
    gc.collect()
    out: dict[str, Any] = {}
    base = _trace_base.get("snapshot")
    if base is not None and tracemalloc.is_tracing():
        now = tracemalloc.take_snapshot().filter_traces(
            (tracemalloc.Filter(False, tracemalloc.__file__),)
        )
        base = base.filter_traces((tracemalloc.Filter(False, tracemalloc.__file__),))
        out["by_line"] = [
            f"{d.size_diff:+d} B {d.count_diff:+d} blocks: {d.traceback[0].filename}:{d.traceback[0].lineno}"
            for d in now.compare_to(base, "lineno")[:_TRACE_TOP]
        ]
        out["by_traceback"] = [
            {"size_diff": d.size_diff, "count_diff": d.count_diff, "traceback": d.traceback.format()}
            for d in now.compare_to(base, "traceback")[: _TRACE_TOP // 3]
        ]
    census = _trace_base.get("census")
    if census is not None:
        grown = _census()
        grown.subtract(census)
        out["objects"] = [f"{n:+d} {name}" for name, n in grown.most_common(_TRACE_TOP) if n > 0]
    out["modules"] = len(sys.modules)
    return out


def _named(dep: Deployment, ranks: dict[Role, list[Any]]) -> dict[str, Any]:
    coords = {f"coordinator-{role.value}": dep.coordinator(role) for role in (Role.CTX, Role.GEN)}
    return {**coords, **{f"{role.value}{i}": h for role, hs in ranks.items() for i, h in enumerate(hs)}}


async def _everywhere(named: dict[str, Any], fn: Callable[..., Any]) -> dict[str, Any]:
    """`fn` run in every named actor and in this driver: name -> result (None
    where the actor did not answer)."""
    found = await asyncio.gather(*(h.__ray_call__.remote(fn) for h in named.values()), return_exceptions=True)
    out: dict[str, Any] = {name: None if isinstance(value, BaseException) else value for name, value in zip(named, found)}
    out["driver"] = fn()
    return out


def _warm(sample: dict[str, Any], warmup_s: float) -> bool:
    """Whether `sample` was taken after the warm-up (module docstring)."""
    return sample["t_s"] >= warmup_s and sample["handoffs"] >= CLOSED_SESSION_MEMORY and sample["memories_full"]


def memories_full(stats: dict[str, Any]) -> bool:
    """Whether every bounded memory (`stats()["memory"]` of each coordinator
    and rank) that holds anything has begun to forget: it is at its steady
    state, and what the process keeps for it grows no more."""
    found = [c.get("memory") for c in stats["coordinators"].values()] + [r.get("memory") for r in stats["ranks"]]
    for memory in found:
        for m in (memory or {}).values():
            if isinstance(m, dict) and m.get("entries") and not (m.get("dropped_by_age") or m.get("dropped_by_bytes")):
                return False
    return True


async def _resident(named: dict[str, Any]) -> dict[str, int | None]:
    """Settled resident bytes of every rank and coordinator, and of this driver."""
    found = await _everywhere(named, settled_resident)
    return {name: value if isinstance(value, int) else None for name, value in found.items()}


async def soak(args: argparse.Namespace, reporter: Reporter, rid: Callable[[str], str]) -> dict[str, Any]:
    a = args
    dep = await Deployment.launch(
        ctx_tp=1, gen_tp=1, layout=SOAK_LAYOUT, pool_blocks=64 * a.soak_clients,
        memory=a.memory, transfer_timeout_s=10.0, lease_timeout_s=30.0,
    )
    rng = random.Random(a.seed)
    outcomes: collections.Counter[str] = collections.Counter()
    samples: list[dict[str, Any]] = []
    named = _named(dep, {role: await dep.ranks(role) for role in (Role.CTX, Role.GEN)})
    trace = bool(getattr(a, "soak_trace", False))
    marked = False
    full = [False]  # every bounded memory forgets already (it stays so)
    if trace:
        await _everywhere(named, _trace_start)
    start = time.perf_counter()
    deadline = start + a.soak_s

    async def client() -> None:
        while time.perf_counter() < deadline:
            request = rid("soak")
            task = asyncio.create_task(dep.handoff(request, rng.choice((16, 64, 256)), timeout=60.0))
            if rng.random() < a.soak_cancel:
                await asyncio.sleep(rng.uniform(0.0, 0.02))
                await dep.cancel(request)
            try:
                outcomes[(await task).outcome] += 1
            except Exception as exc:  # counted, not fatal: the soak is about memory
                outcomes[f"raised:{type(exc).__name__}"] += 1

    async def sampler() -> None:
        nonlocal marked
        every = a.soak_s / _SAMPLES
        while True:
            t = time.perf_counter() - start
            sample: dict[str, Any] = {"t_s": t, "handoffs": sum(outcomes.values()), "resident_bytes": await _resident(named)}
            sample["memories_full"] = full[0] = full[0] or memories_full(await dep.stats())
            if trace:
                sample["traced"] = await _everywhere(named, _trace_sample)
                if not marked and _warm(sample, a.soak_warmup_s):
                    await _everywhere(named, _trace_mark)
                    marked = True
            samples.append(sample)
            if t >= a.soak_s:
                return
            if len(samples) % 10 == 1:
                reporter.line(f"soak: {t:.0f}/{a.soak_s:.0f} s, {sum(outcomes.values())} handoffs")
            await asyncio.sleep(max(0.0, min(every, deadline - time.perf_counter())))

    diagnosis: dict[str, Any] | None = None
    try:
        await asyncio.gather(sampler(), *(client() for _ in range(a.soak_clients)))
        stats = await dep.stats()
        if trace:
            diagnosis = await _everywhere(named, _trace_diff)
    finally:
        await dep.shutdown()
    warm = [s for s in samples if _warm(s, a.soak_warmup_s)]
    warmed = bool(warm) and len(warm) >= 3
    # Not warmed up within the run (a slow machine): the growth over its second
    # half, flagged, rather than no number.
    after = warm if warmed else samples[len(samples) // 2 :]
    growth: dict[str, float] = {}
    traced: dict[str, dict[str, float]] = {}
    for name in samples[0]["resident_bytes"]:
        points = [(s["handoffs"], s["resident_bytes"][name]) for s in after if s["resident_bytes"][name] is not None]
        growth[name] = slope([p[0] for p in points], [p[1] for p in points])
        if trace:
            rows = [(s["handoffs"], (s["traced"] or {}).get(name) or {}) for s in after]
            traced[name] = {
                key: slope([h for h, r in rows if key in r], [r[key] for h, r in rows if key in r])
                for key in ("traced", "overhead")
            }
    served = [g for name, g in growth.items() if name != "driver"]
    return {
        "seconds": a.soak_s,
        "warmup_s": after[0]["t_s"] if after else a.soak_warmup_s,
        "warmup_handoffs": after[0]["handoffs"] if after else 0,
        "warmed_up": warmed,
        "retain_s": RETAIN_S,
        "clients": a.soak_clients,
        "cancel_fraction": a.soak_cancel,
        "handoffs": sum(outcomes.values()),
        "outcomes": dict(outcomes),
        "samples": samples,
        "growth_bytes_per_handoff": growth,
        "max_growth_bytes_per_handoff": max(served, default=float("nan")),
        "remembered": {
            **{f"coordinator-{r}": c.get("memory") for r, c in stats["coordinators"].items()},
            **{f"{s.get('role')}{s.get('rank')}": s.get("memory") for s in stats["ranks"]},
        },
        "leaked_blocks": sum(s.get("leased", 0) + s.get("quarantined", 0) for s in stats["ranks"]),
        **({"trace": {"growth_bytes_per_handoff": traced, "grew": diagnosis}} if trace else {}),
    }


#: The bound on memory growth after the warm-up, bytes per handoff, for every
#: rank and coordinator (an earlier build grew ~3,000 per handoff).
GROWTH_BOUND = 64.0


def soak_targets(result: dict[str, Any], add: Callable[..., None]) -> None:
    add(
        "soak: resident memory growth after warm-up, bytes per handoff (largest rank or coordinator)",
        result["max_growth_bytes_per_handoff"],
        "<=",
        GROWTH_BOUND,
        f"{result['handoffs']} handoffs in {result['seconds']:.0f} s, "
        f"{result['cancel_fraction']:.0%} cancelled; slope after {result['warmup_s']:.0f} s"
        + ("" if result["warmed_up"] else " (NOT warmed up: second half)"),
    )


def soak_table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Per process: resident MiB at the start, at the end of the warm-up and at
    the end, and the growth after the warm-up in bytes per handoff."""
    samples = result["samples"]
    after = [s for s in samples if s["t_s"] >= result["warmup_s"]] or samples[-1:]

    def mib(sample: dict[str, Any], name: str) -> float | None:
        value = sample["resident_bytes"].get(name)
        return None if value is None else value / (1 << 20)

    rows = [
        [name, mib(samples[0], name), mib(after[0], name), mib(samples[-1], name), growth]
        for name, growth in result["growth_bytes_per_handoff"].items()
    ]
    return ["process", "start MiB", "warm MiB", "end MiB", "growth B/handoff"], rows
