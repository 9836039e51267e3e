"""Cancellation at every phase (docs/design.md "Cancellation"), and lease expiry.

Each test stops a handoff at one phase, cancels, and asserts exactly what each
side released, drained or quarantined, and the TERMINAL evidence.
"""

from __future__ import annotations

import pytest

from kvhandoff.protocol import (
    Action,
    AdmissionStop,
    Cancel,
    CancelDeferred,
    CancelIntent,
    CancelReason,
    CleanupSkipped,
    DecodeReady,
    Drain,
    EdgeState,
    Endpoint,
    GenEdgeSpec,
    LeaseError,
    ParentState,
    PostChunk,
    Quarantine,
    RankNamespace,
    Ready,
    Release,
    Role,
    SendMessage,
    Terminal,
    TerminalKind,
    decode_frame,
)

from ._helpers import decided, prepared
from .harness import (
    CHUNK_BYTES,
    Pair,
    buffer_for,
    ctx_endpoint,
    make_ticket,
    parent_key,
)

P = parent_key(1)


def _of(actions: list[Action], kind: type) -> list:  # type: ignore[type-arg]
    return [a for a in actions if isinstance(a, kind)]


def _terminals(pair: Pair) -> list[TerminalKind]:
    return [
        a.message.evidence
        for a in _of(pair.actions, SendMessage)
        if isinstance(a.message, Terminal)
    ]


def _released(pair: Pair) -> int:
    return sum(len(a.blocks) for a in _of(pair.actions, Release))


def _terminals_sent_by_ctx(queue: list) -> list[TerminalKind]:
    messages = [decode_frame(envelope.frame) for envelope in queue]
    return [m.evidence for m in messages if isinstance(m, Terminal)]


def _assert_all_free(pair: Pair) -> None:
    for rank in pair.ranks():
        counts = rank.pool.counts()
        assert counts.free == counts.total, (rank.our, counts)
    pair.check_s4_and_ownership()


def test_cancel_before_open() -> None:
    pair = Pair()
    pair.admit(P)
    pair.prefill(P)
    # The client cancels; the round applies it on every rank before GEN installed.
    for rank in pair.ranks():
        pair.perform(rank.cancel(P, CancelReason.CLIENT, pair.now, from_round=True), rank)
    assert not pair.queue, "no OPEN, no TERMINAL: nothing was exposed"
    # Decided cancel + every local edge terminal (there are none): no completion
    # round will come for a cancelled parent, so each rank releases at once.
    assert pair.ctx.parent_state(P) is ParentState.RELEASED
    assert pair.gens[0].parent_state(P) is ParentState.RELEASED
    assert _released(pair) == 4 and not _of(pair.actions, Quarantine)
    pair.run_rounds()
    assert _released(pair) == 4  # nothing released twice
    assert not _of(pair.actions, CancelIntent)  # from_round: nothing echoed
    _assert_all_free(pair)


def test_cancel_after_open_before_ready() -> None:
    pair = prepared(Pair())
    ticket = pair.tickets(P)[0]
    gen = pair.gens[0]
    actions = gen.cancel(P, CancelReason.CLIENT, pair.now)
    pair.perform(actions, gen)
    assert [a.message for a in _of(actions, SendMessage)] == [
        Cancel(ticket=ticket, reason=CancelReason.CLIENT)
    ]
    assert _of(actions, CancelIntent) == [CancelIntent(P, CancelReason.CLIENT)]
    # GEN exposed its blocks in the OPEN: no release before CTX's evidence.
    assert gen.evidence(ticket).state is EdgeState.CANCELLING
    assert gen.pool.counts().leased == 2 and gen.parent_state(P) is ParentState.CANCELLING
    pair.deliver_all()
    assert pair.ctx.evidence(ticket).state is EdgeState.NOT_STARTED
    assert gen.evidence(ticket).state is EdgeState.NOT_STARTED
    assert _terminals(pair) == [TerminalKind.NOT_STARTED]
    assert not _of(pair.actions, PostChunk) and not _of(pair.actions, Drain)
    pair.run_rounds()
    assert _released(pair) == 4 and not _of(pair.actions, Quarantine)
    _assert_all_free(pair)


def test_cancel_after_open_early_release_by_verdict() -> None:
    """The round's topology-wide NOT_STARTED verdict frees GEN before the TERMINAL arrives."""
    pair = prepared(Pair())
    for rank in pair.ranks():
        pair.perform(rank.cancel(P, CancelReason.CLIENT, pair.now, from_round=True), rank)
    held = list(pair.queue)
    pair.queue.clear()  # CANCEL and TERMINAL(NOT_STARTED) still on the wire
    # CTX proved its edge NOT_STARTED locally (it is the writer): released at once.
    assert pair.ctx.parent_state(P) is ParentState.RELEASED
    # GEN exposed its blocks in the OPEN and has no TERMINAL yet: it waits.
    assert pair.gens[0].parent_state(P) is ParentState.CANCELLING
    assert pair.gens[0].local_not_started(P)
    # The round's topology-wide verdict (CTX proved NOT_STARTED before it released;
    # no GEN has contrary evidence) frees GEN without waiting for the TERMINAL.
    assert _terminals_sent_by_ctx(held) == [TerminalKind.NOT_STARTED]
    pair.perform(pair.gens[0].release_not_started(P), pair.gens[0])
    assert pair.gens[0].parent_state(P) is ParentState.RELEASED
    _assert_all_free(pair)
    # The late messages are stale now and change nothing.
    snaps = [r.snapshot() for r in pair.ranks()]
    pair.queue.extend(held)
    pair.deliver_all()
    assert [r.snapshot() for r in pair.ranks()] == snaps


def test_decided_sends_ready_before_each_edges_first_chunk() -> None:
    """There is no phase between READY and the first post on a CTX edge: each
    edge's READY is sent, then its first window is posted, in one call."""
    pair = Pair(chunk_window=1, n_gen=2)
    prepared(pair)
    actions = pair.ctx.decided(P, pair.now)
    kinds = [
        ("ready", a.message.ticket) if isinstance(a, SendMessage) else ("post", a.ticket)
        for a in actions
        if isinstance(a, SendMessage | PostChunk)
    ]
    tickets = pair.tickets(P)
    assert len(tickets) == 2
    assert kinds == [k for t in tickets for k in (("ready", t), ("post", t))]
    assert all(pair.ctx.evidence(t).state is EdgeState.POSTING for t in tickets)


def test_cancel_mid_dma_drains() -> None:
    pair = decided(Pair(chunk_window=2), chunks=4)
    ticket = pair.tickets(P)[0]
    pair.finish_chunk((ticket, 0))  # chunk 2 gets posted; 1 and 2 in flight
    assert set(pair.in_flight) == {(ticket, 1), (ticket, 2)}
    pair.deliver_all()  # READY reaches GEN
    pair.perform(pair.gens[0].cancel(P, CancelReason.CLIENT, pair.now), pair.gens[0])
    pair.actions.clear()
    pair.deliver_all()  # CANCEL reaches CTX
    (drain,) = _of(pair.actions, Drain)
    assert drain.in_flight == (1, 2) and drain.deadline == pair.now + pair.timeout
    assert pair.ctx.evidence(ticket).state is EdgeState.DRAINING
    assert pair.ctx.pool.counts().leased == 2 and pair.gens[0].pool.counts().leased == 2
    pair.check_s1()
    pair.finish_chunk((ticket, 1))
    assert pair.ctx.evidence(ticket).state is EdgeState.DRAINING
    pair.finish_chunk((ticket, 2), ok=False)  # ERR is quiescent too
    assert pair.ctx.evidence(ticket).state is EdgeState.DRAINED
    assert not [a for a in pair.actions if isinstance(a, PostChunk) and a.index == 3], (
        "posted after cancel"
    )
    pair.deliver_all()
    assert pair.gens[0].evidence(ticket).state is EdgeState.DRAINED
    assert _terminals(pair) == [TerminalKind.DRAINED]
    pair.run_rounds()
    assert not _of(pair.actions, Quarantine)
    _assert_all_free(pair)


def test_cancel_mid_dma_with_siblings_is_parent_scoped() -> None:
    pair = decided(Pair(n_gen=2, chunk_window=1))
    first, second = pair.tickets(P)
    pair.deliver_all()
    pair.perform(pair.gens[0].cancel(P, CancelReason.CLIENT, pair.now), pair.gens[0])
    pair.deliver_all()  # CTX drains both edges; GEN 1 learns by TERMINAL
    assert pair.ctx.evidence(first).state is EdgeState.DRAINING
    assert pair.ctx.evidence(second).state is EdgeState.DRAINING
    pair.pump()
    assert pair.gens[1].evidence(second).state is EdgeState.DRAINED
    assert pair.gens[1].is_cancelled(P)
    assert CancelIntent(P, CancelReason.PEER) in pair.actions  # GEN 1 tells its round
    pair.run_rounds()
    _assert_all_free(pair)


def test_drain_timeout_quarantines_both_sides() -> None:
    pair = decided(Pair(chunk_window=2))
    ticket = pair.tickets(P)[0]
    pair.deliver_all()
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)
    assert pair.ctx.evidence(ticket).state is EdgeState.DRAINING
    pair.now += pair.timeout  # the posted chunks never report
    pair.perform(pair.ctx.expire(pair.now), pair.ctx)
    assert pair.ctx.evidence(ticket).state is EdgeState.UNKNOWN
    assert pair.ctx.parent_state(P) is ParentState.QUARANTINED
    assert pair.ctx.pool.counts().quarantined == 2
    pair.deliver_all()
    assert pair.gens[0].parent_state(P) is ParentState.QUARANTINED
    assert pair.gens[0].pool.counts().quarantined == 2
    assert _terminals(pair) == [TerminalKind.UNKNOWN]
    assert len(_of(pair.actions, AdmissionStop)) == 2
    pair.check_s1()
    pair.run_rounds()
    pair.check_s1()  # rounds never free quarantined blocks
    # One late completion proves nothing: the other chunk may still read our blocks.
    pair.finish_chunk((ticket, 0))
    assert pair.ctx.evidence(ticket).state is EdgeState.UNKNOWN
    assert pair.ctx.pool.counts().quarantined == 2
    pair.check_s1()
    # The last posted chunk polled to DONE is the proof: the edge is DRAINED after
    # all, CTX reclaims in place, and its late TERMINAL(DRAINED) is GEN's proof.
    pair.finish_chunk((ticket, 1))
    assert pair.ctx.parent_state(P) is ParentState.RELEASED  # reclaimed
    assert pair.ctx.pool.counts().quarantined == 0
    assert pair.gens[0].pool.counts().quarantined == 2  # not before the proof reaches it
    pair.deliver_all()
    assert _terminals(pair) == [TerminalKind.UNKNOWN, TerminalKind.DRAINED]
    assert pair.gens[0].parent_state(P) is ParentState.RELEASED
    assert pair.gens[0].pool.counts().quarantined == 0
    assert pair.gens[0].pool.counts().free == pair.gens[0].pool.num_blocks
    pair.check_s1()


def test_reclaim_needs_every_chunk_polled() -> None:
    """A chunk that reports ERR is quiescent too; until the last one reports,
    the quarantine stands (and an explicit reclaim still needs a proof)."""
    pair = decided(Pair(chunk_window=2))
    ticket = pair.tickets(P)[0]
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)
    pair.now += pair.timeout
    pair.perform(pair.ctx.expire(pair.now), pair.ctx)
    assert pair.ctx.parent_state(P) is ParentState.QUARANTINED
    with pytest.raises(LeaseError):
        pair.ctx.reclaim(P, proof="")
    pair.finish_chunk((ticket, 1), ok=False)
    assert pair.ctx.pool.counts().quarantined == 2
    pair.check_s1()
    pair.finish_chunk((ticket, 0), ok=False)
    assert pair.ctx.pool.counts().quarantined == 0
    pair.check_s1()


def test_cancel_after_terminal() -> None:
    pair = decided(Pair())
    ticket = pair.tickets(P)[0]
    for key in list(pair.in_flight):
        pair.finish_chunk(key)
    assert pair.ctx.evidence(ticket).state is EdgeState.COMPLETED
    pair.actions.clear()
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)
    assert not _of(pair.actions, SendMessage) and not _of(pair.actions, Drain)  # nothing to undo
    pair.deliver_all()  # READY, TERMINAL(COMPLETED) -> RECEIPT
    assert pair.gens[0].evidence(ticket).state is EdgeState.COMPLETED
    pair.client_cancel(P)  # the client's cancel reaches both coordinators' next rounds
    pair.run_rounds()  # GEN's round decides it: completion releases without decode
    assert pair.gens[0].parent_state(P) is ParentState.RELEASED
    assert not _of(pair.actions, DecodeReady) and not _of(pair.actions, Quarantine)
    _assert_all_free(pair)


def test_cancel_after_receipt() -> None:
    pair = decided(Pair())
    ticket = pair.tickets(P)[0]
    pair.pump()
    assert pair.ctx.evidence(ticket).state is EdgeState.COMPLETED
    assert pair.ctx._sessions.get(ticket).receipt_bytes is not None
    assert pair.ctx.parent_state(P) is ParentState.SETTLED
    for rank in pair.ranks():
        pair.perform(rank.cancel(P, CancelReason.CLIENT, pair.now, from_round=True), rank)
    assert not pair.queue
    pair.run_rounds()
    assert not _of(pair.actions, DecodeReady)
    assert _terminals(pair) == [TerminalKind.COMPLETED]
    _assert_all_free(pair)


def test_cancel_after_decode_ready_keeps_the_kv_until_free() -> None:
    pair = Pair()
    pair.handoff(P)
    gen = pair.gens[0]
    assert gen.cancel(P, CancelReason.CLIENT, pair.now) == []
    assert gen.pool.counts().leased == 2
    pair.free(P)
    _assert_all_free(pair)


# ---- lease expiry ------------------------------------------------------------


def test_ctx_lease_expiry_records_intent_and_the_round_releases() -> None:
    """A lease deadline frees nothing by itself (seed: timeouts record intent
    only): it cancels and records the intent; the round's decided cancel
    releases, exactly once."""
    pair = Pair()
    pair.ctx.admit(P, 3, now=0.0, lease_deadline=5.0)
    pair.perform(pair.ctx.prefilled(P), pair.ctx)
    assert pair.ctx.expire(4.9) == []
    actions = pair.ctx.expire(5.0)
    assert _of(actions, CancelIntent) == [CancelIntent(P, CancelReason.TIMEOUT)]
    assert not _of(actions, Release)
    assert pair.ctx.pool.counts().leased == 3
    assert pair.ctx.expire(100.0) == []  # once
    released = pair.ctx.cancel(P, CancelReason.TIMEOUT, 100.0, from_round=True)
    assert [len(a.blocks) for a in _of(released, Release)] == [3]
    assert pair.ctx.pool.counts().free == pair.ctx_blocks


def test_ctx_lease_expiry_with_prepared_edge_tells_gen_not_started() -> None:
    pair = prepared(Pair())
    ticket = pair.tickets(P)[0]
    pair.now = 5.0
    pair.perform(pair.ctx.expire(pair.now), pair.ctx)
    assert pair.ctx.parent_state(P) is ParentState.SETTLED  # cancelled, nothing released yet
    assert _terminals(pair) == [TerminalKind.NOT_STARTED]
    pair.deliver_all()
    assert pair.gens[0].evidence(ticket).state is EdgeState.NOT_STARTED
    pair.run_rounds()
    assert pair.ctx.parent_state(P) is ParentState.RELEASED
    _assert_all_free(pair)
    # A late decision for the expired parent publishes nothing.
    assert not [a for a in pair.ctx.decided(P, pair.now) if isinstance(a, SendMessage)]


def test_transfer_timeout_is_a_cancel_intent_not_a_release() -> None:
    pair = decided(Pair(chunk_window=1), chunks=3)
    ticket = pair.tickets(P)[0]
    pair.now += pair.timeout
    actions = pair.ctx.expire(pair.now)
    pair.perform(actions, pair.ctx)
    assert CancelIntent(P, CancelReason.TIMEOUT) in actions
    assert not _of(actions, Release) and not _of(actions, Quarantine)
    assert pair.ctx.evidence(ticket).state is EdgeState.DRAINING
    pair.finish_chunk((ticket, 0))
    assert pair.ctx.evidence(ticket).state is EdgeState.DRAINED


def test_gen_admitted_never_installed_expires_through_the_round() -> None:
    """L1 for a GEN lease whose OPENs are never sent (the driver died after
    admission): the deadline cancels and records the intent; the decided
    cancel returns the blocks."""
    pair = Pair()
    gen = pair.gens[0]
    gen.admit(P, 2, now=0.0, deadline=3.0)
    assert gen.expire(2.0) == []
    actions = gen.expire(3.0)
    assert _of(actions, CancelIntent) == [CancelIntent(P, CancelReason.TIMEOUT)]
    assert not _of(actions, Release) and gen.pool.counts().leased == 2
    released = gen.cancel(P, CancelReason.TIMEOUT, 3.0, from_round=True)
    assert [len(a.blocks) for a in _of(released, Release)] == [2]
    assert gen.pool.counts().free == gen.pool.num_blocks


def test_decode_ready_kv_nobody_frees_ends_at_the_consumer_deadline() -> None:
    pair = decided(Pair())
    for key in list(pair.in_flight):
        pair.finish_chunk(key)
    pair.deliver_all()
    gen = pair.gens[0]
    settled = [p for p, st in gen.parents().items() if st is ParentState.SETTLED]
    assert settled == [P]
    assert _of(gen.completed(P, now=10.0), DecodeReady)
    assert gen.expire(10.0 + gen.consume_timeout - 0.1) == []
    assert gen.pool.counts().leased > 0
    actions = gen.expire(10.0 + gen.consume_timeout)
    assert _of(actions, Release) and gen.pool.counts().leased == 0
    assert _of(gen.free(P), CleanupSkipped)  # a late free is a no-op


def test_gen_waiting_forever_cancels_then_quarantines() -> None:
    pair = Pair()
    pair.admit(P)
    pair.install(P)
    pair.queue.clear()  # the CTX never hears the OPEN (it crashed)
    gen = pair.gens[0]
    pair.now = pair.timeout
    first = gen.expire(pair.now)
    assert CancelIntent(P, CancelReason.TIMEOUT) in first
    assert [type(a.message) for a in _of(first, SendMessage)] == [Cancel]
    assert gen.pool.counts().leased == 2  # the OPEN exposed the blocks: keep them
    pair.now += pair.timeout
    second = gen.expire(pair.now)
    assert [len(a.blocks) for a in _of(second, Quarantine)] == [2]
    assert _of(second, AdmissionStop)
    assert gen.pool.counts().quarantined == 2


def test_peer_restart_with_dma_in_flight_is_unknown() -> None:
    pair = decided(Pair())
    ticket = pair.tickets(P)[0]
    pair.deliver_all()
    pair.restart_gen(0)  # CTX is told; chunks still in flight
    assert pair.ctx.evidence(ticket).state is EdgeState.UNKNOWN
    assert pair.ctx.pool.counts().quarantined == 2
    pair.check_s1()


def test_ctx_restart_quarantines_gen_blocks_it_may_write() -> None:
    pair = decided(Pair())
    pair.deliver_all()
    pair.restart_ctx()
    assert pair.gens[0].parent_state(P) is ParentState.QUARANTINED
    pair.check_s1()
    pair.settle_everything()
    pair.check_s1()


def test_ready_message_is_just_a_ready() -> None:
    pair = decided(Pair())
    readies = [a.message for a in _of(pair.actions, SendMessage) if isinstance(a.message, Ready)]
    assert readies == [Ready(ticket=pair.tickets(P)[0])]


def test_decided_cancel_releases_a_parent_that_already_settled() -> None:
    """Regression (found by the benchmark): the transfer finished and the parent
    settled and reported completion, then a cancel won the round. No completion
    round follows a cancelled parent, so the decided cancel must release it."""
    pair = decided(Pair())
    pair.pump()  # chunks DONE, TERMINAL and RECEIPT delivered; no completion round yet
    assert pair.ctx.parent_state(P) is ParentState.SETTLED
    assert pair.gens[0].parent_state(P) is ParentState.SETTLED
    for rank in pair.ranks():
        pair.perform(rank.cancel(P, CancelReason.CLIENT, pair.now, from_round=True), rank)
    assert pair.ctx.parent_state(P) is ParentState.RELEASED
    assert pair.gens[0].parent_state(P) is ParentState.RELEASED
    assert not _of(pair.actions, Quarantine)
    _assert_all_free(pair)


def test_evidence_completes_only_a_release_the_round_decided() -> None:
    """docs/design.md "Who may free memory": a drained chunk (a poll result)
    settles a cancelled parent but frees nothing while the cancel is only an
    intent; the round's decided cancel releases. With the decision first, the
    last chunk's DONE completes the release it was waiting for."""
    for decided_first in (False, True):
        pair = decided(Pair(chunk_window=2))
        ticket = pair.tickets(P)[0]
        pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now, from_round=decided_first), pair.ctx)
        assert pair.ctx.evidence(ticket).state is EdgeState.DRAINING
        pair.finish_chunk((ticket, 0))
        assert pair.ctx.pool.counts().leased == 2
        pair.finish_chunk((ticket, 1))
        pair.check_s1()
        if decided_first:
            assert pair.ctx.parent_state(P) is ParentState.RELEASED
        else:
            assert pair.ctx.parent_state(P) is ParentState.SETTLED  # drained, still leased
            assert pair.ctx.pool.counts().leased == 2
            pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now, from_round=True), pair.ctx)
            assert pair.ctx.parent_state(P) is ParentState.RELEASED
        assert pair.ctx.pool.counts().free == pair.ctx_blocks


def test_conservative_cancel_lets_the_decided_transfer_finish() -> None:
    """Conservative path as table rows: a cancel of a DECIDED parent defers
    (FINISHING, CancelDeferred, a CancelIntent for the round) and posts on; the
    edges complete, the decided cancel releases; GEN gets COMPLETED evidence."""
    pair = decided(Pair(chunk_window=1, conservative=True), chunks=3)
    ticket = pair.tickets(P)[0]
    actions = pair.ctx.cancel(P, CancelReason.PEER, pair.now)
    pair.perform(actions, pair.ctx)
    assert _of(actions, CancelDeferred) == [CancelDeferred(P)]
    assert _of(actions, CancelIntent) and not _of(actions, Drain)
    assert pair.ctx.parent_state(P) is ParentState.FINISHING
    while pair.in_flight:  # the window moves on: every chunk is still posted
        pair.finish_chunk(next(iter(pair.in_flight)))
    assert pair.ctx.evidence(ticket).state is EdgeState.COMPLETED
    assert pair.ctx.parent_state(P) is ParentState.SETTLED
    assert _terminals(pair) == [TerminalKind.COMPLETED]
    pair.perform(pair.ctx.cancel(P, CancelReason.PEER, pair.now, from_round=True), pair.ctx)
    assert pair.ctx.parent_state(P) is ParentState.RELEASED
    pair.check_s1()


def test_conservative_transfer_past_its_deadline_drains() -> None:
    """L1 on the conservative path: past the transfer deadline the FINISHING
    parent stops waiting and drains like the active path."""
    pair = decided(Pair(chunk_window=1, conservative=True), chunks=3)
    ticket = pair.tickets(P)[0]
    pair.perform(pair.ctx.cancel(P, CancelReason.PEER, pair.now), pair.ctx)
    pair.now += pair.timeout
    pair.perform(pair.ctx.expire(pair.now), pair.ctx)
    assert pair.ctx.evidence(ticket).state is EdgeState.DRAINING
    pair.finish_chunk(next(iter(pair.in_flight)))
    assert pair.ctx.evidence(ticket).state is EdgeState.DRAINED
    assert pair.ctx.parent_state(P) is ParentState.SETTLED
    pair.check_s1()


def test_quarantine_limit_stops_admission_and_asks_for_a_restart_when_idle() -> None:
    """The bounded admission stop: below the limit the rank admits; at the
    limit it stops, and wants a restart only once nothing but quarantined
    requests is left (a live request finishes first)."""
    pair = Pair(chunk_window=2, ctx_blocks=4)
    assert pair.ctx.quarantine_limit == 0.5
    decided(pair)  # 2 of the 4 CTX blocks
    ticket = pair.tickets(P)[0]
    assert not pair.ctx.admission_stopped()
    other = parent_key(2)
    pair.ctx.admit(other, 1, now=pair.now, lease_deadline=pair.now + 100)
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)
    pair.now += pair.timeout
    pair.perform(pair.ctx.expire(pair.now), pair.ctx)  # the drain never ends: UNKNOWN, quarantined
    assert pair.ctx.pool.counts().quarantined == 2
    assert pair.ctx.admission_stopped()
    assert not pair.ctx.wants_restart()  # req-2 is still live
    pair.perform(pair.ctx.cancel(other, CancelReason.CLIENT, pair.now, from_round=True), pair.ctx)
    assert pair.ctx.wants_restart()
    pair.finish_chunk((ticket, 0))
    pair.finish_chunk((ticket, 1))  # the proof after all: reclaimed, admission resumes
    assert not pair.ctx.admission_stopped() and not pair.ctx.wants_restart()


def test_peer_dead_proves_only_the_dead_writers_edges() -> None:
    """A CTX rank killed with DMA in flight: GEN quarantines (UNKNOWN). The death
    of another CTX rank, or of a newer incarnation's namespace twin in another
    instance, proves nothing about this writer: nothing changes. The dead
    writer's own confirmed death is the proof: GEN reclaims every block."""
    pair = decided(Pair(chunk_window=1))
    pair.deliver_all()
    writer = pair.ctx.our
    pair.restart_ctx()  # GEN: the writer is gone with a chunk unproven -> UNKNOWN
    gen = pair.gens[0]
    assert gen.parent_state(P) is ParentState.QUARANTINED
    before = gen.snapshot()
    other_rank = ctx_endpoint(epoch=writer.epoch, rank=1)
    other_instance = Endpoint(
        ns=RankNamespace(instance_id="ctx9", role=Role.CTX, rank=0), epoch=writer.epoch
    )
    for stranger in (other_rank, other_instance):
        assert gen.peer_dead(stranger, pair.now) == []
    assert gen.snapshot() == before
    pair.perform(gen.peer_dead(writer, pair.now), gen)
    assert gen.parent_state(P) is ParentState.RELEASED
    assert gen.pool.counts().quarantined == 0 and gen.pool.counts().free == gen.pool.num_blocks


def test_an_edge_installed_toward_a_writer_already_dead_is_proven_at_once() -> None:
    """The death notice first, the OPEN toward that incarnation after it (a
    GEN rank built it from a registration read before the death: a fleet
    learns a pair's ranks lazily). A dead process posts no WRITE, so the
    install proves the edge and cancels the parent as failed at once; the
    round's cancel returns every block, and nothing is ever quarantined,
    however long it waits (the notice is never repeated)."""
    pair = Pair(chunk_window=1)
    pair.admit(P, blocks=2, chunks=2)
    writer = pair.ctx.our
    pair.restart_ctx()  # the writer's incarnation is gone; nothing of P was installed yet
    gen = pair.gens[0]
    assert gen.peer_dead(writer, pair.now) == []  # nothing of it is live here: nothing to prove yet
    ticket = make_ticket(P, writer, gen.our)
    spec = GenEdgeSpec(ticket=ticket, buffer=buffer_for(gen.lease(P), gen.our.epoch), num_tokens=16, expected_bytes=2 * CHUNK_BYTES)
    actions = gen.install(P, [spec], pair.now)
    assert CancelIntent(P, CancelReason.FAILURE) in actions, actions
    assert gen.edges(P)[ticket].state is EdgeState.DRAINED
    gen.cancel(P, CancelReason.FAILURE, pair.now, from_round=True)  # the round decides the failure
    for _ in range(3):  # past every deadline: still nothing quarantined
        pair.now += pair.timeout + 1
        gen.expire(pair.now)
    assert gen.parent_state(P) is ParentState.RELEASED
    assert gen.pool.counts().quarantined == 0 and gen.pool.counts().free == gen.pool.num_blocks


def test_a_dead_writer_is_remembered_per_rank_and_only_for_its_epochs() -> None:
    """A newer incarnation of the dead writer's rank is alive: an edge toward
    it is installed as usual (nothing proven, nothing cancelled)."""
    pair = Pair(chunk_window=1)
    pair.admit(P, blocks=2, chunks=2)
    gen = pair.gens[0]
    gen.peer_dead(ctx_endpoint(epoch=pair.ctx.our.epoch - 1), pair.now)  # an older incarnation died
    pair.install(P)  # toward the live one
    assert gen.parent_state(P) is ParentState.INSTALLED
    assert all(e.state is EdgeState.OPEN_PROPOSED for e in gen.edges(P).values())
