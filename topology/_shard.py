"""Shard mapping: which bytes of which CTX block go to which GEN block.

Theory of operation
-------------------
A request's KV cache is the same logical tensor on both sides; only the split
across ranks differs when the CTX and GEN instances use different TP
(docs/design.md "Vocabulary": edge). The layout (`topology/_layout.py`) fixes:

* heads are split contiguously: with `H` KV heads, CTX rank `c` holds global
  heads `[c*Hc, (c+1)*Hc)` with `Hc = H/ctx_tp`, GEN rank `g` holds
  `[g*Hg, (g+1)*Hg)` with `Hg = H/gen_tp`;
* a block is `[layer][kv][local head][token][head_dim]`, so one head's data
  for one (layer, kv) is a *slab* of `S = tokens_per_block*head_dim*dtype_bytes`
  bytes, and a rank's heads of one (layer, kv) are consecutive slabs;
* both sides use the same `tokens_per_block`, so block `i` of a request on a
  CTX rank holds the same tokens as block `i` on a GEN rank.

An **edge** `(c, g)` exists iff the two head ranges overlap: `[lo, hi)` with
`lo = max(c*Hc, g*Hg)`, `hi = min((c+1)*Hc, (g+1)*Hg)`, `lo < hi`. For every
(layer, kv) pair `lk = layer*2 + kv` the overlap is one contiguous range on
both sides, so the edge is a list of **segments** `(src_offset, dst_offset,
length)`:

    src_offset = (lk*Hc + lo - c*Hc) * S
    dst_offset = (lk*Hg + lo - g*Hg) * S
    length     = (hi - lo) * S

Consecutive segments are merged when they are contiguous on *both* sides; when
an edge carries a whole block on both sides (equal TP) all `2*num_layers`
segments merge into one full-block segment. The segments are offsets inside a
block, the same for every block index: `descriptor_regions` turns them into
absolute (src_addr, dst_addr, length) regions for a list of block base
addresses, merging across blocks again where the blocks happen to be adjacent.

Why every byte moves exactly once: each head lives on exactly one rank on each
side, so for a GEN rank `g` the CTX head ranges partition its heads, and the
overlaps with `g` tile `[g*Hg, (g+1)*Hg)`; per (layer, kv) those are disjoint
and contiguous slabs, so the incoming segments tile the GEN block. The same
argument from the CTX side shows each CTX byte is read by exactly one edge.
The tests check both by brute force over many shapes.

The number of edges is at most `ctx_tp + gen_tp - 1`. When `gen_tp` divides
`ctx_tp`, each GEN rank has `ctx_tp/gen_tp` incoming edges; when `ctx_tp`
divides `gen_tp`, each GEN rank has one and each CTX rank `gen_tp/ctx_tp`
outgoing edges.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import msgspec

from kvhandoff.protocol import TopologyError

from ._layout import KVLayout, block_bytes, heads_per_rank
from ._spec import MAX_PARALLEL

__all__ = [
    "Edge",
    "Segment",
    "ShardMap",
    "UnknownEdgeError",
    "shard_map",
    "MAX_ADDRESS",
]

#: `(ctx rank, gen rank)`, as `ContextTicket.edge`.
Edge = tuple[int, int]

#: Addresses and lengths are unsigned 64-bit in NIXL.
MAX_ADDRESS = 2**64 - 1


class UnknownEdgeError(TopologyError):
    """An edge that this shard map does not have (rank out of range, or the two
    ranks share no KV heads). Carries the edge and both TP sizes."""

    def __init__(self, edge: object, ctx_tp: int, gen_tp: int) -> None:
        super().__init__(f"no edge {edge!r} in the shard map ctx_tp={ctx_tp} -> gen_tp={gen_tp}")
        self.edge = edge
        self.ctx_tp = ctx_tp
        self.gen_tp = gen_tp


class Segment(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`length` bytes at `src_offset` in a CTX block go to `dst_offset` in the
    GEN block of the same index."""

    src_offset: int
    dst_offset: int
    length: int


def _check_tp(field: str, tp: object) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_PARALLEL:
        raise TopologyError(f"{field} must be an int in [1, {MAX_PARALLEL}], got {tp!r}")


class ShardMap(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The edges and per-block byte segments between a CTX instance with
    `ctx_tp` ranks and a GEN instance with `gen_tp` ranks over one KV layout.

    Construction checks that the heads split evenly on both sides
    (`HeadSplitError` otherwise). Everything else is computed on demand and
    memoized, so a ShardMap is cheap to build, hash and send.
    """

    layout: KVLayout
    ctx_tp: int
    gen_tp: int

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise TopologyError(f"layout must be a KVLayout, got {type(self.layout).__name__}")
        _check_tp("ctx_tp", self.ctx_tp)
        _check_tp("gen_tp", self.gen_tp)
        heads_per_rank(self.layout, self.ctx_tp)
        heads_per_rank(self.layout, self.gen_tp)

    # -- sizes ---------------------------------------------------------------

    @property
    def ctx_block_bytes(self) -> int:
        """Bytes of one block on a CTX rank."""
        return block_bytes(self.layout, self.ctx_tp)

    @property
    def gen_block_bytes(self) -> int:
        """Bytes of one block on a GEN rank."""
        return block_bytes(self.layout, self.gen_tp)

    # -- edges ---------------------------------------------------------------

    @property
    def edges(self) -> tuple[Edge, ...]:
        """Every edge, sorted by (ctx rank, gen rank)."""
        return tuple(e for c in range(self.ctx_tp) for e in self.edges_for_ctx_rank(c))

    def edges_for_gen_rank(self, gen_rank: int) -> tuple[Edge, ...]:
        """The edges into GEN rank `gen_rank`, sorted by ctx rank."""
        self._check_rank("gen", gen_rank, self.gen_tp)
        hc, hg = self._heads
        first, last = gen_rank * hg, (gen_rank + 1) * hg - 1  # global heads
        return tuple((c, gen_rank) for c in range(first // hc, last // hc + 1))

    def edges_for_ctx_rank(self, ctx_rank: int) -> tuple[Edge, ...]:
        """The edges out of CTX rank `ctx_rank`, sorted by gen rank."""
        self._check_rank("ctx", ctx_rank, self.ctx_tp)
        hc, hg = self._heads
        first, last = ctx_rank * hc, (ctx_rank + 1) * hc - 1
        return tuple((ctx_rank, g) for g in range(first // hg, last // hg + 1))

    def has_edge(self, edge: object) -> bool:
        """True iff `edge` is one of this map's edges."""
        try:
            self._check_edge(edge)
        except TopologyError:
            return False
        return True

    # -- segments ------------------------------------------------------------

    def segments(self, edge: Edge) -> tuple[Segment, ...]:
        """The byte segments of `edge`, the same for every block index, sorted
        by source offset (and destination offset: both increase together)."""
        c, g = self._check_edge(edge)
        return _edge_segments(self.layout, self.ctx_tp, self.gen_tp, c, g)

    def edge_bytes_per_block(self, edge: Edge) -> int:
        """Bytes `edge` moves for each block."""
        return sum(s.length for s in self.segments(edge))

    def descriptor_regions(
        self, edge: Edge, block_bases: Iterable[tuple[int, int]]
    ) -> list[tuple[int, int, int]]:
        """Absolute `(src_addr, dst_addr, length)` regions for `edge`.

        `block_bases` lists, in transfer order, `(ctx block base address, gen
        block base address)` for each block of the request. Each block
        contributes the edge's segments shifted by its bases; a region is
        merged into the previous one when it continues it on both sides (e.g.
        equal TP and blocks adjacent in both pools gives one region), which
        keeps the NIXL descriptor count, and its ~5 µs per descriptor, down.
        """
        segs = self.segments(edge)
        our_block, their_block = self.ctx_block_bytes, self.gen_block_bytes
        regions: list[tuple[int, int, int]] = []
        for i, pair in enumerate(block_bases):
            src_base, dst_base = _check_bases(i, pair, our_block, their_block)
            for seg in segs:
                src, dst = src_base + seg.src_offset, dst_base + seg.dst_offset
                if regions:
                    p_src, p_dst, p_len = regions[-1]
                    if p_src + p_len == src and p_dst + p_len == dst:
                        regions[-1] = (p_src, p_dst, p_len + seg.length)
                        continue
                regions.append((src, dst, seg.length))
        return regions

    # -- internals -------------------------------------------------------------

    @property
    def _heads(self) -> tuple[int, int]:
        return (self.layout.num_kv_heads // self.ctx_tp, self.layout.num_kv_heads // self.gen_tp)

    @staticmethod
    def _check_rank(side: str, rank: object, tp: int) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < tp:
            raise TopologyError(f"{side} rank {rank!r} out of range [0, {tp})")

    def _check_edge(self, edge: object) -> Edge:
        if (
            not isinstance(edge, tuple)
            or len(edge) != 2
            or not all(isinstance(r, int) and not isinstance(r, bool) for r in edge)
        ):
            raise UnknownEdgeError(edge, self.ctx_tp, self.gen_tp)
        c, g = edge
        if not (0 <= c < self.ctx_tp and 0 <= g < self.gen_tp):
            raise UnknownEdgeError(edge, self.ctx_tp, self.gen_tp)
        hc, hg = self._heads
        if max(c * hc, g * hg) >= min((c + 1) * hc, (g + 1) * hg):
            raise UnknownEdgeError(edge, self.ctx_tp, self.gen_tp)
        return (c, g)


def _check_bases(i: int, pair: object, src_size: int, dst_size: int) -> tuple[int, int]:
    if not isinstance(pair, tuple) or len(pair) != 2:
        raise TopologyError(f"block_bases[{i}] must be a (src, dst) pair, got {pair!r}")
    src, dst = pair
    for name, addr, size in (("src", src, src_size), ("dst", dst, dst_size)):
        if not isinstance(addr, int) or isinstance(addr, bool):
            raise TopologyError(f"block_bases[{i}] {name} address must be an int, got {addr!r}")
        if not 0 <= addr <= MAX_ADDRESS - size + 1:
            raise TopologyError(f"block_bases[{i}] {name} address {addr:#x} out of range")
    return (src, dst)


@functools.lru_cache(maxsize=4096)
def _edge_segments(
    layout: KVLayout, ctx_tp: int, gen_tp: int, c: int, g: int
) -> tuple[Segment, ...]:
    # See the theory of operation at the top of this file for the formulas.
    hc, hg = layout.num_kv_heads // ctx_tp, layout.num_kv_heads // gen_tp
    lo, hi = max(c * hc, g * hg), min((c + 1) * hc, (g + 1) * hg)
    slab = layout.head_bytes
    length = (hi - lo) * slab
    merged: list[Segment] = []
    for lk in range(2 * layout.num_layers):
        src = (lk * hc + lo - c * hc) * slab
        dst = (lk * hg + lo - g * hg) * slab
        if merged:
            prev = merged[-1]
            if prev.src_offset + prev.length == src and prev.dst_offset + prev.length == dst:
                merged[-1] = Segment(
                    src_offset=prev.src_offset,
                    dst_offset=prev.dst_offset,
                    length=prev.length + length,
                )
                continue
        merged.append(Segment(src_offset=src, dst_offset=dst, length=length))
    return tuple(merged)


def shard_map(layout: KVLayout, ctx_tp: int, gen_tp: int) -> ShardMap:
    """The shard map from a `ctx_tp`-rank CTX instance to a `gen_tp`-rank GEN
    instance over `layout`; `HeadSplitError` if either TP does not divide the
    KV heads."""
    return ShardMap(layout=layout, ctx_tp=ctx_tp, gen_tp=gen_tp)
