"""Staged gather and scatter between memory kinds and TPs: every chunk of
every edge gathered from the CTX memory into a slot and scattered from it into
the GEN memory lands every byte exactly where a direct WRITE would, and not one
byte more (host memory; the rank actors' staged handoffs are
tests/actors/test_staged.py)."""

from __future__ import annotations

import pytest
import torch

from kvhandoff.actors._dataplane import DataPlaneError, KVMemory, edge_pieces, plan_chunks
from kvhandoff.actors._staged import StagingArena, gather, scatter, stage_map, stage_unit
from kvhandoff.topology import KVLayout, memory_pieces, shard_map

from .test_memory_kinds import FP8, LAYOUT, engine_tensors, pattern

KINDS = [("paged", "paged"), ("paged_hnd", "split"), ("split", "paged"), ("blocked", "paged_hnd"), ("paged", "blocked"), ("blocked", "blocked")]


def _staged(ctx_kind: str, gen_kind: str, layout: KVLayout, dtype: torch.dtype, ctx_tp: int, gen_tp: int, chunk: int) -> None:
    nb = 6
    sm = shard_map(layout, ctx_tp, gen_tp)
    ctx = [KVMemory.from_tensors(ctx_kind, layout, ctx_tp, engine_tensors(ctx_kind, layout, ctx_tp, nb, dtype)) for _ in range(ctx_tp)]
    gen = [KVMemory.allocate(gen_kind, layout, gen_tp, nb) for _ in range(gen_tp)]
    ctx_blocks, gen_blocks = [0, 1, 2, 5], [4, 5, 0, 2]
    for c, m in enumerate(ctx):
        m.write_blocks(ctx_blocks, pattern(layout, ctx_tp, c, 4))
    for m in gen:
        m.fill_blocks(range(nb), 0xDB)
    ours, theirs = StagingArena(1, chunk), StagingArena(1, chunk)
    for c, g in sm.edges:
        pieces = edge_pieces(memory_pieces(sm, (c, g), ctx_kind, gen_kind), chunk)
        cu = stage_unit(pieces, 0, ctx[c].strides)
        gu = stage_unit(pieces, 1, gen[g].strides)
        for plan in plan_chunks(pieces, list(zip(ctx_blocks, gen_blocks)), chunk):
            ours.tensor.fill_(0x11)
            gather(ctx[c], ours.slot(0), stage_map(pieces, plan.local, 0, ctx[c], cu, "cpu"))
            theirs.tensor.copy_(ours.tensor)  # the WRITE
            scatter(gen[g], theirs.slot(0), stage_map(pieces, plan.remote, 1, gen[g], gu, "cpu"))
    for g, m in enumerate(gen):
        assert torch.equal(m.read_blocks(gen_blocks), pattern(layout, gen_tp, g, 4)), f"gen {g}"
        others = [b for b in range(nb) if b not in gen_blocks]
        assert set(m.read_blocks(others).unique().tolist()) == {0xDB}  # not one byte more


@pytest.mark.parametrize(("ctx_kind", "gen_kind"), KINDS)
@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(2, 1), (1, 2), (1, 1)])
@pytest.mark.parametrize("chunk", [256, 4096], ids=["small-chunks", "big-chunks"])
def test_gather_then_scatter_lands_every_byte(ctx_kind: str, gen_kind: str, ctx_tp: int, gen_tp: int, chunk: int) -> None:
    _staged(ctx_kind, gen_kind, LAYOUT, torch.float16, ctx_tp, gen_tp, chunk)


def test_fp8_and_odd_units() -> None:
    _staged("split", "paged", FP8, torch.float8_e4m3fn, 2, 2, 512)
    _staged("paged_hnd", "split", FP8, torch.float8_e4m3fn, 1, 2, 96)  # unit 32: not a power-of-two chunk


def test_a_chunk_larger_than_the_slot_or_outside_the_pool_is_refused() -> None:
    sm = shard_map(LAYOUT, 1, 1)
    mem = KVMemory.allocate("paged", LAYOUT, 1, 2)
    pieces = edge_pieces(memory_pieces(sm, (0, 0), "paged", "paged"), 1 << 12)
    unit = stage_unit(pieces, 0, mem.strides)
    plan = plan_chunks(pieces, [(0, 0), (1, 1)], 1 << 12)[0]
    small = StagingArena(1, 64)
    with pytest.raises(DataPlaneError):
        gather(mem, small.slot(0), stage_map(pieces, plan.local, 0, mem, unit, "cpu"))
    with pytest.raises(DataPlaneError):
        scatter(mem, small.slot(0), stage_map(pieces, plan.local, 0, mem, unit, "cpu"))
    with pytest.raises(DataPlaneError):
        stage_map(pieces, plan.local + 2 * len(pieces), 0, mem, unit, "cpu")  # blocks 2, 3 of 2
    with pytest.raises(DataPlaneError):
        StagingArena(2, 12)  # not a multiple of 8
    with pytest.raises(DataPlaneError):
        small.slot(1)


def test_units_follow_offsets_that_are_not_multiples_of_the_lengths() -> None:
    """Pieces of 16 B at offsets 8 and 40 of a 64 B block: the unit must be
    8 B (the offsets count), and the slot holds exactly those bytes, in order."""
    tensor = (torch.arange(4 * 64) % 251).to(torch.uint8).view(4, 64)
    mem = KVMemory("blocked", [tensor], 4, 64)
    pieces = ((0, 8, 0, 0, 16), (0, 40, 0, 16, 16))
    unit = stage_unit(pieces, 0, mem.strides)
    assert unit == 8
    plan = plan_chunks(pieces, [(3, 0), (1, 1)], 64)[0]
    slot = StagingArena(1, 64).slot(0)
    gather(mem, slot, stage_map(pieces, plan.local, 0, mem, unit, "cpu"))
    flat = tensor.view(-1)
    want = torch.cat([flat[3 * 64 + 8 : 3 * 64 + 24], flat[3 * 64 + 40 : 3 * 64 + 56], flat[64 + 8 : 64 + 24], flat[64 + 40 : 64 + 56]])
    assert torch.equal(slot[:64], want)
    out = KVMemory("blocked", [torch.zeros(4, 64, dtype=torch.uint8)], 4, 64)
    scatter(out, slot, stage_map(pieces, plan.local, 0, out, unit, "cpu"))
    assert torch.equal(out.flat[0][3, 8:24], tensor[3, 8:24]) and torch.equal(out.flat[0][1, 40:56], tensor[1, 40:56])
    assert int(out.flat[0][0].sum()) == 0 and int(out.flat[0][3, :8].sum()) == 0  # not one byte more
