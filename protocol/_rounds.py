"""Agreement rounds: the sans-IO logic (docs/design.md "Agreement rounds").

Theory of operation
-------------------
All TP ranks of one instance hold shards of the same requests, so they must
make the same admission, cancel, completion and failure decisions in the same
order. Per topology, a single `RoundLeader` (driven by the coordinator actor)
numbers rounds 1, 2, 3, ... and runs one at a time:

1. ``open_round`` builds a `RoundProposal`: the batch of client admissions and
   client cancels (plus failures the coordinator injects).
2. Every rank takes part, with or without news (rounds are unconditional: no
   rank may skip a round another rank entered). Its `RoundFollower` checks the
   proposal is the next round and builds a `RoundVote`: which proposed
   admissions it could lease blocks for (``admit_ok``) and its own news:
   cancel intents, completions, failures.
3. ``receive_vote`` validates each vote (round, rank, endpoint epoch,
   duplicate, deadline); a rejected vote raises `VoteRejected` carrying a
   typed `VoteRejectReason` and changes nothing.
4. When every vote is in, ``close`` decides (`RoundDecision`):

   - admitted  = proposed admissions that EVERY rank voted admissible;
   - rejected  = the other proposed admissions;
   - cancelled = union of client cancels and every rank's cancel intents;
   - completed = intersection: a parent completes only when every rank
     reports it complete in the same round (ranks keep reporting a completion
     until a decision settles the parent);
   - failed    = union of coordinator-injected and rank-reported failures;
   - decided   = intersection of the ranks' ``prepared`` reports over in-flight
     parents not decided before (CTX: every edge of the parent is prepared on
     every rank, so READY may be published and DMA posted). Deciding is not
     an ending: the parent stays in flight until completed, cancelled or failed.

   Every parent named in a decision has exactly one outcome. Precedence is
   ``failed > cancelled > completed`` and ``failed > cancelled > admitted``:
   a cancel that arrives in the same round as the parent's admission WINS
   (the parent is cancelled, never admitted), because a client that asked to
   cancel must never be charged for a transfer, and because refusing is
   always safe while admitting is not.
5. If the deadline passes with ranks missing, ``expire`` (or ``abort`` when
   the caller already knows a rank is dead) ends the round with
   `RoundTimedOut`, which carries the missing ranks AND a conservative
   decision for the survivors: nothing admitted, every proposed admission
   rejected, cancels and failures as received, no completions (an
   intersection over missing ranks is unknowable), and every in-flight parent
   failed (in a TP instance every parent has a shard on every rank, so a
   missing rank touches all of them). A timed-out round still consumes its
   number and still has exactly one decision, so followers never see a gap.

Followers apply decisions strictly in round order, exactly once: a decision
for an older, the same, or a later-than-next round raises `RoundOrderError`
and changes nothing. Decisions are deterministic: every outcome tuple is
sorted, so the same votes in any arrival order give an equal decision.

Default-deny: news about a parent that is neither in flight (admitted by an
earlier round and not yet settled) nor proposed in this round is dropped.

No clocks here: every time is the ``now`` argument. The messages and errors
named above are defined in `_round_messages` (re-exported here).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping

from ._errors import RoundError, StaleError, _detailed
from ._round_messages import (
    MAX_ROUND_ITEMS,
    AdmissionRequest,
    RankReport,
    RoundDecision,
    RoundOrderError,
    RoundProposal,
    RoundTimedOut,
    RoundVote,
    VoteRejected,
    VoteRejectReason,
    _sort_key,
    _sorted,
)
from ._ticket import DIGEST_LEN, ParentKey

__all__ = ["RoundPhaseError", "RoundPhase", "News", "RoundLeader", "RoundFollower"]


class News(enum.Enum):
    """What a rank tells its round follower about one parent between rounds."""

    CANCEL = "cancel"  # a cancel intent (a union)
    FAILURE = "failure"  # the parent failed here (a union)
    COMPLETION = "completion"  # every local edge completed and verified (an intersection)


class RoundPhase(enum.Enum):
    IDLE = "idle"  # no round open: open_round may start one
    COLLECTING = "collecting"  # a round is open and collecting votes


class RoundPhaseError(RoundError):
    """A leader call that its current phase does not allow."""

    def __init__(self, phase: RoundPhase, event: str, detail: str = "") -> None:
        super().__init__(_detailed(f"RoundLeader: {event} is illegal in phase {phase.name}", detail))
        self.phase = phase
        self.event = event
        self.detail = detail


# The leader's whole phase machine: (phase, event) -> next phase. Anything
# missing is a RoundPhaseError naming both.
_LEADER_TRANSITIONS: dict[tuple[RoundPhase, str], RoundPhase] = {
    (RoundPhase.IDLE, "open_round"): RoundPhase.COLLECTING,
    (RoundPhase.COLLECTING, "receive_vote"): RoundPhase.COLLECTING,
    (RoundPhase.COLLECTING, "close"): RoundPhase.IDLE,
    (RoundPhase.COLLECTING, "expire"): RoundPhase.IDLE,
    (RoundPhase.COLLECTING, "abort"): RoundPhase.IDLE,
}


class RoundLeader:
    """Runs the rounds of one topology, one at a time (sans-IO).

    ``ranks`` is the number of ranks (ids ``0..n-1``) or the rank ids.
    ``epochs`` maps rank → current endpoint epoch (default 0 for every rank);
    `set_epoch` installs a restarted rank's new epoch. Votes carrying any
    other epoch are rejected (older: STALE_EPOCH, newer: UNKNOWN_EPOCH).
    """

    def __init__(
        self,
        ranks: int | Iterable[int],
        *,
        epochs: Mapping[int, int] | None = None,
        topology_digest: bytes | None = None,
        first_round: int = 1,
    ) -> None:
        our_ranks = tuple(range(ranks)) if isinstance(ranks, int) else tuple(ranks)
        if not our_ranks or len(set(our_ranks)) != len(our_ranks):
            raise RoundError(f"ranks must be non-empty and distinct, got {our_ranks!r}")
        if any(not 0 <= r < 4096 for r in our_ranks):
            raise RoundError(f"rank ids must be in [0, 4096), got {our_ranks!r}")
        if topology_digest is not None and len(topology_digest) != DIGEST_LEN:
            raise RoundError(f"topology digest must be {DIGEST_LEN} bytes")
        if first_round < 1:
            raise RoundError(f"first_round must be >= 1, got {first_round}")
        self.ranks: tuple[int, ...] = tuple(sorted(our_ranks))
        self.topology_digest = topology_digest
        self._epochs: dict[int, int] = {r: 0 for r in self.ranks}
        for rank, epoch in (epochs or {}).items():
            if rank not in self._epochs:
                raise RoundError(f"epoch given for unknown rank {rank}")
            self._epochs[rank] = epoch
        self.phase = RoundPhase.IDLE
        #: number the next open_round will use
        self.next_round = first_round
        self._proposal: RoundProposal | None = None
        self._deadline = 0.0
        self._votes: dict[int, RoundVote] = {}
        #: admitted by an earlier round and not yet cancelled/completed/failed
        self.in_flight: set[ParentKey] = set()
        #: in-flight parents already decided (the `prepared` channel decides once)
        self.decided: set[ParentKey] = set()
        #: the latest `RankReport` of each rank's current incarnation
        self._reports: dict[int, RankReport] = {}
        #: in flight because the one rank reported it admitted alone
        self._alone: set[ParentKey] = set()
        #: admitted alone and ended by a decision, while the rank's reports
        #: may still name it (a report sent before the rank applied that
        #: decision): never taken in flight again. Forgotten once a report
        #: no longer names it (a rank's reports only go forward: `seq`).
        self._alone_ended: set[ParentKey] = set()

    # -- queries ------------------------------------------------------------

    @property
    def proposal(self) -> RoundProposal | None:
        """The open round's proposal, or None when idle."""
        return self._proposal

    @property
    def deadline(self) -> float | None:
        return self._deadline if self._proposal is not None else None

    def epoch_of(self, rank: int) -> int:
        if rank not in self._epochs:
            raise RoundError(f"unknown rank {rank}")
        return self._epochs[rank]

    def missing(self, now: float | None = None) -> tuple[int, ...]:
        """Ranks whose vote the open round still lacks (``now`` is accepted
        for symmetry with `expire`; a missing rank stays missing until it votes
        or the round ends)."""
        if self._proposal is None:
            return ()
        return tuple(r for r in self.ranks if r not in self._votes)

    def expired(self, now: float) -> bool:
        """True when a round is open, its deadline has passed and ranks are missing."""
        return self._proposal is not None and now >= self._deadline and bool(self.missing())

    # -- transitions ----------------------------------------------------------

    def _fire(self, event: str, detail: str = "") -> RoundPhase:
        # Checked before any mutation so that a refused call changes nothing.
        try:
            return _LEADER_TRANSITIONS[(self.phase, event)]
        except KeyError:
            raise RoundPhaseError(self.phase, event, detail) from None

    def set_epoch(self, rank: int, epoch: int) -> None:
        """Install the endpoint epoch of a restarted rank (must increase)."""
        old = self.epoch_of(rank)
        if epoch <= old:
            raise StaleError("endpoint epoch", epoch, old)
        self._epochs[rank] = epoch
        self._reports.pop(rank, None)  # the old incarnation's news is void
        self._alone_ended.clear()  # its reports are refused from now on

    def report(self, report: RankReport) -> bool:
        """Store ``report`` as its rank's latest news; returns False (and keeps
        the stored one) for an older ``seq``. Raises `VoteRejected` for an
        unknown rank or another incarnation's epoch, or for parents admitted
        alone by a rank of several (only a one-rank instance admits without
        a round), changing nothing.

        A parent the report names ``admitted`` is in flight from now on, as
        if a round had admitted it, unless it is in flight already, proposed
        in the open round, or was admitted alone and has ended since (a
        report written before the rank applied that end)."""
        probe = RoundVote(round_no=self.next_round, rank=report.rank, epoch=report.epoch)
        if report.rank not in self._epochs:
            raise VoteRejected(VoteRejectReason.UNKNOWN_RANK, probe)
        ours = self._epochs[report.rank]
        if report.epoch != ours:
            reason = VoteRejectReason.STALE_EPOCH if report.epoch < ours else VoteRejectReason.UNKNOWN_EPOCH
            raise VoteRejected(reason, probe, f"current epoch {ours}")
        if report.admitted and len(self.ranks) != 1:
            raise VoteRejected(VoteRejectReason.NOT_ALONE, probe, repr(report.admitted[0]))
        stored = self._reports.get(report.rank)
        if stored is not None and stored.seq >= report.seq:
            return False
        self._reports[report.rank] = report
        named = set(report.admitted)
        self._alone_ended &= named
        proposed = {a.parent for a in self._proposal.admissions} if self._proposal is not None else set()
        fresh = named - self._alone_ended - self.in_flight - proposed
        self.in_flight |= fresh
        self._alone |= fresh
        return True

    def reports_decide(self) -> bool:
        """Would a round without admissions decide anything from the stored
        reports alone (a cancel, failure, completion or decided parent)?
        Lets the caller skip a round that could only end empty: with TP ranks
        reporting one after the other, the first reports of an intersection
        decide nothing until the last one is in."""
        votes = [
            RoundVote(
                round_no=self.next_round,
                rank=rank,
                epoch=self._epochs[rank],
                cancels=got.cancels,
                completions=got.completions,
                failures=got.failures,
                prepared=got.prepared,
            )
            if (got := self._reports.get(rank)) is not None
            else RoundVote(round_no=self.next_round, rank=rank, epoch=self._epochs[rank])
            for rank in self.ranks
        ]
        probe = RoundProposal(round_no=self.next_round)
        decision = self._decide(probe, votes, complete=True)
        return bool(decision.settled() or decision.decided)

    def reports_waiting(self) -> bool:
        """Does some rank's report name an in-flight parent for an
        intersection (completion, or prepared and not yet decided) that the
        reports cannot decide yet? Then a rank has not done its share: slow,
        or dead (the caller probes every rank if it stays so)."""
        for got in self._reports.values():
            if any(p in self.in_flight for p in got.completions):
                return True
            if any(p in self.in_flight and p not in self.decided for p in got.prepared):
                return True
        return False

    def votes_from_reports(self, now: float) -> bool:
        """Vote in the open round on every rank's behalf from its latest
        report (a rank without one has no news: an empty vote). Only for a
        round without admissions (a lease needs the rank's own vote: else
        `RoundError`). Returns True (every vote is in: `close` it)."""
        proposal = self._proposal
        if proposal is None:
            raise RoundPhaseError(self.phase, "votes_from_reports")
        if proposal.admissions:
            raise RoundError("a round with admissions needs every rank's own vote")
        for rank in self.ranks:
            if rank in self._votes:
                continue
            got = self._reports.get(rank)
            self.receive_vote(
                RoundVote(
                    round_no=proposal.round_no,
                    rank=rank,
                    epoch=self._epochs[rank],
                    cancels=got.cancels if got else (),
                    completions=got.completions if got else (),
                    failures=got.failures if got else (),
                    prepared=got.prepared if got else (),
                ),
                now,
            )
        return True

    def open_round(
        self,
        admissions: Iterable[AdmissionRequest] = (),
        cancels: Iterable[ParentKey] = (),
        *,
        now: float,
        timeout: float,
        failures: Iterable[ParentKey] = (),
    ) -> RoundProposal:
        """Open the next round and return the proposal to send to every rank.

        Raises `RoundPhaseError` if a round is already open, and `RoundError`
        for a non-positive timeout, a parent admitted twice, a parent that is
        already in flight, or a batch larger than `MAX_ROUND_ITEMS`.
        """
        admissions = tuple(admissions)
        cancels = _sorted(cancels)
        failures = _sorted(failures)
        next_phase = self._fire("open_round")
        if not timeout > 0:
            raise RoundError(f"round timeout must be positive, got {timeout!r}")
        seen: set[ParentKey] = set()
        for admission in admissions:
            if admission.parent in seen:
                raise RoundError(f"parent {admission.parent!r} proposed twice")
            if admission.parent in self.in_flight:
                raise RoundError(f"parent {admission.parent!r} is already in flight")
            seen.add(admission.parent)
        if max(len(admissions), len(cancels), len(failures)) > MAX_ROUND_ITEMS:
            raise RoundError(f"a round batch is limited to {MAX_ROUND_ITEMS} parents per kind")
        proposal = RoundProposal(
            round_no=self.next_round,
            topology_digest=self.topology_digest,
            admissions=tuple(sorted(admissions, key=lambda a: _sort_key(a.parent))),
            cancels=cancels,
            failures=failures,
        )
        self.phase = next_phase
        self._proposal = proposal
        self._deadline = now + timeout
        self._votes = {}
        self.next_round += 1
        return proposal

    def receive_vote(self, vote: RoundVote, now: float) -> bool:
        """Record one vote; returns True when every rank has voted.

        A vote for another round, from an unknown rank or epoch, a duplicate,
        one naming an unproposed admission, or one arriving at or after the
        deadline raises `VoteRejected` and is not recorded: a late vote is
        never applied, even if the round has not been expired yet.
        """
        proposal = self._proposal
        if proposal is None:
            # Distinguish an old round from one that never existed.
            if vote.round_no < self.next_round:
                raise VoteRejected(VoteRejectReason.STALE_ROUND, vote)
            raise VoteRejected(VoteRejectReason.NO_ROUND_OPEN, vote)
        if vote.round_no < proposal.round_no:
            raise VoteRejected(VoteRejectReason.STALE_ROUND, vote)
        if vote.round_no > proposal.round_no:
            raise VoteRejected(VoteRejectReason.UNKNOWN_ROUND, vote)
        if vote.rank not in self._epochs:
            raise VoteRejected(VoteRejectReason.UNKNOWN_RANK, vote)
        our_epoch = self._epochs[vote.rank]
        if vote.epoch < our_epoch:
            raise VoteRejected(VoteRejectReason.STALE_EPOCH, vote, f"current epoch {our_epoch}")
        if vote.epoch > our_epoch:
            raise VoteRejected(VoteRejectReason.UNKNOWN_EPOCH, vote, f"current epoch {our_epoch}")
        if vote.rank in self._votes:
            raise VoteRejected(VoteRejectReason.DUPLICATE, vote)
        if now >= self._deadline:
            raise VoteRejected(
                VoteRejectReason.LATE, vote, f"now {now} >= deadline {self._deadline}"
            )
        proposed = {a.parent for a in proposal.admissions}
        extra = [p for p in vote.admit_ok if p not in proposed]
        if extra:
            raise VoteRejected(VoteRejectReason.NOT_PROPOSED, vote, repr(extra[0]))
        self._fire("receive_vote")
        self._votes[vote.rank] = vote
        return len(self._votes) == len(self.ranks)

    def close(self, now: float | None = None, *, vetoed: Iterable[ParentKey] = ()) -> RoundDecision:
        """Decide the open round; every vote must be in (else `RoundError`).

        ``vetoed`` admissions are rejected whatever the votes say: the peer
        instance refused them (a handoff needs both instances to admit)."""
        self._fire("close")
        missing = self.missing()
        if missing:
            raise RoundError(f"round {self.next_round - 1} still misses ranks {missing}")
        assert self._proposal is not None
        decision = self._decide(
            self._proposal, list(self._votes.values()), complete=True, vetoed=frozenset(vetoed)
        )
        self._finish(decision)
        return decision

    def expire(self, now: float) -> RoundTimedOut | None:
        """End the open round if its deadline passed with ranks missing.

        Returns None (and changes nothing) while the deadline has not passed
        or when every vote is in (then `close` it). Raises `RoundPhaseError`
        when no round is open.
        """
        self._fire("expire")
        if not self.expired(now):
            return None
        return self._time_out(self.missing())

    def abort(self, ranks: Iterable[int], now: float | None = None) -> RoundTimedOut:
        """End the open round now because ``ranks`` are known dead or invalid.

        The outcome names ``ranks`` plus any rank still missing; votes already
        received from ``ranks`` are discarded (their incarnation is distrusted).
        """
        self._fire("abort")
        bad = set(ranks)
        unknown = bad - set(self.ranks)
        if unknown:
            raise RoundError(f"abort names unknown ranks {sorted(unknown)}")
        return self._time_out(tuple(sorted(bad | set(self.missing()))))

    # -- internals -------------------------------------------------------------

    def _time_out(self, missing_ranks: tuple[int, ...]) -> RoundTimedOut:
        assert self._proposal is not None
        survivors = [v for r, v in self._votes.items() if r not in missing_ranks]
        decision = self._decide(self._proposal, survivors, complete=False)
        self._finish(decision)
        return RoundTimedOut(
            round_no=decision.round_no, missing_ranks=missing_ranks, decision=decision
        )

    def _finish(self, decision: RoundDecision) -> None:
        settled = decision.settled()
        ended_alone = self._alone & settled
        self._alone -= ended_alone
        self._alone_ended |= ended_alone
        self.decided.update(decision.decided)
        self.decided.difference_update(settled)
        self.in_flight.difference_update(settled)
        self.in_flight.update(decision.admitted)
        self.phase = RoundPhase.IDLE
        self._proposal = None
        self._votes = {}

    def _decide(
        self,
        proposal: RoundProposal,
        votes: list[RoundVote],
        *,
        complete: bool,
        vetoed: frozenset[ParentKey] = frozenset(),
    ) -> RoundDecision:
        proposed = {a.parent for a in proposal.admissions}
        # Default-deny: news only counts for parents this leader knows about.
        known = self.in_flight | proposed

        failed = set(proposal.failures)
        cancelled = set(proposal.cancels)
        for vote in votes:
            failed.update(vote.failures)
            cancelled.update(vote.cancels)
        if complete:
            admit_ok = set(proposed)
            completed: set[ParentKey] = set(self.in_flight)
            prepared: set[ParentKey] = set(self.in_flight) - self.decided
            for vote in votes:
                admit_ok.intersection_update(vote.admit_ok)
                completed.intersection_update(vote.completions)
                prepared.intersection_update(vote.prepared)
        else:
            # Missing ranks: nothing can be agreed, and every in-flight parent
            # has a shard on the missing rank.
            admit_ok = set()
            completed = set()
            prepared = set()
            failed.update(self.in_flight)
        failed &= known
        cancelled = (cancelled & known) - failed
        completed = completed - failed - cancelled
        admitted = admit_ok - failed - cancelled - vetoed
        rejected = proposed - admitted - failed - cancelled
        decided = prepared - failed - cancelled - completed
        return RoundDecision(
            round_no=proposal.round_no,
            topology_digest=proposal.topology_digest,
            admitted=_sorted(admitted),
            rejected=_sorted(rejected),
            cancelled=_sorted(cancelled),
            completed=_sorted(completed),
            failed=_sorted(failed),
            timed_out=not complete,
            decided=_sorted(decided),
        )


class RoundFollower:
    """One rank's view of the rounds: strict order, exactly once (sans-IO).

    A rank votes on proposal N only when it has applied N-1, at most once, and
    applies decision N only after N-1. Any other proposal or decision raises
    `RoundOrderError` and changes nothing. ``first_round`` lets a restarted
    rank join at the leader's next round.
    """

    def __init__(
        self,
        rank: int,
        epoch: int,
        *,
        first_round: int = 1,
        topology_digest: bytes | None = None,
    ) -> None:
        if first_round < 1:
            raise RoundError(f"first_round must be >= 1, got {first_round}")
        self.our_rank = rank
        self.our_epoch = epoch
        self.topology_digest = topology_digest
        #: the last round whose decision this rank applied (first_round - 1 at start)
        self.last_applied = first_round - 1
        #: the last round this rank voted in
        self.last_voted = first_round - 1
        # Intents recorded between rounds (see `record_cancel` & co.). Unions
        # (cancels, failures) are cleared by the decision that saw them;
        # intersections (completions, prepared) are reported until settled.
        self._cancels: set[ParentKey] = set()
        self._completions: set[ParentKey] = set()
        self._failures: set[ParentKey] = set()
        self._prepared: set[ParentKey] = set()
        self._admitted: set[ParentKey] = set()
        # Parents our leader holds in flight as far as we know: admitted by a
        # decision we applied, until a decision ends them (`forget` keeps
        # their union news: the leader waits for it).
        self._known: set[ParentKey] = set()
        # (round, cancels, failures) of our latest vote: only those are cleared
        # by that round's decision, never intents recorded after it left.
        self._reported: tuple[int, frozenset[ParentKey], frozenset[ParentKey]] = (
            0,
            frozenset(),
            frozenset(),
        )
        self._report_seq = 0

    # -- intents: recorded between rounds, carried by the next vote or report --

    def record_cancel(self, parent: ParentKey) -> None:
        """Queue a cancel intent (a union: one rank's report suffices)."""
        self._cancels.add(parent)

    def record_failure(self, parent: ParentKey) -> None:
        """Queue a failure (e.g. evidence UNKNOWN; a union)."""
        self._failures.add(parent)

    def record_completion(self, parent: ParentKey) -> None:
        """Report ``parent`` complete here until a decision settles it (an
        intersection: every rank must report it in the same round)."""
        self._completions.add(parent)

    def record(self, news: News, parent: ParentKey) -> None:
        """Record one piece of `news` about `parent` (protocol/_decision.py
        `report_of` says which an action carries)."""
        match news:
            case News.CANCEL:
                self.record_cancel(parent)
            case News.FAILURE:
                self.record_failure(parent)
            case News.COMPLETION:
                self.record_completion(parent)

    def record_prepared(self, parent: ParentKey) -> None:
        """Report every local edge of ``parent`` prepared until a decision
        decides or settles it (an intersection, like completions)."""
        self._prepared.add(parent)

    def record_admitted(self, parent: ParentKey) -> None:
        """Report ``parent`` admitted by this rank alone (the rank is its
        instance's whole intersection) until a decision ends it, held here or
        not (every admitted parent makes news that ends it there): the leader
        takes it in flight from the report."""
        self._admitted.add(parent)

    def has_news(self) -> bool:
        return bool(self._cancels or self._completions or self._failures or self._prepared or self._admitted)

    def forget(self, alive: Callable[[ParentKey], bool]) -> None:
        """Drop union intents about parents this rank no longer holds and its
        leader never took in flight (nothing is left to cancel or fail there,
        and they must not ride in every report forever).

        A parent the leader holds keeps its news until a decision ends it,
        held here or not: a rank that released a parent (its quarantine
        reclaimed by a death proof, say) before a round decided its cancel
        must still report that cancel, or the leader waits for the parent
        forever (L1). Those are the parents a decision admitted and the
        parents this rank admitted alone (`record_admitted`, reported until
        a decision ends them)."""

        def keep(parent: ParentKey) -> bool:
            return alive(parent) or parent in self._known or parent in self._admitted

        self._cancels = {p for p in self._cancels if keep(p)}
        self._failures = {p for p in self._failures if keep(p)}

    def report(self) -> RankReport:
        """This rank's current news as a `RankReport` (pushed between rounds)."""
        self._report_seq += 1
        return RankReport(
            rank=self.our_rank,
            epoch=self.our_epoch,
            seq=self._report_seq,
            cancels=_sorted(self._cancels),
            completions=_sorted(self._completions),
            failures=_sorted(self._failures),
            prepared=_sorted(self._prepared),
            admitted=_sorted(self._admitted),
        )

    def vote_with_news(
        self, proposal: RoundProposal, admit_ok: Iterable[ParentKey] = ()
    ) -> RoundVote:
        """`vote` carrying every recorded intent."""
        vote = self.vote(
            proposal,
            admit_ok=admit_ok,
            cancels=self._cancels,
            completions=self._completions,
            failures=self._failures,
            prepared=self._prepared,
        )
        self._reported = (vote.round_no, frozenset(vote.cancels), frozenset(vote.failures))
        return vote

    @property
    def next_round(self) -> int:
        return self.last_applied + 1

    def join(self, next_round: int) -> None:
        """Start at ``next_round`` (a fresh incarnation joining a running
        leader); intents recorded meanwhile are kept. Raises `RoundError`
        once this follower took part in a round."""
        if self.last_applied != 0 or self.last_voted != 0:
            raise RoundError(f"rank {self.our_rank} already took part in rounds; cannot rejoin")
        if next_round < 1:
            raise RoundError(f"next_round must be >= 1, got {next_round}")
        self.last_applied = self.last_voted = next_round - 1

    def _check_digest(self, what: str, digest: bytes | None) -> None:
        if self.topology_digest is not None and digest != self.topology_digest:
            raise StaleError(f"topology digest of {what}", digest, self.topology_digest)

    def vote(
        self,
        proposal: RoundProposal,
        *,
        admit_ok: Iterable[ParentKey] = (),
        cancels: Iterable[ParentKey] = (),
        completions: Iterable[ParentKey] = (),
        failures: Iterable[ParentKey] = (),
        prepared: Iterable[ParentKey] = (),
    ) -> RoundVote:
        """Build this rank's vote on ``proposal`` (the next round only, once)."""
        self.check_proposal(proposal)
        proposed = {a.parent for a in proposal.admissions}
        our_ok = _sorted(admit_ok)
        extra = [p for p in our_ok if p not in proposed]
        if extra:
            raise RoundError(f"rank {self.our_rank}: admit_ok names unproposed {extra[0]!r}")
        vote = RoundVote(
            round_no=proposal.round_no,
            rank=self.our_rank,
            epoch=self.our_epoch,
            admit_ok=our_ok,
            cancels=_sorted(cancels),
            completions=_sorted(completions),
            failures=_sorted(failures),
            prepared=_sorted(prepared),
        )
        self.last_voted = proposal.round_no
        return vote

    def check_proposal(self, proposal: RoundProposal) -> None:
        """Raise unless ``proposal`` is the next round and not yet voted on."""
        self._check_digest("proposal", proposal.topology_digest)
        if proposal.round_no != self.next_round or self.last_voted >= proposal.round_no:
            raise RoundOrderError(
                self.our_rank,
                "proposal",
                proposal.round_no,
                max(self.next_round, self.last_voted + 1),
            )

    def check_decision(self, decision: RoundDecision) -> None:
        """Raise unless ``decision`` is for exactly the next round."""
        self._check_digest("decision", decision.topology_digest)
        if decision.round_no != self.next_round:
            raise RoundOrderError(self.our_rank, "decision", decision.round_no, self.next_round)

    def apply(self, decision: RoundDecision) -> None:
        """Record ``decision`` as applied (check first: nothing changes on error)."""
        self.check_decision(decision)
        self.last_applied = decision.round_no
        # A rank that never voted (its proposal was lost or late) still applies
        # the decision; its vote on that round would now be stale.
        self.last_voted = max(self.last_voted, decision.round_no)
        settled = decision.settled()
        self._known |= set(decision.admitted)
        self._known -= settled
        self._prepared -= settled
        self._prepared.difference_update(decision.decided)
        self._completions -= settled
        self._cancels -= settled
        self._failures -= settled
        self._admitted -= settled  # the leader knew it: it decided its end
        reported_round, reported_cancels, reported_failures = self._reported
        if reported_round == decision.round_no and not decision.timed_out:
            # Union news we voted reached a full decision (which saw every
            # vote, ours included): done. A timed-out round may not have seen
            # our vote, so its news stays queued for the next round.
            self._cancels -= reported_cancels
            self._failures -= reported_failures
