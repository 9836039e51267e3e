"""Session machines: the tables, the docs rendered from them, default-deny, cleanup-once.

Mirrors protocol/_tables.py and the rank sessions (_session.py, _ctx_session.py, _gen_session.py) (h11's test_state.py, h2's test_state_machines.py).
"""

from __future__ import annotations

import pathlib
import re

import msgspec
import numpy as np
import pytest

import kvhandoff.protocol as protocol
from kvhandoff.protocol import (
    CTX_EDGE_TRANSITIONS,
    CTX_PARENT_TRANSITIONS,
    GEN_EDGE_TRANSITIONS,
    GEN_PARENT_TRANSITIONS,
    MACHINES,
    BlockDescriptor,
    BlockRuns,
    BufferInfo,
    Cancel,
    CancelReason,
    CleanupSkipped,
    CtxRank,
    DecodeReady,
    Drain,
    DuplicateSessionError,
    EdgeEvent,
    EdgeState,
    GenEdgeSpec,
    IllegalTransition,
    LeaseError,
    Open,
    ParentEvent,
    ParentSettled,
    ParentState,
    PoolError,
    PostChunk,
    Ready,
    Receipt,
    Reject,
    RejectReason,
    Release,
    Role,
    SendMessage,
    StaleError,
    Terminal,
    TerminalKind,
    UnknownSessionError,
    block_columns,
    pack_blocks,
    reject_for,
    render_state_tables,
)
from kvhandoff.protocol._tables import _STATE_DOCS

from ._helpers import decided, prepared, resident
from .harness import (
    CHUNK_BYTES,
    CTX_DIGEST,
    Pair,
    buffer_for,
    ctx_endpoint,
    gen_endpoint,
    make_ticket,
    parent_key,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
P = parent_key(1)


# ---- tables ----------------------------------------------------------------

# Every (state, message/event) pair is driven through the real CtxRank/GenRank
# in test_session_pairs.py (generated from the tables); here: table properties.


def test_absorbing_states() -> None:
    # RELEASED never leaves RELEASED; edge UNKNOWN never leaves UNKNOWN;
    # QUARANTINED leaves only by RECLAIM.
    for table in (CTX_PARENT_TRANSITIONS, GEN_PARENT_TRANSITIONS):
        for (state, event), tr in table.items():
            if state is ParentState.RELEASED:
                assert tr.next is ParentState.RELEASED
            if state is ParentState.QUARANTINED and event is not ParentEvent.RECLAIM:
                assert tr.next is ParentState.QUARANTINED
    # UNKNOWN is left only by a proof of quiescence, and only to DRAINED; or,
    # on GEN, by the writer's REJECT of the OPEN (it never recorded it, so it
    # never wrote): to NOT_STARTED.
    for table in (CTX_EDGE_TRANSITIONS, GEN_EDGE_TRANSITIONS):
        for (state, event), tr in table.items():
            if state is EdgeState.UNKNOWN and event is EdgeEvent.QUIESCENCE_PROVEN:
                assert tr.next is EdgeState.DRAINED
            elif state is EdgeState.UNKNOWN and event is EdgeEvent.REJECTED:
                assert table is GEN_EDGE_TRANSITIONS and tr.next is EdgeState.NOT_STARTED
            elif state is EdgeState.UNKNOWN:
                assert tr.next is EdgeState.UNKNOWN and not tr.effects
    # Release is reachable only from SETTLED (every edge terminal, decided),
    # DECODE_READY (GEN), QUARANTINED by reclaim, or by withdrawing an admission
    # the round did not decide (nothing was ever exposed); never from a state
    # with DMA running, and never on a timeout of a parent that may be written.
    for table in (CTX_PARENT_TRANSITIONS, GEN_PARENT_TRANSITIONS):
        for (state, event), tr in table.items():
            if tr.next is not ParentState.RELEASED or state is ParentState.RELEASED:
                continue
            if state is ParentState.ADMITTED:
                assert event is ParentEvent.WITHDRAWN, (state, event)
            elif state is ParentState.CANCELLING:  # GEN: or the round's NOT_STARTED verdict
                assert event in (ParentEvent.WITHDRAWN, ParentEvent.RELEASE_NOT_STARTED)
            elif state is ParentState.QUARANTINED:
                assert event is ParentEvent.RECLAIM
            else:
                assert state in (ParentState.SETTLED, ParentState.DECODE_READY), (state, event)


def test_docs_file_is_the_rendering() -> None:
    on_disk = (ROOT / "docs" / "state-machines.md").read_text()
    assert on_disk == render_state_tables(), (
        "regenerate docs/state-machines.md with render_state_tables()"
    )


def test_rendering_lists_every_row() -> None:
    text = render_state_tables()
    for name, (table, _s, _e) in MACHINES.items():
        assert f"## {name}" in text
        for (state, event), tr in table.items():
            assert f"| `{state.value}` | `{event.value}` | `{tr.next.value}` |" in text


def test_state_docs_match_enum_comments() -> None:
    # The docs' state meanings are the enums' one-line comments, verbatim.
    source = (ROOT / "protocol" / "_tables.py").read_text()
    for member, doc in _STATE_DOCS.items():
        pattern = rf'{member.name} = "{member.value}"  # (.*)'
        block = source[source.index(f"class {type(member).__name__}(") :]
        match = re.search(pattern, block)
        assert match and match.group(1) == doc, member


def test_public_names_exported() -> None:
    for name in (
        "CtxRank",
        "GenRank",
        "BlockPool",
        "SessionRegistry",
        "render_state_tables",
        "reject_for",
    ):
        assert name in protocol.__all__


# ---- success path ----------------------------------------------------------


def test_success_path_actions_in_order() -> None:
    pair = resident(Pair(chunk_window=2), blocks=3, chunks=3)
    (env,) = pair.queue
    assert isinstance(msgspec.msgpack.decode(env.frame[12:]), dict)  # a real frame went through
    pair.deliver_all()
    ticket = pair.tickets(P)[0]
    assert pair.ctx.evidence(ticket).state is EdgeState.PREPARED
    assert not [a for a in pair.actions if isinstance(a, PostChunk)], "OPEN alone must not post"
    pair.actions.clear()
    pair.decide(P)
    kinds = [type(a) for a in pair.actions]
    assert kinds == [SendMessage, PostChunk, PostChunk]  # READY first, then the window
    assert isinstance(pair.actions[0], SendMessage) and isinstance(pair.actions[0].message, Ready)
    pair.pump()
    assert pair.ctx.evidence(ticket).state is EdgeState.COMPLETED
    assert pair.ctx.evidence(ticket).bytes_done == 3 * CHUNK_BYTES
    assert pair.gens[0].evidence(ticket).state is EdgeState.COMPLETED
    settled = [a for a in pair.actions if isinstance(a, ParentSettled)]
    assert len(settled) == 2 and all(not s.cancelled for s in settled)
    assert not pair.ctx.was_released(P)
    pair.run_rounds()
    assert pair.ctx.pool.counts().leased == 0  # CTX released after its completion round
    assert pair.ctx.was_released(P) and not pair.gens[0].was_released(P)  # GEN: decode-ready, live
    assert pair.gens[0].parent_state(P) is ParentState.DECODE_READY
    assert pair.gens[0].pool.counts().leased == 3  # KV stays with the request
    pair.free(P)
    assert pair.gens[0].pool.counts().free == pair.gen_blocks
    # Nothing on the success path was refused: the RECEIPT acknowledged exactly
    # the bytes GEN checked, and the CTX accepted it.
    assert pair.errors == []
    receipts = [
        a.message
        for a in pair.actions
        if isinstance(a, SendMessage) and isinstance(a.message, Receipt)
    ]
    assert [r.bytes_received for r in receipts] == [3 * CHUNK_BYTES]


# ---- default-deny on OPEN and on session messages ----------------------------


def _resident_pair() -> tuple[Pair, Open]:
    pair = resident(Pair())
    env = pair.queue.pop()
    message = protocol.decode_frame(env.frame)
    assert isinstance(message, Open)
    return pair, message


def _variants(good: Open) -> list[tuple[Open, type[Exception]]]:
    t = good.ticket
    r = msgspec.structs.replace
    return [
        (r(good, ticket=r(t, ctx=ctx_endpoint(epoch=7))), StaleError),
        (r(good, ticket=r(t, ctx_digest=bytes(32))), StaleError),
        (r(good, ticket=r(t, ctx_attempt=3)), StaleError),
        (r(good, ticket=r(t, gen_attempt=3)), StaleError),
        (r(good, ticket=r(t, request_id="never-seen")), UnknownSessionError),
        (r(good, buffer=r(good.buffer, endpoint_epoch=99)), StaleError),
    ]


def test_open_default_deny_changes_nothing() -> None:
    pair, good = _resident_pair()
    before = pair.ctx.snapshot()
    for bad, error in _variants(good):
        with pytest.raises(error):
            pair.ctx.receive_open(bad, pair.now)
        assert pair.ctx.snapshot() == before
    pair.ctx.receive_open(good, pair.now)
    with pytest.raises(DuplicateSessionError):
        pair.ctx.receive_open(good, pair.now)


def test_open_before_prefill_is_illegal_and_rejected() -> None:
    pair = Pair()
    pair.admit(P)
    pair.install(P)
    pair.deliver_all()  # CTX refuses, answers REJECT; GEN takes it as NOT_STARTED
    assert isinstance(pair.errors[0], IllegalTransition)
    ticket = pair.tickets(P)[0]
    assert pair.gens[0].evidence(ticket).state is EdgeState.NOT_STARTED
    assert pair.ctx.parent_state(P) is ParentState.ADMITTED


def test_session_messages_need_the_exact_ticket() -> None:
    pair = Pair()
    pair.handoff(P)
    ticket = pair.tickets(P)[0]
    snap = [r.snapshot() for r in pair.ranks()]
    r = msgspec.structs.replace
    for bad in (
        r(ticket, gen=gen_endpoint(epoch=5)),
        r(ticket, gen_attempt=9),
        r(ticket, gen_digest=bytes(32)),
    ):
        with pytest.raises(StaleError):
            pair.ctx.receive_receipt(Receipt(ticket=bad, bytes_received=1))
        with pytest.raises((StaleError, UnknownSessionError)):
            pair.gens[0].receive_terminal(
                Terminal(ticket=bad, evidence=TerminalKind.UNKNOWN), pair.now
            )
    assert [x.snapshot() for x in pair.ranks()] == snap


def test_closed_session_is_stale_not_unknown() -> None:
    pair = Pair()
    pair.handoff(P)
    ticket = pair.tickets(P)[0]
    with pytest.raises(StaleError) as info:
        pair.ctx.receive_receipt(Receipt(ticket=ticket, bytes_received=2 * CHUNK_BYTES))
    assert "closed" in str(info.value)


def _packed(buffer: BufferInfo) -> BufferInfo:
    c = block_columns(buffer)
    return msgspec.structs.replace(buffer, blocks=pack_blocks(c.blocks, c.lengths, c.generations, c.addrs))


def _runs(buffer: BufferInfo) -> BufferInfo:
    """The run form, one run per block (any list: nothing to join)."""
    c = block_columns(buffer)
    ones = np.ones(len(c.blocks), dtype="<u4")
    raw = b"".join((c.blocks.astype("<u4").tobytes(), ones.tobytes(), c.generations.astype("<u8").tobytes(), c.addrs.astype("<u8").tobytes()))
    return msgspec.structs.replace(buffer, blocks=BlockRuns(length=int(c.lengths[0]), stride=0, runs=raw))


def test_install_checks_descriptors_against_the_lease() -> None:
    pair = Pair()
    pair.admit(P)
    pair.admit(parent_key(2))
    gen = pair.gens[0]
    ticket = pair.tickets(P)[0]
    refs = gen.lease(P)
    stale = buffer_for(refs, gen.our.epoch)
    stale = msgspec.structs.replace(
        stale, blocks=[BlockDescriptor(refs[0].block, refs[0].generation + 1, 0, 1)]
    )
    foreign = buffer_for(gen.lease(parent_key(2)), gen.our.epoch)
    before = gen.snapshot()
    for form in (lambda b: b, _packed, _runs):  # any form of the block list, the same checks
        with pytest.raises(StaleError):
            gen.install(
                P, [GenEdgeSpec(ticket=ticket, buffer=form(stale), num_tokens=1, expected_bytes=1)], 0.0
            )
        with pytest.raises(PoolError):
            gen.install(
                P, [GenEdgeSpec(ticket=ticket, buffer=form(foreign), num_tokens=1, expected_bytes=1)], 0.0
            )
    with pytest.raises(StaleError):
        wrong = make_ticket(P, pair.ctx.our, gen_endpoint(epoch=4))
        gen.install(
            P,
            [GenEdgeSpec(ticket=wrong, buffer=buffer_for(refs, 1), num_tokens=1, expected_bytes=1)],
            0.0,
        )
    assert gen.snapshot() == before


def test_completed_with_wrong_bytes_is_not_decode_ready() -> None:
    pair = prepared(Pair())
    ticket = pair.tickets(P)[0]
    actions = pair.gens[0].receive_terminal(
        Terminal(ticket=ticket, evidence=TerminalKind.COMPLETED, bytes_done=1), pair.now
    )
    assert not any(isinstance(a, SendMessage) and isinstance(a.message, Receipt) for a in actions)
    assert pair.gens[0].evidence(ticket).state is EdgeState.DRAINED
    assert pair.gens[0].is_cancelled(P)


def test_reject_from_a_restarted_ctx_proves_nothing() -> None:
    """An OPEN that reached another CTX incarnation than the one it names is
    refused silently: no REJECT could be both truthful and harmless (with our
    endpoint it would match the live session exactly and cancel it: S3)."""
    pair, good = _resident_pair()
    new_ctx = ctx_endpoint(epoch=2)
    assert reject_for(good, StaleError("ctx epoch", 1, 2), new_ctx) is None
    forged = msgspec.structs.replace(good.ticket, ctx=new_ctx)
    with pytest.raises(StaleError):  # a REJECT rewritten to another endpoint proves nothing
        pair.gens[0].receive_reject(Reject(ticket=forged, reason=RejectReason.STALE), pair.now)
    assert pair.gens[0].evidence(good.ticket).state is EdgeState.OPEN_PROPOSED
    # From the incarnation it was sent to, the same REJECT is NOT_STARTED evidence.
    same = reject_for(good, StaleError("x", 1, 2), good.ticket.ctx)
    assert same is not None and same.reason is RejectReason.STALE
    pair.gens[0].receive_reject(same, pair.now)
    assert pair.gens[0].evidence(good.ticket).state is EdgeState.NOT_STARTED


def test_duplicate_reject_is_a_no_op() -> None:
    pair, good = _resident_pair()
    before = pair.gens[0].snapshot()
    pair.gens[0].receive_reject(Reject(ticket=good.ticket, reason=RejectReason.DUPLICATE), 0.0)
    assert pair.gens[0].snapshot() == before


# ---- cleanup-once ------------------------------------------------------------


def test_free_twice_is_reported_never_a_double_free() -> None:
    pair = Pair()
    pair.handoff(P)
    gen = pair.gens[0]
    (release,) = [a for a in gen.free(P) if isinstance(a, Release)]
    assert len(release.blocks) == 2
    free_after = gen.pool.counts().free
    again = gen.free(P)
    assert again == [CleanupSkipped(P, ParentState.RELEASED, ParentEvent.FREE)]
    assert gen.pool.counts().free == free_after
    assert pair.ctx.completed(P) == [CleanupSkipped(P, ParentState.RELEASED, ParentEvent.COMPLETE)]


def test_one_completed_child_cannot_release_a_partial_parent() -> None:
    pair = decided(Pair(n_gen=2, chunk_window=1))
    first, second = pair.tickets(P)
    # Finish only the first edge's chunks.
    while any(k[0] == first for k in pair.in_flight):
        pair.finish_chunk(next(k for k in pair.in_flight if k[0] == first))
    assert pair.ctx.evidence(first).state is EdgeState.COMPLETED
    assert pair.ctx.evidence(second).state is EdgeState.POSTING
    leased = pair.ctx.pool.counts().leased
    with pytest.raises(IllegalTransition):
        pair.ctx.completed(P)
    with pytest.raises(LeaseError):
        pair.ctx.release_not_started(P)
    assert pair.ctx.pool.counts().leased == leased
    pair.deliver_all()
    pair.run_rounds()
    assert pair.ctx.parent_state(P) is ParentState.DECIDED  # the CTX round did not release
    assert pair.ctx.pool.counts().leased == leased


def test_gen_completion_round_is_the_intersection() -> None:
    pair = decided(Pair(n_gen=2, chunk_window=1), chunks=1)
    first, _second = pair.tickets(P)
    pair.finish_chunk(next(k for k in pair.in_flight if k[0] == first))
    pair.deliver_all()
    pair.run_rounds()
    assert pair.gens[0].parent_state(P) is ParentState.SETTLED  # waits for gen 1
    assert not pair.decode_ready
    pair.pump()
    pair.run_rounds()
    assert pair.decode_ready == {P}


def test_cancel_is_idempotent() -> None:
    pair = Pair()
    pair.admit(P)
    first = pair.ctx.cancel(P, CancelReason.CLIENT, 0.0)
    assert first and pair.ctx.is_cancelled(P)
    snap = pair.ctx.snapshot()
    assert pair.ctx.cancel(P, CancelReason.CLIENT, 0.0) == []
    assert pair.ctx.snapshot() == snap


def test_unknown_parent_and_bad_construction() -> None:
    pair = Pair()
    with pytest.raises(UnknownSessionError):
        pair.ctx.cancel(P, CancelReason.CLIENT, 0.0)
    pair.admit(P)
    with pytest.raises(StaleError):
        pair.ctx.cancel(parent_key(1, ctx_attempt=1), CancelReason.CLIENT, 0.0)
    with pytest.raises(LeaseError):
        CtxRank(gen_endpoint(), CTX_DIGEST, pair.ctx.pool, edges_per_parent=1)
    with pytest.raises(LeaseError):
        CtxRank(ctx_endpoint(), CTX_DIGEST, pair.ctx.pool, edges_per_parent=1, transfer_timeout=0)
    with pytest.raises(LeaseError):
        CtxRank(ctx_endpoint(), CTX_DIGEST, pair.ctx.pool, edges_per_parent=0)


def test_decode_ready_action_only_on_success() -> None:
    pair = Pair()
    pair.handoff(P)
    assert [a for a in pair.actions if isinstance(a, DecodeReady)] == [DecodeReady(P)]


# ---- RECEIPT bytes and wrong-role messages (mutants that used to survive) -------


def _completed_with_receipt_held() -> tuple[Pair, Receipt]:
    """A handoff whose edge is COMPLETED on both sides, the GEN's RECEIPT still queued."""
    pair = decided(Pair(chunk_window=2))
    while pair.in_flight:
        pair.finish_chunk(next(iter(pair.in_flight)))
    while any(env.to_role is Role.GEN for env in pair.queue):  # READY, TERMINAL
        pair.deliver(next(i for i, env in enumerate(pair.queue) if env.to_role is Role.GEN))
    (env,) = pair.queue
    receipt = protocol.decode_frame(env.frame)
    assert isinstance(receipt, Receipt)
    return pair, receipt


def test_receipt_must_acknowledge_exactly_the_bytes_written() -> None:
    """A RECEIPT acknowledging fewer or more bytes than the CTX edge wrote is
    refused (StaleError naming the receipt bytes) and changes nothing, in any
    order with the real one; the exact RECEIPT is recorded.

    Kills: deleting the byte-count check in `CtxRank.receive_receipt`."""
    pair, receipt = _completed_with_receipt_held()
    ticket = pair.tickets(P)[0]
    written = pair.ctx.evidence(ticket).bytes_done
    assert receipt.bytes_received == written == 2 * CHUNK_BYTES
    r = msgspec.structs.replace
    before = pair.ctx.snapshot()
    for wrong in (0, written - 1, written + 1, 2 * written):
        with pytest.raises(StaleError) as info:
            pair.ctx.receive(r(receipt, bytes_received=wrong), pair.now)
        assert "receipt bytes" in str(info.value)
        assert pair.ctx.snapshot() == before
    pair.ctx.receive(receipt, pair.now)
    accepted = pair.ctx.snapshot()
    assert accepted != before  # the acknowledgement was recorded ...
    with pytest.raises(StaleError):  # ... and a wrong one after it still changes nothing
        pair.ctx.receive(r(receipt, bytes_received=written - 1), pair.now)
    assert pair.ctx.snapshot() == accepted


def test_each_role_refuses_the_messages_only_the_other_role_receives() -> None:
    """READY and TERMINAL go to GEN ranks only, OPEN and RECEIPT to CTX ranks
    only (in push; a TERMINAL reaches a CTX rank only for a session it lent,
    test_pull.py). Delivered (as frames) to the wrong role for a live session, each is refused
    with IllegalTransition naming the receive boundary, and nothing changes on
    any rank, at every phase of a handoff.

    Kills: deleting the `case _: raise IllegalTransition` of `CtxRank.receive`
    or `GenRank.receive` (the message would be dropped silently)."""
    pair = resident(Pair(chunk_window=1))
    (open_env,) = pair.queue
    open_msg = protocol.decode_frame(open_env.frame)
    ticket = pair.tickets(P)[0]
    to_gen = [Ready(ticket=ticket)] + [
        Terminal(ticket=ticket, evidence=kind, bytes_done=0) for kind in TerminalKind
    ]
    to_ctx = [open_msg, Receipt(ticket=ticket, bytes_received=0)]

    def check_refusals(phase: str) -> None:
        snaps = [rank.snapshot() for rank in pair.ranks()]
        for role, wrong in ((Role.CTX, to_gen), (Role.GEN, to_ctx)):
            for message in wrong:
                queued = len(pair.queue)
                error = pair.deliver_frame(role, 0, protocol.encode_frame(message))
                assert isinstance(error, IllegalTransition), (phase, role, message, error)
                assert error.machine == f"{role.value}-receive", (phase, error.machine)
                del pair.queue[queued:]  # the harness answers a refused OPEN with a REJECT
        assert [rank.snapshot() for rank in pair.ranks()] == snaps, phase

    check_refusals("installed, OPEN in flight")
    pair.deliver_all()
    check_refusals("prepared")
    pair.decide(P)
    check_refusals("posting")
    pair.pump()
    check_refusals("settled")


# ---- decision points the mutation check found untested ---------------------------


def test_a_decided_cancel_releases_a_settled_parent_without_a_completion_round() -> None:
    """The round decided a cancel for a parent whose edges already finished
    (SETTLED): no completion round will ever come for it, so applying the
    decided cancel releases it at once, on both sides (L1)."""
    pair = decided(Pair())
    pair.pump()  # COMPLETED everywhere; the completion round has not run
    for rank in pair.ranks():
        assert rank.parent_state(P) is ParentState.SETTLED
        actions = rank.cancel(P, CancelReason.CLIENT, pair.now, from_round=True)
        assert [type(a) for a in actions if isinstance(a, Release)] == [Release], rank.our
        assert rank.parent_state(P) is ParentState.RELEASED
        assert rank.pool.counts().leased == 0


def test_a_decided_cancel_releases_a_draining_parent_once_drained() -> None:
    """A decided cancel that finds chunks in flight releases nothing until the
    last one reports; then the parent is released without a completion round."""
    pair = decided(Pair(chunk_window=2))
    actions = pair.ctx.cancel(P, CancelReason.CLIENT, pair.now, from_round=True)
    assert not [a for a in actions if isinstance(a, Release)]
    assert pair.ctx.pool.counts().leased == 2
    first, second = sorted(pair.in_flight, key=lambda k: k[1])
    pair.finish_chunk(first)
    assert pair.ctx.parent_state(P) is ParentState.CANCELLING  # one chunk still in flight
    pair.finish_chunk(second)
    assert pair.ctx.parent_state(P) is ParentState.RELEASED
    assert pair.ctx.pool.counts().leased == 0


def test_peer_cancel_after_decode_ready_changes_nothing() -> None:
    """Once decode-ready the KV belongs to the request: a late peer CANCEL is
    accepted as a no-op, echoes no cancel intent, and changes no state."""
    pair = Pair()
    pair.handoff(P)
    gen = pair.gens[0]
    assert gen.parent_state(P) is ParentState.DECODE_READY
    before = gen.snapshot()
    ticket = pair.tickets(P)[0]
    assert gen.receive(Cancel(ticket=ticket, reason=CancelReason.PEER), pair.now) == []
    assert gen.cancel(P, CancelReason.CLIENT, pair.now) == []
    assert gen.snapshot() == before and not gen.is_cancelled(P)


def test_a_cancel_right_after_decide_drains_what_decide_posted() -> None:
    """decided() publishes READY and posts the first window in one step: no
    call can come between them, so a cancel right after it finds the chunk
    in flight (DRAINING, then DRAINED), never a READY edge with nothing posted."""
    pair = decided(Pair(chunk_window=1))
    ticket = pair.tickets(P)[0]
    assert pair.ctx.evidence(ticket).state is EdgeState.POSTING
    assert pair.ctx.evidence(ticket).posted == 1
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)
    assert pair.ctx.parent_state(P) is ParentState.CANCELLING
    assert pair.ctx.evidence(ticket).state is EdgeState.DRAINING


def test_not_started_share_is_false_once_anything_was_posted() -> None:
    """CTX: a cancelled parent with a chunk posted (DRAINING, then DRAINED) is
    never NOT_STARTED. GEN: contrary evidence (DRAINED, COMPLETED) removes its
    share too. Only then may the verdict skip the TERMINAL messages (S1)."""
    pair = decided(Pair(chunk_window=1))
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)
    ticket = pair.tickets(P)[0]
    assert pair.ctx.evidence(ticket).state is EdgeState.DRAINING
    assert not pair.ctx.local_not_started(P)
    with pytest.raises(LeaseError):
        pair.ctx.release_not_started(P)
    gen = pair.gens[0]
    pair.perform(gen.cancel(P, CancelReason.CLIENT, pair.now), gen)
    assert gen.local_not_started(P)  # no contrary evidence yet
    pair.pump()  # the posted chunk reports; TERMINAL(DRAINED) reaches GEN
    assert pair.ctx.evidence(ticket).state is EdgeState.DRAINED
    assert gen.evidence(ticket).state is EdgeState.DRAINED
    assert not pair.ctx.local_not_started(P)
    assert not gen.local_not_started(P)


def test_deadlines_are_inclusive() -> None:
    """A deadline is reached at `now == deadline` (as trio's deadlines): the CTX
    lease deadline cancels a parent that never started (the intent the round
    then decides), and the drain deadline makes a still-draining edge UNKNOWN,
    both exactly at the deadline."""
    pair = Pair()
    pair.admit(P, blocks=2, lease=5.0)
    pair.prefill(P)
    pair.now = 5.0 - 1e-9
    pair.expire()
    assert pair.ctx.parent_state(P) is ParentState.RESIDENT
    pair.now = 5.0
    pair.perform(pair.ctx.expire(pair.now), pair.ctx)
    assert pair.ctx.is_cancelled(P) and pair.ctx.parent_state(P) is ParentState.SETTLED

    pair = decided(Pair(chunk_window=1))
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)
    ticket = pair.tickets(P)[0]
    (drain,) = [a for a in pair.actions if isinstance(a, Drain)]
    pair.perform(pair.ctx.expire(drain.deadline - 1e-9), pair.ctx)
    assert pair.ctx.evidence(ticket).state is EdgeState.DRAINING
    pair.perform(pair.ctx.expire(drain.deadline), pair.ctx)
    assert pair.ctx.evidence(ticket).state is EdgeState.UNKNOWN


def test_restart_notice_for_the_live_epoch_changes_nothing() -> None:
    """peer_restarted names a NEWER epoch; a notice naming the epoch our sessions
    already use (a duplicate or reordered notice) ends nothing (S3)."""
    pair = decided(Pair(chunk_window=1))
    before = [rank.snapshot() for rank in pair.ranks()]
    assert pair.ctx.peer_restarted(pair.gens[0].our, pair.now) == []
    assert pair.gens[0].peer_restarted(pair.ctx.our, pair.now) == []
    assert [rank.snapshot() for rank in pair.ranks()] == before


def test_bad_chunk_reports_and_proofless_reclaim_change_nothing() -> None:
    """chunk_done with a negative byte count, and reclaim without a proof, are
    refused before anything changes (the machine must not move first)."""
    pair = decided(Pair(chunk_window=1))
    ((ticket, index),) = pair.in_flight
    before = pair.ctx.snapshot()
    with pytest.raises(PoolError):
        pair.ctx.chunk_done(ticket, index, -1, pair.now)
    assert pair.ctx.snapshot() == before
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)
    pair.now += pair.timeout + 1
    pair.perform(pair.ctx.expire(pair.now), pair.ctx)  # drain deadline: UNKNOWN, quarantined
    assert pair.ctx.parent_state(P) is ParentState.QUARANTINED
    before = pair.ctx.snapshot()
    with pytest.raises(LeaseError):
        pair.ctx.reclaim(P, proof="")
    assert pair.ctx.snapshot() == before
    pair.ctx.reclaim(P, proof="agent of ctx epoch 1 torn down")
    assert pair.ctx.pool.counts().quarantined == 0


def test_install_refuses_a_buffer_of_another_incarnation() -> None:
    """The GEN buffer info must name our own endpoint epoch: a buffer built by a
    previous incarnation (its agent and registrations are gone) is refused
    before any session is recorded, even when the ticket itself is right."""
    pair = Pair()
    pair.admit(P)
    gen = pair.gens[0]
    ticket = pair.tickets(P)[0]
    old = buffer_for(gen.lease(P), gen.our.epoch - 1)
    before = gen.snapshot()
    with pytest.raises(StaleError) as info:
        gen.install(
            P, [GenEdgeSpec(ticket=ticket, buffer=old, num_tokens=1, expected_bytes=1)], 0.0
        )
    assert "epoch" in str(info.value)
    assert gen.snapshot() == before


def test_a_failed_chunk_while_draining_waits_for_the_others() -> None:
    """S1: an ERR chunk is quiescent, but the edge's other posted chunks may still
    write; the edge stays DRAINING (its lease held) until every one reported."""
    pair = decided(Pair(chunk_window=2))
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)
    ticket = pair.tickets(P)[0]
    first, second = sorted(pair.in_flight, key=lambda k: k[1])
    pair.finish_chunk(first, ok=False)
    assert pair.ctx.evidence(ticket).state is EdgeState.DRAINING
    assert pair.ctx.evidence(ticket).in_flight == (second[1],)
    pair.run_rounds()  # the cancel is decided: release as soon as nothing can write
    pair.check_s1()  # ... which is not yet: the lease is still held under the chunk
    assert pair.ctx.parent_state(P) is ParentState.CANCELLING
    pair.finish_chunk(second, ok=False)
    assert pair.ctx.parent_state(P) is ParentState.RELEASED  # drained, then released
