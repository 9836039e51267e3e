"""Admission at the OPEN on real rank actors (docs/design.md "Admission at
the OPEN"; `Fleet.launch(admit_at_open=True)`, experimental): one-rank CTX
instances admit a handoff when its OPEN arrives, the GEN coordinators ask no
peer admission, and the CTX coordinators learn of each admission from their
rank's report.

What would fail if it broke:

* the handoffs over every pair (CTX tp=1 to GEN tp=1 and tp=2) complete
  with verified bytes (S2) although no peer admission was asked, every
  one of them admitted at its OPEN, and every pool is whole afterwards:
  the CTX coordinators ended what they only heard of in reports (L1);
* a CTX rank without room refuses an OPEN with a REJECT while another
  handoff holds its blocks mid-transfer: that handoff ends unserved, its GEN
  blocks come back, the held one completes, nothing leaks;
* a fleet that cannot admit at the OPEN (a CTX instance of tp > 1) is
  refused before any actor starts, and so is such an instance joining.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvhandoff.actors._dataplane import FaultPlan
from kvhandoff.actors.deployment import InvalidConfig
from kvhandoff.actors.fleet import Fleet
from kvhandoff.topology import KVLayout

from .helpers import assert_clean, inside

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

TOKENS = 40  # 3 blocks of 16 tokens
TIMEOUT = 60.0
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_block=16)
FLEET = dict(layout=LAYOUT, round_timeout_s=20.0, transfer_timeout_s=10.0, lease_timeout_s=20.0, start_timeout_s=300.0)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def run(coro):
    return asyncio.run(coro)


def ctx_completed(stats: dict) -> int:
    """Handoffs the CTX coordinators decided completed (recorded once every
    rank applied the decision: after the release a rank reports)."""
    return sum(c["decided"].get("completed", 0) for name, c in stats["coordinators"].items() if name.startswith("ctx"))


async def settled(fleet: Fleet, ready=lambda stats: True, timeout: float = TIMEOUT) -> dict:
    """Fleet stats once no rank holds a lease, no coordinator a parent in
    flight, and `ready(stats)` (bounded: an L1 limit, not a pace)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await fleet.stats()
        idle = all("error" not in s and s["leased"] == 0 for s in stats["ranks"]) and all(
            c.get("in_flight") == 0 for c in stats["coordinators"].values()
        )
        if (idle and ready(stats)) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


def test_handoffs_over_every_pair_are_admitted_at_their_opens_without_a_peer_admission() -> None:
    async def scenario():
        fleet = await Fleet.launch(ctx=[1, 1], gen=[1, 2], pool_blocks=32, admit_at_open=True, **FLEET)
        try:
            pairs = [(c, g) for c in ("ctx0", "ctx1") for g in ("gen0", "gen1")]
            results = await asyncio.gather(
                *(fleet.handoff(f"p{i}-{c}-{g}", TOKENS, ctx=c, gen=g, timeout=TIMEOUT) for i in range(2) for c, g in pairs)
            )
            # The CTX coordinators heard of each handoff only in a report:
            # they must still end all 8 (L1).
            return results, await settled(fleet, lambda stats: ctx_completed(stats) == 8)
        finally:
            await fleet.shutdown()

    results, stats = run(scenario())
    assert [r.outcome for r in results] == ["completed"] * 8, results
    expected = 3 * (LAYOUT.num_layers * 2 * LAYOUT.num_kv_heads * LAYOUT.tokens_per_block * LAYOUT.head_dim * 2)
    assert all(r.bytes_verified == expected for r in results), results
    coords = stats["coordinators"]
    gen_coords = [c for name, c in coords.items() if name.startswith("gen")]
    ctx_coords = [c for name, c in coords.items() if name.startswith("ctx")]
    assert all(c["calls"].get("peer_admit_calls", 0) == 0 for c in gen_coords), [c["calls"] for c in gen_coords]
    # The CTX coordinators admitted nothing in a round, and ended every handoff they heard of.
    assert all(c["calls"].get("rank_vote_calls", 0) == 0 for c in ctx_coords), [c["calls"] for c in ctx_coords]
    assert ctx_completed(stats) == 8, [c["decided"] for c in ctx_coords]
    ctx_ranks = [s for s in stats["ranks"] if s["role"] == "ctx"]
    assert sum(s["counters"].get("admitted_at_open", 0) for s in ctx_ranks) == 8, [s["counters"] for s in ctx_ranks]
    assert_clean(stats)


def test_a_ctx_rank_without_room_refuses_the_open_and_the_handoff_ends_cleanly() -> None:
    """Pools of 4 blocks, handoffs of 3: the first holds 3 CTX blocks while
    its chunks are held in flight; the second, from the other GEN instance,
    finds 1 free block at its OPEN: a REJECT (the GEN rank's NOT_STARTED
    evidence) ends it unserved and its GEN blocks come back."""

    async def scenario():
        fleet = await Fleet.launch(ctx=1, gen=2, pool_blocks=4, admit_at_open=True, fault_plan=FaultPlan(hold=True), **FLEET)
        try:
            ctx = (await fleet.instance_ranks("ctx0"))[0]
            held = asyncio.create_task(fleet.handoff("held", TOKENS, ctx="ctx0", gen="gen0", timeout=TIMEOUT))
            deadline = time.monotonic() + TIMEOUT
            while (await ctx.stats.remote())["in_flight_chunks"] == 0:
                assert time.monotonic() < deadline and not held.done()
                await asyncio.sleep(0.02)
            refused = await fleet.handoff("refused", TOKENS, ctx="ctx0", gen="gen1", timeout=TIMEOUT)
            during = await ctx.stats.remote()
            await inside(ctx, lambda ep: setattr(ep.transport.plan, "hold", False))
            return await held, refused, during, await settled(fleet)
        finally:
            await fleet.shutdown()

    held, refused, during, stats = run(scenario())
    assert held.outcome == "completed", held
    assert refused.outcome != "completed" and refused.bytes_verified == 0, refused
    assert during["counters"].get("refused_PoolError", 0) >= 1 and during["counters"].get("frames_reject", 0) >= 1, during["counters"]
    assert during["leased"] == 3, during  # the held handoff's blocks only
    ctx_rank = next(s for s in stats["ranks"] if s["role"] == "ctx")
    assert ctx_rank["counters"].get("admitted_at_open", 0) == 1, ctx_rank["counters"]
    assert_clean(stats)


def test_a_fleet_that_cannot_admit_at_the_open_is_refused_before_anything_starts() -> None:
    async def scenario():
        with pytest.raises(InvalidConfig, match="tp=1"):
            await Fleet.launch(ctx=[1, 2], gen=1, pool_blocks=8, admit_at_open=True, **FLEET)
        fleet = await Fleet.launch(ctx=1, gen=1, pool_blocks=8, admit_at_open=True, **FLEET)
        try:
            with pytest.raises(InvalidConfig, match="tp=1"):
                await fleet.add_instance("ctx", tp=2)
            return [i["id"] for i in fleet.instances()]
        finally:
            await fleet.shutdown()

    assert run(scenario()) == ["ctx0", "gen0"]
