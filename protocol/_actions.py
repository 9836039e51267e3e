"""What a rank session hands its actor: the typed actions it performs in
order (send a frame, post a chunk, release, quarantine ...), the parent's
local outcome, the peer buffer an OPEN names, an edge's evidence, and the
REJECT a refused OPEN is answered with (`reject_for`)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Union

from ._errors import (
    AdmissionRefused,
    NegotiationError,
    NoCapacity,
    PoolError,
    ProtocolError,
    UnknownSessionError,
)
from ._messages import (
    BufferInfo,
    CancelReason,
    Open,
    Reject,
    RejectReason,
    SessionMessage,
    TerminalKind,
)
from ._pool import BlockRefs
from ._registry import DuplicateSessionError
from ._tables import (
    EdgeState,
    ParentEvent,
    ParentState,
)
from ._ticket import ContextTicket, Endpoint, ParentKey

__all__ = [
    "LocalOutcome",
    "PeerBuffer",
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
    "EdgeEvidence",
    "GenEdgeSpec",
    "PullEdgeSpec",
    "ADMISSION_REFUSALS",
    "reject_for",
]


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


@dataclass(frozen=True, slots=True)
class PullEdgeSpec:
    """What a reading GEN actor knows about one pull edge before it posts
    READs (`GenRank.install_pull`).

    `source` names the CTX rank's lent blocks as an OPEN names a GEN rank's
    (the actor builds it from the block ids the ticket carries and the CTX
    agent's registered buffer); `peer`, when known, is that registered
    buffer, and every block of `source` must be a whole block of it.
    `lend_seq` is the CTX rank's number for the lend, `num_chunks` how many
    READ chunks the actor splits the edge into, `expected_bytes` what they
    read in all.
    """

    ticket: ContextTicket
    source: BufferInfo
    num_tokens: int
    lend_seq: int
    num_chunks: int
    expected_bytes: int
    block_bytes: int | None = None
    peer: PeerBuffer | None = None


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


