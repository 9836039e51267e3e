"""`RankCore`'s control plane: reports to the coordinator, the rounds' vote
and apply, control frames in (decoded, gated by the agreement, parked
until their admission is applied, handed to the protocol) and the
protocol's actions out (`_perform`; frames grouped per peer and turn).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvhandoff.actors._channel import CallChannel
from kvhandoff.actors._member import VoteNews
from kvhandoff.actors._names import agent_name
from kvhandoff.actors._trace import TraceEvent, rank_actor_name
from kvhandoff.actors.rank._config import _loop_running, log
from kvhandoff.actors.rank._state import _RankState
from kvhandoff.protocol import (
    Action,
    AdmissionRequest,
    AdmissionStop,
    CancelDeferred,
    CancelIntent,
    CleanupSkipped,
    ContextTicket,
    CtxRank,
    Drain,
    Endpoint,
    LocalOutcome,
    Message,
    Negotiated,
    News,
    NotNegotiatedError,
    Open,
    ParentKey,
    ParentSettled,
    PoolError,
    ProtocolError,
    Quarantine,
    RankReport,
    Ready,
    Receipt,
    Release,
    Report,
    Role,
    RoundDecision,
    RoundProposal,
    SendMessage,
    Step,
    admission_verdict,
    apply_step,
    decision_steps,
    decode_frame,
    reject_for,
    report_of,
)
from kvhandoff.topology import blocks_for_tokens

#: Frames nothing waits for at once (`_send`): READY (a TERMINAL follows it,
#: which the GEN waits for) and RECEIPT (the CTX releases its blocks on it).
LAZY_FRAMES = (Ready, Receipt)
#: Parents whose frames a rank keeps while their admission is not applied
#: here yet (`RankCore._park`); a frame past it is handed to the protocol.
MAX_PARKED = 4096


class _ControlPlane(_RankState):
    """Reports, rounds, frames and actions (a concern of `RankCore`)."""

    # -- reports to the coordinator, owned calls ----------------------------------------

    def _nudge(self, lazy: bool = False) -> None:
        """Push our news to the coordinator (one way: ranks never await rounds).

        Coalesced: every intent recorded in this turn of the event loop goes
        out in one `RankReport`, sent when the turn ends. News nothing waits
        for at once (``lazy``: a CTX rank's completions, which no answer
        depends on) waits up to `lazy_flush_s` for other news to ride with:
        a report carries all the news recorded by then."""
        if self._report_due:
            return
        if lazy and _loop_running():
            if not self._lazy_report_due:
                self._lazy_report_due = True
                asyncio.get_running_loop().call_later(self.config.lazy_flush_s, self._push_lazy_report)
            return
        self._report_due = True
        if _loop_running():
            loop = asyncio.get_running_loop()
            wait = self._last_report_at + self.config.report_gap_s - loop.time()
            if wait > 0:
                # Reported a moment ago: this news rides with what comes
                # before the gap ends (`report_gap_s`).
                self.counters["reports_paced"] += 1
                loop.call_later(wait, self._push_report)
            else:
                loop.call_soon(self._push_report)
        else:
            self._push_report()

    async def close_admission(self) -> RankReport:
        """The instance drains: this rank admits nothing on its own any more
        (CTX: at an OPEN; GEN: a receive at the rank), for good; a parent
        held here goes on to its end. Returns the rank's report, so its
        coordinator knows every parent admitted here before this call and
        waits for them too."""
        self._admission_closed = True
        return self.member.report()

    def _push_lazy_report(self) -> None:
        self._lazy_report_due = False
        if not self._report_due and self.member.has_news():
            self._push_report()

    def _push_report(self) -> None:
        self._report_due = False
        if self._flush_due:
            # Urgent frames first: a report's Ray call costs a few hundred µs
            # of this loop's time, and a frame is on a handoff's critical
            # path (an OPEN, a READY, a TERMINAL) while the report is not.
            self._flush()
        channel = self._coordinator_channel
        if channel is not None and channel.closed:
            channel = self._coordinator_channel = None
        if channel is None and not self._find_coordinator():
            return  # not up yet: the next vote carries the news anyway
        self.counters["reports_sent"] += 1
        if _loop_running():
            self._last_report_at = asyncio.get_running_loop().time()
        report = self.member.report()
        if channel is not None and channel.tell("report", (report,)):
            return
        if channel is not None and not self._find_coordinator():
            return
        self._own(self._coordinator.report.remote(report))

    def _own(self, awaitable: Any) -> None:
        """Keep a reference to a fire-and-forget call; log if it fails."""

        async def watch() -> None:
            try:
                await awaitable
            except Exception as exc:  # delivery failure: the protocol's timeouts handle it
                self.counters["send_failures"] += 1
                log.warning("rank %s: call failed: %r", self.ns, exc)

        task = asyncio.get_running_loop().create_task(watch()) if _loop_running() else None
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # -- rounds -------------------------------------------------------------------

    def _vote(self, proposal: RoundProposal) -> VoteNews:
        now = time.monotonic()
        deadline = now + self.config.lease_timeout_s
        stopped = self.side.admission_stopped()
        ok = [r.parent for r in proposal.admissions if self._lease_for(r, now, deadline, stopped)]
        return VoteNews(admit_ok=tuple(ok))

    def _lease_for(self, request: AdmissionRequest, now: float, deadline: float, stopped: bool) -> bool:
        """One admission's verdict and lease, as a vote makes them: True when
        leased (tentatively, until a decision admits or withdraws it); a
        refusal is counted and holds nothing."""
        peer = request.peer_instance or ("" if self.config.fleet else self._default_peer)
        pair = self._pairs.get(peer) if peer else None
        verdict = admission_verdict(
            stopped=stopped,
            peer=peer,
            paired=pair is not None,
            left=pair is not None and pair.left,
            admits_unpaired=self.admits_unpaired,
            negotiation=pair.negotiation if pair is not None else None,
        )
        if not verdict.admit:
            # Refused before any lease or DMA (an unpaired admission, a
            # published engine ticket, is checked at its first OPEN).
            self.counters[verdict.refusal] += 1
            if verdict.renegotiate and pair is not None:
                self._renegotiate(pair)
            return False
        try:
            n = blocks_for_tokens(self.config.layout, request.num_tokens)
            self._admit(request, n, now, deadline, pair)
        except PoolError:
            self.counters["admit_refused"] += 1
            return False
        except Exception as exc:
            # Whatever one admission carries (a size no layout accepts, ...),
            # it refuses that admission only; it never breaks the rank.
            self.counters[f"admit_refused_{type(exc).__name__}"] += 1
            log.warning("rank %s: admission of %s refused: %r", self.ns, request.parent, exc)
            return False
        self._tokens[request.parent] = request.num_tokens
        if peer:
            self._pair_of[request.parent] = peer
        return True

    def _apply(self, decision: RoundDecision) -> None:
        now = time.monotonic()
        parents = self.side.parents()
        for step, parent in decision_steps(decision, parents):
            # What each step means is the protocol's (`apply_step`); here only
            # what the shell adds: the role's work after an admission, the
            # CTX's decide, and what it counts and remembers.
            if step is Step.COMPLETED and parent in self._completed_alone:
                continue  # decided here already, at its last TERMINAL (`_completing`)
            if step is Step.ADMITTED:
                self._admitted(parent, now)
                continue
            if step is Step.DECIDED:
                self._decided(parent, now)
                continue
            if step is Step.WITHDRAW:
                # Leased tentatively in our vote, not admitted (another rank
                # refused, or the round timed out): nothing was exposed.
                self._outcome.remember(parent, LocalOutcome.REJECTED, now)
            elif step is Step.CANCELLED:
                self.metrics.cancelled(parents[parent].value)
            self._perform(apply_step(self.side, step, parent, now))
        self._completed_alone.difference_update(decision.settled())
        alive = self.side.parents()
        self.member.follower.forget(alive.__contains__)
        self._replay_parked()
        self._wake.set()

    # -- the control plane ------------------------------------------------------------

    async def receive_frames(self, frames: list[bytes]) -> int:
        """Control frames from one peer rank, in the order it produced them
        (one one-way call per peer and event-loop turn). Each is handled as
        `receive_frame` handles it; returns how many were accepted."""
        accepted = 0
        for frame in frames:
            accepted += bool(await self.receive_frame(frame))
        return accepted

    async def receive_frame(self, frame: bytes) -> bool:
        """A control frame from a peer rank. Returns whether it was accepted."""
        return await self._receive_frame(frame, "call")

    async def stream_address(self) -> tuple[str, int, str]:
        """(host, port, token) of this rank's frame server (control_frames=
        "stream", actors/_stream.py); a peer asks once per incarnation of
        ours. Raises `RuntimeError` under another carrier."""
        if self._streams is None:
            raise RuntimeError(f"rank {self.ns}: frames go by {self.config.frames!r}, not by stream")
        return await self._streams.address()

    async def call_address(self) -> tuple[str, int, str]:
        """(host, port, token) of this rank's call server (actors/_channel.py),
        which its coordinator asks once per incarnation of ours to send its
        round calls over. Raises `RuntimeError` unless frames go by stream."""
        if self._calls is None:
            raise RuntimeError(f"rank {self.ns}: round calls go by Ray call under frames={self.config.frames!r}")
        return await self._calls.address()

    def _take_channel(self, channel: CallChannel) -> None:
        """Our coordinator opened `channel`: reports go on it from now on."""
        self._coordinator_channel = channel

    async def _stream_frame(self, frame: bytes) -> bool:
        """A frame that arrived on our stream (`receive_frame`'s boundary)."""
        return await self._receive_frame(frame, "stream")

    def _frame_call(self, handle: Any, frames: list[bytes]) -> None:
        """Frames to one peer in one one-way Ray call (`receive_frames`)."""
        self.counters["frame_calls"] += 1
        self._own(handle.receive_frames.remote(frames))

    async def _receive_frame(self, frame: bytes, carrier: str) -> bool:
        message = None
        try:
            # Any version this build reads; the pair's agreed one is checked
            # once the ticket says which pair the frame belongs to.
            message = decode_frame(frame)
            if self.trace.every:
                self._trace_frame(message, carrier)
            pair = self._pair_for(message)
            if self._gate_waiting or not isinstance(pair.negotiation, Negotiated):
                await self._await_agreement(pair)
            self._check_agreed(pair, message, frame[4])
        except ProtocolError as exc:
            self._refused(message, exc, frame[4])
            return False
        if self._park(message, frame[4]):
            return True
        return await self._deliver(message, frame[4])

    async def _deliver(self, message: Message, version: int) -> bool:
        """Hand an agreed frame to the protocol and perform what it produced.
        A RECEIPT for a parent already released here changes nothing and is
        counted apart, not refused: it acknowledges the bytes of an edge that
        ended COMPLETED (a rank alone in its instance releases once its last
        TERMINAL is out, before the RECEIPT can come)."""
        if isinstance(message, Receipt) and self.side.was_released(message.ticket.parent):
            self.counters["receipts_after_release"] += 1
            return True
        try:
            actions = self._receive(message, time.monotonic())
        except ProtocolError as exc:
            self._refused(message, exc, version)
            return False
        await self._accept(message, actions)
        return True

    def _refused(self, message: Message | None, exc: ProtocolError, version: int) -> None:
        """A frame refused: nothing changed (S3), counted."""
        self.counters[f"refused_{type(exc).__name__}"] += 1
        if isinstance(message, Open):  # a refused proposal addressed to us gets a typed REJECT
            # The CTX side keeps the REJECT's promise (`CtxRank.refuse`): a
            # later copy of this OPEN is refused too.
            side = self.side
            reject = side.refuse(message, exc) if isinstance(side, CtxRank) else reject_for(message, exc, self.our)
            encoded = None if reject is None else self._encode(reject, answering=version)
            if encoded is not None:  # written in the OPEN's version when none is agreed
                self.counters["frames_reject"] += 1
                self._send(message.ticket.gen, encoded, message.ticket.request_id)
            else:
                self.counters["refused_open_not_ours"] += 1

    def _park(self, message: Message, version: int) -> bool:
        """Keep a frame of a parent we leased in our vote but whose admission
        we have not applied yet; whether it was kept. The peer instance's
        coordinator hears our round's decision before we apply it, so the
        peer's OPEN can come first: it waits here, in arrival order with
        any frame after it, until the apply (or the lease's end) moves the
        parent on. Bounded: past `MAX_PARKED` parents a frame is not kept
        (the protocol refuses it as before)."""
        ticket = getattr(message, "ticket", None)
        if not isinstance(ticket, ContextTicket):
            return False
        parent = ticket.parent
        queue = self._parked.get(parent)
        if queue is None:
            if len(self._parked) >= MAX_PARKED or not self._leased_unapplied(parent):
                return False
            queue = self._parked[parent] = []
        queue.append((message, version))
        self.counters["frames_parked"] += 1
        return True

    def _leased_unapplied(self, parent: ParentKey) -> bool:
        """Whether `parent` is leased in our vote and its admission not applied."""
        return self.side.is_admitted(parent)

    def _replay_parked(self) -> None:
        """Parents that left the leased-in-vote state get their parked frames
        (one task at a time, so frames keep their order)."""
        if self._parked and not self._replaying and _loop_running():
            self._replaying = True
            self._own(self._replay())

    async def _replay(self) -> None:
        try:
            while True:
                ready = [p for p in self._parked if not self._leased_unapplied(p)]
                if not ready:
                    return
                for parent in ready:
                    queue = self._parked[parent]
                    while queue:  # a frame that comes meanwhile joins the queue
                        message, version = queue.pop(0)
                        await self._deliver(message, version)
                    del self._parked[parent]
        finally:
            self._replaying = False

    def _trace_frame(self, message: Message, carrier: str) -> None:
        ticket = getattr(message, "ticket", None)
        if isinstance(ticket, ContextTicket):
            sender = ticket.gen.ns if self.role is Role.CTX else ticket.ctx.ns
            what = f"frame:{type(message).__name__}"
            self.trace.record(ticket.request_id, what, carrier, rank_actor_name(sender))

    async def set_trace(self, every: int) -> None:
        """Trace one request in `every` from now on (0: off); actors/_trace.py."""
        self.trace.set_every(every)

    async def trace_events(self, request_id: str) -> list[TraceEvent]:
        """This rank's events of a traced request (forgotten here once taken)."""
        return self.trace.take(request_id)

    async def phase(self, parent: ParentKey) -> dict[str, Any]:
        """The parent's local state and its edges' states (for tests and the demo)."""
        phase = self.side.phase(parent)
        if phase is None:  # not live here: its outcome, if it has one
            return {"state": self._outcome.get(parent), "edges": [], "posted": 0, "in_flight": 0}
        return phase

    # -- performing actions --------------------------------------------------------------

    def _perform(self, actions: list[Action]) -> list[Any]:
        refs: list[Any] = []
        now = time.monotonic()
        for action in actions:
            match action:
                case SendMessage(to=to, message=message):
                    refs.append(self._send(to, message))
                case Drain():
                    self._wake.set()  # the poll loop drains what is posted
                case Release(parent=parent, blocks=blocks, reclaimed=reclaimed):
                    self._releasing(parent, blocks)
                    if reclaimed:
                        self.counters["reclaimed"] += 1
                        self.counters["reclaimed_blocks"] += len(blocks)
                        log.info("rank %s reclaimed %d quarantined blocks of %s", self.ns, len(blocks), parent)
                    else:
                        self.counters["released"] += 1
                    self._finish(parent, action.outcome)
                    for future in self._returns.pop(parent, ()):
                        if not future.done():
                            future.set_result(True)
                case Quarantine(parent=parent, reason=reason):
                    self.counters["quarantined"] += 1
                    log.warning("rank %s quarantined %s: %s", self.ns, parent, reason)
                    self._finish(parent, action.outcome)
                case AdmissionStop() | CancelIntent() | ParentSettled():
                    if isinstance(action, AdmissionStop):
                        self.counters["admission_stop"] += 1
                    report = report_of(action, self._bytes_ok)
                    if report is not None and report.news is News.COMPLETION:
                        refs += self._completing(report.parent, now)
                    self._report(report)
                case CleanupSkipped():
                    self.counters["cleanup_skipped"] += 1
                case CancelDeferred():
                    self.counters["cancel_deferred"] += 1
                case _:  # PostChunk and Prepared (CTX), DecodeReady (GEN)
                    refs += self._perform_role(action, now)
        self._maybe_request_restart()
        return [r for r in refs if r is not None]

    #: `_perform` under the name the staged data plane calls it by
    #: (actors/_stager.py `WriterHost`).
    perform = _perform

    def _maybe_request_restart(self) -> None:
        """Past the quarantine limit, with nothing but quarantined requests left:
        ask the coordinator for a restart, once per incarnation. The new
        incarnation has a new process, buffer and NIXL registration (a fresh,
        fully free pool); the old one's quarantined memory dies with it. A
        request the coordinator does not grant (it is recovering) is asked
        again later: the poll loop performs `expire` every 50 ms."""
        if self._restart_requested or not self.config.restartable or not self.side.wants_restart():
            return  # live requests first finish (admission is stopped meanwhile)
        if self._coordinator is None and not self._find_coordinator():
            return
        self._restart_requested = True
        quarantined = self.pool.counts().quarantined
        self.counters["restart_requested"] += 1
        log.warning("rank %s: %d blocks quarantined, asking for a restart", self.ns, quarantined)
        request = self._coordinator.request_restart.remote(self.config.rank, self.our.epoch, quarantined)

        async def ask() -> None:
            try:
                granted = await request
            except Exception as exc:
                log.warning("rank %s: restart request failed: %r", self.ns, exc)
                granted = False
            if not granted:
                self._restart_requested = False

        self._own(ask())

    def _send(self, to: Endpoint, frame: bytes | Message, request_id: str = "") -> Any:
        lazy = isinstance(frame, LAZY_FRAMES)
        if not isinstance(frame, bytes):  # a message: encode it in the pair's agreed version
            pair = self._pairs.get(to.ns.instance_id)
            if pair is not None and (isinstance(pair.negotiation, NotNegotiatedError) or pair.unsent):
                pair.unsent.append((to, frame))  # sent, in order, once negotiated
                self._renegotiate(pair)
                return None
            request_id = frame.ticket.request_id
            self.counters[f"frames_{type(frame).__name__.lower()}"] += 1
            encoded = self._encode(frame)
            if encoded is None:
                return None
            frame = encoded
        if self.faults is not None and self.faults.frames:
            held = self.faults.frames.get((request_id, to.ns.role.value, to.ns.rank))
            if held is not None:  # fault injection: the frame is delayed, in order
                held.append((to, frame))
                return None
        self.counters["frames_sent"] += 1
        if self._notif is not None:
            agent = agent_name(self.config.deployment, to.ns, to.epoch)
            if agent in self.transport.peers and self._notif.send(agent, frame):
                self.counters["frames_nixl"] += 1
                return None
        cached = self._peer_handles.get((to.ns.instance_id, to.ns.rank))
        if cached is not None and cached[0] == to:
            # Group the frames per peer, in the order they were produced: one
            # one-way call carries them all. An urgent frame goes when this
            # event-loop turn ends, with whatever waits for its peer; a lazy
            # one waits for the next urgent frame to its peer, or for the lazy
            # flush: a delay in the channel, which keeps its order.
            box = self._outbox.get(to)
            if box is None:
                box = self._outbox[to] = [cached[1], [], False]
            box[1].append(frame)
            if not _loop_running():
                self._flush(everything=True)
            elif not lazy:
                box[2] = True
                if not self._flush_due:
                    self._flush_due = True
                    asyncio.get_running_loop().call_soon(self._flush)
            elif not self._lazy_flush_due:
                self._lazy_flush_due = True
                asyncio.get_running_loop().call_later(self.config.lazy_flush_s, self._flush_lazy)
            return None
        # Unknown or restarted peer: resolve it, then send (a stale endpoint is
        # dropped). Frames still waiting for it go first: the order holds.
        box = self._outbox.pop(to, None)
        if box is not None:
            self._carry(to, box[0], box[1])

        async def resolve_and_send() -> None:
            handle = await self._peer(to)
            if handle is None:
                self.counters["dropped_stale_sends"] += 1
                return
            if self._streams is not None:
                self._streams.send(to, handle, [frame])
                return
            await handle.receive_frames.remote([frame])

        self._own(resolve_and_send())
        return None

    def _flush(self, everything: bool = False) -> None:
        """Send the grouped frames of every peer with an urgent one (of every
        peer, with ``everything``): one one-way call per peer."""
        self._flush_due = False
        for to, (handle, frames, urgent) in list(self._outbox.items()):
            if urgent or everything:
                del self._outbox[to]
                self._carry(to, handle, frames)

    def _carry(self, to: Endpoint, handle: Any, frames: list[bytes]) -> None:
        """Frames to peer `to`, in order: on its stream (frames="stream"), else one Ray call."""
        if self._streams is not None:
            self._streams.send(to, handle, frames)
        else:
            self._frame_call(handle, frames)

    def _flush_lazy(self) -> None:
        self._lazy_flush_due = False
        self._flush(everything=True)

    def _report(self, report: Report | None) -> None:
        """Perform a `Report` (protocol `report_of`): the news for this rank's
        round follower, and the local outcome it fixes. A cancelled parent is
        released by the protocol once its cancel is decided; a success feeds
        the completion round (GEN verifies every byte first: S2, `_bytes_ok`)."""
        if report is None:
            return
        if report.outcome is not None:
            if report.overrides:
                self._outcome.remember(report.parent, report.outcome, time.monotonic())
            else:
                self._outcome.setdefault(report.parent, report.outcome, time.monotonic())
        if report.news is not None:
            self.member.follower.record(report.news, report.parent)
            lazy = report.news is News.COMPLETION and self._completion_can_wait(report.parent)
            if lazy:
                self.counters["completion_reports_lazy"] += 1
            self._nudge(lazy=lazy)
