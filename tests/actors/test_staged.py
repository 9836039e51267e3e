"""The staged data plane on real rank actors (docs/design.md "Staged data
plane"): real Ray, real NIXL agents, real host bytes. Each chunk is gathered
into a staging slot, moved with one WRITE into the GEN rank's slot and
scattered into its blocks when the WRITE's notice arrives. GEN verifies every
byte of every request (S2); every test ends with every block and every slot
back (L2) and no slot quarantined unless the test made one leak."""

from __future__ import annotations

import asyncio
import functools
import math

import pytest

from kvhandoff.actors import Deployment, InvalidConfig
from kvhandoff.actors._dataplane import edge_pieces
from kvhandoff.actors._faults import FaultPlan
from kvhandoff.protocol import ParentKey, Role, StageWrite
from kvhandoff.topology import KVLayout, block_bytes, memory_pieces, shard_map

from .helpers import assert_clean, inside, settled_stats
from .test_e2e import cancel_mid_dma

pytestmark = pytest.mark.ray

TIMEOUT = 20.0
ROUND_TIMEOUT = 20.0
PAGED = KVLayout(num_layers=3, num_kv_heads=4, head_dim=32, dtype="float16", tokens_per_block=8)


def run(coro):
    return asyncio.run(coro)


def total(layout: KVLayout, tokens: int, gen_tp: int) -> int:
    return math.ceil(tokens / layout.tokens_per_block) * block_bytes(layout, gen_tp) * gen_tp


def _staging(stats: dict, role: str) -> list[dict]:
    return [s["staging"] for s in stats["ranks"] if s["role"] == role]


def _sum(items: list[dict], key: str) -> int:
    return sum(i.get("counters", {}).get(key, 0) for i in items)


@pytest.mark.parametrize(
    ("kind", "ctx_tp", "gen_tp", "window"),
    [("paged", 2, 1, 4), ("split", 1, 2, 2), ("blocked", 2, 2, 1), ("paged_hnd", 2, 1, 1)],
    ids=lambda v: str(v),
)
def test_staged_handoffs_verify_every_byte(ray_cluster, kind, ctx_tp, gen_tp, window) -> None:
    """Forced staged: every chunk goes through a slot pair (no direct post at
    all), sequential and concurrent requests reuse blocks and slots, a window
    of 1 makes chunks queue for the slot, and every byte is verified."""

    async def scenario():
        dep = await Deployment.launch(
            ctx_tp=ctx_tp, gen_tp=gen_tp, layout=PAGED, pool_blocks=24, chunk_bytes=8 << 10,
            memory_kind=kind, round_timeout_s=ROUND_TIMEOUT, data_mode="staged", staging_window=window,
        )
        try:
            results = [await dep.handoff(f"st-{i}", 21 + 17 * i, timeout=TIMEOUT) for i in range(2)]
            results += await asyncio.gather(*(dep.handoff(f"st-c{i}", 9 + 11 * i, timeout=TIMEOUT) for i in range(3)))
            return results, await settled_stats(dep)
        finally:
            await dep.shutdown()

    results, stats = run(scenario())
    for r, n in zip(results, [21, 38, 9, 20, 31]):
        assert r.outcome == "completed", r
        assert r.bytes_verified == total(PAGED, n, gen_tp)
    assert_clean(stats)
    ctx, gen = _staging(stats, "ctx"), _staging(stats, "gen")
    posted = sum(s["posted_chunks"] for s in stats["ranks"] if s["role"] == "ctx")
    assert _sum(ctx, "staged_chunks") == posted > 0  # every WRITE was a slot's
    assert _sum(ctx, "acks") == posted
    assert _sum(gen, "scattered") == posted
    assert all(c["counters"].get("posts_prepared", 0) + c["counters"].get("posts_built", 0) == 0 for c in stats["ranks"] if c["role"] == "ctx")
    if window == 1:
        assert _sum(ctx, "staged_queued") > 0  # chunks waited for their credit
    # Index maps are built before the data phase: at OPEN (CTX), at install (GEN).
    assert _sum(ctx, "maps_prepared") >= 5 and _sum(gen, "maps_prepared") >= 5
    assert _sum(ctx, "map_prepare_failed") == _sum(gen, "map_prepare_failed") == 0


def _edge_descriptors(layout: KVLayout, kind: str, chunk: int) -> int:
    """Pieces per block pair of the (CTX 0 -> GEN 0) edge, CTX TP=2 -> GEN TP=1."""
    return len(edge_pieces(memory_pieces(shard_map(layout, 2, 1), (0, 0), kind, kind), chunk))


def test_auto_stages_small_pieces_of_big_requests_and_posts_the_rest_direct(ray_cluster) -> None:
    """"auto" stages an edge only when its pieces are small AND it has enough
    of them: a request of one block goes direct (a slot's fixed cost would
    outweigh the few descriptors it saves), one of twelve blocks is staged;
    an edge of large pieces goes direct at any size."""
    chunk = 64 << 10

    async def scenario(layout, kind, tokens, least):
        dep = await Deployment.launch(
            ctx_tp=2, gen_tp=1, layout=layout, pool_blocks=16, chunk_bytes=chunk,
            memory_kind=kind, round_timeout_s=ROUND_TIMEOUT, staged_below=4 << 10, staged_min_descriptors=least,
        )
        try:
            counts = []
            for i, n in enumerate(tokens):
                r = await dep.handoff(f"auto-{i}", n, timeout=TIMEOUT)
                assert r.outcome == "completed", r
                assert r.bytes_verified == total(layout, n, 1)
                counts.append(_sum(_staging(await settled_stats(dep), "ctx"), "staged_chunks"))
            return counts, await settled_stats(dep)
        finally:
            await dep.shutdown()

    # paged: per-token pieces of 2 heads x 64 B -> small; 1 block < 4 P <= 12 blocks.
    per_block = _edge_descriptors(PAGED, "paged", chunk)
    tpb = PAGED.tokens_per_block
    counts, stats = run(scenario(PAGED, "paged", [tpb, 12 * tpb, tpb], 4 * per_block))
    assert_clean(stats)
    assert counts[0] == 0  # one block: direct
    assert counts[1] > counts[0]  # twelve blocks: staged
    assert counts[2] == counts[1]  # one block again: direct
    assert sum(s["counters"].get("posts_prepared", 0) for s in stats["ranks"]) > 0
    # blocked with big blocks: the per-layer pieces are 8 KiB -> direct, however many
    big = KVLayout(num_layers=2, num_kv_heads=4, head_dim=128, dtype="float16", tokens_per_block=32)
    counts, stats = run(scenario(big, "blocked", [40], 1))
    assert_clean(stats)
    assert counts == [0]
    assert sum(s["counters"].get("posts_prepared", 0) for s in stats["ranks"]) > 0


def test_launch_refuses_a_bad_data_mode_typed(ray_cluster) -> None:
    with pytest.raises(InvalidConfig):
        run(Deployment.launch(data_mode="bounce"))
    with pytest.raises(InvalidConfig):
        run(Deployment.launch(data_mode="staged", staging_window=0))


@pytest.fixture(scope="module")
def staged(ray_cluster):
    """Staged forced, CTX 2 -> GEN 1, every chunk deferred (real late bytes)."""
    dep = run(
        Deployment.launch(
            ctx_tp=2, gen_tp=1, layout=PAGED, pool_blocks=24, chunk_bytes=4 << 10, memory_kind="paged",
            round_timeout_s=ROUND_TIMEOUT, data_mode="staged", staging_window=2,
            fault_plan=FaultPlan(defer_s=0.05), transfer_timeout_s=3.0,
        )
    )
    yield dep
    run(dep.shutdown())


def test_cancel_mid_dma_drains_slots_and_scatters_nothing_late(staged: Deployment) -> None:
    """Slots in flight at the cancel drain like chunks; the GEN scatters none
    of them into a lease that ended, every slot comes back, and the next
    request through the same slots verifies every byte (S2)."""
    dep = staged
    result, phases = run(cancel_mid_dma(dep, "st-cancel"))
    assert any("draining" in ph["edges"] for ph in phases), phases
    assert result.outcome == "cancelled", result
    stats = run(settled_stats(dep))
    assert_clean(stats)
    again = run(dep.handoff("st-after", 60, timeout=TIMEOUT))
    assert again.outcome == "completed", again
    assert_clean(run(settled_stats(dep)))


def test_a_failed_slot_write_cancels_and_frees_the_slot(ray_cluster) -> None:
    async def scenario():
        dep = await Deployment.launch(
            ctx_tp=1, gen_tp=1, layout=PAGED, pool_blocks=16, chunk_bytes=4 << 10, memory_kind="paged",
            round_timeout_s=ROUND_TIMEOUT, data_mode="staged", staging_window=2, fault_plan=FaultPlan(fail_every=3),
        )
        try:
            results = [await dep.handoff(f"st-err-{i}", 40, timeout=TIMEOUT) for i in range(3)]
            return results, await settled_stats(dep)
        finally:
            await dep.shutdown()

    results, stats = run(scenario())
    assert {r.outcome for r in results} == {"cancelled"}, results  # 5 chunks each: one fails
    assert_clean(stats)


def test_a_lost_ack_quarantines_one_slot_and_nothing_wedges(staged: Deployment) -> None:
    """The GEN drops one ACK: that slot is quarantined after the transfer
    timeout (its reader may still read it) and its request fails; the other
    slot carries every later request, byte-exact."""
    dep = staged
    gen = run(dep.ranks(Role.GEN))[0]

    def drop_one(core):
        core.faults.drop_acks = 1
        return 1

    run(inside(gen, drop_one))
    first = run(dep.handoff("st-lost-ack", 30, timeout=TIMEOUT))
    assert first.outcome in ("cancelled", "failed"), first
    later = [run(dep.handoff(f"st-after-lost-{i}", 50, timeout=TIMEOUT)) for i in range(3)]
    assert all(r.outcome == "completed" for r in later), later
    stats = run(settled_stats(dep))
    assert_clean(stats, slots_quarantined=1)
    ctx = _staging(stats, "ctx")
    assert _sum(ctx, "slots_quarantined") == 1


def test_a_notice_for_an_ended_lease_or_a_replay_writes_nothing(staged: Deployment) -> None:
    """Straight into the real GEN rank: a notice for a request it no longer
    holds is answered without a scatter; a replay of an answered generation
    and a slot outside the sender's partition are refused."""
    dep = staged
    done = run(dep.handoff("st-ended", 30, timeout=TIMEOUT))
    assert done.outcome == "completed"
    parent: ParentKey = dep.parent("st-ended")
    gen = run(dep.ranks(Role.GEN))[0]

    def probe(core):
        from kvhandoff.actors.rank import agent_name
        from kvhandoff.protocol import RankNamespace

        ns = RankNamespace(instance_id=core.config.peer_spec.instance_id, role=Role.CTX, rank=0)
        sender = agent_name(core.config.deployment, ns, 0)
        core.arena.tensor.fill_(0x5A)  # what a late slot would hold
        before = core.buffer.tensor.clone()
        reader = core._reader
        counters = dict(reader.counters)
        msg = StageWrite(
            request_id=parent.request_id, ctx_attempt=parent.ctx_attempt, gen_attempt=parent.gen_attempt,
            ctx_rank=0, ctx_epoch=0, chunk=0, start=0, end=4, max_piece=core.config.chunk_bytes,
            slot=0, generation=10_000, nbytes=4096,
        )
        reader.on_write(sender, msg, 0.0)  # ended lease: not scattered
        reader.on_write(sender, msg, 0.0)  # replay of generation 10_000: refused
        reader.on_write(sender, StageWrite(**{**{f: getattr(msg, f) for f in msg.__struct_fields__}, "slot": 3, "generation": 10_001}), 0.0)
        after = dict(reader.counters)
        return (
            bool(core.buffer.tensor.equal(before)),
            after.get("not_scattered", 0) - counters.get("not_scattered", 0),
            after.get("refused_StaleSlotError", 0) - counters.get("refused_StaleSlotError", 0),
            after.get("refused_DataPlaneError", 0) - counters.get("refused_DataPlaneError", 0),
        )

    unchanged, not_scattered, stale, outside = run(inside(gen, probe))
    assert unchanged  # not one byte of the pool was written
    assert (not_scattered, stale, outside) == (1, 1, 1)


def test_a_chunk_is_done_only_once_the_reader_scattered_it(ray_cluster) -> None:
    """The GEN holds its staging notices: every slot's WRITE is DONE (both
    chunks of each edge fit the window of 2) but nothing is scattered. No
    CTX edge may complete then (its TERMINAL would let the GEN verify blocks
    that do not hold the bytes yet); once the notices go through, the
    request completes with every byte verified."""
    dep = run(
        Deployment.launch(
            ctx_tp=2, gen_tp=1, layout=PAGED, pool_blocks=8, chunk_bytes=4 << 10, memory_kind="paged",
            round_timeout_s=ROUND_TIMEOUT, data_mode="staged", staging_window=2, fault_plan=FaultPlan(),
        )
    )
    gen = run(dep.ranks(Role.GEN))[0]
    ctx = run(dep.ranks(Role.CTX))

    def hold(core):
        core.faults.notices = []
        return 0

    def release(core):
        held, core.faults.notices = core.faults.notices or [], None
        for sender, msg, now in held:
            core._reader.on_write(sender, msg, now)
        return len(held)

    def landed(core):
        return core._writer.stats()["slots"].get("landed", 0)

    async def scenario():
        await inside(gen, hold)
        task = asyncio.ensure_future(dep.handoff("st-held", 8, timeout=TIMEOUT))  # 1 block: 2 chunks per edge
        deadline = asyncio.get_running_loop().time() + TIMEOUT
        while not task.done() and asyncio.get_running_loop().time() < deadline:
            if sum(await asyncio.gather(*(inside(h, landed) for h in ctx))) >= 2 * len(ctx):
                break  # every slot's bytes are in the GEN arena, unscattered
            await asyncio.sleep(0.01)
        parent = dep.parent("st-held")
        phases = await asyncio.gather(*(h.phase.remote(parent) for h in ctx))
        released = await inside(gen, release)
        return phases, released, await task

    try:
        phases, released, result = run(scenario())
        stats = run(settled_stats(dep))
    finally:
        run(dep.shutdown())
    assert all(ph["edges"] == ["posting"] for ph in phases), phases  # done only on the ACK
    assert released == 2 * len(phases)
    assert result.outcome == "completed", result
    assert result.bytes_verified == total(PAGED, 8, 1)
    assert_clean(stats)


def test_a_request_larger_than_one_open_is_refused_typed(staged: Deployment) -> None:
    """More blocks per rank than one OPEN carries (MAX_BLOCKS_PER_OPEN) is an
    InvalidRequest before any actor call: it used to break the GEN rank's
    round apply (the OPEN frame exceeded the frame cap)."""
    from kvhandoff.actors import InvalidRequest
    from kvhandoff.protocol import MAX_BLOCKS_PER_OPEN

    dep = staged
    before = run(dep.stats())
    with pytest.raises(InvalidRequest):
        run(dep.handoff("too-big", (MAX_BLOCKS_PER_OPEN + 1) * PAGED.tokens_per_block, timeout=TIMEOUT))
    after = run(dep.stats())
    assert [(s["free"], s["leased"]) for s in after["ranks"]] == [(s["free"], s["leased"]) for s in before["ranks"]]


def _plan_sizes(core, slots: tuple[int, ...]) -> list[int]:
    """On a CTX rank's endpoint loop: the chunk size it plans for its edge
    toward a GEN agent with each staging slot size in `slots` (0: no arena),
    and toward one it does not know yet."""
    pieces = core._edge_pieces((core.config.rank, 0))
    known = next(iter(core._geometry.values()))
    sizes = []
    for slot in slots:
        core._geometry["probe.gen0"] = known._replace(staging=(known.staging[0], slot, 2) if slot else ())
        sizes.append(core._plan_bytes(pieces, "probe.gen0"))
    del core._geometry["probe.gen0"]
    sizes.append(core._plan_bytes(pieces, "never.seen"))
    return sizes


def test_staged_chunks_are_planned_at_the_slot_size(ray_cluster) -> None:
    """A staged edge's chunks are slots (16 KiB here), not `chunk_bytes` (4
    KiB): one gather, WRITE, notice, scatter and ACK per 16 KiB. Toward a GEN
    whose slots are smaller the CTX plans at the GEN's slot; toward one
    without an arena, or for pieces it would not stage, at chunk_bytes."""
    chunk, slot = 4 << 10, 16 << 10

    async def scenario():
        dep = await Deployment.launch(
            ctx_tp=2, gen_tp=1, layout=PAGED, pool_blocks=24, chunk_bytes=chunk, memory_kind="paged",
            round_timeout_s=ROUND_TIMEOUT, data_mode="staged", staging_window=2, staging_slot_bytes=slot,
        )
        try:
            results = [await dep.handoff(f"slot-{i}", 8 * 20 - i, timeout=TIMEOUT) for i in range(2)]
            ctx = await dep.ranks(Role.CTX)
            sizes = await inside(ctx[0], functools.partial(_plan_sizes, slots=(slot, 8 << 10, 64, 0)))
            return results, sizes, await settled_stats(dep)
        finally:
            await dep.shutdown()

    results, sizes, stats = run(scenario())
    for r, n in zip(results, (160, 159)):
        assert r.outcome == "completed", r
        assert r.bytes_verified == total(PAGED, n, 1)
    assert_clean(stats)
    ctx = _staging(stats, "ctx")
    chunks, moved = _sum(ctx, "staged_chunks"), _sum(ctx, "staged_bytes")
    posted = sum(s["posted_chunks"] for s in stats["ranks"] if s["role"] == "ctx")
    assert chunks == posted > 0 and _sum(ctx, "staged_unfit") == 0
    assert moved == sum(r.bytes_verified for r in results)
    # Every chunk fits a slot, and they are slots, not chunk_bytes: 2 requests
    # x 2 CTX ranks x ceil(edge bytes / slot) chunks.
    per_edge = [math.ceil(total(PAGED, n, 1) / 2 / slot) for n in (160, 159)]
    assert chunks == 2 * sum(per_edge) < moved // chunk
    # Our slot; the GEN's smaller one; chunk_bytes toward a GEN whose slot
    # cannot hold one piece (128 B here) or that has no arena; our own slot
    # toward an agent not known yet (posted direct if it turns out unfit).
    assert sizes == [slot, 8 << 10, chunk, chunk, slot]
