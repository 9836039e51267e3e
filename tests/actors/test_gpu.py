"""End to end in GPU memory: real Ray, real NIXL over UCX, one GPU per rank.

Skipped unless this machine has two GPUs (CTX tp=1 -> GEN tp=1, VRAM). The same
checks as test_e2e.py, where the bytes live in HBM and move GPU to GPU: every
byte verified (S2), a mid-DMA cancel with late-landing writes followed at once
by reuse of the same GEN blocks (S1), both descriptor paths (prepared lists and
descriptors built per chunk), and no leak (L2). The staged tests need one GPU
(CTX tp=2 -> GEN tp=1 ranks share it): gathers and scatters are queued CUDA
kernels there, so they check that a WRITE leaves only after its gather ran, a
chunk is DONE only after its scatter ran, and blocks go back only after every
scatter into them ran (a cancel mid-DMA, then the same blocks reused at once).
Run on the GPU machine with

    python -m pytest -q tests/actors/test_gpu.py --confcutdir tests/actors
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from kvhandoff.actors._faults import FaultPlan
from kvhandoff.actors.deployment import DEFAULT_LAYOUT, Deployment
from kvhandoff.cli.harness import handoff_cancel_at
from kvhandoff.topology import KVLayout, block_bytes
from tests.actors.helpers import (
    assert_clean,
    assert_completed,
    assert_reused_clean,
    cancel_then_reuse,
    gen_bytes,
    run,
    settled_stats,
    then_shutdown,
)
from tests.actors.test_e2e import cancel_mid_dma

pytestmark = pytest.mark.ray
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one per rank)")
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

TOKENS = 1000  # 63 blocks of 16 tokens
TIMEOUT = 30.0
DEFER_S = 0.05


async def _launch(**kw) -> Deployment:
    return await Deployment.launch(
        ctx_tp=1, gen_tp=1, memory="VRAM", round_timeout_s=20.0, transfer_timeout_s=10.0, **kw
    )


@two_gpus
@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "built"])
def test_vram_handoffs_verify_every_byte(ray_cluster, prepared: bool) -> None:
    async def scenario():
        dep = await _launch(pool_blocks=256, chunk_bytes=1 << 20, prepared_descriptors=prepared)
        try:
            sizes = [TOKENS, 37, 2 * TOKENS, 511]
            results = await asyncio.gather(
                *(dep.handoff(f"gpu-{i}", n, timeout=TIMEOUT) for i, n in enumerate(sizes))
            )
            return sizes, results, await settled_stats(dep)
        finally:
            await dep.shutdown()

    sizes, results, stats = run(scenario())
    assert_completed(results, [gen_bytes(n, 1) for n in sizes])
    assert_clean(stats)
    ctx = next(s for s in stats["ranks"] if s["role"] == "ctx")
    used, unused = ("posts_prepared", "posts_built") if prepared else ("posts_built", "posts_prepared")
    assert ctx["counters"].get(used, 0) >= len(sizes), ctx["counters"]
    assert ctx["counters"].get(unused, 0) == 0, ctx["counters"]


@two_gpus
def test_vram_mid_dma_cancel_then_immediate_reuse_sees_no_stale_bytes(ray_cluster) -> None:
    """GEN's pool holds exactly one request; the cancelled request's chunks land
    late (deferred by the fault plan, moved by the real agent), and the next
    request takes the same blocks at once: any early release would show up as
    foreign bytes in its verification."""
    blocks = math.ceil(TOKENS / DEFAULT_LAYOUT.tokens_per_block)

    async def scenario():
        dep = await _launch(
            pool_blocks=blocks, chunk_bytes=256 << 10, fault_plan=FaultPlan(defer_s=DEFER_S)
        )

        def cancel(request_id: str) -> Any:
            return handoff_cancel_at(dep, request_id, TOKENS, "mid_dma", timeout=TIMEOUT)

        return await then_shutdown(dep, cancel_then_reuse(dep, cancel, TOKENS, "gpu", rounds=3, timeout=TIMEOUT))

    outcomes, stats = run(scenario())
    assert_reused_clean(outcomes, stats, gen_bytes(TOKENS, 1))


PAGED = KVLayout(num_layers=3, num_kv_heads=4, head_dim=32, dtype="float16", tokens_per_block=8)


def _share() -> float:
    return 0.5 if torch.cuda.device_count() >= 2 else 0.33  # three ranks


def _staged_sum(stats: dict, role: str, key: str) -> int:
    return sum(s["staging"].get("counters", {}).get(key, 0) for s in stats["ranks"] if s["role"] == role)


@one_gpu
@pytest.mark.parametrize("window", [1, 4])
def test_vram_staged_handoffs_verify_every_byte(ray_cluster, window: int) -> None:
    """Forced staged, CTX 2 -> GEN 1 in HBM: every chunk is a slot's WRITE,
    every ACK a scatter that ran, every byte verified, every slot back."""

    async def scenario():
        dep = await Deployment.launch(
            ctx_tp=2, gen_tp=1, layout=PAGED, pool_blocks=64, chunk_bytes=8 << 10, memory="VRAM",
            memory_kind="paged", gpus_per_rank=_share(), round_timeout_s=20.0, transfer_timeout_s=10.0,
            data_mode="staged", staging_window=window,
        )
        try:
            sizes = [21, 200, 9, 77, 131]
            results = [await dep.handoff("gst-0", sizes[0], timeout=TIMEOUT)]
            results += await asyncio.gather(*(dep.handoff(f"gst-{i}", n, timeout=TIMEOUT) for i, n in enumerate(sizes[1:], 1)))
            return sizes, results, await settled_stats(dep)
        finally:
            await dep.shutdown()

    sizes, results, stats = run(scenario())
    assert_completed(results, [math.ceil(n / PAGED.tokens_per_block) * block_bytes(PAGED, 1) for n in sizes])
    assert_clean(stats)
    posted = sum(s["posted_chunks"] for s in stats["ranks"] if s["role"] == "ctx")
    assert _staged_sum(stats, "ctx", "staged_chunks") == posted > 0
    assert _staged_sum(stats, "ctx", "acks") == posted
    assert _staged_sum(stats, "gen", "scattered") == posted
    assert all(s["in_flight_chunks"] == 0 for s in stats["ranks"])


@one_gpu
def test_vram_staged_mid_dma_cancel_then_reuse_sees_no_stale_bytes(ray_cluster) -> None:
    """Staged in HBM, the GEN pool holding one request: chunks held in flight
    land after the cancel; the next request takes the same blocks at once and
    verifies every byte, so no late scatter (a queued kernel) wrote them."""
    tokens = 160  # 20 blocks of a pool of 20

    async def scenario():
        dep = await Deployment.launch(
            ctx_tp=2, gen_tp=1, layout=PAGED, pool_blocks=20, chunk_bytes=4 << 10, memory="VRAM",
            memory_kind="paged", gpus_per_rank=_share(), round_timeout_s=20.0, transfer_timeout_s=10.0,
            data_mode="staged", staging_window=2, fault_plan=FaultPlan(defer_s=DEFER_S),
        )

        async def cancel(request_id: str) -> object:
            return (await cancel_mid_dma(dep, request_id))[0]

        return await then_shutdown(dep, cancel_then_reuse(dep, cancel, tokens, "gs", rounds=3, timeout=TIMEOUT))

    outcomes, stats = run(scenario())
    assert_reused_clean(outcomes, stats, tokens // PAGED.tokens_per_block * block_bytes(PAGED, 1))
    assert _staged_sum(stats, "ctx", "staged_chunks") > 0
