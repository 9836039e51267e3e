"""Protocol negotiation on real rank actors (real local Ray, real NIXL agents).

Each deployment here has some ranks advertise another descriptor than this
build's `local_descriptor()`. There is no public hook for that: `launch_with`
builds the rank configs with the private `Deployment._plan`, replaces the
`descriptor` field of the chosen ranks, and starts them with `_start`, as
`Deployment.launch` does. What must hold (docs/design.md "Negotiation"):

- every rank computes the same answer from the descriptors of every rank of
  both instances, and reports it in `stats()["negotiated"]`;
- a topology with no common version, or without the capabilities this build
  cannot run without, admits nothing and moves no byte: the handoff is
  "rejected", nothing is posted, every pool is back to free;
- an OPEN that reaches a rank without an agreement is answered with a REJECT
  whose reason is NEGOTIATION, and nothing is posted;
- a compatible mix agrees on v2 and completes, and frames of another version
  are refused;
- without INFLIGHT_CANCEL the CTX runs the conservative path: a cancel
  mid-DMA waits for the decided transfer (`cancel_deferred`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec
import pytest

from kvhandoff.actors._config import LaunchConfig, checked
from kvhandoff.actors._faults import FaultPlan
from kvhandoff.actors.deployment import DEFAULT_LAYOUT, Deployment, HandoffResult
from kvhandoff.cli.harness import handoff_cancel_at, hold_frames, release_frames
from kvhandoff.protocol import (
    ABI_MSGPACK_V1,
    ALL_CAPABILITIES,
    BlockDescriptor,
    BufferInfo,
    Capability,
    ContextTicket,
    Endpoint,
    MemoryKind,
    Open,
    ParentKey,
    RankDescriptorV1,
    RankDescriptorV2,
    RankNamespace,
    Reject,
    RejectReason,
    Role,
    decode_frame,
    descriptor_frame,
    encode_frame,
)
from kvhandoff.topology import KVLayout, block_bytes, topology_digest

from .helpers import assert_clean, gen_bytes, inside, settled_stats, wait_stats

pytestmark = pytest.mark.ray

POOL = 24
TOKENS = 100
TIMEOUT = 30.0
ROUND_TIMEOUT = 20.0
# Everything a rank of a `Deployment` advertises: pull (`Capability.PULL`)
# is advertised by engine pairs' ranks only (`RankConfig.pull`).
ALL = int(ALL_CAPABILITIES & ~Capability.PULL)


def v2(versions: list[int], caps: int = ALL) -> RankDescriptorV2:
    return RankDescriptorV2(versions=versions, capabilities=caps, abi=ABI_MSGPACK_V1)


async def launch_with(descriptors: dict[tuple[Role, int], Any], **kw: Any) -> Deployment:
    """`Deployment.launch`, with the ranks named in `descriptors` advertising
    that descriptor (`RankConfig.descriptor`) instead of the default."""
    dep = Deployment()
    dep.name = f"kvh-neg-{uuid.uuid4().hex[:8]}"
    fault_plan = kw.pop("fault_plan", None)
    fields = {"ctx_tp": 1, "gen_tp": 1, "pool_blocks": POOL, "chunk_bytes": 64 << 10, "round_timeout_s": ROUND_TIMEOUT}
    cfg = checked(LaunchConfig, **{**fields, **kw})
    plans = [
        (
            spec,
            [
                msgspec.structs.replace(c, descriptor=descriptors[(spec.role, c.rank)])
                if (spec.role, c.rank) in descriptors
                else c
                for c in configs
            ],
            resources,
        )
        for spec, configs, resources in dep._plan(cfg, fault_plan)
    ]
    dep._reclaim_timeout_s = 60.0
    try:
        await dep._start(plans, cfg)
    except BaseException:
        await dep._teardown()
        raise
    return dep


def run(coro):
    return asyncio.run(coro)


async def done_and_cancelled(dep: Deployment, tag: str) -> tuple[dict, HandoffResult, HandoffResult]:
    """The stats as launched, then a handoff `tag` run to its end and one
    (`tag`-cancel) cancelled mid-DMA."""
    before = await dep.stats()
    done = await dep.handoff(tag, TOKENS, timeout=TIMEOUT)
    cancelled = await handoff_cancel_at(dep, f"{tag}-cancel", TOKENS, "mid_dma", timeout=TIMEOUT)
    return before, done, cancelled


def assert_done_and_cancelled(done: HandoffResult, cancelled: HandoffResult, stats: dict, *, gen_tp: int) -> None:
    """After `done_and_cancelled`: the handoff completed with every byte
    verified (S2), the other ended cancelled, and nothing leaked (L2)."""
    assert done.outcome == "completed", done
    assert done.bytes_verified == gen_bytes(TOKENS, gen_tp)
    assert cancelled.outcome == "cancelled", cancelled
    assert_clean(stats)


# ---- refused: no common version, or a capability this build cannot run without ----------


@pytest.mark.parametrize(
    ("odd_one", "descriptor", "kind"),
    [
        # An older rank (v1 only) among ranks that speak only v2: no common version.
        ((Role.CTX, 1), RankDescriptorV1(version=1, capabilities=ALL), "version"),
        # A v2 rank without TERMINAL evidence: v2 is common, but this build's
        # session machines cannot end an edge without TERMINAL.
        ((Role.GEN, 0), v2([1, 2], ALL & ~Capability.TERMINAL_V1), "capability"),
    ],
    ids=["v1-rank-among-v2-only", "gen-without-terminal"],
)
def test_mismatch_is_refused_before_any_dma(ray_cluster, odd_one, descriptor, kind) -> None:
    async def scenario():
        descriptors = {(Role.CTX, 0): v2([2]), (Role.CTX, 1): v2([2]), (Role.GEN, 0): v2([2])}
        descriptors[odd_one] = descriptor
        dep = await launch_with(descriptors, ctx_tp=2, gen_tp=1)
        try:
            before = await dep.stats()
            results = [await dep.handoff(f"refused-{i}", TOKENS, timeout=TIMEOUT) for i in range(2)]
            return before, results, await settled_stats(dep, TIMEOUT)
        finally:
            await dep.shutdown()

    before, results, stats = run(scenario())
    # Every rank computed the same refusal from the same descriptors.
    for s in before["ranks"]:
        assert s["negotiated"]["error"] == kind, s["negotiated"]
        assert s["conservative"] is True, s
    assert len({s["negotiated"]["detail"] for s in before["ranks"]}) == 1
    # Refused at admission, on every rank: nothing leased, posted or leaked.
    assert [r.outcome for r in results] == ["rejected", "rejected"], results
    assert_clean(stats)
    for s in stats["ranks"]:
        assert s["counters"].get(f"refused_negotiation_{kind}", 0) == 2, s["counters"]
        assert s["posted_chunks"] == 0, s  # no DMA, ever
        assert s["free"] == s["pool"], s


def test_open_without_agreement_is_answered_with_a_typed_reject(ray_cluster) -> None:
    """Both instances admitted the request; then the CTX rank learns a
    descriptor set with no common version first (here: its own descriptor
    becomes a v1 one, as if it came back as an older build) while the GEN rank
    still holds the v2 agreement. The GEN's OPEN is refused before any DMA
    with REJECT(NEGOTIATION), written in the OPEN's version so that the GEN
    reads it; the GEN side ends at once (NOT_STARTED), the request is
    cancelled everywhere, nothing was posted, every pool is back to free."""

    async def scenario():
        dep = await launch_with(
            {(Role.CTX, 0): v2([2]), (Role.GEN, 0): v2([2])}, transfer_timeout_s=60.0, fault_plan=FaultPlan()
        )
        try:
            ctx, gen = (await dep.ranks(Role.CTX))[0], (await dep.ranks(Role.GEN))[0]
            parent = ParentKey(request_id="late-mismatch", ctx_attempt=0, gen_attempt=0)
            # CTX first; GEN's ranks open when they apply their admission.
            admitted = [await dep.coordinator(Role.CTX).admit.remote(parent, TOKENS)]
            older = descriptor_frame(RankDescriptorV1(version=1, capabilities=ALL))
            await inside(ctx, lambda self: setattr(self, "_descriptor", older))
            await ctx.connect.remote()  # negotiates again: no common version now
            await hold_frames(ctx, "late-mismatch", Role.GEN, 0)
            admitted.append(await dep.coordinator(Role.GEN).admit.remote(parent, TOKENS))
            deadline = time.monotonic() + TIMEOUT
            held: list[bytes] = []
            while not held and time.monotonic() < deadline:
                held = await inside(ctx, lambda self: [f for _, f in self.faults.frames[("late-mismatch", "gen", 0)]])
                await asyncio.sleep(0.02)
            await release_frames(ctx, "late-mismatch", Role.GEN, 0)
            gen_outcome = await gen.wait.remote(parent, TIMEOUT)
            # What the client does with an attempt that did not complete: cancel
            # it in the CTX instance too (nothing was posted: released at once).
            await dep.coordinator(Role.CTX).cancel.remote(parent)
            ctx_outcome = await ctx.wait.remote(parent, TIMEOUT)
            return admitted, held, gen_outcome, ctx_outcome, await settled_stats(dep, TIMEOUT)
        finally:
            await dep.shutdown()

    admitted, held, gen_outcome, ctx_outcome, stats = run(scenario())
    assert list(admitted) == [True, True]
    assert len(held) == 1, held
    assert held[0][4] == 2  # the version of the OPEN it answers (the GEN's agreed one)
    reject = decode_frame(held[0], version=2)
    assert isinstance(reject, Reject), reject
    assert reject.reason is RejectReason.NEGOTIATION, reject
    assert "no common protocol version" in reject.detail, reject
    assert gen_outcome in ("cancelled", "released"), gen_outcome  # not "timeout", not quarantined
    assert ctx_outcome in ("cancelled", "released"), ctx_outcome
    assert_clean(stats)
    ctx, gen = (next(s for s in stats["ranks"] if s["role"] == r) for r in ("ctx", "gen"))
    assert ctx["negotiated"]["error"] == "version", ctx["negotiated"]
    assert gen["negotiated"]["version"] == 2, gen["negotiated"]
    assert ctx["counters"].get("refused_negotiation_version", 0) == 1, ctx["counters"]
    for s in stats["ranks"]:
        assert s["posted_chunks"] == 0, s
        assert s["free"] == s["pool"], s


# ---- a compatible mix: agreed on v2, the active protocol, frames in v2 ------------------------


def test_compatible_mix_agrees_on_v2_and_completes(ray_cluster) -> None:
    """One rank offers [1, 2], the others only [2]: every rank agrees on v2 with
    every capability, the active cancel protocol runs, a handoff completes,
    and a frame written in v1 is refused by its version."""

    async def scenario():
        descriptors = {(Role.CTX, 0): v2([1, 2]), (Role.CTX, 1): v2([2]), (Role.GEN, 0): v2([2])}
        dep = await launch_with(descriptors, ctx_tp=2, gen_tp=1, fault_plan=FaultPlan(defer_s=0.2))
        try:
            before, done, cancelled = await done_and_cancelled(dep, "mix")
            stats = await wait_stats(dep, lambda s: True, TIMEOUT)
            # A well-formed OPEN in v1 (which every rank speaks, but which was not agreed).
            ctx = (await dep.ranks(Role.CTX))[0]
            accepted = await ctx.receive_frame.remote(encode_frame(_open(dep, "v1-open"), version=1))
            refused = (await ctx.stats.remote())["counters"]
            return before, done, cancelled, stats, accepted, refused
        finally:
            await dep.shutdown()

    before, done, cancelled, stats, accepted, refused = run(scenario())
    for s in before["ranks"]:
        assert s["negotiated"] == {"version": 2, "capabilities": ALL, "abi": ABI_MSGPACK_V1, "active_cancel": True}, s
        assert s["conservative"] is False, s
    assert_done_and_cancelled(done, cancelled, stats, gen_tp=1)
    for s in stats["ranks"]:
        if s["role"] == "ctx":
            assert s["counters"].get("cancel_deferred", 0) == 0, s["counters"]  # active: drained, not deferred
    assert accepted is False
    assert refused.get("refused_FrameError", 0) == 1, refused


def test_an_open_is_packed_only_where_every_rank_negotiated_it(ray_cluster) -> None:
    """The GEN describes a lease of `RUNS_FROM_BLOCKS` blocks or more as runs
    (a fresh pool's lease is one run) when every rank of both instances
    offered BLOCK_RUNS, and a smaller one packed (arrays, no per-block
    descriptor); packed both when one rank offered PACKED_BLOCKS only; one
    descriptor per block when one rank offered neither (an older build
    could not read those forms). Each way the bytes arrive and are verified."""
    from kvhandoff.actors.rank._gen import RUNS_FROM_BLOCKS

    no_runs = v2([2], ALL & ~int(Capability.BLOCK_RUNS))
    without = v2([2], ALL & ~int(Capability.PACKED_BLOCKS | Capability.BLOCK_RUNS))
    tiny = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_block=1)
    sizes = (3, RUNS_FROM_BLOCKS)

    async def one(descriptors: dict[tuple[Role, int], Any]) -> tuple[list[Any], dict[str, int], Any]:
        dep = await launch_with(descriptors, ctx_tp=2, gen_tp=1, layout=tiny, pool_blocks=2 * RUNS_FROM_BLOCKS)
        try:
            done = [await dep.handoff(f"n{n}", n, timeout=TIMEOUT) for n in sizes]
            gen = (await dep.ranks(Role.GEN))[0]
            counters = (await gen.stats.remote())["counters"]
            return done, counters, await wait_stats(dep, lambda s: True, TIMEOUT)
        finally:
            await dep.shutdown()

    async def scenario():
        return await one({}), await one({(Role.CTX, 1): no_runs}), await one({(Role.CTX, 1): without})

    arms = run(scenario())
    for done, _, stats in arms:
        assert [d.outcome for d in done] == ["completed"] * 2, done
        assert [d.bytes_verified for d in done] == [n * block_bytes(tiny, 1) for n in sizes], done
        assert_clean(stats)
    # tp 2 -> 1: the GEN rank opens one edge per CTX rank, all in one form.
    forms = ("opens_runs", "opens_packed", "opens_listed")
    expected = ({"opens_runs": 1, "opens_packed": 1}, {"opens_packed": 2}, {"opens_listed": 2})
    for (_, counters, _), want in zip(arms, expected):
        assert {f: counters.get(f, 0) for f in forms} == {f: want.get(f, 0) for f in forms}, counters
    caps = [stats["ranks"][0]["negotiated"]["capabilities"] for _, _, stats in arms]
    assert caps == [ALL, ALL & ~int(Capability.BLOCK_RUNS), ALL & ~int(Capability.PACKED_BLOCKS | Capability.BLOCK_RUNS)]


def _open(dep: Deployment, request_id: str) -> Open:
    ctx = Endpoint(ns=RankNamespace(instance_id=dep.ctx_spec.instance_id, role=Role.CTX, rank=0), epoch=1)
    gen = Endpoint(ns=RankNamespace(instance_id=dep.gen_spec.instance_id, role=Role.GEN, rank=0), epoch=1)
    size = block_bytes(DEFAULT_LAYOUT, dep.gen_spec.tp)
    return Open(
        ticket=ContextTicket(
            request_id=request_id, ctx_attempt=1, gen_attempt=1, ctx=ctx, gen=gen,
            ctx_digest=topology_digest(dep.ctx_spec), gen_digest=topology_digest(dep.gen_spec),
        ),
        buffer=BufferInfo(
            agent_name="x", endpoint_epoch=1, memory=MemoryKind.DRAM,
            blocks=[BlockDescriptor(0, 1, 0x1000, size)],
        ),
        num_tokens=16,
    )


# ---- a missing optional capability: the conservative path -----------------------------------


def test_without_inflight_cancel_the_ctx_runs_the_conservative_path(ray_cluster) -> None:
    """One GEN rank lacks INFLIGHT_CANCEL: every rank agrees on v2 without it,
    handoffs still complete, and a cancel mid-DMA waits for the decided
    transfer (the conservative path) instead of draining it."""

    async def scenario():
        descriptors = {(Role.GEN, 1): v2([1, 2], ALL & ~Capability.INFLIGHT_CANCEL)}
        dep = await launch_with(descriptors, ctx_tp=1, gen_tp=2, fault_plan=FaultPlan(defer_s=0.2))
        try:
            before, done, cancelled = await done_and_cancelled(dep, "cons")
            return before, done, cancelled, await wait_stats(dep, lambda s: True, TIMEOUT)
        finally:
            await dep.shutdown()

    before, done, cancelled, stats = run(scenario())
    caps = ALL & ~Capability.INFLIGHT_CANCEL
    for s in before["ranks"]:
        assert s["negotiated"] == {"version": 2, "capabilities": caps, "abi": ABI_MSGPACK_V1, "active_cancel": False}, s
        assert s["conservative"] is True, s
    assert_done_and_cancelled(done, cancelled, stats, gen_tp=2)
    ctx = next(s for s in stats["ranks"] if s["role"] == "ctx")
    assert ctx["counters"].get("cancel_deferred", 0) >= 1, ctx["counters"]
