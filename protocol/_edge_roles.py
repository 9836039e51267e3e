"""The two edge roles of a handoff, whichever side plays them.

Every edge has a *poster*, the rank that posts its DMA and polls it to an
end, and a *waiter*, the rank whose blocks that DMA touches without a poll
of its own. In push (the default) the CTX rank posts WRITEs from its blocks
into the GEN rank's: the CTX rank is the poster, the GEN rank the waiter. In
pull the GEN rank posts READs from the CTX rank's blocks into its own: the
roles swap, the machines do not. The poster runs the CTX edge table
(PREPARED -> POSTING -> COMPLETED, or DRAINING -> DRAINED, or UNKNOWN) and
sends TERMINAL with its evidence; the waiter runs the GEN edge table and may
let its blocks go only on that evidence, the poster's refusal or the
poster's death proof. A waiter's cancel is its CANCEL (in pull: the FENCE
that asks a reader to stop or never start), and the poster's TERMINAL
answers it (in pull: DONE, or FENCED as NOT_STARTED).

`_PosterEdges` and `_WaiterEdges` hold each role's rules; `_BothRoles`
dispatches an edge to its role (`_Rank._is_poster`). `CtxRank` and `GenRank`
are both, so a rank may hold push and pull edges at once.
"""

from __future__ import annotations

from ._actions import Action, Drain, PostChunk, SendMessage
from ._errors import IllegalTransition, PoolError, StaleError
from ._messages import (
    Cancel,
    CancelReason,
    Ready,
    Receipt,
    Reject,
    RejectReason,
    Terminal,
    TerminalKind,
)
from ._session import _Edge, _Parent, _Rank
from ._tables import (
    _EE,
    _ES,
    _EVIDENCE_OF,
    _FX,
    _PS,
    _TERMINAL_EDGE_STATES,
    _TERMINAL_EVENT,
    Effect,
    _fire,
)
from ._ticket import ContextTicket, Endpoint

__all__ = ["UNKNOWN_ASKS"]

#: How many times a waiter asks the poster of an UNKNOWN edge again (push:
#: its OPEN re-sent; pull: its FENCE), a transfer timeout apart and
#: doubling, before it leaves the quarantine to the poster's death or a
#: restart.
UNKNOWN_ASKS = 4

_POSTER_EFFECTS = frozenset((_FX.SEND_READY, _FX.POST, _FX.SEND_TERMINAL, _FX.STOP_AND_DRAIN))


class _PosterEdges(_Rank):
    """The edges whose DMA this rank posts (push: CTX WRITEs; pull: GEN READs)."""

    def chunk_done(self, ticket: ContextTicket, index: int, nbytes: int, now: float) -> list[Action]:
        """A posted chunk reported DONE with `nbytes` moved."""
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
        one failing does not end the others, whose bytes may still land: the
        chunk stays in flight, unproven, and the edge is UNKNOWN at once
        (quarantine until a proof: the waiter's TERMINAL cannot give one; a
        death or restart of this incarnation does, and so does the peer's
        confirmed death, `_peer_death_ends_writes`)."""
        if type(descriptors) is not int or descriptors < 0:
            raise PoolError(f"descriptors must be an int >= 0, got {descriptors!r}")
        edge = self._posted_edge(ticket, index)
        record = self._parents[ticket.parent]
        if descriptors > 1 and not self._peer_death_ends_writes(edge):
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
        edge loses quiescence: UNKNOWN, TERMINAL(UNKNOWN) to the waiter, and
        the parent is quarantined once every edge is terminal."""
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
        DMA we posted for it has ended (polled from the initiator), so the
        edge is DRAINED after all; its TERMINAL(DRAINED) is the waiter's
        proof too. The parent is reclaimed once no edge is UNKNOWN. In push,
        toward a GEN incarnation confirmed dead, chunks that ended in ERR
        with several descriptors count as ended too: their other writes can
        land only in the dead process, and our blocks are only read."""
        if edge.in_flight and not (self._peer_death_ends_writes(edge) and edge.in_flight <= edge.unproven):
            return []
        edge.in_flight.clear()
        edge.unproven.clear()
        actions = self._prove_quiescent(edge)
        return actions + self._settle(self._parents[edge.ticket.parent], now)

    def _peer_death_ends_writes(self, edge: _Edge) -> bool:
        """Whether the peer's confirmed death ends what `edge`'s posted DMA
        may still do to blocks that matter: in push the writes land in the
        GEN rank's blocks, and a dead process's memory matters to nobody; in
        pull they land in ours, but only with bytes the CTX process serves,
        and a dead one serves none (found by the explorer: a READ that
        failed part-way kept the reader quarantined for good after its
        source died)."""
        return self._peer_is_dead(edge)

    def receive_receipt(self, message: Receipt) -> list[Action]:
        """The waiter acknowledged the bytes of a COMPLETED edge (not quiescence, not completion)."""
        edge = self._sessions.get(message.ticket)
        _fire(self._edge_machine(edge), self._table_of(edge), edge.state, _EE.RECEIPT_RECEIVED)
        if message.bytes_received != edge.bytes_done:
            raise StaleError("receipt bytes", message.bytes_received, edge.bytes_done)
        edge.receipt_bytes = message.bytes_received
        return self._fire_edge(edge, _EE.RECEIPT_RECEIVED)

    def _poster_reject(self, edge: _Edge, now: float) -> list[Action]:
        """The waiter refused one of our messages for this session: it no longer wants the DMA."""
        record = self._parents[edge.ticket.parent]
        if record.cancel_reason is not None or record.state is _PS.QUARANTINED:
            return []
        return self._cancel(record, CancelReason.PEER, now, intent=True)

    def _posted_edge(self, ticket: ContextTicket, index: int) -> _Edge:
        edge = self._sessions.get(ticket)
        if index not in edge.in_flight:
            raise PoolError(f"chunk {index} of edge {ticket.edge} is not in flight")
        return edge

    def _stop_finishing(self, record: _Parent, now: float) -> list[Action]:
        """Conservative path given up (deadline passed, or a chunk failed): the
        edges stop posting and drain, as a cancel on the active path would."""
        actions: list[Action] = []
        for edge in record.edges.values():
            if edge.state not in _TERMINAL_EDGE_STATES and edge.state is not _ES.DRAINING:
                actions += self._cancel_edge(edge, now)
        return actions

    def _poster_cancel_edge(self, edge: _Edge, now: float) -> list[Action]:
        if edge.state is _ES.POSTING:
            edge.deadline = now + self.transfer_timeout
        actions = self._fire_edge(edge, _EE.CANCEL)
        if edge.state is _ES.DRAINING and not edge.in_flight:
            actions += self._fire_edge(edge, _EE.DRAIN_DONE)
        return actions

    def _poster_effect(self, edge: _Edge, effect: Effect) -> list[Action]:
        to = self._peer_of(edge)
        if effect is _FX.SEND_READY:
            # Pull: the reader itself is what READY would tell; nothing to send.
            return [] if edge.pull else [SendMessage(to, Ready(ticket=edge.ticket))]
        if effect is _FX.POST:
            return self._post_more(edge)
        if effect is _FX.SEND_TERMINAL:
            return [self._terminal_of(edge)]
        if effect is _FX.STOP_AND_DRAIN:
            assert edge.deadline is not None
            return [Drain(edge.ticket, tuple(sorted(edge.in_flight)), edge.deadline)]
        raise AssertionError(f"unhandled poster edge effect {effect}")  # pragma: no cover

    def _terminal_of(self, edge: _Edge) -> SendMessage:
        """The TERMINAL that carries terminal `edge`'s evidence to its waiter."""
        kind = _EVIDENCE_OF[edge.state]
        nbytes = edge.bytes_done if kind is TerminalKind.COMPLETED else 0
        return SendMessage(self._peer_of(edge), Terminal(ticket=edge.ticket, evidence=kind, bytes_done=nbytes))

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

    def _posters_restarted(self, their: Endpoint, now: float) -> list[Action]:
        """`their` came back with a newer epoch: the sessions we post for its
        old one are dead. Edges with chunks in flight cannot be proven
        quiescent (UNKNOWN); the parent is cancelled and the others drain or
        never start. In pull an edge that ended already is left as it is."""
        actions: list[Action] = []
        for record in list(self._parents.values()):
            hit = [
                e
                for e in record.edges.values()
                if self._is_poster(e)
                and self._older_incarnation(e, their)
                and not (e.pull and e.state in _TERMINAL_EDGE_STATES)
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

    def _posters_of_dead(self, now: float) -> list[Action]:
        """An UNKNOWN edge we post for a confirmed-dead peer incarnation, whose
        every chunk has ended at the initiator or failed part-way, is proven
        (`_late_drain`, `_peer_death_ends_writes`)."""
        actions: list[Action] = []
        for record in list(self._parents.values()):
            for edge in list(record.edges.values()):
                if (
                    record.key in self._parents
                    and self._is_poster(edge)
                    and edge.state is _ES.UNKNOWN
                    and self._peer_death_ends_writes(edge)
                ):
                    actions += self._late_drain(edge, now)
        return actions


class _WaiterEdges(_Rank):
    """The edges whose DMA touches this rank's blocks with no poll of ours
    (push: the GEN destination; pull: the CTX source)."""

    def receive_terminal(self, message: Terminal, now: float) -> list[Action]:
        """TERMINAL evidence for an exact session.

        COMPLETED with the expected bytes -> RECEIPT (push); COMPLETED with
        other bytes is quiescent but wrong, so it counts as DRAINED and
        cancels the parent; NOT_STARTED/DRAINED cancel the parent (siblings);
        UNKNOWN quarantines.
        """
        edge = self._sessions.get(message.ticket)
        if self._is_poster(edge):
            # Only the poster's word ends a wait: a TERMINAL about an edge we
            # post ourselves proves nothing (our own polls do).
            raise IllegalTransition(self._edge_machine(edge), edge.state, "terminal from the waiter")
        record = self._parents[edge.ticket.parent]
        event = _TERMINAL_EVENT[message.evidence]
        bad_bytes = message.evidence is TerminalKind.COMPLETED and message.bytes_done != edge.expected_bytes
        if bad_bytes:
            event = _EE.TERMINAL_DRAINED
        if edge.state is _ES.UNKNOWN and message.evidence is not TerminalKind.UNKNOWN:
            # The poster sends a TERMINAL other than UNKNOWN only once every
            # chunk it posted on this edge was polled to DONE/ERR: a late proof.
            event = _EE.QUIESCENCE_PROVEN
        tr = _fire(self._edge_machine(edge), self._table_of(edge), edge.state, event)  # validate first
        if tr.next is _ES.COMPLETED and edge.state is not _ES.COMPLETED:
            edge.bytes_done = message.bytes_done  # what the RECEIPT acknowledges
        actions = self._fire_edge(edge, event)
        if (
            edge.state is not _ES.COMPLETED
            and record.cancel_reason is None
            and record.state not in (_PS.QUARANTINED, _PS.DECODE_READY)
        ):
            reason = CancelReason.FAILURE if bad_bytes or edge.state is _ES.UNKNOWN else CancelReason.PEER
            actions += self._cancel(record, reason, now, intent=True)
        return actions + self._settle(record, now)

    def _waiter_reject(self, edge: _Edge, message: Reject, now: float) -> list[Action]:
        """The poster refused our OPEN: it never recorded it, so the edge is NOT_STARTED.

        A DUPLICATE reject means an earlier copy of the OPEN *was* recorded: no change.
        """
        if message.reason is RejectReason.DUPLICATE:
            return []
        record = self._parents[edge.ticket.parent]
        actions = self._fire_edge(edge, _EE.REJECTED)
        if record.cancel_reason is None and record.state not in (_PS.QUARANTINED, _PS.DECODE_READY):
            actions += self._cancel(record, CancelReason.PEER, now, intent=True)
        return actions + self._settle(record, now)

    def _ask_again(self, record: _Parent, now: float) -> list[Action]:
        """Ask the poster of each UNKNOWN edge of quarantined `record` what
        became of it, at once and then a transfer timeout later, doubling,
        `UNKNOWN_ASKS` times in all: in push our OPEN again (the CTX answers
        with `open_again`: its TERMINAL resent, or a REJECT: no session of
        the writer's can write); in pull our FENCE again (the reader answers
        with its TERMINAL). Past the last ask the quarantine waits for the
        poster's death, or counts toward the admission stop and its planned
        restart."""
        actions: list[Action] = []
        for edge in record.edges.values():
            due = edge.deadline is None or now >= edge.deadline
            if not self._is_poster(edge) and edge.state is _ES.UNKNOWN and due and edge.asks < UNKNOWN_ASKS:
                edge.asks += 1
                edge.deadline = now + self.transfer_timeout * (1 << (edge.asks - 1))
                ask = self._fence_of(edge, record) if edge.pull else edge.open
                assert ask is not None
                actions.append(SendMessage(self._peer_of(edge), ask))
        return actions

    def _fence_of(self, edge: _Edge, record: _Parent) -> Cancel:
        """Pull: the CANCEL that fences a reader off this edge's blocks."""
        return Cancel(ticket=edge.ticket, reason=record.cancel_reason or CancelReason.PEER, lend_seq=edge.lend_seq)

    def _waiters_restarted(self, their: Endpoint, now: float) -> list[Action]:
        """`their` came back with a newer epoch: edges still waiting on the
        old one can never get TERMINAL, and its DMA is unproven: UNKNOWN."""
        actions: list[Action] = []
        for record in list(self._parents.values()):
            hit = [
                e
                for e in record.edges.values()
                if not self._is_poster(e) and self._older_incarnation(e, their) and e.state not in _TERMINAL_EDGE_STATES
            ]
            for edge in hit:
                actions += self._fire_edge(edge, _EE.QUIESCENCE_LOST)
            if hit:
                actions += self._settle(record, now)
        return actions

    def _dead_proof(self, record: _Parent, now: float) -> list[Action]:
        """Apply every confirmed death of a poster to `record`'s waiter
        edges: an edge whose poster incarnation is dead (or older than a dead
        one) and still waits, or is UNKNOWN, is proven quiescent (a dead
        process posts no DMA); a parent it hit that still expected the DMA
        (GEN installed, CTX lent) is cancelled as failed."""
        hit = [
            e
            for e in record.edges.values()
            if not self._is_poster(e)
            and self._peer_is_dead(e)
            and (e.state is _ES.UNKNOWN or e.state not in _TERMINAL_EDGE_STATES)
        ]
        if not hit:
            return []
        actions: list[Action] = []
        for edge in hit:
            actions += self._prove_quiescent(edge)
        if record.cancel_reason is None and record.state in (_PS.INSTALLED, _PS.DECIDED):
            actions += self._cancel(record, CancelReason.FAILURE, now, intent=True)
        actions += self._settle(record, now)
        return actions

    def _waiter_cancel_edge(self, edge: _Edge, now: float) -> list[Action]:
        if edge.state not in _TERMINAL_EDGE_STATES and edge.deadline is None:
            edge.deadline = now + self.transfer_timeout
        return self._fire_edge(edge, _EE.CANCEL)

    def _waiter_effect(self, edge: _Edge, effect: Effect) -> list[Action]:
        to = self._peer_of(edge)
        record = self._parents[edge.ticket.parent]
        if effect is _FX.SEND_CANCEL:
            if edge.pull:
                return [SendMessage(to, self._fence_of(edge, record))]
            reason = record.cancel_reason or CancelReason.PEER
            return [SendMessage(to, Cancel(ticket=edge.ticket, reason=reason))]
        if effect is _FX.SEND_RECEIPT:
            # Pull: the reader counted its own bytes; nothing waits for a RECEIPT.
            return [] if edge.pull else [SendMessage(to, Receipt(ticket=edge.ticket, bytes_received=edge.bytes_done))]
        raise AssertionError(f"unhandled waiter edge effect {effect}")  # pragma: no cover


class _BothRoles(_PosterEdges, _WaiterEdges):
    """A rank that may hold edges of both roles: each edge goes to its role's rules."""

    def receive_reject(self, message: Reject, now: float) -> list[Action]:
        """The peer refused one of our messages for an exact session."""
        edge = self._sessions.get(message.ticket)
        if self._is_poster(edge):
            return self._poster_reject(edge, now)
        return self._waiter_reject(edge, message, now)

    def receive_cancel(self, message: Cancel, now: float) -> list[Action]:
        """A peer's CANCEL for an exact installed session: cancel the parent.
        In pull, a CANCEL from the lender is its FENCE, and it asks again
        for the word of an edge that ended already (the TERMINAL was lost,
        or is late): our TERMINAL again, its evidence unchanged."""
        edge = self._sessions.get(message.ticket)
        poster = edge.pull and self._is_poster(edge)
        again = [self._terminal_of(edge)] if poster and edge.state in _TERMINAL_EDGE_STATES else []
        return again + super().receive_cancel(message, now)

    def peer_restarted(self, their: Endpoint, now: float) -> list[Action]:
        """A peer rank came back with a newer epoch: its old sessions are dead.
        Edges we post for it with chunks in flight cannot be proven quiescent
        (UNKNOWN), the others are cancelled and drain or never start; edges
        that wait on its DMA can never get TERMINAL: UNKNOWN."""
        return self._posters_restarted(their, now) + self._waiters_restarted(their, now)

    def peer_dead(self, dead: Endpoint, now: float) -> list[Action]:
        """Peer incarnation `dead` (and every older one) is confirmed dead.

        Edges we post for it: its death does not end DMA we posted (only
        polling it to DONE/ERR does), so first this is `peer_restarted` for
        every epoch up to `dead`'s; then an UNKNOWN edge whose every chunk
        ended at the initiator (DONE, or ERR with any number of descriptors)
        is proven (`_peer_death_ends_writes`). Edges that wait on its DMA: a dead process
        posts none, so every such edge is proven quiescent, UNKNOWN ones
        included; one still waiting cancels its parent. A quarantined parent
        with no UNKNOWN edge left is reclaimed (docs/design.md "Quarantine
        and reclaim")."""
        self._remember_dead(dead)
        actions = self._posters_restarted(Endpoint(ns=dead.ns, epoch=dead.epoch + 1), now)
        for record in list(self._parents.values()):
            actions += self._dead_proof(record, now)
        return actions + self._posters_of_dead(now)

    def _expire_edges(self, record: _Parent, now: float) -> list[Action]:
        """The edge deadlines of `record` that passed at `now`: a cancelled
        edge still without its terminal evidence (a poster's drain, a
        waiter's wait for TERMINAL) becomes UNKNOWN; a quarantined parent
        asks the posters of its UNKNOWN edges again."""
        actions: list[Action] = []
        if record.state in (_PS.CANCELLING, _PS.FINISHING):
            for edge in record.edges.values():
                if edge.state not in _TERMINAL_EDGE_STATES and edge.deadline is not None and now >= edge.deadline:
                    actions += self._fire_edge(edge, _EE.QUIESCENCE_LOST)
            actions += self._settle(record, now)
        if record.state is _PS.QUARANTINED:
            actions += self._ask_again(record, now)
        return actions

    def _cancel_edge(self, edge: _Edge, now: float) -> list[Action]:
        if self._is_poster(edge):
            return self._poster_cancel_edge(edge, now)
        return self._waiter_cancel_edge(edge, now)

    def _edge_effect(self, edge: _Edge, effect: Effect) -> list[Action]:
        if effect in _POSTER_EFFECTS:
            return self._poster_effect(edge, effect)
        return self._waiter_effect(edge, effect)
