"""The GEN (decode) side of one rank: destinations of the DMA. The rules
both sides share and the module's theory of operation: _session.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._actions import Action, GenEdgeSpec, PullEdgeSpec, SendMessage
from ._edge_roles import UNKNOWN_ASKS, _BothRoles
from ._errors import IllegalTransition, PoolError, StaleError
from ._lends import LendMemory
from ._messages import (
    BufferInfo,
    Cancel,
    CancelReason,
    Open,
    Ready,
    Reject,
    SessionMessage,
    Terminal,
    TerminalKind,
    block_columns,
)
from ._pool import BlockRef, BlockRefs
from ._registry import check_descriptors
from ._session import _check_open_buffer, _Edge, _Parent
from ._tables import (
    _EE,
    _ES,
    _PE,
    _PS,
    _WRITE_TARGET,
    CTX_EDGE_TRANSITIONS,
    GEN_EDGE_TRANSITIONS,
    GEN_PARENT_TRANSITIONS,
    EdgeState,
    _fire,
)
from ._ticket import ContextTicket, ParentKey, Role

__all__ = [
    "GenRank",
    "UNKNOWN_ASKS",
]



# ---------------------------------------------------------------------------
# GEN side
# ---------------------------------------------------------------------------


def _new_edge(spec: GenEdgeSpec | PullEdgeSpec, state: EdgeState, buffer: BufferInfo, **more: Any) -> _Edge:
    """A GEN edge of `spec` in `state`: its OPEN names `buffer` (ours for
    push, the CTX blocks it READs for pull)."""
    return _Edge(
        ticket=spec.ticket,
        state=state,
        open=Open(ticket=spec.ticket, buffer=buffer, num_tokens=spec.num_tokens),
        expected_bytes=spec.expected_bytes,
        **more,
    )


class GenRank(_BothRoles):
    """The decode side of one rank: destinations of the DMA (see the module docstring)."""

    _role = Role.GEN
    _parent_table = GEN_PARENT_TRANSITIONS
    _edge_table = GEN_EDGE_TRANSITIONS
    _pull_edge_table = CTX_EDGE_TRANSITIONS
    _edge_machine_name = "gen-edge"
    _pull_edge_machine = "gen-pull-edge"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Pull: the lends this rank read or was fenced off, per CTX incarnation.
        self._lends = LendMemory()

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
        record = self._installing(parent, edges)
        seen: set[ContextTicket] = set()
        for spec in edges:
            ticket = spec.ticket
            if spec.buffer.endpoint_epoch != self.our.epoch:
                raise StaleError(
                    "gen epoch in buffer info", spec.buffer.endpoint_epoch, self.our.epoch
                )
            self._check_edge_ticket(parent, ticket, seen, closed_too=False)
            if spec.expected_bytes < 0:
                raise PoolError(f"negative expected bytes {spec.expected_bytes}")
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
        actions = self._install_edges(record, [_new_edge(spec, _ES.OPEN_PROPOSED, spec.buffer) for spec in edges])
        if self._dead_peers:  # an edge toward a writer already confirmed dead
            actions += self._dead_proof(record, now)
        return actions

    def install_pull(self, parent: ParentKey, edges: Sequence[PullEdgeSpec], now: float) -> list[Action]:
        """Pull: install the parent's edges as READs of the CTX blocks each
        spec names, and post each edge's first window of chunks (no OPEN, no
        round: the CTX rank lent the blocks to this rank before the ticket
        left it, `CtxRank.lend`).

        Every check runs before anything is recorded: each ticket names this
        parent, our endpoint and digest and a CTX peer; the lend was neither
        read nor fenced off here before (`lend_seq` above the CTX
        incarnation's floor and not remembered: a lend is read once); the
        CTX incarnation is not one confirmed dead; `source` names one whole
        block of the CTX agent's registered buffer (`peer`, when given) per
        block of our lease, each `block_bytes` long. Raises `StaleError`,
        `LeaseError`, `PoolError` or `DuplicateSessionError`; nothing changes.
        """
        record = self._installing(parent, edges)
        seen: set[ContextTicket] = set()
        for spec in edges:
            ticket = spec.ticket
            self._check_edge_ticket(parent, ticket, seen)
            if spec.lend_seq < 1:
                raise PoolError(f"a lend is numbered from 1, got {spec.lend_seq}")
            if self._lends.used(ticket.ctx, spec.lend_seq):
                raise StaleError("lend (read or fenced here before)", spec.lend_seq, f"> {self._lends.floor(ticket.ctx)}, unused")
            dead_epoch = self._dead_peers.get(ticket.ctx.ns)
            if dead_epoch is not None and ticket.ctx.epoch <= dead_epoch:
                raise StaleError("ctx incarnation (confirmed dead)", ticket.ctx.epoch, f"> {dead_epoch}")
            if spec.num_chunks < 1:
                raise PoolError(f"an edge needs at least one chunk, got {spec.num_chunks}")
            if spec.expected_bytes < 0:
                raise PoolError(f"negative expected bytes {spec.expected_bytes}")
            source = Open(ticket=ticket, buffer=spec.source, num_tokens=spec.num_tokens)
            _check_open_buffer(
                source, len(record.refs), expected_agent=None, block_bytes=spec.block_bytes, peer=spec.peer
            )
        record.deadline = now + self.transfer_timeout
        for spec in edges:
            self._lends.mark(spec.ticket.ctx, spec.lend_seq)
        actions = self._install_edges(record, [
            _new_edge(spec, _ES.PREPARED, spec.source, num_chunks=spec.num_chunks, pull=True, lend_seq=spec.lend_seq)
            for spec in edges
        ])
        for edge in list(record.edges.values()):
            actions += self._fire_edge(edge, _EE.DECIDED)
        return actions + self._settle(record, now)

    def fence(self, message: Cancel, now: float) -> list[Action]:
        """Pull: a CTX rank's FENCE (a CANCEL with its `lend_seq`) for a lend
        this rank holds no session of. It never reads that lend from now on
        (remembered: a later `install_pull` of it raises) and answers with
        its word: NOT_STARTED if it never used the lend, DRAINED if it read
        it and its session ended already (nothing of it is in flight). A
        FENCE not addressed to this incarnation raises `StaleError`;
        nothing changes."""
        ticket = message.ticket
        self._check_addressed(ticket)
        if message.lend_seq < 1:
            raise PoolError(f"a FENCE names a lend numbered from 1, got {message.lend_seq}")
        if ticket in self._sessions:
            return self.receive_cancel(message, now)
        read = self._lends.used(ticket.ctx, message.lend_seq)
        self._lends.mark(ticket.ctx, message.lend_seq)
        kind = TerminalKind.DRAINED if read else TerminalKind.NOT_STARTED
        return [SendMessage(ticket.ctx, Terminal(ticket=ticket, evidence=kind))]

    def _installing(self, parent: ParentKey, edges: Sequence[object]) -> _Parent:
        """The record of `parent`, whose edges (`edges`, at least one) may be
        installed now: raises, changing nothing, where they may not."""
        record = self._require(parent)
        _fire(self._machine("parent"), self._parent_table, record.state, _PE.INSTALLED)  # validate
        if not edges:
            raise PoolError("a session needs at least one edge")
        return record

    def snapshot(self) -> tuple[object, ...]:
        """What `_Rank.snapshot` pictures, and the lends this rank used."""
        return (*super().snapshot(), self._lends.snapshot())

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

    def receive(self, message: SessionMessage, now: float) -> list[Action]:
        """Dispatch a received message (READY, TERMINAL, REJECT, CANCEL) to its handler."""
        match message:
            case Ready():
                return self.receive_ready(message, now)
            case Terminal():
                return self.receive_terminal(message, now)
            case Reject():
                return self.receive_reject(message, now)
            case Cancel() if message.lend_seq:
                return self.fence(message, now)  # a lender's FENCE (pull)
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
            actions += self._expire_edges(record, now)
        return actions

    # ---- internals -----------------------------------------------------
