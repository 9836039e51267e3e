"""Synthetic prefill: a deterministic KV pattern per request, and its check (S2).

The demo has no model, so CTX "prefills" a request by writing a pattern derived
from the request's seed and each byte's *global* position in the KV cache:
(layer, K/V, global head, global token, byte within the head row). Because the
pattern depends on global coordinates only, a GEN rank can compute exactly what
its shard must hold whatever the CTX/GEN tensor-parallel split was, and any byte
that came from another request (or a stale write) differs from it.

In-block byte order (topology/_layout.py): [layer][kv][local head][token][row bytes].
Row hashes are mixed in 32-bit arithmetic (no int64 overflow), then each byte of a
row is `row_hash + byte_index * 157` mod 256, cheap to broadcast.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

__all__ = ["request_seed", "expected_blocks", "POISON"]

#: Freed GEN blocks are filled with this so a late write is visible when verified.
POISON = 0xDB


def request_seed(request_id: str, ctx_attempt: int) -> int:
    """A 32-bit seed from the request identity (stable across processes)."""
    digest = hashlib.blake2b(f"{request_id}/{ctx_attempt}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


#: The 32-bit mask of the row hash's arithmetic.
_MASK = np.uint64(0xFFFFFFFF)
_MULT = np.uint64(0x45D9F3B)
_SHIFT = np.uint64(16)


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x * _MULT) & _MASK
    x ^= x >> _SHIFT
    x = (x * _MULT) & _MASK
    return x ^ (x >> _SHIFT)


@functools.lru_cache(maxsize=16)
def _byte_ramp(row_bytes: int) -> torch.Tensor:
    """Byte `i` of every row before its hash is added: `i * 157` mod 256."""
    return ((torch.arange(row_bytes, dtype=torch.int64) * 157) & 0xFF).to(torch.uint8)


def expected_blocks(
    seed: int,
    *,
    num_layers: int,
    local_heads: int,
    head_offset: int,
    tokens_per_block: int,
    row_bytes: int,
    first_block: int,
    num_blocks: int,
) -> torch.Tensor:
    """The bytes `num_blocks` consecutive blocks of one rank hold for a request.

    Returns a uint8 tensor of shape [num_blocks, block_bytes] where block_bytes =
    num_layers * 2 * local_heads * tokens_per_block * row_bytes. Block j holds
    tokens [(first_block + j) * tokens_per_block, ...) and heads
    [head_offset, head_offset + local_heads).

    The row hashes (one per row: few) are computed in NumPy, whose calls cost
    a fraction of torch's on small arrays; the rows themselves (every byte)
    in torch.
    """
    blk = np.arange(first_block, first_block + num_blocks, dtype=np.int64).reshape(-1, 1, 1, 1, 1)
    layer = np.arange(num_layers, dtype=np.int64).reshape(1, -1, 1, 1, 1)
    kv = np.arange(2, dtype=np.int64).reshape(1, 1, -1, 1, 1)
    head = np.arange(head_offset, head_offset + local_heads, dtype=np.int64).reshape(1, 1, 1, -1, 1)
    tok = np.arange(tokens_per_block, dtype=np.int64).reshape(1, 1, 1, 1, -1)
    token = blk * tokens_per_block + tok
    # Distinct strides per coordinate; the 32-bit mix spreads them.
    row_id = ((((layer * 2 + kv) * 4099 + head) * 1_000_003 + token) & 0xFFFFFFFF).astype(np.uint64)
    row_hash = torch.from_numpy((_mix(row_id ^ np.uint64(seed & 0xFFFFFFFF)) & np.uint64(0xFF)).astype(np.uint8))
    # uint8 addition wraps mod 256: the full-size tensor is built in bytes, not int64.
    rows = row_hash.unsqueeze(-1) + _byte_ramp(row_bytes)
    return rows.reshape(num_blocks, -1)
