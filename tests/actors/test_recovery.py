"""Recovery and refusal on the real rank actors (issue 8's protocol defects).

Real local Ray, real rank actors with their NIXL agents moving host bytes. Each
test reproduces one defect found by the seed audit and adversarial runs, and
checks the invariants it can observe: S1/S2 (GEN verifies every byte of every
completed request; freed blocks are poisoned), S3 (refused messages change
nothing), S4 (every stats() call checks each pool), L1 (bounded waits on
observable conditions only) and L2 (free + quarantined == pool, nothing leaked).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest

from kvhandoff.actors._faults import FaultPlan
from kvhandoff.actors.deployment import DEFAULT_LAYOUT, Deployment
from kvhandoff.cli.harness import (
    defer_opens,
    handoff_cancel_at,
    held_frames,
    hold_frames,
    release_frames,
    run_deferred_opens,
)
from kvhandoff.protocol import Cancel as CancelMsg
from kvhandoff.protocol import (
    CancelReason,
    Open,
    ParentKey,
    RankNamespace,
    Role,
    RoundProposal,
    StaleError,
    encode_frame,
)
from kvhandoff.topology import topology_digest

from .helpers import (
    ROUND_TIMEOUT,
    TOKENS,
    assert_clean,
    gen_bytes,
    inside,
    run,
    settled_stats,
    wait_stats,
)

pytestmark = pytest.mark.ray

POOL = 24
BLOCKS = math.ceil(TOKENS / DEFAULT_LAYOUT.tokens_per_block)
TIMEOUT = 30.0


async def launch(**kw: Any) -> Deployment:
    kw.setdefault("pool_blocks", POOL)
    kw.setdefault("round_timeout_s", ROUND_TIMEOUT)
    kw.setdefault("chunk_bytes", 64 << 10)
    return await Deployment.launch(**kw)


def key(request_id: str) -> ParentKey:
    return ParentKey(request_id=request_id, ctx_attempt=0, gen_attempt=0)


async def admit_both(
    dep: Deployment, parent: ParentKey, tokens: int = TOKENS, between: Callable[[], Awaitable[Any]] | None = None
) -> list[bool]:
    """Admit in CTX, then (after `between`) in GEN, whose ranks then install
    the session and send their OPENs themselves (the KV is kept for free())."""
    ctx_ok = await dep.coordinator(Role.CTX).admit.remote(parent, tokens)
    if between is not None:
        await between()
    gen_ok = await dep.coordinator(Role.GEN).admit.remote(parent, tokens)
    return [ctx_ok, gen_ok]


async def until_posted(rank: Any, timeout: float = TIMEOUT) -> ParentKey:
    """The parent a CTX rank is posting chunks for (waits on the observable)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = await inside(
            rank, lambda self: [p for p in self.side.parents() if any(e.posted for e in self.side.edges(p).values())]
        )
        if found:
            return found[0]
        await asyncio.sleep(0.01)
    raise AssertionError("no chunk was ever posted")


# ---- defect 1: a rejected admission must not break a healthy rank ---------------------


def _ctx(stats: dict) -> list[dict]:
    return [s for s in stats["ranks"] if s["role"] == "ctx"]


def test_rejected_admission_returns_tentative_leases_quietly(ray_cluster) -> None:
    """TP ranks with unequal free blocks: rank 1 leases in its vote, rank 0 cannot,
    so the round rejects. Rank 1 gives its tentative lease back; no rank breaks,
    nothing restarts (the defect: `release_not_started` raised, the rank was
    restarted and the restart budget spent)."""

    async def scenario():
        dep = await launch(ctx_tp=2, gen_tp=1)
        try:
            ctx = await dep.ranks(Role.CTX)
            epochs = await dep.coordinator(Role.CTX).epochs.remote()
            hog = POOL - BLOCKS + 1  # rank 0 keeps BLOCKS - 1 free blocks: one too few
            await inside(ctx[0], lambda self: len(self.pool.lease("hog", hog)))
            refused = await dep.handoff("too-big-for-rank-0", TOKENS, timeout=TIMEOUT)
            # The rejection is answered at the decision; the ranks apply it
            # next (rank 1 returns its tentative lease then): wait for that,
            # bounded (L1), rather than read one snapshot that may race it.
            during = await wait_stats(dep, lambda st: _ctx(st)[1]["leased"] == 0, TIMEOUT, idle=False)
            await inside(ctx[0], lambda self: self.pool.release("hog").value)
            fine = await dep.handoff("fits", TOKENS, timeout=TIMEOUT)
            coord = await dep.coordinator(Role.CTX).stats.remote()
            return epochs, refused, during, fine, coord, await settled_stats(dep)
        finally:
            await dep.shutdown()

    epochs, refused, during, fine, coord, stats = run(scenario())
    assert refused.outcome == "rejected", refused
    assert all("error" not in s for s in during["ranks"]), during["ranks"]  # no rank broke
    ctx = _ctx(during)
    assert ctx[0]["leased"] == POOL - BLOCKS + 1  # only the hog
    assert ctx[1]["leased"] == 0 and ctx[1]["free"] == POOL  # the tentative lease came back
    assert coord["restarts"] == 0 and coord["epochs"] == epochs, coord  # nobody broke
    assert not coord["rank_errors"], coord["rank_errors"]
    assert fine.outcome == "completed" and fine.bytes_verified == gen_bytes(TOKENS, 1), fine
    assert_clean(stats)


# ---- defect 9 (rank side): an unexpected error in a vote refuses, never breaks -------


def test_unexpected_vote_error_refuses_that_admission_only(ray_cluster) -> None:
    async def scenario():
        dep = await launch(ctx_tp=2, gen_tp=1)
        try:
            ctx = await dep.ranks(Role.CTX)

            def boom(self: Any) -> None:
                def admit(*_a: Any, **_k: Any) -> None:
                    raise RuntimeError("a bug in the admission path")

                self.side.admit = admit

            await inside(ctx[1], boom)
            refused = await dep.handoff("unlucky", TOKENS, timeout=TIMEOUT)
            await inside(ctx[1], lambda self: delattr(self.side, "admit"))
            fine = await dep.handoff("fine", TOKENS, timeout=TIMEOUT)
            coord = await dep.coordinator(Role.CTX).stats.remote()
            return refused, fine, coord, await settled_stats(dep)
        finally:
            await dep.shutdown()

    refused, fine, coord, stats = run(scenario())
    assert refused.outcome == "rejected", refused
    assert fine.outcome == "completed", fine
    assert coord["restarts"] == 0 and coord["state"] == "running", coord
    ctx1 = [s for s in stats["ranks"] if s["role"] == "ctx"][1]
    assert ctx1["counters"].get("admit_refused_RuntimeError") == 1, ctx1["counters"]
    assert_clean(stats)


# ---- defect 3: the conservative path obeys S3 and L1 -----------------------------------


def test_conservative_peer_cancel_at_one_rank_ends_everywhere(ray_cluster) -> None:
    """Unqualified topology (zero-copy): a CANCEL from GEN reaches one CTX rank
    while the decided transfer runs. A stale CANCEL (wrong epoch) is refused
    with no change (S3: it used to be matched by request id alone); the exact
    one defers on that rank and becomes a round intent, so both CTX ranks let
    the transfer finish, then release (L1: the sibling used to wait in SETTLED
    forever for a completion round that could never come)."""

    async def scenario():
        dep = await launch(
            ctx_tp=2, gen_tp=1, fault_plan=FaultPlan(defer_s=0.3), transfer_timeout_s=10.0,
            ctx_overrides={"zero_copy": True},
        )
        try:
            ctx = await dep.ranks(Role.CTX)
            task = asyncio.create_task(dep.handoff("conservative", TOKENS, timeout=TIMEOUT))
            parent = await until_posted(ctx[0])
            tickets = await inside(ctx[0], lambda self: list(self.side.edges(parent)))
            ticket = tickets[0]
            stale = msgspec.structs.replace(
                ticket, ctx=msgspec.structs.replace(ticket.ctx, epoch=ticket.ctx.epoch + 9)
            )
            before = await inside(ctx[0], lambda self: self.side.snapshot())
            stale_ok = await ctx[0].receive_frame.remote(encode_frame(CancelMsg(ticket=stale, reason=CancelReason.PEER)))
            after = await inside(ctx[0], lambda self: self.side.snapshot())
            exact_ok = await ctx[0].receive_frame.remote(encode_frame(CancelMsg(ticket=ticket, reason=CancelReason.PEER)))
            result = await task
            ctx_outcomes = await dep.wait("conservative", Role.CTX, TIMEOUT)
            return dep.qualified, stale_ok, before == after, exact_ok, result, ctx_outcomes, await settled_stats(dep, 30.0)
        finally:
            await dep.shutdown()

    qualified, stale_ok, unchanged, exact_ok, result, ctx_outcomes, stats = run(scenario())
    assert not qualified
    assert stale_ok is False and unchanged  # S3
    assert exact_ok is True
    # Both CTX ranks applied the cancel the round decided from rank 0's intent.
    assert ctx_outcomes == ["cancelled", "cancelled"], (ctx_outcomes, result)
    # The GEN did not ask for it here: its transfer ran to the end and every
    # byte was verified, or the cancel reached it first; never a half result.
    assert result.outcome in ("completed", "cancelled"), result
    if result.outcome == "completed":
        assert result.bytes_verified == gen_bytes(TOKENS, 1), result
    ctx = [s for s in stats["ranks"] if s["role"] == "ctx"]
    assert ctx[0]["counters"].get("cancel_deferred", 0) == 1, ctx[0]["counters"]
    assert all(s["posted_bytes"] > 0 and s["counters"].get("released", 0) == 1 for s in ctx), ctx
    assert_clean(stats)  # no rank waits in SETTLED: everything released


def test_topology_without_transfer_timeout_runs_conservatively(ray_cluster) -> None:
    """transfer_timeout_s=0 is unqualified only by that; it used to fail at
    launch (the protocol refuses a non-positive timeout). It runs the
    conservative path, bounded by the protocol's default timeout."""

    async def scenario():
        dep = await launch(ctx_tp=1, gen_tp=1, transfer_timeout_s=0.0)
        try:
            return dep.qualified, dep.unqualified_reasons, await dep.handoff("t0", TOKENS, timeout=TIMEOUT), await settled_stats(dep)
        finally:
            await dep.shutdown()

    qualified, reasons, result, stats = run(scenario())
    assert not qualified and any("timeout" in r for r in reasons), reasons
    assert result.outcome == "completed" and result.bytes_verified == gen_bytes(TOKENS, 1), result
    assert_clean(stats)


# ---- defect 4: every GEN lease has a deadline ------------------------------------------


def test_gen_lease_without_opens_ends_through_the_round(ray_cluster) -> None:
    """GEN ranks admitted a request but never open it (here: their installs are
    deferred for good): the GEN lease deadline cancels (an intent), and the
    round's decision returns the blocks (L1). It used to stay leased forever."""

    async def scenario():
        dep = await launch(ctx_tp=1, gen_tp=2, lease_timeout_s=0.5)
        try:
            parent = key("orphan-gen")
            gens = await dep.ranks(Role.GEN)
            await asyncio.gather(*(defer_opens(g, "orphan-gen") for g in gens))
            assert await dep.coordinator(Role.GEN).admit.remote(parent, TOKENS)
            held = await dep.stats()
            outcomes = await asyncio.gather(*(g.wait.remote(parent, TIMEOUT) for g in gens))
            return held, outcomes, await settled_stats(dep, TIMEOUT)
        finally:
            await dep.shutdown()

    held, outcomes, stats = run(scenario())
    assert [s["leased"] for s in held["ranks"] if s["role"] == "gen"] == [BLOCKS, BLOCKS]
    assert all(o in ("released", "cancelled") for o in outcomes), outcomes
    assert_clean(stats)


# ---- defect 5: topology digests are checked at runtime ---------------------------------


def test_rounds_carry_and_check_the_topology_digest(ray_cluster) -> None:
    """Every decision of a deployment's coordinator carries its instance's
    digest, and a rank refuses a proposal carrying another topology's digest
    (it used to be built with `topology_digest=None`: the check never ran)."""
    async def scenario():
        dep = await launch(ctx_tp=1, gen_tp=1)
        try:
            done = await dep.handoff("d", TOKENS, timeout=TIMEOUT)
            # A lone handoff is answered by the GEN rank; its coordinator
            # decides it from the rank's report (bounded: L1).
            deadline = time.monotonic() + TIMEOUT
            while not (log := await dep.coordinator(Role.GEN).decision_log.remote()):
                assert time.monotonic() < deadline, "the GEN coordinator never decided the handoff"
                await asyncio.sleep(0.01)
            coord = await dep.coordinator(Role.GEN).stats.remote()
            gen = (await dep.ranks(Role.GEN))[0]
            foreign = RoundProposal(round_no=coord["next_round"], topology_digest=topology_digest(dep.ctx_spec))
            with pytest.raises(Exception) as refused:
                await gen.round_vote.remote(foreign, coord["epochs"][0])
            again = await dep.handoff("d2", TOKENS, timeout=TIMEOUT)
            return topology_digest(dep.gen_spec), done, log, refused.value, again, await settled_stats(dep)
        finally:
            await dep.shutdown()

    want, done, log, refused, again, stats = run(scenario())
    assert done.outcome == "completed"
    assert log and all(d.topology_digest == want for d in log)
    assert isinstance(refused, StaleError) or "StaleError" in repr(refused), refused
    assert again.outcome == "completed", again  # the refusal changed nothing
    assert_clean(stats)


# ---- defect 12: a refused OPEN never cancels a live request ---------------------------


@pytest.mark.parametrize("forgery", ["stale ctx epoch", "another instance"])
def test_refused_open_does_not_cancel_the_live_request(ray_cluster, forgery: str) -> None:
    """Before READY, an OPEN naming the live request but a stale CTX epoch (or
    another instance's CTX) reaches the CTX rank. It is refused, silently: the
    REJECT it used to get named the CTX's real endpoint, matched the GEN's live
    session exactly, and cancelled the request (S3)."""

    async def scenario():
        dep = await launch(ctx_tp=1, gen_tp=1)
        try:
            parent = key("live")
            gen = (await dep.ranks(Role.GEN))[0]
            ctx = (await dep.ranks(Role.CTX))[0]
            await hold_frames(gen, "live", Role.CTX, 0)  # the real OPEN waits
            assert await admit_both(dep, parent) == [True, True]
            deadline = time.monotonic() + TIMEOUT
            while not await held_frames(gen, "live", Role.CTX, 0):
                assert time.monotonic() < deadline, "the GEN rank never opened"
                await asyncio.sleep(0.01)
            real: Open = (await inside(gen, lambda self: [self.side.session_open(t) for t in self.side.edges(parent)]))[0]
            ctx_ep = real.ticket.ctx
            if forgery == "stale ctx epoch":
                fake_ctx = msgspec.structs.replace(ctx_ep, epoch=ctx_ep.epoch + 5)
            else:
                fake_ctx = msgspec.structs.replace(
                    ctx_ep, ns=RankNamespace(instance_id="other-ctx", role=Role.CTX, rank=0)
                )
            forged = msgspec.structs.replace(real, ticket=msgspec.structs.replace(real.ticket, ctx=fake_ctx))
            accepted = await ctx.receive_frame.remote(encode_frame(forged))
            gen_state = await gen.phase.remote(parent)
            await release_frames(gen, "live", Role.CTX, 0)
            outcome = await gen.wait.remote(parent, TIMEOUT)
            verified = await gen.free.remote(parent)
            ctx_outcome = await ctx.wait.remote(parent, TIMEOUT)
            return accepted, gen_state, outcome, verified, ctx_outcome, await settled_stats(dep)
        finally:
            await dep.shutdown()

    accepted, gen_state, outcome, verified, ctx_outcome, stats = run(scenario())
    assert accepted is False
    assert gen_state["state"] == "installed" and gen_state["edges"] == ["open_proposed"], gen_state
    assert outcome == "completed" and verified == gen_bytes(TOKENS, 1)
    assert ctx_outcome == "released"
    ctx = next(s for s in stats["ranks"] if s["role"] == "ctx")
    assert ctx["counters"].get("refused_open_not_ours") == 1, ctx["counters"]
    assert_clean(stats)


# ---- defects 2 and 16: quarantine ends, with proof ---------------------------------------


def test_late_drain_reclaims_quarantine_in_place(ray_cluster) -> None:
    """UNKNOWN → quarantine → proof → reclaim, with no restart: a cancelled
    transfer's chunks outlive the drain deadline (both sides quarantine), then
    land and are polled to DONE. That is the CTX's proof (every WRITE it posted
    ended); its late TERMINAL(DRAINED) is the GEN's. Both pools come back whole
    and a new request reuses the blocks with every byte verified (S1/S2)."""

    async def scenario():
        dep = await launch(ctx_tp=1, gen_tp=1, fault_plan=FaultPlan(defer_s=2.0), transfer_timeout_s=0.5)
        try:
            doomed = await handoff_cancel_at(dep, "late", TOKENS, "mid_dma", timeout=TIMEOUT)
            stats = await wait_stats(dep, lambda s: all(r["quarantined"] == 0 for r in s["ranks"]), TIMEOUT)
            await inside((await dep.ranks(Role.CTX))[0], lambda self: setattr(self.transport, "plan", FaultPlan()))
            reuse = await dep.handoff("reuse", TOKENS, timeout=TIMEOUT)
            coords = [await dep.coordinator(r).stats.remote() for r in (Role.CTX, Role.GEN)]
            return doomed, stats, reuse, coords, await settled_stats(dep)
        finally:
            await dep.shutdown()

    doomed, reclaimed, reuse, coords, stats = run(scenario())
    assert doomed.outcome == "failed" and doomed.gen_outcomes == ("quarantined",), doomed
    for s in reclaimed["ranks"]:
        assert s["reclaimed"] == BLOCKS and s["quarantined"] == 0, s
        assert s["counters"].get("quarantined") == 1, s["counters"]
    assert all(c["restarts"] == 0 and c["reclaim_restarts"] == 0 for c in coords), coords
    assert reuse.outcome == "completed" and reuse.bytes_verified == gen_bytes(TOKENS, 1), reuse
    assert_clean(stats)


def test_a_quarantine_from_lost_frames_ends_by_asking_the_writer(ray_cluster) -> None:
    """The CTX rank's READY and TERMINAL for a request are lost (frames a
    live actor's carrier does not lose, dropped on purpose). The KV landed,
    but the GEN rank never hears so: its wait runs out, its edge goes UNKNOWN
    and its blocks are quarantined. It asks the writer again (its OPEN
    re-sent); the CTX's answer (its TERMINAL again, or a REJECT once it
    released the request) proves the edge, and the blocks come back in
    place: no restart, no admission stop, and a new request reuses them
    with every byte verified (S1/S2)."""

    async def scenario():
        dep = await launch(ctx_tp=1, gen_tp=1, transfer_timeout_s=1.0)
        try:
            ctx = (await dep.ranks(Role.CTX))[0]
            await hold_frames(ctx, "lost", Role.GEN, 0)
            pending = asyncio.ensure_future(dep.handoff("lost", TOKENS, timeout=TIMEOUT))
            deadline = time.monotonic() + TIMEOUT
            while await held_frames(ctx, "lost", Role.GEN, 0) < 2:  # READY, TERMINAL
                assert time.monotonic() < deadline and not pending.done(), "the CTX rank never finished"
                await asyncio.sleep(0.01)
            dropped = await release_frames(ctx, "lost", Role.GEN, 0, drop=True)
            lost = await pending
            stats = await wait_stats(dep, lambda s: all(r["quarantined"] == 0 for r in s["ranks"]), 60.0)
            coords = [await dep.coordinator(r).stats.remote() for r in (Role.CTX, Role.GEN)]
            reuse = await dep.handoff("reuse", TOKENS, timeout=TIMEOUT)
            return dropped, lost, stats, coords, reuse, await settled_stats(dep)
        finally:
            await dep.shutdown()

    dropped, lost, reclaimed, coords, reuse, stats = run(scenario())
    assert dropped == 2
    assert lost.outcome == "failed" and lost.gen_outcomes == ("quarantined",), lost
    gen = next(s for s in reclaimed["ranks"] if s["role"] == "gen")
    assert gen["quarantined"] == 0 and gen["reclaimed"] == BLOCKS, gen
    assert gen["counters"].get("quarantined") == 1 and not gen["admission_stopped"], gen["counters"]
    assert all(c["restarts"] == 0 and c["reclaim_restarts"] == 0 for c in coords), coords
    assert reuse.outcome == "completed" and reuse.bytes_verified == gen_bytes(TOKENS, 1), reuse
    assert_clean(stats)


def test_quarantine_past_the_limit_stops_admission_and_restarts(ray_cluster) -> None:
    """Chunks that never end (no proof will ever come): each stuck request
    quarantines its blocks on both sides. Past half the pool the CTX rank stops
    admitting, and, holding nothing else, asks its coordinator for a restart.
    The new incarnation has a fresh pool; the directory confirms the old one
    dead, which is the GEN's proof: it reclaims too. Full capacity again."""

    async def scenario():
        dep = await launch(ctx_tp=1, gen_tp=1, fault_plan=FaultPlan(hold=True), transfer_timeout_s=0.5)
        try:
            first_epoch = (await dep.coordinator(Role.CTX).epochs.remote())[0]
            stuck = [await handoff_cancel_at(dep, f"stuck-{i}", TOKENS, "mid_dma", timeout=TIMEOUT) for i in range(2)]

            def restarted(s: dict) -> bool:
                ctx = next(r for r in s["ranks"] if r["role"] == "ctx")
                return ctx.get("epoch", first_epoch) != first_epoch and all(r["quarantined"] == 0 for r in s["ranks"])

            back = await wait_stats(dep, restarted, 60.0)
            coord = await dep.coordinator(Role.CTX).stats.remote()
            await inside((await dep.ranks(Role.CTX))[0], lambda self: setattr(self.transport, "plan", FaultPlan()))
            fresh = await dep.handoff("fresh", TOKENS, timeout=TIMEOUT)
            return stuck, back, coord, fresh, await settled_stats(dep)
        finally:
            await dep.shutdown()

    stuck, back, coord, fresh, stats = run(scenario())
    assert [r.outcome for r in stuck] == ["failed", "failed"], stuck
    assert coord["reclaim_restarts"] >= 1 and coord["restarts"] == 0, coord
    assert coord["blocks_reclaimed_by_restart"] == 2 * BLOCKS, coord
    for s in back["ranks"]:
        assert s["quarantined"] == 0 and s["free"] == POOL and not s["admission_stopped"], s
    assert fresh.outcome == "completed" and fresh.bytes_verified == gen_bytes(TOKENS, 1), fresh
    assert_clean(stats)


# ---- defect 11 (rank side): decode-ready KV nobody consumes ends -----------------------


def test_decode_ready_kv_nobody_frees_is_returned_at_the_consumer_deadline(ray_cluster) -> None:
    """A client that never frees decode-ready KV (it died, or abandoned the
    call) used to hold the GEN blocks forever. Past the consumer deadline the
    rank returns them; a late free() is a no-op that reports no bytes."""

    async def scenario():
        dep = await launch(ctx_tp=1, gen_tp=1)
        try:
            gen = (await dep.ranks(Role.GEN))[0]
            await inside(gen, lambda self: setattr(self.side, "consume_timeout", 0.5))
            parent = key("never-freed")
            assert await admit_both(dep, parent) == [True, True]
            outcome = await gen.wait.remote(parent, TIMEOUT)
            held = await dep.stats()
            stats = await settled_stats(dep, TIMEOUT)
            late = await gen.free.remote(parent)
            return outcome, held, stats, late
        finally:
            await dep.shutdown()

    outcome, held, stats, late = run(scenario())
    assert outcome == "completed"
    assert next(s for s in held["ranks"] if s["role"] == "gen")["leased"] == BLOCKS  # decode-ready: held
    assert late == 0
    assert_clean(stats)


# ---- S2: the verification itself can fail -------------------------------------------------


def test_foreign_bytes_are_caught_and_never_reported_completed(ray_cluster) -> None:
    """The S2 check is live: one byte of the CTX's prefilled KV is changed before
    the DMA, the GEN rank's verification flags it (a violation naming the
    request), the request fails instead of completing, and nothing leaks."""

    async def scenario():
        dep = await launch(ctx_tp=1, gen_tp=1)
        try:
            parent = key("tampered")
            ctx = (await dep.ranks(Role.CTX))[0]

            def tamper(self: Any) -> None:
                block = self.pool.lease_of(parent)[0].block
                view = self.buffer.block_view(block)
                view[0] = view[0] ^ 0xFF  # flip every bit of one byte

            # Prefilled at the CTX admission; changed before GEN admits and opens.
            assert await admit_both(dep, parent, between=lambda: inside(ctx, tamper)) == [True, True]
            gen = (await dep.ranks(Role.GEN))[0]
            outcome = await gen.wait.remote(parent, TIMEOUT)
            during = await dep.stats()
            await asyncio.gather(*(c.cancel.remote(parent) for c in (dep.coordinator(Role.CTX), dep.coordinator(Role.GEN))))
            return outcome, during, await settled_stats(dep, TIMEOUT)
        finally:
            await dep.shutdown()

    outcome, during, stats = run(scenario())
    assert outcome == "failed", outcome
    gen = next(s for s in during["ranks"] if s["role"] == "gen")
    assert any("S2" in v and "tampered" in v for v in gen["violations"]), gen["violations"]
    for s in stats["ranks"]:
        assert s["leased"] == 0 and s["free"] + s["quarantined"] == s["pool"], s


# ---- rank decision points the mutation check found untested ---------------------------------


def test_open_refused_by_the_ctx_ends_the_gen_side_at_once(ray_cluster) -> None:
    """The CTX's lease expired (the round released it) before the GEN's OPEN
    came: the CTX refuses the OPEN with a REJECT for the exact session, which
    is NOT_STARTED evidence, so the GEN request ends and its blocks return
    right away, not after a transfer timeout (60 s here) and a quarantine."""

    async def scenario():
        dep = await launch(ctx_tp=1, gen_tp=1, transfer_timeout_s=60.0)
        try:
            ctx = (await dep.ranks(Role.CTX))[0]
            gen = (await dep.ranks(Role.GEN))[0]
            await inside(ctx, lambda self: setattr(self, "config", msgspec.structs.replace(self.config, lease_timeout_s=0.2)))
            parent = key("late-open")
            await defer_opens(gen, "late-open")  # a GEN slow to open
            assert await admit_both(dep, parent) == [True, True]
            ctx_outcome = await ctx.wait.remote(parent, TIMEOUT)
            assert await run_deferred_opens(gen, "late-open") == 1
            gen_outcome = await gen.wait.remote(parent, TIMEOUT)
            return ctx_outcome, gen_outcome, await settled_stats(dep, TIMEOUT)
        finally:
            await dep.shutdown()

    ctx_outcome, gen_outcome, stats = run(scenario())
    assert ctx_outcome in ("cancelled", "released"), ctx_outcome
    assert gen_outcome in ("cancelled", "released"), gen_outcome  # not "timeout", not quarantined
    ctx = next(s for s in stats["ranks"] if s["role"] == "ctx")
    assert sum(n for k, n in ctx["counters"].items() if k.startswith("refused_")) == 1, ctx["counters"]
    assert_clean(stats)


def test_ctx_is_not_prepared_until_every_edge_of_its_parent_is(ray_cluster) -> None:
    """CTX tp=1 -> GEN tp=2: the CTX rank has two edges per request. With one
    GEN rank's OPEN held back, a round (forced now) must not decide the
    parent: nothing is published or posted on the half-prepared parent. Once
    the second OPEN arrives the handoff completes."""

    async def scenario():
        dep = await launch(ctx_tp=1, gen_tp=2)
        try:
            ctx = (await dep.ranks(Role.CTX))[0]
            gens = await dep.ranks(Role.GEN)
            parent = key("half")
            await hold_frames(gens[1], "half", Role.CTX, 0)
            assert await admit_both(dep, parent) == [True, True]
            deadline = time.monotonic() + TIMEOUT
            while (await ctx.phase.remote(parent))["edges"] != ["prepared"]:
                assert time.monotonic() < deadline, "the first OPEN never arrived"
                await asyncio.sleep(0.01)
            decision = await dep.coordinator(Role.CTX).run_round.remote()
            half = await ctx.phase.remote(parent)
            await release_frames(gens[1], "half", Role.CTX, 0)
            outcomes = await asyncio.gather(*(g.wait.remote(parent, TIMEOUT) for g in gens))
            verified = sum(await asyncio.gather(*(g.free.remote(parent) for g in gens)))
            return decision, half, outcomes, verified, await settled_stats(dep, TIMEOUT)
        finally:
            await dep.shutdown()

    decision, half, outcomes, verified, stats = run(scenario())
    assert decision.decided == (), decision  # the half-prepared parent is not decided
    assert half["state"] == "resident" and half["posted"] == 0, half
    assert outcomes == ["completed", "completed"], outcomes
    assert verified == gen_bytes(TOKENS, 2)
    assert_clean(stats)
