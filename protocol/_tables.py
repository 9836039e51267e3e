"""The session state machines as tables: the states, events and effects of
the CTX and GEN parent and edge machines, and one table per machine,
`(state, event) -> Transition(next state, effects)`, fired by `_fire` (a
missing entry raises `IllegalTransition`). The rank sessions (_session.py,
_ctx_session.py, _gen_session.py) carry the effects out; docs/state-machines.md
is rendered from these tables (`render_state_tables()`)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._errors import (
    IllegalTransition,
)
from ._messages import (
    TerminalKind,
)

__all__ = [
    "ParentState",
    "EdgeState",
    "ParentEvent",
    "EdgeEvent",
    "Effect",
    "Transition",
    "CTX_PARENT_TRANSITIONS",
    "GEN_PARENT_TRANSITIONS",
    "CTX_EDGE_TRANSITIONS",
    "GEN_EDGE_TRANSITIONS",
    "MACHINES",
    "render_state_tables",
]


# ---------------------------------------------------------------------------
# States, events, effects
# ---------------------------------------------------------------------------


class ParentState(enum.Enum):
    ADMITTED = "admitted"  # lease held; CTX: prefill running; GEN: session not installed yet
    RESIDENT = "resident"  # CTX: prefilled, KV resident under the lease deadline; collecting OPENs
    INSTALLED = "installed"  # GEN: session installed on this rank, OPEN sent on every edge
    DECIDED = "decided"  # CTX: the round decided the parent; READY published, DMA running
    FINISHING = "finishing"  # CTX, conservative path: cancelled, but the decided transfer finishes first
    CANCELLING = "cancelling"  # cancelled; edges are being brought to terminal evidence
    SETTLED = "settled"  # every local edge terminal; waiting for the completion round
    DECODE_READY = "decode_ready"  # GEN: completion round done; KV kept until free()
    RELEASED = "released"  # lease returned to the pool exactly once (absorbing)
    QUARANTINED = "quarantined"  # an edge is UNKNOWN: blocks kept until reclaim()


class EdgeState(enum.Enum):
    OPEN_PROPOSED = "open_proposed"  # GEN: OPEN sent; CTX has not answered (GEN's initial state)
    PREPARED = "prepared"  # CTX: OPEN validated and recorded; a proposal only (CTX's initial state)
    READY = "ready"  # GEN: READY received (a CTX edge goes from PREPARED to POSTING at once)
    POSTING = "posting"  # CTX: READY published and chunks posted (DMA may be in flight)
    DRAINING = "draining"  # CTX: cancelled with chunks posted; no new chunks, polling the posted
    CANCELLING = "cancelling"  # GEN: CANCEL sent; waiting for the CTX's TERMINAL
    COMPLETED = "completed"  # terminal: every byte written (and, on GEN, checked)
    NOT_STARTED = "not_started"  # terminal: no DMA was ever posted for the edge
    DRAINED = "drained"  # terminal: posted DMA polled to DONE/ERR; nothing in flight
    UNKNOWN = "unknown"  # terminal: quiescence not proven; the lease is quarantined until proof


class ParentEvent(enum.Enum):
    PREFILLED = "prefilled"  # CTX: prefill finished
    EDGE_PREPARED = "edge_prepared"  # CTX: a valid OPEN was recorded
    ALL_PREPARED = "all_prepared"  # CTX: every expected edge of the parent is PREPARED
    INSTALLED = "installed"  # GEN: installation barrier passed; send OPENs
    DECIDED = "decided"  # CTX: agreement round decided the parent
    CANCEL = "cancel"  # cancelled (client, peer, sibling, timeout, failure)
    EDGES_SETTLED = "edges_settled"  # every local edge reached terminal evidence
    COMPLETE = "complete"  # completion round, parent not cancelled
    COMPLETE_CANCELLED = "complete_cancelled"  # completion round, parent cancelled
    RELEASE_NOT_STARTED = "release_not_started"  # round verdict: every edge NOT_STARTED
    WITHDRAWN = "withdrawn"  # the admission round rejected (or timed out) our tentative lease
    DEFER_CANCEL = "defer_cancel"  # CTX, conservative path: cancel of a decided transfer
    QUIESCENCE_LOST = "quiescence_lost"  # an edge became UNKNOWN
    FREE = "free"  # GEN: the client freed the decode-ready KV
    CONSUMER_EXPIRED = "consumer_expired"  # GEN: nobody freed the decode-ready KV in time
    RECLAIM = "reclaim"  # quarantined blocks proven quiescent


class EdgeEvent(enum.Enum):
    DECIDED = "decided"  # CTX: the parent was decided
    CHUNK_POSTED = "chunk_posted"  # CTX: a PostChunk was emitted (the chunk may now be in flight)
    CHUNK_DONE = "chunk_done"  # CTX: a posted chunk reported DONE (more remain)
    ALL_CHUNKS_DONE = "all_chunks_done"  # CTX: the last chunk reported DONE
    CHUNK_FAILED = "chunk_failed"  # CTX: a posted chunk reported ERR (quiescent, incomplete)
    CANCEL = "cancel"  # the parent was cancelled
    DRAIN_DONE = "drain_done"  # CTX: no posted chunk is left in flight while draining
    QUIESCENCE_LOST = "quiescence_lost"  # drain/transfer timeout or peer restart with DMA unproven
    QUIESCENCE_PROVEN = "quiescence_proven"  # late proof: writes ended (chunks polled, writer's TERMINAL, writer dead)
    RECEIPT_RECEIVED = "receipt_received"  # CTX: GEN acknowledged the bytes
    READY_RECEIVED = "ready_received"  # GEN: READY arrived
    TERMINAL_COMPLETED = "terminal_completed"  # GEN: TERMINAL(COMPLETED) with the expected bytes
    TERMINAL_NOT_STARTED = "terminal_not_started"  # GEN: TERMINAL(NOT_STARTED) or the verdict
    TERMINAL_DRAINED = "terminal_drained"  # GEN: TERMINAL(DRAINED), or COMPLETED with wrong bytes
    TERMINAL_UNKNOWN = "terminal_unknown"  # GEN: TERMINAL(UNKNOWN)
    REJECTED = "rejected"  # GEN: CTX refused the OPEN (never recorded it)


class Effect(enum.Enum):
    SEND_READY = "send READY"  # CTX: publish READY to the GEN rank
    POST = "post chunks"  # CTX: post chunks up to the window
    SEND_TERMINAL = "send TERMINAL"  # CTX: send TERMINAL with the new state's evidence
    STOP_AND_DRAIN = "stop posting, drain"  # CTX: Drain(posted chunks); nothing more is posted
    SEND_CANCEL = "send CANCEL"  # GEN: ask the CTX rank to stop
    SEND_RECEIPT = "send RECEIPT"  # GEN: acknowledge the bytes
    SEND_OPEN = "send OPEN"  # GEN: propose every edge
    SETTLED = "report settled"  # ParentSettled for the completion round
    PREPARED = "report prepared"  # CTX: Prepared for the round that decides the parent
    RELEASE = "release lease"  # pool.release: blocks back to FREE
    QUARANTINE = "quarantine lease"  # pool.quarantine + AdmissionStop
    RECLAIM = "reclaim quarantine"  # pool.reclaim_quarantine
    DECODE_READY = "decode ready"  # GEN: the request may decode
    SKIP = "report no-op"  # cleanup already done: CleanupSkipped


@dataclass(frozen=True, slots=True)
class Transition:
    """One table entry: the next state and the effects carried out on entry."""

    next: enum.Enum
    effects: tuple[Effect, ...] = ()


_PS, _ES, _PE, _EE, _FX = ParentState, EdgeState, ParentEvent, EdgeEvent, Effect
#: Parent states in which a rank's local outcome cannot change any more.
_AT_REST = frozenset((_PS.RELEASED, _PS.QUARANTINED, _PS.DECODE_READY))
#: GEN parent states in which a CTX WRITE may be in flight toward the rank.
_WRITE_TARGET = frozenset((_PS.INSTALLED, _PS.CANCELLING, _PS.QUARANTINED))


def _t(next_state: enum.Enum, *effects: Effect) -> Transition:
    return Transition(next_state, effects)


# Terminal-state self loops shared by several rows (a quarantined parent has
# sessions, so it is never withdrawn: withdraw() refuses it first).
_CLEANUP_EVENTS = (_PE.COMPLETE, _PE.COMPLETE_CANCELLED, _PE.RELEASE_NOT_STARTED)

CTX_PARENT_TRANSITIONS: Mapping[tuple[ParentState, ParentEvent], Transition] = {
    (_PS.ADMITTED, _PE.PREFILLED): _t(_PS.RESIDENT),
    (_PS.ADMITTED, _PE.CANCEL): _t(_PS.CANCELLING),
    # Leased in our vote, but the round did not admit: nothing was exposed.
    (_PS.ADMITTED, _PE.WITHDRAWN): _t(_PS.RELEASED, _FX.RELEASE),
    (_PS.RESIDENT, _PE.EDGE_PREPARED): _t(_PS.RESIDENT),
    # Coupling: the last expected edge became PREPARED (receive_open), once.
    (_PS.RESIDENT, _PE.ALL_PREPARED): _t(_PS.RESIDENT, _FX.PREPARED),
    (_PS.RESIDENT, _PE.DECIDED): _t(_PS.DECIDED),
    (_PS.RESIDENT, _PE.CANCEL): _t(_PS.CANCELLING),
    (_PS.DECIDED, _PE.CANCEL): _t(_PS.CANCELLING),
    # Conservative path (outside the qualified scope): a decided transfer is
    # not interrupted; the cancel applies once every edge is terminal.
    (_PS.DECIDED, _PE.DEFER_CANCEL): _t(_PS.FINISHING),
    (_PS.DECIDED, _PE.EDGES_SETTLED): _t(_PS.SETTLED, _FX.SETTLED),
    (_PS.DECIDED, _PE.QUIESCENCE_LOST): _t(_PS.QUARANTINED, _FX.QUARANTINE),
    (_PS.FINISHING, _PE.CANCEL): _t(_PS.FINISHING),
    (_PS.FINISHING, _PE.DECIDED): _t(_PS.FINISHING),
    (_PS.FINISHING, _PE.EDGES_SETTLED): _t(_PS.SETTLED, _FX.SETTLED),
    (_PS.FINISHING, _PE.QUIESCENCE_LOST): _t(_PS.QUARANTINED, _FX.QUARANTINE),
    (_PS.CANCELLING, _PE.CANCEL): _t(_PS.CANCELLING),
    # A decision for a parent we already cancelled publishes nothing.
    (_PS.CANCELLING, _PE.DECIDED): _t(_PS.CANCELLING),
    (_PS.CANCELLING, _PE.EDGES_SETTLED): _t(_PS.SETTLED, _FX.SETTLED),
    (_PS.CANCELLING, _PE.QUIESCENCE_LOST): _t(_PS.QUARANTINED, _FX.QUARANTINE),
    (_PS.SETTLED, _PE.CANCEL): _t(_PS.SETTLED),
    (_PS.SETTLED, _PE.DECIDED): _t(_PS.SETTLED),
    (_PS.SETTLED, _PE.COMPLETE): _t(_PS.RELEASED, _FX.RELEASE),
    (_PS.SETTLED, _PE.COMPLETE_CANCELLED): _t(_PS.RELEASED, _FX.RELEASE),
    (_PS.SETTLED, _PE.RELEASE_NOT_STARTED): _t(_PS.RELEASED, _FX.RELEASE),
    (_PS.SETTLED, _PE.WITHDRAWN): _t(_PS.RELEASED, _FX.RELEASE),
    (_PS.RELEASED, _PE.CANCEL): _t(_PS.RELEASED),
    (_PS.RELEASED, _PE.DECIDED): _t(_PS.RELEASED),
    **{(_PS.RELEASED, e): _t(_PS.RELEASED, _FX.SKIP) for e in (*_CLEANUP_EVENTS, _PE.WITHDRAWN)},
    (_PS.QUARANTINED, _PE.CANCEL): _t(_PS.QUARANTINED),
    (_PS.QUARANTINED, _PE.DECIDED): _t(_PS.QUARANTINED),
    (_PS.QUARANTINED, _PE.QUIESCENCE_LOST): _t(_PS.QUARANTINED),
    **{(_PS.QUARANTINED, e): _t(_PS.QUARANTINED, _FX.SKIP) for e in _CLEANUP_EVENTS},
    (_PS.QUARANTINED, _PE.RECLAIM): _t(_PS.RELEASED, _FX.RECLAIM),
}

GEN_PARENT_TRANSITIONS: Mapping[tuple[ParentState, ParentEvent], Transition] = {
    (_PS.ADMITTED, _PE.INSTALLED): _t(_PS.INSTALLED, _FX.SEND_OPEN),
    (_PS.ADMITTED, _PE.CANCEL): _t(_PS.CANCELLING),
    (_PS.ADMITTED, _PE.WITHDRAWN): _t(_PS.RELEASED, _FX.RELEASE),
    (_PS.INSTALLED, _PE.CANCEL): _t(_PS.CANCELLING),
    (_PS.INSTALLED, _PE.EDGES_SETTLED): _t(_PS.SETTLED, _FX.SETTLED),
    (_PS.INSTALLED, _PE.QUIESCENCE_LOST): _t(_PS.QUARANTINED, _FX.QUARANTINE),
    (_PS.CANCELLING, _PE.CANCEL): _t(_PS.CANCELLING),
    (_PS.CANCELLING, _PE.EDGES_SETTLED): _t(_PS.SETTLED, _FX.SETTLED),
    (_PS.CANCELLING, _PE.QUIESCENCE_LOST): _t(_PS.QUARANTINED, _FX.QUARANTINE),
    # The topology-wide verdict replaces the per-edge TERMINAL messages.
    (_PS.CANCELLING, _PE.RELEASE_NOT_STARTED): _t(_PS.RELEASED, _FX.RELEASE),
    (_PS.SETTLED, _PE.CANCEL): _t(_PS.SETTLED),
    (_PS.SETTLED, _PE.COMPLETE): _t(_PS.DECODE_READY, _FX.DECODE_READY),
    (_PS.SETTLED, _PE.COMPLETE_CANCELLED): _t(_PS.RELEASED, _FX.RELEASE),
    (_PS.SETTLED, _PE.RELEASE_NOT_STARTED): _t(_PS.RELEASED, _FX.RELEASE),
    (_PS.SETTLED, _PE.WITHDRAWN): _t(_PS.RELEASED, _FX.RELEASE),
    # Once decode-ready the KV belongs to the request; only free() returns it,
    # or the consumer deadline (every edge COMPLETED: no writer is left).
    (_PS.DECODE_READY, _PE.CANCEL): _t(_PS.DECODE_READY),
    (_PS.DECODE_READY, _PE.FREE): _t(_PS.RELEASED, _FX.RELEASE),
    (_PS.DECODE_READY, _PE.CONSUMER_EXPIRED): _t(_PS.RELEASED, _FX.RELEASE),
    (_PS.RELEASED, _PE.CANCEL): _t(_PS.RELEASED),
    (_PS.RELEASED, _PE.FREE): _t(_PS.RELEASED, _FX.SKIP),
    **{(_PS.RELEASED, e): _t(_PS.RELEASED, _FX.SKIP) for e in (*_CLEANUP_EVENTS, _PE.WITHDRAWN)},
    (_PS.QUARANTINED, _PE.CANCEL): _t(_PS.QUARANTINED),
    (_PS.QUARANTINED, _PE.QUIESCENCE_LOST): _t(_PS.QUARANTINED),
    (_PS.QUARANTINED, _PE.FREE): _t(_PS.QUARANTINED, _FX.SKIP),
    **{(_PS.QUARANTINED, e): _t(_PS.QUARANTINED, _FX.SKIP) for e in _CLEANUP_EVENTS},
    (_PS.QUARANTINED, _PE.RECLAIM): _t(_PS.RELEASED, _FX.RECLAIM),
}

CTX_EDGE_TRANSITIONS: Mapping[tuple[EdgeState, EdgeEvent], Transition] = {
    # Decided: READY goes out and the first window of chunks is posted, in
    # one step (an edge always has a chunk), so a CTX edge is never READY.
    (_ES.PREPARED, _EE.DECIDED): _t(_ES.POSTING, _FX.SEND_READY, _FX.POST),
    (_ES.PREPARED, _EE.CANCEL): _t(_ES.NOT_STARTED, _FX.SEND_TERMINAL),
    (_ES.POSTING, _EE.CHUNK_POSTED): _t(_ES.POSTING),
    (_ES.POSTING, _EE.CHUNK_DONE): _t(_ES.POSTING, _FX.POST),
    (_ES.POSTING, _EE.ALL_CHUNKS_DONE): _t(_ES.COMPLETED, _FX.SEND_TERMINAL),
    # An ERR chunk is quiescent but the edge is incomplete: the caller cancels the parent.
    (_ES.POSTING, _EE.CHUNK_FAILED): _t(_ES.POSTING),
    (_ES.POSTING, _EE.CANCEL): _t(_ES.DRAINING, _FX.STOP_AND_DRAIN),
    (_ES.POSTING, _EE.QUIESCENCE_LOST): _t(_ES.UNKNOWN, _FX.SEND_TERMINAL),
    (_ES.DRAINING, _EE.CHUNK_DONE): _t(_ES.DRAINING),
    (_ES.DRAINING, _EE.CHUNK_FAILED): _t(_ES.DRAINING),
    (_ES.DRAINING, _EE.CANCEL): _t(_ES.DRAINING),
    (_ES.DRAINING, _EE.DRAIN_DONE): _t(_ES.DRAINED, _FX.SEND_TERMINAL),
    (_ES.DRAINING, _EE.QUIESCENCE_LOST): _t(_ES.UNKNOWN, _FX.SEND_TERMINAL),
    (_ES.COMPLETED, _EE.CANCEL): _t(_ES.COMPLETED),
    (_ES.COMPLETED, _EE.RECEIPT_RECEIVED): _t(_ES.COMPLETED),
    (_ES.NOT_STARTED, _EE.CANCEL): _t(_ES.NOT_STARTED),
    (_ES.DRAINED, _EE.CANCEL): _t(_ES.DRAINED),
    # UNKNOWN: one late completion proves nothing about the other chunks' writes ...
    (_ES.UNKNOWN, _EE.CANCEL): _t(_ES.UNKNOWN),
    (_ES.UNKNOWN, _EE.CHUNK_DONE): _t(_ES.UNKNOWN),
    (_ES.UNKNOWN, _EE.CHUNK_FAILED): _t(_ES.UNKNOWN),
    (_ES.UNKNOWN, _EE.QUIESCENCE_LOST): _t(_ES.UNKNOWN),
    # ... until every chunk it posted was polled to DONE/ERR: late, but proven.
    (_ES.UNKNOWN, _EE.QUIESCENCE_PROVEN): _t(_ES.DRAINED, _FX.SEND_TERMINAL),
}

_GEN_TERMINALS: Mapping[EdgeEvent, Transition] = {
    _EE.TERMINAL_COMPLETED: _t(_ES.COMPLETED, _FX.SEND_RECEIPT),
    _EE.TERMINAL_NOT_STARTED: _t(_ES.NOT_STARTED),
    _EE.TERMINAL_DRAINED: _t(_ES.DRAINED),
    _EE.TERMINAL_UNKNOWN: _t(_ES.UNKNOWN),
}

GEN_EDGE_TRANSITIONS: Mapping[tuple[EdgeState, EdgeEvent], Transition] = {
    (_ES.OPEN_PROPOSED, _EE.READY_RECEIVED): _t(_ES.READY),
    (_ES.OPEN_PROPOSED, _EE.CANCEL): _t(_ES.CANCELLING, _FX.SEND_CANCEL),
    # TERMINAL may overtake READY on the carrier: accept every kind.
    **{(_ES.OPEN_PROPOSED, e): tr for e, tr in _GEN_TERMINALS.items()},
    (_ES.OPEN_PROPOSED, _EE.REJECTED): _t(_ES.NOT_STARTED),
    (_ES.OPEN_PROPOSED, _EE.QUIESCENCE_LOST): _t(_ES.UNKNOWN),
    (_ES.READY, _EE.READY_RECEIVED): _t(_ES.READY),
    (_ES.READY, _EE.CANCEL): _t(_ES.CANCELLING, _FX.SEND_CANCEL),
    **{(_ES.READY, e): tr for e, tr in _GEN_TERMINALS.items()},
    (_ES.READY, _EE.QUIESCENCE_LOST): _t(_ES.UNKNOWN),
    (_ES.CANCELLING, _EE.READY_RECEIVED): _t(_ES.CANCELLING),
    (_ES.CANCELLING, _EE.CANCEL): _t(_ES.CANCELLING),
    **{(_ES.CANCELLING, e): tr for e, tr in _GEN_TERMINALS.items()},
    (_ES.CANCELLING, _EE.REJECTED): _t(_ES.NOT_STARTED),
    (_ES.CANCELLING, _EE.QUIESCENCE_LOST): _t(_ES.UNKNOWN),
    # Duplicates of the same evidence and late READYs change nothing.
    (_ES.COMPLETED, _EE.CANCEL): _t(_ES.COMPLETED),
    (_ES.COMPLETED, _EE.READY_RECEIVED): _t(_ES.COMPLETED),
    (_ES.COMPLETED, _EE.TERMINAL_COMPLETED): _t(_ES.COMPLETED),
    (_ES.NOT_STARTED, _EE.CANCEL): _t(_ES.NOT_STARTED),
    (_ES.NOT_STARTED, _EE.READY_RECEIVED): _t(_ES.NOT_STARTED),
    (_ES.NOT_STARTED, _EE.TERMINAL_NOT_STARTED): _t(_ES.NOT_STARTED),
    (_ES.NOT_STARTED, _EE.REJECTED): _t(_ES.NOT_STARTED),
    (_ES.DRAINED, _EE.CANCEL): _t(_ES.DRAINED),
    (_ES.DRAINED, _EE.READY_RECEIVED): _t(_ES.DRAINED),
    (_ES.DRAINED, _EE.TERMINAL_DRAINED): _t(_ES.DRAINED),
    # The writer incarnation is confirmed dead: nothing can write any more.
    **{
        (state, _EE.QUIESCENCE_PROVEN): _t(_ES.DRAINED)
        for state in (_ES.OPEN_PROPOSED, _ES.READY, _ES.CANCELLING)
    },
    # UNKNOWN is left only by proof: a non-UNKNOWN TERMINAL from the writer (it
    # is sent only once every chunk of the edge was polled to DONE/ERR; it
    # arrives as `quiescence_proven`), the writer incarnation confirmed dead,
    # or the writer's REJECT of this very OPEN: it never recorded the OPEN, so
    # it never wrote (a DUPLICATE reject, which says it did record one, never
    # gets here). Found by the explorer: a GEN edge that went UNKNOWN at its
    # deadline while its OPEN waited on a CTX whose lease ran out was
    # quarantined for good, although the CTX refused that OPEN.
    (_ES.UNKNOWN, _EE.QUIESCENCE_PROVEN): _t(_ES.DRAINED),
    (_ES.UNKNOWN, _EE.REJECTED): _t(_ES.NOT_STARTED),
    **{
        (_ES.UNKNOWN, e): _t(_ES.UNKNOWN)
        for e in (
            _EE.CANCEL,
            _EE.READY_RECEIVED,
            _EE.QUIESCENCE_LOST,
            _EE.TERMINAL_UNKNOWN,
        )
    },
}

#: Every machine by name, with its state and event types (for docs and tests).
MACHINES: Mapping[str, tuple[Mapping[Any, Transition], type[enum.Enum], type[enum.Enum]]] = {
    "ctx-parent": (CTX_PARENT_TRANSITIONS, ParentState, ParentEvent),
    "ctx-edge": (CTX_EDGE_TRANSITIONS, EdgeState, EdgeEvent),
    "gen-parent": (GEN_PARENT_TRANSITIONS, ParentState, ParentEvent),
    "gen-edge": (GEN_EDGE_TRANSITIONS, EdgeState, EdgeEvent),
}

_TERMINAL_EDGE_STATES = frozenset({_ES.COMPLETED, _ES.NOT_STARTED, _ES.DRAINED, _ES.UNKNOWN})
_EVIDENCE_OF: Mapping[EdgeState, TerminalKind] = {
    _ES.COMPLETED: TerminalKind.COMPLETED,
    _ES.NOT_STARTED: TerminalKind.NOT_STARTED,
    _ES.DRAINED: TerminalKind.DRAINED,
    _ES.UNKNOWN: TerminalKind.UNKNOWN,
}
_TERMINAL_EVENT: Mapping[TerminalKind, EdgeEvent] = {
    TerminalKind.COMPLETED: _EE.TERMINAL_COMPLETED,
    TerminalKind.NOT_STARTED: _EE.TERMINAL_NOT_STARTED,
    TerminalKind.DRAINED: _EE.TERMINAL_DRAINED,
    TerminalKind.UNKNOWN: _EE.TERMINAL_UNKNOWN,
}


def _fire(
    machine: str, table: Mapping[Any, Transition], state: enum.Enum, event: enum.Enum
) -> Transition:
    """Look up one transition; a missing entry is an IllegalTransition naming both."""
    try:
        return table[(state, event)]
    except KeyError:
        raise IllegalTransition(machine, state, event) from None


def render_state_tables() -> str:
    """Render every transition table as Markdown (docs/state-machines.md is this text)."""
    lines = [
        "# State machines",
        "",
        "<!-- Generated by kvhandoff.protocol.render_state_tables(); do not edit by hand.",
        "     tests/protocol/test_session.py fails if this file differs from the rendering. -->",
        "",
        "Every `(state, event)` pair not listed raises `IllegalTransition`.",
        "Effects are carried out, in order, on entering the next state.",
        "Initial states: CTX edge `prepared` (a valid OPEN), GEN edge `open_proposed`,",
        "both parents `admitted`. Absorbing: `released`. Edge `unknown` and parent",
        "`quarantined` are left only with a proof of quiescence (`quiescence_proven`, `reclaim`).",
        "In pull the edge roles swap: a GEN rank's pull edges run the CTX edge table (it posts",
        "and polls the READ), a CTX rank's the GEN edge table (it waits for the reader's word);",
        "a lent CTX edge starts in `open_proposed`, a reading GEN edge in `prepared`.",
        "",
        "## States",
        "",
        "| state | meaning |",
        "| --- | --- |",
    ]
    for doc_enum in (ParentState, EdgeState):
        for member in doc_enum:
            lines.append(f"| {doc_enum.__name__}.`{member.value}` | {_member_comment(member)} |")
    for name, (table, _states, _events) in MACHINES.items():
        lines += [
            "",
            f"## {name}",
            "",
            "| state | event | next state | effects |",
            "| --- | --- | --- | --- |",
        ]
        for (state, event), tr in table.items():
            effects = ", ".join(e.value for e in tr.effects) or "-"
            lines.append(f"| `{state.value}` | `{event.value}` | `{tr.next.value}` | {effects} |")
    lines.append("")
    return "\n".join(lines)


def _member_comment(member: enum.Enum) -> str:
    # The one-line comments of the enums above, kept here so the docs read the same.
    return _STATE_DOCS[member]


_STATE_DOCS: Mapping[enum.Enum, str] = {
    _PS.ADMITTED: "lease held; CTX: prefill running; GEN: session not installed yet",
    _PS.RESIDENT: "CTX: prefilled, KV resident under the lease deadline; collecting OPENs",
    _PS.INSTALLED: "GEN: session installed on this rank, OPEN sent on every edge",
    _PS.DECIDED: "CTX: the round decided the parent; READY published, DMA running",
    _PS.FINISHING: "CTX, conservative path: cancelled, but the decided transfer finishes first",
    _PS.CANCELLING: "cancelled; edges are being brought to terminal evidence",
    _PS.SETTLED: "every local edge terminal; waiting for the completion round",
    _PS.DECODE_READY: "GEN: completion round done; KV kept until free()",
    _PS.RELEASED: "lease returned to the pool exactly once (absorbing)",
    _PS.QUARANTINED: "an edge is UNKNOWN: blocks kept until reclaim()",
    _ES.OPEN_PROPOSED: "GEN: OPEN sent; CTX has not answered (GEN's initial state)",
    _ES.PREPARED: "CTX: OPEN validated and recorded; a proposal only (CTX's initial state)",
    _ES.READY: "GEN: READY received (a CTX edge goes from PREPARED to POSTING at once)",
    _ES.POSTING: "CTX: READY published and chunks posted (DMA may be in flight)",
    _ES.DRAINING: "CTX: cancelled with chunks posted; no new chunks, polling the posted",
    _ES.CANCELLING: "GEN: CANCEL sent; waiting for the CTX's TERMINAL",
    _ES.COMPLETED: "terminal: every byte written (and, on GEN, checked)",
    _ES.NOT_STARTED: "terminal: no DMA was ever posted for the edge",
    _ES.DRAINED: "terminal: posted DMA polled to DONE/ERR; nothing in flight",
    _ES.UNKNOWN: "terminal: quiescence not proven; the lease is quarantined until proof",
}

