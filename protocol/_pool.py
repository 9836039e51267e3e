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

Block lists are arrays, not objects. A request may hold thousands of blocks
(8,192 blocks of 64 tokens is a 512k-token context), and a rank leases,
checks and frees them on the handoff's critical path. The per-block state,
generation and owner live in numpy arrays; a lease is a `BlockRefs` (the
lease's block indices and generations, two read-only arrays) and every
transition is a handful of vectorized operations. `BlockRefs` is still a
sequence of `BlockRef`, for the callers that want one incarnation at a time.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from ._errors import LeaseError, PoolError

__all__ = [
    "BlockState",
    "BlockRef",
    "BlockRefs",
    "Cleanup",
    "PoolCounts",
    "BlockPool",
    "CLOSED_OWNER_MEMORY",
]

#: How many closed (released or reclaimed) owners a pool remembers, so that a
#: second release is reported as such rather than as an unknown owner.
CLOSED_OWNER_MEMORY = 4096

# Block states as stored in the pool's state array (`BlockState` outside).
_FREE, _LEASED, _QUARANTINED = 0, 1, 2


class BlockState(enum.Enum):
    FREE = "free"  # owned by nobody; may be leased
    LEASED = "leased"  # owned by one live lease
    QUARANTINED = "quarantined"  # owned by a lease whose writes are UNKNOWN; never reused


@dataclass(frozen=True, slots=True, order=True)
class BlockRef:
    """One incarnation of one block: its index and the generation it was leased at."""

    block: int
    generation: int

    def __reduce__(self) -> tuple[Any, tuple[int, int]]:
        return (BlockRef, (self.block, self.generation))  # positional: cheaper than copyreg's


_STATE_OF_CODE = (BlockState.FREE, BlockState.LEASED, BlockState.QUARANTINED)


def _frozen(values: Any) -> np.ndarray:
    out = np.array(values, dtype=np.int64)  # a copy: the caller keeps its own
    out.setflags(write=False)
    return out


def _refs_from_bytes(blocks: bytes, generations: bytes) -> BlockRefs:
    refs = BlockRefs.__new__(BlockRefs)
    # frombuffer over bytes is read-only already, as `_frozen` makes them.
    refs._blocks = np.frombuffer(blocks, dtype=np.int64)
    refs._generations = np.frombuffer(generations, dtype=np.int64)
    return refs


class BlockRefs(Sequence[BlockRef]):
    """An immutable list of block incarnations held as two arrays: `blocks`
    (indices) and `generations`, both read-only int64. What a lease returns.

    Indexing gives a `BlockRef` (a slice gives `BlockRefs`); iteration makes
    one `BlockRef` per block, so hot paths read the arrays instead. Equal to
    another `BlockRefs`, or a tuple or list of `BlockRef`, with the same
    incarnations in the same order.
    """

    __slots__ = ("_blocks", "_generations")

    def __init__(self, blocks: Any, generations: Any) -> None:
        b, g = _frozen(blocks), _frozen(generations)
        if b.ndim != 1 or b.shape != g.shape:
            raise ValueError(f"blocks {b.shape} and generations {g.shape} must be equal 1-d arrays")
        self._blocks, self._generations = b, g

    def __reduce__(self) -> tuple[Any, tuple[bytes, bytes]]:
        # Pickled as the arrays' bytes: a copy of a rank (the interleaving
        # explorer copies whole worlds) costs a few microseconds, not numpy's
        # generic array reduction.
        return (_refs_from_bytes, (self._blocks.tobytes(), self._generations.tobytes()))

    @classmethod
    def of(cls, refs: Sequence[BlockRef]) -> BlockRefs:
        """The `BlockRefs` of some `BlockRef`s (a `BlockRefs` is returned as is)."""
        if isinstance(refs, BlockRefs):
            return refs
        return cls([r.block for r in refs], [r.generation for r in refs])

    @property
    def blocks(self) -> np.ndarray:
        return self._blocks

    @property
    def generations(self) -> np.ndarray:
        return self._generations

    def block_list(self) -> list[int]:
        """The block indices as Python ints."""
        return self._blocks.tolist()  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return len(self._blocks)

    @overload
    def __getitem__(self, index: int) -> BlockRef: ...
    @overload
    def __getitem__(self, index: slice) -> BlockRefs: ...
    def __getitem__(self, index: int | slice) -> BlockRef | BlockRefs:
        if isinstance(index, slice):
            return BlockRefs(self._blocks[index], self._generations[index])
        return BlockRef(int(self._blocks[index]), int(self._generations[index]))

    def __iter__(self) -> Iterator[BlockRef]:
        for b, g in zip(self._blocks.tolist(), self._generations.tolist()):
            yield BlockRef(b, g)

    def __contains__(self, ref: object) -> bool:
        if not isinstance(ref, BlockRef):
            return False
        return bool(np.any((self._blocks == ref.block) & (self._generations == ref.generation)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockRefs):
            return np.array_equal(self._blocks, other._blocks) and np.array_equal(
                self._generations, other._generations
            )
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._blocks.tobytes(), self._generations.tobytes()))

    def __repr__(self) -> str:
        head = zip(self._blocks[:8].tolist(), self._generations[:8].tolist())
        shown = ", ".join(f"{b}@{g}" for b, g in head)
        more = f", ... {len(self) - 8} more" if len(self) > 8 else ""
        return f"BlockRefs([{shown}{more}])"


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
    refs: BlockRefs
    state: _LeaseState
    oid: int  # the owner's number in the pool's owner array

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_Lease, (self.refs, self.state, self.oid))  # positional: cheaper than copyreg's slot dict


class BlockPool:
    """The KV blocks of one rank: leases, generations, quarantine (S4).

    `owner` is any hashable key naming one parent attempt on this rank (the
    session layer uses `ParentKey`). One owner holds at most one lease.
    """

    _ARRAYS = (
        ("_state", np.int8),
        ("_generation", np.int64),
        ("_owner_id", np.int64),
        ("_free_stamp", np.int64),
        ("_queue", np.int64),
        ("_queue_stamp", np.int64),
    )

    def __getstate__(self) -> dict[str, Any]:
        # The three arrays as bytes (see `BlockRefs.__reduce__`).
        state = dict(self.__dict__)
        for name, _ in self._ARRAYS:
            state[name] = state[name].tobytes()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, dtype in self._ARRAYS:
            state[name] = np.frombuffer(state[name], dtype=dtype).copy()
        self.__dict__.update(state)

    def __init__(self, num_blocks: int, *, first_generation: int = 0) -> None:
        if num_blocks < 1:
            raise PoolError(f"a pool needs at least one block, got {num_blocks}")
        if first_generation < 0:
            raise PoolError(f"generations start at 0 or more, got {first_generation}")
        self._num_blocks = num_blocks
        self._state = np.full(num_blocks, _FREE, dtype=np.int8)
        self._generation = np.full(num_blocks, first_generation, dtype=np.int64)
        # Who owns each block: a number per live lease (0: nobody), so a
        # lease's blocks are claimed and freed in one array operation.
        self._owner_id = np.zeros(num_blocks, dtype=np.int64)
        self._owner_by_id: dict[int, Hashable] = {}
        self._next_oid = 1
        # FIFO free list: a released block goes to the back, so reuse rotates
        # through the pool and generation bumps are exercised. Arrays, so a
        # lease or a release of thousands of blocks is a few numpy calls:
        # `_queue[_head:_tail]` holds block ids with the stamp each was queued
        # under (`_queue_stamp`); a block is free exactly while
        # `_free_stamp[block]` is its entry's stamp (-1: not free). A block
        # leased by name (`lease_blocks`) just loses its stamp: its entry
        # stays behind, stale, and `lease` skips it (lazy deletion); the
        # queue is compacted when its end reaches the array's.
        self._free_stamp = np.arange(num_blocks, dtype=np.int64)
        self._queue = np.zeros(2 * num_blocks, dtype=np.int64)
        self._queue[:num_blocks] = np.arange(num_blocks, dtype=np.int64)
        self._queue_stamp = np.full(2 * num_blocks, -1, dtype=np.int64)
        self._queue_stamp[:num_blocks] = np.arange(num_blocks, dtype=np.int64)
        self._head, self._tail = 0, num_blocks
        self._next_stamp = num_blocks
        self._nfree = num_blocks
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
        free = self._nfree
        return PoolCounts(
            free=free,
            leased=self._num_blocks - free - quarantined,
            quarantined=quarantined,
            total=self._num_blocks,
        )

    def state_of(self, block: int) -> BlockState:
        self._check_index(block)
        return _STATE_OF_CODE[int(self._state[block])]

    def generation_of(self, block: int) -> int:
        self._check_index(block)
        return int(self._generation[block])

    def free_order(self) -> list[int]:
        """The free blocks in the order `lease` hands them out (oldest first)."""
        queued = self._queue[self._head : self._tail]
        live = self._free_stamp[queued] == self._queue_stamp[self._head : self._tail]
        return queued[live].tolist()  # type: ignore[no-any-return]

    def is_current(self, ref: BlockRef) -> bool:
        """True if `ref` names the block's live incarnation (owned, same generation)."""
        if not 0 <= ref.block < self._num_blocks:
            return False
        return bool(
            self._state[ref.block] != _FREE
            and self._generation[ref.block] == ref.generation
        )

    def current(self, blocks: np.ndarray, generations: np.ndarray) -> np.ndarray:
        """`is_current` of many incarnations at once: a bool array, one per
        (block, generation) pair (an index outside the pool is not current)."""
        blocks = np.asarray(blocks, dtype=np.int64)
        generations = np.asarray(generations, dtype=np.int64)
        inside = (blocks >= 0) & (blocks < self._num_blocks)
        safe = np.where(inside, blocks, 0)
        return inside & (self._state[safe] != _FREE) & (self._generation[safe] == generations)  # type: ignore[no-any-return]

    def owned_by(self, owner: Hashable, blocks: np.ndarray) -> np.ndarray:
        """Which of `blocks` (indices inside the pool) `owner`'s lease holds: a bool array."""
        lease = self._leases.get(owner)
        blocks = np.asarray(blocks, dtype=np.int64)
        if lease is None:
            return np.zeros(len(blocks), dtype=bool)
        return self._owner_id[blocks] == lease.oid  # type: ignore[no-any-return]

    def owner_of(self, ref: BlockRef) -> Hashable | None:
        """The owner holding `ref`'s incarnation, or None if it is not current."""
        if not self.is_current(ref):
            return None
        return self._owner_by_id.get(int(self._owner_id[ref.block]))

    def lease_of(self, owner: Hashable) -> BlockRefs:
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

    def lease(self, owner: Hashable, n: int) -> BlockRefs:
        """Lease `n` free blocks to `owner`, bumping each block's generation.

        All or nothing: too few free blocks raises PoolError and leases none.
        An owner that already holds a lease, or was closed recently, raises
        LeaseError (one lease per parent attempt; attempts are never reused).
        """
        if n < 1:
            raise PoolError(f"a lease needs at least one block, got {n}")
        self._check_new_owner(owner)
        if n > self._nfree:
            raise PoolError(f"cannot lease {n} blocks: only {self._nfree} free")
        return self._claim(owner, self._take_oldest(n))

    def lease_blocks(self, owner: Hashable, blocks: Sequence[int] | np.ndarray) -> BlockRefs:
        """Lease exactly `blocks`, in that order, to `owner` (an engine's block
        manager chose them), bumping each block's generation. `blocks` is a
        sequence of ints or an integer array.

        All or nothing, and nothing changes on a refusal: a block out of range,
        named twice or not FREE here (still leased or quarantined for another
        parent) raises PoolError; an owner that holds or held a lease raises
        LeaseError, as for `lease`."""
        if not len(blocks):
            raise PoolError("a lease needs at least one block, got none")
        self._check_new_owner(owner)
        wanted = self._block_array(blocks)
        outside = (wanted < 0) | (wanted >= self._num_blocks)
        if outside.any():
            self._check_index(int(wanted[np.argmax(outside)]))
        order = np.argsort(wanted, kind="stable")
        ranked = wanted[order]
        twice = ranked[1:] == ranked[:-1]
        if twice.any():
            raise PoolError(f"block {int(ranked[1:][np.argmax(twice)])} named twice")
        states = self._state[wanted]
        if (states != _FREE).any():
            block = int(wanted[np.argmax(states != _FREE)])
            raise PoolError(f"block {block} is {self.state_of(block).name}, not FREE")
        self._free_stamp[wanted] = -1  # their queue entries go stale (`_take_oldest` skips them)
        self._nfree -= len(wanted)
        return self._claim(owner, wanted)

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
        self._free_blocks(owner, lease)
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
        self._state[lease.refs.blocks] = _QUARANTINED
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
        self._free_blocks(owner, lease)
        self._remember_closed(owner, Cleanup.RELEASED)
        return Cleanup.RELEASED

    def check_invariants(self) -> None:
        """Raise PoolError if S4 or the ownership bookkeeping is broken."""
        owned = np.zeros(self._num_blocks, dtype=np.int64)  # how many leases hold each block
        for owner, lease in self._leases.items():
            want = _LEASED if lease.state is _LeaseState.LIVE else _QUARANTINED
            blocks = lease.refs.blocks
            np.add.at(owned, blocks, 1)
            if self._owner_by_id.get(lease.oid) != owner:
                raise PoolError(f"the owner record of {owner!r} is wrong")
            for block in blocks[self._state[blocks] != want].tolist():
                raise PoolError(
                    f"block {block} of {owner!r} is {self.state_of(block)}, "
                    f"want {_STATE_OF_CODE[want]}"
                )
            for block in blocks[self._generation[blocks] != lease.refs.generations].tolist():
                raise PoolError(f"block {block} generation moved under its lease")
            for block in blocks[self._owner_id[blocks] != lease.oid].tolist():
                raise PoolError(f"block {block} owner record is wrong")
        for block in np.flatnonzero(owned > 1).tolist():
            raise PoolError(f"block {block} owned by more than one lease")
        if len(self._owner_by_id) != len(self._leases):
            raise PoolError("an owner number outlived its lease")
        in_free = self._free_stamp >= 0
        queued = self._queue[self._head : self._tail]
        valid = self._free_stamp[queued] == self._queue_stamp[self._head : self._tail]
        entries = np.bincount(queued[valid], minlength=self._num_blocks)
        for block in np.flatnonzero(entries != in_free).tolist():
            raise PoolError(f"block {block} has {int(entries[block])} live free-list entries, free={bool(in_free[block])}")
        if int(np.count_nonzero(in_free)) != self._nfree:
            raise PoolError(f"{int(np.count_nonzero(in_free))} blocks are on the free list, the count says {self._nfree}")
        for block in np.flatnonzero(in_free != (self._state == _FREE)).tolist():
            raise PoolError(
                f"block {block} is {self.state_of(block)} but free-list={bool(in_free[block])}"
            )
        for block in np.flatnonzero(in_free == (owned > 0)).tolist():
            raise PoolError(f"block {block} is both free and owned, or neither")
        for block in np.flatnonzero((self._owner_id != 0) != (owned > 0)).tolist():
            raise PoolError(f"block {block} owner record is wrong")
        c = self.counts()
        if c.free + c.leased + c.quarantined != c.total:
            raise PoolError(f"counts do not add up: {c}")
        scanned = int(np.count_nonzero(self._state == _QUARANTINED))
        if scanned != c.quarantined:
            raise PoolError(f"{scanned} blocks are QUARANTINED, the count says {c.quarantined}")

    # ---- internals -----------------------------------------------------

    def _check_new_owner(self, owner: Hashable) -> None:
        if owner in self._leases:
            raise LeaseError(f"owner {owner!r} already holds a lease")
        if owner in self._closed:
            raise LeaseError(
                f"owner {owner!r} was already {self._closed[owner].value}; attempts are not reused"
            )

    def _block_array(self, blocks: Sequence[int] | np.ndarray) -> np.ndarray:
        """Block ids as an int64 array; anything but ints raises PoolError."""
        if isinstance(blocks, np.ndarray):
            if blocks.ndim != 1 or blocks.dtype.kind not in "iu":
                raise PoolError(f"block ids are a 1-d integer array, got {blocks.dtype} {blocks.shape}")
            return blocks.astype(np.int64)
        for block in blocks:
            if not isinstance(block, (int, np.integer)) or isinstance(block, bool):
                raise PoolError(f"block ids are ints, got {block!r}")
        return np.array(blocks, dtype=np.int64)

    def _claim(self, owner: Hashable, blocks: np.ndarray) -> BlockRefs:
        """Give `blocks` (already off the free list) to `owner`: bump their
        generations, mark them LEASED and record the lease."""
        oid = self._next_oid
        self._next_oid += 1
        self._generation[blocks] += 1
        self._state[blocks] = _LEASED
        self._owner_id[blocks] = oid
        self._owner_by_id[oid] = owner
        refs = BlockRefs(blocks, self._generation[blocks])
        self._leases[owner] = _Lease(refs=refs, state=_LeaseState.LIVE, oid=oid)
        return refs

    def _free_blocks(self, owner: Hashable, lease: _Lease) -> None:
        blocks = lease.refs.blocks
        self._state[blocks] = _FREE
        self._owner_id[blocks] = 0
        self._queue_free(blocks)
        del self._owner_by_id[lease.oid]
        del self._leases[owner]

    def _take_oldest(self, n: int) -> np.ndarray:
        """Take the `n` oldest free blocks off the free list (n <= `_nfree`),
        skipping stale entries: a window of the queue's head at a time,
        doubled until it holds `n` live entries."""
        head, tail = self._head, self._tail
        k = n
        while True:
            end = min(tail, head + k)
            blocks = self._queue[head:end]
            live = np.flatnonzero(self._free_stamp[blocks] == self._queue_stamp[head:end])
            if len(live) >= n or end == tail:
                break
            k *= 2
        live = live[:n]
        taken = blocks[live]  # a copy (fancy indexing): the queue may be rewritten
        self._head = head + int(live[-1]) + 1
        self._free_stamp[taken] = -1
        self._nfree -= n
        return taken

    def _queue_free(self, blocks: np.ndarray) -> None:
        """Put `blocks` at the back of the free list, in their order."""
        m = len(blocks)
        if self._tail + m > len(self._queue):
            self._compact()
        stamps = np.arange(self._next_stamp, self._next_stamp + m, dtype=np.int64)
        self._next_stamp += m
        self._queue[self._tail : self._tail + m] = blocks
        self._queue_stamp[self._tail : self._tail + m] = stamps
        self._free_stamp[blocks] = stamps
        self._tail += m
        self._nfree += m

    def _compact(self) -> None:
        """Move the live entries to the queue's start, in order (room for
        every block: at most `num_blocks` are live, the array holds twice that)."""
        head, tail = self._head, self._tail
        blocks = self._queue[head:tail]
        stamps = self._queue_stamp[head:tail]
        live = self._free_stamp[blocks] == stamps
        kept_b, kept_s = blocks[live], stamps[live]
        n = len(kept_b)
        self._queue[:n] = kept_b
        self._queue_stamp[:n] = kept_s
        self._head, self._tail = 0, n

    def _remember_closed(self, owner: Hashable, how: Cleanup) -> None:
        self._closed[owner] = how
        self._closed.move_to_end(owner)
        while len(self._closed) > CLOSED_OWNER_MEMORY:
            self._closed.popitem(last=False)

    def _check_index(self, block: int) -> None:
        if not 0 <= block < self._num_blocks:
            raise PoolError(f"block {block} outside pool of {self._num_blocks}")
