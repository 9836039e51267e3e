"""The data plane: preallocated KV buffers and NIXL WRITEs in chunks.

Theory of operation (DESIGN.md "Lifecycle", "Cancellation", "Data plane modes").

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
    "split_chunks",
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


def split_chunks(regions: Sequence[Region], chunk_bytes: int) -> list[list[Region]]:
    """Split regions into chunks of about `chunk_bytes` each (regions are not cut
    unless one alone is larger than a chunk). Every byte lands in exactly one chunk."""
    if chunk_bytes <= 0:
        raise DataPlaneError(f"chunk_bytes must be positive, got {chunk_bytes}")
    chunks: list[list[Region]] = []
    current: list[Region] = []
    size = 0
    for src, dst, length in regions:
        while length > 0:
            take = min(length, chunk_bytes - size) if size else min(length, chunk_bytes)
            current.append((src, dst, take))
            size += take
            src, dst, length = src + take, dst + take, length - take
            if size >= chunk_bytes:
                chunks.append(current)
                current, size = [], 0
    if current:
        chunks.append(current)
    return chunks


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
            try:
                self.agent.remove_remote_agent(name)
            except Exception as exc:  # a dead peer may already be gone
                log.warning("remove_remote_agent(%s) failed: %s", name, exc)

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

    def build(self, peer: str, regions: Sequence[Region], notif: bytes = b"") -> object:
        if not regions:
            raise DataPlaneError("a chunk needs at least one region")
        if peer not in self.peers:
            raise DataPlaneError(f"unknown peer agent {peer!r}")
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

    def post(self, peer: str, regions: Sequence[Region], notif: bytes = b"") -> Chunk:
        """Build and post one WRITE of `regions` to `peer`."""
        nbytes = sum(n for _, _, n in regions)
        return self.start(self.build(peer, regions, notif), nbytes, notif)

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


class _DeferredHandle:
    def __init__(self, peer: str, regions: Sequence[Region], notif: bytes) -> None:
        self.peer = peer
        self.regions = list(regions)
        self.notif = notif
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

    def post(self, peer: str, regions: Sequence[Region], notif: bytes = b"") -> Chunk:
        nbytes = sum(n for _, _, n in regions)
        if peer not in self.peers:
            raise DataPlaneError(f"unknown peer agent {peer!r}")
        self._count += 1
        handle = _DeferredHandle(peer, regions, notif)
        if self.plan.fail_every and self._count % self.plan.fail_every == 0:
            handle.failed = True
            return Chunk(self, handle, nbytes, XferState.ERR)
        if self.plan.defer_polls <= 0 and self.plan.defer_s <= 0 and not self.plan.hold:
            handle.real = super().post(peer, regions, notif)
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
            handle.real = super().post(handle.peer, handle.regions, handle.notif)
        return handle.real.poll()

    def release(self, chunk: Chunk) -> bool:
        handle = chunk.handle
        if not isinstance(handle, _DeferredHandle):
            return super().release(chunk)
        if handle.real is None:
            return True  # never posted: nothing to release
        return handle.real.release()
