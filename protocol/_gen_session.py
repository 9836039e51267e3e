"""The GEN (decode) side of one rank: destinations of the DMA. The rules
both sides share and the module's theory of operation: _session.py."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._actions import (
    Action,
    GenEdgeSpec,
    SendMessage,
)
from ._errors import (
    IllegalTransition,
    PoolError,
    StaleError,
)
from ._messages import (
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
from ._pool import BlockRef, BlockRefs
from ._registry import DuplicateSessionError, check_descriptors
from ._session import (
    MAX_DEAD_WRITERS,
    _check_endpoint,
    _Edge,
    _Parent,
    _Rank,
)
from ._tables import (
    _EE,
    _ES,
    _FX,
    _PE,
    _PS,
    _TERMINAL_EDGE_STATES,
    _TERMINAL_EVENT,
    _WRITE_TARGET,
    GEN_EDGE_TRANSITIONS,
    GEN_PARENT_TRANSITIONS,
    Effect,
    _fire,
)
from ._ticket import ContextTicket, Endpoint, ParentKey, RankNamespace, Role

__all__ = [
    "GenRank",
    "UNKNOWN_ASKS",
]

#: How many times a GEN rank asks the writer of an UNKNOWN edge again (its
#: OPEN re-sent, `GenRank.expire`), a transfer timeout apart and doubling,
#: before it leaves the quarantine to the writer's death or a restart.
UNKNOWN_ASKS = 4


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

