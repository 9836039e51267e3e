"""The coordinator's round machinery (part of `CoordinatorCore`,
actors/_coordinator.py): the round loop, one round's vote and apply phases
under their watchdog, a decided round's apply riding with the next round's
votes (`_Carried`) and its tail, answering and recording the decisions.
`CoordinatorCore` inherits it as `RoundsMixin`; the design is in the module
docstring of actors/_coordinator.py."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvhandoff.actors._channel import RESULTS
from kvhandoff.actors._coordinator_errors import RoundTimeout, TopologyFailed, TopologyState
from kvhandoff.actors._coordinator_state import CoordinatorState
from kvhandoff.actors._trace import decision_ids, news_ids, proposal_ids
from kvhandoff.protocol import (
    MAX_ROUND_ITEMS,
    AdmissionRequest,
    ParentKey,
    RoundDecision,
    RoundProposal,
    RoundTimedOut,
    RoundVote,
    StaleEpochError,
    VoteRejected,
    paired_outcome,
    pairing_veto,
)


class _Carried:
    """A decided round's apply riding with the next round's votes: the
    decision, the rank epochs it was decided for, and one future per rank
    resolved with the round number once that rank applied it, or with the
    error its call raised (a value, not an exception: the tail reads it)."""

    __slots__ = ("decision", "epochs", "replies", "lazy")

    def __init__(
        self, decision: RoundDecision, epochs: list[int], replies: list[asyncio.Future[Any]], lazy: bool = False
    ) -> None:
        self.decision = decision
        self.epochs = epochs
        self.replies = replies
        self.lazy = lazy  # may wait `lazy_apply_s` for a vote round (`CoordinatorCore._may_wait`)


async def _settle(future: asyncio.Future[Any], ref: Any) -> None:
    """Resolve a carried apply's `future` with what its lone call `ref` gives."""
    try:
        if ref is None:
            raise RuntimeError("the apply call could not be sent")
        answer = await ref
    except Exception as exc:
        answer = exc
    if not future.done():
        future.set_result(answer)


def _key(parent: ParentKey) -> tuple[str, int, int]:
    return (parent.request_id, parent.ctx_attempt, parent.gen_attempt)


class RoundsMixin(CoordinatorState):
    """The rounds of `CoordinatorCore`: it owns the state declared here."""

    _batch_window: float
    _max_batch: int
    _lazy_apply_s: float
    _round_done: asyncio.Event
    _tails: list[asyncio.Task[None]]
    _rounds: int
    _rounds_timed_out: int
    _rejected_votes: collections.Counter[str]
    _round_seconds: collections.deque[float]
    _timeouts: collections.deque[RoundTimeout]

    if TYPE_CHECKING:  # CoordinatorCore's, and the other mixins'
        def _raise_if_unusable(self) -> None: ...
        def _own(self, coro: Any) -> None: ...
        def _log_decision(self, decision: RoundDecision) -> None: ...
        def _ask_direct(self, admissions: list[AdmissionRequest]) -> None: ...
        async def _peers_admit(self, admissions: list[AdmissionRequest]) -> set[ParentKey]: ...
        def _undo_pairing(
            self, decision: RoundDecision, peer_answer: asyncio.Future[set[ParentKey]] | None
        ) -> None: ...
        async def _fail_policy(self, ranks: Sequence[int], reason: str) -> None: ...

    # -- the round loop -------------------------------------------------------------

    async def _round_loop(self) -> None:
        while True:
            if self._leader is not None and self._leader.reports_waiting():
                # Some rank reported its share of an intersection the others
                # have not: if nothing happens for a round bound, probe every
                # rank with a vote round. A rank that died holding its share
                # (its completion or prepared report never comes) is found by
                # it and restarted, instead of holding the others' reports
                # hostage; a slow but live rank just votes.
                try:
                    async with asyncio.timeout(self._round_timeout):
                        await self._wakeup.wait()
                except TimeoutError:
                    self._want_votes = True
                    self.calls["probe_rounds"] += 1
            else:
                await self._wakeup.wait()
            if self._batch_window > 0:
                await asyncio.sleep(self._batch_window)
            # Clear before taking the batch: anything queued from now on sets
            # the event again and gets the next round.
            self._wakeup.clear()
            if not self._work_pending():
                self._flush_idle()  # nothing to vote on after all: it goes alone
                continue  # e.g. the first reports of an intersection: wait for the rest
            try:
                await self._run_round()
            except RoundTimeout:
                pass  # the fail policy ran; keep serving
            except TopologyFailed:
                self._flush_carry()
                return
            if self._work_pending():
                self._wakeup.set()
            else:
                self._flush_idle()

    def _work_pending(self) -> bool:
        """Is there anything a round could decide now?"""
        leader = self._leader
        assert leader is not None
        if self._detached:
            return False  # no round without every rank: they wait for `replace_rank`
        return bool(
            self._pending_admits
            or self._pending_cancels
            or self._pending_failures
            or self._want_votes
            or leader.reports_decide()
        )

    async def _run_round(self, wait_applied: bool = False) -> RoundDecision:
        async with self._round_lock:
            while len(self._tails) > 1:  # at most one round's apply still out
                await asyncio.wait(list(self._tails)[:-1])
            if self.state in (TopologyState.FAILED, TopologyState.SHUT_DOWN):
                self._flush_carry()  # no round takes it: the ranks still apply it
            self._raise_if_unusable()
            leader = self._leader
            assert leader is not None
            loop = asyncio.get_running_loop()
            admissions = [request for request, _ in itertools.islice(self._pending_admits.values(), self._max_batch)]
            cancels = list(self._pending_cancels)[:MAX_ROUND_ITEMS]
            failures = sorted(self._pending_failures & leader.in_flight, key=_key)
            failures = failures[:MAX_ROUND_ITEMS]
            started = time.perf_counter()
            proposal = leader.open_round(
                admissions,
                cancels,
                now=loop.time(),
                timeout=self._round_timeout,
                failures=failures,
            )
            # Taken: from here on these are answered by this round's decision.
            taken_admits = {a.parent: self._pending_admits.pop(a.parent)[1] for a in admissions}
            taken_cancels = {p: self._pending_cancels.pop(p) for p in cancels}
            self._pending_failures.clear()
            # Submitted handoffs need the peer instance to admit them too: ask
            # it now, in one call, while our ranks vote.
            # A claim goes through the peer coordinator in a round (the alone
            # path claims off it); an admission, unless the peer admits at the OPEN.
            submitted = [a for a in admissions if a.parent in self._submitted]
            if submitted and (self._admits_alone or not self._peer_claims):
                self._ask_direct(submitted)
            paired = [a for a in submitted if self._peer_claims or not self._direct.get(a.peer_instance, False)]
            peer_answer = (
                asyncio.ensure_future(self._peers_admit(paired)) if paired else None
            )

            want_votes, self._want_votes = self._want_votes, False
            if admissions or want_votes:
                carried, self._carried = self._carried, None
                outcome = await self._vote_phase(proposal, peer_answer, carried, [a.parent for a in paired])
            else:
                self._flush_carry()
                # No lease to ask for: decide on the news the ranks pushed.
                leader.votes_from_reports(loop.time())
                outcome = leader.close(loop.time())
                self.calls["rounds_without_votes"] += 1
            if not isinstance(outcome, RoundTimedOut):
                decision = outcome
                self._log_decision(decision)  # made: logged before anyone hears it
                self._answer_early(decision, taken_admits)
                # Sent now, or with the next round's votes when that round
                # asks for them at once (a rank applies it, in its turn,
                # before it votes there); awaited by the round's tail while
                # the next round may already vote.
                if wait_applied:
                    sent = self._send_apply(decision)
                elif self._next_round_votes():
                    sent = self._carry_apply(decision)
                elif self._may_wait(decision):
                    sent = self._carry_apply(decision, lazy=True)
                else:
                    sent = self._send_apply(decision)
                self._undo_pairing(decision, peer_answer)
                earlier = list(self._tails)  # recorded after these, in round order
                tail = self._own_tail(self._round_tail(decision, sent, earlier, taken_admits, taken_cancels, started))
                if wait_applied:
                    await asyncio.shield(tail)
                return decision
            decision = outcome.decision
            self._log_decision(decision)
            bad = set(outcome.missing_ranks)
            survivors = [r for r in range(self._tp) if r not in bad]
            bad |= await self._apply_phase(decision, survivors)
            self._undo_pairing(decision, peer_answer)
            await self._tails_done()  # decisions are recorded in round order
            self._record(decision, taken_admits, taken_cancels, time.perf_counter() - started)
            if bad:
                timeout = RoundTimeout(
                    self.topology, decision.round_no, sorted(bad), self._round_timeout
                )
                self._timeouts.append(timeout)
                self._rounds_timed_out += 1
                self._metrics.round_timed_out()
                await self._fail_policy(sorted(bad), str(timeout))
                raise timeout
            return decision

    # -- a round's tail: its apply, awaited while the next round runs -----------------

    def _next_round_votes(self) -> bool:
        """Will the next round open at once and ask every rank for its vote?
        Then this round's apply can ride with it (one call per rank instead
        of two). Not with a batch window: the apply would wait for it."""
        return self._batch_window <= 0 and bool(self._pending_admits or self._want_votes)

    def _may_wait(self, decision: RoundDecision) -> bool:
        """May ``decision``'s apply wait up to `lazy_apply_s` for a vote
        round to ride with? Only when it settles completions and nothing
        else, and nobody waits for it to be applied: the caller of each
        parent was answered at the decision (its GEN ranks return the
        blocks themselves) or there is none. Admissions, decides, cancels,
        failures and rejections go at once: a handoff or a release waits
        on them."""
        if self._lazy_apply_s <= 0 or self._batch_window > 0 or not decision.completed:
            return False
        if decision.admitted or decision.rejected or decision.cancelled or decision.failed or decision.decided:
            return False
        if not self._returns_awaited.isdisjoint(decision.completed):
            return False  # an engine waits for these blocks to come back
        return not any(parent in self._submitted for parent in decision.completed)

    def _carry_apply(self, decision: RoundDecision, *, lazy: bool = False) -> list[tuple[int, int, Any]]:
        """Keep ``decision`` for the next round's vote calls: (rank, epoch,
        future) each, the future resolved with the round number when that
        rank's vote call returns, or with the error it raised. Whatever
        takes the round lock next either sends it with its votes or sends it
        alone (`_flush_carry`); so does the loop when it goes idle, or, for
        a `lazy` one (`_may_wait`), `lazy_apply_s` later at the latest."""
        self._flush_carry()  # at most one decision rides at a time
        loop = asyncio.get_running_loop()
        carried = _Carried(decision, list(self._epochs), [loop.create_future() for _ in range(self._tp)], lazy)
        self._carried = carried
        if lazy:
            self.calls["applies_delayed"] += 1
            loop.call_later(self._lazy_apply_s, self._flush_lazy, carried)
        else:
            self._wakeup.set()  # the round that takes it
        return [(rank, carried.epochs[rank], carried.replies[rank]) for rank in range(self._tp)]

    def _flush_lazy(self, carried: _Carried) -> None:
        if self._carried is carried:  # no round took it within the window
            self._flush_carry()

    def _flush_idle(self) -> None:
        """The loop goes idle: a carried apply goes alone, unless it may
        wait out its window (`_flush_lazy` sends it then)."""
        if self._carried is not None and not self._carried.lazy:
            self._flush_carry()

    def _flush_carry(self) -> None:
        """Send the carried decision alone, now (no vote round takes it)."""
        carried, self._carried = self._carried, None
        if carried is None:
            return
        for rank, _, ref in self._send_apply(carried.decision, carried.epochs):
            self._own(_settle(carried.replies[rank], ref))

    def _send_apply(self, decision: RoundDecision, epochs: Sequence[int] | None = None) -> list[tuple[int, int, Any]]:
        """Send ``decision`` to every rank now: (rank, epoch, reply) each."""
        sent = []
        for rank in range(self._tp):
            self.calls["rank_apply_calls"] += 1
            epoch = self._epochs[rank] if epochs is None else epochs[rank]
            try:
                reply, _ = self._links.call(rank, self._handles[rank], "round_apply", (decision, epoch), RESULTS["round_apply"])
                sent.append((rank, epoch, reply))
            except Exception as exc:
                self._rank_errors.append(f"apply {decision.round_no} rank {rank}: {exc!r}"[:500])
                sent.append((rank, epoch, None))
        return sent

    def _own_tail(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tails.append(task)
        task.add_done_callback(self._tails.remove)
        return task

    async def _tails_done(self) -> None:
        """Wait until every earlier round's tail has ended (never raises)."""
        while self._tails:
            await asyncio.wait(list(self._tails))

    async def _round_tail(
        self,
        decision: RoundDecision,
        sent: list[tuple[int, int, Any]],
        earlier: list[asyncio.Task[None]],
        taken_admits: dict[ParentKey, asyncio.Future[bool]],
        taken_cancels: dict[ParentKey, list[asyncio.Future[str | None]]],
        started: float,
    ) -> None:
        """Await every rank's apply of ``decision`` (under the watchdog), then
        record it, after every earlier round's record. A rank that failed to
        apply it (and was not restarted meanwhile) is behind and holds shards
        of every in-flight parent: they fail in the next round, which asks for
        votes and so finds the rank (a dead or broken one misses its vote and
        the fail policy runs there, as for any missed vote)."""
        answered: set[int] = set()

        async def reply(rank: int, ref: Any) -> None:
            try:
                if ref is None:
                    raise RuntimeError("the apply call could not be sent")
                answer = await ref
                if isinstance(answer, BaseException):  # carried: its vote call raised
                    raise answer
            except Exception as exc:
                self._rank_errors.append(f"apply {decision.round_no} rank {rank}: {exc!r}"[:500])
                return
            answered.add(rank)
            if self.trace.every:  # the carrier: its channel if open now (the apply may have ridden a vote)
                via = "channel" if self._links.channel(rank, self._handles[rank]) is not None else "reply"
                self.trace.record_many(decision_ids(decision), "round_apply", via, f"rank{rank}@{self.topology}")

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._round_timeout):
                await asyncio.gather(*(reply(rank, ref) for rank, _, ref in sent))
        # Failed or missed the watchdog, and not restarted since (a restart
        # already failed what that incarnation held).
        bad = [r for r, epoch, _ in sent if r not in answered and self._epochs[r] == epoch]
        if earlier:
            await asyncio.wait(earlier)
        self._record(decision, taken_admits, taken_cancels, time.perf_counter() - started)
        if bad and self.state not in (TopologyState.FAILED, TopologyState.SHUT_DOWN):
            leader = self._leader
            assert leader is not None
            self._pending_failures |= leader.in_flight
            self._want_votes = True
            self.calls["apply_failures"] += 1
            self._wakeup.set()

    def _answer_early(self, decision: RoundDecision, taken_admits: dict[ParentKey, asyncio.Future[bool]]) -> None:
        """Answer, from the decision itself, what needs no rank to have applied it:

        - the peer instance's admissions (`admit_many`): our ranks leased in
          their vote and apply the admission next; an OPEN the peer's ranks
          send meanwhile waits on our rank until it applied (a CTX rank parks
          frames of a parent it leased but has not applied: `RankCore`);
        - a submission whose GEN ranks release the blocks themselves, when it
          completed: every GEN rank verified its bytes before it reported, and
          nobody frees the blocks (they go back when the ranks apply).

        The rest is answered once every rank applied (`_record`). A decision
        is final: a rank that fails to apply it is restarted by the fail
        policy, as when it fails right after applying."""
        admitted = set(decision.admitted)
        for parent, future in taken_admits.items():
            if parent in self._admit_at_decision and not future.done():
                self._admit_at_decision.discard(parent)
                future.set_result(parent in admitted)
        for parent in decision.completed:
            if parent in self._complete_at_decision:
                self._complete_at_decision.discard(parent)
                submitted = self._submitted.pop(parent, None)
                if submitted is not None and not submitted.done():
                    submitted.set_result("completed")
                    self.calls["answered_at_decision"] += 1

    async def _vote_phase(
        self,
        proposal: RoundProposal,
        peer_answer: asyncio.Future[set[ParentKey]] | None = None,
        carried: _Carried | None = None,
        paired: Sequence[ParentKey] = (),
    ) -> RoundDecision | RoundTimedOut:
        """Ask every rank's vote on ``proposal`` and decide. ``paired``: the
        admissions the peer instances were asked to admit too (``peer_answer``,
        their answer); one they did not admit is vetoed here. The others (a
        peer that admits at the OPEN) are decided on our votes alone."""
        leader = self._leader
        assert leader is not None
        loop = asyncio.get_running_loop()
        bad: set[int] = set()

        async def ask(rank: int) -> bool:
            self.calls["rank_vote_calls"] += 1
            epoch = self._epochs[rank]
            # The previous round's decision rides along, to the incarnation
            # it was decided for (a new one joined after it: not its decision).
            rides = carried.decision if carried is not None and carried.epochs[rank] == epoch else None
            replied: Any = StaleEpochError(epoch, carried.epochs[rank]) if carried is not None and rides is None else None
            try:
                reply, via = self._links.call(
                    rank, self._handles[rank], "round_vote", (proposal, epoch, rides), RESULTS["round_vote"]
                )
                vote: RoundVote = await reply
                if rides is not None:
                    replied = rides.round_no
                    self.calls["applies_carried"] += 1
            except Exception as exc:  # died, broken, stale epoch: all a failed rank
                replied = exc
                self._rank_errors.append(f"round {proposal.round_no} rank {rank}: {exc!r}"[:500])
                bad.add(rank)
                return False
            finally:
                if carried is not None and not carried.replies[rank].done():
                    # Cut by the watchdog: whether it applied is unknown, so it did not.
                    carried.replies[rank].set_result(replied if replied is not None else TimeoutError("vote call cut"))
            if self.trace.every:
                ids = [*proposal_ids(proposal), *news_ids(vote)]
                self.trace.record_many(ids, "round_vote", via, f"rank{rank}@{self.topology}")
            try:
                leader.receive_vote(vote, loop.time())
            except VoteRejected as rejected:
                self._rejected_votes[rejected.reason.value] += 1
                self._rank_errors.append(str(rejected))
                bad.add(rank)
                return False
            return True

        # No early stop: a vote we cancelled would count as missing, and the fail
        # policy would restart a healthy rank (seen as a CI flake: a stale-epoch
        # vote from one rank got the other, healthy rank restarted too). The
        # watchdog still bounds the phase; only ranks that failed or truly
        # missed the deadline are blamed.
        await self._fan_out(ask, range(self._tp))
        if not bad and not leader.missing():
            vetoed: frozenset[ParentKey] = frozenset()
            if peer_answer is not None:
                vetoed = pairing_veto(list(paired), await peer_answer)
            return leader.close(loop.time(), vetoed=vetoed)
        return leader.abort(bad, loop.time())

    async def _apply_phase(self, decision: RoundDecision, ranks: Sequence[int]) -> set[int]:
        """Send ``decision`` to ``ranks``; returns the ranks that failed or
        missed the watchdog bound."""
        done: set[int] = set()

        async def tell(rank: int) -> bool:
            self.calls["rank_apply_calls"] += 1
            try:
                args = (decision, self._epochs[rank])
                reply, via = self._links.call(rank, self._handles[rank], "round_apply", args, RESULTS["round_apply"])
                await reply
            except Exception as exc:
                self._rank_errors.append(f"apply {decision.round_no} rank {rank}: {exc!r}"[:500])
                return False
            if self.trace.every:
                ids = decision_ids(decision)
                self.trace.record_many(ids, "round_apply", via, f"rank{rank}@{self.topology}")
            done.add(rank)
            return True

        # Every survivor must get the decision: no early stop here.
        await self._fan_out(tell, ranks)
        return set(ranks) - done

    async def _fan_out(self, call: Callable[[int], Awaitable[bool]], ranks: Sequence[int]) -> None:
        """Run ``call(rank)`` for every rank under the watchdog (one
        ``asyncio.timeout`` around one TaskGroup that owns every task). Every
        call runs to its end or to the deadline, which cancels whatever is left:
        cancelling a healthy rank's call early would make it look missing.
        """
        try:
            async with asyncio.timeout(self._round_timeout), asyncio.TaskGroup() as group:
                for rank in ranks:
                    group.create_task(call(rank))
        except TimeoutError:
            pass

    def _record(
        self,
        decision: RoundDecision,
        taken_admits: dict[ParentKey, asyncio.Future[bool]],
        taken_cancels: dict[ParentKey, list[asyncio.Future[str | None]]],
        seconds: float,
    ) -> None:
        self._rounds += 1
        self._round_done.set()
        self._round_seconds.append(seconds)
        batch = len(decision.admitted) + len(decision.rejected) + len(decision.decided) + len(decision.settled())
        self._metrics.round(seconds, batch)
        outcomes: dict[ParentKey, str] = {}
        for name in ("admitted", "rejected", "cancelled", "completed", "failed"):
            parents = getattr(decision, name)
            self._counts[name] += len(parents)
            for parent in parents:
                outcomes[parent] = name
        now = time.monotonic()
        for parent, name in outcomes.items():
            self._outcomes.remember(parent, name, now)
            peer = self._peer_of.get(parent)
            if peer is not None:
                self._peer_of.remember(parent, peer, now)  # kept RETAIN_S past its last decision
        admitted = set(decision.admitted)
        for parent, future in taken_admits.items():
            self._admit_at_decision.discard(parent)
            if not future.done():
                future.set_result(parent in admitted)
        for parent, name in outcomes.items():
            if name == "admitted":
                continue
            self._complete_at_decision.discard(parent)
            self._returns_awaited.discard(parent)
            submitted = self._submitted.pop(parent, None)
            name = paired_outcome(name, parent in self._peer_failed)
            self._peer_failed.discard(parent)
            if submitted is not None and not submitted.done():
                submitted.set_result(name)
        for parent, waiters in taken_cancels.items():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(outcomes.get(parent))
