"""The state `CoordinatorCore` keeps and more than one of its parts reads
(part of the coordinator, actors/_coordinator.py): declared once here, as
annotations only, for the mixins that split the coordinator (rounds,
peers, ranks) to type-check against; the core assigns every attribute."""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING, Any

from kvhandoff.actors._channel import RankLinks
from kvhandoff.actors._coordinator_errors import TopologyState
from kvhandoff.actors._metrics import InstanceMetrics
from kvhandoff.actors._trace import TraceRecorder
from kvhandoff.protocol import AdmissionRequest, ParentKey, RecentMemory, RoundLeader

if TYPE_CHECKING:
    from kvhandoff.actors._coordinator_rounds import _Carried

__all__ = ["CoordinatorState"]


class CoordinatorState:
    """What more than one part of the coordinator reads (the core assigns it)."""

    topology: str
    state: TopologyState
    calls: collections.Counter[str]
    trace: TraceRecorder
    _tp: int
    _handles: list[Any]
    _epochs: list[int]
    #: A channel per rank incarnation for the round calls (actors/_channel.py).
    _links: RankLinks
    _leader: RoundLeader | None
    _metrics: InstanceMetrics
    _detached: set[int]
    _admits_at_open: bool
    _admits_alone: bool
    #: Admissions a round takes next (each `_checked`), and what its decision answers.
    _pending_admits: dict[ParentKey, tuple[AdmissionRequest, asyncio.Future[bool]]]
    _pending_cancels: dict[ParentKey, list[asyncio.Future[str | None]]]
    _pending_failures: set[ParentKey]
    _submitted: dict[ParentKey, asyncio.Future[str]]
    _admit_at_decision: set[ParentKey]
    _complete_at_decision: set[ParentKey]
    _returns_awaited: set[ParentKey]
    _want_votes: bool
    _round_lock: asyncio.Lock
    _wakeup: asyncio.Event
    _rank_errors: collections.deque[str]
    _round_timeout: float
    _peer_claims: bool
    _direct: dict[str, bool]
    _peer_of: RecentMemory[ParentKey, str]
    _peer_failed: set[ParentKey]
    _carried: _Carried | None
    _counts: collections.Counter[str]
    _outcomes: RecentMemory[ParentKey, str]
