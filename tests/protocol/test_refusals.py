"""A CTX rank keeps the promise of its REJECT (`CtxRank.refuse`).

A GEN rank takes any REJECT but DUPLICATE as proof that the CTX rank never
writes under that ticket, and gives its blocks back at once. Some refusals
depend on when the OPEN came: before the parent's prefill, with the pool
full (admission at the OPEN), before a protocol was agreed. A later copy of
the same OPEN (a duplicate on the wire, or the GEN rank asking again)
would then be accepted and its WRITE would land in blocks the GEN rank has
reused (S1). The property test found this (two CTX ranks, an OPEN
duplicated, its first copy refused before the prefill); these are that
trace, the pool-full variant, and the registry's bounded memory.

What would fail if it broke: the second copy is accepted and a chunk is
posted toward GEN blocks that are FREE again (`check_s1`); the registry
forgets or double-counts a refusal.
"""

from __future__ import annotations

import pytest

from kvhandoff.protocol import (
    DuplicateSessionError,
    IllegalTransition,
    NoCapacity,
    Open,
    PostChunk,
    Reject,
    RejectReason,
    SessionRegistry,
    StaleError,
    decode_frame,
)

from .harness import Envelope, Pair, ctx_endpoint, gen_endpoint, make_ticket, parent_key


def _opens(pair: Pair) -> list[int]:
    return [i for i, env in enumerate(pair.queue) if isinstance(decode_frame(env.frame), Open)]


def _posted(pair: Pair) -> list[PostChunk]:
    return [a for a in pair.actions if isinstance(a, PostChunk)]


def test_an_open_refused_before_the_prefill_is_refused_again_after_it() -> None:
    pair = Pair(n_ctx=1, n_gen=1, ctx_blocks=8, gen_blocks=8)
    parent = parent_key(1)
    pair.admit(parent, blocks=2, chunks=1, lease=15.0)  # admitted, not prefilled
    pair.install(parent)  # the GEN rank's OPEN is on the wire
    (i,) = _opens(pair)
    pair.queue.append(Envelope(pair.queue[i].to_role, pair.queue[i].to_rank, pair.queue[i].frame))  # a copy
    first = pair.deliver(i)
    assert isinstance(first, IllegalTransition), first  # the parent is not resident yet
    (reject,) = [decode_frame(e.frame) for e in pair.queue if isinstance(decode_frame(e.frame), Reject)]
    assert reject.reason is RejectReason.STALE
    pair.prefill(parent)
    (j,) = _opens(pair)
    second = pair.deliver(j)  # the copy, now that the parent is resident
    assert isinstance(second, StaleError) and "refused" in str(second), second
    assert pair.ctx._sessions.closed_how(reject.ticket) == "refused"
    pair.settle_everything()  # the REJECT reaches the GEN rank: its blocks come back
    pair.check_s1()
    pair.check_s4_and_ownership()
    assert _posted(pair) == [], "a chunk was posted under a refused ticket"
    assert pair.gens[0].pool.counts().leased == 0 and pair.ctx.pool.counts().leased == 0


def test_an_open_refused_for_want_of_room_is_refused_again_once_there_is_room() -> None:
    """Admission at the OPEN (a one-rank CTX instance): a full pool refuses
    NO_CAPACITY; a copy of that OPEN once the pool has room admits nothing."""
    pair = Pair(n_ctx=1, n_gen=1, ctx_blocks=2, gen_blocks=8, direct=True)
    busy, late = parent_key(1), parent_key(2)
    pair.admit(busy, blocks=2, chunks=1, lease=15.0)
    pair.install(busy)
    pair.deliver(_opens(pair)[0])  # admitted at its OPEN: the CTX pool is full
    assert pair.ctx.pool.counts().free == 0
    pair.admit(late, blocks=2, chunks=1, lease=15.0)
    pair.install(late)
    (i,) = _opens(pair)
    copy = pair.queue[i]
    refused = pair.deliver(i)
    assert isinstance(refused, NoCapacity), refused
    pair.settle_everything()  # `busy` completes and frees the CTX pool; `late` is rejected
    assert pair.ctx.pool.counts().free == 2
    again = pair.deliver_frame(copy.to_role, copy.to_rank, copy.frame)
    assert isinstance(again, StaleError) and "refused" in str(again), again
    assert late not in pair.ctx.parents()
    pair.settle_everything()
    pair.check_s1()
    pair.check_s4_and_ownership()
    assert {a.ticket.parent for a in _posted(pair)} == {busy}


def test_a_duplicate_or_a_foreign_open_is_not_remembered_as_refused() -> None:
    """DUPLICATE says an earlier copy *was* recorded (the session is live);
    an OPEN naming another CTX endpoint gets no REJECT at all: neither is a
    promise, and neither is remembered."""
    pair = Pair(n_ctx=1, n_gen=1)
    parent = parent_key(1)
    pair.admit(parent, blocks=2, chunks=1)
    pair.prefill(parent)
    pair.install(parent)
    (i,) = _opens(pair)
    frame = pair.queue[i].frame
    assert pair.deliver(i) is None  # recorded
    open_msg = decode_frame(frame)
    with pytest.raises(DuplicateSessionError) as duplicate:
        pair.ctx.receive_open(open_msg, pair.now)
    reject = pair.ctx.refuse(open_msg, duplicate.value)
    assert reject is not None and reject.reason is RejectReason.DUPLICATE
    assert open_msg.ticket in pair.ctx._sessions and pair.ctx._sessions.closed_how(open_msg.ticket) is None
    foreign_ticket = make_ticket(parent_key(7), ctx_endpoint(epoch=9), gen_endpoint())
    foreign = Open(ticket=foreign_ticket, buffer=open_msg.buffer, num_tokens=open_msg.num_tokens)
    assert pair.ctx.refuse(foreign, StaleError("ctx epoch", 9, 1)) is None
    assert pair.ctx._sessions.closed_how(foreign_ticket) is None


def test_the_registry_remembers_a_refusal_once_and_within_its_bound() -> None:
    registry: SessionRegistry[object] = SessionRegistry(closed_memory=2)
    tickets = [make_ticket(parent_key(n), ctx_endpoint(), gen_endpoint()) for n in range(3)]
    registry.install(tickets[0], object())
    registry.refused(tickets[0])  # live: left alone
    assert tickets[0] in registry and registry.closed_how(tickets[0]) is None
    registry.close(tickets[0], "released")
    registry.refused(tickets[0])  # closed already: how it ended stays
    assert registry.closed_how(tickets[0]) == "released"
    registry.refused(tickets[1])
    registry.refused(tickets[1])
    assert registry.closed_how(tickets[1]) == "refused"
    with pytest.raises(StaleError):
        registry.install(tickets[1], object())
    registry.refused(tickets[2])  # past the bound: the oldest is forgotten
    assert registry.closed_how(tickets[0]) is None
    assert registry.closed_how(tickets[1]) == registry.closed_how(tickets[2]) == "refused"
