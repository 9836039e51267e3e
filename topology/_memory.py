"""Memory kinds: where each KV row of a block lives in a rank's registered memory.

The shard map (`topology/_shard.py`) speaks of one *logical* block per rank in
the "blocked" byte order `[layer][kv][local head][token][head_dim]`. Engines
keep their KV in other physical layouts; a **memory kind** names one. Every
kind keeps `head_dim` innermost and contiguous, so the unit of placement is a
*row*: one (layer, kv, local head, token), `head_dim * dtype_bytes` bytes.

With `Hl` local heads, `T = tokens_per_block`, `D = head_dim`, `e` = dtype bytes,
`L` layers, a rank's memory is one or more **regions** (one registered tensor
each); block `b` of region `r` starts at `region_base[r] + b * stride(r)`:

    kind        tensors (each [nb, ...])      regions         stride         row (l, kv, h, t) offset
    blocked     one [nb, L, 2, Hl, T, D]      1               L*2*Hl*T*D*e   ((l*2+kv)*Hl + h)*T*D*e + t*D*e
    paged       per layer [nb, 2, T, Hl, D]   L (r = l)       2*T*Hl*D*e     ((kv*T + t)*Hl + h)*D*e
    paged_hnd   per layer [nb, 2, Hl, T, D]   L (r = l)       2*Hl*T*D*e     ((kv*Hl + h)*T + t)*D*e
    split       per (layer, kv) [nb, T, Hl, D]  2L (r = 2l+kv)  T*Hl*D*e     (t*Hl + h)*D*e
    paged_interleaved  per layer [nb, Hl, T, 2, D]  L (r = l)  2*Hl*T*D*e  ((h*T + t)*2 + kv)*D*e

"paged_interleaved" is vLLM's CPU attention cache: per layer `[num_blocks,
num_kv_heads, block_size, 2 * head_size]`, a token's K row then its V row.

`memory_pieces` maps an edge's rows from the CTX kind to the GEN kind: every
row (layer, kv, global head in the edge's overlap, token) has a place on both
sides; sorted by source (region, offset), rows are merged greedily into one
piece while they are contiguous on *both* sides and stay in the same region on
both sides. A piece is `(src_region, src_offset, dst_region, dst_offset,
length)`, offsets relative to the block's start in that region, the same for
every block index. For blocked -> blocked the pieces are the shard map's
segments (region 0).

Pure: no torch, numpy or asyncio.
"""

from __future__ import annotations

import functools

from kvhandoff.protocol import TopologyError

from ._layout import KVLayout, _local_heads, heads_per_rank
from ._shard import Edge, ShardMap

__all__ = [
    "MEMORY_KINDS",
    "MemoryPiece",
    "UnknownMemoryKindError",
    "check_memory_kind",
    "memory_regions",
    "region_block_bytes",
    "row_place",
    "memory_pieces",
]

#: The memory kinds, in the order of the table above.
MEMORY_KINDS: tuple[str, ...] = ("blocked", "paged", "paged_hnd", "split", "paged_interleaved")

#: `(src_region, src_offset, dst_region, dst_offset, length)`, offsets relative to
#: the block's start in that region.
MemoryPiece = tuple[int, int, int, int, int]


class UnknownMemoryKindError(TopologyError):
    """A memory kind that is not one of `MEMORY_KINDS`."""

    def __init__(self, kind: object) -> None:
        super().__init__(f"unknown memory kind {kind!r}; known: {list(MEMORY_KINDS)}")
        self.kind = kind


def check_memory_kind(kind: object) -> str:
    """`kind` if it is one of `MEMORY_KINDS`, else `UnknownMemoryKindError`."""
    if not isinstance(kind, str) or kind not in MEMORY_KINDS:
        raise UnknownMemoryKindError(kind)
    return kind


def memory_regions(kind: str, layout: KVLayout) -> int:
    """How many regions (registered tensors) a rank of `kind` has."""
    check_memory_kind(kind)
    if kind == "blocked":
        return 1
    if kind == "split":
        return 2 * layout.num_layers
    return layout.num_layers


def region_block_bytes(kind: str, layout: KVLayout, tp: int) -> int:
    """Bytes one block takes in each region of a rank of `kind` (every region
    of a kind has the same block stride)."""
    check_memory_kind(kind)
    row = heads_per_rank(layout, tp) * layout.head_bytes  # Hl * T * D * e
    if kind == "blocked":
        return layout.num_layers * 2 * row
    if kind == "split":
        return row
    return 2 * row


def _place(kind: str, L: int, hl: int, T: int, row: int, layer: int, kv: int, h: int, t: int) -> tuple[int, int]:
    if kind == "blocked":
        return 0, (((layer * 2 + kv) * hl + h) * T + t) * row
    if kind == "paged":
        return layer, ((kv * T + t) * hl + h) * row
    if kind == "paged_hnd":
        return layer, ((kv * hl + h) * T + t) * row
    if kind == "paged_interleaved":
        return layer, ((h * T + t) * 2 + kv) * row
    return 2 * layer + kv, (t * hl + h) * row  # split


def row_place(
    kind: str, layout: KVLayout, tp: int, *, layer: int, kv: int, head: int, token: int
) -> tuple[int, int]:
    """`(region, offset)` of the row (layer, kv, local head `head`, token in the
    block) in a block of a rank of `kind` among `tp` ranks."""
    check_memory_kind(kind)
    hl = _local_heads(layout, tp, layer=layer, kv=kv, head=head)
    if not 0 <= token < layout.tokens_per_block:
        raise TopologyError(f"token {token} out of range [0, {layout.tokens_per_block})")
    row = layout.head_dim * layout.dtype_bytes
    return _place(kind, layout.num_layers, hl, layout.tokens_per_block, row, layer, kv, head, token)


def memory_pieces(shard: ShardMap, edge: Edge, ctx_kind: str, gen_kind: str) -> tuple[MemoryPiece, ...]:
    """The pieces `edge` moves for every block, from a CTX rank of `ctx_kind` to a
    GEN rank of `gen_kind` (module docstring). Sorted by source (region,
    offset); every byte of the edge's overlap is in exactly one piece."""
    c, g = shard._check_edge(edge)  # UnknownEdgeError for an edge the map does not have
    return _memory_pieces(
        shard.layout, shard.ctx_tp, shard.gen_tp, c, g, check_memory_kind(ctx_kind), check_memory_kind(gen_kind)
    )


@functools.lru_cache(maxsize=1024)
def _memory_pieces(
    layout: KVLayout, ctx_tp: int, gen_tp: int, c: int, g: int, ctx_kind: str, gen_kind: str
) -> tuple[MemoryPiece, ...]:
    H, L, T = layout.num_kv_heads, layout.num_layers, layout.tokens_per_block
    hc, hg = H // ctx_tp, H // gen_tp
    lo, hi = max(c * hc, g * hg), min((c + 1) * hc, (g + 1) * hg)
    row = layout.head_dim * layout.dtype_bytes
    rows = sorted(
        (
            *_place(ctx_kind, L, hc, T, row, layer, kv, head - c * hc, t),
            *_place(gen_kind, L, hg, T, row, layer, kv, head - g * hg, t),
        )
        for layer in range(L)
        for kv in (0, 1)
        for head in range(lo, hi)
        for t in range(T)
    )
    pieces: list[MemoryPiece] = []
    for sr, so, dr, do in rows:
        if pieces:
            psr, pso, pdr, pdo, n = pieces[-1]
            if psr == sr and pdr == dr and pso + n == so and pdo + n == do:
                pieces[-1] = (psr, pso, pdr, pdo, n + row)
                continue
        pieces.append((sr, so, dr, do, row))
    return tuple(pieces)
