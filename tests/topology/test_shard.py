"""KV layout and the heterogeneous-TP shard map.

The property tests check, over many shapes, that the segments of a shard map
tile every GEN block exactly once and read every CTX block exactly once; the
transfer simulations move real bytes with the segments (and with the NIXL
descriptor regions) and compare against the layout computed independently
from the full logical KV block.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol import TopologyError
from kvhandoff.topology import (
    DTYPE_BYTES,
    Edge,
    HeadSplitError,
    KVLayout,
    Segment,
    ShardMap,
    TopologyFieldError,
    UnknownEdgeError,
    block_bytes,
    block_offset,
    blocks_for_tokens,
    heads_per_rank,
    shard_map,
)


def layout(
    layers: int = 2, heads: int = 4, head_dim: int = 2, dtype: str = "float16", tpb: int = 2
) -> KVLayout:
    return KVLayout(
        num_layers=layers, num_kv_heads=heads, head_dim=head_dim, dtype=dtype, tokens_per_block=tpb
    )


# -- layout --------------------------------------------------------------------


def test_layout_sizes() -> None:
    lo = layout(layers=3, heads=8, head_dim=128, dtype="bfloat16", tpb=16)
    assert lo.dtype_bytes == 2
    assert lo.head_bytes == 16 * 128 * 2
    assert heads_per_rank(lo, 4) == 2
    assert block_bytes(lo, 1) == 3 * 2 * 8 * 16 * 128 * 2
    assert block_bytes(lo, 4) * 4 == block_bytes(lo, 1)
    assert {k: DTYPE_BYTES[k] for k in ("float16", "bfloat16", "float32", "fp8", "uint8")} == {
        "float16": 2,
        "bfloat16": 2,
        "float32": 4,
        "fp8": 1,
        "uint8": 1,
    }


def test_blocks_for_tokens_rounds_up() -> None:
    lo = layout(tpb=16)
    assert [blocks_for_tokens(lo, n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    for bad in (-1, 1.5, True):
        with pytest.raises(TopologyError):
            blocks_for_tokens(lo, bad)  # type: ignore[arg-type]


def test_block_offset_follows_layer_kv_head_token_dim_order() -> None:
    lo = layout(layers=2, heads=4, head_dim=2, tpb=2)  # slab = 2 tokens * 2 dims * 2 bytes = 8
    assert block_offset(lo, 2, layer=0, kv=0, head=0) == 0
    assert block_offset(lo, 2, layer=0, kv=0, head=1) == 8
    assert block_offset(lo, 2, layer=0, kv=1, head=0) == 16
    assert block_offset(lo, 2, layer=1, kv=1, head=1) == 56
    for kwargs in (
        {"layer": 2, "kv": 0, "head": 0},
        {"layer": 0, "kv": 2, "head": 0},
        {"layer": 0, "kv": 0, "head": 2},
    ):
        with pytest.raises(TopologyError):
            block_offset(lo, 2, **kwargs)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_layers", 0),
        ("num_kv_heads", 0),
        ("head_dim", -1),
        ("tokens_per_block", 0),
        ("num_layers", True),
        ("head_dim", 2.0),
        ("dtype", "float64"),
        ("num_kv_heads", 5000),
    ],
)
def test_bad_layout_fields(field: str, value: object) -> None:
    fields: dict[str, object] = {
        "num_layers": 2,
        "num_kv_heads": 4,
        "head_dim": 2,
        "dtype": "float16",
        "tokens_per_block": 2,
    }
    fields[field] = value
    with pytest.raises(TopologyFieldError) as info:
        KVLayout(**fields)  # type: ignore[arg-type]
    assert info.value.field == field


@pytest.mark.parametrize(("heads", "tp"), [(4, 3), (6, 4), (2, 4), (1, 2)])
def test_uneven_head_split_is_rejected(heads: int, tp: int) -> None:
    with pytest.raises(HeadSplitError) as info:
        heads_per_rank(layout(heads=heads), tp)
    assert (info.value.num_kv_heads, info.value.tp) == (heads, tp)
    with pytest.raises(HeadSplitError):
        shard_map(layout(heads=heads), 1, tp)
    with pytest.raises(HeadSplitError):
        shard_map(layout(heads=heads), tp, 1)


def test_bad_tp_is_rejected() -> None:
    for tp in (0, -1, True, 2.0, 2000):
        with pytest.raises(TopologyError):
            shard_map(layout(), tp, 1)  # type: ignore[arg-type]


# -- the worked example (docs/topology.md) ----------------------------------------


def test_worked_example_ctx_tp2_to_gen_tp4() -> None:
    m = shard_map(layout(layers=2, heads=4, head_dim=2, tpb=2), 2, 4)
    assert (m.ctx_block_bytes, m.gen_block_bytes) == (64, 32)
    assert m.edges == ((0, 0), (0, 1), (1, 2), (1, 3))
    assert m.edges_for_gen_rank(3) == ((1, 3),)
    assert m.edges_for_ctx_rank(1) == ((1, 2), (1, 3))
    # ctx rank 1 holds heads 2,3; gen rank 3 holds head 3 = ctx-local head 1.
    assert m.segments((1, 3)) == (
        Segment(src_offset=8, dst_offset=0, length=8),  # layer 0 K
        Segment(src_offset=24, dst_offset=8, length=8),  # layer 0 V
        Segment(src_offset=40, dst_offset=16, length=8),  # layer 1 K
        Segment(src_offset=56, dst_offset=24, length=8),  # layer 1 V
    )
    assert m.edge_bytes_per_block((1, 3)) == 32


def test_ctx_tp4_to_gen_tp2_merges_nothing_but_covers_gen_block() -> None:
    m = shard_map(layout(layers=2, heads=4), 4, 2)
    assert m.edges_for_gen_rank(0) == ((0, 0), (1, 0))
    # gen rank 0's block: [L0K h0 h1][L0V h0 h1][L1K ..][L1V ..]; ctx rank 1 fills every h1 slab.
    assert [s.dst_offset for s in m.segments((1, 0))] == [8, 24, 40, 56]
    assert [s.src_offset for s in m.segments((1, 0))] == [0, 8, 16, 24]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_equal_tp_is_identity_with_one_full_block_segment(tp: int) -> None:
    m = shard_map(layout(layers=3, heads=8), tp, tp)
    assert m.edges == tuple((r, r) for r in range(tp))
    for r in range(tp):
        assert m.edges_for_gen_rank(r) == ((r, r),) == m.edges_for_ctx_rank(r)
        assert m.segments((r, r)) == (
            Segment(src_offset=0, dst_offset=0, length=m.gen_block_bytes),
        )


def test_unknown_edges_and_ranks() -> None:
    m = shard_map(layout(heads=4), 2, 4)
    for edge in [(0, 2), (1, 0), (2, 0), (0, 4), (-1, 0), (0,), [0, 0], (0, True), "01"]:
        assert not m.has_edge(edge)
        with pytest.raises(UnknownEdgeError) as info:
            m.segments(edge)  # type: ignore[arg-type]
        assert info.value.edge == edge
    assert m.has_edge((0, 1))
    for bad in (-1, 4, True):
        with pytest.raises(TopologyError):
            m.edges_for_gen_rank(bad)
    with pytest.raises(TopologyError):
        m.edges_for_ctx_rank(2)


# -- properties over many shapes ---------------------------------------------------


@st.composite
def shapes(draw: st.DrawFn, max_layers: int = 4, max_dim: int = 8, max_tpb: int = 4) -> ShardMap:
    tc = draw(st.integers(1, 8))
    tg = draw(st.integers(1, 8))
    heads = math.lcm(tc, tg) * draw(st.integers(1, 3))
    lo = KVLayout(
        num_layers=draw(st.integers(1, max_layers)),
        num_kv_heads=heads,
        head_dim=draw(st.integers(1, max_dim)),
        dtype=draw(st.sampled_from(sorted(DTYPE_BYTES))),
        tokens_per_block=draw(st.integers(1, max_tpb)),
    )
    return shard_map(lo, tc, tg)


def _assert_tiles(intervals: list[tuple[int, int]], size: int) -> None:
    """The half-open intervals cover [0, size) exactly once: no gap, no overlap."""
    pos = 0
    for start, end in sorted(intervals):
        assert start == pos, f"gap or overlap at {pos} (next interval starts at {start})"
        assert end > start
        pos = end
    assert pos == size


def _assert_rank_tiled(
    m: ShardMap, edges: tuple[Edge, ...], offset: Callable[[Segment], int], block_bytes: int
) -> None:
    """The segments of a rank's `edges`, at `offset` on its side, tile its block exactly once."""
    _assert_tiles([(offset(s), offset(s) + s.length) for e in edges for s in m.segments(e)], block_bytes)
    assert sum(m.edge_bytes_per_block(e) for e in edges) == block_bytes


@settings(max_examples=300, deadline=None)
@given(shapes())
def test_segments_tile_every_gen_block_and_read_every_ctx_block_once(m: ShardMap) -> None:
    edges = m.edges
    assert set(edges) == {e for g in range(m.gen_tp) for e in m.edges_for_gen_rank(g)}
    assert set(edges) == {e for c in range(m.ctx_tp) for e in m.edges_for_ctx_rank(c)}
    assert len(edges) <= m.ctx_tp + m.gen_tp - 1
    for g in range(m.gen_tp):  # the edges into each GEN rank write its whole block once
        _assert_rank_tiled(m, m.edges_for_gen_rank(g), lambda s: s.dst_offset, m.gen_block_bytes)
    for c in range(m.ctx_tp):  # the edges out of each CTX rank read its whole block once
        _assert_rank_tiled(m, m.edges_for_ctx_rank(c), lambda s: s.src_offset, m.ctx_block_bytes)
    for e in edges:
        segs = m.segments(e)
        assert len(segs) <= 2 * m.layout.num_layers
        for s in segs:
            assert s.src_offset >= 0 and s.src_offset + s.length <= m.ctx_block_bytes
            assert s.dst_offset >= 0 and s.dst_offset + s.length <= m.gen_block_bytes
        # Merged maximally: no two consecutive segments continue each other on both sides.
        for a, b in zip(segs, segs[1:], strict=False):
            assert not (
                a.src_offset + a.length == b.src_offset and a.dst_offset + a.length == b.dst_offset
            )
    if m.ctx_tp == m.gen_tp:
        assert all(len(m.segments(e)) == 1 and e[0] == e[1] for e in edges)


def _full_block(m: ShardMap, rng: random.Random) -> bytes:
    """One block of the whole model's KV, [layer][kv][global head][token][dim]."""
    lo = m.layout
    return rng.randbytes(lo.num_layers * 2 * lo.num_kv_heads * lo.head_bytes)


def _rank_block(m: ShardMap, full: bytes, tp: int, rank: int) -> bytes:
    """Rank `rank`'s share of a full block, built from the layout definition."""
    lo = m.layout
    h = lo.num_kv_heads // tp
    slab = lo.head_bytes
    parts = []
    for lk in range(2 * lo.num_layers):
        base = lk * lo.num_kv_heads * slab
        parts.append(full[base + rank * h * slab : base + (rank + 1) * h * slab])
    return b"".join(parts)


@settings(max_examples=100, deadline=None)
@given(shapes(max_layers=3, max_dim=4, max_tpb=3), st.integers(0, 2**32))
def test_simulated_transfer_reassembles_gen_blocks(m: ShardMap, seed: int) -> None:
    rng = random.Random(seed)
    full = _full_block(m, rng)
    ctx_blocks = [_rank_block(m, full, m.ctx_tp, c) for c in range(m.ctx_tp)]
    gen_blocks = [bytearray(b"\xee" * m.gen_block_bytes) for _ in range(m.gen_tp)]
    for c, g in m.edges:
        for s in m.segments((c, g)):
            gen_blocks[g][s.dst_offset : s.dst_offset + s.length] = ctx_blocks[c][
                s.src_offset : s.src_offset + s.length
            ]
    for g in range(m.gen_tp):
        assert bytes(gen_blocks[g]) == _rank_block(m, full, m.gen_tp, g)


@settings(max_examples=60, deadline=None)
@given(shapes(max_layers=2, max_dim=4, max_tpb=2), st.integers(1, 4), st.integers(0, 2**32))
def test_descriptor_regions_move_many_blocks_between_scattered_pools(
    m: ShardMap, num_blocks: int, seed: int
) -> None:
    """NIXL-style: each side is one registered arena per rank; the request's
    blocks sit at random pool slots; the regions must deliver every block."""
    rng = random.Random(seed)
    pool_slots = num_blocks + 3
    fulls = [_full_block(m, rng) for _ in range(num_blocks)]
    ctx_slots = [rng.sample(range(pool_slots), num_blocks) for _ in range(m.ctx_tp)]
    gen_slots = [rng.sample(range(pool_slots), num_blocks) for _ in range(m.gen_tp)]
    cb, gb = m.ctx_block_bytes, m.gen_block_bytes
    ctx_arena = [bytearray(pool_slots * cb) for _ in range(m.ctx_tp)]
    for c in range(m.ctx_tp):
        for i, slot in enumerate(ctx_slots[c]):
            ctx_arena[c][slot * cb : (slot + 1) * cb] = _rank_block(m, fulls[i], m.ctx_tp, c)
    gen_arena = [bytearray(pool_slots * gb) for _ in range(m.gen_tp)]
    for c, g in m.edges:
        bases = [(ctx_slots[c][i] * cb, gen_slots[g][i] * gb) for i in range(num_blocks)]
        regions = m.descriptor_regions((c, g), bases)
        assert sum(n for _, _, n in regions) == num_blocks * m.edge_bytes_per_block((c, g))
        assert len(regions) <= num_blocks * len(m.segments((c, g)))
        for src, dst, n in regions:
            gen_arena[g][dst : dst + n] = ctx_arena[c][src : src + n]
    for g in range(m.gen_tp):
        for i, slot in enumerate(gen_slots[g]):
            assert bytes(gen_arena[g][slot * gb : (slot + 1) * gb]) == _rank_block(
                m, fulls[i], m.gen_tp, g
            )


def test_descriptor_regions_merge_adjacent_blocks() -> None:
    m = shard_map(layout(layers=2, heads=4), 2, 2)
    bb = m.ctx_block_bytes
    # Adjacent on both sides: one region for the whole run.
    assert m.descriptor_regions((0, 0), [(1000 + i * bb, 5000 + i * bb) for i in range(4)]) == [
        (1000, 5000, 4 * bb)
    ]
    # A break on the destination side starts a new region.
    assert m.descriptor_regions((0, 0), [(0, 0), (bb, 7 * bb)]) == [(0, 0, bb), (bb, 7 * bb, bb)]
    assert m.descriptor_regions((0, 0), []) == []
    # Heterogeneous TP: one region per segment per block unless they happen to continue.
    h = shard_map(layout(layers=2, heads=4), 2, 4)
    assert len(h.descriptor_regions((0, 0), [(0, 0), (64, 32)])) == 8


def test_descriptor_regions_reject_bad_bases() -> None:
    m = shard_map(layout(), 1, 1)
    for bases in ([(0,)], [(-1, 0)], [(0, 1.5)], [(0, True)], [[0, 0]], [(2**64 - 1, 0)]):
        with pytest.raises(TopologyError):
            m.descriptor_regions((0, 0), bases)  # type: ignore[arg-type]
