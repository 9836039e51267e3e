"""A GEN quarantine the writer can end is asked about, and ends.

A GEN edge goes UNKNOWN when its wait for the writer's TERMINAL runs out:
the TERMINAL (or the OPEN, or the REJECT) was lost or is late, or the writer
itself cannot prove its writes ended. The blocks stay quarantined until a
proof. Without one from the writer only its death or a restart ended it;
now the GEN rank asks the writer again (its OPEN re-sent, a few times, a
transfer timeout apart and doubling), and the writer's answer is a proof
when it has one: its TERMINAL again, or a REJECT once it holds no session
under that ticket (a session closes only once its writes are proven over).
An UNKNOWN writer answers UNKNOWN: nothing is proven and the blocks stay.
"""

from __future__ import annotations

import pytest

from kvhandoff.protocol import (
    UNKNOWN_ASKS,
    DuplicateSessionError,
    EdgeState,
    Open,
    ParentState,
    Release,
    SendMessage,
    Terminal,
    decode_frame,
)

from ._helpers import decided, posting, resident
from .harness import Pair, parent_key

P = parent_key(1)


def _drop(pair: Pair, kind: type) -> int:
    """Lose every queued frame of `kind` (a carrier that drops them)."""
    keep = [e for e in pair.queue if not isinstance(decode_frame(e.frame), kind)]
    lost = len(pair.queue) - len(keep)
    pair.queue[:] = keep
    return lost


def _gen_times_out(pair: Pair) -> None:
    """Time passes twice past every deadline: the GEN rank's transfer wait
    (it cancels) and then its wait for the writer's TERMINAL (UNKNOWN)."""
    for _ in range(2):
        pair.now += pair.timeout + 1
        pair.expire()
        pair.deliver_all()


def _asks(pair: Pair, since: int) -> list[Open]:
    return [
        a.message
        for a in pair.actions[since:]
        if isinstance(a, SendMessage) and isinstance(a.message, Open)
    ]


def test_a_lost_terminal_is_sent_again_when_asked_and_the_quarantine_ends() -> None:
    pair = decided(Pair())
    while pair.in_flight:  # every chunk lands: the CTX edge is COMPLETED
        pair.finish_chunk(next(iter(pair.in_flight)))
    assert _drop(pair, Terminal) == 1
    pair.deliver_all()  # the READY
    asked = len(pair.actions)
    _gen_times_out(pair)
    gen = pair.gens[0]
    # The GEN rank asked once, its edge still UNKNOWN until the answer came:
    # the writer still holds the session (no round ran) and sent its TERMINAL
    # again, which proves the edge; the blocks came back in place.
    assert len(_asks(pair, asked)) == 1
    (ctx_edge,) = pair.ctx.edges(P).values()
    assert ctx_edge.state is EdgeState.COMPLETED
    assert pair.ctx.parent_state(P) is not ParentState.RELEASED
    assert gen.parent_state(P) is ParentState.RELEASED
    assert gen.pool.counts().quarantined == 0
    assert [a.reclaimed for a in pair.actions if isinstance(a, Release) and a.parent == P][-1]
    pair.settle_everything()
    pair.check_s1()
    pair.check_s4_and_ownership()


def test_a_lost_open_is_asked_again_and_the_reject_proves_nothing_wrote() -> None:
    pair = resident(Pair())
    assert _drop(pair, Open) == 1
    asked = len(pair.actions)
    _gen_times_out(pair)
    gen = pair.gens[0]
    # The writer never recorded the OPEN; by the time it is asked its lease
    # ran out too, so it refuses the OPEN: a REJECT, which proves the edge.
    assert len(_asks(pair, asked)) == 1
    assert gen.pool.counts().quarantined == 0
    assert gen.parent_state(P) is ParentState.RELEASED
    pair.settle_everything()
    assert pair.ctx.pool.counts().leased == 0
    pair.check_s4_and_ownership()


def test_asks_are_bounded_a_timeout_apart_doubling_and_prove_nothing_unanswered() -> None:
    pair = resident(Pair())
    _drop(pair, Open)
    gen = pair.gens[0]
    times: list[float] = []
    for _ in range(200):  # far past the last ask
        before = len(pair.actions)
        pair.now += 1.0
        pair.perform(gen.expire(pair.now), gen)
        times += [pair.now] * len(_asks(pair, before))
        pair.queue.clear()  # the writer is unreachable: every frame is lost
    assert len(times) == UNKNOWN_ASKS
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps == [pair.timeout * (1 << i) for i in range(UNKNOWN_ASKS - 1)], gaps
    assert gen.parent_state(P) is ParentState.QUARANTINED  # no answer is no proof
    assert gen.pool.counts().quarantined == 2
    dead = pair.ctx.our
    pair.restart_ctx(notify=False)
    pair.perform(gen.peer_dead(dead, pair.now), gen)  # the writer's death still proves it
    assert gen.pool.counts().quarantined == 0


def test_a_writer_that_cannot_prove_its_writes_answers_unknown_and_nothing_is_freed() -> None:
    pair = posting(Pair(chunk_window=1), chunks=3)
    pair.fail_chunk_partially(next(iter(pair.in_flight)))  # its other writes may still land
    pair.deliver_all()
    gen = pair.gens[0]
    assert gen.parent_state(P) is ParentState.QUARANTINED
    for _ in range(UNKNOWN_ASKS + 2):
        pair.now += pair.timeout * 16
        pair.expire()
        pair.deliver_all()
    assert gen.parent_state(P) is ParentState.QUARANTINED
    assert gen.pool.counts().quarantined == 2
    pair.check_s1()


def test_another_open_under_a_live_ticket_is_still_refused_and_changes_nothing() -> None:
    pair = resident(Pair())
    (env,) = pair.queue
    first = decode_frame(env.frame)
    assert isinstance(first, Open)
    pair.deliver_all()
    other = Open(ticket=first.ticket, buffer=first.buffer, num_tokens=first.num_tokens + 1)
    assert pair.ctx.open_again(other) is None
    before = pair.ctx.snapshot()
    with pytest.raises(DuplicateSessionError):
        pair.ctx.receive(other, pair.now)
    assert pair.ctx.snapshot() == before
    # The same OPEN again, edge not terminal yet: nothing to say, nothing changes.
    assert pair.ctx.open_again(first) == []
    assert pair.ctx.snapshot() == before
