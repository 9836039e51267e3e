"""The direct path's admission, sans-IO: a CTX rank that is its whole
instance (tp=1) admits a parent when the GEN instance's OPEN arrives
(`CtxRank.admit_at_open`), and tells its leader in its reports
(`RoundFollower.record_admitted`, `RankReport.admitted`).

* An admission at the OPEN leases the parent's blocks, makes the KV
  resident and records the OPEN in one step: prepared at once for a parent of
  one edge here; its other OPENs are received as usual.
* Every refusal changes nothing and is answered with a REJECT to the OPEN's
  own ticket (the GEN rank's NOT_STARTED evidence): a pool without room, a
  rank whose admission stopped, a parent held or ended here (a late or
  repeated OPEN never admits a finished handoff again), an OPEN for another
  incarnation or of the wrong size.
* The pair model with `direct=True` runs a whole handoff through it, and the
  CTX leader takes the parent in flight from the report and ends it.
"""

from __future__ import annotations

import pytest

from kvhandoff.protocol import (
    ADMISSION_REFUSALS,
    AdmissionRefused,
    CancelReason,
    LeaseError,
    NoCapacity,
    Open,
    ParentState,
    PoolError,
    Prepared,
    ProtocolError,
    RejectReason,
    Role,
    StaleError,
    reject_for,
)

from ._helpers import take_opens
from .harness import Pair, ctx_endpoint, make_ticket, parent_key

P = parent_key(1)


def _direct(n_gen: int = 1, ctx_blocks: int = 4) -> tuple[Pair, list[Open]]:
    """A direct pair: the GEN instance admitted P and installed it; its OPENs taken out of the queue."""
    pair = Pair(n_gen=n_gen, ctx_blocks=ctx_blocks, direct=True)
    pair.admit(P, blocks=2)
    pair.install(P)
    return pair, take_opens(pair)


def test_no_ctx_round_admits_on_the_direct_path() -> None:
    pair, opens = _direct()
    assert P not in pair.ctx.parents() and len(opens) == 1
    assert pair.leaders[Role.CTX].next_round == 1, "a CTX round ran"


def test_an_admission_at_the_open_leases_makes_resident_and_prepares_in_one_step() -> None:
    pair, (open_msg,) = _direct()
    free = pair.ctx.pool.counts().free
    actions = pair.ctx.admit_at_open(open_msg, 2, now=pair.now, lease_deadline=pair.now + 5.0)
    assert pair.ctx.pool.counts().free == free - 2
    assert [a for a in actions if isinstance(a, Prepared)] == [Prepared(P)]
    assert pair.ctx.parent_state(P) is ParentState.RESIDENT and pair.ctx.is_prepared(P)


def test_the_other_opens_of_a_parent_are_received_not_admitted() -> None:
    pair, opens = _direct(n_gen=2)
    assert len(opens) == 2
    first = pair.ctx.admit_at_open(opens[0], 2, now=pair.now, lease_deadline=pair.now + 5.0, edges=2)
    assert not [a for a in first if isinstance(a, Prepared)]
    before = pair.ctx.snapshot()
    with pytest.raises(LeaseError):  # held here: never a second lease
        pair.ctx.admit_at_open(opens[1], 2, now=pair.now, lease_deadline=pair.now + 5.0, edges=2)
    assert pair.ctx.snapshot() == before
    assert [a for a in pair.ctx.receive_open(opens[1], pair.now) if isinstance(a, Prepared)] == [Prepared(P)]


def _refused(pair: Pair, open_msg: Open, error: type[ProtocolError], n_blocks: int = 2) -> None:
    before = pair.ctx.snapshot()
    with pytest.raises(error) as refused:
        pair.ctx.admit_at_open(open_msg, n_blocks, now=pair.now, lease_deadline=pair.now + 5.0)
    assert pair.ctx.snapshot() == before, "a refused admission at the OPEN changed the rank"
    reject = reject_for(open_msg, refused.value, pair.ctx.our)
    assert reject is None or reject.ticket == open_msg.ticket


def test_a_pool_without_room_refuses_and_answers_a_reject_to_the_opens_ticket() -> None:
    pair, (open_msg,) = _direct(ctx_blocks=1)
    _refused(pair, open_msg, NoCapacity)
    reject = reject_for(open_msg, NoCapacity("no room"), pair.ctx.our)
    assert reject is not None and reject.ticket == open_msg.ticket and reject.reason is RejectReason.NO_CAPACITY
    # A refusal to admit: the GEN side ends it "rejected", not "cancelled".
    assert reject.reason in ADMISSION_REFUSALS
    assert reject_for(open_msg, PoolError("bad blocks"), pair.ctx.our).reason not in ADMISSION_REFUSALS


def test_an_open_of_another_size_or_incarnation_is_refused() -> None:
    pair, (open_msg,) = _direct()
    _refused(pair, open_msg, LeaseError, n_blocks=3)  # the OPEN names 2 GEN blocks
    stale = Open(ticket=make_ticket(P, ctx_endpoint(epoch=7), pair.gens[0].our), buffer=open_msg.buffer, num_tokens=16)
    _refused(pair, stale, StaleError)
    assert reject_for(stale, StaleError("x", 1, 2), pair.ctx.our) is None  # not ours: silent


def test_a_rank_whose_admission_stopped_admits_nothing_at_an_open() -> None:
    pair, (open_msg,) = _direct(ctx_blocks=4)
    other = parent_key(9)
    pair.ctx.admit(other, 2, now=pair.now, lease_deadline=pair.now + 5.0)
    pair.ctx.pool.quarantine(other)
    assert pair.ctx.admission_stopped() and pair.ctx.pool.counts().free == 2  # room, but stopped
    _refused(pair, open_msg, AdmissionRefused)
    reject = reject_for(open_msg, AdmissionRefused("stopped"), pair.ctx.our)
    assert reject is not None and reject.reason is RejectReason.ADMISSION_STOPPED and reject.reason in ADMISSION_REFUSALS


def test_a_late_or_repeated_open_never_admits_an_ended_parent_again() -> None:
    pair, (open_msg,) = _direct()
    pair.perform(pair.ctx.admit_at_open(open_msg, 2, now=pair.now, lease_deadline=pair.now + 5.0), pair.ctx)
    pair.ctx_follower.record_admitted(P)  # what the rank actor reports
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)
    pair.settle_everything()
    assert P not in pair.ctx.parents()
    _refused(pair, open_msg, StaleError)


def test_a_whole_handoff_on_the_direct_path_and_the_leader_learns_from_the_report() -> None:
    pair = Pair(direct=True)
    pair.admit(P, blocks=1, chunks=2)
    pair.install(P)
    pair.deliver_all()  # the OPEN: the CTX rank admits at it
    assert pair.ctx.parent_state(P) is ParentState.RESIDENT
    assert pair.ctx_follower.report().admitted == (P,)
    pair.decide(P)
    pair.pump()
    pair.run_rounds()
    assert P in pair.decode_ready
    pair.free(P)
    pair.settle_everything()
    assert pair.leaders[Role.CTX].in_flight == set() and pair.leaders[Role.GEN].in_flight == set()
    assert P not in pair.ctx.parents() and P not in pair.gens[0].parents()
    assert pair.ctx.pool.counts().free == pair.ctx.pool.num_blocks
    assert pair.gens[0].pool.counts().free == pair.gens[0].pool.num_blocks
