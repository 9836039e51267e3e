"""End to end with engine memory layouts (topology/_memory.py): real Ray, real
NIXL agents moving real host bytes between rank memories of the paged,
paged_hnd and split kinds. Synthetic mode writes each request's pattern
through the logical block view on CTX and verifies every byte through it on
GEN (S2), so a byte landing at a wrong physical place fails the handoff."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvhandoff.actors import Deployment, InvalidConfig
from kvhandoff.actors._faults import FaultPlan
from kvhandoff.topology import KVLayout, block_bytes

from .helpers import assert_clean, settled_stats
from .test_e2e import cancel_mid_dma

pytestmark = pytest.mark.ray

TIMEOUT = 20.0
ROUND_TIMEOUT = 20.0
FP16 = KVLayout(num_layers=3, num_kv_heads=4, head_dim=32, dtype="float16", tokens_per_block=8)
FP8 = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float8_e4m3fn", tokens_per_block=16)

CASES = [
    ("paged", FP16, 2, 1),
    ("paged_hnd", FP16, 1, 2),
    ("split", FP16, 2, 2),
    ("split", FP8, 2, 1),
    ("paged", FP8, 1, 2),
    ("paged_hnd", FP8, 2, 1),
]


def run(coro):
    return asyncio.run(coro)


def gen_total(layout: KVLayout, tokens: int, gen_tp: int) -> int:
    return math.ceil(tokens / layout.tokens_per_block) * block_bytes(layout, gen_tp) * gen_tp


@pytest.mark.parametrize(
    ("kind", "layout", "ctx_tp", "gen_tp"),
    [pytest.param(*c, id=f"{c[0]}-{c[1].dtype}-ctx{c[2]}-gen{c[3]}") for c in CASES],
)
def test_handoffs_verify_every_byte_in_engine_layouts(ray_cluster, kind, layout, ctx_tp, gen_tp) -> None:
    async def scenario():
        dep = await Deployment.launch(
            ctx_tp=ctx_tp, gen_tp=gen_tp, layout=layout, pool_blocks=16, chunk_bytes=8 << 10,
            memory_kind=kind, round_timeout_s=ROUND_TIMEOUT, data_mode="direct",  # staged: test_staged.py
        )
        try:
            # Sequential, then concurrent: blocks are reused across requests.
            results = [await dep.handoff(f"{kind}-{i}", 21 + 17 * i, timeout=TIMEOUT) for i in range(2)]
            results += await asyncio.gather(
                *(dep.handoff(f"{kind}-c{i}", 9 + 11 * i, timeout=TIMEOUT) for i in range(3))
            )
            return results, await settled_stats(dep)
        finally:
            await dep.shutdown()

    results, stats = run(scenario())
    tokens = [21, 38, 9, 20, 31]
    for r, n in zip(results, tokens):
        assert r.outcome == "completed", r
        assert r.bytes_verified == gen_total(layout, n, gen_tp)
    assert_clean(stats)
    for s in stats["ranks"]:
        if s["role"] == "ctx":
            assert s["counters"].get("posts_prepared", 0) >= 1, s["counters"]
            assert s["counters"].get("prepare_failed", 0) == 0, s["counters"]


def test_built_path_with_a_paged_kind(ray_cluster) -> None:
    """Prepared lists off: each chunk's regions come from the GEN's registered
    regions at post time; the same bytes land."""

    async def scenario():
        dep = await Deployment.launch(
            ctx_tp=2, gen_tp=1, layout=FP16, pool_blocks=16, chunk_bytes=8 << 10, memory_kind="split",
            prepared_descriptors=False, round_timeout_s=ROUND_TIMEOUT, data_mode="direct",
        )
        try:
            return await dep.handoff("built", 40, timeout=TIMEOUT), await settled_stats(dep)
        finally:
            await dep.shutdown()

    result, stats = run(scenario())
    assert result.outcome == "completed" and result.bytes_verified == gen_total(FP16, 40, 1)
    assert_clean(stats)
    ctx = [s for s in stats["ranks"] if s["role"] == "ctx"]
    assert all(s["counters"].get("posts_built", 0) >= 1 and not s["counters"].get("posts_prepared") for s in ctx)


def test_mid_dma_cancel_on_a_paged_kind_leaves_pools_whole(ray_cluster) -> None:
    """The cancelled request's chunks land late into paged memory; the next
    request reuses the same blocks at once and still verifies every byte."""

    async def scenario():
        dep = await Deployment.launch(
            round_timeout_s=ROUND_TIMEOUT, ctx_tp=2, gen_tp=1, layout=FP16,
            pool_blocks=math.ceil(100 / FP16.tokens_per_block), chunk_bytes=8 << 10, memory_kind="paged",
            fault_plan=FaultPlan(defer_s=0.2), transfer_timeout_s=5.0,
        )
        try:
            cancelled, phases = await cancel_mid_dma(dep, "paged-cancel")
            fresh = await dep.handoff("paged-fresh", 100, timeout=TIMEOUT)
            return cancelled, phases, fresh, await settled_stats(dep)
        finally:
            await dep.shutdown()

    cancelled, phases, fresh, stats = run(scenario())
    assert cancelled.outcome == "cancelled" and cancelled.bytes_verified == 0
    assert any("draining" in ph["edges"] for ph in phases), phases
    assert fresh.outcome == "completed" and fresh.bytes_verified == gen_total(FP16, 100, 1)
    assert_clean(stats)


def test_unknown_memory_kind_is_an_invalid_config() -> None:
    with pytest.raises(InvalidConfig, match="memory_kind.*'paged'"):  # the field, and what it may be
        run(Deployment.launch(memory_kind="vllm"))  # refused before any actor starts
