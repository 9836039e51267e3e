"""The data plane: preallocated KV buffers and NIXL WRITEs in chunks.

Theory of operation (docs/design.md "Lifecycle", "Cancellation", "Data plane modes").

A rank owns one `KVBuffer`: a single preallocated, NIXL-registered region of
`num_blocks * block_bytes` bytes (a torch tensor on `cuda` when the rank has a
GPU, host memory otherwise). Blocks are addressed by index; the protocol layer
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
(`edge_pieces`: the shard map's segments, cut to at most one chunk), so the
descriptors of *every* block of both pools are known before any request: a
`PreparedEdge` registers them once with NIXL (`prep_xfer_dlist`: the local list
per edge, the remote list per edge and peer agent, i.e. per endpoint epoch), and
a chunk is then two index arrays (`make_prepped_xfer`) instead of two freshly
built descriptor lists. NIXL merges indices that are contiguous on both sides,
so adjacent blocks still travel as one region. `plan_chunks` produces both
forms of every chunk: the index arrays and the absolute regions (merged where
contiguous), which the built path (`initialize_xfer`) posts when the peer's
buffer geometry is not known yet; the bytes moved are identical.

`FaultyTransport` wraps a real transport for tests: it can defer the real post
of a chunk (so the real bytes land *later*, after a cancel), fail a chunk, or
hold a chunk in PROC. The bytes always move through the real NIXL agent.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

log = logging.getLogger("kvhandoff.dataplane")

__all__ = [
    "DataPlaneError",
    "XferState",
    "Region",
    "KVBuffer",
    "NixlTransport",
    "Chunk",
    "FaultPlan",
    "FaultyTransport",
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
    """Where a rank's block pool lives: what a peer needs to address any block."""

    base: int
    num_blocks: int
    block_bytes: int
    mem_kind: str  # "DRAM" or "VRAM"
    device_id: int

    def block_addr(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise DataPlaneError(f"block {block} outside pool of {self.num_blocks}")
        return self.base + block * self.block_bytes


class KVBuffer:
    """One rank's preallocated block pool memory, registered with NIXL once."""

    def __init__(self, num_blocks: int, block_bytes: int, device: str = "cpu") -> None:
        if num_blocks <= 0 or block_bytes <= 0:
            raise DataPlaneError(f"bad buffer shape: {num_blocks} blocks of {block_bytes} bytes")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.device = device
        self.tensor = torch.zeros(num_blocks * block_bytes, dtype=torch.uint8, device=device)
        self.base = self.tensor.data_ptr()
        self.mem_kind = "VRAM" if self.tensor.is_cuda else "DRAM"
        self.device_id = self.tensor.get_device() if self.tensor.is_cuda else 0

    def block_addr(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise DataPlaneError(f"block {block} outside pool of {self.num_blocks}")
        return self.base + block * self.block_bytes

    def block_view(self, block: int) -> torch.Tensor:
        start = block * self.block_bytes
        return self.tensor[start : start + self.block_bytes]

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def geometry(self) -> BufferGeometry:
        return BufferGeometry(
            self.base, self.num_blocks, self.block_bytes, self.mem_kind, self.device_id
        )


#: One piece of an edge's per-block transfer: (offset in the CTX block, offset in
#: the GEN block, length). The same pieces are moved for every block pair.
Piece = tuple[int, int, int]


def edge_pieces(segments: Sequence[tuple[int, int, int]], max_piece: int) -> tuple[Piece, ...]:
    """An edge's segments `(src_offset, dst_offset, length)` cut into pieces of at
    most `max_piece` bytes (one chunk), in order. Every byte is in exactly one piece."""
    if max_piece <= 0:
        raise DataPlaneError(f"max_piece must be positive, got {max_piece}")
    pieces: list[Piece] = []
    for src, dst, length in segments:
        if length <= 0:
            raise DataPlaneError(f"empty segment {(src, dst, length)}")
        for off in range(0, length, max_piece):
            pieces.append((src + off, dst + off, min(max_piece, length - off)))
    return tuple(pieces)


@dataclasses.dataclass(frozen=True, eq=False)
class ChunkPlan:
    """One chunk of one edge, in both forms NIXL can post."""

    #: Absolute (src, dst, length) regions, merged where contiguous on both sides.
    regions: tuple[Region, ...]
    #: Indices into the edge's prepared local list (ctx block * pieces + piece).
    local: np.ndarray
    #: Indices into the edge's prepared remote list (gen block * pieces + piece).
    remote: np.ndarray
    nbytes: int


def plan_chunks(
    pieces: Sequence[Piece],
    pairs: Sequence[tuple[int, int, int, int]],
    chunk_bytes: int,
) -> list[ChunkPlan]:
    """Group an edge's pieces over `pairs` = [(ctx block, ctx block address, gen
    block, gen block address)], in transfer order, into chunks of at most
    `chunk_bytes` (pieces are never cut: `edge_pieces` already bounds them).
    Every byte of every pair is in exactly one chunk."""
    if chunk_bytes <= 0:
        raise DataPlaneError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if any(n > chunk_bytes for _, _, n in pieces):
        raise DataPlaneError(f"a piece is larger than the chunk size {chunk_bytes}")
    per_block = len(pieces)
    plans: list[ChunkPlan] = []
    regions: list[Region] = []
    local: list[int] = []
    remote: list[int] = []
    size = 0

    def close() -> None:
        nonlocal regions, local, remote, size
        plans.append(
            ChunkPlan(
                tuple(regions),
                np.asarray(local, dtype=np.int32),
                np.asarray(remote, dtype=np.int32),
                size,
            )
        )
        regions, local, remote, size = [], [], [], 0

    for ctx_block, ctx_addr, gen_block, gen_addr in pairs:
        for j, (src_off, dst_off, length) in enumerate(pieces):
            if size and size + length > chunk_bytes:
                close()
            src, dst = ctx_addr + src_off, gen_addr + dst_off
            if (
                regions
                and regions[-1][0] + regions[-1][2] == src
                and regions[-1][1] + regions[-1][2] == dst
            ):
                p_src, p_dst, p_len = regions[-1]
                regions[-1] = (p_src, p_dst, p_len + length)
            else:
                regions.append((src, dst, length))
            local.append(ctx_block * per_block + j)
            remote.append(gen_block * per_block + j)
            size += length
    if size:
        close()
    return plans


class PreparedEdge:
    """An edge's prepared NIXL descriptor lists toward one peer agent: every
    piece of every block of our pool (local) and of the peer's pool (remote)."""

    def __init__(self, peer: str, local: object, remote: object, pieces: int) -> None:
        self.peer = peer
        self.local = local
        self.remote = remote
        self.pieces = pieces


class Chunk:
    """One posted WRITE. Poll it to DONE or ERR; only then release it."""

    def __init__(
        self, transport: NixlTransport, handle: object, nbytes: int, state: XferState
    ) -> None:
        self._transport = transport
        self.handle = handle
        self.nbytes = nbytes
        self.state = state
        self.released = False

    @property
    def terminal(self) -> bool:
        return self.state in (XferState.DONE, XferState.ERR)

    def poll(self) -> XferState:
        if not self.terminal:
            self.state = self._transport.check(self)
        return self.state

    def release(self) -> bool:
        """Release the handle if the chunk is terminal; an in-flight chunk is never
        released (that is not an abort in NIXL). Returns whether it was released."""
        if self.released:
            return True
        if not self.terminal:
            log.error("refusing to release in-flight chunk %r (state %s)", self.handle, self.state)
            return False
        self.released = self._transport.release(self)
        return self.released


class NixlTransport:
    """One NIXL agent over UCX, plus the registration of one KVBuffer."""

    def __init__(self, agent_name: str, buffer: KVBuffer) -> None:
        from kvhandoff.actors._nixl import nixl_agent, nixl_agent_config

        self.name = agent_name
        self.buffer = buffer
        # One asyncio actor thread drives the agent; keep the progress thread for UCX.
        self.agent = nixl_agent(agent_name, nixl_agent_config(backends=["UCX"]))
        self.registration = self.agent.register_memory(buffer.tensor)
        self.peers: set[str] = set()
        # Prepared descriptor lists: local per piece layout, remote per (peer, layout).
        self._local_lists: dict[tuple[Piece, ...], object] = {}
        self._prepared: dict[tuple[str, tuple[Piece, ...]], PreparedEdge] = {}
        self.leaked: list[object] = []  # handles whose release failed: kept, never retried blindly
        self.posted_chunks = 0
        self.posted_bytes = 0

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
        # the piece's offset in the CTX (0) or GEN (1) block.
        offsets = np.array([p[side] for p in pieces], dtype=np.uint64)
        lengths = np.array([p[2] for p in pieces], dtype=np.uint64)
        bases = geometry.base + np.arange(geometry.num_blocks, dtype=np.uint64) * np.uint64(
            geometry.block_bytes
        )
        descs = np.empty((geometry.num_blocks * len(pieces), 3), dtype=np.uint64)
        descs[:, 0] = (bases[:, None] + offsets[None, :]).reshape(-1)
        descs[:, 1] = np.tile(lengths, geometry.num_blocks)
        descs[:, 2] = geometry.device_id
        return descs

    def prepare(self, peer: str, pieces: tuple[Piece, ...], their: BufferGeometry) -> PreparedEdge:
        """The prepared lists for `pieces` toward `peer` (built once, then cached)."""
        found = self._prepared.get((peer, pieces))
        if found is not None:
            return found
        if peer not in self.peers:
            raise DataPlaneError(f"unknown peer agent {peer!r}")
        if any(
            src + n > self.buffer.block_bytes or dst + n > their.block_bytes
            for src, dst, n in pieces
        ):
            raise DataPlaneError("a piece falls outside a block")
        local = self._local_lists.get(pieces)
        try:
            if local is None:
                ours = self._piece_descs(self.buffer.geometry(), pieces, 0)
                local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", ours, self.buffer.mem_kind)
                self._local_lists[pieces] = local
            theirs = self._piece_descs(their, pieces, 1)
            remote = self.agent.prep_xfer_dlist(peer, theirs, their.mem_kind)
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

    def build(
        self,
        peer: str,
        work: Sequence[Region] | ChunkPlan,
        notif: bytes = b"",
        prepared: PreparedEdge | None = None,
    ) -> object:
        """A WRITE handle for `work`: from the prepared lists by index when
        `prepared` is given (and `work` is a plan), else from built descriptors."""
        if peer not in self.peers:
            raise DataPlaneError(f"unknown peer agent {peer!r}")
        if isinstance(work, ChunkPlan) and prepared is not None:
            if prepared.peer != peer or not len(work.local):
                raise DataPlaneError(f"prepared lists for {prepared.peer!r} used toward {peer!r}")
            try:
                return self.agent.make_prepped_xfer(
                    "WRITE", prepared.local, work.local, prepared.remote, work.remote, notif
                )
            except Exception as exc:
                raise DataPlaneError(
                    f"NIXL could not make the prepared WRITE to {peer}: {exc}"
                ) from exc
        regions = work.regions if isinstance(work, ChunkPlan) else work
        if not regions:
            raise DataPlaneError("a chunk needs at least one region")
        local, far = self._descs(regions, remote=True)
        try:
            return self.agent.initialize_xfer("WRITE", local, far, peer, notif)
        except Exception as exc:
            raise DataPlaneError(f"NIXL could not build the WRITE to {peer}: {exc}") from exc

    def start(self, handle: object, nbytes: int, notif: bytes = b"") -> Chunk:
        try:
            status = self.agent.transfer(handle, notif)
        except Exception as exc:
            log.warning("NIXL transfer() raised: %s", exc)
            status = "ERR"
        self.posted_chunks += 1
        self.posted_bytes += nbytes
        return Chunk(self, handle, nbytes, XferState(status))

    def post(
        self,
        peer: str,
        work: Sequence[Region] | ChunkPlan,
        notif: bytes = b"",
        prepared: PreparedEdge | None = None,
    ) -> Chunk:
        """Build and post one WRITE of `work` (regions, or a chunk plan) to `peer`."""
        nbytes = _nbytes(work)
        return self.start(self.build(peer, work, notif, prepared), nbytes, notif)

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

    def notifications(self) -> dict[str, list[bytes]]:
        return {str(k): list(v) for k, v in self.agent.get_new_notifs().items()}

    def close(self) -> None:
        for prepared in self._prepared.values():
            self._release_dlist(prepared.remote)
        for local in self._local_lists.values():
            self._release_dlist(local)
        self._prepared.clear()
        self._local_lists.clear()
        try:
            self.agent.deregister_memory(self.registration)
        except Exception as exc:
            log.warning("deregister_memory failed: %s", exc)


@dataclasses.dataclass
class FaultPlan:
    """What a FaultyTransport does to the chunks posted through it.

    `defer_polls` / `defer_s`: a chunk's real post happens only after this many
    polls / seconds (the real bytes land late). `fail_every`: every Nth chunk reports ERR without
    being posted. `hold`: while True, deferred chunks stay PENDING/PROC.
    """

    defer_polls: int = 0
    fail_every: int = 0
    hold: bool = False
    #: A chunk's real post happens this many seconds after it was posted (a slow link).
    defer_s: float = 0.0


def _nbytes(work: Sequence[Region] | ChunkPlan) -> int:
    return work.nbytes if isinstance(work, ChunkPlan) else sum(n for _, _, n in work)


class _DeferredHandle:
    def __init__(
        self,
        peer: str,
        work: Sequence[Region] | ChunkPlan,
        notif: bytes,
        prepared: PreparedEdge | None,
    ) -> None:
        self.peer = peer
        self.work = work if isinstance(work, ChunkPlan) else list(work)
        self.notif = notif
        self.prepared = prepared
        self.polls = 0
        self.born = time.monotonic()
        self.real: Chunk | None = None
        self.failed = False


class FaultyTransport(NixlTransport):
    """The real transport with injected faults (for tests and the demo's chaos).

    Every byte still moves through the real NIXL agent; only *when* it moves, or
    whether a chunk is reported failed, is changed.
    """

    def __init__(self, agent_name: str, buffer: KVBuffer, plan: FaultPlan | None = None) -> None:
        super().__init__(agent_name, buffer)
        self.plan = plan or FaultPlan()
        self._count = 0

    def post(
        self,
        peer: str,
        work: Sequence[Region] | ChunkPlan,
        notif: bytes = b"",
        prepared: PreparedEdge | None = None,
    ) -> Chunk:
        nbytes = _nbytes(work)
        if peer not in self.peers:
            raise DataPlaneError(f"unknown peer agent {peer!r}")
        self._count += 1
        handle = _DeferredHandle(peer, work, notif, prepared)
        if self.plan.fail_every and self._count % self.plan.fail_every == 0:
            handle.failed = True
            return Chunk(self, handle, nbytes, XferState.ERR)
        if self.plan.defer_polls <= 0 and self.plan.defer_s <= 0 and not self.plan.hold:
            handle.real = super().post(peer, work, notif, prepared)
            return Chunk(self, handle, nbytes, handle.real.state)
        return Chunk(self, handle, nbytes, XferState.PROC)

    def check(self, chunk: Chunk) -> XferState:
        handle = chunk.handle
        if not isinstance(handle, _DeferredHandle):  # a real chunk of ours
            return super().check(chunk)
        if handle.failed:
            return XferState.ERR
        if handle.real is None:
            handle.polls += 1
            too_soon = time.monotonic() - handle.born < self.plan.defer_s
            if self.plan.hold or handle.polls < self.plan.defer_polls or too_soon:
                return XferState.PROC
            handle.real = super().post(handle.peer, handle.work, handle.notif, handle.prepared)
        return handle.real.poll()

    def release(self, chunk: Chunk) -> bool:
        handle = chunk.handle
        if not isinstance(handle, _DeferredHandle):
            return super().release(chunk)
        if handle.real is None:
            return True  # never posted: nothing to release
        return handle.real.release()
