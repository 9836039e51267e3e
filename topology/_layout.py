"""KV layout: what one KV block holds on one rank, byte for byte.

A *block* on a rank holds, for `tokens_per_block` consecutive tokens, the K
and the V of every layer for that rank's KV heads. Heads are split
contiguously across TP: with `H` heads and `tp` ranks, rank `r` holds global
heads `[r * H/tp, (r + 1) * H/tp)` (its "local" heads `0 .. H/tp - 1`).

In-block byte order (row-major, outermost first):

    [layer][kv: K=0, V=1][local head][token][head_dim] x dtype_bytes

So the unit of layout is one *head slab*: one head's K (or V) for one layer
and all the block's tokens, `tokens_per_block * head_dim * dtype_bytes`
bytes (`KVLayout.head_bytes`). Within one (layer, kv) the rank's heads are
consecutive slabs, so any contiguous head range of one (layer, kv) is one
contiguous byte range: a heterogeneous-TP edge needs only one segment per
(layer, kv) (`topology/_shard.py`), i.e. few NIXL descriptors.

PP and CP are outside the qualified scope (docs/design.md "Qualified scope"), so a
block always holds every layer. TP larger than the number of KV heads (head
replication) is rejected rather than half-supported.
"""

from __future__ import annotations

import msgspec

from kvhandoff.protocol import TopologyError

from ._spec import TopologyFieldError

__all__ = [
    "KVLayout",
    "DEFAULT_LAYOUT",
    "HeadSplitError",
    "DTYPE_BYTES",
    "heads_per_rank",
    "block_bytes",
    "blocks_for_tokens",
    "block_offset",
    "MAX_LAYERS",
    "MAX_KV_HEADS",
    "MAX_HEAD_DIM",
    "MAX_TOKENS_PER_BLOCK",
]

#: Bytes per element for each dtype name a layout may use.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}

MAX_LAYERS = 4096
MAX_KV_HEADS = 4096
MAX_HEAD_DIM = 65536
MAX_TOKENS_PER_BLOCK = 65536


class HeadSplitError(TopologyError):
    """`num_kv_heads` KV heads cannot be split evenly and contiguously over
    `tp` ranks (not divisible, or more ranks than heads)."""

    def __init__(self, num_kv_heads: int, tp: int) -> None:
        why = (
            "more ranks than KV heads (head replication is not supported)"
            if tp > num_kv_heads
            else "heads are not divisible by tp"
        )
        fits = [n for n in range(1, num_kv_heads + 1) if num_kv_heads % n == 0]
        shown = ", ".join(map(str, fits[:12])) + (", ..." if len(fits) > 12 else "")
        super().__init__(f"cannot split {num_kv_heads} KV heads over tp={tp}: {why} (tp that fit: {shown})")
        self.num_kv_heads = num_kv_heads
        self.tp = tp


def _check_dim(field: str, value: object, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TopologyFieldError(field, value, "must be an int")
    if not 1 <= value <= hi:
        raise TopologyFieldError(field, value, f"must be in [1, {hi}]")


class KVLayout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The model-wide KV cache shape and the block size in tokens.

    `num_kv_heads` is the model's total (all ranks together); a rank holds
    `heads_per_rank(layout, tp)` of them. `dtype` is a name from `DTYPE_BYTES`.
    Both sides of a handoff use the same layout (same tokens per block), so
    block `i` on a CTX rank and block `i` on a GEN rank hold the same tokens.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_block: int

    def __post_init__(self) -> None:
        _check_dim("num_layers", self.num_layers, MAX_LAYERS)
        _check_dim("num_kv_heads", self.num_kv_heads, MAX_KV_HEADS)
        _check_dim("head_dim", self.head_dim, MAX_HEAD_DIM)
        _check_dim("tokens_per_block", self.tokens_per_block, MAX_TOKENS_PER_BLOCK)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise TopologyFieldError("dtype", self.dtype, f"must be one of {sorted(DTYPE_BYTES)}")

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def head_bytes(self) -> int:
        """Bytes of one head slab: one head's K (or V), one layer, one block."""
        return self.tokens_per_block * self.head_dim * self.dtype_bytes


#: A small model-like layout for host-memory demos and synthetic deployments
#: (no model): 4 layers, 8 KV heads of 64 fp16 dims, 16 tokens per block
#: (128 KiB per block at TP=1).
DEFAULT_LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, dtype="float16", tokens_per_block=16)


def _check_tp(tp: object) -> int:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise TopologyError(f"tp must be an int >= 1, got {tp!r}")
    return tp


def heads_per_rank(layout: KVLayout, tp: int) -> int:
    """KV heads each of `tp` ranks holds; `HeadSplitError` if they do not split evenly."""
    _check_tp(tp)
    if tp > layout.num_kv_heads or layout.num_kv_heads % tp:
        raise HeadSplitError(layout.num_kv_heads, tp)
    return layout.num_kv_heads // tp


def block_bytes(layout: KVLayout, tp: int) -> int:
    """Size of one block on one of `tp` ranks: layers x (K, V) x local heads x slab."""
    return layout.num_layers * 2 * heads_per_rank(layout, tp) * layout.head_bytes


def blocks_for_tokens(layout: KVLayout, num_tokens: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (the last may be partial)."""
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise TopologyError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    return -(-num_tokens // layout.tokens_per_block)


def block_offset(layout: KVLayout, tp: int, *, layer: int, kv: int, head: int) -> int:
    """Byte offset, within a block on one of `tp` ranks, of the slab of local
    head `head` for `(layer, kv)` (kv: 0 = K, 1 = V)."""
    hpr = _local_heads(layout, tp, layer=layer, kv=kv, head=head)
    return ((layer * 2 + kv) * hpr + head) * layout.head_bytes


def _local_heads(layout: KVLayout, tp: int, *, layer: int, kv: int, head: int) -> int:
    """`heads_per_rank(layout, tp)`, once `(layer, kv, head)` is checked to
    name one slab of a block on one of `tp` ranks (a `TopologyError` if not)."""
    hpr = heads_per_rank(layout, tp)
    if not 0 <= layer < layout.num_layers:
        raise TopologyError(f"layer {layer} out of range [0, {layout.num_layers})")
    if kv not in (0, 1):
        raise TopologyError(f"kv must be 0 (K) or 1 (V), got {kv!r}")
    if not 0 <= head < hpr:
        raise TopologyError(f"local head {head} out of range [0, {hpr})")
    return hpr
