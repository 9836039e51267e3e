"""`RoundMember`: how a rank actor takes part in agreement rounds.

A rank actor composes one `RoundMember` and exposes its four coroutine
methods as actor methods of the same name (``round_identity``,
``round_join``, ``round_vote``, ``round_apply``); the coordinator calls
them. The member wraps the sans-IO `RoundFollower` (strict order, exactly
once) and two callbacks supplied by the rank actor:

- ``vote_fn(proposal) -> VoteNews``: decide this rank's vote, e.g. try to lease
  blocks for every proposed admission (tentatively), and optionally report
  extra news;
- ``apply_fn(decision) -> None``: apply one decision to the rank's sessions and
  pools (commit tentative leases of admitted parents, return every other
  tentative lease, release / drain / quarantine settled parents).

Lock and await ordering (docs/design.md "Agreement rounds"; docs/rounds.md)
--------------------------------------------------------------------------
The rank actor is an asyncio actor: one thread, one event loop, so coroutines
interleave only at ``await`` points. The rule that makes rounds and control
dispatch (incoming OPEN / CANCEL / TERMINAL frames) deadlock-free is:

1. **State is mutated only in await-free critical sections.** ``round_vote``
   and ``round_apply`` check the follower, call ``vote_fn`` / ``apply_fn``
   (plain functions, never coroutines: an awaitable result is refused with
   `TypeError`) and advance the follower with no ``await`` in between. A
   control handler likewise decodes, hands the message to the session machine
   and records the resulting state without awaiting; it may await only
   *after* its critical section (to send a reply frame). Hence neither can
   interleave inside the other, and no lock is needed — there is none to take
   in the wrong order. The one await of a round call comes before its
   critical section: a call ahead of its turn (round n + 1's proposal before
   round n's decision: the coordinator does not wait for an apply before it
   proposes again, and Ray may run an async actor's calls out of order) waits
   until the follower reached it (`RoundMember._turn`).
2. **Rounds never wait on control messages**, and **control handlers never
   wait on rounds.** A control handler that learns news (a peer CANCEL, a
   TERMINAL that completes an edge) only *records an intent*
   (`record_cancel`, `record_completion`, `record_failure`) that the next
   vote or report carries, and pushes its report to the coordinator with a
   fire-and-forget call.
   So there is no wait-for cycle between the two.
3. **Timeouts and NIXL poll loops only record intents** the same way: they
   never enter a round, never apply a decision, never free memory. Memory is
   freed only by ``apply_fn`` under a decision that every rank applies in the
   same round order.

Intents are sticky until a decision settles them: a completion is reported in
every vote until some decision names the parent (completed, cancelled or
failed), because completion is an intersection that needs every rank to
report it in the same round. Cancel and failure intents are unions, so one
report suffices; they are cleared by the decision of the round that carried
them (and kept if that round timed out without deciding them).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable

import msgspec

from kvhandoff.protocol import (
    ParentKey,
    RankReport,
    RoundDecision,
    RoundError,
    RoundFollower,
    RoundProposal,
    RoundVote,
    StaleEpochError,
)

__all__ = ["VoteNews", "RoundMember", "MemberBroken", "RoundParticipant"]


class VoteNews(msgspec.Struct, frozen=True, kw_only=True):
    """What ``vote_fn`` returns: the admissions this rank can take (its other
    news is recorded in the follower between rounds)."""

    admit_ok: tuple[ParentKey, ...] = ()


class MemberBroken(RoundError):
    """``apply_fn`` raised while applying a decision: the rank's state is no
    longer trustworthy, so it refuses every further round and must be
    restarted (the coordinator's watchdog sees it as a failed rank)."""

    def __init__(self, rank: int, round_no: int, cause: BaseException) -> None:
        super().__init__(f"rank {rank} broke applying round {round_no}: {cause!r}")
        self.rank = rank
        self.round_no = round_no
        self._cause_repr = repr(cause)

    def __reduce__(self) -> tuple[object, ...]:
        # Crosses Ray: rebuild from plain data (the cause may not pickle).
        return (_rebuild_broken, (self.rank, self.round_no, self._cause_repr))


def _rebuild_broken(rank: int, round_no: int, cause: str) -> MemberBroken:
    return MemberBroken(rank, round_no, RuntimeError(cause))


#: The longest a round call that came ahead of its turn waits for it
#: (`RoundMember._turn`); the coordinator's watchdog is shorter.
ORDER_WAIT_S = 120.0

VoteFn = Callable[[RoundProposal], VoteNews]
ApplyFn = Callable[[RoundDecision], None]


class RoundMember:
    """One rank's participation in the rounds of its topology.

    ``rank`` and ``epoch`` identify this rank actor incarnation; the
    coordinator passes the epoch it expects with every call, and a call
    carrying another epoch raises `StaleEpochError` (a `StaleError`) and
    changes nothing.
    """

    def __init__(
        self,
        rank: int,
        epoch: int,
        vote_fn: VoteFn,
        apply_fn: ApplyFn,
        *,
        first_round: int = 1,
        topology_digest: bytes | None = None,
        order_wait_s: float = ORDER_WAIT_S,
    ) -> None:
        self.follower = RoundFollower(
            rank, epoch, first_round=first_round, topology_digest=topology_digest
        )
        self._vote_fn = vote_fn
        self._apply_fn = apply_fn
        self._broken: MemberBroken | None = None
        # Set at every apply or join: a call that came ahead of its turn waits on it.
        self._advanced: asyncio.Event | None = None
        self._order_wait_s = order_wait_s
        self.rounds_waited = 0
        self.rounds_voted = 0
        self.rounds_applied = 0
        # Set by `round_join`: the coordinator took this incarnation into its
        # rounds (at start, or after a restart). A rank that admits on its
        # own (at the OPEN) admits nothing before (its reports would be
        # refused, and a restart that fails would leave what it admitted
        # with no leader).
        self.joined = False

    @property
    def our_rank(self) -> int:
        return self.follower.our_rank

    @property
    def our_epoch(self) -> int:
        return self.follower.our_epoch

    # -- intents: await-free, callable from control handlers, timeouts, polls --
    # The bookkeeping itself is the follower's (protocol/_rounds.py).

    def record_cancel(self, parent: ParentKey) -> None:
        """Queue a cancel intent for the next vote or report (never frees anything)."""
        self.follower.record_cancel(parent)

    def record_completion(self, parent: ParentKey) -> None:
        """Report ``parent`` complete on this rank until settled."""
        self.follower.record_completion(parent)

    def record_failure(self, parent: ParentKey) -> None:
        """Queue a failure (e.g. evidence UNKNOWN) for the next vote or report."""
        self.follower.record_failure(parent)

    def record_prepared(self, parent: ParentKey) -> None:
        """Report every local edge of ``parent`` prepared until decided or settled."""
        self.follower.record_prepared(parent)

    def has_news(self) -> bool:
        return self.follower.has_news()

    def report(self) -> RankReport:
        """The news to push to the coordinator now (one way; see `RankReport`)."""
        return self.follower.report()

    # -- the actor methods (await-free bodies; see the module docstring) ------

    def _check(self, epoch: int | None) -> None:
        if self._broken is not None:
            raise self._broken
        if epoch is not None and epoch != self.our_epoch:
            raise StaleEpochError(epoch, self.our_epoch)

    async def round_identity(self) -> tuple[int, int]:
        """``(rank, epoch)`` of this incarnation."""
        return (self.our_rank, self.our_epoch)

    async def round_join(self, next_round: int, epoch: int | None = None) -> int:
        """Join at ``next_round`` (a fresh incarnation only): the coordinator
        calls this on a restarted rank so its first round is the leader's next."""
        self._check(epoch)
        self.follower.join(next_round)
        self.joined = True
        self._advance()
        return next_round

    def _advance(self) -> None:
        if self._advanced is not None:
            self._advanced.set()
            self._advanced = None

    async def _turn(self, round_no: int) -> None:
        """Wait (bounded) until ``round_no`` is the follower's next round, when
        the call came ahead of it: the coordinator sends round n's decision
        and then, without waiting for its answer, round n + 1's proposal, and
        Ray does not promise that an async actor runs one caller's calls in
        the order they were made (the coordinator has at most one decision
        unanswered when it proposes: a call is at most one round ahead).
        Before the critical section (nothing changes while waiting); a call
        that is not one round ahead, or still is at the bound, goes on to the
        follower's own check (which refuses it)."""
        if round_no != self.follower.next_round + 1:
            return  # its turn, or not one the coordinator could have sent yet
        self.rounds_waited += 1
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._order_wait_s):
                while round_no > self.follower.next_round and self._broken is None:
                    if self._advanced is None:
                        self._advanced = asyncio.Event()
                    await self._advanced.wait()

    async def wait_applied(self, round_no: int) -> None:
        """Wait (bounded like `_turn`) until decision ``round_no`` is applied
        here: a call outside the rounds that depends on what the decisions
        sent before it did (an admission alone needs the blocks they
        return) and may overtake them (Ray does not order one caller's calls
        into an async actor). A decision that never comes (its rank is being
        replaced) costs the bound, then the call goes on."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._order_wait_s):
                while self.follower.next_round <= round_no and self._broken is None:
                    self.rounds_waited += 1
                    if self._advanced is None:
                        self._advanced = asyncio.Event()
                    await self._advanced.wait()

    async def round_vote(
        self, proposal: RoundProposal, epoch: int | None = None, decision: RoundDecision | None = None
    ) -> RoundVote:
        """Vote on ``proposal``; the next round only, once. No await inside
        the critical section (a vote ahead of its turn waits before it).

        ``decision``, when given, is the previous round's: the coordinator
        lets it ride with this proposal instead of sending it alone. It is
        applied first, as `round_apply` would, in the same critical section;
        if it fails the call raises and nothing is voted."""
        if decision is not None:
            await self._turn(decision.round_no)
            self._check(epoch)
            self._apply_now(decision)
        else:
            await self._turn(proposal.round_no)
        self._check(epoch)
        self.follower.check_proposal(proposal)
        news = self._vote_fn(proposal)
        if inspect.isawaitable(news):
            # A coroutine here would let control dispatch interleave inside
            # the round's critical section: refuse it loudly.
            if inspect.iscoroutine(news):
                news.close()
            raise TypeError("vote_fn must be a plain function, not a coroutine")
        vote = self.follower.vote_with_news(proposal, admit_ok=news.admit_ok)
        self.rounds_voted += 1
        return vote

    async def round_apply(self, decision: RoundDecision, epoch: int | None = None) -> int:
        """Apply ``decision`` strictly in order, exactly once. No await inside.

        Returns the round number applied. A wrong round raises
        `RoundOrderError` before ``apply_fn`` runs (nothing changes). A
        decision ahead of its turn waits for it first (`_turn`).
        """
        await self._turn(decision.round_no)
        self._check(epoch)
        self._apply_now(decision)
        return decision.round_no

    def _apply_now(self, decision: RoundDecision) -> None:
        """The await-free body of an apply (alone or riding with a vote)."""
        self.follower.check_decision(decision)
        # Mark applied before running apply_fn: if it raises half-way, the
        # decision must never be applied a second time (exactly once); the
        # member is broken instead and the watchdog restarts the rank.
        self.follower.apply(decision)
        self._advance()
        try:
            result = self._apply_fn(decision)
            if inspect.isawaitable(result):
                if inspect.iscoroutine(result):
                    result.close()
                raise TypeError("apply_fn must be a plain function, not a coroutine")
        except Exception as exc:
            self._broken = MemberBroken(self.our_rank, decision.round_no, exc)
            raise self._broken from exc
        self.rounds_applied += 1


class RoundParticipant:
    """Mixin for an actor that owns ``self.member`` (a `RoundMember`): exposes
    the four methods the coordinator calls as actor methods of the same name."""

    member: RoundMember

    async def round_identity(self) -> tuple[int, int]:
        return await self.member.round_identity()

    async def round_join(self, next_round: int, epoch: int | None = None) -> int:
        return await self.member.round_join(next_round, epoch)

    async def round_vote(
        self, proposal: RoundProposal, epoch: int | None = None, decision: RoundDecision | None = None
    ) -> RoundVote:
        return await self.member.round_vote(proposal, epoch, decision)

    async def round_apply(self, decision: RoundDecision, epoch: int | None = None) -> int:
        return await self.member.round_apply(decision, epoch)
