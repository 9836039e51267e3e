"""The engine-facing API on real endpoints hosted by an engine's own actors.

The workers here are what an engine's are: Ray actors that allocate their own
KV tensors (vLLM-style per-layer paged tensors, or K and V apart), host a rank
endpoint over them (`EndpointHost`), and write a request's KV themselves. The
test plays the engine's block managers: it chooses the block ids on both
sides, and it reuses a block only after kvhandoff gave it back. Every check
reads the real bytes the real NIXL agents moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import ray
import torch

from kvhandoff.actors import (
    Deployment,  # noqa: F401  (the package imports cleanly)
    InvalidConfig,
    InvalidRequest,
    RoundTimeout,
)
from kvhandoff.actors.endpoint import EnginePlan, ctx_endpoint, endpoint_loop, gen_endpoint
from kvhandoff.actors.engine import EngineDeployment, EngineResult, PublishRefused, StaleTicket
from kvhandoff.actors.rank import EndpointHost, endpoint_actor
from kvhandoff.cli.harness import (
    held_decisions,
    held_frames,
    hold_decisions,
    hold_frames,
    release_decisions,
    release_frames,
)
from kvhandoff.protocol import HandoffTicket, Role, TicketError
from kvhandoff.topology import KVLayout, heads_per_rank

pytestmark = pytest.mark.ray

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", tokens_per_block=4)
BLOCKS = 24


def _values(seed: int, layer: int, kv: int, heads: range, tokens: int, dim: int) -> torch.Tensor:
    """The request's KV for (layer, kv): [tokens, len(heads), dim], small
    integers (exact in fp16), different for every request seed."""
    t = torch.arange(tokens).view(-1, 1, 1)
    h = torch.tensor(list(heads)).view(1, -1, 1)
    d = torch.arange(dim).view(1, 1, -1)
    return ((seed * 7 + layer * 5 + kv * 3 + h * 11 + t * 13 + d) % 251).to(torch.float16)


def _alloc(kind: str, heads: int) -> list[torch.Tensor]:
    lay = LAYOUT
    if kind == "paged":
        shape = (BLOCKS, 2, lay.tokens_per_block, heads, lay.head_dim)
        return [torch.zeros(shape, dtype=torch.float16) for _ in range(lay.num_layers)]
    assert kind == "split"
    shape = (BLOCKS, lay.tokens_per_block, heads, lay.head_dim)
    return [torch.zeros(shape, dtype=torch.float16) for _ in range(2 * lay.num_layers)]


def _view(kind: str, tensors: list[torch.Tensor], layer: int, kv: int) -> torch.Tensor:
    """[blocks, tokens, heads, dim] of (layer, kv)."""
    return tensors[layer][:, kv] if kind == "paged" else tensors[2 * layer + kv]


@endpoint_actor(num_cpus=0)
class Worker(EndpointHost):
    """An engine worker: its own tensors, its own writes, a hosted endpoint."""

    def __init__(self, plan: EnginePlan, role: str, rank: int) -> None:
        self.role = Role(role)
        self.kind = plan.ctx_memory if self.role is Role.CTX else plan.gen_memory
        self.heads = heads_per_rank(plan.layout, plan.spec(self.role).tp)
        self.first_head = rank * self.heads
        self.kv = _alloc(self.kind, self.heads)
        make = ctx_endpoint if self.role is Role.CTX else gen_endpoint
        self.kvhandoff = make(plan, rank, self.kv)
        self.plan = plan
        self.front_end: EngineDeployment | None = None

    async def receive_here(
        self, ticket: str, blocks: list[int], on_its_loop: bool = False
    ) -> tuple[str, bool, dict[str, int]]:
        """The engine's front end in this worker's process (as vLLM's
        scheduler is beside its decode worker): a receive through a
        deployment handle connected here, on the actor's default loop, not
        the endpoint's, or (``on_its_loop``) started on the endpoint's own
        loop (`endpoint_loop`) by `start_receive`, as the vLLM connector
        does. Returns its outcome, whether the blocks came back, and the
        handle's call counts, with "ended_at_once": 1 where `start_receive`
        returned the result itself (no turn of the loop), and "leased_then":
        the blocks the rank still leased when it did (0: they were back, as
        the result said)."""
        if self.front_end is None:
            self.front_end = await EngineDeployment.connect(self.plan)
        front_end = self.front_end
        at_once, leased_then = 0, -1
        if on_its_loop:
            loop = endpoint_loop(self)
            assert loop is not None and loop is not asyncio.get_running_loop()

            async def start() -> EngineResult:
                nonlocal at_once, leased_then
                started = front_end.start_receive(ticket, blocks, timeout=60)
                at_once = int(isinstance(started, EngineResult))
                leased_then = self.kvhandoff.pool.counts().leased
                return started if isinstance(started, EngineResult) else await started

            result = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(start(), loop))
        else:
            result = await front_end.receive(ticket, blocks, timeout=60)
        return result.outcome, result.blocks_returned, dict(front_end.calls) | {"ended_at_once": at_once, "leased_then": leased_then}

    def _shard(self, seed: int, blocks: list[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """For each (layer, kv): request `seed`'s KV of our head shard over
        `blocks` ([tokens, heads, dim]), and the view of our tensors it lives in."""
        tokens = len(blocks) * LAYOUT.tokens_per_block
        heads = range(self.first_head, self.first_head + self.heads)
        for layer in range(LAYOUT.num_layers):
            for kv in range(2):
                yield _values(seed, layer, kv, heads, tokens, LAYOUT.head_dim), _view(self.kind, self.kv, layer, kv)

    async def prefill(self, seed: int, blocks: list[int]) -> None:
        """Write the request's KV (our head shard) into `blocks`, whole blocks."""
        for values, view in self._shard(seed, blocks):
            view[blocks] = values.view(len(blocks), LAYOUT.tokens_per_block, self.heads, LAYOUT.head_dim)

    async def matches(self, seed: int, blocks: list[int]) -> bool:
        """Whether `blocks` hold exactly request `seed`'s KV (our head shard)."""
        for want, view in self._shard(seed, blocks):
            if not torch.equal(view[blocks].reshape(want.shape), want):
                return False
        return True

    async def busy(self, seconds: float) -> float:
        """The engine's own work on the actor's default loop, blocking it
        (a forward pass run inline). Returns when it ended (monotonic)."""
        time.sleep(seconds)
        return time.monotonic()

    async def scribble(self, blocks: list[int]) -> None:
        """The engine reuses `blocks` for something else."""
        for t in self.kv:
            t[blocks] = -1.0


class Engine:
    """Both instances' workers and the two block managers (free lists)."""

    def __init__(self, dep: EngineDeployment, ctx: list[Any], gen: list[Any]) -> None:
        self.dep, self.ctx, self.gen = dep, ctx, gen
        self.free = {Role.CTX: list(range(BLOCKS)), Role.GEN: list(range(BLOCKS))[::-1]}

    def take(self, role: Role, n: int) -> list[int]:
        got, self.free[role] = self.free[role][:n], self.free[role][n:]
        assert len(got) == n, "test engine ran out of blocks"
        return got

    def give(self, role: Role, blocks: list[int]) -> None:
        self.free[role] += blocks

    async def prefill_and_publish(self, request_id: str, seed: int, tokens: int) -> tuple[HandoffTicket, list[int]]:
        blocks = self.take(Role.CTX, -(-tokens // LAYOUT.tokens_per_block))
        await asyncio.gather(*(w.prefill.remote(seed, blocks) for w in self.ctx))
        return await self.dep.publish(request_id, tokens, blocks), blocks

    async def give_back(self, ticket: HandoffTicket, gen_blocks: list[int], ctx_blocks: list[int]) -> None:
        """A receive ended with its GEN blocks back: once kvhandoff released
        the CTX blocks too, both go back to their managers."""
        assert await self.dep.returned(ticket, Role.CTX, timeout=60)
        self.give(Role.GEN, gen_blocks)
        self.give(Role.CTX, ctx_blocks)

    async def close(self) -> None:
        """Shut the deployment down and kill the workers."""
        await self.dep.shutdown()
        for w in self.ctx + self.gen:
            ray.kill(w)

    async def check_clean(self) -> None:
        stats = await self.dep.stats()
        for s in stats["ranks"]:
            assert s["violations"] == [], s
            assert s["leased"] == 0 and s["quarantined"] == 0, s
            assert s["free"] == s["pool"] == BLOCKS, s
            assert s["tracking"] == 0, s
        assert sorted(self.free[Role.CTX]) == list(range(BLOCKS))
        assert sorted(self.free[Role.GEN]) == list(range(BLOCKS))


async def _engine(ctx_tp: int, gen_tp: int, ctx_memory: str, gen_memory: str, **kw: Any) -> Engine:
    dep = await EngineDeployment.create(
        ctx_tp=ctx_tp, gen_tp=gen_tp, layout=LAYOUT, ctx_memory=ctx_memory, gen_memory=gen_memory,
        chunk_bytes=1024, **kw,
    )
    ctx = [Worker.remote(dep.plan, "ctx", r) for r in range(ctx_tp)]
    gen = [Worker.remote(dep.plan, "gen", r) for r in range(gen_tp)]
    await dep.attach(ctx, gen)
    return Engine(dep, ctx, gen)


@pytest.fixture(scope="module")
async def engine(ray_cluster: Any) -> Any:
    eng = await _engine(2, 1, "paged", "split")
    yield eng
    await eng.close()


async def _handoff(eng: Engine, request_id: str, seed: int, tokens: int, *, cancel_after: float | None = None) -> str:
    """One request the way an engine runs it; returns the outcome. Checks
    the bytes of a completed one and gives every block back to its manager
    only after kvhandoff returned it."""
    ticket, ctx_blocks = await eng.prefill_and_publish(request_id, seed, tokens)
    gen_blocks = eng.take(Role.GEN, len(ctx_blocks))
    wire = ticket.encode()  # the front end's HTTP hop
    receiving = asyncio.ensure_future(eng.dep.receive(wire, gen_blocks, timeout=60))
    if cancel_after is not None:
        await asyncio.sleep(cancel_after)
        await eng.dep.cancel(wire)
    result = await receiving
    if result.outcome == "completed":
        assert all(await asyncio.gather(*(w.matches.remote(seed, gen_blocks) for w in eng.gen)))
    assert result.blocks_returned, result
    eng.give(Role.GEN, gen_blocks)
    assert await eng.dep.returned(ticket, Role.CTX, timeout=60)
    eng.give(Role.CTX, ctx_blocks)
    return result.outcome


async def test_publish_receive_moves_the_engines_own_bytes(engine: Engine) -> None:
    before = (await engine.dep.stats())["coordinators"]["gen"]["calls"]
    for i, tokens in enumerate((1, 4, 5, 17, 40)):
        assert await _handoff(engine, f"req-{i}", seed=100 + i, tokens=tokens) == "completed"
    await engine.check_clean()
    # A receive waits until its blocks are back, which they are when the GEN
    # ranks apply the completion: that apply never waits for a later round.
    calls = (await engine.dep.stats())["coordinators"]["gen"]["calls"]
    assert calls.get("applies_delayed", 0) == before.get("applies_delayed", 0), calls
    assert calls["answered_at_decision"] - before.get("answered_at_decision", 0) == 5, calls


async def test_a_ticket_is_claimed_once_and_retries_are_new_attempts(engine: Engine) -> None:
    ticket, ctx_blocks = await engine.prefill_and_publish("retry", seed=5, tokens=9)
    gen_blocks = engine.take(Role.GEN, 3)
    first = await engine.dep.receive(ticket.encode(), gen_blocks)
    assert first.outcome == "completed"
    # The same ticket again: the attempt ended, its claim is refused, nothing held.
    again = await engine.dep.receive(ticket, gen_blocks)
    assert again.outcome == "rejected" and again.blocks_returned
    # A retry of the request id publishes a new attempt: the old ticket is stale.
    assert await engine.dep.returned(ticket, Role.CTX)
    retry, blocks2 = await engine.prefill_and_publish("retry", seed=6, tokens=9)
    assert retry.parent != ticket.parent
    await engine.dep.cancel(retry)
    assert await engine.dep.returned(retry, Role.CTX)
    engine.give(Role.GEN, gen_blocks)
    engine.give(Role.CTX, ctx_blocks + blocks2)
    await engine.check_clean()


async def test_bad_tickets_and_blocks_are_refused_before_any_call(engine: Engine) -> None:
    ticket, ctx_blocks = await engine.prefill_and_publish("bad", seed=7, tokens=8)
    for wire in ("", "kvh1.%%%", "kvh1." + "A" * 5000, ticket.encode()[:-4], 42):
        with pytest.raises(TicketError):
            await engine.dep.receive(wire, [0, 1])  # type: ignore[arg-type]
    other = HandoffTicket(**{**{f: getattr(ticket, f) for f in ticket.__struct_fields__}, "deployment": "elsewhere"})
    with pytest.raises(StaleTicket):
        await engine.dep.receive(other, [0, 1])
    for blocks in ([0], [0, 0], [0, -1], [0, "1"], None):
        with pytest.raises(InvalidRequest):
            await engine.dep.receive(ticket, blocks)  # type: ignore[arg-type]
    # Publishing blocks kvhandoff still holds for "bad": refused, nothing held.
    with pytest.raises(PublishRefused):
        await engine.dep.publish("clash", 8, ctx_blocks)
    with pytest.raises(InvalidRequest):
        await engine.dep.publish("bad id!", 8, [0, 1])
    # A GEN block outside the pool: the GEN ranks refuse; the published KV is let go.
    result = await engine.dep.receive(ticket, [0, BLOCKS + 5])
    assert result.outcome == "rejected" and result.blocks_returned
    assert await engine.dep.returned(ticket, Role.CTX)
    engine.give(Role.CTX, ctx_blocks)
    await engine.check_clean()


async def test_a_published_ticket_nobody_claims_ends_by_its_lease(ray_cluster: Any) -> None:
    eng = await _engine(1, 1, "paged", "paged", lease_timeout_s=1.0)
    try:
        ticket, blocks = await eng.prefill_and_publish("orphan", seed=9, tokens=6)
        assert await eng.dep.returned(ticket, Role.CTX, timeout=60)  # the lease deadline ended it
        eng.give(Role.CTX, blocks)
        late = await eng.dep.receive(ticket, eng.take(Role.GEN, 2))
        assert late.outcome == "rejected" and late.blocks_returned
        eng.give(Role.GEN, list(range(BLOCKS))[::-1][:2])
        await eng.check_clean()
    finally:
        await eng.close()


async def test_a_cancel_is_one_call_that_ends_an_unclaimed_ticket(ray_cluster: Any) -> None:
    """`cancel(ticket)` is one client call, to the GEN coordinator, which
    cancels in both instances: a published ticket nobody claimed is let go
    on the CTX instance, long before its lease would end it. With the GEN
    coordinator gone, the client asks the CTX coordinator itself."""
    eng = await _engine(1, 1, "paged", "paged", lease_timeout_s=600.0)
    try:
        ticket, blocks = await eng.prefill_and_publish("one-call", seed=21, tokens=6)
        await eng.dep.cancel(ticket)
        assert eng.dep.calls["cancel"] == 1
        # Bounded: a failure waits 60 s, not the 600 s lease.
        assert await eng.dep.returned(ticket, Role.CTX, timeout=60)
        eng.give(Role.CTX, blocks)
        await eng.check_clean()
        orphan, blocks = await eng.prefill_and_publish("no-gen", seed=22, tokens=6)
        gen_coord = eng.dep._coords[Role.GEN]
        watching = gen_coord.watch.remote()  # answers only with the coordinator's death
        ray.kill(gen_coord, no_restart=True)
        with pytest.raises(ray.exceptions.RayActorError):
            await watching
        await eng.dep.cancel(orphan)
        assert await eng.dep.returned(orphan, Role.CTX, timeout=60)
    finally:
        await eng.close()


async def test_one_rank_instances_publish_at_the_ctx_rank(ray_cluster: Any) -> None:
    """CTX and GEN instances of one rank each: a publish is one call to the
    CTX rank (`publish_alone`), which leases exactly the engine's blocks
    with no admission round, and the CTX coordinator takes the parent in
    flight from the rank's report. Blocks still held are refused with
    nothing held. A cancel that reaches the CTX coordinator before that
    report (held here) is kept and applied once the report comes: the
    blocks come back well before the ticket's 600 s lease would return
    them. A draining CTX instance publishes nothing."""
    from kvhandoff.cli.harness import _hold_reports, _release_reports, on_endpoint_loop

    eng = await _engine(1, 1, "paged", "split", lease_timeout_s=600.0)
    try:
        ctx_coord = eng.dep._coords[Role.CTX]
        before = await ctx_coord.stats.remote()
        for i, tokens in enumerate((1, 6, 17)):
            assert await _handoff(eng, f"pub-{i}", seed=51 + i, tokens=tokens) == "completed"
        assert eng.dep.calls["publish_at_rank"] == 3, eng.dep.calls  # the driver: one Ray call each
        (ctx_stats,) = [s for s in (await eng.dep.stats())["ranks"] if s["role"] == "ctx"]
        assert ctx_stats["counters"]["published_alone"] == 3, ctx_stats["counters"]
        now = await ctx_coord.stats.remote()
        # No admission round: the coordinator decided none, it learned each
        # from the rank's report and decided its end.
        assert now["decided"].get("admitted", 0) == before["decided"].get("admitted", 0), now["decided"]
        assert now["calls"].get("reports_received", 0) > before["calls"].get("reports_received", 0), now["calls"]
        # Blocks the rank still holds are refused: nothing more is held.
        ticket, ctx_blocks = await eng.prefill_and_publish("held-blocks", seed=55, tokens=5)
        with pytest.raises(PublishRefused):
            await eng.dep.publish("same-blocks", 5, ctx_blocks)
        (ctx_stats,) = [s for s in (await eng.dep.stats())["ranks"] if s["role"] == "ctx"]
        assert ctx_stats["leased"] == len(ctx_blocks), ctx_stats
        assert ctx_stats["counters"]["published_alone_refused"] == 1, ctx_stats["counters"]
        await eng.dep.cancel(ticket)
        assert await eng.dep.returned(ticket, Role.CTX, timeout=60)
        eng.give(Role.CTX, ctx_blocks)
        # A cancel ahead of the rank's report: kept until the report comes.
        await eng.ctx[0].__ray_call__.remote(on_endpoint_loop, _hold_reports)
        early, ctx_blocks = await eng.prefill_and_publish("early", seed=56, tokens=5)
        await eng.dep.cancel(early)
        assert await eng.ctx[0].__ray_call__.remote(on_endpoint_loop, _release_reports) >= 1
        assert await eng.dep.returned(early, Role.CTX, timeout=60)  # the lease is 600 s
        assert (await ctx_coord.stats.remote())["calls"].get("cancels_before_report") == 1
        eng.give(Role.CTX, ctx_blocks)
        await eng.check_clean()
        # A draining CTX instance: its coordinator closes the rank's
        # admission, and a publish is refused with nothing held.
        assert await ctx_coord.drain.remote(60.0)
        blocks = eng.take(Role.CTX, 1)
        with pytest.raises(PublishRefused):
            await eng.dep.publish("draining", 3, blocks)
        eng.give(Role.CTX, blocks)
        (ctx_stats,) = [s for s in (await eng.dep.stats())["ranks"] if s["role"] == "ctx"]
        assert ctx_stats["leased"] == 0, ctx_stats
    finally:
        await eng.close()


@pytest.mark.parametrize("pull", [False, True], ids=["push", "pull"])
async def test_one_rank_instances_receive_at_the_gen_rank(ray_cluster: Any, pull: bool) -> None:
    """CTX and GEN instances of one rank each: the CTX rank binds a published
    ticket to the first GEN OPEN and decides it alone, and the GEN rank is
    its instance's whole intersection, so a receive is one call to the GEN
    rank (`receive_alone`), which drives it to its end and answers it: no
    coordinator call on the way, no claim, no admission round. The GEN
    coordinator learns of each from the rank's report and its rounds end
    it there. The bytes are the request's own; a ticket already received,
    or cancelled before, is refused with nothing held; a cancel mid-transfer
    ends in both instances; every block comes back. In pull (the GEN rank
    READs what the CTX rank lent it at publish) the same holds, and no frame
    goes from the CTX rank to the GEN rank unless a cancel FENCEs."""
    # A READ here ends in well under a second however busy the box: polled
    # at once until it does (`read_spin_s`), a pulled receive on the rank's
    # loop always ends within its call.
    eng = await _engine(1, 1, "paged", "split", pull=pull, read_spin_s=5.0)
    try:
        gen_coord, ctx_coord = eng.dep._coords[Role.GEN], eng.dep._coords[Role.CTX]

        async def coord_stats(coord: Any) -> dict[str, Any]:
            return dict(await coord.stats.remote())

        before, ctx_before = await coord_stats(gen_coord), await coord_stats(ctx_coord)
        for i, tokens in enumerate((1, 6, 17)):
            assert await _handoff(eng, f"alone-{i}", seed=31 + i, tokens=tokens) == "completed"
        calls, ctx_calls = (await coord_stats(gen_coord))["calls"], (await coord_stats(ctx_coord))["calls"]
        for name in ("rank_admit_alone", "claims_alone", "peer_admit_calls", "rank_vote_calls"):
            assert calls.get(name, 0) == before["calls"].get(name, 0), (name, calls)
        assert ctx_calls.get("claims", 0) == ctx_before["calls"].get("claims", 0), ctx_calls
        gen_stats = [s for s in (await eng.dep.stats())["ranks"] if s["role"] == "gen"]
        assert gen_stats[0]["counters"]["received_alone"] >= 3, gen_stats
        assert gen_stats[0]["counters"]["completed_alone"] >= 3, gen_stats
        ctx_stats = [s for s in (await eng.dep.stats())["ranks"] if s["role"] == "ctx"]
        assert gen_stats[0]["counters"].get("pulled", 0) == (3 if pull else 0), gen_stats
        assert ctx_stats[0]["counters"].get("lent", 0) == (3 if pull else 0), ctx_stats
        # The coordinator took each in flight from the report and ended it.
        deadline = asyncio.get_running_loop().time() + 60  # a bound (L1), not a guess
        while True:
            now = await coord_stats(gen_coord)
            done = now["decided"].get("completed", 0) - before["decided"].get("completed", 0)
            if done >= 3 and now["in_flight"] == 0:
                break
            assert asyncio.get_running_loop().time() < deadline, now
            await asyncio.sleep(0.01)
        # A front end in the GEN worker's own process calls the rank on its
        # loop: no Ray call either way.
        here, ctx_blocks = await eng.prefill_and_publish("here", seed=39, tokens=17)
        gen_blocks = eng.take(Role.GEN, len(ctx_blocks))
        outcome, back, client_calls = await eng.gen[0].receive_here.remote(here.encode(), gen_blocks)
        assert (outcome, back) == ("completed", True), (outcome, client_calls)
        assert client_calls.get("receive_at_rank_here") == 1 and not client_calls.get("receive_at_rank"), client_calls
        assert not client_calls.get("receive_at_rank_on_its_loop"), client_calls  # from another loop: one thread hop
        assert await eng.gen[0].matches.remote(39, gen_blocks)
        await eng.give_back(here, gen_blocks, ctx_blocks)
        # Run on the endpoint's own loop (the vLLM connector's receive): the
        # rank's receive is called there, with no thread hop either way; a
        # pulled one ends within that call (its READ polled at once), the
        # blocks back and the bytes the request's: no turn of the loop.
        here, ctx_blocks = await eng.prefill_and_publish("on-its-loop", seed=38, tokens=17)
        gen_blocks = eng.take(Role.GEN, len(ctx_blocks))
        outcome, back, client_calls = await eng.gen[0].receive_here.remote(here.encode(), gen_blocks, True)
        assert (outcome, back) == ("completed", True), (outcome, client_calls)
        assert client_calls.get("receive_at_rank_on_its_loop") == 1, client_calls
        assert client_calls["ended_at_once"] == int(pull), client_calls
        if pull:  # ended with its blocks back to the engine, truly
            assert client_calls["leased_then"] == 0, client_calls
        gen_stats = [s for s in (await eng.dep.stats())["ranks"] if s["role"] == "gen"]
        # Every pulled receive ended within its call at the rank (the ones by
        # Ray call and from another loop too: the rank's part took no turn).
        assert gen_stats[0]["counters"].get("received_at_once", 0) == (5 if pull else 0), gen_stats
        assert client_calls.get("receive_at_rank_here") == 2 and not client_calls.get("receive_at_rank"), client_calls
        assert await eng.gen[0].matches.remote(38, gen_blocks)
        await eng.give_back(here, gen_blocks, ctx_blocks)
        # Received already: refused at the rank, which ended it; nothing held.
        ticket, ctx_blocks = await eng.prefill_and_publish("twice", seed=40, tokens=5)
        gen_blocks = eng.take(Role.GEN, len(ctx_blocks))
        assert (await eng.dep.receive(ticket, gen_blocks)).outcome == "completed"
        again = await eng.dep.receive(ticket, gen_blocks)
        assert again.outcome == "rejected" and again.blocks_returned, again
        assert await eng.dep.returned(ticket, Role.CTX)
        # Cancelled before any receive: `cancel` returns once the CTX rank
        # applied it and gave the blocks back, pushed or lent, so a receive
        # right after it is refused: the CTX rank refuses its OPEN (the
        # claim), which the GEN rank takes as "rejected": nothing held.
        # The CTX coordinator's decisions to its rank are held meanwhile: the
        # cancel is decided, yet `cancel` has not returned while the CTX rank
        # has not applied it.
        cancelled, more = await eng.prefill_and_publish("gone", seed=41, tokens=5)
        await hold_decisions(ctx_coord, 0)
        cancelling = asyncio.ensure_future(eng.dep.cancel(cancelled))
        while not await held_decisions(ctx_coord, 0):
            assert not cancelling.done() and asyncio.get_running_loop().time() < deadline + 60
            await asyncio.sleep(0.01)
        # A bound on a negative check, well under the round bound (5 s) the
        # hold must stay below: a cancel that did not wait returns at once.
        done, _ = await asyncio.wait({cancelling}, timeout=0.5)
        assert not done, "cancel returned before the CTX rank applied it"
        await release_decisions(ctx_coord, 0)
        await cancelling
        assert await eng.dep.returned(cancelled, Role.CTX, timeout=0.0)
        late = await eng.dep.receive(cancelled, gen_blocks)
        assert late.outcome == "rejected" and late.blocks_returned, late
        eng.give(Role.GEN, gen_blocks)
        eng.give(Role.CTX, ctx_blocks + more)
        # A cancel while the poster's frames are held: push, the CTX's to
        # the GEN (decided, posted, the GEN not told); pull, the reader's
        # TERMINAL to the lender (read, the lender not told: it must hold).
        held, ctx_blocks = await eng.prefill_and_publish("held", seed=42, tokens=16)
        poster, waiter = (eng.gen[0], Role.CTX) if pull else (eng.ctx[0], Role.GEN)
        await hold_frames(poster, "held", waiter, 0)
        gen_blocks = eng.take(Role.GEN, len(ctx_blocks))
        receiving = asyncio.ensure_future(eng.dep.receive(held, gen_blocks, timeout=60))
        while not await held_frames(poster, "held", waiter, 0):
            assert asyncio.get_running_loop().time() < deadline + 60, "the transfer never started"
            await asyncio.sleep(0.01)
        if pull:  # the READ ended, the lender was not told: its blocks are still held
            assert not await eng.dep.returned(held, Role.CTX, timeout=0.2)
        await eng.dep.cancel(held)
        await release_frames(poster, "held", waiter, 0)
        result = await receiving
        assert result.outcome in ("cancelled", "completed") and result.blocks_returned, result
        await eng.give_back(held, gen_blocks, ctx_blocks)
        await eng.check_clean()
        # A draining GEN instance: its coordinator closes the rank's
        # admission, and a receive there is refused with nothing held.
        assert await gen_coord.drain.remote(60)
        ticket, ctx_blocks = await eng.prefill_and_publish("drained", seed=43, tokens=5)
        gen_blocks = eng.take(Role.GEN, len(ctx_blocks))
        refused = await eng.dep.receive(ticket, gen_blocks)
        assert refused.outcome == "rejected" and refused.blocks_returned, refused
        await eng.dep.cancel(ticket)
        await eng.give_back(ticket, gen_blocks, ctx_blocks)
        await eng.check_clean()
    finally:
        await eng.close()


async def test_a_cancel_before_the_gen_coordinator_knew_the_receive_still_ends_it(ray_cluster: Any) -> None:
    """A receive at the GEN rank reaches its coordinator only with the rank's
    report, which a cancel may overtake. The coordinator keeps such a
    cancel and applies it when the report brings the parent in flight.
    Shown with the CTX coordinator gone (so only the GEN side can end it)
    and the cancel sent before the receive: the GEN round cancels the
    parent, the CTX's frames to the GEN were held meanwhile, and the
    receive ends "cancelled" (else its TERMINAL would complete it), with
    nothing held. (Push: in pull the READ is the GEN rank's own and may
    complete before its report reaches the coordinator.)"""
    eng = await _engine(1, 1, "paged", "split", pull=False)
    try:
        assert await _handoff(eng, "warm", seed=60, tokens=9) == "completed"
        ticket, ctx_blocks = await eng.prefill_and_publish("early", seed=61, tokens=16)
        await hold_frames(eng.ctx[0], "early", Role.GEN, 0)
        ctx_coord = eng.dep._coords[Role.CTX]
        watching = ctx_coord.watch.remote()  # answers only with the coordinator's death
        ray.kill(ctx_coord, no_restart=True)
        with pytest.raises(ray.exceptions.RayActorError):
            await watching
        gen_coord = eng.dep._coords[Role.GEN]
        assert await gen_coord.cancel.remote(ticket.parent) is None  # not known here yet
        gen_blocks = eng.take(Role.GEN, len(ctx_blocks))
        receiving = asyncio.ensure_future(eng.dep.receive(ticket, gen_blocks, timeout=60))
        deadline = asyncio.get_running_loop().time() + 60  # a bound (L1), not a guess
        while (await gen_coord.stats.remote())["calls"].get("cancels_before_report", 0) == 0:
            assert asyncio.get_running_loop().time() < deadline, "the early cancel was never applied"
            await asyncio.sleep(0.01)
        await release_frames(eng.ctx[0], "early", Role.GEN, 0)
        result = await receiving
        assert result.outcome == "cancelled" and result.blocks_returned, result
        gen = eng.gen[0]
        stats = await gen.stats.remote()
        assert stats["leased"] == 0 and stats["violations"] == [], stats
        eng.give(Role.GEN, gen_blocks)
    finally:
        await eng.close()


@pytest.mark.parametrize("pull", [False, True], ids=["push", "pull"])
@pytest.mark.parametrize("role", [Role.GEN, Role.CTX], ids=["gen", "ctx"])
async def test_a_one_rank_instance_completes_alone(ray_cluster: Any, role: Role, pull: bool) -> None:
    """The rank of a one-rank instance is its completion round's whole
    intersection: once the last TERMINAL lands (GEN: and the bytes are
    there) it completes the request with no decision of its coordinator. A
    GEN rank makes it decode-ready, returns the blocks to the engine and
    answers the receive; a CTX rank, every edge terminal COMPLETED (no
    WRITE of its reads the blocks any more), gives its blocks back.
    Shown with that role's coordinator gone while the poster's frames were
    held (push: the CTX's; pull: the reader's TERMINAL, the lender's one
    word): the receive ends "completed" with the request's own bytes and
    the rank's blocks come back; before, they waited for a completion
    round that never came."""
    eng = await _engine(1, 1, "paged", "split", pull=pull)
    rid = f"solo-{role.value}"
    poster, waiter = (eng.gen[0], Role.CTX) if pull else (eng.ctx[0], Role.GEN)
    try:
        assert await _handoff(eng, "warm", seed=50, tokens=9) == "completed"
        ticket, ctx_blocks = await eng.prefill_and_publish(rid, seed=51, tokens=16)
        assert (ticket.lend is not None) is pull
        await hold_frames(poster, rid, waiter, 0)
        gen_blocks = eng.take(Role.GEN, len(ctx_blocks))
        receiving = asyncio.ensure_future(eng.dep.receive(ticket, gen_blocks, timeout=60))
        deadline = asyncio.get_running_loop().time() + 60  # a bound (L1), not a guess
        while not await held_frames(poster, rid, waiter, 0):
            assert asyncio.get_running_loop().time() < deadline, "the transfer never started"
            await asyncio.sleep(0.01)
        coordinator = eng.dep._coords[role]
        watching = coordinator.watch.remote()  # answers only with the coordinator's death
        ray.kill(coordinator, no_restart=True)
        with pytest.raises(ray.exceptions.RayActorError):
            await watching
        await release_frames(poster, rid, waiter, 0)
        result = await receiving
        assert result.outcome == "completed" and result.blocks_returned, result
        assert await eng.gen[0].matches.remote(51, gen_blocks)
        rank = eng.gen[0] if role is Role.GEN else eng.ctx[0]
        assert await rank.returned.remote(ticket.parent, 30.0)
        stats = await rank.stats.remote()
        assert stats["counters"]["completed_alone"] >= 2 and stats["leased"] == 0, stats
    finally:
        await eng.close()


async def test_a_second_receive_of_a_ticket_under_way_is_refused_alone(engine: Engine) -> None:
    """A front end that receives a ticket again while its first receive is
    under way (an HTTP retry): the second is refused ("rejected", nothing of
    it held, its blocks the engine's) and the first goes on, uncancelled,
    to its own bytes."""
    ticket, ctx_blocks = await engine.prefill_and_publish("twice-at-once", seed=17, tokens=9)
    for ctx in engine.ctx:
        await hold_frames(ctx, "twice-at-once", Role.GEN, 0)
    first_blocks, second_blocks = engine.take(Role.GEN, 3), engine.take(Role.GEN, 3)
    first = asyncio.ensure_future(engine.dep.receive(ticket, first_blocks, timeout=60))
    deadline = asyncio.get_running_loop().time() + 60  # a bound (L1), not a guess
    while not await held_frames(engine.ctx[0], "twice-at-once", Role.GEN, 0):
        assert asyncio.get_running_loop().time() < deadline, "the transfer never started"
        await asyncio.sleep(0.01)
    asked = (await engine.dep.stats())["coordinators"]["gen"]["calls"].get("cancels_asked", 0)
    second = await engine.dep.receive(ticket.encode(), second_blocks, timeout=60)
    assert second.outcome == "rejected" and second.blocks_returned, second
    for ctx in engine.ctx:
        await release_frames(ctx, "twice-at-once", Role.GEN, 0)
    result = await first
    assert result.outcome == "completed" and result.blocks_returned, result
    assert await engine.gen[0].matches.remote(17, first_blocks)
    calls = (await engine.dep.stats())["coordinators"]["gen"]["calls"]
    assert calls.get("cancels_asked", 0) == asked, calls  # the refused one cancelled nothing
    engine.give(Role.GEN, second_blocks)
    await engine.give_back(ticket, first_blocks, ctx_blocks)
    await engine.check_clean()


async def test_cancel_with_ready_held_in_flight_never_leaks_or_corrupts(engine: Engine) -> None:
    """A cancel while the CTX's READY/TERMINAL frames to the GEN are held (the
    transfer decided, the GEN not told): the request ends cancelled, both
    sides give every block back, and the next request into the same GEN
    blocks decodes its own bytes only."""
    ticket, ctx_blocks = await engine.prefill_and_publish("held", seed=11, tokens=16)
    for ctx in engine.ctx:
        await hold_frames(ctx, "held", Role.GEN, 0)
    gen_blocks = engine.take(Role.GEN, 4)
    receiving = asyncio.ensure_future(engine.dep.receive(ticket, gen_blocks, timeout=60))
    await asyncio.sleep(0.2)
    await engine.dep.cancel(ticket)
    for ctx in engine.ctx:
        await release_frames(ctx, "held", Role.GEN, 0)
    result = await receiving
    assert result.outcome in ("cancelled", "completed") and result.blocks_returned
    assert await engine.dep.returned(ticket, Role.CTX)
    engine.give(Role.CTX, ctx_blocks)
    engine.give(Role.GEN, gen_blocks)
    await engine.gen[0].scribble.remote(gen_blocks)
    assert await _handoff(engine, "after-held", seed=12, tokens=16) == "completed"
    await engine.check_clean()


async def test_random_cancels_from_either_side(engine: Engine) -> None:
    rng = random.Random(3)
    outcomes = await asyncio.gather(
        *(
            _handoff(
                engine, f"rc-{i}", seed=200 + i, tokens=rng.randint(1, 20),
                cancel_after=rng.choice([None, 0.0, 0.001, 0.005, 0.02]),
            )
            for i in range(4)
        )
    )
    assert set(outcomes) <= {"completed", "cancelled", "rejected"}
    await engine.check_clean()


async def test_create_refuses_what_can_never_work(ray_cluster: Any) -> None:
    with pytest.raises(InvalidConfig):
        await EngineDeployment.create(ctx_tp=3, gen_tp=1, layout=LAYOUT)  # 4 heads over 3 ranks
    with pytest.raises(InvalidConfig):
        await EngineDeployment.create(ctx_tp=1, gen_tp=1, layout=LAYOUT, ctx_memory="nonsense")
    with pytest.raises(InvalidConfig):
        await EngineDeployment.create(ctx_tp=1, gen_tp=1, layout="not a layout")  # type: ignore[arg-type]


async def test_the_ctx_instance_lets_a_published_ticket_be_claimed_once(engine: Engine) -> None:
    ticket, blocks = await engine.prefill_and_publish("claim", seed=13, tokens=5)
    coord = engine.dep._coords[Role.CTX]
    unknown = ticket.parent.__class__(request_id="never", ctx_attempt=1, gen_attempt=1)
    assert await coord.claim_many.remote([ticket.parent, unknown]) == [True, False]
    assert await coord.claim_many.remote([ticket.parent]) == [False]
    await engine.dep.cancel(ticket)
    assert await engine.dep.returned(ticket, Role.CTX)
    assert await coord.claim_many.remote([ticket.parent]) == [False]  # ended: not claimable
    engine.give(Role.CTX, blocks)
    await engine.check_clean()


async def test_unproven_gen_blocks_are_not_returned_until_the_proof_comes(ray_cluster: Any) -> None:
    """The CTX's READY and TERMINAL never reach the GEN (held): the GEN's
    transfer deadline cancels, its edge cannot be proven quiescent and is
    quarantined, so `receive` must say the blocks are NOT back. The late
    TERMINAL is the proof: then, and only then, they are returned. (Push;
    `test_a_lender_holds_its_blocks_until_the_readers_word` is pull's.)"""
    eng = await _engine(1, 1, "paged", "split", transfer_timeout_s=1.0, pull=False)
    try:
        ticket, ctx_blocks = await eng.prefill_and_publish("unproven", seed=21, tokens=12)
        await hold_frames(eng.ctx[0], "unproven", Role.GEN, 0)
        gen_blocks = eng.take(Role.GEN, 3)
        result = await eng.dep.receive(ticket, gen_blocks, timeout=4.0)
        assert result.outcome != "completed"
        assert not result.blocks_returned, result
        stats = await eng.dep.stats()
        assert sum(s["quarantined"] for s in stats["ranks"] if s["role"] == "gen") == 3
        await release_frames(eng.ctx[0], "unproven", Role.GEN, 0)
        assert await eng.dep.returned(ticket, Role.GEN, timeout=60)
        assert await eng.dep.returned(ticket, Role.CTX, timeout=60)
        eng.give(Role.GEN, gen_blocks)
        eng.give(Role.CTX, ctx_blocks)
        await eng.check_clean()
    finally:
        await eng.close()


async def test_a_garbled_or_forged_lend_reads_nothing(ray_cluster: Any) -> None:
    """Pull between one-rank instances: a ticket's lend names the lender's
    block ids, and a proxy may garble them. A lend whose seal does not match
    (another ticket's blocks, or another ticket's whole lend) is refused at
    the reader before any READ: the receive is "rejected" with its blocks
    back and not a byte of the other request read. Nothing of it is
    believed or answered: the true lends stay as they were (held, as an
    unclaimed ticket is, until a receive, a cancel or the lease), and the
    request whose blocks were named is received exactly afterwards."""
    eng = await _engine(1, 1, "paged", "paged")
    try:
        one, one_blocks = await eng.prefill_and_publish("forged-1", seed=71, tokens=9)
        two, two_blocks = await eng.prefill_and_publish("forged-2", seed=72, tokens=9)
        three, three_blocks = await eng.prefill_and_publish("forged-3", seed=73, tokens=9)
        assert one.lend is not None and two.lend is not None and three.lend is not None
        gen_blocks = eng.take(Role.GEN, len(one_blocks))
        for forged in (
            msgspec.structs.replace(one, lend=msgspec.structs.replace(one.lend, blocks=two.lend.blocks)),
            msgspec.structs.replace(three, lend=two.lend),
        ):
            result = await eng.dep.receive(forged.encode(), gen_blocks, timeout=30)
            assert result.outcome == "rejected" and result.blocks_returned, result
            assert not await eng.gen[0].matches.remote(72, gen_blocks)  # not a byte of "forged-2" read
        stats = await eng.gen[0].stats.remote()
        assert stats["counters"]["lend_unsealed"] == 2 and not stats["counters"].get("pulled"), stats
        for ticket in (one, two, three):  # every true lend still held by its lender
            assert not await eng.dep.returned(ticket, Role.CTX, timeout=0.1)
        result = await eng.dep.receive(two, gen_blocks, timeout=30)
        assert result.outcome == "completed" and result.blocks_returned, result
        assert await eng.gen[0].matches.remote(72, gen_blocks)
        await eng.give_back(two, gen_blocks, two_blocks)
        for ticket, blocks in ((one, one_blocks), (three, three_blocks)):
            await eng.dep.cancel(ticket)  # the caller ends what it will not receive
            assert await eng.dep.returned(ticket, Role.CTX, timeout=60)
            eng.give(Role.CTX, blocks)
        await eng.check_clean()
    finally:
        await eng.close()


async def test_a_lender_holds_its_blocks_until_the_readers_word(ray_cluster: Any) -> None:
    """Pull: the reader's frames to the lender are held (its TERMINAL, then
    its answers to the lender's FENCE). The receive completes with the
    request's own bytes (the READ is the reader's own), but the lender never
    gives its blocks back on a guess: past its lease it FENCEs, hears
    nothing, and quarantines them (its blocks are not returned). The held
    frames, let go, are the proof: then, and only then, they come back."""
    eng = await _engine(1, 1, "paged", "split", lease_timeout_s=1.0, transfer_timeout_s=1.0)
    try:
        ticket, ctx_blocks = await eng.prefill_and_publish("unheard", seed=22, tokens=12)
        assert ticket.lend is not None
        await hold_frames(eng.gen[0], "unheard", Role.CTX, 0)
        gen_blocks = eng.take(Role.GEN, len(ctx_blocks))
        result = await eng.dep.receive(ticket, gen_blocks, timeout=30)
        assert result.outcome == "completed" and result.blocks_returned, result
        assert await eng.gen[0].matches.remote(22, gen_blocks)
        eng.give(Role.GEN, gen_blocks)
        deadline = asyncio.get_running_loop().time() + 60  # a bound (L1), not a guess
        while (await eng.ctx[0].stats.remote())["quarantined"] == 0:
            assert asyncio.get_running_loop().time() < deadline, "the lender never quarantined"
            await asyncio.sleep(0.05)
        assert not await eng.dep.returned(ticket, Role.CTX, timeout=0.2)
        await release_frames(eng.gen[0], "unheard", Role.CTX, 0)
        assert await eng.dep.returned(ticket, Role.CTX, timeout=60)
        stats = await eng.ctx[0].stats.remote()
        assert stats["counters"]["reclaimed"] >= 1 and stats["quarantined"] == 0, stats
        eng.give(Role.CTX, ctx_blocks)
        await eng.check_clean()
    finally:
        await eng.close()


async def test_a_front_end_in_another_handle_receives_and_an_abandoned_receive_hands_back(engine: Engine) -> None:
    """`connect(plan)` finds the same deployment by name (as a decode
    server's front end in another process would); a receive whose caller
    goes away is cancelled in both instances by the deployment, and every
    block comes back."""
    other = await EngineDeployment.connect(engine.dep.plan)
    ticket, ctx_blocks = await engine.prefill_and_publish("far", seed=31, tokens=10)
    gen_blocks = engine.take(Role.GEN, 3)
    result = await other.receive(ticket.encode(), gen_blocks)
    assert result.outcome == "completed" and result.blocks_returned
    assert all(await asyncio.gather(*(w.matches.remote(31, gen_blocks) for w in engine.gen)))
    assert await other.returned(ticket, Role.CTX)
    await other.shutdown()  # a connected handle stops nothing
    engine.give(Role.CTX, ctx_blocks)

    ticket, ctx_blocks = await engine.prefill_and_publish("gone", seed=32, tokens=10)
    for ctx in engine.ctx:  # keep it from completing before the caller leaves
        await hold_frames(ctx, "gone", Role.GEN, 0)
    waiting = asyncio.ensure_future(engine.dep.receive(ticket, gen_blocks, timeout=60))
    await asyncio.sleep(0.3)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    for ctx in engine.ctx:
        await release_frames(ctx, "gone", Role.GEN, 0)
    assert await engine.dep.returned(ticket, Role.GEN, timeout=60)
    assert await engine.dep.returned(ticket, Role.CTX, timeout=60)
    engine.give(Role.GEN, gen_blocks)
    engine.give(Role.CTX, ctx_blocks)
    await engine.check_clean()


async def test_an_engine_blocking_its_own_loop_does_not_stall_the_endpoint(ray_cluster: Any) -> None:
    """The endpoint lives in its own concurrency group (its own loop): while
    every worker blocks its default loop far longer than the round bound,
    handoffs still complete (the old failure: the rank missed a round vote,
    was taken for dead, and the instance failed). The block here is inside
    the call; a loop that blocks just after another call returned, with a
    call queued behind it, stalls every group (Ray), which is why hosts run
    blocking work on a thread (docs/design.md)."""
    eng = await _engine(2, 1, "paged", "paged", round_timeout_s=1.0)
    try:
        ticket, ctx_blocks = await eng.prefill_and_publish("busy", seed=41, tokens=20)
        gen_blocks = eng.take(Role.GEN, 5)
        busy = [w.busy.remote(6.0) for w in eng.ctx + eng.gen]
        await asyncio.sleep(0.5)  # the busy calls are running (their actors' default loops are blocked)
        result = await eng.dep.receive(ticket, gen_blocks, timeout=30)
        done_at = time.monotonic()
        ended = await asyncio.gather(*busy)
        assert result.outcome == "completed" and result.blocks_returned, result
        assert done_at < min(ended), "the handoff waited for the engine's work"
        assert all(await asyncio.gather(*(w.matches.remote(41, gen_blocks) for w in eng.gen)))
        assert await eng.dep.returned(ticket, Role.CTX)
        eng.give(Role.GEN, gen_blocks)
        eng.give(Role.CTX, ctx_blocks)
        await eng.check_clean()
        stats = await eng.dep.stats()
        assert all(c.get("state") == "running" for c in stats["coordinators"].values()), stats["coordinators"]
    finally:
        await eng.close()


async def test_a_request_larger_than_one_open_is_refused_typed(engine: Engine) -> None:
    from kvhandoff.protocol import MAX_BLOCKS_PER_OPEN

    n = MAX_BLOCKS_PER_OPEN + 1
    before = [s["leased"] for s in (await engine.dep.stats())["ranks"]]
    with pytest.raises(InvalidRequest):
        await engine.dep.publish("too-big", n * LAYOUT.tokens_per_block, list(range(n)))
    after = [s["leased"] for s in (await engine.dep.stats())["ranks"]]
    # Nothing was leased for it (an earlier test's blocks may still be coming back).
    assert all(a <= b for a, b in zip(after, before)), (before, after)


async def test_a_restarted_worker_reattaches_and_its_next_request_is_exact(ray_cluster: Any) -> None:
    """An engine worker dies and the engine restarts it: kvhandoff detaches
    that rank at the next round (its instance admits nothing, typed:
    PublishRefused), the engine re-attaches the new worker (a new epoch, a
    new agent over its new tensors) without rebuilding anything, and the
    next request is byte-exact. A live worker can be replaced too (fenced:
    its epoch is stale from then on). The other instance's workers are the
    same actors throughout."""
    eng = await _engine(2, 1, "paged", "split", round_timeout_s=3.0)
    gen_before = list(eng.gen)
    try:
        assert await _handoff(eng, "before", seed=1, tokens=9) == "completed"
        ctx_coord = eng.dep._coords[Role.CTX]
        old = (await ctx_coord.epochs.remote())[1]
        ray.kill(eng.ctx[1], no_restart=True)  # the engine's worker process died
        # ray.kill returns before the process is gone: wait until it is (a
        # round call on the rank's channel can still reach it meanwhile).
        deadline = asyncio.get_running_loop().time() + 60  # a bound (L1), not a pace
        while True:
            try:
                await eng.ctx[1].__ray_ready__.remote()
            except ray.exceptions.RayActorError:
                break
            assert asyncio.get_running_loop().time() < deadline, "the killed worker still answers"
            await asyncio.sleep(0.01)
        # The next round finds it dead and detaches it: ours, or the one the
        # coordinator's watch of the rank ran first.
        with contextlib.suppress(RoundTimeout):
            await ctx_coord.run_round.remote()
        stats = await ctx_coord.stats.remote()
        assert stats["detached"] == [1], stats
        assert any("waiting for ranks [1]" in t for t in stats["timeouts"]), stats["timeouts"]
        with pytest.raises(PublishRefused):
            await eng.dep.publish("while-detached", 9, eng.free[Role.CTX][:3])
        # The engine restarts the worker and re-attaches it.
        eng.ctx[1] = Worker.remote(eng.dep.plan, "ctx", 1)
        epoch = await eng.dep.reattach("ctx", 1, eng.ctx[1])
        assert epoch > old
        stats = await ctx_coord.stats.remote()
        assert stats["detached"] == [] and stats["state"] == "running" and stats["reattached"] == 1
        for i in range(3):
            assert await _handoff(eng, f"after-{i}", seed=10 + i, tokens=9 + 4 * i) == "completed"
        # A live GEN worker replaced by a new one: the old is fenced, the new serves.
        fresh = Worker.remote(eng.dep.plan, "gen", 0)
        await eng.dep.reattach(Role.GEN, 0, fresh)
        stale, eng.gen[0] = eng.gen[0], fresh
        assert await _handoff(eng, "after-gen", seed=20, tokens=13) == "completed"
        ray.kill(stale)
        with pytest.raises(InvalidRequest):
            await eng.dep.reattach("gen", 1, fresh)  # GEN has one rank
        await eng.check_clean()
        assert eng.gen[0] is not gen_before[0] and eng.ctx[0] is not None
    finally:
        await eng.close()


async def test_the_engine_cost_bench_runs_a_hosted_endpoint_under_load(ray_cluster: Any) -> None:
    """`kvhandoff bench --sections engine` on real endpoints hosted by
    engine-style workers: the loop ran beside an idle endpoint and one under
    real handoffs (every one completed), and the idle endpoint's own CPU
    share was measured. The numbers are the bench's to judge; here, that
    each was measured."""
    import argparse
    import itertools

    from kvhandoff.cli._bench_engine import engine_cost, engine_targets
    from kvhandoff.cli._console import Reporter

    ids = itertools.count()
    out = await engine_cost(
        argparse.Namespace(engine_spin_s=0.05, repeats=1),
        Reporter("bench", quiet=True),
        lambda tag: f"{tag}-{next(ids)}",
    )
    assert out["handoffs_under_load"] > 0 and out["failures"] == {}, out
    assert len(out["idle_over_none_per_repeat"]) == len(out["load_over_none_per_repeat"]) == 9
    assert all(r > 0 for r in out["idle_over_none_per_repeat"] + out["load_over_none_per_repeat"])
    assert out["idle_cpu_share"]["idle"] > 0 and out["idle_cpu_share"]["none"] > 0
    names: list[str] = []
    engine_targets(out, lambda name, *rest: names.append(name))
    assert len(names) == 3
