"""Memory kinds: the places of KV rows in engine layouts, and the edge pieces
between two kinds.

The simulation keeps, per rank, one byte array per region, filled from the row
places of an independent oracle (the tensor shapes of each kind, written here
with plain index arithmetic, not with `row_place`). It applies the pieces of
every edge to every block and checks that every GEN byte holds what the logical
KV says, and that every GEN byte is written exactly once.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol import TopologyError
from kvhandoff.topology import (
    MEMORY_KINDS,
    KVLayout,
    UnknownEdgeError,
    UnknownMemoryKindError,
    check_memory_kind,
    memory_pieces,
    memory_regions,
    region_block_bytes,
    row_place,
    shard_map,
)


def layout(layers: int = 2, heads: int = 4, head_dim: int = 2, dtype: str = "float16", tpb: int = 2) -> KVLayout:
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, dtype=dtype, tokens_per_block=tpb)


def oracle_place(kind: str, lo: KVLayout, hl: int, layer: int, kv: int, h: int, t: int) -> tuple[int, int]:
    """(region, element index in the region's block) from the tensor shapes."""
    L, T = lo.num_layers, lo.tokens_per_block
    if kind == "blocked":  # [L, 2, Hl, T] rows
        return 0, ((layer * 2 + kv) * hl + h) * T + t
    if kind == "paged":  # per layer [2, T, Hl] rows
        return layer, (kv * T + t) * hl + h
    if kind == "paged_hnd":  # per layer [2, Hl, T] rows
        return layer, (kv * hl + h) * T + t
    if kind == "paged_interleaved":  # per layer [Hl, T, 2] rows
        return layer, (h * T + t) * 2 + kv
    assert kind == "split"  # per (layer, kv) [T, Hl] rows
    assert L
    return 2 * layer + kv, t * hl + h


def value(block: int, layer: int, kv: int, gh: int, t: int, d: int) -> int:
    return (block * 131 + layer * 71 + kv * 37 + gh * 13 + t * 7 + d * 3 + 1) % 251


def rank_memory(kind: str, lo: KVLayout, tp: int, rank: int, blocks: int, fill: bool) -> list[bytearray]:
    hl = lo.num_kv_heads // tp
    stride = region_block_bytes(kind, lo, tp)
    mem = [bytearray(blocks * stride) for _ in range(memory_regions(kind, lo))]
    if not fill:
        return mem
    row = lo.head_dim * lo.dtype_bytes
    for b in range(blocks):
        for layer in range(lo.num_layers):
            for kv in (0, 1):
                for h in range(hl):
                    for t in range(lo.tokens_per_block):
                        r, i = oracle_place(kind, lo, hl, layer, kv, h, t)
                        start = b * stride + i * row
                        mem[r][start : start + row] = bytes(
                            value(b, layer, kv, rank * hl + h, t, d) for d in range(row)
                        )
    return mem


def simulate(lo: KVLayout, ctx_tp: int, gen_tp: int, ctx_kind: str, gen_kind: str, blocks: int = 2) -> None:
    sm = shard_map(lo, ctx_tp, gen_tp)
    ctx = [rank_memory(ctx_kind, lo, ctx_tp, c, blocks, True) for c in range(ctx_tp)]
    gen = [rank_memory(gen_kind, lo, gen_tp, g, blocks, False) for g in range(gen_tp)]
    writes = [[bytearray(len(r)) for r in m] for m in gen]
    s_src, s_dst = region_block_bytes(ctx_kind, lo, ctx_tp), region_block_bytes(gen_kind, lo, gen_tp)
    for c, g in sm.edges:
        pieces = memory_pieces(sm, (c, g), ctx_kind, gen_kind)
        assert sum(p[4] for p in pieces) == sm.edge_bytes_per_block((c, g))
        assert list(pieces) == sorted(pieces)
        for sr, so, dr, do, n in pieces:
            assert n > 0 and so + n <= s_src and do + n <= s_dst
            for b in range(blocks):
                src, dst = b * s_src + so, b * s_dst + do
                gen[g][dr][dst : dst + n] = ctx[c][sr][src : src + n]
                for i in range(dst, dst + n):
                    writes[g][dr][i] += 1
    expected = [rank_memory(gen_kind, lo, gen_tp, g, blocks, True) for g in range(gen_tp)]
    for g in range(gen_tp):
        for r in range(len(gen[g])):
            assert set(writes[g][r]) == {1}, f"gen {g} region {r}: a byte written {set(writes[g][r])} times"
            assert gen[g][r] == expected[g][r], f"gen {g} region {r} differs"


# -- kinds, regions, places ----------------------------------------------------------


def test_kind_names_are_checked() -> None:
    assert MEMORY_KINDS == ("blocked", "paged", "paged_hnd", "split", "paged_interleaved")
    for kind in MEMORY_KINDS:
        assert check_memory_kind(kind) == kind
    for bad in ("Paged", "", None, 3, "nhd"):
        with pytest.raises(UnknownMemoryKindError) as err:
            check_memory_kind(bad)
        assert isinstance(err.value, TopologyError) and err.value.kind == bad
    with pytest.raises(UnknownMemoryKindError):
        memory_regions("hnd", layout())
    with pytest.raises(UnknownMemoryKindError):
        memory_pieces(shard_map(layout(), 1, 1), (0, 0), "blocked", "vllm")


def test_regions_and_strides() -> None:
    lo = layout(layers=3, heads=8, head_dim=64, dtype="bfloat16", tpb=16)
    e, hl = 2, 4  # tp 2
    assert [memory_regions(k, lo) for k in MEMORY_KINDS] == [1, 3, 3, 6, 3]
    assert region_block_bytes("blocked", lo, 2) == 3 * 2 * hl * 16 * 64 * e
    assert region_block_bytes("paged", lo, 2) == 2 * 16 * hl * 64 * e
    assert region_block_bytes("paged_hnd", lo, 2) == 2 * 16 * hl * 64 * e
    assert region_block_bytes("split", lo, 2) == 16 * hl * 64 * e
    assert region_block_bytes("paged_interleaved", lo, 2) == 2 * 16 * hl * 64 * e
    row = 64 * e
    assert row_place("blocked", lo, 2, layer=1, kv=1, head=2, token=5) == (0, (((1 * 2 + 1) * hl + 2) * 16 + 5) * row)
    assert row_place("paged", lo, 2, layer=1, kv=1, head=2, token=5) == (1, ((1 * 16 + 5) * hl + 2) * row)
    assert row_place("paged_hnd", lo, 2, layer=1, kv=1, head=2, token=5) == (1, ((1 * hl + 2) * 16 + 5) * row)
    assert row_place("split", lo, 2, layer=1, kv=1, head=2, token=5) == (3, (5 * hl + 2) * row)
    assert row_place("paged_interleaved", lo, 2, layer=1, kv=1, head=2, token=5) == (1, ((2 * 16 + 5) * 2 + 1) * row)
    for bad in ({"layer": 3}, {"kv": 2}, {"head": 4}, {"token": 16}, {"layer": -1}):
        args = {"layer": 0, "kv": 0, "head": 0, "token": 0, **bad}
        with pytest.raises(TopologyError):
            row_place("paged", lo, 2, **args)


@pytest.mark.parametrize("kind", MEMORY_KINDS)
def test_every_row_has_its_own_place_inside_the_block(kind: str) -> None:
    lo = layout(layers=2, heads=6, head_dim=3, dtype="float32", tpb=5)
    tp = 2
    stride, row = region_block_bytes(kind, lo, tp), 3 * 4
    seen = set()
    for layer in range(2):
        for kv in (0, 1):
            for h in range(3):
                for t in range(5):
                    r, off = row_place(kind, lo, tp, layer=layer, kv=kv, head=h, token=t)
                    assert 0 <= r < memory_regions(kind, lo) and off % row == 0 and off + row <= stride
                    seen.add((r, off))
    assert len(seen) == 2 * 2 * 3 * 5 == memory_regions(kind, lo) * stride // row


# -- pieces -------------------------------------------------------------------------


@pytest.mark.parametrize("tps", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (3, 1), (1, 3)])
def test_blocked_to_blocked_is_the_shard_segments(tps: tuple[int, int]) -> None:
    lo = layout(layers=3, heads=12, head_dim=4, tpb=3)
    sm = shard_map(lo, *tps)
    for edge in sm.edges:
        segs = tuple((0, s.src_offset, 0, s.dst_offset, s.length) for s in sm.segments(edge))
        assert memory_pieces(sm, edge, "blocked", "blocked") == segs


@pytest.mark.parametrize("ctx_kind", MEMORY_KINDS)
@pytest.mark.parametrize("gen_kind", MEMORY_KINDS)
@pytest.mark.parametrize("tps", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (1, 4)])
def test_brute_force_every_gen_byte_once_and_right(ctx_kind: str, gen_kind: str, tps: tuple[int, int]) -> None:
    simulate(layout(layers=2, heads=4, head_dim=2, dtype="float16", tpb=3), *tps, ctx_kind, gen_kind)


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads_per=st.integers(1, 3),
    ctx_mult=st.sampled_from([1, 2, 4]),
    gen_mult=st.sampled_from([1, 2, 4]),
    head_dim=st.integers(1, 3),
    dtype=st.sampled_from(["float8_e4m3fn", "bfloat16", "float32"]),
    tpb=st.integers(1, 4),
    ctx_kind=st.sampled_from(MEMORY_KINDS),
    gen_kind=st.sampled_from(MEMORY_KINDS),
)
def test_property_pieces_over_layouts_tps_kinds(
    layers: int,
    heads_per: int,
    ctx_mult: int,
    gen_mult: int,
    head_dim: int,
    dtype: str,
    tpb: int,
    ctx_kind: str,
    gen_kind: str,
) -> None:
    # heads divisible by both TPs: heads = lcm-ish multiple
    heads = heads_per * 4
    lo = layout(layers=layers, heads=heads, head_dim=head_dim, dtype=dtype, tpb=tpb)
    simulate(lo, ctx_mult, gen_mult, ctx_kind, gen_kind, blocks=2)


#: Pieces per edge for 2 layers, 4 KV heads, head_dim 64, 16 tokens/block, fp16,
#: ctx_tp 2 -> gen_tp 1 (both edges alike), and for equal TP 2 -> 2.
EXPECTED_COUNTS_2_TO_1 = {
    ("blocked", "blocked"): 4,  # per (layer, kv): 2 of the 4 GEN head slabs
    ("blocked", "paged"): 128,  # every (layer, kv, head, token) row alone: t vs h innermost
    ("paged", "paged"): 64,  # per (layer, kv, token): the 2 heads side by side
    ("paged_hnd", "paged_hnd"): 4,  # per (layer, kv): 2 heads x all tokens
    ("split", "split"): 64,  # per (layer, kv, token): 2 of the 4 GEN heads
    ("paged", "split"): 64,  # per (layer, kv, token)
    ("paged_hnd", "blocked"): 4,  # same (kv, head, token) order inside a layer
    ("split", "paged"): 64,  # per (layer, kv, token)
    ("paged_interleaved", "paged_interleaved"): 2,  # per layer: the 2 heads lead the GEN block
    ("paged", "paged_interleaved"): 128,  # every (layer, kv, head, token) row alone
}


def test_piece_counts_for_a_representative_layout() -> None:
    lo = layout(layers=2, heads=4, head_dim=64, dtype="float16", tpb=16)
    sm = shard_map(lo, 2, 1)
    got = {kinds: len(memory_pieces(sm, (0, 0), *kinds)) for kinds in EXPECTED_COUNTS_2_TO_1}
    assert got == EXPECTED_COUNTS_2_TO_1
    assert {len(memory_pieces(sm, (1, 0), *kinds)) for kinds in EXPECTED_COUNTS_2_TO_1} >= {4}
    # Equal TP: one piece per region of the kind (the whole block of that region).
    eq = shard_map(lo, 2, 2)
    for kind in MEMORY_KINDS:
        pieces = memory_pieces(eq, (1, 1), kind, kind)
        stride = region_block_bytes(kind, lo, 2)
        assert pieces == tuple((r, 0, r, 0, stride) for r in range(memory_regions(kind, lo)))


def test_unknown_edge_is_refused_and_pieces_are_memoized() -> None:
    sm = shard_map(layout(), 2, 2)
    with pytest.raises(UnknownEdgeError):
        memory_pieces(sm, (0, 1), "paged", "paged")
    with pytest.raises(UnknownEdgeError):
        memory_pieces(sm, "edge", "paged", "paged")  # type: ignore[arg-type]
    assert memory_pieces(sm, (0, 0), "paged", "split") is memory_pieces(sm, (0, 0), "paged", "split")
