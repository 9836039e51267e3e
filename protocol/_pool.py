"""Block pools, slot generations, leases and quarantine (docs/design.md "Slots, leases, ownership").

Theory of operation
-------------------
Each rank owns one `BlockPool` over its preallocated KV blocks. Every block is,
at every moment, in exactly one of three states (invariant S4):

* FREE: nobody owns it; the next `lease()` may hand it out.
* LEASED: one lease (one parent attempt on this rank) owns it.
* QUARANTINED: its last owner could not prove that no transfer still writes it
  (TerminalKind.UNKNOWN). It stays owned by that lease and is never handed out
  again until `reclaim_quarantine()` is called with a proof of quiescence (the
  NIXL agent of the epoch that posted the writes is torn down, or the rank
  process restarted and builds a fresh pool).

Each block carries a *generation* that increases every time the block is
leased, so a descriptor `(block, generation)` names one incarnation of the
block. A late message that names an older generation is detected (ABA-safe,
S3): `is_current()` is false for it.

Ownership is cleanup-once: a lease is released or quarantined exactly once. A
second `release()` is a reported no-op (`Cleanup.ALREADY_RELEASED`), never a
double free; releasing a quarantined lease is refused the same way
(`Cleanup.ALREADY_QUARANTINED`) so a quarantined block can never slip back to
FREE through the ordinary path. The record of closed owners is bounded (the
oldest are forgotten first), like h2's `_closed_streams`.

The pool is pure bookkeeping: it never touches memory, has no clock, and every
failing call raises a `PoolError`/`LeaseError` before changing anything.
"""

from __future__ import annotations

import collections
import enum
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ._errors import LeaseError, PoolError

__all__ = [
    "BlockState",
    "BlockRef",
    "Cleanup",
    "PoolCounts",
    "BlockPool",
    "CLOSED_OWNER_MEMORY",
]

#: How many closed (released or reclaimed) owners a pool remembers, so that a
#: second release is reported as such rather than as an unknown owner.
CLOSED_OWNER_MEMORY = 4096


class BlockState(enum.Enum):
    FREE = "free"  # owned by nobody; may be leased
    LEASED = "leased"  # owned by one live lease
    QUARANTINED = "quarantined"  # owned by a lease whose writes are UNKNOWN; never reused


@dataclass(frozen=True, slots=True, order=True)
class BlockRef:
    """One incarnation of one block: its index and the generation it was leased at."""

    block: int
    generation: int


class Cleanup(enum.Enum):
    RELEASED = "released"  # this call returned the blocks to FREE
    QUARANTINED = "quarantined"  # this call moved the blocks to QUARANTINED
    ALREADY_RELEASED = "already_released"  # no-op: the lease was released before
    ALREADY_QUARANTINED = "already_quarantined"  # no-op: the lease is quarantined


@dataclass(frozen=True, slots=True)
class PoolCounts:
    """How many blocks are in each state; `free + leased + quarantined == total` (S4)."""

    free: int
    leased: int
    quarantined: int
    total: int


class _LeaseState(enum.Enum):
    LIVE = "live"  # blocks LEASED
    QUARANTINED = "quarantined"  # blocks QUARANTINED, still owned


@dataclass(slots=True)
class _Lease:
    refs: tuple[BlockRef, ...]
    state: _LeaseState


class BlockPool:
    """The KV blocks of one rank: leases, generations, quarantine (S4).

    `owner` is any hashable key naming one parent attempt on this rank (the
    session layer uses `ParentKey`). One owner holds at most one lease.
    """

    def __init__(self, num_blocks: int, *, first_generation: int = 0) -> None:
        if num_blocks < 1:
            raise PoolError(f"a pool needs at least one block, got {num_blocks}")
        if first_generation < 0:
            raise PoolError(f"generations start at 0 or more, got {first_generation}")
        self._num_blocks = num_blocks
        self._state = [BlockState.FREE] * num_blocks
        self._generation = [first_generation] * num_blocks
        self._owner: list[Hashable | None] = [None] * num_blocks
        # FIFO free list: a released block goes to the back, so reuse rotates
        # through the pool and generation bumps are exercised.
        # An insertion-ordered set (dict keys): FIFO for `lease`, O(1) removal
        # of a named block for `lease_blocks`.
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))
        self._leases: dict[Hashable, _Lease] = {}
        self._quarantined = 0  # blocks in QUARANTINED, kept as they move (O(1) `counts`)
        self._closed: collections.OrderedDict[Hashable, Cleanup] = collections.OrderedDict()

    # ---- queries -------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def counts(self) -> PoolCounts:
        """Count blocks per state, O(1): ranks ask on every action they perform
        (the admission stop), so a scan of a 65,536-block pool is not affordable.
        `check_invariants` checks the counts against a scan."""
        quarantined = self._quarantined
        free = len(self._free)
        return PoolCounts(
            free=free,
            leased=self._num_blocks - free - quarantined,
            quarantined=quarantined,
            total=self._num_blocks,
        )

    def state_of(self, block: int) -> BlockState:
        self._check_index(block)
        return self._state[block]

    def generation_of(self, block: int) -> int:
        self._check_index(block)
        return self._generation[block]

    def is_current(self, ref: BlockRef) -> bool:
        """True if `ref` names the block's live incarnation (owned, same generation)."""
        if not 0 <= ref.block < self._num_blocks:
            return False
        return (
            self._state[ref.block] is not BlockState.FREE
            and self._generation[ref.block] == ref.generation
        )

    def owner_of(self, ref: BlockRef) -> Hashable | None:
        """The owner holding `ref`'s incarnation, or None if it is not current."""
        return self._owner[ref.block] if self.is_current(ref) else None

    def lease_of(self, owner: Hashable) -> tuple[BlockRef, ...]:
        """The blocks `owner` holds (leased or quarantined); LeaseError if none."""
        lease = self._leases.get(owner)
        if lease is None:
            raise LeaseError(f"no live lease for owner {owner!r}")
        return lease.refs

    def holds(self, owner: Hashable) -> bool:
        return owner in self._leases

    def is_quarantined(self, owner: Hashable) -> bool:
        lease = self._leases.get(owner)
        return lease is not None and lease.state is _LeaseState.QUARANTINED

    # ---- transitions ---------------------------------------------------

    def lease(self, owner: Hashable, n: int) -> tuple[BlockRef, ...]:
        """Lease `n` free blocks to `owner`, bumping each block's generation.

        All or nothing: too few free blocks raises PoolError and leases none.
        An owner that already holds a lease, or was closed recently, raises
        LeaseError (one lease per parent attempt; attempts are never reused).
        """
        if n < 1:
            raise PoolError(f"a lease needs at least one block, got {n}")
        if owner in self._leases:
            raise LeaseError(f"owner {owner!r} already holds a lease")
        if owner in self._closed:
            raise LeaseError(
                f"owner {owner!r} was already {self._closed[owner].value}; attempts are not reused"
            )
        if n > len(self._free):
            raise PoolError(f"cannot lease {n} blocks: only {len(self._free)} free")
        refs = []
        # The n oldest free blocks, taken in one pass: deleting a dict's first
        # key and iterating again skips every deleted slot (quadratic: 0.6 s
        # for a 32,768-block lease).
        for block in list(itertools.islice(self._free, n)):
            del self._free[block]
            self._generation[block] += 1
            self._state[block] = BlockState.LEASED
            self._owner[block] = owner
            refs.append(BlockRef(block, self._generation[block]))
        self._leases[owner] = _Lease(refs=tuple(refs), state=_LeaseState.LIVE)
        return tuple(refs)

    def lease_blocks(self, owner: Hashable, blocks: Sequence[int]) -> tuple[BlockRef, ...]:
        """Lease exactly `blocks`, in that order, to `owner` (an engine's block
        manager chose them), bumping each block's generation.

        All or nothing, and nothing changes on a refusal: a block out of range,
        named twice or not FREE here (still leased or quarantined for another
        parent) raises PoolError; an owner that holds or held a lease raises
        LeaseError, as for `lease`."""
        if not blocks:
            raise PoolError("a lease needs at least one block, got none")
        if owner in self._leases:
            raise LeaseError(f"owner {owner!r} already holds a lease")
        if owner in self._closed:
            raise LeaseError(
                f"owner {owner!r} was already {self._closed[owner].value}; attempts are not reused"
            )
        seen: set[int] = set()
        for block in blocks:
            if not isinstance(block, int) or isinstance(block, bool):
                raise PoolError(f"block ids are ints, got {block!r}")
            self._check_index(block)
            if block in seen:
                raise PoolError(f"block {block} named twice")
            seen.add(block)
            if self._state[block] is not BlockState.FREE:
                raise PoolError(f"block {block} is {self._state[block].name}, not FREE")
        refs = []
        for block in blocks:
            del self._free[block]
            self._generation[block] += 1
            self._state[block] = BlockState.LEASED
            self._owner[block] = owner
            refs.append(BlockRef(block, self._generation[block]))
        self._leases[owner] = _Lease(refs=tuple(refs), state=_LeaseState.LIVE)
        return tuple(refs)

    def release(self, owner: Hashable) -> Cleanup:
        """Return `owner`'s blocks to FREE, exactly once.

        A second release reports `ALREADY_RELEASED` and frees nothing; a
        quarantined lease reports `ALREADY_QUARANTINED` and stays quarantined.
        An owner never seen (or long forgotten) raises LeaseError.
        """
        lease = self._leases.get(owner)
        if lease is None:
            if owner in self._closed:
                return Cleanup.ALREADY_RELEASED
            raise LeaseError(f"release of unknown owner {owner!r}")
        if lease.state is _LeaseState.QUARANTINED:
            return Cleanup.ALREADY_QUARANTINED
        self._free_blocks(lease)
        del self._leases[owner]
        self._remember_closed(owner, Cleanup.RELEASED)
        return Cleanup.RELEASED

    def quarantine(self, owner: Hashable) -> Cleanup:
        """Move `owner`'s blocks to QUARANTINED: still owned, never reused.

        Idempotent (`ALREADY_QUARANTINED`). A released owner cannot be
        quarantined any more (its blocks may belong to someone else): LeaseError.
        """
        lease = self._leases.get(owner)
        if lease is None:
            raise LeaseError(f"quarantine of owner {owner!r} that holds no lease")
        if lease.state is _LeaseState.QUARANTINED:
            return Cleanup.ALREADY_QUARANTINED
        for ref in lease.refs:
            self._state[ref.block] = BlockState.QUARANTINED
        self._quarantined += len(lease.refs)
        lease.state = _LeaseState.QUARANTINED
        return Cleanup.QUARANTINED

    def reclaim_quarantine(self, owner: Hashable, *, proof: str) -> Cleanup:
        """Return a quarantined lease's blocks to FREE, given a proof of quiescence.

        This is the only way out of QUARANTINED besides a process restart (a
        restarted rank builds a new pool under a new endpoint epoch). `proof`
        names the evidence, e.g. "nixl agent of epoch 7 torn down"; it must be
        non-empty so a reclaim is always an explicit, logged decision.
        """
        if not proof:
            raise LeaseError("reclaim_quarantine needs a non-empty proof of quiescence")
        lease = self._leases.get(owner)
        if lease is None or lease.state is not _LeaseState.QUARANTINED:
            raise LeaseError(f"owner {owner!r} holds no quarantined lease")
        self._quarantined -= len(lease.refs)
        self._free_blocks(lease)
        del self._leases[owner]
        self._remember_closed(owner, Cleanup.RELEASED)
        return Cleanup.RELEASED

    def check_invariants(self) -> None:
        """Raise PoolError if S4 or the ownership bookkeeping is broken."""
        free_set = set(self._free)
        owned: dict[int, Hashable] = {}
        for owner, lease in self._leases.items():
            want = BlockState.LEASED if lease.state is _LeaseState.LIVE else BlockState.QUARANTINED
            for ref in lease.refs:
                if ref.block in owned:
                    raise PoolError(
                        f"block {ref.block} owned by {owned[ref.block]!r} and {owner!r}"
                    )
                owned[ref.block] = owner
                if self._state[ref.block] is not want:
                    raise PoolError(
                        f"block {ref.block} of {owner!r} is {self._state[ref.block]}, want {want}"
                    )
                if self._generation[ref.block] != ref.generation:
                    raise PoolError(f"block {ref.block} generation moved under its lease")
                if self._owner[ref.block] != owner:
                    raise PoolError(f"block {ref.block} owner record is wrong")
        for block in range(self._num_blocks):
            in_free = block in free_set
            if in_free != (self._state[block] is BlockState.FREE):
                raise PoolError(f"block {block} is {self._state[block]} but free-list={in_free}")
            if in_free == (block in owned):
                raise PoolError(f"block {block} is both free and owned, or neither")
        c = self.counts()
        if c.free + c.leased + c.quarantined != c.total:
            raise PoolError(f"counts do not add up: {c}")
        scanned = sum(1 for s in self._state if s is BlockState.QUARANTINED)
        if scanned != c.quarantined:
            raise PoolError(f"{scanned} blocks are QUARANTINED, the count says {c.quarantined}")

    # ---- internals -----------------------------------------------------

    def _free_blocks(self, lease: _Lease) -> None:
        for ref in lease.refs:
            self._state[ref.block] = BlockState.FREE
            self._owner[ref.block] = None
            self._free[ref.block] = None

    def _remember_closed(self, owner: Hashable, how: Cleanup) -> None:
        self._closed[owner] = how
        self._closed.move_to_end(owner)
        while len(self._closed) > CLOSED_OWNER_MEMORY:
            self._closed.popitem(last=False)

    def _check_index(self, block: int) -> None:
        if not 0 <= block < self._num_blocks:
            raise PoolError(f"block {block} outside pool of {self._num_blocks}")
