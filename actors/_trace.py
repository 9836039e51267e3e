"""Per-handoff hop traces: where a sampled handoff's time goes, hop by hop.

Every actor on a handoff's path (the client, both coordinators, the ranks)
records an event when a message about a traced request reaches it: when
(wall clock, ns), where (the actor: ``rank<k>@<instance id>``, ``coord@<instance id>`` or ``client``), what (the call, reply or frame) and the
carrier it came by:

- ``call``: a Ray actor call arrived (a submission, a vote or apply, a report,
  a frame call);
- ``reply``: the answer to a Ray call we made arrived;
- ``notif``: a NIXL notification arrived (frames with ``control_frames="nixl"``);
- ``stream``: a frame arrived on a rank's TCP stream (``control_frames="stream"``);
- ``channel``: a round call, its answer or a report arrived on the TCP
  channel between a coordinator and its rank (``control_frames="stream"``);
- ``local``: no message (the client's start).

A request is traced when its id samples in: ``crc32(request_id) % every == 0``
(`TraceRecorder.sampled`), so every actor agrees without a word on the wire
and a trace costs nothing for the requests it does not sample. ``every=0``
(the default) records nothing; ``every=1`` records every request (the bench).

`critical_path` rebuilds the sequential path from the merged events of every
actor: an event that came by a message is caused by the latest earlier event
of the actor that sent it (when the receiver knows the sender: a reply, a
round message, a frame; else of any other actor: the sender acted last
before it), a local one by the previous event of its own actor. The path's message arrivals are the hops.
On one host the wall clocks agree; across nodes the per-hop times carry the
clock skew between them (the hop count stays right while the skew is under
one hop). Parallel branches off the path (a vote that answered before the
peer instance did) are not hops: nothing on the path waited for them.
"""

from __future__ import annotations

import asyncio
import collections
import time
import zlib
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any

import msgspec

from kvhandoff.protocol import RankNamespace, RankReport, RoundDecision, RoundProposal, RoundVote

#: The caller's name in traces: its last event ends the critical path.
CLIENT = "client"

#: A local event named ``SENT + what`` marks when an actor sent a call
#: ``what`` (`critical_path` takes the call's cause from it).
SENT = "sent:"

#: How a traced event reached its actor.
CARRIERS = ("call", "reply", "notif", "stream", "channel", "local")

#: Requests one actor keeps events of at most (oldest dropped first), and
#: events per request at most (later ones dropped, counted).
MAX_REQUESTS = 1024
MAX_EVENTS = 256


class TraceEvent(msgspec.Struct, frozen=True, array_like=True):
    """One message arrival (or local step) of a traced request."""

    t_ns: int  # time.time_ns() where it happened
    actor: str  # who: "client", "gen.coord", "ctx.rank0", ...
    what: str  # the call, reply or frame: "submit", "round_apply", "frame:OPEN", ...
    carrier: str  # one of CARRIERS
    source: str = ""  # the actor the message came from, where the receiver knows it


class Hop(msgspec.Struct, frozen=True):
    """One step of the critical path: the event, and the time since the step
    before it (0 for the first)."""

    actor: str
    what: str
    carrier: str
    since_prev_ms: float


class HandoffTrace(msgspec.Struct, frozen=True):
    """A traced request's merged events and its critical path.

    ``hops``: message arrivals on the critical path (the sequential actor
    hops the request waited for); ``total_ms``: first to last event of the
    path; ``by_carrier``: the path's hops per carrier; ``events``: every
    recorded event, in time order (parallel branches included)."""

    request_id: str
    hops: int
    total_ms: float
    by_carrier: dict[str, int]
    path: list[Hop]
    events: list[TraceEvent]


def rank_actor_name(ns: RankNamespace) -> str:
    """A rank actor's name in traces (a coordinator's: ``coord@<instance id>``)."""
    return f"rank{ns.rank}@{ns.instance_id}"


def proposal_ids(proposal: RoundProposal) -> list[str]:
    """The request ids a round proposal is about."""
    return [a.parent.request_id for a in proposal.admissions] + [
        p.request_id for p in (*proposal.cancels, *proposal.failures)
    ]


def decision_ids(decision: RoundDecision) -> list[str]:
    """The request ids a round decision is about."""
    return [
        p.request_id
        for p in (
            *decision.admitted,
            *decision.rejected,
            *decision.cancelled,
            *decision.completed,
            *decision.failed,
            *decision.decided,
        )
    ]


def news_ids(news: RoundVote | RankReport) -> list[str]:
    """The request ids a vote or a report carries news of."""
    parents = (*news.cancels, *news.completions, *news.failures, *news.prepared)
    return [p.request_id for p in (*parents, *getattr(news, "admit_ok", ()))]


def sampled(request_id: str, every: int) -> bool:
    """Whether `request_id` is traced at sampling rate 1/`every` (0: never)."""
    return every > 0 and (every == 1 or zlib.crc32(request_id.encode()) % every == 0)


class TraceRecorder:
    """One actor's recorder. Cheap when off: `on` is one comparison."""

    def __init__(self, actor: str, every: int = 0) -> None:
        self.actor = actor
        self.every = 0
        self.dropped = 0
        self._events: collections.OrderedDict[str, list[TraceEvent]] = collections.OrderedDict()
        # Requests whose events were taken: what comes later (a rank applying
        # a decision the client already heard) is off the path, not kept.
        self._taken: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.set_every(every)

    def set_every(self, every: int) -> None:
        """Trace one request in `every` (0: none). Events already kept stay."""
        if type(every) is not int or every < 0:
            raise ValueError(f"trace sampling must be an int >= 0 (0: off), got {every!r}")
        self.every = every

    def on(self, request_id: str) -> bool:
        return self.every > 0 and sampled(request_id, self.every)

    def record(
        self, request_id: str, what: str, carrier: str, source: str = "", t_ns: int | None = None
    ) -> None:
        """An event of `request_id` here (no-op for a request not sampled)."""
        if not self.on(request_id) or request_id in self._taken:
            return
        events = self._events.get(request_id)
        if events is None:
            events = self._events[request_id] = []
            while len(self._events) > MAX_REQUESTS:
                self._events.popitem(last=False)
                self.dropped += 1
        if len(events) >= MAX_EVENTS:
            self.dropped += 1
            return
        events.append(
            TraceEvent(time.time_ns() if t_ns is None else t_ns, self.actor, what, carrier, source)
        )

    def record_many(
        self, request_ids: Iterable[str], what: str, carrier: str, source: str = ""
    ) -> None:
        """One event for each sampled request of a batch (a round message)."""
        if self.every <= 0:
            return
        t_ns = time.time_ns()
        for request_id in dict.fromkeys(request_ids):
            self.record(request_id, what, carrier, source, t_ns)

    def take(self, request_id: str) -> list[TraceEvent]:
        """The events kept for `request_id`, forgotten here; later ones of it
        are not kept (bounded: the oldest taken ids are forgotten first)."""
        self._taken[request_id] = None
        while len(self._taken) > MAX_REQUESTS:
            self._taken.popitem(last=False)
        return self._events.pop(request_id, [])

    def stats(self) -> dict[str, Any]:
        return {"every": self.every, "requests": len(self._events), "dropped": self.dropped}


def critical_path(request_id: str, events: Sequence[TraceEvent]) -> HandoffTrace:
    """The request's critical path through `events` (every actor's, merged),
    ending at the client's last event (it learned the outcome), or at the
    last event when the client recorded none."""
    ordered = sorted(events, key=lambda e: (e.t_ns, e.actor))
    if not ordered:
        return HandoffTrace(request_id, 0, 0.0, {}, [], [])
    # The path ends where the client learned the outcome (events after it,
    # such as ranks applying a decision already answered, are off the path).
    clients = [i for i, e in enumerate(ordered) if e.actor == CLIENT]
    chain = [clients[-1] if clients else len(ordered) - 1]
    while True:
        i = chain[-1]
        event = ordered[i]
        cause = _cause(ordered, i)
        if cause is None:
            break
        chain.append(cause)
    chain.reverse()
    path: list[Hop] = []
    by_carrier: collections.Counter[str] = collections.Counter()
    for k, i in enumerate(chain):
        event = ordered[i]
        since = 0.0 if k == 0 else (event.t_ns - ordered[chain[k - 1]].t_ns) / 1e6
        path.append(Hop(event.actor, event.what, event.carrier, since))
        if k > 0 and event.carrier != "local":
            by_carrier[event.carrier] += 1
    total = (ordered[chain[-1]].t_ns - ordered[chain[0]].t_ns) / 1e6
    return HandoffTrace(
        request_id, sum(by_carrier.values()), total, dict(by_carrier), path, list(ordered)
    )


def _cause(ordered: Sequence[TraceEvent], i: int) -> int | None:
    """The index of the event that caused ``ordered[i]``: for a local step
    its actor's previous event; for a message its sender's latest earlier
    event (any other actor's when the sender is not known or left none)."""
    event = ordered[i]
    if event.carrier == "local":
        return next((j for j in range(i - 1, -1, -1) if ordered[j].actor == event.actor), None)
    if event.source:
        # The sender marked the send (a call made while other answers were
        # still coming to it): the arrival follows that mark, not whatever
        # reached the sender after it.
        sent = f"{SENT}{event.what}"
        for match in (lambda e: e.actor == event.source and e.what == sent, lambda e: e.actor == event.source):
            found = next((j for j in range(i - 1, -1, -1) if match(ordered[j])), None)
            if found is not None:
                return found
    return next((j for j in range(i - 1, -1, -1) if ordered[j].actor != event.actor), None)


def hop_summary(traces: Sequence[HandoffTrace]) -> dict[str, Any]:
    """The bench's view of many traces: hops p50, and per path step (by
    position, when the paths agree on their shape) the median time."""
    if not traces:
        return {"n": 0}
    hops = sorted(t.hops for t in traces)
    shapes = collections.Counter(
        tuple((h.actor, h.what, h.carrier) for h in t.path) for t in traces
    )
    shape, count = shapes.most_common(1)[0]
    same = [t for t in traces if tuple((h.actor, h.what, h.carrier) for h in t.path) == shape]
    steps = []
    for k, (actor, what, carrier) in enumerate(shape):
        times = sorted(t.path[k].since_prev_ms for t in same)
        steps.append(
            {"actor": actor, "what": what, "carrier": carrier, "p50_ms": times[len(times) // 2]}
        )
    carriers = collections.Counter[str]()
    for t in same:
        carriers.update(t.by_carrier)
    return {
        "n": len(traces),
        "hops_p50": hops[len(hops) // 2],
        "hops_max": hops[-1],
        "total_ms_p50": sorted(t.total_ms for t in traces)[len(traces) // 2],
        "common_path": {"share": count / len(traces), "steps": steps},
        "by_carrier_p50": {c: n / len(same) for c, n in sorted(carriers.items())},
    }


async def with_events_of(events: list[TraceEvent], calls: Iterable[Awaitable[Any]]) -> list[TraceEvent]:
    """``events`` and the events each of ``calls`` answers (an actor's
    ``trace_events``); a call that fails adds none."""
    for more in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(more, list):
            events.extend(more)
    return events
