"""The data plane: preallocated KV buffers and NIXL WRITEs in chunks.

Theory of operation (docs/design.md "Lifecycle", "Cancellation", "Data plane modes").

A rank owns one `KVMemory`: one or more preallocated, NIXL-registered regions
laid out as its memory kind says (`topology/_memory.py`: "blocked" is one
region of `num_blocks * block_bytes`; "paged", "paged_hnd" and "split" are one
tensor per layer or per layer and K/V), torch tensors on `cuda` when the rank
has a GPU, host memory otherwise, the engine's own or allocated here
(`KVMemory.from_tensors`, `KVMemory.allocate`; `KVBuffer` is the blocked kind
without a layout). Blocks are addressed by index; the protocol layer
(`kvhandoff.protocol` pools) decides who owns which block and when it may be
reused. This module never decides that: it moves bytes and reports what it saw.

`NixlTransport` wraps one `nixl_agent` and enforces the NIXL facts learned the
hard way:

- releasing an in-flight transfer handle is *not* an abort (it breaks the UCX
  connection): `release()` refuses a handle that has not been polled to DONE
  or ERR, and a release that fails is logged and the handle kept, never retried
  blindly;
- `transfer()` and `check_xfer_state()` raise on error: both are mapped to the
  state ERR, never propagated as an arbitrary exception;
- descriptor helpers return None on bad input: that becomes a typed
  `DataPlaneError`, before anything is posted.

A `Chunk` is one posted WRITE (a list of contiguous regions). The caller posts
chunks one by one, so a cancel stops posting between chunks and only drains what
is already posted (`Chunk.poll()` to DONE or ERR within the transfer timeout).

Prepared descriptor lists. An edge moves the same byte pieces of every block
(`edge_pieces`: `topology.memory_pieces` between the two kinds, `(src region,
src offset, dst region, dst offset, length)`, cut to at most one chunk), so the
descriptors of *every* block of both pools are known before any request: a
`PreparedEdge` registers them once with NIXL (`prep_xfer_dlist`: the local list
per edge, the remote list per edge and peer agent, i.e. per endpoint epoch), and
a chunk is then two index arrays (`make_prepped_xfer`) instead of two freshly
built descriptor lists. NIXL merges indices that are contiguous on both sides,
so adjacent blocks still travel as one region. `plan_chunks` produces both
forms of every chunk: the index arrays and, given both sides' region tables,
the absolute regions (merged where contiguous and in one region on both sides;
`resolve_regions` fills them in later), which the built path
(`initialize_xfer`) posts when prepared lists are off or failed; the bytes
moved are identical.

The fault-injecting wrapper around this transport, for tests and the demo's
chaos, is `FaultyTransport` in actors/_faults.py.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvhandoff.topology import (
    KVLayout,
    UnknownMemoryKindError,
    block_bytes,
    check_memory_kind,
    heads_per_rank,
    memory_regions,
)

log = logging.getLogger("kvhandoff.dataplane")

__all__ = [
    "DataPlaneError",
    "XferState",
    "Region",
    "KVBuffer",
    "KVMemory",
    "MemoryLayoutError",
    "resolve_regions",
    "NixlTransport",
    "Chunk",
    "BufferGeometry",
    "Piece",
    "edge_pieces",
    "ChunkPlan",
    "plan_chunks",
    "PreparedEdge",
]


class DataPlaneError(RuntimeError):
    """A data-plane request that could not be built (bad descriptors, unknown peer)."""


class XferState(str, enum.Enum):
    PENDING = "PENDING"  # built but not yet posted (FaultyTransport defers posts)
    PROC = "PROC"  # posted, may still write the destination
    DONE = "DONE"  # every byte landed; the handle may be released
    ERR = "ERR"  # the transfer failed; nothing more will be written


#: One contiguous WRITE region: (source address, destination address, length).
Region = tuple[int, int, int]


class BufferGeometry(NamedTuple):
    """Where a rank's block pool lives: what a peer needs to address any block.

    `regions` lists `(base, block stride)` of every registered region (memory
    kinds, `topology/_memory.py`); empty means one region `(base, block_bytes)`.
    `block_bytes` is always the *logical* block size (`block_bytes(layout,
    tp)`), `base` the start of region 0, `kind` the memory kind."""

    base: int
    num_blocks: int
    block_bytes: int
    mem_kind: str  # "DRAM" or "VRAM"
    device_id: int
    regions: tuple[tuple[int, int], ...] = ()
    kind: str = "blocked"
    #: The staging arena (actors/_staged.py), if the rank has one: (base,
    #: slot bytes, slots per peer rank); empty: none (direct mode only).
    staging: tuple[int, ...] = ()
    #: A CTX rank that lends (pull): the key its lends are sealed with
    #: (`Lend.seal`), for its readers to check them; empty: it lends nothing.
    lend_key: bytes = b""

    def region_table(self) -> tuple[tuple[int, int], ...]:
        """`(base, block stride)` of every region, region 0 first."""
        return self.regions or ((self.base, self.block_bytes),)

    def block_addr(self, block: int) -> int:
        """The address of `block` in region 0."""
        if not 0 <= block < self.num_blocks:
            raise DataPlaneError(f"block {block} outside pool of {self.num_blocks}")
        base, stride = self.region_table()[0]
        return base + block * stride


class MemoryLayoutError(DataPlaneError):
    """Engine-provided KV tensors that do not match the memory kind, layout and
    TP they were given for (count, shape, dtype bytes, contiguity, device,
    number of blocks). Nothing was registered or changed."""


def _region_shape(kind: str, layout: KVLayout, hl: int) -> tuple[int, ...]:
    """The shape of one region's tensor after its block dimension."""
    L, T, D = layout.num_layers, layout.tokens_per_block, layout.head_dim
    if kind == "blocked":
        return (L, 2, hl, T, D)
    if kind == "paged":
        return (2, T, hl, D)
    if kind == "paged_hnd":
        return (2, hl, T, D)
    if kind == "paged_interleaved":
        return (hl, T, 2, D)
    return (T, hl, D)  # split


class KVMemory:
    """One rank's KV memory: one or more registered regions (memory kinds,
    `topology/_memory.py`), each a contiguous tensor of `num_blocks` blocks of
    its block stride. Registered with NIXL once, all regions (`NixlTransport`).

    `read_blocks` / `write_blocks` / `fill_blocks` move whole *logical* blocks
    (the blocked byte order `[layer][kv][local head][token][head_dim]`,
    `block_bytes` bytes each) between a uint8 tensor and their physical places:
    the synthetic prefill, the verification and the poison go through them, so
    they are the same for every kind."""

    def __init__(
        self,
        kind: str,
        tensors: Sequence[torch.Tensor],
        num_blocks: int,
        block_bytes: int,
        layout: KVLayout | None = None,
        local_heads: int = 0,
    ) -> None:
        self.kind = kind
        self.tensors = list(tensors)  # as given (engine dtypes): what NIXL registers
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.layout = layout
        self.local_heads = local_heads
        # uint8 [num_blocks, stride] views of the same memory, one per region.
        self.flat = [t.view(-1).view(torch.uint8).view(num_blocks, -1) for t in self.tensors]
        self.strides = [f.shape[1] for f in self.flat]
        self.bases = [t.data_ptr() for t in self.tensors]
        first = self.tensors[0]
        self.device = str(first.device)
        self.tensor = self.flat[0].view(-1)  # region 0, flat (the blocked pool)
        self.base = self.bases[0]
        self.mem_kind = "VRAM" if first.is_cuda else "DRAM"
        self.device_id = first.get_device() if first.is_cuda else 0

    # -- construction -----------------------------------------------------------
    @classmethod
    def allocate(
        cls, kind: str, layout: KVLayout, tp: int, num_blocks: int, device: str = "cpu"
    ) -> KVMemory:
        """Zeroed regions of `kind` for `num_blocks` blocks (the synthetic path)."""
        kind = _check_kind(kind)
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise DataPlaneError(f"num_blocks must be a positive int, got {num_blocks!r}")
        hl = heads_per_rank(layout, tp)
        shape = _region_shape(kind, layout, hl)
        row = layout.head_dim * layout.dtype_bytes
        tensors = [
            torch.zeros((num_blocks, *shape[:-1], row), dtype=torch.uint8, device=device)
            for _ in range(memory_regions(kind, layout))
        ]
        return cls(kind, tensors, num_blocks, block_bytes(layout, tp), layout, hl)

    @classmethod
    def from_tensors(
        cls, kind: str, layout: KVLayout, tp: int, tensors: Sequence[torch.Tensor]
    ) -> KVMemory:
        """The engine's own KV tensors as a rank's memory, checked: `kind`'s
        count and shapes (`[num_blocks, ...]`, see `topology/_memory.py`), the
        layout's dtype bytes, contiguous, one device, one `num_blocks`, no two
        overlapping. `MemoryLayoutError` otherwise; nothing is changed."""
        kind = _check_kind(kind)
        hl = heads_per_rank(layout, tp)
        want = memory_regions(kind, layout)
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
            raise MemoryLayoutError(f"tensors must be a sequence of {want} tensors")
        tensors = list(tensors)
        if len(tensors) != want:
            raise MemoryLayoutError(f"memory kind {kind!r} needs {want} tensors, got {len(tensors)}")
        shape = _region_shape(kind, layout, hl)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise MemoryLayoutError(f"tensors[{i}] is a {type(t).__name__}, not a torch.Tensor")
        nb = tensors[0].shape[0] if tensors[0].dim() else 0
        for i, t in enumerate(tensors):
            if t.element_size() != layout.dtype_bytes:
                raise MemoryLayoutError(
                    f"tensors[{i}] has {t.element_size()}-byte elements, the layout's "
                    f"{layout.dtype} has {layout.dtype_bytes}"
                )
            if tuple(t.shape[1:]) != shape or t.dim() != len(shape) + 1:
                raise MemoryLayoutError(
                    f"tensors[{i}] has shape {tuple(t.shape)}, {kind!r} needs [num_blocks, *{shape}]"
                )
            if t.shape[0] != nb or nb <= 0:
                raise MemoryLayoutError(f"tensors[{i}] has {t.shape[0]} blocks, tensors[0] {nb}")
            if not t.is_contiguous():
                raise MemoryLayoutError(f"tensors[{i}] is not contiguous")
            if t.device != tensors[0].device:
                raise MemoryLayoutError(f"tensors[{i}] is on {t.device}, tensors[0] on {tensors[0].device}")
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            raise MemoryLayoutError("two tensors share memory")
        return cls(kind, tensors, nb, block_bytes(layout, tp), layout, hl)

    # -- addresses ---------------------------------------------------------------
    def block_addr(self, block: int) -> int:
        """The address of `block` in region 0."""
        if not 0 <= block < self.num_blocks:
            raise DataPlaneError(f"block {block} outside pool of {self.num_blocks}")
        return self.base + block * self.strides[0]

    def block_addrs(self, blocks: np.ndarray) -> np.ndarray:
        """`block_addr` of many blocks at once (uint64)."""
        blocks = np.asarray(blocks, dtype=np.int64)
        if len(blocks) and not (int(blocks.min()) >= 0 and int(blocks.max()) < self.num_blocks):
            raise DataPlaneError(f"a block outside pool of {self.num_blocks}")
        return np.uint64(self.base) + blocks.astype(np.uint64) * np.uint64(self.strides[0])  # type: ignore[no-any-return]

    def region_table(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.bases, self.strides))

    @property
    def nbytes(self) -> int:
        return self.num_blocks * sum(self.strides)

    def geometry(self) -> BufferGeometry:
        table = self.region_table()
        regions = () if table == ((self.base, self.block_bytes),) else table
        return BufferGeometry(
            self.base, self.num_blocks, self.block_bytes, self.mem_kind, self.device_id, regions, self.kind
        )

    # -- logical blocks ------------------------------------------------------------
    def block_view(self, block: int) -> torch.Tensor:
        """Block `block` of a blocked memory, in place (other kinds: `read_blocks`)."""
        if self.kind != "blocked":
            raise DataPlaneError(f"block_view needs the blocked kind, this memory is {self.kind!r}")
        return self.flat[0][block]

    def _index(self, blocks: Sequence[int]) -> torch.Tensor:
        # NumPy for the bounds check: its calls cost a fraction of torch's on
        # the few blocks of a small request.
        idx = np.asarray(blocks, dtype=np.int64).reshape(-1)
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= self.num_blocks):
            raise DataPlaneError(f"blocks {list(blocks)} outside pool of {self.num_blocks}")
        return torch.from_numpy(idx).to(self.flat[0].device)

    def _dims(self) -> tuple[int, int, int, int]:
        assert self.layout is not None
        lo = self.layout
        return lo.num_layers, self.local_heads, lo.tokens_per_block, lo.head_dim * lo.dtype_bytes

    def read_blocks(self, blocks: Sequence[int]) -> torch.Tensor:
        """A copy of `blocks`, logical order: uint8 `[len(blocks), block_bytes]`."""
        idx = self._index(blocks)
        n = len(idx)
        if self.kind == "blocked":
            return self.flat[0][idx]
        L, hl, T, R = self._dims()
        out = torch.empty((n, L, 2, hl, T, R), dtype=torch.uint8, device=self.flat[0].device)
        for layer in range(L):
            if self.kind == "paged":
                out[:, layer] = self.flat[layer][idx].view(n, 2, T, hl, R).permute(0, 1, 3, 2, 4)
            elif self.kind == "paged_hnd":
                out[:, layer] = self.flat[layer][idx].view(n, 2, hl, T, R)
            elif self.kind == "paged_interleaved":
                out[:, layer] = self.flat[layer][idx].view(n, hl, T, 2, R).permute(0, 3, 1, 2, 4)
            else:
                for kv in (0, 1):
                    phys = self.flat[2 * layer + kv][idx].view(n, T, hl, R)
                    out[:, layer, kv] = phys.permute(0, 2, 1, 3)
        return out.view(n, -1)

    def write_blocks(self, blocks: Sequence[int], data: torch.Tensor) -> None:
        """Write logical blocks (uint8 `[len(blocks), block_bytes]`) to their places."""
        idx = self._index(blocks)
        n = len(idx)
        if tuple(data.shape) != (n, self.block_bytes) or data.dtype != torch.uint8:
            raise DataPlaneError(f"need uint8 [{n}, {self.block_bytes}], got {data.dtype} {tuple(data.shape)}")
        data = data.to(self.flat[0].device)
        if self.kind == "blocked":
            self.flat[0][idx] = data
            return
        L, hl, T, R = self._dims()
        d = data.view(n, L, 2, hl, T, R)
        for layer in range(L):
            if self.kind == "paged":
                self.flat[layer][idx] = d[:, layer].permute(0, 1, 3, 2, 4).reshape(n, -1)
            elif self.kind == "paged_hnd":
                self.flat[layer][idx] = d[:, layer].reshape(n, -1)
            elif self.kind == "paged_interleaved":
                self.flat[layer][idx] = d[:, layer].permute(0, 2, 3, 1, 4).reshape(n, -1)
            else:
                for kv in (0, 1):
                    self.flat[2 * layer + kv][idx] = d[:, layer, kv].permute(0, 2, 1, 3).reshape(n, -1)

    def fill_blocks(self, blocks: Sequence[int], value: int) -> None:
        """Fill every byte of `blocks`, in every region, with `value`."""
        idx = self._index(blocks)
        for flat in self.flat:
            flat[idx] = value


class KVBuffer(KVMemory):
    """The blocked kind without a layout: one region of `num_blocks` blocks of
    `block_bytes` (benchmarks and tests that move raw bytes)."""

    def __init__(self, num_blocks: int, block_bytes: int, device: str = "cpu") -> None:
        if num_blocks <= 0 or block_bytes <= 0:
            raise DataPlaneError(f"bad buffer shape: {num_blocks} blocks of {block_bytes} bytes")
        tensor = torch.zeros(num_blocks * block_bytes, dtype=torch.uint8, device=device)
        super().__init__("blocked", [tensor], num_blocks, block_bytes)


def _check_kind(kind: object) -> str:
    try:
        return check_memory_kind(kind)
    except UnknownMemoryKindError as exc:
        raise MemoryLayoutError(str(exc)) from exc


#: One piece of an edge's per-block transfer: (CTX region, offset in the CTX
#: block of that region, GEN region, offset in the GEN block of that region,
#: length). The same pieces are moved for every block pair.
Piece = tuple[int, int, int, int, int]


def edge_pieces(segments: Sequence[tuple[int, ...]], max_piece: int) -> tuple[Piece, ...]:
    """An edge's segments cut into pieces of at most `max_piece` bytes (one
    chunk), in order. A segment is `(src_region, src_offset, dst_region,
    dst_offset, length)` (`topology.memory_pieces`) or `(src_offset,
    dst_offset, length)` (region 0 on both sides). Every byte is in exactly one piece."""
    if max_piece <= 0:
        raise DataPlaneError(f"max_piece must be positive, got {max_piece}")
    pieces: list[Piece] = []
    for seg in segments:
        sr, src, dr, dst, length = seg if len(seg) == 5 else (0, seg[0], 0, seg[1], seg[2])
        if length <= 0:
            raise DataPlaneError(f"empty segment {seg}")
        for off in range(0, length, max_piece):
            pieces.append((sr, src + off, dr, dst + off, min(max_piece, length - off)))
    return tuple(pieces)


@dataclasses.dataclass(frozen=True, eq=False)
class ChunkPlan:
    """One chunk of one edge, in both forms NIXL can post."""

    #: Absolute (src, dst, length) regions, merged where contiguous on both
    #: sides (and in one region on both sides); empty until resolved against
    #: both sides' region tables (`resolve_regions`).
    regions: tuple[Region, ...]
    #: Indices into the edge's prepared local list (ctx block * pieces + piece).
    local: np.ndarray
    #: Indices into the edge's prepared remote list (gen block * pieces + piece).
    remote: np.ndarray
    nbytes: int


RegionTable = Sequence[tuple[int, int]]


def _piece_arrays(pieces: Sequence[Piece]) -> tuple[np.ndarray, ...]:
    a = np.array(pieces, dtype=np.uint64).reshape(-1, 5)
    return a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4]


def _addresses(
    table: RegionTable, region: np.ndarray, offset: np.ndarray, block: np.ndarray
) -> np.ndarray:
    t = np.array(table, dtype=np.uint64).reshape(-1, 2)
    if len(region) and int(region.max()) >= len(t):
        raise DataPlaneError(f"a piece names region {int(region.max())} of {len(t)}")
    r = region.astype(np.int64)
    return t[r, 0] + block * t[r, 1] + offset


def resolve_regions(
    plan: ChunkPlan, pieces: Sequence[Piece], src_regions: RegionTable, dst_regions: RegionTable
) -> ChunkPlan:
    """`plan` with its absolute regions, from both sides' region tables `(base,
    block stride)`: piece j of a block pair goes from `src base[r] + ctx block *
    stride[r] + offset`; merged where contiguous on both sides and in the same
    region on both sides (never across two registered regions)."""
    p = len(pieces)
    if not p or not len(plan.local):
        return dataclasses.replace(plan, regions=())
    sr, so, dr, do, n = _piece_arrays(pieces)
    local = plan.local.astype(np.int64)
    remote = plan.remote.astype(np.int64)
    j = local % p
    if not np.array_equal(j, remote % p):
        raise DataPlaneError("local and remote indices name different pieces")
    src = _addresses(src_regions, sr[j], so[j], (local // p).astype(np.uint64))
    dst = _addresses(dst_regions, dr[j], do[j], (remote // p).astype(np.uint64))
    length = n[j]
    cont = (
        (src[:-1] + length[:-1] == src[1:])
        & (dst[:-1] + length[:-1] == dst[1:])
        & (sr[j][:-1] == sr[j][1:])
        & (dr[j][:-1] == dr[j][1:])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    sums = np.add.reduceat(length, starts)
    regions = tuple(
        (int(a), int(b), int(c)) for a, b, c in zip(src[starts], dst[starts], sums)
    )
    return dataclasses.replace(plan, regions=regions)


def plan_chunks(
    pieces: Sequence[Piece],
    pairs: Sequence[tuple[int, int]] | np.ndarray,
    chunk_bytes: int,
    src_regions: RegionTable | None = None,
    dst_regions: RegionTable | None = None,
) -> list[ChunkPlan]:
    """Group an edge's pieces over `pairs` = [(ctx block, gen block)], in
    transfer order, into chunks of at most `chunk_bytes` (pieces are never cut:
    `edge_pieces` already bounds them). Every byte of every pair is in exactly
    one chunk. With both sides' region tables the absolute regions are filled
    in too (`resolve_regions`); without, only the prepared-list indices."""
    if chunk_bytes <= 0:
        raise DataPlaneError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if any(p[4] > chunk_bytes for p in pieces):
        raise DataPlaneError(f"a piece is larger than the chunk size {chunk_bytes}")
    per_block = len(pieces)
    if not per_block or not len(pairs):
        return []
    # Row k = pair i, piece j (k = i * per_block + j), in transfer order.
    blocks = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    if per_block == 1:
        local, remote = blocks[:, 0], blocks[:, 1]
    else:
        j = np.arange(per_block, dtype=np.int64)
        local = (blocks[:, 0:1] * per_block + j).reshape(-1)
        remote = (blocks[:, 1:2] * per_block + j).reshape(-1)
    edge_bytes = sum(p[4] for p in pieces) * len(blocks)
    if edge_bytes <= chunk_bytes:  # the whole edge in one chunk (a small handoff's): no search
        plan = ChunkPlan((), local.astype(np.int32), remote.astype(np.int32), edge_bytes)
        if src_regions is not None and dst_regions is not None:
            plan = resolve_regions(plan, pieces, src_regions, dst_regions)
        return [plan]
    lengths = np.tile(np.array([p[4] for p in pieces], dtype=np.int64), len(blocks))
    cum = np.concatenate(([0], np.cumsum(lengths)))
    plans: list[ChunkPlan] = []
    start, total = 0, len(lengths)
    while start < total:
        # Greedy: the longest run from `start` of at most chunk_bytes (>= 1 piece).
        end = max(int(np.searchsorted(cum, cum[start] + chunk_bytes, side="right")) - 1, start + 1)
        plan = ChunkPlan(
            (),
            local[start:end].astype(np.int32),
            remote[start:end].astype(np.int32),
            int(cum[end] - cum[start]),
        )
        if src_regions is not None and dst_regions is not None:
            plan = resolve_regions(plan, pieces, src_regions, dst_regions)
        plans.append(plan)
        start = end
    return plans


class PreparedEdge:
    """An edge's prepared NIXL descriptor lists toward one peer agent: every
    piece of every block of our pool (local) and of the peer's pool (remote)."""

    def __init__(self, peer: str, local: object, remote: object, pieces: int) -> None:
        self.peer = peer
        self.local = local
        self.remote = remote
        self.pieces = pieces


@dataclasses.dataclass(eq=False)
class Chunk:
    """One posted WRITE. Poll it to DONE or ERR; only then release it.

    `descriptors` is how many descriptors the post handed to NIXL (0: none,
    the post failed before any DMA). It says what an ERR proves: one
    descriptor is one transport operation, which has ended when it reports
    ERR; with several, one failing does not end the others, whose bytes may
    still land (the protocol then takes the edge as UNKNOWN)."""

    _transport: NixlTransport
    handle: object
    nbytes: int
    state: XferState
    descriptors: int = 1
    released: bool = dataclasses.field(default=False, init=False)

    @property
    def terminal(self) -> bool:
        return self.state in (XferState.DONE, XferState.ERR)

    def poll(self) -> XferState:
        if not self.terminal:
            self.state = self._transport.check(self)
        return self.state

    @property
    def unproven(self) -> bool:
        """ERR with several descriptors: some of its writes may still run."""
        return self.state is XferState.ERR and self.descriptors > 1

    def release(self) -> bool:
        """Release the handle if the chunk is terminal; an in-flight chunk is never
        released (that is not an abort in NIXL), nor an unproven one (its
        handle is kept, in `NixlTransport.unproven`, until the agent goes).
        Returns whether it was released."""
        if self.released:
            return True
        if not self.terminal:
            log.error("refusing to release in-flight chunk %r (state %s)", self.handle, self.state)
            return False
        if self.unproven:
            if self not in self._transport.unproven:
                self._transport.unproven.append(self)
            return False
        self.released = self._transport.release(self)
        return self.released


class NixlTransport:
    """One NIXL agent over UCX, plus the registration of one KVMemory (every region)."""

    def __init__(self, agent_name: str, buffer: KVMemory) -> None:
        from kvhandoff.actors._nixl import nixl_agent, nixl_agent_config

        self.name = agent_name
        self.buffer = buffer
        # One asyncio thread drives the agent, and progresses it: NIXL's UCX
        # progress thread spun a whole core per agent even when idle (measured:
        # docs/benchmarks.md), so there is none. check_xfer_state and
        # get_new_notifs progress the worker; a WRITE target polls the latter
        # while a WRITE may come (RankCore's poll loop).
        self.agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.registration = self.agent.register_memory(buffer.tensors)
        self.arena_registration: object | None = None
        self.peers: set[str] = set()
        # Prepared descriptor lists: local per piece layout, remote per (peer, layout).
        self._local_lists: dict[tuple[Piece, ...], object] = {}
        self._prepared: dict[tuple[str, tuple[Piece, ...]], PreparedEdge] = {}
        self.leaked: list[object] = []  # handles whose release failed: kept, never retried blindly
        # Chunks that reported ERR with several descriptors: writes of theirs
        # may still run, so their handles are kept, never released.
        self.unproven: list[Chunk] = []
        self.posted_chunks = 0
        self.posted_bytes = 0

    def register_arena(self, tensor: torch.Tensor) -> None:
        """Register a staging arena (one tensor on the buffer's device) beside
        the KV memory, once, before the metadata is published."""
        if self.arena_registration is not None:
            raise DataPlaneError("a staging arena is already registered")
        self.arena_registration = self.agent.register_memory([tensor])

    # -- metadata -----------------------------------------------------------
    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self.peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        if name in self.peers:
            self.peers.discard(name)
            for key in [k for k in self._prepared if k[0] == name]:
                self._release_dlist(self._prepared.pop(key).remote)
            try:
                self.agent.remove_remote_agent(name)
            except Exception as exc:  # a dead peer may already be gone
                log.warning("remove_remote_agent(%s) failed: %s", name, exc)

    # -- prepared descriptor lists ---------------------------------------------
    def _piece_descs(
        self, geometry: BufferGeometry, pieces: Sequence[Piece], side: int
    ) -> np.ndarray:
        # Row (block * len(pieces) + j) addresses piece j of `block`; `side` picks
        # the piece's (region, offset) in the CTX (0) or GEN (1) block.
        sr, so, dr, do, n = _piece_arrays(pieces)
        region, offset = (sr, so) if side == 0 else (dr, do)
        table = np.array(geometry.region_table(), dtype=np.uint64).reshape(-1, 2)
        r = region.astype(np.int64)
        starts = table[r, 0] + offset  # piece j of block 0
        strides = table[r, 1]
        blocks = np.arange(geometry.num_blocks, dtype=np.uint64)
        descs = np.empty((geometry.num_blocks * len(pieces), 3), dtype=np.uint64)
        descs[:, 0] = (starts[None, :] + blocks[:, None] * strides[None, :]).reshape(-1)
        descs[:, 1] = np.tile(n, geometry.num_blocks)
        descs[:, 2] = geometry.device_id
        return descs

    def prepare(self, peer: str, pieces: tuple[Piece, ...], their: BufferGeometry) -> PreparedEdge:
        """The prepared lists for `pieces` toward `peer` (built once, then cached)."""
        found = self._prepared.get((peer, pieces))
        if found is not None:
            return found
        if peer not in self.peers:
            raise DataPlaneError(f"unknown peer agent {peer!r}")
        ours, theirs = self.buffer.geometry().region_table(), their.region_table()
        if any(
            not (0 <= sr < len(ours) and 0 <= dr < len(theirs))
            or so + n > ours[sr][1]
            or do + n > theirs[dr][1]
            for sr, so, dr, do, n in pieces
        ):
            raise DataPlaneError("a piece falls outside a block")
        local = self._local_lists.get(pieces)
        try:
            if local is None:
                descs = self._piece_descs(self.buffer.geometry(), pieces, 0)
                local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, self.buffer.mem_kind)
                self._local_lists[pieces] = local
            descs = self._piece_descs(their, pieces, 1)
            remote = self.agent.prep_xfer_dlist(peer, descs, their.mem_kind)
        except Exception as exc:
            raise DataPlaneError(
                f"NIXL could not prepare descriptor lists for {peer}: {exc}"
            ) from exc
        if local is None or remote is None:
            raise DataPlaneError(f"NIXL rejected the prepared descriptor lists for {peer}")
        prepared = PreparedEdge(peer, local, remote, len(pieces))
        self._prepared[(peer, pieces)] = prepared
        return prepared

    def _release_dlist(self, handle: object) -> None:
        try:
            self.agent.release_dlist_handle(handle)
        except Exception as exc:
            log.warning("release_dlist_handle failed: %s", exc)

    # -- transfers ----------------------------------------------------------
    def _descs(self, regions: Sequence[Region], remote: bool) -> tuple[object, object]:
        kind = self.buffer.mem_kind
        dev = self.buffer.device_id
        src = np.array([(s, n, dev) for s, _, n in regions], dtype=np.uint64).reshape(-1, 3)
        dst = np.array([(d, n, dev) for _, d, n in regions], dtype=np.uint64).reshape(-1, 3)
        local = self.agent.get_xfer_descs(src, kind)
        far = self.agent.get_xfer_descs(dst, kind)
        if local is None or far is None:
            raise DataPlaneError(f"NIXL rejected the descriptors ({len(regions)} regions)")
        return local, far

    def start(self, handle: object, nbytes: int, notif: bytes = b"", descriptors: int = 1) -> Chunk:
        """Post a built WRITE handle of `descriptors` descriptors."""
        try:
            status = self.agent.transfer(handle, notif)
        except Exception as exc:
            # Part of a multi-descriptor WRITE may have been posted already.
            log.warning("NIXL transfer() raised: %s", exc)
            status = "ERR"
        self.posted_chunks += 1
        self.posted_bytes += nbytes
        return Chunk(self, handle, nbytes, XferState(status), descriptors)

    def post(
        self,
        peer: str,
        work: Sequence[Region] | ChunkPlan,
        notif: bytes = b"",
        prepared: PreparedEdge | None = None,
        op: str = "WRITE",
    ) -> Chunk:
        """Build and post one WRITE of `work` (regions, or a chunk plan) to
        `peer`: from the prepared lists by index when `prepared` is given (and
        `work` is a plan), else from built descriptors. ``op="READ"`` reads
        instead: each region's (local, remote, length) moves from the peer's
        remote address into our local one (pull)."""
        if op not in ("WRITE", "READ"):
            raise DataPlaneError(f"op must be 'WRITE' or 'READ', got {op!r}")
        nbytes = _nbytes(work)
        if peer not in self.peers:
            raise DataPlaneError(f"unknown peer agent {peer!r}")
        if isinstance(work, ChunkPlan) and prepared is not None:
            if prepared.peer != peer or not len(work.local):
                raise DataPlaneError(f"prepared lists for {prepared.peer!r} used toward {peer!r}")
            try:
                handle = self.agent.make_prepped_xfer(
                    op, prepared.local, work.local, prepared.remote, work.remote, notif
                )
            except Exception as exc:
                raise DataPlaneError(
                    f"NIXL could not make the prepared {op} with {peer}: {exc}"
                ) from exc
        else:
            regions = work.regions if isinstance(work, ChunkPlan) else work
            if not regions:
                raise DataPlaneError("a chunk needs at least one region")
            local, far = self._descs(regions, remote=True)
            try:
                handle = self.agent.initialize_xfer(op, local, far, peer, notif)
            except Exception as exc:
                raise DataPlaneError(f"NIXL could not build the {op} with {peer}: {exc}") from exc
        return self.start(handle, nbytes, notif, _descriptors(work, prepared))

    def check(self, chunk: Chunk) -> XferState:
        try:
            return XferState(self.agent.check_xfer_state(chunk.handle))
        except Exception as exc:
            log.warning("NIXL check_xfer_state raised: %s", exc)
            return XferState.ERR

    def release(self, chunk: Chunk) -> bool:
        try:
            self.agent.release_xfer_handle(chunk.handle)
            return True
        except Exception as exc:
            # The release hook: log, keep the handle, never pretend it was freed.
            log.error("failed to release NIXL transfer handle %r: %s", chunk.handle, exc)
            self.leaked.append(chunk.handle)
            return False

    # -- notifications --------------------------------------------------------
    def send_notif(self, peer: str, message: bytes) -> None:
        self.agent.send_notif(peer, message)

    def close(self) -> None:
        for prepared in self._prepared.values():
            self._release_dlist(prepared.remote)
        for local in self._local_lists.values():
            self._release_dlist(local)
        self._prepared.clear()
        self._local_lists.clear()
        for registration in (self.registration, self.arena_registration):
            if registration is None:
                continue
            try:
                self.agent.deregister_memory(registration)
            except Exception as exc:
                log.warning("deregister_memory failed: %s", exc)


def _nbytes(work: Sequence[Region] | ChunkPlan) -> int:
    return work.nbytes if isinstance(work, ChunkPlan) else sum(n for _, _, n in work)


def _descriptors(work: Sequence[Region] | ChunkPlan, prepared: PreparedEdge | None) -> int:
    """How many descriptors a post of `work` hands to NIXL (prepared: the
    indices, before NIXL merges contiguous ones; so never fewer than posted)."""
    if isinstance(work, ChunkPlan):
        return len(work.local) if prepared is not None else len(work.regions)
    return len(work)
