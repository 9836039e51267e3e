"""Reclaiming quarantine (protocol/_pool.py): only a quarantined lease, only with a proof.

Added for a mutant the rest of the suite let survive: `reclaim_quarantine` on
a LIVE lease would free blocks that a transfer may still be writing (S1), and
nothing checked that it is refused.
"""

from __future__ import annotations

import pytest

from kvhandoff.protocol import BlockPool, BlockState, Cleanup, LeaseError


def _picture(pool: BlockPool) -> tuple[object, ...]:
    return tuple((pool.state_of(b), pool.generation_of(b)) for b in range(pool.num_blocks))


def test_reclaim_refuses_a_live_lease_and_changes_nothing() -> None:
    """A lease that was never quarantined is not reclaimable, proof or not: the
    refusal is a LeaseError and every block keeps its state and generation."""
    pool = BlockPool(4)
    refs = pool.lease("live", 2)
    before = _picture(pool)
    with pytest.raises(LeaseError):
        pool.reclaim_quarantine("live", proof="agent of epoch 1 torn down")
    assert _picture(pool) == before
    assert all(pool.state_of(r.block) is BlockState.LEASED for r in refs)
    assert pool.is_current(refs[0]) and pool.holds("live")
    pool.check_invariants()


def test_reclaim_refuses_unknown_and_released_owners() -> None:
    pool = BlockPool(2)
    pool.lease("done", 1)
    assert pool.release("done") is Cleanup.RELEASED
    before = _picture(pool)
    for owner in ("done", "never-seen"):
        with pytest.raises(LeaseError):
            pool.reclaim_quarantine(owner, proof="agent of epoch 1 torn down")
    assert _picture(pool) == before
