"""Session state machines for the CTX and GEN sides of a handoff.

Theory of operation
-------------------
The rank sessions hold every rule that decides what a rank may do with its KV
blocks (docs/design.md "Lifecycle", "Cancellation", "Slots, leases,
ownership"): this module (what both sides share), _ctx_session.py (`CtxRank`),
_gen_session.py (`GenRank`), with their tables in _tables.py and the actions
they return in _actions.py. They are sans-IO in the h11 sense: events go in
(method calls, received messages, the current time `now` as an argument),
typed actions come out; nothing here sends, polls, sleeps or reads a clock.

There are four machines, each an explicit module-level table (_tables.py)
`(state, event) -> Transition(next state, effects)` fired by one `_fire()` that
raises `IllegalTransition` for a missing entry:

* CTX parent / CTX edge (prefill side: sources of the DMA, writer);
* GEN parent / GEN edge (decode side: destinations of the DMA).

A *parent* is one request attempt on one rank: it owns the rank's lease. An
*edge* is one ctx rank -> gen rank session of that parent, named by an exact
`ContextTicket` in a default-deny registry (_registry.py). The `effects` of a
transition are carried out by the rank session right after the state changes
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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._actions import (
    _RELEASE_OUTCOME,
    Action,
    AdmissionStop,
    CancelIntent,
    CleanupSkipped,
    DecodeReady,
    EdgeEvidence,
    ParentSettled,
    PeerBuffer,
    Prepared,
    Quarantine,
    Release,
    SendMessage,
)
from ._errors import (
    LeaseError,
    ProtocolError,
    StaleError,
    UnknownSessionError,
)
from ._messages import (
    BlockColumns,
    Cancel,
    CancelReason,
    Open,
    block_columns,
)
from ._pool import BlockPool, BlockRefs
from ._registry import DuplicateSessionError, SessionRegistry
from ._tables import (
    _AT_REST,
    _EE,
    _ES,
    _EVIDENCE_OF,
    _FX,
    _PE,
    _PS,
    _TERMINAL_EDGE_STATES,
    EdgeEvent,
    EdgeState,
    Effect,
    ParentEvent,
    ParentState,
    Transition,
    _fire,
)
from ._ticket import ContextTicket, Endpoint, ParentKey, RankNamespace, Role

__all__ = [
    "whole_block_misfits",
    "DEFAULT_TRANSFER_TIMEOUT",
    "DEFAULT_CHUNK_WINDOW",
    "DEFAULT_QUARANTINE_LIMIT",
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
#: How many CTX ranks' confirmed deaths a GEN rank remembers (`GenRank.peer_dead`):
#: one entry per CTX rank namespace (a fleet's instance incarnation and rank).
MAX_DEAD_WRITERS = 4096



# ---------------------------------------------------------------------------
# Per-rank records
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Edge:
    ticket: ContextTicket
    state: EdgeState
    #: Push: the GEN rank's OPEN (its destination blocks). Pull, on the
    #: reader: what it reads (the CTX blocks as an OPEN would name them);
    #: on the CTX rank: None (the reader was named at the lend).
    open: Open | None
    num_chunks: int = 1  # poster: chunks of this edge
    expected_bytes: int = 0  # waiter: what COMPLETED must report
    next_index: int = 0  # poster: next chunk to post
    in_flight: set[int] = field(default_factory=set)  # poster: posted, not DONE/ERR
    #: poster: indices in `in_flight` that ended in ERR with several
    #: descriptors (ended at the initiator, their other writes unproven).
    unproven: set[int] = field(default_factory=set)
    chunks_done: int = 0
    bytes_done: int = 0
    failed: bool = False  # poster: a chunk reported ERR
    deadline: float | None = None  # drain (poster) / cancel wait (waiter)
    receipt_bytes: int | None = None  # poster: what the waiter acknowledged
    asks: int = 0  # waiter: times the poster of this UNKNOWN edge was asked again
    #: Pull (the GEN rank reads the CTX rank's blocks): the roles of the
    #: edge machines swap (_edge_roles.py).
    pull: bool = False
    #: Pull: the CTX rank's number for the lend (its incarnation's sequence),
    #: by which the reader remembers what it read or was fenced off.
    lend_seq: int = 0

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
    #: The table of this role's push edges (CTX: poster; GEN: waiter) and of
    #: its pull edges (the other role's).
    _edge_table: Mapping[tuple[EdgeState, EdgeEvent], Transition]
    _pull_edge_table: Mapping[tuple[EdgeState, EdgeEvent], Transition]
    #: The machines' names in errors (built once: an edge fires on every event).
    _edge_machine_name: str
    _pull_edge_machine: str

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
        #: Most chunks of one edge this rank posts at a time (poster edges).
        self.chunk_window = DEFAULT_CHUNK_WINDOW
        #: Chunks that reported ERR with more than one descriptor (unproven).
        self.unproven_chunks = 0
        #: Peer incarnations confirmed dead: the newest dead epoch per peer
        #: rank, bounded (`peer_dead`).
        self._dead_peers: collections.OrderedDict[RankNamespace, int] = collections.OrderedDict()

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
        """The OPEN recorded for an installed session: push, the GEN block
        descriptors; pull, on the reader, the CTX blocks it reads. A pull
        session on the CTX rank has none (`UnknownSessionError`)."""
        message = self._sessions.get(ticket).open
        if message is None:
            raise UnknownSessionError(f"no OPEN for the lent session {ticket.edge} of {ticket.parent.request_id!r}")
        return message

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
            # Pull edges send nothing: the reader posts its READs (`GenRank.install_pull`).
            return [SendMessage(e.ticket.ctx, e.open) for e in record.edges.values() if not e.pull and e.open]
        raise AssertionError(f"unhandled parent effect {effect}")  # pragma: no cover

    def _close(self, record: _Parent, how: str) -> None:
        for ticket in record.edges:
            self._sessions.close(ticket, how)
        del self._parents[record.key]
        self._closed_parents[record.key] = _PS.RELEASED
        while len(self._closed_parents) > _CLOSED_PARENT_MEMORY:
            self._closed_parents.popitem(last=False)

    def _is_poster(self, edge: _Edge) -> bool:
        """Whether this rank posts `edge`'s DMA (push: the CTX rank; pull: the GEN rank)."""
        return (self._role is Role.CTX) is not edge.pull

    def _table_of(self, edge: _Edge) -> Mapping[tuple[EdgeState, EdgeEvent], Transition]:
        return self._pull_edge_table if edge.pull else self._edge_table

    def _edge_machine(self, edge: _Edge) -> str:
        return self._pull_edge_machine if edge.pull else self._edge_machine_name

    def _peer_of(self, edge: _Edge) -> Endpoint:
        """The other rank of `edge`."""
        return edge.ticket.gen if self._role is Role.CTX else edge.ticket.ctx

    def _install_edge(self, record: _Parent, edge: _Edge) -> None:
        """Record `edge` of `record` in the session registry and the parent."""
        self._sessions.install(edge.ticket, edge)
        record.edges[edge.ticket] = edge

    def _install_edges(self, record: _Parent, edges: list[_Edge]) -> list[Action]:
        """Record every edge of `record` (checked already), then fire the
        parent's INSTALLED."""
        for edge in edges:
            self._install_edge(record, edge)
        return self._fire_parent(record.key, _PE.INSTALLED)

    def _check_edge_ticket(
        self, parent: ParentKey, ticket: ContextTicket, seen: set[ContextTicket], *, closed_too: bool = True
    ) -> None:
        """What every edge ticket installed here must say: this parent, our
        endpoint and digest, a peer of the other role, once (`closed_too`:
        never installed before either). Raises; changes nothing but `seen`."""
        if ticket.parent != parent:
            raise StaleError("parent", ticket.parent, parent)
        self._check_addressed(ticket)
        if ticket in seen or ticket in self._sessions or (closed_too and self._sessions.closed_how(ticket) is not None):
            raise DuplicateSessionError(ticket)
        seen.add(ticket)

    def _check_addressed(self, ticket: ContextTicket) -> None:
        """What a ticket must say to be this rank's: our endpoint (this
        incarnation), our topology digest, a peer of the other role. Raises
        `StaleError`; changes nothing."""
        if self._role is Role.CTX:
            ours, digest, peer, peer_role = ticket.ctx, ticket.ctx_digest, ticket.gen, Role.GEN
        else:
            ours, digest, peer, peer_role = ticket.gen, ticket.gen_digest, ticket.ctx, Role.CTX
        _check_endpoint(self._role.value, ours, self.our)
        if digest != self.digest:
            raise StaleError(f"{self._role.value} topology digest", digest.hex(), self.digest.hex())
        if peer.ns.role is not peer_role:
            raise StaleError(f"{peer_role.value} namespace role", peer.ns.role, peer_role)

    def _older_incarnation(self, edge: _Edge, their: Endpoint) -> bool:
        """Whether `edge`'s peer is an incarnation of `their` rank older than `their`."""
        peer = self._peer_of(edge)
        return peer.ns == their.ns and peer.epoch < their.epoch

    def _remember_dead(self, dead: Endpoint) -> None:
        known = self._dead_peers.get(dead.ns)
        if known is None or dead.epoch > known:
            # Remembered: an edge toward this incarnation installed after this
            # notice (built from a registration read before the death) is
            # proven at its install, not quarantined for good.
            self._dead_peers[dead.ns] = dead.epoch
            self._dead_peers.move_to_end(dead.ns)
            while len(self._dead_peers) > MAX_DEAD_WRITERS:
                self._dead_peers.popitem(last=False)

    def _peer_is_dead(self, edge: _Edge) -> bool:
        """Whether `edge`'s peer incarnation is confirmed dead (`peer_dead`)."""
        peer = self._peer_of(edge)
        dead_epoch = self._dead_peers.get(peer.ns)
        return dead_epoch is not None and peer.epoch <= dead_epoch

    def _fire_edge(self, edge: _Edge, event: EdgeEvent) -> list[Action]:
        if edge.pull:
            tr = _fire(self._pull_edge_machine, self._pull_edge_table, edge.state, event)
        else:
            tr = _fire(self._edge_machine_name, self._edge_table, edge.state, event)
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


