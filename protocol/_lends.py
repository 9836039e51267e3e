"""A reader's memory of the lends it has used (pull).

A CTX rank lends a parent's blocks to a reader (a GEN rank) and gives them
back only on the reader's word. Once the reader has read a lend, or been
fenced off one it never read, it must never read that lend again: the CTX
rank may have given the blocks to another request since. `LendMemory`
remembers, per CTX incarnation, the lends used (by the CTX rank's number for
each, `lend_seq`, increasing in an incarnation), in bounded memory: past
the bound it forgets the lowest remembered number of the incarnation with
the most, and refuses every number up to it from then on (its floor). A
refusal fails that request cleanly; nothing is read.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ._ticket import Endpoint

__all__ = ["MAX_REMEMBERED_LENDS"]

#: How many used lends a reader remembers above the floors, over every CTX incarnation.
MAX_REMEMBERED_LENDS = 65536


@dataclass(slots=True)
class _Incarnation:
    floor: int = 0  # every lend numbered up to here counts as used
    used: set[int] = field(default_factory=set)
    order: list[int] = field(default_factory=list)  # heap of `used`


class LendMemory:
    """The lends a reader has read or been fenced off, per CTX incarnation."""

    __slots__ = ("limit", "_by_ctx", "_size")

    def __init__(self, limit: int = MAX_REMEMBERED_LENDS) -> None:
        if limit < 1:
            raise ValueError(f"a lend memory needs room for at least one lend, got {limit}")
        self.limit = limit
        self._by_ctx: dict[Endpoint, _Incarnation] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def used(self, ctx: Endpoint, seq: int) -> bool:
        """Whether lend `seq` of CTX incarnation `ctx` was used (or is below its floor)."""
        known = self._by_ctx.get(ctx)
        return known is not None and (seq <= known.floor or seq in known.used)

    def snapshot(self) -> tuple[object, ...]:
        """A comparable picture of what is remembered (for S3 tests)."""
        return tuple(sorted((repr(ctx), known.floor, tuple(sorted(known.used))) for ctx, known in self._by_ctx.items()))

    def floor(self, ctx: Endpoint) -> int:
        known = self._by_ctx.get(ctx)
        return 0 if known is None else known.floor

    def mark(self, ctx: Endpoint, seq: int) -> None:
        """Remember lend `seq` of `ctx` as used (a no-op if it counts as used already)."""
        if self.used(ctx, seq):
            return
        known = self._by_ctx.setdefault(ctx, _Incarnation())
        known.used.add(seq)
        heapq.heappush(known.order, seq)
        self._size += 1
        while self._size > self.limit:
            self._forget_one()

    def _forget_one(self) -> None:
        fullest = max(self._by_ctx.values(), key=lambda known: len(known.used))
        lowest = heapq.heappop(fullest.order)
        fullest.used.discard(lowest)
        fullest.floor = max(fullest.floor, lowest)
        self._size -= 1
