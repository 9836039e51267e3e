"""End to end on a real local Ray cluster with real NIXL agents moving real host bytes.

Every test checks the invariants the actors layer can observe: S2 (GEN verifies
every byte against the request's pattern), S4 (each rank's pool checks its own
states on every stats() call), L1 (every handoff ends within its timeout) and
L2 (after the dust settles, free + quarantined == pool on every rank).
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import time

import pytest

from kvhandoff.actors._faults import FaultPlan
from kvhandoff.actors.deployment import DEFAULT_LAYOUT, Deployment
from kvhandoff.cli.harness import delay_lookups, handoff_cancel_at, until_posted
from kvhandoff.protocol import (
    BlockDescriptor,
    BufferInfo,
    CancelReason,
    ContextTicket,
    Endpoint,
    MemoryKind,
    Open,
    RankNamespace,
    Role,
    encode_frame,
)
from kvhandoff.protocol import Cancel as CancelMsg
from kvhandoff.topology import block_bytes, topology_digest

from .helpers import (
    ROUND_TIMEOUT,
    TOKENS,
    assert_clean,
    assert_reused_clean,
    cancel_then_reuse,
    gen_bytes,
    inside,
    run,
    settled_stats,
    then_shutdown,
    wait_stats,
)

pytestmark = pytest.mark.ray

POOL = 24
TIMEOUT = 20.0
# Per-chunk DMA deferral: gives the cancel storms real in-flight DMA to hit.
# It synchronises nothing: the mid-DMA phase tests hold chunks in flight and let
# them go once the ranks show the cancel applied (cancel_mid_dma below).
DEFER_S = 0.2


@pytest.fixture(scope="module", params=[(1, 1), (2, 1), (1, 2), (2, 2)], ids=lambda p: f"ctx{p[0]}-gen{p[1]}")
def deployment(request, ray_cluster):
    ctx_tp, gen_tp = request.param
    # Deferred completions: every chunk stays in flight for DEFER_S, and its
    # real bytes land only then, so mid-DMA cancels race genuinely late writes.
    dep = asyncio.run(
        Deployment.launch(
            round_timeout_s=ROUND_TIMEOUT,
            ctx_tp=ctx_tp,
            gen_tp=gen_tp,
            pool_blocks=POOL,
            chunk_bytes=64 << 10,
            fault_plan=FaultPlan(defer_s=DEFER_S),
            transfer_timeout_s=5.0,
        )
    )
    yield dep
    asyncio.run(dep.shutdown())


def test_happy_path_moves_and_verifies_every_byte(deployment: Deployment) -> None:
    dep = deployment
    result = run(dep.handoff("happy", TOKENS, timeout=TIMEOUT))
    assert result.outcome == "completed", result
    assert result.bytes_verified == gen_bytes(TOKENS, dep.gen_spec.tp)
    # CTX released exactly once each (its completion round follows the receipts).
    assert run(dep.wait("happy", Role.CTX, TIMEOUT)) == ["released"] * dep.ctx_spec.tp
    stats = run(settled_stats(dep))
    assert_clean(stats)
    for s in stats["ranks"]:
        assert s["counters"].get("released", 0) >= 1
        assert s["counters"].get("cleanup_skipped", 0) == 0  # no double release attempted
        if s["role"] == "ctx":  # every chunk went out through the prepared lists
            assert s["counters"].get("posts_prepared", 0) >= 1, s["counters"]
            assert s["counters"].get("posts_built", 0) == 0, s["counters"]
            assert s["counters"].get("prepare_failed", 0) == 0, s["counters"]


def test_built_descriptor_path_moves_the_same_bytes(ray_cluster) -> None:
    """With prepared lists off, every chunk is built per post (initialize_xfer)
    from the same plan: the GEN still verifies every byte."""

    async def scenario():
        dep = await Deployment.launch(
            ctx_tp=2, gen_tp=1, pool_blocks=POOL, chunk_bytes=64 << 10,
            prepared_descriptors=False, round_timeout_s=ROUND_TIMEOUT,
        )
        try:
            results = [await dep.handoff(f"built-{i}", TOKENS + 31 * i, timeout=TIMEOUT) for i in range(3)]
            return results, await settled_stats(dep)
        finally:
            await dep.shutdown()

    results, stats = run(scenario())
    for i, r in enumerate(results):
        assert r.outcome == "completed", r
        assert r.bytes_verified == gen_bytes(TOKENS + 31 * i, 1)
    assert_clean(stats)
    for s in stats["ranks"]:
        if s["role"] == "ctx":
            assert s["counters"].get("posts_built", 0) >= 3, s["counters"]
            assert s["counters"].get("posts_prepared", 0) == 0, s["counters"]


def test_concurrent_handoffs_never_mix_bytes(deployment: Deployment) -> None:
    dep = deployment

    async def many():
        return await asyncio.gather(*(dep.handoff(f"many-{i}", 20 + 13 * i, timeout=TIMEOUT) for i in range(6)))

    results = run(many())
    done = [r for r in results if r.outcome == "completed"]
    assert done, results
    assert {r.outcome for r in results} <= {"completed", "rejected"}  # rejected: pool full
    for r in done:
        assert r.bytes_verified == gen_bytes(int(r.request_id.split("-")[1]) * 13 + 20, dep.gen_spec.tp)
    assert_clean(run(settled_stats(dep)))


def test_cancel_storm_never_wedges(deployment: Deployment) -> None:
    """A burst of concurrent handoffs, each cancelled at a random moment (some
    before admission, some mid-DMA, some after completion), some refused for
    lack of blocks. Every one ends (L1) as completed, cancelled or rejected,
    never failed; the instance keeps serving right after; nothing leaks (L2)."""
    dep = deployment
    rng = random.Random(7)

    async def storm():
        async def one(i: int):
            task = asyncio.create_task(dep.handoff(f"storm-{i}", 20 + 7 * (i % 5), timeout=TIMEOUT))
            await asyncio.sleep(rng.uniform(0.0, 0.4))
            await dep.cancel(f"storm-{i}")
            return await task

        results = await asyncio.gather(*(one(i) for i in range(20)))
        after = [await dep.handoff(f"after-storm-{i}", TOKENS, timeout=TIMEOUT) for i in range(2)]
        return results, after, await settled_stats(dep)

    results, after, stats = run(storm())
    outcomes = collections.Counter(r.outcome for r in results)
    assert set(outcomes) <= {"completed", "cancelled", "rejected"}, outcomes
    assert outcomes["cancelled"] >= 5, outcomes  # the burst really cancelled
    for r in results:
        if r.outcome == "completed":  # a cancel that lost the race leaves valid KV
            assert r.bytes_verified == gen_bytes(20 + 7 * (int(r.request_id.split("-")[1]) % 5), dep.gen_spec.tp)
    assert [r.outcome for r in after] == ["completed", "completed"], after
    assert_clean(stats)


async def set_hold(dep: Deployment, hold: bool) -> None:
    """Hold (or let go) every CTX rank's posted chunks in flight (FaultPlan.hold)."""

    def apply(self: object) -> None:
        self.transport.plan.hold = hold  # type: ignore[attr-defined]

    await asyncio.gather(*(inside(h, apply) for h in await dep.ranks(Role.CTX)))


async def cancel_mid_dma(dep: Deployment, request_id: str) -> tuple[object, list[dict]]:
    """A mid-DMA cancel synchronised on what the ranks show, not on a delay:
    every CTX chunk is held in flight; the handoff cancels once a chunk is
    posted; the chunks are let go only when every CTX rank has applied the
    cancel (no CTX parent still decided, at least one edge draining). So the
    real bytes land after the cancel, whatever the machine's speed. Returns the
    result and the CTX phases seen at the moment of release."""
    await set_hold(dep, True)
    task = asyncio.create_task(handoff_cancel_at(dep, request_id, TOKENS, "mid_dma", timeout=TIMEOUT))
    ctx = await dep.ranks(Role.CTX)
    deadline = time.monotonic() + TIMEOUT
    while True:
        parents = [p for p in await asyncio.gather(*(inside(h, _live_parents) for h in ctx)) if p]
        phases = [await h.phase.remote(p[0]) for h, p in zip(ctx, parents)] if parents else []
        applied = phases and all(ph["state"] not in ("decided", "resident") for ph in phases)
        if (applied and any("draining" in ph["edges"] for ph in phases)) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    await set_hold(dep, False)
    return await task, phases


def _live_parents(self: object) -> list:
    return list(self.side.parents())  # type: ignore[attr-defined]


@pytest.mark.parametrize("phase", ["before_open", "before_ready", "mid_dma"])
def test_cancel_at_each_phase_releases_everything(deployment: Deployment, phase: str) -> None:
    dep = deployment
    before = run(dep.stats())
    posted_before = sum(s["posted_chunks"] for s in before["ranks"])
    if phase == "mid_dma":
        result, phases = run(cancel_mid_dma(dep, f"cancel-{phase}"))
        assert any("draining" in ph["edges"] for ph in phases), phases  # DMA was in flight
    else:
        result = run(handoff_cancel_at(dep, f"cancel-{phase}", TOKENS, phase, timeout=TIMEOUT))
    assert result.outcome == "cancelled", result
    assert result.bytes_verified == 0
    stats = run(settled_stats(dep))
    assert_clean(stats)
    posted = sum(s["posted_chunks"] for s in stats["ranks"]) - posted_before
    if phase == "mid_dma":
        assert posted > 0  # DMA really was posted when the cancel came, and was drained
    elif phase == "before_open" or not before["coordinators"]["ctx"]["admits_at_open"]:
        assert posted == 0  # nothing may be posted for a parent cancelled before READY
    # else: a CTX rank that admits at the OPEN takes the held OPEN when it is
    # let go (its CANCEL follows it) and may post before the CANCEL reaches
    # it; the GEN kept its blocks until that drained (assert_clean above).


def test_cancel_after_completion_changes_nothing(deployment: Deployment) -> None:
    result = run(handoff_cancel_at(deployment, "late-cancel", TOKENS, "after_complete", timeout=TIMEOUT))
    assert result.outcome == "completed"
    assert result.bytes_verified == gen_bytes(TOKENS, deployment.gen_spec.tp)
    assert_clean(run(settled_stats(deployment)))


def test_mid_dma_cancel_then_immediate_reuse_sees_no_stale_bytes(ray_cluster) -> None:
    """S1/S2 under reuse pressure: GEN's pool holds exactly one request, the
    cancelled request's chunks land late, and the next request takes the same
    blocks at once. Releasing before the drain finished would let the late
    bytes overwrite the new request's KV, and GEN's verification would catch it."""

    async def scenario():
        blocks = math.ceil(TOKENS / DEFAULT_LAYOUT.tokens_per_block)
        dep = await Deployment.launch(
            round_timeout_s=ROUND_TIMEOUT,
            ctx_tp=2, gen_tp=1, pool_blocks=blocks, chunk_bytes=64 << 10,
            fault_plan=FaultPlan(defer_s=DEFER_S), transfer_timeout_s=5.0,
        )

        async def cancel(request_id: str) -> object:
            cancelled, phases = await cancel_mid_dma(dep, request_id)
            assert any("draining" in ph["edges"] for ph in phases), phases
            return cancelled

        return await then_shutdown(dep, cancel_then_reuse(dep, cancel, TOKENS, "reuse", rounds=2, timeout=TIMEOUT))

    outcomes, stats = run(scenario())
    assert_reused_clean(outcomes, stats, gen_bytes(TOKENS, 1))


def test_transfer_that_never_finishes_is_quarantined_not_reused(ray_cluster) -> None:
    """UNKNOWN: chunks stuck in flight past the transfer timeout. The blocks are
    quarantined on both sides (never reused), the request fails within a bound
    (L1), and free + quarantined == pool (L2)."""

    async def scenario():
        dep = await Deployment.launch(
            round_timeout_s=ROUND_TIMEOUT,
            ctx_tp=1, gen_tp=1, pool_blocks=POOL, chunk_bytes=64 << 10,
            fault_plan=FaultPlan(hold=True), transfer_timeout_s=1.0,
        )
        try:
            start = time.monotonic()
            result = await handoff_cancel_at(dep, "stuck", TOKENS, "mid_dma", timeout=TIMEOUT)
            elapsed = time.monotonic() - start
            return result, elapsed, await settled_stats(dep)
        finally:
            await dep.shutdown()

    result, elapsed, stats = run(scenario())
    assert result.outcome == "failed", result
    assert elapsed < TIMEOUT  # bounded by the transfer timeout, not by the test's patience
    assert_clean(stats, quarantined_ok=True)
    blocks = math.ceil(TOKENS / DEFAULT_LAYOUT.tokens_per_block)
    for s in stats["ranks"]:
        assert s["quarantined"] == blocks, s  # exactly the lease, still owned, never free
        # The stats say whose it is and why: the stuck parent, its edge UNKNOWN.
        (q,) = s["quarantine"]
        assert q["request_id"] == "stuck" and [e[2] for e in q["edges"]] == ["unknown"], q
    ctx = next(s for s in stats["ranks"] if s["role"] == "ctx")
    # The stuck chunks are still tracked, never released to "abort" them (NIXL: not an abort).
    assert ctx["in_flight_chunks"] > 0 and ctx["leaked_handles"] == 0


def test_write_that_errs_partially_is_quarantined_not_reused(ray_cluster) -> None:
    """A WRITE of several descriptors reports ERR while its other descriptors
    still write (the fault plan posts it for real, then reports ERR). That ERR
    is no proof: the CTX takes the edge as UNKNOWN, and the GEN keeps the
    blocks quarantined, never reused, while the stray bytes land. The next
    request gets other blocks and reads exactly its own bytes (S1/S2)."""

    async def scenario():
        dep = await Deployment.launch(
            round_timeout_s=ROUND_TIMEOUT,
            ctx_tp=2, gen_tp=1, pool_blocks=POOL, chunk_bytes=64 << 10, data_mode="direct",
            fault_plan=FaultPlan(fail_partial_every=1), transfer_timeout_s=5.0,
        )
        try:
            failed = await dep.handoff("partial", TOKENS, timeout=TIMEOUT)
            after_failure = await settled_stats(dep)
            for ctx in await dep.ranks(Role.CTX):  # no more faults from here on
                await inside(ctx, lambda ep: setattr(ep.transport.plan, "fail_partial_every", 0))
            fresh = await dep.handoff("after-partial", TOKENS, timeout=TIMEOUT)
            return failed, after_failure, fresh, await settled_stats(dep)
        finally:
            await dep.shutdown()

    failed, after_failure, fresh, stats = run(scenario())
    assert failed.outcome == "failed", failed
    blocks = math.ceil(TOKENS / DEFAULT_LAYOUT.tokens_per_block)
    ctx_ranks = [s for s in after_failure["ranks"] if s["role"] == "ctx"]
    assert all(s["unproven_chunks"] > 0 for s in ctx_ranks), ctx_ranks  # the path ran: several descriptors
    for s in after_failure["ranks"]:
        assert s["quarantined"] == blocks, s  # the lease, kept on both sides, never free
    assert_clean(after_failure, quarantined_ok=True)
    assert fresh.outcome == "completed" and fresh.bytes_verified == gen_bytes(TOKENS, 1), fresh
    gen = next(s for s in stats["ranks"] if s["role"] == "gen")
    assert gen["quarantined"] == blocks, gen
    assert_clean(stats, quarantined_ok=True)


def _check_raises_once(transport) -> None:
    """The transport's next check raises (a broken promise: checks return a
    state); the one after is the real check again."""
    real = transport.check

    def check(chunk):
        transport.check = real
        raise RuntimeError("injected: a transport check that raises")

    transport.check = check


def test_poll_sweep_that_raises_is_counted_and_polling_goes_on(ray_cluster) -> None:
    """An exception out of one poll sweep (here the CTX transport's check)
    must not end the rank's poll loop: that would leave every chunk and
    frame of the rank unpolled. The sweep is counted and logged, the next
    one polls the same chunk again, and the request completes."""

    async def scenario():
        dep = await Deployment.launch(
            round_timeout_s=ROUND_TIMEOUT, pool_blocks=POOL, chunk_bytes=64 << 10,
            fault_plan=FaultPlan(defer_s=DEFER_S), transfer_timeout_s=TIMEOUT,
        )
        try:
            for ctx in await dep.ranks(Role.CTX):
                await inside(ctx, lambda ep: _check_raises_once(ep.transport))
            result = await dep.handoff("sweep-raised", TOKENS, timeout=TIMEOUT)
            return result, await settled_stats(dep)
        finally:
            await dep.shutdown()

    result, stats = run(scenario())
    assert result.outcome == "completed" and result.bytes_verified == gen_bytes(TOKENS, 1), result
    for ctx in [s for s in stats["ranks"] if s["role"] == "ctx"]:  # each CTX rank polled its chunks
        assert ctx["counters"].get("poll_loop_errors") == 1, ctx["counters"]
        ctx["counters"]["poll_loop_errors"] = 0  # the injected one: everything else is clean
    assert_clean(stats)


def test_ctx_lease_expires_when_gen_never_opens(ray_cluster) -> None:
    async def scenario():
        dep = await Deployment.launch(ctx_tp=2, gen_tp=1, pool_blocks=POOL, lease_timeout_s=0.5, round_timeout_s=ROUND_TIMEOUT)
        try:
            parent = dep.parent("orphan")
            assert await dep.coordinator(Role.CTX).admit.remote(parent, TOKENS)
            held = await dep.stats()
            outcomes = await dep.wait("orphan", Role.CTX, TIMEOUT)
            return held, outcomes, await settled_stats(dep)
        finally:
            await dep.shutdown()

    held, outcomes, stats = run(scenario())
    blocks = math.ceil(TOKENS / DEFAULT_LAYOUT.tokens_per_block)
    assert [s["leased"] for s in held["ranks"] if s["role"] == "ctx"] == [blocks, blocks]
    assert all(o in ("released", "cancelled") for o in outcomes), outcomes
    assert_clean(stats)


def test_stale_and_garbage_frames_change_nothing(deployment: Deployment) -> None:
    """S3 at the actor boundary: a CANCEL naming an old epoch, or bytes that
    are not a frame, are refused and leave every rank's state unchanged."""
    dep = deployment

    async def scenario():
        ctx = (await dep.ranks(Role.CTX))[0]
        endpoints = await dep.ctx_endpoints()
        gen_entry = (await dep._directory.all_of.remote(Role.GEN.value))[0][0][0]
        ok = await dep.handoff("s3-victim", TOKENS, timeout=TIMEOUT)
        # The handoff returns at the GEN decision; the CTX completion round
        # may still be applying: compare from the settled state on.
        before = await settled_stats(dep)
        stale_ctx = Endpoint(ns=endpoints[0].ns, epoch=endpoints[0].epoch + 1000)
        victim = dep.parent("s3-victim")  # the real attempt: only the epoch is stale
        ticket = ContextTicket(
            request_id="s3-victim", ctx_attempt=victim.ctx_attempt, gen_attempt=victim.gen_attempt,
            ctx=stale_ctx, gen=gen_entry,
            ctx_digest=topology_digest(dep.ctx_spec), gen_digest=topology_digest(dep.gen_spec),
        )
        stale = encode_frame(CancelMsg(ticket=ticket, reason=CancelReason.PEER))
        accepted = [await ctx.receive_frame.remote(stale), await ctx.receive_frame.remote(b"\x00garbage")]
        after = await dep.stats()
        return ok, accepted, before, after

    ok, accepted, before, after = run(scenario())
    assert ok.outcome == "completed"
    assert accepted == [False, False]
    strip = lambda st: [(s["free"], s["leased"], s["quarantined"], s["parents"]) for s in st["ranks"]]  # noqa: E731
    assert strip(before) == strip(after)


@pytest.mark.parametrize(
    "where", ["misaligned", "past the pool", "another agent's block size", "another agent"]
)
def test_open_pointing_outside_the_gen_buffer_is_refused(deployment: Deployment, where: str) -> None:
    """A CTX rank checks every block descriptor of an OPEN against the GEN
    rank's registered buffer (its geometry from the directory) and refuses one
    that points anywhere else, before any session state or DMA: the WRITE can
    only ever land on a whole block the GEN actually leased out."""
    dep = deployment

    async def scenario():
        ctx = (await dep.ranks(Role.CTX))[0]
        (gen_ep, gen_agent, _, geometry), _ = (await dep._directory.all_of.remote(Role.GEN.value))[0]
        ctx_ep = (await dep.ctx_endpoints())[0]
        dep._new_attempt("evil")
        parent = dep.parent("evil")
        assert await dep.coordinator(Role.CTX).admit.remote(parent, TOKENS)
        before = await dep.stats()
        n = math.ceil(TOKENS / DEFAULT_LAYOUT.tokens_per_block)
        size = block_bytes(DEFAULT_LAYOUT, dep.gen_spec.tp)
        blocks = list(range(n))
        if where == "past the pool":
            blocks[-1] = geometry.num_blocks
        addrs = [geometry.base + b * size for b in blocks]
        if where == "misaligned":
            addrs[2] += 64
        length = size if where != "another agent's block size" else size // 2
        open_msg = Open(
            ticket=ContextTicket(
                request_id=parent.request_id, ctx_attempt=parent.ctx_attempt,
                gen_attempt=parent.gen_attempt, ctx=ctx_ep, gen=gen_ep,
                ctx_digest=topology_digest(dep.ctx_spec), gen_digest=topology_digest(dep.gen_spec),
            ),
            buffer=BufferInfo(
                agent_name=gen_agent if where != "another agent" else gen_agent + "x",
                endpoint_epoch=gen_ep.epoch, memory=MemoryKind.DRAM, device=0,
                blocks=[BlockDescriptor(block=b, generation=0, addr=a, length=length) for b, a in zip(blocks, addrs)],
            ),
            num_tokens=TOKENS,
        )
        accepted = await ctx.receive_frame.remote(encode_frame(open_msg))
        after = await dep.stats()
        await dep.cancel("evil")
        return accepted, before, after, await settled_stats(dep)

    accepted, before, after, settled = run(scenario())
    assert accepted is False
    ctx0 = lambda st: next(s for s in st["ranks"] if s["role"] == "ctx" and s["rank"] == 0)  # noqa: E731
    error = "refused_StaleError" if where == "another agent" else "refused_LeaseError"
    assert ctx0(after)["counters"].get(error, 0) == ctx0(before)["counters"].get(error, 0) + 1
    assert ctx0(after)["posted_chunks"] == ctx0(before)["posted_chunks"]  # no DMA
    keep = ("free", "leased", "quarantined", "parents")
    assert [{k: s[k] for k in keep} for s in after["ranks"]] == [{k: s[k] for k in keep} for s in before["ranks"]]
    assert_clean(settled)


def test_foreign_restart_notices_change_nothing(deployment: Deployment) -> None:
    """`peer_restarted` is only believed about a rank of the peer instance: a
    notice naming another deployment's rank, or our own role, is refused."""
    dep = deployment

    async def scenario():
        ctx = (await dep.ranks(Role.CTX))[0]
        gen_ep = (await dep._directory.all_of.remote(Role.GEN.value))[0][0][0]
        ctx_ep = (await dep.ctx_endpoints())[0]
        before = await dep.stats()
        foreign = Endpoint(ns=RankNamespace(instance_id="other-gen", role=Role.GEN, rank=0), epoch=gen_ep.epoch + 7)
        own_role = Endpoint(ns=ctx_ep.ns, epoch=ctx_ep.epoch + 7)
        told = [await ctx.peer_restarted.remote(foreign), await ctx.peer_restarted.remote(own_role)]
        after = await dep.stats()
        ok = await dep.handoff("after-foreign-notice", TOKENS, timeout=TIMEOUT)
        return told, before, after, ok

    told, before, after, ok = run(scenario())
    assert told == [0, 0]
    ctx0 = lambda st: next(s for s in st["ranks"] if s["role"] == "ctx" and s["rank"] == 0)  # noqa: E731
    assert ctx0(after)["counters"].get("refused_peer_restarted", 0) == ctx0(before)["counters"].get("refused_peer_restarted", 0) + 2
    assert ctx0(after)["counters"].get("peer_restarts_seen", 0) == ctx0(before)["counters"].get("peer_restarts_seen", 0)
    keep = ("free", "leased", "quarantined", "parents")
    assert [{k: s[k] for k in keep} for s in after["ranks"]] == [{k: s[k] for k in keep} for s in before["ranks"]]
    assert ok.outcome == "completed", ok  # the GEN peer is still believed alive


XFER_TIMEOUT = 4.0


def test_rank_killed_mid_handoff_restarts_with_new_epoch(ray_cluster) -> None:
    """A CTX rank dies with DMA in flight. The CTX coordinator's watchdog fires,
    fails the in-flight parent, retires the dead epoch and restarts the rank
    with a new endpoint epoch (a new NIXL agent). The directory tells GEN at
    once; until the death is confirmed GEN cannot prove the dead rank's writes
    stopped, so it quarantines (UNKNOWN), well before its own transfer timeout
    would have fired. Once the directory confirmed the old incarnation dead
    (Ray reports it dead and its process is gone), GEN has its proof: every
    quarantined block is reclaimed, full capacity again (the defect: 18-48 of
    64 blocks stayed quarantined for good). The next request works through the
    new incarnation, and a frame naming the old epoch is refused."""
    import ray

    async def scenario():
        dep = await Deployment.launch(
            ctx_tp=2, gen_tp=1, pool_blocks=POOL, chunk_bytes=32 << 10,
            fault_plan=FaultPlan(defer_s=0.05), transfer_timeout_s=XFER_TIMEOUT, round_timeout_s=2.0,
        )
        try:
            old = await dep.ctx_endpoints()
            victim = (await dep.ranks(Role.CTX))[1]
            task = asyncio.create_task(dep.handoff("doomed", TOKENS, timeout=TIMEOUT))
            await until_posted(dep, "doomed", TIMEOUT)
            start = time.monotonic()
            ray.kill(victim)
            doomed = await task
            elapsed = time.monotonic() - start
            # The restart happens in the round after the failure; wait for it (bounded).
            deadline = time.monotonic() + TIMEOUT
            while (await dep.coordinator(Role.CTX).epochs.remote())[1] == old[1].epoch:
                assert time.monotonic() < deadline, "no restart"
                await asyncio.sleep(0.1)
            new = await dep.ctx_endpoints()
            fresh = None
            while time.monotonic() < deadline:  # admission resumes once the rank is back
                fresh = await dep.handoff("after-restart", TOKENS, timeout=TIMEOUT)
                if fresh.outcome != "rejected":
                    break
                await asyncio.sleep(0.2)
            ctx1 = (await dep.ranks(Role.CTX))[1]
            gen_ep = (await dep._directory.all_of.remote(Role.GEN.value))[0][0][0]
            live = dep.parent("after-restart")  # the real attempt: only the epoch is old
            ticket = ContextTicket(
                request_id="after-restart", ctx_attempt=live.ctx_attempt, gen_attempt=live.gen_attempt,
                ctx=old[1], gen=gen_ep,
                ctx_digest=topology_digest(dep.ctx_spec), gen_digest=topology_digest(dep.gen_spec),
            )
            stale_ok = await ctx1.receive_frame.remote(encode_frame(CancelMsg(ticket=ticket, reason=CancelReason.PEER)))
            proven = await wait_stats(
                dep, lambda s: any(r["counters"].get("peer_deaths_seen") for r in s["ranks"] if r["role"] == "gen")
            )
            return doomed, elapsed, old, new, fresh, stale_ok, proven
        finally:
            await dep.shutdown()

    doomed, elapsed, old, new, fresh, stale_ok, stats = run(scenario())
    assert doomed.outcome == "failed", doomed
    # Quarantined while the writer might live, or (death confirmed first) proven quiescent.
    assert doomed.gen_outcomes in (("quarantined",), ("cancelled",)), doomed
    # L1: GEN learned of the death from the retire notice (measured 0.2-0.4 s
    # here), not from its transfer timeout (which alone takes 1-2 timeouts).
    assert doomed.latency_s < XFER_TIMEOUT, (elapsed, doomed)
    assert new[1].epoch > old[1].epoch  # the dead rank came back as a new incarnation
    assert fresh is not None and fresh.outcome == "completed", fresh
    assert fresh.bytes_verified == gen_bytes(TOKENS, 1)
    assert stale_ok is False  # S3: the old incarnation's session does not exist here
    gen = next(s for s in stats["ranks"] if s["role"] == "gen")
    assert gen["counters"].get("peer_restarts_seen", 0) >= 1, gen["counters"]
    assert gen["counters"].get("peer_deaths_seen", 0) >= 1, gen["counters"]
    if doomed.gen_outcomes == ("quarantined",):  # reclaimed on the proof, every block of it
        assert gen["reclaimed"] == math.ceil(TOKENS / DEFAULT_LAYOUT.tokens_per_block), gen
    assert_clean(stats)  # nothing quarantined any more: full capacity


def test_gen_rank_restart_then_handoffs_resume_through_the_new_agent(ray_cluster) -> None:
    """A GEN rank dies between requests. The next admission round finds it gone,
    the GEN coordinator restarts it with a new endpoint epoch (a new NIXL agent
    and buffer), and handoffs resume: the CTX ranks learn the new agent from the
    directory on its first OPEN. Regression: with a slow directory, a CTX rank
    used to vote the OPEN prepared before it knew the agent; the decide round
    then posted to an unknown agent and the request was cancelled. "Prepared"
    now waits for the agent, so a 0.3 s lookup only delays the handoff."""
    import ray

    async def scenario():
        dep = await Deployment.launch(
            ctx_tp=2, gen_tp=1, pool_blocks=POOL, chunk_bytes=64 << 10,
            transfer_timeout_s=5.0, round_timeout_s=2.0, fault_plan=FaultPlan(),
        )
        try:
            first = await dep.handoff("before-gen-restart", TOKENS, timeout=TIMEOUT)
            old = (await dep.coordinator(Role.GEN).epochs.remote())[0]
            ray.kill((await dep.ranks(Role.GEN))[0])
            await delay_lookups(dep, 0.3)
            deadline = time.monotonic() + 3 * TIMEOUT
            outcomes = []
            while time.monotonic() < deadline:
                result = await dep.handoff("after-gen-restart", TOKENS, timeout=TIMEOUT)
                outcomes.append(result.outcome)
                if result.outcome not in ("rejected", "failed"):
                    break
                await asyncio.sleep(0.2)
            new = (await dep.coordinator(Role.GEN).epochs.remote())[0]
            await delay_lookups(dep, 0.0)
            return first, result, outcomes, old, new, await settled_stats(dep)
        finally:
            await dep.shutdown()

    first, fresh, outcomes, old, new, stats = run(scenario())
    assert first.outcome == "completed", first
    assert new > old  # the GEN rank came back as a new incarnation
    # Until the restart, admissions are refused or fail; the first one that gets
    # through completes (never "cancelled": nothing cancelled it).
    assert set(outcomes[:-1]) <= {"rejected", "failed"}, outcomes
    assert fresh.outcome == "completed", (fresh, outcomes)
    assert fresh.bytes_verified == gen_bytes(TOKENS, 1)
    assert_clean(stats)


def test_unqualified_topology_cancel_waits_for_the_transfer(ray_cluster) -> None:
    """Outside the qualified scope (here zero-copy) the conservative path runs:
    a cancel that arrives while the transfer is decided and in flight does not
    interrupt it; the transfer finishes, then everything is released."""

    async def scenario():
        dep = await Deployment.launch(
            ctx_tp=2, gen_tp=1, pool_blocks=POOL, chunk_bytes=32 << 10,
            fault_plan=FaultPlan(defer_s=DEFER_S), transfer_timeout_s=5.0,
            round_timeout_s=ROUND_TIMEOUT, ctx_overrides={"zero_copy": True},
        )
        try:
            before = await dep.stats()
            result = await handoff_cancel_at(dep, "conservative", TOKENS, "mid_dma", timeout=TIMEOUT)
            return dep.qualified, dep.unqualified_reasons, before, result, await settled_stats(dep)
        finally:
            await dep.shutdown()

    qualified, reasons, before, result, stats = run(scenario())
    assert not qualified and any("zero" in r for r in reasons), reasons
    assert result.outcome == "cancelled", result
    ctx = [s for s in stats["ranks"] if s["role"] == "ctx"]
    assert all(s["counters"].get("cancel_deferred", 0) >= 1 for s in ctx)  # the cancel waited
    moved = sum(s["posted_bytes"] for s in ctx) - sum(s["posted_bytes"] for s in before["ranks"] if s["role"] == "ctx")
    assert moved == gen_bytes(TOKENS, 1)  # every chunk was posted: the transfer ran to its end
    assert_clean(stats)
