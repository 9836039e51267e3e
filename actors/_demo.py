"""`kvhandoff demo`: the embedded default (docs/design.md "Public contract").

What it does, with no flags:

1. starts a local Ray cluster (2 CPUs, no dashboard) unless one is up, with
   `NIXL_LOG_LEVEL=WARN` in the environment so every worker inherits it;
2. launches a CTX instance (tp=2) and a GEN instance (tp=1) of rank actors on
   host memory, with NIXL over UCX (`Deployment.launch`);
3. runs a mixed workload: a few hundred requests of log-uniform sizes, a
   bounded number in flight, and about a third of them cancelled. The cancels
   are spread over every phase: half at an exact phase (the harness in actors/_phases.py:
   before OPEN, before READY, mid-DMA, after completion) and half by a
   concurrent `cancel()` after a random delay, which lands wherever the
   request happens to be (admission included);
4. waits (bounded) until no rank holds a leased block, then prints a summary
   and checks the invariants:
   - L1: every request returned a terminal outcome within its bound, and none
     ended as "timeout";
   - L2: leaked = pool - free - quarantined, summed over every rank, is 0;
   - S2: no rank reports a violation (GEN verifies every byte it receives);
   - S4: `stats()` runs `BlockPool.check_invariants()` on every rank, which
     raises if a block is in two states: such a rank shows up as an error;
   and the coordinators must still be running (no topology failed).

Exit status: 0 when every invariant holds, 1 when one does not (each is
printed), 2 when the deployment could not be launched.

`--json` prints exactly one JSON object on stdout and nothing else (no
progress bar; stderr only carries errors). The progress bar is also off when
stderr is not a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["add_arguments", "run", "plan_workload", "Planned", "DemoReport"]

#: The exact phases the harness (actors/_phases.py) reaches (docs/design.md "Lifecycle").
EXACT_PHASES = ("before_open", "before_ready", "mid_dma", "after_complete")
#: A concurrent `cancel()` after a random delay: lands in whatever phase the
#: request is in (admission, OPEN, READY, DMA, completion or after the end).
DELAYED = "random_delay"
#: Outcomes a handoff may end with (deployment.HandoffResult.outcome).
OUTCOMES = ("completed", "cancelled", "rejected", "failed", "timeout")

# Request sizes: log-uniform, so most requests are short and a few are long,
# like real prompts; and cheap enough for a 2-core machine.
MIN_TOKENS = 16
MAX_TOKENS = 1024
#: Default per-request timeout passed to `handoff` (`--timeout`). It bounds the
#: whole handoff; L1's bound (`run_workload`) is twice that plus slack.
REQUEST_TIMEOUT_S = 15.0
#: Default bound on starting the rank actors (`--start-timeout`): generous,
#: since a launch waits on progress and a rank that died fails it at once.
START_TIMEOUT_S = 600.0
#: After the workload, how long ranks may take to give back every leased block.
SETTLE_S = 20.0
#: Range of the random delay before a concurrent cancel (seconds), log-uniform:
#: from "right after the handoff started" (admission) to about the p99 latency
#: of a handoff on a loaded 2-core machine (after completion), so the cancels
#: land in every phase in between.
MIN_CANCEL_DELAY_S = 0.001
MAX_CANCEL_DELAY_S = 1.5


@dataclass(frozen=True)
class Planned:
    """One request of the workload: its size and how (if at all) it is cancelled.

    `cancel` is None (no cancel), one of EXACT_PHASES, or DELAYED (then
    `cancel_delay_s` is the delay between starting the handoff and `cancel()`).
    """

    request_id: str
    num_tokens: int
    cancel: str | None = None
    cancel_delay_s: float = 0.0


def plan_workload(
    requests: int,
    cancel_rate: float,
    seed: int,
    *,
    exact_phases: bool,
    min_tokens: int = MIN_TOKENS,
    max_tokens: int = MAX_TOKENS,
) -> list[Planned]:
    """A deterministic workload for `seed`.

    About `cancel_rate` of the requests are cancelled. When `exact_phases` (the
    harness can drive the deployment's rank actors), the cancels alternate between
    an exact phase (round-robin over EXACT_PHASES, so every phase is exercised
    even in a short run) and a random delay; otherwise all use random delays.
    """
    rng = random.Random(seed)
    run_id = f"{seed:x}-{rng.getrandbits(32):08x}"  # request ids unique per run
    plan: list[Planned] = []
    n_cancels = 0
    for i in range(requests):
        tokens = int(math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens))))
        request_id = f"demo-{run_id}-{i}"
        if rng.random() >= cancel_rate:
            plan.append(Planned(request_id, tokens))
            continue
        if exact_phases and n_cancels % 2 == 0:
            phase = EXACT_PHASES[(n_cancels // 2) % len(EXACT_PHASES)]
            plan.append(Planned(request_id, tokens, cancel=phase))
        else:
            low, high = math.log(MIN_CANCEL_DELAY_S), math.log(MAX_CANCEL_DELAY_S)
            delay = math.exp(rng.uniform(low, high))
            plan.append(Planned(request_id, tokens, cancel=DELAYED, cancel_delay_s=delay))
        n_cancels += 1
    return plan


@dataclass
class Finished:
    """What one planned request ended as, seen from the client."""

    planned: Planned
    outcome: str
    bytes_verified: int
    latency_s: float
    elapsed_s: float  # from starting the handoff to its result (L1)
    error: str = ""


@dataclass
class DemoReport:
    """Everything the summary and the JSON object are made of."""

    args: dict[str, Any]
    qualified: bool
    unqualified_reasons: list[str]
    results: list[Finished]
    ranks: list[dict[str, Any]]
    coordinators: dict[str, Any]
    durations: dict[str, float]
    settled: bool
    violations: list[str]

    # -- derived numbers ------------------------------------------------------

    def outcomes(self) -> dict[str, int]:
        counts = collections.Counter(r.outcome for r in self.results)
        return {o: counts.get(o, 0) for o in (*OUTCOMES, *sorted(set(counts) - set(OUTCOMES)))}

    def cancel_mix(self) -> dict[str, dict[str, int]]:
        """Outcomes per way of cancelling ("none" for requests not cancelled)."""
        mix: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for r in self.results:
            mix[r.planned.cancel or "none"][r.outcome] += 1
        return {k: dict(v) for k, v in sorted(mix.items())}

    def bytes_verified(self) -> int:
        return sum(r.bytes_verified for r in self.results)

    def latencies(self) -> list[float]:
        return sorted(r.latency_s for r in self.results if r.outcome == "completed")

    def leaked(self) -> int:
        return sum(_leaked(s) for s in self.ranks if "error" not in s)

    def counters(self) -> dict[str, int]:
        """The ranks' protocol counters, summed (refusals, deferred cancels, ...)."""
        total: collections.Counter[str] = collections.Counter()
        for s in self.ranks:
            total.update(s.get("counters", {}) if "error" not in s else {})
        return dict(sorted(total.items()))

    def quarantined(self) -> int:
        return sum(int(s.get("quarantined", 0)) for s in self.ranks if "error" not in s)

    def leaked_slots(self) -> int:
        return sum(_slots_held(s) for s in self.ranks if "error" not in s)

    def staged_chunks(self) -> int:
        return sum(
            int(s.get("staging", {}).get("counters", {}).get("staged_chunks", 0))
            for s in self.ranks
            if "error" not in s
        )

    def to_json(self) -> dict[str, Any]:
        outcomes = self.outcomes()
        latencies = self.latencies()
        workload_s = self.durations.get("workload_s", 0.0)
        return {
            "requests": len(self.results),
            "completed": outcomes["completed"],
            "cancelled": outcomes["cancelled"],
            "failed": outcomes["failed"],
            "rejected": outcomes["rejected"],
            "timeout": outcomes["timeout"],
            "outcomes": outcomes,
            "cancel_mix": self.cancel_mix(),
            "bytes_verified": self.bytes_verified(),
            "leaked_blocks": self.leaked(),
            "quarantined_blocks": self.quarantined(),
            "leaked_slots": self.leaked_slots(),
            "staged_chunks": self.staged_chunks(),
            "invariant_violations": list(self.violations),
            "ok": not self.violations,
            "wall_s": self.durations.get("total_s", 0.0),
            "handoffs_per_s": outcomes["completed"] / workload_s if workload_s > 0 else 0.0,
            "requests_per_s": len(self.results) / workload_s if workload_s > 0 else 0.0,
            "latency_p50_s": _percentile(latencies, 50),
            "latency_p99_s": _percentile(latencies, 99),
            "qualified": self.qualified,
            "unqualified_reasons": list(self.unqualified_reasons),
            "durations": dict(self.durations),
            "counters": self.counters(),
            "ranks": [_rank_summary(s) for s in self.ranks],
            "config": dict(self.args),
        }


def _leaked(rank: dict[str, Any]) -> int:
    return int(rank["pool"]) - int(rank["free"]) - int(rank["quarantined"])


def _slots_held(rank: dict[str, Any]) -> int:
    """Staging slots a CTX rank still holds after the settle wait (writing,
    landed or quarantined) plus chunks queued for one: leaked slots."""
    st = rank.get("staging", {})
    return int(st.get("in_use", 0)) + int(st.get("queued", 0))


def _rank_summary(rank: dict[str, Any]) -> dict[str, Any]:
    if "error" in rank:
        return {"error": rank["error"]}
    keys = (
        "role",
        "rank",
        "epoch",
        "pool",
        "free",
        "leased",
        "quarantined",
        "posted_bytes",
        "leaked_handles",
    )
    return {
        **{k: rank.get(k) for k in keys},
        "leaked": _leaked(rank),
        "violations": list(rank.get("violations", [])),
    }


def _percentile(sorted_values: list[float], pct: float) -> float | None:
    """Nearest-rank percentile of an already sorted list (None if empty)."""
    if not sorted_values:
        return None
    k = max(0, math.ceil(pct / 100 * len(sorted_values)) - 1)
    return sorted_values[min(k, len(sorted_values) - 1)]


# -- command line -----------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `kvhandoff demo` flags; every one has a default (the embedded demo)."""
    parser.add_argument(
        "--ctx-tp", type=_positive, default=2, help="CTX (prefill) tensor parallelism (default 2)"
    )
    parser.add_argument(
        "--gen-tp", type=_positive, default=1, help="GEN (decode) tensor parallelism (default 1)"
    )
    parser.add_argument(
        "--requests", type=_positive, default=300, help="number of requests (default 300)"
    )
    parser.add_argument(
        "--cancel-rate",
        type=_rate,
        default=0.3,
        help="fraction of requests cancelled, 0..1 (default 0.3)",
    )
    parser.add_argument(
        "--concurrency", type=_positive, default=16, help="requests in flight at once (default 16)"
    )
    parser.add_argument(
        "--memory",
        choices=("DRAM", "VRAM"),
        default="DRAM",
        help="KV buffers in host (DRAM) or GPU (VRAM) memory",
    )
    parser.add_argument(
        "--gpus-per-rank",
        type=float,
        default=0.0,
        help="VRAM: each rank's share of a GPU (default: the cluster's GPUs shared by all ranks, at most 1)",
    )
    parser.add_argument(
        "--data-mode",
        choices=("auto", "direct", "staged"),
        default="auto",
        help="how chunks move: auto (staged for small pieces), direct, or staged forced",
    )
    parser.add_argument(
        "--pool-blocks", type=_positive, default=1024, help="KV blocks per rank (default 1024)"
    )
    parser.add_argument(
        "--max-tokens",
        type=_positive,
        default=MAX_TOKENS,
        help=f"largest request, in tokens (sizes are log-uniform from {MIN_TOKENS}; default {MAX_TOKENS})",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=REQUEST_TIMEOUT_S,
        help=f"per-request handoff timeout in seconds (default {REQUEST_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--start-timeout",
        type=_positive_float,
        default=START_TIMEOUT_S,
        help="seconds the rank actors may take to start (default %(default)g); a rank that "
        "dies while starting fails the launch at once",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout and nothing else"
    )
    parser.add_argument(
        "--unqualified",
        action="store_true",
        help="use pp=2 on both sides: outside the qualified scope, so the conservative path runs "
        "(a cancel waits for the transfer to finish)",
    )
    parser.add_argument(
        "--chaos",
        action="store_true",
        help="defer every DMA chunk's real post by 5 ms, so cancels meet DMA genuinely in flight",
    )


# Flag types raise ArgumentTypeError with the whole message: for a ValueError
# argparse would print the function's name ("invalid _positive value").


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status (0 only if every invariant holds)."""
    # Before Ray (and therefore any worker) starts: workers inherit it.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    t0 = time.perf_counter()
    progress = _Progress(sys.stderr, enabled=not args.json and sys.stderr.isatty())
    progress.note(
        f"starting Ray and launching CTX tp={args.ctx_tp} -> GEN tp={args.gen_tp} "
        f"({args.memory}, NIXL/UCX)..."
    )
    import ray

    started_ray = False
    if not ray.is_initialized():
        quiet = {"log_to_driver": False, "logging_level": logging.ERROR}
        try:
            if os.environ.get("RAY_ADDRESS"):  # inside `ray job submit` or a cluster: join it
                ray.init(**quiet)
            else:
                ray.init(num_cpus=2, include_dashboard=False, **quiet)
        except Exception as exc:
            print(f"kvhandoff demo: could not start Ray: {exc}", file=sys.stderr)
            return 2
        started_ray = True
    ray_init_s = time.perf_counter() - t0
    try:
        report = asyncio.run(_run_async(args, progress))
    except _LaunchFailed as exc:
        print(f"kvhandoff demo: could not launch the deployment: {exc}", file=sys.stderr)
        return 2
    finally:
        if started_ray:
            t = time.perf_counter()
            ray.shutdown()
            ray_shutdown_s = time.perf_counter() - t
        else:
            ray_shutdown_s = 0.0
    report.durations = {
        "ray_init_s": ray_init_s,
        **report.durations,
        "ray_shutdown_s": ray_shutdown_s,
        "total_s": time.perf_counter() - t0,
    }
    if args.json:
        print(json.dumps(report.to_json()))
        for violation in report.violations:
            # Errors go to stderr too, so that `--json` callers see why it failed.
            print(f"kvhandoff demo: invariant violated: {violation}", file=sys.stderr)
    else:
        print(render_summary(report))
    return 0 if not report.violations else 1


class _LaunchFailed(RuntimeError):
    """The deployment did not come up (nothing to check)."""


async def _run_async(args: argparse.Namespace, progress: _Progress) -> DemoReport:
    from kvhandoff.actors._dataplane import FaultPlan
    from kvhandoff.actors.deployment import Deployment

    durations: dict[str, float] = {}
    overrides: dict[str, Any] = {"pp": 2} if args.unqualified else {}
    t = time.perf_counter()
    gpus_per_rank = getattr(args, "gpus_per_rank", 0.0) or 1.0
    if args.memory == "VRAM" and not getattr(args, "gpus_per_rank", 0.0):
        import ray

        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus:  # every rank on a GPU: share them when there are fewer GPUs than ranks
            gpus_per_rank = min(1.0, int(100 * gpus / (args.ctx_tp + args.gen_tp)) / 100)
    try:
        dep = await Deployment.launch(
            gpus_per_rank=gpus_per_rank,
            ctx_tp=args.ctx_tp,
            gen_tp=args.gen_tp,
            pool_blocks=args.pool_blocks,
            memory=args.memory,
            fault_plan=FaultPlan(defer_s=0.005) if args.chaos else None,
            data_mode=args.data_mode,
            ctx_overrides=overrides,
            gen_overrides=overrides,
            start_timeout_s=args.start_timeout,
            name=f"kvh-demo-{os.getpid()}",
        )
    except Exception as exc:  # InvalidConfig, LaunchFailed: one line, no traceback
        raise _LaunchFailed(f"{type(exc).__name__}: {exc}") from exc
    durations["launch_s"] = time.perf_counter() - t
    try:
        exact = isinstance(dep, Deployment)  # the harness drives the real rank actors
        plan = plan_workload(
            args.requests,
            args.cancel_rate,
            args.seed,
            exact_phases=exact,
            min_tokens=min(MIN_TOKENS, args.max_tokens),
            max_tokens=args.max_tokens,
        )
        progress.start(len(plan))
        t = time.perf_counter()
        results = await run_workload(dep, plan, args.concurrency, progress, args.timeout)
        durations["workload_s"] = time.perf_counter() - t
        progress.close()
        t = time.perf_counter()
        stats, settled = await settle(dep, SETTLE_S)
        durations["settle_s"] = time.perf_counter() - t
    finally:
        t = time.perf_counter()
        with contextlib.suppress(Exception):
            await dep.shutdown()
        durations["shutdown_s"] = time.perf_counter() - t
    report = DemoReport(
        args={
            "ctx_tp": args.ctx_tp,
            "gen_tp": args.gen_tp,
            "requests": args.requests,
            "cancel_rate": args.cancel_rate,
            "concurrency": args.concurrency,
            "memory": args.memory,
            "pool_blocks": args.pool_blocks,
            "seed": args.seed,
            "max_tokens": args.max_tokens,
            "timeout_s": args.timeout,
            "unqualified": bool(args.unqualified),
            "chaos": bool(args.chaos),
            "cancel_at_phases": exact,
        },
        qualified=bool(dep.qualified),
        unqualified_reasons=list(dep.unqualified_reasons),
        results=results,
        ranks=list(stats.get("ranks", [])),
        coordinators=dict(stats.get("coordinators", {})),
        durations=durations,
        settled=settled,
        violations=[],
    )
    report.violations = check_invariants(report)
    return report


async def run_workload(
    dep: Any,
    plan: list[Planned],
    concurrency: int,
    progress: _Progress,
    timeout: float = REQUEST_TIMEOUT_S,
) -> list[Finished]:
    """Run every planned request, at most `concurrency` at once."""
    slots = asyncio.Semaphore(concurrency)
    bound = 2 * timeout + 5.0  # L1: GEN wait + CTX wait + slack

    async def one(planned: Planned) -> Finished:
        async with slots:
            start = time.perf_counter()
            try:
                result = await asyncio.wait_for(_handoff(dep, planned, timeout), bound)
                finished = Finished(
                    planned,
                    result.outcome,
                    int(result.bytes_verified),
                    float(result.latency_s),
                    time.perf_counter() - start,
                )
            except TimeoutError:
                finished = Finished(
                    planned,
                    "hung",
                    0,
                    0.0,
                    time.perf_counter() - start,
                    f"no result in {bound:.0f} s",
                )
            except Exception as exc:  # the library raised instead of returning an outcome
                finished = Finished(
                    planned, "error", 0, 0.0, time.perf_counter() - start, repr(exc)
                )
            progress.update(finished.outcome)
            return finished

    return list(await asyncio.gather(*(one(p) for p in plan)))


async def _handoff(dep: Any, planned: Planned, timeout: float) -> Any:
    from kvhandoff.actors._phases import handoff_cancel_at

    if planned.cancel is None:
        return await dep.handoff(planned.request_id, planned.num_tokens, timeout=timeout)
    if planned.cancel in EXACT_PHASES:
        return await handoff_cancel_at(
            dep, planned.request_id, planned.num_tokens, planned.cancel, timeout=timeout
        )
    # A concurrent cancel: both run on this loop; the handoff is owned and awaited.
    handoff = asyncio.ensure_future(
        dep.handoff(planned.request_id, planned.num_tokens, timeout=timeout)
    )
    try:
        await asyncio.sleep(planned.cancel_delay_s)
        await dep.cancel(planned.request_id)
    finally:
        result = await handoff
    return result


async def settle(dep: Any, limit_s: float) -> tuple[dict[str, Any], bool]:
    """Poll `stats()` until no rank holds a leased block (or `limit_s` passes).

    Returns the last stats and whether every rank settled."""
    deadline = time.perf_counter() + limit_s
    while True:
        try:
            stats = await dep.stats()
        except Exception as exc:  # e.g. a coordinator died: nothing can be proven
            return {"ranks": [{"error": f"stats() failed: {exc!r}"}], "coordinators": {}}, False
        ranks = stats.get("ranks", [])
        busy = [
            s
            for s in ranks
            if "error" not in s
            and (
                s.get("leased", 0)
                or s.get("in_flight_chunks", 0)
                or _slots_held(s) - s.get("staging", {}).get("slots", {}).get("quarantined", 0)
            )
        ]
        if not busy or time.perf_counter() >= deadline:
            return stats, not busy
        await asyncio.sleep(0.1)


def check_invariants(report: DemoReport) -> list[str]:
    """Each violated invariant as one line (empty: all hold)."""
    out: list[str] = []
    for s in report.ranks:
        if "error" in s:  # S4: stats() runs pool.check_invariants() and it raised
            out.append(f"S4: a rank's stats failed (pool invariant?): {s['error']}")
    leaked = report.leaked()
    if leaked:
        # Blocks still leased after the bounded settle wait are leaks too.
        where = ", ".join(
            f"{s['role']}{s['rank']}={_leaked(s)}"
            for s in report.ranks
            if "error" not in s and _leaked(s)
        )
        out.append(f"L2: {leaked} blocks leaked (pool - free - quarantined): {where}")
    slots = report.leaked_slots()
    if slots:
        where = ", ".join(f"{s['role']}{s['rank']}={s.get('staging')}" for s in report.ranks if "error" not in s and _slots_held(s))
        out.append(f"L2: {slots} staging slots held after the workload: {where}")
    if not report.settled and not leaked:
        out.append(f"L2: DMA chunks still in flight {SETTLE_S:.0f} s after the workload")
    for s in report.ranks:
        for v in s.get("violations", []) if "error" not in s else []:
            out.append(f"S2: {s['role']}{s['rank']}: {v}")
    late = [r for r in report.results if r.outcome in ("hung", "error")]
    for r in late[:5]:
        out.append(
            f"L1: {r.planned.request_id} ({r.planned.cancel or 'no cancel'}) got no terminal outcome: {r.error}"
        )
    if len(late) > 5:
        out.append(f"L1: ... and {len(late) - 5} more requests without a terminal outcome")
    timeouts = [r for r in report.results if r.outcome == "timeout"]
    if timeouts:
        ids = ", ".join(
            f"{r.planned.request_id} ({r.planned.cancel or 'no cancel'})" for r in timeouts[:5]
        )
        out.append(f"L1: {len(timeouts)} requests timed out: {ids}")
    for role, c in sorted(report.coordinators.items()):
        if c.get("state") not in ("running", "shut_down"):
            out.append(
                f"coordinator {role} is {c.get('state')}: {c.get('failure_reason') or 'no reason given'}"
            )
    return out


# -- output ---------------------------------------------------------------------------


def render_summary(report: DemoReport) -> str:
    """The human-readable summary table."""
    j = report.to_json()
    max_tokens = report.args.get("max_tokens", MAX_TOKENS)
    lines = ["", "kvhandoff demo", "=" * 62]
    lines.append(
        f"topology     CTX tp={report.args['ctx_tp']} -> GEN tp={report.args['gen_tp']}, "
        f"{report.args['memory']}, {report.args['pool_blocks']} blocks/rank"
        + (", chaos (deferred DMA)" if report.args["chaos"] else "")
    )
    if report.qualified:
        lines.append(
            "scope        qualified: active protocol (cancel interrupts DMA between chunks)"
        )
    else:
        lines.append(
            "scope        UNQUALIFIED: conservative path (a cancel waits for the transfer to finish)"
        )
        for reason in report.unqualified_reasons:
            lines.append(f"               - {reason}")
        deferred = j["counters"].get("cancel_deferred", 0)
        lines.append(
            f"               {deferred} cancels waited for their decided transfer to finish"
        )
    lines.append(
        f"workload     {j['requests']} requests, {min(MIN_TOKENS, max_tokens)}..{max_tokens} tokens, "
        f"{report.args['concurrency']} in flight, cancel rate {report.args['cancel_rate']:.0%}, seed {report.args['seed']}"
    )
    lines.append("-" * 62)
    lines.append(
        "outcomes     "
        + "  ".join(f"{k} {v}" for k, v in j["outcomes"].items() if v or k in OUTCOMES[:4])
    )
    for way, counts in j["cancel_mix"].items():
        if way == "none":
            continue
        lines.append(
            f"  cancel {way:<15} " + "  ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        )
    lines.append(f"bytes        {_mib(j['bytes_verified'])} verified byte for byte on GEN (S2)")
    lines.append(
        f"throughput   {j['handoffs_per_s']:.1f} completed handoffs/s ({j['requests_per_s']:.1f} requests/s)"
    )
    p50, p99 = j["latency_p50_s"], j["latency_p99_s"]
    lines.append(f"latency      completed p50 {_ms(p50)}  p99 {_ms(p99)}")
    lines.append(
        f"data plane   mode {report.args.get('data_mode', 'auto')}: {j['staged_chunks']} chunks staged, "
        f"{j['leaked_slots']} staging slots leaked"
    )
    lines.append("blocks       rank      pool   free  leased  quarantined  leaked")
    for s in report.ranks:
        if "error" in s:
            lines.append(f"             error: {s['error']}")
            continue
        name = f"{s['role']}{s['rank']}"
        lines.append(
            f"             {name:<8}{s['pool']:>6}{s['free']:>7}{s['leased']:>8}{s['quarantined']:>13}{_leaked(s):>8}"
        )
    d = report.durations
    lines.append(
        f"wall time    {d.get('total_s', 0):.1f} s (launch {d.get('launch_s', 0):.1f} s, "
        f"workload {d.get('workload_s', 0):.1f} s, settle {d.get('settle_s', 0):.1f} s)"
    )
    lines.append("-" * 62)
    if report.violations:
        lines.append(f"INVARIANTS VIOLATED ({len(report.violations)}):")
        lines.extend(f"  - {v}" for v in report.violations)
    else:
        lines.append(
            "invariants   OK: L1 (all terminal, no timeout), L2 (0 leaked), S2 (bytes verified), S4 (pools)"
        )
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


class _Progress:
    """A plain-text progress bar on stderr (only when it is a terminal)."""

    WIDTH = 30

    def __init__(self, stream: TextIO, *, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.total = 0
        self.counts: collections.Counter[str] = collections.Counter()
        self.started = 0.0
        self.last_draw = 0.0

    def note(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()

    def start(self, total: int) -> None:
        self.total = total
        self.started = time.perf_counter()
        self._draw(force=True)

    def update(self, outcome: str) -> None:
        self.counts[outcome] += 1
        self._draw(force=sum(self.counts.values()) == self.total)

    def _draw(self, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self.last_draw < 0.1:
            return
        self.last_draw = now
        done = sum(self.counts.values())
        filled = self.WIDTH * done // max(self.total, 1)
        rate = done / (now - self.started) if now > self.started else 0.0
        tail = " ".join(f"{k[:4]} {v}" for k, v in sorted(self.counts.items()))
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{self.total} {rate:5.1f}/s {tail}  "
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
