"""`PairCore`: one CTX instance and one GEN instance, whoever hosts the ranks.

`Deployment` is this pair over kvhandoff's own synthetic hosts (rank actors
it places and starts, restartable by their coordinator); `EngineDeployment`
is the same pair over an engine's workers (each hosting its endpoint over
the engine's tensors). Both start their instances the one way every
instance starts (actors/_instance.py), and share, from here:

- the coordinators by role, the GEN one paired with the CTX one: it admits a
  request in both instances and answers the submission that ends it;
- a cancel is one client call, to the GEN coordinator, which cancels in both
  instances (its forward to the CTX coordinator is sent after any admission
  or claim it asked there, so it cannot overtake it). Only when the GEN
  coordinator cannot be asked (it died) does the client cancel on the CTX
  coordinator itself, so the CTX blocks are not left to their lease;
- `stats()`: every coordinator's and every rank's, readable while parts are
  dead (an unreachable coordinator, a rank that does not answer, each
  reported in its place).

What differs is only how a request enters: a `Deployment` submits a
request id and the ranks lease blocks from their own pools; an engine
publishes the blocks its block manager chose and receives into others.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

from kvhandoff.actors._carrier import CarrierChoice
from kvhandoff.actors._client import ClientCore
from kvhandoff.protocol import ParentKey, Role

__all__ = ["PairCore"]

log = logging.getLogger("kvhandoff.deployment")


class PairCore(ClientCore):
    """What a one-pair client handle is (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        #: The control-frame carrier taken at launch (actors/_carrier.py); None
        #: for a handle that found a running deployment.
        self.carrier: CarrierChoice | None = None
        self._coords: dict[Role, Any] = {}
        #: Ray calls this client made, per kind (the bench prints them per handoff).
        self.calls: collections.Counter[str] = collections.Counter()

    def _coordinators(self) -> list[Any]:
        return list(self._coords.values())

    # -- cancel -------------------------------------------------------------------------

    async def _cancel_parent(self, parent: ParentKey, attempt: Any = None) -> None:
        """Cancel `parent` in both instances: one call (module docstring)."""
        self.calls["cancel"] += 1
        try:
            await self._cancel_call(attempt, parent)
        except Exception as exc:
            log.debug("%s: cancel of %s through the GEN coordinator raised: %r", self.name, parent, exc)
            ctx = self._ctx_coordinator(attempt)
            if ctx is not None:
                try:
                    await ctx.cancel.remote(parent)
                except Exception as err:  # both coordinators gone: their ranks' leases end it
                    log.debug("%s: cancel of %s on the CTX coordinator raised: %r", self.name, parent, err)

    def _cancel_call(self, attempt: Any, parent: ParentKey) -> Any:
        """The cancel's Ray call: to the GEN coordinator (a fleet names the attempt's)."""
        return self._coords[Role.GEN].cancel.remote(parent)

    def _ctx_coordinator(self, attempt: Any) -> Any:
        """The CTX coordinator a cancel falls back to (a fleet: the attempt's, if known)."""
        return self._coords.get(Role.CTX)

    # -- stats --------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """Per-rank pool counts and counters, and each coordinator's stats.

        Works while parts are dead: a coordinator that does not answer is
        reported as {"state": "unreachable", "error": ...}, its ranks are
        asked through the last known handles, and a rank that does not answer
        is reported as {"error": ..., "role": ..., "rank": ...}."""
        self._check_open()
        roles = list(self._coords)
        coords = await asyncio.gather(*(self._coords[r].stats.remote() for r in roles), return_exceptions=True)
        handles = await asyncio.gather(*(self._coords[r].rank_handles.remote() for r in roles), return_exceptions=True)
        who: list[tuple[Role, int, Any]] = []
        for role, found in zip(roles, handles):
            if isinstance(found, BaseException):
                found = self._known_ranks(role)
            who += [(role, rank, h) for rank, h in enumerate(found)]
        per_rank = await asyncio.gather(*(h.stats.remote() for _, _, h in who), return_exceptions=True)
        return {
            **self._stats_head(),
            # This client's submissions: calls of one, batches, requests.
            "submits": dict(self._submitter.counters),
            "control_frames": self.carrier.as_dict() if self.carrier is not None else self._default_carrier(),
            "ranks": [
                s if isinstance(s, dict) else {"error": repr(s)[:500], "role": role.value, "rank": rank}
                for (role, rank, _), s in zip(who, per_rank)
            ],
            "coordinators": {
                role.value: c if isinstance(c, dict) else {"state": "unreachable", "error": repr(c)[:500]}
                for role, c in zip(roles, coords)
            },
        }

    def _stats_head(self) -> dict[str, Any]:
        """What `stats()` says of the handle itself, first."""
        return {"name": self.name}

    def _default_carrier(self) -> dict[str, Any] | None:
        """`stats()["control_frames"]` of a handle that took no carrier itself."""
        return None

    def _known_ranks(self, role: Role) -> list[Any]:
        """The last rank handles this client knew of `role`'s instance."""
        return []
