"""`kvhandoff demo`: the embedded default (docs/design.md "Public contract").

What it does, with no flags:

1. starts a local Ray cluster (2 CPUs, no dashboard) unless one is up, with
   `NIXL_LOG_LEVEL=WARN` in the environment so every worker inherits it;
2. launches a CTX instance (tp=2) and a GEN instance (tp=1) of rank actors on
   host memory, with NIXL over UCX (`Deployment.launch`);
3. runs a mixed workload: a few hundred requests of log-uniform sizes, a
   bounded number in flight, and `--cancel-rate` of them (30%) cancelled. The
   cancels are spread over every phase: at least one in each way as soon as
   there are enough requests, then half at an exact phase (the harness in
   cli/harness.py: before OPEN, before READY, mid-DMA, after completion)
   and half by a concurrent `cancel()` after a random delay, which lands
   wherever the request happens to be (admission included);
4. waits (bounded) until no rank holds a leased block, stops what it started,
   then prints a summary and checks the invariants:
   - L1: every request returned a terminal outcome within its bound, and none
     ended as "timeout";
   - L2: leaked = pool - free - quarantined, summed over every rank, is 0;
   - S2: no rank reports a violation (GEN verifies every byte it receives);
   - S4: `stats()` runs `BlockPool.check_invariants()` on every rank, which
     raises if a block is in two states: such a rank shows up as an error;
   and the coordinators must still be running (no topology failed).

Exit status: 0 when every invariant holds, 1 when one does not (each is
printed), 2 when the deployment could not be launched.

Progress goes to stderr (cli/_console.py): a live display in a terminal,
plain lines otherwise. The summary goes to stdout: tables whose parts add up
to the wall time and whose notes say what each count means, the expected
refusals of a clean run included. `--json` prints exactly one JSON object on
stdout and nothing else (no progress; stderr only carries errors).
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
from typing import Any

from kvhandoff.cli._console import Reporter, is_terminal
from kvhandoff.cli._flags import MAX_TOKENS, MIN_TOKENS, REQUEST_TIMEOUT_S

__all__ = ["run", "plan_workload", "Planned", "DemoReport"]

#: The exact phases the harness (cli/harness.py) reaches (docs/design.md "Lifecycle").
EXACT_PHASES = ("before_open", "before_ready", "mid_dma", "after_complete")
#: A concurrent `cancel()` after a random delay: lands in whatever phase the
#: request is in (admission, OPEN, READY, DMA, completion or after the end).
DELAYED = "random_delay"
#: Outcomes a handoff may end with (deployment.HandoffResult.outcome).
OUTCOMES = ("completed", "cancelled", "rejected", "failed", "timeout")
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


def cancel_ways(exact_phases: bool) -> tuple[str, ...]:
    """The ways a request may be cancelled: every exact phase and a random
    delay when the harness can drive the ranks, else random delays only."""
    return (*EXACT_PHASES, DELAYED) if exact_phases else (DELAYED,)


def plan_workload(
    requests: int, cancel_rate: float, seed: int,
    *,
    exact_phases: bool, min_tokens: int = MIN_TOKENS, max_tokens: int = MAX_TOKENS,
) -> list[Planned]:
    """A deterministic workload for `seed`.

    `cancel_rate` of the requests (rounded) are cancelled, and when it is above
    0 at least one in each of `cancel_ways(exact_phases)`, as far as there are
    requests: a short run (`--requests 5`) still cancels in every way. The
    first cancels take each way once; the rest alternate between an exact
    phase (round-robin over EXACT_PHASES) and a random delay. Which requests
    are cancelled, and in which way, is drawn from the seed.
    """
    rng = random.Random(seed)
    run_id = f"{seed:x}-{rng.getrandbits(32):08x}"  # request ids unique per run
    low, high = math.log(min_tokens), math.log(max_tokens)
    sizes = [int(math.exp(rng.uniform(low, high))) for _ in range(requests)]
    ways = cancel_ways(exact_phases)
    n_cancels = math.floor(cancel_rate * requests + 0.5)
    if cancel_rate > 0:
        n_cancels = max(n_cancels, len(ways))
    n_cancels = min(n_cancels, requests)
    kinds = [ways[k] if k < len(ways) else _alternate(k - len(ways), exact_phases) for k in range(n_cancels)]
    rng.shuffle(kinds)
    cancelled = dict(zip(sorted(rng.sample(range(requests), n_cancels)), kinds))
    plan: list[Planned] = []
    for i, tokens in enumerate(sizes):
        request_id = f"demo-{run_id}-{i}"
        kind = cancelled.get(i)
        if kind is None:
            plan.append(Planned(request_id, tokens))
        elif kind == DELAYED:
            low_s, high_s = math.log(MIN_CANCEL_DELAY_S), math.log(MAX_CANCEL_DELAY_S)
            delay = math.exp(rng.uniform(low_s, high_s))
            plan.append(Planned(request_id, tokens, cancel=DELAYED, cancel_delay_s=delay))
        else:
            plan.append(Planned(request_id, tokens, cancel=kind))
    return plan


def _alternate(k: int, exact_phases: bool) -> str:
    """The way of the k-th cancel after the first of each way."""
    if exact_phases and k % 2 == 0:
        return EXACT_PHASES[(k // 2) % len(EXACT_PHASES)]
    return DELAYED


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

    def time_parts(self) -> list[tuple[str, float]]:
        """The parts of the wall time, in order, then "other" (what no part
        measured): they add up to `durations["total_s"]`."""
        parts = [(label, self.durations[key]) for key, label in TIME_PARTS if key in self.durations]
        total = self.durations.get("total_s", 0.0)
        other = self.durations.get("other_s", max(0.0, total - sum(s for _, s in parts)))
        return [*parts, ("other", other)]

    def notes(self) -> list[str]:
        """What else a reader needs to read the numbers (in the table and the JSON)."""
        out: list[str] = []
        ways = cancel_ways(bool(self.args.get("cancel_at_phases")))
        planned = {r.planned.cancel for r in self.results}
        missing = [w for w in ways if w not in planned]
        if not float(self.args.get("cancel_rate", 0.0)):
            out.append("no request was cancelled (--cancel-rate 0)")
        elif missing:
            out.append(
                f"{len(self.results)} requests are too few to cancel in every way: no cancel "
                f"{', '.join(missing)} (every way needs --requests >= {len(ways)})"
            )
        return out

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
            "notes": self.notes(),
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


# -- the command ------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status (0 only if every invariant holds).

    `args` are the `kvhandoff demo` flags (cli/_flags.py)."""
    # Before Ray (and therefore any worker) starts: workers inherit it.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    fleet = getattr(args, "ctx_instances", 1) > 1 or getattr(args, "gen_instances", 1) > 1
    for role in ("ctx", "gen"):  # one TP per instance: checked before Ray starts
        tps = getattr(args, f"{role}_tp")
        if isinstance(tps, list):
            if not fleet and len(tps) > 1:
                print(f"kvhandoff demo: --{role}-tp {','.join(map(str, tps))}: one instance takes one TP "
                      f"(a list needs --{role}-instances above 1)", file=sys.stderr)
                return 2
            if not fleet:
                setattr(args, f"{role}_tp", tps[0])
    from kvhandoff.protocol import TopologyError
    from kvhandoff.topology import DEFAULT_LAYOUT, heads_per_rank

    for role in ("ctx", "gen"):  # a TP the KV heads do not split over: refused before Ray starts
        tps = getattr(args, f"{role}_tp")
        for tp in tps if isinstance(tps, list) else [tps]:
            try:
                heads_per_rank(DEFAULT_LAYOUT, tp)
            except TopologyError as exc:
                print(f"kvhandoff demo: --{role}-tp {tp}: {exc}", file=sys.stderr)
                return 2
    t0 = time.perf_counter()
    reporter = Reporter("kvhandoff demo", quiet=args.json)
    address = getattr(args, "address", None)  # --address: an existing cluster
    joining = bool(address or os.environ.get("RAY_ADDRESS"))  # or inside `ray job submit`: join it
    started_ray = False
    try:
        with reporter.step(
            f"joining the Ray cluster at {address or '$RAY_ADDRESS'}" if joining else "starting a local Ray cluster (2 CPUs)",
            done="Ray ready",
        ):
            import ray

            if not ray.is_initialized():
                quiet = {"log_to_driver": False, "logging_level": logging.ERROR}
                if joining:
                    ray.init(address=address, **quiet)
                else:  # a new cluster, even if another one runs on this machine (RAY_AUTH_MODE: cli.py)
                    ray.init(address="local", num_cpus=2, include_dashboard=False, **quiet)
                started_ray = True
    except Exception as exc:  # one line; the token hint only for a token refused
        if joining:
            from kvhandoff.cli._address import init_error

            line = init_error(exc, address or os.environ.get("RAY_ADDRESS", ""), os.environ)
        else:
            line = "could not start Ray: " + (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"kvhandoff demo: {line}", file=sys.stderr)
        return 2
    ray_init_s = time.perf_counter() - t0
    failed: _LaunchFailed | None = None
    try:
        # With --json, stdout carries the one JSON object: what Ray's driver
        # prints there meanwhile (its raylet's warnings) goes to stderr.
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            if fleet:
                from kvhandoff.cli._fleet_demo import run_fleet

                report = asyncio.run(run_fleet(args, reporter))
            else:
                report = asyncio.run(_run_async(args, reporter))
    except _LaunchFailed as exc:
        failed = exc
    finally:
        t = time.perf_counter()
        if started_ray:
            with reporter.step("stopping Ray", done="Ray stopped"):
                ray.shutdown()
        ray_shutdown_s = time.perf_counter() - t
    if failed is not None:  # one line, the last
        print(f"kvhandoff demo: could not launch the deployment: {failed}", file=sys.stderr)
        return 2
    parts = {"ray_init_s": ray_init_s, **report.durations, "ray_shutdown_s": ray_shutdown_s}
    total_s = time.perf_counter() - t0
    # The parts add up to the total: what no part measured (planning the
    # workload, asyncio.run, the report) is `other_s`.
    report.durations = {**parts, "other_s": max(0.0, total_s - sum(parts.values())), "total_s": total_s}
    if args.json:
        print(json.dumps(report.to_json()))
        for violation in report.violations:
            # Errors go to stderr too, so that `--json` callers see why it failed.
            print(f"kvhandoff demo: invariant violated: {violation}", file=sys.stderr)
    elif fleet:
        from kvhandoff.cli._fleet_demo import print_summary as print_fleet_summary

        print_fleet_summary(report)
    else:
        print_summary(report)
    return 0 if not report.violations else 1


class _LaunchFailed(RuntimeError):
    """The deployment did not come up (nothing to check)."""


async def _run_async(args: argparse.Namespace, reporter: Reporter) -> DemoReport:
    t = time.perf_counter()
    from kvhandoff.actors._faults import FaultPlan
    from kvhandoff.actors.deployment import Deployment

    durations: dict[str, float] = {"import_s": time.perf_counter() - t}  # torch, NIXL, ...
    overrides: dict[str, Any] = {"pp": 2} if args.unqualified else {}
    t = time.perf_counter()
    gpus_per_rank = getattr(args, "gpus_per_rank", 0.0) or 1.0
    if args.memory == "VRAM" and not getattr(args, "gpus_per_rank", 0.0):
        import ray

        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus:  # every rank on a GPU: share them when there are fewer GPUs than ranks
            gpus_per_rank = min(1.0, int(100 * gpus / (args.ctx_tp + args.gen_tp)) / 100)
    launching = (
        f"launching CTX tp={args.ctx_tp} -> GEN tp={args.gen_tp} ({args.memory}, NIXL/UCX"
        + (", pp=2: unqualified" if args.unqualified else "")
        + ")"
    )
    try:
        with reporter.step(launching, done="ranks ready"):
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
                placement=getattr(args, "placement", "any"),
                control_frames=getattr(args, "control_frames", "stream"),
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
        cancels = sum(p.cancel is not None for p in plan)
        t = time.perf_counter()
        reporter.start_requests(
            len(plan), f"running {len(plan)} requests, {args.concurrency} in flight, {cancels} cancelled"
        )
        try:
            results = await run_workload(dep, plan, args.concurrency, reporter, args.timeout)
        finally:
            reporter.end_requests()
        durations["workload_s"] = time.perf_counter() - t
        t = time.perf_counter()
        with reporter.step("waiting until every rank gave back its blocks", done="blocks settled"):
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
            "data_mode": args.data_mode,
            "placement": getattr(args, "placement", "any"),
            "nodes": {role.value: node for role, node in getattr(dep, "nodes", {}).items()},
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
    progress: Reporter,
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
            progress.request_done(finished.outcome)
            return finished

    return list(await asyncio.gather(*(one(p) for p in plan)))


async def _handoff(dep: Any, planned: Planned, timeout: float) -> Any:
    from kvhandoff.cli.harness import handoff_cancel_at

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

#: What each way of cancelling does (the summary's notes).
WAY_NOTES = {
    "before_open": "both sides admitted, no OPEN sent yet",
    "before_ready": "OPENs sent, no CTX rank decided yet",
    "mid_dma": "a chunk was posted; completed if every byte landed first",
    "after_complete": "after completion: a no-op, so completed",
    DELAYED: "cancel() after a random delay, in any phase; completed if after completion",
}
#: The protocol counters a clean run shows: a label, and why they are expected there.
COUNTER_LABELS = {
    "refused_StaleError": "refused: stale",
    "refused_UnknownSessionError": "refused: unknown",
    "frames_reject": "REJECT frames",
    "cancel_deferred": "cancels deferred",
}
COUNTER_NOTES = {
    "refused_StaleError": "frames for a closed session or an older attempt (frames after a "
    "cancel, a RECEIPT of a cancelled edge): refused by the generation checks, "
    "nothing changed (S3). Expected on a clean run: the protocol working",
    "refused_UnknownSessionError": "frames for a session never opened here (a cancel ahead of "
    "its OPEN): refused, nothing changed (S3). Expected with cancels",
    "frames_reject": "REJECT frames answering OPENs of requests already cancelled or ended. "
    "Expected with cancels; not rejected requests (see outcomes)",
    "cancel_deferred": "cancels that waited for their decided transfer (conservative path)",
}
#: Any other refusal.
REFUSED_NOTE = "frames or requests refused by the protocol's checks: nothing changed (S3)"
#: The parts of the wall time, in order (`durations` in the JSON object).
TIME_PARTS = (
    ("ray_init_s", "Ray start"),
    ("import_s", "imports"),
    ("launch_s", "launch"),
    ("workload_s", "run"),
    ("settle_s", "settle"),
    ("shutdown_s", "shutdown"),
    ("ray_shutdown_s", "Ray stop"),
)


def summary_tables(report: DemoReport) -> list[Any]:
    """The summary as rich tables: the run, then the blocks of every rank."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    j = report.to_json()
    args = report.args
    table = Table(title="kvhandoff demo", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("value", max_width=30)
    table.add_column("what it means", style="dim", ratio=1, overflow="fold")
    table.add_row(
        "topology",
        f"CTX tp={args['ctx_tp']} -> GEN tp={args['gen_tp']}, {args['memory']}, "
        f"{args['pool_blocks']} blocks/rank" + (", chaos (deferred DMA)" if args.get("chaos") else ""),
        "",
    )
    if report.qualified:
        table.add_row("scope", "qualified", "active protocol: a cancel stops DMA between chunks")
    else:
        deferred = j["counters"].get("cancel_deferred", 0)
        table.add_row(
            "scope",
            Text("UNQUALIFIED", style="yellow"),
            "conservative path: a cancel waits for the transfer to finish ("
            + "; ".join(report.unqualified_reasons)
            + f"); {deferred} cancels waited",
        )
    max_tokens = args.get("max_tokens", MAX_TOKENS)
    table.add_row(
        "workload",
        f"{j['requests']} requests, {min(MIN_TOKENS, max_tokens)}..{max_tokens} tokens, "
        f"{args['concurrency']} in flight, seed {args['seed']}",
        "",
    )
    cancels = sum(r.planned.cancel is not None for r in report.results)
    asked = math.floor(args["cancel_rate"] * len(report.results) + 0.5)
    table.add_row(
        "cancels",
        f"{cancels} of {len(report.results)} (--cancel-rate {args['cancel_rate']:g})",
        f"{asked} asked, raised to one in each way below" if cancels > asked
        else "each way below at least once, when there are enough requests",
    )
    table.add_row(
        "outcomes",
        ", ".join(f"{k} {v}" for k, v in j["outcomes"].items() if v or k in OUTCOMES[:4]),
        "every request ended (L1)",
    )
    for way, counts in j["cancel_mix"].items():
        if way != "none":
            table.add_row(
                f"  cancel {way}",
                ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                WAY_NOTES.get(way, ""),
            )
    table.add_row(
        "bytes completed",
        _mib(j["bytes_verified"]),
        "completed requests' KV, every byte verified on GEN (S2); JSON bytes_verified",
    )
    table.add_row(
        "bytes GEN checked",
        _mib(j["counters"].get("bytes_verified", 0)),
        "what GEN verified, requests cancelled after their bytes landed included; "
        "JSON counters.bytes_verified",
    )
    table.add_row(
        "throughput",
        f"{j['handoffs_per_s']:.1f} completed/s, {j['requests_per_s']:.1f} requests/s",
        "over the run",
    )
    table.add_row(
        "latency",
        f"p50 {_ms(j['latency_p50_s'])}, p99 {_ms(j['latency_p99_s'])}",
        "completed requests, handoff() to result",
    )
    table.add_row(
        "data plane",
        f"{args.get('data_mode', 'auto')}: {j['staged_chunks']} chunks staged",
        f"{j['leaked_slots']} staging slots leaked",
    )
    for name, count in j["counters"].items():
        if name in COUNTER_NOTES or name.startswith("refused_"):
            label = COUNTER_LABELS.get(name, name.replace("refused_", "refused: "))
            note = f"{COUNTER_NOTES.get(name, REFUSED_NOTE)}; JSON counters.{name}"
            table.add_row(label, str(count), note)
    total = report.durations.get("total_s", 0.0)
    parts = report.time_parts()
    table.add_row(
        "wall time",
        f"{total:.1f} s",
        " + ".join(f"{label} {seconds:.1f}" for label, seconds in parts),
    )
    for note in j["notes"]:
        table.add_row("note", "", note)
    if report.violations:
        table.add_row(
            "invariants",
            Text(f"VIOLATED ({len(report.violations)})", style="bold red"),
            "\n".join(report.violations),
        )
    else:
        table.add_row(
            "invariants",
            Text("OK", style="bold green"),
            "L1 (all terminal, no timeout), L2 (0 leaked), S2 (bytes verified), S4 (pools)",
        )
    blocks = Table(title="blocks per rank", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("rank", "pool", "free", "leased", "quarantined", "leaked"):
        blocks.add_column(column, justify="left" if column == "rank" else "right")
    for s in report.ranks:
        if "error" in s:
            blocks.add_row(Text(f"error: {s['error']}", style="red"), "", "", "", "", "")
            continue
        blocks.add_row(
            f"{s['role']}{s['rank']}",
            *(str(s[k]) for k in ("pool", "free", "leased", "quarantined")),
            str(_leaked(s)),
        )
    return [table, blocks]


def print_summary(report: DemoReport) -> None:
    """The summary on stdout: styled in a terminal, plain text otherwise."""
    if is_terminal(sys.stdout):
        from rich.console import Console

        Console(highlight=False).print(*summary_tables(report))
    else:
        print(render_summary(report))


def render_summary(report: DemoReport, width: int = 100) -> str:
    """The summary as plain text (no escape sequences)."""
    import io

    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False, highlight=False)
    console.print(*summary_tables(report))
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()).strip("\n")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"
