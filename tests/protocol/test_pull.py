"""Pull: the GEN rank READs the blocks a CTX rank lent it (protocol/_edge_roles.py).

The same edge machines as push with the roles swapped: the reader posts and
polls, the lender waits for the reader's word (its TERMINAL), its confirmed
death, or the answer to its FENCE (the CANCEL of a lent session). These
tests drive the real `CtxRank` / `GenRank` through the pair model; the
explorer's `pull` worlds (tests/protocol/test_explore.py) walk every
interleaving of the same steps.
"""

from __future__ import annotations

import pytest

from kvhandoff import protocol
from kvhandoff.protocol import (
    Cancel,
    CancelReason,
    Drain,
    IllegalTransition,
    Open,
    ParentState,
    PeerBuffer,
    Quarantine,
    Ready,
    StaleError,
    Terminal,
    TerminalKind,
)
from kvhandoff.protocol._lends import LendMemory

from .harness import Pair, ctx_endpoint, make_ticket, parent_key

P = parent_key(1)


def lent(pair: Pair | None = None, *, chunks: int = 2) -> Pair:
    """Admitted on both sides, prefilled and lent: the GEN rank has not read yet."""
    pair = pair or Pair(pull=True, chunk_window=1)
    pair.admit(P, blocks=2, chunks=chunks)
    pair.prefill(P)
    pair.lend(P)
    return pair


def frames(pair: Pair) -> list[object]:
    return [protocol.decode_frame(env.frame) for env in pair.queue]


def cancel_on(pair: Pair, rank: protocol.CtxRank | protocol.GenRank) -> None:
    pair.perform(rank.cancel(P, CancelReason.CLIENT, pair.now), rank)


def test_a_pulled_handoff_moves_no_frame_before_the_read_and_the_lender_waits_for_the_readers_word() -> None:
    """Lent, the CTX parent is DECIDED with its blocks held; the reader's
    install posts READs at once (no OPEN, no READY on the wire); the CTX
    blocks stay leased until the reader's TERMINAL(COMPLETED) reaches the
    lender, which then releases them once; the GEN rank is decode-ready."""
    pair = lent()
    assert pair.ctx.parent_state(P) is ParentState.DECIDED
    pair.install(P)
    assert pair.queue == []  # nothing on the wire: the READ is the reader's own
    assert all(w.pull for w in pair.in_flight.values()) and len(pair.in_flight) == 1  # window 1
    pair.pump()
    (terminal,) = frames(pair) if pair.queue else (None,)
    assert terminal is None  # pump delivered it: the lender got the reader's word
    assert pair.ctx.parent_state(P) is ParentState.SETTLED
    assert pair.ctx.pool.holds(P)  # held until the completion round
    pair.run_rounds()
    assert not pair.ctx.is_live(P) and pair.ctx.pool.counts().free == pair.ctx.pool.num_blocks
    assert P in pair.decode_ready and pair.gens[0].parent_state(P) is ParentState.DECODE_READY
    assert not any(isinstance(a, (Open, Ready)) for a in map(_message_of, pair.actions))


def _message_of(action: object) -> object:
    return getattr(action, "message", None)


def test_the_lenders_blocks_stay_leased_while_the_readers_terminal_is_in_flight() -> None:
    """S1 for the read side: until the TERMINAL lands, the lender holds."""
    pair = lent(chunks=1)
    pair.install(P)
    (key,) = pair.in_flight
    pair.finish_chunk(key)
    (terminal,) = frames(pair)
    assert isinstance(terminal, Terminal) and terminal.evidence is TerminalKind.COMPLETED
    pair.run_rounds()
    assert pair.ctx.pool.holds(P) and pair.ctx.parent_state(P) is ParentState.DECIDED
    pair.deliver_all()
    pair.run_rounds()
    assert not pair.ctx.is_live(P)


def test_a_fence_before_the_read_is_answered_not_started_and_the_reader_never_reads_that_lend() -> None:
    """The CTX side cancels before the GEN rank received the ticket: its
    FENCE (a CANCEL naming the lend) goes to the reader and the blocks stay
    leased; the reader answers NOT_STARTED and remembers the lend; the
    lender releases; the reader's later install of that lend is refused
    and changes nothing."""
    pair = lent()
    cancel_on(pair, pair.ctx)
    (fence,) = frames(pair)
    assert isinstance(fence, Cancel) and fence.lend_seq == 1
    assert pair.ctx.pool.holds(P)
    pair.deliver_all()  # the reader's answer comes back and lands
    assert pair.actions and any(
        isinstance(m, Terminal) and m.evidence is TerminalKind.NOT_STARTED for m in map(_message_of, pair.actions)
    )
    pair.run_rounds()
    assert not pair.ctx.is_live(P)
    gen = pair.gens[0]
    before = gen.snapshot()
    with pytest.raises(StaleError, match="lend"):
        gen.install_pull(P, pair.pull_specs(P, 0), pair.now)
    assert gen.snapshot() == before


def test_a_fence_during_the_read_waits_for_the_read_to_end() -> None:
    """FENCE while a READ runs: the reader stops posting and drains (a
    Drain order), the lender keeps its blocks; only when the READ is polled
    to its end does the reader's TERMINAL(DRAINED) let the lender release."""
    pair = lent()
    pair.install(P)
    (key,) = pair.in_flight
    cancel_on(pair, pair.ctx)
    pair.deliver_all()  # the FENCE reaches the reader
    assert any(isinstance(a, Drain) for a in pair.actions)
    pair.run_rounds()
    assert pair.ctx.pool.holds(P) and pair.gens[0].pool.holds(P)
    pair.finish_chunk(key)
    pair.deliver_all()
    pair.run_rounds()
    assert not pair.ctx.is_live(P) and not pair.gens[0].is_live(P)
    pair.check_s4_and_ownership()


def test_a_reader_cancel_drains_its_read_then_tells_the_lender() -> None:
    pair = lent()
    pair.install(P)
    (key,) = pair.in_flight
    cancel_on(pair, pair.gens[0])
    assert pair.queue == []  # nothing to say while its READ runs
    pair.finish_chunk(key)
    (word,) = frames(pair)
    assert isinstance(word, Terminal) and word.evidence is TerminalKind.DRAINED
    pair.deliver_all()
    pair.run_rounds()
    assert not pair.ctx.is_live(P) and not pair.gens[0].is_live(P)


def test_a_reader_that_never_answers_quarantines_the_lender_until_its_death_is_confirmed() -> None:
    """The FENCE is lost and the reader's READ never ends: past the wait the
    lent edge is UNKNOWN (quarantine, admission stop), the lender asks
    again (its FENCE re-sent) and keeps the blocks; the reader's confirmed
    death proves them and they come back."""
    pair = lent()
    pair.install(P)
    cancel_on(pair, pair.ctx)
    pair.queue.clear()  # the FENCE is lost
    pair.now += pair.timeout + 1
    pair.expire()
    assert pair.ctx.parent_state(P) is ParentState.QUARANTINED
    assert any(isinstance(a, Quarantine) for a in pair.actions)
    assert any(isinstance(m, Cancel) and m.lend_seq for m in frames(pair))  # asked again
    pair.queue.clear()
    pair.restart_gen(0)
    assert pair.ctx.parent_state(P) is ParentState.QUARANTINED  # a restart is not a death proof
    pair.confirm_gen_dead(0, 1)
    assert not pair.ctx.is_live(P) and pair.ctx.pool.counts().quarantined == 0


def test_the_readers_late_terminal_ends_the_lenders_quarantine() -> None:
    """A quarantine on the lender ends on the reader's word, however late."""
    pair = lent(chunks=1)
    pair.install(P)
    (key,) = pair.in_flight
    cancel_on(pair, pair.ctx)
    fence = pair.queue.pop()
    pair.now += pair.timeout + 1
    pair.expire()
    assert pair.ctx.parent_state(P) is ParentState.QUARANTINED
    pair.queue.clear()
    pair.queue.append(fence)
    pair.deliver_all()  # the reader drains ...
    pair.finish_chunk(key)  # ... its READ ends ...
    pair.deliver_all()  # ... and its TERMINAL(DRAINED) is the proof
    assert not pair.ctx.is_live(P) and pair.ctx.pool.counts().quarantined == 0


def test_a_terminal_about_an_edge_a_rank_posts_itself_is_refused() -> None:
    """Only the poster's word ends a wait: a TERMINAL from the lender about
    the reader's own READ is refused and changes nothing (else it could
    prove an UNKNOWN edge quiescent while the READ runs)."""
    pair = lent(chunks=1)
    pair.install(P)
    gen = pair.gens[0]
    for phase in ("reading", "unknown"):
        if phase == "unknown":  # its READ failed part-way: only its own proof may end this
            pair.fail_chunk_partially(next(iter(pair.in_flight)))
            assert gen.parent_state(P) is ParentState.QUARANTINED
        before = gen.snapshot()
        for kind in TerminalKind:
            with pytest.raises(IllegalTransition):
                gen.receive(Terminal(ticket=pair.tickets(P)[0], evidence=kind), pair.now)
        assert gen.snapshot() == before, phase


def test_a_reader_checks_the_lent_blocks_against_the_lenders_registered_buffer() -> None:
    """The source must be whole blocks of the CTX agent's registered
    buffer (as an OPEN's blocks are checked on a CTX rank), with one block
    per block of the reader's lease; otherwise nothing is recorded."""
    pair = lent()
    gen = pair.gens[0]
    (spec,) = pair.pull_specs(P, 0)
    agent = spec.source.agent_name
    wrong = [
        type(spec)(**{**_fields(spec), "peer": PeerBuffer(agent, base=4096, block_bytes=spec.block_bytes, num_blocks=16)}),
        type(spec)(**{**_fields(spec), "block_bytes": (spec.block_bytes or 0) * 2}),
        type(spec)(**{**_fields(spec), "lend_seq": 0}),
        type(spec)(**{**_fields(spec), "num_chunks": 0}),
    ]
    before = gen.snapshot()
    for bad in wrong:
        with pytest.raises(protocol.ProtocolError):
            gen.install_pull(P, [bad], pair.now)
        assert gen.snapshot() == before
    right = type(spec)(**{**_fields(spec), "peer": PeerBuffer(agent, base=0, block_bytes=spec.block_bytes, num_blocks=16)})
    pair.perform(gen.install_pull(P, [right], pair.now), gen)
    assert pair.in_flight


def _fields(spec: object) -> dict[str, object]:
    return {name: getattr(spec, name) for name in spec.__slots__}  # type: ignore[attr-defined]


def test_a_lend_is_given_once_to_a_resident_parent_with_the_readers_it_pairs_with() -> None:
    pair = Pair(pull=True)
    pair.admit(P, blocks=2, chunks=1)
    ctx = pair.ctx
    ticket = pair.tickets(P)[0]
    with pytest.raises(IllegalTransition):  # not prefilled yet
        ctx.lend(P, {ticket: 1}, lend_seq=1, now=0.0)
    pair.prefill(P)
    before = ctx.snapshot()
    other = make_ticket(P, ctx_endpoint(epoch=2), ticket.gen)
    for readers, seq in (({ticket: 1}, 0), ({}, 1), ({other: 1}, 1), ({ticket: -1}, 1)):
        with pytest.raises(protocol.ProtocolError):
            ctx.lend(P, readers, lend_seq=seq, now=0.0)
        assert ctx.snapshot() == before
    pair.lend(P)
    with pytest.raises(protocol.ProtocolError):
        ctx.lend(P, {ticket: 1}, lend_seq=2, now=0.0)


def test_the_lend_memory_forgets_below_a_floor_and_refuses_everything_there() -> None:
    """Bounded: past its limit the memory forgets the lowest lend of the
    incarnation with the most, and counts every lend up to it as used (a
    refusal, never a second read)."""
    memory = LendMemory(limit=3)
    a, b = ctx_endpoint(epoch=1), ctx_endpoint(epoch=2)
    for seq in (5, 2, 9):
        memory.mark(a, seq)
    assert not memory.used(a, 1) and memory.used(a, 2) and not memory.used(a, 3)
    memory.mark(b, 1)  # over the limit: a's lowest (2) is forgotten, its floor is 2
    assert len(memory) == 3 and memory.floor(a) == 2 and memory.floor(b) == 0
    assert memory.used(a, 1) and memory.used(a, 2) and not memory.used(a, 3)
    memory.mark(a, 3)  # a is fullest again: 3 in, its lowest (3) out
    assert memory.floor(a) == 3 and memory.used(a, 3) and not memory.used(a, 4) and memory.used(a, 5)
    assert not memory.used(b, 2) and memory.used(b, 1)


def test_a_reader_remembers_the_lends_of_each_incarnation_apart() -> None:
    """A lend number means something only in its CTX incarnation: a new
    incarnation's lend 1 is not the old one's."""
    memory = LendMemory()
    memory.mark(ctx_endpoint(epoch=1), 1)
    assert memory.used(ctx_endpoint(epoch=1), 1) and not memory.used(ctx_endpoint(epoch=2), 1)
    assert not memory.used(ctx_endpoint(epoch=1, instance=1), 1)


def test_a_read_that_failed_part_way_holds_the_readers_blocks_until_its_source_is_dead() -> None:
    """A READ chunk of several descriptors ends ERR while its others may
    still bring bytes: the reader's blocks are quarantined (S1: its own
    READ may still write them), and the lender's too (the reader's word is
    UNKNOWN). The source's confirmed death ends both: a dead process serves
    no bytes (found by the explorer: without it the reader stayed
    quarantined for good)."""
    pair = lent(chunks=1)
    pair.install(P)
    (key,) = pair.in_flight
    pair.fail_chunk_partially(key)
    gen = pair.gens[0]
    assert gen.parent_state(P) is ParentState.QUARANTINED
    pair.deliver_all()  # TERMINAL(UNKNOWN): the lender holds on
    assert pair.ctx.parent_state(P) is ParentState.QUARANTINED
    pair.restart_ctx(0)
    assert gen.parent_state(P) is ParentState.QUARANTINED  # a restart is no proof: it may still serve
    pair.confirm_ctx_dead(0, 1)
    assert not gen.is_live(P) and gen.pool.counts().quarantined == 0
    pair.check_s1()


def test_a_lend_nobody_reads_is_fenced_at_its_lease_deadline() -> None:
    """No reader ever installs: past the lease deadline the lender cancels
    and FENCEs the reader it named, keeping the blocks until the answer."""
    pair = lent()
    pair.now += 5.0 + 1  # the lease (`admit`'s default)
    pair.expire()
    (fence,) = frames(pair)
    assert isinstance(fence, Cancel) and fence.lend_seq == 1 and fence.reason is CancelReason.TIMEOUT
    assert pair.ctx.pool.holds(P)
    pair.deliver_all()
    pair.run_rounds()
    assert not pair.ctx.is_live(P)


def test_a_lost_terminal_is_asked_for_again_by_the_fence() -> None:
    """The reader finished and its TERMINAL(COMPLETED) was lost: the lender
    FENCEs at its lease deadline, and the reader, decode-ready and
    unharmed, answers with its TERMINAL again; the lender releases."""
    pair = lent(chunks=1)
    pair.install(P)
    pair.finish_chunk(next(iter(pair.in_flight)))
    pair.queue.clear()  # its TERMINAL is lost
    pair.run_rounds()
    assert P in pair.decode_ready
    pair.now += 5.0 + 1
    pair.expire()
    pair.deliver_all()
    pair.run_rounds()
    assert not pair.ctx.is_live(P) and pair.ctx.pool.counts().free == pair.ctx.pool.num_blocks
    assert pair.gens[0].parent_state(P) is ParentState.DECODE_READY  # the FENCE ended nothing there
