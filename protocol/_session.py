"""Session state machines for the CTX and GEN sides of a handoff.

Theory of operation
-------------------
This file holds every rule that decides what a rank may do with its KV blocks
(docs/design.md "Lifecycle", "Cancellation", "Slots, leases, ownership"). It is
sans-IO in the h11 sense: events go in (method calls, received messages, the
current time `now` as an argument), typed actions come out; nothing here sends,
polls, sleeps or reads a clock.

There are four machines, each an explicit module-level table
`(state, event) -> Transition(next state, effects)` fired by one `_fire()` that
raises `IllegalTransition` for a missing entry:

* CTX parent / CTX edge (prefill side: sources of the DMA, writer);
* GEN parent / GEN edge (decode side: destinations of the DMA).

A *parent* is one request attempt on one rank: it owns the rank's lease. An
*edge* is one ctx rank -> gen rank session of that parent, named by an exact
`ContextTicket` in a default-deny registry (_registry.py). The `effects` of a
transition are carried out by this module right after the state changes
(send a message, post chunks, release, quarantine ...), so the table is the
behaviour, and docs/state-machines.md is rendered from it
(`render_state_tables()`; a test compares the file with the rendering).

Safety (docs/design.md "Invariants"):

* S1 - a block is released only through a RELEASE effect, and RELEASE is only
  reachable once every edge of the parent is terminal with quiescence proven
  (COMPLETED, NOT_STARTED, DRAINED) and the matching agreement round has run,
  or through the topology-wide NOT_STARTED verdict (which the runtime does
  not use: each rank's own evidence suffices, docs/design.md "Who may free
  memory"). UNKNOWN quarantines.
* S3 - every received message is looked up by exact ticket first; a stale or
  unknown ticket raises before anything changes. Validation of an OPEN is
  complete before the edge is recorded.
* S4 - the pool (_pool.py) is the only place that moves blocks.
* Cleanup-once - the parent machine reaches RELEASED/QUARANTINED once; later
  cleanup events there are reported no-ops (`CleanupSkipped`).

Cancellation (docs/design.md "Cancellation") is parent-scoped: cancelling through
any edge cancels the parent, which fires CANCEL on every sibling edge. On CTX a
cancelled edge with nothing posted becomes NOT_STARTED at once (we are the only
writer from our blocks and we will never post); an edge with chunks posted
stops posting and drains (DRAINING -> DRAINED once every posted chunk reported
DONE or ERR), or becomes UNKNOWN if the drain deadline passes or the peer's
epoch changes with chunks in flight. On GEN a cancelled edge sends CANCEL and
waits for the CTX's TERMINAL; it never frees blocks that an OPEN exposed
before that evidence, unless the agreement layer hands down the topology-wide
verdict that every edge is NOT_STARTED (`release_not_started`). Timeouts
(`expire(now)`) only produce intents and the transitions the table allows: a
lease deadline releases only a parent that provably never exposed or posted
anything; everything else becomes a cancel intent, and an unprovable drain
becomes UNKNOWN (quarantine + `AdmissionStop`). The success path needs no
extra message or round: OPEN, READY, chunks, TERMINAL, RECEIPT, completion.

API for the actors layer
------------------------
One `CtxRank` or `GenRank` per rank actor, built with the actor's `Endpoint`,
its topology digest and its `BlockPool`. Every method returns `list[Action]`
(or the lease for `admit`) that the actor performs in order; the protocol has
already updated the pool when it returns `Release`/`Quarantine`. Bad input
raises a `ProtocolError` subclass and changes nothing; for a bad OPEN the actor
answers with `reject_for(open, error)`.

CTX rank (prefill)::

    ctx = CtxRank(our, digest, pool, edges_per_parent=n)  # n: this rank's edges per request
    refs = ctx.admit(parent, n_blocks, now=now, lease_deadline=t)  # after admission round
    ctx.prefilled(parent)                          # KV resident, waiting for OPENs
    ctx.receive_open(open, now, num_chunks=k,      # edge PREPARED (a proposal only); the
                     expected_agent=a,             #   OPEN is checked against the lease and
                     block_bytes=b, peer=buf)      #   the GEN agent's buffer (PeerBuffer)
        # -> Prepared(parent) once, when the n-th edge is PREPARED: vote it prepared
    ctx.decided(parent, now)                       # after the CTX round decided the parent
        # -> per edge: SendMessage(Ready), then PostChunk(ticket, i) up to the window
    ctx.chunk_done(ticket, i, nbytes, now)         # -> more PostChunk, or Terminal(COMPLETED)
    ctx.chunk_failed(ticket, i, now)               # NIXL ERR: quiescent, cancels the parent
    ctx.receive_receipt(receipt)                   # bytes acknowledged
    ctx.completed(parent)                          # after the CTX completion round -> Release
    ctx.receive(message, now)                      # dispatch for any received SessionMessage

GEN rank (decode)::

    refs = gen.admit(parent, n_blocks, now=now)    # after admission round
    gen.install(parent, [GenEdgeSpec(...)], now)   # the actor builds BufferInfo from refs
        # -> SendMessage(Open) per edge
    gen.receive_ready / receive_terminal / receive_reject / receive_cancel
        # Terminal(COMPLETED, bytes == expected) -> SendMessage(Receipt)
    # every edge terminal -> ParentSettled(parent, evidence): feed the GEN completion round
    gen.completed(parent, now)                     # -> DecodeReady (lease kept until the
                                                   #    consumer deadline) or Release
    gen.free(parent)                               # client done with the KV -> Release, once

Both sides::

    cancel(parent, reason, now, from_round=False)  # idempotent; from_round=True when the
        # agreement round applies a decided cancel (then no CancelIntent is echoed)
    receive_cancel(cancel, now)                    # exact installed ticket only
    expire(now)                                    # deadlines -> intents / quarantine
    peer_restarted(their_endpoint, now)            # a peer came back with a new epoch
    peer_dead(dead_endpoint, now)                  # a peer incarnation is confirmed dead
    withdraw(parent)                               # admission not decided: tentative lease back
    local_not_started(parent) -> bool              # this rank's share of the NOT_STARTED verdict
    release_not_started(parent)                    # the round's topology-wide verdict
    reclaim(parent, proof=...)                     # quarantine -> free, with proof of quiescence

Quarantine ends with proof, in place: an UNKNOWN edge becomes DRAINED when
the proof arrives (CTX: every chunk it posted polled to DONE/ERR; GEN: a
non-UNKNOWN TERMINAL from the writer, its REJECT of the OPEN, or `peer_dead`
for the writer), and a quarantined parent with no UNKNOWN edge left is
reclaimed. A GEN rank asks the writer of an UNKNOWN edge for its proof
(`expire` re-sends the OPEN, `UNKNOWN_ASKS` times, backing off); the writer
answers with `open_again` (its TERMINAL again) or, holding no such session,
refuses the OPEN.

`Prepared` (CTX: every edge of the parent prepared), `ParentSettled` (every
local edge terminal) and `CancelIntent` are what the actor feeds into the next
agreement round; `AdmissionStop` asks the coordinator to stop admitting and
run the restart policy. `Release`, `Quarantine` and `DecodeReady` carry the
parent's `LocalOutcome` on this rank (what the client's `wait` reports).
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from ._errors import (
    AdmissionRefused,
    IllegalTransition,
    LeaseError,
    NegotiationError,
    NoCapacity,
    PoolError,
    ProtocolError,
    StaleError,
    UnknownSessionError,
)
from ._messages import (
    BlockColumns,
    BufferInfo,
    Cancel,
    CancelReason,
    Open,
    Ready,
    Receipt,
    Reject,
    RejectReason,
    SessionMessage,
    Terminal,
    TerminalKind,
    block_columns,
)
from ._pool import BlockPool, BlockRef, BlockRefs
from ._registry import DuplicateSessionError, SessionRegistry, check_descriptors
from ._ticket import ContextTicket, Endpoint, ParentKey, RankNamespace, Role

__all__ = [
    "ADMISSION_REFUSALS",
    "whole_block_misfits",
    "ParentState",
    "EdgeState",
    "ParentEvent",
    "EdgeEvent",
    "Effect",
    "Transition",
    "CTX_PARENT_TRANSITIONS",
    "CTX_EDGE_TRANSITIONS",
    "GEN_PARENT_TRANSITIONS",
    "GEN_EDGE_TRANSITIONS",
    "MACHINES",
    "render_state_tables",
    "SendMessage",
    "PostChunk",
    "Drain",
    "Release",
    "Quarantine",
    "AdmissionStop",
    "CancelIntent",
    "ParentSettled",
    "DecodeReady",
    "CleanupSkipped",
    "CancelDeferred",
    "Prepared",
    "Action",
    "LocalOutcome",
    "PeerBuffer",
    "EdgeEvidence",
    "GenEdgeSpec",
    "CtxRank",
    "GenRank",
    "reject_for",
    "DEFAULT_TRANSFER_TIMEOUT",
    "DEFAULT_CHUNK_WINDOW",
    "DEFAULT_QUARANTINE_LIMIT",
    "UNKNOWN_ASKS",
]

#: Seconds a decided transfer, a drain or a GEN wait may take before escalation.
DEFAULT_TRANSFER_TIMEOUT = 30.0
#: Most chunks of one edge posted and not yet DONE/ERR at a time.
DEFAULT_CHUNK_WINDOW = 4
#: Share of a rank's pool in quarantine at which it stops admitting.
DEFAULT_QUARANTINE_LIMIT = 0.5
# How many released parents a rank remembers (cleanup-once reporting, stale
# classification of late calls).
_CLOSED_PARENT_MEMORY = 4096
#: How many times a GEN rank asks the writer of an UNKNOWN edge again (its
#: OPEN re-sent, `GenRank.expire`), a transfer timeout apart and doubling,
#: before it leaves the quarantine to the writer's death or a restart.
UNKNOWN_ASKS = 4
#: How many CTX ranks' confirmed deaths a GEN rank remembers (`GenRank.peer_dead`):
#: one entry per CTX rank namespace (a fleet's instance incarnation and rank).
MAX_DEAD_WRITERS = 4096


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


# ---------------------------------------------------------------------------
# Outcomes, peer buffers, actions
# ---------------------------------------------------------------------------


class LocalOutcome(str, enum.Enum):
    """How a parent ended on one rank (what the rank's client `wait` reports).

    str-valued: it compares, hashes and encodes as its value, so callers that
    compare with the plain strings keep working."""

    COMPLETED = "completed"  # GEN: every byte arrived and was checked (decode-ready)
    CANCELLED = "cancelled"  # cancelled (client, peer, timeout, round) before completion
    REJECTED = "rejected"  # the admission round did not admit it; the tentative lease returned
    FAILED = "failed"  # the rank found the request broken (e.g. bytes that do not verify)
    RELEASED = "released"  # CTX: the transfer completed and the completion round released it
    QUARANTINED = "quarantined"  # quiescence not proven: its blocks were quarantined

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True, slots=True)
class PeerBuffer:
    """A GEN rank's registered buffer, as plain data (its NIXL agent, where block 0
    starts, the block size, how many blocks, the block stride): every block
    descriptor of an OPEN naming `agent_name` must be a whole block of it
    (`CtxRank.receive_open`): `addr == base + block * block_stride`, `length ==
    block_bytes`."""

    agent_name: str
    base: int
    block_bytes: int
    num_blocks: int
    #: Distance between two blocks' addresses (region 0 of a GEN whose KV is in
    #: several regions: topology/_memory.py); None: `block_bytes`.
    block_stride: int | None = None


@dataclass(frozen=True, slots=True)
class SendMessage:
    """Send `message` (encoded with encode_frame) to the rank actor `to`."""

    to: Endpoint
    message: SessionMessage


@dataclass(frozen=True, slots=True)
class PostChunk:
    """CTX: post NIXL WRITE chunk `index` of the edge; report chunk_done/chunk_failed."""

    ticket: ContextTicket
    index: int


@dataclass(frozen=True, slots=True)
class Drain:
    """CTX: keep polling the posted chunks `in_flight` and report each; call
    `expire(now)` after `deadline` (the edge becomes UNKNOWN if any is left)."""

    ticket: ContextTicket
    in_flight: tuple[int, ...]
    deadline: float


@dataclass(frozen=True, slots=True)
class Release:
    """The pool already returned these blocks to FREE: they may be reused.
    `reclaimed`: they come back from quarantine, on a proof of quiescence."""

    parent: ParentKey
    blocks: BlockRefs
    reclaimed: bool = False
    outcome: LocalOutcome = LocalOutcome.RELEASED


@dataclass(frozen=True, slots=True)
class Quarantine:
    """The pool already quarantined these blocks: keep them, never reuse them."""

    parent: ParentKey
    blocks: BlockRefs
    reason: str
    outcome: LocalOutcome = LocalOutcome.QUARANTINED


@dataclass(frozen=True, slots=True)
class AdmissionStop:
    """Ask the coordinator to stop admission and run the fail/restart policy."""

    parent: ParentKey
    reason: str


@dataclass(frozen=True, slots=True)
class CancelIntent:
    """Feed a cancel of `parent` into the next agreement round (siblings on other ranks)."""

    parent: ParentKey
    reason: CancelReason


@dataclass(frozen=True, slots=True)
class ParentSettled:
    """Every edge of `parent` on this rank is terminal: feed the completion round."""

    parent: ParentKey
    cancelled: bool
    evidence: tuple[tuple[ContextTicket, TerminalKind], ...]


@dataclass(frozen=True, slots=True)
class DecodeReady:
    """GEN: every byte arrived and was checked; the request may decode."""

    parent: ParentKey
    outcome: LocalOutcome = LocalOutcome.COMPLETED


@dataclass(frozen=True, slots=True)
class CleanupSkipped:
    """A cleanup event hit a parent already released or quarantined: nothing was freed."""

    parent: ParentKey
    state: ParentState
    event: ParentEvent


@dataclass(frozen=True, slots=True)
class CancelDeferred:
    """CTX, conservative path: the cancel of `parent` waits for its decided
    transfer to finish (or to reach its deadline) before it applies."""

    parent: ParentKey


@dataclass(frozen=True, slots=True)
class Prepared:
    """CTX: every expected edge of `parent` on this rank is PREPARED (emitted once,
    never after a cancel): report it prepared to the round that decides it. An
    actor that performs it only after an await checks `CtxRank.is_prepared` first."""

    parent: ParentKey


Action = Union[
    SendMessage,
    PostChunk,
    Drain,
    Release,
    Quarantine,
    AdmissionStop,
    CancelIntent,
    ParentSettled,
    DecodeReady,
    CleanupSkipped,
    CancelDeferred,
    Prepared,
]


#: The local outcome a RELEASE (or RECLAIM) reports, by the event that fired it.
_RELEASE_OUTCOME: Mapping[ParentEvent, LocalOutcome] = {
    ParentEvent.WITHDRAWN: LocalOutcome.REJECTED,
    ParentEvent.COMPLETE: LocalOutcome.RELEASED,
    ParentEvent.COMPLETE_CANCELLED: LocalOutcome.CANCELLED,
    ParentEvent.RELEASE_NOT_STARTED: LocalOutcome.CANCELLED,
    ParentEvent.FREE: LocalOutcome.COMPLETED,
    ParentEvent.CONSUMER_EXPIRED: LocalOutcome.COMPLETED,
    ParentEvent.RECLAIM: LocalOutcome.QUARANTINED,
}


@dataclass(frozen=True, slots=True)
class EdgeEvidence:
    """What this rank has proven about one edge (docs/design.md vocabulary "evidence")."""

    state: EdgeState
    posted: int
    in_flight: tuple[int, ...]
    chunks_done: int
    bytes_done: int
    terminal: TerminalKind | None


@dataclass(frozen=True, slots=True)
class GenEdgeSpec:
    """What the GEN actor knows about one edge before it sends OPEN.

    The actor builds `buffer` from the lease's BlockRefs (addresses are its
    business); the protocol checks that every descriptor names a current block
    of this parent's lease. `expected_bytes` is what TERMINAL(COMPLETED) must say.
    """

    ticket: ContextTicket
    buffer: BufferInfo
    num_tokens: int
    expected_bytes: int


#: The REJECT reasons by which a CTX rank that admits at the OPEN refused to
#: admit the parent (it holds nothing of it): the handoff is "rejected", as
#: when an admission round refuses it, not cancelled.
ADMISSION_REFUSALS = frozenset({RejectReason.NO_CAPACITY, RejectReason.ADMISSION_STOPPED})


def reject_for(open_msg: Open, error: ProtocolError, our: Endpoint) -> Reject | None:
    """The REJECT a CTX actor (endpoint `our`) answers to an OPEN that `receive_open`
    refused, or None when the refusal must stay silent.

    A GEN rank treats a REJECT whose ticket matches its session exactly as
    NOT_STARTED evidence and cancels the request. So only an OPEN addressed to
    *us* (our exact endpoint) is answered, with its own ticket unchanged. An
    OPEN naming another CTX endpoint (a stale epoch, another instance, a
    restarted incarnation) is dropped: answering it with our endpoint would
    forge a ticket that a live session accepts (S3), and answering with its
    own ticket would speak for an incarnation that is not us. Its sender
    learns the outcome from its own timeout or the restart notice.

    A `NegotiationError` (the rank has no agreed protocol: `_negotiation.py`)
    is answered with reason NEGOTIATION, before anything is recorded or posted.
    """
    if isinstance(error, DuplicateSessionError):
        reason = RejectReason.DUPLICATE
    elif isinstance(error, UnknownSessionError):
        reason = RejectReason.UNKNOWN_SESSION
    elif isinstance(error, NoCapacity):
        reason = RejectReason.NO_CAPACITY  # too few free blocks: admitted nothing
    elif isinstance(error, AdmissionRefused):
        reason = RejectReason.ADMISSION_STOPPED  # admitted nothing, checked nothing else
    elif isinstance(error, PoolError):
        reason = RejectReason.BAD_BUFFER_INFO
    elif isinstance(error, NegotiationError):
        reason = RejectReason.NEGOTIATION  # no agreed protocol: refused before any DMA
    else:
        reason = RejectReason.STALE
    if open_msg.ticket.ctx != our:
        return None
    return Reject(ticket=open_msg.ticket, reason=reason, detail=str(error)[:200])


# ---------------------------------------------------------------------------
# Per-rank records
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Edge:
    ticket: ContextTicket
    state: EdgeState
    open: Open
    num_chunks: int = 1  # CTX: chunks of this edge
    expected_bytes: int = 0  # GEN: what COMPLETED must report
    next_index: int = 0  # CTX: next chunk to post
    in_flight: set[int] = field(default_factory=set)  # CTX: posted, not DONE/ERR
    #: CTX: indices in `in_flight` that ended in ERR with several descriptors
    #: (ended at the initiator, their other writes unproven).
    unproven: set[int] = field(default_factory=set)
    chunks_done: int = 0
    bytes_done: int = 0
    failed: bool = False  # CTX: a chunk reported ERR
    deadline: float | None = None  # drain (CTX) / cancel wait (GEN)
    receipt_bytes: int | None = None  # CTX: what GEN acknowledged
    asks: int = 0  # GEN: times the writer of this UNKNOWN edge was asked again

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Every field, positionally (cheaper than copyreg's slot dict: the
        # explorer copies whole ranks at every step).
        return (_Edge, tuple(getattr(self, name) for name in self.__slots__))

    def evidence(self) -> EdgeEvidence:
        return EdgeEvidence(
            state=self.state,
            posted=self.next_index,
            in_flight=tuple(sorted(self.in_flight)),
            chunks_done=self.chunks_done,
            bytes_done=self.bytes_done,
            terminal=_EVIDENCE_OF.get(self.state),
        )


@dataclass(slots=True)
class _Parent:
    key: ParentKey
    state: ParentState
    refs: BlockRefs
    lease_deadline: float | None
    edges: dict[ContextTicket, _Edge] = field(default_factory=dict)
    deadline: float | None = None  # CTX: transfer deadline after DECIDED; GEN: after INSTALLED
    cancel_reason: CancelReason | None = None
    # The agreement round decided this parent cancelled (or failed): no
    # completion round will ever come, so the rank releases it itself as soon
    # as every edge is terminal (SETTLED), i.e. as soon as nothing can write.
    cancel_decided: bool = False
    # CTX: how many edges (GEN ranks) this parent has here; it depends on the
    # GEN instance the parent pairs with (a fleet mixes TPs). 0: the rank's default.
    expected_edges: int = 0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_Parent, tuple(getattr(self, name) for name in self.__slots__))  # as `_Edge`


class _Rank:
    """What both sides share: pool, registry, parent records, the firing of effects."""

    _role: Role
    _parent_table: Mapping[tuple[ParentState, ParentEvent], Transition]
    _edge_table: Mapping[tuple[EdgeState, EdgeEvent], Transition]

    def __init__(
        self,
        our: Endpoint,
        digest: bytes,
        pool: BlockPool,
        *,
        transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
        consume_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
        quarantine_limit: float = DEFAULT_QUARANTINE_LIMIT,
    ) -> None:
        if our.ns.role is not self._role:
            raise LeaseError(
                f"{type(self).__name__} needs a {self._role.value} endpoint, got {our.ns.role.value}"
            )
        if not transfer_timeout > 0:
            # docs/design.md "Qualified scope": a positive transfer timeout is required.
            raise LeaseError(f"transfer_timeout must be positive, got {transfer_timeout}")
        self.our = our
        self.digest = digest
        self.pool = pool
        if not consume_timeout > 0:
            raise LeaseError(f"consume_timeout must be positive, got {consume_timeout}")
        if not 0 < quarantine_limit <= 1:
            raise LeaseError(f"quarantine_limit must be in (0, 1], got {quarantine_limit}")
        self.quarantine_limit = quarantine_limit
        self.transfer_timeout = transfer_timeout
        self.consume_timeout = consume_timeout
        self._parents: dict[ParentKey, _Parent] = {}
        self._closed_parents: collections.OrderedDict[ParentKey, ParentState] = (
            collections.OrderedDict()
        )
        self._sessions: SessionRegistry[_Edge] = SessionRegistry()

    # ---- queries -------------------------------------------------------

    def parent_state(self, parent: ParentKey) -> ParentState:
        """The parent's state (RELEASED for a recently released one)."""
        record = self._parents.get(parent)
        if record is not None:
            return record.state
        if parent in self._closed_parents:
            return self._closed_parents[parent]
        raise self._unknown_parent(parent)

    def was_released(self, parent: ParentKey) -> bool:
        """Whether `parent` is no longer live here because it was released
        (remembered as RELEASED among the recently closed)."""
        return parent not in self._parents and self._closed_parents.get(parent) is _PS.RELEASED

    def parents(self) -> dict[ParentKey, ParentState]:
        """Every live (not yet released) parent and its state."""
        return {key: record.state for key, record in self._parents.items()}

    def live_state(self, parent: ParentKey) -> ParentState | None:
        """The state of live parent `parent`, None if it is not live (never
        admitted here, or released): `parents().get(parent)` without
        building the whole map (a rank asks on every poll and frame)."""
        record = self._parents.get(parent)
        return record.state if record is not None else None

    def any_live(self, states: Collection[ParentState] | None = None) -> bool:
        """Whether a live parent is in one of `states` (None: in any state but
        QUARANTINED), without building `parents()`."""
        if states is None:
            return any(record.state is not ParentState.QUARANTINED for record in self._parents.values())
        return any(record.state in states for record in self._parents.values())

    def edges(self, parent: ParentKey) -> dict[ContextTicket, EdgeEvidence]:
        record = self._parents.get(parent)
        if record is None:
            return {}
        return {t: e.evidence() for t, e in record.edges.items()}

    def evidence(self, ticket: ContextTicket) -> EdgeEvidence:
        return self._sessions.get(ticket).evidence()

    def session_open(self, ticket: ContextTicket) -> Open:
        """The OPEN recorded for an installed session (its GEN block descriptors)."""
        return self._sessions.get(ticket).open

    def lease(self, parent: ParentKey) -> BlockRefs:
        return self._require(parent).refs

    def admission_stopped(self) -> bool:
        """Quarantine holds `quarantine_limit` of the pool or more: admit nothing
        until a restart gives this rank a fresh pool (the bounded admission stop
        of docs/design.md "Quarantine and reclaim")."""
        return self.pool.counts().quarantined >= self.quarantine_limit * self.pool.num_blocks

    def wants_restart(self) -> bool:
        """Admission is stopped and nothing but quarantined requests is left:
        only a new incarnation (a fresh pool) brings the capacity back."""
        return self.admission_stopped() and all(
            record.state is _PS.QUARANTINED for record in self._parents.values()
        )

    def is_live(self, parent: ParentKey) -> bool:
        """Whether `parent` is live here (admitted and not yet released)."""
        return parent in self._parents

    def is_admitted(self, parent: ParentKey) -> bool:
        """Whether `parent` is live and ADMITTED: leased (by our vote, or an
        applied admission) and nothing else has happened to it yet. A GEN
        opens only such a parent (one cancelled meanwhile opens nothing);
        frames for such a parent may wait for its admission to apply."""
        record = self._parents.get(parent)
        return record is not None and record.state is _PS.ADMITTED

    def at_rest(self, parent: ParentKey) -> bool:
        """Whether `parent`'s local outcome can no longer change here: it is
        not live, or live only as RELEASED, QUARANTINED or DECODE_READY."""
        record = self._parents.get(parent)
        return record is None or record.state in _AT_REST

    def quarantined_parents(self) -> list[ParentKey]:
        """The live parents whose blocks are quarantined here."""
        return [key for key, record in self._parents.items() if record.state is _PS.QUARANTINED]

    def phase(self, parent: ParentKey) -> dict[str, Any] | None:
        """`parent`'s state and its edges' (for tests, the demo and traces),
        None if it is not live."""
        record = self._parents.get(parent)
        if record is None:
            return None
        edges = [e.evidence() for e in record.edges.values()]
        return {
            "state": record.state.value,
            "edges": sorted(e.state.value for e in edges),
            "posted": sum(e.posted for e in edges),
            "in_flight": sum(len(e.in_flight) for e in edges),
        }

    def may_post(self, ticket: ContextTicket) -> bool:
        """Whether a chunk of `ticket`'s edge may start now: the edge is
        POSTING (False for an edge that stopped posting, ended, or is not
        known here). The staged data plane asks before it starts a queued
        chunk; one it may not start is reported failed, unposted."""
        edge = self._sessions.find(ticket)
        return edge is not None and edge.state is _ES.POSTING

    def is_cancelled(self, parent: ParentKey) -> bool:
        record = self._parents.get(parent)
        return record is not None and record.cancel_reason is not None

    def local_not_started(self, parent: ParentKey) -> bool:
        """This rank's share of the topology-wide NOT_STARTED verdict.

        CTX: the parent is cancelled and every local edge is NOT_STARTED (we are
        the only writer from our blocks, and a cancelled parent never posts).
        GEN: the parent is cancelled and no edge has contrary evidence
        (COMPLETED, DRAINED, UNKNOWN); the CTX ranks hold the real proof.
        """
        record = self._parents.get(parent)
        if record is None or record.cancel_reason is None:
            return False
        if record.state not in (_PS.CANCELLING, _PS.SETTLED):
            return False
        allowed = (
            {_ES.NOT_STARTED}
            if self._role is Role.CTX
            else {_ES.NOT_STARTED, _ES.OPEN_PROPOSED, _ES.READY, _ES.CANCELLING}
        )
        return all(e.state in allowed for e in record.edges.values())

    def snapshot(self) -> tuple[object, ...]:
        """A comparable picture of everything this rank holds (for S3 tests)."""
        pool_view = tuple(
            (self.pool.state_of(b), self.pool.generation_of(b)) for b in range(self.pool.num_blocks)
        )
        parent_view = tuple(
            sorted(
                (
                    repr(key),
                    record.state,
                    record.cancel_reason,
                    record.deadline,
                    tuple(
                        sorted(
                            (repr(t), e.evidence(), e.deadline, e.receipt_bytes, e.asks)
                            for t, e in record.edges.items()
                        )
                    ),
                )
                for key, record in self._parents.items()
            )
        )
        return (pool_view, parent_view, tuple(self._closed_parents.items()))

    # ---- shared events -------------------------------------------------

    def cancel(
        self, parent: ParentKey, reason: CancelReason, now: float, *, from_round: bool = False
    ) -> list[Action]:
        """Cancel `parent` on this rank (idempotent).

        Parent-scoped: every edge gets CANCEL. Returns the peer messages, drain
        orders and (unless `from_round`) a CancelIntent for the next round.
        """
        state = self.parent_state(parent)
        _fire(self._machine("parent"), self._parent_table, state, _PE.CANCEL)  # validate only
        record = self._parents.get(parent)
        if record is None or state in (_PS.DECODE_READY, _PS.QUARANTINED):
            return []  # idempotent: released or past the handoff
        actions: list[Action] = []
        if record.cancel_reason is None:
            actions += self._cancel(record, reason, now, intent=not from_round)
        if from_round:
            # A decided cancel can find the parent already SETTLED (its transfer
            # finished and its completion was reported, but the cancel won the
            # round): without this it would wait forever for a completion round.
            record.cancel_decided = True
            actions += self._release_if_decided(record)
        return actions

    def _release_if_decided(self, record: _Parent) -> list[Action]:
        if record.cancel_decided and record.state is _PS.SETTLED:
            return self._fire_parent(record.key, _PE.COMPLETE_CANCELLED)
        return []

    def receive_cancel(self, message: Cancel, now: float) -> list[Action]:
        """A peer's CANCEL for an exact installed session: cancel the parent."""
        edge = self._sessions.get(message.ticket)
        record = self._parents[edge.ticket.parent]
        if record.cancel_reason is not None or record.state in (_PS.DECODE_READY, _PS.QUARANTINED):
            return []
        return self._cancel(record, CancelReason.PEER, now, intent=True)

    def completed(self, parent: ParentKey, now: float | None = None) -> list[Action]:
        """The completion round decided `parent`: release (CTX) or decode-ready (GEN).

        GEN: with `now`, a decode-ready parent gets the consumer deadline
        (`now + consume_timeout`): past it, `expire` returns the KV (L1)."""
        record = self._parents.get(parent)
        cancelled = record is not None and record.cancel_reason is not None
        event = _PE.COMPLETE_CANCELLED if cancelled else _PE.COMPLETE
        actions = self._fire_parent(parent, event)
        if record is not None and record.state is _PS.DECODE_READY:
            record.deadline = None if now is None else now + self.consume_timeout
        return actions

    def withdraw(self, parent: ParentKey) -> list[Action]:
        """The admission round did not admit `parent` (another rank refused, or
        the round timed out), but we leased for it in our vote: return the
        tentative lease. Nothing was exposed (no OPEN was ever recorded for
        it), so this needs no further proof; an edge would contradict that and
        raises `LeaseError` with nothing changed."""
        record = self._parents.get(parent)
        if record is not None and record.edges:
            raise LeaseError(f"withdrawal of {parent!r}, which already has sessions")
        return self._fire_parent(parent, _PE.WITHDRAWN)

    def release_not_started(self, parent: ParentKey) -> list[Action]:
        """Apply the round's verdict that every edge of `parent` is NOT_STARTED topology-wide."""
        record = self._parents.get(parent)
        if record is not None and not self.local_not_started(parent):
            raise LeaseError(f"NOT_STARTED verdict contradicts local evidence of {parent!r}")
        if record is not None:
            # The verdict is the evidence the missing TERMINALs would have brought.
            for edge in record.edges.values():
                if edge.state is not _ES.NOT_STARTED:
                    self._fire_edge(edge, _EE.TERMINAL_NOT_STARTED)
        return self._fire_parent(parent, _PE.RELEASE_NOT_STARTED)

    def reclaim(self, parent: ParentKey, *, proof: str) -> list[Action]:
        """Return a quarantined parent's blocks to FREE given a proof of quiescence."""
        if not proof:
            raise LeaseError("reclaim needs a non-empty proof of quiescence")
        return self._fire_parent(parent, _PE.RECLAIM, reason=proof)

    # ---- internals -----------------------------------------------------

    def _machine(self, kind: str) -> str:
        return f"{self._role.value}-{kind}"

    def _require(self, parent: ParentKey) -> _Parent:
        record = self._parents.get(parent)
        if record is None:
            if parent in self._closed_parents:
                raise StaleError("parent", parent, f"closed ({self._closed_parents[parent].value})")
            raise self._unknown_parent(parent)
        return record

    def _unknown_parent(self, parent: ParentKey) -> ProtocolError:
        for other in [*self._parents, *self._closed_parents]:
            if other.request_id == parent.request_id:
                if other.ctx_attempt != parent.ctx_attempt:
                    return StaleError("ctx attempt", parent.ctx_attempt, other.ctx_attempt)
                return StaleError("gen attempt", parent.gen_attempt, other.gen_attempt)
        return UnknownSessionError(f"no parent {parent.request_id!r} here")

    def _admit(
        self,
        parent: ParentKey,
        n_blocks: int,
        lease_deadline: float | None,
        blocks: Sequence[int] | None = None,
    ) -> BlockRefs:
        if parent in self._parents or parent in self._closed_parents:
            raise LeaseError(f"parent {parent!r} already admitted on this rank")
        if blocks:
            # The engine's block manager chose them: exactly these, one per block.
            if len(blocks) != n_blocks:
                raise LeaseError(f"{len(blocks)} block ids for a request of {n_blocks} blocks")
            refs = self.pool.lease_blocks(parent, blocks)
        else:
            refs = self.pool.lease(parent, n_blocks)
        self._parents[parent] = _Parent(
            key=parent, state=_PS.ADMITTED, refs=refs, lease_deadline=lease_deadline
        )
        return refs

    def _fire_parent(self, parent: ParentKey, event: ParentEvent, reason: str = "") -> list[Action]:
        state = self.parent_state(parent)
        tr = _fire(self._machine("parent"), self._parent_table, state, event)
        record = self._parents.get(parent)
        actions: list[Action] = []
        if record is not None:
            record.state = tr.next  # type: ignore[assignment]
        for effect in tr.effects:
            if effect is _FX.SKIP:
                actions.append(CleanupSkipped(parent, state, event))
                continue
            assert record is not None  # only SKIP rows start from a closed parent
            actions.extend(self._parent_effect(record, effect, event, reason))
        return actions

    def _parent_effect(
        self, record: _Parent, effect: Effect, event: ParentEvent, reason: str
    ) -> list[Action]:
        if effect is _FX.RELEASE:
            self.pool.release(record.key)
            self._close(record, "released")
            return [Release(record.key, record.refs, outcome=_RELEASE_OUTCOME[event])]
        if effect is _FX.RECLAIM:
            self.pool.reclaim_quarantine(record.key, proof=reason)
            self._close(record, "reclaimed")
            return [
                Release(record.key, record.refs, reclaimed=True, outcome=_RELEASE_OUTCOME[event])
            ]
        if effect is _FX.QUARANTINE:
            self.pool.quarantine(record.key)
            why = reason or "quiescence not provable"
            return [Quarantine(record.key, record.refs, why), AdmissionStop(record.key, why)]
        if effect is _FX.SETTLED:
            evidence = tuple((t, _EVIDENCE_OF[e.state]) for t, e in record.edges.items())
            return [ParentSettled(record.key, record.cancel_reason is not None, evidence)]
        if effect is _FX.DECODE_READY:
            return [DecodeReady(record.key)]
        if effect is _FX.PREPARED:
            return [Prepared(record.key)]
        if effect is _FX.SEND_OPEN:
            return [SendMessage(e.ticket.ctx, e.open) for e in record.edges.values()]
        raise AssertionError(f"unhandled parent effect {effect}")  # pragma: no cover

    def _close(self, record: _Parent, how: str) -> None:
        for ticket in record.edges:
            self._sessions.close(ticket, how)
        del self._parents[record.key]
        self._closed_parents[record.key] = _PS.RELEASED
        while len(self._closed_parents) > _CLOSED_PARENT_MEMORY:
            self._closed_parents.popitem(last=False)

    def _fire_edge(self, edge: _Edge, event: EdgeEvent) -> list[Action]:
        tr = _fire(self._machine("edge"), self._edge_table, edge.state, event)
        edge.state = tr.next  # type: ignore[assignment]
        actions: list[Action] = []
        for effect in tr.effects:
            actions.extend(self._edge_effect(edge, effect))
        return actions

    def _edge_effect(self, edge: _Edge, effect: Effect) -> list[Action]:
        raise NotImplementedError  # pragma: no cover

    def _cancel(
        self, record: _Parent, reason: CancelReason, now: float, *, intent: bool
    ) -> list[Action]:
        """Cancel the parent and every edge; then settle or quarantine as evidence allows."""
        actions: list[Action] = []
        self._fire_parent(record.key, _PE.CANCEL)
        record.cancel_reason = reason
        if intent:
            actions.append(CancelIntent(record.key, reason))
        for edge in list(record.edges.values()):
            actions += self._cancel_edge(edge, now)
        actions += self._settle(record, now)
        return actions

    def _cancel_edge(self, edge: _Edge, now: float) -> list[Action]:
        return self._fire_edge(edge, _EE.CANCEL)

    def _settle(self, record: _Parent, now: float) -> list[Action]:
        """Fire the parent's coupling to its edges (h11's state-triggered transitions):
        an UNKNOWN edge cancels the siblings and quarantines; all terminal settles."""
        if record.state is _PS.QUARANTINED:
            return self._reclaim_if_proven(record)
        if record.state in (_PS.RELEASED, _PS.SETTLED, _PS.DECODE_READY):
            return []
        edges = record.edges.values()
        if any(e.state is _ES.UNKNOWN for e in edges):
            if record.cancel_reason is None:
                # Siblings must stop too (the round tells the other ranks); the
                # nested _settle of the cancel then quarantines.
                return self._cancel(record, CancelReason.FAILURE, now, intent=True)
            return self._fire_parent(record.key, _PE.QUIESCENCE_LOST, "edge evidence UNKNOWN")
        waiting = record.state in (_PS.ADMITTED, _PS.RESIDENT) and record.cancel_reason is None
        settling = record.state in (_PS.DECIDED, _PS.FINISHING, _PS.INSTALLED, _PS.CANCELLING)
        if settling and not waiting and all(e.state in _TERMINAL_EDGE_STATES for e in edges):
            return self._fire_parent(record.key, _PE.EDGES_SETTLED) + self._release_if_decided(record)
        return []


    def _reclaim_if_proven(self, record: _Parent) -> list[Action]:
        """A quarantined parent whose every edge is terminal with quiescence
        proven (none UNKNOWN any more; a proven terminal state has nothing in
        flight) is reclaimed in place: the proof is the evidence that replaced
        each UNKNOWN."""
        edges = record.edges.values()
        if not edges or any(e.state not in _TERMINAL_EDGE_STATES or e.state is _ES.UNKNOWN for e in edges):
            return []
        return self._fire_parent(
            record.key, _PE.RECLAIM, "every UNKNOWN edge later proven quiescent"
        )

    def _prove_quiescent(self, edge: _Edge) -> list[Action]:
        """Late proof that nothing writes through `edge` any more."""
        return self._fire_edge(edge, _EE.QUIESCENCE_PROVEN)


def _check_open_buffer(
    message: Open,
    lease_blocks: int,
    *,
    expected_agent: str | None,
    block_bytes: int | None,
    peer: PeerBuffer | None,
) -> None:
    """The buffer checks of an OPEN (pure; raises, never changes anything).

    The WRITE of an edge goes to the agent and the addresses the OPEN names, so
    the agent must be the sender's own and every descriptor a whole block of its
    registered buffer; one descriptor per block of our lease (the chunks pair
    them one to one)."""
    buffer = message.buffer
    if buffer.num_blocks != lease_blocks:
        raise LeaseError(f"OPEN names {buffer.num_blocks} blocks, our lease has {lease_blocks}")
    cols = block_columns(buffer)
    if block_bytes is not None and (cols.lengths != block_bytes).any():
        raise LeaseError(f"OPEN block length is not the GEN block size {block_bytes}")
    if expected_agent is not None and buffer.agent_name != expected_agent:
        raise StaleError("gen agent in buffer info", buffer.agent_name, expected_agent)
    if peer is None:
        return
    if peer.agent_name != buffer.agent_name:
        raise StaleError("gen agent of the registered buffer", peer.agent_name, buffer.agent_name)
    stride = peer.block_bytes if peer.block_stride is None else peer.block_stride
    wrong = whole_block_misfits(cols, peer.num_blocks, peer.block_bytes, peer.base, stride)
    if wrong is not None:
        block, addr = int(cols.blocks[wrong]), int(cols.addrs[wrong])
        raise LeaseError(
            f"OPEN block {block} at {addr:#x} is not a block of "
            f"{buffer.agent_name}'s registered buffer"
        )


def whole_block_misfits(
    cols: BlockColumns, num_blocks: int, block_bytes: int, base: int, stride: int
) -> int | None:
    """The index of the first block of `cols` that is not a whole block of a
    registered buffer (`num_blocks` blocks of `block_bytes` at `base` +
    block x `stride`), or None if every one is."""
    inside = cols.blocks < num_blocks
    # The address of a block inside the buffer is registered memory: it fits in 64 bits.
    index = np.where(inside, cols.blocks, 0).astype(np.uint64)
    expected = np.uint64(base) + index * np.uint64(stride)
    whole = inside & (cols.lengths == block_bytes) & (cols.addrs == expected)
    return None if whole.all() else int(np.argmin(whole))


def _check_endpoint(what: str, got: Endpoint, ours: Endpoint) -> None:
    if got.ns != ours.ns:
        raise StaleError(f"{what} namespace", got.ns, ours.ns)
    if got.epoch != ours.epoch:
        raise StaleError(f"{what} epoch", got.epoch, ours.epoch)


# ---------------------------------------------------------------------------
# CTX side
# ---------------------------------------------------------------------------


class CtxRank(_Rank):
    """The prefill side of one rank: sources of the DMA (see the module docstring)."""

    _role = Role.CTX
    _parent_table = CTX_PARENT_TRANSITIONS
    _edge_table = CTX_EDGE_TRANSITIONS

    def __init__(
        self,
        our: Endpoint,
        digest: bytes,
        pool: BlockPool,
        *,
        edges_per_parent: int,
        transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
        chunk_window: int = DEFAULT_CHUNK_WINDOW,
        conservative: bool = False,
        quarantine_limit: float = DEFAULT_QUARANTINE_LIMIT,
    ) -> None:
        """`edges_per_parent` is how many edges (GEN ranks) every parent has on this
        CTX rank (from the shard map): the parent is `Prepared` once that many
        OPENs are recorded, and an OPEN beyond it is refused.

        `conservative=True` is the path outside the qualified scope: a cancel
        never interrupts a decided transfer (parent FINISHING); it applies once
        every edge is terminal. The transfer deadline still bounds it (L1):
        past it the edges drain as on the active path."""
        super().__init__(
            our, digest, pool, transfer_timeout=transfer_timeout, quarantine_limit=quarantine_limit
        )
        if chunk_window < 1:
            raise LeaseError(f"chunk_window must be at least 1, got {chunk_window}")
        if edges_per_parent < 1:
            raise LeaseError(f"edges_per_parent must be at least 1, got {edges_per_parent}")
        self.edges_per_parent = edges_per_parent
        self.chunk_window = chunk_window
        self.conservative = conservative
        #: Chunks that reported ERR with more than one descriptor (unproven).
        self.unproven_chunks = 0
        #: GEN incarnations confirmed dead: the newest dead epoch per GEN
        #: rank, bounded (`peer_dead`). A WRITE toward one can land only in
        #: a dead process's memory, and our blocks are only read by it.
        self._dead_targets: collections.OrderedDict[RankNamespace, int] = collections.OrderedDict()

    def admit(
        self,
        parent: ParentKey,
        n_blocks: int,
        *,
        now: float,
        lease_deadline: float,
        blocks: Sequence[int] | None = None,
        edges: int | None = None,
    ) -> BlockRefs:
        """Lease `n_blocks` for `parent` (after the CTX admission round):
        exactly `blocks` when the engine named them, else any free ones.

        The KV is held until `lease_deadline` waiting for the GEN side; past it,
        `expire()` releases a parent that never started, or cancels it.

        `edges` is how many edges this parent has on this rank when it is not
        `edges_per_parent`: in a fleet it depends on the TP of the GEN instance
        the parent pairs with.
        """
        if lease_deadline < now:
            raise LeaseError(f"lease deadline {lease_deadline} is before now {now}")
        if edges is not None and edges < 1:
            raise LeaseError(f"a parent needs at least one edge, got {edges}")
        refs = self._admit(parent, n_blocks, lease_deadline, blocks)
        if edges is not None:
            self._parents[parent].expected_edges = edges
        return refs

    def _edges_of(self, record: _Parent) -> int:
        return record.expected_edges or self.edges_per_parent

    def bind_edges(self, parent: ParentKey, edges: int) -> None:
        """Say how many edges `parent` has here once the GEN instance it pairs
        with is known (an engine fleet publishes before any GEN instance
        claims the ticket: the first OPEN names it). Allowed only while no
        edge is recorded and the parent is admitted or resident; raises
        `LeaseError` otherwise and changes nothing."""
        record = self._require(parent)
        if edges < 1:
            raise LeaseError(f"a parent needs at least one edge, got {edges}")
        if record.edges or record.state not in (_PS.ADMITTED, _PS.RESIDENT):
            raise LeaseError(f"{parent!r}: its edges are bound already (state {record.state.value})")
        record.expected_edges = edges

    def unbind_unopened(self, parent: ParentKey) -> bool:
        """Undo `bind_edges` after the OPEN that bound `parent` was refused:
        True (its pair is unbound; the next OPEN may bind it) if no edge of
        it is recorded here, False (it stays bound) otherwise, or if it is
        not live."""
        record = self._parents.get(parent)
        if record is None or record.edges:
            return False
        record.expected_edges = 0
        return True

    def prefilled(self, parent: ParentKey) -> list[Action]:
        """Prefill finished: the KV is resident and OPENs may be prepared."""
        return self._fire_parent(parent, _PE.PREFILLED)

    def open_again(self, message: Open) -> list[Action] | None:
        """The answer to an OPEN we recorded already, asked again by a GEN
        rank whose edge went UNKNOWN without our TERMINAL (it was lost, or
        late): our TERMINAL again once the edge is terminal (its evidence
        unchanged: nothing is recorded), else nothing (the TERMINAL comes when
        the edge ends). None when this exact OPEN is not a session we hold:
        `receive_open` decides (a new OPEN is recorded; a refused one is
        answered by `reject_for`, and any REJECT but DUPLICATE tells the GEN
        rank that nothing of ours writes under that ticket: a session is
        closed only once its writes are proven over).
        """
        ticket = message.ticket
        if ticket.ctx != self.our or ticket not in self._sessions:
            return None
        edge = self._sessions.get(ticket)
        if edge.open != message:
            return None  # another OPEN under a live ticket: DUPLICATE, as before
        if edge.state not in _TERMINAL_EDGE_STATES:
            return []
        return self._edge_effect(edge, _FX.SEND_TERMINAL)

    def receive_open(
        self,
        message: Open,
        now: float,
        *,
        num_chunks: int = 1,
        expected_agent: str | None = None,
        block_bytes: int | None = None,
        peer: PeerBuffer | None = None,
    ) -> list[Action]:
        """Validate a GEN rank's OPEN (default-deny) and record the edge as PREPARED.

        The OPEN is a proposal: nothing is published or posted until
        `decided()`. `num_chunks` is how many WRITE chunks the actor will split
        the edge into (from the shard mapping). The OPEN must name exactly as
        many blocks as our lease, at most `edges_per_parent` OPENs are recorded
        per parent, and, when the caller knows them:

        * `expected_agent`: the NIXL agent of the ticket's GEN endpoint (the
          WRITE goes to the agent the OPEN names: never another rank's buffer);
        * `block_bytes`: the GEN block size of the layout (every descriptor's length);
        * `peer`: that agent's registered buffer: every descriptor must be a
          whole block of it (`base + block * block_bytes`, `block < num_blocks`).

        Any failure raises (`StaleError`, `LeaseError`, ...) and records
        nothing; answer it with `reject_for(message, error)`. When the last
        expected edge is recorded, the parent is `Prepared` (once).
        """
        ticket = message.ticket
        self._check_open_ticket(message, num_chunks)
        record = self._require(ticket.parent)
        if ticket in self._sessions:
            raise DuplicateSessionError(ticket)
        if self._sessions.closed_how(ticket) is not None:
            raise self._sessions.classify(ticket)
        _fire(
            self._machine("parent"), self._parent_table, record.state, _PE.EDGE_PREPARED
        )  # validate
        if len(record.edges) >= self._edges_of(record):
            raise LeaseError(
                f"OPEN for edge {ticket.edge} of {ticket.parent.request_id!r}: the parent has"
                f" {self._edges_of(record)} edge(s) here, all recorded"
            )
        _check_open_buffer(
            message,
            len(record.refs),
            expected_agent=expected_agent,
            block_bytes=block_bytes,
            peer=peer,
        )
        edge = _Edge(ticket=ticket, state=_ES.PREPARED, open=message, num_chunks=num_chunks)
        self._sessions.install(ticket, edge)
        record.edges[ticket] = edge
        actions = self._fire_parent(record.key, _PE.EDGE_PREPARED)
        if self.is_prepared(record.key):
            actions += self._fire_parent(record.key, _PE.ALL_PREPARED)
        return actions

    def _check_open_ticket(self, message: Open, num_chunks: int) -> None:
        """What an OPEN must say whatever this rank holds: addressed to us,
        our topology, from a GEN rank, its buffer of the ticket's GEN
        incarnation, at least one chunk. Raises; changes nothing."""
        ticket = message.ticket
        _check_endpoint("ctx", ticket.ctx, self.our)
        if ticket.ctx_digest != self.digest:
            raise StaleError("ctx topology digest", ticket.ctx_digest.hex(), self.digest.hex())
        if ticket.gen.ns.role is not Role.GEN:
            raise StaleError("gen namespace role", ticket.gen.ns.role, Role.GEN)
        if message.buffer.endpoint_epoch != ticket.gen.epoch:
            raise StaleError(
                "gen epoch in buffer info", message.buffer.endpoint_epoch, ticket.gen.epoch
            )
        if num_chunks < 1:
            raise PoolError(f"an edge needs at least one chunk, got {num_chunks}")

    def admit_at_open(
        self,
        message: Open,
        n_blocks: int,
        *,
        now: float,
        lease_deadline: float,
        num_chunks: int = 1,
        expected_agent: str | None = None,
        block_bytes: int | None = None,
        peer: PeerBuffer | None = None,
        edges: int | None = None,
    ) -> list[Action]:
        """Admit the OPEN's parent here and record the OPEN, in one step: the
        admission of a rank that is its whole instance (tp=1), made when the
        GEN instance's OPEN arrives instead of in a round of our own
        (`RoundFollower.record_admitted` tells the leader).

        Everything is checked first, and any failure raises and changes
        nothing (answer it with `reject_for`): the OPEN as `receive_open`
        checks it, a parent held here already (its OPENs go to
        `receive_open`) or ended here (`_closed_parents`: a late or repeated
        OPEN never admits a finished handoff again), a pool without
        `n_blocks` free blocks (`PoolError`). Then: the lease (until
        `lease_deadline`), the KV resident (the caller prefilled it or
        will not), and the OPEN recorded; `Prepared` once every edge is."""
        ticket = message.ticket
        self._check_open_ticket(message, num_chunks)
        if ticket.parent in self._parents:
            raise LeaseError(f"{ticket.parent!r} is admitted here already: its OPENs are received, not admitted")
        if lease_deadline < now:
            raise LeaseError(f"lease deadline {lease_deadline} is before now {now}")
        if edges is not None and edges < 1:
            raise LeaseError(f"a parent needs at least one edge, got {edges}")
        if ticket.parent in self._closed_parents:
            raise StaleError("parent", ticket.parent, f"closed ({self._closed_parents[ticket.parent].value})")
        if self._sessions.closed_how(ticket):  # "released" or "reclaimed"
            raise self._sessions.classify(ticket)
        _check_open_buffer(message, n_blocks, expected_agent=expected_agent, block_bytes=block_bytes, peer=peer)
        if self.admission_stopped():
            raise AdmissionRefused("admission stopped: quarantine holds the limit of the pool")
        if n_blocks > self.pool.counts().free:
            raise NoCapacity(f"cannot admit {n_blocks} blocks: only {self.pool.counts().free} free")
        self._admit(ticket.parent, n_blocks, lease_deadline)  # any other refusal raises, unchanged
        if edges is not None:
            self._parents[ticket.parent].expected_edges = edges
        actions = self.prefilled(ticket.parent)
        return actions + self.receive_open(
            message, now, num_chunks=num_chunks, expected_agent=expected_agent, block_bytes=block_bytes, peer=peer
        )

    def is_prepared(self, parent: ParentKey) -> bool:
        """Every expected edge of `parent` is recorded and still PREPARED, and the
        parent is RESIDENT (not decided, not cancelled): what `Prepared` reports."""
        record = self._parents.get(parent)
        return (
            record is not None
            and record.state is _PS.RESIDENT
            and len(record.edges) == self._edges_of(record)
            and all(e.state is _ES.PREPARED for e in record.edges.values())
        )

    def decided(self, parent: ParentKey, now: float) -> list[Action]:
        """The CTX round decided `parent`: publish READY on every edge and post
        each edge's first window of chunks."""
        actions = self._fire_parent(parent, _PE.DECIDED)
        record = self._parents.get(parent)
        if record is None or record.state is not _PS.DECIDED:
            return actions  # cancelled, settled or released first: publish nothing
        record.deadline = now + self.transfer_timeout
        for edge in record.edges.values():
            actions += self._fire_edge(edge, _EE.DECIDED)
        return actions + self._settle(record, now)

    def chunk_done(
        self, ticket: ContextTicket, index: int, nbytes: int, now: float
    ) -> list[Action]:
        """A posted chunk reported DONE with `nbytes` written."""
        edge = self._posted_edge(ticket, index)
        if nbytes < 0:
            raise PoolError(f"negative byte count {nbytes}")
        if edge.state is _ES.UNKNOWN:
            edge.in_flight.discard(index)
            return self._fire_edge(edge, _EE.CHUNK_DONE) + self._late_drain(edge, now)
        edge.in_flight.discard(index)
        edge.chunks_done += 1
        edge.bytes_done += nbytes
        record = self._parents[ticket.parent]
        if edge.state is _ES.POSTING and edge.chunks_done == edge.num_chunks:
            actions = self._fire_edge(edge, _EE.ALL_CHUNKS_DONE)
        else:
            actions = self._fire_edge(edge, _EE.CHUNK_DONE)
            if edge.state is _ES.DRAINING and not edge.in_flight:
                actions += self._fire_edge(edge, _EE.DRAIN_DONE)
        return actions + self._settle(record, now)

    def chunk_failed(self, ticket: ContextTicket, index: int, now: float, descriptors: int = 1) -> list[Action]:
        """A posted chunk reported ERR: the edge is incomplete, the parent is cancelled.

        `descriptors` is how many descriptors the post handed to the transport
        (0: none, it failed before any DMA). An ERR proves the chunk quiescent
        only with at most one: one transport operation, ended. With several,
        one failing does not end the others, whose bytes may still land in the
        peer's blocks: the chunk stays in flight, unproven, and the edge is
        UNKNOWN at once (quarantine until a proof: the peer's TERMINAL cannot
        give one, a death or restart of this incarnation does)."""
        if type(descriptors) is not int or descriptors < 0:
            raise PoolError(f"descriptors must be an int >= 0, got {descriptors!r}")
        edge = self._posted_edge(ticket, index)
        record = self._parents[ticket.parent]
        if descriptors > 1 and not self._target_dead(edge):
            return self._chunk_unproven(record, edge, index, now)
        edge.in_flight.discard(index)
        if edge.state is _ES.UNKNOWN:
            return self._fire_edge(edge, _EE.CHUNK_FAILED) + self._late_drain(edge, now)
        edge.failed = True
        actions = self._fire_edge(edge, _EE.CHUNK_FAILED)
        if edge.state is _ES.DRAINING and not edge.in_flight:
            actions += self._fire_edge(edge, _EE.DRAIN_DONE)
        if record.cancel_reason is None:
            actions += self._cancel(record, CancelReason.FAILURE, now, intent=True)
        elif record.state is _PS.FINISHING:
            actions += self._stop_finishing(record, now)  # incomplete: stop waiting for it
        return actions + self._settle(record, now)

    def _chunk_unproven(self, record: _Parent, edge: _Edge, index: int, now: float) -> list[Action]:
        """A multi-descriptor chunk reported ERR: its index stays in flight
        (nothing proves its writes ended), the parent is cancelled, and the
        edge loses quiescence: UNKNOWN, TERMINAL(UNKNOWN) to the GEN, and the
        parent is quarantined once every edge is terminal."""
        edge.failed = True
        edge.unproven.add(index)
        self.unproven_chunks += 1
        if edge.state is _ES.UNKNOWN:
            return self._settle(record, now)
        actions: list[Action] = []
        if record.cancel_reason is None:
            actions += self._cancel(record, CancelReason.FAILURE, now, intent=True)
        elif record.state is _PS.FINISHING:
            actions += self._stop_finishing(record, now)
        if not self._edge_unknown(edge):  # the cancel may have moved it already
            actions += self._fire_edge(edge, _EE.QUIESCENCE_LOST)
        return actions + self._settle(record, now)

    @staticmethod
    def _edge_unknown(edge: _Edge) -> bool:
        return edge.state is _ES.UNKNOWN

    def _late_drain(self, edge: _Edge, now: float) -> list[Action]:
        """An UNKNOWN edge whose last posted chunk just reported DONE/ERR: every
        WRITE we posted from these blocks has ended (polled from the initiator),
        so the edge is DRAINED after all; its TERMINAL(DRAINED) is the GEN's
        proof too. The parent is reclaimed once no edge is UNKNOWN. Toward a
        GEN incarnation confirmed dead, chunks that ended in ERR with several
        descriptors count as ended too: their other writes can land only in
        the dead process, and our blocks are only read."""
        if edge.in_flight and not (self._target_dead(edge) and edge.in_flight <= edge.unproven):
            return []
        edge.in_flight.clear()
        edge.unproven.clear()
        actions = self._prove_quiescent(edge)
        return actions + self._settle(self._parents[edge.ticket.parent], now)

    def receive_receipt(self, message: Receipt) -> list[Action]:
        """GEN acknowledged the bytes of a COMPLETED edge (not quiescence, not completion)."""
        edge = self._sessions.get(message.ticket)
        _fire(self._machine("edge"), self._edge_table, edge.state, _EE.RECEIPT_RECEIVED)
        if message.bytes_received != edge.bytes_done:
            raise StaleError("receipt bytes", message.bytes_received, edge.bytes_done)
        edge.receipt_bytes = message.bytes_received
        return self._fire_edge(edge, _EE.RECEIPT_RECEIVED)

    def receive_reject(self, message: Reject, now: float) -> list[Action]:
        """GEN refused one of our messages for this session: it no longer wants the bytes."""
        edge = self._sessions.get(message.ticket)
        record = self._parents[edge.ticket.parent]
        if record.cancel_reason is not None or record.state is _PS.QUARANTINED:
            return []
        return self._cancel(record, CancelReason.PEER, now, intent=True)

    def receive(self, message: SessionMessage, now: float, *, num_chunks: int = 1) -> list[Action]:
        """Dispatch a received message (OPEN, CANCEL, RECEIPT, REJECT) to its handler."""
        match message:
            case Open():
                again = self.open_again(message)
                if again is not None:
                    return again
                return self.receive_open(message, now, num_chunks=num_chunks)
            case Cancel():
                return self.receive_cancel(message, now)
            case Receipt():
                return self.receive_receipt(message)
            case Reject():
                return self.receive_reject(message, now)
            case _:
                raise IllegalTransition("ctx-receive", self._role, type(message).__name__)

    def expire(self, now: float) -> list[Action]:
        """Apply every deadline that passed at `now`.

        * lease deadline while waiting for GEN (ADMITTED/RESIDENT): nothing was
          ever posted from our blocks: cancel + CancelIntent (the round's
          decision releases, never the timeout itself);
        * transfer deadline of a DECIDED parent: cancel (drain) + CancelIntent;
          of a FINISHING one (conservative path): stop waiting, drain;
        * drain deadline of a DRAINING edge: UNKNOWN -> quarantine.
        """
        actions: list[Action] = []
        for record in list(self._parents.values()):
            if record.state in (_PS.ADMITTED, _PS.RESIDENT):
                if record.lease_deadline is not None and now >= record.lease_deadline:
                    # Nothing was decided, so nothing was posted from our blocks:
                    # cancel (every proposer hears NOT_STARTED) and record the
                    # intent. The lease returns when the round decides the cancel.
                    actions += self._cancel(record, CancelReason.TIMEOUT, now, intent=True)
                continue
            past = record.deadline is not None and now >= record.deadline
            if record.state is _PS.DECIDED and past:
                actions += self._cancel(record, CancelReason.TIMEOUT, now, intent=True)
            elif record.state is _PS.FINISHING and past:
                actions += self._stop_finishing(record, now)
            if record.state in (_PS.CANCELLING, _PS.FINISHING):
                for edge in record.edges.values():
                    if (
                        edge.state is _ES.DRAINING
                        and edge.deadline is not None
                        and now >= edge.deadline
                    ):
                        actions += self._fire_edge(edge, _EE.QUIESCENCE_LOST)
                actions += self._settle(record, now)
        return actions

    def peer_restarted(self, their: Endpoint, now: float) -> list[Action]:
        """A GEN rank came back with a newer epoch: its old sessions are dead.

        Edges to the old epoch with chunks in flight cannot be proven quiescent
        (UNKNOWN); the others are cancelled and drain/not-start normally.
        """
        actions: list[Action] = []
        for record in list(self._parents.values()):
            hit = [
                e
                for e in record.edges.values()
                if e.ticket.gen.ns == their.ns and e.ticket.gen.epoch < their.epoch
            ]
            if not hit:
                continue
            for edge in hit:
                if edge.in_flight and edge.state in (_ES.POSTING, _ES.DRAINING):
                    actions += self._fire_edge(edge, _EE.QUIESCENCE_LOST)
            if record.cancel_reason is None and record.state is not _PS.QUARANTINED:
                actions += self._cancel(record, CancelReason.FAILURE, now, intent=True)
            else:
                actions += self._settle(record, now)
        return actions

    def peer_dead(self, dead: Endpoint, now: float) -> list[Action]:
        """GEN incarnation `dead` (and every older one) is confirmed dead. We
        are the writer: its death does not end WRITEs we posted (only polling
        them to DONE/ERR does), so first this is `peer_restarted` for every
        epoch up to `dead`'s. But a WRITE toward it can land only in the dead
        process's memory, and it only reads our blocks: an UNKNOWN edge
        toward it whose every chunk has ended at the initiator (DONE, or ERR
        with any number of descriptors) is proven, and a quarantined parent
        with no UNKNOWN edge left is reclaimed. A chunk still in flight ends
        it later, at its poll (docs/design.md "Quarantine and reclaim")."""
        known = self._dead_targets.get(dead.ns)
        if known is None or dead.epoch > known:
            self._dead_targets[dead.ns] = dead.epoch
            self._dead_targets.move_to_end(dead.ns)
            while len(self._dead_targets) > MAX_DEAD_WRITERS:
                self._dead_targets.popitem(last=False)
        actions = self.peer_restarted(Endpoint(ns=dead.ns, epoch=dead.epoch + 1), now)
        for record in list(self._parents.values()):
            for edge in list(record.edges.values()):
                if (
                    record.key in self._parents
                    and edge.state is _ES.UNKNOWN
                    and self._target_dead(edge)
                ):
                    actions += self._late_drain(edge, now)
        return actions

    def _target_dead(self, edge: _Edge) -> bool:
        """Whether `edge`'s GEN incarnation is confirmed dead (`peer_dead`)."""
        dead_epoch = self._dead_targets.get(edge.ticket.gen.ns)
        return dead_epoch is not None and edge.ticket.gen.epoch <= dead_epoch

    # ---- internals -----------------------------------------------------

    def _posted_edge(self, ticket: ContextTicket, index: int) -> _Edge:
        edge = self._sessions.get(ticket)
        if index not in edge.in_flight:
            raise PoolError(f"chunk {index} of edge {ticket.edge} is not in flight")
        return edge

    def _cancel(
        self, record: _Parent, reason: CancelReason, now: float, *, intent: bool
    ) -> list[Action]:
        if not (self.conservative and record.state is _PS.DECIDED):
            return super()._cancel(record, reason, now, intent=intent)
        # Conservative path: the decided transfer runs to its end (or to its
        # deadline); the cancel is recorded and applies when the edges settle.
        self._fire_parent(record.key, _PE.DEFER_CANCEL)
        record.cancel_reason = reason
        actions: list[Action] = [CancelDeferred(record.key)]
        if intent:
            actions.append(CancelIntent(record.key, reason))
        return actions + self._settle(record, now)

    def _stop_finishing(self, record: _Parent, now: float) -> list[Action]:
        """Conservative path given up (deadline passed, or a chunk failed): the
        edges stop posting and drain, as a cancel on the active path would."""
        actions: list[Action] = []
        for edge in record.edges.values():
            if edge.state not in _TERMINAL_EDGE_STATES and edge.state is not _ES.DRAINING:
                actions += self._cancel_edge(edge, now)
        return actions

    def _cancel_edge(self, edge: _Edge, now: float) -> list[Action]:
        if edge.state is _ES.POSTING:
            edge.deadline = now + self.transfer_timeout
        actions = self._fire_edge(edge, _EE.CANCEL)
        if edge.state is _ES.DRAINING and not edge.in_flight:
            actions += self._fire_edge(edge, _EE.DRAIN_DONE)
        return actions

    def _edge_effect(self, edge: _Edge, effect: Effect) -> list[Action]:
        to = edge.ticket.gen
        if effect is _FX.SEND_READY:
            return [SendMessage(to, Ready(ticket=edge.ticket))]
        if effect is _FX.POST:
            return self._post_more(edge)
        if effect is _FX.SEND_TERMINAL:
            kind = _EVIDENCE_OF[edge.state]
            nbytes = edge.bytes_done if kind is TerminalKind.COMPLETED else 0
            return [SendMessage(to, Terminal(ticket=edge.ticket, evidence=kind, bytes_done=nbytes))]
        if effect is _FX.STOP_AND_DRAIN:
            assert edge.deadline is not None
            return [Drain(edge.ticket, tuple(sorted(edge.in_flight)), edge.deadline)]
        raise AssertionError(f"unhandled ctx edge effect {effect}")  # pragma: no cover

    def _post_more(self, edge: _Edge) -> list[Action]:
        # The chunk counts as in flight from the moment the action exists: the
        # actor may post it before telling us anything (S1 is conservative).
        actions: list[Action] = []
        while len(edge.in_flight) < self.chunk_window and edge.next_index < edge.num_chunks:
            self._fire_edge(edge, _EE.CHUNK_POSTED)
            edge.in_flight.add(edge.next_index)
            actions.append(PostChunk(edge.ticket, edge.next_index))
            edge.next_index += 1
        return actions


# ---------------------------------------------------------------------------
# GEN side
# ---------------------------------------------------------------------------


class GenRank(_Rank):
    """The decode side of one rank: destinations of the DMA (see the module docstring)."""

    _role = Role.GEN
    _parent_table = GEN_PARENT_TRANSITIONS
    _edge_table = GEN_EDGE_TRANSITIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The newest confirmed-dead epoch of each CTX rank (`peer_dead`), newest last, bounded.
        self._dead_writers: collections.OrderedDict[RankNamespace, int] = collections.OrderedDict()

    def admit(
        self,
        parent: ParentKey,
        n_blocks: int,
        *,
        now: float,
        deadline: float | None = None,
        blocks: Sequence[int] | None = None,
    ) -> BlockRefs:
        """Lease `n_blocks` for `parent` (after the GEN admission round):
        exactly `blocks` when the engine named them, else any free ones.

        `deadline`, if given, bounds the wait for `install()`; past it an
        uninstalled parent (no OPEN ever sent) is released by `expire()`.
        """
        return self._admit(parent, n_blocks, deadline, blocks)

    def install(self, parent: ParentKey, edges: Sequence[GenEdgeSpec], now: float) -> list[Action]:
        """Install the session's edges (after the installation barrier): OPEN per edge.

        Every ticket must name this parent, our endpoint and digest; every
        block descriptor must be a current block of this parent's lease. All
        checks run before anything is recorded.
        """
        record = self._require(parent)
        _fire(self._machine("parent"), self._parent_table, record.state, _PE.INSTALLED)  # validate
        if not edges:
            raise PoolError("a session needs at least one edge")
        seen: set[ContextTicket] = set()
        for spec in edges:
            ticket = spec.ticket
            if ticket.parent != parent:
                raise StaleError("parent", ticket.parent, parent)
            _check_endpoint("gen", ticket.gen, self.our)
            if ticket.gen_digest != self.digest:
                raise StaleError("gen topology digest", ticket.gen_digest.hex(), self.digest.hex())
            if ticket.ctx.ns.role is not Role.CTX:
                raise StaleError("ctx namespace role", ticket.ctx.ns.role, Role.CTX)
            if spec.buffer.endpoint_epoch != self.our.epoch:
                raise StaleError(
                    "gen epoch in buffer info", spec.buffer.endpoint_epoch, self.our.epoch
                )
            if ticket in seen or ticket in self._sessions:
                raise DuplicateSessionError(ticket)
            if spec.expected_bytes < 0:
                raise PoolError(f"negative expected bytes {spec.expected_bytes}")
            seen.add(ticket)
            cols = block_columns(spec.buffer)
            check_descriptors(self.pool, cols.blocks, cols.generations)
            ours = self.pool.owned_by(parent, cols.blocks)  # a current block of our lease
            if not ours.all():
                i = int(np.argmin(ours))
                raise PoolError(
                    f"block {BlockRef(int(cols.blocks[i]), int(cols.generations[i]))} does not "
                    f"belong to the lease of {parent.request_id!r}"
                )
        record.deadline = now + self.transfer_timeout
        for spec in edges:
            open_msg = Open(ticket=spec.ticket, buffer=spec.buffer, num_tokens=spec.num_tokens)
            edge = _Edge(
                ticket=spec.ticket,
                state=_ES.OPEN_PROPOSED,
                open=open_msg,
                expected_bytes=spec.expected_bytes,
            )
            self._sessions.install(spec.ticket, edge)
            record.edges[spec.ticket] = edge
        actions = self._fire_parent(parent, _PE.INSTALLED)
        if self._dead_writers:  # an edge toward a writer already confirmed dead
            actions += self._dead_proof(record, now)
        return actions

    def may_be_written(self) -> bool:
        """Whether a CTX WRITE may be in flight toward this rank: a live parent
        is INSTALLED, CANCELLING or QUARANTINED (the staged data plane keeps
        polling meanwhile)."""
        return any(record.state in _WRITE_TARGET for record in self._parents.values())

    def may_scatter(self, parent: ParentKey) -> bool:
        """Whether bytes staged for `parent` may be copied into its lease now:
        it is live, INSTALLED (not cancelled, decode-ready, released or
        quarantined) and its lease is held. Never write an ended lease (S1)."""
        record = self._parents.get(parent)
        return record is not None and record.state is _PS.INSTALLED and self.pool.holds(parent)

    def receive_ready(self, message: Ready, now: float) -> list[Action]:
        """READY for an exact session: the CTX topology decided; DMA may happen."""
        edge = self._sessions.get(message.ticket)
        return self._fire_edge(edge, _EE.READY_RECEIVED)

    def receive_terminal(self, message: Terminal, now: float) -> list[Action]:
        """TERMINAL evidence for an exact session.

        COMPLETED with the expected bytes -> RECEIPT; COMPLETED with other bytes
        is quiescent but wrong, so it counts as DRAINED and cancels the parent;
        NOT_STARTED/DRAINED cancel the parent (siblings); UNKNOWN quarantines.
        """
        edge = self._sessions.get(message.ticket)
        record = self._parents[edge.ticket.parent]
        event = _TERMINAL_EVENT[message.evidence]
        bad_bytes = (
            message.evidence is TerminalKind.COMPLETED and message.bytes_done != edge.expected_bytes
        )
        if bad_bytes:
            event = _EE.TERMINAL_DRAINED
        if edge.state is _ES.UNKNOWN and message.evidence is not TerminalKind.UNKNOWN:
            # The writer sends a TERMINAL other than UNKNOWN only once every chunk
            # it posted on this edge was polled to DONE/ERR: a late proof.
            event = _EE.QUIESCENCE_PROVEN
        tr = _fire(self._machine("edge"), self._edge_table, edge.state, event)  # validate first
        if tr.next is _ES.COMPLETED and edge.state is not _ES.COMPLETED:
            edge.bytes_done = message.bytes_done  # what the RECEIPT acknowledges
        actions = self._fire_edge(edge, event)
        if (
            edge.state is not _ES.COMPLETED
            and record.cancel_reason is None
            and record.state not in (_PS.QUARANTINED, _PS.DECODE_READY)
        ):
            reason = (
                CancelReason.FAILURE
                if bad_bytes or edge.state is _ES.UNKNOWN
                else CancelReason.PEER
            )
            actions += self._cancel(record, reason, now, intent=True)
        return actions + self._settle(record, now)

    def receive_reject(self, message: Reject, now: float) -> list[Action]:
        """CTX refused our OPEN: it never recorded it, so the edge is NOT_STARTED.

        A DUPLICATE reject means an earlier copy of the OPEN *was* recorded: no change.
        """
        edge = self._sessions.get(message.ticket)
        if message.reason is RejectReason.DUPLICATE:
            return []
        record = self._parents[edge.ticket.parent]
        actions = self._fire_edge(edge, _EE.REJECTED)
        if record.cancel_reason is None and record.state not in (_PS.QUARANTINED, _PS.DECODE_READY):
            actions += self._cancel(record, CancelReason.PEER, now, intent=True)
        return actions + self._settle(record, now)

    def receive(self, message: SessionMessage, now: float) -> list[Action]:
        """Dispatch a received message (READY, TERMINAL, REJECT, CANCEL) to its handler."""
        match message:
            case Ready():
                return self.receive_ready(message, now)
            case Terminal():
                return self.receive_terminal(message, now)
            case Reject():
                return self.receive_reject(message, now)
            case Cancel():
                return self.receive_cancel(message, now)
            case _:
                raise IllegalTransition("gen-receive", self._role, type(message).__name__)

    def free(self, parent: ParentKey) -> list[Action]:
        """The client is done with a decode-ready request: release its KV, once."""
        return self._fire_parent(parent, _PE.FREE)

    def expire(self, now: float) -> list[Action]:
        """Apply every deadline that passed at `now`.

        * admitted, never installed, past its lease deadline: no OPEN exposed
          our blocks: cancel + CancelIntent (the round's decision releases);
        * decode-ready past the consumer deadline: release (no writer is left);
        * installed, past the transfer deadline: cancel (CANCEL to every CTX
          rank) + CancelIntent; each cancelled edge waits one more timeout;
        * a cancelled edge still without TERMINAL past its wait: UNKNOWN ->
          quarantine + AdmissionStop.
        """
        actions: list[Action] = []
        for record in list(self._parents.values()):
            if record.state is _PS.ADMITTED and record.cancel_reason is None:
                if record.lease_deadline is not None and now >= record.lease_deadline:
                    # No OPEN was sent, nothing exposed: cancel and record the
                    # intent; the lease returns when the round decides it.
                    actions += self._cancel(record, CancelReason.TIMEOUT, now, intent=True)
                continue
            if record.state is _PS.DECODE_READY:
                if record.deadline is not None and now >= record.deadline:
                    # Nobody consumed the KV in time. Every edge is COMPLETED and
                    # acknowledged: no writer is left, so returning it is safe (S1).
                    actions += self._fire_parent(record.key, _PE.CONSUMER_EXPIRED)
                continue
            if (
                record.state is _PS.INSTALLED
                and record.deadline is not None
                and now >= record.deadline
            ):
                actions += self._cancel(record, CancelReason.TIMEOUT, now, intent=True)
            if record.state is _PS.CANCELLING:
                for edge in record.edges.values():
                    if (
                        edge.state not in _TERMINAL_EDGE_STATES
                        and edge.deadline is not None
                        and now >= edge.deadline
                    ):
                        actions += self._fire_edge(edge, _EE.QUIESCENCE_LOST)
                actions += self._settle(record, now)
            if record.state is _PS.QUARANTINED:
                actions += self._ask_again(record, now)
        return actions

    def _ask_again(self, record: _Parent, now: float) -> list[Action]:
        """Ask the writer of each UNKNOWN edge of quarantined `record` what
        became of it: its OPEN again, at once and then a transfer timeout
        later, doubling, `UNKNOWN_ASKS` times in all. The answer proves the
        edge or nothing (`CtxRank.open_again`): our TERMINAL resent (a lost
        one ends the quarantine), or a REJECT (no session of the writer's
        can write). Past the last ask the quarantine waits for the writer's
        death, or counts toward the admission stop and its planned restart."""
        actions: list[Action] = []
        for edge in record.edges.values():
            due = edge.deadline is None or now >= edge.deadline
            if edge.state is _ES.UNKNOWN and due and edge.asks < UNKNOWN_ASKS:
                edge.asks += 1
                edge.deadline = now + self.transfer_timeout * (1 << (edge.asks - 1))
                actions.append(SendMessage(edge.ticket.ctx, edge.open))
        return actions

    def peer_restarted(self, their: Endpoint, now: float) -> list[Action]:
        """A CTX rank came back with a newer epoch: edges still waiting on the old
        one can never get TERMINAL, and its posted writes are unproven: UNKNOWN."""
        actions: list[Action] = []
        for record in list(self._parents.values()):
            hit = [
                e
                for e in record.edges.values()
                if e.ticket.ctx.ns == their.ns
                and e.ticket.ctx.epoch < their.epoch
                and e.state not in _TERMINAL_EDGE_STATES
            ]
            for edge in hit:
                actions += self._fire_edge(edge, _EE.QUIESCENCE_LOST)
            if hit:
                actions += self._settle(record, now)
        return actions

    def peer_dead(self, dead: Endpoint, now: float) -> list[Action]:
        """CTX incarnation `dead` (and every older one) is confirmed dead: a dead
        process posts no WRITE, so every edge it was writing is proven
        quiescent, UNKNOWN ones included. Edges still waiting become DRAINED and
        cancel their parent; a quarantined parent whose every edge is now
        proven is reclaimed (docs/design.md "Quarantine and reclaim")."""
        known = self._dead_writers.get(dead.ns)
        if known is None or dead.epoch > known:
            # Remembered: an edge toward this incarnation installed after
            # this notice (an OPEN built from a registration read before the
            # death) is proven at its install, not quarantined for good.
            self._dead_writers[dead.ns] = dead.epoch
            self._dead_writers.move_to_end(dead.ns)
            while len(self._dead_writers) > MAX_DEAD_WRITERS:
                self._dead_writers.popitem(last=False)
        actions: list[Action] = []
        for record in list(self._parents.values()):
            actions += self._dead_proof(record, now)
        return actions

    def _dead_proof(self, record: _Parent, now: float) -> list[Action]:
        """Apply every confirmed death of a writer to `record`'s edges: an
        edge whose CTX incarnation is dead (or older than a dead one) and
        still waits, or is UNKNOWN, is proven quiescent (a dead process posts
        no WRITE); an installed parent it hit is cancelled as failed."""
        hit = []
        for e in record.edges.values():
            dead_epoch = self._dead_writers.get(e.ticket.ctx.ns)
            if (
                dead_epoch is not None
                and e.ticket.ctx.epoch <= dead_epoch
                and (e.state is _ES.UNKNOWN or e.state not in _TERMINAL_EDGE_STATES)
            ):
                hit.append(e)
        if not hit:
            return []
        actions: list[Action] = []
        for edge in hit:
            actions += self._prove_quiescent(edge)
        if record.cancel_reason is None and record.state is _PS.INSTALLED:
            actions += self._cancel(record, CancelReason.FAILURE, now, intent=True)
        actions += self._settle(record, now)
        return actions

    # ---- internals -----------------------------------------------------

    def _cancel_edge(self, edge: _Edge, now: float) -> list[Action]:
        if edge.state not in _TERMINAL_EDGE_STATES and edge.deadline is None:
            edge.deadline = now + self.transfer_timeout
        return self._fire_edge(edge, _EE.CANCEL)

    def _edge_effect(self, edge: _Edge, effect: Effect) -> list[Action]:
        to = edge.ticket.ctx
        if effect is _FX.SEND_CANCEL:
            record = self._parents[edge.ticket.parent]
            reason = record.cancel_reason or CancelReason.PEER
            return [SendMessage(to, Cancel(ticket=edge.ticket, reason=reason))]
        if effect is _FX.SEND_RECEIPT:
            return [SendMessage(to, Receipt(ticket=edge.ticket, bytes_received=edge.bytes_done))]
        raise AssertionError(f"unhandled gen edge effect {effect}")  # pragma: no cover
