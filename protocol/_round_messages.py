"""The agreement rounds' messages and errors (docs/design.md "Agreement rounds").

What a round carries between the leader (the coordinator) and its followers
(the ranks): `AdmissionRequest`, `RoundProposal`, `RoundVote`, `RankReport`,
`RoundDecision`, `RoundTimedOut`, each a frozen, bounded msgspec struct; and
the typed errors a leader or follower raises when it refuses one
(`VoteRejected` with its `VoteRejectReason`, `StaleEpochError`,
`RoundOrderError`). The logic that runs the rounds is `_rounds`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Annotated

import msgspec
from msgspec import Meta

from ._errors import RoundError, StaleError, _detailed
from ._messages import MAX_BLOCKS_PER_OPEN
from ._ticket import DIGEST_LEN, MAX_ID_LEN, ParentKey

__all__ = [
    "MAX_ROUND_ITEMS",
    "MAX_REQUEST_BLOCKS",
    "AdmissionRequest",
    "RoundProposal",
    "RoundVote",
    "RankReport",
    "RoundDecision",
    "RoundTimedOut",
    "VoteRejectReason",
    "VoteRejected",
    "StaleEpochError",
    "RoundOrderError",
]


#: Most parents one tuple of a round message may name (bounds decode work).
MAX_ROUND_ITEMS = 4096
#: Most block ids one admission may name (an engine's block table of one
#: request): what one OPEN can carry to a GEN rank (`MAX_BLOCKS_PER_OPEN`).
MAX_REQUEST_BLOCKS = MAX_BLOCKS_PER_OPEN

_U63 = Annotated[int, Meta(ge=0, le=2**63 - 1)]
_RoundNo = Annotated[int, Meta(ge=1, le=2**63 - 1)]
_Rank = Annotated[int, Meta(ge=0, lt=4096)]
_Tokens = Annotated[int, Meta(ge=0, lt=2**32)]
_BlockId = Annotated[int, Meta(ge=0, lt=2**32)]
_Digest = Annotated[bytes, Meta(min_length=DIGEST_LEN, max_length=DIGEST_LEN)]
_Parents = Annotated[tuple[ParentKey, ...], Meta(max_length=MAX_ROUND_ITEMS)]
_Ranks = Annotated[tuple[_Rank, ...], Meta(max_length=4096)]


class _Frozen(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


def _sort_key(parent: ParentKey) -> tuple[str, int, int]:
    return (parent.request_id, parent.ctx_attempt, parent.gen_attempt)


def _sorted(parents: Iterable[ParentKey]) -> tuple[ParentKey, ...]:
    return tuple(sorted(set(parents), key=_sort_key))


class AdmissionRequest(_Frozen, frozen=True):
    """One client admission in a proposal: the parent and its size."""

    parent: ParentKey
    num_tokens: _Tokens
    #: GEN: return the blocks as soon as the request is decode-ready and its
    #: bytes are verified (nobody consumes them: demos, benchmarks, a driver
    #: that only moves KV). False keeps them for the consumer's ``free``.
    release_when_ready: bool = False
    #: The block ids this instance's engine chose for the request, one per
    #: block (the same ids on every rank of the instance, as engines keep one
    #: block table per instance); empty: each rank leases free blocks itself.
    blocks: Annotated[tuple[_BlockId, ...], Meta(max_length=MAX_REQUEST_BLOCKS)] = ()
    #: The instance of the other role this parent pairs with (a fleet has
    #: many): GEN ranks open to that CTX instance, CTX ranks expect the edges
    #: of that GEN instance's TP. Empty: the instance's one configured peer.
    peer_instance: Annotated[str, Meta(max_length=MAX_ID_LEN, pattern=r"^[A-Za-z0-9_.:\-]*$")] = ""


class RoundProposal(_Frozen, frozen=True, tag="round_proposal"):
    """What the leader asks every rank to vote on in round ``round_no``."""

    round_no: _RoundNo
    topology_digest: _Digest | None = None
    admissions: Annotated[tuple[AdmissionRequest, ...], Meta(max_length=MAX_ROUND_ITEMS)] = ()
    cancels: _Parents = ()
    #: failures the coordinator injects (e.g. parents of a restarted rank)
    failures: _Parents = ()


class _RankNews(_Frozen, frozen=True):
    """What a rank tells its leader about its parents, in a vote or a report.

    ``epoch`` is the endpoint epoch of the rank actor incarnation that sent
    it: news from an older incarnation is stale (invariant S3).
    """

    rank: _Rank
    epoch: _U63
    cancels: _Parents = ()
    completions: _Parents = ()
    failures: _Parents = ()
    #: parents whose every local edge is prepared on this rank (CTX: ready to decide)
    prepared: _Parents = ()


class RoundVote(_RankNews, frozen=True, kw_only=True, tag="round_vote"):
    """One rank's answer to one proposal: its news, and the admissions of
    the proposal it leased (``admit_ok``)."""

    round_no: _RoundNo
    admit_ok: _Parents = ()


class RankReport(_RankNews, frozen=True, kw_only=True, tag="rank_report"):
    """News a rank pushes to its leader between rounds (one way, no reply).

    The same sets a vote carries, minus ``admit_ok`` (only a proposal can ask
    for a lease): the leader decides a round without admissions from the
    latest report of every rank instead of asking for votes, which takes one
    fan-out off every such round. ``seq`` orders the reports of one
    incarnation (a report older than the stored one is ignored); a report of
    another incarnation is refused like a vote.
    """

    seq: _U63
    #: parents this rank admitted alone (a one-rank instance is its whole
    #: admission intersection), held here still: the leader takes them in
    #: flight as if a round had admitted them (`RoundLeader.report`)
    admitted: _Parents = ()


class RoundDecision(_Frozen, frozen=True, tag="round_decision"):
    """The outcome of round ``round_no``; every tuple is sorted and the tuples
    are pairwise disjoint (one outcome per parent)."""

    round_no: _RoundNo
    topology_digest: _Digest | None = None
    admitted: _Parents = ()
    rejected: _Parents = ()
    cancelled: _Parents = ()
    completed: _Parents = ()
    failed: _Parents = ()
    #: True when the round ended without every vote (see `RoundTimedOut`)
    timed_out: bool = False
    #: in-flight parents every rank reported prepared (intersection), decided
    #: once: CTX publishes READY and posts. Not an ending: a parent stays in flight.
    decided: _Parents = ()

    def settled(self) -> frozenset[ParentKey]:
        """Parents this decision ends (cancelled, completed or failed)."""
        return frozenset((*self.cancelled, *self.completed, *self.failed))


class RoundTimedOut(_Frozen, frozen=True, tag="round_timed_out"):
    """A round that ended without every vote.

    ``decision`` is what the surviving ranks must still apply, so that round
    numbers stay gap-free; see the module docstring for what it contains.
    """

    round_no: _RoundNo
    missing_ranks: _Ranks
    decision: RoundDecision


class VoteRejectReason(str, enum.Enum):
    NO_ROUND_OPEN = "no_round_open"  # nothing is being voted on
    STALE_ROUND = "stale_round"  # the round was already decided
    UNKNOWN_ROUND = "unknown_round"  # the round was never opened
    UNKNOWN_RANK = "unknown_rank"  # not a rank of this topology
    STALE_EPOCH = "stale_epoch"  # an older incarnation of the rank
    UNKNOWN_EPOCH = "unknown_epoch"  # an incarnation the leader never started
    DUPLICATE = "duplicate"  # this rank already voted in this round
    LATE = "late"  # arrived at or after the deadline: never applied
    NOT_PROPOSED = "not_proposed"  # admit_ok names a parent not proposed
    NOT_ALONE = "not_alone"  # a rank of several reports a parent it admitted alone


class VoteRejected(RoundError):
    """`RoundLeader.receive_vote` refused a vote; the leader did not change."""

    def __init__(self, reason: VoteRejectReason, vote: RoundVote, detail: str = "") -> None:
        super().__init__(
            _detailed(
                f"vote of rank {vote.rank} (epoch {vote.epoch}) for round {vote.round_no} "
                f"rejected: {reason.value}",
                detail,
            )
        )
        self.reason = reason
        self.round_no = vote.round_no
        self.rank = vote.rank
        self.epoch = vote.epoch
        self.vote = vote
        self.detail = detail


class StaleEpochError(StaleError):
    """A round call or nudge carried an endpoint epoch other than the rank's
    current one: it comes from (or is meant for) another incarnation (S3)."""

    def __init__(self, got: int, expected: int) -> None:
        super().__init__("endpoint epoch", got, expected)


class RoundOrderError(RoundError):
    """A follower got a proposal or decision that is not for its next round.

    ``kind`` is ``"stale"`` (older than the last one handled), ``"duplicate"``
    (exactly the last one handled) or ``"out_of_order"`` (beyond the next).
    """

    def __init__(self, rank: int, what: str, got: int, expected: int) -> None:
        if got < expected - 1:
            kind = "stale"
        elif got == expected - 1:
            kind = "duplicate"
        else:
            kind = "out_of_order"
        super().__init__(f"rank {rank}: {kind} {what} for round {got} (next expected {expected})")
        self.rank = rank
        self.what = what
        self.got = got
        self.expected = expected
        self.kind = kind
