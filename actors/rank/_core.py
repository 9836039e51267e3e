"""`RankCore`: what every rank actor does, whatever its role, mixed from its
concerns (actors/rank/_peers.py, _control.py and _poll.py, over the state
and hooks of actors/rank/_state.py), with its round and lifecycle actor
methods.
"""

from __future__ import annotations

import asyncio

from kvhandoff.actors._channel import carried_by
from kvhandoff.actors._member import RoundParticipant
from kvhandoff.actors._trace import decision_ids, proposal_ids
from kvhandoff.actors.rank._control import _ControlPlane
from kvhandoff.actors.rank._peers import _Peers
from kvhandoff.actors.rank._poll import _Polling
from kvhandoff.protocol import RoundDecision, RoundProposal, RoundVote


class RankCore(_Peers, _ControlPlane, _Polling, RoundParticipant):
    """What every rank actor does, whatever its role (the package docstring,
    actors/rank/__init__.py). Not an actor itself: `CtxRankCore` and
    `GenRankCore` fill in the role's hooks (the methods of `_RankState` that
    raise `NotImplementedError` or do nothing), and `rank_actor_class(role)`
    is either one as a Ray actor."""

    # -- rounds (RoundParticipant exposes the member's methods as actor methods) ------

    async def round_vote(
        self, proposal: RoundProposal, epoch: int | None = None, decision: RoundDecision | None = None
    ) -> RoundVote:
        if self.trace.every:
            if decision is not None:  # the previous round's decision rides with this proposal
                self.trace.record_many(decision_ids(decision), "round_apply", carried_by(), self._coordinator_actor)
            ids = proposal_ids(proposal)
            self.trace.record_many(ids, "round_vote", carried_by(), self._coordinator_actor)
        if decision is not None:
            self._ensure_polling()  # the decision riding along may post chunks or start drains
        return await super().round_vote(proposal, epoch, decision)

    async def round_apply(self, decision: RoundDecision, epoch: int | None = None) -> int:
        if self.trace.every:
            ids = decision_ids(decision)
            self.trace.record_many(ids, "round_apply", carried_by(), self._coordinator_actor)
        self._ensure_polling()  # a decision may post chunks or start drains
        return await super().round_apply(decision, epoch)

    async def watch(self) -> None:
        """Never answers while this rank lives (returns at `shutdown`): its
        coordinator awaits it and learns of the rank's death at once (Ray
        fails the call), without waiting for its next round."""
        if self._stopped is None:
            self._stopped = asyncio.Event()
        await self._stopped.wait()

    async def shutdown(self) -> None:
        if self._stopped is not None:
            self._stopped.set()
        if self._streams is not None:
            self._streams.close()
        if self._calls is not None:
            self._calls.close()
        for task in list(self._tasks):
            task.cancel()
        if self._poll_task is not None:
            self._poll_task.cancel()

