"""A fleet of engine instances (actors/engine_fleet.py) on real engine workers.

The workers are test_engine's: Ray actors with their own KV tensors (paged
or split), hosting an endpoint, writing and checking their own bytes. The
test plays each instance's block manager and reuses a block only after
kvhandoff gave it back. What would fail if the engine fleet broke: a ticket
claimed by a GEN instance of another TP than the CTX parent was bound to
(the bytes would not match, or the OPENs would be refused), a ticket of a
removed incarnation accepted, a re-attached worker not serving.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import ray

from kvhandoff.actors import InvalidRequest
from kvhandoff.actors.engine import PublishRefused, StaleTicket
from kvhandoff.actors.engine_fleet import EngineFleet, FleetInstance
from kvhandoff.actors.fleet import InstanceUnavailable, UnknownInstance
from kvhandoff.cli.harness import held_decisions, hold_decisions, release_decisions
from kvhandoff.protocol import Role

from .test_engine import BLOCKS, LAYOUT, Worker

pytestmark = pytest.mark.ray


class Blocks:
    """One block manager per instance."""

    def __init__(self) -> None:
        self.free: dict[str, list[int]] = {}

    def take(self, instance: str, n: int) -> list[int]:
        free = self.free.setdefault(instance, list(range(BLOCKS)))
        got, self.free[instance] = free[:n], free[n:]
        assert len(got) == n
        return got

    def give(self, instance: str, blocks: list[int]) -> None:
        self.free[instance] += blocks


async def _instance(fleet: EngineFleet, role: str, tp: int, kind: str, name: str | None = None) -> tuple[str, list[Any]]:
    plan = await fleet.plan(role, tp, memory_kind=kind, name=name)
    workers = [Worker.remote(plan, role, r) for r in range(tp)]
    await fleet.attach(plan, workers)
    return plan.instance, workers


async def _handoff(fleet: EngineFleet, mgr: Blocks, workers: dict[str, list[Any]], rid: str, seed: int, tokens: int, ctx: str, gen: str) -> str:
    n = -(-tokens // LAYOUT.tokens_per_block)
    ctx_blocks = mgr.take(ctx, n)
    await asyncio.gather(*(w.prefill.remote(seed, ctx_blocks) for w in workers[ctx]))
    ticket = await fleet.publish(rid, tokens, ctx_blocks, ctx=ctx)
    gen_blocks = mgr.take(gen, n)
    result = await fleet.receive(ticket.encode(), gen_blocks, gen=gen, timeout=60)
    if result.outcome == "completed":
        assert all(await asyncio.gather(*(w.matches.remote(seed, gen_blocks) for w in workers[gen])))
    assert result.blocks_returned
    mgr.give(gen, gen_blocks)
    assert await fleet.returned(ticket, Role.CTX, timeout=60)
    mgr.give(ctx, ctx_blocks)
    return result.outcome


async def _assert_whole(fleet: EngineFleet) -> None:
    """Every rank's pool is whole: nothing leased or quarantined (L1, S4)."""
    for s in (await fleet.stats())["ranks"]:
        assert s["violations"] == [] and s["leased"] == 0 and s["free"] == s["pool"], s


async def _stop(fleet: EngineFleet, workers: dict[str, list[Any]]) -> None:
    """Shut the fleet down, then the engine's workers (the engine's to stop)."""
    await fleet.shutdown()
    for ws in workers.values():
        for w in ws:
            ray.kill(w)


async def test_engine_instances_join_pair_any_to_any_drain_and_reattach(ray_cluster: Any) -> None:
    fleet = await EngineFleet.create(layout=LAYOUT, chunk_bytes=1024, round_timeout_s=5.0)
    mgr = Blocks()
    workers: dict[str, list[Any]] = {}
    try:
        ctx0, workers_ctx0 = await _instance(fleet, "ctx", 2, "paged")
        gen0, workers_gen0 = await _instance(fleet, "gen", 1, "split")
        workers.update({ctx0: workers_ctx0, gen0: workers_gen0})
        assert await _handoff(fleet, mgr, workers, "a", 1, 9, ctx0, gen0) == "completed"
        # Two instances join: a GEN of another TP and memory kind, a CTX of another TP.
        gen1, workers[gen1] = await _instance(fleet, "gen", 2, "paged")
        ctx1, workers[ctx1] = await _instance(fleet, "ctx", 1, "split")
        for i, (c, g) in enumerate([(ctx0, gen1), (ctx1, gen0), (ctx1, gen1), (ctx0, gen0)]):
            assert await _handoff(fleet, mgr, workers, f"pair-{i}", 10 + i, 5 + 4 * i, c, g) == "completed"
        # gen0 (one rank) never claims a ticket of ctx0 (two ranks) alone: two
        # GEN instances could each bind a different CTX rank first.
        direct = (await fleet._by_id[gen0].coord.stats.remote())["peers_admitting_at_open"]
        assert ctx0 not in direct, direct
        # A ticket is claimed once: a second GEN instance is refused, nothing held.
        blocks = mgr.take(ctx0, 3)
        await asyncio.gather(*(w.prefill.remote(40, blocks) for w in workers[ctx0]))
        ticket = await fleet.publish("once", 9, blocks, ctx=ctx0)
        g0, g1 = mgr.take(gen0, 3), mgr.take(gen1, 3)
        first, second = await fleet.receive(ticket, g0, gen=gen0), await fleet.receive(ticket, g1, gen=gen1)
        assert (first.outcome, second.outcome) == ("completed", "rejected") and second.blocks_returned
        mgr.give(gen0, g0), mgr.give(gen1, g1)
        assert await fleet.returned(ticket, Role.CTX)
        mgr.give(ctx0, blocks)
        # Bad input: typed, before any call.
        with pytest.raises(UnknownInstance):
            await fleet.publish("x", 4, [0], ctx="no-such-instance")
        with pytest.raises(InstanceUnavailable):
            await fleet.publish("x", 4, [0], ctx=gen0)
        # ctx1 drains and leaves: its tickets are stale, the peers forgot it.
        blocks = mgr.take(ctx1, 2)
        await asyncio.gather(*(w.prefill.remote(50, blocks) for w in workers[ctx1]))
        late = await fleet.publish("late", 5, blocks, ctx=ctx1)
        late_gen = mgr.take(gen1, 2)
        done = await fleet.receive(late, late_gen, gen=gen1)
        assert done.outcome == "completed" and done.blocks_returned
        assert all(await asyncio.gather(*(w.matches.remote(50, late_gen) for w in workers[gen1])))
        mgr.give(gen1, late_gen)
        assert await fleet.returned(late, Role.CTX)
        mgr.give(ctx1, blocks)
        assert await fleet.drain(ctx1, 60.0)
        with pytest.raises(StaleTicket):
            await fleet.receive(late.encode(), [0, 1], gen=gen0)
        with pytest.raises(InstanceUnavailable):
            await fleet.publish("y", 4, [0], ctx=ctx1)
        for w in workers[gen0] + workers[gen1]:
            pairs = await w.pairs.remote()
            assert ctx1 not in pairs and set(pairs) == {ctx0}, pairs
        # A GEN worker of gen1 is restarted by the engine and re-attached.
        fresh = Worker.remote(fleet._by_id[gen1].plan, "gen", 1)
        await fleet.reattach(gen1, 1, fresh)
        workers[gen1][1] = fresh
        assert await _handoff(fleet, mgr, workers, "after-reattach", 60, 13, ctx0, gen1) == "completed"
        stats = await fleet.stats()
        for s in stats["ranks"]:
            assert s["violations"] == [] and s["leased"] == 0 and s["quarantined"] == 0, s
            assert s["free"] == s["pool"] == BLOCKS, s
        # A block kvhandoff still holds for another ticket refuses a publish, typed.
        held = mgr.take(ctx0, 1)
        h1 = await fleet.publish("h1", 4, held, ctx=ctx0)
        with pytest.raises(PublishRefused):
            await fleet.publish("h2", 4, held, ctx=ctx0)
        await fleet.cancel(h1)
        # `cancel` returns once the CTX workers got the blocks back.
        assert await fleet.returned(h1, Role.CTX, timeout=0.0)
    finally:
        await _stop(fleet, workers)


async def test_fleet_instance_handles_publish_receive_and_cancel_from_each_side(ray_cluster: Any) -> None:
    """`FleetInstance`: each instance's own view of the fleet, as an engine's
    front end beside its workers uses it (the vLLM connector does). A CTX
    handle publishes into its instance, a GEN handle receives from any CTX
    instance of the fleet (the bytes match), a cancel from the GEN side gives
    the CTX blocks back, and misuse is typed: the wrong role, a ticket of
    another deployment."""
    # A lease far beyond every wait here: a block back means a cancel or a completion gave it back.
    fleet = await EngineFleet.create(layout=LAYOUT, chunk_bytes=1024, round_timeout_s=5.0, lease_timeout_s=600.0)
    mgr = Blocks()
    workers: dict[str, list[Any]] = {}
    try:
        ctx0, workers[ctx0] = await _instance(fleet, "ctx", 1, "paged")
        ctx1, workers[ctx1] = await _instance(fleet, "ctx", 2, "paged")
        gen0, workers[gen0] = await _instance(fleet, "gen", 1, "split")
        handle = {i: await FleetInstance.connect(fleet._by_id[i].plan) for i in (ctx0, ctx1, gen0)}
        for k, ctx in enumerate((ctx0, ctx1)):
            blocks = mgr.take(ctx, 2)
            await asyncio.gather(*(w.prefill.remote(70 + k, blocks) for w in workers[ctx]))
            ticket = await handle[ctx].publish(f"h{k}", 8, blocks)
            assert ticket.ctx_instance == ctx
            gen_blocks = mgr.take(gen0, 2)
            result = await handle[gen0].receive(ticket.encode(), gen_blocks, timeout=60)
            assert result.outcome == "completed" and result.blocks_returned, result
            assert all(await asyncio.gather(*(w.matches.remote(70 + k, gen_blocks) for w in workers[gen0])))
            assert await handle[gen0].returned(ticket, Role.GEN)
            mgr.give(gen0, gen_blocks)
            assert await handle[ctx].returned(ticket, Role.CTX, timeout=60)
            mgr.give(ctx, blocks)
        # Cancelled from the decode side before anyone claimed it: `cancel`
        # returns once the CTX instance (another one's, two workers) got the
        # blocks back, so a receive right after it is refused, nothing held.
        blocks = mgr.take(ctx1, 2)
        await asyncio.gather(*(w.prefill.remote(80, blocks) for w in workers[ctx1]))
        ticket = await handle[ctx1].publish("dropped", 8, blocks)
        # Its coordinator's round calls to one of its workers are held: the
        # cancel is decided, yet `cancel` has not returned while that worker
        # has not applied it.
        ctx1_coord = fleet._by_id[ctx1].coord
        await hold_decisions(ctx1_coord, 1)
        cancelling = asyncio.ensure_future(handle[gen0].cancel(ticket.encode()))
        deadline = asyncio.get_running_loop().time() + 60  # a bound, not a guess
        while not await held_decisions(ctx1_coord, 1):
            assert not cancelling.done() and asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        # A bound on a negative check, well under the round bound (5 s) the
        # hold must stay below: a cancel that did not wait returns at once.
        done, _ = await asyncio.wait({cancelling}, timeout=0.5)
        assert not done, "cancel returned before the CTX workers applied it"
        await release_decisions(ctx1_coord, 1)
        await cancelling
        assert await handle[ctx1].returned(ticket, Role.CTX, timeout=0.0)
        gen_blocks = mgr.take(gen0, 2)
        late = await handle[gen0].receive(ticket.encode(), gen_blocks, timeout=60)
        assert late.outcome != "completed" and late.blocks_returned, late
        mgr.give(gen0, gen_blocks)
        mgr.give(ctx1, blocks)
        # Misuse, typed, nothing sent.
        with pytest.raises(InvalidRequest):
            await handle[ctx0].receive(ticket, [0, 1])
        with pytest.raises(InvalidRequest):
            await handle[gen0].publish("x", 4, [0])
        foreign = msgspec.structs.replace(ticket, deployment="another-fleet")
        with pytest.raises(StaleTicket):
            await handle[gen0].receive(foreign, [0, 1])
        await _assert_whole(fleet)
    finally:
        await _stop(fleet, workers)


async def test_a_cancel_is_one_call_to_the_tickets_ctx_instance(ray_cluster: Any) -> None:
    """A ticket received into one of two GEN instances (its rank admits it
    alone: both instances have one rank), cancelled while its transfer is in
    flight (the CTX worker's frames to the GEN held): one call, to the
    ticket's CTX instance, which forwards it to the GEN instance that
    claimed the ticket; the other GEN instance is never asked.
    The receive ends (cancelled, or completed if the bytes won) with every
    block back on both sides. A ticket nobody claimed ends by the same one
    call, long before its lease would end it."""
    from kvhandoff.cli.harness import held_frames, hold_frames, release_frames

    fleet = await EngineFleet.create(layout=LAYOUT, chunk_bytes=1024, round_timeout_s=5.0, lease_timeout_s=600.0)
    mgr = Blocks()
    workers: dict[str, list[Any]] = {}

    async def asked(instance: str) -> int:
        return int((await fleet._by_id[instance].coord.stats.remote())["calls"].get("cancels_asked", 0))

    try:
        ctx0, workers[ctx0] = await _instance(fleet, "ctx", 1, "paged")
        gen0, workers[gen0] = await _instance(fleet, "gen", 1, "paged")
        gen1, workers[gen1] = await _instance(fleet, "gen", 1, "paged")
        ctx_worker = workers[ctx0][0]
        # gen1 learns that ctx0 (one rank) binds at the first OPEN: from here
        # on its rank admits alone, and its claim goes beside the OPEN.
        assert await _handoff(fleet, mgr, workers, "warm", 89, 8, ctx0, gen1) == "completed"
        blocks = mgr.take(ctx0, 2)
        await asyncio.gather(*(w.prefill.remote(90, blocks) for w in workers[ctx0]))
        ticket = await fleet.publish("one-call", 8, blocks, ctx=ctx0)
        await hold_frames(ctx_worker, "one-call", Role.GEN, 0)
        gen_blocks = mgr.take(gen1, 2)
        claims = int((await fleet._by_id[ctx0].coord.stats.remote())["calls"]["claims"])
        receiving = asyncio.ensure_future(fleet.receive(ticket, gen_blocks, gen=gen1, timeout=60))
        deadline = asyncio.get_running_loop().time() + 60  # a bound (L1), not a guess
        while not await held_frames(ctx_worker, "one-call", Role.GEN, 0):  # opened, bound, decided
            assert asyncio.get_running_loop().time() < deadline, "the transfer never started"
            await asyncio.sleep(0.01)
        while int((await fleet._by_id[ctx0].coord.stats.remote())["calls"]["claims"]) == claims:
            assert asyncio.get_running_loop().time() < deadline, "gen1's claim never reached ctx0's coordinator"
            await asyncio.sleep(0.01)
        gen1_calls = (await fleet._by_id[gen1].coord.stats.remote())["calls"]
        assert gen1_calls["rank_admit_alone"] >= 1 and gen1_calls["claims_alone"] >= 1, gen1_calls
        await fleet.cancel(ticket)
        while not await asked(gen1):  # the forward is the CTX coordinator's, one way
            assert asyncio.get_running_loop().time() < deadline, "the claiming GEN instance was never told"
            await asyncio.sleep(0.01)
        await release_frames(ctx_worker, "one-call", Role.GEN, 0)
        result = await receiving
        assert result.outcome in ("cancelled", "completed") and result.blocks_returned, result
        assert await fleet.returned(ticket, Role.CTX, timeout=60)
        mgr.give(gen1, gen_blocks)
        mgr.give(ctx0, blocks)
        # Nobody claimed this one: the one call ends it on the CTX instance.
        blocks = mgr.take(ctx0, 2)
        orphan = await fleet.publish("unclaimed", 8, blocks, ctx=ctx0)
        await fleet.cancel(orphan)
        assert await fleet.returned(orphan, Role.CTX, timeout=60)  # a 600 s lease: the cancel did it
        mgr.give(ctx0, blocks)
        assert await asked(gen0) == 0  # never asked, for either ticket
        await _assert_whole(fleet)
    finally:
        await _stop(fleet, workers)
