"""An ERR from a WRITE of several descriptors is not a proof of quiescence.

NIXL posts each descriptor of a WRITE as its own transport operation; one of
them failing ends the WRITE with ERR while the others may still be writing
into the GEN's blocks. The CTX must then take the edge as UNKNOWN: the GEN
keeps those blocks quarantined (never reused for another request) until a
proof, and the CTX keeps its source blocks. One descriptor is one operation:
its ERR ends it, and the edge drains as before.
"""

from __future__ import annotations

import pytest

from kvhandoff.protocol import EdgeState, ParentState, PoolError

from ._helpers import posting
from .harness import Pair, parent_key

P = parent_key(1)


def _posting() -> Pair:
    """READY delivered, the first of three chunks posted."""
    return posting(Pair(chunk_window=1), chunks=3)


def test_multi_descriptor_err_quarantines_both_sides_and_no_block_is_reused() -> None:
    pair = _posting()
    key = next(iter(pair.in_flight))
    pair.fail_chunk_partially(key)
    assert pair.ctx.unproven_chunks == 1
    pair.deliver_all()
    (edge,) = pair.ctx.edges(P).values()
    assert edge.state is EdgeState.UNKNOWN
    assert pair.ctx.parent_state(P) is ParentState.QUARANTINED
    assert pair.gens[0].parent_state(P) is ParentState.QUARANTINED
    # Whatever else happens (rounds, deadlines, new requests wanting the
    # blocks), the write that may still land never meets a reused block.
    pair.handoff(parent_key(2), blocks=2, chunks=2)
    pair.settle_everything()
    pair.check_s1()
    pair.check_s4_and_ownership()
    assert pair.gens[0].parent_state(P) is ParentState.QUARANTINED
    assert pair.ctx.parent_state(P) is ParentState.QUARANTINED


def test_the_restart_of_the_writer_proves_it_and_the_gen_reclaims() -> None:
    pair = _posting()
    pair.fail_chunk_partially(next(iter(pair.in_flight)))
    pair.deliver_all()
    assert pair.gens[0].parent_state(P) is ParentState.QUARANTINED
    held = pair.gens[0].pool.counts().quarantined
    assert held > 0
    dead = pair.ctx.our
    pair.restart_ctx()  # the old incarnation is gone: nothing of it writes any more
    assert pair.gens[0].parent_state(P) is ParentState.QUARANTINED  # a restart notice is not proof
    pair.perform(pair.gens[0].peer_dead(dead, pair.now), pair.gens[0])  # the directory confirmed the death
    pair.settle_everything()
    assert pair.gens[0].pool.counts().quarantined == 0
    pair.check_s4_and_ownership()


def test_single_descriptor_err_still_drains() -> None:
    pair = _posting()
    pair.finish_chunk(next(iter(pair.in_flight)), ok=False)  # descriptors=1: one operation, ended
    pair.deliver_all()
    pair.settle_everything()
    assert pair.ctx.unproven_chunks == 0
    assert pair.gens[0].pool.counts().quarantined == 0
    assert pair.ctx.pool.counts().quarantined == 0
    pair.check_s4_and_ownership()


def test_zero_descriptors_means_nothing_was_posted() -> None:
    pair = _posting()
    key = next(iter(pair.in_flight))
    pair.fail_chunk_partially(key, descriptors=0)
    pair.strays.clear()  # nothing was posted: nothing can land
    pair.settle_everything()
    assert pair.ctx.unproven_chunks == 0
    assert pair.gens[0].pool.counts().quarantined == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_bad_descriptor_count_is_refused_and_changes_nothing(bad: object) -> None:
    pair = _posting()
    ticket, index = next(iter(pair.in_flight))
    before = pair.ctx.snapshot()
    with pytest.raises(PoolError):
        pair.ctx.chunk_failed(ticket, index, pair.now, bad)  # type: ignore[arg-type]
    assert pair.ctx.snapshot() == before


def test_the_death_of_the_target_proves_the_writers_lease() -> None:
    """The GEN rank a multi-descriptor WRITE failed toward dies. Its restart
    notice proves nothing; its confirmed death does for the CTX: the other
    writes of that WRITE can land only in the dead process, and they only
    read the CTX's blocks. The CTX's quarantine ends, its blocks serve the
    next request, and no write that may still land meets a reused block of
    a live rank (S1 as the harness checks it)."""
    pair = _posting()
    pair.fail_chunk_partially(next(iter(pair.in_flight)))
    pair.deliver_all()
    assert pair.ctx.parent_state(P) is ParentState.QUARANTINED
    dead = pair.gens[0].our.epoch
    pair.restart_gen(0)  # the notice: sessions with it end, nothing is proven
    pair.settle_everything()
    assert pair.ctx.parent_state(P) is ParentState.QUARANTINED
    assert pair.ctx.pool.counts().quarantined > 0
    pair.confirm_gen_dead(0, dead)
    pair.settle_everything()
    assert pair.ctx.parent_state(P) is ParentState.RELEASED
    assert pair.ctx.pool.counts().quarantined == 0
    pair.handoff(parent_key(2), blocks=2, chunks=2)  # the reclaimed blocks serve again
    pair.settle_everything()
    pair.check_s1()
    pair.check_s4_and_ownership()


def test_a_chunk_still_in_flight_toward_a_dead_target_ends_the_proof_at_its_poll() -> None:
    """Two chunks in flight toward the GEN rank when it dies: one ERR'd with
    several descriptors, one still running. The death alone does not end
    the quarantine (a WRITE still posted from our blocks is polled to its
    end first); its ERR then does, whatever its descriptors."""
    pair = posting(Pair(chunk_window=2), chunks=3)
    first, second = list(pair.in_flight)
    pair.fail_chunk_partially(first)
    pair.deliver_all()
    dead = pair.gens[0].our.epoch
    pair.restart_gen(0)
    pair.confirm_gen_dead(0, dead)
    assert pair.ctx.parent_state(P) is ParentState.QUARANTINED  # `second` is still posted
    pair.fail_chunk_partially(second)  # ERR, several descriptors: toward a dead target, it ends
    pair.settle_everything()
    assert pair.ctx.parent_state(P) is ParentState.RELEASED
    assert pair.ctx.pool.counts().quarantined == 0
    pair.check_s1()
    pair.check_s4_and_ownership()


def test_the_death_of_an_older_incarnation_proves_nothing_here() -> None:
    """A confirmed death proves only edges toward that incarnation or an
    older one: the death of an older epoch of the same GEN rank leaves the
    quarantine toward the newer one in place."""
    pair = _posting()
    pair.fail_chunk_partially(next(iter(pair.in_flight)))
    pair.deliver_all()
    epoch = pair.gens[0].our.epoch
    pair.restart_gen(0)
    pair.confirm_gen_dead(0, epoch - 1)  # an older incarnation than the edge's
    pair.settle_everything()
    assert pair.ctx.parent_state(P) is ParentState.QUARANTINED
    pair.confirm_gen_dead(0, epoch)
    pair.settle_everything()
    assert pair.ctx.parent_state(P) is ParentState.RELEASED
