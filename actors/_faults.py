"""Fault injection, for tests and the demo's chaos: injected at construction.

A deployment launched with a `FaultPlan` hands it to every rank (a CTX
rank's chunks go through `FaultyTransport` when the plan faults chunks), and
every rank and the directory of such a deployment are built with a live
fault state (`RankFaults`, `DirectoryFaults`) that a harness drives from
outside, through Ray's `__ray_call__` (kvhandoff.cli.harness). A rank or
directory built without one has `faults` None, and its hot paths test only
that; the harness installs a state on a live one when it first holds
something there (an engine's endpoint, which the engine constructs).

Every byte still moves through the real NIXL agent; a fault changes only
*when* it moves, whether a chunk is reported failed, or when a frame, an
OPEN, a staging notice or a directory answer is let through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvhandoff.actors._dataplane import (
    Chunk,
    ChunkPlan,
    DataPlaneError,
    KVMemory,
    NixlTransport,
    PreparedEdge,
    Region,
    XferState,
    _descriptors,
    _nbytes,
)

__all__ = ["FaultPlan", "FaultyTransport", "RankFaults", "DirectoryFaults"]


@dataclasses.dataclass
class FaultPlan:
    """What a FaultyTransport does to the chunks posted through it.

    `defer_polls` / `defer_s`: a chunk's real post happens only after this many
    polls / seconds (the real bytes land late). `fail_every`: every Nth chunk reports ERR without
    being posted. `fail_partial_every`: every Nth chunk is posted for real and
    reports ERR. `hold`: while True, deferred chunks stay PENDING/PROC.
    """

    defer_polls: int = 0
    fail_every: int = 0
    hold: bool = False
    #: Every Nth chunk is really posted (its bytes land) but reports ERR at
    #: once: a multi-descriptor WRITE whose first descriptor failed while the
    #: others still write.
    fail_partial_every: int = 0
    #: A chunk's real post happens this many seconds after it was posted (a slow link).
    defer_s: float = 0.0

    @property
    def chunk_faults(self) -> bool:
        """Whether chunks need `FaultyTransport` (a plan of none gives a rank
        its live fault state only, over the real transport)."""
        return bool(self.defer_polls or self.fail_every or self.hold or self.fail_partial_every or self.defer_s)


class _WriteOrder(NamedTuple):
    """One WRITE (or READ) order: the arguments of `NixlTransport.post` (bound as it
    binds them), kept to post it late."""

    peer: str
    work: Sequence[Region] | ChunkPlan
    notif: bytes = b""
    prepared: PreparedEdge | None = None
    op: str = "WRITE"


class _DeferredHandle:
    def __init__(self, write: _WriteOrder) -> None:
        # A region list is the caller's: copied, in case it reuses it before the real post.
        self.write = write if isinstance(write.work, ChunkPlan) else write._replace(work=list(write.work))
        self.polls = 0
        self.born = time.monotonic()
        self.real: Chunk | None = None
        self.failed = False


class FaultyTransport(NixlTransport):
    """The real transport with injected faults (for tests and the demo's chaos).

    Every byte still moves through the real NIXL agent; only *when* it moves, or
    whether a chunk is reported failed, is changed.
    """

    def __init__(self, agent_name: str, buffer: KVMemory, plan: FaultPlan | None = None) -> None:
        super().__init__(agent_name, buffer)
        self.plan = plan or FaultPlan()
        self._count = 0
        # The real WRITEs behind chunks that reported ERR while writing: kept
        # (and polled by `progress_partial`) so they finish for real.
        self.partial_failures: list[Chunk] = []

    def post(self, *args: Any, **kwargs: Any) -> Chunk:
        """`NixlTransport.post` (the same arguments: a `_WriteOrder`'s) as the plan faults it."""
        write = _WriteOrder(*args, **kwargs)
        nbytes = _nbytes(write.work)
        if write.peer not in self.peers:
            raise DataPlaneError(f"unknown peer agent {write.peer!r}")
        self._count += 1
        handle = _DeferredHandle(write)
        descriptors = _descriptors(write.work, write.prepared)
        if self.plan.fail_every and self._count % self.plan.fail_every == 0:
            handle.failed = True
            return Chunk(self, handle, nbytes, XferState.ERR, descriptors=0)  # nothing posted
        if self.plan.fail_partial_every and self._count % self.plan.fail_partial_every == 0:
            handle.real = super().post(*write)  # the bytes really go
            handle.failed = True  # ... and the chunk reports ERR at once
            self.partial_failures.append(handle.real)
            return Chunk(self, handle, nbytes, XferState.ERR, descriptors)
        if self.plan.defer_polls <= 0 and self.plan.defer_s <= 0 and not self.plan.hold:
            handle.real = super().post(*write)
            return Chunk(self, handle, nbytes, handle.real.state, descriptors)
        return Chunk(self, handle, nbytes, XferState.PROC, descriptors)

    def check(self, chunk: Chunk) -> XferState:
        if self.partial_failures:
            self.progress_partial()
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
            handle.real = super().post(*handle.write)
        return handle.real.poll()

    def release(self, chunk: Chunk) -> bool:
        handle = chunk.handle
        if not isinstance(handle, _DeferredHandle):
            return super().release(chunk)
        if handle.real is None:
            return True  # never posted: nothing to release
        if handle.real in self.partial_failures:
            return False  # still writing: released by `progress_partial` once DONE
        return handle.real.release()

    def progress_partial(self) -> int:
        """Poll the real WRITEs of partial failures; release the finished ones.
        Returns how many are still writing."""
        for real in list(self.partial_failures):
            # The real transport's check: `real.poll()` would come back
            # through `check` above, and here again, while the WRITE runs.
            if not real.terminal:
                real.state = super().check(real)
            if real.terminal:
                real.release()
                self.partial_failures.remove(real)
        return len(self.partial_failures)


class RankFaults:
    """A rank's live fault state (its `faults`; None without a `FaultPlan`).

    `frames`: frames of request id R to peer (role, rank) wait under
    (R, role, rank), in order, while the key is present. `opens`: a GEN
    rank's admissions of request id R are not installed (no OPEN) while R is
    present. `notices`: while a list, staging notices that reach this rank's
    reader wait there (not scattered, not answered). `drop_acks`: the
    reader's next ACKs that are dropped."""

    def __init__(self) -> None:
        self.frames: dict[tuple[str, str, int], list[tuple[Any, bytes]]] = {}
        self.opens: dict[str, list[Any]] = {}
        self.notices: list[tuple[str, Any, float]] | None = None
        self.drop_acks = 0


class DirectoryFaults:
    """The directory's live fault state: `lookup` answers late."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.instance: str | None = None  # None: every instance's lookups
        self.left: int | None = None  # None: every lookup from now on

    def delay(self, seconds: float, instance: str | None = None, count: int | None = None) -> None:
        """Delay lookups of `instance` (every instance: None) by `seconds`,
        the next `count` of them (all: None); 0 seconds ends it."""
        self.delay_s = max(0.0, float(seconds))
        self.instance = instance
        self.left = count

    async def before_lookup(self, instance: str) -> None:
        if self.delay_s and self.instance in (None, instance) and self.left != 0:
            if self.left is not None:
                self.left -= 1
            await asyncio.sleep(self.delay_s)
