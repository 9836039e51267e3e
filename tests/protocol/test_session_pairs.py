"""Every (state, message/event) pair of the session machines, through the real ranks.

For each machine of protocol/_tables.py (`MACHINES`: ctx-parent, ctx-edge,
gen-parent, gen-edge), scenarios built with the real API (the pair harness:
admit, prefill, install, OPEN frames, decide, chunks, cancel, expire, peer
restarts, rounds) bring a `CtxRank`/`GenRank` parent or edge (the *subject*)
to each state its table names. On every such state, every entry point of
that role is tried: each message kind delivered through `receive()` as a
decoded frame (including the kinds the role must refuse), and each event
method called. A small model, written from the API docstrings, says which
table event the call delivers to the subject (`Entry.event`); the table then
says what must happen:

* the pair (state, event) is a row: the call succeeds and the subject ends in
  the row's next state, or further along rows the same call fired (h11's
  state-triggered transitions: PREPARED -decided-> POSTING -chunk_posted->
  POSTING);
* the pair is missing: the call raises `IllegalTransition` or the documented
  `ProtocolError` (a message for a session that is not installed is stale or
  unknown; a chunk that is not in flight is refused), and nothing changes:
  `snapshot()` of every rank is equal before and after;
* the call documents that it does not address the subject here (None: e.g.
  `decided` reaches the edges only of a RESIDENT parent, a duplicate REJECT
  is a no-op):
  the subject's state does not change.

The cases are generated from the tables and the scenarios, so rows, states
and events that other changes add are picked up. What cannot be generated
fails loudly instead of being skipped: a state a table names that no scenario
reaches, an event that no entry point delivers and that is not listed in
`INTERNAL_EVENTS` (fired by a coupling or the clock) or `NOT_AN_EVENT_OF`
(another role's event, which then must appear in no row), and a row that no
case and no scenario fires (unless listed, with the reason, in
`UNREACHABLE_ROWS`).
"""

from __future__ import annotations

import contextlib
import enum
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import kvhandoff.protocol._ctx_session as ctx_session_module
import kvhandoff.protocol._edge_roles as edge_roles_module
import kvhandoff.protocol._gen_session as gen_session_module
import kvhandoff.protocol._session as session_module
from kvhandoff import protocol
from kvhandoff.protocol import (
    MACHINES,
    BlockRef,
    Cancel,
    CancelReason,
    CtxRank,
    EdgeEvent,
    EdgeState,
    GenEdgeSpec,
    GenRank,
    Open,
    ParentEvent,
    ParentState,
    PeerBuffer,
    ProtocolError,
    Ready,
    Receipt,
    Reject,
    SessionMessage,
    Terminal,
    TerminalKind,
    decode_frame,
    encode_frame,
)

from ._helpers import posting, prepared
from .harness import (
    CHUNK_BYTES,
    Pair,
    buffer_for,
    gen_endpoint,
    make_ticket,
    parent_key,
)

P = parent_key(1)
_PS, _ES, _PE, _EE = ParentState, EdgeState, ParentEvent, EdgeEvent


class _Refused(enum.Enum):
    REFUSED = "refused"  # the call must raise a ProtocolError and change nothing


REFUSED = _Refused.REFUSED
Expected = Any  # a ParentEvent / EdgeEvent, REFUSED, or None (subject not addressed)


# ---------------------------------------------------------------------------
# Scenarios: reach states with the real API
# ---------------------------------------------------------------------------


def _admitted(**kw: Any) -> Pair:
    pair = Pair(chunk_window=1, **kw)
    pair.admit(P, blocks=2, chunks=3)
    return pair


def _prepared(**kw: Any) -> Pair:
    """OPEN -> CTX edge PREPARED."""
    return prepared(Pair(chunk_window=1, **kw), chunks=3)


def _posting(chunks: int = 3, **kw: Any) -> Pair:
    """READY + the first chunk posted; READY -> GEN edge READY."""
    return posting(Pair(chunk_window=1, **kw), chunks=chunks)


def s_admitted() -> Pair:
    return _admitted()


def _then(scenario: Callable[[], Pair], step: Callable[[Pair], object]) -> Callable[[], Pair]:
    """The scenario `scenario`, then `step` on its pair."""

    def then() -> Pair:
        pair = scenario()
        step(pair)
        return pair

    return then


s_resident = _then(_admitted, lambda pair: pair.prefill(P))
s_installed = _then(_admitted, lambda pair: pair.install(P))  # the OPEN stays queued


def s_prepared() -> Pair:
    return _prepared()


def s_posting() -> Pair:
    return _posting(chunks=3)  # one chunk in flight, two to go


def s_posting_last() -> Pair:
    return _posting(chunks=1)  # the only chunk is in flight


def s_draining() -> Pair:
    pair = _posting()
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)
    return pair


def s_gen_cancelling() -> Pair:
    pair = _prepared()
    pair.perform(pair.gens[0].cancel(P, CancelReason.CLIENT, pair.now), pair.gens[0])
    return pair


def s_completed() -> Pair:
    pair = _posting()
    pair.pump()  # every chunk DONE, TERMINAL, RECEIPT; no rounds yet
    return pair


def s_not_started() -> Pair:
    pair = _prepared()
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)
    pair.deliver_all()  # TERMINAL(NOT_STARTED) -> GEN
    return pair


def s_drained() -> Pair:
    pair = s_draining()
    pair.pump()
    return pair


def s_unknown() -> Pair:
    pair = s_draining()
    pair.now += pair.timeout + 1
    pair.perform(pair.ctx.expire(pair.now), pair.ctx)  # drain deadline: UNKNOWN, quarantine
    pair.deliver_all()  # TERMINAL(UNKNOWN) -> GEN quarantines too
    return pair


def s_released() -> Pair:
    pair = Pair(chunk_window=1)
    pair.handoff(P, chunks=2)  # CTX released; GEN decode-ready
    return pair


s_freed = _then(s_released, lambda pair: pair.free(P))
s_cancel_decided = _then(s_not_started, Pair.run_rounds)  # verdict / decided cancels release both sides


# Scenarios that exist to fire the clock / coupling rows (INTERNAL_EVENTS).


def s_admitted_expired() -> Pair:
    pair = _admitted()
    pair.now += 6.0  # past the lease deadline (5 s): cancelled (an intent), still leased
    pair.expire()
    return pair


def s_finishing() -> Pair:
    pair = _posting(conservative=True)
    pair.perform(pair.ctx.cancel(P, CancelReason.PEER, pair.now), pair.ctx)  # deferred: FINISHING
    return pair


def s_finishing_done() -> Pair:
    pair = s_finishing()
    pair.pump()  # the decided transfer runs to its end, then the parent settles
    return pair


def s_finishing_stuck() -> Pair:
    pair = s_finishing()
    pair.now += pair.timeout + 1
    pair.expire()  # past the transfer deadline: stop waiting, drain
    pair.now += pair.timeout + 1
    pair.expire()  # the drain never ends: UNKNOWN, quarantine
    return pair


def s_consumer_expired() -> Pair:
    pair = _posting(chunks=1)
    pair.pump()
    pair.perform(pair.gens[0].completed(P, pair.now), pair.gens[0])  # decode-ready, consumer deadline set
    pair.now += pair.gens[0].consume_timeout + 1
    pair.perform(pair.gens[0].expire(pair.now), pair.gens[0])  # nobody freed it: returned
    return pair


def s_resident_expired() -> Pair:
    pair = _prepared()
    pair.now += 6.0
    pair.expire()
    return pair


def s_gen_restarted() -> Pair:
    pair = _posting()
    pair.restart_gen(0)  # CTX: a chunk in flight toward the old GEN -> UNKNOWN
    return pair


def s_ctx_restarted() -> Pair:
    pair = _posting()
    pair.restart_ctx()  # GEN: its writer is gone with DMA unproven -> UNKNOWN
    return pair


def s_ctx_restarted_before_ready() -> Pair:
    pair = _prepared()
    pair.restart_ctx()  # OPEN_PROPOSED: the old CTX may have decided and posted
    return pair


def s_gen_wait_expired() -> Pair:
    pair = s_gen_cancelling()
    pair.now += 2 * pair.timeout + 1
    pair.expire()
    return pair


def s_transfer_expired() -> Pair:
    pair = _posting()
    pair.now += pair.timeout + 1
    pair.expire()
    pair.deliver_all()
    return pair


def s_chunk_failed() -> Pair:
    pair = _posting()
    pair.finish_chunk(next(iter(pair.in_flight)), ok=False)
    pair.deliver_all()
    return pair


SCENARIOS: dict[str, Callable[[], Pair]] = {
    name[2:]: fn for name, fn in sorted(globals().items()) if name.startswith("s_")
}


def subject_state(pair: Pair, machine: str) -> enum.Enum | None:
    """The state of the subject of `machine` in `pair` (None: no such subject)."""
    role, kind = machine.split("-")
    rank: CtxRank | GenRank = pair.ctx if role == "ctx" else pair.gens[0]
    try:
        parent_state = rank.parent_state(P)
    except ProtocolError:
        return None
    if kind == "parent":
        return parent_state
    edge = rank.edges(P).get(_subject_ticket(pair))
    return edge.state if edge is not None else None


def _subject_ticket(pair: Pair) -> Any:
    return make_ticket(P, pair.ctx.our, pair.gens[0].our)


# ---------------------------------------------------------------------------
# Entry points and the model of which event each delivers
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Situation:
    pair: Pair
    machine: str
    state: enum.Enum

    @property
    def rank(self) -> CtxRank | GenRank:
        return self.pair.ctx if self.machine.startswith("ctx") else self.pair.gens[0]

    @property
    def ticket(self) -> Any:
        return _subject_ticket(self.pair)

    @property
    def installed(self) -> bool:
        return self.ticket in self.rank.edges(P)

    @property
    def edge(self) -> Any:
        return self.rank.edges(P)[self.ticket]

    @property
    def parent_live(self) -> bool:
        return P in self.rank.parents()

    @property
    def cancelled(self) -> bool:
        return self.rank.is_cancelled(P)

    @property
    def parent_state(self) -> ParentState:
        return self.rank.parent_state(P)


@dataclass(frozen=True)
class Entry:
    """One entry point of one role: a message kind or an event method."""

    name: str
    role: str  # "ctx" | "gen"
    call: Callable[[Situation], list[Any]]
    # machine -> the events this entry can deliver there (static, for the checks)
    delivers: dict[str, frozenset[enum.Enum]]
    # (machine, situation) -> the event delivered to the subject (the model)
    event: Callable[[str, Situation], Expected]


def _frame(message: SessionMessage) -> SessionMessage:
    # Through the real codec, as a peer's frame would arrive.
    decoded = decode_frame(encode_frame(message))
    assert isinstance(decoded, (Open, Ready, Cancel, Terminal, Receipt, Reject))
    return decoded


def _receive(sit: Situation, message: SessionMessage) -> list[Any]:
    return sit.rank.receive(_frame(message), sit.pair.now)


def _fresh_open(sit: Situation, blocks: int = 2) -> Open:
    # An OPEN for a new edge of P, from a GEN rank that has none yet; one block
    # descriptor per block of the CTX lease (every scenario leases 2).
    gen = gen_endpoint(rank=7)
    return Open(
        ticket=make_ticket(P, sit.pair.ctx.our, gen),
        buffer=buffer_for([BlockRef(b, 1) for b in range(blocks)], gen.epoch),
        num_tokens=16,
    )


# What the actor knows about the fresh OPEN's GEN agent (harness.buffer_for lays
# block b at b * CHUNK_BYTES of agent "gen-agent-<epoch>").
_AGENT = "gen-agent-1"
_PEER = PeerBuffer(agent_name=_AGENT, base=0, block_bytes=CHUNK_BYTES, num_blocks=16)


def _open_checked(sit: Situation, message: Open, **checks: Any) -> list[Any]:
    """receive_open with the actor's expectations (agent, block size, buffer),
    `checks` overriding one of them."""
    kw: dict[str, Any] = {"expected_agent": _AGENT, "block_bytes": CHUNK_BYTES, "peer": _PEER}
    kw.update(checks)
    return sit.pair.ctx.receive_open(_frame(message), sit.pair.now, num_chunks=2, **kw)


def _open_event(machine: str, sit: Situation) -> Expected:
    # A valid OPEN is recorded while the parent has room for another edge; the
    # one past `edges_per_parent` is refused (LeaseError) like an illegal one.
    if sit.parent_live and len(sit.rank.edges(P)) >= sit.pair.ctx.edges_per_parent:
        return REFUSED
    return _PE.EDGE_PREPARED


def _in_flight_index(sit: Situation) -> int:
    edge = sit.edge if sit.installed else None
    if edge is not None and edge.in_flight:
        return min(edge.in_flight)
    return 0


def _expected_bytes(sit: Situation) -> int:
    return sit.pair.chunks[P] * CHUNK_BYTES


def _on_installed(event: enum.Enum) -> Callable[[str, Situation], Expected]:
    """A message for the subject's session: refused (stale/unknown) unless it is installed."""
    return lambda machine, sit: event if sit.installed else REFUSED


def _cancel_edge_event(sit: Situation) -> Expected:
    # cancel() is idempotent and parent-scoped: edges get CANCEL only the first time,
    # and never once the parent is past the handoff (decode-ready, quarantined).
    if not sit.parent_live or sit.cancelled:
        return None
    if sit.parent_state in (_PS.DECODE_READY, _PS.QUARANTINED):
        return None
    return _EE.CANCEL


def _cancel_event(machine: str, sit: Situation) -> Expected:
    return _PE.CANCEL if machine.endswith("parent") else _cancel_edge_event(sit)


def _cancel_message_event(machine: str, sit: Situation) -> Expected:
    if not sit.installed:
        return REFUSED  # CANCEL names an exact installed session, or it is stale
    return _cancel_event(machine, sit)


def _local_not_started(sit: Situation) -> bool:
    # The documented share of the verdict: a cancelled CANCELLING/SETTLED parent whose
    # edges are NOT_STARTED (CTX) or carry no contrary evidence (GEN).
    allowed = (
        {_ES.NOT_STARTED}
        if sit.machine.startswith("ctx")
        else {_ES.NOT_STARTED, _ES.OPEN_PROPOSED, _ES.READY, _ES.CANCELLING}
    )
    return (
        sit.cancelled
        and sit.parent_state in (_PS.CANCELLING, _PS.SETTLED)
        and all(e.state in allowed for e in sit.rank.edges(P).values())
    )


def _release_not_started_event(machine: str, sit: Situation) -> Expected:
    if sit.parent_live and not _local_not_started(sit):
        return REFUSED  # the verdict contradicts local evidence: LeaseError
    return _PE.RELEASE_NOT_STARTED


def _chunk_done_event(machine: str, sit: Situation) -> Expected:
    if not sit.installed or not sit.edge.in_flight:
        return REFUSED  # only a posted chunk can report
    edge = sit.edge
    last = edge.state is _ES.POSTING and edge.chunks_done + 1 == sit.pair.chunks[P]
    return _EE.ALL_CHUNKS_DONE if last else _EE.CHUNK_DONE


def _chunk_failed_event(machine: str, sit: Situation) -> Expected:
    if not sit.installed or not sit.edge.in_flight:
        return REFUSED
    return _EE.CHUNK_FAILED


_TERMINAL_STATES = frozenset({_ES.COMPLETED, _ES.NOT_STARTED, _ES.DRAINED, _ES.UNKNOWN})


def _gen_terminal_event(kind: TerminalKind, event: enum.Enum) -> Callable[[str, Situation], Expected]:
    """TERMINAL for an exact session; on an UNKNOWN edge, any evidence but UNKNOWN
    is the writer's late proof of quiescence."""

    def model(machine: str, sit: Situation) -> Expected:
        if not sit.installed:
            return REFUSED
        if sit.state is _ES.UNKNOWN and kind is not TerminalKind.UNKNOWN:
            return _EE.QUIESCENCE_PROVEN
        return event

    return model


def _install(sit: Situation) -> list[Any]:
    gen = sit.pair.gens[0]
    spec = GenEdgeSpec(
        ticket=sit.ticket,
        buffer=buffer_for(gen.lease(P), gen.our.epoch),
        num_tokens=16,
        expected_bytes=_expected_bytes(sit),
    )
    return gen.install(P, [spec], sit.pair.now)


def _terminal(kind: TerminalKind, nbytes: Callable[[Situation], int] | None = None) -> Any:
    def call(sit: Situation) -> list[Any]:
        n = nbytes(sit) if nbytes is not None else 0
        return _receive(sit, Terminal(ticket=sit.ticket, evidence=kind, bytes_done=n))

    return call


def _events(*events: enum.Enum) -> frozenset[enum.Enum]:
    return frozenset(events)


_TERMINAL_EVENTS = {
    TerminalKind.COMPLETED: _EE.TERMINAL_COMPLETED,
    TerminalKind.NOT_STARTED: _EE.TERMINAL_NOT_STARTED,
    TerminalKind.DRAINED: _EE.TERMINAL_DRAINED,
    TerminalKind.UNKNOWN: _EE.TERMINAL_UNKNOWN,
}


def _common_entries(role: str) -> list[Entry]:
    """Entry points both roles have (cancel, completion, verdict, reclaim, CANCEL)."""
    return [
        Entry(
            "cancel()",
            role,
            lambda sit: sit.rank.cancel(P, CancelReason.CLIENT, sit.pair.now),
            {f"{role}-parent": _events(_PE.CANCEL), f"{role}-edge": _events(_EE.CANCEL)},
            _cancel_event,
        ),
        Entry(
            "receive(Cancel)",
            role,
            lambda sit: _receive(sit, Cancel(ticket=sit.ticket, reason=CancelReason.PEER)),
            {f"{role}-parent": _events(_PE.CANCEL), f"{role}-edge": _events(_EE.CANCEL)},
            _cancel_message_event,
        ),
        Entry(
            "completed()",
            role,
            lambda sit: sit.rank.completed(P),
            {f"{role}-parent": _events(_PE.COMPLETE, _PE.COMPLETE_CANCELLED)},
            lambda machine, sit: _PE.COMPLETE_CANCELLED if sit.cancelled else _PE.COMPLETE,
        ),
        Entry(
            "release_not_started()",
            role,
            lambda sit: sit.rank.release_not_started(P),
            {f"{role}-parent": _events(_PE.RELEASE_NOT_STARTED)},
            _release_not_started_event,
        ),
        Entry(
            "reclaim()",
            role,
            lambda sit: sit.rank.reclaim(P, proof="agent of the writer's epoch torn down"),
            {f"{role}-parent": _events(_PE.RECLAIM)},
            lambda machine, sit: _PE.RECLAIM,
        ),
        Entry(
            "withdraw()",
            role,
            lambda sit: sit.rank.withdraw(P),
            {f"{role}-parent": _events(_PE.WITHDRAWN)},
            # Only a parent that never exposed anything (no session) may be withdrawn.
            lambda machine, sit: REFUSED if sit.parent_live and sit.rank.edges(P) else _PE.WITHDRAWN,
        ),
    ]


CTX_ENTRIES: list[Entry] = [
    *_common_entries("ctx"),
    Entry(
        "prefilled()",
        "ctx",
        lambda sit: sit.pair.ctx.prefilled(P),
        {"ctx-parent": _events(_PE.PREFILLED)},
        lambda machine, sit: _PE.PREFILLED,
    ),
    Entry(
        "receive(Open)",
        "ctx",
        lambda sit: sit.pair.ctx.receive(_frame(_fresh_open(sit)), sit.pair.now, num_chunks=2),
        {"ctx-parent": _events(_PE.EDGE_PREPARED)},
        _open_event,
    ),
    Entry(
        "receive(Open, checked against the GEN agent's buffer)",
        "ctx",
        lambda sit: _open_checked(sit, _fresh_open(sit)),
        {"ctx-parent": _events(_PE.EDGE_PREPARED)},
        _open_event,
    ),
    # OPENs the buffer checks refuse, in every state: a typed error, nothing changes.
    *[
        Entry(
            f"receive(Open, {name})",
            "ctx",
            call,
            {"ctx-parent": frozenset()},
            lambda machine, sit: REFUSED,
        )
        for name, call in (
            ("fewer blocks than the lease", lambda sit: _open_checked(sit, _fresh_open(sit, 1))),
            ("more blocks than the lease", lambda sit: _open_checked(sit, _fresh_open(sit, 3))),
            (
                "another agent",
                lambda sit: _open_checked(sit, _fresh_open(sit), expected_agent="gen-agent-9"),
            ),
            (
                "another block size",
                lambda sit: _open_checked(sit, _fresh_open(sit), block_bytes=2 * CHUNK_BYTES),
            ),
            (
                "outside the registered buffer",
                lambda sit: _open_checked(
                    sit, _fresh_open(sit), peer=PeerBuffer(_AGENT, 64, CHUNK_BYTES, 16)
                ),
            ),
            (
                "past the registered pool",
                lambda sit: _open_checked(
                    sit, _fresh_open(sit), peer=PeerBuffer(_AGENT, 0, CHUNK_BYTES, 1)
                ),
            ),
        )
    ],
    Entry(
        "decided()",
        "ctx",
        lambda sit: sit.pair.ctx.decided(P, sit.pair.now),
        {"ctx-parent": _events(_PE.DECIDED), "ctx-edge": _events(_EE.DECIDED)},
        # Edges hear DECIDED only when the parent itself becomes DECIDED.
        lambda machine, sit: (
            _PE.DECIDED
            if machine == "ctx-parent"
            else (_EE.DECIDED if sit.parent_state is _PS.RESIDENT else None)
        ),
    ),
    Entry(
        "chunk_done()",
        "ctx",
        lambda sit: sit.pair.ctx.chunk_done(
            sit.ticket, _in_flight_index(sit), CHUNK_BYTES, sit.pair.now
        ),
        {"ctx-edge": _events(_EE.CHUNK_DONE, _EE.ALL_CHUNKS_DONE)},
        _chunk_done_event,
    ),
    Entry(
        "chunk_failed()",
        "ctx",
        lambda sit: sit.pair.ctx.chunk_failed(sit.ticket, _in_flight_index(sit), sit.pair.now),
        {"ctx-edge": _events(_EE.CHUNK_FAILED)},
        _chunk_failed_event,
    ),
    Entry(
        "receive(Receipt)",
        "ctx",
        lambda sit: _receive(
            sit,
            Receipt(
                ticket=sit.ticket,
                bytes_received=sit.edge.bytes_done if sit.installed else 0,
            ),
        ),
        {"ctx-edge": _events(_EE.RECEIPT_RECEIVED)},
        _on_installed(_EE.RECEIPT_RECEIVED),
    ),
    Entry(
        "receive(Receipt, other bytes)",
        "ctx",
        lambda sit: _receive(
            sit,
            Receipt(
                ticket=sit.ticket,
                bytes_received=(sit.edge.bytes_done if sit.installed else 0) + 1,
            ),
        ),
        {"ctx-edge": frozenset()},
        # A RECEIPT must acknowledge exactly the bytes written: never accepted.
        lambda machine, sit: REFUSED,
    ),
    Entry(
        "receive(Reject)",
        "ctx",
        lambda sit: _receive(sit, Reject(ticket=sit.ticket, reason=protocol.RejectReason.STALE)),
        # To CTX a REJECT means GEN no longer wants the bytes: a parent cancel.
        {"ctx-parent": _events(_PE.CANCEL), "ctx-edge": _events(_EE.CANCEL)},
        _cancel_message_event,
    ),
    # Messages only a GEN rank receives: CTX must refuse them (wrong role).
    Entry(
        "receive(Ready)",
        "ctx",
        lambda sit: _receive(sit, Ready(ticket=sit.ticket)),
        {"ctx-edge": _events(_EE.READY_RECEIVED)},
        lambda machine, sit: _EE.READY_RECEIVED,
    ),
    *[
        Entry(
            f"receive(Terminal {kind.value})",
            "ctx",
            _terminal(kind, _expected_bytes),
            {"ctx-edge": _events(event)},
            lambda machine, sit, event=event: event,  # type: ignore[misc]
        )
        for kind, event in _TERMINAL_EVENTS.items()
    ],
]

GEN_ENTRIES: list[Entry] = [
    *_common_entries("gen"),
    Entry(
        "install()",
        "gen",
        _install,
        {"gen-parent": _events(_PE.INSTALLED)},
        lambda machine, sit: _PE.INSTALLED,
    ),
    Entry(
        "free()",
        "gen",
        lambda sit: sit.pair.gens[0].free(P),
        {"gen-parent": _events(_PE.FREE)},
        lambda machine, sit: _PE.FREE,
    ),
    Entry(
        "receive(Ready)",
        "gen",
        lambda sit: _receive(sit, Ready(ticket=sit.ticket)),
        {"gen-edge": _events(_EE.READY_RECEIVED)},
        _on_installed(_EE.READY_RECEIVED),
    ),
    *[
        Entry(
            f"receive(Terminal {kind.value})",
            "gen",
            _terminal(kind, _expected_bytes if kind is TerminalKind.COMPLETED else None),
            {"gen-edge": _events(event, _EE.QUIESCENCE_PROVEN)},
            _gen_terminal_event(kind, event),
        )
        for kind, event in _TERMINAL_EVENTS.items()
    ],
    Entry(
        "receive(Terminal completed, other bytes)",
        "gen",
        _terminal(TerminalKind.COMPLETED, lambda sit: _expected_bytes(sit) + 1),
        # Quiescent but wrong: counts as DRAINED (and cancels the parent).
        {"gen-edge": _events(_EE.TERMINAL_DRAINED, _EE.QUIESCENCE_PROVEN)},
        _gen_terminal_event(TerminalKind.COMPLETED, _EE.TERMINAL_DRAINED),
    ),
    Entry(
        "peer_dead()",
        "gen",
        lambda sit: sit.pair.gens[0].peer_dead(sit.pair.ctx.our, sit.pair.now),
        {"gen-edge": _events(_EE.QUIESCENCE_PROVEN)},
        # The writer is confirmed dead: an edge it was writing, not yet proven, is now.
        lambda machine, sit: (
            _EE.QUIESCENCE_PROVEN
            if sit.installed and (sit.state is _ES.UNKNOWN or sit.state not in _TERMINAL_STATES)
            else None
        ),
    ),
    Entry(
        "receive(Reject)",
        "gen",
        lambda sit: _receive(sit, Reject(ticket=sit.ticket, reason=protocol.RejectReason.STALE)),
        {"gen-edge": _events(_EE.REJECTED)},
        _on_installed(_EE.REJECTED),
    ),
    Entry(
        "receive(Reject duplicate)",
        "gen",
        lambda sit: _receive(sit, Reject(ticket=sit.ticket, reason=protocol.RejectReason.DUPLICATE)),
        {"gen-edge": frozenset()},
        # An earlier copy of the OPEN was recorded: documented no-op.
        lambda machine, sit: None if sit.installed else REFUSED,
    ),
    # Messages only a CTX rank receives: GEN must refuse them (wrong role).
    Entry(
        "receive(Open)",
        "gen",
        lambda sit: sit.pair.gens[0].receive(_frame(_fresh_open(sit)), sit.pair.now),
        {"gen-parent": _events(_PE.EDGE_PREPARED)},
        lambda machine, sit: _PE.EDGE_PREPARED,
    ),
    Entry(
        "receive(Receipt)",
        "gen",
        lambda sit: _receive(sit, Receipt(ticket=sit.ticket, bytes_received=0)),
        {"gen-edge": _events(_EE.RECEIPT_RECEIVED)},
        lambda machine, sit: _EE.RECEIPT_RECEIVED,
    ),
]

ENTRIES = {"ctx": CTX_ENTRIES, "gen": GEN_ENTRIES}

# Events not reachable by a message or an event method: the couplings and
# effects inside the machine, and the clock (expire / peer_restarted fire them
# only where their own guards say). Their rows must still be fired, by the
# scenarios (test_every_row_is_fired).
INTERNAL_EVENTS: dict[str, dict[enum.Enum, str]] = {
    "ctx-parent": {
        _PE.ALL_PREPARED: "coupling: receive_open recorded the last expected edge",
        _PE.EDGES_SETTLED: "coupling: every edge terminal (_settle)",
        _PE.QUIESCENCE_LOST: "coupling: an edge became UNKNOWN (_settle)",
        _PE.DEFER_CANCEL: "conservative path: cancel() of a DECIDED parent (s_finishing)",
    },
    "ctx-edge": {
        _EE.CHUNK_POSTED: "effect: each PostChunk the POST effect emits",
        _EE.DRAIN_DONE: "coupling: the last posted chunk of a DRAINING edge reported",
        _EE.QUIESCENCE_LOST: "clock / restart: expire() past the drain deadline, peer_restarted()",
        _EE.QUIESCENCE_PROVEN: "coupling: the last posted chunk of an UNKNOWN edge reported",
    },
    "gen-parent": {
        _PE.EDGES_SETTLED: "coupling: every edge terminal (_settle)",
        _PE.QUIESCENCE_LOST: "coupling: an edge became UNKNOWN (_settle)",
        _PE.CONSUMER_EXPIRED: "clock: expire(now) past the consumer deadline (s_consumer_expired)",
    },
    "gen-edge": {
        _EE.QUIESCENCE_LOST: "clock / restart: expire() past the wait, peer_restarted()",
    },
}

# Events of the other role: no entry point of this role delivers them, so no row
# of this machine may name them.
NOT_AN_EVENT_OF: dict[str, frozenset[enum.Enum]] = {
    "ctx-parent": frozenset({_PE.INSTALLED, _PE.FREE, _PE.CONSUMER_EXPIRED}),
    "ctx-edge": frozenset({_EE.REJECTED}),  # a REJECT to CTX cancels the parent
    "gen-parent": frozenset({_PE.PREFILLED, _PE.DECIDED, _PE.DEFER_CANCEL, _PE.ALL_PREPARED}),
    "gen-edge": frozenset(
        {
            _EE.DECIDED,
            _EE.CHUNK_POSTED,
            _EE.CHUNK_DONE,
            _EE.ALL_CHUNKS_DONE,
            _EE.CHUNK_FAILED,
            _EE.DRAIN_DONE,
        }
    ),
}

# Rows no real call sequence can fire, with the reason. Kept honest by
# test_every_row_is_fired: a row listed here that does fire fails it too.
_ONCE = (
    "edges hear CANCEL once, with their parent's first cancel (_cancel runs only for a"
    " parent not yet cancelled), and an edge reaches this state only after that cancel"
)
_SETTLE_CANCELS_FIRST = (
    "_settle cancels an uncancelled parent before quarantining it, so QUIESCENCE_LOST"
    " always finds the parent CANCELLING"
)
_QUARANTINED_IS_CANCELLED = (
    "a quarantined parent is always cancelled (see above), so completed() sends COMPLETE_CANCELLED"
)
UNREACHABLE_ROWS: dict[tuple[str, enum.Enum, enum.Enum], str] = {
    ("ctx-edge", _ES.DRAINING, _EE.CANCEL): _ONCE,
    ("ctx-edge", _ES.DRAINED, _EE.CANCEL): _ONCE,
    ("ctx-edge", _ES.NOT_STARTED, _EE.CANCEL): _ONCE,
    ("gen-edge", _ES.CANCELLING, _EE.CANCEL): _ONCE,
    ("ctx-edge", _ES.UNKNOWN, _EE.QUIESCENCE_LOST): (
        "expire() and peer_restarted() fire it only on POSTING/DRAINING edges"
    ),
    ("gen-edge", _ES.UNKNOWN, _EE.QUIESCENCE_LOST): (
        "expire() and peer_restarted() fire it only on edges not yet terminal"
    ),
    ("ctx-parent", _PS.DECIDED, _PE.QUIESCENCE_LOST): _SETTLE_CANCELS_FIRST,
    ("gen-parent", _PS.INSTALLED, _PE.QUIESCENCE_LOST): _SETTLE_CANCELS_FIRST,
    ("ctx-parent", _PS.QUARANTINED, _PE.QUIESCENCE_LOST): "_settle ignores a quarantined parent",
    ("gen-parent", _PS.QUARANTINED, _PE.QUIESCENCE_LOST): "_settle ignores a quarantined parent",
    ("ctx-parent", _PS.QUARANTINED, _PE.COMPLETE): _QUARANTINED_IS_CANCELLED,
    ("gen-parent", _PS.QUARANTINED, _PE.COMPLETE): _QUARANTINED_IS_CANCELLED,
    ("ctx-parent", _PS.QUARANTINED, _PE.RELEASE_NOT_STARTED): (
        "release_not_started() refuses (LeaseError) a live parent whose local evidence"
        " is not NOT_STARTED, which a quarantined one never is"
    ),
    ("gen-parent", _PS.QUARANTINED, _PE.RELEASE_NOT_STARTED): (
        "release_not_started() refuses (LeaseError) a live parent whose local evidence"
        " is not NOT_STARTED, which a quarantined one never is"
    ),
    ("ctx-parent", _PS.RELEASED, _PE.COMPLETE_CANCELLED): (
        "completed() on a closed parent cannot know it was cancelled: it sends COMPLETE"
    ),
    ("gen-parent", _PS.RELEASED, _PE.COMPLETE_CANCELLED): (
        "completed() on a closed parent cannot know it was cancelled: it sends COMPLETE"
    ),
}


# ---------------------------------------------------------------------------
# Tracing the table lookups
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def traced() -> Iterator[list[tuple[str, enum.Enum, enum.Enum]]]:
    """Record every successful table lookup `_fire` makes (machine, state, event)."""
    fired: list[tuple[str, enum.Enum, enum.Enum]] = []
    # Every module that fires a table imports `_fire` by name: spy on each.
    modules = (session_module, ctx_session_module, gen_session_module, edge_roles_module)
    real = session_module._fire

    def spy(machine: str, table: Any, state: enum.Enum, event: enum.Enum) -> Any:
        tr = real(machine, table, state, event)
        fired.append((machine, state, event))
        return tr

    for module in modules:
        module._fire = spy  # type: ignore[attr-defined]
    try:
        yield fired
    finally:
        for module in modules:
            module._fire = real  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    machine: str
    state: enum.Enum
    scenario: str
    entry: Entry

    @property
    def id(self) -> str:
        return f"{self.machine}:{self.state.value}@{self.scenario}:{self.entry.name}"


def _reached() -> dict[tuple[str, str], enum.Enum]:
    """(machine, scenario) -> the subject's state there."""
    found = {}
    for name, build in SCENARIOS.items():
        pair = build()
        for machine in MACHINES:
            state = subject_state(pair, machine)
            if state is not None:
                found[(machine, name)] = state
    return found


REACHED = _reached()

CASES = [
    Case(machine, state, scenario, entry)
    for (machine, scenario), state in REACHED.items()
    for entry in ENTRIES[machine.split("-")[0]]
    if machine in entry.delivers
]


def _snapshots(pair: Pair) -> list[object]:
    return [rank.snapshot() for rank in pair.ranks()]


def run_case(case: Case) -> None:
    """Build the scenario, call the entry point, check what the table says."""
    pair = SCENARIOS[case.scenario]()
    assert subject_state(pair, case.machine) is case.state  # scenarios are deterministic
    table = MACHINES[case.machine][0]
    sit = Situation(pair, case.machine, case.state)
    expected = case.entry.event(case.machine, sit)
    allowed = case.entry.delivers[case.machine]
    assert expected in (None, REFUSED) or expected in allowed, (
        f"model of {case.entry.name} returned {expected}, not one of {sorted(map(str, allowed))}"
    )
    row = table.get((case.state, expected)) if expected not in (None, REFUSED) else None
    before = _snapshots(pair)
    with traced() as fired:
        try:
            case.entry.call(sit)
        except ProtocolError as error:
            refused: ProtocolError | None = error
        else:
            refused = None
    after_state = subject_state(pair, case.machine)
    what = f"{case.entry.name} in {case.machine} {case.state.value} (event {expected})"

    if expected is None:
        # The entry does not address the subject here: the subject is unchanged.
        assert after_state is case.state, f"{what} moved the subject to {after_state}"
        if refused is not None:
            assert _snapshots(pair) == before, f"{what} refused ({refused!r}) but changed state"
        return
    if row is None:
        # Missing from the table (or refused by contract): a typed error, no change.
        assert refused is not None, (
            f"{what}: ({case.state}, {expected}) is not a row, yet the call was accepted"
            f" (subject now {after_state})"
        )
        assert _snapshots(pair) == before, f"{what} was refused ({refused!r}) but changed state"
        return
    assert refused is None, f"{what}: the row ({case.state}, {expected}) exists, yet {refused!r}"
    if row.next is not case.state or row.effects:
        # An idempotent call may short-circuit a plain self-loop; anything else
        # must go through the table.
        assert (case.machine, case.state, expected) in fired, f"{what}: the row was never fired"
    # The subject is in the row's next state, or further along rows this call fired.
    reachable = {row.next}
    frontier = [row.next]
    while frontier:
        state = frontier.pop()
        for machine, from_state, event in fired:
            if machine == case.machine and from_state is state:
                nxt = table[(from_state, event)].next
                if nxt not in reachable:
                    reachable.add(nxt)
                    frontier.append(nxt)
    if after_state is None:
        # The subject's session closed: only a fired row of its parent that
        # released it (a reclaim after late proof, a decided release) may do that.
        parent_machine = case.machine.split("-")[0] + "-parent"
        parent_table = MACHINES[parent_machine][0]
        closed = any(
            m == parent_machine and parent_table[(st, ev)].next is _PS.RELEASED
            for m, st, ev in fired
        )
        assert closed, f"{what}: the subject vanished without a release of its parent"
        return
    assert after_state in reachable, (
        f"{what}: the row says {row.next}, the subject is {after_state}"
        f" (reachable through the fired rows: {sorted(s.value for s in reachable)})"
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_state_and_entry_point_obeys_the_table(case: Case) -> None:
    """A (state, message/event) pair in the table does what its row says; a pair
    not in it is refused with a typed error and changes nothing."""
    run_case(case)


# ---------------------------------------------------------------------------
# The generation itself cannot silently shrink
# ---------------------------------------------------------------------------


def test_every_state_a_table_names_is_reached() -> None:
    """Each state that is a source of some row is reached by a scenario."""
    missing = []
    for machine, (table, _states, _events) in MACHINES.items():
        reached = {state for (m, _s), state in REACHED.items() if m == machine}
        for state in {s for (s, _e) in table}:
            if state not in reached:
                missing.append(f"{machine}: {state}")
    assert not missing, f"no scenario reaches {missing}: add an s_* scenario that does"


def test_every_event_is_delivered_or_listed() -> None:
    """Each event is delivered by an entry point of the machine's role, or is
    internal (coupling / clock), or belongs to the other role and no row names it."""
    problems = []
    for machine, (table, _states, events) in MACHINES.items():
        delivered: set[enum.Enum] = set()
        for entry in ENTRIES[machine.split("-")[0]]:
            delivered |= entry.delivers.get(machine, frozenset())
        internal = set(INTERNAL_EVENTS[machine])
        foreign = set(NOT_AN_EVENT_OF[machine])
        for event in events:
            kinds = [event in delivered, event in internal, event in foreign]
            if sum(kinds) != 1:
                problems.append(f"{machine}: {event} delivered/internal/foreign = {kinds}")
        for state, event in table:
            if event in foreign:
                problems.append(f"{machine}: row ({state}, {event}) names another role's event")
    assert not problems, (
        "\n".join(problems)
        + "\nAn event some entry point delivers: add an Entry (the method or message, with"
        " the model of when it delivers the event) to CTX_ENTRIES / GEN_ENTRIES. An event"
        " fired by a coupling or the clock: list it in INTERNAL_EVENTS (its rows must then"
        " be fired by a scenario). Another role's event: NOT_AN_EVENT_OF."
    )


def test_every_role_gets_every_message_kind() -> None:
    """Each message kind is delivered to each role (the wrong-role kinds must be refused)."""
    kinds = {"Open", "Ready", "Cancel", "Terminal", "Receipt", "Reject"}
    for role, entries in ENTRIES.items():
        got = {m.group(1) for e in entries if (m := re.match(r"receive\((\w+)", e.name))}
        assert got == kinds, (role, got)


def test_every_row_is_fired() -> None:
    """Every row of every table is fired by some case or scenario (through the real
    API), except the rows listed, with the reason, in UNREACHABLE_ROWS."""
    with traced() as fired:
        for build in SCENARIOS.values():
            build()
    for case in CASES:
        with traced() as more, contextlib.suppress(AssertionError):
            run_case(case)
        fired += more
    seen = set(fired)
    unreached = []
    for machine, (table, _states, _events) in MACHINES.items():
        for state, event in table:
            key = (machine, state, event)
            if key not in seen and key not in UNREACHABLE_ROWS:
                unreached.append(f"{machine}: ({state}, {event})")
    assert not unreached, (
        "rows no real call fires:\n"
        + "\n".join(sorted(unreached))
        + "\nAdd a scenario (or an Entry) that reaches each, or list it in UNREACHABLE_ROWS"
        " with the reason no call sequence can fire it."
    )
    for key, why in UNREACHABLE_ROWS.items():
        machine, state, event = key
        assert (state, event) in MACHINES[machine][0], f"listed row {key} is gone: {why}"
        assert key not in seen, f"listed in UNREACHABLE_ROWS but fired (remove it): {key}"



@pytest.mark.parametrize("scenario", ["_admitted", "_prepared", "s_unknown", "s_released", "s_freed", "s_cancel_decided"])
def test_live_state_and_any_live_agree_with_the_parents_map(scenario: str) -> None:
    """`live_state` and `any_live` (what a rank asks on every poll and frame)
    say what `parents()` says, on every rank, in every state reached."""
    pair = globals()[scenario]()
    for rank in pair.ranks():
        live = rank.parents()
        assert rank.live_state(P) is live.get(P)
        assert rank.any_live() == any(s is not _PS.QUARANTINED for s in live.values())
        for state in _PS:
            assert rank.any_live([state]) == (state in live.values())
    if scenario == "s_unknown":  # a quarantined parent alone needs no fast polling
        assert all(rank.live_state(P) is _PS.QUARANTINED and not rank.any_live() for rank in pair.ranks())
    if scenario == "s_freed":
        assert all(rank.live_state(P) is None and not rank.any_live() for rank in pair.ranks())
