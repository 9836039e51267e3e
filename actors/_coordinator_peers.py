"""The coordinator's pairing with the peer instance (part of
`CoordinatorCore`, actors/_coordinator.py): the peer coordinators' handles,
the peer instance's admission of a round's batch (`admit_many` /
`claim_many`) and taking back what only it admitted, cancels forwarded there,
learning which peers admit at the OPEN, and a one-rank instance's admission
alone. `CoordinatorCore` inherits it as `PeersMixin`."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import ray

from kvhandoff.actors._channel import RESULTS
from kvhandoff.actors._coordinator_errors import AdmissionStopped
from kvhandoff.actors._coordinator_rounds import _key
from kvhandoff.actors._coordinator_state import CoordinatorState
from kvhandoff.actors._trace import SENT
from kvhandoff.protocol import (
    AdmissionRequest,
    ParentKey,
    RoundDecision,
    RoundError,
    StaleEpochError,
    pairing_undo,
)


class PeersMixin(CoordinatorState):
    """The pairing of `CoordinatorCore`: it owns the state declared here."""

    _trace_peer: str
    _peer_name: str | None
    _peer: Any
    _fleet: str | None
    _peers: dict[str, Any]
    _alone_calls: dict[ParentKey, asyncio.Future[None]]
    _asking_direct: set[str]
    _last_decided: int

    if TYPE_CHECKING:  # CoordinatorCore's
        def _own(self, coro: Any) -> None: ...

    # -- admission alone, and the peer instances ----------------------------------------

    def _idle_for_alone(self) -> bool:
        """May a submission be admitted alone now? Only while nothing else is
        under way here: no other submission waiting for its outcome, no
        admission queued, no round running, no admission alone out. Under load a round admits the whole batch with
        one call per rank, and the rank sends their OPENs in one frame call
        per peer; an admission alone is one call per handoff, and its OPENs
        go in a frame call of their own. Measured on the GPU host at 16
        clients per instance with every admission alone: rank frame calls per
        handoff 0.6 -> 2.0 and a third of a pair's rate lost. So a lone
        handoff takes the short path (two hops fewer) and a busy instance
        batches."""
        return not self._submitted and not self._pending_admits and not self._alone_calls and not self._round_lock.locked()

    async def _admit_alone(self, request: AdmissionRequest) -> None:
        """Hand ``request`` to this one-rank instance's rank, which admits it
        with no round (`admit_alone`; its CTX peer admits at the OPEN). The
        rank's report comes back with its answer and goes to the leader
        first, so the parent is in flight before a cancel of it (which waits
        for this call) is proposed. A refusal answers "rejected"; a rank
        that failed or restarted meanwhile, "failed" (whatever it admitted
        died with it: a new incarnation is a new pool)."""
        parent = request.parent
        self.calls["rank_admit_alone"] += 1
        if self.trace.every:
            self.trace.record(parent.request_id, f"{SENT}admit_alone", "local")
        # A decision kept to ride with a vote rides with this call instead
        # (no vote will come), to the incarnation it was decided for: the
        # rank applies it first, so the blocks its completions return are
        # free for this admission. Else the rank admits only once it applied
        # every decision up to here (one may still be on its way).
        if self._peer_claims:
            # Our rank's OPEN binds the published parent (the peer's one rank
            # refuses an OPEN of another GEN instance). The claim only names
            # us to the peer coordinator, which forwards a cancel here: sent
            # now, answered off the handoff's path.
            self._own(self._claim_alone(request))
        carried, self._carried = self._carried, None
        epoch = self._epochs[0]
        rides = carried.decision if carried is not None and carried.epochs[0] == epoch else None
        replied: Any = StaleEpochError(epoch, carried.epochs[0]) if carried is not None and rides is None else None
        try:
            args = (request, epoch, self._last_decided, rides)
            reply, _ = self._links.call(0, self._handles[0], "admit_alone", args, RESULTS["admit_alone"])
            admitted, report = await reply
            if rides is not None:
                replied = rides.round_no
                self.calls["applies_carried"] += 1
        except Exception as exc:
            replied = exc
            self._rank_errors.append(f"rank 0: admit_alone({parent!r}): {exc!r}")
            admitted, report, outcome = False, None, "failed"
        else:
            outcome = "rejected"
        finally:
            self._alone_calls.pop(parent, None)
            if carried is not None and not carried.replies[0].done():
                carried.replies[0].set_result(replied)
        if report is not None and self._leader is not None:
            try:
                if self._leader.report(report):
                    self._wakeup.set()
            except RoundError:
                admitted, outcome = False, "failed"  # another incarnation's: it restarted meanwhile
        if admitted:
            return  # in flight: the decision that ends it answers the submission
        self._counts["rejected" if outcome == "rejected" else "failed"] += 1
        self._outcomes.remember(parent, outcome, time.monotonic())
        self._complete_at_decision.discard(parent)
        submitted = self._submitted.pop(parent, None)
        if submitted is not None and not submitted.done():
            submitted.set_result(outcome)

    async def _claim_alone(self, request: AdmissionRequest) -> None:
        """Name this instance as the claimer of a parent admitted alone (its
        peer binds at the first OPEN). A refusal changes nothing here: the
        OPEN is the claim that counts, refused at the peer's rank if the
        parent is gone, cancelled or bound to another GEN instance."""
        self.calls["claims_alone"] += 1
        try:
            async with asyncio.timeout(self._round_timeout * 2):
                ours = self.topology if self._fleet else ""
                await self._peer_coordinator(request.peer_instance).claim_many.remote([request.parent], ours)
        except Exception as exc:
            self._rank_errors.append(f"claim of {request.parent!r}: {exc!r}"[:500])

    def _peer_coordinator(self, instance: str = "") -> Any:
        """The coordinator of peer instance `instance` ("": the configured peer)."""
        if not instance:
            if self._peer is None:
                assert self._peer_name is not None
                self._peer = ray.get_actor(self._peer_name)
            return self._peer
        found = self._peers.get(instance)
        if found is None:
            found = self._peers[instance] = ray.get_actor(f"{self._fleet}.coord.{instance}")
        return found

    async def forget_peer(self, instance: str) -> None:
        """Peer instance `instance` left the fleet: drop its cached handle."""
        self._peers.pop(instance, None)
        self._direct.pop(instance, None)

    async def admits_at_open(self) -> bool:
        """Whether this instance's rank admits a handoff at its first OPEN
        (a GEN coordinator then asks it no admission)."""
        return self._admits_at_open

    async def binds_at_first_open(self) -> bool:
        """Whether a parent this instance published binds to the first GEN
        instance whose OPEN reaches it: true for an instance of one rank,
        whose rank records at most the parent's edges and decides it alone
        (an OPEN of a second GEN instance is refused there). A GEN instance
        of one rank then admits a claim of it alone; with more ranks, two
        GEN instances could each bind a different rank first, so the claim
        (`claim_many`) must come before any OPEN."""
        return self._tp == 1

    def _ask_direct(self, admissions: list[AdmissionRequest]) -> None:
        """Start learning whether the peer instances of `admissions` admit at
        the OPEN (once per peer incarnation; until the answer, they are
        asked to admit as usual: the two ways of admitting mix safely, a
        CTX rank admits at an OPEN only a parent it does not hold)."""
        for peer in {a.peer_instance for a in admissions}:
            if peer not in self._direct and peer not in self._asking_direct:
                self._asking_direct.add(peer)
                self._own(self._learn_direct(peer))

    async def _learn_direct(self, peer: str) -> None:
        try:
            async with asyncio.timeout(self._round_timeout * 2):
                coordinator = self._peer_coordinator(peer)
                asked = coordinator.binds_at_first_open if self._peer_claims else coordinator.admits_at_open
                direct = bool(await asked.remote())
        except Exception:
            direct = False  # gone, or does not say: admit it in its rounds
        finally:
            self._asking_direct.discard(peer)
        self._direct[peer] = direct

    # -- the peer instance's admission of a round's batch -------------------------------

    def _undo_pairing(self, decision: RoundDecision, peer_answer: asyncio.Future[set[ParentKey]] | None) -> None:
        """The peer admitted what we did not: take it back there (once its
        answer is in; it is by the time the round decided)."""
        if peer_answer is None:
            return

        async def undo() -> None:
            peer_ok = await peer_answer
            undo = pairing_undo(sorted(peer_ok, key=_key), set(decision.admitted))
            for instance in sorted({self._peer_of.get(p, "") for p in undo}):
                await self._peer_cancel([p for p in undo if self._peer_of.get(p, "") == instance], instance)

        self._own(undo())

    async def _peers_admit(self, admissions: list[AdmissionRequest]) -> set[ParentKey]:
        """The parents their peer instances admitted: one call per peer
        instance, all at once (a fleet pairs one round's batch with many)."""
        by_peer: dict[str, list[AdmissionRequest]] = {}
        for a in admissions:
            by_peer.setdefault(a.peer_instance, []).append(a)
        answers = await asyncio.gather(*(self._peer_admit(peer, batch) for peer, batch in by_peer.items()))
        return set().union(*answers)

    async def _peer_admit(self, instance: str, admissions: list[AdmissionRequest]) -> set[ParentKey]:
        """The parents peer instance `instance` admitted (none if it refused,
        is restarting or draining, failed or did not answer within the round
        bound)."""
        self.calls["peer_admit_calls"] += 1
        # The peer's ranks learn which instance of ours each parent pairs with.
        ours = self.topology if self._fleet else ""
        if self.trace.every:  # sent while our ranks vote: mark it (actors/_trace.py)
            ids = [a.parent.request_id for a in admissions]
            self.trace.record_many(ids, f"{SENT}admit_many", "local")
        try:
            async with asyncio.timeout(self._round_timeout * 2):
                if self._peer_claims:
                    answers = await self._peer_coordinator(instance).claim_many.remote(
                        [a.parent for a in admissions], ours
                    )
                else:
                    answers = await self._peer_coordinator(instance).admit_many.remote(
                        [(a.parent, a.num_tokens) for a in admissions], ours
                    )
            if self.trace.every:
                source = f"coord@{instance}" if instance else self._trace_peer
                ids = [a.parent.request_id for a in admissions]
                self.trace.record_many(ids, "admit_many", "reply", source)
        except Exception as exc:
            self._rank_errors.append(f"peer admission: {exc!r}"[:500])
            if not isinstance(exc, AdmissionStopped):
                # Not a refusal (it is restarting: retry later) but a failure:
                # the peer died, failed, or did not answer in time.
                for a in admissions:
                    self._peer_failed.add(a.parent)
            # It may still admit them later (a slow answer): cancel there.
            self._own(self._peer_cancel([a.parent for a in admissions], instance))
            return set()
        return {a.parent for a, ok in zip(admissions, answers) if ok}

    async def _peer_cancel(self, parents: list[ParentKey], instance: str = "") -> None:
        self.calls["peer_cancel_calls"] += 1
        try:
            await self._peer_coordinator(instance).cancel_many.remote(parents)
        except Exception as exc:
            self._rank_errors.append(f"peer cancel: {exc!r}"[:500])
