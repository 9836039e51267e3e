"""Helpers shared by the end-to-end tests on real rank actors."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kvhandoff.actors.deployment import DEFAULT_LAYOUT, Deployment
from kvhandoff.topology import block_bytes

T = TypeVar("T")

TOKENS = 100  # 7 blocks of 16 tokens
# The watchdog has its own tests (test_coordinator.py); here a loaded 2-core box must not trip it.
ROUND_TIMEOUT = 20.0
BOUND_S = 60.0  # generous: the box is shared and has 2 cores


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def gen_bytes(tokens: int, gen_tp: int) -> int:
    """Bytes every GEN rank together must hold for `tokens` (the whole KV)."""
    return math.ceil(tokens / DEFAULT_LAYOUT.tokens_per_block) * block_bytes(DEFAULT_LAYOUT, gen_tp) * gen_tp


def _slots_busy(s: dict) -> int:
    """Staging slots a rank's writer holds that are not quarantined."""
    st = s.get("staging", {})
    return st.get("in_use", 0) - st.get("slots", {}).get("quarantined", 0) + st.get("queued", 0)


async def settled_stats(dep: Deployment, timeout: float = 10.0) -> dict:
    """Stats once no rank holds a lease or a (not quarantined) staging slot
    any more (bounded: L1/L2)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await dep.stats()
        if all(s.get("leased") == 0 and not _slots_busy(s) for s in stats["ranks"]) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def wait_stats(
    dep: Deployment, ready: Callable[[dict], bool], timeout: float = 60.0, *, idle: bool = True
) -> dict:
    """Stats once `ready(stats)` holds and, with `idle`, no rank holds a lease
    (bounded: an L1 limit, not a pace)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await dep.stats()
        # A rank that is restarting answers with an error entry: not there yet.
        up = all("error" not in s and (not idle or s["leased"] == 0) for s in stats["ranks"])
        if (up and ready(stats)) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


def assert_clean(stats: dict, *, quarantined_ok: bool = False, slots_quarantined: int = 0) -> None:
    """L2 on every rank: nothing leased, nothing leaked, no bookkeeping left;
    no staging slot held, and exactly `slots_quarantined` quarantined in all."""
    quarantined = 0
    for s in stats["ranks"]:
        st = s.get("staging", {})
        quarantined += st.get("slots", {}).get("quarantined", 0)
        assert _slots_busy(s) == 0, st
        assert "error" not in s, s
        assert s["violations"] == [], s["violations"]  # S2
        assert s["leased"] == 0, s  # nothing still held: no leak (L2)
        assert s["free"] + s["quarantined"] == s["pool"], s
        assert s["leaked_handles"] == 0, s  # every release that was tried succeeded
        assert s["counters"].get("poll_loop_errors", 0) == 0, s["counters"]  # no sweep raised
        assert s["tracking"] == 0, s  # no per-request bookkeeping outlives its request
        if not quarantined_ok:
            assert s["quarantined"] == 0, s
            assert s["in_flight_chunks"] == 0, s
    if not quarantined_ok:
        assert quarantined == slots_quarantined, [s.get("staging") for s in stats["ranks"]]


async def inside(handle: Any, fn: Callable[[Any], Any]) -> Any:
    """Run `fn(endpoint)` inside a real rank actor (Ray's `__ray_call__`) on the
    rank endpoint it hosts: how a test reads or arranges a rank's internals
    without a hook in its public API."""
    from kvhandoff.cli.harness import on_endpoint_loop

    return await handle.__ray_call__.remote(on_endpoint_loop, fn)


async def then_shutdown(dep: Deployment, work: Awaitable[T]) -> tuple[T, dict]:
    """What `work` returns, and the stats once the ranks settled; `dep` is
    shut down either way."""
    try:
        return await work, await settled_stats(dep)
    finally:
        await dep.shutdown()


def assert_completed(results: Sequence[Any], verified: Sequence[int]) -> None:
    """Every handoff completed, with exactly its `verified` bytes checked by GEN (S2)."""
    assert len(results) == len(verified)
    for r, nbytes in zip(results, verified):
        assert r.outcome == "completed", r
        assert r.bytes_verified == nbytes


async def cancel_then_reuse(
    dep: Deployment, cancel: Callable[[str], Awaitable[Any]], tokens: int, tag: str, *, rounds: int, timeout: float
) -> list[tuple[str, str, int]]:
    """`rounds` times: a request ended by `cancel(request_id)`, then at once a
    fresh handoff of `tokens` (where the GEN pool holds one request, it takes
    the cancelled request's blocks). (cancelled's outcome, fresh's outcome,
    fresh's bytes verified) for each round."""
    outcomes = []
    for i in range(rounds):
        cancelled = await cancel(f"{tag}-c{i}")
        fresh = await dep.handoff(f"{tag}-f{i}", tokens, timeout=timeout)
        outcomes.append((cancelled.outcome, fresh.outcome, fresh.bytes_verified))
    return outcomes


def assert_reused_clean(outcomes: list[tuple[str, str, int]], stats: dict, fresh_bytes: int) -> None:
    """After `cancel_then_reuse`: every cancel ended cancelled, every fresh
    request completed with all its `fresh_bytes` verified, so no late byte of
    a cancelled request landed in it (S1/S2), and nothing leaked (L2)."""
    for cancelled, fresh, verified in outcomes:
        assert cancelled == "cancelled"
        assert fresh == "completed" and verified == fresh_bytes
    assert_clean(stats)


async def carried_handoffs(
    control_frames: str, prefix: str, then: Callable[[Deployment], Awaitable[Any]] | None = None
) -> tuple[list[Any], Any, Any, dict]:
    """A CTX tp=2 -> GEN tp=1 deployment whose control frames take
    `control_frames`: three handoffs, one cancelled mid-DMA, then `then(dep)`
    (its answer returned), and the stats once the ranks settled."""
    from kvhandoff.actors._faults import FaultPlan
    from kvhandoff.cli.harness import handoff_cancel_at

    dep = await Deployment.launch(
        ctx_tp=2, gen_tp=1, pool_blocks=32, chunk_bytes=64 << 10, round_timeout_s=20.0,
        fault_plan=FaultPlan(defer_s=0.05), control_frames=control_frames,
    )
    try:
        done = [await dep.handoff(f"{prefix}-{i}", 100 + 40 * i, timeout=BOUND_S) for i in range(3)]
        cancelled = await handoff_cancel_at(dep, f"{prefix}-cancel", 100, "mid_dma", timeout=BOUND_S)
        after = await then(dep) if then is not None else None
        return done, cancelled, after, await settled_stats(dep, BOUND_S)
    finally:
        await dep.shutdown()


def assert_carried(done: list[Any], cancelled: Any) -> None:
    """`carried_handoffs`' three completed with every byte verified; the cancel cancelled."""
    assert_completed(done, [gen_bytes(100 + 40 * i, 1) for i in range(3)])
    assert cancelled.outcome == "cancelled", cancelled
