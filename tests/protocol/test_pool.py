"""BlockPool: S4, generations (ABA), all-or-nothing leases, cleanup-once, quarantine."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol import (
    BlockPool,
    BlockRef,
    BlockRefs,
    BlockState,
    Cleanup,
    LeaseError,
    PoolError,
)

from ._helpers import end_lease


def test_lease_bumps_generations_and_counts_add_up() -> None:
    pool = BlockPool(4)
    refs = pool.lease("a", 3)
    assert [r.generation for r in refs] == [1, 1, 1]
    assert pool.counts().free == 1 and pool.counts().leased == 3
    assert all(pool.is_current(r) and pool.owner_of(r) == "a" for r in refs)
    assert pool.release("a") is Cleanup.RELEASED
    assert not any(pool.is_current(r) for r in refs)  # freed: no incarnation is current
    again = pool.lease("b", 4)
    reused = {r.block: r.generation for r in again}
    for old in refs:
        assert reused[old.block] == old.generation + 1  # ABA-safe: a new incarnation
        assert not pool.is_current(old)
    pool.check_invariants()


def test_no_partial_lease() -> None:
    pool = BlockPool(3)
    pool.lease("a", 2)
    with pytest.raises(PoolError):
        pool.lease("b", 2)
    assert pool.counts().free == 1 and not pool.holds("b")
    with pytest.raises(PoolError):
        pool.lease("c", 0)
    with pytest.raises(LeaseError):
        pool.lease("a", 1)  # one lease per owner


def test_release_is_cleanup_once() -> None:
    pool = BlockPool(2)
    pool.lease("a", 2)
    assert pool.release("a") is Cleanup.RELEASED
    pool.lease("b", 2)  # the blocks now belong to b
    assert pool.release("a") is Cleanup.ALREADY_RELEASED  # reported, b keeps its blocks
    assert pool.counts().leased == 2 and pool.holds("b")
    with pytest.raises(LeaseError):
        pool.release("never")
    with pytest.raises(LeaseError):
        pool.lease("a", 1)  # a closed attempt is not reused


def test_quarantine_is_never_reused_until_reclaimed() -> None:
    pool = BlockPool(3)
    refs = pool.lease("a", 2)
    assert pool.quarantine("a") is Cleanup.QUARANTINED
    assert pool.quarantine("a") is Cleanup.ALREADY_QUARANTINED
    assert pool.release("a") is Cleanup.ALREADY_QUARANTINED  # the ordinary path cannot free it
    assert all(pool.state_of(r.block) is BlockState.QUARANTINED for r in refs)
    with pytest.raises(PoolError):
        pool.lease("b", 2)
    with pytest.raises(LeaseError):
        pool.reclaim_quarantine("a", proof="")
    assert pool.reclaim_quarantine("a", proof="agent epoch 1 gone") is Cleanup.RELEASED
    assert pool.counts().free == 3
    with pytest.raises(LeaseError):
        pool.quarantine("a")  # released owners cannot be quarantined after the fact


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda p: p._state.__setitem__(2, 1),  # a block LEASED by nobody
        lambda p: p._state.__setitem__(0, 0),  # a leased block marked FREE
        lambda p: p._generation.__setitem__(0, 99),  # a generation moved under its lease
        lambda p: p._owner_id.__setitem__(2, 1),  # a free block with an owner
        lambda p: p._owner_id.__setitem__(0, 0),  # a leased block with none
        lambda p: p._queue_free(np.array([0])),  # a leased block on the free list
    ],
)
def test_check_invariants_detects_corruption(corrupt: Any) -> None:
    pool = BlockPool(3)
    pool.lease("a", 1)
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(PoolError):
        pool.check_invariants()


def test_a_lease_is_arrays_and_still_a_sequence_of_refs() -> None:
    pool = BlockPool(6)
    pool.lease("x", 2)
    pool.release("x")
    refs = pool.lease_blocks("a", np.array([4, 0, 2]))
    assert isinstance(refs, BlockRefs)
    assert refs.block_list() == [4, 0, 2]
    assert refs.generations.tolist() == [1, 2, 1]  # block 0 was leased once before
    assert refs == (BlockRef(4, 1), BlockRef(0, 2), BlockRef(2, 1))
    assert refs[1] == BlockRef(0, 2) and refs[1:] == (BlockRef(0, 2), BlockRef(2, 1))
    assert BlockRef(0, 2) in refs and BlockRef(0, 1) not in refs
    with pytest.raises(ValueError):
        refs.blocks[0] = 5  # read-only: a lease cannot be edited behind the pool
    assert pool.current(np.array([4, 0, 2, 0, 9]), np.array([1, 2, 1, 1, 1])).tolist() == [
        True, True, True, False, False
    ]
    assert pool.owned_by("a", np.array([4, 1])).tolist() == [True, False]
    assert pool.owner_of(BlockRef(0, 2)) == "a" and pool.owner_of(BlockRef(0, 1)) is None
    pool.release("a")
    assert not pool.current(refs.blocks, refs.generations).any()
    pool.check_invariants()


def test_bad_construction_and_indices() -> None:
    with pytest.raises(PoolError):
        BlockPool(0)
    pool = BlockPool(1)
    with pytest.raises(PoolError):
        pool.state_of(5)
    assert not pool.is_current(BlockRef(7, 1))


OPS = st.lists(
    st.tuples(
        st.sampled_from(["lease", "release", "quarantine", "reclaim"]),
        st.integers(0, 5),
        st.integers(1, 4),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_random_operations_keep_s4(ops: list[tuple[str, int, int]]) -> None:
    pool = BlockPool(8)
    held: dict[int, tuple[BlockRef, ...]] = {}
    for op, owner, n in ops:
        before = pool.counts()
        try:
            if op == "lease":
                held[owner] = pool.lease(owner, n)
            else:
                end_lease(pool, op, owner)
        except (PoolError, LeaseError):
            assert pool.counts() == before  # a refused call changes nothing
        pool.check_invariants()
        # No two live owners hold the same block incarnation.
        live = [r for o, refs in held.items() if pool.holds(o) for r in refs]
        assert len({r.block for r in live}) == len(live)


def test_a_pickled_pool_and_its_refs_come_back_exact_and_keep_working() -> None:
    """Pools and refs pickle as their arrays' bytes (the explorer copies whole
    worlds at every step): a copy equals the original in every count, owner
    and incarnation, its refs stay read-only, and it goes on leasing,
    quarantining and releasing with its invariants intact."""
    import pickle

    pool = BlockPool(6)
    held = pool.lease("a", 2)
    pool.lease("b", 3)
    pool.quarantine("b")
    copy = pickle.loads(pickle.dumps(pool))
    copy.check_invariants()
    assert copy.counts() == pool.counts()
    assert copy.lease_of("a") == held and all(copy.is_current(r) for r in held)
    refs = pickle.loads(pickle.dumps(held))
    assert refs == held and not refs.blocks.flags.writeable
    assert copy.release("a") is Cleanup.RELEASED
    again = copy.lease("c", 3)
    assert {r.block for r in again} >= {r.block for r in held}  # freed blocks, new incarnations
    assert not any(copy.is_current(r) for r in held)
    copy.check_invariants()
    assert pool.lease_of("a") == held  # the original is untouched
    pool.check_invariants()


FIFO_OPS = st.lists(
    st.tuples(
        st.sampled_from(["lease", "lease", "lease_blocks", "release", "release", "quarantine", "reclaim"]),
        st.integers(0, 7),
        st.lists(st.integers(0, 7), min_size=1, max_size=5, unique=True),
    ),
    max_size=80,
)


def _fifo_walk(ops: list[tuple[str, int, list[int]]]) -> None:
    pool = BlockPool(8)
    model = list(range(8))
    owners: list[int] = []  # holding a lease (live or quarantined), oldest first
    fresh = iter(range(10**6))
    for op, pick, blocks in ops:
        owner = owners[pick % len(owners)] if owners else None
        try:
            if op == "lease":
                new = next(fresh)
                refs = pool.lease(new, len(blocks))
                assert refs.block_list() == model[: len(blocks)]
                del model[: len(blocks)]
                owners.append(new)
            elif op == "lease_blocks":
                new = next(fresh)
                pool.lease_blocks(new, blocks)
                model = [b for b in model if b not in blocks]
                owners.append(new)
            elif op == "release" and owner is not None:
                refs = pool.lease_of(owner)
                if pool.release(owner) is Cleanup.RELEASED:
                    model += refs.block_list()
                    owners.remove(owner)
            elif op == "quarantine" and owner is not None:
                pool.quarantine(owner)
            elif op == "reclaim" and owner is not None:
                refs = pool.lease_of(owner)
                pool.reclaim_quarantine(owner, proof="test")
                model += refs.block_list()
                owners.remove(owner)
        except (PoolError, LeaseError):
            pass
        pool.check_invariants()
        assert pool.free_order() == model
        assert pool.counts().free == len(model)


@settings(max_examples=300, deadline=None)
@given(FIFO_OPS)
def test_the_free_list_is_a_fifo_like_a_reference_list(ops: list[tuple[str, int, list[int]]]) -> None:
    """The free list (arrays with lazily deleted entries, compacted when the
    queue's end reaches the array's) against a plain Python list: `lease`
    hands out the oldest free blocks, `lease_blocks` takes named ones out of
    the middle, a release or reclaim puts a lease's blocks at the back in
    order. Many rounds over an 8-block pool run the compaction often."""
    _fifo_walk(ops)


def test_the_free_list_survives_a_long_random_walk() -> None:
    """The same check over one long seeded walk (thousands of compactions,
    with live and stale entries in the queue each time)."""
    import random

    rng = random.Random(7)
    kinds = ["lease", "lease", "lease_blocks", "release", "release", "quarantine", "reclaim"]
    _fifo_walk([(rng.choice(kinds), rng.randrange(8), rng.sample(range(8), rng.randint(1, 5))) for _ in range(5000)])
