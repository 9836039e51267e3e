"""The CTX (prefill) side of one rank: sources of the DMA. The rules both
sides share and the module's theory of operation: _session.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ._actions import (
    Action,
    CancelDeferred,
    CancelIntent,
    PeerBuffer,
    reject_for,
)
from ._edge_roles import _BothRoles
from ._errors import (
    AdmissionRefused,
    IllegalTransition,
    LeaseError,
    NoCapacity,
    PoolError,
    ProtocolError,
    StaleError,
)
from ._messages import (
    Cancel,
    CancelReason,
    Open,
    Receipt,
    Reject,
    SessionMessage,
    Terminal,
)
from ._pool import BlockPool, BlockRefs
from ._registry import DuplicateSessionError
from ._session import (
    DEFAULT_CHUNK_WINDOW,
    DEFAULT_QUARANTINE_LIMIT,
    DEFAULT_TRANSFER_TIMEOUT,
    _check_open_buffer,
    _Edge,
    _Parent,
)
from ._tables import (
    _EE,
    _ES,
    _FX,
    _PE,
    _PS,
    _TERMINAL_EDGE_STATES,
    CTX_EDGE_TRANSITIONS,
    CTX_PARENT_TRANSITIONS,
    GEN_EDGE_TRANSITIONS,
    _fire,
)
from ._ticket import ContextTicket, Endpoint, ParentKey, Role

__all__ = [
    "CtxRank",
]


# ---------------------------------------------------------------------------
# CTX side
# ---------------------------------------------------------------------------


class CtxRank(_BothRoles):
    """The prefill side of one rank: sources of the DMA (see the module docstring)."""

    _role = Role.CTX
    _parent_table = CTX_PARENT_TRANSITIONS
    _edge_table = CTX_EDGE_TRANSITIONS
    _pull_edge_table = GEN_EDGE_TRANSITIONS
    _edge_machine_name = "ctx-edge"
    _pull_edge_machine = "ctx-pull-edge"

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
        if edge.pull or edge.open != message:
            return None  # another OPEN under a live ticket: DUPLICATE, as before
        if edge.state not in _TERMINAL_EDGE_STATES:
            return []
        return self._edge_effect(edge, _FX.SEND_TERMINAL)

    def refuse(self, message: Open, error: ProtocolError) -> Reject | None:
        """The REJECT that answers an OPEN `receive_open` or `admit_at_open`
        refused with `error` (`reject_for`: None when the OPEN is not ours),
        and the promise it makes kept. Any REJECT but DUPLICATE tells the GEN
        rank that nothing of ours ever writes under that ticket, and the GEN
        rank releases its blocks on it. A refusal can depend on when the
        OPEN came (its parent not prefilled yet, a full pool, no agreed
        protocol), so a later copy of the same OPEN (a duplicate, a GEN
        rank's ask) could be accepted and write into blocks the GEN rank
        has reused (S1). The ticket is remembered as refused instead, and
        every copy of it is refused from then on (bounded: the registry's
        memory of closed sessions). A DUPLICATE names a session we hold: it
        stays as it is. Nothing else changes."""
        reject = reject_for(message, error, self.our)
        if reject is not None:
            self._sessions.refused(message.ticket)  # a live ticket is left alone
        return reject

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
        self._install_edge(record, edge)
        actions = self._fire_parent(record.key, _PE.EDGE_PREPARED)
        if self.is_prepared(record.key):
            actions += self._fire_parent(record.key, _PE.ALL_PREPARED)
        return actions

    def _check_open_ticket(self, message: Open, num_chunks: int) -> None:
        """What an OPEN must say whatever this rank holds: addressed to us,
        our topology, from a GEN rank, its buffer of the ticket's GEN
        incarnation, at least one chunk. Raises; changes nothing."""
        ticket = message.ticket
        self._check_addressed(ticket)
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

    def lend(self, parent: ParentKey, readers: Mapping[ContextTicket, int], *, lend_seq: int, now: float) -> list[Action]:
        """Pull: lend the RESIDENT parent's blocks to the GEN ranks that
        `readers` name (one ticket per edge of the parent here, each with the
        bytes its reader reads), under this rank's number `lend_seq` for the
        lend (increasing in an incarnation: `LendMemory`).

        From now on a READ may be in flight whenever a reader holds the
        ticket, so the parent is DECIDED at once and its blocks come back
        only on each reader's word (its TERMINAL), its confirmed death, or,
        past the lease deadline, a FENCE it answered (the cancel's CANCEL to
        each reader). Call it before the ticket leaves this rank. Raises
        (`LeaseError`, `StaleError`, `DuplicateSessionError`,
        `IllegalTransition`) and changes nothing if the parent is not
        RESIDENT with no edge, a ticket does not name this parent, our
        endpoint and digest and a GEN peer, or the count is not the
        parent's edges here."""
        record = self._require(parent)
        _fire(self._machine("parent"), self._parent_table, record.state, _PE.DECIDED)  # validate
        if record.state is not _PS.RESIDENT or record.edges:
            raise LeaseError(f"{parent!r}: only a resident parent with no edge is lent (state {record.state.value})")
        if lend_seq < 1:
            raise LeaseError(f"a lend is numbered from 1, got {lend_seq}")
        if len(readers) != self._edges_of(record):
            raise LeaseError(f"{len(readers)} reader(s) for a parent of {self._edges_of(record)} edge(s) here")
        seen: set[ContextTicket] = set()
        for ticket, nbytes in readers.items():
            self._check_edge_ticket(parent, ticket, seen)
            if nbytes < 0:
                raise LeaseError(f"negative bytes {nbytes} for a reader")
        for ticket, nbytes in readers.items():
            edge = _Edge(
                ticket=ticket, state=_ES.OPEN_PROPOSED, open=None, expected_bytes=nbytes, pull=True, lend_seq=lend_seq
            )
            self._install_edge(record, edge)
        actions = self._fire_parent(parent, _PE.DECIDED)
        record.deadline = record.lease_deadline
        if self._dead_peers:  # a reader already confirmed dead reads nothing
            actions += self._dead_proof(record, now)
        return actions

    def _lent(self, ticket: ContextTicket) -> bool:
        """Whether `ticket` names a session this rank lent (pull)."""
        edge = self._sessions.find(ticket)
        return edge is not None and edge.pull

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
            case Terminal() if self._lent(message.ticket):
                return self.receive_terminal(message, now)  # a reader's word on a lent edge
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
            actions += self._expire_edges(record, now)
        return actions

    # ---- internals -----------------------------------------------------

    def _cancel(
        self, record: _Parent, reason: CancelReason, now: float, *, intent: bool
    ) -> list[Action]:
        lent = any(e.pull for e in record.edges.values())
        if not (self.conservative and record.state is _PS.DECIDED) or lent:
            # A lent parent's transfer is its reader's: the FENCE is how it ends.
            return super()._cancel(record, reason, now, intent=intent)
        # Conservative path: the decided transfer runs to its end (or to its
        # deadline); the cancel is recorded and applies when the edges settle.
        self._fire_parent(record.key, _PE.DEFER_CANCEL)
        record.cancel_reason = reason
        actions: list[Action] = [CancelDeferred(record.key)]
        if intent:
            actions.append(CancelIntent(record.key, reason))
        return actions + self._settle(record, now)
